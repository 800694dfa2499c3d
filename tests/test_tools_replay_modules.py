"""`atb-probe replay TARGET OP --weights PATH`: a module op replayed as a whole, its class built
and loaded with the user's checkpoint. A real tiny Llama saved with save_pretrained (random
weights), loaded by the target process, which makes one decoder layer's weight 1% larger and is
dumped at layer level: the layer replayed with the clean checkpoint introduced error, the others
did not."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import tiny_llama
from harness import cli, config, run_loaded
from test_tools_replay import small_dump

TARGET = """
import torch
from transformers import LlamaForCausalLM
model = LlamaForCausalLM.from_pretrained({checkpoint!r}).eval()
with torch.no_grad():
    model.model.layers[1].mlp.down_proj.weight.mul_(1.01)
prompt = torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(0))
with torch.no_grad():
    model(prompt, use_cache=False)                                  # round 0
    model.generate(prompt, max_new_tokens=1, do_sample=False, pad_token_id=0)   # round 1
print("OK")
"""
CHANGED = "3_LlamaDecoderLayer"       # model.layers.1
UNCHANGED = "2_LlamaDecoderLayer"     # model.layers.0


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("checkpoint")
    tiny_llama().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def target(tmp_path_factory, checkpoint) -> Path:
    tmp = tmp_path_factory.mktemp("target")
    result = run_loaded(tmp, TARGET.format(checkpoint=str(checkpoint)),
                        config(task="tensor", save_child=False))
    assert result.returncode == 0 and "OK" in result.stdout, result.stdout + result.stderr
    return tmp


def replay(*args):
    return cli("replay", *map(str, args))


def record(out, path: Path) -> dict:
    assert out.returncode in (0, 1), out.stdout + out.stderr
    records = json.loads(path.read_text())
    assert len(records) == 1, records
    return records[0]


def test_the_layer_with_the_changed_weight_introduced_error(target, checkpoint, tmp_path):
    out = replay(target, CHANGED, "--round", "0", "--weights", checkpoint, "--json",
                 tmp_path / "r.json")
    found = record(out, tmp_path / "r.json")
    assert out.returncode == 1
    assert found["verdict"] == "introduced here"
    assert found["op"] == "transformers.models.llama.modeling_llama.LlamaDecoderLayer"
    assert found["op_path"] == CHANGED and found["outputs"][0]["introduced"] is True
    assert f"introduced here: round 0, 3 ({CHANGED})" in out.stdout


def test_another_layer_did_not(target, checkpoint, tmp_path):
    out = replay(target, UNCHANGED, "--round", "0", "--weights", checkpoint, "--json",
                 tmp_path / "r.json")
    found = record(out, tmp_path / "r.json")
    assert out.returncode == 0
    assert found["verdict"] == "within its dtype"
    assert found["outputs"][0]["error"] <= found["outputs"][0]["bound"]


def test_a_safetensors_file_and_a_module_built_from_its_settings(target, checkpoint, tmp_path):
    # lm_head: a Linear, built from its extra_repr; its weight found under its module path.
    out = replay(target, "5_Linear", "--round", "0", "--weights",
                 checkpoint / "model.safetensors", "--json", tmp_path / "r.json")
    assert record(out, tmp_path / "r.json")["verdict"] == "within its dtype"


def test_an_argument_held_as_an_object_is_named_as_missing(target, checkpoint, tmp_path):
    # generate's layers get a DynamicCache: the dump holds its name, not its contents.
    out = replay(target, CHANGED, "--round", "1", "--weights", checkpoint, "--json",
                 tmp_path / "r.json")
    found = record(out, tmp_path / "r.json")
    assert (found["verdict"], found["reason"]) == ("not replayed", "argument not recorded")
    assert "`cache` was recorded as <transformers.cache_utils.DynamicCache>" in found["detail"]


def test_weights_that_lack_a_parameter_say_which(target, tmp_path):
    lone = tmp_path / "lone"
    from safetensors.torch import save_file
    import torch
    lone.mkdir()
    save_file({"weight": torch.zeros(3)}, str(lone / "model.safetensors"))
    out = replay(target, CHANGED, "--round", "0", "--weights", lone, "--json",
                 tmp_path / "r.json")
    found = record(out, tmp_path / "r.json")
    assert found["verdict"] == "not replayed"
    assert "model.layers.1.self_attn.q_proj.weight" in found["detail"]


def test_without_weights_replay_lists_the_kernels_it_can_replay(tmp_path):
    root = small_dump(tmp_path / "d")
    out = replay(root, "0", "-j", "1")
    assert "0 is a module op (" in out.stdout and "needs its weights" in out.stdout
    listed = [line for line in out.stdout.splitlines() if line.startswith("  0_")]
    assert any(line.endswith("aten.mul.Tensor") for line in listed), out.stdout
    assert any("cannot be replayed: random op" in line for line in listed), out.stdout


def test_without_weights_or_kernels_replay_says_none_were_dumped(target):
    out = replay(target, CHANGED)
    assert out.returncode == 2
    assert "no kernel below it was dumped (dump with save_child true)" in out.stdout


def test_weights_for_a_kernel_are_refused(target, checkpoint):
    out = replay(target, "9_9", "--weights", checkpoint)
    assert out.returncode == 2 and "--weights replays a module op" in out.stderr


# -- torch modules built from what extra_repr says without names -------------------------------

BLOCKS = """
import torch
from torch import nn


