"""A round says which tokens it holds (SPEC §9): tokens.json of a `transformers` generation
with a left-padded batch, its prompts recognised again when run one at a time, and
request_statistic.csv's statistics over each request's tokens."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from atb_probe.binread import load_numpy
from atb_probe.capture.tokens import _real_tokens
from atb_probe.statcsv import REQUEST_COLUMNS
from atb_probe.tokens import prompt_of

from conftest import dump, only_proc, read_csv, tiny_llama
from harness import config, run_loaded

SHORT, LONG = [5, 6, 7], [1, 2, 3, 4, 5]
PAD = 0

SCRIPT = f"""
import torch
from transformers import LlamaConfig, LlamaForCausalLM
torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
model = LlamaForCausalLM(cfg).eval()
short, long = {SHORT}, {LONG}
pad = [{PAD}] * (len(long) - len(short))
with torch.no_grad():
    # rounds 0 and 1: both prompts in one batch, the short one padded on the left
    model.generate(input_ids=torch.tensor([pad + short, long]),
                   attention_mask=torch.tensor([[0] * len(pad) + [1] * len(short),
                                                [1] * len(long)]),
                   max_new_tokens=2, do_sample=False, pad_token_id={PAD})
    # rounds 2 and 3, 4 and 5: one at a time
    for prompt in (short, long):
        model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=2, do_sample=False,
                       pad_token_id={PAD})
