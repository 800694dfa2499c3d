"""vLLM's offline `LLM.generate` through the load script (SPEC §8): every engine step is one
round holding the model's layers, the logits processor and the sampler; phases from the batch;
the compiled model dumped eagerly; the answers unchanged."""
from __future__ import annotations

import json
import math

import pytest

pytest.importorskip("vllm")

from conftest import read_csv  # noqa: E402
from harness import config  # noqa: E402
from vllm_harness import (EAGER_LINE, LAYER_OPS, layer_ops, model_files, offline,  # noqa: E402
                          probe_cli, tiny_model, vllm_cache, wait_complete, worker_dir)

__all__ = ["tiny_model", "vllm_cache"]  # fixtures


@pytest.fixture(scope="module")
def unprobed(tmp_path_factory, tiny_model, vllm_cache):
    """The token ids vLLM generates in eager mode without the probe."""
    tmp = tmp_path_factory.mktemp("unprobed")
    tokens, _ = offline(tmp, tiny_model, vllm_cache, eager=True, probe=False)
    return tokens


def rounds_of(proc) -> list[int]:
    return sorted(int(p.name) for p in proc.iterdir())


def test_every_engine_step_is_one_round_with_logits_and_sampler(tmp_path, tiny_model,
                                                                 vllm_cache, unprobed):
    (tmp_path / "config.json").write_text(json.dumps(config(task="statistics")))
    tokens, err = offline(tmp_path, tiny_model, vllm_cache, eager=True)
    assert tokens == unprobed
    root = tmp_path / "atb_dump_data"
    wait_complete(root)
    proc = worker_dir(root)
    rounds = rounds_of(proc)
    # 2 prompts x 4 tokens: one step per new token, the second prompt's prefill maybe with the
    # first's decode; warm-up and profiling runs are not rounds.
    assert rounds == list(range(len(rounds))) and 4 <= len(rounds) <= 5, rounds
    for index in rounds:
        assert layer_ops(proc / str(index)) == LAYER_OPS, index
        rows = read_csv(proc / str(index) / "statistic.csv")
        assert {r["Execution Count"] for r in rows} == {str(index)}
        assert all(math.isfinite(float(r[k])) for r in rows for k in ("Max", "Min", "Norm"))
    files = model_files(root)
    assert files["LlamaForCausalLM_Prefill.json"]["rounds"][0][0] == 0
    decoder = files["LlamaForCausalLM_Decoder.json"]["rounds"]
    assert decoder[-1][1] == rounds[-1]
    assert [n["opType"] for n in files["LlamaForCausalLM_Decoder.json"]["nodes"]] == LAYER_OPS
    status = json.loads(next((root / "status").glob(f"{proc.name}.json")).read_text())
    assert status["rounds_dumped"] == status["rounds_started"] == len(rounds)
    assert status["compile_problem"] is None
    scanned = probe_cli("scan", str(root))
    assert scanned.returncode == 0, scanned.stdout + scanned.stderr


def test_compiled_vllm_dumps_its_steps_eagerly_and_leaves_the_others_compiled(
        tmp_path, tiny_model, vllm_cache, unprobed):
    (tmp_path / "config.json").write_text(json.dumps(config(task="statistics",
                                                            exec_range="1,2")))
    tokens, err = offline(tmp_path, tiny_model, vllm_cache, eager=False)
    assert tokens == unprobed  # the dumped steps' tokens are those of vLLM's eager run
    assert sum(EAGER_LINE in line for line in err.splitlines()) == 1, err[-3000:]
    root = tmp_path / "atb_dump_data"
    wait_complete(root)
    proc = worker_dir(root)
    assert rounds_of(proc) == [1, 2]
    for index in (1, 2):
        assert layer_ops(proc / str(index)) == LAYER_OPS
    status = json.loads((root / "status" / f"{proc.name}.json").read_text())
    assert status["rounds_dumped"] == 2 and status["rounds_started"] >= 4
    assert status["compile_problem"] is None


def test_a_save_child_step_records_written_arguments_and_scans_clean(tmp_path, tiny_model,
                                                                     vllm_cache, unprobed):
    (tmp_path / "config.json").write_text(json.dumps(config(
        task="all", exec_range="1,1", save_child=True)))
    tokens, _ = offline(tmp_path, tiny_model, vllm_cache, eager=True)
    assert tokens == unprobed
    root = tmp_path / "atb_dump_data"
    wait_complete(root)
    step = worker_dir(root) / "1"
    params = {p.parent.relative_to(step): json.loads(p.read_text())
              for p in step.rglob("op_param.json")}
    # Kernels that write into an argument (vLLM's attention writes `output`, its rotary
    # embedding rotates query and key in place): what they wrote is an output, after the kernel.
    writers = {rel: doc for rel, doc in params.items() if doc.get("written")}
    assert writers, sorted(map(str, params))[:40]
    rows = read_csv(step / "statistic.csv")
    for rel, doc in writers.items():
        op_id = "_".join(part.split("_", 1)[0] for part in rel.parts)
        outputs = [r for r in rows if r["Op Id"] == op_id and r["Input/Output"] == "output"]
        assert len(outputs) == len(doc["outputs"]) and set(doc["written"]) <= set(doc["outputs"])
        for name in doc["written"]:
            assert (step / rel / "after" / f"{name}.bin").is_file(), (rel, name)
    scanned = probe_cli("scan", str(root))
    assert scanned.returncode == 0, scanned.stdout + scanned.stderr


def test_a_weight_loaded_into_the_running_engine_gets_new_statistics(tmp_path, tiny_model,
                                                                    vllm_cache):
    """New weights pushed into a running engine through `load_weights`: vLLM's embedding loader
    writes through `param[:n].data`, behind the weight's version counter. The steps after the
    load must show the new weight, not the statistics kept from before (SPEC §5)."""
    (tmp_path / "config.json").write_text(json.dumps(config(task="statistics", save_child=True)))
    offline(tmp_path, tiny_model, vllm_cache, eager=True, prompts=1, tokens=2, reload_scale=4.0)
    root = tmp_path / "atb_dump_data"
    wait_complete(root)
    proc = worker_dir(root)
    rounds = rounds_of(proc)
    assert len(rounds) == 4, rounds   # a prefill and a decode step before the load, and after

    def embedding_max(index: int) -> float:
        rows = [r for r in read_csv(proc / str(index) / "statistic.csv")
                if r["Op Type"] == "EmbeddingKernel" and r["Input/Output"] == "input" and
                r["Index"] == "0"]
        assert len(rows) == 1, rows
        return float(rows[0]["Max"])

    before, after = [embedding_max(i) for i in rounds[:2]], [embedding_max(i) for i in rounds[2:]]
    assert before[0] == before[1] and after[0] == after[1]
    assert after[0] == pytest.approx(4.0 * before[0], rel=1e-6)
