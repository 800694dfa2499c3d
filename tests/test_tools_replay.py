"""`atb-probe replay` on real dumps of a tiny Llama: one whose `aten::mm` is wrong for one call
(its CPU kernel overridden through `torch.library`), its clean fp32 golden, a plain bf16 run;
and small dumps of what cannot be replayed."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from atb_probe.tools.replay import Bound, judge

from conftest import Root, dump
from harness import cli, clean_env, config, run_loaded

# layers[1].self_attn.v_proj's matrix product in the prompt round
CULPRIT_ID = "3_1_6_2"
CULPRIT = "3_LlamaDecoderLayer/1_LlamaAttention/6_Linear/2_MmKernel"
AFTER_CULPRIT = "3_LlamaDecoderLayer/1_LlamaAttention/6_Linear/3_UnsafeViewKernel"

# The kernel made wrong: `aten::mm` on the CPU, through the same structured kernel as always
# (`mm.out`), but 10% too large for the 4th product with a (32, 16) matrix: the k, v, k, v
# projections of the two layers, so layer 1's v_proj only.
FAULT = """
_calls = [0]
def _mm(a, b):
    out = a.new_empty((a.shape[0], b.shape[1]))
    torch.ops.aten.mm.out(a, b, out=out)
    if tuple(b.shape) == (32, 16):
        _calls[0] += 1
        if _calls[0] == 4:
            out.mul_(1.1)
    return out
_lib = torch.library.Library("aten", "IMPL")
_lib.impl("mm", _mm, "CPU")
"""

LLAMA = """
import torch
from transformers import LlamaConfig, LlamaForCausalLM
{fault}
torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
model = LlamaForCausalLM(cfg).to(torch.{dtype}).eval()
prompt = torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(0))
with torch.no_grad():
    model.generate(prompt, max_new_tokens=1, do_sample=False, pad_token_id=0)
