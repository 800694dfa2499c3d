"""`atb-probe scan`: the first op that made a NaN/Inf, and growth warnings, from one dump.

Real dumps of a tiny float16 Llama: a healthy one, one whose second layer's MLP overflows
float16 (up_proj scaled by 1e4 and down_proj by 1e4: the down_proj matmul makes +-inf from finite
inputs), and one that comes close (down_proj by 1e3 only: the hidden states reach ~3e4, and the
final norm's square, taken in float32, would overflow float16).
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from torch import nn

from atb_probe import cli
from atb_probe.tools.compare import compare_dumps, write_outputs
from atb_probe.tools.scan import Settings, scan_dump

from conftest import Root, dump, generate, tiny_llama
from harness import config

OVERFLOW_MM = "3_LlamaDecoderLayer/4_LlamaMLP/4_Linear/2_MmKernel"   # layers[1].mlp.down_proj


def fp16_llama(tmp_path_factory, name, down=1.0, up=1.0, task="statistics", tokens=1, **cfg):
    model = tiny_llama(dtype=torch.float16)
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight.mul_(up)
        model.model.layers[1].mlp.down_proj.weight.mul_(down)
    tmp = tmp_path_factory.mktemp(name)
    settings = dict(task=task, save_child=True, exec_range="0,0")
    settings.update(cfg)
    dump(tmp, config(**settings), lambda: generate(model, prompt_len=4, new_tokens=tokens))
    return tmp


@pytest.fixture(scope="module")
def healthy(tmp_path_factory):
    return fp16_llama(tmp_path_factory, "healthy", exec_range="0,1", tokens=2)


@pytest.fixture(scope="module")
def overflow(tmp_path_factory):
    return fp16_llama(tmp_path_factory, "overflow", up=1e4, down=1e4)


@pytest.fixture(scope="module")
def overflow_tensor(tmp_path_factory):
    return fp16_llama(tmp_path_factory, "overflow_tensor", up=1e4, down=1e4, task="tensor")


@pytest.fixture(scope="module")
def near_overflow(tmp_path_factory):
    return fp16_llama(tmp_path_factory, "near", up=1e4, down=1e3)


def test_a_healthy_model_has_no_finding_and_no_growth_warning(healthy):
    results = scan_dump(str(healthy))
    assert [r.round_index for r in results] == [0, 1]
    for r in results:
        assert r.first is None and r.non_finite_ops == 0 and r.growth == []
        assert r.tensors > 400 and r.unchecked == 0
        # SDPA builds its float mask from scalar_tensor(-inf) and where: masks, not findings.
        assert r.mask_ops == 4


def test_the_floor_is_what_keeps_rsqrt_of_a_small_variance_off_the_warnings(healthy):
    loose = scan_dump(str(healthy), Settings(growth=1000, floor=0))
    flagged = {g.tensor.split("/")[-2].split("_", 1)[1] for r in loose for g in r.growth}
    assert "RsqrtKernel" in flagged          # 1e-4 -> 1e2: a x1e5 growth, harmless
    assert all(g.out_max_abs < 1000 for r in loose for g in r.growth)


def test_the_op_that_made_the_inf_is_named_from_statistics(overflow):
    [r] = scan_dump(str(overflow))
    f = r.first
    assert f is not None
    assert (f.op_path, f.layer, f.kind) == (OVERFLOW_MM, "3_LlamaDecoderLayer", "Inf")
    assert f.inputs_finite is True and f.bad_inputs == []
    assert r.non_finite_ops > 1                 # what comes after is infected


def test_without_statistics_the_data_is_read_and_gives_the_same_op(overflow_tensor):
    [r] = scan_dump(str(overflow_tensor))
    assert r.first is not None and r.first.op_path == OVERFLOW_MM and r.first.inputs_finite


def test_growth_before_an_overflow_is_a_warning_and_leaves_the_exit_status_0(near_overflow,
                                                                             capsys):
    [r] = scan_dump(str(near_overflow))
    assert r.first is None
    # The MLP (whose weights are no inputs of the module) takes the hidden states from ~0.05
    # to ~3e4, and the final norm squares that in float32, beyond float16's range.
    grown = {g.tensor: g for g in r.growth}
    assert set(grown) == {"3_LlamaDecoderLayer/4_LlamaMLP/output.0",
                          "3_LlamaDecoderLayer/output.0",
                          "4_LlamaRMSNorm/1_PowTensorScalarKernel/output.0"}
    assert grown["4_LlamaRMSNorm/1_PowTensorScalarKernel/output.0"].out_max_abs > 65504
    assert cli.main(["scan", str(near_overflow)]) == 0
    out = capsys.readouterr().out
    assert "growth warnings" in out and "PowTensorScalarKernel" in out


def test_cli_exits_1_on_a_nan_or_inf_and_writes_json(overflow, tmp_path, capsys):
    report = tmp_path / "scan.json"
    assert cli.main(["scan", str(overflow), "--json", str(report), "-j", "1"]) == 1
    out = capsys.readouterr().out
    assert f"first Inf: round 0, {OVERFLOW_MM} (output.0), in layer 3_LlamaDecoderLayer" in out
    doc = json.loads(report.read_text())
    assert doc["non_finite"] is True
    [rnd] = doc["rounds"]
    assert rnd["first"]["op_path"] == OVERFLOW_MM and rnd["first"]["inputs_finite"] is True


def test_cli_exits_0_on_a_healthy_dump(healthy, capsys):
    assert cli.main(["scan", str(healthy)]) == 0
    assert "no NaN/Inf in any output" in capsys.readouterr().out


def test_a_nan_in_the_model_input_is_not_blamed_on_the_first_op(tmp_path):
    root = Root(nn.Linear(8, 4))
    x = torch.randn(2, 8)
    x[1, 3] = float("nan")
    dump(tmp_path, config(task="statistics", save_child=True), lambda: root(x))
    [r] = scan_dump(str(tmp_path))
    assert r.first is not None and r.first.kind == "NaN"
    assert r.first.inputs_finite is False and r.first.bad_inputs
    assert "comes from before the first dumped op" in r.first.summary(r)


def test_rounds_are_scanned_in_parallel_with_the_same_result(healthy):
    assert scan_dump(str(healthy), jobs=2) == scan_dump(str(healthy), jobs=1)


STDIN_SCRIPT = """
import sys
from atb_probe.tools.compare import compare_dumps
from atb_probe.tools.scan import scan_dump
dump = sys.argv[1]
one, two = (compare_dumps(dump, dump, jobs=j, batch_elements=1) for j in (1, 2))
assert two.jobs == 2 and len(two.rows) == len(one.rows) > 0, (two.jobs, len(two.rows))
assert [r.metrics for r in two.rows] == [r.metrics for r in one.rows]
assert scan_dump(dump, jobs=2) == scan_dump(dump, jobs=1)
print("OK", len(two.rows), __file__)
"""


def test_worker_processes_start_from_a_script_read_on_standard_input(healthy):
    """`python - <<EOF` gives `__main__` the file name "<stdin>", which workers cannot run."""
    done = subprocess.run([sys.executable, "-", str(healthy)], input=STDIN_SCRIPT, text=True,
                          capture_output=True, timeout=300, cwd=healthy)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[0] == "OK" and done.stdout.split()[2] == "<stdin>"


@pytest.mark.parametrize("args, message", [
    (["scan", "/nonexistent/dump"], "does not exist"),
    (["scan", "{dump}", "--growth", "0"], "--growth must be > 0"),
])
def test_bad_input_exits_2_with_a_message(healthy, capsys, args, message):
    args = [a.format(dump=healthy) for a in args]
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_compare_marks_the_scan_findings_in_its_report(healthy, overflow, tmp_path):
    result = compare_dumps(str(healthy), str(overflow))
    [found] = [s for s in result.scan if s.side == "target" and s.first is not None]
    assert found.first.op_path == OVERFLOW_MM
    write_outputs(result, str(tmp_path), xlsx=False)
    report = (tmp_path / "atb_compare_report.html").read_text()
    assert "NaN/Inf and overflow" in report and f"first Inf: round 0, {OVERFLOW_MM}" in report
    assert "class='bad nf'" in report or "class='nf'" in report


# -- NaN/Inf that never reaches a layer-level op's output -------------------------------------

def t5_dump(tmp_path_factory, name, task="statistics", hook=None, **cfg):
    """A tiny T5's `generate` (encoder, decoder prompt, one decode step: rounds 0-2), with
    `hook` a forward hook on the decoder's first block (layer-level op 2 of rounds 1 and 2)."""
    from test_families import tiny_t5
    model = tiny_t5()
    if hook is not None:
        model.decoder.block[0].register_forward_hook(hook)
    prompt = torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(0))
    tmp = tmp_path_factory.mktemp(name)
    settings = dict(task=task, save_child=True, exec_range="all")
    settings.update(cfg)
    with torch.no_grad():
        dump(tmp, config(**settings),
             lambda: model.generate(prompt, max_new_tokens=2, do_sample=False))
    return tmp


