"""From an op's tensors to records: `.bin` files, statistic.csv rows and op_param.json, handed
to the background writer as jobs (record/jobs.py); the structure files are `StructureFiles`'.

The recorder owns the records it keeps while ops run: an `OpRecord` per op execution it records
(tensor counts, op_param.json, children for the structure files), a `LayerRecord` per layer-level
op execution (its rows, pending statistics, files written, uninitialised memory), a
`RoundRecord` per dumped round (its folder, whether it wrote anything, its structure). The call
tree creates none of them and reads none of their fields: it carries them on its frames and
rounds and hands them back.

Everything here runs on the model thread, so it does only what cannot wait. Per op side it
takes the IDs, looks the tensors' statistics up (stats_reuse) and appends one side record
(statcsv.py) to the layer-level op execution's; statistics that are not known yet are queued
and computed in one batch when the execution ends, or at once where the probe does not see the
kernels that could change the tensors before then. Tensor files need a private copy of the
bytes at once (on an accelerator: a copy to pinned memory that the writer waits for). A
layer-level op execution's rows join its round's at its end, and a round's rows are handed to
the writer when the round ends (sooner in a long round: `_RowHandover`); formatting, encoding and
disk I/O happen there.
"""
from __future__ import annotations

import threading
import time
import weakref
from functools import lru_cache

import torch

from .. import layout, log
from ..binfile import encode_header, encode_reference
from ..config import Task
from ..layout import INPUT, OUTPUT
from ..naming import sanitize
from ..record.jobs import JsonJob, RowsJob, TensorFileJob
from ..statcsv import (DERIVED_FILE_NAME, FILE_NAME as CSV_FILE, HEADER, REQUEST_FILE_NAME,
                       REQUEST_HEADER, shape_cell, side_rows, tensor_path_cell)
from ..tokens import TokenLayout
from .arguments import bind_args, kernel_tensors
from .models import module_class, uncompiled
from .requests import RequestSlices
from .stats_reuse import Queue, StatsCache, version_of
from .sums import sum_index, sums_of
from .structure import RoundStructure, StructureFiles
from .tensors import (DUMPABLE_DTYPES, dumpable_dtype, flatten, host_bytes, local_of,
                      may_hold_tensor, same_bytes_key)

MAX_PARAM_SHAPES = 256
_UNINITIALIZED = torch.nn.parameter.UninitializedTensorMixin
_STRIDED = torch.strided
# Bytes of tensors a layer execution keeps alive for statistics computed at its end; beyond
# this they are computed at once.
MAX_PENDING_BYTES = 64 * 1024 ** 2


class OpRecord:
    """What the recorder keeps of one op execution while it runs."""

    __slots__ = ("inputs", "outputs", "param", "nodes", "writes_args", "factory", "view",
                 "inputs_seen", "shards", "sums")

    def __init__(self, writes_args: bool = False, factory: bool = False, view: bool = False):
        self.inputs = 0               # number of input tensors (for structure files)
        self.outputs = 0
        self.param = None             # op_param.json content, once known
        self.nodes = None             # structure of the children, when collected
        self.writes_args = writes_args  # kernels: writes to its arguments (values change)
        self.factory = factory        # kernels: a factory function (capture/kernels.py)
        self.view = view              # kernels: returns aliases of its inputs
        self.inputs_seen = None       # kernels: what the inputs' statistics leave the outputs
        self.shards = None            # DTensor layouts by file name, for op_param.json
        self.sums = None              # modules: the sums measured per side (capture/sums.py)


class LayerRecord:
    """Per layer-level op execution: what was written (for filter_level 1), its statistic.csv
    rows (handed over in one piece when the layer ends), its pending statistics, whether its
    structure is collected, and the memory nothing has written yet."""

    __slots__ = ("written", "collect", "rows", "request_rows", "derived_rows", "deferred",
                 "pending", "uninit")

    def __init__(self, collect: bool, deferred: bool = False):
        self.written = {}     # same_bytes_key -> (weakref to tensor, path in round)
        self.collect = collect
        self.rows = []
        self.request_rows = []    # request_statistic.csv's, the same way
        self.derived_rows = []    # derived_statistic.csv's
        self.deferred = deferred  # kernels seen: statistics may wait for the end
        self.pending = None       # stats_reuse.Queue, once something is pending
        # Storage addresses of allocation kernels' outputs (`torch.empty`) that no kernel has
        # written since: those outputs and the views of them are uninitialised (SPEC §8).
        self.uninit = None


