"""A dump is byte for byte what it was: `.bin` files, references and statistic.csv cells.

`tests/golden/exact_dump.json.gz` (gzip'd JSON: `zcat` reads it) was made by the probe before its hot path was redesigned
(commit 0e4d0f8: statistics per tensor on the model thread). A dump of the same model on the
same configurations must give the same `.bin` bytes under the same names, and the same
statistic.csv, cell for cell, statistics compared exactly (as text).

The model is built so that its arithmetic is exact on every machine: integer-valued weights in
{-1, 0, 1}, activations kept small by `clamp`, no transcendental functions, so every matmul
and every statistic (a float32 sum of small integers) comes out the same whatever the BLAS or
the CPU. It still has what the hot path must get right: views and transposes (references),
a kernel's output as the next one's input, weights used through `aten.t`, an input written in
place by the layer (a KV cache filled with `index_copy_`) and in-place activations, bool, int,
bfloat16 and float64 tensors, tuples and keyword arguments, three rounds.

JSON files (op_param.json, the structure files) are not compared: they are described by
other tests, and their content is not what the hot path's redesign is about.

Regenerate (only when a change of output is intended, and say why in the commit):

    python tests/test_dump_golden.py --regenerate
"""
from __future__ import annotations

import csv
import gzip
import hashlib
import json
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import atb_probe

GOLDEN = Path(__file__).parent / "golden" / "exact_dump.json.gz"
HIDDEN, VOCAB, CACHE = 8, 16, 8
BASE = {"task": "tensor", "dump_enable": True, "exec_range": "all", "ids": "", "op_name": "",
        "save_child": False, "device": "", "filter_level": 1}

CONFIGS = {
    "all-child-fl1": {"task": "all", "save_child": True, "filter_level": 1},
    "all-child-fl2": {"task": "all", "save_child": True, "filter_level": 2},
    "tensor-child-fl0": {"task": "tensor", "save_child": True, "filter_level": 0},
    "stat-child": {"task": "statistics", "save_child": True},
    "stat-layer": {"task": "statistics"},
    "all-layer": {"task": "all"},
    "stat-ids": {"task": "statistics", "ids": "2_0,3", "save_child": True},
}


def _ternary(*shape: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-1, 2, shape, generator=g).float()


class Attention(nn.Module):
    def __init__(self, seed: int):
        super().__init__()
        self.q = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.k = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.o = nn.Linear(HIDDEN, HIDDEN)
        for i, lin in enumerate((self.q, self.k, self.o)):
            lin.weight.data = _ternary(HIDDEN, HIDDEN, seed=seed + i)
        self.o.bias.data = _ternary(HIDDEN, seed=seed + 7)

    def forward(self, x, cache, position):
        q, k = self.q(x), self.k(x)
        cache.index_copy_(1, position, k)           # writes the layer's input in place
        keys = cache[:, :int(position[-1]) + 1]
        scores = torch.clamp(q @ keys.transpose(1, 2), -4, 4)
        mask = scores > 0
        scores = scores.masked_fill(~mask, 0.5)
        return self.o(torch.clamp(scores @ keys, -8, 8))


class Mlp(nn.Module):
    def __init__(self, seed: int):
        super().__init__()
        self.up = nn.Linear(HIDDEN, 2 * HIDDEN)
        self.down = nn.Linear(2 * HIDDEN, HIDDEN, bias=False)
        self.up.weight.data = _ternary(2 * HIDDEN, HIDDEN, seed=seed)
        self.up.bias.data = _ternary(2 * HIDDEN, seed=seed + 1)
        self.down.weight.data = _ternary(HIDDEN, 2 * HIDDEN, seed=seed + 2)
        self.act = nn.ReLU(inplace=True)

    def forward(self, x):
        h = self.act(self.up(x))
        h.mul_(0.5)
        return self.down(h)


class Block(nn.Module):
    def __init__(self, seed: int):
        super().__init__()
        self.attn = Attention(seed)
        self.mlp = Mlp(seed + 10)

    def forward(self, hidden, position_embeddings=None, cache=None, position=None):
        cos, sin = position_embeddings
        h = hidden + self.attn(hidden * cos + sin, cache, position)
        h = torch.clamp(h, -8, 8)
        wide = h.to(torch.bfloat16).float()        # exact for these values
        out = torch.clamp(wide + self.mlp(h), -8, 8)
        return out, out.double().sum(-1)


