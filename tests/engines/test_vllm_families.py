"""The built-in vLLM conventions on more model families than Llama and Qwen2 (SPEC §9): a
checkpoint of each family dumped under `transformers` (prompts one at a time) and under vLLM
(all at once), `task: tensor` with `save_child`, and `atb-probe compare GOLDEN TARGET` with no
flags finds no divergence with every decoder layer compared element by element. Qwen3 (q_norm
and k_norm inside its attention), Gemma ((1 + weight) norms, an embedding scaled inside the op)
and Qwen2-MoE (a sparse MoE block with a shared expert) each call or name something differently
from Llama.
"""
from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm")

from harness import config  # noqa: E402
from vllm_harness import probe_cli, transformers_golden, vllm_cache, vllm_target  # noqa: E402

from atb_probe.tools.compare import compare_dumps  # noqa: E402

__all__ = ["vllm_cache"]  # fixtures
# A module's setup runs a golden run and a vLLM engine: more than the suite's 600 s on a loaded
# machine.
pytestmark = pytest.mark.timeout(1800)

PROMPTS = 2
TOKENS = 2
RUN = {"prompts": PROMPTS, "tokens": TOKENS}
DUMP = config(task="tensor", save_child=True)
LAYERS = {"qwen3": "Qwen3DecoderLayer", "gemma": "GemmaDecoderLayer",
          "qwen2_moe": "Qwen2MoeDecoderLayer"}


@pytest.fixture(scope="module", params=sorted(LAYERS))
def runs(request, tmp_path_factory, vllm_cache):
    """(family, golden dump, clean vLLM dump) of one family's checkpoint."""
    from atb_probe.tools.demo_model import save_llama
    family = request.param
    model = save_llama(tmp_path_factory.mktemp(f"{family}-model"), family=family)
    g = tmp_path_factory.mktemp(f"{family}-golden")
    g_tokens = transformers_golden(g, model, DUMP, **RUN)
    clean = tmp_path_factory.mktemp(f"{family}-clean")
    assert vllm_target(clean, model, vllm_cache, DUMP, **RUN) == g_tokens
    return family, g / "atb_dump_data", clean / "atb_dump_data"


def test_same_weights_diverge_nowhere_and_every_layer_is_compared(runs, tmp_path):
    family, g_root, t_root = runs
    out = tmp_path / "cmp"
    shown = probe_cli("compare", str(g_root), str(t_root), "-o", str(out), "--no-xlsx")
    assert shown.returncode == 0, shown.stdout + shown.stderr
    assert "conventions: vLLM against transformers (built in)" in shown.stdout, shown.stdout
    summary = json.loads((out / "atb_compare_summary.json").read_text())
    assert summary["diverged"] is False, summary["verdict"]
    assert not summary.get("unjudged"), summary["unjudged"]

    result = compare_dumps(str(g_root), str(t_root))
    layers = [r for r in result.rows if r.layer.endswith("_" + LAYERS[family])
              and r.op_path == r.layer]
    # Every request's every step through both decoder layers, input and output, compared
    # element by element on that request's tokens.
    outputs = {(r.request, r.golden.round_index, r.layer) for r in layers if r.io == "output"}
    assert len(outputs) == PROMPTS * TOKENS * 2, sorted(outputs)
    assert all(r.metrics.cosine is not None and r.metrics.cosine > 0.9999 for r in layers)
    # The modules inside a layer too: its attention and its MLP (or MoE block).
    inside = {r.op_path.split("/")[1].split("_", 1)[1] for r in result.rows
              if r.op_path.count("/") == 1 and r.layer.endswith("_" + LAYERS[family])
              and r.metrics.cosine is not None}
    assert any(name.endswith("Attention") for name in inside), inside
    assert any(name.endswith(("MLP", "MoeBlock", "MoE")) for name in inside), inside
