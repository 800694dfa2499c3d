"""From an op's tensors to records: `.bin` files, statistic.csv rows, op_param.json and the
structure files of SPEC §5, all handed to the background writer.

Everything here runs on the model thread, so it does only what cannot wait. Per op side it
takes the IDs, looks the tensors' statistics up (statscache) and appends one side record
(statcsv.py) to the layer-level op execution's; statistics that are not known yet are queued
and computed in one batch when the execution ends, or at once where the probe does not see the
kernels that could change the tensors before then. Tensor files need a private copy of the
bytes at once (on an accelerator: a copy to pinned memory that the writer waits for). A
layer-level op execution's rows join its round's at its end, and a round's rows are handed to
the writer when the round ends (sooner in a long round: `_RoundRows`); formatting, encoding and
disk I/O happen there.
"""
from __future__ import annotations

import bisect
import threading
import time
import weakref
from functools import lru_cache

import torch

from .. import layout, log
from ..binfile import encode_header, encode_reference
from ..naming import sanitize
from ..statcsv import FILE_NAME as CSV_FILE, HEADER, NA, shape_cell
from .arguments import bind_args
from .statscache import Queue, StatsCache
from .tensors import (DUMPABLE_DTYPES, dumpable_dtype, flatten, host_bytes, local_of,
                      may_hold_tensor, same_bytes_key)

MAX_PARAM_SHAPES = 256
_STRIDED = torch.strided
# Bytes of tensors a layer execution keeps alive for statistics computed at its end; beyond
# this they are computed at once.
MAX_PENDING_BYTES = 64 * 1024 ** 2


