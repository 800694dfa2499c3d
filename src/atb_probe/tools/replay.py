"""`atb-probe replay TARGET [--golden GOLDEN] [OP]`: was it this kernel, or was it given wrong
inputs? (SPEC §10)

Each ATen kernel of a dump (task `tensor` or `all`, `save_child`) is run again from its own
recorded inputs, its call rebuilt from `op_param.json` (kernelcall.py) and run by kernelrun.py:

* the *reference*: the same op with every floating tensor widened to float64, on the CPU;
* the *rerun*: the same op in the recorded dtypes, on the CPU (and, with `--device`, on that
  device too).

The error a kernel *introduced* is its recorded output against the reference. Every narrow
dtype makes some, so it counts only beyond what the dtype explains:

    ‖recorded − reference‖₂ > margin × ‖rerun − reference‖₂ + ulps × eps(dtype) × ‖reference‖₂

The first term is the error this very op makes in this dtype on these inputs (the CPU's kernel
rounds as a correct kernel does; another correct kernel may sum in another order, hence the
margin, 4 by default); the second is a few units in the last place of the dtype (2 by default),
for outputs the CPU rerun happens to get exactly right. NaN/Inf in the recorded output where the
reference has finite values count as introduced unless the rerun in the dtype has them too
(an overflow the dtype explains). Elements where any of the three is NaN/Inf are left out of the
norms.

With a golden dump (its kernels paired with this one's as compare pairs them, align.py), the
error *inherited* is each input against the golden's same input, and the *total* is each output
against the golden's, with compare's metrics and thresholds. A kernel that introduced nothing but
whose output crosses the thresholds against the golden *inherited* its error: replay names the
input that carries it (the first crossing input, else the one of lowest cosine).

`--until-culprit` replays kernels in execution order (from compare's first divergence with a
golden, else from the start) and stops at the first that introduced error. `--export DIR` hands
over one kernel: its tensors as .npy, its call as `call.json`, and `repro.py` (kernelrun.py, which
needs only torch and numpy).

A module op is replayed as a whole with `OP --weights PATH` (modulecall.py builds it, loads
the user's weights and calls it from its recorded inputs) and judged as a kernel is; without
weights, replay lists the kernels below it and replays those. compare's `--replay` runs the
culprit search from its own finding (culprit.py).

What cannot be replayed is reported with its reason (kernelcall.SkipReason): inputs without data
(statistics dumps, header-only files of filter_level 2; references of filter_level 1 are
followed), random ops, ops without a schema here, allocations, collectives, ops reading storage.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from .. import layout
from ..layout import Side
from . import StrEnum
from .align import align_dumps
from .comparison import CompareError, PairResult, TensorRef, Thresholds
from .divergence import crosses
from .dumpreader import Dump, DumpError, DumpLevel, open_dump
from .jobs import default_jobs, worker_pool
from .metrics import TensorMetrics

MARGIN = 4.0      # times the rerun's own error in the recorded dtype
ULPS = 2.0        # units in the last place of the recorded dtype, times the reference's norm
WINDOW = 4        # batches in flight per job while looking for the culprit
BATCH = 16        # kernels per batch sent to a worker


class Verdict(StrEnum):
    """What replay concludes of a kernel."""

    INTRODUCED = "introduced here"     # its output is off by more than its dtype explains
    INHERITED = "inherited"            # off against the golden, but from its inputs
    CLEAN = "within its dtype"         # nothing beyond its dtype's error
    SKIPPED = "not replayed"           # see SkipReason


@dataclass(frozen=True, slots=True)
class Bound:
    """How much error a kernel's dtype explains (the module docstring)."""

    margin: float = MARGIN
    ulps: float = ULPS

    def limit(self, rerun_error: float, reference_norm: float, eps: float) -> float:
        return self.margin * rerun_error + self.ulps * eps * reference_norm

    def describe(self) -> str:
        return (f"{self.margin:g} × the recorded dtype's own error (the op rerun in that dtype "
                f"on the CPU) + {self.ulps:g} ulps × the reference's norm")


@dataclass(slots=True)
class TensorFile:
    """One tensor of a kernel: its file name, the target's dumped tensor and the golden's."""

    name: str                     # `intensor0`, `outtensor0`
    target: TensorRef
    golden: TensorRef | None = None


@dataclass(slots=True)
class KernelJob:
    """A kernel to replay, as it goes to a worker process."""

    process: str                  # `0_1234`
    round_index: int
    op_id: str                    # `3_1_6_2`
    op_path: str                  # `3_LlamaDecoderLayer/1_LlamaAttention/6_Linear/2_MmKernel`
    folder: str                   # the op's folder on disk
    order: int                    # its first row's place in the round: execution order
    inputs: list[TensorFile]
    outputs: list[TensorFile]
    golden_op_path: str = ""      # the golden's paired kernel, "" without one

    @property
    def where(self) -> str:
        return f"round {self.round_index}, {self.op_id} ({self.op_path})"


