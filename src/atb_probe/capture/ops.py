"""The ops below a round's root: layer-level ops, their child modules and kernels (SPEC §1).

`OpWalker` is the per-op path of the call tree (capture/calltree.py): it numbers an op, asks the
selection what to write of it, pushes its frame on the thread's op stack, hands its tensors to
the recorder, and captures the kernels of a tracked layer-level op (capture/kernels.py).
Everything it catches goes to the round source's `report`; the model's own call always runs.
"""
from __future__ import annotations

import torch

from .. import layout
from ..selection import LayerPlan, SKIP_LAYER
from ..layout import INPUT
from .arguments import bind_args, kernel_tensors
from .frames import Below, Frame, OpFrame, RoundRun
from .kernels import KernelCapture, kernel_info
from .models import ModuleInfo
from .recorder import bound_tensors

_UNSEEN, _CONTAINER, _TRACK = Below.UNSEEN, Below.CONTAINER, Below.TRACK


class OpWalker:
    """Walks the ops below the roots for one `Engine`."""

    def __init__(self, engine):
        self.engine = engine
        self.tls = engine.tls
        self.recorder = engine.recorder
        self.source = engine.source
        self.info = engine.models.info

    # -- ops below the root -----------------------------------------------------------------

    def child_call(self, parent: Frame, module, args, kwargs):
        original = self.engine.original_call
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
        if parent.wraps is module:
            return None, None  # called by its torch.compile wrapper: the wrapper's op
        info = self.info(module)
        if info.stands_for_function:
            return None, None  # the function call it stands for (`is_function_adapter`)
        if parent.below is _CONTAINER:
            if info.is_container:
                return Frame(_CONTAINER, info.wraps), None
            return self.enter_layer(rnd, module, info, args, kwargs)
        index = parent.children
        parent.children += 1
        op_id = f"{parent.op_id}_{index}"
        full_name = f"{parent.full_name}/{info.name}"
        choice = rnd.selection.child_selected(op_id, full_name, info.name,
                                              parent.dump_children)
        frame = OpFrame(op_id, info.name, full_name,
                        layout.child_op_dir(parent.rel, index, info.name), choice.dump,
                        choice.dump_children, _TRACK, parent.layer, parent.collect,
                        wraps=info.wraps)
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
                        layer, layer.collect, rnd.model.paths.get(module), info.wraps)
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

    def kernel_call(self, func, args, kwargs):
        stack = self.tls.stack
        top = stack[-1] if stack else None
        if top is None or top.below is not _TRACK:
            return func(*args, **kwargs)
        rnd = self.tls.round
        frame = kernel = None
        rows_only = False
        try:
            kernel = kernel_info(func)
            name = kernel.name
            index = top.children
            top.children = index + 1
            op_id = f"{top.op_id}_{index}"
            full_name = f"{top.full_name}/{name}"
            dump = top.dump_children or \
                rnd.selection.child_selected(op_id, full_name, name, False).dump
            if dump:
                rnd.selected += 1
            rows_only = dump and not top.collect and rnd.record.statistics_only
            # Neither written nor described in a structure file (and writing to nothing that
            # filter_level 1 may refer to): the kernel only takes its ID.
            record = dump or top.collect
            written = kernel.written
            if (record or written) and not rows_only:
                frame = OpFrame(op_id, name, full_name,
                                layout.child_op_dir(top.rel, index, name), dump, False,
                                _UNSEEN, top.layer, top.collect)
                pairs = None
                if record:
                    frame.record, pairs = self.recorder.kernel_inputs(rnd, frame, kernel, args,
                                                                      kwargs)
                if written:
                    if pairs is None:
                        pairs = bind_args(kernel.params, args, kwargs)
                    self.recorder.forget_written(frame.layer, pairs, written)
        except Exception as exc:
            self.source.report(exc)
            frame = None
            rows_only = False
        if rows_only:  # outside the `try`: the model's own errors are not the probe's
            return self.statistics_kernel_call(rnd, top, kernel, index, op_id, full_name, func,
                                               args, kwargs)
        out = func(*args, **kwargs)
        if kernel is not None and kernel.allocates:
            self.recorder.allocated(top.layer, out)
        if frame is not None:
            try:
                if dump and kernel.collective:
                    _wait_for_collective(kernel.op_name, out)
                if record:
                    self.recorder.kernel_outputs(rnd, frame, kernel, out,
                                                 _written_values(pairs, written, out))
                    self.recorder.child_done(top, frame)
            except Exception as exc:
                self.source.report(exc)
        return out

    def statistics_kernel_call(self, rnd: RoundRun, top: OpFrame, kernel, index: int,
                               op_id: str, full_name: str, func, args, kwargs):
        """`kernel_call` of a dumped kernel whose sides are only statistic.csv rows (a
        statistics dump, no structure collected, no per-request rows): no frame and no record
        of it; its rows come from what this call holds (`Recorder.kernel_side`)."""
        recorder = self.recorder
        layer = top.layer
        written = kernel.written
        names = (full_name, kernel.name, op_id)
        pairs = seen = None
        recorded = False
        try:
            tensors = None if written else kernel_tensors(kernel.params, args, kwargs)
            if tensors is None:
                pairs = bind_args(kernel.params, args, kwargs)
                tensors = bound_tensors(pairs)
            seen = recorder.kernel_side(rnd, layer, names, INPUT, tensors, kernel)
            if written:
                recorder.forget_written(layer, pairs, written)
            recorded = True
        except Exception as exc:
            self.source.report(exc)
        out = func(*args, **kwargs)
        if kernel.allocates:
            recorder.allocated(layer, out)
        if recorded:
            try:
                if kernel.collective:
                    _wait_for_collective(kernel.op_name, out)
                recorder.kernel_output_statistics(
                    rnd, layer, names, kernel, out, _written_values(pairs, written, out), seen,
                    lambda: layout.child_op_dir(top.rel, index, kernel.name))
            except Exception as exc:
                self.source.report(exc)
        return out


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