class Recorder:
    """Writes what the call tree decided to dump to `sink` (the probe's background writer)."""

    def __init__(self, sink):
        self.sink = sink
        self._static: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        # (model name, layer name, id) -> nodes written in that layer's structure file
        self._layer_files: dict[tuple[str, str, str], int] = {}
        # (model name, phase) -> its model file. Held here, not on the model: an engine may
        # drop its model before the probe closes, and the file's last rounds must still be
        # written then.
        self._model_files: dict[tuple[str, str], ModelFile] = {}
        # Guards `_layer_files` and `_model_files`: model threads end layers and rounds
        # concurrently when a server runs one model in several threads.
        self._structure_lock = threading.Lock()
        self.stats = StatsCache()
        self._round_rows = _RoundRows()

    # -- module ops -------------------------------------------------------------------------

    def module_inputs(self, rnd, frame, module, info, args, kwargs, named: bool) -> None:
        if not (frame.dump or _collecting(frame)):
            return
        pairs = bind_args(info.params, args, kwargs)
        # op_param.json (tensor tasks) and the structure files describe the arguments;
        # otherwise only the tensors matter.
        describe = rnd.config.wants_tensors or _collecting(frame)
        items, params = [], {}
        if describe:
            for name, value in pairs:
                flatten(value, name, items, params, name_items=True)
        else:
            _tensors_of(pairs, items)
        frame.inputs = len(items)
        labels = self.write_side(rnd, frame, "input", items, named, kernel=False) \
            if frame.dump else []
        if describe:
            frame.param = dict(self.static_param(module), modulePath=frame.path, args=params,
                               inputs=labels)

    def module_outputs(self, rnd, frame, out, named: bool) -> None:
        if not (frame.dump or _collecting(frame)):
            return
        items = [("", out)] if isinstance(out, torch.Tensor) else _output_items(out)
        frame.outputs = len(items)
        if frame.dump:
            labels = self.write_side(rnd, frame, "output", items, named, kernel=False)
            if rnd.config.wants_tensors:
                doc = frame.param
                doc["outputs"] = labels
                if frame.shards:
                    doc["dtensors"] = frame.shards
                self.sink.put_json(f"{rnd.rel}/{frame.rel}", layout.OP_PARAM, doc)

    def static_param(self, module) -> dict:
        """The module's configuration: class, extra_repr, dtype and parameter shapes."""
        doc = self._static.get(module)
        if doc is None:
            shapes, dtype = {}, None
            for i, (name, p) in enumerate(module.named_parameters()):
                if i >= MAX_PARAM_SHAPES:
                    shapes["..."] = "more parameters not listed"
                    break
                shapes[name] = list(p.shape)
                dtype = dtype or str(p.dtype).rpartition(".")[2]
            try:
                extra = module.extra_repr()
            except Exception:
                extra = ""
            doc = {"type": type(module).__name__,
                   "class": f"{type(module).__module__}.{type(module).__qualname__}",
                   "extra_repr": extra, "dtype": dtype, "parameters": shapes}
            self._static[module] = doc
        return doc

    # -- kernels ----------------------------------------------------------------------------

    def kernel_inputs(self, rnd, frame, op_name: str, pairs) -> None:
        items = []
        # op_param.json (tensor tasks) and the structure files describe the kernel's arguments;
        # otherwise only its tensors matter.
        describe = frame.dump and (rnd.config.wants_tensors or frame.layer.collect)
        if describe:
            params, arg_names = {}, []
            for name, value in pairs:
                before = len(items)
                flatten(value, name, items, params, name_items=True)
                arg_names.extend(label for label, _ in items[before:])
        else:
            _tensors_of(pairs, items)
        frame.inputs = len(items)
        if frame.dump:
            self.write_side(rnd, frame, "input", items, named=False, kernel=True)
            if describe:
                frame.param = {"op": op_name, "type": frame.name,
                               "inputs": {f"intensor{i}": n for i, n in enumerate(arg_names)},
                               "args": params}

    def kernel_outputs(self, rnd, frame, op_name: str, out, written: list) -> None:
        """A kernel's outputs: what it returned, then the arguments it wrote (`written`: their
        (name, tensor), values after the kernel)."""
        # Most kernels return one tensor.
        items = [("", out)] if isinstance(out, torch.Tensor) else _output_items(out)
        returned = len(items)
        if written:
            items += written
        frame.outputs = len(items)
        if not frame.dump:
            return
        self.write_side(rnd, frame, "output", items, named=False, kernel=True)
        uninit = _uninitialized(frame.layer, items, frame.writes_args)
        if rnd.config.wants_tensors:
            param = frame.param
            param["outputs"] = [layout.tensor_name("output", i) for i in range(len(items))]
            if written:
                param["written"] = {layout.tensor_name("output", returned + i): name
                                    for i, (name, _) in enumerate(written)}
            if frame.shards:
                param["dtensors"] = frame.shards
        elif uninit:  # the one thing the tools must know of a statistics dump's kernel
            param = {"op": op_name, "type": frame.name}
        else:
            return
        if uninit:
            param["uninitialized"] = uninit
        self.sink.put_json(f"{rnd.rel}/{frame.rel}", layout.OP_PARAM, param)

    def forget_written(self, layer, pairs, written: tuple) -> None:
        """An in-place kernel is about to change these tensors: statistics still pending are
        computed now, their bytes on disk are no longer theirs, and their memory is no longer
        uninitialised."""
        if layer is None:
            return
        if layer.pending is not None:
            layer.pending.resolve()
        if not (layer.written or layer.uninit):
            return
        for name, value in pairs:
            if name not in written:
                continue
            for t in value if isinstance(value, (tuple, list)) else (value,):
                key = same_bytes_key(t) if isinstance(t, torch.Tensor) else None
                if key is not None:
                    for k in [k for k in layer.written if k[2] == key[2]]:
                        del layer.written[k]
                    if layer.uninit:
                        layer.uninit.discard(key[2])

    # -- tensors ----------------------------------------------------------------------------

    def write_side(self, rnd, frame, side: str, items, named: bool, kernel: bool) -> list[str]:
        """Record one side (inputs or outputs) of an op: its statistic.csv rows join the
        layer execution's, statistics pending (see statscache), files queued; returns the
        index labels."""
        cfg = rnd.config
        kept, tensors = [], []
        for i, (label, t) in enumerate(items):
            cls = type(t)
            if cls is torch.Tensor and t.layout is _STRIDED and not t.is_meta and \
                    not t.is_nested:  # `dumpable_dtype` of a plain tensor, inline
                dt = DUMPABLE_DTYPES.get(t.dtype)
            else:
                if cls is not torch.Tensor and cls is not torch.nn.Parameter:
                    t, meta = local_of(t)
                    if meta is not None:
                        _describe_shard(frame, side, i, label if named else "", meta)
                dt = dumpable_dtype(t)
            if dt is not None:
                kept.append((i, label, t, dt))
                tensors.append(t)
            else:
                _skipped(t, frame)
        layer = frame.layer
        if cfg.wants_statistics or (kernel and cfg.save_child and cfg.filter_level >= 2):
            queue = _queue(layer)
            if not kernel:
                stats, _ = self.stats.side(queue, tensors)
            elif side == "input":
                stats, frame.inputs_seen = self.stats.side(
                    queue, tensors, remember_inputs=not frame.writes_args)
            else:
                stats, _ = self.stats.side(queue, tensors, kernel_output=True,
                                           inputs_seen=frame.inputs_seen)
            # Deferred only where every in-place kernel is seen (see forget_written).
            if layer is None or not layer.deferred or queue.nbytes > MAX_PENDING_BYTES:
                queue.resolve()
        else:
            stats = [None] * len(kept)
        if cfg.wants_tensors:
            rows, labels = self._write_tensors(rnd, frame, side, kept, stats, named, kernel)
        else:
            rows, labels = [], []
            for (i, label, t, dt), st in zip(kept, stats):
                if named and label:
                    index = f"{i}_{_safe_label(label)}"
                else:
                    index = _INDEX[i] if i < 64 else str(i)
                labels.append(index)
                rows += (index, dt.csv_name, shape_cell(t.shape), st, NA)
        if rows:
            rnd.wrote = True
            # One flat tuple of strings and cells (statcsv.py): the garbage collector lets go
            # of it at its first collection.
            record = (rnd.devpid, str(rnd.index), frame.full_name, frame.name, frame.op_id,
                      side, *rows)
            if layer is not None:
                layer.rows.append(record)
            else:
                self._wait(rnd, [record])
        return labels

    def _write_tensors(self, rnd, frame, side, kept, stats, named, kernel):
        """Queue the `.bin` files of one side (data, or references under filter_level 1 and 2);
        returns its statistic.csv rows (the cells after the head of a side record, statcsv.py)
        and index labels."""
        cfg = rnd.config
        sink = self.sink
        sub = layout.side_dir(side)
        level = cfg.filter_level if cfg.save_child else 0
        header_only = kernel and level >= 2
        rows, labels = [], []
        op_dir = f"{rnd.rel}/{frame.rel}/{sub}"
        layer = frame.layer
        for (i, label, t, dt), st in zip(kept, stats):
            index = f"{i}_{_safe_label(label)}" if named and label else str(i)
            labels.append(index)
            dims = t.shape
            fname = layout.tensor_file(side, index)
            in_round = f"{frame.rel}/{sub}/{fname}"
            if header_only:
                sink.put_file(op_dir, fname, [encode_reference(dt.code, dims, in_round)], 0)
            else:
                key = same_bytes_key(t) if level >= 1 and t.numel() else None
                target = _lookup(layer, key, t) if key and not (named and label) else None
                if target is not None:
                    sink.put_file(op_dir, fname, [encode_reference(dt.code, dims, target)], 0)
                    # This alias keeps the storage alive now, maybe after the first one died.
                    layer.written[key] = (weakref.ref(t), target)
                else:
                    data, ready = host_bytes(t)
                    sink.put_file(op_dir, fname, [encode_header(dt.code, dims, data.nbytes), data],
                                  data.nbytes, ready)
                    if key is not None and layer is not None:
                        layer.written[key] = (weakref.ref(t), in_round)
            rows += (index, dt.csv_name, shape_cell(dims), st,
                     f"{sink.tree.root}/{op_dir}/{fname}")
        return rows, labels

    # -- structure files --------------------------------------------------------------------

    def wants_structure(self, rnd, name: str, op_id: str, tracking: bool) -> bool:
        written = self._layer_files.get((rnd.model.name, name, op_id))
        return written is None or (tracking and written == 0)

    def child_done(self, parent, frame) -> None:
        if parent.layer is not None and parent.layer.collect:
            if parent.nodes is None:
                parent.nodes = []
            parent.nodes.append(_node(frame))

    def flush_rows(self, rnd, layer) -> None:
        """Compute a layer execution's pending statistics and queue its statistic.csv rows for
        the writer, in execution order (see `_RoundRows`)."""
        if layer.pending is not None:
            layer.pending.resolve()
        if layer.rows:
            rows, layer.rows = layer.rows, []
            self._wait(rnd, rows)

    def _wait(self, rnd, sides: list) -> None:
        """Queue `sides` of round `rnd` behind this thread's waiting rows."""
        waiting = self._round_rows
        if waiting.rnd is not rnd:
            self.hand_rows()
            waiting.rnd, waiting.since = rnd, time.monotonic()
        waiting.sides += sides
        if len(waiting.sides) >= MAX_WAITING_SIDES or \
                time.monotonic() - waiting.since >= MAX_WAITING_SECONDS:
            self.hand_rows()

    def hand_rows(self) -> None:
        """Hand the rows this thread has waiting to the writer (see `_RoundRows`)."""
        waiting = self._round_rows
        rnd, sides = waiting.rnd, waiting.sides
        if rnd is None:
            return
        waiting.rnd, waiting.sides = None, []
        if sides:
            self.sink.put_records(rnd.rel, CSV_FILE, sides, HEADER)

    def layer_done(self, rnd, frame) -> None:
        collect = frame.layer.collect
        model = rnd.model
        if (model.name, rnd.phase) in self._model_files and not collect:
            return  # this phase's model file is written: nothing to describe
        node = _node(frame)
        rnd.layer_nodes.append({k: node[k] for k in ("opName", "opType", "modulePath",
                                                     "inTensors", "outTensors") if k in node})
        if collect:
            key = (model.name, frame.name, frame.op_id)
            count = _count(node)
            with self._structure_lock:
                if self._layer_files.get(key, -1) >= count:
                    return
                self._layer_files[key] = count
            folder = layout.layer_info_dir(rnd.devpid, None if model.first else model.name)
            self.sink.put_json(folder, layout.layer_info_file(frame.name, frame.op_id), node)

    def end_round(self, rnd) -> None:
        """The round's model file (SPEC §5): written at the first round of its model and phase
        that had layer-level ops; its `rounds` grow with every later round of that phase."""
        self.hand_rows()
        model = rnd.model
        with self._structure_lock:  # threads serving one model end rounds side by side
            file = self._model_files.get((model.name, rnd.phase))
            if file is None:
                if not rnd.layer_nodes:
                    return
                file = ModelFile(layout.model_info_dir(rnd.devpid), {
                    "modelName": f"{model.name}_{rnd.phase}", "modelType": model.name,
                    "phase": rnd.phase, "param": _model_param(rnd.root_module), "rounds": [],
                    "nodes": rnd.layer_nodes})
                self._model_files[model.name, rnd.phase] = file
                file.add_round(rnd.index)
                self._write_model_file(file)
            elif file.add_round(rnd.index):
                self._write_model_file(file)

    def after_fork(self) -> None:
        """A forked child writes structure files of its own, into its own folders. Rows the
        forking thread had waiting are the parent's to write."""
        self._structure_lock = threading.Lock()
        self._round_rows = _RoundRows()
        self._layer_files.clear()
        self._model_files.clear()

    def flush_model_files(self, due_only: bool = False) -> None:
        """Write the model files whose `rounds` changed since they were last written (with
        `due_only`, those last written a second ago or more)."""
        with self._structure_lock:
            for file in self._model_files.values():
                if file.due() if due_only else file.dirty:
                    self._write_model_file(file)

    def model_files_pending(self) -> int:
        """How many model files hold rounds not yet handed to the writer."""
        return sum(file.dirty for file in list(self._model_files.values()))

    def _write_model_file(self, file: ModelFile) -> None:
        """(Holding `_structure_lock`.) Queue the model file as it is now."""
        file.dirty = False
        file.written_at = time.monotonic()
        # Serialised later, on the writer thread: hand over a copy of what keeps changing.
        doc = dict(file.doc, rounds=[list(r) for r in file.doc["rounds"]])
        self.sink.put_json(file.folder, layout.model_info_file(doc["modelType"], doc["phase"]),
                           doc)


