"""compare pairs rounds by the tokens they hold (SPEC §9): the reading of tokens.json, the
pairing of round slices, and real dumps of a tiny Llama whose two prompts ran batched (left
padding) in one run and one at a time in the other."""
from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import torch

from atb_probe.statcsv import HEADER, parse_shape
from atb_probe.tokens import (UNKNOWN_PROMPT, Arrangement, RequestSpan, Source, TokenLayout,
                              prompt_of)
from atb_probe.tools.align import RoundMethod, pair_rounds
from atb_probe.tools.compare import compare_dumps, write_outputs
from atb_probe.tools.comparison import PairMode, Positions, Role, UnmatchedKind
from atb_probe.tools.dumpreader import open_dump
from atb_probe.tools.report import REPORT_HTML
from atb_probe.tools.summary import summary_doc
from atb_probe.tools.tokenpairs import pair_by_tokens
from atb_probe.tools.tokens import LayoutError, layout_of, read_layout

from conftest import dump, tiny_llama
from harness import config

PROMPT_A = [5, 6, 7, 8, 9]
PROMPT_B = [11, 12, 13, 14, 15, 16, 17]
NEW_TOKENS = 3
LAYERS = ("2_LlamaDecoderLayer", "3_LlamaDecoderLayer")
PERTURBED_LAYER = "3_LlamaDecoderLayer"                # layers[1]
PERTURBED_MODULE = "3_LlamaDecoderLayer/4_LlamaMLP/4_Linear"   # its mlp.down_proj


# -- layouts written by hand -------------------------------------------------------------------

@dataclass(frozen=True)
class Place:
    """A round as the pairing sees it: its name."""

    where: str


def span(request: str, prompt: list[int], start: int, stop: int, position: int,
         row: int = 0) -> RequestSpan:
    return RequestSpan(request, row, start, stop, position, prompt_of(prompt))


def flat(tokens: int, *spans: RequestSpan) -> TokenLayout:
    return TokenLayout(Source.VLLM, Arrangement.FLAT, tokens, 1, spans)


def batch(tokens: int, rows: int, *spans: RequestSpan) -> TokenLayout:
    return TokenLayout(Source.TRANSFORMERS, Arrangement.BATCH, tokens, rows, spans)


def one_at_a_time(*prompts: list[int], new_tokens: int = 2) -> list[tuple[Place, TokenLayout]]:
    """transformers' rounds of `generate` called on each prompt in turn."""
    rounds = []
    for prompt in prompts:
        n = len(prompt)
        rounds.append((Place(f"g/{len(rounds)}"), batch(n, 1, span("row0", prompt, 0, n, 0))))
        for k in range(new_tokens - 1):
            rounds.append((Place(f"g/{len(rounds)}"),
                           batch(1, 1, span("row0", prompt, 0, 1, n + k))))
    return rounds


def slices(pairing) -> list[tuple]:
    """(golden round, golden [start, stop), target round, target [start, stop), positions)."""
    return [(p.golden.round.where, (p.golden.start, p.golden.stop), p.target.round.where,
             (p.target.start, p.target.stop), str(p.positions)) for p in pairing.pairs]


def test_a_token_layout_reads_back_as_the_probe_writes_it(tmp_path):
    written = batch(7, 2, span("row0", PROMPT_A, 2, 7, 0), span("row1", PROMPT_B, 0, 7, 0, 1))
    (tmp_path / "tokens.json").write_text(json.dumps(written.doc()))
    assert read_layout(str(tmp_path)) == written
    assert read_layout(str(tmp_path / "elsewhere")) is None


@pytest.mark.parametrize("change, complaint", [
    (lambda d: d.pop("rows"), "rows"),
    (lambda d: d.update(layout="diagonal"), "diagonal"),
    (lambda d: d["requests"][0].update(stop=9), "outside"),
    (lambda d: d["requests"][0].update(position=-1), "not a count"),
])
def test_a_token_layout_that_is_not_the_documented_one_says_what_is_wrong(change, complaint):
    doc = batch(7, 1, span("row0", PROMPT_B, 0, 7, 0)).doc()
    change(doc)
    with pytest.raises(LayoutError, match=complaint):
        layout_of(doc)