@dataclass(frozen=True, slots=True)
class ReplaySettings:
    """What every replay of a run shares."""

    bound: Bound = Bound()
    device: str | None = None     # also rerun in the recorded dtype there
    imports: tuple[str, ...] = ()  # modules registering custom ops
    thresholds: Thresholds = Thresholds()


@dataclass(slots=True)
class Judgement:
    """One output against the reference, and whether its dtype explains the difference."""

    error: float                  # ‖recorded − reference‖₂
    rerun_error: float            # ‖rerun in the recorded dtype − reference‖₂
    limit: float                  # what the dtype explains (Bound.limit)
    nonfinite: int                # NaN/Inf the reference and the rerun do not have
    introduced: bool


@dataclass(slots=True)
class OutputError:
    """One output of a replayed kernel."""

    name: str
    dtype: str
    judgement: Judgement | None   # None: not compared (see note)
    metrics: TensorMetrics        # compare's metrics, recorded against the reference
    device_metrics: TensorMetrics | None = None   # recorded against the rerun on --device
    total: PairResult | None = None               # against the golden's output
    note: str = ""

    @property
    def introduced(self) -> bool:
        return bool(self.judgement and self.judgement.introduced)


@dataclass(slots=True)
class InputError:
    """One input of a replayed kernel against the golden's: the error it inherits."""

    name: str
    argument: str                 # its ATen argument name
    row: PairResult
    crossing: bool | None


@dataclass(slots=True)
class KernelResult:
    """What replaying one kernel found."""

    job: KernelJob
    op: str                       # `aten.mm.default`, "" when unknown
    verdict: Verdict
    reason: str = ""              # a SkipReason when not replayed
    detail: str = ""
    outputs: list[OutputError] = field(default_factory=list)
    inputs: list[InputError] = field(default_factory=list)
    carrier: str = ""             # the input carrying an inherited error

    def worst(self) -> OutputError | None:
        """The output that decided the verdict: the first introduced, else the first."""
        judged = [o for o in self.outputs if o.judgement is not None]
        return next((o for o in judged if o.introduced), judged[0] if judged else None)

    def summary(self) -> str:
        """One line for the console."""
        head = f"{self.verdict}: {self.job.where} {self.op}".rstrip()
        if self.verdict == Verdict.SKIPPED:
            return f"{head}: {self.reason}: {self.detail}"
        out = self.worst()
        text = head
        if out is not None:
            j = out.judgement
            sign = ">" if j.introduced else "≤"
            text += (f", {out.name} ({out.dtype}): ‖recorded − float64‖ {j.error:.4g} {sign} "
                     f"bound {j.limit:.4g}; {_metrics_text(out.metrics)}")
            if j.nonfinite:
                text += f"; {j.nonfinite} NaN/Inf the reference does not have"
            if out.device_metrics is not None:
                text += f"; against the device rerun: {_metrics_text(out.device_metrics)}"
            if out.total is not None:
                text += f"; against the golden: {_metrics_text(out.total.metrics)}"
        if self.verdict == Verdict.INHERITED and self.carrier:
            text += f"; carried by {self.carrier}"
        return text

    def as_dict(self) -> dict:
        """The record for `--json`."""
        doc = {"process": self.job.process, "round": self.job.round_index,
               "op_id": self.job.op_id, "op_path": self.job.op_path, "op": self.op,
               "verdict": str(self.verdict)}
        if self.reason:
            doc.update(reason=str(self.reason), detail=self.detail)
        if self.carrier:
            doc["carrier"] = self.carrier
        outputs = []
        for o in self.outputs:
            entry = {"name": o.name, "dtype": o.dtype, "metrics": _metrics_dict(o.metrics)}
            if o.judgement is not None:
                j = o.judgement
                entry.update(error=j.error, rerun_error=j.rerun_error, bound=j.limit,
                             nonfinite=j.nonfinite, introduced=j.introduced)
            if o.device_metrics is not None:
                entry["device_metrics"] = _metrics_dict(o.device_metrics)
            if o.total is not None:
                entry["total"] = _metrics_dict(o.total.metrics)
                entry["total_crossing"] = o.total.diverged
            if o.note:
                entry["note"] = o.note
            outputs.append(entry)
        doc["outputs"] = outputs
        if self.inputs:
            doc["inherited"] = [{"name": i.name, "argument": i.argument,
                                 "metrics": _metrics_dict(i.row.metrics),
                                 "crossing": i.crossing} for i in self.inputs]
        return doc


def _metrics_dict(m: TensorMetrics) -> dict:
    return {k: getattr(m, k) for k in m.__slots__}


def _metrics_text(m: TensorMetrics) -> str:
    def num(v, fmt):
        return "N/A" if v is None else format(v, fmt)
    return (f"cosine {num(m.cosine, '.6f')}, max abs err {num(m.max_abs_err, '.4g')}, "
            f"1‰-ratio {num(m.one_thousandth_ratio, '.4f')}")


