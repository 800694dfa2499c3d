"""Module calls as ops: the call tree of SPEC §1 (root, containers, layer-level ops, children).

While the probe is awake, `torch.nn.Module.__call__` is replaced by a thin wrapper; while it
sleeps the original is back in place and the model pays nothing. Each thread keeps its own op
stack, so a server running the model in worker threads gets one consistent tree per thread.

* A module called with an empty stack is a *root*: its call is one *round*, and the round's
  configuration is fixed when it starts (a config change applies at the next round).
* The root is a *container*; so is any module called from a container that owns an
  `nn.ModuleList`/`nn.Sequential` of two or more modules.
* Non-container modules called from a container are *layer-level* ops, numbered 0, 1, 2... in
  the round. Below them every module and kernel is a *child*, numbered among its siblings.

Children are followed only inside layer-level ops whose subtree the selection may write; every
other call goes straight to the original `__call__` after one stack check.
"""
from __future__ import annotations

import sys
import threading
import weakref

import torch
from torch import nn

from ..naming import sanitize
from ..selection import LayerPlan, SKIP_LAYER
from .arguments import bind_args, forward_params
from .kernels import KernelCapture, kernel_info
from .recorder import Recorder

_CALL_CODES = frozenset({nn.Module._call_impl.__code__, nn.Module._wrapped_call_impl.__code__})


class ModuleInfo:
    """What the probe needs to know about one module, computed once."""

    __slots__ = ("name", "is_container", "params", "__weakref__")

    def __init__(self, module: nn.Module):
        self.name = sanitize(type(module).__name__)
        self.is_container = _is_container(module)
        self.params = forward_params(type(module))


def _is_container(module: nn.Module) -> bool:
    return any(isinstance(child, (nn.ModuleList, nn.Sequential)) and len(child) >= 2
               for child in module._modules.values())


class Frame:
    """One op execution on a thread's op stack."""

    __slots__ = ("op_id", "name", "full_name", "rel", "children", "dump", "dump_children",
                 "passthrough", "track", "container", "nodes", "layer", "inputs", "outputs",
                 "param", "reuse")

    def __init__(self, op_id="", name="", full_name="", rel="", dump=False, dump_children=False,
                 passthrough=True, track=False, container=False, layer=None):
        self.op_id = op_id
        self.name = name
        self.full_name = full_name
        self.rel = rel                # op folder relative to the round folder
        self.children = 0             # child IDs handed out so far
        self.dump = dump
        self.dump_children = dump_children
        self.passthrough = passthrough  # calls below go straight to the original __call__
        self.track = track
        self.container = container
        self.nodes = None             # structure of the children, when collected
        self.layer = layer            # the enclosing layer-level op execution
        self.inputs = 0               # number of input tensors (for structure files)
        self.outputs = 0
        self.param = None             # op_param.json content, once known
        self.reuse = None             # kernels: statistics of inputs for the outputs (statscache)


class Round:
    """One root call: its number, the configuration it runs under, and its progress."""

    __slots__ = ("index", "selection", "config", "rel", "dumping", "layer_count", "layer_nodes",
                 "root_name", "phase", "root_module")

    def __init__(self, index, selection, rel, dumping):
        self.index = index
        self.selection = selection
        self.config = selection.config if selection is not None else None
        self.rel = rel
        self.dumping = dumping
        self.layer_count = 0
        self.layer_nodes = []
        self.root_name = ""
        self.phase = "Forward"
        self.root_module = None


class LayerRun:
    """Per layer-level op execution: what was written (for filter_level 1), its statistic.csv
    rows (handed to the writer in one piece when the layer ends), its pending statistics and
    structure."""

    __slots__ = ("written", "collect", "rows", "deferred", "pending")

    def __init__(self, collect: bool, deferred: bool = False):
        self.written = {}     # same_bytes_key -> (weakref to tensor, path in round)
        self.collect = collect
        self.rows = []
        self.deferred = deferred  # kernels seen: statistics may wait for the end (recorder)
        self.pending = None       # statscache.Queue, once something is pending


class _ThreadState(threading.local):
    def __init__(self):
        self.stack: list[Frame] = []
        self.round: Round | None = None


_PASS = Frame()


