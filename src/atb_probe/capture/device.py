"""The device ID of a process (SPEC §1): the accelerator index of its tensors, else LOCAL_RANK.

The probe asks once, at the process's first round, and keeps the answer for the life of the
process (a dump must not be split over two `<dev>_<pid>` folders). The tensors looked at are the
root call's inputs (and what they hold: lists, tuples, dicts), then the root module's parameters
and buffers; the first one on an accelerator (CUDA, NPU through torch_npu, or any other device
with an index) decides. A process running on CPU only falls back to `LOCAL_RANK`, which
torchrun and most launchers set per process; else, when the process has joined a
`torch.distributed` group by then (an engine's tensor-parallel workers, which vLLM starts itself
without `LOCAL_RANK`), its rank in it; else 0.

The tensor's own index is used rather than the backend's current device: a rank that puts its
model on `cuda:1` without calling `set_device(1)` still reports 1; when `set_device` was called,
as torchrun programs normally do, the two agree.
"""
from __future__ import annotations

import os
from collections.abc import Mapping

import torch

from ..process.identity import local_rank

_NOT_ACCELERATORS = frozenset({"cpu", "meta"})
_MAX_DEPTH = 3


def device_id(module, args, kwargs) -> int:
    """At the first round: the accelerator index of its tensors, else LOCAL_RANK, else 0."""
    for tensor in _candidates(module, args, kwargs):
        if tensor.device.type in _NOT_ACCELERATORS:
            continue
        index = tensor.device.index
        if index is None:
            index = _current_index(tensor.device.type)
        if index is not None:
            return index
    return _cpu_rank()


def _cpu_rank() -> int:
    """LOCAL_RANK when it is set, else the process's rank in `torch.distributed`'s default
    group when there is one, else 0."""
    if "LOCAL_RANK" not in os.environ:
        dist = torch.distributed
        try:
            if dist.is_available() and dist.is_initialized():
                return dist.get_rank()
        except Exception:  # a backend that cannot answer
            pass
    return local_rank()


def _candidates(module, args, kwargs):
    for value in (*args, *kwargs.values()):
        yield from _tensors_in(value, 0)
    if isinstance(module, torch.nn.Module):
        yield from module.parameters()
        yield from module.buffers()


def _tensors_in(value, depth):
    if isinstance(value, torch.Tensor):
        yield value
    elif depth < _MAX_DEPTH:
        if isinstance(value, (list, tuple)):
            for item in value:
                yield from _tensors_in(item, depth + 1)
        elif isinstance(value, Mapping):
            for item in value.values():
                yield from _tensors_in(item, depth + 1)


def _current_index(device_type: str) -> int | None:
    """`torch.<backend>.current_device()` (torch.cuda, torch.npu…) for a tensor without index."""
    current = getattr(getattr(torch, device_type, None), "current_device", None)
    if not callable(current):
        return None
    try:
        return int(current())
    except Exception:  # a backend that cannot answer: fall back to LOCAL_RANK
        return None
