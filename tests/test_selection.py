"""Which ops are written (SPEC §3 "Selection"): the pure rules, then on a real model."""
from __future__ import annotations


import pytest

from atb_probe.config import parse_config
from atb_probe.selection import Selection

from conftest import dump, dump_first_round, generate, only_proc, op_dirs, read_csv, tiny_llama
from harness import config


def selection(**overrides) -> Selection:
    import json
    cfg, _ = parse_config(json.dumps(config(**overrides)))
    return Selection(cfg)


def test_default_selects_layer_level_ops_only():
    s = selection()
    assert s.layer_plan("2", "LlamaDecoderLayer").dump
    assert not s.layer_plan("2", "LlamaDecoderLayer").track_children
    assert s.child_selected("2_1", "LlamaDecoderLayer/LlamaAttention", "LlamaAttention",
                            False) == (False, False)


def test_ids_without_save_child_are_exact():
    s = selection(ids="2,3_1")
    assert s.layer_plan("2", "X").dump and not s.layer_plan("20", "X").dump
    assert not s.layer_plan("3", "X").dump and s.layer_plan("3", "X").track_children
    assert s.child_selected("3_1", "X/Y", "Y", False) == (True, False)
    assert s.child_selected("3_1_0", "X/Y/Z", "Z", False) == (False, False)
    assert s.child_selected("2_0", "X/Y", "Y", False) == (False, False)


def test_ids_with_save_child_select_the_subtree_with_a_boundary():
    s = selection(ids="2", save_child=True)
    plan = s.layer_plan("2", "X")
    assert plan.dump and plan.dump_children and plan.track_children
    assert not s.layer_plan("20", "X").dump
    assert s.child_selected("2_0_3", "X/Y/Z", "Z", plan.dump_children) == (True, True)


def test_op_name_without_save_child_matches_own_name_prefix_case_insensitively():
    s = selection(op_name="llamaattention,MmK")
    assert s.op_matches("2_1", "LlamaDecoderLayer/LlamaAttention", "LlamaAttention")
    assert s.op_matches("2_1_3", "LlamaDecoderLayer/LlamaAttention/MmKernel", "MmKernel")
    assert not s.op_matches("2", "LlamaDecoderLayer", "LlamaDecoderLayer")
    assert not s.op_matches("2_1_0", "LlamaDecoderLayer/LlamaAttention/Linear", "Linear")


def test_op_name_with_save_child_matches_full_name_or_any_segment():
    s = selection(op_name="llamaattention", save_child=True)
    assert s.op_matches("2_1", "LlamaDecoderLayer/LlamaAttention", "LlamaAttention")
    assert s.op_matches("2_1_0", "LlamaDecoderLayer/LlamaAttention/Linear", "Linear")
    assert not s.op_matches("2_2", "LlamaDecoderLayer/LlamaMLP", "LlamaMLP")
    s = selection(op_name="llamadecoder", save_child=True)
    assert s.op_matches("2", "LlamaDecoderLayer", "LlamaDecoderLayer")


def test_ids_and_op_name_together_either_is_enough():
    s = selection(ids="0", op_name="linear")
    assert s.layer_plan("0", "Embedding").dump
    assert s.layer_plan("5", "Linear").dump
    assert not s.layer_plan("4", "LlamaRMSNorm").dump


@pytest.mark.parametrize("exec_range,device,rounds", [
    ("all", "", {0, 1, 2}), ("none", "", set()), ("1,2", "", {1, 2}), ("0,0,2,2", "", {0, 2}),
    ("all", "0", {0, 1, 2}), ("all", "1", set()), ("all", "3,0", {0, 1, 2}),
])
def test_round_and_device_filters(exec_range, device, rounds):
    s = selection(exec_range=exec_range, device=device)
    assert {r for r in range(3) if s.round_selected(r, 0)} == rounds


def test_dump_enable_false_selects_no_round():
    assert not selection(dump_enable=False).round_selected(0, 0)


# -- on a real model ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def llama():
    return tiny_llama()


def test_model_ids_exact(tmp_path, llama):
    assert op_dirs(dump_first_round(tmp_path, llama, ids="2,5")) == \
        ["2_LlamaDecoderLayer", "5_Linear"]


def test_model_child_id_without_save_child(tmp_path, llama):
    dirs = op_dirs(dump_first_round(tmp_path, llama, ids="2_1"))
    assert dirs == ["2_LlamaDecoderLayer", "2_LlamaDecoderLayer/1_LlamaAttention"]
    assert not (dump_first_round(tmp_path / "b", llama, ids="2_1") /
                "2_LlamaDecoderLayer" / "before").exists()


def test_model_op_name_prefix(tmp_path, llama):
    round0 = dump_first_round(tmp_path, llama, op_name="LLAMADEC")
    assert op_dirs(round0) == ["2_LlamaDecoderLayer", "3_LlamaDecoderLayer"]
    assert {r["Op Type"] for r in read_csv(round0 / "statistic.csv")} == {"LlamaDecoderLayer"}


def test_model_op_name_finds_ops_at_any_depth(tmp_path, llama):
    round0 = dump_first_round(tmp_path, llama, op_name="llamamlp")
    assert [d for d in op_dirs(round0) if d.endswith("LlamaMLP")] == [
        "2_LlamaDecoderLayer/4_LlamaMLP", "3_LlamaDecoderLayer/4_LlamaMLP"]  # kernels count too
    ops = {r["Op Name"] for r in read_csv(round0 / "statistic.csv")}
    assert ops == {"LlamaDecoderLayer/LlamaMLP"}


def test_model_exec_range_pairs(tmp_path, llama):
    root = dump(tmp_path, config(exec_range="1,1,3,3"), lambda: generate(llama, 4, 4))
    assert sorted(p.name for p in only_proc(root).iterdir()) == ["1", "3"]


def test_model_device_filter(tmp_path, llama):
    mine = dump(tmp_path / "a", config(device="0"), lambda: generate(llama, 4, 1))
    assert (only_proc(mine) / "0").is_dir()
    other = dump(tmp_path / "b", config(device="1"), lambda: generate(llama, 4, 1))
    assert not list((other / "data").glob("*/*"))
