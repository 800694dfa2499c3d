"""Module calls as ops: the call tree of SPEC §1 (root, containers, layer-level ops, children).

While the probe is awake, `torch.nn.Module.__call__` is replaced by a thin wrapper; while it
sleeps the original is back in place and the model pays nothing. Each thread keeps its own op
stack, so a server running the model in worker threads gets one consistent tree per thread.

* A module called with an empty stack is a *root*: its call is one *round*, and the round's
  configuration is fixed when it starts (a config change applies at the next round). Each root
  module instance is a *model* (`Model`): its name, its module paths and its structure files.
* The root is a *container*. A module called from a container is a container too when it is not
  an element of a *block list* (an `nn.ModuleList` of one or more modules, an `nn.Sequential` of
  two or more) and it is a block list or has one anywhere below it.
* Non-container modules called from a container are *layer-level* ops, numbered 0, 1, 2... in
  the round. Below them every module and kernel is a *child*, numbered among its siblings.

What a module is (its name, forward signature, whether it holds block lists, whether it is an
element of one) is decided once per module and kept with a weak reference, so a round pays a
dictionary lookup per module call, not a walk of the model.

Children are followed only inside layer-level ops whose subtree the selection may write; every
other call goes straight to the original `__call__` after one stack check.

While a round is dumped, code compiled by `torch.compile` runs eagerly (the "force_eager"
stance), so the modules and kernels it would hide are seen; other rounds run it compiled.
"""
from __future__ import annotations

import enum
import sys
import threading
import weakref

import torch
from torch import nn

from .. import layout, log
from ..naming import sanitize
from ..rounds import RoundSource, RoundStart
from ..selection import LayerPlan, SKIP_LAYER
from .arguments import bind_args, forward_params
from .kernels import KernelCapture, kernel_info
from .recorder import Recorder
from .vllm import VllmSteps

_CALL_CODES = frozenset({nn.Module._call_impl.__code__, nn.Module._wrapped_call_impl.__code__})


class ModuleInfo:
    """What the probe needs to know about one module, computed once."""

    __slots__ = ("name", "params", "holds_blocks", "element", "__weakref__")

    def __init__(self, module: nn.Module):
        self.name = sanitize(type(module).__name__)
        self.params = forward_params(type(module))
        # A block list itself, or one anywhere below: a container unless it is an element.
        self.holds_blocks = any(is_block_list(m) for m in module.modules())
        self.element = False  # an element of a block list: set when its model is first seen

    @property
    def is_container(self) -> bool:
        """Whether this module, called from a container, is a container itself (SPEC §1)."""
        return self.holds_blocks and not self.element


def is_block_list(module: nn.Module) -> bool:
    """The model's repeated blocks: an `nn.ModuleList` of one or more modules (a one-layer
    draft model still has its layer list) or an `nn.Sequential` of two or more."""
    if isinstance(module, nn.ModuleList):
        return len(module) >= 1
    return isinstance(module, nn.Sequential) and len(module) >= 2


class Model:
    """One root module instance: its name, module paths and what its structure files hold.

    `name` is the class name for the first instance of that class in the process and
    `<Class>_<k>` for later ones (SPEC §1), so two models of one class (a draft model in
    speculative decoding) never share structure files."""

    __slots__ = ("name", "first", "paths", "compiled")

    def __init__(self, name: str, first: bool, module: nn.Module):
        self.name = name
        self.first = first    # the first model of the process: its layer files need no folder
        inner = _uncompiled(module)
        # Attribute paths from the root; a torch.compile wrapper is looked through, so paths
        # read as in the model's code (`model.layers.0`, not `_orig_mod.model.layers.0`).
        self.paths: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.compiled = inner is not module
        for path, m in inner.named_modules():
            self.paths.setdefault(m, path)
            if getattr(m, "_compiled_call_impl", None) is not None or _uncompiled(m) is not m:
                self.compiled = True


