"""`torch.compile` (SPEC §7): dumped rounds run compiled code eagerly so its ops are seen; other
rounds, and a sleeping probe, leave it compiled. And `torch.jit.trace`, whose runs are no rounds.

A custom backend counts how often compiled code runs, so the tests see which rounds bypassed it.
"""
from __future__ import annotations

import json
import sys

import pytest
import torch
from torch import nn

import atb_probe
from atb_probe.binread import load_tensor
from conftest import dump, only_proc, op_dirs, read_csv
from harness import config, run, run_loaded

MESSAGE = "compiled code (torch.compile) runs eagerly while a round is dumped"


class CountingBackend:
    """A torch.compile backend that runs the captured graph and counts the runs."""

    def __init__(self):
        self.runs = 0

    def __call__(self, graph_module, example_inputs):
        def run(*args):
            self.runs += 1
            return graph_module.forward(*args)
        return run


def compiled_runs(model, backend: CountingBackend, x, rounds: int):
    """A function calling `model(x)` `rounds` times without grad, and the list it fills with
    how many times each call ran the compiled graph."""
    runs = []

    @torch.no_grad()
    def call():
        for _ in range(rounds):
            before = backend.runs
            model(x)
            runs.append(backend.runs - before)

    return call, runs


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).eval()


def test_only_dumped_rounds_bypass_compiled_code(tmp_path, capfd):
    backend = CountingBackend()
    model = torch.compile(mlp(), backend=backend)
    x = torch.randn(2, 4)
    three_rounds, runs = compiled_runs(model, backend, x, rounds=3)

    root = dump(tmp_path, config(exec_range="1,1", save_child=True), three_rounds)
    assert runs == [1, 0, 1]
    proc = only_proc(root)
    assert [p.name for p in proc.iterdir()] == ["1"]
    assert op_dirs(proc / "1") == [
        "0_Linear", "0_Linear/0_TKernel", "0_Linear/1_AddmmKernel", "1_ReLU",
        "1_ReLU/0_ReluKernel", "2_Linear", "2_Linear/0_TKernel", "2_Linear/1_AddmmKernel"]
    assert capfd.readouterr().err.count(MESSAGE) == 1


class Scaled(nn.Module):
    """Reads its weight through `.data` in `forward`, as vLLM's RMSNorm does."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.full((4,), 2.0))

    def forward(self, x):
        return x * self.weight.data + x.data


class Logged(torch.Tensor):
    """A tensor subclass with a `__torch_function__` of its own."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return super().__torch_function__(func, types, args, kwargs or {})


def test_compiled_code_reading_data_keeps_its_whole_graph_while_the_probe_is_awake(tmp_path):
    """While the probe is awake `.data` is watched (stats_reuse.py); code compiled in a round
    that is not dumped still compiles to one graph, and a tensor subclass's `.data` is its
    own."""
    backend = CountingBackend()
    module = Scaled()
    model = torch.compile(nn.Sequential(module, nn.ReLU()), backend=backend, fullgraph=True)
    x = torch.arange(4.0)

    @torch.no_grad()
    def rounds():
        assert "data" in torch.Tensor.__dict__
        assert torch.equal(model(x), x * 3.0)        # round 0, not dumped: compiled
        module.weight.data.mul_(2.0)                 # round 1 must see the write
        assert torch.equal(model(x), x * 5.0)        # dumped: run eagerly
        sub = torch.arange(3.0).as_subclass(Logged)
        assert type(sub.data) is Logged and torch.equal(sub.data, torch.arange(3.0))

    root = dump(tmp_path, config(task="statistics", exec_range="1,1", save_child=True), rounds)
    assert backend.runs == 1
    assert "data" not in torch.Tensor.__dict__
    rows = read_csv(only_proc(root) / "1" / "statistic.csv")
    weight = [r for r in rows if r["Shape"] == "4" and r["Input/Output"] == "input" and
              r["Max"] == r["Min"]]
    assert weight and all(float(r["Max"]) == 4.0 for r in weight)


