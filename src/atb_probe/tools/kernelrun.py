"""Running one recorded kernel call again: a call description (`call.json`) and its input
tensors in, the kernel's outputs out, in the recorded precision or widened to float64, on a
chosen device.

This file is also the reproducer `atb-probe replay --export` hands over: it is copied as is to
`repro.py`, so it imports only the standard library, numpy and torch (never atb_probe), and a
kernel team can run it on a machine that never saw the model. `replay` (replay.py) runs its
kernels through the same functions, so the reproducer computes exactly what replay reported.

The call description (built from `op_param.json` by kernelcall.py) is JSON:

    {"op": "aten.mm.default",
     "kwargs": {"self": {"tensor": "intensor0"}, "mat2": {"tensor": "intensor1"}},
     "outputs": [{"name": "outtensor0", "returned": 0}],
     "inputs": {"intensor0": {"file": "inputs/intensor0.npy", "dtype": "bfloat16"}, ...}}

Every argument goes by its schema name. Tagged values stand for what JSON cannot hold:
`{"tensor": NAME}` an input tensor, `{"dtype": "bfloat16"}` a dtype, `{"torch": "strided"}` a
layout or memory format, `{"device": "cpu"}` a device (the run's device replaces it),
`{"float": "inf"}` a non-finite number. An output is either the `returned` value at that index
(the op's return flattened in order) or an argument the kernel `written` in place.

Widened to float64 (the reference), every floating tensor and every floating dtype argument
becomes float64; the few arguments that only make sense for a narrow dtype are set as
`WIDENED_ARGS` says.

    python repro.py [--device cuda:0] [--import torch_npu]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

import numpy as np
import torch

FLOAT64 = "float64"          # the reference precision
RECORDED = "recorded"        # the precision the kernel ran in
PRECISIONS = (FLOAT64, RECORDED)

# Arguments that ask for a narrow-dtype behaviour, as they must be for a float64 input.
WIDENED_ARGS = {"half_to_float": False}

# Libraries that register custom ops when imported, tried when an op is not yet known.
OP_LIBRARIES = ("vllm._custom_ops",)


def resolve_op(name: str):
    """The op overload of a name as the dump writes it (`aten.mm.default`,
    `_C.rms_norm.default`); None when this process does not know it."""
    namespace, _, rest = name.partition(".")
    op_name, _, overload = rest.rpartition(".")
    for attempt in range(len(OP_LIBRARIES) + 1):
        try:
            return getattr(getattr(getattr(torch.ops, namespace), op_name), overload)
        except (AttributeError, RuntimeError):
            if attempt == len(OP_LIBRARIES):
                return None
            try:
                __import__(OP_LIBRARIES[attempt])
            except Exception:
                pass
    return None


def _widened(dtype, precision: str):
    if precision == FLOAT64 and dtype.is_floating_point:
        return torch.float64
    return dtype


def decode(value, inputs: dict, precision: str, device):
    """An argument of the call description as the op takes it (`inputs`: name -> tensor, in
    the recorded dtype, on the CPU). Every tensor is a fresh copy: an in-place kernel writes
    into the copy of its run only."""
    if isinstance(value, list):
        return [decode(v, inputs, precision, device) for v in value]
    if not isinstance(value, dict):
        return value
    if "tensor" in value:
        t = inputs[value["tensor"]]
        return t.to(device=device, dtype=_widened(t.dtype, precision), copy=True)
    if "dtype" in value:
        return _widened(getattr(torch, value["dtype"]), precision)
    if "device" in value:
        return torch.device(device)
    if "torch" in value:
        return getattr(torch, value["torch"])
    if "float" in value:
        return float(value["float"])
    raise ValueError(f"unknown argument value {value!r}")


def run_call(call: dict, inputs: dict, precision: str = RECORDED, device="cpu") -> list:
    """The kernel's outputs (CPU tensors, in `call["outputs"]` order) from `inputs`."""
    op = resolve_op(call["op"])
    if op is None:
        raise LookupError(f"{call['op']} is not known to this process: import the module that "
                          "registers it first")
    kwargs = {}
    for name, value in call["kwargs"].items():
        kwargs[name] = decode(value, inputs, precision, device)
        if precision == FLOAT64 and name in WIDENED_ARGS:
            kwargs[name] = WIDENED_ARGS[name]
    with torch.no_grad():
        out = op(**kwargs)
    returned = _flatten(out)
    outputs = []
    for entry in call["outputs"]:
        if "written" in entry:
            t = kwargs[entry["written"]]
        else:
            t = returned[entry["returned"]]
        outputs.append(t.detach().cpu() if isinstance(t, torch.Tensor) else t)
    return outputs


