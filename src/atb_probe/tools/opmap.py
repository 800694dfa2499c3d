"""Op maps: how the ops and tensors of one implementation of a model are those of another.

Two implementations of one model name and call the same computation differently. An ATB graph
says `Prefill_layer` where PyTorch says `LlamaDecoderLayer`; vLLM's decoder layer is called
`(positions, hidden_states, residual)` and returns `(hidden_states, residual)`, the residual add
fused into the next norm, where `transformers`' layer takes and returns the residual stream; vLLM
computes q, k and v in one fused projection. A map file, YAML or JSON, describes such conventions
as data. Its two sides are called *left* and *right*; either dump may be GOLDEN::

    name: vLLM against transformers     # optional: how compare names the map
    sides: [vLLM, transformers]         # optional: what the left and right sides are
    recognise:                          # optional: op names that only a dump of that side holds
      left: [VocabParallelEmbedding, LogitsProcessor]
      right: [Embedding]
    ops:                                # a left op name: the right op name (or a list of them)
      VocabParallelEmbedding: Embedding
      RMSNorm: [LlamaRMSNorm, Qwen2RMSNorm]
      LlamaDecoderLayer: LlamaDecoderLayer    # same name, another implementation
    none:                               # ops with no counterpart on the other side: op names,
      - Sampler                         # or `.attr` for the last part of a module path
      - .rotary_emb
    kernels: false                      # below two ops paired by the map, pair modules only
    fused:                              # a left child module (by attribute name) that computes
      qkv_proj: [q_proj, k_proj, v_proj]    # several right ones (one: the same module renamed)
      block_sparse_moe: [mlp]
    opaque: [MixtralMoE]                # ops compared as a whole: their children are not paired
    tensors:                            # a left op name (or `Left:Right`, for that pair only):
      LlamaDecoderLayer:                # [left tensor, right tensor] pairs
        - [{sum: [input.1, input.2]}, input.0]
        - [{sum: [output.0, output.1]}, output.0]
      QKVParallelLinear:
        - [input.0, q_proj/input.0]
        - [output.0, {concat: [q_proj/output.0, k_proj/output.0, v_proj/output.0], dim: -1}]
    outputs:                            # a left op name: {its output index: the right's}
      LmHead: {0: 0}

Op names are the last part of an op's name (a module class, an ATB op or a kernel name), not
IDs; several names may map to one. Ops the map names are paired by these names, never by shape
alone; a pair of equal names the map names is two implementations (compared like any pair the
map made: size-1 dimensions do not count). Ops it does not name are paired as without a map.

A tensor is `input.N` or `output.N` (N: the index's leading number, or the parameter name after
it: `input.hidden_states`), optionally behind `attr/`, a module of the pair's fused group (the
right ops of a `fused` entry, by the last part of their module paths). A tensor may be *derived*
from tensors of its op before it is compared:

- `{sum: [a, b]}`: their element-wise sum. A missing part is left out (vLLM passes the first
  layer no residual), so one part left is that tensor itself.
- `{concat: [a, b], dim: -1}`: their concatenation along `dim` (every part must exist).
- `{slice: a, dim: -1, start: 0, stop: 128}`: a part of one tensor.

An op with a `tensors` entry is compared by those pairs only; its other tensors, the ops that
`none` names, the children of a fused pair or of an `opaque` op, and (with `kernels: false`) the
kernels below two ops the map paired are listed as having no counterpart by convention, not as
unmatched. Which dump is the left side: the one
holding a `recognise.left` name (and, when given, the other holding a `recognise.right` one);
without `recognise`, the one holding names that only the left of `ops` has.

Built-in maps (the `conventions` package next to this file) describe engines against
`transformers`; it chooses one from the op names of the two dumps.
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field, replace


from ..layout import Side
from ..statcsv import Stats, parse_shape, shape_cell
from .comparison import CompareError, DeriveKind, Derivation, Role
from .dumpreader import Op, TensorRecord

_KEYS = {"name", "sides", "recognise", "ops", "none", "kernels", "fused", "opaque", "tensors",
         "outputs"}
_TENSOR = re.compile(r"(?:(\w+)/)?(input|output)\.(\w+)")


@dataclass(frozen=True, slots=True)
class TensorKey:
    """A tensor of an op, as a map names it: `[attr/]input.1`, `output.hidden_states`."""

    module: str                  # "": the op itself; else a module of the fused group
    io: Side
    index: str                   # `1` or `hidden_states`

    @classmethod
    def parse(cls, text) -> TensorKey:
        match = _TENSOR.fullmatch(text) if isinstance(text, str) else None
        if match is None:
            raise ValueError(f"{text!r} is not a tensor: write input.N or output.N, "
                             "optionally behind a module name (q_proj/output.0)")
        return cls(match[1] or "", Side(match[2]), match[3])

    def matches(self, io, index: str) -> bool:
        """Whether a recorded tensor (its side and Index cell) is this one."""
        if io != self.io:
            return False
        number, _, name = index.partition("_")
        return self.index in (index, number, name)

    @property
    def text(self) -> str:
        return f"{self.module}/{self.io}.{self.index}" if self.module \
            else f"{self.io}.{self.index}"


@dataclass(frozen=True, slots=True)
class Expr:
    """A map's tensor: one recorded tensor (`derive` None), or one derived from several."""

    parts: tuple[TensorKey, ...]
    derive: Derivation | None = None

    @classmethod
    def parse(cls, value) -> Expr:
        if not isinstance(value, dict):
            return cls((TensorKey.parse(value),))
        kinds = [k for k in DeriveKind if k.value in value]
        if len(kinds) != 1:
            raise ValueError(f"{value!r}: a derived tensor has one of sum, concat, slice")
        kind = kinds[0]
        extra = set(value) - {kind.value, "dim", "start", "stop"}
        if extra:
            raise ValueError(f"{value!r}: unknown key {sorted(extra)[0]!r}")
        args = value[kind.value]
        if kind == DeriveKind.SLICE:
            parts = (TensorKey.parse(args),)
        elif isinstance(args, list) and args:
            parts = tuple(TensorKey.parse(a) for a in args)
        else:
            raise ValueError(f"{value!r}: {kind} takes a list of tensors")
        numbers = {k: value.get(k) for k in ("dim", "start", "stop")}
        if not all(v is None or (isinstance(v, int) and not isinstance(v, bool))
                   for v in numbers.values()):
            raise ValueError(f"{value!r}: dim, start and stop are integers")
        return cls(parts, Derivation(kind, -1 if numbers["dim"] is None else numbers["dim"],
                                     numbers["start"], numbers["stop"]))

    def text(self, parts: list[str]) -> str:
        """How a derived tensor is named, from its parts' names."""
        if self.derive is None:
            return parts[0]
        if self.derive.kind == DeriveKind.SUM:
            return "+".join(parts)
        dim = "" if self.derive.dim == -1 else f",dim={self.derive.dim}"
        if self.derive.kind == DeriveKind.CONCAT:
            return f"cat({','.join(parts)}{dim})"
        start = "" if self.derive.start is None else self.derive.start
        stop = "" if self.derive.stop is None else self.derive.stop
        return f"{parts[0]}[{start}:{stop}{dim}]"