# -- judging one output (numpy only) ---------------------------------------------------------

def judge(reference: np.ndarray, recorded: np.ndarray, rerun: np.ndarray, eps: float,
          bound: Bound) -> Judgement:
    """Whether `recorded` differs from `reference` (float64) by more than `rerun` (the op in
    the recorded dtype) and `eps` (that dtype's machine epsilon) explain."""
    ref = np.asarray(reference, dtype=np.float64).reshape(-1)
    rec = np.asarray(recorded, dtype=np.float64).reshape(-1)
    again = np.asarray(rerun, dtype=np.float64).reshape(-1)
    finite_ref, finite_rec, finite_again = np.isfinite(ref), np.isfinite(rec), np.isfinite(again)
    off = (~finite_rec | ~finite_ref) & ~_same(rec, ref)
    nonfinite = int(np.count_nonzero(off & ~_same(rec, again)))
    keep = finite_ref & finite_rec & finite_again
    ref, rec, again = ref[keep], rec[keep], again[keep]
    error = float(np.linalg.norm(rec - ref))
    rerun_error = float(np.linalg.norm(again - ref))
    limit = bound.limit(rerun_error, float(np.linalg.norm(ref)), eps)
    return Judgement(error, rerun_error, limit, nonfinite, nonfinite > 0 or error > limit)


def _same(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Elementwise: equal, or both NaN."""
    with np.errstate(invalid="ignore"):
        return (a == b) | (np.isnan(a) & np.isnan(b))


# -- replaying one kernel (in a worker process) ---------------------------------------------

def replay_batch(jobs: list[KernelJob], settings: ReplaySettings) -> list[KernelResult]:
    """The results of a batch of kernels (run in a worker process)."""
    import_modules(settings.imports)
    return [replay_kernel(job, settings) for job in jobs]


def import_modules(names) -> None:
    """Import the modules that register custom ops (`--import`)."""
    for name in names:
        importlib.import_module(name)


def replay_kernel(job: KernelJob, settings: ReplaySettings) -> KernelResult:
    """Replay one kernel: its verdict, with the error of each output and each input."""
    from .kernelcall import CannotReplay, SkipReason, build_call
    from .kernelrun import FLOAT64, RECORDED, run_call
    op = ""
    try:
        param = read_param(job.folder)
        op = param.op
        call = build_call(param)
        inputs = load_inputs(job, call)
        runs = {}
        for key, precision, device in (("reference", FLOAT64, "cpu"),
                                       ("rerun", RECORDED, "cpu"),
                                       ("device", RECORDED, settings.device)):
            if device is None:
                continue
            try:
                runs[key] = run_call(call, inputs, precision, device)
            except Exception as exc:
                text = str(exc).strip().splitlines()
                raise CannotReplay(SkipReason.FAILED, f"the {key} run raised "
                                   f"{type(exc).__name__}: {text[0] if text else ''}") from None
    except CannotReplay as exc:
        return KernelResult(job, op, Verdict.SKIPPED, str(exc.reason), exc.detail)
    result = KernelResult(job, op, Verdict.CLEAN)
    recorded = {f.name: f for f in job.outputs}
    try:
        for i, entry in enumerate(call["outputs"]):
            result.outputs.append(_output_error(entry["name"], recorded.get(entry["name"]),
                                                param, {k: v[i] for k, v in runs.items()},
                                                settings))
        _inherited(result, param.inputs, settings.thresholds)
    except Exception as exc:  # one kernel's odd output must not end the whole replay
        return KernelResult(job, op, Verdict.SKIPPED, str(SkipReason.FAILED),
                            f"comparing its outputs raised {type(exc).__name__}: {exc}")
    _decide(result)
    return result


def replay_module(job: KernelJob, settings: ReplaySettings, weights: str,
                  config: dict | None = None) -> KernelResult:
    """Replay one module op with the user's weights (`--weights`; `config`: the model's config
    the dump records), judged as a kernel is: its verdict, with the error of each output and
    each input."""
    from . import modulecall
    from .kernelcall import CannotReplay, SkipReason
    name = ""
    try:
        param = read_module_param(job.folder)
        name = param.cls
        module = modulecall.build_module(param, weights, config)
        by_name = {f.name: f for f in job.inputs}
        inputs = {}
        for label in param.inputs:
            found = by_name.get(layout.tensor_name(Side.INPUT, label))
            if found is None:
                raise CannotReplay(SkipReason.NO_DATA, f"input {label} has no row in "
                                   "statistic.csv")
            inputs[found.name] = load_tensor(found.target)
        kwargs = modulecall.call_arguments(module, param, inputs)
        runs = {}
        for key, wide in (("reference", True), ("rerun", False)):
            try:
                runs[key] = modulecall.run_module(module, kwargs, wide)
            except Exception as exc:
                text = str(exc).strip().splitlines()
                raise CannotReplay(SkipReason.FAILED, f"the {key} run raised "
                                   f"{type(exc).__name__}: {text[0] if text else ''}") from None
    except CannotReplay as exc:
        return KernelResult(job, name, Verdict.SKIPPED, str(exc.reason), exc.detail)
    result = KernelResult(job, name, Verdict.CLEAN)
    recorded = {f.name: f for f in job.outputs}
    for label in param.outputs:
        out_name = layout.tensor_name(Side.OUTPUT, label)
        index = int(label.split("_", 1)[0])
        if index >= len(runs["reference"]):
            result.outputs.append(OutputError(out_name, "", None, TensorMetrics(),
                                              note="the rerun returned fewer outputs"))
            continue
        result.outputs.append(_output_error(out_name, recorded.get(out_name), param,
                                            {k: v[index] for k, v in runs.items()}, settings))
    arguments = {layout.tensor_name(Side.INPUT, label): argument
                 for label, argument in zip(param.inputs, param.arguments or ())}
    _inherited(result, arguments, settings.thresholds)
    _decide(result)
    return result


def read_module_param(folder: str):
    """A module op's `op_param.json` (modulecall.ModuleParam), or `CannotReplay`."""
    from .kernelcall import CannotReplay, SkipReason
    from .modulecall import ModuleParam
    path = os.path.join(folder, layout.OP_PARAM)
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except FileNotFoundError:
        raise CannotReplay(SkipReason.NO_PARAM, "the dump has no op_param.json for it (task "
                           "statistics keeps no arguments: dump with task tensor or all)") \
            from None
    except (OSError, ValueError) as exc:
        raise CannotReplay(SkipReason.NO_PARAM, f"unreadable {path}: {exc}") from None
    if not isinstance(doc, dict) or not doc.get("class"):
        raise CannotReplay(SkipReason.NO_PARAM, "its op_param.json names no module class")
    return ModuleParam.of(doc)


