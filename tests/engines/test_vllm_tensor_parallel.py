"""vLLM with two tensor-parallel workers against its `transformers` golden run of one process
(SPEC §9): the two workers' dumps are one side, each tensor joined from its ranks' pieces before
it is compared. The workers are CPU processes vLLM starts itself, without LOCAL_RANK: each takes
its rank in vLLM's process group as its device ID. The fused projections are column-parallel:
each rank's QKVParallelLinear output holds its slice of q and the key/value head it shares with
the other rank (the model has one), one after the other, and MergedColumnParallelLinear's its
slices of gate and up: compare splits them into their parts before joining. The clean pair
diverges nowhere with every fused projection compared; a perturbed query weight is named at the
fused projection that computes it.
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
pytestmark = pytest.mark.timeout(2400)

RUN = {"prompts": 1, "tokens": 2}
DUMP = config(task="tensor", save_child=True)
PERTURBED = "model.layers.1.self_attn.q_proj.weight"
FUSED = ("QKVParallelLinear", "MergedColumnParallelLinear")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, vllm_cache):
    """(golden dump, clean 2-rank vLLM dump, perturbed 2-rank vLLM dump) of a tiny Llama."""
    from atb_probe.tools.demo_model import save_llama
    model = save_llama(tmp_path_factory.mktemp("model"))
    g = tmp_path_factory.mktemp("golden")
    g_tokens = transformers_golden(g, model, DUMP, **RUN)
    clean = tmp_path_factory.mktemp("clean")
    assert vllm_target(clean, model, vllm_cache, DUMP, tp=2, **RUN) == g_tokens
    bad = tmp_path_factory.mktemp("perturbed")
    vllm_target(bad, perturbed_copy(model, bad / "model", PERTURBED, 0.5), vllm_cache, DUMP,
                tp=2, **RUN)
    return g / "atb_dump_data", clean / "atb_dump_data", bad / "atb_dump_data"


def summary_of(golden_root: Path, target_root: Path, out: Path) -> tuple[dict, str]:
    shown = probe_cli("compare", str(golden_root), str(target_root), "-o", str(out),
                      "--no-xlsx")
    assert shown.returncode == 0, shown.stdout + shown.stderr
    return json.loads((out / "atb_compare_summary.json").read_text()), shown.stdout


def test_each_worker_dumps_under_its_rank(runs):
    _, root, _ = runs
    assert sorted(p.name.split("_")[0] for p in (root / "data").iterdir()) == ["0", "1"]


def test_the_ranks_joined_diverge_nowhere_with_the_fused_projections_compared(runs, tmp_path):
    g_root, t_root, _ = runs
    summary, shown = summary_of(g_root, t_root, tmp_path / "cmp")
    assert "target: 2 ranks joined (tensor parallel)" in shown, shown
    assert summary["diverged"] is False, summary["verdict"]
    assert summary["counts"]["unjudged_ops"] == 0, summary["unjudged"]

    result = compare_dumps(str(g_root), str(t_root), full=True)
    fused = [r for r in result.rows if r.target.data_name.split("/")[-2].endswith(FUSED)
             and r.io == "output"]
    assert {r.target.data_name.split("/")[-2].split("_", 1)[1] for r in fused} == set(FUSED)
    assert all(r.metrics.cosine is not None and r.metrics.cosine > 0.9999 for r in fused), \
        [(r.target.data_name, r.metrics.cosine, r.note) for r in fused]


def test_a_perturbed_query_weight_is_named_at_its_fused_projection(runs, tmp_path):
    g_root, _, t_root = runs
    summary, _ = summary_of(g_root, t_root, tmp_path / "cmp")
    found = summary["first_divergence"]
    assert found is not None, summary["verdict"]
    assert found["target"]["op_path"] == \
        "2_LlamaDecoderLayer/1_LlamaAttention/0_QKVParallelLinear", found
    assert found["inputs"] == "clean", summary["verdict"]