def _flatten(value) -> list:
    """The tensors of a returned value, in order (a tensor, or tuples and lists of them)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _flatten(v)]
    return []


def as_numpy(t) -> np.ndarray:
    """A tensor's values as numpy holds them (bf16 and the fp8 dtypes as float32, exactly)."""
    if t.dtype in (torch.bfloat16, torch.float16) or "float8" in str(t.dtype):
        t = t.float()
    return t.numpy()


# -- the reproducer ------------------------------------------------------------------------

def distances(reference: np.ndarray, other: np.ndarray) -> dict:
    """How far `other` is from `reference`: Euclidean distance, max absolute and relative
    error, cosine (NaN/Inf at the same places are left out, at different places reported)."""
    r = np.asarray(reference, dtype=np.float64).reshape(-1)
    o = np.asarray(other, dtype=np.float64).reshape(-1)
    if r.shape != o.shape:
        return {"note": f"shapes differ: {reference.shape} vs {other.shape}"}
    bad_r, bad_o = ~np.isfinite(r), ~np.isfinite(o)
    same_bad = bad_r & bad_o & ((r == o) | (np.isnan(r) & np.isnan(o)))
    mismatched = int(np.count_nonzero((bad_r | bad_o) & ~same_bad))
    keep = ~(bad_r | bad_o)
    r, o = r[keep], o[keep]
    diff = o - r
    norm_r, norm_o = math.sqrt(float(r @ r)), math.sqrt(float(o @ o))
    cosine = float(r @ o) / (norm_r * norm_o) if norm_r and norm_o else \
        (1.0 if norm_r == norm_o else float("nan"))
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = np.abs(diff) / np.where(r == 0, np.finfo(np.float32).eps, np.abs(r))
    return {"euclidean": math.sqrt(float(diff @ diff)),
            "max_abs_err": float(np.abs(diff).max()) if diff.size else 0.0,
            "max_rel_err": float(rel.max()) if rel.size else 0.0,
            "cosine": cosine, "nonfinite_mismatches": mismatched}


def _line(label: str, d: dict) -> str:
    if "note" in d:
        return f"  {label}: {d['note']}"
    extra = f", {d['nonfinite_mismatches']} NaN/Inf mismatches" \
        if d["nonfinite_mismatches"] else ""
    return (f"  {label}: euclidean {d['euclidean']:.6g}, max abs err {d['max_abs_err']:.6g}, "
            f"max rel err {d['max_rel_err']:.6g}, cosine {d['cosine']:.6f}{extra}")


def _load(folder: str, entry: dict):
    array = np.load(os.path.join(folder, entry["file"]))
    return torch.from_numpy(array).to(getattr(torch, entry["dtype"]))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description="Rerun one recorded kernel from its recorded inputs and print how far its "
                    "recorded output is from the same op on DEVICE, from float64 on the CPU, "
                    "and (when the golden run's output is here) from the golden run.")
    parser.add_argument("--device", default="cpu", help="where to rerun it (default cpu)")
    parser.add_argument("--call", default=None, help="the call description (default: "
                        "call.json next to this script)")
    parser.add_argument("--import", dest="imports", action="append", default=[],
                        metavar="MODULE", help="import MODULE first: a device's torch backend "
                        "(torch_npu) or the library of a custom op (repeatable)")
    args = parser.parse_args(argv)
    for name in args.imports:
        __import__(name)
    path = args.call or os.path.join(os.path.dirname(os.path.abspath(__file__)), "call.json")
    folder = os.path.dirname(os.path.abspath(path))
    with open(path, encoding="utf-8") as f:
        call = json.load(f)
    inputs = {name: _load(folder, entry) for name, entry in call["inputs"].items()}
    on_device = run_call(call, inputs, RECORDED, args.device)
    reference = run_call(call, inputs, FLOAT64, "cpu")
    print(f"{call['op']} ({call.get('where', '')}), rerun on {args.device}:")
    for i, entry in enumerate(call["outputs"]):
        recorded = np.load(os.path.join(folder, entry["file"]))
        print(f"{entry['name']}:")
        print(_line(f"recorded vs {args.device} ({entry['dtype']})",
                    distances(as_numpy(on_device[i]), recorded)))
        print(_line("recorded vs float64 on cpu", distances(as_numpy(reference[i]), recorded)))
        print(_line(f"{args.device} ({entry['dtype']}) vs float64 on cpu",
                    distances(as_numpy(reference[i]), as_numpy(on_device[i]))))
        if entry.get("golden"):
            golden = np.load(os.path.join(folder, entry["golden"]))
            print(_line("golden vs recorded", distances(golden, recorded)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
