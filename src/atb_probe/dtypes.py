"""The dtype table shared by the `.bin` format and `statistic.csv` (SPEC §5).

Each entry ties together the names a dtype has in the three places it appears: the numeric code in
a `.bin` header, the name in the Dtype column of `statistic.csv`, and the torch dtype attribute
name (kept as a string so this module stays free of torch).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DType:
    code: int          # `dtype=` in a .bin header
    csv_name: str      # Dtype column of statistic.csv
    torch_name: str    # attribute of the torch module
    itemsize: int      # bytes per element
    numpy_name: str | None  # numpy dtype of the payload; None when numpy has none (bf16, fp8)


DTYPES: tuple[DType, ...] = (
    DType(0, "float", "float32", 4, "<f4"),
    DType(1, "float16", "float16", 2, "<f2"),
    DType(2, "int8", "int8", 1, "i1"),
    DType(3, "int32", "int32", 4, "<i4"),
    DType(4, "uint8", "uint8", 1, "u1"),
    DType(6, "int16", "int16", 2, "<i2"),
    DType(7, "uint16", "uint16", 2, "<u2"),
    DType(8, "uint32", "uint32", 4, "<u4"),
    DType(9, "int64", "int64", 8, "<i8"),
    DType(10, "uint64", "uint64", 8, "<u8"),
    DType(11, "double", "float64", 8, "<f8"),
    DType(12, "bool", "bool", 1, "?"),
    DType(16, "complex64", "complex64", 8, "<c8"),
    DType(17, "complex128", "complex128", 16, "<c16"),
    DType(27, "bf16", "bfloat16", 2, None),
    DType(35, "float8_e5m2", "float8_e5m2", 1, None),
    DType(36, "float8_e4m3fn", "float8_e4m3fn", 1, None),
    DType(37, "float8_e8m0", "float8_e8m0fnu", 1, None),
)

BY_CODE = {d.code: d for d in DTYPES}
BY_TORCH_NAME = {d.torch_name: d for d in DTYPES}