def _uncompiled(module: nn.Module) -> nn.Module:
    """The module a `torch.compile` wrapper (`OptimizedModule`) stands for, else `module`."""
    inner = getattr(module, "_orig_mod", None)
    return inner if isinstance(inner, nn.Module) else module


class Below(enum.Enum):
    """What happens to the module calls made inside an op (a frame on the op stack)."""

    UNSEEN = "unseen"        # straight to the original __call__: nothing below is seen
    CONTAINER = "container"  # the container rule: containers, or layer-level ops (SPEC §1)
    TRACK = "track"          # children: IDs handed out, kernels captured


_UNSEEN, _CONTAINER, _TRACK = Below.UNSEEN, Below.CONTAINER, Below.TRACK


class Frame:
    """An entry of a thread's op stack that is not an op: a root or a container, or a call
    whose inside is not seen. `below` says what happens to the calls made inside it."""

    __slots__ = ("below",)

    def __init__(self, below: Below):
        self.below = below


class OpFrame(Frame):
    """One op execution on a thread's op stack: where it is, what the selection wants of it
    (`dump` its own tensors, `dump_children` everything below), what happens `below` it, and
    the recorder's records it carries (`layer`: the layer-level op execution's, `record`: its
    own; None when nothing of it is recorded)."""

    __slots__ = ("op_id", "name", "full_name", "rel", "children", "dump", "dump_children",
                 "collect", "layer", "path", "record")

    def __init__(self, op_id: str, name: str, full_name: str, rel: str, dump: bool,
                 dump_children: bool, below: Below, layer, collect: bool, path=None):
        self.below = below
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
    (`Engine.begin_step`); its number, the selection it runs under, its model and phase, and
    its progress. `record`: the recorder's record of it, when it is dumped."""

    __slots__ = ("index", "selection", "devpid", "dumping", "layer_count", "layer_names",
                 "phase", "root_module", "model", "selected", "roots", "main", "record")

    def __init__(self, start: RoundStart, model: Model):
        self.index = start.index
        self.selection = start.selection
        self.devpid = start.devpid
        self.dumping = start.dumping
        self.layer_count = 0
        self.layer_names = []      # the distinct layer-level op names, in order (for warnings)
        self.phase = "Forward"
        self.root_module = None
        self.model = model
        self.selected = 0          # ops the selection chose in this round
        self.roots = 0             # root calls made in it so far (more than one in a step)
        self.main = False          # `model` holds block lists: the step's main model
        self.record = None


class _ThreadState(threading.local):
    def __init__(self):
        self.stack: list[Frame] = []
        self.round: RoundRun | None = None
        self.step = None  # the engine step this thread is in (`Step`), or None


class Step:
    """An engine step in one thread: its root calls share one round, started at the first of
    them and ended with the step (SPEC §8)."""

    __slots__ = ("depth", "phase", "passive", "round")

    def __init__(self, phase: str | None, passive: bool):
        self.depth = 1             # nested steps join the outer one
        self.phase = phase         # the engine's word on the phase, or None: the root's cache
        self.passive = passive     # begun while the probe slept: not a round, even if it wakes
        self.round: RoundRun | None = None


_UNSEEN_FRAME = Frame(_UNSEEN)