class RoundRecord:
    """Per dumped round: its folder, whether it wrote any tensor or row, its structure, its
    token layout (tokens.py) and, when request_statistic.csv is written, how that layout cuts
    its tensors per request (`by_request`)."""

    __slots__ = ("rel", "head", "wrote", "structure", "tokens", "by_request",
                 "statistics_only")

    def __init__(self, devpid: str, index: int):
        self.rel = layout.round_dir(devpid, index)
        self.head = (devpid, str(index))  # the first cells of its statistic.csv rows
        self.wrote = False
        self.structure = RoundStructure()
        self.tokens: TokenLayout | None = None
        self.by_request: RequestSlices | None = None  # the cuts of `tokens` (requests.py)
        # A statistics dump without request_statistic.csv: kernel sides take `kernel_side`.
        self.statistics_only = False


class Recorder:
    """Turns what the call tree decided to dump into jobs for `sink` (the background writer).

    Its methods follow an op's life: `begin_round`, `begin_layer`, `module_inputs` /
    `kernel_inputs`, `module_outputs` / `kernel_outputs`, `end_layer_rows` ... `end_round`.
    More of them than we like in a class: they are the call tree's one interface to recording,
    and share the statistics cache and the thread's row handover; the structure files are
    `StructureFiles`', the statistics `StatsCache`'s."""

    def __init__(self, sink):
        self.sink = sink
        self._static: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.stats = StatsCache()
        self.structure = StructureFiles(sink)
        self._rows = _RowHandover(sink, self.stats, CSV_FILE)
        self._request_rows = _RowHandover(sink, self.stats, REQUEST_FILE_NAME)
        self._derived_rows = _RowHandover(sink, self.stats, DERIVED_FILE_NAME)

    # -- rounds and layers ------------------------------------------------------------------

    @staticmethod
    def begin_round(devpid: str, index: int) -> RoundRecord:
        """The record of a dumped round."""
        return RoundRecord(devpid, index)

    @staticmethod
    def set_tokens(rnd, tokens: TokenLayout | None) -> None:
        """The round's token layout: written with it (tokens.json), and its tensors' statistics
        per request (request_statistic.csv) when they say more than the tensor's."""
        record = rnd.record
        record.tokens = tokens
        cfg = rnd.selection.config
        record.by_request = RequestSlices(tokens) if tokens is not None and \
            tokens.per_request and cfg.wants_statistics else None
        record.statistics_only = cfg.task is Task.STATISTICS and record.by_request is None

    def begin_layer(self, rnd, name: str, op_id: str, tracking: bool) -> LayerRecord:
        """The record of a layer-level op execution; `tracking`: its children are seen."""
        collect = self.structure.wants_layer(rnd.model.name, name, op_id, tracking)
        return LayerRecord(collect, deferred=tracking)

    def end_layer_rows(self, rnd, layer: LayerRecord) -> None:
        """Compute a layer execution's pending statistics and queue its statistic.csv rows for
        the writer, in execution order (see `_RowHandover`)."""
        if layer.pending is not None:
            layer.pending.resolve()
        if layer.rows:
            rows, layer.rows = layer.rows, []
            self._rows.queue(rnd.record, rows)
        if layer.request_rows:
            rows, layer.request_rows = layer.request_rows, []
            self._request_rows.queue(rnd.record, rows)
        if layer.derived_rows:
            rows, layer.derived_rows = layer.derived_rows, []
            self._derived_rows.queue(rnd.record, rows)

    def layer_done(self, rnd, frame) -> None:
        self.structure.layer_done(rnd, rnd.record.structure, frame, frame.layer.collect)

    def child_done(self, parent, frame) -> None:
        if parent.layer.collect:
            self.structure.child_done(parent.record, frame)

    def end_round(self, rnd) -> bool:
        """Hand the round's rows over, write its token layout and update its model file;
        whether it wrote anything."""
        record = rnd.record
        self._rows.hand_over()
        self._request_rows.hand_over()
        self._derived_rows.hand_over()
        self.stats.device.flush()  # what no row shows (a cache entry's) lets its buffer go too
        if record.wrote and record.tokens is not None:
            self.sink.put(JsonJob(record.rel, layout.TOKENS_JSON, record.tokens.doc()))
        self.structure.end_round(rnd, record.structure)
        return record.wrote

    def after_fork(self) -> None:
        """A forked child writes structure files of its own, into its own folders. Rows the
        forking thread had waiting are the parent's to write."""
        self._rows = _RowHandover(self.sink, self.stats, CSV_FILE)
        self._request_rows = _RowHandover(self.sink, self.stats, REQUEST_FILE_NAME)
        self._derived_rows = _RowHandover(self.sink, self.stats, DERIVED_FILE_NAME)
        self.structure.after_fork()

    # -- module ops -------------------------------------------------------------------------

    def module_inputs(self, rnd, frame, module, params, args, kwargs, named: bool):
        """A module op begins: its input side recorded. Returns its `OpRecord` (None when
        nothing of it is recorded)."""
        if not (frame.dump or frame.layer.collect):
            return None
        record = OpRecord()
        record.sums = _class_sums(type(frame.wraps or module))
        pairs = bind_args(params, args, kwargs)
        # op_param.json (tensor tasks) and the structure files describe the arguments;
        # otherwise only the tensors matter.
        describe = rnd.selection.config.wants_tensors or frame.layer.collect
        items, described = [], {}
        if describe:
            for name, value in pairs:
                flatten(value, name, items, described, name_items=True)
        else:
            _tensors_of(pairs, items)
        record.inputs = len(items)
        labels = self.write_side(rnd, frame, record, INPUT, items, named, kernel=False,
                                 sums=record.sums and record.sums.get(INPUT)) \
            if frame.dump else []
        if describe:
            # Which argument each input file is: a layer-level op's file names do not say
            # (`intensor0`), and replay calls the module by them.
            arguments = [items[int(label.split("_", 1)[0])][0] for label in labels]
            record.param = dict(self.static_param(module), modulePath=frame.path,
                                args=described, inputs=labels, arguments=arguments)
        return record

    def module_outputs(self, rnd, frame, out, named: bool) -> None:
        record = frame.record
        if record is None:
            return
        items = [("", out)] if isinstance(out, torch.Tensor) else _output_items(out)
        record.outputs = len(items)
        if frame.dump:
            labels = self.write_side(rnd, frame, record, OUTPUT, items, named, kernel=False,
                                     sums=record.sums and record.sums.get(OUTPUT))
            if rnd.selection.config.wants_tensors:
                doc = record.param
                doc["outputs"] = labels
                if record.shards:
                    doc["dtensors"] = record.shards
                self.sink.put(JsonJob(layout.op_dir(rnd.record.rel, frame.rel), layout.OP_PARAM,
                                      doc))

    def static_param(self, module) -> dict:
        """The module's configuration: class, extra_repr, dtype and parameter shapes (of the
        module a torch.compile wrapper wraps)."""
        doc = self._static.get(module)
        if doc is None:
            key, module = module, uncompiled(module)
            cls = module_class(module)
            shapes, dtype, lazy = {}, None, False
            for i, (name, p) in enumerate(module.named_parameters()):
                if i >= MAX_PARAM_SHAPES:
                    shapes["..."] = "more parameters not listed"
                    break
                if isinstance(p, _UNINITIALIZED):  # a lazy module before its first forward
                    shapes[name], lazy = "uninitialized", True
                    continue
                shapes[name] = list(p.shape)
                dtype = dtype or str(p.dtype).rpartition(".")[2]
            try:
                extra = module.extra_repr()
            except Exception:
                extra = ""
            doc = {"type": cls.__name__, "class": f"{cls.__module__}.{cls.__qualname__}",
                   "extra_repr": extra, "dtype": dtype, "parameters": shapes}
            if not lazy:  # kept once its shapes are known
                self._static[key] = doc
        return doc

    # -- kernels ----------------------------------------------------------------------------

    def kernel_inputs(self, rnd, frame, kernel, args, kwargs) -> tuple:
        """A kernel begins (`kernel`: its `kernels.Kernel`): its input side recorded. Returns
        its `OpRecord`, and its arguments bound to their names where that was needed (else
        None)."""
        record = OpRecord(bool(kernel.written), kernel.factory, kernel.view)
        # op_param.json (tensor tasks) and the structure files describe the kernel's arguments;
        # otherwise only its tensors matter.
        describe = frame.dump and (rnd.selection.config.wants_tensors or frame.layer.collect)
        if not describe and rnd.record.statistics_only:
            tensors = kernel_tensors(kernel.params, args, kwargs)
            if tensors is not None:
                record.inputs = len(tensors)
                if frame.dump:
                    record.inputs_seen = self.kernel_side(
                        rnd, frame.layer, (frame.full_name, frame.name, frame.op_id), INPUT,
                        tensors, kernel)
                return record, None
        pairs = bind_args(kernel.params, args, kwargs)
        items = []
        if describe:
            described, arg_names = {}, []
            for name, value in pairs:
                before = len(items)
                flatten(value, name, items, described, name_items=True)
                arg_names.extend(label for label, _ in items[before:])
        else:
            _tensors_of(pairs, items)
        record.inputs = len(items)
        if frame.dump:
            self.write_side(rnd, frame, record, INPUT, items, named=False, kernel=True)
            if describe:
                record.param = {"op": kernel.op_name, "type": frame.name,
                                "inputs": {layout.tensor_name(INPUT, i): n
                                           for i, n in enumerate(arg_names)},
                                "args": described}
        return record, pairs

    def kernel_outputs(self, rnd, frame, kernel, out, written: list) -> None:
        """A kernel's outputs: what it returned, then the arguments it wrote (`written`: their
        (name, tensor), values after the kernel)."""
        record = frame.record
        op_name = kernel.op_name
        if rnd.record.statistics_only:
            if frame.dump:
                self.kernel_output_statistics(
                    rnd, frame.layer, (frame.full_name, frame.name, frame.op_id), kernel, out,
                    written, record.inputs_seen, lambda: frame.rel)
            # (The structure files count what the kernel returned and wrote.)
            record.outputs = (1 if isinstance(out, torch.Tensor) else
                              len(_output_items(out))) + len(written)
            return
        # Most kernels return one tensor.
        items = [("", out)] if isinstance(out, torch.Tensor) else _output_items(out)
        returned = len(items)
        if written:
            items += written
        record.outputs = len(items)
        if not frame.dump:
            return
        self.write_side(rnd, frame, record, OUTPUT, items, named=False, kernel=True)
        uninit = _uninitialized(frame.layer, [t for _, t in items], record.writes_args)
        if rnd.selection.config.wants_tensors:
            param = record.param
            param["outputs"] = [layout.tensor_name(OUTPUT, i) for i in range(len(items))]
            if written:
                param["written"] = {layout.tensor_name(OUTPUT, returned + i): name
                                    for i, (name, _) in enumerate(written)}
            if record.shards:
                param["dtensors"] = record.shards
        elif uninit:  # the one thing the tools must know of a statistics dump's kernel
            param = {"op": op_name, "type": frame.name}
        else:
            return
        if uninit:
            param["uninitialized"] = uninit
        self.sink.put(JsonJob(layout.op_dir(rnd.record.rel, frame.rel), layout.OP_PARAM, param))

    def forget_written(self, layer: LayerRecord, pairs, written: tuple) -> None:
        """An in-place kernel is about to change these tensors: statistics still pending are
        computed now, those kept for their present values are dropped (a collective writes
        without bumping the version counter), their bytes on disk are no longer theirs, and
        their memory is no longer uninitialised."""
        if layer.pending is not None:
            layer.pending.resolve()
        tensors = [t for name, value in pairs if name in written
                   for t in (value if isinstance(value, (tuple, list)) else (value,))
                   if isinstance(t, torch.Tensor)]
        for t in tensors:
            self.stats.forget(t)
        if not (layer.written or layer.uninit):
            return
        for t in tensors:
            key = same_bytes_key(t)
            if key is not None:
                for k in [k for k in layer.written if k[2] == key[2]]:
                    del layer.written[k]
                if layer.uninit:
                    layer.uninit.discard(key[2])

    @staticmethod
    def allocated(layer: LayerRecord, out) -> None:
        """An allocation kernel's output: its memory holds nothing yet (`LayerRecord.uninit`)."""
        if isinstance(out, torch.Tensor) and out.layout is torch.strided:
            if layer.uninit is None:
                layer.uninit = set()
            layer.uninit.add(out.untyped_storage().data_ptr())

    # -- tensors ----------------------------------------------------------------------------

    def write_side(self, rnd, frame, record: OpRecord, side: str, items, named: bool,
                   kernel: bool, sums: tuple[int, int] | None = None) -> list[str]:
        """Record one side (inputs or outputs) of an op: its statistic.csv rows join the
        layer execution's, statistics pending (see stats_reuse), files queued; returns the
        index labels. `sums`: the two tensors of the side whose sum is measured too
        (derived_statistic.csv, capture/sums.py)."""
        cfg = rnd.selection.config
        dumpable, tensors = [], []
        for i, (label, t) in enumerate(items):
            cls = type(t)
            if cls is torch.Tensor and t.layout is _STRIDED and not t.is_meta and \
                    not t.is_nested:  # `dumpable_dtype` of a plain tensor, inline
                dt = DUMPABLE_DTYPES.get(t.dtype)
            else:
                if cls is not torch.Tensor and cls is not torch.nn.Parameter:
                    t, meta = local_of(t)
                    if meta is not None:
                        _describe_shard(record, side, i, label if named else "", meta)
                dt = dumpable_dtype(t)
            if dt is not None:
                dumpable.append((i, label, t, dt))
                tensors.append(t)
            else:
                _skipped(t, frame)
        layer = frame.layer
        by_request = rnd.record.by_request
        request_cells = derived = None
        if cfg.wants_statistics or (kernel and cfg.save_child and cfg.filter_level >= 2):
            # A factory's outputs are not kept for later: their statistics are computed now,
            # in a queue of their own (see `Kernel.factory`).
            at_once = kernel and side == OUTPUT and record.factory
            queue = self.stats.new_queue() if at_once else self._queue(layer)
            if not kernel:
                stats, _ = self.stats.side(queue, tensors)
            elif side == INPUT:
                stats, record.inputs_seen = self.stats.side(
                    queue, tensors, remember_inputs=not record.writes_args)
            else:
                stats, _ = self.stats.side(queue, tensors, kernel_output=True,
                                           inputs_seen=record.inputs_seen, view=record.view)
            if by_request is not None:
                request_cells = self._request_cells(by_request, queue, tensors,
                                                    by_row="_" not in frame.op_id)
            if sums is not None and cfg.wants_statistics:
                derived = self._sum_rows(sums, dumpable, queue, by_request)
            # Deferred only where every in-place kernel is seen (see forget_written); a module
            # side's small host tensors are copied then, and measured with the round's rows.
            if at_once or layer is None or not layer.deferred:
                queue.resolve(later=not kernel)
            elif queue.nbytes > MAX_PENDING_BYTES:
                queue.resolve()
        else:
            stats = [None] * len(dumpable)
        if cfg.wants_tensors:
            rows, labels = self._write_tensors(rnd, frame, side, dumpable, stats, named, kernel)
        else:
            rows, labels = [], []
            for (i, label, t, dt), st in zip(dumpable, stats):
                if named and label:
                    index = f"{i}_{_safe_label(label)}"
                else:
                    index = _INDEX[i] if i < 64 else str(i)
                labels.append(index)
                rows += (index, dt.csv_name, shape_cell(t.shape), st, None)
        if rows:
            rnd.record.wrote = True
            # One flat tuple of strings and cells (statcsv.py): the garbage collector lets go
            # of it at its first collection.
            head = (*rnd.record.head, frame.full_name, frame.name, frame.op_id, side)
            side_record = (*head, *rows)
            if layer is not None:
                layer.rows.append(side_record)
            else:
                self._rows.queue(rnd.record, [side_record])
            if request_cells:
                request_record = (*head, *_request_rows(request_cells, dumpable, labels))
                if layer is not None:
                    layer.request_rows.append(request_record)
                else:
                    self._request_rows.queue(rnd.record, [request_record])
            if derived:
                if layer is not None:
                    layer.derived_rows.append((*head, *derived))
                else:
                    self._derived_rows.queue(rnd.record, [(*head, *derived)])
        return labels

    def _sum_rows(self, pair: tuple[int, int], dumpable: list, queue: Queue,
                  by_request: RequestSlices | None) -> list:
        """The cells after the head of a derived_statistic.csv side record (statcsv.py): the
        statistics of the sum of the side's tensors `pair`, whole and per request, pending in
        `queue`; empty when the side has no such two tensors of one shape, dtype and device
        (vLLM's first decoder layer gets no residual)."""
        found = {i: (t, dt) for i, _, t, dt in dumpable if i in pair}
        if len(found) != 2:
            return []
        (a, dt), (b, _) = found[pair[0]], found[pair[1]]
        if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device or \
                not a.is_floating_point():
            return []
        if torch.is_grad_enabled():  # (the context costs more than the add where it is not)
            with torch.no_grad():
                total = torch.add(a, b)   # a snapshot: the next norm adds in place
        else:
            total = torch.add(a, b)
        index, dtype = sum_index(pair), dt.csv_name
        rows = [index, dtype, shape_cell(total.shape), self.stats.fresh(total, queue), ""]
        if by_request is not None:
            for _, cut, cells in self._request_cells(by_request, queue, [total]):
                _add_slice_rows(rows, index, dtype, cut, cells)
        return rows

    def kernel_side(self, rnd, layer: LayerRecord | None, names: tuple, side: str,
                    tensors: list, kernel, inputs_seen=None):
        """`write_side` of a kernel's side in a statistics dump without request_statistic.csv
        (`RoundRecord.statistics_only`): the same side record, in fewer steps, from what the
        kernel call holds (no frame or record needed: see `OpWalker.statistics_kernel_call`).
        Most sides of a `save_child` dump are kernels'; a kernel's rows are indexed by
        position, so its tensors come without labels (`arguments.kernel_tensors`).

        `names`: the kernel's (Op Name, Op Type, Op Id); `kernel`: its `kernels.Kernel`;
        `inputs_seen`: for its outputs, what its inputs left. Returns that, for its inputs."""
        # A factory's outputs are not kept for later: their statistics are computed now, in a
        # queue of their own (see `Kernel.factory`).
        at_once = side == OUTPUT and kernel.factory
        queue = self.stats.new_queue() if at_once else self._queue(layer)
        rows = []
        if side == INPUT:
            # Most inputs are outputs of the kernels before, held by the queue with their
            # row's cells (`StatsCache.output_cell`): one lookup makes their row.
            held_get = queue.held.get
            input_cell = self.stats.input_cell
            dumpable, cells = [], []
            for i, t in enumerate(tensors):
                held = held_get(id(t))
                if held is not None and held[4] is not None and \
                        held[1] == version_of(t) and held[3] == t.data_ptr():
                    cell = held[2]
                    rows += (_INDEX[i] if i < 64 else str(i), held[4], held[5], cell, None)
                else:
                    t, dt = _dumpable(t, names[0])
                    if dt is None:
                        continue
                    cell = input_cell(t, queue)
                    rows += (_INDEX[i] if i < 64 else str(i), dt.csv_name,
                             shape_cell(t.shape), cell, None)
                dumpable.append(t)
                cells.append(cell)
            inputs_seen = None if kernel.written else (dumpable, cells)
        else:
            output_cell = self.stats.output_cell
            view = kernel.view
            for i, t in enumerate(tensors):
                t, dt = _dumpable(t, names[0])
                if dt is None:
                    continue
                row = (dt.csv_name, shape_cell(t.shape))
                rows += (_INDEX[i] if i < 64 else str(i), *row,
                         output_cell(t, queue, inputs_seen, view, row), None)
        # Deferred only where every in-place kernel is seen (see forget_written).
        if at_once or layer is None or not layer.deferred or queue.nbytes > MAX_PENDING_BYTES:
            queue.resolve()
        if rows:
            round_record = rnd.record
            round_record.wrote = True
            side_record = (*round_record.head, *names, side, *rows)
            if layer is not None:
                layer.rows.append(side_record)
            else:
                self._rows.queue(round_record, [side_record])
        return inputs_seen

    def kernel_output_statistics(self, rnd, layer, names: tuple, kernel, out, written: list,
                                 inputs_seen, rel) -> None:
        """A kernel's outputs in a statistics dump, its frame-less way (`kernel_side`): what it
        returned, then the arguments it wrote (`written`); `rel()`: its op folder, for the
        op_param.json of outputs over uninitialised memory."""
        tensors = [out] if isinstance(out, torch.Tensor) else [t for _, t in _output_items(out)]
        if written:
            tensors += [t for _, t in written]
        self.kernel_side(rnd, layer, names, OUTPUT, tensors, kernel, inputs_seen)
        uninit = _uninitialized(layer, tensors, bool(kernel.written))
        if uninit:  # the one thing the tools must know of a statistics dump's kernel
            self.sink.put(JsonJob(layout.op_dir(rnd.record.rel, rel()), layout.OP_PARAM,
                                  {"op": kernel.op_name, "type": names[1],
                                   "uninitialized": uninit}))

    def _request_cells(self, slices: RequestSlices, queue: Queue, tensors: list,
                       by_row: bool = False) -> list:
        """Statistics cells of each request's slice of the tensors that have the round's token
        dimension (and with `by_row`, a layer-level op's, of each request's row of a tensor with
        a row per request: the logits), pending in `queue` with the tensors': (tensor index,
        its `Cut`, the cells of its slices) per tensor cut. The slices live only until the
        queue resolves, so nothing of them is looked up or kept (`StatsCache.fresh`). A
        request's slice of a contiguous host tensor is one run of its memory: the runs of one
        tensor are measured together (`StatsCache.fresh_runs`), without a tensor per slice."""
        out = []
        fresh = self.stats.fresh
        for i, t in enumerate(tensors):
            cut = slices.cut(t.shape, by_row)
            if cut is None:
                continue
            if _runs_of(t):
                cells = self.stats.fresh_runs(t, cut.runs, queue, cut.one_after_another)
            else:
                cells = [fresh(piece, queue) for piece in cut.pieces(t)]
            out.append((i, cut, cells))
        return out

    def _write_tensors(self, rnd, frame, side, dumpable, stats, named, kernel):
        """Queue the `.bin` files of one side (data, or references under filter_level 1 and 2);
        returns its statistic.csv rows (the cells after the head of a side record, statcsv.py)
        and index labels."""
        cfg = rnd.selection.config
        put = self.sink.put
        level = cfg.filter_level if cfg.save_child else 0
        header_only = kernel and level >= 2
        rows, labels = [], []
        files_dir = layout.tensor_dir(layout.op_dir(rnd.record.rel, frame.rel), side)
        layer = frame.layer
        for (i, label, t, dt), st in zip(dumpable, stats):
            index = f"{i}_{_safe_label(label)}" if named and label else str(i)
            labels.append(index)
            dims = t.shape
            fname = layout.tensor_file(side, index)
            in_round = layout.tensor_rel(frame.rel, side, index)
            path_cell = tensor_path_cell(in_round)
            if header_only:
                put(TensorFileJob(files_dir, fname, [encode_reference(dt.code, dims, in_round)],
                                  _FILE_JOB_BYTES, None, path_cell))
            else:
                key = same_bytes_key(t) if level >= 1 and t.numel() else None
                target = _lookup(layer, key, t) if key and not (named and label) else None
                if target is not None:
                    put(TensorFileJob(files_dir, fname, [encode_reference(dt.code, dims, target)],
                                      _FILE_JOB_BYTES, None, path_cell))
                    # This alias keeps the storage alive now, maybe after the first one died.
                    layer.written[key] = (weakref.ref(t), target)
                else:
                    data, ready = host_bytes(t, self.stats.device.landings)
                    put(TensorFileJob(files_dir, fname,
                                      [encode_header(dt.code, dims, data.nbytes), data],
                                      data.nbytes + _FILE_JOB_BYTES, ready, path_cell))
                    if key is not None and layer is not None:
                        layer.written[key] = (weakref.ref(t), in_round)
            rows += (index, dt.csv_name, shape_cell(dims), st, path_cell)
        return rows, labels

    def _queue(self, layer: LayerRecord | None) -> Queue:
        """The queue of pending statistics of a layer execution (a new one for an op outside
        any)."""
        if layer is None:
            return self.stats.new_queue()
        if layer.pending is None:
            layer.pending = self.stats.new_queue()
        return layer.pending


