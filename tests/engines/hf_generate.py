"""The golden run of the engine tests: `transformers` greedy generation from a local model, each
prompt on its own, as a user's golden script does it.

    python hf_generate.py MODEL [--prompts N] [--tokens N]

Prints `TOKENS <json>`: the generated token ids of each prompt, in order (the prompts of
offline.py, so that the two runs can be compared).
"""
import argparse
import json

from offline import PROMPTS


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--prompts", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=4)
    args = parser.parse_args()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    out = []
    for text in PROMPTS[:args.prompts]:
        ids = tokenizer(text, return_tensors="pt").input_ids
        with torch.no_grad():
            generated = model.generate(ids, max_new_tokens=args.tokens, min_new_tokens=args.tokens,
                                       do_sample=False, pad_token_id=1)
        out.append(generated[0, ids.shape[1]:].tolist())
    print("TOKENS " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
