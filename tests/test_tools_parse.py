"""`atb-probe parse`: .bin files of a real dump to .npy / .pt, every dtype, references resolved."""
from __future__ import annotations

import subprocess

import numpy as np
import pytest
import torch
from torch import nn

from atb_probe import cli, load
from atb_probe.binfile import read_header
from atb_probe.dtypes import DTYPES
from atb_probe.tools.parse import parse_path

from conftest import MSPROBE_MISSING, dump, msprobe_executable, only_proc
from harness import config


class Passthrough(nn.Module):
    def forward(self, *xs):
        return xs


class Root(nn.Module):
    """A root whose layer-level op takes (and returns) one tensor of every dtype."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Passthrough(), Passthrough()])

    def forward(self, *xs):
        return self.blocks[0](*xs)


def one_of_each_dtype() -> list[torch.Tensor]:
    base = torch.randn(3, 5, generator=torch.Generator().manual_seed(0)) * 10
    tensors = []
    for d in DTYPES:
        dt = getattr(torch, d.torch_name)
        if dt is torch.bool:
            t = base > 0
        elif dt.is_complex:
            t = torch.complex(base, -base).to(dt)
        elif d.torch_name == "float8_e8m0fnu":
            t = base.abs().to(dt)         # exponent-only: positive values
        elif dt.is_floating_point:
            t = base.to(dt)
        else:
            t = base.abs().to(torch.int64).to(dt)
        tensors.append(t)
    return tensors


@pytest.fixture(scope="module")
def dtype_dump(tmp_path_factory):
    tensors = one_of_each_dtype()
    root = dump(tmp_path_factory.mktemp("dtypes"), config(task="tensor"),
                lambda: Root()(*tensors))
    return root, tensors


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def test_parse_to_pt_round_trips_every_dtype(dtype_dump, tmp_path):
    root, tensors = dtype_dump
    counts = parse_path(str(root), str(tmp_path), "pt")
    assert counts.written == 2 * len(DTYPES) and not counts.failed
    op = tmp_path / only_proc(root).relative_to(root) / "0" / "0_Passthrough"
    for i, original in enumerate(tensors):
        for side, name in (("before", f"intensor{i}.pt"), ("after", f"outtensor{i}.pt")):
            back = torch.load(op / side / name)
            assert same_bits(back, original), (DTYPES[i].csv_name, side)


def test_parse_to_npy_keeps_numpy_dtypes_and_widens_bf16_and_fp8_to_float32(dtype_dump,
                                                                            tmp_path):
    root, tensors = dtype_dump
    assert cli.main(["parse", str(root), "--to", "npy", "-o", str(tmp_path)]) == 0
    op = tmp_path / only_proc(root).relative_to(root) / "0" / "0_Passthrough"
    for i, (d, original) in enumerate(zip(DTYPES, tensors)):
        back = np.load(op / "after" / f"outtensor{i}.npy")
        if d.numpy_name is None:
            assert back.dtype == np.float32, d.csv_name
            assert np.array_equal(back, original.float().numpy()), d.csv_name
        else:
            assert back.dtype == np.dtype(d.numpy_name), d.csv_name
            assert np.array_equal(back, original.numpy()), d.csv_name


def test_parse_resolves_reference_files_to_the_bytes_they_point_at(tmp_path):
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4)).eval()
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(1))
    root = dump(tmp_path / "d", config(save_child=True, filter_level=1), lambda: model(x))
    refs = [p for p in root.rglob("*.bin") if read_header(p).is_reference]
    assert refs, "a save_child dump at filter_level 1 has reference files"
    assert parse_path(str(root), str(tmp_path / "npy"), "npy").written == \
        len(list(root.rglob("*.bin")))
    for ref in refs:
        parsed = np.load(tmp_path / "npy" / ref.relative_to(root).with_suffix(".npy"))
        assert parsed.shape == tuple(read_header(ref).dims)
        assert np.array_equal(parsed, load(ref).numpy())
        assert parsed.size and np.any(parsed != 0)


def test_header_only_files_are_skipped_and_counted(tmp_path, capsys):
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4)).eval()
    x = torch.randn(2, 8)
    root = dump(tmp_path / "d", config(save_child=True, filter_level=2), lambda: model(x))
    assert cli.main(["parse", str(root), "-o", str(tmp_path / "out")]) == 0
    printed = capsys.readouterr().out
    kernels = [p for p in root.rglob("*.bin") if "Kernel" in p.parent.parent.name]
    assert kernels and f"skipped {len(kernels)} header-only file(s)" in printed
    assert not list((tmp_path / "out").rglob("*Kernel/*/*.npy"))


def test_parse_of_one_file_writes_the_named_output(dtype_dump, tmp_path):
    root, tensors = dtype_dump
    src = only_proc(root) / "0" / "0_Passthrough" / "before" / "intensor0.bin"
    assert cli.main(["parse", str(src), "-o", str(tmp_path / "x.npy")]) == 0
    assert np.array_equal(np.load(tmp_path / "x.npy"), tensors[0].numpy())
    assert cli.main(["parse", str(src), "--to", "pt", "-o", str(tmp_path / "dir")]) == 0
    assert same_bits(torch.load(tmp_path / "dir" / "intensor0.pt"), tensors[0])


def test_parse_errors_say_what_to_give_instead(tmp_path, capsys):
    assert cli.main(["parse", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert cli.main(["parse", str(tmp_path / "empty")]) == 2
    assert "no .bin file" in capsys.readouterr().err
    bad = tmp_path / "bad.bin"
    bad.write_bytes(b"not a tensor file")
    assert cli.main(["parse", str(bad), "-o", str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err
    assert "failed" in err and "Traceback" not in err


def test_msprobe_parse_reads_our_files_as_we_do(dtype_dump, tmp_path):
    """msprobe's own parser (for the dtypes it knows) gives the same arrays as ours."""
    msprobe = msprobe_executable()
    if msprobe is None:
        pytest.skip(MSPROBE_MISSING)
    root, tensors = dtype_dump
    after = only_proc(root) / "0" / "0_Passthrough" / "after"
    run = subprocess.run([msprobe, "parse", "-d", str(after), "-t", "npy", "-o",
                          str(tmp_path / "theirs")], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    parse_path(str(after), str(tmp_path / "ours"), "npy")
    theirs = sorted(p.name for p in (tmp_path / "theirs").glob("*.npy"))
    # msprobe knows float32, float16, int8, int32, int64, bool and bf16.
    known = [i for i, d in enumerate(DTYPES) if d.code in (0, 1, 2, 3, 9, 12, 27)]
    assert theirs == sorted(f"outtensor{i}.npy" for i in known)
    for name in theirs:
        a, b = np.load(tmp_path / "theirs" / name), np.load(tmp_path / "ours" / name)
        assert a.dtype == b.dtype and np.array_equal(a, b), name