def read_param(folder: str):
    """The kernel's `op_param.json`, or `CannotReplay`."""
    from .kernelcall import CannotReplay, KernelParam, SkipReason
    path = os.path.join(folder, layout.OP_PARAM)
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except FileNotFoundError:
        raise CannotReplay(SkipReason.NO_PARAM, "the dump has no op_param.json for it (task "
                           "statistics keeps no arguments: dump with task tensor or all)") \
            from None
    except (OSError, ValueError) as exc:
        raise CannotReplay(SkipReason.NO_PARAM, f"unreadable {path}: {exc}") from None
    if not isinstance(doc, dict) or "op" not in doc or "inputs" not in doc:
        raise CannotReplay(SkipReason.NO_PARAM, "its op_param.json names no ATen op and inputs "
                           "(task statistics writes only `op`, `type`, `uninitialized`)")
    return KernelParam.of(doc)


def load_tensor(ref: TensorRef):
    """A dumped tensor in its own dtype, references followed; `CannotReplay` without data."""
    from ..binfile import BinFormatError
    from ..binread import HeaderOnlyError
    from ..binread import load_tensor as load
    from .kernelcall import CannotReplay, SkipReason
    name = ref.data_name.rsplit("/", 1)[-1]
    if ref.path is None:
        raise CannotReplay(SkipReason.NO_DATA, f"{name} has no .bin file (task statistics, or "
                           "a file the probe could not write): statistics only")
    try:
        return load(ref.path)
    except HeaderOnlyError:
        raise CannotReplay(SkipReason.NO_DATA, f"{name} is a header-only file (filter_level "
                           "2): statistics only") from None
    except (OSError, BinFormatError) as exc:
        raise CannotReplay(SkipReason.NO_DATA, f"{name} cannot be read: {exc}") from None


def load_inputs(job: KernelJob, call: dict) -> dict:
    """The kernel's input tensors the call uses, by file name (`intensor0`)."""
    from .kernelcall import CannotReplay, SkipReason
    by_name = {f.name: f for f in job.inputs}
    inputs = {}
    for name in sorted(_tensor_names(call["kwargs"])):
        found = by_name.get(name)
        if found is None:
            raise CannotReplay(SkipReason.NO_DATA, f"{name} has no row in statistic.csv")
        inputs[name] = load_tensor(found.target)
    return inputs


def _tensor_names(value) -> set[str]:
    if isinstance(value, dict):
        if "tensor" in value:
            return {value["tensor"]}
        return set().union(*(_tensor_names(v) for v in value.values()))
    if isinstance(value, list):
        return set().union(*(_tensor_names(v) for v in value))
    return set()


