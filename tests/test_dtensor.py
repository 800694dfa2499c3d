"""Tensor subclasses (SPEC §7): PyTorch's own tensor parallelism on 2 real torchrun ranks.

`examples/tensor_parallel/tp_dtensor.py` parallelises a tiny Llama's attention and MLP with
`parallelize_module`: the weights are `DTensor`s and the row-parallel outputs pending
functional-collective results. Each is dumped as its local shard, with its layout in
`op_param.json`.
"""
from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest
import torch

from atb_probe.binread import load_tensor
from conftest import read_csv
from harness import config, torchrun_loaded

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tensor_parallel" / "tp_dtensor.py"


def _example():
    spec = importlib.util.spec_from_file_location("tp_dtensor", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tp_dump(tmp_path_factory):
    """Layer 0 (op 2) of round 0 with everything below it, on both ranks: {device: round dir}."""
    tmp = tmp_path_factory.mktemp("dtensor")
    stdout = torchrun_loaded(tmp, config(task="all", exec_range="0,0", ids="2", save_child=True),
                             EXAMPLE, "--check")
    errors = [float(e) for e in re.findall(r"single\| = ([0-9.e+-]+)", stdout)]
    assert len(errors) == 2 and max(errors) < 1e-5, stdout
    procs = {p.name.split("_")[0]: p / "0" for p in (tmp / "atb_dump_data" / "data").iterdir()}
    assert sorted(procs) == ["0", "1"]
    return procs


def test_weights_are_dumped_as_the_local_shard_with_their_layout(tp_dump):
    full = _example().build_model().model.layers[0].self_attn.q_proj.weight.detach()
    for rank, round_dir in tp_dump.items():
        kernel = round_dir / "2_LlamaDecoderLayer" / "1_LlamaAttention" / "0_Linear" / "1_TKernel"
        param = json.loads((kernel / "op_param.json").read_text())
        assert param["dtensors"]["intensor0"] == {
            "placements": ["Shard(dim=0)"], "mesh_shape": [2], "global_shape": [32, 32]}
        shard = load_tensor(str(kernel / "before" / "intensor0.bin"))
        rows = full.shape[0] // 2
        assert torch.equal(shard, full[int(rank) * rows:(int(rank) + 1) * rows])


def test_pending_collective_results_are_waited_for_and_dumped(tp_dump):
    """The row-parallel o_proj returns a pending all-reduce: both ranks dump the reduced sum."""
    outputs = []
    for round_dir in tp_dump.values():
        linear = round_dir / "2_LlamaDecoderLayer" / "1_LlamaAttention"
        o_proj = max((p for p in linear.iterdir() if p.name.endswith("_Linear")),
                     key=lambda p: int(p.name.split("_")[0]))
        assert json.loads((o_proj / "op_param.json").read_text())["modulePath"] == \
            "model.layers.0.self_attn.o_proj"
        outputs.append(load_tensor(str(o_proj / "after" / "outtensor0.bin")))
    assert outputs[0].shape == (1, 8, 32)
    assert torch.allclose(outputs[0], outputs[1], atol=1e-6)


def test_layer_outputs_agree_across_ranks(tp_dump):
    layer_outputs = [load_tensor(str(d / "2_LlamaDecoderLayer" / "after" / "outtensor0.bin"))
                     for d in tp_dump.values()]
    assert torch.allclose(*layer_outputs, atol=1e-6)
    for round_dir in tp_dump.values():
        rows = read_csv(round_dir / "statistic.csv")
        assert rows and all(r["Tensor Path"] != "N/A" for r in rows)
        # Empty tensors (the KV cache before its first update) have no statistics.
        assert all(r["Max"] != "N/A" for r in rows if "0" not in r["Shape"].split("x"))
