"""`atb-probe compare` of an ATB model's dump against a PyTorch golden run of the same model.

The target trees are built (atb_named.py) from a real atb-probe dump of a tiny three-layer
Llama whose third layer's v_proj was scaled by 10%, renamed and laid out the way an ATB Llama
dumps: `WordEmbedding, Prefill_layer x3, FinalNorm, LmHead` in round 0, `Decoder_layer` in
round 1, no rotary embedding op, [tokens, hidden] shapes, other layer inputs. The golden run is
the unchanged model dumped by atb-probe with PyTorch's names.
"""
from __future__ import annotations

import json

import pytest
import torch

from atb_probe import cli
from atb_probe.tools.compare import compare_dumps
from atb_probe.tools.comparison import CompareError
from atb_probe.tools.opmap import load_map

from atb_named import atb_tree, write_map
from conftest import dump, generate, tiny_llama
from harness import config

PERTURBED_V_PROJ = ("3_Prefill_layer/1_SelfAttention/6_Linear",
                    "4_LlamaDecoderLayer/1_LlamaAttention/6_Linear")


def llama3(tmp_path_factory, name, broken=False):
    model = tiny_llama(layers=3)
    if broken:
        with torch.no_grad():
            model.model.layers[2].self_attn.v_proj.weight.mul_(1.1)
    tmp = tmp_path_factory.mktemp(name)
    dump(tmp, config(task="all", save_child=True, filter_level=1, exec_range="0,1"),
         lambda: generate(model, prompt_len=4, new_tokens=2))
    return tmp


@pytest.fixture(scope="module")
def golden(tmp_path_factory):
    return llama3(tmp_path_factory, "torch_golden")


@pytest.fixture(scope="module")
def broken(tmp_path_factory):
    return llama3(tmp_path_factory, "torch_broken", broken=True)


@pytest.fixture(scope="module")
def atb_layers(broken, tmp_path_factory):
    """The ATB tree with layer-level ops only."""
    return atb_tree(broken, tmp_path_factory.mktemp("atb_layers"), children=False)


@pytest.fixture(scope="module")
def atb_children(broken, tmp_path_factory):
    """The ATB tree with every child op and kernel (attention renamed SelfAttention...)."""
    return atb_tree(broken, tmp_path_factory.mktemp("atb_children"))


@pytest.fixture(scope="module")
def llama_map(tmp_path_factory):
    return write_map(tmp_path_factory.mktemp("map"))


def test_layer_ops_of_different_names_are_paired_by_order_and_shape(golden, atb_layers):
    result = compare_dumps(str(golden), str(atb_layers))
    pairs = {(r.round_index, r.op_path, r.golden_op_path) for r in result.rows
             if r.io == "output"}
    assert pairs == {
        (0, "0_WordEmbedding", "0_Embedding"), (0, "1_Prefill_layer", "2_LlamaDecoderLayer"),
        (0, "2_Prefill_layer", "3_LlamaDecoderLayer"), (0, "3_Prefill_layer", "4_LlamaDecoderLayer"),
        (0, "4_FinalNorm", "5_LlamaRMSNorm"), (0, "5_LmHead", "6_Linear"),
        (1, "0_WordEmbedding", "0_Embedding"), (1, "1_Decoder_layer", "2_LlamaDecoderLayer"),
        (1, "2_Decoder_layer", "3_LlamaDecoderLayer"), (1, "3_Decoder_layer", "4_LlamaDecoderLayer"),
        (1, "4_FinalNorm", "5_LlamaRMSNorm"), (1, "5_LmHead", "6_Linear")}
    assert {r.match for r in result.rows} == {"order"}


def test_the_rotary_op_of_one_side_is_unmatched_not_a_failure(golden, atb_layers):
    result = compare_dumps(str(golden), str(atb_layers))
    ops = [u for u in result.unmatched if u.kind == "op" and u.what == "1_LlamaRotaryEmbedding"]
    assert [(u.side, u.where.rsplit("/", 1)[1]) for u in ops] == [("golden", "0"), ("golden", "1")]
    assert not [u for u in result.unmatched if u.side == "target"]


def test_layer_inputs_pair_by_shape_and_the_perturbed_layer_is_named_on_both_sides(golden,
                                                                                   atb_layers):
    result = compare_dumps(str(golden), str(atb_layers))
    inputs = {(r.name, r.golden.data_name) for r in result.rows
              if r.round_index == 0 and r.op_path == "3_Prefill_layer" and r.io == "input"}
    # hidden, cos, sin, mask in ATB's order against PyTorch's hidden, mask, positions, cos, sin
    assert inputs == {("3_Prefill_layer/input.0", "4_LlamaDecoderLayer/input.0"),
                      ("3_Prefill_layer/input.1", "4_LlamaDecoderLayer/input.3"),
                      ("3_Prefill_layer/input.2", "4_LlamaDecoderLayer/input.4"),
                      ("3_Prefill_layer/input.3", "4_LlamaDecoderLayer/input.1")}
    f = result.finding
    assert f is not None and f.inputs_clean
    assert (f.round_index, f.op_path, f.golden_op_path) == (0, "3_Prefill_layer",
                                                           "4_LlamaDecoderLayer")
    assert "round 0, 3_Prefill_layer ↔ 4_LlamaDecoderLayer (output.0)" in f.summary()
    before = [r for r in result.rows if r.round_index == 0 and r.order < f.row.order]
    assert before and all(r.metrics.max_abs_err == 0.0 for r in before)


