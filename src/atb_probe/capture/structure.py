"""The structure files of SPEC §5: what each layer-level op holds (`info/layer`) and which
layer-level ops each model runs in a phase (`info/model`), with the rounds they describe.

`StructureFiles` owns every record of them: the node count written per layer file, the model
files and their rounds, and each round's list of layer-level ops (`RoundStructure`). The
recorder tells it about ops as they end (`child_done`, `layer_done`) and about rounds
(`end_round`); it hands finished documents to the writer as `JsonJob`s. No tensors here.
"""
from __future__ import annotations

import bisect
import threading
import time

from .. import layout
from ..record.jobs import JsonJob

# A model file is rewritten at most this often while rounds keep coming (see `ModelFile`).
MODEL_FILE_SECONDS = 1.0
_NOT_PARAM = frozenset({"inputs", "arguments", "outputs", "modulePath"})


class RoundStructure:
    """The layer-level ops one round ran, in order, as its model file lists them."""

    __slots__ = ("layer_nodes",)

    def __init__(self):
        self.layer_nodes: list[dict] = []


class StructureFiles:
    """Layer and model structure files of one process, written as ops and rounds end.

    `_lock` guards `_layer_files` and `_model_files`: model threads end layers and rounds
    concurrently when a server runs one model in several threads."""

    def __init__(self, sink):
        self.sink = sink
        # (model name, layer name, id) -> nodes written in that layer's structure file
        self._layer_files: dict[tuple[str, str, str], int] = {}
        # (model name, phase) -> its model file. Held here, not on the model: an engine may
        # drop its model before the probe closes, and the file's last rounds must still be
        # written then.
        self._model_files: dict[tuple[str, str], ModelFile] = {}
        self._lock = threading.Lock()

    def wants_layer(self, model_name: str, name: str, op_id: str, tracking: bool) -> bool:
        """Whether a layer-level op execution should collect its structure: its file is not
        written yet, or was written without children that this execution tracks."""
        written = self._layer_files.get((model_name, name, op_id))
        return written is None or (tracking and written == 0)

    def child_done(self, parent_record, frame) -> None:
        """An op below a layer-level op ended: it joins its parent's nodes."""
        if parent_record.nodes is None:
            parent_record.nodes = []
        parent_record.nodes.append(node_of(frame))

    def layer_done(self, rnd, structure: RoundStructure, frame, collect: bool) -> None:
        """A layer-level op execution ended: listed in the round's model file; its own file
        written when it holds more than the one on disk."""
        model = rnd.model
        if (model.name, rnd.phase) in self._model_files and not collect:
            return  # this phase's model file is written: nothing to describe
        node = node_of(frame)
        structure.layer_nodes.append({k: node[k] for k in (
            "opName", "opType", "modulePath", "inTensors", "outTensors") if k in node})
        if not collect:
            return
        key = (model.name, frame.name, frame.op_id)
        count = _count(node)
        with self._lock:
            if self._layer_files.get(key, -1) >= count:
                return
            self._layer_files[key] = count
        folder = layout.layer_info_dir(rnd.devpid, None if model.first else model.name)
        self.sink.put(JsonJob(folder, layout.layer_info_file(frame.name, frame.op_id), node))

    def end_round(self, rnd, structure: RoundStructure) -> None:
        """The round's model file: written at the first round of its model and phase that had
        layer-level ops; its `rounds` grow with every later round of that phase."""
        model = rnd.model
        with self._lock:  # threads serving one model end rounds side by side
            file = self._model_files.get((model.name, rnd.phase))
            if file is None:
                nodes = structure.layer_nodes
                if not nodes:
                    return
                doc = {"modelName": f"{model.name}_{rnd.phase}", "modelType": model.name,
                       "phase": rnd.phase, "param": _model_param(rnd.root_module)}
                plan = _parallel_plan(rnd.root_module)
                if plan:
                    doc["tpPlan"] = plan
                file = ModelFile(layout.model_info_dir(rnd.devpid),
                                 {**doc, "rounds": [], "nodes": nodes})
                self._model_files[model.name, rnd.phase] = file
                file.add_round(rnd.index)
                self._write_model_file(file)
            elif file.add_round(rnd.index):
                self._write_model_file(file)

    def flush(self, due_only: bool = False) -> None:
        """Write the model files whose `rounds` changed since they were last written (with
        `due_only`, those last written a second ago or more)."""
        with self._lock:
            for file in self._model_files.values():
                if file.due() if due_only else file.dirty:
                    self._write_model_file(file)

    def pending(self) -> int:
        """How many model files hold rounds not yet handed to the writer."""
        return sum(file.dirty for file in list(self._model_files.values()))

    def after_fork(self) -> None:
        """A forked child writes structure files of its own, into its own folders."""
        self._lock = threading.Lock()
        self._layer_files.clear()
        self._model_files.clear()

    def _write_model_file(self, file: ModelFile) -> None:
        """(Holding `_lock`.) Queue the model file as it is now."""
        file.dirty = False
        file.written_at = time.monotonic()
        # Serialised later, on the writer thread: hand over a copy of what keeps changing.
        doc = dict(file.doc, rounds=[list(r) for r in file.doc["rounds"]])
        self.sink.put(JsonJob(file.folder, layout.model_info_file(doc["modelType"],
                                                                  doc["phase"]), doc))


