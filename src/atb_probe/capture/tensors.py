"""Tensors as the dump sees them: flattening call arguments, memory keys, host copies.

Flattening follows SPEC §5: tensors in call order, tuples/lists/dicts/dataclasses (ModelOutput
included) walked in order; everything else is a plain parameter for `op_param.json`.
Statistics are computed in stats_compute.py.
"""
from __future__ import annotations

import dataclasses
import math

import torch

from ..dtypes import BY_TORCH_NAME, DType
from .landing import Landings, to_host

# torch dtype -> its table entry, for every dtype the format holds
DUMPABLE_DTYPES: dict = {getattr(torch, d.torch_name): d for d in BY_TORCH_NAME.values()
                         if hasattr(torch, d.torch_name)}


def dumpable_dtype(t) -> DType | None:
    """The table entry of a tensor's dtype when the tensor can be dumped: a real, dense tensor
    whose bytes can be read (not meta, fake, sparse or nested) of a dtype the format holds; else
    None."""
    cls = type(t)
    if cls is not torch.Tensor and cls is not torch.nn.Parameter:
        return None
    if t.layout is not torch.strided or t.is_meta or t.is_nested:
        return None
    return DUMPABLE_DTYPES.get(t.dtype)


def local_of(t) -> tuple[object, dict | None]:
    """What is dumped for a tensor subclass: a `DTensor`'s local shard (and its placements,
    mesh shape and global shape for `op_param.json`), the waited-for result of a pending
    functional collective (`AsyncCollectiveTensor`); anything else unchanged, no description.

    `_local_tensor` and `elem` are read directly: `to_local()` and friends are differentiable
    ops that would dispatch again inside the kernel capture."""
    meta = None
    for _ in range(4):  # a DTensor may hold a pending collective result, and so on
        cls = type(t)
        if cls is torch.Tensor or cls is torch.nn.Parameter:
            break
        name = cls.__name__
        if name == "DTensor" and hasattr(t, "_local_tensor"):
            if meta is None:
                meta = {"placements": [repr(p) for p in t.placements],
                        "mesh_shape": list(t.device_mesh.shape),
                        "global_shape": list(t.shape)}
            t = t._local_tensor
        elif name == "AsyncCollectiveTensor" and hasattr(t, "trigger_wait"):
            t = t.trigger_wait()
        else:
            break
    return t, meta


def flatten(value, label: str, out: list, params: dict | None, name_items: bool,
            depth: int = 0) -> None:
    """Append (label, tensor) pairs of `value` to `out`; put other values into `params` (None:
    only the tensors are wanted).

    `name_items`: tuple/list items get `_<i>` suffixes (inputs); when False only mapping keys
    add to the label (outputs: `outtensor0_last_hidden_state`)."""
    if isinstance(value, torch.Tensor):
        out.append((label, value))
        return
    if depth > 8:
        if params is not None:
            params[label or "value"] = _plain(value)
        return
    if isinstance(value, dict):
        for key, item in value.items():
            flatten(item, _join(label, str(key)), out, params, name_items, depth + 1)
        return
    if isinstance(value, (tuple, list)) and not _is_namedtuple_like(value):
        if not any(may_hold_tensor(v) for v in value):
            if params is not None:
                params[label or "value"] = _plain(value)
            return
        for i, item in enumerate(value):
            flatten(item, _join(label, str(i)) if name_items else label, out, params, name_items,
                    depth + 1)
        return
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            flatten(getattr(value, f.name), _join(label, f.name), out, params, name_items,
                    depth + 1)
        return
    if isinstance(value, tuple):  # namedtuple: fields by name
        for key, item in zip(value._fields, value):
            flatten(item, _join(label, key), out, params, name_items, depth + 1)
        return
    if params is not None and (value is not None or label):
        params[label or "value"] = _plain(value)


def _join(label: str, part: str) -> str:
    return f"{label}_{part}" if label else part


def _is_namedtuple_like(value) -> bool:
    return isinstance(value, tuple) and hasattr(value, "_fields")


def may_hold_tensor(value) -> bool:
    return isinstance(value, (torch.Tensor, tuple, list, dict)) or dataclasses.is_dataclass(value)


def _plain(value):
    """A JSON-friendly rendering of a non-tensor value."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, (torch.dtype, torch.device, torch.Size)):
        return str(value)
    if isinstance(value, (tuple, list)) and len(value) <= 64:
        return [_plain(v) for v in value]
    text = repr(value) if isinstance(value, (tuple, list, dict, set)) else \
        f"<{type(value).__module__}.{type(value).__qualname__}>"
    return text if len(text) <= 200 else text[:200] + "..."


def host_bytes(t: torch.Tensor, landings: Landings):
    """A private host copy of `t`'s bytes, C-contiguous, as a flat uint8 numpy array, and what
    to wait for before reading it: None, or for a tensor on an accelerator the `Landed` of its
    copy to pinned memory (queued without blocking the model thread, seen land by `landings`).

    Always a copy: the model may change the tensor in place after this returns."""
    x = t.detach()
    if x.is_conj():
        x = x.resolve_conj()
    if x.is_neg():
        x = x.resolve_neg()
    ready = None
    if x.device.type != "cpu":
        x, event = to_host(x if x.is_contiguous() else x.contiguous())
        ready = landings.watch(event)
    else:
        # In C order whatever its strides: `clone()` keeps those of a tensor counted as
        # contiguous, and a dimension of size 1 may have any stride (`x[..., 0]` of a row).
        x = x.clone(memory_format=torch.contiguous_format) if x.is_contiguous() else \
            x.contiguous()
    return x.reshape(-1).view(torch.uint8).numpy(), ready


def storage_key(t: torch.Tensor) -> tuple:
    """Where a tensor's elements start and what they are: device, dtype, storage address (at
    index 2), offset, element count, lazy negation/conjugation. Raises for tensors without
    storage."""
    return (t.device, t.dtype, t.untyped_storage().data_ptr(), t.storage_offset(), t.numel(),
            t.is_neg(), t.is_conj())


def same_bytes_key(t: torch.Tensor):
    """What identifies the bytes a tensor's file would hold, or None when it has no such key.

    Contiguous tensors with the same `storage_key` hold the same bytes whatever their shape (a
    reshaped view). A non-contiguous view holds the same bytes as another only with the same
    shape and strides too (the same view, e.g. a transposed weight handed from `aten.t` to
    `aten.mm`)."""
    try:
        key = storage_key(t)
        return key if t.is_contiguous() else key + (tuple(t.shape), tuple(t.stride()))
    except Exception:  # subclasses, tensors without storage
        return None
