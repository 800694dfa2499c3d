"""The comparison numbers and the divergence rule, on arrays with known answers."""
from __future__ import annotations

import numpy as np
import pytest

from atb_probe.layout import Side
from atb_probe.statcsv import Stats
from atb_probe.tools.comparison import MatchMethod, PairMode, PairResult, TensorRef, Thresholds
from atb_probe.tools.divergence import InputState, OpRows, crosses, judge
from atb_probe.tools.metrics import StatsDiff, TensorMetrics, compare_arrays, stats_metrics


def test_identical_arrays_are_exactly_equal():
    a = np.linspace(-3, 5, 64, dtype=np.float32).reshape(8, 8)
    compared = compare_arrays(a, a.copy())
    assert compared.note == ""
    assert compared.metrics == TensorMetrics(cosine=1.0, euc_distance=0.0, max_abs_err=0.0,
                                             max_rel_err=0.0, one_thousandth_ratio=1.0,
                                             five_thousandth_ratio=1.0)


def test_a_one_percent_scale_has_known_errors():
    golden = np.arange(1, 101, dtype=np.float64)
    m = compare_arrays(golden, golden * 1.01).metrics
    assert m.cosine == pytest.approx(1.0)
    assert m.max_rel_err == pytest.approx(0.01)
    assert m.max_abs_err == pytest.approx(1.0)
    assert m.euc_distance == pytest.approx(0.01 * np.linalg.norm(golden))
    assert m.one_thousandth_ratio == 0.0 and m.five_thousandth_ratio == 0.0


def test_ratios_count_the_share_of_elements_within_the_bound():
    golden = np.ones(10, dtype=np.float64)
    target = golden.copy()
    target[:3] += 0.002      # 2‰: outside 1‰, inside 5‰
    target[3] += 0.01        # 1%: outside both
    m = compare_arrays(golden, target).metrics
    assert m.one_thousandth_ratio == pytest.approx(0.6)
    assert m.five_thousandth_ratio == pytest.approx(0.9)


def test_opposite_vectors_have_cosine_minus_one():
    g = np.array([1.0, 2.0, 3.0])
    assert compare_arrays(g, -g).metrics.cosine == pytest.approx(-1.0)


def test_nan_at_the_same_places_is_ignored_and_elsewhere_flagged():
    g = np.array([1.0, np.nan, 3.0, np.inf])
    same = compare_arrays(g, g.copy())
    assert same.note == "" and same.metrics.max_abs_err == 0.0
    t = np.array([1.0, 2.0, np.nan, np.inf])
    elsewhere = compare_arrays(g, t)
    assert elsewhere.note.startswith("nan_mismatch") and elsewhere.metrics.cosine is None


def test_shape_mismatch_gives_no_metrics_and_says_why():
    compared = compare_arrays(np.zeros((2, 3)), np.zeros((3, 2)))
    assert compared.metrics == TensorMetrics() and "shape differs" in compared.note


def test_single_elements_have_no_cosine():
    m = compare_arrays(np.array([2.0]), np.array([2.0])).metrics
    assert m.cosine is None and m.max_abs_err == 0.0


def test_statistics_differences_follow_msprobe():
    m = stats_metrics(Stats(4.0, -2.0, 0.0, 10.0), Stats(5.0, -2.0, 1.0, 9.0))
    assert m.max_diff == 1.0 and m.max_rel_pct == 25.0
    assert m.min_diff == 0.0 and m.min_rel_pct == 0.0
    assert m.mean_diff == 1.0 and m.mean_rel_pct is None   # golden 0
    assert m.norm_diff == -1.0 and m.norm_rel_pct == 10.0


def ref(order=0, io=Side.OUTPUT):
    return TensorRef(data_name="0_Op/output.0", process="0_1", round_index=0, dtype="float",
                     shape="4", stats=None, path=None, order=order, layer="0_Op", io=io)


def row(mode=PairMode.TENSOR, cos=1.0, ratio=1.0, rel_norm=None, g_norm=1.0, t_norm=1.0,
        note="", diverged=None, order=0, io=Side.OUTPUT):
    return PairResult(ref(order, io), ref(order, io), MatchMethod.ID, mode,
                      metrics=TensorMetrics(cosine=cos, one_thousandth_ratio=ratio),
                      diffs=StatsDiff(norm_rel_pct=rel_norm),
                      golden_stats=Stats(1.0, 0.0, 0.5, g_norm),
                      target_stats=Stats(1.0, 0.0, 0.5, t_norm), diverged=diverged, note=note)