def _output_error(name: str, dumped: TensorFile | None, param, runs: dict,
                  settings: ReplaySettings) -> OutputError:
    from .compare import compare_pair
    from .kernelcall import CannotReplay
    from .kernelrun import as_numpy
    from .metrics import compare_arrays
    reference = runs["reference"]
    if name in param.uninitialized:
        return OutputError(name, "", None, TensorMetrics(), note="uninitialized memory")
    if dumped is None:
        return OutputError(name, "", None, TensorMetrics(), note="no row in statistic.csv")
    try:
        recorded = load_tensor(dumped.target)
    except CannotReplay as exc:
        return OutputError(name, dumped.target.dtype, None, TensorMetrics(), note=exc.detail)
    out = OutputError(name, dumped.target.dtype, None, TensorMetrics())
    if dumped.golden is not None:
        out.total = compare_pair(dumped.golden, dumped.target)
        out.total.diverged = crosses(out.total, settings.thresholds)
    if not hasattr(reference, "shape") or tuple(reference.shape) != tuple(recorded.shape):
        out.note = (f"the rerun's output is {getattr(reference, 'shape', type(reference))}, "
                    f"the recorded {tuple(recorded.shape)}")
        return out
    rec = as_numpy(recorded)
    ref = as_numpy(reference)
    out.metrics = compare_arrays(ref, rec).metrics
    eps = _eps(recorded)
    out.judgement = judge(ref, rec, as_numpy(runs["rerun"]), eps, settings.bound)
    if "device" in runs:
        out.device_metrics = compare_arrays(as_numpy(runs["device"]), rec).metrics
    return out


def _eps(t) -> float:
    import torch
    return float(torch.finfo(t.dtype).eps) if t.dtype.is_floating_point else 0.0


def _inherited(result: KernelResult, arguments: dict, thresholds: Thresholds) -> None:
    """The inputs against the golden's: the error the kernel was handed."""
    from .compare import compare_pair
    for f in result.job.inputs:
        if f.golden is None:
            continue
        row = compare_pair(f.golden, f.target)
        row.diverged = crosses(row, thresholds)
        result.inputs.append(InputError(f.name, arguments.get(f.name, ""), row, row.diverged))


def _decide(result: KernelResult) -> None:
    """The verdict from the judged outputs and, with a golden, the inputs (module docstring)."""
    if any(o.introduced for o in result.outputs):
        result.verdict = Verdict.INTRODUCED
        return
    if not any(o.judgement for o in result.outputs):
        notes = "; ".join(f"{o.name}: {o.note}" for o in result.outputs if o.note)
        result.verdict, result.reason = Verdict.SKIPPED, "nothing to compare"
        result.detail = notes or "it returns no tensor"
        return
    if not any(o.total is not None and o.total.diverged for o in result.outputs):
        return
    crossing = [i for i in result.inputs if i.crossing]
    compared = [i for i in result.inputs if i.row.metrics.cosine is not None]
    carrier = crossing[0] if crossing else \
        min(compared, key=lambda i: i.row.metrics.cosine, default=None)
    if carrier is not None:
        result.verdict = Verdict.INHERITED
        result.carrier = f"{carrier.name} ({carrier.argument}): " \
                         f"{_metrics_text(carrier.row.metrics)}"


# -- which kernels -------------------------------------------------------------------------

def kernel_jobs(target: Dump, golden: Dump | None = None, opmap=None,
                left=None) -> list[KernelJob]:
    """Every kernel of `target` in execution order (process, round, start), each with the
    golden's tensors paired as compare pairs them (`opmap`, `left`: the op map compare
    chose, conventions.choose)."""
    paired, golden_of = _pairing(target, golden, opmap, left)
    jobs = []
    for rnd in target.rounds:
        for op in rnd.ops:
            if is_kernel(op.op_name):
                jobs.append(_job(rnd, op, golden_of, paired))
    return jobs


def is_kernel(op_name: str) -> bool:
    """Whether an op (by its full `/` name) is a kernel, not a module."""
    return op_name.rsplit("/", 1)[-1].endswith("Kernel")


def module_jobs(target: Dump, op: str, golden: Dump | None = None) -> list[KernelJob]:
    """The module ops of `target` an OP argument names exactly (an op ID or an op path below
    the round), one per round, with the golden's tensors paired as compare pairs them."""
    op = op.rstrip("/")
    op = layout.below_round(op.replace(os.sep, "/")) or op
    found = [(rnd, o) for rnd in target.rounds for o in rnd.ops
             if not is_kernel(o.op_name) and op in (o.op_id, o.op_path)]
    if not found:
        return []
    paired, golden_of = _pairing(target, golden)
    return [_job(rnd, o, golden_of, paired) for rnd, o in found]


def _pairing(target: Dump, golden: Dump | None, opmap=None, left=None) -> tuple[dict, dict]:
    """The golden's op path of each target (round, op path), and the golden's tensor record of
    each target tensor record (by id), as compare pairs them."""
    paired, golden_of = {}, {}
    if golden is not None:
        for rp in align_dumps(golden, target, opmap, left).rounds:
            for pair in rp.ops:
                paired[(rp.target.where, pair.target.op_path)] = pair.golden.op_path
                for t in pair.tensors:
                    golden_of[id(t.target)] = t.golden
    return paired, golden_of


