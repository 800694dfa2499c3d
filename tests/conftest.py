"""Shared fixtures: tiny real models, dumps made in-process or through the load script."""
from __future__ import annotations

import csv
import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import atb_probe
from atb_probe.tools.where import scripts_dir

SCRIPTS = Path(scripts_dir())

# Prefix for the command of a program whose signal handling a test checks: it starts with SIGINT
# and SIGTERM at their defaults, as a program started from a terminal does, however the suite
# was started. A background job (`pytest ... &` in a script), `nohup` or a CI runner may start the
# suite with SIGINT ignored, and every child inherits that: Python installs its KeyboardInterrupt
# handler only when SIGINT is not ignored at start, and the probe its SIGTERM handler only when
# SIGTERM is at its default. (`preexec_fn` would do the same, but is unsafe with threads.)
DEFAULT_SIGNALS = "env --default-signal=INT,TERM"

FULL_CONFIG = {
    "task": "tensor",
    "dump_enable": True,
    "exec_range": "all",
    "ids": "",
    "op_name": "",
    "save_child": False,
    "device": "",
    "filter_level": 1,
}


def config(**overrides) -> dict:
    """A complete config document (no missing-key warnings) with `overrides` applied."""
    doc = dict(FULL_CONFIG)
    doc.update(overrides)
    return doc


def tiny_llama(layers: int = 2, hidden: int = 32, vocab: int = 64, seed: int = 0,
               dtype=torch.float32):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 2,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=128)
    return LlamaForCausalLM(cfg).to(dtype).eval()


def tiny_gpt2(layers: int = 2, hidden: int = 32, vocab: int = 64, seed: int = 0):
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=vocab, n_embd=hidden, n_layer=layers, n_head=4, n_positions=64)
    return GPT2LMHeadModel(cfg).eval()


