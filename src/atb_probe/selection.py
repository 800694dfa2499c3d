"""Which rounds and ops are written (SPEC §3 "Selection"); pure, no torch.

Ops are identified by their full ID (`2_1_0`) and full name (`LlamaDecoderLayer/LlamaAttention/
Linear`). A `Selection` answers three questions the capture layer asks as it walks the call tree:

* `round_selected(round, device)`: does this round get dumped at all (exec_range, device)?
* `layer_plan(layer_id, layer_name)`: for a layer-level op, is it written, and must its children
  be tracked (given IDs, kernels captured) because something below it may be selected?
* `child_selected(...)`: for an op below a layer-level op, is it written?

Child IDs count kernels, so a layer whose children are tracked always has its kernels captured:
the same config always yields the same IDs, whatever else it selects.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from .config import DumpConfig


@dataclass(frozen=True)
class LayerPlan:
    dump: bool            # write the layer-level op's own tensors
    dump_children: bool   # everything below is written (save_child on a selected layer)
    track_children: bool  # give children IDs and capture kernels


SKIP_LAYER = LayerPlan(False, False, False)


class ChildChoice(NamedTuple):
    """What the selection wants of an op below a layer-level op."""

    dump: bool            # write the op's own tensors
    dump_children: bool   # everything below it is written


_EVERYTHING = ChildChoice(True, True)
_ITSELF = ChildChoice(True, False)
_NOTHING = ChildChoice(False, False)


class Selection:
    """The selection rules of one configuration."""

    def __init__(self, config: DumpConfig):
        self.config = config
        self._by_default = not config.ids and not config.op_name
        self._ids = frozenset(config.ids)
        self._id_prefixes = tuple(i + "_" for i in config.ids)

    def round_selected(self, round_index: int, device: int) -> bool:
        cfg = self.config
        if not cfg.dump_enable or round_index not in cfg.exec_range:
            return False
        return not cfg.device or device in cfg.device

    def layer_plan(self, layer_id: str, layer_name: str) -> LayerPlan:
        cfg = self.config
        if self._by_default:
            return LayerPlan(True, cfg.save_child, cfg.save_child)
        dump = self.op_matches(layer_id, layer_name, layer_name)
        dump_children = dump and cfg.save_child
        # Anything below may match a name; an ID below this layer may be listed.
        track = dump_children or bool(cfg.op_name) or any(
            i.startswith(layer_id + "_") for i in self._ids)
        return LayerPlan(dump, dump_children, track)

    def child_selected(self, op_id: str, full_name: str, own_name: str,
                       ancestor_dumps_children: bool) -> ChildChoice:
        """For an op below a layer-level op: is it written, and everything below it?"""
        if ancestor_dumps_children:
            return _EVERYTHING
        if self._by_default or not self.op_matches(op_id, full_name, own_name):
            return _NOTHING
        return _EVERYTHING if self.config.save_child else _ITSELF

    def op_matches(self, op_id: str, full_name: str, own_name: str) -> bool:
        """Whether `ids` or `op_name` names this op itself (inheritance is the caller's)."""
        cfg = self.config
        if op_id in self._ids:
            return True
        if cfg.save_child and op_id.startswith(self._id_prefixes):
            return True
        if not cfg.op_name:
            return False
        own = own_name.lower()
        if not cfg.save_child:
            return own.startswith(cfg.op_name)
        full = full_name.lower()
        return any(full.startswith(p) or ("/" + p) in full for p in cfg.op_name)
