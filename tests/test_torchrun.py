"""Many processes and devices: torchrun ranks, device IDs, the `device` filter (SPEC §1, §3, §5).

The ranks are real: `torchrun --nproc-per-node 2` started from a shell that sourced the load
script, running the 2-way tensor-parallel example (gloo, CPU) with a real all_reduce.
"""
from __future__ import annotations

import io
import json
import os
import re
import sys
import threading
from pathlib import Path

import pandas as pd
import pytest
import torch

from atb_probe.capture.device import device_id
from atb_probe.probe import Probe
from atb_probe.binread import load_tensor
from conftest import read_csv
from harness import config, run, run_loaded, status_of, torchrun_loaded, wait_until

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tensor_parallel"
STEPS = 2
CSV_KEY = ["Execution Count", "Op Id", "Op Name", "Input/Output", "Index"]


def torchrun(tmp: Path, cfg: dict) -> dict[int, int]:
    """Run the example on 2 CPU ranks with the probe loaded; {rank: pid} of the workers."""
    stdout = torchrun_loaded(tmp, cfg, EXAMPLE / "tp_block.py", "--steps", str(STEPS))
    pids = {int(rank): int(pid) for rank, local, pid in
            re.findall(r"rank (\d)/2 local_rank (\d) pid (\d+)", stdout) if rank == local}
    assert sorted(pids) == [0, 1], stdout
    return pids


def names(folder: Path) -> set[str]:
    return {p.name for p in folder.iterdir()} if folder.is_dir() else set()


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    """Both ranks dumped (`device: ""`): the block-level ops, the row-parallel linears and the
    all_reduce kernels, tensors and statistics. (output root, {rank: pid})"""
    tmp = tmp_path_factory.mktemp("tp_all")
    pids = torchrun(tmp, config(task="all", exec_range="all", device="",
                                op_name="ParallelBlock,RowParallelLinear,AllreduceKernel"))
    return tmp / "atb_dump_data", pids


@pytest.fixture(scope="module")
def only_rank1(tmp_path_factory):
    """Only the process on device 1 (`device: "1"`): the row-parallel linears and everything
    below them, at the default filter_level 1. (output root, {rank: pid})"""
    tmp = tmp_path_factory.mktemp("tp_dev1")
    pids = torchrun(tmp, config(task="all", exec_range="all", device="1",
                                op_name="RowParallelLinear", save_child=True, filter_level=1))
    return tmp / "atb_dump_data", pids


def row_parallel_dirs(root: Path, devpid: str) -> dict[str, Path]:
    """Every RowParallelLinear op folder of one process, keyed by `<round>/<op path>`."""
    base = root / "data" / devpid
    return {str(p.relative_to(base)): p
            for p in base.glob("*/*_ParallelBlock/*/*_RowParallelLinear")}


# -- one folder per process, named by device and pid ----------------------------------------

def test_each_rank_dumps_into_its_own_device_pid_folder(both):
    root, pids = both
    expected = {f"{rank}_{pid}" for rank, pid in pids.items()}
    assert names(root / "data") == expected
    for devpid in expected:
        assert names(root / "data" / devpid) == {str(r) for r in range(STEPS)}


def test_structure_files_use_the_same_device_pid_folders(both):
    root, pids = both
    expected = {f"{rank}_{pid}" for rank, pid in pids.items()}
    assert names(root / "info" / "layer") == expected
    assert names(root / "info" / "model") == expected
    for devpid in expected:
        assert names(root / "info" / "model" / devpid) == {"TinyParallelModel_Forward.json"}
        assert "ParallelBlock_1.json" in names(root / "info" / "layer" / devpid)


