"""A tiny random-weight Llama saved the way a user's checkpoint is (`save_pretrained`), with a
byte-level BPE tokenizer trained here, so that an engine can load it with no model hub.

    python tests/engines/tiny_model.py DIR
"""
from __future__ import annotations

import sys
from pathlib import Path

TEXT = ("the quick brown fox jumps over the lazy dog. a probe dumps every operator of a model. "
        "hello world, how are you today? one two three four five six seven eight nine ten. ")


def make_tiny_llama(folder: Path, layers: int = 2) -> Path:
    """Write config.json, the weights and a tokenizer to `folder`; return it."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT] * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    # A chat template, so that `vllm serve`'s /v1/chat/completions takes it.
    fast.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
                          "{% endfor %}assistant:")
    fast.save_pretrained(folder)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256,
                      num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1,
                      max_position_embeddings=512, bos_token_id=0, eos_token_id=1,
                      torch_dtype="float32")
    LlamaForCausalLM(cfg).save_pretrained(folder)
    return folder


if __name__ == "__main__":
    print(make_tiny_llama(Path(sys.argv[1])))
