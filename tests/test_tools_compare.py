"""`atb-probe compare` on real dumps of a tiny Llama: itself, bf16, a perturbed layer."""
from __future__ import annotations

import csv
import math
import re
import subprocess

import pytest
import torch

from atb_probe import cli, load
from atb_probe.statcsv import parse_shape
from atb_probe.tools.compare import CompareError, compare_dumps
from atb_probe.tools.comparison import PairMode, Thresholds
from atb_probe.tools.resulttable import COLUMNS
from atb_probe.tools.dumpreader import open_dump

from conftest import MSPROBE_MISSING, dump, generate, msprobe_executable, only_proc, tiny_llama
from harness import config

PERTURBED_OP = "3_LlamaDecoderLayer/1_LlamaAttention/6_Linear"   # layers[1].self_attn.v_proj

MSPROBE_TENSOR_COLUMNS = [
    "Target Data Name", "Golden Data Name", "Target Device and PID", "Golden Device and PID",
    "Target Execution Count", "Golden Execution Count", "Target Data Type", "Golden Data Type",
    "Target Data Shape", "Golden Data Shape", "Cosine", "Euc Distance", "Max Absolute Err",
    "Max Relative Err", "One Thousandth Err Ratio", "Five Thousandth Err Ratio", "Target Max",
    "Golden Max", "Target Min", "Golden Min", "Target Mean", "Golden Mean", "Target Norm",
    "Golden Norm"]
MSPROBE_STATS_ONLY_COLUMNS = [
    "Max Diff", "Min Diff", "Mean Diff", "Norm Diff", "Relative Err of Max(%)",
    "Relative Err of Min(%)", "Relative Err of Mean(%)", "Relative Err of Norm(%)"]


def perturb(model):
    """Scale one projection of the second decoder layer by 10%."""
    with torch.no_grad():
        model.model.layers[1].self_attn.v_proj.weight.mul_(1.1)
    return model


def llama_dump(tmp_path_factory, name, dtype=torch.float32, broken=False, **cfg):
    model = tiny_llama(dtype=dtype)
    if broken:
        perturb(model)
    settings = dict(task="all", save_child=True, filter_level=1)
    settings.update(cfg)
    tmp = tmp_path_factory.mktemp(name)
    dump(tmp, config(**settings), lambda: generate(model, prompt_len=4, new_tokens=2))
    return tmp


@pytest.fixture(scope="module")
def golden(tmp_path_factory):
    return llama_dump(tmp_path_factory, "golden")


