"""The built-in op maps (opmap.py describes the format), and the choice of one for two dumps.

Each `.yaml` file here describes one engine against `transformers` for the model families both
implement. `choose` reads them in name order and takes the first whose `recognise` names say
that one dump is its left side and the other its right side: the module classes a dump holds
tell the engine that made it (vLLM's `VocabParallelEmbedding`, `LogitsProcessor`, fused linear
layers) apart from `transformers`, whose modules are plain `torch.nn` ones.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from ..comparison import Role
from ..dumpreader import Dump
from ..opmap import OpMap, load_map

FOLDER = os.path.dirname(os.path.abspath(__file__))
BUILT_IN = "built in"


@dataclass(frozen=True, slots=True)
class Chosen:
    """The map in force for a comparison, and which dump is its left side (None: neither
    could be told, so only its op names apply)."""

    opmap: OpMap
    left: Role | None


def built_in() -> list[OpMap]:
    """Every built-in map, in file name order."""
    return [load_map(os.path.join(FOLDER, name), BUILT_IN)
            for name in sorted(os.listdir(FOLDER)) if name.endswith(".yaml")]


def op_names(dump: Dump) -> set[str]:
    """Every op name (module class, kernel name) a dump holds, at any depth."""
    return {name for rnd in dump.rounds for op in rnd.ops for name in op.op_name.split("/")}


def choose(g_names: set[str], t_names: set[str], user: OpMap | None = None,
           automatic: bool = True) -> Chosen | None:
    """The map for two dumps holding these op names (`op_names`): the built-in one that
    recognises them (when `automatic`), with the `user` map's entries over it; None when
    there is neither."""
    base = None
    if automatic:
        base = next((m for m in built_in() if m.left_role(g_names, t_names) is not None), None)
    if base is None and user is None:
        return None
    opmap = user if base is None else base if user is None else base.merged(user)
    return Chosen(opmap, opmap.left_role(g_names, t_names))
