"""On a CUDA machine: dumps of a model on the GPU are right, and the probe never waits on the
device inside a round. Skipped where torch sees no CUDA device (CI); `bench/device_check.py`
measures the cost on the same machine."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

import atb_probe
from atb_probe.binread import load_numpy
from atb_probe.capture import stats_compute as statistics
from atb_probe.capture.stats_compute import DeviceStatistics, compute
from atb_probe.stats_cell import new_cell, new_serial, values
from atb_probe.tools.compare import compare_dumps
from conftest import dump, generate, only_proc, read_csv, tiny_llama
from harness import config, run_loaded

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

STAT_COLUMNS = ("Max", "Min", "Mean", "Norm")


def _tensors() -> dict:
    """Host tensors of every kind the statistics path treats apart."""
    g = torch.Generator().manual_seed(0)
    big = torch.randn(257, 129, generator=g)
    return {
        "float32": torch.randn(1000, generator=g),
        "float64": torch.randn(300, dtype=torch.float64, generator=g),
        "bfloat16": torch.randn(64, 33, generator=g).bfloat16(),
        "float16": torch.randn(5000, generator=g).half(),
        "int64": torch.randint(-50, 50, (77,), generator=g),
        "bool": torch.rand(40, generator=g) > 0.5,
        "complex64": torch.randn(20, dtype=torch.complex64, generator=g),
        "transposed": big.t(),
        "strided slice": big[::2, 1::3],
        "negated view": torch.randn(31, dtype=torch.complex64, generator=g).conj().imag,
        "one element": torch.tensor([2.5]),
        "overflows float32": torch.full((64,), 3e19),
        "nan": torch.tensor([1.0, float("nan"), -2.0]),
        "inf": torch.tensor([1.0, float("inf"), -2.0]),
    }


_DEVICE = DeviceStatistics()  # the device statistics of the tests that reduce on their own


def _stats(tensors: list) -> list:
    cells = [new_cell(new_serial()) for _ in tensors]
    compute(tensors, cells, _DEVICE)
    _DEVICE.flush()  # as a thread does before it hands its rows over
    landed = _DEVICE.landings.last()
    if landed is not None:
        landed.wait()
    return [values(c) for c in cells]


def _close(a: tuple, b: tuple, rel: float) -> bool:
    """Max and min exactly equal (nan equal to nan), mean and norm within `rel`."""
    if not all(x == y or (math.isnan(x) and math.isnan(y)) for x, y in zip(a[:2], b[:2])):
        return False
    for x, y in zip(a[2:], b[2:]):
        if math.isnan(x) or math.isinf(x):
            if not (x == y or (math.isnan(x) and math.isnan(y))):
                return False
        elif not math.isclose(x, y, rel_tol=rel, abs_tol=1e-6):
            return False
    return True


@pytest.mark.parametrize("batched", [False, True])
def test_device_statistics_equal_the_host_statistics(batched):
    tensors = _tensors()
    names = list(tensors)
    host = [t for t in tensors.values()]
    device = [t.cuda() for t in host]
    if batched:
        want, got = _stats(host), _stats(device)
    else:
        want = [_stats([t])[0] for t in host]
        got = [_stats([t])[0] for t in device]
    for name, w, g in zip(names, want, got):
        assert g is not None, name
        assert _close(w, g, 1e-5), (name, w, g)
    assert math.isfinite(got[names.index("overflows float32")][3])
    assert _DEVICE.segment_failure is None


def test_many_tensors_of_a_batch_are_reduced_by_segments_on_the_device():
    g = torch.Generator().manual_seed(1)
    host = [torch.randn(int(n), generator=g) for n in torch.randint(1, 3000, (200,), generator=g)]
    host += [torch.tensor([1.0, float("nan")])] * 3 + [torch.randn(statistics.SEGMENT_ELEMENTS + 1)]
    host += [t.bfloat16() for t in host[:50]]
    want, got = _stats(host), _stats([t.cuda() for t in host])
    for i, (w, g) in enumerate(zip(want, got)):
        assert _close(w, g, 1e-5), (i, w, g)
    assert _DEVICE.segment_failure is None and "cuda" not in _DEVICE.no_segments


class Stack(nn.Module):
    """Layer-level ops of plain torch modules, no synchronising call in the model itself."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64), nn.LayerNorm(64))
            for _ in range(3))
        self.head = nn.Linear(64, 16)

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x).softmax(-1)


@pytest.mark.parametrize("task,save_child", [("statistics", False), ("statistics", True),
                                             ("tensor", True), ("all", True)])