class _RoundRows(threading.local):
    """statistic.csv rows of a thread's round that wait to be handed to the writer in one
    piece: one `put_records` (the writer's lock, its accounting) per round rather than per
    layer-level op execution. They are handed over at the end of the round (whether the model
    returned or raised), and sooner once `MAX_WAITING_SIDES` sides or `MAX_WAITING_SECONDS`
    have gathered, so a long round keeps its rows flowing and what waits stays small (rows
    hold no tensor data: only their shapes and statistics cells)."""

    def __init__(self):
        self.rnd = None     # the round whose rows wait, or None
        self.sides: list = []
        self.since = 0.0    # when the first of them was queued


# Under the writer's own delay for rows (writer.ROWS_DELAY): the rows of a layer execution reach
# the writer in about the same time as when they were handed over at its end.
MAX_WAITING_SECONDS = 0.1
MAX_WAITING_SIDES = 4096


class ModelFile:
    """One `info/model` document and the rounds it describes, as inclusive `[first, last]`
    ranges: a service dumping for hours keeps a short list.

    It is written when first made; a later round marks it dirty, and it is rewritten at most
    every `MODEL_FILE_SECONDS` (by the round that finds it due, else by the probe's background
    thread: `flush_model_files(due_only=True)`) and when the probe closes, so a decode loop, or
    an engine whose steps interleave several models, does not rewrite it on every round."""

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


