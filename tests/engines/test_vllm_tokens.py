"""vLLM's steps say which tokens they hold (SPEC §9): tokens.json from the V1 runner's batch,
and request_statistic.csv for the steps that hold several requests."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm")

from conftest import read_csv  # noqa: E402
from harness import config  # noqa: E402
from vllm_harness import offline, tiny_model, vllm_cache, wait_complete, worker_dir  # noqa: E402

from atb_probe.statcsv import REQUEST_COLUMNS  # noqa: E402

__all__ = ["tiny_model", "vllm_cache"]  # fixtures
PROMPTS, NEW_TOKENS = 2, 4


@pytest.fixture(scope="module")
def steps(tmp_path_factory, tiny_model, vllm_cache) -> dict:
    """{round: (its folder, its tokens.json)} of an offline generation of two prompts."""
    tmp = tmp_path_factory.mktemp("tokens")
    (tmp / "config.json").write_text(json.dumps(config(task="statistics")))
    offline(tmp, tiny_model, vllm_cache, eager=True, prompts=PROMPTS, tokens=NEW_TOKENS)
    root = tmp / "atb_dump_data"
    wait_complete(root)
    proc = worker_dir(root)
    return {int(p.name): (p, json.loads((p / "tokens.json").read_text()))
            for p in proc.iterdir()}


def test_each_step_lists_its_requests_along_the_token_dimension(steps):
    for index, (folder, doc) in sorted(steps.items()):
        assert (doc["source"], doc["layout"], doc["rows"]) == ("vllm", "flat", 1), index
        spans = [(r["start"], r["stop"]) for r in doc["requests"]]
        assert spans[0][0] == 0 and all(a[1] == b[0] for a, b in zip(spans, spans[1:])), spans
        assert spans[-1][1] == doc["tokens"], (index, doc)  # no padding on this engine
        embedding = [r for r in read_csv(folder / "statistic.csv")
                     if r["Op Type"] == "VocabParallelEmbedding" and r["Input/Output"] == "input"]
        assert embedding[0]["Shape"] == str(doc["tokens"]), index


def test_prompts_start_at_position_zero_and_decode_steps_follow_them(steps):
    seen: dict[str, list] = {}
    for index, (_, doc) in sorted(steps.items()):
        for r in doc["requests"]:
            seen.setdefault(r["request"], []).append(r)
    assert len(seen) == PROMPTS
    assert steps[0][1]["requests"][0]["position"] == 0
    hashes = set()
    for request, spans in seen.items():
        prefill, decodes = spans[0], spans[1:]
        assert prefill["position"] == 0 and prefill["stop"] - prefill["start"] == \
            prefill["prompt_len"] > 0, prefill
        assert prefill["prompt_head"] == prefill["prompt_head"][:16] and \
            len(prefill["prompt_head"]) == min(16, prefill["prompt_len"])
        assert len(prefill["prompt_hash"]) == 16
        assert [d["position"] for d in decodes] == \
            [prefill["prompt_len"] + k for k in range(len(decodes))], spans
        assert all(d["stop"] - d["start"] == 1 for d in decodes)
        assert {d["prompt_hash"] for d in spans} == {prefill["prompt_hash"]}
        hashes.add(prefill["prompt_hash"])
    assert len(hashes) == PROMPTS


def test_steps_of_several_requests_have_statistics_per_request(steps):
    shared = [(folder, doc) for folder, doc in steps.values() if len(doc["requests"]) > 1]
    assert shared
    for folder, doc in shared:
        rows = read_csv(folder / "request_statistic.csv")
        assert list(rows[0]) == list(REQUEST_COLUMNS)
        spans = {r["request"]: r["stop"] - r["start"] for r in doc["requests"]}
        embedding = [r for r in rows if r["Op Type"] == "VocabParallelEmbedding" and
                     r["Input/Output"] == "output"]
        assert {r["Request"]: int(r["Shape"].split("x")[0]) for r in embedding} == spans
    single = [folder for folder, doc in steps.values() if len(doc["requests"]) == 1]
    assert all(not (folder / "request_statistic.csv").exists() for folder in single)