def test_a_batched_round_pairs_with_the_rounds_of_each_request_run_alone():
    golden = one_at_a_time(PROMPT_A, PROMPT_B)   # g/0 A prefill, g/1 A decode, g/2 B, g/3 B
    target = [(Place("t/0"), batch(7, 2, span("row0", PROMPT_A, 2, 7, 0),
                                   span("row1", PROMPT_B, 0, 7, 0, 1))),
              (Place("t/1"), batch(1, 2, span("row0", PROMPT_A, 0, 1, 5),
                                   span("row1", PROMPT_B, 0, 1, 7, 1)))]
    pairing = pair_by_tokens(golden, target)
    assert slices(pairing) == [("g/0", (0, 5), "t/0", (2, 7), "0-4"),
                               ("g/2", (0, 7), "t/0", (0, 7), "0-6"),
                               ("g/1", (0, 1), "t/1", (0, 1), "5"),
                               ("g/3", (0, 1), "t/1", (0, 1), "7")]
    assert [p.label for p in pairing.pairs] == ["0", "1", "0", "1"]
    assert pairing.requests == 2 and not pairing.unmatched
    assert [p.golden.whole_round for p in pairing.pairs] == [True] * 4
    assert [p.target.whole_span for p in pairing.pairs] == [True] * 4


def test_a_request_prefilled_in_chunks_pairs_with_slices_of_the_round_that_ran_it_whole():
    prompt = list(range(1, 11))
    golden = one_at_a_time(prompt, new_tokens=1)
    other = [40, 41, 42]
    target = [(Place("t/0"), flat(7, span("a", prompt, 0, 4, 0), span("b", other, 4, 7, 0))),
              (Place("t/1"), flat(7, span("b", other, 0, 1, 3), span("a", prompt, 1, 7, 4)))]
    pairing = pair_by_tokens(golden, target)
    assert slices(pairing) == [("g/0", (0, 4), "t/0", (0, 4), "0-3"),
                               ("g/0", (4, 10), "t/1", (1, 7), "4-9")]
    assert not pairing.pairs[0].golden.whole_span and pairing.pairs[0].target.whole_span
    # The other request ran in the target only.
    [only] = pairing.unmatched
    assert (only.side, only.kind, only.where, only.count) == (Role.TARGET, UnmatchedKind.REQUEST,
                                                              "t/0", 2)
    assert "prompt of 3 tokens: 40, 41, 42" in only.what and "golden run never ran" in only.what


def test_positions_one_run_never_ran_are_reported_with_the_round_that_ran_them():
    golden = one_at_a_time(PROMPT_B, new_tokens=3)               # positions 0-8
    target = [(Place("t/0"), flat(4, span("7", PROMPT_B, 0, 4, 0))),
              (Place("t/1"), flat(2, span("7", PROMPT_B, 0, 2, 6)))]   # 0-3, 6-7
    pairing = pair_by_tokens(golden, target)
    assert [str(p.positions) for p in pairing.pairs] == ["0-3", "6", "7"]
    assert [(u.side, u.kind, u.where, u.what, u.count) for u in pairing.unmatched] == [
        (Role.GOLDEN, UnmatchedKind.TOKENS, "g/0",
         "request 0, positions 4-5: the target run never ran them", 2),
        (Role.GOLDEN, UnmatchedKind.TOKENS, "g/2",
         "request 0, positions 8: the target run never ran them", 1)]


def test_requests_of_the_same_prompt_pair_in_the_order_each_run_started_them():
    golden = one_at_a_time(PROMPT_A, PROMPT_A)          # row0 twice: two requests
    target = [(Place("t/0"), flat(10, span("x", PROMPT_A, 0, 5, 0), span("y", PROMPT_A, 5, 10,
                                                                        0))),
              (Place("t/1"), flat(2, span("y", PROMPT_A, 0, 1, 5), span("x", PROMPT_A, 1, 2,
                                                                       5)))]
    pairing = pair_by_tokens(golden, target)
    assert slices(pairing) == [("g/0", (0, 5), "t/0", (0, 5), "0-4"),
                               ("g/2", (0, 5), "t/0", (5, 10), "0-4"),
                               ("g/3", (0, 1), "t/1", (0, 1), "5"),
                               ("g/1", (0, 1), "t/1", (1, 2), "5")]
    assert [p.label for p in pairing.pairs] == ["0", "1", "1", "0"]


