"""The call tree's records: the frames on a thread's op stack and the round being run.

They hold what capture decided (IDs, names, folders, what the selection wants) and carry the
recorder's records (`OpFrame.layer`, `OpFrame.record`, `RoundRun.record`) without reading them.
Pure: no torch.
"""
from __future__ import annotations

import enum

from ..rounds import Phase, RoundStart


class Below(enum.Enum):
    """What happens to the module calls made inside an op (a frame on the op stack)."""

    UNSEEN = "unseen"        # straight to the original __call__: nothing below is seen
    CONTAINER = "container"  # the container rule: containers, or layer-level ops (SPEC §1)
    TRACK = "track"          # children: IDs handed out, kernels captured


class Frame:
    """An entry of a thread's op stack that is not an op: a root or a container, or a call
    whose inside is not seen. `below` says what happens to the calls made inside it; `wraps`,
    for a `torch.compile` wrapper's call, the module it wraps, whose own call inside it is
    the same op (or container) and gets no frame."""

    __slots__ = ("below", "wraps")

    def __init__(self, below: Below, wraps=None):
        self.below = below
        self.wraps = wraps


class OpFrame(Frame):
    """One op execution on a thread's op stack: where it is, what the selection wants of it
    (`dump` its own tensors, `dump_children` everything below), what happens `below` it, and
    the recorder's records it carries (`layer`: the layer-level op execution's, `record`: its
    own; None when nothing of it is recorded)."""

    __slots__ = ("op_id", "name", "full_name", "rel", "children", "dump", "dump_children",
                 "collect", "layer", "path", "record")

    def __init__(self, op_id: str, name: str, full_name: str, rel: str, dump: bool,
                 dump_children: bool, below: Below, layer, collect: bool, path=None,
                 wraps=None):
        self.below = below
        self.wraps = wraps
        self.op_id = op_id
        self.name = name
        self.full_name = full_name
        self.rel = rel                # op folder relative to the round folder
        self.children = 0             # child IDs handed out so far
        self.dump = dump
        self.dump_children = dump_children
        self.collect = collect        # the layer-level op execution's structure is collected
        self.layer = layer            # the recorder's record of that execution
        self.path = path              # modules: the attribute path from the root (modulePath)
        self.record = None


class RoundRun:
    """One round as it runs: a root call, or every root call of one engine step
    (`Steps.begin`); its number, the selection it runs under, its model and phase, and
    its progress. `record`: the recorder's record of it, when it is dumped."""

    __slots__ = ("index", "selection", "devpid", "dumping", "layer_count", "layer_names",
                 "phase", "root_module", "model", "selected", "roots", "main", "record")

    def __init__(self, start: RoundStart, model):
        self.index = start.index
        self.selection = start.selection
        self.devpid = start.devpid
        self.dumping = start.dumping
        self.layer_count = 0
        self.layer_names = []      # the distinct layer-level op names, in order (for warnings)
        self.phase = Phase.FORWARD
        self.root_module = None
        self.model = model
        self.selected = 0          # ops the selection chose in this round
        self.roots = 0             # root calls made in it so far (more than one in a step)
        self.main = False          # `model` holds block lists: the step's main model
        self.record = None
