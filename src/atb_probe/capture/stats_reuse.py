"""Statistics computed once per state of a tensor's memory, not once per appearance, and in
batches: a lookup that misses queues the tensor and returns a pending cell (stats_cell.py), and
`resolve` computes everything queued in one call (stats_compute.py).

Each layer-level op execution has its own `Queue`. The recorder resolves it at the end of the
execution when it sees the kernels inside (and before any kernel there that writes to its
arguments, so what is queued still holds the values of the moment it was seen), and at once
otherwise: there a module side's small contiguous host tensors (and the runs of them a request
each, where those are their rows: a decode step's token per request) are copied instead, and
the copies measured when the thread hands its rows over (`DeviceStatistics.hold`). Queued tensors
are kept alive until then; `Queue.nbytes` lets the recorder bound that.

With `save_child` the same values show up again and again: a kernel's output is the next
kernel's input, a view (`aten.view`, `aten.t`, `aten.unsqueeze`...) holds the values of its
input, and every weight is an input in every round. Max, min, sum and norm depend only on the
multiset of values, and `stats_compute.compute` reduces a dense tensor in storage order, so two
tensors over the same dense memory get bit-identical results.

Before any memory key is computed, a tensor is looked up by identity: the same object, at the
same version, over the same data pointer as when its cell was handed out (the next kernel's
input is most often the previous kernel's output object).

A kernel output over fresh memory goes into no cache when it is made: its queue, which keeps
it alive until it resolves anyway, holds it (`Queue.held`) and hands its cell to the next ops
of the layer execution that take that object, checked the same way. When the queue resolves,
an output that something else still refers to (the layer's output, a tensor a KV cache keeps)
is kept in the cache as below; the others, most of a layer's intermediate tensors, die with
the queue and cost the cache nothing. The reference count tells which is which, and it may
err either way (a reference that only C++ holds, an interpreter that counts its own
differently): a tensor kept for nothing is swept out later, and one left out is measured again
when it is seen next, never taken for another. In a statistics dump the queue holds a view
kernel's outputs too (`view`, `t`, `transpose`...: 40% of a decode step's kernel outputs), and
an entry carries its row's Dtype and Shape cells, so the next op's row of that tensor is one
lookup (`Recorder.kernel_side`). A tensor dump's views are remembered at once instead
(`_remember_output`): holding one keeps it alive longer, and filter_level 1's references follow
what is alive.

A cached value is keyed by that memory (`tensors.storage_key`, plus shape and strides for a
view with gaps) and by the value of the version counter, and is used only for a tensor owned
by the very tensor it was computed from (itself, or its view base) while that one is alive:
its memory cannot have been reused meanwhile, and every in-place change through PyTorch bumps
the counter they share. (`.data` makes an alias
with a counter of its own, starting at 0: the owner check keeps it from matching.)

A write through the `.data` of a parameter or of a view of one (`w.data.mul_(2)`, and as
vLLM's weight loaders write a weight, `w.data.narrow(0, 0, n).copy_(x)` or
`w[:n].data.copy_(x)`) changes `w`'s values and leaves `w._version` as it was. So while the
probe is awake `torch.Tensor.data` is a property (`watch_parameter_data`) that gives the
parameter a new *data epoch* each time the `.data` of it or of a view of it is read or set, and
`_version` reports a tensor's counter together with its owner's epoch: whatever was kept for
the parameter, its views and the kernel outputs over its memory stops matching. (A read alone,
vLLM's `RMSNorm` passing `self.weight.data` to its kernel, only costs that parameter a new
measurement.) The engine clears the cache when the probe wakes, for writes made while it slept.

A collective writes its tensors the same way, behind their counters (gloo's and NCCL's
`c10d::broadcast_`, `allreduce_`...), and weights are written so between rounds: a trainer
broadcasting new weights to its inference ranks, DDP syncing a model's parameters. Inside a
dumped round the kernel capture sees such a kernel (`StatsCache.forget`); between rounds, while
the probe is awake, the `torch.distributed` functions that write in place are wrapped
(`watch_collectives`) to give what they wrote a new data epoch when they return, as `.data`
does for a parameter.

One exception makes kernel outputs special. Inside `__torch_dispatch__` a view made by the
kernel does not share its base's version counter yet (autograd's view tracking sits above the
Python dispatch key and links them only after the kernel returns), so a kernel output is never
looked up in the cache. Instead it reuses the statistics of one of the same kernel's inputs
over the same memory (a view kernel), which is safe when the kernel writes to none of its
arguments; and its own statistics are cached only when it owns fresh memory (no input shares
its storage), whose version counter is its own for good.

A write into a tensor's memory that bypasses PyTorch (through a numpy view or a raw pointer, as
vLLM's own NCCL wrapper writes) bumps no version counter and is not seen while the probe is
awake; nor is one by a collective called through a reference to its function taken before the
probe woke, or by `irecv` (alone: a batch's are seen), or by an `async_op` collective after
its call returned, in a round not dumped; nor is a write through the
`.data` alias of a tensor that is no parameter or view of one (a buffer, an activation), nor
one through a `.data` alias kept from before the parameter's statistics were computed, nor one
inside code that `torch.compile` compiled (it takes `.data` without the property), in a round
not dumped.
"""
from __future__ import annotations

