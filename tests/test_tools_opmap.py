"""Op maps as data (opmap.py, conventions/): the format's parsing, the derived tensors, and the
choice of a built-in map. Pure: no torch, no dump."""
from __future__ import annotations

import os
import re

import numpy as np
import pytest

from atb_probe.layout import Side
from atb_probe.statcsv import Stats
from atb_probe.tools.comparison import CompareError, Role
from atb_probe.tools.conventions import FOLDER, built_in, choose
from atb_probe.tools.dumpreader import Op, TensorRecord
from atb_probe.tools.opmap import (DerivedTensor, DeriveKind, Derivation, Expr, OpMap,
                                   TensorKey, load_map, resolve)

VLLM = {"VocabParallelEmbedding", "LlamaDecoderLayer", "RMSNorm", "LogitsProcessor", "Sampler",
        "QKVParallelLinear", "EmbeddingKernel"}
TRANSFORMERS = {"Embedding", "LlamaRotaryEmbedding", "LlamaDecoderLayer", "LlamaRMSNorm",
                "Linear", "EmbeddingKernel"}


def write(tmp_path, text: str, name: str = "map.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def record(op_id: str, op_name: str, io: str, index: str, shape: str = "4x8",
           stats: Stats | None = None, order: int = 0) -> TensorRecord:
    return TensorRecord(None, op_id, op_name, Side(io), index, "float", shape, stats, None,
                        order, {})


def op(op_id: str, op_name: str, *tensors: tuple[str, str]) -> Op:
    return Op(op_id, op_name, [record(op_id, op_name, io, index, order=k)
                               for k, (io, index) in enumerate(tensors)])


# -- the format ---------------------------------------------------------------------------------

def test_a_map_of_only_ops_and_outputs_reads_as_before(tmp_path):
    m = load_map(write(tmp_path, "ops: {Prefill_layer: LlamaDecoderLayer, Decoder_layer: "
                                 "LlamaDecoderLayer}\noutputs: {Prefill_layer: {0: 0}}\n"))
    assert m.canonical("Prefill_layer") == m.canonical("Decoder_layer") == "LlamaDecoderLayer"
    assert m.output_pairs("LlamaDecoderLayer", "Prefill_layer") == {0: 0}
    assert not m.tensors and not m.none and m.kernels


def test_a_left_name_may_stand_for_several_right_names(tmp_path):
    m = load_map(write(tmp_path, "ops: {RMSNorm: [LlamaRMSNorm, Qwen2RMSNorm]}\n"))
    assert m.canonical("RMSNorm") == m.canonical("LlamaRMSNorm") == m.canonical("Qwen2RMSNorm")
    assert m.names("Qwen2RMSNorm") and not m.names("Linear")


def test_tensor_pairs_parse_into_derivations(tmp_path):
    m = load_map(write(tmp_path, """
tensors:
  Layer:
    - [{sum: [input.1, input.2]}, input.0]
    - [output.0, {concat: [q/output.0, k/output.0], dim: 1}]
    - [{slice: output.hidden, dim: 0, start: 2, stop: 4}, output.0]
"""))
    summed, cat, part = m.tensors["Layer"]
    assert summed.left == Expr((TensorKey("", Side.INPUT, "1"), TensorKey("", Side.INPUT, "2")),
                               Derivation(DeriveKind.SUM))
    assert cat.right.derive == Derivation(DeriveKind.CONCAT, 1)
    assert [k.module for k in cat.right.parts] == ["q", "k"]
    assert part.left.derive == Derivation(DeriveKind.SLICE, 0, 2, 4)
    assert part.left.parts[0].index == "hidden"