@dataclass(frozen=True, slots=True)
class TensorRule:
    """A pair of tensors to compare: the left op's and the right op's."""

    left: Expr
    right: Expr

    def of(self, side_is_left: bool) -> Expr:
        return self.left if side_is_left else self.right


@dataclass(slots=True)
class OpMap:
    """A parsed map file (or several merged: `merged`); empty, it changes nothing."""

    ops: dict[str, tuple[str, ...]] = field(default_factory=dict)    # left -> right names
    outputs: dict[str, dict[int, int]] = field(default_factory=dict)  # left name -> {i: j}
    name: str = ""
    sides: tuple[str, str] = ("left", "right")
    recognise: tuple[frozenset, frozenset] = (frozenset(), frozenset())
    none: frozenset = frozenset()                  # op names and `.attr` module names
    kernels: bool = True
    fused: dict[str, tuple[str, ...]] = field(default_factory=dict)  # left attr -> right attrs
    opaque: frozenset = frozenset()                # op names compared without their children
    tensors: dict[str, tuple[TensorRule, ...]] = field(default_factory=dict)
    source: str = ""                               # the file, or `built in`
    _groups: dict[str, str] = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        self.ops = {k: (v,) if isinstance(v, str) else tuple(v) for k, v in self.ops.items()}
        self._groups = self._group_names()

    def _group_names(self) -> dict[str, str]:
        """Each name the map pairs: the one name of its group (names paired with each other,
        directly or through a third) that stands for all of them, a right-hand name."""
        parent: dict[str, str] = {}

        def find(x: str) -> str:
            while parent.setdefault(x, x) != x:
                x = parent[x]
            return x
        for left, rights in self.ops.items():
            for right in rights:
                a, b = find(right), find(left)
                if a != b:
                    parent[b] = a
        return {name: find(name) for name in parent}

    def canonical(self, name: str) -> str:
        """The name both sides share for `name`: a right-hand name of the map."""
        return self._groups.get(name, name)

    def names(self, name: str) -> bool:
        """Whether the map pairs `name` with something."""
        return name in self._groups

    def output_pairs(self, golden_name: str, target_name: str) -> dict[int, int] | None:
        """{golden output index: target output index} for a pair of ops, when the map has one."""
        if target_name in self.outputs:
            return {g: t for t, g in self.outputs[target_name].items()}
        if golden_name in self.outputs:
            return dict(self.outputs[golden_name])
        return None

    def has_none(self, name: str, module: str | None) -> bool:
        """Whether an op (its name, its module path) has no counterpart by convention."""
        return name in self.none or (
            module is not None and "." + module.rsplit(".", 1)[-1] in self.none)

    def rules(self, left: str, right: str) -> tuple[TensorRule, ...] | None:
        """The tensor pairs of a left op and a right op, when the map has them."""
        return self.tensors.get(f"{left}:{right}") or self.tensors.get(left)

    def left_role(self, golden: set[str], target: set[str]) -> Role | None:
        """Which dump, by the op names it holds, is the map's left side; None: neither is
        (or both are) by the map's `recognise` (else by the names only the left of `ops`
        has)."""
        marks, others = self.recognise
        if not marks:
            rights = {r for rs in self.ops.values() for r in rs}
            marks = frozenset(self.ops) - rights
        g, t = bool(golden & marks), bool(target & marks)
        if g == t:
            return None
        left, other = (Role.GOLDEN, target) if g else (Role.TARGET, golden)
        if others and not other & others:
            return None
        return left

    def title(self) -> str:
        """How compare names the map in force: `vLLM against transformers (built in)`."""
        return f"{self.name} ({self.source})" if self.name else self.source

    def merged(self, user: OpMap) -> OpMap:
        """This map with `user`'s entries added; where both say something of one name,
        `user`'s."""
        return _merged(self, user)


