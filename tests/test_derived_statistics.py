"""The sums the probe measures for the tools (capture/sums.py, derived_statistic.csv) are the
sums the built-in conventions compare: each left-side (engine) op whose map rule sums two of its
own tensors has exactly that sum in the probe's table, and the table has no other. The probe
measures them only for an engine's classes. The dump and its comparison are tested with vLLM
itself (tests/engines/test_vllm_statistics_against_transformers.py)."""
from __future__ import annotations

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
