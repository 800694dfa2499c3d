"""A tiny Llama split over ranks with PyTorch's own tensor parallelism (`DTensor`), for `torchrun`.

Each decoder layer's attention and MLP are parallelised with `parallelize_module`: q/k/v and
gate/up projections `ColwiseParallel` (each rank keeps some heads / hidden features), o and down
projections `RowwiseParallel` (partial sums reduced across ranks). The weights become `DTensor`s,
and the reductions return pending functional-collective results; atb-probe dumps the local shard
of each, with its layout in `op_param.json`.

    torchrun --nproc-per-node 2 tp_dtensor.py            # CPU, gloo
    torchrun --nproc-per-node 2 tp_dtensor.py --check    # also compare with one process

Nothing here knows about atb-probe: start torchrun from a shell that sourced the load script.
"""
from __future__ import annotations

import argparse
import copy
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                               parallelize_module)

PLAN = {
    "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
    "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
    "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
    "mlp.down_proj": RowwiseParallel(),
}


def build_model(layers: int = 2, seed: int = 0):
    """The full model, the same on every rank (same seed)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=64)
    return LlamaForCausalLM(cfg).eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2, help="forward calls (dump rounds)")
    parser.add_argument("--check", action="store_true",
                        help="compare the logits with a single-process run")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    model = build_model()
    single = copy.deepcopy(model) if args.check else None
    for layer in model.model.layers:
        parallelize_module(layer, mesh, PLAN)
    tokens = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for _ in range(args.steps):
            logits = model(tokens).logits
        if single is not None:
            err = (logits - single(tokens).logits).abs().max().item()
            print(f"rank {rank}: max |parallel - single| = {err:.3g}", flush=True)
    print(f"rank {rank}/{world} local_rank {os.environ.get('LOCAL_RANK')} pid {os.getpid()}",
          flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