class Leaf(nn.Module):
    """A module of the user's own with no submodule: `torch.compile` wraps it so that the
    compiled call goes to its `__call__` as it was when it was compiled."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3, 4))
        self.bias = nn.Parameter(torch.randn(3))

    def forward(self, x):
        return nn.functional.linear(x, self.weight, self.bias)


def test_a_compiled_module_without_submodules_called_as_the_model_is_its_layer_level_op(
        tmp_path):
    """`torch.compile(Leaf())` called as the model, compiled before the probe woke: its dumped
    round holds the Leaf and its kernels, as the Leaf called eagerly gives (SPEC §1), though the
    wrapper calls the Leaf past the probe's `nn.Module.__call__`; other rounds run it
    compiled."""
    torch.manual_seed(0)
    leaf = Leaf()
    backend = CountingBackend()
    model = torch.compile(leaf, backend=backend)
    x = torch.randn(2, 4)
    three_rounds, runs = compiled_runs(model, backend, x, rounds=3)

    cfg = config(task="statistics", exec_range="1,1", save_child=True)
    compiled = only_proc(dump(tmp_path / "compiled", cfg, three_rounds)) / "1"
    assert runs == [1, 0, 1]
    rows = read_csv(compiled / "statistic.csv")
    assert sorted({(r["Op Id"], r["Op Name"]) for r in rows}) == [
        ("0", "Leaf"), ("0_0", "Leaf/TKernel"), ("0_1", "Leaf/AddmmKernel")]
    with torch.no_grad():
        eager = only_proc(dump(tmp_path / "eager", config(task="statistics", save_child=True),
                               lambda: leaf(x))) / "0"
    columns = ("Op Name", "Op Type", "Op Id", "Input/Output", "Index", "Shape", "Max", "Min",
               "Mean", "Norm")
    assert [[r[c] for c in columns] for r in rows] == \
        [[r[c] for c in columns] for r in read_csv(eager / "statistic.csv")]


def test_compiled_model_is_named_and_pathed_as_the_model_it_wraps(tmp_path):
    model = torch.compile(mlp(), backend=CountingBackend())
    root = dump(tmp_path, config(task="statistics"), lambda: model(torch.randn(2, 4)))
    files = list((root / "info" / "model").rglob("*.json"))
    assert [p.name for p in files] == ["Sequential_Forward.json"]
    nodes = json.loads(files[0].read_text())["nodes"]
    assert [(n["opName"], n["modulePath"]) for n in nodes] == [
        ("Linear_0", "0"), ("ReLU_1", "1"), ("Linear_2", "2")]


def test_a_module_called_eagerly_and_compiled_is_one_model(tmp_path):
    """The same module called as it is and through its `torch.compile` wrapper: one model, one
    name, one model file listing both rounds, and the same layer-level ops in each."""
    eager = mlp()
    compiled = torch.compile(eager, backend=CountingBackend())
    x = torch.randn(2, 4)

    @torch.no_grad()
    def both():
        eager(x)
        compiled(x)

    root = dump(tmp_path, config(task="statistics"), both)
    files = list((root / "info" / "model").rglob("*.json"))
    assert [p.name for p in files] == ["Sequential_Forward.json"]
    assert json.loads(files[0].read_text())["rounds"] == [[0, 1]]
    proc = only_proc(root)
    ops = [[r["Op Name"] for r in read_csv(proc / i / "statistic.csv")] for i in ("0", "1")]
    assert ops[0] == ops[1] and ops[0][::2] == ["Linear", "ReLU", "Linear"]


def test_a_dumped_round_of_compiled_code_writes_the_values_eager_execution_gives(tmp_path):
    """The modules and kernels inside the compiled region are dumped with the values the eager
    model computes, and the compiled model's results are the eager ones in dumped rounds and
    in the others."""
    eager = mlp()
    x = torch.randn(3, 4)
    with torch.no_grad():
        expected = eager(x)
        hidden = torch.relu(eager[0](x))
    compiled = torch.compile(mlp(), backend=CountingBackend())
    outputs = []

    @torch.no_grad()
    def two_rounds():
        outputs.extend(compiled(x) for _ in range(2))

    root = dump(tmp_path, config(exec_range="0,0", save_child=True), two_rounds)
    assert all(torch.equal(out, expected) for out in outputs)
    round0 = only_proc(root) / "0"
    assert torch.equal(load_tensor(round0 / "0_Linear" / "before" / "intensor0.bin"), x)
    assert torch.equal(load_tensor(round0 / "1_ReLU" / "after" / "outtensor0.bin"), hidden)
    assert torch.equal(load_tensor(round0 / "2_Linear" / "after" / "outtensor0.bin"), expected)
    kernel = round0 / "2_Linear" / "1_AddmmKernel"
    assert torch.equal(load_tensor(kernel / "after" / "outtensor0.bin"), expected)


def test_sleeping_probe_leaves_compiled_code_alone(tmp_path, capfd):
    backend = CountingBackend()
    model = torch.compile(mlp(), backend=backend)
    x = torch.randn(2, 4)
    atb_probe.enable(str(tmp_path), config(dump_enable=False))
    try:
        for _ in range(3):
            model(x)
    finally:
        atb_probe.disable(timeout=60)
    assert backend.runs == 3
    assert MESSAGE not in capfd.readouterr().err


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        return torch.relu(self.linear(x)) + x


def test_a_compiled_submodule_is_seen_in_dumped_rounds(tmp_path):
    """`module.compile()` in place, on one block of a model that is not compiled itself."""
    backend = CountingBackend()
    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block()).eval()
    model[1].compile(backend=backend)
    x = torch.randn(2, 4)
    with torch.no_grad():
        model(x)
        assert backend.runs == 1
        root = dump(tmp_path, config(exec_range="0,0", ids="1", save_child=True),
                    lambda: [model(x) for _ in range(2)])
    assert backend.runs == 2  # round 1 ran it compiled
    assert op_dirs(only_proc(root) / "0") == [
        "1_Block", "1_Block/0_Linear", "1_Block/0_Linear/0_TKernel",
        "1_Block/0_Linear/1_AddmmKernel", "1_Block/1_ReluKernel", "1_Block/2_AddTensorKernel"]


class Gate(nn.Module):
    """A user's module with no submodule, inside a block."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        return torch.relu(x @ self.weight)


class GatedBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.gate = Gate()

    def forward(self, x):
        return self.gate(self.fc(x)) + x


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([GatedBlock() for _ in range(2)])
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def compile_regions(model: Stack, what: str) -> Stack:
    """`torch.compile` wrappers put in place of some of `model`'s modules."""
    def wrap(module):
        return torch.compile(module, backend="eager")
    if what == "blocks":
        model.layers = nn.ModuleList([wrap(b) for b in model.layers])
    elif what == "user leaves":
        for block in model.layers:
            block.gate = wrap(block.gate)
    elif what == "torch leaves":
        for block in model.layers:
            block.fc = wrap(block.fc)
        model.head = wrap(model.head)
    return model


def dump_rows_and_paths(root):
    """A one-round dump's statistic.csv rows, and the (opName, modulePath)s of its structure
    files (the model file and the layer files)."""
    rows = read_csv(only_proc(root) / "0" / "statistic.csv")
    pairs = []

    def walk(node):
        for child in node.get("nodes", []):
            pairs.append((child["opName"], child.get("modulePath")))
            walk(child)
    for file in (root / "info").rglob("*.json"):
        walk(json.loads(file.read_text()))
    columns = ("Op Name", "Op Type", "Op Id", "Input/Output", "Index", "Shape", "Max", "Min",
               "Mean", "Norm")
    return [[r[c] for c in columns] for r in rows], sorted(pairs)


