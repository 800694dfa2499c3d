"""The writer's JSON text is the standard library's, character for character."""
from __future__ import annotations

import enum
import json
from collections import OrderedDict
from pathlib import PurePosixPath

import pytest
import torch
from hypothesis import example, given, settings, strategies as st

from atb_probe.record.jsontext import dumps


def _standard(doc) -> str:
    return json.dumps(doc, indent=2, ensure_ascii=False, default=str)


class Color(enum.IntEnum):
    RED = 1


class Level(float):
    pass


class Name(str):
    pass


_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-10 ** 30, 10 ** 30),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
    st.sampled_from([Color.RED, Level(2.5), Name("n\u00e9\n\"x\""), torch.float32,
                     PurePosixPath("/a/b"), b"bytes", 1 + 2j, "\ud800", "\x00\x1f\u2028"]))
_keys = st.one_of(st.text(max_size=8), st.integers(-5, 5), st.floats(allow_nan=True),
                  st.booleans(), st.none())
_docs = st.recursive(
    _scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=6), st.lists(inner, max_size=6).map(tuple),
                            st.lists(st.text(max_size=5), max_size=6),
                            st.lists(st.integers(-99, 99), max_size=6),
                            st.dictionaries(_keys, inner, max_size=6)),
    max_leaves=40)


_SPECIAL = [float("nan"), float("inf"), float("-inf"), -0.0, 1e300, 5e-324]


@settings(max_examples=1000, deadline=None)
@given(_docs)
@example(_SPECIAL)
@example({x: x for x in _SPECIAL})
@example([{True: False, None: [1, "a", 2.5, None]}, (), {"k": ()}])
def test_any_document_gives_the_standard_librarys_text(doc):
    assert dumps(doc) == _standard(doc)


def test_the_documents_the_probe_writes_give_the_standard_librarys_text():
    node = {"opName": "LlamaDecoderLayer_2", "opType": "LlamaDecoderLayer",
            "param": {"type": "LlamaDecoderLayer", "dtype": "bfloat16", "extra_repr": "",
                      "parameters": {"mlp.up_proj.weight": [2816, 1024]}, "args": {}},
            "inTensors": [f"LlamaDecoderLayer_2_input_{i}" for i in range(3)],
            "outTensors": [], "internalTensors": [],
            "nodes": [{"opName": "MmKernel_0", "nodes": [], "param": {"alpha": 1.0}}]}
    tokens = {"requests": [{"id": "r0", "tokens": list(range(64)), "mask": [True, False]}],
              "positions": [[0, 1], [2, 3]], "nothing": OrderedDict()}
    for doc in (node, tokens, [], {}, "top", 3, None, [[]], {"": {"": []}}):
        assert dumps(doc) == _standard(doc)


def test_what_it_cannot_write_goes_to_the_standard_library():
    with pytest.raises(TypeError):  # a key json refuses: refused the same way
        dumps({(1, 2): 3})
    looped: list = []
    looped.append(looped)
    with pytest.raises(ValueError, match="Circular reference"):
        dumps({"a": looped})
