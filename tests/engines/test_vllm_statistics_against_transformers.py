"""vLLM against its `transformers` golden run in statistics mode at layer level, the cheapest
dump users take first (SPEC §9): `task: statistics`, no `save_child`, so only the decoder layers
and the modules beside them are dumped. vLLM's decoder layer returns the residual stream in two
halves whose sum is the golden's one output; the norm of a sum is not known from its halves',
so the probe measures the sum itself (derived_statistic.csv) and compare judges every decoder
layer with it. The golden runs each prompt on its own, vLLM all of them in one batch.
"""
from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from harness import config  # noqa: E402
from vllm_harness import (perturbed_copy, probe_cli, transformers_golden, vllm_cache,  # noqa: E402
                          vllm_target, worker_dir)

from atb_probe.tools.compare import compare_dumps  # noqa: E402

__all__ = ["vllm_cache"]  # fixtures
pytestmark = pytest.mark.timeout(2400)

PROMPTS = 3
TOKENS = 3
RUN = {"prompts": PROMPTS, "tokens": TOKENS}
DUMP = config(task="statistics", save_child=False)
LAYER = "LlamaDecoderLayer"
# Layer 1's MLP output projection. vLLM's layer 1 is layer-level op 2 (after the embedding),
# the golden's op 3 (its rotary embedding is layer-level op 1).
PERTURBED = "model.layers.1.mlp.down_proj.weight"


@pytest.fixture(scope="module")
def runs(tmp_path_factory, vllm_cache):
    """(golden dump, clean vLLM dump, perturbed vLLM dump) of a tiny Llama."""
    from atb_probe.tools.demo_model import save_llama
    model = save_llama(tmp_path_factory.mktemp("model"))
    g = tmp_path_factory.mktemp("golden")
    g_tokens = transformers_golden(g, model, DUMP, **RUN)
    clean = tmp_path_factory.mktemp("clean")
    assert vllm_target(clean, model, vllm_cache, DUMP, **RUN) == g_tokens
    bad = tmp_path_factory.mktemp("perturbed")
    # Noise of twice the weight's spread: layer 1's output (its residual stream) moves past
    # statistics mode's thresholds.
    vllm_target(bad, perturbed_copy(model, bad / "model", PERTURBED, 2.0), vllm_cache, DUMP,
                **RUN)
    return g / "atb_dump_data", clean / "atb_dump_data", bad / "atb_dump_data"


def summary_of(golden_root: Path, target_root: Path, out: Path) -> dict:
    """`atb-probe compare` with no flags: its JSON summary."""
    shown = probe_cli("compare", str(golden_root), str(target_root), "-o", str(out),
                      "--no-xlsx")
    assert shown.returncode == 0, shown.stdout + shown.stderr
    return json.loads((out / "atb_compare_summary.json").read_text())


def test_the_probe_measures_the_sum_of_a_decoder_layers_halves(runs):
    _, root, _ = runs
    # The step that holds every request (vLLM's first step may take only the first one).
    batched = next(r for r in sorted(worker_dir(root).iterdir(), key=lambda p: int(p.name))
                   if len(json.loads((r / "tokens.json").read_text())["requests"]) == PROMPTS)
    with open(batched / "derived_statistic.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    # Two decoder layers: the first's outputs, the second's inputs (the first gets no residual)
    # and outputs; the final norm's inputs. Each over the whole step and over each of the three
    # requests' tokens.
    sides = [(r["Op Name"], r["Op Id"], r["Input/Output"], r["Index"]) for r in rows
             if not r["Request"]]
    assert sides == [(LAYER, "1", "output", "0+1"), (LAYER, "2", "input", "1+2"),
                     (LAYER, "2", "output", "0+1"), ("RMSNorm", "3", "input", "0+1")], sides
    assert len(rows) == len(sides) * (1 + PROMPTS)
    assert all(float(r["Norm"]) > 0 for r in rows)


def test_same_weights_diverge_nowhere_and_every_decoder_layer_is_judged(runs, tmp_path):
    g_root, t_root, _ = runs
    summary = summary_of(g_root, t_root, tmp_path / "cmp")
    assert summary["diverged"] is False, summary["verdict"]
    # Every paired op judged, the logits of a step's several requests (a row each) included.
    assert summary["counts"]["unjudged_ops"] == 0, summary["unjudged"]

    result = compare_dumps(str(g_root), str(t_root), mode="statistics")
    outputs = [r for r in result.rows if r.layer.endswith("_" + LAYER) and r.op_path == r.layer
               and r.io == "output"]
    # Every request's every step through both decoder layers, judged on statistics.
    assert len({(r.request, r.golden.round_index, r.layer) for r in outputs}) == \
        PROMPTS * TOKENS * 2
    assert all(r.mode == "statistics" and r.diverged is False for r in outputs), \
        [(r.mode, r.note) for r in outputs if r.diverged is not False]


def test_a_perturbed_decoder_layer_is_named(runs, tmp_path):
    g_root, _, t_root = runs
    summary = summary_of(g_root, t_root, tmp_path / "cmp")
    found = summary["first_divergence"]
    assert found is not None, summary["verdict"]
    assert found["target"]["op_path"] == f"2_{LAYER}", found
    assert found["golden"]["op_path"] == f"3_{LAYER}", found
    assert found["inputs"] == "clean", summary["verdict"]
    assert found["target"]["round"] == 0 and found["request"] is not None, found