class Engine:
    """Installs the `__call__` wrapper and walks the call tree for one `Probe`."""

    def __init__(self, probe):
        self.probe = probe
        self.tls = _ThreadState()
        self.recorder = Recorder(probe)
        self._infos: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._original = None
        self._lock = threading.Lock()
        self.active_rounds = 0
        self._sleep_requested = False

    # -- installing -------------------------------------------------------------------------

    def install(self) -> None:
        with self._lock:
            self._sleep_requested = False
            if self._original is not None:
                return
            original = nn.Module.__call__
            engine, tls = self, self.tls

            def __call__(module, *args, **kwargs):
                stack = tls.stack
                if stack:
                    top = stack[-1]
                    if top.passthrough:
                        return original(module, *args, **kwargs)
                    return engine.child_call(top, module, args, kwargs)
                return engine.root_call(module, args, kwargs)

            __call__.__atb_probe__ = True
            self._original = original
            nn.Module.__call__ = __call__

    def uninstall(self, force: bool = False) -> None:
        """Put the original `__call__` back, at once when no round is running, else after the
        last running round ends (a round is never cut in two)."""
        with self._lock:
            if self._original is None:
                return
            if self.active_rounds and not force:
                self._sleep_requested = True
                return
            self._restore()

    def _restore(self) -> None:
        """(Holding `_lock`.) Put the original `__call__` back."""
        if getattr(nn.Module.__call__, "__atb_probe__", False):
            nn.Module.__call__ = self._original
        self._original = None
        self._sleep_requested = False

    def after_fork(self) -> None:
        """In a forked child only the forking thread survives: start its stack afresh."""
        self.tls.stack.clear()
        self.tls.round = None
        self._lock = threading.Lock()
        self.active_rounds = 0

    @property
    def original_call(self):
        return self._original or nn.Module.__call__

    def info(self, module) -> ModuleInfo:
        info = self._infos.get(module)
        if info is None:
            info = ModuleInfo(module)
            self._infos[module] = info
        return info

    # -- roots and rounds -------------------------------------------------------------------

    def root_call(self, module, args, kwargs):
        original = self.original_call
        stack = self.tls.stack
        rnd = None
        try:
            # Once sleep is requested no new round starts, so the running ones drain and the
            # original __call__ goes back even while other threads keep calling the model.
            if self._sleep_requested or _joined_mid_call() or torch.compiler.is_compiling():
                frame = _PASS
            else:
                rnd = self.begin_round(module, args, kwargs)
                frame = Frame(container=True, passthrough=not rnd.dumping)
        except Exception as exc:
            self.probe.report(exc)
            frame = _PASS
        stack.append(frame)
        try:
            return original(module, *args, **kwargs)
        finally:
            stack.pop()
            if rnd is not None:
                self.end_round(rnd)

    def begin_round(self, module, args, kwargs) -> Round:
        probe = self.probe
        selection = probe.selection
        index = probe.next_round()
        with self._lock:
            self.active_rounds += 1
        device = probe.decide_device(module, args, kwargs)
        # Once the writer has stopped (disk full, I/O error) nothing more is captured.
        dumping = selection is not None and selection.round_selected(index, device) \
            and not probe.writer.failed
        rnd = Round(index, selection, f"data/{probe.devpid}/{index}", dumping)
        self.tls.round = rnd
        if dumping:
            info = self.info(module)
            rnd.root_name = info.name
            rnd.root_module = module
            rnd.phase = _phase(info.params, args, kwargs)
        return rnd

    def end_round(self, rnd: Round) -> None:
        self.tls.round = None
        try:
            if rnd.dumping:
                self.recorder.end_round(rnd)
        except Exception as exc:
            self.probe.report(exc)
        finally:
            # Checked and done under one lock: a wake-up (install) in between must win.
            with self._lock:
                self.active_rounds -= 1
                if self._sleep_requested and not self.active_rounds:
                    self._restore()

    # -- ops below the root -----------------------------------------------------------------

    def child_call(self, parent: Frame, module, args, kwargs):
        original = self.original_call
        rnd = self.tls.round
        mode = None
        try:
            frame, mode = self.enter(rnd, parent, module, args, kwargs)
        except Exception as exc:
            self.probe.report(exc)
            frame = None
        if frame is None:
            return original(module, *args, **kwargs)
        stack = self.tls.stack
        stack.append(frame)
        if mode is not None:
            mode.__enter__()
        try:
            out = original(module, *args, **kwargs)
        except BaseException:
            if parent.container and frame.layer is not None:
                self.recorder.flush_rows(rnd, frame.layer)  # what ran is still recorded
            raise
        finally:
            if mode is not None:
                mode.__exit__(None, None, None)
            stack.pop()
        try:
            self.leave(rnd, parent, frame, out)
        except Exception as exc:
            self.probe.report(exc)
        return out

    def enter(self, rnd: Round, parent: Frame, module, args, kwargs):
        info = self.info(module)
        if parent.container:
            if info.is_container:
                return Frame(container=True, passthrough=False), None
            return self.enter_layer(rnd, module, info, args, kwargs)
        index = parent.children
        parent.children += 1
        op_id = f"{parent.op_id}_{index}"
        full_name = f"{parent.full_name}/{info.name}"
        dump, dump_children = rnd.selection.child_selected(op_id, full_name, info.name,
                                                           parent.dump_children)
        frame = Frame(op_id, info.name, full_name, f"{parent.rel}/{index}_{info.name}", dump,
                      dump_children, passthrough=False, track=True, layer=parent.layer)
        if frame.dump or frame.layer.collect:  # else nothing to record: skip the context
            with torch._C._DisableTorchDispatch():
                self.recorder.module_inputs(rnd, frame, module, info, args, kwargs, named=True)
        return frame, None

    def enter_layer(self, rnd: Round, module, info: ModuleInfo, args, kwargs):
        index = rnd.layer_count
        rnd.layer_count += 1
        op_id = str(index)
        plan: LayerPlan = rnd.selection.layer_plan(op_id, info.name) if rnd.selection else \
            SKIP_LAYER
        layer = LayerRun(self.recorder.wants_structure(rnd, info.name, op_id, plan.track_children),
                         deferred=plan.track_children)
        frame = Frame(op_id, info.name, info.name, f"{op_id}_{info.name}", plan.dump,
                      plan.dump_children, passthrough=not plan.track_children,
                      track=plan.track_children, layer=layer)
        self.recorder.module_inputs(rnd, frame, module, info, args, kwargs, named=False)
        mode = KernelCapture(self) if plan.track_children else None
        return frame, mode

    def leave(self, rnd: Round, parent: Frame, frame: Frame, out) -> None:
        if frame.container and not frame.op_id:
            return
        is_layer = parent.container
        try:
            if frame.dump or (frame.layer is not None and frame.layer.collect):
                with torch._C._DisableTorchDispatch():
                    self.recorder.module_outputs(rnd, frame, out, named=not is_layer)
        finally:
            if is_layer:
                self.recorder.flush_rows(rnd, frame.layer)
        if is_layer:
            self.recorder.layer_done(rnd, frame)
        else:
            self.recorder.child_done(parent, frame)

    # -- kernels ----------------------------------------------------------------------------

    def kernel_call(self, func, args, kwargs):
        stack = self.tls.stack
        top = stack[-1] if stack else None
        if top is None or not top.track:
            return func(*args, **kwargs)
        rnd = self.tls.round
        frame = None
        try:
            op_name, kname, params, written = kernel_info(func)
            index = top.children
            top.children += 1
            op_id = f"{top.op_id}_{index}"
            full_name = f"{top.full_name}/{kname}"
            dump, _ = rnd.selection.child_selected(op_id, full_name, kname, top.dump_children)
            # Neither written nor described in a structure file (and writing to nothing that
            # filter_level 1 may refer to): the kernel only takes its ID.
            record = dump or top.layer.collect
            if record or written:
                frame = Frame(op_id, kname, full_name, f"{top.rel}/{index}_{kname}", dump,
                              False, passthrough=True, track=False, layer=top.layer)
                frame.reuse = not written  # a kernel writing its arguments changes their values
                pairs = bind_args(params, args, kwargs)
                if record:
                    self.recorder.kernel_inputs(rnd, frame, op_name, pairs)
                if written:
                    self.recorder.forget_written(frame.layer, pairs, written)
        except Exception as exc:
            self.probe.report(exc)
            frame = None
        out = func(*args, **kwargs)
        if frame is not None:
            try:
                if dump and op_name.startswith("c10d."):
                    _wait_for_collective(out)
                if record:
                    self.recorder.kernel_outputs(rnd, frame, out)
                    self.recorder.child_done(top, frame)
            except Exception as exc:
                self.probe.report(exc)
        return out