def test_each_rank_keeps_one_status_file_under_its_device_pid(both):
    root, pids = both
    docs = {p.stem: json.loads(p.read_text()) for p in (root / "status").glob("*.json")}
    for rank, pid in pids.items():
        doc = docs[f"{rank}_{pid}"]
        assert (doc["pid"], doc["device"], doc["rounds_dumped"]) == (pid, rank, STEPS)
        assert doc["exited"] and doc["bytes_queued"] == 0 and doc["last_error"] is None
        # no second file for the same process (e.g. under a provisional name)
        assert [name for name, d in docs.items() if d["pid"] == pid] == [f"{rank}_{pid}"]


def test_statistic_rows_name_the_process_folder_they_are_in(both):
    root, pids = both
    for rank, pid in pids.items():
        for round_dir in (root / "data" / f"{rank}_{pid}").iterdir():
            rows = read_csv(round_dir / "statistic.csv")
            assert rows
            assert {r["Device and PID"] for r in rows} == {f"{rank}_{pid}"}
            assert {r["Execution Count"] for r in rows} == {round_dir.name}
            assert all(r["Tensor Path"].startswith(str(round_dir) + os.sep) for r in rows)


# -- the ranks agree after the all_reduce ---------------------------------------------------

def test_all_reduce_outputs_are_identical_on_both_ranks(both):
    root, pids = both
    rank0, rank1 = (row_parallel_dirs(root, f"{r}_{pids[r]}") for r in (0, 1))
    # 2 rounds x 2 blocks x (attention output, MLP down projection)
    assert len(rank0) == STEPS * 2 * 2 and rank0.keys() == rank1.keys()
    for op in rank0:
        out0 = load_tensor(rank0[op] / "after" / "outtensor0.bin")
        out1 = load_tensor(rank1[op] / "after" / "outtensor0.bin")
        assert torch.equal(out0, out1), op
        # The inputs are each rank's own shard: the equality above comes from the all_reduce.
        in0 = load_tensor(rank0[op] / "before" / "intensor0_x.bin")
        in1 = load_tensor(rank1[op] / "before" / "intensor0_x.bin")
        assert in0.shape == in1.shape and not torch.equal(in0, in1), op


def test_all_reduce_kernel_output_is_the_reduced_sum(both):
    """The collective's Work completes after the kernel returns: its output is recorded then."""
    root, pids = both
    rank0, rank1 = (row_parallel_dirs(root, f"{r}_{pids[r]}") for r in (0, 1))
    for op in rank0:
        kernel0 = next(rank0[op].glob("*_AllreduceKernel"))
        kernel1 = rank1[op] / kernel0.name
        out = [load_tensor(k / "after" / "outtensor0.bin") for k in (kernel0, kernel1)]
        partial = [load_tensor(k / "before" / "intensor0.bin") for k in (kernel0, kernel1)]
        assert torch.equal(out[0], out[1]), op
        assert torch.allclose(out[0], partial[0] + partial[1]), op


def merged_statistics(root: Path, pids: dict[int, int]) -> pd.DataFrame:
    """Both ranks' statistic.csv rows side by side, one line per tensor."""
    frames = []
    for rank, pid in pids.items():
        paths = sorted((root / "data" / f"{rank}_{pid}").glob("*/statistic.csv"))
        frame = pd.concat([pd.read_csv(p, dtype=str, keep_default_na=False) for p in paths])
        frames.append(frame.set_index(CSV_KEY).add_suffix(f"@{rank}"))
    return frames[0].join(frames[1], how="outer")


def test_merged_statistics_agree_after_the_all_reduce_and_differ_before_it(both):
    root, pids = both
    merged = merged_statistics(root, pids)
    assert not merged.isna().any(axis=None), "both ranks dump the same tensors"
    assert (merged["Device and PID@0"] == f"0_{pids[0]}").all()
    assert (merged["Device and PID@1"] == f"1_{pids[1]}").all()
    assert (merged["Shape@0"] == merged["Shape@1"]).all()
    stats = ["Max", "Min", "Mean", "Norm"]
    same = (merged[[f"{s}@0" for s in stats]].to_numpy() ==
            merged[[f"{s}@1" for s in stats]].to_numpy()).all(axis=1)
    op_type = merged.index.get_level_values("Op Name").str.rsplit("/", n=1).str[-1]
    side = merged.index.get_level_values("Input/Output")
    after_reduce = (op_type == "RowParallelLinear") & (side == "output")
    sharded = (op_type == "RowParallelLinear") & (side == "input")
    replicated = op_type == "ParallelBlock"
    assert after_reduce.sum() == sharded.sum() == STEPS * 2 * 2
    assert same[after_reduce].all() and same[replicated].all()
    assert not same[sharded].any()


