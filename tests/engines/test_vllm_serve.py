"""`vllm serve` under the load script, as the user guide walks it (docs/engines.md): the server
starts with the probe sleeping; the user picks the next request's steps from `atb-probe
status`, sends one chat completion over real HTTP, waits for COMPLETE; the dump holds exactly
that request's steps, and the answer is the one the server gives with the probe asleep."""
from __future__ import annotations

import json
import math

import pytest

pytest.importorskip("vllm")

from conftest import read_csv  # noqa: E402
from vllm_harness import (EAGER_LINE, LAYER_OPS, WAKE, Server, answer_tokens,  # noqa: E402
                          layer_ops, model_files, probe_cli, tiny_model, vllm_cache,
                          wait_complete, worker_dir)

__all__ = ["tiny_model", "vllm_cache"]  # fixtures

MAX_TOKENS = 4  # one prefill step, then one decode step per further token


@pytest.mark.parametrize("eager", [True, False], ids=["enforce-eager", "compiled"])
def test_serve_dumps_exactly_the_steps_of_the_next_request(tmp_path, tiny_model, vllm_cache,
                                                          eager):
    server = Server(tmp_path, tiny_model, vllm_cache, eager=eager)
    try:
        server.write_config(dump_enable=False)
        server.wait_ready()
        asleep = server.chat(max_tokens=MAX_TOKENS)
        status = server.status()
        assert status["state"] == "sleeping" and status["rounds_started"] == 0

        # The next request's steps: from the next round number on (rounds count while awake).
        first = server.status()["rounds_started"]
        last = first + MAX_TOKENS - 1
        server.write_config(task="statistics", exec_range=f"{first},{last}")
        server.wait_applied(task="statistics", exec_range=f"{first},{last}")
        body = server.chat(max_tokens=MAX_TOKENS)
        shown = wait_complete(server.root)
        assert "COMPLETE" in shown
    finally:
        server.stop()
    assert answer_tokens(body) == answer_tokens(asleep)
    assert server.lines(WAKE)
    assert len(server.lines(EAGER_LINE)) == (0 if eager else 1)

    root = server.root
    proc = worker_dir(root)
    assert sorted(int(p.name) for p in proc.iterdir()) == list(range(first, last + 1))
    prompt = body["usage"]["prompt_tokens"]
    for index in range(first, last + 1):
        assert layer_ops(proc / str(index)) == LAYER_OPS
        rows = read_csv(proc / str(index) / "statistic.csv")
        assert all(math.isfinite(float(r[k])) for r in rows for k in ("Max", "Min", "Norm"))
        embedding_in = next(r for r in rows if r["Op Id"] == "0" and r["Input/Output"] == "input")
        assert embedding_in["Shape"] == str(prompt if index == first else 1)
    files = model_files(root)
    assert files["LlamaForCausalLM_Prefill.json"]["rounds"] == [[first, first]]
    assert files["LlamaForCausalLM_Decoder.json"]["rounds"] == [[first + 1, last]]
    status = json.loads((root / "status" / f"{proc.name}.json").read_text())
    assert status["rounds_dumped"] == MAX_TOKENS and status["compile_problem"] is None
    scanned = probe_cli("scan", str(root))
    assert scanned.returncode == 0, scanned.stdout + scanned.stderr
    # Stopped after COMPLETE: nothing was lost, whatever vLLM did to its worker.
    after = probe_cli("status", str(root))
    assert after.returncode == 0 and "partial" not in after.stdout, after.stdout
