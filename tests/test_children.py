"""save_child: child modules, ATen kernels, IDs and filter levels (SPEC §1, §3, §5)."""
from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from atb_probe import load
from atb_probe.binfile import read_header

from conftest import (Root, dump, dump_first_round, only_proc, op_dirs, read_csv, tiny_gpt2,
                      tiny_llama)
from harness import config

LAYER = "2_LlamaDecoderLayer"


@pytest.fixture(scope="module")
def llama():
    return tiny_llama()


@pytest.fixture(scope="module")
def level0(tmp_path_factory, llama):
    return dump_first_round(tmp_path_factory.mktemp("l0"), llama, ids="2", save_child=True,
                  filter_level=0, task="all")


@pytest.fixture(scope="module")
def level1(tmp_path_factory, llama):
    return dump_first_round(tmp_path_factory.mktemp("l1"), llama, ids="2", save_child=True,
                  filter_level=1, task="all")


@pytest.fixture(scope="module")
def level2(tmp_path_factory, llama):
    return dump_first_round(tmp_path_factory.mktemp("l2"), llama, ids="2", save_child=True,
                  filter_level=2, task="tensor")


def test_save_child_nests_modules_and_kernels_with_chained_ids(level0):
    dirs = op_dirs(level0)
    assert dirs[0] == LAYER and all(d.startswith(LAYER) for d in dirs)
    assert f"{LAYER}/1_LlamaAttention" in dirs
    assert f"{LAYER}/1_LlamaAttention/0_Linear" in dirs
    assert f"{LAYER}/4_LlamaMLP/0_Linear" in dirs
    kernels = [d for d in dirs if d.endswith("Kernel")]
    assert f"{LAYER}/1_LlamaAttention/0_Linear/1_MmKernel" in kernels or \
        any(k.startswith(f"{LAYER}/1_LlamaAttention/0_Linear/") for k in kernels)
    rows = read_csv(level0 / "statistic.csv")
    names = {r["Op Id"]: r["Op Name"] for r in rows}
    assert names["2_1_0"] == "LlamaDecoderLayer/LlamaAttention/Linear"
    assert names["2_1"] == "LlamaDecoderLayer/LlamaAttention"


def test_functional_calls_are_kernels_of_the_innermost_module(level0):
    attention = [d for d in op_dirs(level0) if d.startswith(f"{LAYER}/1_LlamaAttention/")
                 and d.count("/") == 2]
    assert any("ScaledDotProduct" in d and d.endswith("Kernel") for d in attention)


def test_child_inputs_carry_parameter_names_and_kernels_plain_names(level0):
    attn = level0 / LAYER / "1_LlamaAttention" / "before"
    names = sorted(p.name for p in attn.iterdir())
    assert "intensor0_hidden_states.bin" in names
    assert "intensor1_position_embeddings_0.bin" in names
    assert "intensor2_position_embeddings_1.bin" in names
    linear = level0 / LAYER / "1_LlamaAttention" / "0_Linear"
    assert [p.name for p in (linear / "before").iterdir()] == ["intensor0_input.bin"]
    kernel = next(p for p in linear.iterdir() if p.name.endswith("Kernel"))
    assert all(p.name.startswith("intensor") and "_" not in p.stem
               for p in (kernel / "before").iterdir())
    param = json.loads((kernel / "op_param.json").read_text())
    assert param["op"].startswith("aten.")
    assert set(param["inputs"].values()) <= {"self", "mat2", "input", "weight", "bias", "other",
                                             "mat1", "dim0", "dim1", "size"}


def test_kernel_names_are_camel_case_aten_names(level0):
    kernels = {d.rsplit("/", 1)[1].split("_", 1)[1] for d in op_dirs(level0)
               if d.endswith("Kernel")}
    assert "MmKernel" in kernels or "AddmmKernel" in kernels
    assert "AddTensorKernel" in kernels
    assert "MulTensorKernel" in kernels
    assert all(k[0].isupper() and "." not in k for k in kernels)


def test_module_outputs_with_fields_are_named(tmp_path):
    class Inner(nn.Module):
        def forward(self, x):
            return {"last_hidden_state": x * 2, "aux": x + 1}

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = Inner()

        def forward(self, x):
            return self.inner(x)["last_hidden_state"]

    root = dump(tmp_path / "m", config(save_child=True), lambda: Root(Layer())(torch.ones(2)))
    after = only_proc(root) / "0" / "0_Layer" / "0_Inner" / "after"
    assert sorted(p.name for p in after.iterdir()) == ["outtensor0_last_hidden_state.bin",
                                                       "outtensor1_aux.bin"]


