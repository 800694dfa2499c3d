"""Call arguments by parameter name: what a module's `forward` signature (read once per class)
or a kernel's schema says."""
from __future__ import annotations

import inspect

_PARAMS_CACHE: dict = {}


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
