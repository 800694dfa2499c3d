"""vLLM's offline API as a user's script uses it: greedy generation from a local model.

    python offline.py MODEL [--eager] [--prompts N] [--tokens N] [--tp N] [--reload-scale S]

Prints `TOKENS <json>`: the generated token ids of each prompt, in order. With
`--reload-scale S`, the engine then loads its embedding weight again, times S, through the
model's `load_weights` (as an RL trainer pushes new weights into a running engine) and
generates once more.
"""
import argparse
import functools
import json

PROMPTS = ["hello world", "the quick brown fox", "a probe dumps every operator",
           "one two three", "how are you today", "the lazy dog", "seven eight nine",
           "of a model"]
EMBEDDING = "model.embed_tokens.weight"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--eager", action="store_true", help="enforce_eager=True")
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=4)
    parser.add_argument("--tp", type=int, default=1, help="tensor_parallel_size")
    parser.add_argument("--reload-scale", type=float, default=None)
    args = parser.parse_args()
    from vllm import LLM, SamplingParams
    llm = LLM(model=args.model, enforce_eager=args.eager, max_model_len=256, dtype="float32",
              max_num_seqs=8, seed=0, tensor_parallel_size=args.tp,
              **({"distributed_executor_backend": "mp"} if args.tp > 1 else {}))
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    prompts = (PROMPTS * (args.prompts // len(PROMPTS) + 1))[:args.prompts]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    print("TOKENS " + json.dumps([list(o.outputs[0].token_ids) for o in outputs]), flush=True)
    if args.reload_scale is not None:
        llm.apply_model(functools.partial(reload_embedding, scale=args.reload_scale))
        llm.generate(prompts, params, use_tqdm=False)


def reload_embedding(model, scale: float) -> None:
    """Load the embedding weight again, times `scale` (runs in the engine's worker)."""
    weight = dict(model.named_parameters())[EMBEDDING]
    model.load_weights([(EMBEDDING, weight.detach().clone() * scale)])


if __name__ == "__main__":  # vLLM starts its engine in a spawned process
    main()
