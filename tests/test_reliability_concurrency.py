"""Concurrent dumps (issue #6, SPEC §6): several processes dumping into one output directory at
once, and several threads calling the same model at once. No file is clobbered and no file or csv
line mixes two writers: every process and every round holds exactly what a dump made alone
holds."""
from __future__ import annotations

import csv
import hashlib
import os
import threading
from pathlib import Path

import torch

import atb_probe
from atb_probe.statcsv import COLUMNS

from conftest import config, tiny_llama
from test_reliability_disk import check_dump
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
    results = [p.communicate(timeout=180) for p in procs]
    for p, (stdout, stderr) in zip(procs, results):
        assert p.returncode == 0 and "MODEL-DONE" in stdout, stderr
        assert "[atb-probe] ERROR" not in stderr and "WARNING" not in stderr, stderr
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