def overflow_hook(module, args, out):
    """The block's hidden states times 1e60: +-inf from finite values, in its output."""
    return (out[0] * 1e30 * 1e30,) + tuple(out[1:])


T5_LOG = "2_T5Block/0_T5LayerSelfAttention/1_T5Attention/23_LogKernel"


@pytest.fixture(scope="module")
def t5(tmp_path_factory):
    return t5_dump(tmp_path_factory, "t5")


@pytest.fixture(scope="module")
def t5_inf(tmp_path_factory):
    return t5_dump(tmp_path_factory, "t5_inf", hook=overflow_hook)


def test_t5s_log_of_zero_is_contained_not_a_finding(t5):
    """The relative-position bucket takes log(0) = -inf and drops it with `where`: the first
    block's output is finite, so the -inf is listed as contained."""
    results = scan_dump(str(t5))
    assert [r.round_index for r in results] == [0, 1, 2]
    for r in results:
        assert r.first is None and r.non_finite_ops == 0
        [held] = r.contained
        assert (held.layer, held.kind) == ("2_T5Block", "-Inf")
        assert held.op_path.startswith("2_T5Block/0_T5LayerSelfAttention/1_T5Attention/")
        assert held.op_path.endswith("_LogKernel") and held.ops >= 1
    assert results[0].contained[0].op_path == T5_LOG