MODEL_FILE_SECONDS = 1.0


def _model_param(root) -> dict:
    """The model's configuration (a transformers config as a dict), else {}."""
    root = getattr(root, "_orig_mod", root)
    config = getattr(root, "config", None)
    try:
        return config.to_dict() if hasattr(config, "to_dict") else (
            dict(vars(config)) if config is not None else {})
    except Exception:
        return {}


@lru_cache(maxsize=4096)
def _safe_label(label: str) -> str:
    """A parameter label (it may come from a dict key) as a file-name part."""
    return sanitize(label, limit=64)


_INDEX = tuple(str(i) for i in range(64))


def _output_items(out) -> list:
    """The (label, tensor) items of what an op returned that is not a single tensor."""
    items = []
    flatten(out, "", items, {}, name_items=False)
    return items


def _tensors_of(pairs, items: list) -> None:
    """`flatten` of each (name, value) pair into `items`, without rendering the other
    values as parameters."""
    for name, value in pairs:
        cls = type(value)
        if cls in _NO_TENSOR:
            continue
        if isinstance(value, torch.Tensor):
            items.append((name, value))
        elif cls is list or cls is tuple:
            # Sizes and strides (lists of ints) are the common case: no tensor, nothing to do;
            # then a tuple of tensors (position embeddings), labelled as `flatten` does.
            if value and all(type(v) is torch.Tensor for v in value):
                items.extend([(f"{name}_{i}" if name else _INDEX[i] if i < 64 else str(i), v)
                              for i, v in enumerate(value)])
                continue
            for v in value:
                if not isinstance(v, (int, float, bool)):
                    flatten(value, name, items, {}, name_items=True)
                    break
        elif may_hold_tensor(value):
            flatten(value, name, items, {}, name_items=True)


