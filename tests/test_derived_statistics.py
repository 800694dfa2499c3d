"""The sums the probe measures for the tools (capture/sums.py, derived_statistic.csv) are the
sums the built-in conventions compare: each left-side (engine) op whose map rule sums two of its
own tensors has exactly that sum in the probe's table, and the table has no other. The probe
measures them only for an engine's classes. The dump and its comparison are tested with vLLM
itself (tests/engines/test_vllm_statistics_against_transformers.py)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from atb_probe.capture.sums import SUMS, sum_index, sums_of
from atb_probe.tools.comparison import DeriveKind
from atb_probe.tools.conventions import built_in


def _map_sums() -> dict[str, dict[str, tuple[int, int]]]:
    """{left op name: {side: (i, j)}} of every built-in rule that sums two of the left op's own
    tensors."""
    found: dict[str, dict[str, tuple[int, int]]] = {}
    for opmap in built_in():
        for name, rules in opmap.tensors.items():
            if ":" in name:  # a rule for one pair of op names: the left name is the same
                name = name.partition(":")[0]
            for rule in rules:
                left = rule.left
                if left.derive is None or left.derive.kind != DeriveKind.SUM:
                    continue
                keys = left.parts
                assert len(keys) == 2 and not any(k.module for k in keys), (name, left)
                assert keys[0].io == keys[1].io, (name, left)
                pair = (int(keys[0].index), int(keys[1].index))
                found.setdefault(name, {})[str(keys[0].io)] = pair
    return found


def test_the_probe_measures_exactly_the_sums_the_conventions_compare():
    assert _map_sums() == SUMS


def test_only_an_engines_classes_have_their_sums_measured():
    engine = type("LlamaDecoderLayer", (), {"__module__": "vllm.model_executor.models.llama"})
    ascend = type("RMSNorm", (), {"__module__": "vllm_ascend.ops.layernorm"})
    assert sums_of(engine) == {"input": (1, 2), "output": (0, 1)}
    assert sums_of(ascend) == {"input": (0, 1)}
    assert sums_of(LlamaDecoderLayer) is None          # transformers' class of the same name
    assert sums_of(type("LlamaMLP", (), {"__module__": "vllm.x"})) is None
    assert sum_index((1, 2)) == "1+2"


class _EngineLayer(torch.nn.Module):
    """A decoder layer as vLLM's is called: `(positions, hidden_states, residual)` in,
    `(hidden_states, residual)` out, the residual stream in two halves; the next layer adds
    them in place, as vLLM's fused RMSNorm does."""

    def __init__(self, seed: int):
        super().__init__()
        self.proj = torch.nn.Linear(16, 16)
        with torch.no_grad():
            self.proj.weight.copy_(torch.randn(16, 16, generator=torch.Generator()
                                               .manual_seed(seed)) / 4)

    def forward(self, positions, hidden_states, residual):
        if residual is None:
            residual = hidden_states.clone()
        else:
            residual.add_(hidden_states)  # written after the layer before has returned it
        return self.proj(residual), residual


_EngineLayer.__name__ = _EngineLayer.__qualname__ = "LlamaDecoderLayer"
_EngineLayer.__module__ = "vllm.model_executor.models.llama"


class _EngineModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(_EngineLayer(seed) for seed in range(3))

    def forward(self, hidden):
        positions, residual, halves = torch.arange(hidden.shape[0]), None, []
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
            halves.append(hidden + residual)  # each layer's output sum, before the next adds
        return halves


def test_a_sum_of_halves_is_measured_as_it_was_though_the_next_layer_writes_a_half(tmp_path):
    """An engine's decoder layer returns its output in two halves, and the next layer adds
    one into the other in place: each output's derived_statistic.csv row holds the sum as the
    layer returned it (in a statistics dump at layer level, with the side's small tensors
    copied and measured at the round's end)."""
    from conftest import dump, only_proc, read_csv
    from harness import config

    model = _EngineModel()
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        sums = model(x.clone())
    root = dump(tmp_path, config(task="statistics"), lambda: _no_grad(model, x.clone()))
    rows = [r for r in read_csv(only_proc(root) / "0" / "derived_statistic.csv")
            if r["Input/Output"] == "output"]
    assert [r["Op Id"] for r in rows] == ["0", "1", "2"]
    for row, total in zip(rows, sums):
        values = total.numpy().astype(np.float32).reshape(-1)
        assert float(row["Max"]) == float(values.max())
        assert float(row["Min"]) == float(values.min())
        assert float(row["Norm"]) == pytest.approx(float(np.linalg.norm(values)), rel=1e-6)


def _no_grad(model, x):
    with torch.no_grad():
        model(x)
