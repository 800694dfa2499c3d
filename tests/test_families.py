"""The op model of SPEC §1 on every family (§7): which modules are layer-level ops, module paths,
several models in one process, IDs that do not depend on the filters.

Every model is a real `transformers` (or plain torch) model built from a tiny config with random
weights; the layer-level ops are read back from the structure files the probe wrote.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from hypothesis import given, strategies as st
from torch import nn

from conftest import dump, generate, only_proc, read_csv, tiny_llama
from harness import config


def _model_files(root: Path) -> dict[str, dict]:
    """{file name without .json: document} of every info/model file."""
    return {p.stem: json.loads(p.read_text()) for p in (root / "info" / "model").rglob("*.json")}


def _layer_ops(doc: dict) -> list[str]:
    """A model file's layer-level ops as `<opName>@<modulePath>`."""
    return [f"{n['opName']}@{n['modulePath']}" for n in doc["nodes"]]


def _statistics_dump(tmp: Path, run, **overrides) -> Path:
    with torch.no_grad():
        return dump(tmp, config(task="statistics", exec_range="all", **overrides), run)


def tiny_bert():
    from transformers import BertConfig, BertForSequenceClassification
    torch.manual_seed(0)
    return BertForSequenceClassification(BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=64)).eval()


def tiny_t5():
    from transformers import T5Config, T5ForConditionalGeneration
    torch.manual_seed(0)
    return T5ForConditionalGeneration(T5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
        decoder_start_token_id=0)).eval()


def tiny_whisper():
    from transformers import WhisperConfig, WhisperForConditionalGeneration
    torch.manual_seed(0)
    return WhisperForConditionalGeneration(WhisperConfig(
        vocab_size=64, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=8,
        max_source_positions=16, max_target_positions=32, decoder_start_token_id=1,
        pad_token_id=0, eos_token_id=2, bos_token_id=1)).eval()


