"""`compare --map FILE`: which op names of one dump are which of the other's.

An ATB model and its PyTorch golden run name the same computation differently (`Prefill_layer`
and `LlamaDecoderLayer`, `FinalNorm` and `LlamaRMSNorm`). The file, YAML or JSON, says so::

    ops:                        # an op name of one dump: the op name of the other
      WordEmbedding: Embedding
      Prefill_layer: LlamaDecoderLayer
      Decoder_layer: LlamaDecoderLayer
      SelfAttention: LlamaAttention
    outputs:                    # optional, per op on the left: its output index: the other's
      LmHead: {0: 0}

Names are op names (the last part of an op's name: a module class, an ATB op or a kernel name),
not IDs; either dump may be GOLDEN. Several names may map to one (`Prefill_layer` and
`Decoder_layer` above). Ops the file names are paired by these names and never by shape alone;
ops it does not name are paired as without a map.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from .comparison import CompareError


@dataclass(slots=True)
class OpMap:
    ops: dict[str, str] = field(default_factory=dict)           # left name -> right name
    outputs: dict[str, dict[int, int]] = field(default_factory=dict)   # left name -> {i: j}

    def canonical(self, name: str) -> str:
        """The name both sides share for `name`: the right-hand name of the map."""
        return self.ops.get(name, name)

    def names(self, name: str) -> bool:
        """Whether the map says anything about `name`."""
        return name in self.ops or name in self._right

    @property
    def _right(self) -> set[str]:
        return set(self.ops.values())

    def output_pairs(self, golden_name: str, target_name: str) -> dict[int, int] | None:
        """{golden output index: target output index} for a pair of ops, when the map has one."""
        if target_name in self.outputs:
            return {g: t for t, g in self.outputs[target_name].items()}
        if golden_name in self.outputs:
            return dict(self.outputs[golden_name])
        return None


def load_map(path: str) -> OpMap:
    """Read a map file; `CompareError` says what is wrong with it."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise CompareError(f"cannot read the map file {path}: {exc.strerror}") from None
    doc = _parse(path, text)
    if not isinstance(doc, dict) or not set(doc) <= {"ops", "outputs"}:
        raise CompareError(f"{path}: expected a mapping with the keys 'ops' (name: name) and, "
                           "optionally, 'outputs' (name: {index: index})")
    ops = doc.get("ops") or {}
    outputs = doc.get("outputs") or {}
    if not isinstance(ops, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                            for k, v in ops.items()):
        raise CompareError(f"{path}: 'ops' must map op names to op names, "
                           "e.g. Prefill_layer: LlamaDecoderLayer")
    if not isinstance(outputs, dict):
        raise CompareError(f"{path}: 'outputs' must map op names to {{index: index}}")
    parsed: dict[str, dict[int, int]] = {}
    for name, pairs in outputs.items():
        try:
            parsed[str(name)] = {int(k): int(v) for k, v in dict(pairs).items()}
        except (TypeError, ValueError):
            raise CompareError(f"{path}: outputs of {name!r} must map an output index to an "
                               "output index, e.g. {0: 0}") from None
    return OpMap(dict(ops), parsed)


def _parse(path: str, text: str):
    if os.path.splitext(path)[1].lower() == ".json":
        try:
            return json.loads(text)
        except ValueError as exc:
            raise CompareError(f"{path} is not valid JSON: {exc}") from None
    try:
        import yaml
    except ImportError:
        try:
            return json.loads(text)
        except ValueError:
            raise CompareError(f"{path}: reading YAML needs PyYAML (pip install "
                               "'atb-probe[tools]'), or write the map as JSON") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise CompareError(f"{path} is not valid YAML: {exc}") from None