class Rotary(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("table", _ternary(CACHE, HIDDEN, seed=99))

    def forward(self, x, position):
        cos = self.table[position]
        sin = cos.t().contiguous().t() * 0.5  # a transposed copy: non-contiguous memory
        return cos[None], sin[None]


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.proj.weight.data = _ternary(VOCAB, HIDDEN, seed=50)

    def forward(self, x):
        logits = self.proj(x)
        return {"logits": logits, "best": logits.argmax(-1).int(), "positive": logits > 0}


class ExactLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.embed.weight.data = _ternary(VOCAB, HIDDEN, seed=1)
        self.rotary = Rotary()
        self.layers = nn.ModuleList([Block(100), Block(200)])
        self.norm = nn.Hardtanh(-2.0, 2.0)
        self.head = Head()

    def forward(self, input_ids, caches, position):
        h = self.embed(input_ids)
        emb = self.rotary(h, position)
        for layer, cache in zip(self.layers, caches):
            h, _ = layer(h, position_embeddings=emb, cache=cache, position=position)
        return self.head(self.norm(h))


def run_model() -> None:
    """Three rounds: a prompt of four tokens, then two single tokens."""
    model = ExactLM().eval()
    caches = [torch.zeros(1, CACHE, HIDDEN) for _ in model.layers]
    with torch.no_grad():
        model(torch.tensor([[3, 1, 4, 1]]), caches, torch.arange(4))
        model(torch.tensor([[5]]), caches, torch.tensor([4]))
        model(torch.tensor([[9]]), caches, torch.tensor([5]))


def make_dump(out: Path, overrides: dict) -> dict:
    """Dump `run_model()` into `out` on BASE + `overrides`; the summary kept in the golden."""
    atb_probe.enable(str(out), {**BASE, **overrides})
    try:
        run_model()
    finally:
        assert atb_probe.disable(timeout=60)
    return summarize(out / "atb_dump_data" / "data")


def summarize(data: Path) -> dict:
    """{"bin": {path: sha256}, "csv": {path: rows}} with the `<dev>_<pid>` folder and the
    output directory taken out of paths and cells."""
    (proc,) = [p for p in data.iterdir() if p.is_dir()]
    devpid, root = proc.name, str(data.parent.parent)
    bins, tables = {}, {}
    for path in sorted(proc.rglob("*")):
        rel = str(path.relative_to(proc))
        if path.suffix == ".bin":
            bins[rel] = hashlib.sha256(path.read_bytes()).hexdigest()[:20]
        elif path.name == "statistic.csv":
            with open(path, newline="") as f:
                rows = list(csv.reader(f))
            tables[rel] = [[c.replace(root, "OUT").replace(devpid, "DEVPID") for c in row]
                           for row in rows]
    return {"bin": bins, "csv": tables}


def _golden() -> dict:
    return json.loads(gzip.decompress(GOLDEN.read_bytes()))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_bin_files_are_those_of_the_golden_dump(tmp_path, name):
    """The same `.bin` files under the same names, with the same bytes (data, references and
    header-only files alike)."""
    got = make_dump(tmp_path, CONFIGS[name])["bin"]
    want = _golden()[name]["bin"]
    assert sorted(got) == sorted(want)
    differ = [p for p in want if got[p] != want[p]]
    assert not differ, f"{len(differ)} files differ, first: {differ[:5]}"


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_statistic_csv_is_that_of_the_golden_dump_cell_for_cell(tmp_path, name):
    """The same statistic.csv files, rows in the same order, every cell the same text
    (statistics compared exactly)."""
    got = make_dump(tmp_path, CONFIGS[name])["csv"]
    want = _golden()[name]["csv"]
    assert sorted(got) == sorted(want)
    for path, rows in want.items():
        assert len(got[path]) == len(rows), path
        for i, (a, b) in enumerate(zip(got[path], rows)):
            assert a == b, f"{path} row {i}:\n got  {a}\n want {b}"


def test_the_golden_model_covers_what_the_hot_path_must_get_right():
    """The golden dumps are worth comparing: references, header-only files, in-place inputs,
    every dtype kind, several rounds."""
    golden = _golden()
    rows = [r for rows in golden["all-child-fl1"]["csv"].values() for r in rows[1:]]
    assert {r[7] for r in rows} >= {"float", "bool", "int64", "int32", "bf16", "double"}
    assert len(golden["all-child-fl1"]["csv"]) == 3
    fl1 = golden["all-child-fl1"]["bin"]
    fl0 = golden["tensor-child-fl0"]["bin"]
    assert len(fl1) == len(fl0) > 500
    assert sum(fl1[p] != fl0[p] for p in fl0) > 100   # references and more
    assert len(golden["stat-layer"]["csv"]["0/statistic.csv"]) > 20


def _regenerate() -> None:
    import tempfile
    doc = {}
    for name, overrides in sorted(CONFIGS.items()):
        with tempfile.TemporaryDirectory() as tmp:
            doc[name] = make_dump(Path(tmp), overrides)
    GOLDEN.parent.mkdir(exist_ok=True)
    text = json.dumps(doc, indent=0, sort_keys=True) + "\n"
    GOLDEN.write_bytes(gzip.compress(text.encode(), mtime=0))
    print(f"wrote {GOLDEN} ({GOLDEN.stat().st_size} bytes)")


if __name__ == "__main__":
    if sys.argv[1:] == ["--regenerate"]:
        _regenerate()
    else:
        sys.exit("usage: python tests/test_dump_golden.py --regenerate")
