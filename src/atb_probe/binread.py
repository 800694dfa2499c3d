"""Reading one `.bin` file back as a tensor, references resolved (SPEC §5).

`binfile` parses and checks a file's header; this module follows a reference file to the file
holding its bytes (a path relative to the round folder, found with `layout.round_dir_of`) and
turns the bytes into an array. `load_tensor` gives the tensor in its own dtype (torch is imported
only then); `load_numpy` gives what numpy can hold (bf16 and the fp8 dtypes widened to float32,
as msprobe's `parse -t npy` does), for the analysis tools.
"""
from __future__ import annotations

import os

import numpy as np

from .binfile import BinFormatError, BinHeader, read_header, read_payload
from .layout import round_dir_of


class HeaderOnlyError(BinFormatError):
    """A header-only file (filter_level 2 kernels): its statistics are in statistic.csv, its
    bytes were never written."""


def resolve(path: str, header: BinHeader | None = None, depth: int = 0) -> tuple[str, BinHeader]:
    """The file that holds the bytes of `path` (itself, or what its reference points to)."""
    header = header or read_header(path)
    if not header.is_reference:
        return path, header
    if depth > 8:
        raise BinFormatError(f"{path}: reference chain too long")
    root = round_dir_of(path)
    if root is None:
        raise BinFormatError(f"{path} is a reference ({header.data_ref}) outside a round folder")
    target = os.path.normpath(os.path.join(root, header.data_ref))
    if not target.startswith(root + os.sep):
        raise BinFormatError(f"{path}: reference {header.data_ref!r} leaves the round folder")
    if os.path.abspath(target) == os.path.abspath(path):
        raise HeaderOnlyError(f"{path} is header-only (filter_level 2): its data was not kept")
    return resolve(target, None, depth + 1)


def load_array(path: str) -> tuple[np.ndarray, BinHeader]:
    """The tensor's data as a numpy array of its raw dtype (bf16/fp8 as unsigned ints)."""
    header = read_header(path)
    data_path, data_header = resolve(path, header)
    payload = read_payload(data_path, data_header)
    if data_header.nbytes != header.numel * header.dtype.itemsize:
        raise BinFormatError(f"{path}: reference target {data_path} holds "
                             f"{data_header.nbytes} bytes, not {header.numel} elements")
    raw_dtype = header.dtype.numpy_name or {1: "<u1", 2: "<u2"}[header.dtype.itemsize]
    array = np.frombuffer(payload, dtype=raw_dtype).reshape(header.dims)
    return array, header


def load_tensor(path):
    """A `.bin` file (data or reference) as a torch tensor of its own dtype and dims."""
    import torch
    array, header = load_array(os.fspath(path))
    tensor = torch.from_numpy(array.copy())
    if header.dtype.numpy_name is None:
        tensor = tensor.view(getattr(torch, header.dtype.torch_name))
    return tensor


def load_numpy(path) -> np.ndarray:
    """A `.bin` file as a numpy array; dtypes numpy lacks (bf16, fp8) become float32."""
    array, header = load_array(os.fspath(path))
    if header.dtype.numpy_name is not None:
        return array
    if header.dtype.torch_name == "bfloat16":
        # bf16 is the upper half of a float32: widening is a shift, exact and torch-free.
        return (array.astype(np.uint32) << 16).view(np.float32)
    return load_tensor(path).float().numpy()
