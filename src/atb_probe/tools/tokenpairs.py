"""Pairing two runs' rounds by the tokens they hold (SPEC §9), from each round's token layout
(tokens.json: atb_probe/tokens.py).

A request is known across runs by its prompt (`RequestKey`: the prompt's hash, and for the k-th
request of a run with that prompt, k). Each side's rounds are indexed as *pieces*: one request's
tokens in one round, the positions `[first, end)` of its sequence they hold. For every request
both runs ran, the two sides' pieces are intersected position by position: each overlap is a
`SlicePair`, the golden round's tokens of those positions against the target round's. A round of
one side may so pair with slices of several rounds of the other (one request at a time against
a batch), and a request's positions may be split differently on the two sides (chunked
prefill). What only one side has is left over as `Unmatched`: a request the other never ran, or
positions of a request it never ran.

Who a request is within one run: vLLM's request ids are unique in a run, so a span continues the
request of its id; transformers names a request by its batch row (`row0`), reused by every
`generate` call, so there a span that starts before where its row's request had got to starts a
new request. A position a side ran twice (a request recomputed after preemption) counts once,
where it ran first. Pure: no files, no torch.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from ..tokens import RequestSpan, Source, TokenLayout
from .comparison import Positions, Role, Unmatched, UnmatchedKind


class Located(Protocol):
    """A round as the pairing needs it: how the tools name it (`dumpreader.Round`)."""

    @property
    def where(self) -> str: ...


R = TypeVar("R", bound=Located)


@dataclass(frozen=True, slots=True)
class RequestKey:
    """A request as both runs know it: its prompt's hash, and which of its run's requests with
    that prompt it is (0: the first to appear)."""

    digest: str
    rank: int


@dataclass(frozen=True, slots=True)
class Piece(Generic[R]):
    """Part of one request's tokens in one round: `span`'s tokens from `skip` on (the ones
    before it ran earlier on this side)."""

    round: R
    layout: TokenLayout
    span: RequestSpan
    skip: int = 0

    @property
    def first(self) -> int:
        """The first position it holds."""
        return self.span.position + self.skip

    @property
    def end(self) -> int:
        """The position after its last."""
        return self.span.position + self.span.stop - self.span.start


@dataclass(frozen=True, slots=True)
class SideSlice(Generic[R]):
    """The tokens of one side of a slice pair: `[start, stop)` along the token dimension of
    its round (of the span's row)."""

    round: R
    layout: TokenLayout
    span: RequestSpan
    start: int
    stop: int

    @property
    def whole_span(self) -> bool:
        """Whether it holds all of its request's tokens in the round."""
        return self.start == self.span.start and self.stop == self.span.stop

    @property
    def whole_round(self) -> bool:
        """Whether it is the round's whole token dimension: a tensor needs no cut."""
        return self.layout.rows == 1 and self.start == 0 and self.stop == self.layout.tokens


@dataclass(slots=True)
class SlicePair(Generic[R]):
    """The same positions of one request in a golden round and in a target round."""

    request: RequestKey
    label: str                   # the request's number in this comparison: `1`
    positions: Positions
    golden: SideSlice[R]
    target: SideSlice[R]

    def side(self, role: Role) -> SideSlice[R]:
        return self.golden if role == Role.GOLDEN else self.target


@dataclass(slots=True)
class TokenPairing(Generic[R]):
    """The slice pairs of two runs, in the target's execution order, and what one side only
    has."""

    pairs: list[SlicePair[R]] = field(default_factory=list)
    unmatched: list[Unmatched] = field(default_factory=list)
    requests: int = 0            # requests both runs ran


def pair_by_tokens(golden: list[tuple[R, TokenLayout]], target: list[tuple[R, TokenLayout]]
                   ) -> TokenPairing[R]:
    """Pair two sides' rounds (each in execution order, with its layout) by token."""
    g_index, t_index = _Index.of(golden, Role.GOLDEN), _Index.of(target, Role.TARGET)
    out: TokenPairing[R] = TokenPairing(unmatched=g_index.unmatched + t_index.unmatched)
    order = list(g_index.pieces) + [k for k in t_index.pieces if k not in g_index.pieces]
    labels = {key: str(n) for n, key in enumerate(order)}
    order_of = {id(rnd): n for n, (rnd, _) in enumerate(target)}
    for key in order:
        g_pieces, t_pieces = g_index.pieces.get(key), t_index.pieces.get(key)
        if g_pieces is None or t_pieces is None:
            role, pieces = (Role.GOLDEN, g_pieces) if t_pieces is None else (Role.TARGET,
                                                                             t_pieces)
            out.unmatched.append(Unmatched(
                role, UnmatchedKind.REQUEST, pieces[0].round.where,
                f"request {labels[key]} ({_prompt_text(pieces[0].span)}): the "
                f"{role.other()} run never ran it", len(pieces)))
            continue
        out.requests += 1
        out.pairs += _intersect(key, labels[key], g_pieces, t_pieces)
        for role, mine, theirs in ((Role.GOLDEN, g_pieces, t_pieces),
                                   (Role.TARGET, t_pieces, g_pieces)):
            for piece, gap in _gaps(mine, theirs):
                out.unmatched.append(Unmatched(
                    role, UnmatchedKind.TOKENS, piece.round.where,
                    f"request {labels[key]}, positions {gap}: the {role.other()} run never "
                    "ran them", gap.stop - gap.start))
    out.pairs.sort(key=lambda p: (order_of[id(p.target.round)], p.target.span.row,
                                  p.target.start))
    return out


@dataclass(slots=True)
class _Index(Generic[R]):
    """One side's pieces per request, in position order, and the spans no request key fits."""

    pieces: dict[RequestKey, list[Piece[R]]] = field(default_factory=dict)
    unmatched: list[Unmatched] = field(default_factory=list)

    @classmethod
    def of(cls, rounds: list[tuple[R, TokenLayout]], role: Role) -> _Index[R]:
        index: _Index[R] = cls()
        ranks: dict[str, int] = {}                       # prompt hash -> requests seen
        open_: dict[tuple[str, str], RequestKey] = {}    # (hash, request id) -> its key
        reached: dict[RequestKey, int] = {}              # the position after the last run
        for rnd, layout in rounds:
            for span in layout.requests:
                digest = span.prompt.digest
                if not digest:
                    index.unmatched.append(Unmatched(
                        role, UnmatchedKind.TOKENS, rnd.where,
                        f"request {span.request!r}, positions {_positions(span)}: its prompt "
                        "is not known, so it cannot be recognised in the other run",
                        span.stop - span.start))
                    continue
                key = open_.get((digest, span.request))
                if key is None or (layout.source != Source.VLLM
                                   and span.position < reached[key]):
                    key = RequestKey(digest, ranks.get(digest, 0))
                    ranks[digest] = key.rank + 1
                    open_[(digest, span.request)] = key
                    reached[key] = 0
                piece = Piece(rnd, layout, span, max(0, reached[key] - span.position))
                if piece.first < piece.end:
                    index.pieces.setdefault(key, []).append(piece)
                    reached[key] = piece.end
        return index


def _intersect(key: RequestKey, label: str, golden: list[Piece[R]], target: list[Piece[R]]
               ) -> list[SlicePair[R]]:
    """The overlaps of two sides' pieces of one request (each list in position order)."""
    pairs, i, j = [], 0, 0
    while i < len(golden) and j < len(target):
        g, t = golden[i], target[j]
        first, end = max(g.first, t.first), min(g.end, t.end)
        if first < end:
            pairs.append(SlicePair(key, label, Positions(first, end),
                                   _side(g, first, end), _side(t, first, end)))
        if g.end <= t.end:
            i += 1
        else:
            j += 1
    return pairs


def _side(piece: Piece[R], first: int, end: int) -> SideSlice[R]:
    """The tokens of positions `[first, end)` in a piece's round."""
    start = piece.span.start + first - piece.span.position
    return SideSlice(piece.round, piece.layout, piece.span, start, start + end - first)


def _gaps(mine: list[Piece[R]], theirs: list[Piece[R]]) -> list[tuple[Piece[R], Positions]]:
    """The positions of `mine` that no piece of `theirs` holds, with the piece holding them."""
    out, j = [], 0
    for piece in mine:
        at = piece.first
        while j < len(theirs) and theirs[j].end <= at:
            j += 1
        k = j
        while at < piece.end:
            if k < len(theirs) and theirs[k].first <= at:
                at = max(at, theirs[k].end)
                k += 1
                continue
            stop = min(piece.end, theirs[k].first) if k < len(theirs) else piece.end
            out.append((piece, Positions(at, stop)))
            at = stop
    return out


def _positions(span: RequestSpan) -> Positions:
    return Positions(span.position, span.position + span.stop - span.start)


def _prompt_text(span: RequestSpan) -> str:
    """`prompt of 7 tokens: 1, 278, 4996, …`."""
    head = ", ".join(map(str, span.prompt.head))
    more = ", …" if span.prompt.length > len(span.prompt.head) else ""
    return f"prompt of {span.prompt.length} tokens: {head}{more}"
