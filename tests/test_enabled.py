"""`with atb_probe.enabled(...)`: the probe runs for the block and is closed however it ends."""
from __future__ import annotations

import json

import pytest
import torch

import atb_probe
from conftest import read_csv, tiny_llama
from harness import config


def _dump_files(root):
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())


def test_the_block_dumps_its_rounds_and_closes_the_probe(tmp_path):
    model = tiny_llama()
    ids = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(0))
    with atb_probe.enabled(str(tmp_path), config(task="statistics")) as probe:
        assert atb_probe.active() is probe
        with torch.no_grad():
            model(ids)
    assert atb_probe.active() is None
    root = tmp_path / "atb_dump_data"
    rows = read_csv(next(root.rglob("statistic.csv")))
    assert len(rows) > 10
    status = json.loads(next((root / "status").glob("*.json")).read_text())
    assert status["state"] == "exited" and status["exited"] is True
    assert status["bytes_queued"] == 0
    # Closed: the model runs unprobed again and nothing more is written.
    before = _dump_files(root)
    with torch.no_grad():
        model(ids)
    assert _dump_files(root) == before
    assert torch.nn.Module.__call__ is not None and \
        not getattr(torch.nn.Module.__call__, "__atb_probe__", False)


def test_an_exception_in_the_block_still_writes_what_ran(tmp_path):
    model = tiny_llama()
    ids = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(0))
    with pytest.raises(RuntimeError, match="user code failed"):
        with atb_probe.enabled(str(tmp_path), config(task="statistics")):
            with torch.no_grad():
                model(ids)
            raise RuntimeError("user code failed")
    assert atb_probe.active() is None
    root = tmp_path / "atb_dump_data"
    assert len(read_csv(next(root.rglob("statistic.csv")))) > 10
    status = json.loads(next((root / "status").glob("*.json")).read_text())
    assert status["exited"] is True
