"""bench/layer_floor.py's floor writes what a `stat-layer` dump writes, less the statistics.

Its `copies+rows` variant is the floor of a safe design only if its rounds hold the same
files and rows as the probe's: each round's statistic.csv with the same rows, column for
column, except the four statistics, and its tokens.json. A real generation of the bench's
`small` model (shortened) is dumped both ways."""
from __future__ import annotations

import csv
import os
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
STATS = ("Max", "Min", "Mean", "Norm")
CONSTANT = ("1.0", "-1.0", "0.0", "1.0")  # the floor's one statistics cell, as written


@pytest.fixture(scope="module")
def floor():
    pytest.importorskip("transformers")
    sys.path.insert(0, BENCH)
    try:
        import layer_floor
        from workload import Workload, spec
        yield layer_floor, Workload(spec("small", quick=True))
    finally:
        sys.path.remove(BENCH)


def _rounds(out: str) -> dict:
    """round folder (relative) -> (its statistic.csv rows, whether it has tokens.json)."""
    found = {}
    for folder, _, files in os.walk(out):
        if "statistic.csv" in files:
            with open(os.path.join(folder, "statistic.csv"), newline="") as f:
                rows = list(csv.DictReader(f))
            found[os.path.relpath(folder, out)] = (rows, "tokens.json" in files)
    return found


def test_the_floor_writes_the_probes_rows_with_a_constant_in_place_of_the_statistics(
        floor, tmp_path):
    layer_floor, workload = floor
    real = str(tmp_path / "real")
    least = str(tmp_path / "floor")
    layer_floor.Variant(workload, "stat-layer").run(real, keep=True)
    layer_floor.Variant(workload, "copies+rows").run(least, keep=True)

    real_rounds, floor_rounds = _rounds(real), _rounds(least)
    assert len(real_rounds) == workload.spec.new_tokens  # a round per forward of `generate`
    assert set(floor_rounds) == set(real_rounds)
    for folder, (rows, tokens) in real_rounds.items():
        floor_rows, floor_tokens = floor_rounds[folder]
        assert tokens and floor_tokens, folder
        assert len(floor_rows) == len(rows) > 0, folder

        def without_stats(row):
            return {k: v for k, v in row.items() if k not in STATS}

        assert [without_stats(r) for r in floor_rows] == [without_stats(r) for r in rows]
        assert {tuple(r[k] for k in STATS) for r in floor_rows} == {CONSTANT}
        assert any(tuple(r[k] for k in STATS) != CONSTANT for r in rows)


def test_each_floor_variant_runs_and_puts_the_probes_own_recording_back(floor, tmp_path):
    layer_floor, workload = floor
    from atb_probe.capture.recorder import Recorder
    original = Recorder.write_side
    for variant in layer_floor.VARIANTS:
        seconds = layer_floor.Variant(workload, variant).run(str(tmp_path / variant))
        assert seconds > 0
        assert Recorder.write_side is original
        assert not os.path.exists(tmp_path / variant)  # deleted unless kept


# A user script of two processes, each running a model with the probe loaded: the parent and a
# child started by `multiprocessing`'s spawn, as a serving engine starts its worker.
TWO_PROCESSES = """
import multiprocessing
import torch
import atb_probe


def run_model():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    with torch.no_grad():
        model(torch.randn(3, 8))
    assert atb_probe.active().writer.flush(60)


if __name__ == "__main__":
    run_model()
    child = multiprocessing.get_context("spawn").Process(target=run_model)
    child.start()
    child.join(120)
    assert child.exitcode == 0
"""


@pytest.mark.parametrize("variant", [None, "copies+rows"])
def test_the_floor_site_records_as_the_variant_in_every_process_of_a_loaded_program(
        tmp_path, variant):
    # vllm_offline.py --floor: bench/floor_site after the probe's bootstrap on PYTHONPATH.
    from harness import config, run_loaded
    env = {"PYTHONPATH": os.path.join(BENCH, "floor_site")}
    if variant:
        env["BENCH_LAYER_FLOOR"] = variant
    result = run_loaded(tmp_path, TWO_PROCESSES, config(task="statistics"),
                        env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    marks = [line for line in result.stderr.splitlines() if "[bench] layer floor" in line]
    csvs = list((tmp_path / "atb_dump_data" / "data").glob("*/*/statistic.csv"))
    assert len({p.parent.parent.name for p in csvs}) == 2  # a folder per process
    stats = set()
    for path in csvs:
        with open(path, newline="") as f:
            stats |= {tuple(r[k] for k in STATS) for r in csv.DictReader(f)}
    if variant:
        assert len(marks) == 2 and all(variant in m for m in marks), result.stderr
        assert stats == {CONSTANT}
    else:
        assert not marks
        assert CONSTANT not in stats and len(stats) > 1