def test_cli_names_both_sides_of_the_first_divergence(golden, atb_layers, tmp_path, capsys):
    out = tmp_path / "cmp"
    assert cli.main(["compare", str(golden), str(atb_layers), "-o", str(out), "--no-xlsx"]) == 0
    printed = capsys.readouterr().out
    assert "first divergence: round 0, 3_Prefill_layer ↔ 4_LlamaDecoderLayer (output.0)" in printed
    report = (out / "atb_compare_report.html").read_text()
    assert "<code>3_Prefill_layer</code> ↔ <code>4_LlamaDecoderLayer</code>" in report


def test_without_a_map_children_of_renamed_ops_are_paired_only_by_equal_names(golden,
                                                                              atb_children):
    result = compare_dumps(str(golden), str(atb_children))
    children = {(r.op_path, r.golden_op_path) for r in result.rows
                if r.round_index == 0 and r.op_path.startswith("3_Prefill_layer/")}
    assert children == {("3_Prefill_layer/2_AddTensorKernel", "4_LlamaDecoderLayer/2_AddTensorKernel"),
                        ("3_Prefill_layer/5_AddTensorKernel", "4_LlamaDecoderLayer/5_AddTensorKernel")}
    unmatched = {u.what.split("/", 1)[1] for u in result.unmatched
                 if u.kind == "op" and u.side == "target" and u.where.endswith("/0")}
    assert {"1_SelfAttention", "4_Mlp", "0_RmsNorm", "3_RmsNorm"} <= unmatched
    assert result.finding.op_path == "3_Prefill_layer"


def test_the_map_pairs_renamed_children_and_finds_the_changed_projection(golden, atb_children,
                                                                         llama_map):
    result = compare_dumps(str(golden), str(atb_children), opmap=load_map(llama_map))
    f = result.finding
    assert f is not None and f.inputs_clean
    assert (f.round_index, f.op_path, f.golden_op_path) == (0, *PERTURBED_V_PROJ)
    assert f.row.match == "map"
    assert f.first_inside == f"{PERTURBED_V_PROJ[0]}/0_TKernel/input.0"
    # What is left unmatched is what one side does not have: the rotary op, the position ids.
    assert {(u.side, u.what.split("/")[0].split("_", 1)[1], u.kind) for u in result.unmatched} \
        == {("golden", "LlamaRotaryEmbedding", "op"), ("golden", "LlamaDecoderLayer", "tensor")}


def test_parallel_jobs_give_the_same_rows_as_one(golden, atb_children, llama_map):
    opmap = load_map(llama_map)
    one = compare_dumps(str(golden), str(atb_children), opmap=opmap)
    two = compare_dumps(str(golden), str(atb_children), opmap=opmap, jobs=2,
                        batch_elements=4096)
    assert two.jobs == 2 and len(two.rows) == len(one.rows) > 1000
    assert two.rows == one.rows
    assert two.finding.summary() == one.finding.summary()


def test_a_map_in_json_is_read_like_yaml(tmp_path):
    path = tmp_path / "map.json"
    path.write_text(json.dumps({"ops": {"LmHead": "Linear"}, "outputs": {"LmHead": {"0": 0}}}))
    m = load_map(str(path))
    assert m.canonical("LmHead") == "Linear" and m.canonical("Linear") == "Linear"
    assert m.output_pairs("Linear", "LmHead") == {0: 0}


@pytest.mark.parametrize("text, message", [
    ("ops: [a, b]\n", "'ops' must map op names to op names"),
    ("ops: {a: b}\nlayers: {}\n", "expected a mapping with the keys 'ops'"),
    ("ops: {a: b}\noutputs: {a: {x: 1}}\n", "outputs of 'a' must map an output index"),
    ("ops: {a: [\n", "is not valid YAML"),
])
def test_a_bad_map_file_is_a_user_error_with_a_clear_message(golden, atb_layers, tmp_path,
                                                             capsys, text, message):
    path = tmp_path / "map.yaml"
    path.write_text(text)
    with pytest.raises(CompareError, match=message):
        load_map(str(path))
    assert cli.main(["compare", str(golden), str(atb_layers), "--map", str(path),
                     "-o", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()
