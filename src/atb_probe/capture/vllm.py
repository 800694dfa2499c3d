"""vLLM's engine step as one round (SPEC §8), and its compiled model run eagerly when dumped.

vLLM's V1 model runner splits one engine step over two calls made by its worker, in one thread:
`execute_model(scheduler_output)` runs the model and its logits processor and returns None, then
`sample_tokens(grammar_output)` runs the sampler (and a draft model, in speculative decoding).
When `execute_model` returns anything else (no tokens scheduled, a pooling model, a pipeline
stage's intermediate tensors) no sampling follows and the step ends there. The CPU and XPU
runners inherit both methods from `GPUModelRunner`; vllm-ascend's `NPUModelRunner` does too and
is patched in its own right where it overrides them. `ModelRunner` V2 (`vllm.v1.worker.gpu`) has
the same two methods.

Once a runner class is patched, the engine counts only steps as rounds: the model calls vLLM
makes outside a step (profiling, compilation warm-up, CUDA-graph capture) are not dumped and
take no round number, so `exec_range` counts engine steps from the first.

A step's phase comes from its batch: `Prefill` when it carries prompt tokens (a new request, a
chunk of a prompt, a resumed request's recomputation; a mixed chunked-prefill step is `Prefill`
too), `Decoder` when every request gets only its next token (plus its speculative tokens).

Compiled models: vLLM calls the code it compiled directly (an AOT-compiled function, CUDA graphs
replayed by `CUDAGraphWrapper`), not through dynamo, so dynamo's stance changes nothing. In a
dumped step the V1 runner's `_model_forward` runs under vLLM's own switches: the forward
context's `skip_compiled` (the decorated model calls its plain `forward`) and
`cudagraph_runtime_mode = NONE` (no CUDA-graph replay in that step). Other steps, and a sleeping
probe, leave both alone. Where a runner has no such switch, the probe says so (`compile_problem`).

A dumped step's token layout (tokens.json, SPEC §9) comes from what the V1 runner has on the
host when it calls its model (`_model_forward`): its batch's request order
(`input_batch.req_ids`), the tokens the scheduler gave each request, how many of each request's
tokens were computed before (the position of its first one), its prompt ids, and the number of
tokens the model is called with (padding included). Each request's prompt is hashed once and
kept until the scheduler says the request finished.

Patching replaces class attributes, so every runner of the process is seen. The runners are
patched as soon as vLLM imports their modules (an import hook on `sys.meta_path`, as tracing
tools use), before any step or warm-up runs: the probe starts when torch is imported, long
before vLLM builds its worker. `stop` takes the hook out and puts the originals back. Nothing
here runs unless vLLM itself imports its runner modules.
"""
from __future__ import annotations

import importlib.abc
import sys
import threading

from ..rounds import Phase
from ..tokens import (UNKNOWN_PROMPT, Arrangement, Prompt, RequestSpan, Source, TokenLayout,
                      prompt_of)

# (module, class) of the model runners whose steps are rounds. vllm-ascend's is on paper: its
# code path is the same two methods, not run here.
RUNNERS = (
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner"),
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner"),
    ("vllm_ascend.worker.model_runner_v1", "NPUModelRunner"),
)
_MARK = "__atb_probe_original__"

EAGER_MESSAGE = ("vLLM's compiled model runs eagerly in dumped steps (vLLM's skip_compiled, no "
                 "CUDA-graph replay), so the ops inside it are seen; other steps run it compiled")
NO_SWITCH = ("this vLLM runner ({runner}) offers no switch to run its compiled model eagerly: "
             "the ops inside compiled code are not dumped; start vLLM with --enforce-eager "
             "(`LLM(..., enforce_eager=True)`) to dump them")