class _RowHandover(threading.local):
    """statistic.csv rows (or request_statistic.csv's, derived_statistic.csv's: `name`) of a
    thread's round that wait to be handed to the writer in one piece: one job (the writer's
    lock, its accounting) per round rather than per layer-level op execution. They are handed over at the end of the
    round (whether the model returned or raised), and sooner once `MAX_WAITING_SIDES` sides or
    `MAX_WAITING_SECONDS` have gathered, so a long round keeps its rows flowing and what waits
    stays small (rows hold no tensor data: only their shapes and statistics cells). Each job
    carries what the writer waits on before reading them: the `Landed` of the device batches
    still on their way, or None."""

    def __init__(self, sink, stats: StatsCache, name: str):
        self.sink, self.stats = sink, stats
        self.name = name
        self.record = None  # the RoundRecord whose rows wait, or None
        self.sides: list = []
        self.since = 0.0    # when the first of them was queued

    def queue(self, record: RoundRecord, sides: list) -> None:
        """Queue `sides` of the round of `record` behind this thread's waiting rows."""
        if self.record is not record:
            self.hand_over()
            self.record, self.since = record, time.monotonic()
        self.sides += sides
        if len(self.sides) >= MAX_WAITING_SIDES or \
                time.monotonic() - self.since >= MAX_WAITING_SECONDS:
            self.hand_over()

    def hand_over(self) -> None:
        """Hand the rows this thread has waiting to the writer, their accelerator statistics
        on their way (`DeviceStatistics.flush`)."""
        record, sides = self.record, self.sides
        if record is None:
            return
        self.record, self.sides = None, []
        if sides:
            self.stats.device.flush()
            size = _ROW_BYTES * sum([side_rows(side) for side in sides])
            requests = self.name != CSV_FILE  # the columns of request_statistic.csv
            self.sink.put(RowsJob(record.rel, self.name, sides,
                                  REQUEST_HEADER if requests else HEADER, size,
                                  self.stats.device.landings.last(), requests))