def tiny_llava():
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, \
        LlavaForConditionalGeneration
    torch.manual_seed(0)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=4, image_size=16, patch_size=8,
                              projection_dim=32)
    text = LlamaConfig(vocab_size=80, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlavaForConditionalGeneration(LlavaConfig(
        vision_config=vision, text_config=text, image_token_index=70, vision_feature_layer=-1,
        image_seq_length=4)).eval()


def tiny_resnet():
    from transformers import ResNetConfig, ResNetForImageClassification
    torch.manual_seed(0)
    return ResNetForImageClassification(ResNetConfig(
        embedding_size=8, hidden_sizes=[8, 16], depths=[1, 2], num_labels=3)).eval()


def test_decoder_only_layers_are_the_blocks_and_the_modules_beside_them(tmp_path):
    root = _statistics_dump(tmp_path, lambda: generate(tiny_llama(), 4, 1))
    assert _layer_ops(_model_files(root)["LlamaForCausalLM_Prefill"]) == [
        "Embedding_0@model.embed_tokens", "LlamaRotaryEmbedding_1@model.rotary_emb",
        "LlamaDecoderLayer_2@model.layers.0", "LlamaDecoderLayer_3@model.layers.1",
        "LlamaRMSNorm_4@model.norm", "Linear_5@lm_head"]


def test_encoder_only_layers_are_found_below_the_base_model(tmp_path):
    model = tiny_bert()
    root = _statistics_dump(tmp_path, lambda: model(torch.randint(0, 64, (1, 6))))
    assert _layer_ops(_model_files(root)["BertForSequenceClassification_Forward"]) == [
        "BertEmbeddings_0@bert.embeddings", "BertLayer_1@bert.encoder.layer.0",
        "BertLayer_2@bert.encoder.layer.1", "BertPooler_3@bert.pooler", "Dropout_4@dropout",
        "Linear_5@classifier"]


def test_encoder_decoder_blocks_are_ops_although_they_hold_lists(tmp_path):
    """A T5Block holds a list of sub-layers, yet as an element of the block list it is one op;
    `generate` runs the encoder on its own, so it is a model of its own."""
    model = tiny_t5()
    root = _statistics_dump(tmp_path, lambda: model.generate(
        torch.randint(0, 64, (1, 6)), max_new_tokens=2, do_sample=False))
    files = _model_files(root)
    assert _layer_ops(files["T5Stack_Prefill"]) == [
        "Embedding_0@embed_tokens", "Dropout_1@dropout", "T5Block_2@block.0",
        "T5Block_3@block.1", "T5LayerNorm_4@final_layer_norm", "Dropout_5@dropout"]
    assert files["T5Stack_Prefill"]["rounds"] == [[0, 0]]
    assert _layer_ops(files["T5ForConditionalGeneration_Prefill"]) == [
        "Embedding_0@decoder.embed_tokens", "Dropout_1@decoder.dropout",
        "T5Block_2@decoder.block.0", "T5Block_3@decoder.block.1",
        "T5LayerNorm_4@decoder.final_layer_norm", "Dropout_5@decoder.dropout",
        "Linear_6@lm_head"]
    assert files["T5ForConditionalGeneration_Prefill"]["rounds"] == [[1, 1]]
    assert files["T5ForConditionalGeneration_Decoder"]["rounds"] == [[2, 2]]


def test_speech_encoder_decoder_layers_in_both_stacks(tmp_path):
    model = tiny_whisper()
    root = _statistics_dump(tmp_path, lambda: model.generate(
        torch.randn(1, 8, 32), max_new_tokens=2, do_sample=False))
    files = _model_files(root)
    assert _layer_ops(files["WhisperEncoder_Forward"]) == [
        "Conv1d_0@conv1", "Conv1d_1@conv2", "Embedding_2@embed_positions",
        "WhisperEncoderLayer_3@layers.0", "WhisperEncoderLayer_4@layers.1",
        "LayerNorm_5@layer_norm"]
    assert _layer_ops(files["WhisperForConditionalGeneration_Prefill"]) == [
        "Embedding_0@model.decoder.embed_tokens",
        "WhisperPositionalEmbedding_1@model.decoder.embed_positions",
        "WhisperDecoderLayer_2@model.decoder.layers.0",
        "WhisperDecoderLayer_3@model.decoder.layers.1", "LayerNorm_4@model.decoder.layer_norm",
        "Linear_5@proj_out"]


def test_speech_encoder_with_a_weight_normed_convolution(tmp_path):
    """Wav2Vec2's positional convolution is weight-normed (`torch.nn.utils.parametrize`): its
    module is an op as any other (test_parametrized.py)."""
    from transformers import Wav2Vec2Config, Wav2Vec2Model
    torch.manual_seed(0)
    model = Wav2Vec2Model(Wav2Vec2Config(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=2)).eval()
    with torch.no_grad():
        root = _statistics_dump(tmp_path, lambda: model(torch.randn(1, 400)))
    assert _layer_ops(_model_files(root)["Wav2Vec2Model_Forward"]) == [
        "Wav2Vec2GroupNormConvLayer_0@feature_extractor.conv_layers.0",
        "Wav2Vec2NoLayerNormConvLayer_1@feature_extractor.conv_layers.1",
        "Wav2Vec2FeatureProjection_2@feature_projection",
        "Wav2Vec2PositionalConvEmbedding_3@encoder.pos_conv_embed",
        "LayerNorm_4@encoder.layer_norm", "Dropout_5@encoder.dropout",
        "Wav2Vec2EncoderLayer_6@encoder.layers.0", "Wav2Vec2EncoderLayer_7@encoder.layers.1"]


def test_vision_language_layers_of_both_towers_in_execution_order(tmp_path):
    model = tiny_llava()
    ids = torch.tensor([[1, 70, 70, 70, 70, 5, 6]])
    root = _statistics_dump(tmp_path, lambda: model(input_ids=ids,
                                                    pixel_values=torch.randn(1, 3, 16, 16)))
    assert _layer_ops(_model_files(root)["LlavaForConditionalGeneration_Prefill"]) == [
        "Embedding_0@model.language_model.embed_tokens",
        "CLIPVisionEmbeddings_1@model.vision_tower.embeddings",
        "LayerNorm_2@model.vision_tower.pre_layrnorm",
        "CLIPEncoderLayer_3@model.vision_tower.encoder.layers.0",
        "CLIPEncoderLayer_4@model.vision_tower.encoder.layers.1",
        "LayerNorm_5@model.vision_tower.post_layernorm",
        "LlavaMultiModalProjector_6@model.multi_modal_projector",
        "LlamaRotaryEmbedding_7@model.language_model.rotary_emb",
        "LlamaDecoderLayer_8@model.language_model.layers.0",
        "LlamaDecoderLayer_9@model.language_model.layers.1",
        "LlamaRMSNorm_10@model.language_model.norm", "Linear_11@lm_head"]


def test_cnn_stages_are_ops(tmp_path):
    model = tiny_resnet()
    root = _statistics_dump(tmp_path, lambda: model(torch.randn(1, 3, 32, 32)))
    assert _layer_ops(_model_files(root)["ResNetForImageClassification_Forward"]) == [
        "ResNetEmbeddings_0@resnet.embedder", "ResNetStage_1@resnet.encoder.stages.0",
        "ResNetStage_2@resnet.encoder.stages.1", "AdaptiveAvgPool2d_3@resnet.pooler",
        "Flatten_4@classifier.0", "Linear_5@classifier.1"]


def test_plain_sequential_each_module_is_an_op(tmp_path):
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 8), nn.ReLU()),
                        nn.Linear(8, 2))
    root = _statistics_dump(tmp_path, lambda: mlp(torch.randn(2, 4)))
    # An element of a block list is an op even when it is a block list itself.
    assert _layer_ops(_model_files(root)["Sequential_Forward"]) == [
        "Linear_0@0", "ReLU_1@1", "Sequential_2@2", "Linear_3@3"]