class Scaled(nn.Module):
    def __init__(self, size, act="tanh", bias=True):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.bias = nn.Parameter(torch.zeros(size)) if bias else None
        self.act = act

    def forward(self, x):
        y = getattr(torch, self.act)(x.transpose(1, 2) * self.weight)
        return (y if self.bias is None else y + self.bias).transpose(1, 2)

    def extra_repr(self):  # says neither bias=False nor act as a value
        return f"{self.weight.shape[0]}" + (
            f", act={getattr(torch, self.act)}" if self.act != "tanh" else "")
"""

CNN = """
import torch
from torch import nn
from safetensors.torch import save_file
from replayblocks import Scaled
torch.manual_seed(0)
model = nn.Sequential(nn.Conv1d(4, 8, 3, padding=1, padding_mode="reflect"), nn.GroupNorm(2, 8),
                      nn.Conv1d(8, 8, 3, bias=False), Scaled(8, act="sigmoid"),
                      Scaled(8, bias=False)).eval()
embedding = nn.Embedding(10, 4)
save_file(model.state_dict(), {weights!r})
save_file(embedding.state_dict(), {weights!r}.replace("clean", "embedding"))
with torch.no_grad():
    model[2].weight.mul_(1.01)
    model(torch.randn(1, 4, 16))                     # round 0
    embedding(torch.tensor([[1, 2, 3]]))             # round 1: a model of its own
print("OK")
"""


@pytest.fixture(scope="module")
def cnn(tmp_path_factory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("cnn")
    (tmp / "replayblocks.py").write_text(BLOCKS)
    weights = tmp / "clean.safetensors"
    result = run_loaded(tmp, CNN.format(weights=str(weights)),
                        config(task="tensor", save_child=False))
    assert result.returncode == 0 and "OK" in result.stdout, result.stdout + result.stderr
    return tmp, weights


@pytest.mark.parametrize("op, verdict", [
    ("0_Conv1d", "within its dtype"),    # `4, 8, kernel_size=(3,), ..., padding_mode=reflect`
    ("1_GroupNorm", "within its dtype"),  # `2, 8, eps=1e-05, affine=True`
    ("2_Conv1d", "introduced here"),     # `..., bias=False`, and its weight 1% larger
])
def test_torch_modules_built_from_their_unnamed_settings(cnn, op, verdict, tmp_path):
    target, weights = cnn
    out = replay(target, op, "--weights", weights, "--json", tmp_path / "r.json")
    found = record(out, tmp_path / "r.json")
    assert found["verdict"] == verdict, found


def test_an_embedding_is_built_from_its_sizes(cnn, tmp_path):
    target, weights = cnn
    out = replay(target, "0_Embedding", "--round", "1", "--weights",
                 weights.with_name("embedding.safetensors"), "--json", tmp_path / "r.json")
    assert record(out, tmp_path / "r.json")["verdict"] == "within its dtype"


@pytest.mark.parametrize("op, missing", [
    ("3_Scaled", "needs `act`, which extra_repr gives as <built-in method sigmoid"),
    ("4_Scaled", "Scaled(size=8) built here has bias, which the dump does not list"),
])
def test_a_module_whose_settings_the_dump_does_not_give_is_not_guessed(cnn, op, missing,
                                                                      tmp_path):
    target, weights = cnn
    out = cli("replay", target, op, "--weights", weights, "--json", tmp_path / "r.json",
              cwd=target)  # where replayblocks is
    found = record(out, tmp_path / "r.json")
    assert (found["verdict"], found["reason"]) == ("not replayed", "argument not recorded")
    assert missing in found["detail"], found["detail"]
