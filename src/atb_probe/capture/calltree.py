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
dictionary lookup per module call, not a walk of the model (capture/models.py).

Children are followed only inside layer-level ops whose subtree the selection may write; every
other call goes straight to the original `__call__` after one stack check.

While a round is dumped, code compiled by `torch.compile` runs eagerly (the "force_eager"
stance), so the modules and kernels it would hide are seen; other rounds run it compiled.
"""
from __future__ import annotations

import os
import sys
import threading

import torch
from torch import nn

from .. import log
from ..process.stacks import current_frames
from ..rounds import RoundSource
from .checkpoint import DtypeNotice
from .frames import Below, Frame, RoundRun
from .models import ModelCatalog, phase_of, uncompiled
from .ops import OpWalker
from .recorder import Recorder
from .stats_reuse import watch_writes
from .tokens import call_layout
from .vllm import VllmSteps

_CALL_CODES = frozenset({nn.Module._call_impl.__code__, nn.Module._wrapped_call_impl.__code__})


_UNSEEN, _CONTAINER = Below.UNSEEN, Below.CONTAINER


class _ThreadState(threading.local):
    def __init__(self):
        self.stack: list[Frame] = []
        self.round: RoundRun | None = None
        self.step = None  # the engine step this thread is in (`Step`), or None


class Step:
    """An engine step in one thread: its root calls share one round, started at the first of
    them and ended with the step (SPEC §8)."""

    __slots__ = ("depth", "phase", "passive", "round", "tokens")

    def __init__(self, phase: str | None, passive: bool):
        self.depth = 1             # nested steps join the outer one
        self.phase = phase         # the engine's word on the phase, or None: the root's cache
        self.passive = passive     # begun while the probe slept: not a round, even if it wakes
        self.round: RoundRun | None = None
        self.tokens = None         # the engine's word on the token layout (tokens.py), or None


_UNSEEN_FRAME = Frame(_UNSEEN)


class Engine:
    """Installs the `__call__` wrapper and runs the rounds of one `Probe`; engine steps are
    `Steps`', the ops below a root `OpWalker`'s, modules and models `ModelCatalog`'s.

    Installing and the rounds stay in one class: they share one lock (`_lock`) and the counts
    it guards (`active_rounds`, `dumped_rounds_open`, a pending sleep), because an uninstall
    must wait for the last running round to end, in whatever thread it runs."""

    def __init__(self, source: RoundSource, sink):
        self.source = source
        self.tls = _ThreadState()
        self.recorder = Recorder(sink)
        self.models = ModelCatalog()
        self._unmatched_warned: set = set()
        self.compile_notice = CompileNotice()
        self.dtype_notice = DtypeNotice()
        self.steps = Steps(self)
        self.ops = OpWalker(self)
        self.vllm = VllmSteps(self)
        self.vllm.start()
        self._original = None   # the __call__ the current (or last) wrapper wraps
        self._wrapper = None    # the installed wrapper; None while the probe sleeps
        # Threads that may be inside a module call begun before the wrapper was installed
        # (None: any thread may be), see `_joined_mid_call`.
        self._mid_call_threads: set[int] | None = None
        self._lock = threading.Lock()
        self.active_rounds = 0
        self.dumped_rounds_open = 0  # dumped rounds running now: their data is still to come
        self.sleep_requested = False  # uninstall once the running rounds end; no new round

    # -- installing -------------------------------------------------------------------------

    @staticmethod
    def leaves_a_core() -> bool:
        """Whether torch's CPU threads leave one of this process's cores idle: fewer intra-op
        threads than the cores it may run on."""
        try:
            cores = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            cores = os.cpu_count() or 1
        return torch.get_num_threads() < cores

    def install(self) -> None:
        with self._lock:
            self.sleep_requested = False
            if self._wrapper is not None:
                return
            original = nn.Module.__call__
            engine, tls, ops = self, self.tls, self.ops

            def __call__(module, *args, **kwargs):
                stack = tls.stack
                if stack:
                    top = stack[-1]
                    if top.below is _UNSEEN:
                        return original(module, *args, **kwargs)
                    return ops.child_call(top, module, args, kwargs)
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
            self._mid_call_threads = None  # every root call looks, until the snapshot below
            nn.Module.__call__ = __call__
            # A module call that began before this line runs without the wrapper: only the
            # threads that hold one now can join a call midway (`_joined_mid_call`).
            self._mid_call_threads = _threads_in_module_calls()
            # What was measured before the probe slept may have changed meanwhile unseen
            # (through `.data`, by a collective, or a raw pointer): measure anew. While it is
            # awake, a parameter's `.data` and the collectives are watched (stats_reuse.py).
            self.recorder.stats.clear()
            watch_writes(True)

    @property
    def awake(self) -> bool:
        """Whether the wrapper is installed (the probe is not sleeping)."""
        return self._wrapper is not None

    def close(self) -> None:
        """The probe closes: capture nothing more, and write what the structure files still
        lack."""
        self.uninstall(force=True)
        self.vllm.stop()
        self.recorder.structure.flush()

    def flush_model_files(self) -> None:
        """Rewrite the model files whose last rewrite is a second old or more and that hold
        rounds since (the probe's background thread: a finished round is listed soon even
        when no other round follows)."""
        self.recorder.structure.flush(due_only=True)

    def model_files_pending(self) -> int:
        """How many model files hold rounds that are not on their way to disk yet."""
        return self.recorder.structure.pending()

    def uninstall(self, force: bool = False) -> None:
        """Put the original `__call__` back, at once when no round is running, else after the
        last running round ends (a round is never cut in two)."""
        with self._lock:
            if self._wrapper is None:
                return
            if self.active_rounds and not force:
                self.sleep_requested = True
                return
            self._restore()

    def _restore(self) -> None:
        """(Holding `_lock`.) Take the wrapper out: put back what it wrapped when it is on top;
        under another tool's wrapper it stays in the chain, passing calls through."""
        if nn.Module.__call__ is self._wrapper:
            nn.Module.__call__ = self._original
        self._wrapper = None
        self.sleep_requested = False
        watch_writes(False)

    def after_fork(self) -> None:
        """In a forked child only the forking thread survives: start its stack afresh; its
        rounds and structure files are its own."""
        self.tls.stack.clear()
        self.tls.round = None
        self.tls.step = None
        self._lock = threading.Lock()
        self.active_rounds = 0
        self.dumped_rounds_open = 0
        if self.sleep_requested:  # waiting for rounds that ran in other threads: none here
            self._restore()
        self.models.after_fork()
        self.recorder.after_fork()

    @property
    def original_call(self):
        """What the wrapper wraps: calls of a round that outlives an uninstall end there too."""
        return self._original or nn.Module.__call__

    # -- roots and rounds -------------------------------------------------------------------

    def root_call(self, module, args, kwargs):
        if _DYNAMO in sys.modules and _in_compiled_region():
            return self._root_call_in_compiled_code(module, args, kwargs)
        original = self.original_call
        if self._stands_for_function(module):
            return original(module, *args, **kwargs)  # no model's call: no round
        frame, rnd, owned, as_op = self._open_root(module, args, kwargs)
        stack = self.tls.stack
        stack.append(frame)
        try:
            if rnd is not None and rnd.dumping and _FORCE_EAGER is not None and \
                    _DYNAMO in sys.modules:
                return self._dumped_root_call(frame, module, args, kwargs, as_op)
            if as_op:
                return self.ops.child_call(frame, module, args, kwargs)
            return original(module, *args, **kwargs)
        finally:
            stack.pop()
            if owned:
                self.end_round(rnd)

    def _root_call_in_compiled_code(self, module, args, kwargs):
        """A root call made from compiled code: `torch.compile(model.__call__)` made while the
        probe is awake (transformers compiles decoding with a static cache so). The probe's
        own steps run with torch.compile off, so they are never compiled; a dumped round, which
        compiled code cannot switch to eager inside itself, runs wholly with it off; any other
        round calls the model from here, where torch.compile compiles it."""
        off = sys.modules[_DYNAMO].disable
        if off(self._stands_for_function)(module):
            return self.original_call(module, *args, **kwargs)
        frame, rnd, owned, as_op = off(self._open_root)(module, args, kwargs)
        stack = self.tls.stack
        off(stack.append)(frame)
        try:
            if rnd is not None and rnd.dumping:
                return off(self._dumped_root_call)(frame, module, args, kwargs, as_op)
            return self.original_call(module, *args, **kwargs)  # nothing below is seen
        finally:
            off(stack.pop)()
            if owned:
                off(self.end_round)(rnd)

    def _dumped_root_call(self, frame: Frame, module, args, kwargs, as_op: bool):
        """A dumped round's root call where torch.compile has been used: compiled code runs
        eagerly in it."""
        with _FORCE_EAGER("force_eager"):
            if as_op:
                return self.ops.child_call(frame, module, args, kwargs)
            return self.original_call(module, *args, **kwargs)

    def _open_root(self, module, args, kwargs):
        """A root call begins: its round (a new one, the engine step's, or none), the frame
        it pushes, whether it owns the round (ends it) and whether it is a layer-level op."""
        tls = self.tls
        step = tls.step
        rnd = None
        owned = False   # this call started its round, so it ends it
        as_op = False   # the root is a layer-level op itself
        try:
            if step is not None:
                rnd = None if step.passive else step.round
                if rnd is None and not step.passive and not torch.compiler.is_compiling():
                    rnd = step.round = self.begin_round(module, args, kwargs, step.phase,
                                                        step.tokens)
                elif rnd is not None and rnd.dumping and not rnd.main:
                    self._main_root(rnd, module, args, kwargs, step.phase)
            # Once sleep is requested no new round starts, so the running ones drain and the
            # original __call__ goes back even while other threads keep calling the model.
            # Inside a serving engine only its steps are rounds (capture/vllm.py). A call that
            # `torch.jit.trace` records is no round: what the probe computes on the model's
            # tensors would be recorded into the trace too.
            elif not (self.sleep_requested or self._steps_only() or self._joined_mid_call() or
                      torch.compiler.is_compiling() or torch._C._get_tracing_state()):
                rnd = self.begin_round(module, args, kwargs)
                owned = True
            if rnd is None:
                frame = _UNSEEN_FRAME
            else:
                frame = Frame(_CONTAINER if rnd.dumping else _UNSEEN,
                              self.models.info(module).wraps)
                rnd.roots += 1
                if rnd.dumping:
                    as_op = self._root_is_op(rnd, module)
        except Exception as exc:
            self.source.report(exc)
            frame = _UNSEEN_FRAME
        return frame, rnd, owned, as_op

    def _joined_mid_call(self) -> bool:
        """(Called by `_open_root` only.) Whether this "root" is really a child of a module
        call that began before the wrapper was installed (the probe woke up in the middle of a
        forward): such a call is not a round. Only a thread that was inside a module call at
        the install looks up its stack (a few dozen frames at each root call otherwise), and
        once it finds none there, it never looks again: what it calls from then on passes
        the wrapper."""
        threads = self._mid_call_threads
        if threads is None:
            return _in_module_call(sys._getframe(2))
        ident = threading.get_ident()
        if ident not in threads:
            return False
        if _in_module_call(sys._getframe(2)):
            return True
        threads.discard(ident)
        return False

    def _stands_for_function(self, module) -> bool:
        """Whether `module` is a plain function's stand-in (`models.is_function_adapter`)."""
        try:
            return self.models.info(module).stands_for_function
        except Exception as exc:
            self.source.report(exc)
            return False

    def _steps_only(self) -> bool:
        """Whether root calls outside an engine step are not rounds: vLLM's runners are
        patched."""
        return self.vllm.attached

    @property
    def runs_engine_steps(self) -> bool:
        """Whether an engine's model runner is loaded in this process (vLLM's worker)."""
        return self.vllm.attached

    def _root_is_op(self, rnd: RoundRun, module) -> bool:
        """Whether a root is a layer-level op itself rather than a container (SPEC §1, §8): a
        root with no submodule (an `nn.Linear` called as the model, compiled or not), or a
        later root of an engine step that holds no block list (vLLM's logits processor and
        sampler; a draft model in the same step still shows its layers)."""
        if next(iter(uncompiled(module)._modules.values()), None) is None:
            return True
        return rnd.roots > 1 and not self.models.info(module).holds_blocks

    def _main_root(self, rnd: RoundRun, module, args, kwargs, phase: str | None) -> None:
        """A step's round belongs to its main model: the first of its roots that holds a block
        list (a serving loop may call an embedding on its own first)."""
        if not self.models.info(uncompiled(module)).holds_blocks:
            return
        rnd.main = True
        rnd.model = self.models.model(module)
        rnd.root_module = module
        rnd.phase = phase or phase_of(self.models.info(uncompiled(module)).params, args, kwargs)
        self.dtype_notice.check(rnd.model.name, uncompiled(module))

    def begin_round(self, module, args, kwargs, phase: str | None = None,
                    tokens=None) -> RoundRun:
        """A round begins at this root call; `phase` and `tokens` (its token layout) are an
        engine's word on them, else the root call's arguments tell."""
        start = self.source.start_round(module, args, kwargs)
        dumping = start.dumping
        with self._lock:
            self.active_rounds += 1
            self.dumped_rounds_open += dumping
        model = self.models.model(module)
        rnd = RoundRun(start, model)
        self.tls.round = rnd
        if not dumping and tokens is None:
            # A later dumped decode round names the prompts that start here (tokens.json).
            self._call_tokens(model, self.models.info(uncompiled(module)), args, kwargs)
        if dumping:
            rnd.record = self.recorder.begin_round(start.devpid, start.index)
            rnd.root_module = module
            info = self.models.info(uncompiled(module))
            rnd.main = info.holds_blocks
            rnd.phase = phase or phase_of(info.params, args, kwargs)
            if tokens is None:
                tokens = self._call_tokens(model, info, args, kwargs)
            self.recorder.set_tokens(rnd, tokens)
            if rnd.main:
                self.dtype_notice.check(model.name, uncompiled(module))
            if model.compiled or _dynamo_compiled():
                self.compile_notice.say()
        return rnd

    def _call_tokens(self, model, info, args, kwargs):
        """The token layout a root call's arguments give (capture/tokens.py), or None."""
        try:
            return call_layout(info.params, args, kwargs, model.prompts)
        except Exception as exc:
            self.source.report(exc)
            return None

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
                if self.sleep_requested and not self.active_rounds:
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