def _job(rnd, op, golden_of: dict, paired: dict) -> KernelJob:
    """The replay job of one op of a round; `golden_of`: the golden's tensor record of each
    target tensor record (by id), `paired`: the golden's op path of each (round, op path)."""
    files = {Side.INPUT: [], Side.OUTPUT: []}
    for t in op.tensors:
        if t.io in files:
            g = golden_of.get(id(t))
            files[t.io].append(TensorFile(layout.tensor_name(t.io, t.index), TensorRef.of(t),
                                          TensorRef.of(g) if g is not None else None))
    return KernelJob(rnd.process.name, rnd.index, op.op_id, op.op_path,
                     os.path.join(rnd.path, op.op_path), op.tensors[0].order,
                     files[Side.INPUT], files[Side.OUTPUT],
                     paired.get((rnd.where, op.op_path), ""))


def select(jobs: list[KernelJob], op: str) -> list[KernelJob]:
    """The kernels an OP argument names: an op ID (`3_1_6_2`) or an op path below the round
    (`3_LlamaDecoderLayer/.../2_MmKernel`, or a folder path ending so); a module op names the
    kernels below it."""
    op = op.rstrip("/")
    below = layout.below_round(op.replace(os.sep, "/"))
    if below:
        op = below
    picked = []
    for job in jobs:
        for key in (job.op_id, job.op_path):
            sep = "_" if key is job.op_id else "/"
            if key == op or key.startswith(op + sep):
                picked.append(job)
                break
    return picked


def start_at_divergence(jobs: list[KernelJob], golden: str, target: str, n_jobs: int
                        ) -> tuple[list[KernelJob], str]:
    """The kernels from compare's first divergence on, and a line saying where that is."""
    from .compare import compare_dumps
    result = compare_dumps(golden, target, jobs=n_jobs)
    return start_at(jobs, result.finding, open_dump(target))


def start_at(jobs: list[KernelJob], finding, target: Dump) -> tuple[list[KernelJob], str]:
    """The kernels from a finding of compare (divergence.Finding; None: from the start) on,
    and a line saying where that is."""
    if finding is None:
        return jobs, "compare finds no divergence against the golden: replaying from the start"
    process = finding.row.target.process
    rnd = next(r for r in target.rounds
               if r.process.name == process and r.index == finding.round_index)
    start = min(t.order for op in rnd.ops if op.op_path == finding.op_path for t in op.tensors)
    for i, job in enumerate(jobs):
        if job.process == process and (job.round_index, job.order) >= (finding.round_index,
                                                                       start):
            return jobs[i:], f"from compare's first divergence: round {finding.round_index}, " \
                             f"{finding.op_path}"
    return [], f"compare's first divergence ({finding.op_path}) holds no kernel"


# -- running many ------------------------------------------------------------------------------

def replay_all(jobs: list[KernelJob], settings: ReplaySettings, n_jobs: int = 1,
               stop_at_culprit: bool = False) -> list[KernelResult]:
    """Replay `jobs` in order, in `n_jobs` worker processes when more than one; with
    `stop_at_culprit`, only up to the first kernel that introduced error (the last result)."""
    batches = [jobs[i:i + BATCH] for i in range(0, len(jobs), BATCH)]
    results: list[KernelResult] = []
    if n_jobs <= 1 or len(batches) <= 1:
        import_modules(settings.imports)
        for job in jobs:
            results.append(replay_kernel(job, settings))
            if stop_at_culprit and results[-1].verdict == Verdict.INTRODUCED:
                break
        return results
    with worker_pool(min(n_jobs, len(batches))) as pool:
        pending = []
        queue = iter(batches)
        for batch in queue:
            pending.append(pool.submit(replay_batch, batch, settings))
            if len(pending) >= n_jobs * WINDOW:
                break
        while pending:
            done = pending.pop(0).result()
            for result in done:
                results.append(result)
                if stop_at_culprit and result.verdict == Verdict.INTRODUCED:
                    for future in pending:
                        future.cancel()
                    return results
            batch = next(queue, None)
            if batch is not None:
                pending.append(pool.submit(replay_batch, batch, settings))
    return results


# -- command line --------------------------------------------------------------------------

