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