def test_a_one_layer_list_is_still_a_block_list(tmp_path):
    model = tiny_llama(layers=1)
    root = _statistics_dump(tmp_path, lambda: generate(model, 4, 1))
    assert "LlamaDecoderLayer_2@model.layers.0" in \
        _layer_ops(_model_files(root)["LlamaForCausalLM_Prefill"])


def test_ids_select_the_same_op_whatever_the_filter(tmp_path):
    model = tiny_bert()
    tokens = torch.randint(0, 64, (1, 6))

    def rows(sub: str, **overrides) -> list[dict]:
        root = _statistics_dump(tmp_path / sub, lambda: model(tokens), **overrides)
        return read_csv(only_proc(root) / "0" / "statistic.csv")

    everything = rows("all")
    chosen = rows("ids", ids="2")
    assert {r["Op Id"] for r in chosen} == {"2"}
    assert [r for r in everything if r["Op Id"] == "2"] == chosen
    assert chosen[0]["Op Name"] == "BertLayer"


def test_module_paths_in_op_param_and_structure_files(tmp_path):
    model = tiny_llama()
    root = dump(tmp_path, config(exec_range="0,0", ids="2", save_child=True),
                lambda: generate(model, 4, 1))
    layer = only_proc(root) / "0" / "2_LlamaDecoderLayer"
    assert json.loads((layer / "op_param.json").read_text())["modulePath"] == "model.layers.0"
    attention = json.loads((layer / "1_LlamaAttention" / "op_param.json").read_text())
    assert attention["modulePath"] == "model.layers.0.self_attn"
    q_proj = json.loads((layer / "1_LlamaAttention" / "0_Linear" / "op_param.json").read_text())
    assert q_proj["modulePath"] == "model.layers.0.self_attn.q_proj"

    structure = json.loads(next((root / "info" / "layer").rglob("LlamaDecoderLayer_2.json"))
                           .read_text())
    assert structure["modulePath"] == "model.layers.0"
    attention_node = next(n for n in structure["nodes"] if n["opType"] == "LlamaAttention")
    assert attention_node["modulePath"] == "model.layers.0.self_attn"
    assert attention_node["nodes"][0]["modulePath"] == "model.layers.0.self_attn.q_proj"
    kernels = [n for n in structure["nodes"] if n["opType"].endswith("Kernel")]
    assert kernels and all("modulePath" not in n for n in kernels)


