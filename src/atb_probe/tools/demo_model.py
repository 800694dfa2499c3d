"""The demo's model program: a small random-weight Llama generating a few tokens.

It knows nothing of the probe; `atb-probe demo` runs it with the probe loaded, exactly as a
user's own inference script would be run. Also usable for trying things by hand::

    python -m atb_probe.tools.demo_model --layers 2 --new-tokens 4
    python -m atb_probe.tools.demo_model --save DIR   # a checkpoint folder, for vLLM and co.
"""
from __future__ import annotations

import argparse


def build_llama(layers: int = 2, hidden: int = 64, vocab: int = 256, seed: int = 0,
                dtype: str = "float32"):
    """A LlamaForCausalLM with random weights from a transformers config (nothing downloaded)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 2,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256)
    return LlamaForCausalLM(config).to(getattr(torch, dtype)).eval()


_TOKENIZER_TEXT = ("the quick brown fox jumps over the lazy dog. a probe dumps every operator of "
                   "a model. hello world, how are you today? one two three four five six seven "
                   "eight nine ten. ")


# The families `save_llama` can write: (config class, model class) in transformers.
FAMILIES = {"llama": ("LlamaConfig", "LlamaForCausalLM"),
            "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
            "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
            "mistral": ("MistralConfig", "MistralForCausalLM"),
            "gemma": ("GemmaConfig", "GemmaForCausalLM"),
            "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
            "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM")}
# The families' own sizes besides the common ones: small expert counts for the MoE ones.
_FAMILY_CONFIG = {"mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
                  "qwen2_moe": {"num_experts": 4, "num_experts_per_tok": 2,
                                "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64}}


def save_llama(folder, layers: int = 2, hidden: int = 128, vocab: int = 512, seed: int = 0,
               intermediate: int | None = None, family: str = "llama"):
    """Save a random-weight Llama (or another decoder-only family of `FAMILIES`) as a
    checkpoint folder (`save_pretrained`: config.json, safetensors weights) with a byte-level
    BPE tokenizer trained here and a chat template, so that a serving engine (`vllm serve DIR`)
    loads it with no model hub. Head size 64, which every vLLM attention backend takes.
    Returns the folder."""
    import os

    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    config_class, model_class = (getattr(transformers, name) for name in FAMILIES[family])
    os.makedirs(folder, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([_TOKENIZER_TEXT] * 20, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
                          "{% endfor %}assistant:")
    fast.save_pretrained(folder)
    torch.manual_seed(seed)
    config = config_class(vocab_size=vocab, hidden_size=hidden,
                          intermediate_size=intermediate or hidden * 2,
                          num_hidden_layers=layers, num_attention_heads=hidden // 64,
                          num_key_value_heads=1, head_dim=64, max_position_embeddings=512,
                          bos_token_id=0, eos_token_id=1, torch_dtype="float32",
                          tie_word_embeddings=False, **_FAMILY_CONFIG.get(family, {}))
    model_class(config).save_pretrained(folder)
    return folder


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=None,
                        help="hidden size (default 64; 128 with --save)")
    parser.add_argument("--prompt-tokens", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=4)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save", metavar="DIR",
                        help="save the model as a checkpoint folder instead (hidden 128 unless "
                             "--hidden is given)")
    args = parser.parse_args(argv)
    if args.save:
        print(save_llama(args.save, args.layers, args.hidden or 128, seed=args.seed))
        return
    import torch
    model = build_llama(args.layers, args.hidden or 64, seed=args.seed, dtype=args.dtype)
    prompt = torch.randint(0, model.config.vocab_size, (1, args.prompt_tokens),
                           generator=torch.Generator().manual_seed(args.seed))
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=args.new_tokens, do_sample=False,
                             pad_token_id=0)
    print("generated:", out[0, args.prompt_tokens:].tolist())


if __name__ == "__main__":
    main()
