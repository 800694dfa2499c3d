"""Tensors as the dump sees them: flattening call arguments, statistics, host copies.

Flattening follows SPEC §5: tensors in call order, tuples/lists/dicts/dataclasses (ModelOutput
included) walked in order; everything else is a plain parameter for `op_param.json`.
Statistics are computed on the tensor's own device in one batched pass per op and fetched with a
single host transfer.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch

from ..dtypes import BY_TORCH_NAME, DType

_max, _min, _sum = np.maximum.reduce, np.minimum.reduce, np.add.reduce


_BY_DTYPE: dict = {getattr(torch, d.torch_name): d for d in BY_TORCH_NAME.values()
                   if hasattr(torch, d.torch_name)}


def dtype_of(t: torch.Tensor) -> DType | None:
    """The table entry of a tensor's dtype; None for dtypes the format cannot hold."""
    return _BY_DTYPE.get(t.dtype)


def is_dumpable(t) -> bool:
    """A real, dense tensor whose bytes can be read (not meta/fake/sparse/nested)."""
    cls = type(t)
    if cls is not torch.Tensor and cls is not torch.nn.Parameter:
        return False
    return t.layout is torch.strided and not t.is_meta and not t.is_nested


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


def flatten(value, label: str, out: list, params: dict, name_items: bool, depth: int = 0) -> None:
    """Append (label, tensor) pairs of `value` to `out`; put other values into `params`.

    `name_items`: tuple/list items get `_<i>` suffixes (inputs); when False only mapping keys
    add to the label (outputs: `outtensor0_last_hidden_state`)."""
    if isinstance(value, torch.Tensor):
        out.append((label, value))
        return
    if depth > 8:
        params[label or "value"] = _plain(value)
        return
    if isinstance(value, dict):
        for key, item in value.items():
            flatten(item, _join(label, str(key)), out, params, name_items, depth + 1)
        return
    if isinstance(value, (tuple, list)) and not _is_namedtuple_like(value):
        if not any(may_hold_tensor(v) for v in value):
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
    if value is not None or label:
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


def statistics(tensors: list[torch.Tensor]) -> list[tuple[float, float, float, float] | None]:
    """(max, min, mean, L2 norm) of each tensor; None for empty ones.

    Accumulated in float32 (float64 for double and integer tensors), over the tensor's memory in
    storage order (a transposed view is reduced as fast as its base); means are sums divided by
    the element count. Where a float32 sum or sum of squares overflows although every element is
    finite (values beyond ~1e19), that tensor is summed again in float64, so a representable
    norm is never reported as inf. inf and nan in the data are results here, not errors: numpy
    is kept from warning about them in the user's process.

    CPU tensors are reduced by numpy: single-threaded, so a busy machine's thread pool never
    makes a small reduction wait. Accelerator tensors are reduced on their device, and all of an
    op's results come back in one host transfer."""
    rows: list = [None] * len(tensors)
    parts, where = [], []
    with np.errstate(all="ignore"):
        for i, t in enumerate(tensors):
            n = t.numel()
            if n == 0:
                continue
            x = t.detach() if t.requires_grad else t
            dtype = x.dtype
            if dtype is not torch.float32 and dtype is not torch.float64:
                if x.is_complex():
                    x = x.abs()
                if x.dtype is not torch.float32 and x.dtype is not torch.float64:
                    x = x.to(torch.float32 if x.is_floating_point() or x.dtype is torch.bool
                             else torch.float64)
            if x.is_neg():
                x = x.resolve_neg()
            if x.is_cpu:
                a = x.numpy().reshape(-1) if x.is_contiguous() else _dense_flat(x).numpy()
                high, low, total, squares = (float(_max(a)), float(_min(a)), float(_sum(a)),
                                             float(np.dot(a, a)))
                if _overflowed(high, low, total, squares):
                    a = a.astype(np.float64)
                    total, squares = float(_sum(a)), float(np.dot(a, a))
                rows[i] = (high, low, total / n, math.sqrt(squares))
                continue
            x = _dense_flat(x)
            low, high = torch.aminmax(x)
            parts.append(torch.stack((high, low, x.sum(), torch.linalg.vector_norm(x))).double())
            where.append((i, n))
    if parts:
        values = torch.stack(parts).tolist()
        for (i, n), (high, low, total, norm) in zip(where, values):
            if _overflowed(high, low, total, norm):
                x = tensors[i].detach()
                x = _dense_flat(x.abs() if x.is_complex() else x.resolve_neg()).double()
                total, norm = torch.stack((x.sum(), torch.linalg.vector_norm(x))).tolist()
            rows[i] = (high, low, total / n, norm)
    return rows


def _overflowed(high: float, low: float, total: float, squares: float) -> bool:
    """A float32 sum (or sum of squares) went infinite while every element is finite."""
    return not (math.isfinite(total) and math.isfinite(squares)) and \
        math.isfinite(high) and math.isfinite(low)


def is_dense(x: torch.Tensor) -> bool:
    """Whether `x`'s elements fill its memory densely in some order (contiguous, transposed,
    permuted)."""
    expected = 1
    for size, stride in sorted(zip(x.shape, x.stride()), key=lambda p: p[1]):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


def _dense_flat(x: torch.Tensor) -> torch.Tensor:
    """`x` as a 1-D tensor over the same memory when its elements fill it densely in some order
    (contiguous, transposed, permuted), else a contiguous copy."""
    if x.is_contiguous():
        return x.view(-1)
    if is_dense(x):
        return x.as_strided((x.numel(),), (1,))
    return x.reshape(-1)


def host_bytes(t: torch.Tensor):
    """A private host copy of `t`'s bytes, C-contiguous, as a flat uint8 numpy array.

    Always a copy: the model may change the tensor in place after this returns."""
    x = t.detach()
    if x.is_conj():
        x = x.resolve_conj()
    if x.is_neg():
        x = x.resolve_neg()
    if x.device.type != "cpu":
        x = x.to("cpu")
        if not x.is_contiguous():
            x = x.contiguous()
    elif x.is_contiguous():
        x = x.clone()
    else:
        x = x.contiguous()
    return x.reshape(-1).view(torch.uint8).numpy()


def storage_key(t: torch.Tensor) -> tuple:
    """Where a tensor's elements start and what they are: device, storage address, offset,
    dtype, element count, lazy negation/conjugation. Raises for tensors without storage."""
    return (t.device.type, t.device.index, t.untyped_storage().data_ptr(), t.storage_offset(),
            t.dtype, t.numel(), t.is_neg(), t.is_conj())


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
