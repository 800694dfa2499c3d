"""Our tools on an ATB-layout tree this project did not write.

The fixture is built by hand from the format (SPEC §5, msprobe's reader): ATB-style op and kernel
names, parameter-named kernel files, a reference file, float16/int64/bf16 data, and a
statistic.csv whose Tensor Paths point at the machine the dump was made on, not at this one.
"""
from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest
import torch

from atb_probe import cli
from atb_probe.tools.compare import compare_dumps
from atb_probe.tools.dumpreader import open_dump
from atb_probe.tools.parse import parse_path

HEADER = ("Device and PID,Execution Count,Op Name,Op Type,Op Id,Input/Output,Index,Dtype,Format,"
          "Shape,Max,Min,Mean,Norm,Tensor Path")


def bin_bytes(array: np.ndarray, code: int) -> bytes:
    payload = array.tobytes()
    header = (f"$Version=1.0\n$Object.Count=1\n$Object.Length={len(payload)}\nformat=2\n"
              f"dtype={code}\ndims={','.join(map(str, array.shape))}\n"
              f"$Object.data=0,{len(payload)}\n$End=1\n")
    return header.encode() + payload


def ref_bytes(code: int, dims, target: str) -> bytes:
    return (f"$Version=1.0\n$Object.Count=0\n$Object.Length=0\nformat=2\ndtype={code}\n"
            f"dims={','.join(map(str, dims))}\ndata={target}\n$End=1\n").encode()


def build_tree(root: Path, pid: int, broken: bool, extra_kernel: bool = False) -> Path:
    """An ATB dump of embedding -> linear -> cast; `broken` makes the matmul kernel wrong."""
    rng = np.random.default_rng(0)
    table = rng.standard_normal((8, 4)).astype(np.float16)
    ids = np.array([3, 1, 6], dtype=np.int64)
    emb = table[ids]
    weight = rng.standard_normal((2, 4)).astype(np.float16)
    out = (emb.astype(np.float32) @ weight.astype(np.float32).T)
    if broken:
        out = out * 1.05 + 0.01
    out = out.astype(np.float16)
    cast = torch.from_numpy(out.astype(np.float32)).to(torch.bfloat16).view(torch.int16).numpy()

    rnd = root / "atb_dump_data" / "data" / f"0_{pid}" / "0"
    matmul = "1_MatMulV2Kernel" if extra_kernel else "0_MatMulV2Kernel"
    files = [  # (op id, op name, io, index, relative path, bytes, csv dtype, dims)
        ("0", "GatherOperation", "input", "0", "0_GatherOperation/before/intensor0.bin",
         bin_bytes(table, 1), "float16", table.shape),
        ("0", "GatherOperation", "input", "1", "0_GatherOperation/before/intensor1.bin",
         bin_bytes(ids, 9), "int64", ids.shape),
        ("0_0", "GatherOperation/Gather16I64Kernel", "input", "0_x",
         "0_GatherOperation/0_Gather16I64Kernel/before/intensor0_x.bin",
         bin_bytes(table, 1), "float16", table.shape),
        ("0_0", "GatherOperation/Gather16I64Kernel", "input", "1_indices",
         "0_GatherOperation/0_Gather16I64Kernel/before/intensor1_indices.bin",
         bin_bytes(ids, 9), "int64", ids.shape),
        ("0_0", "GatherOperation/Gather16I64Kernel", "output", "0",
         "0_GatherOperation/0_Gather16I64Kernel/after/outtensor0.bin",
         ref_bytes(1, emb.shape, "0_GatherOperation/after/outtensor0.bin"), "float16", emb.shape),
        ("0", "GatherOperation", "output", "0", "0_GatherOperation/after/outtensor0.bin",
         bin_bytes(emb, 1), "float16", emb.shape),
        ("1", "LinearOperation", "input", "0", "1_LinearOperation/before/intensor0.bin",
         ref_bytes(1, emb.shape, "0_GatherOperation/after/outtensor0.bin"), "float16", emb.shape),
        ("1", "LinearOperation", "input", "1", "1_LinearOperation/before/intensor1.bin",
         bin_bytes(weight, 1), "float16", weight.shape),
    ]
    if extra_kernel:
        files.append(("1_0", "LinearOperation/TransdataKernel", "input", "0",
                      "1_LinearOperation/0_TransdataKernel/before/intensor0.bin",
                      bin_bytes(weight, 1), "float16", weight.shape))
        files.append(("1_0", "LinearOperation/TransdataKernel", "output", "0",
                      "1_LinearOperation/0_TransdataKernel/after/outtensor0.bin",
                      bin_bytes(weight, 1), "float16", weight.shape))
    mm_id = "1_1" if extra_kernel else "1_0"
    files += [
        (mm_id, "LinearOperation/MatMulV2Kernel", "input", "0_x1",
         f"1_LinearOperation/{matmul}/before/intensor0_x1.bin", bin_bytes(emb, 1), "float16",
         emb.shape),
        (mm_id, "LinearOperation/MatMulV2Kernel", "input", "1_x2",
         f"1_LinearOperation/{matmul}/before/intensor1_x2.bin", bin_bytes(weight, 1), "float16",
         weight.shape),
        (mm_id, "LinearOperation/MatMulV2Kernel", "output", "0_y",
         f"1_LinearOperation/{matmul}/after/outtensor0_y.bin", bin_bytes(out, 1), "float16",
         out.shape),
        ("1", "LinearOperation", "output", "0", "1_LinearOperation/after/outtensor0.bin",
         bin_bytes(out, 1), "float16", out.shape),
        ("2", "CastOperation", "input", "0", "2_CastOperation/before/intensor0.bin",
         bin_bytes(out, 1), "float16", out.shape),
        ("2", "CastOperation", "output", "0", "2_CastOperation/after/outtensor0.bin",
         bin_bytes(cast, 27), "bf16", out.shape),
    ]
    lines = [HEADER]
    for op_id, name, io, index, rel, data, dtype, dims in files:
        path = rnd / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        where = f"/home/someone/run/atb_dump_data/data/0_{pid}/0/{rel}"   # another machine
        lines.append(f"0_{pid},0,{name},{name.split('/')[-1]},{op_id},{io},{index},{dtype},nd,"
                     f"{'x'.join(map(str, dims))},N/A,N/A,N/A,N/A,{where}")
    (rnd / "statistic.csv").write_text("\n".join(lines) + "\n")
    return root


