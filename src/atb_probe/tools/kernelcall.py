"""A dumped kernel's call rebuilt: its `op_param.json` (the ATen name, the non-tensor arguments,
which input file is which argument, the arguments it wrote) read against the op's schema into
the call description kernelrun.py runs. What cannot be rebuilt raises `CannotReplay` with the
reason.

The probe records a kernel's arguments by schema name (capture/arguments.py): tensors as input
files, `intensor<i>` -> `self`, a list of tensors item by item (`tensors_0`, `tensors_1`, a None
item among them under `args`), everything else under `args` as JSON renders it (`"torch.bfloat16"`,
`"-inf"`, `"cpu"`). An argument the call did not pass is left to its schema default.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from . import StrEnum
from .kernelrun import resolve_op


class SkipReason(StrEnum):
    """Why a kernel is not replayed."""

    NO_PARAM = "no op_param.json"          # a statistics dump, or not a kernel of ours
    NO_DATA = "input without data"         # statistics only, header-only, missing file
    UNKNOWN_OP = "op unknown here"         # no schema in this process
    RANDOM = "random op"                   # its output is drawn, not computed
    ALLOCATION = "uninitialized output"    # an allocation kernel: nothing to recompute
    COLLECTIVE = "collective"              # needs the other ranks
    STORAGE = "reads storage"              # reads its input's memory, not its values
    ARGUMENT = "argument not recorded"     # an argument the dump does not hold as a value
    FAILED = "rerun failed"                # the op raised when rerun


class CannotReplay(Exception):
    """A kernel that cannot be replayed, and why."""

    def __init__(self, reason: SkipReason, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


# Ops whose result depends on the input's storage (its strides and offset), which the dump
# does not hold (it holds the values of the view), or on its bytes, which a float64 reference
# does not keep.
_STORAGE_OPS = frozenset({"aten.as_strided.default", "aten.as_strided_.default",
                          "aten.as_strided_scatter.default", "aten.set_.source_Storage",
                          "aten.set_.source_Storage_storage_offset", "aten.set_.source_Tensor",
                          "aten.view.dtype"})
_COLLECTIVES = ("c10d.", "_c10d_functional.")
_UNRENDERED = re.compile(r"^<.*>$|\.\.\.$")   # tensors.py `_plain` of an object it cannot write
_NON_FINITE = {"inf", "-inf", "nan"}


@dataclass(frozen=True, slots=True)
class KernelParam:
    """What `op_param.json` says of a kernel."""

    op: str                                  # `aten.mm.default`
    inputs: dict[str, str]                   # `intensor0` -> `self`
    args: dict                               # non-tensor arguments by name
    outputs: tuple[str, ...]                 # `outtensor0`, ...
    written: dict[str, str]                  # `outtensor1` -> `self`
    uninitialized: frozenset[str]            # outputs over memory nothing wrote

    @classmethod
    def of(cls, doc: dict) -> KernelParam:
        """From the parsed `op_param.json` of a kernel."""
        return cls(doc["op"], dict(doc.get("inputs") or {}), dict(doc.get("args") or {}),
                   tuple(doc.get("outputs") or ()), dict(doc.get("written") or {}),
                   frozenset(doc.get("uninitialized") or ()))


def build_call(param: KernelParam) -> dict:
    """The call description (kernelrun.py) of a kernel, without its `inputs` entry."""
    if param.op.startswith(_COLLECTIVES):
        raise CannotReplay(SkipReason.COLLECTIVE, "a collective needs the other ranks")
    if param.op in _STORAGE_OPS:
        raise CannotReplay(SkipReason.STORAGE, "it reads its input's storage (strides, "
                           "offset) or bytes, not only its values")
    op = resolve_op(param.op)
    if op is None:
        raise CannotReplay(SkipReason.UNKNOWN_OP, f"{param.op} has no schema in this process "
                           "(a custom op: --import the module that registers it)")
    if _draws(op, param.args):
        raise CannotReplay(SkipReason.RANDOM, f"{param.op} draws random numbers: its output "
                           "cannot be recomputed")
    if param.outputs and set(param.outputs) <= param.uninitialized:
        raise CannotReplay(SkipReason.ALLOCATION, "its outputs hold memory nothing has "
                           "written yet (an allocation)")
    by_arg = {name: file for file, name in param.inputs.items()}
    kwargs = {}
    for arg in op._schema.arguments:
        value = _argument(arg, by_arg, param.args)
        if value is not _ABSENT:
            kwargs[arg.name] = value
    returned = len(param.outputs) - len(param.written)
    outputs = [{"name": name, "written": param.written[name]} if name in param.written
               else {"name": name, "returned": i}
               for i, name in enumerate(param.outputs)]
    if any("returned" in o and o["returned"] >= returned for o in outputs):
        raise CannotReplay(SkipReason.ARGUMENT, "op_param.json lists more returned outputs "
                           "than it has")
    return {"op": param.op, "kwargs": kwargs, "outputs": outputs}


_ABSENT = object()

# Recorded as `<torch.layout>` or `<torch.memory_format>` by probes that did not render them:
# they choose how the output is laid out, never its values, so their defaults do as well.
_LAYOUT_ONLY = frozenset({"<torch.layout>", "<torch.memory_format>"})
_PROBABILITIES = ("p", "dropout_p")


def _draws(op, args: dict) -> bool:
    """Whether the op draws random numbers in this call: a seeded op, unless it is told not
    to train or its probability is 0 (attention without dropout)."""
    if torch.Tag.nondeterministic_seeded not in op.tags or args.get("train") is False:
        return False
    for arg in op._schema.arguments:
        if arg.name in _PROBABILITIES:
            p = args.get(arg.name, arg.default_value if arg.has_default_value() else None)
            return p != 0
    return True


def _argument(arg, by_arg: dict, args: dict):
    """The description of one schema argument, or `_ABSENT` (left to its default)."""
    name = arg.name
    if name in by_arg:
        return {"tensor": by_arg[name]}
    if _is_tensor_list(arg.type):
        items = {}
        for key, file in by_arg.items():
            index = _item_index(key, name)
            if index is not None:
                items[index] = {"tensor": file}
        for key, value in args.items():
            index = _item_index(key, name)
            if index is not None and value is None:
                items[index] = None
        if items:
            if sorted(items) != list(range(len(items))):
                raise CannotReplay(SkipReason.ARGUMENT, f"the items of `{name}` are not all "
                                   "recorded")
            return [items[i] for i in range(len(items))]
    if name not in args:
        if arg.has_default_value() or _is_optional(arg.type):
            return _ABSENT
        raise CannotReplay(SkipReason.ARGUMENT, f"`{name}` is neither an input file nor in "
                           "`args`")
    if isinstance(args[name], str) and args[name] in _LAYOUT_ONLY:
        return _ABSENT
    return _value(name, args[name], str(arg.type))


def _item_index(key: str, name: str) -> int | None:
    head, _, tail = key.rpartition("_")
    return int(tail) if head == name and tail.isdigit() else None


def _is_tensor_list(schema_type) -> bool:
    text = str(schema_type)
    return text.startswith(("List[Tensor]", "List[Optional[Tensor]]", "Optional[List[Tensor]]"))


def _is_optional(schema_type) -> bool:
    return str(schema_type).startswith("Optional[")


def _value(name: str, value, type_text: str):
    """A recorded non-tensor argument as the call description holds it."""
    if isinstance(value, str):
        if "Device" in type_text:
            return {"device": value}
        if value.startswith("torch."):
            found = getattr(torch, value[len("torch."):], None)
            if isinstance(found, torch.dtype):
                return {"dtype": value[len("torch."):]}
            if isinstance(found, (torch.layout, torch.memory_format)):
                return {"torch": value[len("torch."):]}
        if value in _NON_FINITE and type_text not in ("str", "Optional[str]"):
            return {"float": value}
        if _UNRENDERED.search(value) and type_text not in ("str", "Optional[str]"):
            raise CannotReplay(SkipReason.ARGUMENT, f"`{name}` was recorded as {value!r}, "
                               "not as a value")
        return value
    if isinstance(value, list):
        return [_value(name, v, type_text) for v in value]
    return value