import functools
import inspect
import itertools
import os
import threading
import weakref
from sys import getrefcount

import torch
from torch import nn

from ..stats_cell import EMPTY, QUEUED, new_cell, new_serial, waits_in
from .stats_compute import DeviceStatistics, compute, compute_runs, is_dense
from .tensors import storage_key

# Entries that can no longer be used (their tensor died, or changed since: versions only grow)
# are swept out when a dict reaches its limit: twice what was left after the last sweep, and at
# least MIN_ENTRIES. The small floor keeps dead entries (and their weak references, which the
# garbage collector tracks) from living long enough to be promoted to its oldest generation;
# doubling keeps the sweeps' cost linear in the insertions. What is left is one entry per live
# tensor (per view shape of it); a process holding more than MAX_ENTRIES such tensors loses them
# all at once, and only recomputes statistics.
MIN_ENTRIES = 512
MAX_ENTRIES = 1 << 16
_NO_KEY = object()  # `_lookup` did not compute the memory key
_NO_ROW = (None, None)  # a held output's row cells, where its kernel gave none


def memory_key(t: torch.Tensor):
    """What the statistics of `t` are computed over, or None when it cannot be told: its
    `storage_key`, plus shape and strides unless its elements fill that memory densely."""
    try:
        key = storage_key(t)
    except Exception:  # subclasses, tensors without storage
        return None
    if t.is_contiguous() or is_dense(t):
        return key
    return key + (tuple(t.shape), tuple(t.stride()))


