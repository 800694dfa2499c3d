"""The sums of an op's own tensors whose statistics the probe records in derived_statistic.csv
(SPEC §9, docs/format.md).

vLLM's decoder layers carry the residual stream in two halves: a layer returns
`(hidden_states, residual)` and leaves their sum to the next layer's norm, which takes both
(`RMSNorm` given a residual adds it first). `transformers` returns the stream itself. compare
pairs the two with a derived tensor, the sum of vLLM's halves (tools/conventions/
vllm_transformers.yaml): in a tensor dump it adds the halves' bytes, but statistics do not add up
(the norm of a sum is not known from the norms of its parts). So in a statistics dump the probe
measures the sum itself, once per such op side, for the ops whose class is listed here and that
come from an engine package (a `transformers` class of the same name is left alone).

The table must name the same sums as the conventions file; tests/test_derived_statistics.py
keeps the two in step. Pure: no torch.
"""
from __future__ import annotations

from ..layout import INPUT, OUTPUT

# Where engine classes live: the top-level package of a module class's `__module__`.
ENGINE_PACKAGES = frozenset({"vllm", "vllm_ascend"})

# The decoder layer: `(positions, hidden_states, residual)` -> `(hidden_states, residual)`
# (the first layer gets no residual: its input side has no sum).
_LAYER = {INPUT: (1, 2), OUTPUT: (0, 1)}
# The norm given a residual: `(x, residual)` -> `(normed, x + residual)`.
_NORM = {INPUT: (0, 1)}

SUMS: dict[str, dict[str, tuple[int, int]]] = {
    **dict.fromkeys(("LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer",
                     "Qwen3DecoderLayer", "MixtralDecoderLayer", "Qwen2MoeDecoderLayer",
                     "Qwen3MoeDecoderLayer", "DeepseekV2DecoderLayer", "GemmaDecoderLayer"),
                    _LAYER),
    "RMSNorm": _NORM,
    "GemmaRMSNorm": _NORM,
}


def sums_of(cls: type) -> dict[str, tuple[int, int]] | None:
    """The sums to measure on each side (`input` / `output`: the indices of the two tensors
    added) of an op of module class `cls`; None for a class with none."""
    sums = SUMS.get(cls.__name__)
    if sums is None or cls.__module__.partition(".")[0] not in ENGINE_PACKAGES:
        return None
    return sums


def sum_index(pair: tuple[int, int]) -> str:
    """The Index cell of a sum's row: `1+2` for the sum of tensors 1 and 2 of its side."""
    return f"{pair[0]}+{pair[1]}"
