"""A round's token layout (SPEC §9): which requests its token dimension holds, where, and at
which positions of their sequences; `tokens.json` of a round folder (docs/format.md).

The capture side reads the layout from what the engine already has on the host (vLLM's
batch, the root call's `input_ids` and `attention_mask`: capture/tokens.py, capture/vllm.py)
and builds a `TokenLayout`; the recorder writes it with the round's files and slices the
round's tensors along the token dimension for request_statistic.csv. A request is recognised
in another run by its prompt: its length, first ids and a hash of all of them (`Prompt`).
Pure: no torch.
"""
from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

from .enums import StrEnum

PROMPT_HEAD = 16           # prompt ids written in full (`prompt_head`)


class Source(StrEnum):
    """Who described the round's tokens."""

    VLLM = "vllm"                  # the V1 model runner's batch
    TRANSFORMERS = "transformers"  # the root module's call


class Arrangement(StrEnum):
    """How a round's token tensors hold their tokens (`layout` in tokens.json)."""

    FLAT = "flat"    # dim 0 is the token dimension: [num_tokens, hidden] (vLLM)
    BATCH = "batch"  # dims 0 and 1 are [rows, seq]: [batch, seq, hidden] (transformers)


@dataclass(frozen=True, slots=True)
class Prompt:
    """What identifies a request across runs: its prompt's length, first ids and hash."""

    length: int
    head: tuple[int, ...]
    digest: str   # 16 hex digits of sha1 over the ids as little-endian int64; "" when unknown


UNKNOWN_PROMPT = Prompt(0, (), "")


def prompt_of(ids) -> Prompt:
    """The `Prompt` of a sequence of token ids (ints, padding removed)."""
    ids = list(ids)
    data = struct.pack(f"<{len(ids)}q", *ids)
    return Prompt(len(ids), tuple(ids[:PROMPT_HEAD]), hashlib.sha1(data).hexdigest()[:16])


@dataclass(frozen=True, slots=True)
class RequestSpan:
    """One request's tokens in a round: `[start, stop)` along the token dimension of `row`,
    whose first token is at `position` of the request's sequence."""

    request: str
    row: int
    start: int
    stop: int
    position: int
    prompt: Prompt


@dataclass(frozen=True, slots=True)
class TokenLayout:
    """The token layout of one round: `tokens` slots along the token dimension (padding
    included), `rows` batch rows, and the requests' spans in order (row, then start)."""

    source: Source
    arrangement: Arrangement
    tokens: int
    rows: int
    requests: tuple[RequestSpan, ...]

    @property
    def per_request(self) -> bool:
        """Whether statistics per request say more than the tensor's: several requests, or
        padding."""
        if len(self.requests) > 1:
            return True
        return sum(r.stop - r.start for r in self.requests) < self.tokens * self.rows

    def has_token_dim(self, shape) -> bool:
        """Whether a tensor of this shape has the round's token dimension (and rows)."""
        if self.arrangement is Arrangement.FLAT:
            return len(shape) >= 1 and shape[0] == self.tokens
        return len(shape) >= 2 and shape[0] == self.rows and shape[1] == self.tokens

    def has_request_rows(self, shape) -> bool:
        """Whether a tensor of this shape, without the token dimension, has a row per request
        (the logits of each request's last token): dim 0 is the batch's rows, or in a flat
        layout the round's requests, and the round holds several."""
        if len(self.requests) < 2 or not len(shape) or self.has_token_dim(shape):
            return False
        return shape[0] == (self.rows if self.arrangement is Arrangement.BATCH
                            else len(self.requests))

    def request_row(self, span: RequestSpan) -> int:
        """The row of `span`'s request in a tensor with a row per request."""
        return span.row if self.arrangement is Arrangement.BATCH else self.requests.index(span)

    def request_rows(self) -> list[int]:
        """`request_row` of each of the requests, in order (in one pass: a step of a serving
        engine may hold hundreds)."""
        if self.arrangement is Arrangement.BATCH:
            return [span.row for span in self.requests]
        return list(range(len(self.requests)))

    def doc(self) -> dict:
        """The tokens.json document (docs/format.md)."""
        return {
            "source": self.source.value,
            "layout": self.arrangement.value,
            "tokens": self.tokens,
            "rows": self.rows,
            "requests": [{"request": r.request, "row": r.row, "start": r.start, "stop": r.stop,
                          "position": r.position, "prompt_len": r.prompt.length,
                          "prompt_head": list(r.prompt.head), "prompt_hash": r.prompt.digest}
                         for r in self.requests],
        }