print("OK")
"""


@pytest.fixture(scope="module")
def rounds(tmp_path_factory) -> dict[int, Path]:
    tmp = tmp_path_factory.mktemp("tokens")
    result = run_loaded(tmp, SCRIPT, config(task="all"))
    assert result.returncode == 0 and "OK" in result.stdout, result.stderr[-3000:]
    proc = only_proc(tmp / "atb_dump_data")
    found = {int(p.name): p for p in proc.iterdir()}
    assert sorted(found) == list(range(6))
    return found


def tokens_of(folder: Path) -> dict:
    return json.loads((folder / "tokens.json").read_text())


def spans(doc: dict) -> list[tuple]:
    return [(r["request"], r["row"], r["start"], r["stop"], r["position"], r["prompt_len"],
             r["prompt_head"]) for r in doc["requests"]]


def test_the_prefill_of_a_padded_batch_gives_each_row_its_real_tokens(rounds):
    doc = tokens_of(rounds[0])
    assert (doc["source"], doc["layout"], doc["tokens"], doc["rows"]) == \
        ("transformers", "batch", 5, 2)
    assert spans(doc) == [("row0", 0, 2, 5, 0, 3, SHORT), ("row1", 1, 0, 5, 0, 5, LONG)]
    assert [r["prompt_hash"] for r in doc["requests"]] == \
        [prompt_of(SHORT).digest, prompt_of(LONG).digest]


def test_a_decode_round_carries_its_rows_prompts_and_positions_after_them(rounds):
    doc = tokens_of(rounds[1])
    assert (doc["tokens"], doc["rows"]) == (1, 2)
    assert spans(doc) == [("row0", 0, 0, 1, 3, 3, SHORT), ("row1", 1, 0, 1, 5, 5, LONG)]
    assert [r["prompt_hash"] for r in doc["requests"]] == \
        [r["prompt_hash"] for r in tokens_of(rounds[0])["requests"]]


def test_the_same_prompts_run_alone_have_the_same_hashes(rounds):
    batched = [r["prompt_hash"] for r in tokens_of(rounds[0])["requests"]]
    alone = []
    for index, prompt in ((2, SHORT), (4, LONG)):
        prefill, decode = tokens_of(rounds[index]), tokens_of(rounds[index + 1])
        assert spans(prefill) == [("row0", 0, 0, len(prompt), 0, len(prompt), prompt)]
        assert spans(decode) == [("row0", 0, 0, 1, len(prompt), len(prompt), prompt)]
        alone.append(prefill["requests"][0]["prompt_hash"])
    assert alone == batched


def test_rounds_of_one_request_without_padding_have_no_request_statistics(rounds):
    assert all(not (rounds[i] / "request_statistic.csv").exists() for i in (2, 3, 4, 5))
    assert all((rounds[i] / "request_statistic.csv").exists() for i in (0, 1))


@pytest.mark.parametrize("index", [0, 1])
def test_request_statistics_of_a_layer_output_are_those_of_its_slice(rounds, index):
    folder = rounds[index]
    rows = read_csv(folder / "request_statistic.csv")
    assert list(rows[0]) == list(REQUEST_COLUMNS)
    layer = [r for r in rows if r["Op Name"] == "LlamaDecoderLayer" and r["Op Id"] == "2"
             and r["Input/Output"] == "output" and r["Index"] == "0"]
    assert [r["Request"] for r in layer] == ["row0", "row1"]
    tensor = load_numpy(folder / "2_LlamaDecoderLayer" / "after" / "outtensor0.bin")
    for row, span in zip(layer, tokens_of(folder)["requests"]):
        piece = tensor[span["row"]:span["row"] + 1, span["start"]:span["stop"]]
        assert row["Shape"] == "x".join(map(str, piece.shape))
        assert row["Tensor Path"] == "N/A"
        flat = piece.astype(np.float32).reshape(-1)
        assert float(row["Max"]) == float(flat.max()) and float(row["Min"]) == float(flat.min())
        assert math.isclose(float(row["Mean"]), float(flat.sum()) / flat.size, rel_tol=1e-5,
                            abs_tol=1e-7)
        assert math.isclose(float(row["Norm"]), math.sqrt(float(np.dot(flat, flat))),
                            rel_tol=1e-5)
    # the whole tensor's row in statistic.csv is another thing: both requests' tokens, and the
    # padding
    whole = [r for r in read_csv(folder / "statistic.csv") if r["Op Id"] == "2" and
             r["Input/Output"] == "output" and r["Index"] == "0"]
    assert whole[0]["Shape"] == "x".join(map(str, tensor.shape))
    assert {r["Norm"] for r in layer}.isdisjoint({whole[0]["Norm"]})


def test_every_request_row_names_a_tensor_of_statistic_csv_with_the_token_dimension(rounds):
    """... or, for a layer-level op, with a row per request (dim 0 the batch's rows)."""
    for index in (0, 1):
        folder = rounds[index]
        doc = tokens_of(folder)
        whole = {(r["Op Id"], r["Input/Output"], r["Index"]): r["Shape"]
                 for r in read_csv(folder / "statistic.csv")}
        per = read_csv(folder / "request_statistic.csv")
        keyed = {}
        for r in per:
            keyed.setdefault((r["Op Id"], r["Input/Output"], r["Index"]), []).append(r["Request"])
        dims = {k: [int(d) for d in shape.split("x")] for k, shape in whole.items() if shape}
        with_dim = {k for k, d in dims.items() if d[:2] == [doc["rows"], doc["tokens"]]}
        with_rows = {k for k, d in dims.items() if k not in with_dim and d[0] == doc["rows"]
                     and "_" not in k[0]}
        assert set(keyed) == with_dim | with_rows
        assert with_dim and all(v == ["row0", "row1"] for v in keyed.values())
        shapes = {(r["Op Id"], r["Input/Output"], r["Index"]): r["Shape"] for r in per}
        assert all(shapes[k] == "x".join(map(str, [1, *dims[k][1:]])) for k in with_rows)


def test_right_padding_puts_each_rows_span_first(tmp_path):
    model = tiny_llama()

    def run():
        with torch.no_grad():
            model(input_ids=torch.tensor([SHORT + [PAD, PAD], LONG]),
                  attention_mask=torch.tensor([[1, 1, 1, 0, 0], [1] * 5]))

    doc = tokens_of(only_proc(dump(tmp_path, config(task="statistics"), run)) / "0")
    assert spans(doc) == [("row0", 0, 0, 3, 0, 3, SHORT), ("row1", 1, 0, 5, 0, 5, LONG)]


def test_with_save_child_every_tensor_with_the_token_dimension_has_request_rows(tmp_path):
    model = tiny_llama()

    def run():
        with torch.no_grad():
            model(input_ids=torch.tensor([[PAD, PAD] + SHORT, LONG]),
                  attention_mask=torch.tensor([[0, 0, 1, 1, 1], [1] * 5]))

    folder = only_proc(dump(tmp_path, config(task="statistics", save_child=True), run)) / "0"
    per = read_csv(folder / "request_statistic.csv")
    assert any(r["Op Type"].endswith("Kernel") for r in per)
    whole = read_csv(folder / "statistic.csv")
    # ... and a layer-level op's tensors with a row per request (the decoder layers' mask)
    with_dim = [r for r in whole if r["Shape"].split("x")[:2] == ["2", "5"] or
                "_" not in r["Op Id"] and r["Shape"].split("x")[0] == "2"]
    assert len(per) == 2 * len(with_dim)
    assert [(r["Op Id"], r["Input/Output"], r["Index"]) for r in per[::2]] == \
        [(r["Op Id"], r["Input/Output"], r["Index"]) for r in with_dim]
    tokens = {(r["Op Id"], r["Input/Output"], r["Index"]) for r in with_dim
              if r["Shape"].split("x")[:2] == ["2", "5"]}
    assert {r["Shape"].split("x")[1] for r in per if r["Request"] == "row0" and
            (r["Op Id"], r["Input/Output"], r["Index"]) in tokens} == {"3"}


def test_a_decode_round_knows_its_prompts_when_the_prefill_was_not_dumped(tmp_path):
    model = tiny_llama()

    def run():
        with torch.no_grad():
            model.generate(input_ids=torch.tensor([[PAD, PAD] + SHORT, LONG]),
                           attention_mask=torch.tensor([[0, 0, 1, 1, 1], [1] * 5]),
                           max_new_tokens=2, do_sample=False, pad_token_id=PAD)

    proc = only_proc(dump(tmp_path, config(task="statistics", exec_range="1,1"), run))
    assert sorted(p.name for p in proc.iterdir()) == ["1"]
    assert spans(tokens_of(proc / "1")) == [("row0", 0, 0, 1, 3, 3, SHORT),
                                            ("row1", 1, 0, 1, 5, 5, LONG)]


def test_a_prompt_hash_is_sha1_of_its_ids_as_little_endian_int64():
    import hashlib
    ids = [1, 15043, 3186, 2, 7] + list(range(100, 120))
    prompt = prompt_of(ids)
    assert prompt.digest == hashlib.sha1(np.array(ids, dtype="<i8").tobytes()).hexdigest()[:16]
    assert (prompt.length, prompt.head) == (25, tuple(ids[:16]))
    assert prompt_of(ids[:-1]).digest != prompt.digest


def test_which_tensors_have_the_token_dimension_and_when_requests_are_split():
    from atb_probe.tokens import Arrangement, RequestSpan, Source, TokenLayout
    p = prompt_of(SHORT)
    one = RequestSpan("a", 0, 0, 5, 0, p)
    flat = TokenLayout(Source.VLLM, Arrangement.FLAT, 5, 1, (one,))
    assert not flat.per_request
    assert flat.has_token_dim((5, 32)) and flat.has_token_dim((5,)) and \
        not flat.has_token_dim((4, 5)) and not flat.has_token_dim(())
    padded = TokenLayout(Source.VLLM, Arrangement.FLAT, 8, 1, (one,))
    assert padded.per_request
    batch = TokenLayout(Source.TRANSFORMERS, Arrangement.BATCH, 5, 2,
                        (RequestSpan("row0", 0, 2, 5, 0, p), RequestSpan("row1", 1, 0, 5, 0, p)))
    assert batch.per_request
    assert batch.has_token_dim((2, 5, 32)) and not batch.has_token_dim((5, 2, 32)) and \
        not batch.has_token_dim((2,))
    many = TokenLayout(Source.VLLM, Arrangement.FLAT, 300, 1,
                       tuple(RequestSpan(f"r{i}", 0, i, i + 1, 7, p) for i in range(300)))
    for layout in (flat, batch, many):  # each request's row in a tensor with one per request
        assert layout.request_rows() == [layout.request_row(s) for s in layout.requests]
    assert batch.request_rows() == [0, 1] and many.request_rows()[-1] == 299


def _slices_by_hand(layout, t: torch.Tensor, by_row: bool) -> list | None:
    """Each request's slice of `t` and its Shape cell, as the spans say, or None."""
    from atb_probe.tokens import Arrangement
    shape = tuple(t.shape)
    if layout.has_token_dim(shape):
        if layout.arrangement is Arrangement.FLAT:
            return [(t[s.start:s.stop], s.request) for s in layout.requests]
        return [(t[s.row:s.row + 1, s.start:s.stop], s.request) for s in layout.requests]
    if by_row and layout.has_request_rows(shape):
        return [(t[r:r + 1], s.request) for r, s in zip(layout.request_rows(), layout.requests)]
    return None


@pytest.mark.parametrize("which", ["flat-decode", "flat-prefill", "batch-padded", "batch-rows"])
def test_a_rounds_cut_of_a_shape_gives_each_request_its_own_slice(which):
    from atb_probe.capture.requests import RequestSlices
    from atb_probe.statcsv import shape_cell
    from atb_probe.tokens import Arrangement, RequestSpan, Source, TokenLayout
    p = prompt_of(SHORT)
    if which == "flat-decode":    # a token per request, one after another: rows of one view
        layout = TokenLayout(Source.VLLM, Arrangement.FLAT, 4, 1,
                             tuple(RequestSpan(f"r{i}", 0, i, i + 1, 9, p) for i in range(4)))
    elif which == "flat-prefill":  # prompts of unequal length, and padding after them
        layout = TokenLayout(Source.VLLM, Arrangement.FLAT, 12, 1,
                             (RequestSpan("a", 0, 0, 3, 0, p), RequestSpan("b", 0, 3, 10, 0, p)))
    elif which == "batch-padded":  # left padding: each row's tokens start where they start
        layout = TokenLayout(Source.TRANSFORMERS, Arrangement.BATCH, 5, 3,
                             (RequestSpan("row0", 0, 2, 5, 0, p), RequestSpan("row1", 1, 0, 5, 0, p),
                              RequestSpan("row2", 2, 4, 5, 0, p)))
    else:                          # whole rows of equal length: one after another
        layout = TokenLayout(Source.TRANSFORMERS, Arrangement.BATCH, 3, 2,
                             (RequestSpan("row0", 0, 0, 3, 0, p), RequestSpan("row1", 1, 0, 3, 0, p)))
    slices = RequestSlices(layout)
    g = torch.Generator().manual_seed(0)
    tokens = (layout.tokens,) if layout.arrangement is Arrangement.FLAT else \
        (layout.rows, layout.tokens)
    tensors = [torch.randn(*tokens, 6, generator=g), torch.randn(*tokens, generator=g),
               torch.randn(*tokens, 2, 3, generator=g),
               torch.randn(6, *tokens, generator=g).movedim(0, -1),   # not contiguous
               torch.randn(len(layout.requests), 7, generator=g),      # a row per request
               torch.randn(3, 7, 11, generator=g)]                     # no part per request
    for t in tensors:
        for by_row in (False, True):
            expected = _slices_by_hand(layout, t, by_row)
            cut = slices.cut(t.shape, by_row)
            assert slices.cut(t.shape, by_row) is cut  # worked out once per round and shape
            if expected is None:
                assert cut is None
                continue
            assert cut.cells == [(shape_cell(tuple(piece.shape)), request)
                                 for piece, request in expected]
            for (piece, _), view in zip(expected, cut.pieces(t)):
                assert torch.equal(view, piece)
            if t.is_contiguous():
                flat = t.reshape(-1)
                for (piece, _), (start, stop) in zip(expected, cut.runs):
                    assert torch.equal(flat[start:stop], piece.reshape(-1))
                sizes = {stop - start for start, stop in cut.runs}
                together = all(cut.runs[k][1] == cut.runs[k + 1][0]
                               for k in range(len(cut.runs) - 1))
                assert cut.one_after_another == (len(sizes) == 1 and together and
                                                 0 not in sizes and len(cut.runs) > 1)
    if which in ("flat-decode", "batch-rows"):
        assert slices.cut(tensors[0].shape).one_after_another
    else:
        assert not slices.cut(tensors[0].shape).one_after_another


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_a_mask_read_whole_gives_what_the_cut_one_gives(data):
    """A small bool or integer mask is read whole, in one call into torch (capture/tokens.py);
    a float one is cut in torch first: the same spans and positions for the same 0/1 pattern."""
    rows = data.draw(st.integers(1, 4))
    width = data.draw(st.integers(1, 12))
    seq = data.draw(st.integers(1, width))
    bits = data.draw(st.lists(st.lists(st.booleans(), min_size=width, max_size=width),
                              min_size=rows, max_size=rows))
    dtype = data.draw(st.sampled_from([torch.bool, torch.int64, torch.int32, torch.uint8]))
    mask = torch.tensor(bits, dtype=dtype)
    assert _real_tokens(mask, rows, seq) == _real_tokens(mask.to(torch.float32), rows, seq)