def register(sub) -> None:
    p = sub.add_parser(
        "replay", help="rerun kernels from their recorded inputs: which one introduced error",
        description="Rerun the ATen kernels of TARGET (a dump of task tensor or all, with "
                    "save_child) from their own recorded inputs, in float64 on the CPU, and "
                    "report the error each one introduced beyond what its dtype explains; with "
                    "--golden, also the error it inherited from its inputs and the total.",
        epilog="examples:\n  atb-probe replay bf16 --until-culprit\n"
               "  atb-probe replay bf16 --golden fp32 3_1_6_2 --export repro_mm\n"
               "  python repro_mm/repro.py --device cuda:0",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("target", help="the dump to check (root, <dev>_<pid> or round folder)")
    p.add_argument("op", nargs="?", default=None,
                   help="a kernel by op ID (3_1_6_2) or path (3_LlamaDecoderLayer/.../"
                        "2_MmKernel); a module op means its kernels; default: all kernels")
    p.add_argument("--golden", metavar="GOLDEN", help="a reference dump of the same model")
    p.add_argument("--round", type=int, default=None, metavar="N", help="only round N")
    p.add_argument("--until-culprit", action="store_true",
                   help="stop at the first kernel (in execution order; from compare's first "
                        "divergence with --golden) that introduced error; exit 1 if one did")
    p.add_argument("--export", metavar="DIR",
                   help="write one kernel's tensors (.npy), its call (call.json) and a "
                        "standalone repro.py (torch and numpy only) into DIR")
    p.add_argument("--weights", metavar="PATH",
                   help="replay OP, a module op, as a whole: its class built and loaded with "
                        "these weights (a save_pretrained folder or a .safetensors file, "
                        "parameters named as the model names them)")
    p.add_argument("--device", metavar="DEV",
                   help="also rerun each kernel in its recorded dtype on DEV (cuda:0, npu:0)")
    p.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                   help="import MODULE first: it registers custom ops (repeatable)")
    p.add_argument("--margin", type=float, default=MARGIN,
                   help=f"times the dtype's own error that still counts as explained "
                        f"(default {MARGIN:g})")
    p.add_argument("--ulps", type=float, default=ULPS,
                   help=f"units in the last place always allowed (default {ULPS:g})")
    d = Thresholds()
    p.add_argument("--min-cosine", type=float, default=d.min_cosine, metavar="C",
                   help=f"with --golden: a tensor with cosine below C differs from the golden's "
                        f"(default {d.min_cosine}, as compare)")
    p.add_argument("--min-ratio", type=float, default=d.min_ratio, metavar="R",
                   help="with --golden: a tensor whose share of elements within 1‰ relative "
                        f"error is below R differs (default {d.min_ratio}; 0 turns it off)")
    p.add_argument("-j", "--jobs", type=int, default=None, metavar="N",
                   help=f"worker processes (default: the cores available, here "
                        f"{default_jobs()})")
    p.add_argument("--json", metavar="FILE", help="write every kernel's result as JSON")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="print every kernel, not only those with a finding")
    p.set_defaults(func=_replay)


def _replay(args) -> int:
    n_jobs = default_jobs() if args.jobs is None else args.jobs
    if n_jobs < 1:
        print("atb-probe replay: --jobs must be at least 1", file=sys.stderr)
        return 2
    try:
        import_modules(args.imports)
    except Exception as exc:
        print(f"atb-probe replay: cannot import {exc}", file=sys.stderr)
        return 2
    try:
        target = open_dump(args.target)
        golden = open_dump(args.golden) if args.golden else None
    except DumpError as exc:
        print(f"atb-probe replay: {exc}", file=sys.stderr)
        return 2
    if golden is not None and \
            (golden.kind == DumpLevel.ROUND) != (target.kind == DumpLevel.ROUND):
        print(f"atb-probe replay: GOLDEN is a {golden.kind} folder but TARGET is a "
              f"{target.kind} folder: give two round folders, or two dump roots / process "
              "folders", file=sys.stderr)
        return 2
    settings = ReplaySettings(Bound(args.margin, args.ulps), args.device, tuple(args.imports),
                              Thresholds(args.min_cosine, args.min_ratio))
    modules = module_jobs(target, args.op, golden) if args.op else []
    if args.round is not None:
        modules = [j for j in modules if j.round_index == args.round]
    if args.weights:
        if not modules:
            print(f"atb-probe replay: --weights replays a module op, and {args.op!r} names "
                  "none of TARGET's (give its op ID, such as 3, or its path, such as "
                  "3_LlamaDecoderLayer)", file=sys.stderr)
            return 2
        return _replay_modules(modules, args, settings, target)
    jobs = kernel_jobs(target, golden)
    if args.round is not None:
        jobs = [j for j in jobs if j.round_index == args.round]
    if args.op:
        jobs = select(jobs, args.op)
        if modules:
            _kernels_instead(args.op, modules[0], jobs)
        if not jobs:
            print(f"atb-probe replay: no kernel of TARGET is {args.op!r} (give an op ID such "
                  "as 3_1_6_2 or a path below the round; kernels are dumped with save_child)",
                  file=sys.stderr)
            return 2
    if not jobs:
        print("atb-probe replay: TARGET holds no kernel: dump with save_child true (and task "
              "tensor or all)", file=sys.stderr)
        return 2
    if args.export and not args.until_culprit and len(jobs) > 1:
        print(f"atb-probe replay: --export writes one kernel, and {len(jobs)} are selected: "
              "name one by its op ID, or add --until-culprit", file=sys.stderr)
        return 2
    if args.until_culprit and golden is not None:
        try:
            jobs, line = start_at_divergence(jobs, args.golden, args.target, n_jobs)
        except CompareError as exc:
            print(f"atb-probe replay: {exc}", file=sys.stderr)
            return 2
        print(line)
    results = replay_all(jobs, settings, n_jobs, stop_at_culprit=args.until_culprit)
    _print(results, args.verbose, settings, culprit_line=args.until_culprit)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump([r.as_dict() for r in results], f, indent=1, allow_nan=True)
    culprit = next((r for r in results if r.verdict == Verdict.INTRODUCED), None)
    if args.until_culprit:
        if culprit is None:
            print(f"no culprit: none of the {len(results)} kernels replayed introduced error "
                  f"beyond its dtype")
        else:
            print(f"culprit: {culprit.summary()}")
    if args.export:
        chosen = culprit if args.until_culprit else results[0]
        if chosen is None:
            print("nothing exported: no culprit", file=sys.stderr)
        else:
            from .reproducer import ExportError, export_kernel
            try:
                folder = export_kernel(chosen.job, args.export)
            except ExportError as exc:
                print(f"atb-probe replay: cannot export: {exc}", file=sys.stderr)
                return 2
            print(f"wrote {folder} (run: python {os.path.join(folder, 'repro.py')} "
                  "--device cpu)")
    return 1 if culprit is not None else 0


