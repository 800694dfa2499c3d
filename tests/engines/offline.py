"""vLLM's offline API as a user's script uses it: greedy generation from a local model.

    python offline.py MODEL [--eager] [--prompts N] [--tokens N] [--tp N]

Prints `TOKENS <json>`: the generated token ids of each prompt, in order.
"""
import argparse
import json

PROMPTS = ["hello world", "the quick brown fox", "a probe dumps every operator",
           "one two three", "how are you today", "the lazy dog", "seven eight nine",
           "of a model"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--eager", action="store_true", help="enforce_eager=True")
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=4)
    parser.add_argument("--tp", type=int, default=1, help="tensor_parallel_size")
    args = parser.parse_args()
    from vllm import LLM, SamplingParams
    llm = LLM(model=args.model, enforce_eager=args.eager, max_model_len=256, dtype="float32",
              max_num_seqs=8, seed=0, tensor_parallel_size=args.tp,
              **({"distributed_executor_backend": "mp"} if args.tp > 1 else {}))
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    prompts = (PROMPTS * (args.prompts // len(PROMPTS) + 1))[:args.prompts]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    print("TOKENS " + json.dumps([list(o.outputs[0].token_ids) for o in outputs]), flush=True)


if __name__ == "__main__":  # vLLM starts its engine in a spawned process
    main()