print("OK")
"""


def llama_run(tmp_path_factory, name: str, dtype: str = "float32", fault: bool = False) -> Path:
    tmp = tmp_path_factory.mktemp(name)
    script = LLAMA.format(fault=FAULT if fault else "", dtype=dtype)
    result = run_loaded(tmp, script, config(task="tensor", save_child=True))
    assert result.returncode == 0 and "OK" in result.stdout, result.stdout + result.stderr
    return tmp


@pytest.fixture(scope="module")
def golden(tmp_path_factory):
    return llama_run(tmp_path_factory, "golden")


@pytest.fixture(scope="module")
def faulty(tmp_path_factory):
    return llama_run(tmp_path_factory, "faulty", fault=True)


@pytest.fixture(scope="module")
def bf16(tmp_path_factory):
    return llama_run(tmp_path_factory, "bf16", dtype="bfloat16")


def replay(*args, env=None):
    return cli("replay", *map(str, args), env=env)


def results(path: Path) -> dict:
    """The --json records by op path."""
    return {r["op_path"]: r for r in json.loads(path.read_text())}


def test_until_culprit_without_golden_names_the_wrong_kernel(faulty):
    out = replay(faulty, "--until-culprit", "-j", "1")
    assert out.returncode == 1, out.stdout + out.stderr
    culprit = [line for line in out.stdout.splitlines() if line.startswith("culprit:")]
    assert len(culprit) == 1, out.stdout
    assert f"introduced here: round 0, {CULPRIT_ID} ({CULPRIT}) aten.mm.default" in culprit[0]
    assert "bound" in culprit[0]


def test_with_the_golden_only_the_wrong_kernel_introduced_and_later_ones_inherited(
        faulty, golden, tmp_path):
    out = replay(faulty, "--golden", golden, "-j", "1", "--json", tmp_path / "r.json")
    assert out.returncode == 1, out.stdout + out.stderr
    found = results(tmp_path / "r.json")
    introduced = [p for p, r in found.items() if r["verdict"] == "introduced here"]
    assert introduced == [CULPRIT]
    culprit = found[CULPRIT]
    assert culprit["outputs"][0]["total_crossing"] is True
    assert not any(i["crossing"] for i in culprit["inherited"])
    after = found[AFTER_CULPRIT]
    assert after["verdict"] == "inherited"
    assert after["carrier"].startswith("intensor0 (self)")
    # Everything before the culprit matches the golden.
    order = list(found)
    assert all(found[p]["verdict"] == "within its dtype" for p in order[:order.index(CULPRIT)])


def test_until_culprit_with_golden_starts_at_compares_divergence_in_parallel_jobs(faulty,
                                                                                  golden):
    out = replay(faulty, "--golden", golden, "--until-culprit", "-j", "2")
    assert out.returncode == 1, out.stdout + out.stderr
    assert f"from compare's first divergence: round 0, {CULPRIT}" in out.stdout
    assert f"culprit: introduced here: round 0, {CULPRIT_ID} ({CULPRIT})" in out.stdout


def test_a_plain_bf16_run_introduces_nothing(bf16, tmp_path):
    out = replay(bf16, "--until-culprit", "-j", "1")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "no culprit" in out.stdout
    out = replay(bf16, "-j", "1", "--json", tmp_path / "r.json")
    assert out.returncode == 0, out.stdout + out.stderr
    found = results(tmp_path / "r.json")
    assert {r["verdict"] for r in found.values()} == {"within its dtype"}
    # Nothing is left out: the attention (no dropout) and the clones are replayed too.
    assert any(r["op"].startswith("aten._scaled_dot_product") for r in found.values())


def test_one_kernel_is_selected_by_id_or_path(faulty, tmp_path):
    for op in (CULPRIT_ID, CULPRIT):
        out = replay(faulty, op, "-j", "1", "--device", "cpu", "--json", tmp_path / "r.json")
        assert out.returncode == 1, out.stdout + out.stderr
        found = results(tmp_path / "r.json")
        assert list(found) == [CULPRIT]
        # The rerun on the device (here the CPU again) is 10% off the recorded product too.
        assert found[CULPRIT]["outputs"][0]["device_metrics"]["max_rel_err"] > 0.09
    out = replay(faulty, "3_1_6", "-j", "1", "--json", tmp_path / "r.json")
    assert "3_1_6 is a module op" in out.stdout and "the 4 kernel(s) below it" in out.stdout
    assert list(results(tmp_path / "r.json")) == [
        f"3_LlamaDecoderLayer/1_LlamaAttention/6_Linear/{k}"
        for k in ("0_TKernel", "1_ViewKernel", "2_MmKernel", "3_UnsafeViewKernel")]
    out = replay(faulty, "9_9_9")
    assert out.returncode == 2 and "no kernel of TARGET" in out.stderr


def _torch_only_env() -> dict:
    """An environment where Python finds torch and numpy (its site-packages, without the .pth
    files that make atb_probe importable) and nothing of atb_probe."""
    return clean_env(PYTHONPATH=sysconfig.get_paths()["purelib"])


def test_export_gives_a_reproducer_that_needs_only_torch_and_numpy(faulty, golden, tmp_path):
    folder = tmp_path / "repro_mm"
    out = replay(faulty, CULPRIT_ID, "--golden", golden, "--export", folder)
    assert out.returncode == 1, out.stdout + out.stderr
    call = json.loads((folder / "call.json").read_text())
    assert call["op"] == "aten.mm.default"
    assert sorted(p.name for p in (folder / "inputs").iterdir()) == ["intensor0.npy",
                                                                     "intensor1.npy"]
    assert (folder / "outputs" / "outtensor0.npy").is_file()
    assert (folder / "golden" / "outtensor0.npy").is_file()
    env = _torch_only_env()
    isolated = [sys.executable, "-S"]
    probe = subprocess.run(isolated + ["-c", "import atb_probe"], env=env, cwd=tmp_path,
                           capture_output=True, text=True)
    assert probe.returncode != 0, "atb_probe must not be importable here"
    ran = subprocess.run(isolated + [str(folder / "repro.py"), "--device", "cpu"], env=env,
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    lines = {line.split(":")[0].strip(): line for line in ran.stdout.splitlines()}
    # The recorded product is 10% off: against the rerun, float64 and the golden alike.
    for label in ("recorded vs cpu (float32)", "recorded vs float64 on cpu",
                  "golden vs recorded"):
        assert label in lines, ran.stdout
        rel = float(lines[label].split("max rel err ")[1].split(",")[0])
        assert 0.09 < rel < 0.11, lines[label]
    assert "max rel err 0," in lines["cpu (float32) vs float64 on cpu"] or \
        float(lines["cpu (float32) vs float64 on cpu"].split("max rel err ")[1]
              .split(",")[0]) < 1e-3


def test_until_culprit_exports_the_culprit(faulty, tmp_path):
    out = replay(faulty, "--until-culprit", "-j", "1", "--export", tmp_path / "x")
    assert out.returncode == 1, out.stdout + out.stderr
    assert json.loads((tmp_path / "x" / "call.json").read_text())["op"] == "aten.mm.default"


# -- what cannot be replayed says why ---------------------------------------------------------

class Noisy(nn.Module):
    """A random op, an allocation, and plain arithmetic."""

    def forward(self, x):
        y = torch.nn.functional.dropout(x, 0.5, training=True)
        z = x.new_empty(x.shape)
        z.copy_(x)
        return y + z * 2


def small_dump(tmp: Path, **cfg) -> Path:
    settings = dict(task="tensor", save_child=True)
    settings.update(cfg)
    return dump(tmp, config(**settings), lambda: Root(Noisy())(torch.randn(4, 8)))


def verdicts(path: Path) -> dict:
    """op -> (verdict, reason) of the --json records."""
    return {r["op"]: (r["verdict"], r.get("reason", ""), r.get("detail", ""))
            for r in json.loads(path.read_text())}


def test_random_ops_and_allocations_are_reported_not_replayed(tmp_path):
    root = small_dump(tmp_path / "d")
    out = replay(root, "-j", "1", "--json", tmp_path / "r.json")
    assert out.returncode == 0, out.stdout + out.stderr
    found = verdicts(tmp_path / "r.json")
    random_op = next(op for op in found if "dropout" in op or "bernoulli" in op)
    assert found[random_op][:2] == ("not replayed", "random op")
    assert found["aten.new_empty.default"][:2] == ("not replayed", "uninitialized output")
    assert found["aten.copy_.default"][0] == "within its dtype"
    assert found["aten.mul.Tensor"][0] == "within its dtype"
    assert "not replayed:" in out.stdout and "random op" in out.stdout


def test_filter_level_1_references_are_followed(tmp_path):
    root = small_dump(tmp_path / "d", filter_level=1)
    refs = [p for p in Path(root).rglob("*.bin") if b"data=" in p.read_bytes()[:300]
            and b"$Object.Count=0" in p.read_bytes()[:300]]
    assert refs, "the dump should hold reference files"
    replay(root, "-j", "1", "--json", tmp_path / "r.json")
    found = verdicts(tmp_path / "r.json")
    assert found["aten.add.Tensor"][0] == "within its dtype"


def test_header_only_and_statistics_dumps_say_why(tmp_path):
    root = small_dump(tmp_path / "h", filter_level=2)
    replay(root, "-j", "1", "--json", tmp_path / "h.json")
    found = verdicts(tmp_path / "h.json")
    assert found["aten.mul.Tensor"][:2] == ("not replayed", "input without data")
    assert "header-only" in found["aten.mul.Tensor"][2]
    root = small_dump(tmp_path / "s", task="statistics")
    out = replay(root, "-j", "1", "--json", tmp_path / "s.json")
    records = json.loads((tmp_path / "s.json").read_text())
    assert records and all(r["reason"] == "no op_param.json" for r in records)
    assert "task statistics" in out.stdout


CUSTOM = """
import torch

