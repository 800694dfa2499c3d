"""Concurrent dumps (issue #6, SPEC §6): several processes dumping into one output directory at
once, and several threads calling the same model at once. No file is clobbered and no file or csv
line mixes two writers: every process and every round holds exactly what a dump made alone
holds."""
from __future__ import annotations

import csv
import hashlib
import json
import os
import sys
import threading
from pathlib import Path

import torch

import atb_probe
from atb_probe.statcsv import COLUMNS

from conftest import check_dump, tiny_llama
from harness import config, status_of
from test_reliability_signals import DUMP_ALL, start

# Columns that legitimately differ between processes or rounds.
VARYING = ("Device and PID", "Execution Count", "Tensor Path")


def contents(folder: Path) -> dict[str, str]:
    """Every file below `folder` (relative path -> digest), statistic.csv without the columns
    that name the process or round."""
    out = {}
    for d, _, files in os.walk(folder):
        for name in files:
            path = Path(d) / name
            rel = str(path.relative_to(folder))
            if name == "statistic.csv":
                with open(path, newline="") as f:
                    rows = list(csv.DictReader(f))
                keep = [c for c in COLUMNS if c not in VARYING]
                out[rel] = repr(sorted(tuple(r[c] for c in keep) for r in rows))
            else:
                out[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def test_four_processes_dumping_into_one_output_do_not_clash(tmp_path):
    out = tmp_path / "out"
    rounds = 2
    procs = []
    for i in range(4):
        home = tmp_path / f"p{i}"
        home.mkdir()
        procs.append(start(home, out, rounds, "exit", DUMP_ALL, OMP_NUM_THREADS="1"))
    for p in procs:
        assert p.wait(timeout=180) == 0 and "MODEL-DONE" in p.stdout, p.stderr
        assert "[atb-probe] ERROR" not in p.stderr and "WARNING" not in p.stderr, p.stderr
    root = out / "atb_dump_data"
    check_dump(root)
    folders = sorted((root / "data").iterdir())
    assert sorted(f.name for f in folders) == sorted(f"0_{p.pid}" for p in procs)
    reference = contents(folders[0])
    assert len([k for k in reference if k.endswith("statistic.csv")]) == rounds
    for folder in folders[1:]:
        assert contents(folder) == reference, folder.name
    for folder in ("info/layer", "info/model"):
        assert sorted(f.name for f in (root / folder).iterdir()) == sorted(
            f.name for f in folders)
    statuses = sorted((root / "status").iterdir())
    assert len(statuses) == 4


def test_threads_calling_one_model_at_once_get_whole_separate_rounds(tmp_path):
    model = tiny_llama()
    ids = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(1))
    threads_before = torch.get_num_threads()
    torch.set_num_threads(1)  # the same arithmetic in every thread, so the bytes compare
    try:
        cfg = config(save_child=True, filter_level=1, task="all")
        atb_probe.enable(str(tmp_path / "alone"), cfg)
        with torch.no_grad():
            expected = model(ids).logits
        assert atb_probe.disable(timeout=60)

        results, errors = [], []

        def call(n):
            try:
                with torch.no_grad():
                    for _ in range(n):
                        results.append(model(ids).logits)
            except BaseException as exc:  # surfaced below
                errors.append(exc)

        atb_probe.enable(str(tmp_path / "threads"), cfg)
        workers = [threading.Thread(target=call, args=(2,)) for _ in range(4)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(120)
        assert atb_probe.disable(timeout=60)
    finally:
        torch.set_num_threads(threads_before)
    assert errors == [] and len(results) == 8
    assert all(torch.equal(r, expected) for r in results)
    alone = next((tmp_path / "alone/atb_dump_data/data").iterdir())
    reference = contents(alone / "0")
    root = tmp_path / "threads/atb_dump_data"
    check_dump(root)
    proc = next((root / "data").iterdir())
    rounds = sorted(proc.iterdir(), key=lambda p: int(p.name))
    assert [r.name for r in rounds] == [str(i) for i in range(8)]
    for r in rounds:
        assert contents(r) == reference, r.name


def round_signature(round_dir: Path) -> str:
    """A round's statistic.csv without the columns that name the process or round."""
    return contents(round_dir)["statistic.csv"]


def test_eight_threads_dumping_statistics_with_save_child_match_a_dump_made_alone(
        tmp_path, monkeypatch, capfd):
    """A server's pattern: one model, eight request threads calling it at once, statistics of
    every op and kernel. The statistics cache and the structure bookkeeping are shared by the
    threads; a small cache keeps its sweeps running all the time."""
    from atb_probe.capture import stats_reuse
    monkeypatch.setattr(stats_reuse, "MIN_ENTRIES", 16)
    model = tiny_llama()
    inputs = [torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(i))
              for i in range(8)]
    per_thread = 4
    cfg = config(save_child=True, task="statistics")
    threads_before, switch_before = torch.get_num_threads(), sys.getswitchinterval()
    torch.set_num_threads(1)  # the same arithmetic in every thread, so the numbers compare
    sys.setswitchinterval(1e-5)  # threads take turns between far fewer bytecodes than usual
    try:
        atb_probe.enable(str(tmp_path / "alone"), cfg)
        with torch.no_grad():
            for ids in inputs:
                model(ids)
        assert atb_probe.disable(timeout=60)

        errors = []
        start_together = threading.Barrier(len(inputs))

        def serve(ids):
            try:
                start_together.wait(60)
                with torch.no_grad():
                    for _ in range(per_thread):
                        model(ids)
            except BaseException as exc:  # surfaced below
                errors.append(exc)

        atb_probe.enable(str(tmp_path / "threads"), cfg)
        workers = [threading.Thread(target=serve, args=(ids,)) for ids in inputs]
        for w in workers:
            w.start()
        for w in workers:
            w.join(300)
        assert atb_probe.disable(timeout=60)
    finally:
        torch.set_num_threads(threads_before)
        sys.setswitchinterval(switch_before)
    assert errors == []
    err = capfd.readouterr().err
    assert "[atb-probe] ERROR" not in err and "WARNING" not in err, err

    alone = next((tmp_path / "alone/atb_dump_data/data").iterdir())
    expected = sorted(round_signature(alone / str(i)) for i in range(len(inputs)))
    assert len(set(expected)) == len(inputs)  # each input leaves rounds of its own
    root = tmp_path / "threads/atb_dump_data"
    rows = check_dump(root)  # every line complete, every row's columns well-formed
    assert rows and all(r["Max"] != "N/A" and r["Norm"] != "N/A" for r in rows
                        if "0" not in r["Shape"].split("x"))  # empty tensors have none
    proc = next((root / "data").iterdir())
    got = sorted(round_signature(r) for r in proc.iterdir())
    assert got == sorted(expected * per_thread)
    # The layer files, written once by whichever thread got there first, are the same; so is
    # the model file, but for the rounds it describes: all of them, from every thread.
    assert contents(root / "info" / "layer") == \
        contents(tmp_path / "alone/atb_dump_data/info/layer")
    alone_model, threads_model = (next((r / "info" / "model").rglob("*.json"))
                                  for r in (tmp_path / "alone/atb_dump_data", root))
    expected_doc = dict(json.loads(alone_model.read_text()), rounds=[[0, len(got) - 1]])
    assert json.loads(threads_model.read_text()) == expected_doc
    status = status_of(root)
    assert status["last_error"] is None and status["rounds_dumped"] == len(inputs) * per_thread