# Under the writer's own delay for rows (writer.ROWS_DELAY): the rows of a layer execution reach
# the writer in about the same time as when they were handed over at its end.
MAX_WAITING_SECONDS = 0.1
MAX_WAITING_SIDES = 4096
_FILE_JOB_BYTES = 256   # accounted bytes of a file job besides its payload
_ROW_BYTES = 192        # accounted bytes of a statistic.csv row


_class_sums = lru_cache(maxsize=None)(sums_of)


@lru_cache(maxsize=4096)
def _safe_label(label: str) -> str:
    """A parameter label (it may come from a dict key) as a file-name part."""
    return sanitize(label, limit=64)


_INDEX = tuple(str(i) for i in range(64))


def _runs_of(t: torch.Tensor) -> bool:
    """Whether slices of `t` are measured as runs of its memory (`StatsCache.fresh_runs`): a
    contiguous, non-empty host tensor."""
    return t.is_cpu and t.is_contiguous() and t.numel() > 0


def _request_rows(request_cells: list, dumpable: list, labels: list) -> list:
    """The cells after the head of a request_statistic.csv side record (statcsv.py): per
    request slice, its tensor's Index and Dtype, its own Shape, its statistics cell and the
    request."""
    rows = []
    for i, cut, cells in request_cells:
        _add_slice_rows(rows, labels[i], dumpable[i][3].csv_name, cut, cells)
    return rows