def _wait_for_collective(out) -> None:
    """A collective's output tensors hold the result only once its Work completes; wait for it
    before recording them (the caller would wait for it next anyway)."""
    for item in out if isinstance(out, (tuple, list)) else (out,):
        if not isinstance(item, torch.Tensor) and callable(getattr(item, "wait", None)):
            item.wait()


def _joined_mid_call() -> bool:
    """Whether this "root" is really a child of a module call that began before we were
    installed (the probe woke up in the middle of a forward): such a call is not a round."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code in _CALL_CODES:
            return True
        frame = frame.f_back
    return False


_CACHE_PARAMS = ("past_key_values", "past_key_value", "kv_cache", "cache", "layer_past", "past")


def _phase(params: tuple, args: tuple, kwargs: dict) -> str:
    """Prefill, Decoder (a KV cache with content came in) or Forward (no cache argument)."""
    positional, _, ordered = params
    name = next((n for n in _CACHE_PARAMS if n in ordered), None)
    if name is None:
        return "Forward"
    if name in kwargs:
        value = kwargs[name]
    elif name in positional and positional.index(name) < len(args):
        value = args[positional.index(name)]
    else:
        value = None
    return "Decoder" if _has_content(value) else "Prefill"


def _has_content(cache) -> bool:
    if cache is None:
        return False
    length = getattr(cache, "get_seq_length", None)
    if callable(length):
        try:
            return int(length()) > 0
        except Exception:
            return False
    if isinstance(cache, torch.Tensor):
        return cache.numel() > 0
    if isinstance(cache, (tuple, list)):
        return any(_has_content(c) for c in cache)
    return True