def test_a_request_whose_prompt_is_unknown_is_left_over_with_the_reason():
    golden = one_at_a_time(PROMPT_A)
    unknown = RequestSpan("row0", 0, 0, 1, 5, UNKNOWN_PROMPT)
    target = [(Place("t/0"), batch(5, 1, span("row0", PROMPT_A, 0, 5, 0))),
              (Place("t/1"), batch(1, 1, unknown))]
    pairing = pair_by_tokens(golden, target)
    assert [str(p.positions) for p in pairing.pairs] == ["0-4"]
    kinds = {(u.side, u.kind, u.where) for u in pairing.unmatched}
    assert (Role.TARGET, UnmatchedKind.TOKENS, "t/1") in kinds
    assert any("prompt is not known" in u.what for u in pairing.unmatched)


def write_round(root, index: int, layout: TokenLayout | None) -> None:
    """A round folder of a dump with an empty statistic.csv and `layout` as its tokens.json."""
    folder = root / "atb_dump_data" / "data" / "0_100" / str(index)
    folder.mkdir(parents=True)
    (folder / "statistic.csv").write_text(HEADER)
    if layout is not None:
        (folder / "tokens.json").write_text(json.dumps(layout.doc()))


def test_rounds_laid_out_alike_are_paired_by_number(tmp_path):
    for side in ("g", "t"):
        for index, (_, layout) in enumerate(one_at_a_time(PROMPT_A, PROMPT_B)):
            write_round(tmp_path / side, index, layout)
    rounds, pairing = pair_rounds(open_dump(str(tmp_path / "g")), open_dump(str(tmp_path / "t")))
    assert pairing.method == RoundMethod.NUMBER and pairing.text() == "by round number"
    assert [(m.golden.index, m.target.index, m.tokens) for m in rounds.pairs] == [
        (i, i, None) for i in range(4)]


def test_rounds_of_a_side_without_token_layouts_are_paired_by_number_and_why_is_said(tmp_path):
    layouts = one_at_a_time(PROMPT_A, PROMPT_B)
    for index, (_, layout) in enumerate(layouts):
        write_round(tmp_path / "g", index, layout)
        write_round(tmp_path / "t", index, None if index == 2 else layouts[(index + 2) % 4][1])
    rounds, pairing = pair_rounds(open_dump(str(tmp_path / "g")), open_dump(str(tmp_path / "t")))
    assert pairing.method == RoundMethod.NUMBER
    assert pairing.why == "target round 0_100/2 has no token layout"
    assert len(rounds.pairs) == 4


def test_rounds_laid_out_differently_are_paired_by_tokens(tmp_path):
    for index, (_, layout) in enumerate(one_at_a_time(PROMPT_A, PROMPT_B)):
        write_round(tmp_path / "g", index, layout)
    write_round(tmp_path / "t", 0, batch(7, 2, span("row0", PROMPT_A, 2, 7, 0),
                                         span("row1", PROMPT_B, 0, 7, 0, 1)))
    write_round(tmp_path / "t", 1, batch(1, 2, span("row0", PROMPT_A, 0, 1, 5),
                                         span("row1", PROMPT_B, 0, 1, 7, 1)))
    rounds, pairing = pair_rounds(open_dump(str(tmp_path / "g")), open_dump(str(tmp_path / "t")))
    assert pairing.text() == "by tokens: 2 requests, 4 round slices"
    assert [(m.golden.index, m.target.index) for m in rounds.pairs] == [(0, 0), (2, 0), (1, 1),
                                                                         (3, 1)]


# -- real dumps: two prompts batched against one at a time ----------------------------------------

def batched(model) -> None:
    """Both prompts in one `generate`, the shorter one padded on the left."""
    width = max(len(PROMPT_A), len(PROMPT_B))
    rows = [[0] * (width - len(p)) + p for p in (PROMPT_A, PROMPT_B)]
    mask = [[0] * (width - len(p)) + [1] * len(p) for p in (PROMPT_A, PROMPT_B)]
    with torch.no_grad():
        model.generate(input_ids=torch.tensor(rows), attention_mask=torch.tensor(mask),
                       max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)


def one_by_one(model) -> None:
    for prompt in (PROMPT_A, PROMPT_B):
        with torch.no_grad():
            model.generate(input_ids=torch.tensor([prompt]),
                           attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                           max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)


def perturbed(scale: float):
    model = tiny_llama()
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight.mul_(scale)
    return model


def run_dump(tmp_path_factory, name: str, model, run, **cfg):
    tmp = tmp_path_factory.mktemp(name)
    dump(tmp, config(**cfg), lambda: run(model))
    return str(tmp)