class Steps:
    """The engine steps of one `Engine` (SPEC §8): while a thread is in a step, its root calls
    share one round, begun at the first of them and ended with the step. `atb_probe.step()`
    and the vLLM runner patches (capture/vllm.py) begin and end them."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.tls = engine.tls

    def begin(self, phase: str | None = None) -> None:
        """An engine step begins in this thread. `phase` ("Prefill" or "Decoder") is the
        engine's word on it; None lets the first root call's cache argument tell. A step
        inside a step is part of it."""
        step = self.tls.step
        if step is not None:
            step.depth += 1
        else:
            self.tls.step = Step(phase, passive=not self.engine.awake)

    def current(self) -> Step | None:
        """The engine step this thread is in, or None."""
        return self.tls.step

    def set_tokens(self, tokens) -> None:
        """The engine's word on the token layout of the step this thread is in (tokens.py):
        for its round, begun already or not yet."""
        step = self.tls.step
        if step is None:
            return
        step.tokens = tokens
        rnd = step.round
        if rnd is not None and rnd.dumping:
            self.engine.recorder.set_tokens(rnd, tokens)

    def end(self, step: Step | None = None) -> None:
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
            self.engine.end_round(step.round)

    def dumped(self) -> bool:
        """Whether the step this thread is in (or the next root call) will be dumped: for an
        engine's switch to run that step eagerly."""
        step = self.tls.step
        if step is not None and step.round is not None:
            return step.round.dumping
        engine = self.engine
        if step is not None and step.passive or not engine.awake or engine.sleep_requested:
            return False
        return engine.source.next_round_dumped()