def test_ids_select_subtree_with_boundary_and_op_name_any_segment(tmp_path, llama):
    round0 = dump_first_round(tmp_path / "a", llama, ids="2_1", save_child=True)
    dirs = op_dirs(round0)
    assert dirs[:2] == [LAYER, f"{LAYER}/1_LlamaAttention"]
    assert all(d.startswith(f"{LAYER}/1_LlamaAttention") for d in dirs[1:])
    assert not (round0 / LAYER / "before").exists()   # the layer itself is not selected

    round0 = dump_first_round(tmp_path / "b", llama, op_name="llamaattention", save_child=True)
    ids = {r["Op Id"] for r in read_csv(round0 / "statistic.csv")}
    assert {"2_1", "3_1", "2_1_0", "3_1_0"} <= ids
    assert not any(i in ids for i in ("2", "3", "2_0", "2_4"))


def test_everything_at_every_depth_without_ids_or_op_name(tmp_path, llama):
    round0 = dump_first_round(tmp_path, llama, save_child=True, task="statistics")
    ops = {r["Op Id"] for r in read_csv(round0 / "statistic.csv")}
    assert {"0", "1", "2", "3", "4", "5", "2_1_0", "3_4_0"} <= ops
    assert any(i.startswith("0_") for i in ops)   # the embedding's kernels


def test_same_config_gives_same_ids_at_every_filter_level(level0, level1, level2):
    def ids(r):
        return [(x["Op Id"], x["Op Name"], x["Input/Output"], x["Index"])
                for x in read_csv(r / "statistic.csv")]
    assert ids(level0) == ids(level1) == ids(level2)
    assert op_dirs(level0) == op_dirs(level1) == op_dirs(level2)


def test_level1_references_resolve_to_identical_bytes(level0, level1):
    refs = [p for p in level1.rglob("*.bin") if read_header(p).is_reference]
    assert len(refs) >= 10
    for ref in refs:
        assert "_" not in ref.stem.replace("intensor", "").replace("outtensor", "") or \
            not ref.stem.split("_", 1)[1][0].isalpha(), f"named file became a reference: {ref}"
        twin = level0 / ref.relative_to(level1)
        assert torch.equal(load(ref).reshape(-1).view(torch.uint8),
                           load(twin).reshape(-1).view(torch.uint8)), ref
        assert read_header(ref).dims == read_header(twin).dims


def test_named_files_always_hold_data(level1):
    named = [p for p in level1.rglob("*.bin") if p.stem.count("_") and
             p.stem.split("_", 1)[1][:1].isalpha()]
    assert named
    assert not any(read_header(p).is_reference for p in named)


def test_level1_saves_disk(level0, level1):
    size0 = sum(p.stat().st_size for p in level0.rglob("*.bin"))
    size1 = sum(p.stat().st_size for p in level1.rglob("*.bin"))
    assert size1 < 0.8 * size0


def test_level2_keeps_kernel_headers_and_their_statistics(level2):
    kernel_bins = [p for p in level2.rglob("*.bin") if p.parent.parent.name.endswith("Kernel")]
    assert kernel_bins
    for p in kernel_bins:
        h = read_header(p)
        assert h.is_reference and p.stat().st_size == h.payload_offset
        assert h.data_ref == str(p.relative_to(level2))
    rows = [r for r in read_csv(level2 / "statistic.csv") if r["Op Type"].endswith("Kernel")
            and "0" not in r["Shape"].split("x")]   # empty tensors have no statistics
    assert rows and all(r["Max"] != "N/A" for r in rows)
    module_bins = [p for p in level2.rglob("*.bin") if not p.parent.parent.name.endswith("Kernel")]
    assert any(not read_header(p).is_reference for p in module_bins)


def test_layer_structure_file_nests_children_and_kernels(level0):
    info = level0.parents[2] / "info" / "layer" / level0.parent.name
    doc = json.loads((info / "LlamaDecoderLayer_2.json").read_text())
    children = [n["opType"] for n in doc["nodes"]]
    assert children[:2] == ["LlamaRMSNorm", "LlamaAttention"]
    attention = doc["nodes"][1]
    assert attention["opName"] == "LlamaAttention_2_1"
    assert attention["nodes"][0]["opType"] == "Linear"
    assert any(n["opType"].endswith("Kernel") for n in attention["nodes"])
    assert attention["inTensors"][0] == "LlamaAttention_2_1_input_0"