def test_compare_ranks_example_calls_all_reduce_outputs_the_same(both):
    root, _ = both
    result = run([sys.executable, EXAMPLE / "compare_ranks.py", root.parent, "--op",
                  "RowParallelLinear"], timeout=120)
    assert result.returncode == 0, result.stderr
    verdicts = {}
    for line in result.stdout.splitlines()[1:]:
        if line.split()[2].endswith("/RowParallelLinear"):
            verdicts.setdefault(line.split()[3], set()).add(line.split()[7])
    assert verdicts == {"input": {"differs"}, "output": {"same"}}


def test_show_csv_merges_both_ranks_into_one_comparable_table(both):
    root, pids = both
    result = run([Path(sys.executable).with_name("atb-probe"), "show", "--csv", root],
                 timeout=120)
    assert result.returncode == 0, result.stderr
    table = pd.read_csv(io.StringIO(result.stdout), dtype=str, keep_default_na=False)
    per_rank = merged_statistics(root, pids)
    assert len(table) == 2 * len(per_rank)
    assert set(table["Device and PID"]) == {f"{r}_{p}" for r, p in pids.items()}
    outputs = table[table["Op Type"].eq("RowParallelLinear") & table["Input/Output"].eq("output")]
    norms = outputs.groupby(CSV_KEY)["Norm"].agg(["count", "nunique"])
    assert len(norms) == STEPS * 2 * 2
    assert (norms["count"] == 2).all() and (norms["nunique"] == 1).all()


# -- the device filter ----------------------------------------------------------------------

def test_device_filter_dumps_only_the_process_on_that_device(only_rank1):
    root, pids = only_rank1
    assert names(root / "data") == {f"1_{pids[1]}"}
    assert names(root / "info" / "layer") == {f"1_{pids[1]}"}
    assert names(root / "info" / "model") == {f"1_{pids[1]}"}
    rows = read_csv(root / "data" / f"1_{pids[1]}" / "0" / "statistic.csv")
    assert {r["Op Name"].split("/")[2] for r in rows} == {"RowParallelLinear"}
    assert {r["Op Type"] for r in rows} >= {"RowParallelLinear", "AllreduceKernel"}


def test_a_filtered_out_process_still_reports_its_status(only_rank1):
    root, pids = only_rank1
    docs = {rank: status_of(root, pid) for rank, pid in pids.items()}
    assert docs[0]["rounds_dumped"] == 0 and docs[0]["files_written"] == 0
    assert docs[1]["rounds_dumped"] == STEPS and docs[1]["files_written"] > 0


def test_all_reduce_kernel_output_holds_the_sum_at_filter_level_1(only_rank1):
    root, pids = only_rank1
    ops = row_parallel_dirs(root, f"1_{pids[1]}")
    assert len(ops) == STEPS * 2 * 2
    for op, folder in ops.items():
        reduced = load_tensor(next(folder.glob("*_AllreduceKernel")) / "after" / "outtensor0.bin")
        add = next(folder.glob("*_AddTensorKernel"))
        bias = load_tensor(add / "before" / "intensor1.bin")
        assert torch.allclose(reduced + bias, load_tensor(folder / "after" / "outtensor0.bin")), op


# -- the device ID of one process -----------------------------------------------------------

