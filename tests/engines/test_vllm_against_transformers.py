"""vLLM against its `transformers` golden run (SPEC §9, conventions as data): the same
checkpoint dumped under both, one prompt, and `atb-probe compare GOLDEN TARGET` with no flags
pairs vLLM's fused residual, fused projections and logits processor with transformers' modules
through the built-in map, compares every decoder layer element by element, and names a
perturbed MLP weight's layer and module."""
from __future__ import annotations

import re

import pytest

pytest.importorskip("vllm")

from harness import config  # noqa: E402
from vllm_harness import (perturbed_copy, probe_cli, tiny_model, transformers_golden,  # noqa: E402
                          vllm_cache, vllm_target)

from atb_probe.tools.compare import compare_dumps  # noqa: E402

__all__ = ["tiny_model", "vllm_cache"]  # fixtures
# A test's setup runs the golden run and a vLLM engine: more than the suite's 600 s on a loaded
# machine.
pytestmark = pytest.mark.timeout(1800)

DUMP = config(task="tensor", save_child=True)
PERTURBED = "model.layers.1.mlp.down_proj.weight"


@pytest.fixture(scope="module")
def golden_dump(tmp_path_factory, tiny_model):
    tmp = tmp_path_factory.mktemp("golden")
    return tmp / "atb_dump_data", transformers_golden(tmp, tiny_model, DUMP)


@pytest.fixture(scope="module")
def target_dump(tmp_path_factory, tiny_model, vllm_cache):
    tmp = tmp_path_factory.mktemp("target")
    return tmp / "atb_dump_data", vllm_target(tmp, tiny_model, vllm_cache, DUMP)


def decoder_layer_rows(result) -> list:
    return [r for r in result.rows if r.layer.endswith("_LlamaDecoderLayer")
            and r.op_path == r.layer]


def test_same_weights_compare_with_no_flags_finds_no_divergence_in_any_layer(
        golden_dump, target_dump, tmp_path):
    (g_root, g_tokens), (t_root, t_tokens) = golden_dump, target_dump
    assert g_tokens == t_tokens
    shown = probe_cli("compare", str(g_root), str(t_root), "-o", str(tmp_path / "cmp"))
    assert shown.returncode == 0, shown.stdout + shown.stderr
    assert "conventions: vLLM against transformers (built in)" in shown.stdout
    assert "no divergence" in shown.stdout, shown.stdout
    assert "could not be matched" not in shown.stdout, shown.stdout

    result = compare_dumps(str(g_root), str(t_root), full=True)   # every row's metrics
    rounds = {r.round_index for r in result.rows}
    layers = decoder_layer_rows(result)
    # Each round: both layers' input (hidden + residual) and output (the two outputs' sum).
    assert len(layers) == 4 * len(rounds) and len(rounds) == 4
    assert all(r.metrics.cosine is not None and r.metrics.cosine > 0.9999 for r in layers)
    outputs = [r for r in layers if r.io == "output"]
    assert all(r.target.data_name.endswith("/output.0+output.1") for r in outputs)
    names = {r.golden.data_name.split("/", 1)[1] for r in result.rows if r.round_index == 0}
    for inside in ("0_LlamaRMSNorm/output.0", "1_LlamaAttention/output.0",
                   "3_LlamaRMSNorm/output.0", "4_LlamaMLP/output.0", "4_LlamaMLP/4_Linear/output.0",
                   "1_LlamaAttention/0_Linear/cat(q_proj:output.0,k_proj:output.0,v_proj:output.0)",
                   "4_LlamaMLP/0_Linear/cat(gate_proj:output.0,up_proj:output.0)"):
        assert inside in names, inside
    # o_proj: the attention's last Linear (its ID counts the kernels before it).
    assert any(re.fullmatch(r"1_LlamaAttention/\d+_Linear/output\.0", n) for n in names)
    assert all(r.metrics.cosine is not None for r in result.rows if r.target.shape != "1")
    assert not [u for u in result.unmatched if not u.expected]
    assert result.finding is None


def test_a_perturbed_mlp_weight_is_named_with_its_layer_and_module(
        golden_dump, tiny_model, vllm_cache, tmp_path):
    g_root, g_tokens = golden_dump
    model = perturbed_copy(tiny_model, tmp_path / "model", PERTURBED, 0.01)
    tokens = vllm_target(tmp_path, model, vllm_cache, DUMP)
    assert tokens == g_tokens  # a subtle change: the answer is the same
    shown = probe_cli("compare", str(g_root), str(tmp_path / "atb_dump_data"), "-o",
                      str(tmp_path / "cmp"))
    assert shown.returncode == 0, shown.stdout + shown.stderr
    # The two runs lay their tokens out differently (vLLM flat, transformers as a batch), so
    # rounds are paired by tokens and the finding names the request's positions.
    assert "first divergence: round 0 ~ 0 (req 0, pos 0-" in shown.stdout, shown.stdout
    assert "2_LlamaDecoderLayer/3_LlamaMLP/2_RowParallelLinear ↔ " \
           "3_LlamaDecoderLayer/4_LlamaMLP/4_Linear (output.0)" in shown.stdout, shown.stdout
    assert "its inputs match" in shown.stdout