def _add_slice_rows(rows: list, index: str, dtype: str, cut, cells: list) -> None:
    """Append the request_statistic.csv cells of one tensor's slices (`cut`, their `cells`),
    the tensor's Index and Dtype on each."""
    for (shape, request), cell in zip(cut.cells, cells):
        rows += (index, dtype, shape, cell, request)


def _output_items(out) -> list:
    """The (label, tensor) items of what an op returned that is not a single tensor."""
    if type(out) is tuple and all(type(t) is torch.Tensor for t in out):
        return [("", t) for t in out]  # what `flatten` makes of it (vLLM's decoder layers)
    items = []
    flatten(out, "", items, None, name_items=False)
    return items


def bound_tensors(pairs) -> list:
    """The tensors of a call's bound arguments, in the order of its rows."""
    items = []
    _tensors_of(pairs, items)
    return [t for _, t in items]


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
                    flatten(value, name, items, None, name_items=True)
                    break
        elif may_hold_tensor(value):
            flatten(value, name, items, None, name_items=True)


# Argument types that never hold a tensor (`_tensors_of` skips them at once).
_NO_TENSOR = frozenset({type(None), bool, int, float, str, torch.dtype, torch.device,
                        torch.layout, torch.memory_format})


def _describe_shard(record: OpRecord, side: str, i: int, label: str, meta: dict) -> None:
    """Note a DTensor's layout under its file's name, for the op's `op_param.json`."""
    name = layout.tensor_name(side, f"{i}_{_safe_label(label)}" if label else i)
    if record.shards is None:
        record.shards = {}
    record.shards[name] = meta


