"""ATen kernels as ops: a `TorchDispatchMode` pushed only while a tracked layer-level op runs.

Every ATen operator that reaches the dispatcher inside such an op becomes a kernel child of the
innermost module on the op stack (SPEC §1). The mode is pushed on the thread's own dispatch-mode
stack, so other threads and the rest of the model never pay for it.
"""
from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..naming import ALLOCATION_OPS, kernel_name


class KernelCapture(TorchDispatchMode):
    """Hands every kernel executed in this thread to `walker.kernel_call` (capture/ops.py)."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # TorchDispatchMode wraps a subclass's __torch_dispatch__ so that torch.compile never
        # traces into it: two more Python frames on every kernel, and an import of
        # torch._dynamo (a second, 70 MB) at the first one. Where torch has compiler stances,
        # nothing compiles while this mode is pushed: it is pushed only in dumped rounds,
        # which run compiled code eagerly (calltree.py, `_FORCE_EAGER`).
        return not hasattr(torch.compiler, "set_stance")

    def __init__(self, walker):
        super().__init__()
        self.walker = walker

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self.walker.kernel_call(func, args, kwargs or {})


class Kernel(NamedTuple):
    """What the probe needs to know about one ATen operator, computed once."""

    op_name: str                # `aten.mm.default`
    name: str                   # `<CamelCase>Kernel`: its name as an op (`MmKernel`)
    params: tuple               # parameters for `arguments.bind_args`
    written: tuple[str, ...]    # names of the arguments it writes in place
    allocates: bool             # an allocation kernel: its output holds nothing yet
    collective: bool            # a collective: its outputs are complete only once it is
    factory: bool               # a factory function: keep no reference to its output (below)
    view: bool                  # its schema returns aliases of its inputs (`aten.view`...)


_COLLECTIVES = ("c10d.", "_c10d_functional.")
# A factory function (`torch.arange`, `torch.zeros`, `torch.empty_like`...) is one that takes
# tensor options, as PyTorch's code generator defines it. Its C++ entry point hands the kernel's
# result to autograd's `make_variable`, which keeps that tensor only when nothing else holds a
# reference to it; otherwise it makes a shallow copy, and under a dispatch mode that copy is an
# `aten.detach` the mode sees. So while a mode is pushed, a reference kept to a factory's
# output past the kernel adds a kernel to the model's run: the recorder keeps none. Casts take
# tensor options too, but are reached through `Tensor.to`, whose binding returns the kernel's
# result as it is: their outputs may wait for the layer's batch.
_TENSOR_OPTIONS = frozenset({"dtype", "layout", "device", "pin_memory"})
_CASTS = ("aten._to_copy.", "aten.to.")


@lru_cache(maxsize=4096)
def kernel_info(func) -> Kernel:
    """The `Kernel` record of an ATen operator."""
    op_name = str(func)
    try:
        arguments = func._schema.arguments
        names = tuple(a.name for a in arguments)
        written = tuple(a.name for a in arguments
                        if a.alias_info is not None and a.alias_info.is_write)
        if op_name.startswith("c10d."):
            # Collectives fill their tensors in place without saying so in their schemas.
            written = names
        view = any(r.alias_info is not None and not r.alias_info.is_write
                   for r in func._schema.returns)
    except Exception:
        names, written, view = (), (), False
    return Kernel(op_name, kernel_name(op_name), (names, None, names), written,
                  op_name in ALLOCATION_OPS, op_name.startswith(_COLLECTIVES),
                  _TENSOR_OPTIONS.issubset(names) and not op_name.startswith(_CASTS), view)