# Argument types that never hold a tensor (`_tensors_of` skips them at once).
_NO_TENSOR = frozenset({type(None), bool, int, float, str, torch.dtype, torch.device,
                        torch.layout, torch.memory_format})


def _describe_shard(frame, side: str, i: int, label: str, meta: dict) -> None:
    """Note a DTensor's layout under its file's name, for the op's `op_param.json`."""
    name = f"{'intensor' if side == 'input' else 'outtensor'}{i}"
    if label:
        name += f"_{_safe_label(label)}"
    if frame.shards is None:
        frame.shards = {}
    frame.shards[name] = meta


def _uninitialized(layer, items, writes_args: bool) -> list[str]:
    """The names of a kernel's outputs over memory nothing has written yet: an allocation
    kernel's, and views of it made before anything wrote it (`LayerRun.uninit`)."""
    if layer is None or not layer.uninit or writes_args:
        return []
    names = []
    for i, (_, t) in enumerate(items):
        try:
            address = t.untyped_storage().data_ptr()
        except Exception:  # subclasses, tensors without storage
            continue
        if address in layer.uninit:
            names.append(layout.tensor_name("output", i))
    return names


def _skipped(t, frame) -> None:
    log.warn_once(f"skip-{type(t).__name__}-{getattr(t, 'dtype', '')}",
                  f"cannot dump a {type(t).__name__} of dtype {getattr(t, 'dtype', '?')} "
                  f"({frame.full_name}); skipped")


def _queue(layer) -> Queue:
    """The queue of pending statistics of a layer execution (a new one for an op outside
    any)."""
    if layer is None:
        return Queue()
    if layer.pending is None:
        layer.pending = Queue()
    return layer.pending


def _collecting(frame) -> bool:
    return frame.layer is not None and frame.layer.collect


_NOT_PARAM = frozenset({"inputs", "outputs", "modulePath"})


def _node(frame) -> dict:
    name = f"{frame.name}_{frame.op_id}"
    node = {
        "opName": name,
        "opType": frame.name,
        "param": {k: v for k, v in (frame.param or {}).items() if k not in _NOT_PARAM},
        "inTensors": [f"{name}_input_{i}" for i in range(frame.inputs)],
        "outTensors": [f"{name}_output_{i}" for i in range(frame.outputs)],
        "internalTensors": [],
        "nodes": frame.nodes or [],
    }
    if frame.path is not None:
        node["modulePath"] = frame.path
    return node


def _count(node: dict) -> int:
    return sum(1 + _count(n) for n in node["nodes"])


def _lookup(layer, key, t):
    """The file already holding `t`'s bytes in this layer execution, if any.

    An entry is valid while the tensor it was written from is alive (so its memory cannot have
    been reused) and no in-place kernel has written to its storage since: every ATen op inside a
    tracked layer passes the kernel capture, which drops the entries of the storages an op
    writes to (`forget_written`). Version counters cannot serve here: inference tensors have
    none, and a view made by a kernel gets its base's counter only after the dispatch returns."""
    if layer is None:
        return None
    entry = layer.written.get(key)
    if entry is None:
        return None
    ref, path = entry
    return path if ref() is not None else None
