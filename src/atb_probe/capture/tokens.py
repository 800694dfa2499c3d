"""The token layout of a root call (`transformers` models), read from its arguments.

A `[batch, seq]` `input_ids` (or a `[batch, seq, hidden]` `inputs_embeds`) gives the rows and
the token dimension; a 2-D `attention_mask` over the cache and the new tokens gives each row's
padding (left or right) and its position: the real tokens before the row's first new one. With
no mask every row is all tokens, at the position `position_ids`, `cache_position` or the cache's
length says. Only tensors on the host are read: on an accelerator the probe would have to wait
for the device, so such a round has no layout.

A decode round carries only each row's new token, so the prompts are kept per model, one per
batch row, from its last round that started the rows' sequences (`ModelPrompts`).
"""
from __future__ import annotations

import torch

from ..tokens import (UNKNOWN_PROMPT, Arrangement, Prompt, RequestSpan, Source, TokenLayout,
                      prompt_of)
from .arguments import bind_args

_WANTED = frozenset({"input_ids", "inputs_embeds", "attention_mask", "position_ids",
                     "cache_position", "past_key_values", "cache"})


class ModelPrompts:
    """The prompt of each batch row of one model, as its last prefill round saw them."""

    __slots__ = ("rows",)

    def __init__(self):
        self.rows: tuple[Prompt, ...] = ()

    def of(self, row: int) -> Prompt:
        return self.rows[row] if row < len(self.rows) else UNKNOWN_PROMPT


def call_layout(params: tuple, args: tuple, kwargs: dict,
                prompts: ModelPrompts) -> TokenLayout | None:
    """The layout of a root call of a token model; None when it has no such arguments, or they
    are not on the host. Remembers the prompts of rows that start here in `prompts`."""
    named = {n: v for n, v in bind_args(params, args, kwargs) if n in _WANTED}
    ids = named.get("input_ids")
    if isinstance(ids, torch.Tensor) and ids.dim() == 2:
        if not ids.is_cpu:
            return None
        rows, seq = ids.shape
    else:
        embeds = named.get("inputs_embeds")
        if not (isinstance(embeds, torch.Tensor) and embeds.dim() == 3):
            return None
        rows, seq = embeds.shape[:2]
        ids = None
    real = _real_tokens(named.get("attention_mask"), rows, seq)
    if real is None:
        return None
    spans, past = real
    if past is None:
        past = _positions(named, rows)
        if past is None:
            return None
    starting = [None] * rows  # the prompts of rows whose sequence starts in this round
    requests = []
    for row, (start, stop) in enumerate(spans):
        if start == stop:
            continue
        position = past[row]
        if position == 0:
            prompt = UNKNOWN_PROMPT if ids is None else prompt_of(ids[row, start:stop].tolist())
            starting[row] = prompt
        else:
            prompt = prompts.of(row)
        requests.append(RequestSpan(f"row{row}", row, start, stop, position, prompt))
    if any(p is not None for p in starting):
        prompts.rows = tuple(p if p is not None else prompts.of(r) for r, p in enumerate(starting))
    return TokenLayout(Source.TRANSFORMERS, Arrangement.BATCH, seq, rows, tuple(requests))


def _real_tokens(mask, rows: int, seq: int):
    """([start, stop) of each row's real tokens among the new ones, the positions of those
    (None: no mask to count them)) from a 2-D mask; every token real without one; None when
    the mask cannot be read (on a device, real tokens not contiguous)."""
    if not (isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape[0] == rows and
            mask.shape[1] >= seq):
        return [(0, seq)] * rows, None
    if not mask.is_cpu:
        return None
    width = mask.shape[1]
    if rows * width <= _WHOLE and not mask.is_floating_point():
        rows_values = mask.tolist()
        new = [[v != 0 for v in row[width - seq:]] for row in rows_values]
        past = [sum(row[:width - seq]) for row in rows_values]
    else:
        new = mask[:, width - seq:].bool().tolist()
        past = mask[:, :width - seq].sum(1).tolist() if width > seq else [0] * rows
    spans = []
    for flags in new:
        if True not in flags:
            spans.append((0, 0))
            continue
        start = flags.index(True)
        stop = seq - flags[::-1].index(True)
        if not all(flags[start:stop]):
            return None
        spans.append((start, stop))
    return spans, [int(p) for p in past]


# A host mask or positions tensor of at most this many elements is read whole: one call into
# torch, where slicing and reducing it first takes two to six, at tens of microseconds each
# between the model's calls (a 1x80 mask: 26 us against 86); a larger one is cut first.
_WHOLE = 1024


def _positions(named: dict, rows: int) -> list[int] | None:
    """The position of each row's first new token, without a mask: `position_ids`,
    `cache_position` or the cache's length (host tensors only)."""
    positions = named.get("position_ids")
    if isinstance(positions, torch.Tensor) and positions.dim() == 2 and \
            positions.shape[0] == rows and positions.shape[1]:
        if not positions.is_cpu:
            return None
        if positions.numel() <= _WHOLE:
            return [row[0] for row in positions.tolist()]
        return positions[:, 0].tolist()
    cache_position = named.get("cache_position")
    if isinstance(cache_position, torch.Tensor) and cache_position.dim() == 1 and \
            cache_position.numel():
        if not cache_position.is_cpu:
            return None
        first = cache_position.tolist()[0] if cache_position.numel() <= _WHOLE else \
            cache_position[0].item()
        return [int(first)] * rows
    cache = named.get("past_key_values", named.get("cache"))
    length = getattr(cache, "get_seq_length", None)
    if callable(length):
        try:
            return [int(length())] * rows
        except Exception:
            return None
    return [0] * rows
