"""A saved checkpoint split over ranks by `transformers` itself (`tp_plan="auto"`), for `torchrun`.

Every rank loads its part of the weights (the model's own tensor-parallel plan: q/k/v and
gate/up projections column-parallel, o and down projections row-parallel, the embedding
vocabulary-parallel) and generates greedily from the same prompt. Run with one rank, the same
script loads the whole model: that run is the golden one for `atb-probe compare`, which joins the
ranks' pieces of each tensor (docs/scaling.md).

    torchrun --nproc-per-node 2 tp_auto.py CHECKPOINT     # CPU, gloo
    torchrun --nproc-per-node 1 tp_auto.py CHECKPOINT     # the golden run

Needs `accelerate` (transformers asks for it with `tp_plan`). Nothing here knows about atb-probe:
start torchrun from a shell that sourced the load script.
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="a folder written by save_pretrained")
    parser.add_argument("--prompt-len", type=int, default=6, help="prompt tokens (random ids)")
    parser.add_argument("--new-tokens", type=int, default=2, help="tokens to generate")
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        model = AutoModelForCausalLM.from_pretrained(args.checkpoint, tp_plan="auto")
    else:
        model = AutoModelForCausalLM.from_pretrained(args.checkpoint)
    model.eval()
    prompt = torch.randint(0, model.config.vocab_size, (1, args.prompt_len),
                           generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        tokens = model.generate(prompt, max_new_tokens=args.new_tokens, do_sample=False,
                                pad_token_id=0)
    rank = dist.get_rank() if dist.is_initialized() else 0
    print(f"rank {rank}/{world} local_rank {os.environ.get('LOCAL_RANK')} pid {os.getpid()} "
          f"tokens {tokens[0].tolist()}", flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