@pytest.fixture(scope="module")
def golden(tmp_path_factory):
    return run_dump(tmp_path_factory, "alone", tiny_llama(), one_by_one, task="tensor",
                    save_child=True)


@pytest.fixture(scope="module")
def golden_stats(tmp_path_factory):
    return run_dump(tmp_path_factory, "alone_stats", tiny_llama(), one_by_one,
                    task="statistics")


def test_the_same_weights_batched_and_alone_do_not_diverge_and_every_layer_is_compared_on_its_slice(
        tmp_path_factory, golden):
    target = run_dump(tmp_path_factory, "batched", tiny_llama(), batched, task="tensor",
                      save_child=True)
    result = compare_dumps(golden, target)
    assert result.finding is None
    assert result.pairing == "by tokens: 2 requests, 6 round slices"
    outputs = [r for r in result.rows if r.name in {f"{layer}/output.0" for layer in LAYERS}]
    # Each layer's output once per request and step: 2 requests x 3 rounds.
    assert len(outputs) == 2 * len(LAYERS) * NEW_TOKENS
    for row in outputs:
        assert row.mode == PairMode.TENSOR and row.metrics.cosine > 0.9999, row
        assert row.request in ("0", "1") and row.positions is not None
        length = row.positions.stop - row.positions.start
        assert parse_shape(row.target.shape) == parse_shape(row.golden.shape) == (1, length, 32)
        assert row.target.cut is not None and row.golden.cut is None
    prefill_b = next(r for r in outputs if r.positions == Positions(0, 7))
    assert prefill_b.round_cell(Role.TARGET) == "0[req 1, pos 0-6]"
    assert prefill_b.round_cell(Role.GOLDEN) == "3"
    # The report plots each round slice on its own.
    out = tmp_path_factory.mktemp("out")
    write_outputs(result, str(out), xlsx=False)
    page = (out / REPORT_HTML).read_text()
    assert "<h3>round 3 ~ 0[req 1, pos 0-6]</h3>" in page
    assert "<h3>round 0 ~ 0[req 0, pos 0-4]</h3>" in page
    # The weights inside the layers are compared whole, once per pair of rounds.
    weights = [r for r in result.rows if r.name.endswith("/0_TKernel/input.0")]
    assert weights and all(not r.request and r.target.cut is None for r in weights)
    assert len({(r.name, r.golden.round_index, r.target.round_index) for r in weights}) == \
        len(weights)


def test_a_perturbed_layer_is_named_with_its_request_and_tokens_in_tensor_mode(
        tmp_path_factory, golden):
    target = run_dump(tmp_path_factory, "batched_broken", perturbed(1.05), batched,
                      task="tensor", save_child=True)
    result = compare_dumps(golden, target)
    f = result.finding
    assert f is not None and f.inputs_clean and f.op_path == PERTURBED_MODULE, \
        f and f.summary()
    assert f.request == "0" and f.positions == Positions(0, 5)
    assert "round 0 ~ 0[req 0, pos 0-4], " + PERTURBED_MODULE in f.summary()
    doc = summary_doc(result)
    assert doc["rounds_paired"] == "by tokens: 2 requests, 6 round slices"
    assert doc["first_divergence"]["request"] == "0"
    assert doc["first_divergence"]["token"] == {"first": 0, "last": 4}


def test_a_perturbed_layer_is_named_in_statistics_mode_from_the_statistics_per_request(
        tmp_path_factory, golden_stats):
    target = run_dump(tmp_path_factory, "batched_broken_stats", perturbed(30.0), batched,
                      task="statistics")
    result = compare_dumps(golden_stats, target)
    f = result.finding
    assert f is not None and f.op_path == PERTURBED_LAYER, f and f.summary()
    assert f.row.mode == PairMode.STATISTICS and f.request == "0"
    assert (f.request, f.positions) == ("0", Positions(0, 5)), f.summary()
    # The layer before it matches in the prompts' round (the tokens generated next differ):
    # its statistics per request are those of the request's tokens alone.
    first = [r for r in result.rows if r.name == f"{LAYERS[0]}/output.0"
             and r.positions.start == 0]
    assert len(first) == 2
    for row in first:
        assert row.mode == PairMode.STATISTICS and row.diffs.norm_rel_pct < 1e-4, row
