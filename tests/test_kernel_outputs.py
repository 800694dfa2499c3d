"""What a kernel outputs (SPEC §8): the arguments it writes (`Tensor(a!)`: in-place ops, `out=`
variants, custom ops with `mutates_args`) after it ran, and allocation kernels' outputs marked
as uninitialised memory that scan and compare never report."""
from __future__ import annotations

import csv
import json

import pytest
import torch
from torch import nn

from atb_probe import load
from atb_probe.binfile import read_header
from atb_probe.tools.compare import compare_dumps
from atb_probe.tools.scan import scan_dump

from conftest import Root, dump, only_proc, read_csv
from harness import config


# Registered the way vLLM registers its kernels (`direct_register_custom_op`): a schema that
# marks `out` as written, and a CPU implementation.
_LIB = torch.library.Library("atbprobe_test", "DEF")
_LIB.define("scale_into(Tensor x, Tensor(a!) out, float factor) -> ()")


def _scale_into(x, out, factor):
    out.copy_(x * factor)


_LIB.impl("scale_into", _scale_into, "CPU")


class WritesArguments(nn.Module):
    """A custom op that fills a buffer it is given (a view of fresh memory), then a matmul
    into a given tensor; run under inference mode, as engines run models."""

    def forward(self, x):
        buffer = torch.empty_like(x).view(x.shape)
        torch.ops.atbprobe_test.scale_into(x, buffer, 3.0)
        product = torch.zeros(x.shape[0], x.shape[0])
        torch.mm(buffer, x.t(), out=product)
        return product.sum(-1)


X = torch.arange(6, dtype=torch.float32).reshape(2, 3)


def run(model):
    with torch.inference_mode():
        model(X)


def kernel_dir(round_dir, suffix):
    [found] = [p for p in (round_dir / "0_WritesArguments").iterdir() if p.name.endswith(suffix)]
    return found


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("written")
    model = Root(WritesArguments())
    root = dump(tmp, config(task="all", save_child=True, filter_level=1), lambda: run(model))
    return only_proc(root) / "0"


def test_a_custom_ops_mutated_argument_is_its_output_after_the_kernel(written):
    kernel = kernel_dir(written, "_ScaleIntoKernel")
    assert torch.equal(load(kernel / "after" / "outtensor0.bin"), X * 3)
    param = json.loads((kernel / "op_param.json").read_text())
    assert param["written"] == {"outtensor0": "out"}
    rows = [r for r in read_csv(written / "statistic.csv") if r["Op Type"] == "ScaleIntoKernel"]
    assert [r["Input/Output"] for r in rows] == ["input", "input", "output"]
    assert float(rows[-1]["Max"]) == 15.0


def test_an_out_variant_lists_its_out_argument_once(written):
    kernel = kernel_dir(written, "_MmOutKernel")
    assert sorted(p.name for p in (kernel / "after").iterdir()) == ["outtensor0.bin"]
    assert torch.equal(load(kernel / "after" / "outtensor0.bin"), (X * 3) @ X.t())


def test_a_written_output_read_next_is_a_reference_under_filter_level_1(written):
    scale = kernel_dir(written, "_ScaleIntoKernel")
    mm = kernel_dir(written, "_MmOutKernel")
    header = read_header(str(mm / "before" / "intensor0.bin"))
    assert header.data_ref == f"0_WritesArguments/{scale.name}/after/outtensor0.bin"


def marked(kernel) -> list:
    return json.loads((kernel / "op_param.json").read_text()).get("uninitialized", [])


def test_an_allocation_kernels_output_and_its_views_are_marked_uninitialized(written):
    assert marked(kernel_dir(written, "_EmptyLikeKernel")) == ["outtensor0"]
    assert marked(kernel_dir(written, "1_ViewKernel")) == ["outtensor0"]
    assert marked(kernel_dir(written, "_ScaleIntoKernel")) == []  # written by then


def _poison_allocations(round_dir) -> None:
    """Make every allocation kernel's output row read as memory that held NaN (what a reused
    block of freed memory holds: the allocator decides, so a test cannot make it happen)."""
    path = round_dir / "statistic.csv"
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    for row in rows[1:]:
        if row[3] in ("EmptyLikeKernel", "ViewKernel") and row[4].endswith(("_0", "_1")) \
                and row[5] == "output":
            row[10:14] = ["nan", "nan", "nan", "nan"]
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows(rows)


@pytest.fixture
def poisoned(tmp_path):
    model = Root(WritesArguments())
    round_dir = only_proc(dump(tmp_path, config(task="statistics", save_child=True),
                               lambda: run(model))) / "0"
    _poison_allocations(round_dir)
    return round_dir


def test_scan_never_reports_uninitialized_memory(poisoned):
    [result] = scan_dump(str(poisoned.parent.parent.parent))
    assert result.first is None


def test_compare_never_reports_uninitialized_memory(poisoned, tmp_path):
    golden = tmp_path / "golden"
    model = Root(WritesArguments())
    dump(golden, config(task="statistics", save_child=True), lambda: run(model))
    result = compare_dumps(str(golden / "atb_dump_data"), str(poisoned.parent.parent.parent))
    assert result.finding is None
    assert not any(r.target.data_name.endswith("EmptyLikeKernel/output.0") for r in result.rows)


class WritesAColumn(nn.Module):
    def forward(self, x):
        x = x.clone()
        x[..., 0] = 5.0  # select: a (1, 1) view with strides (4, 4), then fill_ through it
        return x


def test_a_one_element_view_with_a_long_stride_is_written_whole(tmp_path, capfd):
    root = dump(tmp_path, config(task="tensor", save_child=True),
                lambda: Root(WritesAColumn())(torch.zeros(1, 1, 4)))
    assert "internal error" not in capfd.readouterr().err
    layer = only_proc(root) / "0" / "0_WritesAColumn"
    [fill] = [p for p in layer.iterdir() if p.name.endswith("Kernel") and "Fill" in p.name]
    assert torch.equal(load(fill / "after" / "outtensor0.bin"), torch.full((1, 1), 5.0))