class CompileNotice:
    """How compiled code is dumped, said once per probe: on stderr, and `problem` in the
    status file when the ops inside compiled code are not seen."""

    def __init__(self):
        self.problem: str | None = None  # why compiled code is not dumped, or None
        self._said = False

    def cannot_run_eagerly(self, problem: str) -> None:
        """An engine's compiled code cannot be switched to eager: the first such problem is
        the one reported."""
        if self.problem is None:
            self.problem = problem
            self.say()

    def say(self, message: str | None = None) -> None:
        """Say once how compiled code is dumped: `message` from an engine that switched it to
        eager, else torch.compile's stance (or the `problem`)."""
        if self._said:
            return
        self._said = True
        if self.problem:
            log.warn(self.problem)
        elif message:
            log.info(message)
        elif _FORCE_EAGER is None:
            log.warn("this torch has no torch.compiler.set_stance: the modules and kernels "
                     "inside compiled code (torch.compile) are not seen")
        else:
            log.info("compiled code (torch.compile) runs eagerly while a round is dumped, so "
                     "the ops inside it are seen; other rounds run it compiled")


# "force_eager" runs compiled code as plain Python for the length of a dumped round. Only where
# torch.compile has been used: `torch.compile` and `Module.compile` import torch._dynamo, and
# without them nothing compiled can run, while setting the stance would import it (a second and
# 70 MB on the first dumped round of a process that never compiles).
_FORCE_EAGER = getattr(getattr(torch, "compiler", None), "set_stance", None)
_DYNAMO = "torch._dynamo"


_EVAL_FRAME_CALLBACK = getattr(getattr(getattr(torch._C, "_dynamo", None), "eval_frame", None),
                               "get_eval_frame_callback", None)


def _in_compiled_region() -> bool:
    """Whether this code runs inside a call of compiled code: torch.compile's frame callback
    is set (each Python frame called is offered to it, and the stance cannot change)."""
    return _EVAL_FRAME_CALLBACK is not None and _EVAL_FRAME_CALLBACK() not in (None, False)


def _dynamo_compiled() -> bool:
    """Whether torch.compile has compiled any code in this process yet."""
    utils = sys.modules.get("torch._dynamo.utils")
    counters = getattr(utils, "counters", None)
    try:
        return bool(counters and counters["stats"]["unique_graphs"])
    except Exception:
        return False


def _in_module_call(frame) -> bool:
    """Whether `frame` or a frame below it on its thread's stack runs a module's call."""
    while frame is not None:
        if frame.f_code in _CALL_CODES:
            return True
        frame = frame.f_back
    return False


def _threads_in_module_calls() -> set[int]:
    """The threads whose stack holds a module's call now."""
    return {ident for ident, frame in current_frames().items() if _in_module_call(frame)}