class ModelFile:
    """One `info/model` document and the rounds it describes, as inclusive `[first, last]`
    ranges: a service dumping for hours keeps a short list.

    It is written when first made; a later round marks it dirty, and it is rewritten at most
    every `MODEL_FILE_SECONDS` (by the round that finds it due, else by the probe's background
    thread: `flush(due_only=True)`) and when the probe closes, so a decode loop, or an engine
    whose steps interleave several models, does not rewrite it on every round."""

    __slots__ = ("folder", "doc", "dirty", "written_at")

    def __init__(self, folder: str, doc: dict):
        self.folder = folder  # info/model/<dev>_<pid>
        self.doc = doc
        self.dirty = False
        self.written_at = 0.0

    def add_round(self, index: int) -> bool:
        """Record round `index` (rounds of threads serving one model end in any order); whether
        the file should be written now."""
        ranges = self.doc["rounds"]  # sorted, disjoint, never adjacent
        i = bisect.bisect_left(ranges, [index, index])
        before = ranges[i - 1] if i else None
        after = ranges[i] if i < len(ranges) else None
        if (before and index <= before[1]) or (after and after[0] == index):
            return False
        joins_before = before is not None and before[1] + 1 == index
        joins_after = after is not None and after[0] == index + 1
        if joins_before and joins_after:
            before[1] = after[1]
            del ranges[i]
        elif joins_before:
            before[1] = index
        elif joins_after:
            after[0] = index
        else:
            ranges.insert(i, [index, index])
        self.dirty = True
        return self.due()

    def due(self) -> bool:
        """Whether the file is dirty and was last written `MODEL_FILE_SECONDS` ago or more."""
        return self.dirty and time.monotonic() - self.written_at >= MODEL_FILE_SECONDS


def node_of(frame) -> dict:
    """An op as a structure file's node: its name, parameters, tensors and children."""
    name = f"{frame.name}_{frame.op_id}"
    record = frame.record
    inputs = outputs = 0
    param, nodes = None, None
    if record is not None:
        inputs, outputs, param, nodes = record.inputs, record.outputs, record.param, \
            record.nodes
    node = {
        "opName": name,
        "opType": frame.name,
        "param": {k: v for k, v in (param or {}).items() if k not in _NOT_PARAM},
        "inTensors": [f"{name}_input_{i}" for i in range(inputs)],
        "outTensors": [f"{name}_output_{i}" for i in range(outputs)],
        "internalTensors": [],
        "nodes": nodes or [],
    }
    if frame.path is not None:
        node["modulePath"] = frame.path
    return node


def _count(node: dict) -> int:
    return sum(1 + _count(n) for n in node["nodes"])


def _parallel_plan(root) -> dict:
    """The tensor-parallel plan in effect (module path pattern -> style, as `transformers`
    keeps it in `tp_plan`) of a model whose weights are split over ranks (`DTensor`s); {} for
    any other. compare joins the ranks' pieces by it (tools/shards.py)."""
    root = getattr(root, "_orig_mod", root)
    try:
        plan = getattr(root, "tp_plan", None)
        if not isinstance(plan, dict) or not plan:
            return {}
        if not any(type(p).__name__ == "DTensor" for p in root.parameters()):
            return {}
        return {str(k): str(v) for k, v in plan.items()}
    except Exception:
        return {}


def _model_param(root) -> dict:
    """The model's configuration (a transformers config as a dict), else {}."""
    root = getattr(root, "_orig_mod", root)
    config = getattr(root, "config", None)
    try:
        return config.to_dict() if hasattr(config, "to_dict") else (
            dict(vars(config)) if config is not None else {})
    except Exception:
        return {}