@torch.library.custom_op("replaytest::twice", mutates_args=())
def twice(x: torch.Tensor) -> torch.Tensor:
    return x * 2
"""


def test_a_custom_op_is_replayed_once_its_module_is_imported(tmp_path):
    (tmp_path / "replaytest_ops.py").write_text(textwrap.dedent(CUSTOM))
    sys.path.insert(0, str(tmp_path))
    try:
        import replaytest_ops  # noqa: F401
    finally:
        sys.path.remove(str(tmp_path))

    class Twice(nn.Module):
        def forward(self, x):
            return torch.ops.replaytest.twice(x) + 1

    root = dump(tmp_path / "d", config(task="tensor", save_child=True),
                lambda: Root(Twice())(torch.randn(3, 5)))
    env = clean_env(PYTHONPATH=os.pathsep.join(
        p for p in (os.environ.get("PYTHONPATH"), str(tmp_path)) if p))
    replay(root, "-j", "1", "--json", tmp_path / "a.json", env=env)
    found = verdicts(tmp_path / "a.json")
    assert found["replaytest.twice.default"][:2] == ("not replayed", "op unknown here")
    assert "--import" in found["replaytest.twice.default"][2]
    replay(root, "-j", "1", "--import", "replaytest_ops", "--json", tmp_path / "b.json", env=env)
    assert verdicts(tmp_path / "b.json")["replaytest.twice.default"][0] == "within its dtype"


# -- the bound --------------------------------------------------------------------------------

def test_the_bound_counts_what_the_dtype_explains_and_no_more():
    rng = np.random.default_rng(0)
    reference = rng.standard_normal(1000)
    rounded = reference.astype(np.float16).astype(np.float64)
    eps = float(np.finfo(np.float16).eps)
    assert not judge(reference, rounded, rounded, eps, Bound()).introduced
    off = rounded.copy()
    off[7] += 1.0
    assert judge(reference, off, rounded, eps, Bound()).introduced
    inf = rounded.copy()
    inf[3] = np.inf
    assert judge(reference, inf, rounded, eps, Bound()).nonfinite == 1
    assert not judge(reference, inf, inf, eps, Bound()).introduced   # the dtype overflows too