def _kernels_instead(op: str, module: KernelJob, kernels: list[KernelJob]) -> None:
    """A module op named without --weights: which of its kernels can be replayed instead."""
    from .kernelcall import CannotReplay, build_call
    try:
        cls = read_module_param(module.folder).cls
    except CannotReplay:
        cls = module.op_path.rsplit("/", 1)[-1]
    print(f"{op} is a module op ({cls}): replaying it as a whole needs its weights (--weights "
          "a save_pretrained folder or a .safetensors file)", end="")
    if not kernels:
        print("; no kernel below it was dumped (dump with save_child true)")
        return
    print(f"; replaying the {len(kernels)} kernel(s) below it instead")
    seen = set()
    for job in kernels:
        if job.op_path in seen:      # the same kernel in later rounds
            continue
        seen.add(job.op_path)
        try:
            param = read_param(job.folder)
            build_call(param)
            state = param.op
        except CannotReplay as exc:
            state = f"cannot be replayed: {exc.reason}"
        print(f"  {job.op_id} {job.op_path}: {state}")


def _replay_modules(jobs: list[KernelJob], args, settings: ReplaySettings, target: Dump) -> int:
    """`OP --weights PATH`: the module op replayed as a whole, in every round (or `--round`)."""
    if not os.path.exists(args.weights):
        print(f"atb-probe replay: --weights {args.weights} does not exist", file=sys.stderr)
        return 2
    configs = _recorded_configs(target)
    results = [replay_module(job, settings, args.weights, configs.get(job.process))
               for job in jobs]
    for r in results:
        print(r.summary())
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump([r.as_dict() for r in results], f, indent=1, allow_nan=True)
    print(f"replayed {len(results)} module op(s): " + ", ".join(
        f"{sum(r.verdict == v for r in results)} {v}" for v in Verdict)
        + f" (bound: {settings.bound.describe()})")
    return 1 if any(r.verdict == Verdict.INTRODUCED for r in results) else 0


def _recorded_configs(target: Dump) -> dict[str, dict]:
    """The model config each process's dump records (info/model `param`), by process name."""
    configs = {}
    for process, files in target.info_files("model").items():
        for path in files:
            try:
                with open(path, encoding="utf-8") as f:
                    param = json.load(f).get("param")
            except (OSError, ValueError):
                continue
            if param:
                configs[process] = param
                break
    return configs


def _print(results: list[KernelResult], verbose: bool, settings: ReplaySettings,
           culprit_line: bool) -> None:
    """A line per kernel with a finding (all with `verbose`), the kernels not replayed (three
    per reason unless `verbose`), and the counts; the culprit is left to its own line."""
    counts = defaultdict(int)
    skipped = defaultdict(list)
    for r in results:
        counts[r.verdict] += 1
        if r.verdict == Verdict.SKIPPED:
            skipped[r.reason].append(r)
        elif culprit_line and r.verdict == Verdict.INTRODUCED:
            continue
        elif verbose or r.verdict != Verdict.CLEAN:
            print(r.summary())
    for reason, group in skipped.items():
        for r in group[:3 if not verbose else len(group)]:
            print(r.summary())
        if len(group) > 3 and not verbose:
            print(f"not replayed: {len(group) - 3} more kernels ({reason}); -v lists them")
    print(f"replayed {len(results)} kernels: " + ", ".join(
        f"{counts[v]} {v}" for v in Verdict) + f" (bound: {settings.bound.describe()})")
