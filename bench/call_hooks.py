"""What attaching to every module call costs: global module hooks versus a patched `__call__`.

The probe sees module calls by replacing `nn.Module.__call__` while it is awake. PyTorch also
offers global hooks for every module (`register_module_forward_pre_hook` and
`register_module_forward_hook(..., always_call=True)`, the second also running when forward
raises). This times both ways of doing the same minimal work — push the module on a per-thread
stack before its forward, pop it after, even on an exception — per module call, on a model of
`LAYERS` modules whose forward returns its input (so the numbers are the call machinery only),
and, for reference, the probe itself awake in a round that writes nothing.

    python bench/call_hooks.py               # best of 15 rounds per case
    python bench/call_hooks.py --repeats 50

Like `micro.py`: the best of several timed rounds, the garbage collector paused. See
docs/design.md for the numbers and what they decided.
"""
from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import threading
import time

import torch
from torch import nn
from torch.nn.modules import module as module_mod

import atb_probe

LAYERS = 256


class Leaf(nn.Module):
    def forward(self, x):
        return x


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(Leaf() for _ in range(LAYERS))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


_tls = threading.local()


def _stack() -> list:
    stack = getattr(_tls, "stack", None)
    if stack is None:
        stack = _tls.stack = []
    return stack


def _pre_hook(module, args):
    _stack().append(module)


def _post_hook(module, args, output):
    _stack().pop()


def global_hooks():
    """The same work through PyTorch's global module hooks; returns the function removing them."""
    pre = module_mod.register_module_forward_pre_hook(_pre_hook)
    post = module_mod.register_module_forward_hook(_post_hook, always_call=True)

    def remove():
        pre.remove()
        post.remove()
    return remove


def _post_hook_kwargs(module, args, kwargs, output):
    _stack().pop()


def global_hooks_kwargs():
    """As `global_hooks`, the forward hook also given the keyword arguments
    (`with_kwargs=True`). The global pre-hook has no such option: keyword arguments are out of
    its sight before forward runs."""
    pre = module_mod.register_module_forward_pre_hook(_pre_hook)
    post = module_mod.register_module_forward_hook(_post_hook_kwargs, with_kwargs=True,
                                                   always_call=True)

    def remove():
        pre.remove()
        post.remove()
    return remove


def patched_call():
    """The same work through a replaced `nn.Module.__call__`; returns the function undoing it."""
    original = nn.Module.__call__

    def __call__(module, *args, **kwargs):
        stack = _stack()
        stack.append(module)
        try:
            return original(module, *args, **kwargs)
        finally:
            stack.pop()

    nn.Module.__call__ = __call__

    def remove():
        nn.Module.__call__ = original
    return remove


def probe_awake(exec_range: str):
    """The probe, awake, in rounds that write nothing (`exec_range: none`) or that track every
    op without writing (`op_name` matching nothing, `save_child`)."""
    out = tempfile.TemporaryDirectory()
    cfg = {"task": "statistics", "dump_enable": True, "exec_range": exec_range, "ids": "",
           "op_name": "", "save_child": False, "device": "", "filter_level": 1}
    if exec_range == "track":
        cfg.update(exec_range="all", op_name="no_such_op", save_child=True)
    atb_probe.enable(out.name, cfg)

    def remove():
        atb_probe.disable(timeout=60)
        out.cleanup()
    return remove


def _best(model, x, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        model(x)
        best = min(best, time.perf_counter() - start)
    return best


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=15, help="timed rounds; the best is kept")
    opts = parser.parse_args(argv)
    torch.set_num_threads(1)
    gc.disable()
    model, x = Stack().eval(), torch.ones(1)
    calls = LAYERS + 1  # the leaves and the root
    cases = [
        ("plain", None),
        ("global-hooks", global_hooks),
        ("global-kwargs", global_hooks_kwargs),
        ("patched-call", patched_call),
        ("probe-none", lambda: probe_awake("none")),
        ("probe-track", lambda: probe_awake("track")),
    ]
    print(f"{'case':<14}{'us/call':>9}{'extra us/call':>15}")
    plain = None
    with torch.no_grad():
        for name, attach in cases:
            remove = attach() if attach else None
            try:
                _best(model, x, 3)
                per_call = _best(model, x, opts.repeats) / calls
            finally:
                if remove:
                    remove()
            plain = per_call if plain is None else plain
            print(f"{name:<14}{per_call * 1e6:>9.2f}{(per_call - plain) * 1e6:>15.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
