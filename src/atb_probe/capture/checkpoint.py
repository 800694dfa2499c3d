"""The dtype a model runs in against the one its checkpoint declares, said once per probe.

An engine may load a checkpoint in another dtype than the one it was saved in: vLLM's CPU build
serves a float32 checkpoint as bfloat16 unless it is started with `--dtype float32`. The dump
then holds bfloat16 tensors, and every later comparison against a float32 golden run compares
the two dtypes first of all. At the first dumped round of a model whose config declares a dtype
(`torch_dtype`, or `dtype` in newer transformers), the probe compares it with the dtype of the
model's floating-point parameters and, when they differ, says so on stderr and in the status
file (`dtype_notice`).
"""
from __future__ import annotations

import sys

import torch
from torch import nn

from .. import log


class DtypeNotice:
    """Whether the model runs in its checkpoint's dtype, checked at the first dumped round of a
    model that declares one; `message` says how they differ, or is None."""

    def __init__(self):
        self.message: str | None = None
        self._checked = False

    def check(self, model_name: str, root: nn.Module) -> None:
        """Compare `root`'s declared dtype with the dtype of its parameters (once per probe:
        at the first dumped round of a model whose config declares a dtype)."""
        if self._checked:
            return
        declared = _declared_dtype(root)
        if declared is None:
            return
        self._checked = True
        actual = _parameter_dtype(root)
        if actual is None or actual == declared:
            return
        hint = (f"; start vLLM with --dtype {declared} to keep the checkpoint's dtype"
                if "vllm" in sys.modules else "")
        self.message = (f"the model {model_name} runs in {actual}, but its checkpoint's config "
                        f"says torch_dtype {declared}: the dump holds {actual} tensors, and a "
                        f"comparison with a {declared} run compares the two dtypes{hint}")
        log.warn(self.message)


def _declared_dtype(root: nn.Module) -> str | None:
    """The dtype the model's config declares (`torch_dtype`, or `dtype` in newer
    transformers), as a torch dtype name, or None."""
    # From the instance's own attributes: newer transformers keep `dtype` there, and reading
    # its `torch_dtype` property would print a deprecation warning in the user's program.
    try:
        attrs = vars(getattr(root, "config", None))
    except TypeError:
        return None
    for key in ("dtype", "torch_dtype"):
        name = _dtype_name(attrs.get(key))
        if name is not None:
            return name
    return None


def _dtype_name(value) -> str | None:
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if isinstance(value, str) and isinstance(getattr(torch, value, None), torch.dtype):
        return str(getattr(torch, value)).removeprefix("torch.")
    return None


def _parameter_dtype(root: nn.Module) -> str | None:
    """The dtype of the model's first floating-point parameter, or None."""
    for param in root.parameters():
        if param.is_floating_point():
            return str(param.dtype).removeprefix("torch.")
    return None