def _owner(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose version counter `t` uses: its view base, else itself. (`.data` and
    `detach()` give aliases with a base of None: they count as owners of their own, and miss.)"""
    base = t._base
    return t if base is None else base


def version_of(t: torch.Tensor):
    """What says `t`'s values changed: its version counter, with its owner's data epoch when
    that owner may have been written behind the counter (a parameter's `.data` taken, a
    collective's write: see the module docstring); None when there is none."""
    # Inference tensors (made under torch.inference_mode, as serving engines run) have no
    # version counter; asking raises, and a raised C++ error costs ~15 us.
    if t.is_inference():
        return None
    try:
        version = t._version
    except Exception:
        return None
    if _DATA_EPOCHS:
        base = t._base
        epoch = _DATA_EPOCHS.get(id(t) if base is None else id(base))
        if epoch is not None:
            return version, epoch
    return version


# -- writes through a parameter's `.data` --------------------------------------------------------

_DATA_EPOCHS: dict = {}  # id(owner) -> its latest data epoch; the entry goes with the owner
_next_epoch = itertools.count(1).__next__
_TENSOR_DATA = torch._C.TensorBase.__dict__["data"]  # the getter and setter the property wraps
_watchers = 0
_watch_lock = threading.Lock()


def _data_taken(t) -> None:
    """`t.data` was read or set: when `t` is a parameter or a view of one, that parameter's
    values may change behind its version counter; give it a new data epoch."""
    base = t._base
    p = t if base is None else base
    if isinstance(p, _PARAMETER):
        _new_epoch(p)


def _new_epoch(p) -> None:
    """`p`'s values may have changed behind its version counter: give it a new data epoch, so
    that whatever was kept for it, its views and the kernel outputs over its memory stops
    matching (`version_of`)."""
    key = id(p)
    if key not in _DATA_EPOCHS:
        try:
            weakref.finalize(p, _DATA_EPOCHS.pop, key, None)
        except TypeError:  # not weak-referenceable: an entry could outlive it, under its id
            return
    _DATA_EPOCHS[key] = _next_epoch()


def _get_data(self):
    if type(self) is _TENSOR or isinstance(self, _PARAMETER):
        _data_taken(self)
    return _TENSOR_DATA.__get__(self, type(self))


def _set_data(self, value):
    _TENSOR_DATA.__set__(self, value)
    if type(self) is _TENSOR or isinstance(self, _PARAMETER):
        _data_taken(self)


# A parameter is an nn.Parameter, its views plain tensors. Other tensor subclasses are passed
# by: `torch.compile` traces this property for those with a `__torch_function__` of their own,
# and would break its graph at `_base`.
_TENSOR, _PARAMETER = torch.Tensor, nn.Parameter
_WATCHED_DATA = property(_get_data, _set_data, doc=_TENSOR_DATA.__doc__)


def watch_writes(on: bool) -> None:
    """Watch (`on`) or stop watching, once the last awake probe asks, the writes that bump no
    version counter but can be seen from Python: through a parameter's `.data`
    (`watch_parameter_data`) and by the collectives of `torch.distributed`
    (`watch_collectives`)."""
    watch_parameter_data(on)
    watch_collectives(on)


def watch_parameter_data(on: bool) -> None:
    """Install (`on`) or take back, once the last awake probe asks, the `torch.Tensor.data`
    property that gives a parameter a new data epoch whenever the `.data` of it or of a view
    of it is read or set. A `data` that torch.Tensor already defines (another tool's) is left
    alone, and then such writes are not seen."""
    global _watchers
    with _watch_lock:
        _watchers = max(0, _watchers + (1 if on else -1))
        mine = torch.Tensor.__dict__.get("data") is _WATCHED_DATA
        if _watchers and not mine and "data" not in torch.Tensor.__dict__:
            torch.Tensor.data = _WATCHED_DATA
        elif not _watchers and mine:
            del torch.Tensor.data


def _after_fork(ref) -> None:
    cache = ref()
    if cache is not None:
        cache._lock = threading.Lock()
        cache.device.after_fork()


# Elements of the largest host tensor whose statistics `Queue.resolve` may leave for later,
# and the classes of the tensors it may (no subclass whose `clone` could do anything else).
HOLD_LARGEST = 4096
_PLAIN = frozenset({torch.Tensor, torch.nn.Parameter})


def _small_plain(t) -> bool:
    """Whether `DeviceStatistics.hold` may copy `t`: a plain contiguous host tensor of at most
    HOLD_LARGEST elements."""
    return type(t) in _PLAIN and t.is_cpu and t.numel() <= HOLD_LARGEST and t.is_contiguous()


class Queue:
    """Tensors of one thread's layer-level op execution whose statistics are pending, and
    their cells (see the module docstring)."""

    __slots__ = ("tensors", "cells", "runs", "nbytes", "serial", "device", "held", "cache")

    def __init__(self, device: DeviceStatistics, cache: StatsCache):
        self.device = device  # where accelerator tensors are reduced
        self.tensors: list = []
        self.cells: list = []
        self.runs: list = []  # (host tensor, runs, cells, one after another): `fresh_runs`
        self.nbytes = 0       # bytes of the tensors kept alive for it
        self.serial = new_serial()  # what its cells say they wait in
        # id(t) -> (t, its version, cell, its data pointer, its row's Dtype and Shape cells or
        # None, the input whose memory it views or None): kernel outputs whose cells go to the
        # next ops that take them, until the queue resolves (`StatsCache.output_cell`).
        self.held: dict = {}
        self.cache = cache    # where `held` outputs still referred to go when it resolves

    def resolve(self, later: bool = False) -> None:
        """Compute every queued statistic (one batch) and let go of the tensors. A tensor
        measured whole and by runs (a request's tokens) is converted once for both. Then the
        outputs held here that something else still refers to go to the cache.

        `later`: where every queued tensor is a small contiguous host tensor, cut (if at all)
        into runs of one length that tile it (an op side of a decode step, in vLLM a token
        per request), they are copied instead and measured with the thread's others when it
        hands its rows over (`DeviceStatistics.hold`)."""
        held = self.held
        if held:
            self.held = {}
        if later and (self.tensors or self.runs) and self._holdable():
            self.device.hold(self.tensors, self.cells, self.runs)
            # (no reference to them left here: `_keep_held` counts what still refers to them)
            self.tensors, self.cells, self.runs, self.nbytes = [], [], [], 0
        elif self.tensors or self.runs:
            self._compute()
        if held:
            self.cache._keep_held(held)

    def _holdable(self) -> bool:
        """Whether `DeviceStatistics.hold` may take what is queued: plain, contiguous host
        tensors of at most HOLD_LARGEST elements, and runs of one length, one after another
        from the first element to the last (each run a row of the tensor)."""
        for t in self.tensors:
            if not _small_plain(t):
                return False
        for t, runs, _, one_after_another in self.runs:
            if not (one_after_another and _small_plain(t) and runs[0][0] == 0 and
                    len(runs) * runs[0][1] == t.numel()):
                return False
        return True

    def _compute(self) -> None:
        tensors, cells, runs = self.tensors, self.cells, self.runs
        self.tensors, self.cells, self.runs, self.nbytes = [], [], [], 0
        if runs:
            tensors, cells = compute_runs(runs, tensors, cells)
        if tensors:
            compute(tensors, cells, self.device)


class StatsCache:
    """`statistics` of a side of an op, reusing earlier results (see the module docstring).

    One cache serves every model thread. `_lock` guards the changes to `_entries`, `_seen` and
    their limits (a store, the sweep that walks the entries, a clear): two threads sweeping at
    once would delete the same key, or change the dict while the other walks it. Lookups take
    no lock: a dict read is atomic, and an entry is checked against its live owner before it
    is used."""

    def __init__(self):
        self.device = DeviceStatistics()
        self._entries: dict = {}
        self._limit = MIN_ENTRIES
        # id(tensor) -> (weak reference to it, its version, cell, its data pointer): the same
        # tensor object at the same version over the same memory (the next kernel's input is
        # the last one's output) is found without computing its memory key. (`t.data = other`
        # keeps the object and its version counter but not the pointer.)
        self._seen: dict = {}
        self._seen_limit = MIN_ENTRIES
        self._lock = threading.Lock()
        # A fork while another thread holds the lock would leave it held for good in the child.
        ref = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: _after_fork(ref))

    def new_queue(self) -> Queue:
        """An empty queue for the statistics of one layer-level op execution."""
        return Queue(self.device, self)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._seen.clear()
            self._limit = self._seen_limit = MIN_ENTRIES

    def forget(self, t) -> None:
        """`t` is about to be written by a kernel: what is kept for it at its present version is
        no longer its value. A kernel that bumps the version counter makes this moot; a
        collective (`c10d::allreduce_`, gloo or NCCL writing in place) does not bump it."""
        key, version = memory_key(t), version_of(t)
        with self._lock:
            self._seen.pop(id(t), None)
            if key is not None and version is not None:
                self._entries.pop(key + (version,), None)

    def side(self, queue: Queue, tensors: list, kernel_output: bool = False, inputs_seen=None,
             remember_inputs: bool = False, view: bool = False):
        """The cells of `tensors`, in order: earlier results, or new cells pending in
        `queue` (a cell pending in another thread's queue is not used: it may never be
        computed before this thread's rows are written).

        `kernel_output`: the tensors are a kernel's outputs, inside the dispatch; then
        `inputs_seen` is what the same kernel's inputs left (see `remember_inputs`), or None
        when the kernel writes to its arguments. `remember_inputs`: also return what these
        tensors leave for the outputs of the same kernel; `view`: the kernel returns aliases
        of its inputs (`kernels.Kernel.view`). Returns (cells, that or None)."""
        if kernel_output:
            cells = [self.output_cell(t, queue, inputs_seen, view) for t in tensors]
            return cells, None
        cells = []
        seen_get = self._seen.get
        held_get = queue.held.get
        for t in tensors:
            # Most inputs of an op are the outputs of the kernels before it in the same layer
            # execution, held by the queue (`output_cell`).
            held = held_get(id(t))
            if held is not None and held[1] == version_of(t) and held[3] == t.data_ptr():
                cells.append(held[2])
                continue
            cells.append(self.input_cell(t, queue, seen_get))
        return cells, ((tensors, cells) if remember_inputs else None)

    def input_cell(self, t, queue: Queue, seen_get=None):
        """The cell of `t`, an input of an op, not held by `queue` (`side`): an earlier result
        found by identity or memory key, else a new one pending in `queue` and kept."""
        # The identity check of `_lookup`, inline: the hidden state, position embeddings,
        # weights.
        seen = (seen_get or self._seen.get)(id(t))
        if seen is not None and seen[0]() is t and seen[3] == t.data_ptr() and \
                seen[1] == version_of(t) and (len(seen) == 4 or _valid(seen)):
            cell = seen[2]
            if cell[-1] != QUEUED or self._usable_here(cell, queue):
                return cell
        cell, key, version = self._lookup(t, queue)
        if cell is None:
            cell = self._new(t, queue)
            if cell is not EMPTY and version is not None:
                self._keep(t, cell, memory_key(t) if key is _NO_KEY else key, version)
        return cell

    def _lookup(self, t, queue: Queue):
        """The cell of `t`'s values as they are, if known and usable here, else None; `t`'s
        memory key where it was computed on the way (else `_NO_KEY`); and its version."""
        version = version_of(t)
        if version is None:
            return None, None, None  # nothing is kept for it either (`_keep`)
        key = _NO_KEY
        seen = self._seen.get(id(t))
        if seen is not None and seen[1] == version and seen[0]() is t and \
                seen[3] == t.data_ptr() and (len(seen) == 4 or _valid(seen)):
            cell = seen[2]
        else:
            key = memory_key(t)
            entry = self._entries.get(key + (version,)) if key is not None else None
            if entry is None or entry[0]() is not _owner(t):
                return None, key, version
            cell = entry[1]
            self._remember(t, version, cell)
        if cell[-1] == QUEUED and not self._usable_here(cell, queue):
            return None, key, version
        return cell, key, version

    def _usable_here(self, cell, queue: Queue) -> bool:
        """Whether a `QUEUED` cell is computed before this thread's rows are written: it waits
        in `queue`, or in this thread's accelerator buffers (`DeviceStatistics.gather`)."""
        serial = waits_in(cell)
        return serial == queue.serial or serial == self.device.serial_here()

    def output_cell(self, t, queue: Queue, inputs_seen, view: bool, row=_NO_ROW):
        """The cell of a kernel output: that of an input over the same memory (a view
        kernel), else a new one. An output over fresh memory is held by the queue
        (`Queue.held`), which keeps it alive until it resolves anyway, for the next ops that
        take this very object, and goes to the cache then only if anything else still refers
        to it (`_keep_held`): most outputs of a layer execution are dead by then, and never
        looked up again. An output over an input's storage is remembered by identity
        (`_remember_output`) at once, or, given its `row`, held as well and remembered only if
        it outlives the queue. `view`: the kernel returns aliases of its inputs.

        `row`: the (Dtype, Shape) cells of the output's statistic.csv row, held with it so
        that an op taking it next makes its row from the entry (`Recorder.kernel_side`).
        Only a statistics dump's kernels give it: a view held past its kernel lives longer,
        and a tensor dump's references (filter_level 1) follow what lives."""
        if inputs_seen is None:  # an in-place kernel: not kept
            return self._new(t, queue)
        try:
            address = t.untyped_storage().data_ptr()
        except Exception:  # subclasses, tensors without storage: not kept
            return self._new(t, queue)
        key = _NO_KEY
        shared = cell = None
        for it, seen in zip(*inputs_seen):
            try:
                if it.untyped_storage().data_ptr() != address:
                    continue
            except Exception:  # subclasses, tensors without storage
                continue
            shared = it
            if key is _NO_KEY:
                key = memory_key(t)
            if seen is not EMPTY and key is not None and memory_key(it) == key:
                cell = seen
                break
        if cell is None:
            cell = self._new(t, queue)
            if cell is EMPTY:
                return cell
        if shared is None:
            # Fresh memory: its version counter is its own for good.
            version = version_of(t)
            if version is not None:
                queue.held[id(t)] = (t, version, cell, t.data_ptr(), *row, None)
        elif view and row is not _NO_ROW:
            # Its counter becomes its base's once the kernel returns (`_remember_output`).
            version = version_of(_owner(shared))
            if version is not None:
                queue.held[id(t)] = (t, version, cell, t.data_ptr(), *row, shared)
        else:
            self._remember_output(t, cell, shared, view)
        return cell

    def _keep_held(self, held: dict) -> None:
        """A queue resolved: the outputs it held that something else refers to (a layer's
        output, a cache's tensor) are kept for later lookups, by memory key and identity as
        `_keep` keeps them (a view by identity, as `_remember_output`); the others die once
        the queue lets go of them. (A held view refers to the input it was made from: that
        reference is not counted.)"""
        sources = None
        for entry in held.values():
            if entry[6] is not None:
                if sources is None:
                    sources = {}
                key = id(entry[6])
                sources[key] = sources.get(key, 0) + 1
        for entry in held.values():
            t = entry[0]
            if getrefcount(t) > _HELD_REFS + (sources.get(id(t), 0) if sources else 0):
                if entry[6] is None:
                    self._keep(t, entry[2], memory_key(t), entry[1])
                else:
                    self._remember_output(t, entry[2], entry[6], True)

    def _remember_output(self, t, cell, source, view: bool) -> None:
        """Remember, by identity only, the cell of a kernel output over the memory of its input
        `source` (a view, a slice, `aten._unsafe_view`'s reshaped matmul result), for the next
        op that takes this very object; otherwise it is looked up by memory key, where an
        output that is no autograd view of its input misses and is measured again.

        Inside the dispatch the output's version counter is a new one of its own. A view
        kernel's (`view`: its schema says it returns an alias) becomes its base's once the
        kernel returns, so its entry expects the base's present version; any other output
        keeps its own, which no write through `source` bumps. Either way the entry also holds
        `source`'s owner and that one's version (`_valid`), so a view whose counter is never
        linked (made below autograd's view tracking) is not taken for unchanged either."""
        owner = _owner(source)
        owner_version = version_of(owner)
        if owner_version is None:
            return  # inference tensors: no counters, nothing kept (as in `_keep`)
        try:
            entry = (weakref.ref(t), owner_version if view else version_of(t), cell, t.data_ptr(),
                     weakref.ref(owner), owner_version)
        except (TypeError, RuntimeError):  # not weak-referenceable, no storage
            return
        with self._lock:
            self._set_seen(t, entry)

    def fresh(self, t, queue: Queue):
        """A new cell for `t` pending in `queue`, with no lookup and nothing kept: for a tensor
        made only to be measured (a request's slice of another), which dies with the queue."""
        return self._new(t, queue)

    @staticmethod
    def fresh_runs(t, runs: list, queue: Queue, one_after_another: bool = False) -> list:
        """`fresh` cells of slices of a contiguous host tensor `t`, each a run (start, stop) of
        its elements in storage order (a request's tokens), pending in `queue`: measured
        from `t` itself when the queue resolves, no tensor made per slice.
        `one_after_another`: the runs are of one length, each starting where the one before
        ends (`stats_compute.compute_runs`)."""
        if one_after_another:  # none empty
            serial = queue.serial
            cells = [new_cell(serial) for _ in runs]
        else:
            cells = [EMPTY if start >= stop else new_cell(queue.serial) for start, stop in runs]
        queue.runs.append((t, runs, cells, one_after_another))
        queue.nbytes += t.numel() * t.element_size()
        return cells

    @staticmethod
    def _new(t, queue: Queue):
        """A new cell for `t`, pending in `queue` (EMPTY for an empty tensor)."""
        n = t.numel()
        if not n:
            return EMPTY
        cell = new_cell(queue.serial)
        queue.tensors.append(t)
        queue.cells.append(cell)
        queue.nbytes += n * t.element_size()
        return cell

    def _keep(self, t, cell, key, version) -> None:
        """Remember `cell` for `t`'s memory at its present `version` (not None): by memory key
        and by identity, under one taking of the lock."""
        if key is None:
            return
        try:
            ref = weakref.ref(t)
            seen = (ref, version, cell, t.data_ptr())
        except (TypeError, RuntimeError):  # not weak-referenceable, no storage
            ref = seen = None
        owner = _owner(t)
        try:
            entry = (ref if owner is t and ref is not None else weakref.ref(owner), cell)
        except TypeError:  # not weak-referenceable
            entry = None
        with self._lock:
            if entry is not None:
                entries = self._entries
                if len(entries) >= self._limit:
                    self._limit = _sweep(entries, _stale_entry)
                entries[key + (version,)] = entry
            if seen is not None:
                self._set_seen(t, seen)

    def _remember(self, t, version, cell) -> None:
        try:
            entry = (weakref.ref(t), version, cell, t.data_ptr())
        except (TypeError, RuntimeError):  # not weak-referenceable, no storage
            return
        with self._lock:
            self._set_seen(t, entry)

    def _set_seen(self, t, entry) -> None:
        """(Holding `_lock`.) The identity entry of `t`, the dict swept first at its limit."""
        seen = self._seen
        if len(seen) >= self._seen_limit:
            self._seen_limit = _sweep(seen, _stale_seen)
        seen[id(t)] = entry


# What `StatsCache._keep_held` counts of a held tensor's references before anything else's: its
# entry in `Queue.held`, a local variable and `getrefcount`'s argument. (The queue's lists let go
# of it first: `Queue.resolve`.)
_HELD_REFS = 3


def _sweep(entries: dict, stale) -> int:
    """Delete the entries `stale(key, entry)` says are of no more use; the dict's next limit
    (see MIN_ENTRIES)."""
    for k in [k for k, e in entries.items() if stale(k, e)]:
        del entries[k]
    if len(entries) >= MAX_ENTRIES:
        entries.clear()
    return max(MIN_ENTRIES, 2 * len(entries))


def _valid(entry) -> bool:
    """The owner check of a `_seen` entry of a kernel output over its input's memory
    (`StatsCache._remember_output`): that input's owner is unchanged, or dead (then nothing
    but the output itself and its views can write that memory)."""
    owner = entry[4]()
    return owner is None or version_of(owner) == entry[5]


def _stale_seen(key, entry) -> bool:
    """`_seen`: id -> (weak reference to the tensor, its version, cell, data pointer), plus
    (weak reference to an owner, its version) for `_remember_output`'s entries."""
    t = entry[0]()
    return t is None or version_of(t) != entry[1] or (len(entry) > 4 and not _valid(entry))


def _stale_entry(key, entry) -> bool:
    """`_entries`: memory key + (version,) -> (weak reference to the owner, cell)."""
    owner = entry[0]()
    return owner is None or version_of(owner) != key[-1]


# -- writes by collectives between rounds --------------------------------------------------------

# The functions of torch.distributed that write tensors in place, and the parameter naming what
# they write (a tensor or a list of tensors). `isend` and `irecv` are left as they are: `P2POp`
# takes only the very functions of torch; a batch's receives are marked by the wrapper of
# `batch_isend_irecv`.
_COLLECTIVES = {
    "broadcast": "tensor", "all_reduce": "tensor", "reduce": "tensor", "recv": "tensor",
    "scatter": "tensor", "all_gather": "tensor_list", "gather": "gather_list",
    "all_gather_into_tensor": "output_tensor", "_all_gather_base": "output_tensor",
    "reduce_scatter": "output", "reduce_scatter_tensor": "output",
    "_reduce_scatter_base": "output", "all_to_all": "output_tensor_list",
    "all_to_all_single": "output", "all_reduce_coalesced": "tensors",
}
_collective_watchers = 0
_wrapped: list = []  # (module, name, the function found there, its wrapper) while installed


def _mark_written(written, args, kwargs) -> None:
    """A collective called with `args` and `kwargs` wrote `written(args, kwargs)` (a tensor, a
    list of them, or None): new data epochs for their owners. (An inference tensor has no
    counter, so nothing is kept for it.) Arguments the collective refused name nothing: its
    own error is what its caller gets."""
    try:
        found = written(args, kwargs)
        for t in (found,) if isinstance(found, torch.Tensor) else found or ():
            if isinstance(t, torch.Tensor) and not t.is_inference():
                _new_epoch(_owner(t))
    except Exception:
        pass


def _marking(fn, written):
    """A wrapper of the collective `fn` that marks what it wrote, `written(args, kwargs)`,
    once it returns. Compiled code calls `fn` itself (torch.compile traces it)."""
    @functools.wraps(fn)
    def collective(*args, **kwargs):
        if torch.compiler.is_compiling():
            return fn(*args, **kwargs)
        try:
            return fn(*args, **kwargs)
        finally:
            _mark_written(written, args, kwargs)

    return collective


def _argument(fn, name: str, index: int | None = None):
    """What a call of `fn` passes as its argument `name` (at position `index`, else where
    `fn`'s signature puts it), as a function of (args, kwargs); None when `fn` has no such
    argument."""
    if index is None:
        try:
            index = list(inspect.signature(fn).parameters).index(name)
        except (TypeError, ValueError):  # no signature, or another one
            return None
    return lambda args, kwargs: args[index] if len(args) > index else kwargs.get(name)


@functools.lru_cache(maxsize=None)
def _collective_wrappers() -> tuple:
    """(module, name, function, its wrapper) for each collective to wrap, in the
    `torch.distributed` package and the module that defines them: made once (a signature is
    read for each), installed at each wake-up where that function is there."""
    if not (hasattr(torch, "distributed") and torch.distributed.is_available()):
        return ()
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d
    made = {}
    for name, argument in _COLLECTIVES.items():
        fn = getattr(c10d, name, None)
        written = _argument(fn, argument) if fn is not None else None
        if written is not None:
            made[name] = (fn, _marking(fn, written))
    # DDP syncs a model's parameters and buffers with this one (`dist._broadcast_coalesced`,
    # a C++ function without a signature: (process group, tensors, buffer size, source)).
    broadcast_coalesced = getattr(dist, "_broadcast_coalesced", None)
    if broadcast_coalesced is not None:
        made["_broadcast_coalesced"] = (broadcast_coalesced, _marking(
            broadcast_coalesced, _argument(broadcast_coalesced, "tensors", 1)))
    batch, irecv = getattr(c10d, "batch_isend_irecv", None), getattr(c10d, "irecv", None)
    if batch is not None and irecv is not None:
        made["batch_isend_irecv"] = (batch, _marking(batch, lambda args, kwargs: [
            op.tensor for op in (args[0] if args else kwargs.get("p2p_op_list", ()))
            if getattr(op, "op", None) is irecv]))
    return tuple((module, name, fn, wrapper) for module in (dist, c10d)
                 for name, (fn, wrapper) in made.items())


def watch_collectives(on: bool) -> None:
    """Install (`on`) or take back, once the last awake probe asks, the wrappers of the
    collectives of `torch.distributed` that write in place (`_COLLECTIVES`). A function that
    another tool has replaced is left alone (its writes are not seen); a wrapper of ours that
    another one has wrapped since stays in the chain, marking what it writes."""
    global _collective_watchers
    with _watch_lock:
        _collective_watchers = max(0, _collective_watchers + (1 if on else -1))
        if _collective_watchers and not _wrapped:
            try:
                wrappers = _collective_wrappers()
            except Exception:  # a torch.distributed unlike the one known here: not watched
                wrappers = ()
            for module, name, fn, wrapper in wrappers:
                if getattr(module, name, None) is fn:  # (else another tool's: left alone)
                    setattr(module, name, wrapper)
                    _wrapped.append((module, name, fn, wrapper))
        elif not _collective_watchers and _wrapped:
            for module, name, fn, wrapper in _wrapped:
                if getattr(module, name, None) is wrapper:
                    setattr(module, name, fn)
            _wrapped.clear()
