"""vLLM against its `transformers` golden run as users compare them (SPEC §9): the golden runs
each prompt on its own, vLLM runs all of them in one `LLM.generate`, so every vLLM step holds
several requests side by side along its token dimension while each golden round holds one.
`atb-probe compare GOLDEN TARGET` with no flags pairs the two by (request, position) and by the
built-in vLLM conventions; for two model families it finds nothing in the clean pair, with every
decoder layer compared on each request's tokens, and names the decoder layer (and the module
inside it) whose weight was perturbed in the target checkpoint, in tensor and in statistics mode.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from harness import config  # noqa: E402
from vllm_harness import (perturbed_copy, probe_cli, transformers_golden, vllm_cache,  # noqa: E402
                          vllm_target)

from atb_probe.tools.compare import compare_dumps  # noqa: E402

__all__ = ["vllm_cache"]  # fixtures
# A module's setup runs a golden run and two vLLM engines: more than the suite's 600 s on a
# loaded machine.
pytestmark = pytest.mark.timeout(2400)

PROMPTS = 3
TOKENS = 3
RUN = {"prompts": PROMPTS, "tokens": TOKENS}
DUMP = config(task="all", save_child=True)
# Layer 1's MLP output projection: vLLM's `2_<Layer>/3_<MLP>/2_RowParallelLinear`, the golden's
# `3_<Layer>/4_<MLP>/4_Linear` (the golden's rotary embedding is layer-level op 1).
PERTURBED = "model.layers.1.mlp.down_proj.weight"
LAYERS = {"llama": "LlamaDecoderLayer", "qwen2": "Qwen2DecoderLayer"}
MLP = {"llama": "LlamaMLP", "qwen2": "Qwen2MLP"}


@pytest.fixture(scope="module", params=sorted(LAYERS))
def runs(request, tmp_path_factory, vllm_cache):
    """(family, golden dump, clean vLLM dump, perturbed vLLM dump) of one family's checkpoint."""
    from atb_probe.tools.demo_model import save_llama
    family = request.param
    model = save_llama(tmp_path_factory.mktemp(f"{family}-model"), family=family)
    g = tmp_path_factory.mktemp(f"{family}-golden")
    g_tokens = transformers_golden(g, model, DUMP, **RUN)
    clean = tmp_path_factory.mktemp(f"{family}-clean")
    # The same answers, batched or not.
    assert vllm_target(clean, model, vllm_cache, DUMP, **RUN) == g_tokens
    bad = tmp_path_factory.mktemp(f"{family}-perturbed")
    # Noise of half the weight's spread: enough to move the MLP output's norm by several
    # percent, which statistics mode sees.
    vllm_target(bad, perturbed_copy(model, bad / "model", PERTURBED, 0.5), vllm_cache, DUMP,
                **RUN)
    return family, g / "atb_dump_data", clean / "atb_dump_data", bad / "atb_dump_data"


def summary_of(golden_root: Path, target_root: Path, out: Path, *flags: str) -> dict:
    """`atb-probe compare` with no other flags: its JSON summary."""
    shown = probe_cli("compare", str(golden_root), str(target_root), "-o", str(out),
                      "--no-xlsx", *flags)
    assert shown.returncode == 0, shown.stdout + shown.stderr
    assert "conventions: vLLM against transformers (built in)" in shown.stdout, shown.stdout
    return json.loads((out / "atb_compare_summary.json").read_text())


def test_same_weights_batched_differently_diverge_nowhere_and_every_layer_is_compared(
        runs, tmp_path):
    family, g_root, t_root, _ = runs
    summary = summary_of(g_root, t_root, tmp_path / "cmp")
    assert summary["diverged"] is False, summary["verdict"]

    result = compare_dumps(str(g_root), str(t_root), full=True)   # every row's metrics
    layers = [r for r in result.rows if r.layer.endswith("_" + LAYERS[family])
              and r.op_path == r.layer and r.io == "output"]
    # Every request's every step through every decoder layer, compared element by element on
    # that request's tokens of the batched vLLM step.
    steps = {(r.request, r.golden.round_index, r.layer) for r in layers}
    assert len({r.request for r in layers}) == PROMPTS
    assert len(steps) == PROMPTS * TOKENS * 2, sorted(steps)   # a round per new token
    assert all(r.metrics.cosine is not None and r.metrics.cosine > 0.9999 for r in layers)


def test_same_weights_batched_differently_diverge_nowhere_in_statistics_mode(runs, tmp_path):
    _, g_root, t_root, _ = runs
    summary = summary_of(g_root, t_root, tmp_path / "cmp", "--mode", "statistics")
    assert summary["diverged"] is False, summary["verdict"]
    assert summary["counts"]["statistics"] > 0


@pytest.mark.parametrize("mode", ["tensor", "statistics"])
def test_a_perturbed_layer_is_named_with_the_module_inside_it(runs, tmp_path, mode):
    family, g_root, _, t_root = runs
    summary = summary_of(g_root, t_root, tmp_path / "cmp", "--mode", mode)
    found = summary["first_divergence"]
    assert found is not None, summary["verdict"]
    layer, mlp = LAYERS[family], MLP[family]
    assert found["target"]["op_path"].startswith(f"2_{layer}/3_{mlp}"), found
    assert found["golden"]["op_path"].startswith(f"3_{layer}/4_{mlp}"), found
    assert found["inputs"] == "clean", summary["verdict"]
    assert found["target"]["round"] == 0 and found["request"] is not None, found
