"""`atb-probe show` and the dump reader it is built on."""
from __future__ import annotations

import csv
import io

import numpy as np
import pytest

from atb_probe import cli
from atb_probe.statcsv import COLUMNS
from atb_probe.tools.dumpreader import DumpError, open_dump

from conftest import dump, generate, only_proc, read_csv, tiny_llama
from harness import config


@pytest.fixture(scope="module")
def llama_dump(tmp_path_factory):
    model = tiny_llama()
    tmp = tmp_path_factory.mktemp("show")
    return dump(tmp, config(task="all", save_child=True, ids="2", exec_range="0,1"),
                lambda: generate(model, prompt_len=4, new_tokens=2))


def test_reader_iterates_rounds_ops_and_tensors_in_csv_order(llama_dump):
    d = open_dump(str(llama_dump.parent))
    assert d.kind == "root" and [p.name for p in d.processes] == [only_proc(llama_dump).name]
    rounds = d.processes[0].rounds
    assert [r.index for r in rounds] == [0, 1]
    for rnd in rounds:
        rows = read_csv(only_proc(llama_dump) / str(rnd.index) / "statistic.csv")
        assert [t.row for t in rnd.tensors] == rows
        assert rnd.task == "all"
        assert rnd.ops[0].op_id == "2" and rnd.ops[0].op_path == "2_LlamaDecoderLayer"
        assert {op.op_id.split("_")[0] for op in rnd.ops} == {"2"}
        for op in rnd.ops:
            for t in op.tensors:
                assert t.op_id == op.op_id and t.data_name.startswith(op.op_path + "/")
        t = rnd.ops[0].outputs[0]
        values = t.load()
        assert "x".join(map(str, values.shape)) == t.shape
        assert np.isclose(values.max(), float(t.row["Max"]))


def test_reader_opens_every_level_of_a_dump(llama_dump):
    proc = only_proc(llama_dump)
    assert open_dump(str(llama_dump)).kind == "root"
    assert open_dump(str(llama_dump / "data")).kind == "root"
    assert open_dump(str(proc)).kind == "process"
    single = open_dump(str(proc / "1"))
    assert single.kind == "round" and [r.index for r in single.rounds] == [1]
    with pytest.raises(DumpError, match="not a dump"):
        open_dump(str(proc / "1" / "2_LlamaDecoderLayer"))


def test_show_prints_processes_rounds_layers_and_ops_with_counts(llama_dump, capsys):
    assert cli.main(["show", str(llama_dump), "--depth", "2"]) == 0
    out = capsys.readouterr().out
    proc = only_proc(llama_dump)
    rows0 = read_csv(proc / "0" / "statistic.csv")
    assert proc.name in out
    assert f"round 0  model=LlamaForCausalLM  phase=Prefill  task=all  {len(rows0)} tensors" \
        in out
    assert f"2_LlamaDecoderLayer (model.layers.0)  {len(rows0)} tensors" in out
    assert "1_LlamaAttention (model.layers.0.self_attn)" in out  # depth 2: the layer's children
    assert "0_Linear" not in out                 # depth 3 is not shown
    assert "op(s) below" in out


def test_show_gives_each_rounds_phase_from_the_model_files(llama_dump, capsys):
    assert cli.main(["show", str(llama_dump), "--depth", "1"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # rich wraps long lines
    assert "round 0 model=LlamaForCausalLM phase=Prefill task=all" in out
    assert "round 1 model=LlamaForCausalLM phase=Decoder task=all" in out


def test_show_of_a_statistics_dump_counts_rows_not_bytes(tmp_path, capsys):
    model = tiny_llama()
    root = dump(tmp_path, config(task="statistics", exec_range="0,0"),
                lambda: generate(model, prompt_len=4, new_tokens=1))
    rows = read_csv(only_proc(root) / "0" / "statistic.csv")
    assert cli.main(["show", str(root), "--depth", "1"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # rich wraps long lines
    assert f"phase=Prefill task=statistics {len(rows)} rows" in out
    assert "0 B" not in out and "tensors" not in out


def test_show_csv_merges_every_statistic_csv_into_one_table(llama_dump, tmp_path, capsys):
    proc = only_proc(llama_dump)
    expected = read_csv(proc / "0" / "statistic.csv") + read_csv(proc / "1" / "statistic.csv")
    assert cli.main(["show", str(llama_dump), "--csv"]) == 0
    merged = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert merged == expected
    target = tmp_path / "all.csv"
    assert cli.main(["show", str(llama_dump), "--csv", "-o", str(target)]) == 0
    with open(target, newline="") as f:
        assert next(csv.reader(f)) == list(COLUMNS)


def test_show_of_something_that_is_not_a_dump_exits_2(tmp_path, capsys):
    assert cli.main(["show", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "is not a dump" in err and "Traceback" not in err
