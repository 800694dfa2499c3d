"""The comparison numbers and the divergence rule, on arrays with known answers."""
from __future__ import annotations

import numpy as np
import pytest

from atb_probe.tools.divergence import Thresholds, crosses, first_divergence
from atb_probe.tools.metrics import stats_metrics, tensor_metrics


def test_identical_arrays_are_exactly_equal():
    a = np.linspace(-3, 5, 64, dtype=np.float32).reshape(8, 8)
    m, note = tensor_metrics(a, a.copy())
    assert note == ""
    assert m == {"Cosine": 1.0, "Euc Distance": 0.0, "Max Absolute Err": 0.0,
                 "Max Relative Err": 0.0, "One Thousandth Err Ratio": 1.0,
                 "Five Thousandth Err Ratio": 1.0}


def test_a_one_percent_scale_has_known_errors():
    golden = np.arange(1, 101, dtype=np.float64)
    m, _ = tensor_metrics(golden, golden * 1.01)
    assert m["Cosine"] == pytest.approx(1.0)
    assert m["Max Relative Err"] == pytest.approx(0.01)
    assert m["Max Absolute Err"] == pytest.approx(1.0)
    assert m["Euc Distance"] == pytest.approx(0.01 * np.linalg.norm(golden))
    assert m["One Thousandth Err Ratio"] == 0.0 and m["Five Thousandth Err Ratio"] == 0.0


def test_ratios_count_the_share_of_elements_within_the_bound():
    golden = np.ones(10, dtype=np.float64)
    target = golden.copy()
    target[:3] += 0.002      # 2‰: outside 1‰, inside 5‰
    target[3] += 0.01        # 1%: outside both
    m, _ = tensor_metrics(golden, target)
    assert m["One Thousandth Err Ratio"] == pytest.approx(0.6)
    assert m["Five Thousandth Err Ratio"] == pytest.approx(0.9)


def test_opposite_vectors_have_cosine_minus_one():
    g = np.array([1.0, 2.0, 3.0])
    assert tensor_metrics(g, -g)[0]["Cosine"] == pytest.approx(-1.0)


def test_nan_at_the_same_places_is_ignored_and_elsewhere_flagged():
    g = np.array([1.0, np.nan, 3.0, np.inf])
    m, note = tensor_metrics(g, g.copy())
    assert note == "" and m["Max Absolute Err"] == 0.0
    t = np.array([1.0, 2.0, np.nan, np.inf])
    m, note = tensor_metrics(g, t)
    assert note.startswith("nan_mismatch") and m["Cosine"] is None


def test_shape_mismatch_gives_no_metrics_and_says_why():
    m, note = tensor_metrics(np.zeros((2, 3)), np.zeros((3, 2)))
    assert set(m.values()) == {None} and "shape differs" in note


def test_single_elements_have_no_cosine():
    m, _ = tensor_metrics(np.array([2.0]), np.array([2.0]))
    assert m["Cosine"] is None and m["Max Absolute Err"] == 0.0


def test_statistics_differences_follow_msprobe():
    m = stats_metrics((4.0, -2.0, 0.0, 10.0), (5.0, -2.0, 1.0, 9.0))
    assert m["Max Diff"] == 1.0 and m["Relative Err of Max(%)"] == 25.0
    assert m["Min Diff"] == 0.0 and m["Relative Err of Min(%)"] == 0.0
    assert m["Mean Diff"] == 1.0 and m["Relative Err of Mean(%)"] is None   # golden 0
    assert m["Norm Diff"] == -1.0 and m["Relative Err of Norm(%)"] == 10.0


def row(mode="tensor", cos=1.0, ratio=1.0, rel_norm=None, g_norm=1.0, t_norm=1.0, note=""):
    return {"Compare Mode": mode, "Cosine": cos, "One Thousandth Err Ratio": ratio,
            "Relative Err of Norm(%)": rel_norm, "Golden Norm": g_norm, "Target Norm": t_norm,
            "Note": note}


def test_default_thresholds_are_those_of_the_issue():
    th = Thresholds()
    assert crosses(row(cos=0.98), th) and crosses(row(ratio=0.89), th)
    assert not crosses(row(cos=0.995, ratio=0.95), th)
    assert crosses(row(cos=None, ratio=None, note="nan_mismatch: x"), th)
    assert crosses(row(cos=None, ratio=None), th) is None
    assert crosses(row("statistics", rel_norm=1.5), th)
    assert not crosses(row("statistics", rel_norm=0.5), th)
    assert crosses(row("statistics", rel_norm=None, g_norm=0.0, t_norm=0.3), th)
    assert crosses(row("no data"), th) is None


def test_first_divergence_skips_ops_whose_inputs_already_differ():
    def r(diverged, order):
        return {"Diverged": diverged, "Order": order}
    ops = [
        (0, "0_A", "0_A", [r("no", 0)], [r("no", 1)]),
        (0, "1_B", "1_B", [r("yes", 2)], [r("yes", 3)]),   # bad input: not the origin
        (0, "2_C", "2_C", [r("no", 4)], [r("yes", 5)]),
    ]
    f = first_divergence(ops, Thresholds())
    assert f.op_path == "2_C" and f.inputs_clean
    f = first_divergence(ops[:2], Thresholds())
    assert f.op_path == "1_B" and not f.inputs_clean
    assert first_divergence(ops[:1], Thresholds()) is None
