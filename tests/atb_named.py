"""Turn a real atb-probe dump of a tiny Llama into the tree an ATB model would have left.

An ATB Llama names its layer-level ops `WordEmbedding`, `Prefill_layer` (round 0) or
`Decoder_layer` (later rounds), `FinalNorm` and `LmHead`; it has no rotary embedding op (the
rotary embedding is computed inside its layers); its tensors are laid out as [tokens, hidden]
(no batch dimension); a layer takes hidden states, cos, sin and the mask (not the position ids)
and more inputs of its own. The tree is written in the SPEC §5 format (`.bin` files with their
own dims, a statistic.csv per round with Tensor Paths) from the real data of the source dump,
so the numbers are those of a real run.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from atb_probe.binfile import encode_header
from atb_probe.dtypes import BY_CODE
from atb_probe.statcsv import HEADER
from atb_probe.tools.dumpreader import open_dump
from atb_probe.binread import load_array

LAYER_NAMES = {"Embedding": "WordEmbedding", "LlamaRMSNorm": "FinalNorm", "Linear": "LmHead"}
CHILD_NAMES = {"LlamaAttention": "SelfAttention", "LlamaMLP": "Mlp", "LlamaRMSNorm": "RmsNorm"}
LAYER_INPUTS = ("0", "3", "4", "1")   # hidden states, cos, sin, mask: in ATB's order
LLAMA_MAP = """\
# ATB op name: PyTorch module class
ops:
  WordEmbedding: Embedding
  Prefill_layer: LlamaDecoderLayer
  Decoder_layer: LlamaDecoderLayer
  FinalNorm: LlamaRMSNorm
  LmHead: Linear
  SelfAttention: LlamaAttention
  Mlp: LlamaMLP
  RmsNorm: LlamaRMSNorm
outputs:
  Prefill_layer: {0: 0}
  Decoder_layer: {0: 0}
"""
_CODE = {d.csv_name: code for code, d in BY_CODE.items()}


def atb_tree(source: Path, dest: Path, children: bool = True, pid: int = 9999) -> Path:
    """Write the ATB-named tree of the dump at `source` below `dest`; `dest`."""
    dump = open_dump(str(source))
    for rnd in dump.rounds:
        out_round = dest / "atb_dump_data" / "data" / f"0_{pid}" / str(rnd.index)
        renumber = _layer_ids(rnd)
        lines = [HEADER]
        for t in rnd.tensors:
            ids, names = t.op_id.split("_"), t.op_name.split("/")
            if ids[0] not in renumber or (len(ids) > 1 and not children):
                continue
            new_id, layer_name = renumber[ids[0]]
            ids = [new_id] + ids[1:]
            names = [layer_name] + [CHILD_NAMES.get(n, n) for n in names[1:]]
            index = t.index
            if len(ids) == 1 and layer_name.endswith("_layer") and t.io == "input":
                if index not in LAYER_INPUTS:
                    continue
                index = str(LAYER_INPUTS.index(index))
            array, _ = load_array(t.path)
            dims = _atb_dims(array.shape)
            folder = out_round.joinpath(*(f"{i}_{n}" for i, n in zip(ids, names)))
            side, stem = ("before", "intensor") if t.io == "input" else ("after", "outtensor")
            path = folder / side / f"{stem}{index}.bin"
            path.parent.mkdir(parents=True, exist_ok=True)
            payload = np.ascontiguousarray(array).tobytes()
            path.write_bytes(encode_header(_CODE[t.dtype], dims, len(payload)) + payload)
            stats = ",".join(t.row[k] for k in ("Max", "Min", "Mean", "Norm"))
            lines.append(f"0_{pid},{rnd.index},{'/'.join(names)},{names[-1]},{'_'.join(ids)},"
                         f"{t.io},{index},{t.dtype},nd,{'x'.join(map(str, dims))},{stats},"
                         f"{path}\n")
        (out_round / "statistic.csv").write_text("".join(lines))
    return dest


def _layer_ids(rnd) -> dict[str, tuple[str, str]]:
    """Source layer ID -> (ATB ID, ATB name); the rotary embedding op is left out."""
    layer = "Prefill_layer" if rnd.index == 0 else "Decoder_layer"
    tops = []
    for op in rnd.ops:
        own = op.op_id.split("_")[0]
        if own not in (i for i, _ in tops):
            tops.append((own, op.op_name.split("/")[0]))
    out, k = {}, 0
    for own, name in tops:
        if name == "LlamaRotaryEmbedding":
            continue
        out[own] = (str(k), layer if name == "LlamaDecoderLayer" else LAYER_NAMES[name])
        k += 1
    return out


def _atb_dims(shape: tuple) -> tuple:
    """ATB's [tokens, hidden] layout: a leading batch dimension of 1 dropped."""
    return shape[1:] if len(shape) >= 2 and shape[0] == 1 else shape


def write_map(folder: Path, name: str = "llama_map.yaml") -> str:
    """The Llama map of docs/analysis.md, as a file; its path."""
    path = os.path.join(folder, name)
    Path(path).write_text(LLAMA_MAP)
    return path