def test_the_probe_never_synchronises_inside_a_round(tmp_path, task, save_child):
    torch.manual_seed(0)
    model = Stack().cuda().eval()
    x = torch.randn(4, 8, 64, device="cuda")
    with torch.no_grad():
        model(x)  # warm-up outside the probe
    torch.cuda.synchronize()
    on = model.register_forward_pre_hook(lambda *_: torch.cuda.set_sync_debug_mode("error"))
    off = model.register_forward_hook(lambda *_: torch.cuda.set_sync_debug_mode("default"),
                                      always_call=True)
    probe = atb_probe.enable(str(tmp_path), config(task=task, save_child=save_child))
    try:
        with torch.no_grad():
            for _ in range(3):
                model(x)  # raises here if the model's own code synchronised
        assert probe.last_error is None, probe.last_error
        device = probe.engine.recorder.stats.device
        assert device.segment_failure is None, device.segment_failure
    finally:
        on.remove(), off.remove()
        torch.cuda.set_sync_debug_mode("default")
        assert atb_probe.disable(timeout=120)
    rows = [r for p in (tmp_path / "atb_dump_data").rglob("statistic.csv") for r in read_csv(p)]
    assert len({r["Execution Count"] for r in rows}) == 3
    assert any("Kernel" in r["Op Type"] for r in rows) == save_child
    for r in rows:
        if task != "tensor":
            assert all(r[c] not in ("N/A", "nan") for c in STAT_COLUMNS), r
        if task != "statistics":
            assert r["Tensor Path"].endswith(".bin"), r


def test_statistics_of_a_gpu_dump_match_its_tensor_files(tmp_path):
    """task "all" on the GPU: every row's statistics (computed on the device) agree with the
    bytes of its `.bin` file (copied from the device), reduced here in float64."""
    model = tiny_llama().cuda()
    root = dump(tmp_path, config(task="all", save_child=True, exec_range="0,1"),
                lambda: generate(model))
    rows = [r for p in root.rglob("statistic.csv") for r in read_csv(p)]
    assert len(rows) > 500
    checked = 0
    for r in rows:
        data = load_numpy(r["Tensor Path"]).astype(np.float64).reshape(-1)
        if data.size == 0 or r["Dtype"] in ("complex64", "complex128"):
            continue
        want = (data.max(), data.min(), data.mean(), float(np.sqrt(np.dot(data, data))))
        got = tuple(float(r[c]) for c in STAT_COLUMNS)
        assert _close(want, got, 1e-4), (r["Op Name"], r["Input/Output"], r["Index"], want, got)
        checked += 1
    assert checked > 500


def _cuda_generate():
    model = tiny_llama().cuda()
    prompt = torch.randint(0, model.config.vocab_size, (1, 6),
                           generator=torch.Generator().manual_seed(0)).cuda()
    with torch.no_grad():
        model.generate(prompt, max_new_tokens=2, do_sample=False, pad_token_id=0)


def test_a_gpu_dump_compares_with_a_cpu_golden_dump(tmp_path):
    """The user's workflow: the same model dumped on the CPU (golden) and on the GPU."""
    golden = dump(tmp_path / "cpu", config(), lambda: generate(tiny_llama()))
    target = dump(tmp_path / "gpu", config(), _cuda_generate)
    assert only_proc(target).name.startswith("0_")
    result = compare_dumps(str(golden), str(target))
    assert result.unmatched == [] and result.name_matched_ops == 0
    floats = [r for r in result.rows if r.mode == "tensor" and r.metrics.cosine is not None]
    assert len(floats) > 30
    assert min(r.metrics.cosine for r in floats) > 0.9999
    assert result.finding is None


GPU_SCRIPT = """
import torch
from transformers import LlamaConfig, LlamaForCausalLM
torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
model = LlamaForCausalLM(cfg).eval().cuda()
prompt = torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(0)).cuda()
with torch.no_grad():
    out = model.generate(prompt, max_new_tokens=2, do_sample=False, pad_token_id=0)
print("OK", out.shape[1])
"""


def test_a_gpu_process_started_through_the_load_script_is_dumped(tmp_path):
    done = run_loaded(tmp_path, GPU_SCRIPT, config(task="all", save_child=True))
    assert done.returncode == 0 and "OK 8" in done.stdout, done.stderr
    proc = only_proc(tmp_path / "atb_dump_data")
    assert proc.name.startswith(f"{torch.cuda.current_device()}_")
    rounds = sorted(p.name for p in proc.iterdir() if p.is_dir())
    assert rounds == ["0", "1"]
    for rnd in rounds:
        rows = read_csv(proc / rnd / "statistic.csv")
        assert rows and all(r["Max"] != "N/A" or "0" in r["Shape"].split("x") for r in rows)