class Engine:
    """Installs the `__call__` wrapper and walks the call tree for one `Probe`."""

    def __init__(self, source: RoundSource, sink):
        self.source = source
        self.tls = _ThreadState()
        self.recorder = Recorder(sink)
        self._infos: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._models: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._model_counts: dict[str, int] = {}
        self._unmatched_warned: set = set()
        self._compile_said = False
        self.compile_problem: str | None = None  # why compiled code is not dumped, or None
        self.vllm = VllmSteps(self)
        self.vllm.start()
        self._original = None   # the __call__ the current (or last) wrapper wraps
        self._wrapper = None    # the installed wrapper; None while the probe sleeps
        self._lock = threading.Lock()
        self.active_rounds = 0
        self.dumped_rounds_open = 0  # dumped rounds running now: their data is still to come
        self._sleep_requested = False

    # -- installing -------------------------------------------------------------------------

    def install(self) -> None:
        with self._lock:
            self._sleep_requested = False
            if self._wrapper is not None:
                return
            original = nn.Module.__call__
            engine, tls = self, self.tls

            def __call__(module, *args, **kwargs):
                stack = tls.stack
                if stack:
                    top = stack[-1]
                    if top.below is _UNSEEN:
                        return original(module, *args, **kwargs)
                    return engine.child_call(top, module, args, kwargs)
                if engine._wrapper is not __call__:
                    # Uninstalled while another tool's wrapper sat above this one, so it could
                    # not be taken out of the chain: pass through, and step out as soon as
                    # nothing wraps it any more.
                    if nn.Module.__call__ is __call__:
                        nn.Module.__call__ = original
                    return original(module, *args, **kwargs)
                return engine.root_call(module, args, kwargs)

            __call__.__atb_probe__ = True
            self._original, self._wrapper = original, __call__
            nn.Module.__call__ = __call__

    @property
    def awake(self) -> bool:
        """Whether the wrapper is installed (the probe is not sleeping)."""
        return self._wrapper is not None

    def close(self) -> None:
        """The probe closes: capture nothing more, and write what the structure files still
        lack."""
        self.uninstall(force=True)
        self.vllm.stop()
        self.recorder.flush_model_files()

    def flush_model_files(self) -> None:
        """Rewrite the model files whose last rewrite is a second old or more and that hold
        rounds since (the probe's background thread: a finished round is listed soon even
        when no other round follows)."""
        self.recorder.flush_model_files(due_only=True)

    def model_files_pending(self) -> int:
        """How many model files hold rounds that are not on their way to disk yet."""
        return self.recorder.model_files_pending()

    def uninstall(self, force: bool = False) -> None:
        """Put the original `__call__` back, at once when no round is running, else after the
        last running round ends (a round is never cut in two)."""
        with self._lock:
            if self._wrapper is None:
                return
            if self.active_rounds and not force:
                self._sleep_requested = True
                return
            self._restore()

    def _restore(self) -> None:
        """(Holding `_lock`.) Take the wrapper out: put back what it wrapped when it is on top;
        under another tool's wrapper it stays in the chain, passing calls through."""
        if nn.Module.__call__ is self._wrapper:
            nn.Module.__call__ = self._original
        self._wrapper = None
        self._sleep_requested = False

    def after_fork(self) -> None:
        """In a forked child only the forking thread survives: start its stack afresh; its
        rounds and structure files are its own."""
        self.tls.stack.clear()
        self.tls.round = None
        self.tls.step = None
        self._lock = threading.Lock()
        self.active_rounds = 0
        self.dumped_rounds_open = 0
        self.recorder.after_fork()

    @property
    def original_call(self):
        """What the wrapper wraps: calls of a round that outlives an uninstall end there too."""
        return self._original or nn.Module.__call__

    def info(self, module) -> ModuleInfo:
        info = self._infos.get(module)
        if info is None:
            info = ModuleInfo(module)
            self._infos[module] = info
        return info

    def model(self, root) -> Model:
        """The `Model` of a root module instance, named and walked the first time it is seen."""
        model = self._models.get(root)
        if model is None:
            with self._lock:
                model = self._models.get(root)
                if model is None:
                    model = self._new_model(root)
        return model

    def _new_model(self, root) -> Model:
        """(Holding `_lock`.) Name a new root and mark the elements of its block lists."""
        cls = sanitize(type(_uncompiled(root)).__name__)
        count = self._model_counts.get(cls, 0)
        self._model_counts[cls] = count + 1
        model = Model(cls if count == 0 else f"{cls}_{count}", not self._models, root)
        for m in model.paths:
            if is_block_list(m):
                for element in m._modules.values():
                    if element is not None:
                        self.info(element).element = True
        self._models[root] = model
        return model

    # -- roots and rounds -------------------------------------------------------------------

    def root_call(self, module, args, kwargs):
        original = self.original_call
        tls = self.tls
        stack = tls.stack
        step = tls.step
        rnd = None
        owned = False   # this call started its round, so it ends it
        as_op = False   # the root is a layer-level op itself
        try:
            if step is not None:
                rnd = None if step.passive else step.round
                if rnd is None and not step.passive and not torch.compiler.is_compiling():
                    rnd = step.round = self.begin_round(module, args, kwargs, step.phase)
                elif rnd is not None and rnd.dumping and not rnd.main:
                    self._main_root(rnd, module, args, kwargs, step.phase)
            # Once sleep is requested no new round starts, so the running ones drain and the
            # original __call__ goes back even while other threads keep calling the model.
            # Inside a serving engine only its steps are rounds (capture/vllm.py).
            elif not (self._sleep_requested or self._steps_only() or _joined_mid_call() or
                      torch.compiler.is_compiling()):
                rnd = self.begin_round(module, args, kwargs)
                owned = True
            if rnd is None:
                frame = _UNSEEN_FRAME
            else:
                frame = Frame(_CONTAINER if rnd.dumping else _UNSEEN)
                rnd.roots += 1
                if rnd.dumping:
                    as_op = self._root_is_op(rnd, module)
        except Exception as exc:
            self.source.report(exc)
            frame = _UNSEEN_FRAME
        stack.append(frame)
        try:
            if rnd is not None and rnd.dumping and _FORCE_EAGER is not None and \
                    _DYNAMO in sys.modules:
                with _FORCE_EAGER("force_eager"):
                    if as_op:
                        return self.child_call(frame, module, args, kwargs)
                    return original(module, *args, **kwargs)
            if as_op:
                return self.child_call(frame, module, args, kwargs)
            return original(module, *args, **kwargs)
        finally:
            stack.pop()
            if owned:
                self.end_round(rnd)

    def _steps_only(self) -> bool:
        """Whether root calls outside an engine step are not rounds: vLLM's runners are
        patched."""
        return self.vllm.attached

    def _root_is_op(self, rnd: RoundRun, module) -> bool:
        """Whether a root is a layer-level op itself rather than a container (SPEC §1, §8): a
        root with no submodule (an `nn.Linear` called as the model), or a later root of an
        engine step that holds no block list (vLLM's logits processor and sampler; a draft
        model in the same step still shows its layers)."""
        if next(iter(module._modules.values()), None) is None:
            return True
        return rnd.roots > 1 and not self.info(module).holds_blocks

    def _main_root(self, rnd: RoundRun, module, args, kwargs, phase: str | None) -> None:
        """A step's round belongs to its main model: the first of its roots that holds a block
        list (a serving loop may call an embedding on its own first)."""
        if not self.info(_uncompiled(module)).holds_blocks:
            return
        rnd.main = True
        rnd.model = self.model(module)
        rnd.root_module = module
        rnd.phase = phase or _phase(self.info(_uncompiled(module)).params, args, kwargs)

    def begin_round(self, module, args, kwargs, phase: str | None = None) -> RoundRun:
        start = self.source.start_round(module, args, kwargs)
        dumping = start.dumping
        with self._lock:
            self.active_rounds += 1
            self.dumped_rounds_open += dumping
        model = self.model(module)
        rnd = RoundRun(start, model)
        self.tls.round = rnd
        if dumping:
            rnd.record = self.recorder.begin_round(start.devpid, start.index)
            rnd.root_module = module
            info = self.info(_uncompiled(module))
            rnd.main = info.holds_blocks
            rnd.phase = phase or _phase(info.params, args, kwargs)
            if model.compiled or _dynamo_compiled():
                self.say_compiled()
        return rnd

    # -- engine steps -----------------------------------------------------------------------

    def begin_step(self, phase: str | None = None) -> None:
        """An engine step begins in this thread: its root calls make one round (SPEC §8).
        `phase` ("Prefill" or "Decoder") is the engine's word on it; None lets the first root
        call's cache argument tell. A step inside a step is part of it."""
        step = self.tls.step
        if step is not None:
            step.depth += 1
        else:
            self.tls.step = Step(phase, passive=self._wrapper is None)

    def current_step(self) -> Step | None:
        """The engine step this thread is in, or None."""
        return self.tls.step

    def end_step(self, step: Step | None = None) -> None:
        """The step begun last in this thread ends (only if it is `step`, when given); the
        outermost ends its round."""
        if step is not None and self.tls.step is not step:
            return
        step = self.tls.step
        if step is None:
            return
        step.depth -= 1
        if step.depth:
            return
        self.tls.step = None
        if step.round is not None:
            self.end_round(step.round)

    def step_dumped(self) -> bool:
        """Whether the step this thread is in (or the next root call) will be dumped: for an
        engine's switch to run that step eagerly."""
        step = self.tls.step
        if step is not None and step.round is not None:
            return step.round.dumping
        if step is not None and step.passive or self._wrapper is None or self._sleep_requested:
            return False
        return self.source.next_round_dumped()

    def say_compiled(self, message: str | None = None) -> None:
        """Say once how compiled code is dumped: `message` from an engine that switched it to
        eager, else torch.compile's stance (or this engine's `compile_problem`)."""
        if self._compile_said:
            return
        self._compile_said = True
        if self.compile_problem:
            log.warn(self.compile_problem)
        elif message:
            log.info(message)
        elif _FORCE_EAGER is None:
            log.warn("this torch has no torch.compiler.set_stance: the modules and kernels "
                     "inside compiled code (torch.compile) are not seen")
        else:
            log.info("compiled code (torch.compile) runs eagerly while a round is dumped, so "
                     "the ops inside it are seen; other rounds run it compiled")

    def end_round(self, rnd: RoundRun) -> None:
        self.tls.round = None
        try:
            if rnd.dumping:
                self.source.round_dumped(self.recorder.end_round(rnd))
                if not rnd.selected:
                    self._warn_unmatched(rnd)
        except Exception as exc:
            self.source.report(exc)
        finally:
            # Checked and done under one lock: a wake-up (install) in between must win.
            with self._lock:
                self.active_rounds -= 1
                self.dumped_rounds_open -= rnd.dumping
                if self._sleep_requested and not self.active_rounds:
                    self._restore()

    def _warn_unmatched(self, rnd: RoundRun) -> None:
        """SPEC §7: `ids`/`op_name` chose no op of a selected round; once per configuration."""
        cfg = rnd.selection.config
        if not (cfg.ids or cfg.op_name) or cfg in self._unmatched_warned:
            return
        self._unmatched_warned.add(cfg)
        keys = []
        if cfg.ids:
            keys.append(f'ids "{",".join(cfg.ids)}"')
        if cfg.op_name:
            keys.append(f'op_name "{",".join(cfg.op_name)}"')
        had = (f"layer-level op IDs 0..{rnd.layer_count - 1}: {', '.join(rnd.layer_names)}"
               if rnd.layer_count else "no layer-level op")
        log.warn(f"{' and '.join(keys)} matched no op in round {rnd.index} of "
                 f"{rnd.model.name}, so nothing was written for it; that round had {had}")

    # -- ops below the root -----------------------------------------------------------------

    def child_call(self, parent: Frame, module, args, kwargs):
        original = self.original_call
        rnd = self.tls.round
        mode = None
        try:
            frame, mode = self.enter(rnd, parent, module, args, kwargs)
        except Exception as exc:
            self.source.report(exc)
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
            if parent.below is _CONTAINER and type(frame) is OpFrame:
                self.recorder.end_layer_rows(rnd, frame.layer)  # what ran is still recorded
            raise
        finally:
            if mode is not None:
                mode.__exit__(None, None, None)
            stack.pop()
        try:
            self.leave(rnd, parent, frame, out)
        except Exception as exc:
            self.source.report(exc)
        return out

    def enter(self, rnd: RoundRun, parent: Frame, module, args, kwargs):
        info = self.info(module)
        if parent.below is _CONTAINER:
            if info.is_container:
                return Frame(_CONTAINER), None
            return self.enter_layer(rnd, module, info, args, kwargs)
        index = parent.children
        parent.children += 1
        op_id = f"{parent.op_id}_{index}"
        full_name = f"{parent.full_name}/{info.name}"
        choice = rnd.selection.child_selected(op_id, full_name, info.name,
                                              parent.dump_children)
        frame = OpFrame(op_id, info.name, full_name,
                        layout.child_op_dir(parent.rel, index, info.name), choice.dump,
                        choice.dump_children, _TRACK, parent.layer, parent.collect)
        if choice.dump:
            rnd.selected += 1
        if frame.dump or frame.collect:  # else nothing to record: skip the context
            frame.path = rnd.model.paths.get(module)
            with torch._C._DisableTorchDispatch():
                frame.record = self.recorder.module_inputs(rnd, frame, module, info.params,
                                                           args, kwargs, named=True)
        return frame, None

    def enter_layer(self, rnd: RoundRun, module, info: ModuleInfo, args, kwargs):
        index = rnd.layer_count
        rnd.layer_count += 1
        if info.name not in rnd.layer_names:
            rnd.layer_names.append(info.name)
        op_id = str(index)
        plan: LayerPlan = rnd.selection.layer_plan(op_id, info.name) if rnd.selection else \
            SKIP_LAYER
        if plan.dump:
            rnd.selected += 1
        layer = self.recorder.begin_layer(rnd, info.name, op_id, plan.track_children)
        frame = OpFrame(op_id, info.name, info.name, layout.op_folder(op_id, info.name),
                        plan.dump, plan.dump_children, _TRACK if plan.track_children else _UNSEEN,
                        layer, layer.collect, rnd.model.paths.get(module))
        frame.record = self.recorder.module_inputs(rnd, frame, module, info.params, args, kwargs,
                                                   named=False)
        mode = KernelCapture(self) if plan.track_children else None
        return frame, mode

    def leave(self, rnd: RoundRun, parent: Frame, frame: Frame, out) -> None:
        if type(frame) is not OpFrame:
            return
        is_layer = parent.below is _CONTAINER
        try:
            if frame.record is not None:
                with torch._C._DisableTorchDispatch():
                    self.recorder.module_outputs(rnd, frame, out, named=not is_layer)
        finally:
            if is_layer:
                self.recorder.end_layer_rows(rnd, frame.layer)
        if is_layer:
            self.recorder.layer_done(rnd, frame)
        else:
            self.recorder.child_done(parent, frame)

    # -- kernels ----------------------------------------------------------------------------

    def kernel_call(self, func, args, kwargs):
        stack = self.tls.stack
        top = stack[-1] if stack else None
        if top is None or top.below is not _TRACK:
            return func(*args, **kwargs)
        rnd = self.tls.round
        frame = None
        kernel = None
        try:
            kernel = kernel_info(func)
            index = top.children
            top.children += 1
            op_id = f"{top.op_id}_{index}"
            full_name = f"{top.full_name}/{kernel.name}"
            dump = rnd.selection.child_selected(op_id, full_name, kernel.name,
                                                top.dump_children).dump
            if dump:
                rnd.selected += 1
            # Neither written nor described in a structure file (and writing to nothing that
            # filter_level 1 may refer to): the kernel only takes its ID.
            record = dump or top.collect
            written = kernel.written
            if record or written:
                frame = OpFrame(op_id, kernel.name, full_name,
                                layout.child_op_dir(top.rel, index, kernel.name), dump, False,
                                _UNSEEN, top.layer, top.collect)
                pairs = bind_args(kernel.params, args, kwargs)
                if record:
                    frame.record = self.recorder.kernel_inputs(rnd, frame, kernel.op_name, pairs,
                                                               bool(written))
                if written:
                    self.recorder.forget_written(frame.layer, pairs, written)
        except Exception as exc:
            self.source.report(exc)
            frame = None
        out = func(*args, **kwargs)
        if kernel is not None and kernel.allocates:
            self.recorder.allocated(top.layer, out)
        if frame is not None:
            try:
                if dump and kernel.collective:
                    _wait_for_collective(kernel.op_name, out)
                if record:
                    self.recorder.kernel_outputs(rnd, frame, kernel.op_name, out,
                                                 _written_values(pairs, written, out))
                    self.recorder.child_done(top, frame)
            except Exception as exc:
                self.source.report(exc)
        return out


