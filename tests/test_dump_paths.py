"""The dump tree's paths, built and parsed in one torch-free module (SPEC §5)."""
from __future__ import annotations

import sys

from atb_probe import layout
from harness import run


def test_layout_does_not_import_torch():
    code = "import sys, atb_probe.layout; print('torch' in sys.modules)"
    out = run([sys.executable, "-c", code], timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr


def test_process_round_and_op_paths_follow_the_spec_tree():
    name = layout.devpid(1, 4242)
    assert name == "1_4242"
    assert layout.process_dir(name) == "data/1_4242"
    assert layout.round_dir(name, 3) == "data/1_4242/3"
    assert layout.round_csv("data/1_4242/3") == "data/1_4242/3/statistic.csv"
    layer = layout.op_folder(2, "LlamaDecoderLayer")
    assert layer == "2_LlamaDecoderLayer"
    child = layout.child_op_dir(layer, 1, "LlamaAttention")
    assert child == "2_LlamaDecoderLayer/1_LlamaAttention"
    assert layout.op_path("2_1", "LlamaDecoderLayer/LlamaAttention") == child


def test_tensor_files_go_before_and_after_with_their_index():
    assert layout.tensor_rel("0_Embedding", "input", 0) == "0_Embedding/before/intensor0.bin"
    assert layout.tensor_rel("0_Embedding", "output", "1_last_hidden_state") == \
        "0_Embedding/after/outtensor1_last_hidden_state.bin"
    assert layout.side_dir("input") == "before" and layout.side_dir("output") == "after"


def test_tensor_file_names_parse_back_to_side_and_index():
    assert layout.parse_tensor_file("intensor0_hidden_states.bin") == ("input", "0_hidden_states")
    assert layout.parse_tensor_file("outtensor2.bin") == ("output", "2")
    assert layout.parse_tensor_file("op_param.json") is None
    assert layout.parse_tensor_file("intensor0.bin.tmp") is None


def test_devpid_and_op_folder_names_parse_back():
    assert layout.parse_devpid("0_123") == (0, 123)
    assert layout.parse_devpid("rank0") is None
    assert layout.parse_devpid("0_123_4") is None
    assert layout.parse_op_folder("2_LlamaDecoderLayer") == ("2", "LlamaDecoderLayer")
    assert layout.parse_op_folder("12_My_Op") == ("12", "My_Op")
    assert layout.parse_op_folder("before") is None
    assert layout.parse_op_folder("x_Linear") is None


def test_structure_and_status_files():
    assert layout.layer_info_dir("0_7") == "info/layer/0_7"
    assert layout.layer_info_dir("0_7", "Draft") == "info/layer/0_7/Draft"
    assert layout.layer_info_file("LlamaDecoderLayer", "2") == "LlamaDecoderLayer_2.json"
    assert layout.model_info_dir("0_7") == "info/model/0_7"
    assert layout.info_dir("model", "0_7") == "info/model/0_7"
    assert layout.model_info_file("LlamaForCausalLM", "Prefill") == "LlamaForCausalLM_Prefill.json"
    assert layout.status_file("0_7") == "0_7.json"
    assert layout.parse_status_file("0_7.json") == "0_7"
    assert layout.parse_status_file(".0_7.json.tmp") is None


def test_dump_root_accepts_the_output_or_the_dump_folder(tmp_path):
    root = tmp_path / "atb_dump_data"
    assert layout.dump_root(str(tmp_path)) == str(root)
    assert layout.dump_root(str(root)) == str(root)


def test_a_round_folder_is_a_round_index_with_a_csv_or_in_a_process_folder(tmp_path):
    in_process = tmp_path / "atb_dump_data" / "data" / "0_99" / "4"
    (in_process / "0_Embedding" / "after").mkdir(parents=True)
    moved = tmp_path / "copied" / "7"
    moved.mkdir(parents=True)
    (moved / "statistic.csv").write_text("")
    bare = tmp_path / "elsewhere" / "5"
    bare.mkdir(parents=True)
    assert layout.is_round_dir(str(in_process))
    assert layout.is_round_dir(str(moved))
    assert not layout.is_round_dir(str(bare))
    assert not layout.is_round_dir(str(in_process / "0_Embedding"))
    tensor = in_process / "0_Embedding" / "after" / "outtensor0.bin"
    assert layout.round_dir_of(str(tensor)) == str(in_process)
    assert layout.round_dir_of(str(bare / "x.bin")) is None
    assert layout.root_of_process(str(in_process.parent)) == str(tmp_path / "atb_dump_data")
    assert layout.root_of_process(str(moved.parent)) is None


def test_a_written_tensor_path_is_found_below_its_round_wherever_it_was_written():
    written = "/home/someone/run/atb_dump_data/data/0_42/3/2_Layer/after/outtensor0.bin"
    assert layout.below_round(written) == "2_Layer/after/outtensor0.bin"
    assert layout.below_round("/tmp/x/outtensor0.bin") is None
    assert layout.below_round("/r/atb_dump_data/data/0_42/3") is None
