"""`atb-probe compare` of a vLLM-style dump against its `transformers` golden run, with the
built-in conventions (SPEC §9). The target is the same tiny Llama written the way vLLM writes
it (vllm_like.py: fused residual, fused projections, flat tensors, logits processor and
sampler), dumped by the probe like the golden run; tests/engines/ runs vLLM itself."""
from __future__ import annotations

import pytest
import torch

from atb_probe import cli
from atb_probe.tools.compare import compare_dumps
from atb_probe.tools.opmap import load_map

import vllm_like
from conftest import dump, tiny_llama
from harness import config

NEW_TOKENS = 3
DUMP = config(task="tensor", save_child=True, filter_level=1)
DOWN_PROJ = ("2_LlamaDecoderLayer/3_LlamaMLP/2_RowParallelLinear",
             "3_LlamaDecoderLayer/4_LlamaMLP/4_Linear")
BUILT_IN = "vLLM against transformers (built in)"


def prompt() -> torch.Tensor:
    return torch.randint(0, 64, (6,), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def golden(tmp_path_factory):
    return golden_dump(tmp_path_factory.mktemp("golden"))


def golden_dump(tmp, cfg: dict = DUMP):
    """transformers' generate of the prompt: its dump and its tokens."""
    model = tiny_llama()
    out = {}

    def run():
        with torch.no_grad():
            ids = prompt()[None]   # (it holds the pad token: attend to every token)
            ids = model.generate(ids, attention_mask=torch.ones_like(ids),
                                 max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
        out["tokens"] = ids[0, 6:].tolist()
    return dump(tmp, cfg, run), out["tokens"]


def vllm_dump(tmp, perturb: float = 0.0, cfg: dict = DUMP):
    """The vLLM-style Llama on the golden's weights, layer 1's down_proj weight changed by
    `perturb` times its spread: its dump and its tokens."""
    engine = vllm_like.LlamaForCausalLM(tiny_llama())
    if perturb:
        w = engine.model.layers[1].mlp.down_proj.weight
        with torch.no_grad():
            w += torch.randn(w.shape, generator=torch.Generator().manual_seed(1)) * w.std() \
                * perturb
    out = {}
    root = dump(tmp, cfg, lambda: out.update(tokens=vllm_like.generate(engine, prompt(),
                                                                         NEW_TOKENS)))
    return root, out["tokens"]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return vllm_dump(tmp_path_factory.mktemp("target"))


def layer_rows(result):
    return [r for r in result.rows if r.layer.endswith("_LlamaDecoderLayer")
            and r.op_path == r.layer]


def test_the_vllm_style_model_generates_what_transformers_does(golden, target):
    assert golden[1] == target[1]


def test_with_no_flags_every_decoder_layer_is_compared_and_nothing_diverges(golden, target):
    result = compare_dumps(str(golden[0]), str(target[0]))
    assert result.conventions == BUILT_IN
    assert result.finding is None
    layers = layer_rows(result)
    assert len(layers) == 2 * 2 * NEW_TOKENS   # each layer's input and output, every round
    assert all(r.metrics.cosine > 0.99999 and r.metrics.one_thousandth_ratio > 0.99
               for r in layers)
    first, second = (r.target.data_name for r in layers[:2])
    assert first == "1_LlamaDecoderLayer/input.1"            # the first layer: no residual
    assert second == "1_LlamaDecoderLayer/output.0+output.1"
    assert layers[2].target.data_name == "2_LlamaDecoderLayer/input.1+input.2"
    assert not [u for u in result.unmatched if not u.expected]


def test_ops_without_a_counterpart_by_convention_are_not_ops_that_could_not_be_judged(
        golden, target):
    result = compare_dumps(str(golden[0]), str(target[0]))
    expected = [u for u in result.unmatched if u.expected and u.side == "target"]
    assert any(u.what.endswith("_Sampler") for u in expected)   # the sampler, among others
    assert result.unjudged == []


def test_modules_inside_the_layers_pair_by_attribute_and_fused_ones_with_a_concatenation(
        golden, target):
    result = compare_dumps(str(golden[0]), str(target[0]))
    pairs = {r.target.data_name.split("/", 1)[1]: r.golden.data_name.split("/", 1)[1]
             for r in result.rows if r.round_index == 0 and r.layer == "2_LlamaDecoderLayer"}
    assert pairs["0_RMSNorm/input.0_x+input.1_residual"] == "0_LlamaRMSNorm/input.0_hidden_states"
    assert pairs["1_LlamaAttention/0_QKVParallelLinear/output.0"] == \
        "1_LlamaAttention/0_Linear/cat(q_proj:output.0,k_proj:output.0,v_proj:output.0)"
    o_proj = [k for k in pairs if k.endswith("_RowParallelLinear/output.0")]
    assert [pairs[k] for k in o_proj] == ["1_LlamaAttention/33_Linear/output.0",
                                          "4_LlamaMLP/4_Linear/output.0"]
    assert pairs["3_LlamaMLP/0_MergedColumnParallelLinear/output.0"] == \
        "4_LlamaMLP/0_Linear/cat(gate_proj:output.0,up_proj:output.0)"
    assert all(r.metrics.cosine is not None for r in result.rows if r.target.shape != "1")
    assert not any("Kernel" in r.name for r in result.rows)


def test_either_dump_may_be_golden(golden, target):
    one = compare_dumps(str(golden[0]), str(target[0]))
    other = compare_dumps(str(target[0]), str(golden[0]))
    assert other.conventions == BUILT_IN and other.finding is None
    assert sorted(r.name for r in other.rows) == sorted(r.golden.data_name for r in one.rows)


def test_without_the_conventions_the_layers_are_not_compared(golden, target):
    result = compare_dumps(str(golden[0]), str(target[0]), conventions=False)
    assert result.conventions == ""
    assert not any(r.metrics.cosine for r in layer_rows(result) if r.io == "output")


def test_a_perturbed_mlp_weight_is_named_with_its_layer_and_module(golden, tmp_path):
    root, tokens = vllm_dump(tmp_path, perturb=0.01)
    assert tokens == golden[1]
    result = compare_dumps(str(golden[0]), str(root))
    f = result.finding
    assert (f.round_index, f.op_path, f.golden_op_path) == (0, *DOWN_PROJ), f.summary()
    assert f.inputs_clean


def test_without_save_child_the_verdict_names_the_layer(tmp_path):
    layers_only = config(task="tensor", filter_level=1)
    g_root, g_tokens = golden_dump(tmp_path / "golden", layers_only)
    t_root, t_tokens = vllm_dump(tmp_path / "target", 0.01, layers_only)
    assert t_tokens == g_tokens
    f = compare_dumps(str(g_root), str(t_root)).finding
    assert (f.round_index, f.op_path, f.golden_op_path, f.row.name) == (
        0, "2_LlamaDecoderLayer", "3_LlamaDecoderLayer",
        "2_LlamaDecoderLayer/output.0+output.1"), f.summary()
    assert f.inputs_clean


def test_a_user_map_adds_to_the_built_in_one(golden, target, tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("tensors:\n  LogitsProcessor: [[input.0, input.0]]\n")
    result = compare_dumps(str(golden[0]), str(target[0]), opmap=load_map(str(path)))
    assert result.conventions == f"vLLM against transformers (built in and {path})"
    logits = [r for r in result.rows if r.layer == "4_LogitsProcessor"]
    assert [r.io for r in logits] == ["input"] * NEW_TOKENS


def test_compare_says_which_conventions_it_used(golden, target, tmp_path, capsys):
    assert cli.main(["compare", str(golden[0]), str(target[0]), "-o", str(tmp_path / "out"),
                     "--no-xlsx", "--no-html", "-j", "1"]) == 0
    shown = capsys.readouterr().out
    assert f"conventions: {BUILT_IN}" in shown and "no counterpart by convention" in shown
    assert "could not be matched" not in shown and "no divergence" in shown
