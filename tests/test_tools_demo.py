"""`atb-probe demo`: a real dump of a small Llama, and the tree it prints of it."""
from __future__ import annotations

import os

from atb_probe import cli

from conftest import only_proc, read_csv


def _files_and_bytes(folder) -> tuple[int, int]:
    sizes = [os.path.getsize(os.path.join(base, n)) for base, _, names in os.walk(folder)
             for n in names]
    return len(sizes), sum(sizes)


def test_demo_dumps_a_llama_and_prints_each_rounds_layer_folders(tmp_path, capsys):
    assert cli.main(["demo", "--output", str(tmp_path), "--layers", "1",
                     "--new-tokens", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    root = tmp_path / "atb_dump_data"
    proc = only_proc(root)
    assert f"  data/{proc.name}/" in lines
    rounds = sorted(p for p in proc.iterdir() if p.is_dir())
    assert [p.name for p in rounds] == ["0", "1"]
    for rnd in rounds:
        layers = sorted((p for p in rnd.iterdir() if p.is_dir()),
                        key=lambda p: int(p.name.split("_")[0]))
        assert [p.name for p in layers] == ["0_Embedding", "1_LlamaRotaryEmbedding",
                                            "2_LlamaDecoderLayer", "3_LlamaRMSNorm", "4_Linear"]
        rows = len(read_csv(rnd / "statistic.csv"))
        at = lines.index(f"    {rnd.name}/  statistic.csv ({rows} tensors), 5 layer-level ops")
        shown = ["      %s/  %d files, %d bytes" % (p.name, *_files_and_bytes(p)) for p in layers]
        assert lines[at + 1:at + 6] == shown
    layer_files = len(list((root / "info" / "layer").rglob("*.json")))
    assert f"  info/layer/  {layer_files} files" in lines
    assert "  status/  1 files" in lines
    assert f"next:    atb-probe show {root}" in lines