def test_default_thresholds_are_those_of_the_issue():
    th = Thresholds()
    assert crosses(row(cos=0.98), th) and crosses(row(ratio=0.89), th)
    assert not crosses(row(cos=0.995, ratio=0.95), th)
    assert crosses(row(cos=None, ratio=None, note="nan_mismatch: x"), th)
    assert crosses(row(cos=None, ratio=None), th) is None
    assert crosses(row(PairMode.STATISTICS, rel_norm=1.5), th)
    assert not crosses(row(PairMode.STATISTICS, rel_norm=0.5), th)
    assert crosses(row(PairMode.STATISTICS, rel_norm=None, g_norm=0.0, t_norm=0.3), th)
    assert crosses(row(PairMode.NO_DATA), th) is None


def test_first_divergence_skips_ops_whose_inputs_already_differ():
    def r(diverged, order, io):
        return row(diverged=diverged, order=order, io=io)

    def op(path, input_diverged, output_diverged, order):
        return OpRows(0, path, path, [r(input_diverged, order, Side.INPUT)],
                      [r(output_diverged, order + 1, Side.OUTPUT)])
    ops = [op("0_A", False, False, 0),
           op("1_B", True, True, 2),        # bad input: not the origin
           op("2_C", False, True, 4)]
    f = judge(ops).finding
    assert f.op_path == "2_C" and f.inputs_clean
    f = judge(ops[:2]).finding
    assert f.op_path == "1_B" and f.inputs == InputState.CROSSING
    assert judge(ops[:1]).finding is None


def test_before_the_first_dumped_op_is_said_only_of_the_first_op_of_a_round():
    def op(path, order, input_diverged=True):
        return OpRows(0, path, path, [row(diverged=input_diverged, order=order, io=Side.INPUT)],
                      [row(diverged=True, order=order + 1, io=Side.OUTPUT)])
    first = judge([op("0_A", 0)]).finding
    assert "before the first dumped op" in first.summary()
    quiet = OpRows(0, "0_Q", "0_Q", [], [row(diverged=False, order=0, io=Side.OUTPUT)])
    later = judge([quiet, op("1_A", 2)]).finding
    assert later.inputs == InputState.CROSSING and not later.first_op
    assert "before the first dumped op" not in later.summary()
    assert "no compared op before it crosses" in later.summary()
    unknown = judge([quiet, op("1_A", 2, input_diverged=None), op("2_B", 4, False)]).finding
    assert unknown.op_path == "1_A" and unknown.inputs == InputState.UNKNOWN
    assert unknown.then_clean.op_path == "2_B"
    assert "the first later crossing op whose inputs all match is round 0, 2_B" \
        in unknown.summary()


def test_chunked_metrics_equal_the_whole_array_definitions():
    """Tensors longer than a chunk give the numbers of the one-pass formulas."""
    rng = np.random.default_rng(0)
    golden = rng.standard_normal(100_003).astype(np.float32)
    golden[::97] = 0.0
    target = (golden * (1 + rng.standard_normal(golden.size) * 1e-3)).astype(np.float32)
    compared = compare_arrays(golden, target)
    m, note, g_stats, t_stats = (compared.metrics, compared.note, compared.golden_stats,
                                 compared.target_stats)
    g, t = golden.astype(np.float64), target.astype(np.float64)
    eps = np.finfo(np.float32).eps
    gw, tw = golden.copy(), target.copy()
    gw[golden == 0] += eps
    tw[golden == 0] += eps
    rel = np.abs((tw - gw) / gw)
    assert note == ""
    assert m.cosine == pytest.approx(np.dot(g, t) / np.linalg.norm(g) / np.linalg.norm(t),
                                     abs=1e-12)
    assert m.euc_distance == pytest.approx(np.linalg.norm(t - g), rel=1e-12)
    assert m.max_abs_err == np.max(np.abs(t - g))
    assert m.max_rel_err == pytest.approx(float(rel.max()), rel=1e-6)
    assert m.one_thousandth_ratio == np.mean(rel < 0.001)
    assert g_stats == pytest.approx((g.max(), g.min(), g.mean(), np.linalg.norm(g)), rel=1e-9)
    assert t_stats.norm == pytest.approx(np.linalg.norm(t), rel=1e-12)


def test_size_one_dimensions_are_ignored_only_when_asked():
    a = np.arange(12, dtype=np.float32)
    loose = compare_arrays(a.reshape(1, 3, 4), a.reshape(3, 4), loose_shapes=True)
    assert loose.note == "" and loose.metrics.max_abs_err == 0.0 and loose.metrics.cosine == 1.0
    strict = compare_arrays(a.reshape(1, 3, 4), a.reshape(3, 4))
    assert strict.metrics == TensorMetrics() and "shape differs" in strict.note
