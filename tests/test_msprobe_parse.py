"""Our `.bin` files read by mindstudio-probe's own `msprobe parse` (the original tool).

mindstudio-probe is not a dependency: the test runs when `msprobe` is found (the MSPROBE
environment variable, else .venv-msprobe/bin/msprobe in this checkout, else PATH) and is skipped
otherwise.
"""
from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from torch import nn

from atb_probe import load

from conftest import MSPROBE_MISSING, dump, msprobe_executable, only_proc
from harness import config, run

# The dtypes msprobe's ATB reader knows (its table: float32, float16, int8, int32, int64, bool,
# bfloat16).
MSPROBE_DTYPES = [torch.float32, torch.float16, torch.int8, torch.int32, torch.int64, torch.bool,
                  torch.bfloat16]


pytestmark = pytest.mark.skipif(msprobe_executable() is None, reason=MSPROBE_MISSING)


class Cast(nn.Module):
    def forward(self, x, dtype):
        return x.to(dtype)


class Casts(nn.Module):
    def __init__(self):
        super().__init__()
        self.cast = Cast()

    def forward(self, x):
        return [self.cast(x, d) for d in MSPROBE_DTYPES]


def test_msprobe_parse_reads_every_dtype_it_supports(tmp_path):
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(0)) * 5
    root = dump(tmp_path, config(), lambda: Casts()(x))
    round0 = only_proc(root) / "0"
    # msprobe parse reads the .bin files of one folder: gather ours under distinct names.
    flat = tmp_path / "flat"
    flat.mkdir()
    for i in range(len(MSPROBE_DTYPES)):
        shutil.copy(round0 / f"{i}_Cast" / "after" / "outtensor0.bin", flat / f"cast{i}.bin")
    out = tmp_path / "parsed"
    result = run([msprobe_executable(), "parse", "-d", flat, "-t", "npy", "-o", out])
    assert result.returncode == 0, result.stderr[-2000:]
    for i, dtype in enumerate(MSPROBE_DTYPES):
        parsed = np.load(out / f"cast{i}.npy")
        ours = load(flat / f"cast{i}.bin")
        assert ours.dtype == dtype
        expected = ours.float().numpy() if dtype is torch.bfloat16 else ours.numpy()
        np.testing.assert_array_equal(parsed, expected)