# "force_eager" runs compiled code as plain Python for the length of a dumped round. Only where
# torch.compile has been used: `torch.compile` and `Module.compile` import torch._dynamo, and
# without them nothing compiled can run, while setting the stance would import it (a second and
# 70 MB on the first dumped round of a process that never compiles).
_FORCE_EAGER = getattr(getattr(torch, "compiler", None), "set_stance", None)
_DYNAMO = "torch._dynamo"


def _dynamo_compiled() -> bool:
    """Whether torch.compile has compiled any code in this process yet."""
    utils = sys.modules.get("torch._dynamo.utils")
    counters = getattr(utils, "counters", None)
    try:
        return bool(counters and counters["stats"]["unique_graphs"])
    except Exception:
        return False


def _written_values(pairs, written: tuple, out) -> list:
    """The arguments a kernel wrote (`Tensor(a!)`, SPEC §8) that it did not also return (an
    in-place op returns its `self`), as (name, value) pairs: outputs too, after the kernel."""
    if not written:
        return []
    returned = out if isinstance(out, (tuple, list)) else (out,)
    found = []
    for name, value in pairs:
        if name not in written:
            continue
        for t in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(t, torch.Tensor) and not any(t is r for r in returned):
                found.append((name, t))
    return found


def _wait_for_collective(op_name: str, out) -> None:
    """A collective's output tensors hold the result only once it completes; wait for it before
    recording them (the caller would wait for it next anyway). A c10d op returns its Work; a
    functional collective returns tensors that `_c10d_functional.wait_tensor` completes."""
    items = out if isinstance(out, (tuple, list)) else (out,)
    if op_name.startswith("c10d."):
        for item in items:
            if not isinstance(item, torch.Tensor) and callable(getattr(item, "wait", None)):
                item.wait()
    elif not op_name.startswith("_c10d_functional.wait_tensor"):
        for item in items:
            if isinstance(item, torch.Tensor):
                torch.ops._c10d_functional.wait_tensor(item)


def _joined_mid_call() -> bool:
    """Whether this "root" is really a child of a module call that began before we were
    installed (the probe woke up in the middle of a forward): such a call is not a round."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code in _CALL_CODES:
            return True
        frame = frame.f_back
    return False


# Cache arguments, attention KV caches first, then state-space models' (Mamba's `cache_params`,
# `inference_params` of mamba_ssm).
_CACHE_PARAMS = ("past_key_values", "past_key_value", "kv_cache", "cache", "layer_past", "past",
                 "cache_params", "inference_params", "mamba_cache_params")


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
    for name in ("seqlen_offset", "has_previous_state"):  # older Mamba caches, mamba_ssm
        value = getattr(cache, name, None)
        if isinstance(value, (int, bool)):
            return bool(value)
    if isinstance(cache, torch.Tensor):
        return cache.numel() > 0
    if isinstance(cache, (tuple, list)):
        return any(_has_content(c) for c in cache)
    return True