def _merged(base: OpMap, user: OpMap) -> OpMap:
    return replace(
        base, ops={**base.ops, **user.ops}, outputs={**base.outputs, **user.outputs},
        name=user.name or base.name,
        sides=user.sides if user.sides != ("left", "right") else base.sides,
        recognise=user.recognise if any(user.recognise) else base.recognise,
        none=base.none | user.none, kernels=base.kernels and user.kernels,
        fused={**base.fused, **user.fused}, opaque=base.opaque | user.opaque,
        tensors={**base.tensors, **user.tensors},
        source=f"{base.source} and {user.source}")


def load_map(path: str, source: str | None = None) -> OpMap:
    """Read a map file; `CompareError` says what is wrong with it."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise CompareError(f"cannot read the map file {path}: {exc.strerror}") from None
    doc = _parse(path, text)
    if not isinstance(doc, dict) or not set(doc) <= _KEYS:
        raise CompareError(f"{path}: expected a mapping with the keys 'ops' (name: name) and, "
                           "optionally, 'outputs' (name: {index: index}), 'tensors', 'fused', "
                           "'none', 'kernels', 'recognise', 'sides', 'name' (see "
                           "docs/analysis.md)")
    try:
        return _build(doc, source or path)
    except ValueError as exc:
        raise CompareError(f"{path}: {exc}") from None


def _build(doc: dict, source: str) -> OpMap:
    ops = doc.get("ops") or {}
    if not isinstance(ops, dict) or not all(
            isinstance(k, str) and (isinstance(v, str) or _strings(v)) for k, v in ops.items()):
        raise ValueError("'ops' must map op names to op names, e.g. Prefill_layer: "
                         "LlamaDecoderLayer")
    outputs = doc.get("outputs") or {}
    if not isinstance(outputs, dict):
        raise ValueError("'outputs' must map op names to {index: index}")
    parsed: dict[str, dict[int, int]] = {}
    for name, pairs in outputs.items():
        try:
            parsed[str(name)] = {int(k): int(v) for k, v in dict(pairs).items()}
        except (TypeError, ValueError):
            raise ValueError(f"outputs of {name!r} must map an output index to an output "
                             "index, e.g. {0: 0}") from None
    sides = doc.get("sides") or ["left", "right"]
    if not _strings(sides) or len(sides) != 2:
        raise ValueError("'sides' names the left and the right side: [vLLM, transformers]")
    recognise = doc.get("recognise") or {}
    if not isinstance(recognise, dict) or not set(recognise) <= {"left", "right"} or \
            not all(_strings(v) for v in recognise.values()):
        raise ValueError("'recognise' has 'left' and 'right', each a list of op names")
    none = doc.get("none") or []
    if not _strings(none):
        raise ValueError("'none' is a list of op names (or .attr module names)")
    kernels = doc.get("kernels", True)
    if not isinstance(kernels, bool):
        raise ValueError("'kernels' is true or false")
    fused = doc.get("fused") or {}
    if not isinstance(fused, dict) or not all(
            isinstance(k, str) and _strings(v) and v for k, v in fused.items()):
        raise ValueError("'fused' maps a module name to a list of module names, e.g. "
                         "qkv_proj: [q_proj, k_proj, v_proj]")
    opaque = doc.get("opaque") or []
    if not _strings(opaque):
        raise ValueError("'opaque' is a list of op names")
    tensors = doc.get("tensors") or {}
    if not isinstance(tensors, dict):
        raise ValueError("'tensors' maps op names to lists of [left, right] tensor pairs")
    rules: dict[str, tuple[TensorRule, ...]] = {}
    for name, pairs in tensors.items():
        if not isinstance(pairs, list) or not all(
                isinstance(p, list) and len(p) == 2 for p in pairs):
            raise ValueError(f"tensors of {name!r}: a list of [left, right] tensor pairs, e.g. "
                             "[output.0, output.0]")
        try:
            rules[str(name)] = tuple(TensorRule(Expr.parse(a), Expr.parse(b))
                                     for a, b in pairs)
        except ValueError as exc:
            raise ValueError(f"tensors of {name!r}: {exc}") from None
    name = doc.get("name") or ""
    if not isinstance(name, str):
        raise ValueError("'name' is a text")
    return OpMap(dict(ops), parsed, name, tuple(sides),
                 (frozenset(recognise.get("left") or ()), frozenset(recognise.get("right") or ())),
                 frozenset(none), kernels, {k: tuple(v) for k, v in fused.items()},
                 frozenset(opaque), rules, source)


def _strings(value) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


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


@dataclass(slots=True)
class DerivedTensor:
    """A tensor computed from recorded tensors of one side before it is compared. It answers
    what the comparison asks of a `dumpreader.TensorRecord`; its values are `derive` applied to
    its parts' (compare.py)."""

    parts: list[TensorRecord]
    derive: Derivation
    data_name: str               # `1_LlamaDecoderLayer/output.0+output.1`
    shape: str
    stats: Stats | None
    path = None                  # no file of its own
    uninitialized = False

    @classmethod
    def of(cls, expr: Expr, parts: list[TensorRecord], names: list[str]) -> DerivedTensor:
        """The tensor `expr` derives from `parts` (named `names` in its name)."""
        cells = [p.shape for p in parts]
        try:
            shape = shape_cell(expr.derive.shape([parse_shape(c) for c in cells]))
            sizes = [math.prod(parse_shape(c)) for c in cells]
        except (ValueError, IndexError):
            shape, sizes = "?", [0] * len(parts)
        made = cls(parts, expr.derive, f"{parts[0].op_path}/{expr.text(names)}", shape, None)
        made.stats = expr.derive.stats([p.stats for p in parts], sizes) or \
            made.request_stats("")
        return made

    def request_stats(self, request: str) -> Stats | None:
        """The statistics the probe measured of this tensor over one request's tokens (`""`:
        all of it): those of a sum of two tensors of one op side, in derived_statistic.csv
        (capture/sums.py); None for another derived tensor, or a round without them."""
        parts = self.parts
        if self.derive.kind != DeriveKind.SUM or len(parts) != 2 or \
                parts[0].op_id != parts[1].op_id or parts[0].io != parts[1].io:
            return None
        first, second = parts[0].index, parts[1].index
        look = getattr(self.round, "derived_stats", None)  # None: records not read from a dump
        if look is None:
            return None
        return look(parts[0].op_id, parts[0].io, f"{first}+{second}", request) or \
            look(parts[0].op_id, parts[0].io, f"{second}+{first}", request)

    @property
    def round(self):
        return self.parts[0].round

    @property
    def dtype(self) -> str:
        return self.parts[0].dtype

    @property
    def order(self) -> int:
        return self.parts[0].order

    @property
    def layer(self) -> str:
        return self.parts[0].layer

    @property
    def io(self):
        return self.parts[0].io


Tensor = TensorRecord | DerivedTensor


def resolve(expr: Expr, op: Op, group: dict[str, Op]) -> Tensor | None:
    """The tensor `expr` names on `op` (and on the ops of its fused group, by module name);
    None when a part it needs is not there."""
    found: list[TensorRecord] = []
    names: list[str] = []
    for key in expr.parts:
        owner = group.get(key.module) if key.module else op
        record = None if owner is None else next(
            (t for t in owner.tensors if key.matches(t.io, t.index)), None)
        if record is not None:
            found.append(record)
            names.append(f"{key.module}:{record.io}.{record.index}" if key.module
                         else f"{record.io}.{record.index}")
        elif expr.derive is None or expr.derive.kind != DeriveKind.SUM:
            return None
    if not found:
        return None
    if len(found) == 1 and (expr.derive is None or expr.derive.kind == DeriveKind.SUM):
        return found[0]
    return DerivedTensor.of(expr, found, names)
