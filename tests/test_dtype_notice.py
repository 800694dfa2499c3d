"""The dtype a model runs in against its checkpoint's `torch_dtype`: said once, at the first
dumped round, on stderr and in the status file, naming both; nothing said when they agree.
(An engine that loads a float32 checkpoint as bfloat16 makes the first case: vLLM's CPU build
does unless started with `--dtype float32`.)"""
from __future__ import annotations

import pytest

from harness import config, run_loaded, status_of

SCRIPT = """
import torch
from transformers import LlamaConfig, LlamaForCausalLM
torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, torch_dtype="float32")
model = LlamaForCausalLM(cfg).to(torch.{runs_in}).eval()
with torch.no_grad():
    model.generate(torch.arange(4).unsqueeze(0), max_new_tokens=3, do_sample=False,
                   pad_token_id=0)
"""


@pytest.mark.parametrize("runs_in", ["bfloat16", "float32"])
def test_a_model_running_in_another_dtype_than_its_checkpoint_says_so_once(tmp_path, runs_in):
    result = run_loaded(tmp_path, SCRIPT.format(runs_in=runs_in),
                        config(task="statistics", exec_range="all"))
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stderr.splitlines() if "checkpoint's config says" in line]
    notice = status_of(tmp_path / "atb_dump_data")["dtype_notice"]
    if runs_in == "float32":
        assert lines == [] and notice is None
        return
    assert len(lines) == 1, result.stderr
    assert "runs in bfloat16" in lines[0] and "torch_dtype float32" in lines[0]
    assert "LlamaForCausalLM" in lines[0]
    assert notice and notice in lines[0]
    assert "deprecated" not in result.stderr  # the config is read without its old alias