@pytest.fixture(scope="module")
def bf16(tmp_path_factory):
    return llama_dump(tmp_path_factory, "bf16", dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def broken(tmp_path_factory):
    return llama_dump(tmp_path_factory, "broken", broken=True)


@pytest.fixture(scope="module")
def vs_broken(golden, broken):
    return compare_dumps(str(golden), str(broken))


@pytest.fixture(scope="module")
def vs_broken_full(golden, broken):
    """Every pair's data read: the tests of the whole table's metrics."""
    return compare_dumps(str(golden), str(broken), full=True)


@pytest.fixture(scope="module")
def vs_bf16(golden, bf16):
    return compare_dumps(str(golden), str(bf16), full=True)


def test_compare_of_a_dump_with_itself_is_exact(golden):
    result = compare_dumps(str(golden), str(golden), full=True)   # every pair's data read
    assert len(result.rows) == sum(len(r.tensors) for r in open_dump(str(golden)).rounds)
    assert {str(r.round_index) for r in result.rows} == {"0", "1"}
    for row in result.rows:
        if row.mode == "no data":
            assert row.note == "empty tensor"
            continue
        assert row.mode == "tensor"
        assert row.metrics.cosine in (1.0, None)          # None: single-element tensors
        assert row.metrics.max_abs_err == 0.0 and row.metrics.euc_distance == 0.0
        assert row.metrics.max_rel_err == 0.0
        assert row.metrics.one_thousandth_ratio == 1.0 and row.metrics.five_thousandth_ratio == 1.0
        assert row.diverged is False and row.match == "id"
    assert result.unmatched == [] and result.finding is None


def test_perturbed_layer_is_named_as_the_first_divergence(vs_broken):
    result = vs_broken
    f = result.finding
    assert f is not None and f.inputs_clean
    assert (f.round_index, f.op_path) == (0, PERTURBED_OP)
    assert f.row.name == f"{PERTURBED_OP}/output.0"
    # Everything that ran before it is bit-identical; inside it, the changed weight is the
    # first tensor that differs (the transpose kernel's input).
    before = [r for r in result.rows
              if str(r.round_index) == "0" and r.order < f.row.order
              and r.mode == "tensor"]
    inside = [r for r in before if r.name.startswith(PERTURBED_OP + "/")]
    assert before and all(r.metrics.max_abs_err == 0.0 for r in before if r not in inside)
    assert f.first_inside == f"{PERTURBED_OP}/0_TKernel/input.0"


def test_the_named_op_is_the_one_whose_weights_were_changed(golden, broken):
    """6_Linear of the second layer's attention really is v_proj: its dumped output is
    v_proj(input) with the golden model's weights."""
    model = tiny_llama()
    rnd = only_proc(golden / "atb_dump_data") / "0" / PERTURBED_OP
    from atb_probe import load
    x = load(next((rnd / "before").glob("intensor0*.bin")))
    y = load(rnd / "after" / "outtensor0.bin")
    expected = torch.nn.functional.linear(x, model.model.layers[1].self_attn.v_proj.weight)
    assert torch.allclose(y, expected, atol=1e-6)


def test_bf16_against_fp32_gives_plausible_metrics(vs_bf16):
    result = vs_bf16
    floats = [r for r in result.rows if r.mode == "tensor"
              and r.target.dtype == "bf16" and r.metrics.cosine is not None]
    assert len(floats) > 100
    cosines = sorted(r.metrics.cosine for r in floats)
    assert cosines[0] > 0.99 and cosines[len(cosines) // 2] > 0.9999
    assert all(c <= 1.0 + 1e-12 for c in cosines)
    errors = [r.metrics.max_abs_err for r in floats]
    assert sum(e > 0 for e in errors) > len(errors) // 2 and max(errors) < 0.5
    assert any(r.note.startswith("dtype differs") for r in floats)


def test_bf16_only_casts_are_reported_as_unmatched_and_the_rest_paired_by_name(vs_bf16):
    result = vs_bf16
    assert result.name_matched_ops > 0
    assert result.unmatched
    for u in result.unmatched:
        assert (u.side, u.kind) == ("target", "op") and u.what.endswith("_ToCopyKernel")
    # The kernels after an extra cast keep their pairing: RMSNorm's PowTensorScalarKernel is
    # #0 in fp32 and #1 in bf16.
    names = {(r.golden.data_name, r.name) for r in result.rows}
    assert ("2_LlamaDecoderLayer/0_LlamaRMSNorm/0_PowTensorScalarKernel/output.0",
            "2_LlamaDecoderLayer/0_LlamaRMSNorm/1_PowTensorScalarKernel/output.0") in names


def test_bf16_rounding_of_the_embedding_crosses_the_default_1permille_ratio(golden, bf16,
                                                                           vs_bf16):
    assert vs_bf16.finding is not None and vs_bf16.finding.op_path == "0_Embedding"
    loose = compare_dumps(str(golden), str(bf16), thresholds=Thresholds(min_ratio=0.0))
    assert loose.finding is None


def test_a_statistics_dump_is_compared_by_its_statistics(tmp_path_factory, golden):
    stats_only = llama_dump(tmp_path_factory, "stats", broken=True, task="statistics",
                            exec_range="0,0")
    result = compare_dumps(str(golden), str(stats_only))
    modes = {r.mode for r in result.rows}
    assert modes <= {"statistics", "no data"} and "statistics" in modes
    f = result.finding
    assert f is not None and f.op_path == PERTURBED_OP
    assert f.row.diffs.norm_rel_pct == pytest.approx(10.0, rel=0.01)
    # Round 1 exists only in the golden dump.
    assert [(u.side, u.kind) for u in result.unmatched] == [("golden", "round")]


def test_header_only_kernels_fall_back_to_csv_statistics_or_report_no_data(tmp_path_factory,
                                                                          golden):
    level2 = llama_dump(tmp_path_factory, "level2", broken=True, task="tensor", filter_level=2,
                        exec_range="0,0")
    result = compare_dumps(str(golden), str(level2))
    kernels = [r for r in result.rows if r.name.split("/")[-2].endswith("Kernel")]
    assert kernels and {r.mode for r in kernels} <= {"statistics", "no data"}
    assert result.finding.op_path == PERTURBED_OP
    strict = compare_dumps(str(golden), str(level2), mode="tensor")
    no_data = [r for r in strict.rows if r.mode == "no data"
               and r.note != "empty tensor"]
    assert no_data and all("header-only" in r.note for r in no_data)
    assert strict.finding.op_path == PERTURBED_OP


def test_cli_writes_csv_xlsx_and_a_self_contained_report(golden, broken, tmp_path, capsys):
    out = tmp_path / "cmp"
    assert cli.main(["compare", str(golden), str(broken), "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"first divergence: round 0, {PERTURBED_OP} (output.0)" in printed
    with open(out / "atb_compare_result.csv", newline="") as f:
        reader = csv.reader(f)
        header = next(reader)
        rows = list(reader)
    assert header == list(COLUMNS)
    # msprobe's columns, in its order, come first; its statistics-mode columns are there too.
    assert [c for c in header if c in MSPROBE_TENSOR_COLUMNS] == MSPROBE_TENSOR_COLUMNS
    assert header[:16] == MSPROBE_TENSOR_COLUMNS[:16]
    assert set(MSPROBE_STATS_ONLY_COLUMNS) <= set(header)
    assert rows and all(len(r) == len(header) for r in rows)
    import pandas as pd
    sheets = pd.read_excel(out / "atb_compare_result.xlsx", sheet_name=None,
                           keep_default_na=False)
    assert list(sheets) == ["compare", "unmatched", "summary"]
    assert len(sheets["compare"]) == len(rows)
    report = (out / "atb_compare_report.html").read_text()
    assert report.index(PERTURBED_OP) < report.index("<svg")     # the finding comes first
    assert report.count("<svg") == 2                               # one plot per round
    assert not re.search(r"""(src|href)\s*=\s*["']?https?:""", report)
    assert "<script src" not in report


def test_compare_accepts_process_and_round_folders(golden, broken):
    g, b = only_proc(golden / "atb_dump_data"), only_proc(broken / "atb_dump_data")
    by_proc = compare_dumps(str(g), str(b))
    by_round = compare_dumps(str(g / "0"), str(b / "0"))
    assert by_proc.finding.op_path == by_round.finding.op_path == PERTURBED_OP
    assert len(by_round.rows) < len(by_proc.rows)


def test_a_round_folder_against_a_dump_root_is_a_user_error(golden, broken, capsys):
    g = only_proc(golden / "atb_dump_data") / "0"
    with pytest.raises(CompareError, match="round folder"):
        compare_dumps(str(g), str(broken))
    assert cli.main(["compare", str(g), str(broken)]) == 2
    err = capsys.readouterr().err
    assert "give two round folders" in err and "Traceback" not in err
    assert cli.main(["compare", str(golden / "nope"), str(broken)]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_layer_level_dumps_name_the_perturbed_layer(tmp_path_factory, tmp_path, capsys):
    """The README's second example: layer-level ops only, the broken layer is named."""
    good = llama_dump(tmp_path_factory, "layers_good", save_child=False, exec_range="0,0")
    bad = llama_dump(tmp_path_factory, "layers_bad", broken=True, save_child=False,
                     exec_range="0,0")
    assert cli.main(["compare", str(good), str(bad), "-o", str(tmp_path / "c"), "--no-xlsx"]) == 0
    assert "first divergence: round 0, 3_LlamaDecoderLayer (output.0)" in capsys.readouterr().out
    report = (tmp_path / "c" / "atb_compare_report.html").read_text()
    assert "First divergence: round 0, <code>3_LlamaDecoderLayer</code>" in report


def test_every_tensor_mode_row_has_finite_metrics(vs_broken_full):
    rows = [r for r in vs_broken_full.rows if r.mode == PairMode.TENSOR]
    assert len(rows) > 900
    for row in rows:
        m = row.metrics
        for value in (m.euc_distance, m.max_abs_err, m.max_rel_err, m.one_thousandth_ratio,
                      m.five_thousandth_ratio):
            assert value is not None and math.isfinite(value), row.name
        # Cosine is not defined for a single element.
        assert (m.cosine is None) == (math.prod(parse_shape(row.target.shape)) == 1), row.name
        assert m.cosine is None or -1.0 <= m.cosine <= 1.0


def test_the_perturbed_ops_metrics_are_those_of_its_data(golden, broken, vs_broken):
    row = next(r for r in vs_broken.rows if r.name == f"{PERTURBED_OP}/output.0")
    g = load(only_proc(golden / "atb_dump_data") / "0" / PERTURBED_OP / "after" /
             "outtensor0.bin").double().flatten()
    t = load(only_proc(broken / "atb_dump_data") / "0" / PERTURBED_OP / "after" /
             "outtensor0.bin").double().flatten()
    m = row.metrics
    assert m.max_abs_err > 0
    assert m.max_abs_err == pytest.approx((t - g).abs().max().item(), rel=1e-6)
    assert m.euc_distance == pytest.approx(torch.linalg.vector_norm(t - g).item(), rel=1e-6)
    assert m.cosine == pytest.approx(torch.nn.functional.cosine_similarity(g, t, dim=0).item(),
                                     abs=1e-9)
    # v_proj scaled by 1.1: every element is 10% off, far outside 1 and 5 per mille.
    assert m.one_thousandth_ratio == m.five_thousandth_ratio == 0.0
    assert m.max_rel_err == pytest.approx(0.1, rel=1e-3)


# -- interoperability with mindstudio-probe ---------------------------------------------------

@pytest.fixture(scope="module")
def msprobe():
    """The msprobe executable (`conftest.msprobe_executable`)."""
    path = msprobe_executable()
    if path is None:
        pytest.skip(MSPROBE_MISSING)
    return path


def test_msprobe_compare_accepts_our_dumps_and_agrees_with_our_metrics(msprobe, golden, broken,
                                                                      vs_broken_full,
                                                                      tmp_path):
    g = only_proc(golden / "atb_dump_data") / "0"
    b = only_proc(broken / "atb_dump_data") / "0"
    out = tmp_path / "msprobe_out"
    run = subprocess.run([msprobe, "compare", "-m", "atb", "-gp", str(g), "-tp", str(b),
                          "-o", str(out)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    results = list(out.glob("atb_tensor_compare_result_*.xlsx"))
    assert len(results) == 1, run.stdout + run.stderr
    import pandas as pd
    theirs = pd.read_excel(results[0], dtype=str, keep_default_na=False)
    assert list(theirs.columns) == MSPROBE_TENSOR_COLUMNS
    ours = {r.name: r for r in vs_broken_full.rows
            if str(r.round_index) == "0"}
    assert set(theirs["Target Data Name"]) == set(ours)
    compared = 0
    for _, row in theirs.iterrows():
        mine = ours[row["Target Data Name"]]
        if row["Cosine"] in ("N/A", "unsupported"):
            continue  # reference files (msprobe never follows them), single elements
        compared += 1
        assert mine.metrics.cosine == pytest.approx(float(row["Cosine"]), abs=2e-6)
        assert mine.metrics.max_abs_err == pytest.approx(float(row["Max Absolute Err"]),
                                                         rel=1e-6, abs=1e-12)
        assert mine.metrics.max_rel_err == pytest.approx(float(row["Max Relative Err"]),
                                                         rel=1e-4, abs=1e-9)
        assert mine.metrics.one_thousandth_ratio == pytest.approx(
            float(row["One Thousandth Err Ratio"]), abs=1e-9)
        assert mine.metrics.euc_distance == pytest.approx(float(row["Euc Distance"]),
                                                          rel=1e-6, abs=1e-12)
    assert compared > 100
    # The perturbed op's matmul diverges in msprobe's numbers too (the op's own output file is
    # a reference to the matmul's bytes at filter_level 1, which msprobe shows as N/A).
    bad = theirs[theirs["Target Data Name"] == f"{PERTURBED_OP}/2_MmKernel/output.0"].iloc[0]
    assert float(bad["One Thousandth Err Ratio"]) < 0.9
