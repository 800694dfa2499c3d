"""docs/format.md names everything the probe writes: every statistic.csv column, every key of
op_param.json, the structure files and the status file, every config key. A dump of a real
model (and of kernels that write arguments and allocate memory) is read back and each column
and key is looked for on the page, in backticks."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from torch import nn

from atb_probe.config import DEFAULTS
from atb_probe.statcsv import COLUMNS, REQUEST_COLUMNS

from conftest import dump, generate, tiny_llama
from harness import config

PAGE = Path(__file__).resolve().parent.parent / "docs" / "format.md"


_LIB = torch.library.Library("atbprobe_format", "DEF")
_LIB.define("fill_into(Tensor x, Tensor(a!) out) -> ()")


def _fill_into(x, out):
    out.copy_(x)


_LIB.impl("fill_into", _fill_into, "CPU")


class WritesAndAllocates(nn.Module):
    """A kernel that writes into the buffer it is given, a buffer fresh from `torch.empty`."""

    def forward(self, x):
        buffer = torch.empty_like(x)
        torch.ops.atbprobe_format.fill_into(x, buffer)
        return buffer * 2


@pytest.fixture(scope="module")
def named() -> set[str]:
    """Every word the page puts in backticks (a cell like `Max`, `Min` counts each)."""
    words = set()
    text = re.sub(r"```.*?```", "", PAGE.read_text(), flags=re.S)  # code blocks
    for span in re.findall(r"`([^`\n]+)`", text):
        words.update(w.strip() for w in span.split(","))
        words.add(span)
    return words


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("format")

    def run():
        model = tiny_llama()
        generate(model, 4, 2)
        with torch.no_grad():  # two rows, one padded: tokens.json and request_statistic.csv
            model.generate(input_ids=torch.tensor([[0, 5, 6], [1, 2, 3]]),
                           attention_mask=torch.tensor([[0, 1, 1], [1, 1, 1]]),
                           max_new_tokens=1, do_sample=False, pad_token_id=0)
        with torch.inference_mode():
            WritesAndAllocates()(torch.ones(3))

    return dump(tmp, config(task="all", save_child=True), run)


def keys_of(paths) -> set[str]:
    keys = set()
    for p in paths:
        keys.update(json.loads(p.read_text()))
    return keys


def node_keys(node: dict) -> set[str]:
    keys = set(node)
    for child in node.get("nodes", []):
        keys |= node_keys(child)
    return keys


def test_every_statistic_csv_column_is_on_the_page(named, written):
    header = next(written.rglob("statistic.csv")).read_text().splitlines()[0].split(",")
    assert header == list(COLUMNS)
    assert set(header) - named == set()


def test_every_request_statistic_csv_column_is_on_the_page(named, written):
    header = next(written.rglob("request_statistic.csv")).read_text().splitlines()[0]
    assert header.split(",") == list(REQUEST_COLUMNS)
    assert set(REQUEST_COLUMNS) - named == set()


def test_every_tokens_json_key_is_on_the_page(named, written):
    docs = [json.loads(p.read_text()) for p in written.rglob("tokens.json")]
    assert docs
    keys = set().union(*(set(d) for d in docs))
    request_keys = set().union(*(set(r) for d in docs for r in d["requests"]))
    assert (keys | request_keys) - named == set()


def test_every_op_param_key_is_on_the_page(named, written):
    keys = keys_of(written.rglob("op_param.json"))
    assert {"written", "uninitialized", "modulePath", "op"} <= keys  # the dump has them all
    assert keys - named == set()


def test_every_structure_file_key_is_on_the_page(named, written):
    layer = set()
    for p in (written / "info" / "layer").rglob("*.json"):
        layer |= node_keys(json.loads(p.read_text()))
    models = [json.loads(p.read_text()) for p in (written / "info" / "model").rglob("*.json")]
    model = set().union(*(set(m) for m in models))
    nodes = set().union(*(set(n) for m in models for n in m["nodes"]))
    assert (layer | model | nodes) - named == set()


def test_every_status_and_config_key_is_on_the_page(named, written):
    status = keys_of((written / "status").glob("*.json"))
    assert status - named == set()
    assert set(DEFAULTS) - named == set()
