"""The demo's model program: a small random-weight Llama generating a few tokens.

It knows nothing of the probe; `atb-probe demo` runs it with the probe loaded, exactly as a
user's own inference script would be run. Also usable for trying things by hand::

    python -m atb_probe.tools.demo_model --layers 2 --new-tokens 4
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


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=4)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    import torch
    model = build_llama(args.layers, args.hidden, seed=args.seed, dtype=args.dtype)
    prompt = torch.randint(0, model.config.vocab_size, (1, args.prompt_tokens),
                           generator=torch.Generator().manual_seed(args.seed))
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=args.new_tokens, do_sample=False,
                             pad_token_id=0)
    print("generated:", out[0, args.prompt_tokens:].tolist())


if __name__ == "__main__":
    main()
