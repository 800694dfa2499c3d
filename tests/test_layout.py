"""The output layout of SPEC §5 for layer-level ops: tree, statistic.csv, .bin, structure files."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from atb_probe import layout, load
from atb_probe.binfile import encode_header, read_header
from atb_probe.dtypes import DTYPES
from atb_probe.statcsv import COLUMNS, HEADER
from atb_probe.binread import load_tensor

from conftest import Root, dump, generate, only_proc, read_csv, tiny_llama
from harness import config

LLAMA_LAYERS = ["0_Embedding", "1_LlamaRotaryEmbedding", "2_LlamaDecoderLayer",
                "3_LlamaDecoderLayer", "4_LlamaRMSNorm", "5_Linear"]


@pytest.fixture(scope="module")
def llama():
    return tiny_llama()


@pytest.fixture(scope="module")
def all_dump(tmp_path_factory, llama):
    tmp = tmp_path_factory.mktemp("all")
    return dump(tmp, config(task="all", exec_range="0,1"), lambda: generate(llama, new_tokens=3))


def test_layer_level_ops_of_a_llama_are_its_blocks_in_call_order(all_dump):
    round0 = only_proc(all_dump) / "0"
    assert sorted(p.name for p in round0.iterdir() if p.is_dir()) == sorted(LLAMA_LAYERS)


def test_exec_range_selects_rounds_and_each_round_has_its_own_csv(all_dump):
    proc = only_proc(all_dump)
    assert sorted(p.name for p in proc.iterdir()) == ["0", "1"]
    for rnd in ("0", "1"):
        rows = read_csv(proc / rnd / "statistic.csv")
        assert rows and {r["Execution Count"] for r in rows} == {rnd}


def test_process_folder_is_device_and_pid(all_dump):
    import os
    assert only_proc(all_dump).name == f"0_{os.getpid()}"


def test_statistic_csv_has_the_exact_header_and_fifteen_columns(all_dump):
    path = only_proc(all_dump) / "0" / "statistic.csv"
    lines = path.read_text().splitlines()
    assert lines[0] + "\n" == HEADER
    assert len(COLUMNS) == 15
    for line in lines:
        assert len(line.split(",")) == 15


def test_layer_files_use_plain_names_and_match_csv_rows(all_dump):
    round0 = only_proc(all_dump) / "0"
    layer = round0 / "2_LlamaDecoderLayer"
    inputs = sorted(p.name for p in (layer / "before").iterdir())
    assert inputs and all(n.startswith("intensor") and "_" not in n for n in inputs)
    assert [p.name for p in (layer / "after").iterdir()] == ["outtensor0.bin"]
    rows = [r for r in read_csv(round0 / "statistic.csv") if r["Op Id"] == "2"]
    assert {r["Op Name"] for r in rows} == {"LlamaDecoderLayer"}
    assert {r["Op Type"] for r in rows} == {"LlamaDecoderLayer"}
    files = {Path(r["Tensor Path"]) for r in rows}
    assert files == set((layer / "before").iterdir()) | set((layer / "after").iterdir())
    for r in rows:
        assert r["Format"] == "nd"
        assert Path(r["Tensor Path"]).is_absolute()


def test_statistics_equal_torch_on_the_files_own_data(all_dump):
    rows = read_csv(only_proc(all_dump) / "0" / "statistic.csv")
    checked = 0
    for r in rows:
        t = load_tensor(r["Tensor Path"])
        assert "x".join(str(d) for d in t.shape) == r["Shape"]
        if t.numel() == 0:
            continue
        x = t.double() if not t.is_floating_point() else t.float()
        expected = [x.max().item(), x.min().item(), x.mean().item(),
                    torch.linalg.vector_norm(x).item()]
        got = [float(r[k]) for k in ("Max", "Min", "Mean", "Norm")]
        assert got == pytest.approx(expected, rel=1e-5, abs=1e-6), r["Tensor Path"]
        checked += 1
    assert checked >= 15


def test_dtype_column_names_the_tensor_dtype(all_dump):
    rows = read_csv(only_proc(all_dump) / "0" / "statistic.csv")
    by_op = {(r["Op Id"], r["Input/Output"], r["Index"]): r["Dtype"] for r in rows}
    assert by_op[("0", "input", "0")] == "int64"     # token ids
    assert by_op[("0", "output", "0")] == "float"


@pytest.mark.parametrize("task", ["tensor", "statistics"])
def test_na_columns_follow_the_task(tmp_path, llama, task):
    root = dump(tmp_path, config(task=task, exec_range="0,0"), lambda: generate(llama, 4, 1))
    rows = read_csv(only_proc(root) / "0" / "statistic.csv")
    assert rows
    for r in rows:
        stats = [r[k] for k in ("Max", "Min", "Mean", "Norm")]
        if task == "tensor":
            assert stats == ["N/A"] * 4
            assert Path(r["Tensor Path"]).is_file()
        else:
            assert all(s != "N/A" and math.isfinite(float(s)) for s in stats)
            assert r["Tensor Path"] == "N/A"
    bins = list((only_proc(root) / "0").rglob("*.bin"))
    assert bool(bins) == (task == "tensor")


def test_structure_files_describe_layers_and_model_phases(all_dump):
    info = all_dump / "info"
    proc = only_proc(all_dump).name
    layer_files = sorted(p.name for p in (info / "layer" / proc).iterdir())
    assert layer_files == sorted(f"{n.split('_', 1)[1]}_{n.split('_', 1)[0]}.json"
                                 for n in LLAMA_LAYERS)
    layer = json.loads((info / "layer" / proc / "LlamaDecoderLayer_2.json").read_text())
    assert layer["opName"] == "LlamaDecoderLayer_2"
    assert layer["opType"] == "LlamaDecoderLayer"
    assert layer["inTensors"][0] == "LlamaDecoderLayer_2_input_0"
    assert layer["outTensors"] == ["LlamaDecoderLayer_2_output_0"]
    assert "self_attn.q_proj.weight" in layer["param"]["parameters"]
    models = sorted(p.name for p in (info / "model" / proc).iterdir())
    assert models == ["LlamaForCausalLM_Decoder.json", "LlamaForCausalLM_Prefill.json"]
    model = json.loads((info / "model" / proc / "LlamaForCausalLM_Prefill.json").read_text())
    assert [n["opName"] for n in model["nodes"]] == [
        f"{n.split('_', 1)[1]}_{n.split('_', 1)[0]}" for n in LLAMA_LAYERS]
    assert model["param"]["num_hidden_layers"] == 2


def test_every_path_in_the_tree_is_the_one_layout_builds(all_dump):
    """The tools read the tree through `layout`: each row's file, each structure file is
    where its functions say."""
    devpid = only_proc(all_dump).name
    for index in (0, 1):
        rnd = all_dump / layout.round_dir(devpid, index)
        rows = read_csv(Path(layout.round_csv(str(rnd))))
        assert rows
        for r in rows:
            side = layout.parse_side(r["Input/Output"])
            assert side in (layout.Side.INPUT, layout.Side.OUTPUT)
            op = rnd / layout.op_path(r["Op Id"], r["Op Name"])
            assert r["Tensor Path"] == layout.tensor_rel(str(op), side, r["Index"])
    assert [p.name for p in (all_dump / layout.info_kind_dir("layer")).iterdir()] == [devpid]
    layers = sorted(p.name for p in (all_dump / layout.layer_info_dir(devpid)).iterdir())
    assert layers == sorted(layout.layer_info_file(*reversed(n.split("_", 1)))
                            for n in LLAMA_LAYERS)
    models = sorted(layout.parse_info_file(p.name)
                    for p in (all_dump / layout.model_info_dir(devpid)).iterdir())
    assert models == ["LlamaForCausalLM_Decoder", "LlamaForCausalLM_Prefill"]


def test_op_param_records_module_config_and_plain_arguments(all_dump):
    param = json.loads((only_proc(all_dump) / "0" / "5_Linear" / "op_param.json").read_text())
    assert param["type"] == "Linear"
    assert "in_features=32" in param["extra_repr"]
    assert param["parameters"] == {"weight": [64, 32]}
    assert param["inputs"] == ["0"] and param["outputs"] == ["0"]


def test_a_model_without_cache_argument_is_a_forward_phase(tmp_path):
    mlp = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    x = torch.randn(3, 8)
    root = dump(tmp_path, config(task="all", exec_range="all"), lambda: (mlp(x), mlp(x)))
    proc = only_proc(root)
    assert sorted(p.name for p in proc.iterdir()) == ["0", "1"]
    assert sorted(p.name for p in (proc / "0").iterdir() if p.is_dir()) == \
        ["0_Linear", "1_ReLU", "2_Linear"]
    out = load(proc / "0" / "2_Linear" / "after" / "outtensor0.bin")
    torch.testing.assert_close(out, mlp(x), rtol=0, atol=0)
    assert [p.name for p in (root / "info" / "model" / proc.name).iterdir()] == \
        ["Sequential_Forward.json"]


def test_nested_sequential_blocks_are_looked_through(tmp_path):
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = nn.Linear(4, 8)
            self.blocks = nn.Sequential(*(nn.Sequential(nn.Linear(8, 8), nn.GELU())
                                          for _ in range(3)))
            self.head = nn.Linear(8, 2)

        def forward(self, x):
            return self.head(self.blocks(self.stem(x)))

    net = Net()
    root = dump(tmp_path, config(), lambda: net(torch.randn(2, 4)))
    names = sorted((p.name for p in (only_proc(root) / "0").iterdir() if p.is_dir()),
                   key=lambda n: int(n.split("_")[0]))
    # Net and its `blocks` Sequential are containers; each repeated block is a layer.
    assert names == ["0_Linear", "1_Sequential", "2_Sequential", "3_Sequential", "4_Linear"]


@pytest.mark.parametrize("dt", DTYPES, ids=lambda d: d.csv_name)
def test_bin_round_trip_for_every_dtype(tmp_path, dt):
    torch_dtype = getattr(torch, dt.torch_name)
    gen = torch.Generator().manual_seed(dt.code)
    base = torch.randn(3, 5, generator=gen) * 4
    if dt.torch_name == "bool":
        t = base > 0
    elif dt.torch_name.startswith("complex"):
        t = torch.complex(base, -base).to(torch_dtype)
    elif dt.torch_name.startswith("uint") or dt.torch_name.startswith("int"):
        t = base.abs().to(torch_dtype)
    else:
        t = base.to(torch_dtype)

    class Identity(nn.Module):
        def forward(self, x):
            return x

    root = dump(tmp_path, config(), lambda: Root(Identity())(t))
    path = only_proc(root) / "0" / "0_Identity" / "before" / "intensor0.bin"
    header = read_header(path)
    assert header.dtype.code == dt.code and header.dims == (3, 5)
    back = load(path)
    assert back.dtype == t.dtype and back.shape == t.shape
    assert torch.equal(back.view(torch.uint8), t.contiguous().view(torch.uint8))
    assert path.read_bytes()[:header.payload_offset] == encode_header(dt.code, (3, 5),
                                                                        header.nbytes)
    rows = read_csv(only_proc(root) / "0" / "statistic.csv")
    assert rows[0]["Dtype"] == dt.csv_name


def test_bin_header_follows_the_atb_format_exactly(all_dump):
    path = only_proc(all_dump) / "0" / "0_Embedding" / "before" / "intensor0.bin"
    raw = path.read_bytes()
    head, _, payload = raw.partition(b"$End=1\n")
    assert head.decode().splitlines() == [
        "$Version=1.0", "$Object.Count=1", "$Object.Length=48", "format=2", "dtype=9",
        "dims=1,6", "$Object.data=0,48"]
    assert len(payload) == 48


def test_files_and_dirs_have_restrictive_modes(all_dump):
    import stat
    for p in all_dump.rglob("*"):
        mode = stat.S_IMODE(p.stat().st_mode)
        assert mode == (0o750 if p.is_dir() else 0o640), p
    assert not list(all_dump.rglob("*.tmp"))


@pytest.mark.filterwarnings("error::RuntimeWarning")  # nothing may warn in the user's process
def test_statistics_of_special_values_and_every_kind_of_dtype(tmp_path):
    """nan/inf, integer, bool, half, complex, negated-view and transposed tensors, empty ones,
    values whose float32 sum of squares overflows: each row holds the statistics of that
    tensor, formatted exactly."""
    class Mixed(nn.Module):
        def forward(self, x):
            return (torch.tensor([1.0, float("nan"), 2.0]), torch.tensor([1.0, float("inf")]),
                    torch.tensor([-float("inf"), 0.5]), torch.arange(7) - 3,
                    torch.tensor([True, False, True]), x.half(), x.bfloat16(),
                    torch.complex(x, -x), torch.conj(torch.complex(x, x)).imag, x.t(),
                    torch.zeros(0, 3), torch.full((10,), 3e37), x.bfloat16() * 1e30)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([Mixed(), Mixed()])

        def forward(self, x):
            return [b(x) for b in self.blocks]

    x = torch.randn(3, 5)
    net = Net()
    expected = Mixed()(x)
    root = dump(tmp_path, config(task="statistics"), lambda: net(x))
    rows = [r for r in read_csv(only_proc(root) / "0" / "statistic.csv")
            if r["Op Id"] == "0" and r["Input/Output"] == "output"]
    assert len(rows) == len(expected)
    for r, t in zip(rows, expected):
        got = [r[k] for k in ("Max", "Min", "Mean", "Norm")]
        assert r["Shape"] == "x".join(map(str, t.shape))
        if t.numel() == 0:
            assert got == ["N/A"] * 4
            continue
        if t.is_complex():
            t = t.abs()
        v = t.double()
        want = [v.max().item(), v.min().item(), v.sum().item() / v.numel(),
                torch.linalg.vector_norm(v).item()]
        for text, value in zip(got, want):
            if math.isnan(value):
                assert text == "nan"
            elif math.isinf(value):
                assert text == ("inf" if value > 0 else "-inf")
            else:
                assert float(text) == pytest.approx(value, rel=1e-5, abs=1e-6), (r, t)