@pytest.fixture
def trees(tmp_path):
    return (build_tree(tmp_path / "golden", 4242, broken=False),
            build_tree(tmp_path / "target", 777, broken=True))


def test_a_foreign_tree_is_compared_and_the_wrong_kernel_named(trees):
    golden, target = trees
    result = compare_dumps(str(golden), str(target), full=True)
    assert result.unmatched == []
    assert len(result.rows) == 14 and {r.mode for r in result.rows} == {"tensor"}
    f = result.finding
    assert f is not None and f.inputs_clean
    assert f.op_path == "1_LinearOperation/0_MatMulV2Kernel"
    assert compare_dumps(str(golden), str(target)).finding.summary() == f.summary()
    assert f.row.name == "1_LinearOperation/0_MatMulV2Kernel/output.0_y"
    by_name = {r.name: r for r in result.rows}
    # Reference files are compared through the bytes they point at.
    assert by_name["1_LinearOperation/input.0"].metrics.max_abs_err == 0.0
    assert by_name["0_GatherOperation/0_Gather16I64Kernel/output.0"].metrics.cosine == 1.0
    assert by_name["2_CastOperation/output.0"].diverged is True


def test_a_foreign_tree_without_statistic_csv_is_read_from_its_folders(trees):
    golden, target = trees
    for root in trees:
        next(root.rglob("statistic.csv")).unlink()
    result = compare_dumps(str(golden), str(target))
    assert len(result.rows) == 14 and result.unmatched == []
    assert result.finding.op_path == "1_LinearOperation/0_MatMulV2Kernel"


def test_different_kernel_ids_are_paired_by_name_and_the_extra_one_reported(tmp_path):
    golden = build_tree(tmp_path / "golden", 4242, broken=False)
    target = build_tree(tmp_path / "target", 777, broken=True, extra_kernel=True)
    result = compare_dumps(str(golden), str(target))
    assert [(u.side, u.kind, u.what) for u in result.unmatched] == [
        ("target", "op", "1_LinearOperation/0_TransdataKernel")]
    f = result.finding
    assert (f.op_path, f.golden_op_path) == ("1_LinearOperation/1_MatMulV2Kernel",
                                              "1_LinearOperation/0_MatMulV2Kernel")
    assert f.row.match == "name"


def test_show_and_parse_read_a_foreign_tree(trees, tmp_path, capsys):
    golden, _ = trees
    assert cli.main(["show", str(golden)]) == 0
    shown = capsys.readouterr().out
    assert "0_4242" in shown and "task=tensor" in shown and "1_LinearOperation" in shown
    counts = parse_path(str(golden), str(tmp_path / "npy"), "npy")
    assert counts.written == 14 and not counts.failed
    linear_in = np.load(tmp_path / "npy/atb_dump_data/data/0_4242/0/1_LinearOperation/before/"
                        "intensor0.npy")
    gather_out = np.load(tmp_path / "npy/atb_dump_data/data/0_4242/0/0_GatherOperation/after/"
                         "outtensor0.npy")
    assert linear_in.dtype == np.float16 and np.array_equal(linear_in, gather_out)
    cast = np.load(tmp_path / "npy/atb_dump_data/data/0_4242/0/2_CastOperation/after/"
                   "outtensor0.npy")
    assert cast.dtype == np.float32 and cast.shape == (3, 2)


def test_the_csv_of_a_foreign_tree_is_its_index(trees):
    golden, _ = trees
    rnd = open_dump(str(golden)).rounds[0]
    with open(rnd.csv_path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert [t.row for t in rnd.tensors] == rows
    assert all(t.path and Path(t.path).is_file() and str(golden) in t.path for t in rnd.tensors)


def test_a_row_whose_side_is_another_word_is_kept_with_its_file(trees, tmp_path):
    """A foreign tool's row whose Input/Output cell says neither `input` nor `output` (here
    `Input`) is still a tensor of the round: kept with that word, and with its file when its
    Tensor Path names one; only the layout's own guess of a path needs a side."""
    golden, _ = trees
    rnd = open_dump(str(golden)).rounds[0]
    text = Path(rnd.csv_path).read_text()
    lines = text.splitlines()
    lines[1] = lines[1].replace(",input,", ",Input,", 1)
    Path(rnd.csv_path).write_text("\n".join(lines) + "\n")
    tensors = open_dump(str(golden)).rounds[0].tensors
    assert len(tensors) == len(lines) - 1
    odd = tensors[0]
    assert odd.io == "Input" and odd.path and Path(odd.path).is_file()
