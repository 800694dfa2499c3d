"""A kernel handed over: `replay --export DIR` writes one kernel as a folder a kernel team can
run on a machine that never saw the model (SPEC §10):

    DIR/call.json              the call (kernelrun.py's description), with its tensors' files
    DIR/inputs/intensor<i>.npy the recorded inputs
    DIR/outputs/outtensor<i>.npy  the recorded outputs
    DIR/golden/...             the golden run's inputs and outputs, when a golden was given
    DIR/repro.py               kernelrun.py itself: torch and numpy only

numpy has no bf16 or fp8: those tensors are stored widened to float32 (exactly) and `call.json`
names their dtype, to which repro.py narrows them back.
"""
from __future__ import annotations

import json
import os
import shutil

import numpy as np

from . import kernelrun


class ExportError(Exception):
    """A kernel that cannot be exported, and why."""


def export_kernel(job, folder: str) -> str:
    """Write the reproducer of a `replay.KernelJob` into `folder`; its path."""
    from .kernelcall import CannotReplay, build_call
    from .replay import load_inputs, read_param
    try:
        param = read_param(job.folder)
        call = build_call(param)
        inputs = load_inputs(job, call)
    except CannotReplay as exc:
        raise ExportError(str(exc)) from None
    from .replay import load_tensor
    os.makedirs(folder, exist_ok=True)
    call["where"] = f"{job.process} {job.where}"
    call["inputs"] = {name: _save(folder, "inputs", name, t) for name, t in inputs.items()}
    by_name = {f.name: f for f in job.outputs}
    golden_inputs = {}
    for f in job.inputs:
        if f.golden is not None and f.name in inputs:
            golden_inputs[f.name] = _save_ref(folder, f.name, f.golden, load_tensor)
    for entry in call["outputs"]:
        dumped = by_name.get(entry["name"])
        if dumped is None or entry["name"] in param.uninitialized:
            raise ExportError(f"{entry['name']} has no recorded data to compare with")
        try:
            recorded = load_tensor(dumped.target)
        except CannotReplay as exc:
            raise ExportError(str(exc)) from None
        entry.update(_save(folder, "outputs", entry["name"], recorded))
        if dumped.golden is not None:
            entry["golden"] = _save_ref(folder, entry["name"], dumped.golden, load_tensor)["file"]
    if golden_inputs:
        call["golden_inputs"] = golden_inputs
    with open(os.path.join(folder, "call.json"), "w", encoding="utf-8") as f:
        json.dump(call, f, indent=1)
    shutil.copyfile(kernelrun.__file__, os.path.join(folder, "repro.py"))
    return folder


def _save(folder: str, sub: str, name: str, tensor) -> dict:
    """Write a tensor as `<sub>/<name>.npy`; its entry (file, dtype, shape)."""
    os.makedirs(os.path.join(folder, sub), exist_ok=True)
    rel = f"{sub}/{name}.npy"
    np.save(os.path.join(folder, rel), kernelrun.as_numpy(tensor))
    return {"file": rel, "dtype": str(tensor.dtype).rpartition(".")[2],
            "shape": list(tensor.shape)}


def _save_ref(folder: str, name: str, ref, load) -> dict:
    """The golden's tensor, when it has data; an entry with a note when it has none."""
    from .kernelcall import CannotReplay
    try:
        return _save(folder, "golden", name, load(ref))
    except CannotReplay as exc:
        return {"file": None, "note": exc.detail}