@pytest.mark.parametrize("text, message", [
    ("tensors: {Layer: [[input.x.y, input.0]]}\n", "is not a tensor"),
    ("tensors: {Layer: [[{sum: [input.0], concat: [input.1]}, input.0]]}\n", "one of sum"),
    ("tensors: {Layer: [[{concat: input.0}, input.0]]}\n", "takes a list of tensors"),
    ("tensors: {Layer: [[{slice: input.0, stop: x}, input.0]]}\n", "are integers"),
    ("tensors: {Layer: [input.0]}\n", "list of [left, right] tensor pairs"),
    ("fused: {qkv_proj: q_proj}\n", "'fused' maps a module name"),
    ("none: Sampler\n", "'none' is a list"),
    ("kernels: maybe\n", "'kernels' is true or false"),
    ("recognise: {both: [A]}\n", "'recognise' has 'left' and 'right'"),
    ("sides: [a]\n", "'sides' names the left and the right side"),
    ("ops: {a: b}\nlayers: {}\n", "expected a mapping with the keys 'ops'"),
])
def test_a_bad_map_says_what_is_wrong(tmp_path, text, message):
    with pytest.raises(CompareError, match=re.escape(message)):
        load_map(write(tmp_path, text))


def test_a_key_names_a_tensor_by_number_or_by_parameter_name():
    assert TensorKey.parse("input.1").matches(Side.INPUT, "1_hidden_states")
    assert TensorKey.parse("input.hidden_states").matches(Side.INPUT, "1_hidden_states")
    assert TensorKey.parse("input.1").matches(Side.INPUT, "1")
    assert not TensorKey.parse("input.1").matches(Side.OUTPUT, "1")
    assert not TensorKey.parse("input.1").matches(Side.INPUT, "10_x")


# -- derived tensors ----------------------------------------------------------------------------

def test_a_sum_adds_a_concat_joins_and_a_slice_cuts():
    a, b = np.arange(6.0).reshape(2, 3), np.ones((2, 3))
    assert np.array_equal(Derivation(DeriveKind.SUM).apply([a, b]), a + b)
    assert Derivation(DeriveKind.CONCAT).apply([a, b]).shape == (2, 6)
    assert Derivation(DeriveKind.CONCAT, 0).shape([(2, 3), (5, 3)]) == (7, 3)
    cut = Derivation(DeriveKind.SLICE, -1, 1, 3)
    assert np.array_equal(cut.apply([a]), a[:, 1:3]) and cut.shape([(2, 3)]) == (2, 2)
    with pytest.raises(ValueError, match="cannot add"):
        Derivation(DeriveKind.SUM).apply([a, np.ones(3)])


def test_the_statistics_of_a_concatenation_come_from_its_parts():
    a, b = np.array([1.0, -2.0, 3.0]), np.array([4.0, 0.5])
    stats = [Stats(x.max(), x.min(), x.mean(), float(np.linalg.norm(x))) for x in (a, b)]
    whole = np.concatenate([a, b])
    got = Derivation(DeriveKind.CONCAT).stats(stats, [3, 2])
    assert got == pytest.approx(Stats(whole.max(), whole.min(), whole.mean(),
                                      float(np.linalg.norm(whole))))
    assert Derivation(DeriveKind.SUM).stats(stats, [3, 3]) is None


def test_a_sum_without_one_of_its_parts_is_the_other_part_itself():
    first = op("1", "LlamaDecoderLayer", ("input", "0"), ("input", "1"))
    later = op("2", "LlamaDecoderLayer", ("input", "0"), ("input", "1"), ("input", "2"))
    expr = Expr.parse({"sum": ["input.1", "input.2"]})
    assert resolve(expr, first, {}) is first.tensors[1]
    derived = resolve(expr, later, {})
    assert isinstance(derived, DerivedTensor)
    assert derived.parts == later.tensors[1:] and derived.shape == "4x8"
    assert derived.data_name == "2_LlamaDecoderLayer/input.1+input.2"
    assert derived.io == Side.INPUT and derived.path is None