def test_speculative_decoding_models_keep_their_own_structure_files(tmp_path):
    """A draft and a main model of the same class: two model names, no file overwritten, and
    every dumped round traced to one of them."""
    main = tiny_llama(layers=2, seed=0)
    draft = tiny_llama(layers=1, seed=1)
    prompt = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(0))
    root = dump(tmp_path, config(task="statistics", exec_range="all", save_child=True),
                lambda: main.generate(prompt, assistant_model=draft, max_new_tokens=4,
                                      do_sample=False, pad_token_id=0))
    files = _model_files(root)
    names = {doc["modelType"] for doc in files.values()}
    assert names == {"LlamaForCausalLM", "LlamaForCausalLM_1"}
    layer_counts = {doc["modelType"]: sum(n["opType"] == "LlamaDecoderLayer" for n in doc["nodes"])
                    for doc in files.values()}
    assert sorted(layer_counts.values()) == [1, 2]

    described = [i for doc in files.values() for lo, hi in doc["rounds"]
                 for i in range(lo, hi + 1)]
    dumped = sorted(int(p.name) for p in only_proc(root).iterdir())
    assert sorted(described) == dumped  # each round in exactly one model file

    proc = only_proc(root).name
    layer_root = root / "info" / "layer" / proc
    first = next(doc["modelType"] for doc in files.values() if [0, 0] in doc["rounds"])
    second = ({"LlamaForCausalLM", "LlamaForCausalLM_1"} - {first}).pop()
    assert (layer_root / second).is_dir() and not (layer_root / first).exists()
    decoder_files = {p.relative_to(layer_root).as_posix()
                     for p in layer_root.rglob("LlamaDecoderLayer_*.json")}
    assert f"{second}/LlamaDecoderLayer_2.json" in decoder_files
    assert "LlamaDecoderLayer_2.json" in decoder_files


def tiny_mamba():
    from transformers import MambaConfig, MambaForCausalLM
    torch.manual_seed(0)
    return MambaForCausalLM(MambaConfig(vocab_size=64, hidden_size=32, state_size=4,
                                        num_hidden_layers=2, expand=2, conv_kernel=4)).eval()


def test_state_space_rounds_after_the_prompt_are_decoder_rounds(tmp_path):
    """Mamba's cache holds no tokens to count, only states: the rounds whose cache already
    holds state from earlier tokens are `Decoder`, the prompt's is `Prefill`."""
    model = tiny_mamba()
    root = _statistics_dump(tmp_path, lambda: generate(model, 6, 4))
    files = _model_files(root)
    assert files["MambaForCausalLM_Prefill"]["rounds"] == [[0, 0]]
    assert files["MambaForCausalLM_Decoder"]["rounds"] == [[1, 3]]


def test_model_file_lists_its_rounds(tmp_path):
    model = tiny_llama()
    root = dump(tmp_path, config(task="statistics", exec_range="0,1,3,5"),
                lambda: generate(model, 4, 6))
    files = _model_files(root)
    assert files["LlamaForCausalLM_Prefill"]["rounds"] == [[0, 0]]
    assert files["LlamaForCausalLM_Decoder"]["rounds"] == [[1, 1], [3, 5]]


@given(st.lists(st.integers(0, 60), unique=True, max_size=40))
def test_model_file_rounds_are_sorted_ranges_whatever_order_rounds_end_in(order):
    """Threads serving one model end their rounds in any order."""
    from atb_probe.capture.structure import ModelFile
    file = ModelFile("info/model/0_1", {"rounds": []})
    for index in order:
        file.add_round(index)
    expected: list[list[int]] = []
    for index in sorted(order):
        if expected and expected[-1][1] + 1 == index:
            expected[-1][1] = index
        else:
            expected.append([index, index])
    assert file.doc["rounds"] == expected


def test_a_lazy_module_is_dumped_from_its_first_call(tmp_path, capfd):
    """`nn.LazyLinear` has no parameter shapes before its first forward: that round still
    dumps without an internal error, its op_param.json says so, and a later round lists the
    shapes the forward gave it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.LazyLinear(3)).eval()
    x = torch.randn(2, 4)
    root = dump(tmp_path, config(task="tensor", exec_range="0,1"),
                lambda: [model(x) for _ in range(2)])
    assert "internal error" not in capfd.readouterr().err
    proc = only_proc(root)
    first = json.loads((proc / "0" / "2_LazyLinear" / "op_param.json").read_text())
    later = json.loads((proc / "1" / "2_LazyLinear" / "op_param.json").read_text())
    assert first["parameters"] == {"weight": "uninitialized", "bias": "uninitialized"}
    assert later["parameters"] == {"weight": [3, 8], "bias": [3]}
    assert (proc / "0" / "2_LazyLinear" / "after" / "outtensor0.bin").is_file()
