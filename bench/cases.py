"""The benchmark cases: what is switched on around a probed run, and the goal it is held to.

A case's runner does one probed run and says where it wrote. Runners import their tool only
when built, so a case for one tool never needs the other tool installed: atb-probe cases run
with atb-probe's environment, msprobe cases with mindstudio-probe's.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field

# A complete config.json (no missing-key warnings); cases override some keys.
ATB_BASE = {"task": "tensor", "dump_enable": True, "exec_range": "all", "ids": "",
            "op_name": "", "save_child": False, "device": "", "filter_level": 1}

RSS_GOAL_MIB = 256


@dataclass(frozen=True)
class Goal:
    """`kind`: "ratio" (probed/un-probed), "plain" (probed / (un-probed + plain write)) or
    "bytes" (bytes written / bytes of case `other`); met when the value is <= `limit`, or the
    limit `on` gives for the workload measured ((workload, limit) pairs)."""

    kind: str
    limit: float
    other: str = ""
    on: tuple = ()

    def for_workload(self, workload: str) -> Goal:
        """This goal with the limit that holds on `workload`."""
        limit = dict(self.on).get(workload, self.limit)
        return Goal(self.kind, limit, self.other)

    def text(self) -> str:
        if self.kind == "ratio":
            return f"<= {self.limit:g}"
        if self.kind == "plain":
            return f"<= {self.limit:g} x (un-probed + plain write)"
        return f"bytes <= {self.limit:.0%} of {self.other}"


@dataclass(frozen=True)
class Case:
    name: str
    tool: str                  # "none" | "atb-probe" | "msprobe"
    what: str
    config: dict = field(default_factory=dict)
    goal: Goal | None = None
    tensors: bool = False      # writes tensor data: held to the peak-RSS goal
    plain_baseline: bool = False
    heavy: bool = False        # many GB on the large workload: opt-in there
    compare_to: str = ""       # msprobe case: the atb-probe case doing the nearest work

    def runner(self):
        if self.tool == "atb-probe":
            return AtbProbeRunner(self.config)
        if self.tool == "msprobe":
            return MsprobeRunner(self.config)
        return NoProbeRunner()


def _atb(**overrides) -> dict:
    return {**ATB_BASE, **overrides}


def _ms(task: str, level: str) -> dict:
    return {"task": task, "level": level}


CASES = [
    Case("unprobed", "none", "un-probed vs un-probed (noise floor, RSS baseline)"),
    Case("sleeping", "atb-probe", "loaded, dump_enable false",
         _atb(dump_enable=False), Goal("ratio", 1.01)),
    Case("awake-none", "atb-probe", 'dump_enable true, exec_range "none"',
         _atb(exec_range="none"), Goal("ratio", 1.03)),
    Case("track-only", "atb-probe",
         "op_name matching nothing: every module and kernel tracked, nothing written",
         _atb(task="statistics", op_name="no_such_op")),
    Case("walk-only", "atb-probe",
         "ids matching nothing: dumped rounds walk the call tree to the layer-level ops, "
         "nothing recorded or written",
         _atb(task="statistics", ids="999999")),
    Case("stat-layer", "atb-probe", "statistics, layer-level ops",
         _atb(task="statistics"), Goal("ratio", 1.3, on=(("large", 1.15),))),
    Case("stat-child", "atb-probe", "statistics, save_child (every module and kernel)",
         _atb(task="statistics", save_child=True), Goal("ratio", 4.0, on=(("large", 2.5),))),
    Case("tensor-layer", "atb-probe", "tensor, layer-level ops",
         _atb(task="tensor"), Goal("plain", 1.2), tensors=True, plain_baseline=True),
    Case("tensor-child-fl0", "atb-probe", "tensor, save_child, filter_level 0",
         _atb(task="tensor", save_child=True, filter_level=0), tensors=True,
         plain_baseline=True, heavy=True),
    Case("tensor-child-fl1", "atb-probe", "tensor, save_child, filter_level 1",
         _atb(task="tensor", save_child=True, filter_level=1),
         Goal("bytes", 0.6, "tensor-child-fl0"), tensors=True, plain_baseline=True,
         heavy=True),
    Case("ms-stat-L0", "msprobe", "msprobe statistics, L0 (every module)",
         _ms("statistics", "L0"), compare_to="stat-layer"),
    Case("ms-stat-L1", "msprobe", "msprobe statistics, L1 (every torch API)",
         _ms("statistics", "L1")),
    Case("ms-stat-mix", "msprobe", "msprobe statistics, mix (modules and APIs)",
         _ms("statistics", "mix"), compare_to="stat-child"),
    Case("ms-tensor-L0", "msprobe", "msprobe tensor, L0 (every module)",
         _ms("tensor", "L0"), tensors=True, compare_to="tensor-layer"),
    Case("ms-tensor-mix", "msprobe", "msprobe tensor, mix (modules and APIs)",
         _ms("tensor", "mix"), tensors=True, heavy=True, compare_to="tensor-child-fl0"),
]

BY_NAME = {c.name: c for c in CASES}


# -- runners ------------------------------------------------------------------------------------
#
# A probed run is `start()` (not timed: attaching the tool), `run()` (timed: the generation and
# everything needed to have its data on disk) and `finish()` (not timed: detaching). The untimed
# parts are measured too and reported apart. After `run()`, a runner's `after_s` is how much of
# it came after the generation: waiting for the data to reach the disk.

class NoProbeRunner:
    """The un-probed model on both sides of a pair."""

    after_s = 0.0

    def setup(self, workload, work_dir: str) -> None:
        pass

    def start(self, workload, run_dir: str) -> None:
        pass

    def run(self, workload, run_dir: str) -> str:
        workload.run()
        return run_dir

    def finish(self) -> None:
        pass


class AtbProbeRunner:
    """`atb_probe.enable`; the generation and a flush of the writer queue (timed: the run ends
    when every file is on disk); `atb_probe.disable()`."""

    def __init__(self, config: dict):
        self.config = config
        self.after_s = 0.0

    def setup(self, workload, work_dir: str) -> None:
        import atb_probe  # noqa: F401  (imported before the first timed run)

    def start(self, workload, run_dir: str) -> None:
        import atb_probe
        atb_probe.enable(run_dir, dict(self.config))

    def run(self, workload, run_dir: str) -> str:
        import atb_probe
        workload.run()
        generated = time.perf_counter()
        writer = getattr(atb_probe.active(), "writer", None)
        if writer is None or not hasattr(writer, "flush"):
            self.finish()  # no writer to wait for: disabling flushes
        elif not writer.flush(3600):
            raise RuntimeError("atb-probe did not finish writing within an hour")
        self.after_s = time.perf_counter() - generated
        return run_dir

    def finish(self) -> None:
        import atb_probe
        if not atb_probe.disable(timeout=3600):
            raise RuntimeError("atb-probe did not finish writing within an hour")


class MsprobeRunner:
    """mindstudio-probe's PyTorch dump: `PrecisionDebugger(config)` once, then per run
    `start(model)`; the generation, `stop()` and `step()` (timed: `step` writes dump.json,
    tensors are written synchronously by the hooks)."""

    def __init__(self, config: dict):
        self.config = config
        self.debugger = None
        self.dump_path = ""
        self.after_s = 0.0

    def setup(self, workload, work_dir: str) -> None:
        from msprobe.pytorch import PrecisionDebugger
        self.dump_path = os.path.join(work_dir, "msprobe_dump")
        task = self.config["task"]
        doc = {"task": task, "dump_path": self.dump_path, "rank": [], "step": [],
               "level": self.config["level"], "async_dump": False,
               "statistics": {"scope": [], "list": [], "data_mode": ["all"],
                              "summary_mode": "statistics"},
               "tensor": {"scope": [], "list": [], "data_mode": ["all"]}}
        path = os.path.join(work_dir, "msprobe_config.json")
        with open(path, "w") as f:
            json.dump(doc, f, indent=2)
        self.debugger = PrecisionDebugger(config_path=path)

    def start(self, workload, run_dir: str) -> None:
        self.debugger.start(workload.model)

    def run(self, workload, run_dir: str) -> str:
        try:
            workload.run()
        finally:
            generated = time.perf_counter()
            self.debugger.stop()
            self.debugger.step()
            self.after_s = time.perf_counter() - generated
        return self.dump_path

    def finish(self) -> None:
        pass
