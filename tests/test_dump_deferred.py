"""Statistics that wait for the end of a layer execution, or are found again, still describe the
values of the moment the tensor was seen."""
from __future__ import annotations

import torch
from torch import nn

from conftest import dump, only_proc, read_csv
from harness import config


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def _weight_rows(round_dir):
    """The rows of the first Linear's weight as its kernel input (`aten.t`'s input)."""
    return [r for r in read_csv(round_dir / "statistic.csv")
            if r["Op Id"] == "0_0_0" and r["Input/Output"] == "input"]


def test_a_weight_whose_data_is_replaced_between_rounds_gets_new_statistics(tmp_path):
    """`param.data = new` keeps the parameter object and its version counter: the statistics
    must still follow the new values."""
    net = Net()
    x = torch.randn(2, 4)

    def run():
        with torch.no_grad():
            net(x)
            net.blocks[0].lin.weight.data = torch.full((4, 4), 3.0)
            net(x)

    root = only_proc(dump(tmp_path, config(task="statistics", save_child=True), run))
    first, second = _weight_rows(root / "0"), _weight_rows(root / "1")
    assert first and second
    assert [float(second[0][k]) for k in ("Max", "Min", "Mean", "Norm")] == [3.0, 3.0, 3.0, 12.0]
    assert first[0]["Max"] != second[0]["Max"]


def test_a_tensor_written_in_place_later_in_the_layer_keeps_the_statistics_of_its_time(tmp_path):
    """A kernel output waits for the end of the layer execution; a later in-place kernel on it
    makes it be computed first."""
    class Scale(nn.Module):
        def forward(self, x):
            y = x * 2.0          # queued: y = 2x
            y.add_(100.0)        # in place: y's statistics must be those of 2x
            return y

    class Root(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([Scale(), Scale()])

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    x = torch.arange(4.0)
    root = only_proc(dump(tmp_path, config(task="statistics", save_child=True),
                          lambda: Root()(x)))
    rows = read_csv(root / "0" / "statistic.csv")
    mul_out = [r for r in rows if r["Op Id"] == "0_0" and r["Input/Output"] == "output"]
    add_in = [r for r in rows if r["Op Id"] == "0_1" and r["Input/Output"] == "input"]
    add_out = [r for r in rows if r["Op Id"] == "0_1" and r["Input/Output"] == "output"]
    assert float(mul_out[0]["Max"]) == 6.0 and float(add_in[0]["Max"]) == 6.0
    assert float(add_out[0]["Max"]) == 106.0
