"""Modules with a parametrized tensor (`torch.nn.utils.parametrize`: new-style weight norm,
spectral norm, any `register_parametrization`) dump as the modules they are: named by their own
class, not the `Parametrized<Class>` torch swaps in, and never taken for a container because
of the list that computes their weight. So a weight-normed model pairs with the same model
whose weight norm was removed, or applied the old hook-based way (SPEC §1, §9)."""
from __future__ import annotations

import json
import re
import warnings

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrizations, parametrize

from atb_probe import cli
from conftest import dump, only_proc, read_csv
from harness import config


class Symmetric(nn.Module):
    """A parametrization of one's own: the weight is made symmetric when read."""

    def forward(self, w):
        return w.triu() + w.triu(1).transpose(0, 1)


def norm(style: str, conv: nn.Module) -> nn.Module:
    if style == "parametrization":
        return parametrizations.weight_norm(conv)
    if style == "hook":
        with warnings.catch_warnings():  # deprecated, and still found in models
            warnings.simplefilter("ignore", FutureWarning)
            return nn.utils.weight_norm(conv)  # the old way: a forward pre-hook, its class kept
    return conv


class Vocoder(nn.Module):
    """A vocoder's shape: weight-normed convolutions around a block list."""

    def __init__(self, style: str):
        super().__init__()
        torch.manual_seed(0)
        self.pre = norm(style, nn.Conv1d(4, 8, 3, padding=1))
        self.blocks = nn.ModuleList([nn.Conv1d(8, 8, 3, padding=1) for _ in range(2)])
        self.mix = nn.Linear(8, 8)
        self.post = norm(style, nn.Conv1d(8, 1, 3, padding=1))
        if style == "parametrization":
            parametrize.register_parametrization(self.mix, "weight", Symmetric())

    def forward(self, x):
        x = self.pre(x)
        for block in self.blocks:
            x = torch.relu(block(x))
        return self.post(self.mix(x.transpose(1, 2)).transpose(1, 2))


def rows_of(tmp_path, style: str, **cfg) -> list[tuple]:
    model, x = Vocoder(style).eval(), torch.randn(1, 4, 16)
    if style == "hook":  # the same values as the parametrized model's, symmetric included
        with torch.no_grad():
            model.mix.weight.copy_(Symmetric()(model.mix.weight))
    root = dump(tmp_path / style, config(task="statistics", **cfg), lambda: model(x))
    text = "\n".join(p.read_text() for p in root.rglob("*.json"))
    assert not re.search(r"Parametrized\w", text)  # ParametrizedConv1d, ParametrizedLinear
    return [(r["Op Name"], r["Op Id"], r["Input/Output"], r["Max"], r["Norm"])
            for r in read_csv(only_proc(root) / "0" / "statistic.csv")]


def test_a_parametrized_module_is_a_layer_level_op_named_by_its_class(tmp_path):
    rows = {style: rows_of(tmp_path, style) for style in ("parametrization", "hook", "none")}
    ops = [(name, op_id) for name, op_id, *_ in rows["parametrization"]]
    assert list(dict.fromkeys(ops)) == [("Conv1d", "0"), ("Conv1d", "1"), ("Conv1d", "2"),
                                        ("Linear", "3"), ("Conv1d", "4")]
    # The same weights either way: the same rows, values included.
    assert rows["parametrization"] == rows["hook"]
    # Without the weight norm the weights differ in their last bits: the same ops.
    assert [r[:3] for r in rows["none"]] == [r[:3] for r in rows["parametrization"]]


def test_what_computes_a_parametrized_weight_is_the_modules_child(tmp_path):
    rows = rows_of(tmp_path, "parametrization", save_child=True)
    names = list(dict.fromkeys((name, op_id) for name, op_id, *_ in rows))
    assert names[:5] == [("Conv1d", "0"), ("Conv1d/ParametrizationList/_WeightNorm", "0_0_0"),
                         ("Conv1d/ParametrizationList/_WeightNorm/WeightNormInterfaceKernel",
                          "0_0_0_0"),
                         ("Conv1d/ParametrizationList", "0_0"), ("Conv1d/ConvolutionKernel",
                                                                 "0_1")]
    # The old hook-based weight norm computes the weight in its pre-hook, inside the op too.
    hook = list(dict.fromkeys((name, op_id) for name, op_id, *_ in
                              rows_of(tmp_path, "hook", save_child=True)))
    assert hook[:3] == [("Conv1d", "0"), ("Conv1d/WeightNormInterfaceKernel", "0_0"),
                        ("Conv1d/ConvolutionKernel", "0_1")]


def test_structure_and_op_param_name_the_class_before_parametrization(tmp_path):
    model, x = Vocoder("parametrization").eval(), torch.randn(1, 4, 16)
    root = dump(tmp_path, config(task="tensor"), lambda: model(x))
    doc = json.loads(next(only_proc(root).glob("0/0_Conv1d/op_param.json")).read_text())
    assert doc["type"] == "Conv1d" and doc["class"] == "torch.nn.modules.conv.Conv1d"
    assert doc["modulePath"] == "pre"


# -- transformers' Wav2Vec2: its positional convolution is weight-normed -----------------------

def wav2vec2(removed: bool, fault: bool):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.Wav2Vec2Config(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=2)
    model = transformers.Wav2Vec2Model(cfg).eval()
    conv = model.encoder.pos_conv_embed.conv
    if not parametrize.is_parametrized(conv):
        pytest.skip("this transformers applies the old hook-based weight norm")
    if removed:  # as an inference implementation would: the weight computed once, kept
        for name in list(conv.parametrizations.keys()):
            parametrize.remove_parametrizations(conv, name, leave_parametrized=True)
    if fault:
        with torch.no_grad():
            conv.weight[:4] *= 3
    return model


def wav2vec2_dump(tmp_path, name: str, removed: bool = False, fault: bool = False):
    model = wav2vec2(removed, fault)
    audio = torch.randn(1, 400, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return dump(tmp_path / name, config(task="statistics"), lambda: model(audio))


def compare(tmp_path, golden, target, name: str) -> dict:
    out = tmp_path / name
    assert cli.main(["compare", str(golden), str(target), "-o", str(out), "--no-xlsx",
                     "--no-html"]) == 0
    return json.loads((out / "atb_compare_summary.json").read_text())


def test_a_fault_in_a_weight_normed_convolution_is_named_against_its_removed_norm(tmp_path):
    golden = wav2vec2_dump(tmp_path, "golden")
    clean = compare(tmp_path, golden, wav2vec2_dump(tmp_path, "removed", removed=True), "clean")
    assert clean["unmatched"] == [] and clean["diverged"] is False
    broken = compare(tmp_path, golden,
                     wav2vec2_dump(tmp_path, "fault", removed=True, fault=True), "broken")
    first = broken["first_divergence"]
    assert broken["unmatched"] == [] and broken["diverged"] is True
    for side in ("golden", "target"):
        assert first[side]["op_path"] == "3_Wav2Vec2PositionalConvEmbedding", first
    assert first["inputs"] == "clean"  # its inputs match: the convolution is the culprit