def test_a_concat_spans_the_ops_of_a_fused_group_and_needs_them_all():
    q = op("2_1_0", "D/A/Linear", ("input", "0_input"), ("output", "0"))
    k = op("2_1_3", "D/A/Linear", ("input", "0_input"), ("output", "0"))
    expr = Expr.parse({"concat": ["q/output.0", "k/output.0"]})
    derived = resolve(expr, q, {"q": q, "k": k})
    assert derived.parts == [q.tensors[1], k.tensors[1]] and derived.shape == "4x16"
    assert derived.data_name == "2_D/1_A/0_Linear/cat(q:output.0,k:output.0)"
    assert resolve(expr, q, {"q": q}) is None


# -- sides and the choice of a built-in map -----------------------------------------------------

def test_the_left_side_is_the_dump_holding_the_recognised_names(tmp_path):
    m = load_map(write(tmp_path, "recognise: {left: [VocabParallelEmbedding], "
                                 "right: [Embedding]}\n"))
    assert m.left_role(TRANSFORMERS, VLLM) == Role.TARGET
    assert m.left_role(VLLM, TRANSFORMERS) == Role.GOLDEN
    assert m.left_role(VLLM, VLLM) is None and m.left_role(TRANSFORMERS, TRANSFORMERS) is None


def test_without_recognise_the_left_side_holds_the_names_only_the_left_of_ops_has(tmp_path):
    m = load_map(write(tmp_path, "ops: {WordEmbedding: Embedding, LmHead: Linear}\n"))
    assert m.left_role({"Embedding", "Linear"}, {"WordEmbedding", "LmHead"}) == Role.TARGET


def test_every_built_in_map_reads():
    maps = built_in()
    assert len(maps) == len([n for n in os.listdir(FOLDER) if n.endswith(".yaml")]) >= 1
    assert all(m.source == "built in" and m.name and m.tensors for m in maps)


def test_vllm_against_transformers_is_chosen_from_the_op_names_either_way():
    for g, t, left in ((TRANSFORMERS, VLLM, Role.TARGET), (VLLM, TRANSFORMERS, Role.GOLDEN)):
        chosen = choose(g, t)
        assert chosen.opmap.title() == "vLLM against transformers (built in)"
        assert chosen.left == left
    assert choose(TRANSFORMERS, TRANSFORMERS) is None
    assert choose(TRANSFORMERS, VLLM, automatic=False) is None


def test_user_entries_win_over_the_built_in_ones(tmp_path):
    user = load_map(write(tmp_path, "ops: {RMSNorm: MyNorm}\nnone: [Extra]\n"
                                    "tensors: {LogitsProcessor: [[output.0, output.0]]}\n"))
    chosen = choose(TRANSFORMERS, VLLM, user)
    m = chosen.opmap
    assert m.canonical("RMSNorm") == m.canonical("MyNorm")
    assert m.has_none("Extra", None) and m.has_none("Sampler", None)
    assert len(m.tensors["LogitsProcessor"]) == 1 and "LlamaDecoderLayer" in m.tensors
    assert m.title().endswith("(built in and " + str(tmp_path / "map.yaml") + ")")


def test_a_none_entry_with_a_dot_names_a_module_by_its_attribute():
    m = OpMap(none=frozenset({".rotary_emb", "Sampler"}))
    assert m.has_none("LlamaRotaryEmbedding", "model.rotary_emb")
    assert m.has_none("Sampler", None) and not m.has_none("Linear", "model.layers.0.mlp")


def test_a_rule_for_one_pair_of_names_wins_over_the_rule_for_the_left_name(tmp_path):
    m = load_map(write(tmp_path, """
tensors:
  Embed: [[input.0, input.0], [output.0, output.0]]
  Embed:ScaledEmbed: [[input.0, input.0]]
opaque: [MoE]
"""))
    assert len(m.rules("Embed", "ScaledEmbed")) == 1 and len(m.rules("Embed", "Embedding")) == 2
    assert m.rules("Other", "Embedding") is None and m.opaque == {"MoE"}
