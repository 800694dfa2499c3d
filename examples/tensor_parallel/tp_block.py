"""A 2-way (or N-way) tensor-parallel transformer, Megatron style, for `torchrun`.

Each rank holds a slice of every weight:

* `ColumnParallelLinear` keeps a block of output features (the q/k/v projection, the MLP's up
  projection): no communication, each rank computes its own heads / hidden slice.
* `RowParallelLinear` keeps the matching block of input features (the attention output
  projection, the MLP's down projection): each rank computes a partial sum, then
  `dist.all_reduce` adds the partial sums, so every rank ends with the same full output.

Nothing here knows about atb-probe; dump it by starting torchrun from a shell that sourced
`load_atb_probe.sh` (see run.sh beside this file):

    torchrun --nproc-per-node 2 tp_block.py                 # CPU, gloo
    torchrun --nproc-per-node 2 tp_block.py --device cuda   # one GPU per rank, nccl

Every rank builds the full weights from the same seed and keeps its shard, so `--check`
can compare the parallel result with a single-process run of the same model.
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn


class ColumnParallelLinear(nn.Module):
    """y_local = x @ W[rows of this rank].T: the output features are split across ranks."""

    def __init__(self, full: nn.Linear, rank: int, world: int):
        super().__init__()
        out = full.out_features // world
        self.weight = nn.Parameter(full.weight.detach()[rank * out:(rank + 1) * out].clone())
        self.bias = nn.Parameter(full.bias.detach()[rank * out:(rank + 1) * out].clone())

    def forward(self, x):
        return nn.functional.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_local @ W[:, cols of this rank].T) + b: the input features are split."""

    def __init__(self, full: nn.Linear, rank: int, world: int):
        super().__init__()
        cols = full.in_features // world
        self.weight = nn.Parameter(full.weight.detach()[:, rank * cols:(rank + 1) * cols].clone())
        self.bias = nn.Parameter(full.bias.detach().clone())
        self.world = world

    def forward(self, x):
        partial = nn.functional.linear(x, self.weight)
        if self.world > 1:
            dist.all_reduce(partial)
        return partial + self.bias


class ParallelAttention(nn.Module):
    def __init__(self, hidden: int, heads: int, rank: int, world: int):
        super().__init__()
        self.local_heads = heads // world
        self.head_dim = hidden // heads
        self.q_proj = ColumnParallelLinear(nn.Linear(hidden, hidden), rank, world)
        self.k_proj = ColumnParallelLinear(nn.Linear(hidden, hidden), rank, world)
        self.v_proj = ColumnParallelLinear(nn.Linear(hidden, hidden), rank, world)
        self.o_proj = RowParallelLinear(nn.Linear(hidden, hidden), rank, world)

    def forward(self, x):
        batch, seq, _ = x.shape
        q, k, v = (proj(x).view(batch, seq, self.local_heads, self.head_dim).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        attn = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(attn.transpose(1, 2).reshape(batch, seq, -1))


class ParallelMLP(nn.Module):
    def __init__(self, hidden: int, inner: int, rank: int, world: int):
        super().__init__()
        self.up = ColumnParallelLinear(nn.Linear(hidden, inner), rank, world)
        self.down = RowParallelLinear(nn.Linear(inner, hidden), rank, world)

    def forward(self, x):
        return self.down(nn.functional.gelu(self.up(x)))


class ParallelBlock(nn.Module):
    """Pre-norm transformer block; its output is the same on every rank."""

    def __init__(self, hidden: int, heads: int, rank: int, world: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(hidden)
        self.attn = ParallelAttention(hidden, heads, rank, world)
        self.ln2 = nn.LayerNorm(hidden)
        self.mlp = ParallelMLP(hidden, 4 * hidden, rank, world)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyParallelModel(nn.Module):
    """Embedding, `layers` parallel blocks, final norm: the root module of each round."""

    def __init__(self, vocab: int, hidden: int, heads: int, layers: int, rank: int, world: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(ParallelBlock(hidden, heads, rank, world)
                                    for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)

    def forward(self, input_ids):
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


def build(rank: int, world: int, args) -> TinyParallelModel:
    torch.manual_seed(0)  # the same full weights on every rank; each keeps its shard
    return TinyParallelModel(args.vocab, args.hidden, args.heads, args.layers, rank, world)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda", "npu"), default="cpu")
    parser.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default="float32")
    parser.add_argument("--steps", type=int, default=2, help="forward calls (dump rounds)")
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", type=int, default=8)
    parser.add_argument("--check", action="store_true",
                        help="compare with a single-process run of the same model")
    args = parser.parse_args()

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if args.device == "cuda":
        torch.cuda.set_device(local_rank)
        device, backend = torch.device("cuda", local_rank), "nccl"
    elif args.device == "npu":
        import torch_npu  # noqa: F401  (registers the npu device)
        torch.npu.set_device(local_rank)
        device, backend = torch.device("npu", local_rank), "hccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = getattr(torch, args.dtype)

    model = build(rank, world, args).to(device, dtype).eval()
    tokens = torch.randint(0, args.vocab, (1, args.seq),
                           generator=torch.Generator().manual_seed(1)).to(device)
    with torch.no_grad():
        for _ in range(args.steps):
            out = model(tokens)

    if args.check:
        with torch.no_grad():
            reference = build(0, 1, args).to(device, dtype).eval()(tokens)
        err = (out.float() - reference.float()).abs().max().item()
        print(f"rank {rank}: max |parallel - single| = {err:.3g}", flush=True)
    print(f"rank {rank}/{world} local_rank {local_rank} pid {os.getpid()} device {device}: "
          f"output {tuple(out.shape)} {out.dtype}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
