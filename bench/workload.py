"""The models the benchmark runs: tiny Llama decoders built from a config with random weights.

Each workload is one `generate` call (greedy, a fixed number of new tokens), the same call the
issue measured: the root module is called once per token, so one run is 1 + (new - 1) rounds.
Only torch and transformers are needed, so the same file works in any virtual environment
(msprobe's included).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Spec:
    """What one workload is made of."""

    name: str
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int
    dtype: str
    prompt: int
    new_tokens: int

    def describe(self) -> str:
        return (f"LlamaForCausalLM, {self.layers} layers, hidden {self.hidden}, "
                f"intermediate {self.intermediate}, vocab {self.vocab}, {self.dtype}; "
                f"generate {self.prompt}+{self.new_tokens} tokens")


SPECS = {
    "small": Spec("small", layers=4, hidden=256, intermediate=1024, heads=4, kv_heads=2,
                  vocab=1024, dtype="float32", prompt=64, new_tokens=16),
    "large": Spec("large", layers=8, hidden=1024, intermediate=2816, heads=16, kv_heads=4,
                  vocab=32000, dtype="bfloat16", prompt=64, new_tokens=16),
}

QUICK_TOKENS = (16, 4)  # prompt, new tokens of a --quick run


def spec(name: str, quick: bool = False) -> Spec:
    """The workload `name`; a shorter generation when `quick`."""
    base = SPECS[name]
    if not quick:
        return base
    prompt, new = QUICK_TOKENS
    return Spec(**{**base.__dict__, "prompt": prompt, "new_tokens": new})


class Workload:
    """A built model and its prompt; `run()` is one un-probed generation."""

    def __init__(self, s: Spec, seed: int = 0):
        from transformers import LlamaConfig, LlamaForCausalLM
        self.spec = s
        torch.manual_seed(seed)
        cfg = LlamaConfig(vocab_size=s.vocab, hidden_size=s.hidden,
                          intermediate_size=s.intermediate, num_hidden_layers=s.layers,
                          num_attention_heads=s.heads, num_key_value_heads=s.kv_heads,
                          max_position_embeddings=max(256, s.prompt + s.new_tokens))
        self.model = LlamaForCausalLM(cfg).to(getattr(torch, s.dtype)).eval()
        self.prompt = torch.randint(0, s.vocab, (1, s.prompt),
                                    generator=torch.Generator().manual_seed(seed))

    def run(self):
        """One generation: the prompt, then exactly `new_tokens` greedy tokens."""
        with torch.no_grad():
            out = self.model.generate(self.prompt, max_new_tokens=self.spec.new_tokens,
                                      min_new_tokens=self.spec.new_tokens, do_sample=False,
                                      pad_token_id=0)
        if out.shape[1] != self.spec.prompt + self.spec.new_tokens:
            raise RuntimeError(f"generate produced {out.shape[1]} tokens")
        return out
