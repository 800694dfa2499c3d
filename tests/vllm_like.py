"""A Llama written the way vLLM writes it, on the weights of a `transformers` Llama: the tests
of compare's built-in conventions run it where vLLM itself is not installed.

What vLLM's Llama does and `transformers`' does not, as vLLM's modules do it (vLLM 0.32,
`model_executor/models/llama.py`): tensors are `[tokens, hidden]`; a decoder layer is called
`(positions, hidden_states, residual)` and returns `(hidden_states, residual)`, leaving the
MLP's residual add to the next `RMSNorm`, which given a residual adds it and returns
`(normed, sum)`; q, k and v come from one `QKVParallelLinear` and gate and up from one
`MergedColumnParallelLinear`; a `RotaryEmbedding` module rotates q and k; an `Attention`
module holds the KV cache; the last token's hidden state goes to a `LogitsProcessor` and its
logits to a `Sampler`. The class names are vLLM's, so that the dumps carry them.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class VocabParallelEmbedding(nn.Embedding):
    pass


class QKVParallelLinear(nn.Linear):
    pass


class MergedColumnParallelLinear(nn.Linear):
    pass


class RowParallelLinear(nn.Linear):
    pass


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.weight = nn.Parameter(weight.clone())
        self.eps = eps

    def forward(self, x, residual=None):
        if residual is not None:
            x = x + residual
            residual = x
        out = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight
        return out if residual is None else (out, residual)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        self.head_dim = head_dim
        self.inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)

    def forward(self, positions, q, k):
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos()[:, None, :], emb.sin()[:, None, :]

        def rotate(x):
            x = x.view(x.shape[0], -1, self.head_dim)
            half = x.shape[-1] // 2
            turned = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
            return (x * cos + turned * sin).flatten(1)
        return rotate(q), rotate(k)


class Attention(nn.Module):
    """Causal attention over a KV cache kept here (what vLLM's backend keeps in its blocks)."""

    def __init__(self, heads: int, kv_heads: int, head_dim: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.cache = None

    def forward(self, q, k, v):
        tokens = q.shape[0]
        q = q.view(tokens, self.heads, self.head_dim).transpose(0, 1)
        k = k.view(tokens, self.kv_heads, self.head_dim).transpose(0, 1)
        v = v.view(tokens, self.kv_heads, self.head_dim).transpose(0, 1)
        prefill = self.cache is None
        if not prefill:
            k, v = torch.cat((self.cache[0], k), 1), torch.cat((self.cache[1], v), 1)
        self.cache = (k, v)
        repeat = self.heads // self.kv_heads
        out = F.scaled_dot_product_attention(
            q[None], k.repeat_interleave(repeat, 0)[None], v.repeat_interleave(repeat, 0)[None],
            is_causal=prefill and tokens > 1)
        return out[0].transpose(0, 1).reshape(tokens, self.heads * self.head_dim)


class SiluAndMul(nn.Module):
    def forward(self, x):
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class LlamaAttention(nn.Module):
    def __init__(self, hf, cfg):
        super().__init__()
        hd = cfg.hidden_size // cfg.num_attention_heads
        self.q_size = hf.q_proj.out_features
        self.kv_size = hf.k_proj.out_features
        self.qkv_proj = _linear(QKVParallelLinear, hf.q_proj, hf.k_proj, hf.v_proj)
        self.rotary_emb = RotaryEmbedding(hd, getattr(cfg, "rope_theta", None)
                                          or cfg.rope_parameters["rope_theta"])
        self.attn = Attention(cfg.num_attention_heads, cfg.num_key_value_heads, hd)
        self.o_proj = _linear(RowParallelLinear, hf.o_proj)

    def forward(self, positions, hidden_states):
        qkv = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v))


class LlamaMLP(nn.Module):
    def __init__(self, hf):
        super().__init__()
        self.gate_up_proj = _linear(MergedColumnParallelLinear, hf.gate_proj, hf.up_proj)
        self.act_fn = SiluAndMul()
        self.down_proj = _linear(RowParallelLinear, hf.down_proj)

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, hf, cfg):
        super().__init__()
        self.input_layernorm = RMSNorm(hf.input_layernorm.weight, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(hf.self_attn, cfg)
        self.post_attention_layernorm = RMSNorm(hf.post_attention_layernorm.weight,
                                                cfg.rms_norm_eps)
        self.mlp = LlamaMLP(hf.mlp)

    def forward(self, positions, hidden_states, residual):
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class LogitsProcessor(nn.Module):
    def forward(self, lm_head, hidden_states):
        return hidden_states @ lm_head.weight.T


class Sampler(nn.Module):
    def forward(self, logits):
        return logits.argmax(dim=-1)


class LlamaModel(nn.Module):
    def __init__(self, hf):
        super().__init__()
        cfg = hf.config
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight = nn.Parameter(hf.model.embed_tokens.weight.clone())
        self.layers = nn.ModuleList(LlamaDecoderLayer(layer, cfg) for layer in hf.model.layers)
        self.norm = RMSNorm(hf.model.norm.weight, cfg.rms_norm_eps)

    def forward(self, input_ids, positions):
        hidden_states, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    """One engine step per call: the tokens of the step in, the next token out."""

    def __init__(self, hf):
        super().__init__()
        self.model = LlamaModel(hf)
        self.lm_head = _linear(nn.Linear, hf.lm_head)
        self.logits_processor = LogitsProcessor()
        self.sampler = Sampler()

    def forward(self, input_ids, positions):
        hidden_states = self.model(input_ids, positions)
        logits = self.logits_processor(self.lm_head, hidden_states[-1:])
        return self.sampler(logits)


def _linear(cls, *parts: nn.Linear) -> nn.Linear:
    """A `cls` whose weight stacks the weights of `parts` (and their biases)."""
    weight = torch.cat([p.weight for p in parts])
    bias = None if parts[0].bias is None else torch.cat([p.bias for p in parts])
    out = cls(weight.shape[1], weight.shape[0], bias=bias is not None)
    with torch.no_grad():
        out.weight.copy_(weight)
        if bias is not None:
            out.bias.copy_(bias)
    return out


@torch.no_grad()
def generate(model: LlamaForCausalLM, prompt: torch.Tensor, new_tokens: int) -> list[int]:
    """Greedy generation of `new_tokens` tokens from a `[tokens]` prompt, one step per token."""
    tokens = prompt.tolist()
    step = prompt
    positions = torch.arange(len(tokens))
    for _ in range(new_tokens):
        tokens.append(int(model(step, positions)[0]))
        step = torch.tensor(tokens[-1:])
        positions = torch.tensor([len(tokens) - 1])
    return tokens[len(prompt):]