def generate(model, prompt_len: int = 6, new_tokens: int = 2, seed: int = 0):
    prompt = torch.randint(0, model.config.vocab_size, (1, prompt_len),
                           generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model.generate(prompt, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)


class Root(nn.Module):
    """A root module whose one layer-level op is `op`: `Root(op)(x)` returns `op(x)`."""

    def __init__(self, op: nn.Module):
        super().__init__()
        self.op = op

    def forward(self, *args, **kwargs):
        return self.op(*args, **kwargs)


def dump(tmp: Path, cfg: dict, run) -> Path:
    """Run `run()` with the probe enabled in-process on `cfg`; the atb_dump_data root."""
    atb_probe.enable(str(tmp), cfg)
    try:
        run()
    finally:
        assert atb_probe.disable(timeout=60)
    return tmp / "atb_dump_data"


def dump_first_round(tmp: Path, model, **overrides) -> Path:
    """Dump round 0 (the prompt) of a one-token generation on `config(exec_range="0,0",
    **overrides)`; that round's folder."""
    root = dump(tmp, config(exec_range="0,0", **overrides), lambda: generate(model, 4, 1))
    return only_proc(root) / "0"


def only_proc(root: Path) -> Path:
    """The single `data/<dev>_<pid>` folder of a dump."""
    procs = [p for p in (root / "data").iterdir() if p.is_dir()]
    assert len(procs) == 1, procs
    return procs[0]


def read_csv(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def op_dirs(round_dir: Path) -> list[str]:
    """Every op folder below a round, as paths relative to it, sorted."""
    return sorted(str(p.relative_to(round_dir)) for p in round_dir.rglob("*")
                  if p.is_dir() and p.name not in ("before", "after"))


def run_loaded(tmp: Path, script: str, cfg: dict | None = None, load_args: str | None = None,
               env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run `python script` in `bash -c` after sourcing the load script, like a user would."""
    script_path = tmp / "user_script.py"
    script_path.write_text(textwrap.dedent(script))
    if cfg is not None:
        (tmp / "config.json").write_text(json.dumps(cfg))
    if load_args is None:
        load_args = f"--output={tmp} --config={tmp / 'config.json'}"
    cmd = (f'source "{SCRIPTS}/load_atb_probe.sh" {load_args} && '
           f'"{sys.executable}" "{script_path}"')
    full_env = dict(os.environ)
    for key in ("ATB_OUTPUT_DIR", "ATB_DUMP_CONFIG", "ATB_PROBE_BOOTSTRAP"):
        full_env.pop(key, None)
    full_env.update(env or {})
    return subprocess.run(["bash", "-c", cmd], cwd=tmp, env=full_env, capture_output=True,
                          text=True, timeout=timeout)


def torchrun_loaded(tmp: Path, cfg: dict, script: Path, *args: str, ranks: int = 2) -> str:
    """`torchrun --nproc-per-node <ranks> script args` (CPU) from a shell that sourced the load
    script with `cfg` as config.json; its stdout (the run must succeed)."""
    (tmp / "config.json").write_text(json.dumps(cfg))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = (f'source "{SCRIPTS}/load_atb_probe.sh" --output="{tmp}" --config="{tmp}/config.json"'
           f' && "{torchrun}" --nproc-per-node {ranks} --master-addr 127.0.0.1'
           f' --master-port {port} "{script}" {" ".join(args)}')
    env = {k: v for k, v in os.environ.items()
           if k not in ("ATB_OUTPUT_DIR", "ATB_DUMP_CONFIG", "ATB_PROBE_BOOTSTRAP",
                        "ATB_PROBE_PYTHONPATH_WAS_SET", "LOCAL_RANK", "RANK", "WORLD_SIZE")}
    env["OMP_NUM_THREADS"] = "1"
    result = subprocess.run(["bash", "-c", cmd], cwd=tmp, env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "cannot dump" not in result.stderr, result.stderr
    return result.stdout


MSPROBE_DEFAULT = Path(__file__).resolve().parent.parent / ".venv-msprobe" / "bin" / "msprobe"


def msprobe_executable() -> str | None:
    """mindstudio-probe's `msprobe`, for the interoperability tests: $MSPROBE, else
    `.venv-msprobe/bin/msprobe` in this checkout, else `msprobe` on PATH; None if none runs."""
    for candidate in (os.environ.get("MSPROBE"), str(MSPROBE_DEFAULT), shutil.which("msprobe")):
        if candidate and os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return None


MSPROBE_MISSING = ("mindstudio-probe not found: set MSPROBE to its msprobe executable (default: "
                   ".venv-msprobe/bin/msprobe in this checkout, then PATH)")


def wait_until(condition, timeout: float, what: str, interval: float = 0.01):
    """Poll `condition` until it returns something truthy; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


class LiveProcess:
    """What the tests of a running, probed process share: its config file and its status.
    Subclasses set `config_path` and `status_file`."""

    config_path: Path
    status_file: Path

    def status(self) -> dict:
        return json.loads(self.status_file.read_text())

    def write_config(self, **overrides) -> float:
        """Save config.json the way an editor does (truncate, then write); the time it was saved."""
        with open(self.config_path, "w") as f:
            f.write(json.dumps(config(**overrides), indent=4))
        return time.monotonic()

    def wait_applied(self, timeout: float = 5, **overrides) -> dict:
        """Wait until the status shows `config(**overrides)` in effect; the status."""
        want = config(**overrides)
        return wait_until(lambda: (lambda s: s if s["config_in_effect"] == want else None)(
            self.status()), timeout, f"config {overrides} in effect")


def count_rounds_by_config(rounds: dict, tensor_op: str, stats_op: str) -> dict:
    """For rounds dumped while the config flipped between `ids: tensor_op` with task tensor and
    `ids: stats_op` with task statistics: assert every round holds exactly one op's input and
    output rows, all of that round and all written under one config; count rounds per op."""
    seen = {tensor_op: 0, stats_op: 0}
    for index, folder in rounds.items():
        rows = read_csv(folder / "statistic.csv")
        ops = {r["Op Id"] for r in rows}
        assert ops in ({tensor_op}, {stats_op}), (index, rows)
        op = ops.pop()
        seen[op] += 1
        assert sorted(r["Input/Output"] for r in rows) == ["input", "output"], (index, rows)
        assert {r["Execution Count"] for r in rows} == {str(index)}
        if op == tensor_op:
            assert all(r["Max"] == "N/A" and os.path.isfile(r["Tensor Path"]) for r in rows)
        else:
            assert all(r["Max"] != "N/A" and r["Tensor Path"] == "N/A" for r in rows)
    return seen


LLAMA_SCRIPT = """
import torch
from transformers import LlamaConfig, LlamaForCausalLM
torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
model = LlamaForCausalLM(cfg).eval()
prompt = torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(0))
with torch.no_grad():
    out = model.generate(prompt, max_new_tokens=2, do_sample=False, pad_token_id=0)
print("OK", out.shape[1])
"""


@pytest.fixture(autouse=True)
def _no_probe_leak():
    """Every test starts and ends without a running probe in this process."""
    atb_probe.disable(timeout=60)
    yield
    atb_probe.disable(timeout=60)