def _uninitialized(layer, tensors: list, writes_args: bool) -> list[str]:
    """The names of a kernel's outputs over memory nothing has written yet: an allocation
    kernel's, and views of it made before anything wrote it (`LayerRecord.uninit`)."""
    if layer is None or not layer.uninit or writes_args:
        return []
    names = []
    for i, t in enumerate(tensors):
        try:
            address = t.untyped_storage().data_ptr()
        except Exception:  # subclasses, tensors without storage
            continue
        if address in layer.uninit:
            names.append(layout.tensor_name(OUTPUT, i))
    return names


def _dumpable(t, full_name: str) -> tuple:
    """A kernel's tensor as its row records it (a subclass's local tensor) and its dtype's
    table entry, None where it cannot be dumped (logged once)."""
    if type(t) is torch.Tensor and t.layout is _STRIDED and not t.is_meta and not t.is_nested:
        dt = DUMPABLE_DTYPES.get(t.dtype)  # `dumpable_dtype` of a plain tensor, inline
    else:
        if type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter:
            t, _ = local_of(t)
        dt = dumpable_dtype(t)
    if dt is None:
        _skipped_in(t, full_name)
    return t, dt


def _skipped(t, frame) -> None:
    _skipped_in(t, frame.full_name)


def _skipped_in(t, full_name: str) -> None:
    log.warn_once(f"skip-{type(t).__name__}-{getattr(t, 'dtype', '')}",
                  f"cannot dump a {type(t).__name__} of dtype {getattr(t, 'dtype', '?')} "
                  f"({full_name}); skipped")


def _lookup(layer, key, t):
    """The file already holding `t`'s bytes in this layer execution, if any.

    An entry is valid while the tensor it was written from is alive (so its memory cannot have
    been reused) and no in-place kernel has written to its storage since: every ATen op inside a
    tracked layer passes the kernel capture, which drops the entries of the storages an op
    writes to (`Recorder.forget_written`). Version counters cannot serve here: inference tensors
    have none, and a view made by a kernel gets its base's counter only after the dispatch
    returns."""
    if layer is None:
        return None
    entry = layer.written.get(key)
    if entry is None:
        return None
    ref, path = entry
    return path if ref() is not None else None
