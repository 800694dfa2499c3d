"""Call arguments by parameter name: what a module's `forward` signature (read once per class)
or a kernel's schema says."""
from __future__ import annotations

import inspect

import torch

_PARAMS_CACHE: dict = {}
_TENSOR = torch.Tensor
# Argument types that never hold a tensor, and the numbers of size and stride lists.
_NO_TENSOR = frozenset({type(None), bool, int, float, str, torch.dtype, torch.device,
                        torch.layout, torch.memory_format})
_NUMBERS = frozenset({bool, int, float})


def forward_params(cls) -> tuple:
    """(positional names, *args name or None, keyword-able names in order) of `cls.forward`."""
    forward = getattr(cls, "forward", None)
    cached = _PARAMS_CACHE.get(forward)
    if cached is not None:
        return cached
    positional, var_pos, ordered = [], None, []
    try:
        sig = inspect.signature(forward)
        for p in list(sig.parameters.values())[1:]:  # skip self
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
                positional.append(p.name)
                ordered.append(p.name)
            elif p.kind is p.VAR_POSITIONAL:
                var_pos = p.name
            elif p.kind is p.KEYWORD_ONLY:
                ordered.append(p.name)
    except (TypeError, ValueError):
        pass
    result = (tuple(positional), var_pos, tuple(ordered))
    _PARAMS_CACHE[forward] = result
    return result


def bind_args(params: tuple, args: tuple, kwargs: dict) -> list[tuple[str, object]]:
    """A call's arguments as (parameter name, value): positional, then keywords in signature
    order, then any other keywords. `params` is (positional names, *args name or None,
    keyword-able names in order): `forward_params` of a module, `kernel_info` of a kernel."""
    positional, var_pos, ordered = params
    pairs = []
    for i, value in enumerate(args):
        if i < len(positional):
            pairs.append((positional[i], value))
        else:
            pairs.append((f"{var_pos or 'args'}_{i - len(positional)}", value))
    if kwargs:
        for name in ordered:
            if name in kwargs:
                pairs.append((name, kwargs[name]))
        for name, value in kwargs.items():
            if name not in ordered:
                pairs.append((name, value))
    return pairs


def kernel_tensors(params: tuple, args: tuple, kwargs: dict) -> list | None:
    """The tensors of a kernel call in `bind_args` order, without binding names to them: what a
    statistics dump records of a kernel's inputs (a kernel's rows are indexed by position).
    None where a value needs `recorder.bound_tensors`' walk (a container that is neither a list
    of tensors nor of numbers), so the caller binds the arguments instead."""
    out = []
    for value in args:
        if not _take(value, out):
            return None
    if kwargs:
        found = 0
        for name in params[2]:
            if name in kwargs:
                found += 1
                if not _take(kwargs[name], out):
                    return None
        if found != len(kwargs):  # a keyword the schema does not name: bound after the rest
            return None
    return out


def _take(value, out: list) -> bool:
    """Append the tensors of one argument value to `out`; False for a value that needs
    `recorder.bound_tensors`' walk."""
    cls = type(value)
    if cls in _NO_TENSOR:
        return True
    if cls is _TENSOR or isinstance(value, _TENSOR):
        out.append(value)
        return True
    if cls is list or cls is tuple:
        return _tensors_of_list(value, out)
    return False


def _tensors_of_list(value, out: list) -> bool:
    """Append a list argument's tensors (a list of tensors, or of numbers: none); False for
    anything else."""
    if not value:
        return True
    if all(type(v) is _TENSOR for v in value):
        out.extend(value)
        return True
    return all(type(v) in _NUMBERS for v in value)
