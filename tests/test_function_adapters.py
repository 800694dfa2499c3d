"""A module that stands for a plain function (the `kernels` package's `Func`, which replaces
transformers' `apply_rotary_pos_emb` from transformers 5.25 on) is taken for the function call
it was: its kernels are its caller's children, so a dump's IDs and names are those of the same
model calling the function itself (docs/format.md)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from conftest import dump, only_proc, read_csv
from harness import config

kernels = pytest.importorskip("kernels")


def rotate(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return torch.cat((-x[..., 1:], x[..., :1]), dim=-1) * scale


ROTATE = kernels.use_kernel_forward_from_hub("atb_probe_test_rotate")(rotate)


class Attention(nn.Module):
    def __init__(self, through_adapter: bool):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.rotate = ROTATE if through_adapter else rotate
        self.scale = torch.full((4,), 0.5)

    def forward(self, x):
        return self.proj(self.rotate(x, self.scale)) + x


class Block(nn.Module):
    def __init__(self, through_adapter: bool):
        super().__init__()
        self.attn = Attention(through_adapter)

    def forward(self, x):
        return self.attn(x)


class Net(nn.Module):
    def __init__(self, through_adapter: bool):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([Block(through_adapter), Block(through_adapter)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return ROTATE(x, torch.ones(4)) if self.layers[0].attn.rotate is ROTATE else \
            rotate(x, torch.ones(4))


def test_the_adapter_is_the_module_class_kernels_makes():
    assert isinstance(ROTATE, nn.Module) and type(ROTATE).__name__ == "Func"


@pytest.mark.parametrize("task", ["statistics", "all"])
def test_a_function_adapter_dumps_as_the_function_call_it_stands_for(tmp_path, task):
    rows = {}
    for through_adapter in (False, True):
        net, x = Net(through_adapter), torch.randn(2, 4)
        root = dump(tmp_path / str(through_adapter), config(task=task, save_child=True),
                    lambda: net(x))
        csv = read_csv(only_proc(root) / "0" / "statistic.csv")
        rows[through_adapter] = [(r["Op Name"], r["Op Id"], r["Input/Output"], r["Max"],
                                  r["Norm"]) for r in csv]
    names = {name for name, *_ in rows[True]}
    assert not [n for n in names if "Func" in n], names
    assert "Block/Attention/CatKernel" in names, names  # the function's, as the caller's
    assert rows[True] == rows[False]


def test_a_function_adapter_called_outside_a_model_starts_no_round(tmp_path):
    root = dump(tmp_path, config(task="statistics"), lambda: ROTATE(torch.ones(4), torch.ones(4)))
    data = root / "data"
    assert not data.exists() or not any(p.glob("*/statistic.csv") for p in data.iterdir())