class VllmSteps:
    """vLLM's runners patched for one `calltree.Engine`: steps begin and end, dumped steps run
    eagerly."""

    def __init__(self, engine):
        self.engine = engine
        self.patched: list[tuple[type, str, object]] = []  # (class, attribute, original)
        self.pending: dict[int, object] = {}  # id(runner) -> its step awaiting sample_tokens
        self.batches: dict[int, object] = {}  # id(runner) -> its dumped step's scheduler output
        self.prompts: dict[str, Prompt] = {}  # request id -> its prompt, until it finishes
        self._hook: _ImportHook | None = None

    @property
    def attached(self) -> bool:
        return bool(self.patched)

    def start(self) -> None:
        """Patch the runners vLLM has imported already, and the others when it imports them."""
        self.attach()
        self._hook = _ImportHook({name for name, _ in RUNNERS}, self._imported)
        sys.meta_path.insert(0, self._hook)

    def stop(self) -> None:
        """Take the import hook out and put every original method back."""
        if self._hook is not None:
            try:
                sys.meta_path.remove(self._hook)
            except ValueError:
                pass
            self._hook = None
        self.detach()

    def _imported(self) -> None:
        try:
            self.attach()
        except Exception as exc:   # never break vLLM's import
            self.engine.source.report(exc)

    def attach(self) -> bool:
        """Patch the runner classes vLLM has imported so far; whether any is patched now."""
        wrappers = (("execute_model", self._execute_model), ("sample_tokens", self._sample_tokens),
                    ("_model_forward", self._model_forward))
        for module_name, class_name in RUNNERS:
            cls = getattr(sys.modules.get(module_name), class_name, None)
            if not isinstance(cls, type):
                continue
            for name, make in wrappers:
                # Only what the class defines itself (a subclass inherits the patched method),
                # and only once.
                if name in vars(cls) and not hasattr(vars(cls)[name], _MARK):
                    self._patch(cls, name, make)
        return self.attached

    def detach(self) -> None:
        """Put every original method back (where nobody replaced ours since)."""
        for cls, name, original in reversed(self.patched):
            if getattr(vars(cls).get(name), _MARK, None) is original:
                setattr(cls, name, original)
        self.patched.clear()
        self.pending.clear()
        self.batches.clear()
        self.prompts.clear()

    def _patch(self, cls: type, name: str, make) -> None:
        original = vars(cls)[name]
        wrapper = make(original)
        wrapper.__name__ = name
        wrapper.__qualname__ = f"{cls.__qualname__}.{name}"
        wrapper.__doc__ = getattr(original, "__doc__", None)
        setattr(wrapper, _MARK, original)
        setattr(cls, name, wrapper)
        self.patched.append((cls, name, original))

    # -- the wrappers -----------------------------------------------------------------------

    def _execute_model(self, original):
        steps, engine = self, self.engine

        def execute_model(runner, scheduler_output, *args, **kwargs):
            if not engine.awake:
                return original(runner, scheduler_output, *args, **kwargs)
            try:
                steps._end_pending(runner)   # a step whose sampling never came
                engine.steps.begin(step_phase(runner, scheduler_output))
                steps._forget_finished(scheduler_output)
                if engine.steps.dumped():
                    steps.batches[id(runner)] = scheduler_output
            except Exception as exc:
                engine.source.report(exc)
                return original(runner, scheduler_output, *args, **kwargs)
            if not hasattr(getattr(type(runner), "_model_forward", None), _MARK) and \
                    engine.steps.dumped():
                no_switch(engine, runner)
            try:
                out = original(runner, scheduler_output, *args, **kwargs)
            except BaseException:
                engine.steps.end()
                raise
            finally:
                steps.batches.pop(id(runner), None)
            if out is None and getattr(runner, "execute_model_state", None) is not None:
                steps.pending[id(runner)] = engine.steps.current()
            else:
                engine.steps.end()
            return out

        return execute_model

    def _sample_tokens(self, original):
        steps = self

        def sample_tokens(runner, *args, **kwargs):
            try:
                return original(runner, *args, **kwargs)
            finally:
                steps._end_pending(runner)

        return sample_tokens

    def _forget_finished(self, scheduler_output) -> None:
        """Let go of the prompts of the requests the scheduler says have finished."""
        if not self.prompts:
            return
        for req_id in getattr(scheduler_output, "finished_req_ids", None) or ():
            self.prompts.pop(req_id, None)
        if len(self.prompts) > MAX_PROMPTS:  # finished ids that never reached this runner
            self.prompts.clear()

    def step_layout(self, runner, scheduler_output, args: tuple, kwargs: dict):
        """The token layout of the step the runner is about to run its model for (V1 runner),
        or None where its batch cannot be read."""
        batch = getattr(runner, "input_batch", None)
        requests = getattr(runner, "requests", None)
        if batch is None or requests is None or scheduler_output is None:
            return None
        tokens = model_tokens(args, kwargs)
        scheduled = scheduler_output.num_scheduled_tokens
        computed = batch.num_computed_tokens_cpu
        spans, start = [], 0
        for i, req_id in enumerate(batch.req_ids[:batch.num_reqs]):
            n = scheduled.get(req_id, 0)
            if not n:
                continue
            prompt = self.prompts.get(req_id)
            if prompt is None:
                ids = getattr(requests.get(req_id), "prompt_token_ids", None)
                prompt = UNKNOWN_PROMPT if ids is None else prompt_of(ids)
                self.prompts[req_id] = prompt
            spans.append(RequestSpan(str(req_id), 0, start, start + n, int(computed[i]), prompt))
            start += n
        if tokens is None or start > tokens:
            return None
        return TokenLayout(Source.VLLM, Arrangement.FLAT, tokens, 1, tuple(spans))

    def _end_pending(self, runner) -> None:
        step = self.pending.pop(id(runner), None)
        if step is not None:
            self.engine.steps.end(step)

    def _model_forward(self, original):
        steps, engine = self, self.engine

        def _model_forward(runner, *args, **kwargs):
            if not engine.awake or not engine.steps.dumped():
                return original(runner, *args, **kwargs)
            try:
                engine.steps.set_tokens(steps.step_layout(
                    runner, steps.batches.get(id(runner)), args, kwargs))
            except Exception as exc:
                engine.source.report(exc)
            switch = _EagerSwitch()
            if not switch.on():
                no_switch(engine, runner)
            elif compiled(runner):
                engine.compile_notice.say(EAGER_MESSAGE)
            try:
                return original(runner, *args, **kwargs)
            finally:
                switch.off()

        return _model_forward


