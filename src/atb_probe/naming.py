"""Op names, kernel names and file-system-safe path parts (SPEC §1 "Names", §5)."""
from __future__ import annotations

import re

MAX_NAME_BYTES = 255  # the SPEC's bound on a name, and the file system's NAME_MAX
# A name becomes part of longer components (`<index>_<name>`, `<name>_<id>.json`): keeping it
# at 200 bytes leaves room for those within NAME_MAX.
NAME_LIMIT = 200
_UNSAFE = re.compile(r"[^A-Za-z0-9_.\-]")


def sanitize(name: str, limit: int = NAME_LIMIT) -> str:
    """A single path component: no `/`, no `..`, letters, digits, `_.-` only, at most `limit`
    bytes (`NAME_LIMIT` by default)."""
    text = _UNSAFE.sub("_", str(name)) or "_"
    text = text.replace("..", "__")
    if text.startswith("."):
        text = "_" + text[1:]
    encoded = text.encode("utf-8")
    if len(encoded) > limit:
        text = encoded[:limit].decode("utf-8", errors="ignore")
    return text


def kernel_name(op_name: str) -> str:
    """`aten.mm.default` -> `MmKernel`, `aten.add.Tensor` -> `AddTensorKernel`."""
    parts = op_name.split(".")
    if len(parts) >= 3:
        base, overload = parts[-2], parts[-1]
    elif len(parts) == 2:
        base, overload = parts[-1], "default"
    else:
        base, overload = parts[0], "default"
    name = _camel(base)
    if overload and overload != "default":
        name += _camel(overload)
    return sanitize(name + "Kernel")


# ATen ops that allocate memory without writing it: their outputs hold whatever the memory held
# (SPEC §8 "Uninitialised memory"). They are dumped as they are, marked in op_param.json, and the
# tools never report them.
ALLOCATION_OPS = frozenset({
    "aten.empty.memory_format", "aten.empty.out", "aten.empty_strided.default",
    "aten.empty_like.default", "aten.new_empty.default", "aten.new_empty_strided.default",
    "aten.empty_permuted.default",
})


def is_uninitialized(op_type: str, io: str) -> bool:
    """Whether a tensor of statistic.csv (its Op Type and Input/Output) is the output of an
    allocation kernel: memory nothing wrote yet."""
    return io == "output" and op_type in ALLOCATION_KERNELS


def _camel(text: str) -> str:
    return "".join(w[:1].upper() + w[1:] for w in text.split("_") if w)



ALLOCATION_KERNELS = frozenset(kernel_name(op) for op in ALLOCATION_OPS)
