"""The probe's hold on vLLM's runner (capture/vllm.py): patched once however often it looks,
as soon as vLLM imports the runner, and given back whole when the probe stops."""
from __future__ import annotations

import sys

import pytest

pytest.importorskip("vllm")

import atb_probe  # noqa: E402

from harness import config, run  # noqa: E402

METHODS = ("execute_model", "sample_tokens", "_model_forward")


def test_the_runner_is_patched_and_given_back_when_the_probe_stops(tmp_path):
    from vllm.v1.worker import gpu_model_runner
    from atb_probe.capture.vllm import _MARK
    runner = gpu_model_runner.GPUModelRunner
    originals = {name: vars(runner)[name] for name in METHODS}
    atb_probe.enable(str(tmp_path), config(dump_enable=False))
    for name in METHODS:
        assert getattr(vars(runner)[name], _MARK) is originals[name], name
    atb_probe.disable(timeout=60)
    assert {name: vars(runner)[name] for name in METHODS} == originals
    assert not any(type(f).__name__ == "_ImportHook" for f in sys.meta_path)


def test_the_runner_is_patched_once_as_soon_as_vllm_imports_it(tmp_path):
    # A new process: the probe starts before vLLM is imported, as under the load script. The
    # import of the other runner module makes the probe look at the first one again.
    code = f"""
import atb_probe
atb_probe.enable({str(tmp_path)!r}, {{"dump_enable": False}})
import sys
assert "vllm.v1.worker.gpu_model_runner" not in sys.modules
from vllm.v1.worker.gpu_model_runner import GPUModelRunner
patched = {{name: vars(GPUModelRunner)[name] for name in {METHODS!r}}}
assert all(hasattr(m, "__atb_probe_original__") for m in patched.values())
import vllm.v1.worker.gpu.model_runner as other
assert hasattr(vars(other.GPUModelRunner)["execute_model"], "__atb_probe_original__")
assert {{name: vars(GPUModelRunner)[name] for name in patched}} == patched
assert not any(hasattr(m.__atb_probe_original__, "__atb_probe_original__")
               for m in patched.values())
print("patched once")
"""
    result = run([sys.executable, "-c", code])
    assert result.returncode == 0 and "patched once" in result.stdout, result.stderr[-3000:]