MAX_PROMPTS = 1 << 16  # prompts kept at most (see `_forget_finished`)


def model_tokens(args: tuple, kwargs: dict) -> int | None:
    """The number of tokens `_model_forward` calls the model with (padding included): the
    length of its `input_ids`, `positions` or `inputs_embeds` (a shape: nothing is read from
    the device)."""
    for i, name in enumerate(("input_ids", "positions", "intermediate_tensors",
                              "inputs_embeds")):
        value = kwargs.get(name, args[i] if i < len(args) else None)
        shape = getattr(value, "shape", None)
        if name != "intermediate_tensors" and shape is not None and len(shape) >= 1:
            return int(shape[-1] if name == "positions" else shape[0])
    return None


class _ImportHook(importlib.abc.MetaPathFinder):
    """Calls `then()` right after one of the modules `names` is executed by its import. (The
    bootstrap's hook for `import torch` works the same way; it stays apart because it must run
    before anything of the package is imported.)"""

    def __init__(self, names: set[str], then):
        self.names = names
        self.then = then
        self._busy = threading.local()

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.names or getattr(self._busy, "name", None) == fullname:
            return None
        self._busy.name = fullname  # the finders below must not find us again
        try:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
            else:
                return None
        finally:
            self._busy.name = None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _ThenLoader(spec.loader, self.then)
        return spec


class _ThenLoader(importlib.abc.Loader):
    """A module's own loader, then a call."""

    def __init__(self, loader, then):
        self.loader = loader
        self.then = then

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        self.then()

    def __getattr__(self, name):  # get_source, get_code, is_package... as the loader has them
        return getattr(self.loader, name)


class _EagerSwitch:
    """vLLM's forward-context switches for one model call: `skip_compiled` and no CUDA graph."""

    __slots__ = ("context", "saved")

    def __init__(self):
        self.context = None
        self.saved = None

    def on(self) -> bool:
        """Set both switches; whether this vLLM has them."""
        forward = sys.modules.get("vllm.forward_context")
        try:
            if forward is None or not forward.is_forward_context_available():
                return False
            context = forward.get_forward_context()
        except Exception:
            return False
        if not hasattr(context, "skip_compiled"):
            return False
        self.context = context
        self.saved = (context.skip_compiled, getattr(context, "cudagraph_runtime_mode", None))
        context.skip_compiled = True
        if self.saved[1] is not None:
            context.cudagraph_runtime_mode = type(self.saved[1])(0)  # CUDAGraphMode.NONE
        return True

    def off(self) -> None:
        if self.context is None:
            return
        self.context.skip_compiled = self.saved[0]
        if self.saved[1] is not None:
            self.context.cudagraph_runtime_mode = self.saved[1]
        self.context = None


def compiled(runner) -> bool:
    """Whether the runner's model runs compiled code (or replays CUDA graphs)."""
    config = getattr(getattr(runner, "vllm_config", None), "compilation_config", None)
    mode = getattr(config, "mode", None)
    cudagraph = getattr(config, "cudagraph_mode", None)
    return bool(getattr(mode, "value", mode)) or bool(getattr(cudagraph, "value", cudagraph))


def no_switch(engine, runner) -> None:
    """A dumped step of a compiled model that the probe cannot run eagerly: say so, once, on
    stderr and in the status file (`compile_problem`)."""
    if compiled(runner):
        engine.compile_notice.cannot_run_eagerly(NO_SWITCH.format(runner=type(runner).__name__))


def step_phase(runner, scheduler_output) -> Phase | None:
    """`Prefill` when the step carries prompt tokens, `Decoder` when it carries only each
    request's next tokens; None when the batch cannot be read (the model's cache decides)."""
    try:
        if scheduler_output.scheduled_new_reqs:
            return Phase.PREFILL
        cached = scheduler_output.scheduled_cached_reqs
        scheduled = scheduler_output.num_scheduled_tokens
        spec = getattr(scheduler_output, "scheduled_spec_decode_tokens", None) or {}
        requests = getattr(runner, "requests", {})
        for i, req_id in enumerate(cached.req_ids):
            state = requests.get(req_id)
            prompt = getattr(state, "num_prompt_tokens", None)
            if prompt is not None and cached.num_computed_tokens[i] < prompt:
                return Phase.PREFILL
            if scheduled.get(req_id, 0) > 1 + len(spec.get(req_id, ())):
                return Phase.PREFILL   # a resumed request recomputes what it had
        return Phase.DECODER if scheduled else None
    except Exception:
        return None
