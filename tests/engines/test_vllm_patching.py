"""The probe's hold on vLLM's runner (capture/vllm.py), in this process: patched once however
often it looks, only once vLLM imports the runner, and given back whole when the probe stops."""
from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("vllm")

import atb_probe  # noqa: E402

from conftest import config  # noqa: E402

METHODS = ("execute_model", "sample_tokens", "_model_forward")


def test_the_runner_is_patched_once_and_given_back_when_the_probe_stops(tmp_path):
    from vllm.v1.worker import gpu_model_runner
    from atb_probe.capture.vllm import _MARK
    runner = gpu_model_runner.GPUModelRunner
    originals = {name: vars(runner)[name] for name in METHODS}
    probe = atb_probe.enable(str(tmp_path), config(dump_enable=False))
    probe.engine.vllm.attach()   # looked for again: still one layer of ours
    for name in METHODS:
        assert getattr(vars(runner)[name], _MARK) is originals[name], name
    assert probe.engine.vllm.attached
    atb_probe.disable(timeout=60)
    assert {name: vars(runner)[name] for name in METHODS} == originals
    assert not any(type(f).__name__ == "_ImportHook" for f in sys.meta_path)


def test_the_runner_is_patched_as_soon_as_vllm_imports_it(tmp_path):
    # A new process: the probe starts before vLLM is imported, as under the load script.
    code = f"""
import atb_probe
atb_probe.enable({str(tmp_path)!r}, {{"dump_enable": False}})
import sys
assert "vllm.v1.worker.gpu_model_runner" not in sys.modules
from vllm.v1.worker.gpu_model_runner import GPUModelRunner
assert hasattr(vars(GPUModelRunner)["execute_model"], "__atb_probe_original__")
assert atb_probe.active().engine.vllm.attached
print("patched")
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0 and "patched" in result.stdout, result.stderr[-3000:]