def test_cli_exits_0_on_t5_and_lists_the_contained_inf(t5, tmp_path, capsys):
    report = tmp_path / "scan.json"
    assert cli.main(["scan", str(t5), "--json", str(report), "-j", "1"]) == 0
    out = capsys.readouterr().out
    assert "no NaN/Inf in any output" in out
    assert f"-Inf from {T5_LOG} (output.0)" in out and "never reaches the output of 2_T5Block" \
        in out
    doc = json.loads(report.read_text())
    assert doc["non_finite"] is False and doc["contained"] == 3
    assert doc["rounds"][0]["contained"][0]["op_path"] == T5_LOG


def test_an_inf_reaching_a_layer_output_is_the_finding_beside_a_contained_one(t5_inf, capsys):
    """The decoder's first block holds both: the -inf of its position bucket (dropped) and
    the overflow its hook adds to its output (the finding, named in that block)."""
    results = scan_dump(str(t5_inf))
    assert results[0].first is None             # the encoder: untouched
    for r in results[1:]:
        f = r.first
        assert f is not None and f.kind == "Inf" and f.layer == "2_T5Block"
        assert f.op_path.startswith("2_T5Block/") and f.op_path.endswith("_MulTensorKernel")
        assert f.inputs_finite is True
        assert [c.layer for c in r.contained] == ["2_T5Block"]
        assert r.contained[0].op_path.endswith("_LogKernel")
    assert cli.main(["scan", str(t5_inf), "-j", "1"]) == 1
    assert "first Inf: round 1, 2_T5Block/" in capsys.readouterr().out


def test_without_statistics_the_data_tells_the_same(tmp_path_factory):
    root = t5_dump(tmp_path_factory, "t5_tensor", task="tensor")
    results = scan_dump(str(root))
    assert all(r.first is None and r.unchecked == 0 for r in results)
    assert [c.op_path for c in results[0].contained] == [T5_LOG]


def test_layer_level_statistics_alone_see_a_clean_t5(tmp_path_factory):
    root = t5_dump(tmp_path_factory, "t5_layers", save_child=False)
    assert all(r.first is None and not r.contained for r in scan_dump(str(root)))
    assert cli.main(["scan", str(root), "-j", "1"]) == 0


def test_an_inf_written_through_a_view_is_traced_to_the_kernel_that_wrote_it():
    """`x[..., 0] = inf`: the kernel's output is the view, and no row shows the tensor it
    wrote whole; the trail goes to the last op that output +inf."""
    from atb_probe.layout import Side
    from atb_probe.statcsv import Stats
    from atb_probe.tools.scan import Seen, scan_items
    inf, nan = float("inf"), float("nan")

    def row(name, io, high, low):
        return Seen(name, Side(io), "float", Stats(high, low, nan, nan))

    rows = [row("2_Block/input.0", "input", 1.0, -1.0),
            row("2_Block/0_LogKernel/input.0", "input", 1.0, 0.0),
            row("2_Block/0_LogKernel/output.0", "output", 0.0, -inf),
            row("2_Block/1_WhereSelfKernel/input.0", "input", 0.0, -inf),
            row("2_Block/1_WhereSelfKernel/output.0", "output", 0.0, -3.0),
            row("2_Block/2_SelectIntKernel/input.0", "input", 1.0, -1.0),
            row("2_Block/2_SelectIntKernel/output.0", "output", 0.5, 0.5),
            row("2_Block/3_FillScalarKernel/input.0", "input", 0.5, 0.5),
            row("2_Block/3_FillScalarKernel/output.0", "output", inf, inf),
            row("2_Block/output.0", "output", inf, -1.0)]
    r = scan_items(rows, "0_1", 0)
    assert r.first.op_path == "2_Block/3_FillScalarKernel" and r.first.inputs_finite
    assert [c.op_path for c in r.contained] == ["2_Block/0_LogKernel"]
    assert r.non_finite_ops == 2    # the fill and the block