@pytest.mark.parametrize("awake", [False, True], ids=["compiled asleep", "compiled awake"])
@pytest.mark.parametrize("what", ["blocks", "user leaves", "torch leaves"])
def test_compiled_regions_of_a_model_dump_as_the_eager_model(tmp_path, what, awake):
    """Blocks, user modules with no submodule or torch's own modules each wrapped by
    `torch.compile` (regional compilation), compiled before the probe woke or while it is
    awake: a dumped round has the eager model's ops, IDs, names, values and module paths, with
    no `OptimizedModule` op and no op doubled by its wrapper."""
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(1))
    cfg = config(task="statistics", save_child=True)
    torch.manual_seed(0)
    eager = Stack().eval()
    with torch.no_grad():
        expected = dump_rows_and_paths(dump(tmp_path / "eager", cfg, lambda: eager(x)))
    torch.manual_seed(0)
    model = Stack().eval()

    @torch.no_grad()
    def compiled_call():
        if awake:
            compile_regions(model, what)
        model(x)

    if not awake:
        compile_regions(model, what)
        with torch.no_grad():
            model(x)
    got = dump_rows_and_paths(dump(tmp_path / "compiled", cfg, compiled_call))
    assert got == expected
    layer_ops = [r[0] for r in got[0] if "/" not in r[0]]
    assert layer_ops[::2] == ["GatedBlock", "GatedBlock", "Linear"]
    assert ("Gate_0_1", "layers.0.gate") in got[1]


def test_hooks_on_a_compiled_wrapper_run_in_dumped_rounds(tmp_path):
    """Hooks registered on the `torch.compile` wrapper of a leaf called as the model run in
    its dumped rounds as in the others: the model returns what it returns un-probed, and the
    hooks' kernels are the op's children."""
    torch.manual_seed(0)
    model = torch.compile(Leaf(), backend="eager")
    model.register_forward_pre_hook(lambda module, args: (args[0] * 2,))
    model.register_forward_hook(lambda module, args, out: out + 100)
    x = torch.randn(2, 4)
    with torch.no_grad():
        expected = model(x)
    outputs = []
    with torch.no_grad():
        root = dump(tmp_path, config(task="statistics", save_child=True),
                    lambda: outputs.append(model(x)))
    assert torch.equal(outputs[0], expected)
    rows = read_csv(only_proc(root) / "0" / "statistic.csv")
    assert [r["Op Name"] for r in rows if r["Input/Output"] == "output"] == [
        "Leaf/MulTensorKernel", "Leaf/TKernel", "Leaf/AddmmKernel", "Leaf/AddTensorKernel", "Leaf"]
    assert float(rows[-1]["Max"]) == pytest.approx(float(expected.max()))


def test_a_model_whose_call_is_compiled_while_the_probe_is_awake(tmp_path):
    """`torch.compile(model.__call__)` (as transformers compiles decoding with a static cache
    on a GPU) compiled while the probe is awake: compiled code calls the probe's round, which
    used to stop the user's run (`set_stance` inside compiled code) and had torch.compile trace
    the probe's own code. Every call is a round; the dumped one runs eagerly and holds what
    the eager model gives, the others run compiled; the results are the model's."""
    model = mlp()
    backend = CountingBackend()
    x = torch.randn(2, 4)
    with torch.no_grad():
        expected = model(x)
        eager = only_proc(dump(tmp_path / "eager", config(task="statistics"),
                               lambda: model(x))) / "0"
    outputs = []

    runs = []

    @torch.no_grad()
    def three_calls():
        compiled = torch.compile(model.__call__, backend=backend)
        for _ in range(3):
            before = backend.runs
            outputs.append(compiled(x))
            runs.append(backend.runs - before)

    root = dump(tmp_path / "compiled", config(task="statistics", exec_range="1,1"), three_calls)
    assert all(torch.equal(out, expected) for out in outputs)
    assert runs[0] > 0 and runs[1] == 0 and runs[2] > 0  # only the dumped round ran eagerly
    status = json.loads(next((root / "status").glob("*.json")).read_text())
    assert (status["rounds_started"], status["rounds_dumped"], status["last_error"]) == \
        (3, 1, None)
    columns = ("Op Name", "Op Id", "Input/Output", "Index", "Shape", "Max", "Min", "Mean",
               "Norm")
    assert [[r[c] for c in columns] for r in read_csv(only_proc(root) / "1" / "statistic.csv")] \
        == [[r[c] for c in columns] for r in read_csv(eager / "statistic.csv")]