def test_a_device_decided_after_start_leaves_no_second_name(tmp_path):
    """A program that sets LOCAL_RANK itself after importing torch (as mpirun users do): the
    status file first written under `0_<pid>` moves to `3_<pid>`, and nothing stays behind."""
    script = """
        import os, time, torch
        status = os.path.join(os.environ["ATB_OUTPUT_DIR"], "atb_dump_data", "status")
        print("PROVISIONAL", os.path.exists(os.path.join(status, f"0_{os.getpid()}.json")))
        os.environ["LOCAL_RANK"] = "3"
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
        with torch.no_grad():
            model(torch.ones(1, 4))
        moved, deadline = os.path.join(status, f"3_{os.getpid()}.json"), time.time() + 30
        while not (os.path.exists(moved) and '"rounds_dumped": 1' in open(moved).read()):
            assert time.time() < deadline, "the status never showed the round"
            time.sleep(0.01)  # the watch thread rewrites the status meanwhile
        print("PID", os.getpid())
    """
    result = run_loaded(tmp_path, script, config(exec_range="all"))
    assert result.returncode == 0, result.stderr
    assert "PROVISIONAL True" in result.stdout
    pid = re.search(r"PID (\d+)", result.stdout).group(1)
    devpid = f"3_{pid}"
    root = tmp_path / "atb_dump_data"
    assert names(root / "status") == {f"{devpid}.json"}
    assert status_of(root, int(pid))["device"] == 3
    for folder in ("data", "info/layer", "info/model"):
        assert names(root / folder) == {devpid}, folder


def test_status_writes_racing_the_device_decision_leave_one_file(tmp_path, monkeypatch):
    """The watch thread may be writing the status under the provisional name at the moment the
    first round decides the device; the old name must not come back after the rename."""
    leftovers = []
    for attempt in range(100):  # the window is narrow: about one attempt in five hits it
        monkeypatch.setenv("LOCAL_RANK", "0")
        (tmp_path / str(attempt)).mkdir()
        probe = Probe(str(tmp_path / str(attempt)), config={"dump_enable": False})
        stop = threading.Event()
        writes = [0]

        def keep_writing():  # as the watch thread does while rounds end
            while not stop.is_set():
                probe.rounds_dumped += 1
                probe.write_status()
                writes[0] += 1

        writer = threading.Thread(target=keep_writing)
        writer.start()
        wait_until(lambda: writes[0] >= 1, 10, "the first status write")
        monkeypatch.setenv("LOCAL_RANK", "2")
        assert probe.decide_device(torch.nn.Linear(1, 1), (), {}) == 2
        decided = writes[0]
        wait_until(lambda: writes[0] >= decided + 2, 10, "status writes after the decision")
        stop.set()
        writer.join()
        probe.close(timeout=5)
        status = names(tmp_path / str(attempt) / "atb_dump_data" / "status")
        if status != {f"2_{os.getpid()}.json"}:
            leftovers.append(status)
    assert leftovers == []


def test_cpu_process_takes_local_rank_whatever_its_inputs_hold(monkeypatch):
    model = torch.nn.Linear(2, 2)
    inputs = ({"x": [torch.zeros(2)]},)
    monkeypatch.setenv("LOCAL_RANK", "5")
    assert device_id(model, inputs, {}) == 5
    monkeypatch.setenv("LOCAL_RANK", "not-a-number")
    assert device_id(model, inputs, {}) == 0
    monkeypatch.delenv("LOCAL_RANK")
    assert device_id(model, inputs, {}) == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_process_takes_the_index_of_its_tensors_over_local_rank(monkeypatch):
    index = torch.cuda.device_count() - 1
    monkeypatch.setenv("LOCAL_RANK", str(index + 1))
    model = torch.nn.Linear(2, 2).to(f"cuda:{index}")
    # A CPU tensor among the inputs does not hide the model's device.
    assert device_id(model, (torch.zeros(2),), {}) == index
    batch = {"x": torch.zeros(2, device=model.weight.device)}
    assert device_id(torch.nn.Linear(2, 2), (), {"batch": batch}) == index