def test_a_shared_submodule_called_twice_gets_two_ids(tmp_path):
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(4, 4)

        def forward(self, x):
            return self.proj(torch.relu(self.proj(x)))

    with torch.no_grad():
        root = dump(tmp_path, config(save_child=True, task="statistics"),
                    lambda: Root(Block())(torch.randn(2, 4)))
    rows = read_csv(only_proc(root) / "0" / "statistic.csv")
    linears = sorted({r["Op Id"] for r in rows if r["Op Type"] == "Linear"})
    assert linears == ["0_0", "0_2"]
    assert {r["Op Type"] for r in rows if r["Op Id"] == "0_1"} == {"ReluKernel"}


def test_gpt2_children_and_kernels(tmp_path):
    gpt2 = tiny_gpt2()
    round0 = dump_first_round(tmp_path, gpt2, ids="3_1", save_child=True, task="all")
    dirs = op_dirs(round0)
    assert dirs[0] == "3_GPT2Block" and dirs[1] == "3_GPT2Block/1_GPT2Attention"
    assert any(d.startswith("3_GPT2Block/1_GPT2Attention/0_Conv1D") for d in dirs)
    assert any(d.endswith("Kernel") for d in dirs)
    before = round0 / "3_GPT2Block" / "1_GPT2Attention" / "before"
    assert "intensor0_hidden_states.bin" in {p.name for p in before.iterdir()}


def test_kernels_are_not_captured_outside_selected_layers(tmp_path, llama):
    from torch.utils._python_dispatch import _get_current_dispatch_mode
    seen = []
    hook = llama.model.norm.register_forward_pre_hook(lambda m, a: seen.append(
        _get_current_dispatch_mode()))
    try:
        dump_first_round(tmp_path, llama, ids="2", save_child=True)
    finally:
        hook.remove()
    assert seen and all(m is None for m in seen)


def _row_matches_its_file(r) -> bool:
    from atb_probe.binread import load_tensor
    t = load_tensor(r["Tensor Path"])
    if t.numel() == 0:
        return r["Max"] == "N/A"
    x = t.abs() if t.is_complex() else t
    x = x.double() if not x.is_floating_point() else x.float()
    want = [x.max().item(), x.min().item(), x.sum().item() / x.numel(),
            torch.linalg.vector_norm(x).item()]
    got = [float(r[k]) for k in ("Max", "Min", "Mean", "Norm")]
    return got == pytest.approx(want, rel=1e-5, abs=1e-6)


def test_reused_statistics_always_describe_the_values_of_the_moment(tmp_path):
    """Statistics are computed once per state of a tensor's memory and reused for its views,
    for the next kernel's inputs and across rounds. In-place kernels, views of changed memory,
    weights changed between rounds: every row must still equal the statistics of the bytes
    written for it at that moment."""
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(6, 6)

        def forward(self, x):
            y = self.lin(x)              # fresh output: cached
            v = y.view(-1)               # a view kernel: reuses y's statistics
            y.mul_(-2.0)                 # in place: y and v change
            w = y.view(3, 6).t()         # a view of the changed memory
            z = torch.relu(w)            # input w: must not reuse the old statistics
            v.add_(1.0)                  # in place through the first view
            y.view(-1)                   # a view of memory changed before, made in a kernel
            y.add_(5.0)
            d = torch.relu(y.data)       # `.data`: same memory, a version counter of its own
            u = torch.ops.aten._unsafe_view(y, (18,))  # y's memory, a counter of its own
            torch.relu(u)                # input u: the statistics of its output, by identity
            y.mul_(3.0)                  # u changes; its counter does not
            r = torch.relu(u)            # input u: must not reuse them
            m = y.view(1, 3, 6) @ self.lin.weight  # mm, then `_unsafe_view` of its result
            return z + y.sum() + d.sum() + r.sum() + m.sum(), v.view(2, 9), \
                torch.conj(torch.complex(y, y)).imag

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([Block(), Block()])

        def forward(self, x):
            for b in self.blocks:
                x = b(x)[1].view(3, 6)
            return x

    net = Net()
    x = torch.randn(3, 6)

    def run():
        with torch.no_grad():
            net(x)
            net.blocks[0].lin.weight.mul_(3.0)  # a weight changed in place between rounds
            net(x)
            net(x)

    root = dump(tmp_path, config(task="all", save_child=True, filter_level=1), run)
    checked = 0
    for round_dir in sorted(only_proc(root).iterdir()):
        for r in read_csv(round_dir / "statistic.csv"):
            assert _row_matches_its_file(r), r
            checked += 1
    assert checked > 100


