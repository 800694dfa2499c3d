"""Shared fixtures: tiny real models, dumps made in this process and how to check them, file
systems mounted for one test. (Other processes, and waiting for them: harness.py.)"""
from __future__ import annotations

import csv
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from torch import nn

import atb_probe
from atb_probe.binfile import read_header
from atb_probe.statcsv import COLUMNS
from harness import config, run, wait_until


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


# -- checking a dump, and file systems mounted for one test (the reliability tests) ----------

def bins(root: Path) -> list[Path]:
    """Every .bin file below `root`."""
    return [Path(d) / n for d, _, files in os.walk(root) for n in files if n.endswith(".bin")]


def check_dump(root: Path, temp_files_allowed: bool = False) -> list[dict]:
    """Every .bin parses and holds exactly what its header says; every csv line is whole and
    names a file that is there (or N/A). Returns the csv rows."""
    rows = []
    for d, _, files in os.walk(root):
        for name in files:
            path = Path(d) / name
            if name.endswith(".tmp"):
                assert temp_files_allowed, f"temporary file left behind: {path}"
                continue
            assert not name.startswith("."), path
            if name.endswith(".bin"):
                header = read_header(path)  # raises on a partial file
                assert header.payload_offset + header.nbytes == path.stat().st_size
            if name == "statistic.csv":
                with open(path, newline="") as f:
                    lines = f.read().split("\n")
                assert lines[-1] == "", f"{path} ends in a partial line"
                table = list(csv.reader(lines[:-1]))
                assert table[0] == list(COLUMNS)
                assert all(len(r) == len(COLUMNS) for r in table[1:]), path
                rows += [dict(zip(COLUMNS, r)) for r in table[1:]]
    for r in rows:
        if r["Tensor Path"] != "N/A":
            assert Path(r["Tensor Path"]).is_file(), r["Tensor Path"]
    return rows


def probe_lines(err: str, level: str) -> list[str]:
    """The probe's lines of `level` (ERROR, WARNING) in a process's stderr."""
    return [line for line in err.splitlines() if line.startswith(f"[atb-probe] {level}")]


def _fd_target(fd: str) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return ""


class Mounted:
    """A file system mounted for one test."""

    def __init__(self, path: Path, source: str, fstype: str, options: str):
        self.path, self.source, self.fstype, self.options = path, source, fstype, options

    def mount(self) -> None:
        done = run(["mount", "-t", self.fstype, "-o", self.options, self.source, self.path],
                   timeout=60)
        if done.returncode:
            pytest.skip(f"cannot mount a {self.fstype} here: {done.stderr.strip()}")

    def umount(self) -> None:
        if run(["umount", self.path], timeout=60).returncode:
            run(["umount", "-l", self.path], timeout=60)  # never leave a mount behind

    def remount(self) -> None:
        """Unmount and mount again: what is on disk, as the next reader sees it."""
        tries = []

        def unmounted() -> bool:  # a descriptor closed a moment ago may still be on its way out
            tries.append(run(["umount", self.path], timeout=60))
            return tries[-1].returncode == 0

        try:
            wait_until(unmounted, 5, f"{self.path} to unmount", interval=0.1)
        except pytest.fail.Exception:
            held = [p for p in map(_fd_target, os.listdir("/proc/self/fd"))
                    if p.startswith(str(self.path))]
            pytest.fail(f"{self.path} still in use: {tries[-1].stderr.strip()}; held here: {held}")
        self.mount()

    def read_only(self) -> None:
        """Remount read-only, in the first moment no file is open for writing there."""
        wait_until(lambda: run(["mount", "-o", "remount,ro", self.path], timeout=60)
                   .returncode == 0, 60, f"{self.path} to remount read-only", interval=0)


@pytest.fixture
def mount_fs():
    """`mount_fs("tmpfs", "size=8m")` or `mount_fs("ext4", size_mb=64)`: a fresh mount.

    Mounted outside pytest's own temporary tree, whose clean-up (by any later pytest run on the
    machine) must never walk into, or be blocked by, a mounted file system."""
    base = Path(tempfile.mkdtemp(prefix="atb-probe-mounts-"))
    mounts: list[Mounted] = []

    def make(fstype: str = "tmpfs", options: str = "size=8m", size_mb: int = 64) -> Mounted:
        path = base / f"mnt{len(mounts)}"
        path.mkdir()
        if fstype == "tmpfs":
            fs = Mounted(path, "tmpfs", "tmpfs", options)
        else:
            if shutil.which("mkfs.ext4") is None:
                pytest.skip("mkfs.ext4 is not installed")
            image = base / f"disk{len(mounts)}.img"
            with open(image, "wb") as f:
                f.truncate(size_mb * 1024 * 1024)
            done = run(["mkfs.ext4", "-q", "-F", image], timeout=60)
            if done.returncode:
                pytest.skip(f"mkfs.ext4 failed: {done.stderr.strip()}")
            fs = Mounted(path, str(image), "ext4", "loop")
        fs.mount()
        mounts.append(fs)
        return fs

    try:
        yield make
    finally:
        for fs in mounts:
            fs.umount()
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(autouse=True)
def _no_probe_leak():
    """Every test starts and ends without a running probe in this process."""
    atb_probe.disable(timeout=60)
    yield
    atb_probe.disable(timeout=60)