def test_a_model_traced_by_torch_jit_while_the_probe_is_awake(tmp_path):
    """`torch.jit.trace` runs the model twice (the trace, then its check) and records every
    torch call made meanwhile: those runs are no rounds, so the probe's own work on the
    model's tensors stays out of the trace, and the check passes (it failed with "Graphs
    differed across invocations", the second run finding the statistics the first had
    computed)."""
    model = mlp()
    x = torch.randn(2, 4)

    def kinds(traced):
        return [node.kind() for node in traced.inlined_graph.nodes()]

    with torch.no_grad():
        expected = model(x)
        unprobed = kinds(torch.jit.trace(model, x))
    outputs, graphs = [], []

    @torch.no_grad()
    def trace_and_call():
        traced = torch.jit.trace(model, x)
        graphs.append(kinds(traced))
        outputs.append(traced(x))

    root = dump(tmp_path, config(task="statistics"), trace_and_call)
    assert graphs == [unprobed] and torch.equal(outputs[0], expected)
    status = json.loads(next((root / "status").glob("*.json")).read_text())
    assert status["last_error"] is None
    # Two rounds: the check's eager run of the model, dumped, then the traced module's call,
    # whose modules run inside TorchScript, unseen.
    rounds = sorted(p.name for p in only_proc(root).iterdir())
    assert (status["rounds_started"], status["rounds_empty"], rounds) == (2, 1, ["0"])


BERT_COMPILED = """
import torch
from transformers import BertConfig, BertForSequenceClassification
torch.manual_seed(0)
model = BertForSequenceClassification(BertConfig(
    vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
    intermediate_size=64, max_position_embeddings=64)).eval()
compiled = torch.compile(model, backend="eager")
tokens = torch.randint(0, 64, (1, 6))
with torch.no_grad():
    outputs = [compiled(tokens).logits for _ in range(3)]
    print("EQUAL", all(torch.equal(o, model(tokens).logits) for o in outputs))
"""


def test_compiled_encoder_through_the_load_script(tmp_path):
    """A compiled BERT in an unmodified program: the dumped round shows its layers."""
    result = run_loaded(tmp_path, BERT_COMPILED, config(exec_range="1,1"))
    assert result.returncode == 0, result.stderr
    assert "EQUAL True" in result.stdout
    assert result.stderr.count(MESSAGE) == 1
    round_dir = only_proc(tmp_path / "atb_dump_data") / "1"
    assert [d for d in op_dirs(round_dir) if "/" not in d and d[0].isdigit()] == [
        "0_BertEmbeddings", "1_BertLayer", "2_BertLayer", "3_BertPooler", "4_Dropout",
        "5_Linear"]


@pytest.mark.parametrize("save_child", [False, True])
def test_a_process_that_never_compiles_does_not_load_the_compiler(tmp_path, save_child):
    """Nothing compiled can run before `torch.compile` imports torch._dynamo, so a dumped round
    of an eager model, its kernels tracked or not, leaves it unimported (importing it takes a
    second and 70 MB)."""
    script = f"""
import sys, torch
from torch import nn
import atb_probe
model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
atb_probe.enable({str(tmp_path)!r}, {config(task="statistics", save_child=save_child)!r})
model(torch.randn(2, 4))
assert atb_probe.disable(timeout=60)
print("dynamo imported:", "torch._dynamo" in sys.modules)
"""
    done = run([sys.executable, "-c", script])
    assert done.returncode == 0, done.stderr
    assert "dynamo imported: False" in done.stdout
    rows = read_csv(only_proc(tmp_path / "atb_dump_data") / "0" / "statistic.csv")
    layers = {r["Op Id"] for r in rows if "_" not in r["Op Id"]}
    kernels = {r["Op Id"] for r in rows if "_" in r["Op Id"]}
    assert layers == {"0", "1", "2"} and bool(kernels) == save_child
