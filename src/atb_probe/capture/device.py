"""The device ID of a process (SPEC §1): the accelerator index of its tensors, else LOCAL_RANK."""
from __future__ import annotations

import os

import torch


def device_id(module, args, kwargs) -> int:
    """Decided from the first round's tensors: their CUDA/NPU index, else LOCAL_RANK, else 0."""
    tensor = _first_tensor(args, kwargs)
    if tensor is None:
        tensor = next(iter(module.parameters()), None)
        if tensor is None:
            tensor = next(iter(module.buffers()), None)
    if tensor is not None and tensor.device.type not in ("cpu", "meta"):
        if tensor.device.index is not None:
            return tensor.device.index
        backend = getattr(torch, tensor.device.type, None)
        current = getattr(backend, "current_device", None)
        if callable(current):
            return int(current())
    raw = os.environ.get("LOCAL_RANK", "")
    return int(raw) if raw.isdecimal() else 0


def _first_tensor(args, kwargs):
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value
    return None