def test_the_memory_the_statistics_cache_holds_stays_bounded_however_many_rounds_run(
        tmp_path, monkeypatch):
    """A long-running service: a cache buffer changed in place every round stays alive, and so
    would what the statistics cache (stats_reuse.py) keeps for each of its past versions. It
    keeps only what can still be used: the memory allocated there and still held, as
    tracemalloc counts it, stays what it was after the first rounds."""
    import tracemalloc

    from atb_probe.capture import stats_reuse
    monkeypatch.setattr(stats_reuse, "MIN_ENTRIES", 16)  # small: a sweep every few rounds

    class Cached(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.register_buffer("cache", torch.zeros(8, 4))

        def forward(self, x, step):
            self.cache[step % 8].copy_(self.lin(x)[0])  # in place, as a KV cache is
            return self.cache.sum(0, keepdim=True) + x

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([Cached(), Cached()])

        def forward(self, x, step):
            for layer in self.layers:
                x = layer(x, step)
            return x

    net, x, held = Net(), torch.randn(1, 4), []
    in_cache = [tracemalloc.Filter(True, stats_reuse.__file__)]

    def run():
        with torch.no_grad():
            for step in range(300):
                net(x, step)
                if step % 50 == 49:
                    snapshot = tracemalloc.take_snapshot().filter_traces(in_cache)
                    held.append(sum(s.size for s in snapshot.statistics("filename")))

    tracemalloc.start()
    try:
        dump(tmp_path, config(task="statistics", save_child=True), run)
    finally:
        tracemalloc.stop()
    # Kept for every version, it would grow by the first rounds' amount every 50 rounds. (What
    # tracemalloc gives this file depends on the process's history: an object reused from a
    # free list counts where it was first allocated. The first two snapshots are the yardstick:
    # one of them alone read 3.9 KB once, against 8-10 KB usually.)
    assert max(held[2:]) <= 1.5 * max(held[:2]), held


@pytest.mark.parametrize("overrides", [
    {},                                                     # layer-level ops only
    {"save_child": True},                                   # every child module and kernel
    {"save_child": True, "op_name": "no_such_op"},          # tracked, nothing written
    {"save_child": True, "task": "tensor", "filter_level": 1},
    {"save_child": True, "task": "statistics"},             # kernels' rows without frames
])
def test_an_exception_in_the_model_passes_through_once_and_the_probe_goes_on(tmp_path, capfd,
                                                                             overrides):
    """The model's own errors (an ATen kernel refusing its arguments, a Python error in a child
    module) reach the caller unchanged and once; what ran before them is still recorded, and
    the next round is dumped as usual."""
    calls = {"mm": 0}

    class Child(nn.Module):
        def forward(self, x, fail):
            if fail == "python":
                raise ValueError("bad input")
            return x * 2

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.child = Child()

        def forward(self, x, fail=None):
            y = self.child(x.view(-1, 4), fail)
            if fail == "kernel":
                calls["mm"] += 1
                return torch.mm(y, torch.ones(3, 3))  # 4 columns against 3 rows
            return y

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([Block(), Block()])

        def forward(self, x, fail=None):
            x = self.blocks[0](x)
            return self.blocks[1](x, fail)

    net = Net()
    x = torch.randn(2, 4)

    def run():
        net(x)  # a full round first: later rounds need no structure files
        with pytest.raises(RuntimeError):
            net(x, "kernel")
        with pytest.raises(ValueError, match="bad input"):
            net(x, "python")
        net(x)

    root = dump(tmp_path, config(**overrides), run)
    assert calls["mm"] == 1
    assert "internal error" not in capfd.readouterr().err
    if overrides.get("op_name"):
        assert not list((root / "data").rglob("*.csv"))  # tracked, nothing written
        return
    proc = only_proc(root)
    assert sorted(int(p.name) for p in proc.iterdir()) == [0, 1, 2, 3]
    for index in (1, 2):  # the first block ran before each failure and is recorded
        rows = read_csv(proc / str(index) / "statistic.csv")
        assert any(r["Op Id"] == "0" for r in rows)
    last = read_csv(proc / "3" / "statistic.csv")
    assert {r["Op Id"] for r in last} >= {"0", "1"}
