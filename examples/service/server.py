"""A small OpenAI-compatible chat-completions service, for trying atb-probe on a live server.

It serves a random-weight Llama built from a config (nothing is downloaded) behind
`POST /v1/chat/completions`, with FastAPI and uvicorn. The tokenizer is a stand-in: one token
per UTF-8 byte of the prompt, and each generated token is shown as one printable character.
The answers are gibberish; the point is a real model running real forward passes in a
long-lived process, as an inference service does.

Requests are served in uvicorn's worker threads, so several requests run the model at once.
Each request runs `model.generate` for exactly `max_tokens` new tokens: one forward pass (one
probe round) for the prompt, then one per further token, so `max_tokens` rounds in all.

    source "$(atb-probe where)/load_atb_probe.sh" --output=$PWD --config=$PWD/config.json
    python examples/service/server.py --port 1025
    curl -s -X POST -H "Content-Type: application/json" \
         -d '{"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}],
              "max_tokens": 3}' http://127.0.0.1:1025/v1/chat/completions

See docs/service.md for the whole walk-through.
"""
from __future__ import annotations

import argparse
import sys
import time
import uuid
from typing import Any

import torch
import uvicorn
from fastapi import FastAPI, HTTPException
from pydantic import BaseModel
from transformers import LlamaConfig, LlamaForCausalLM

MAX_PROMPT_TOKENS = 96


class Message(BaseModel):
    role: str
    content: Any = ""


class ChatRequest(BaseModel):
    model: str | None = None
    messages: list[Message]
    max_tokens: int | None = 16
    stream: bool = False


def build_model(layers: int, hidden: int, vocab: int, seed: int) -> LlamaForCausalLM:
    """A random-weight Llama; `eos_token_id` is unset so every request runs `max_tokens` steps."""
    torch.manual_seed(seed)
    heads = max(1, hidden // 16)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 2,
                         num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=max(1, heads // 2),
                         max_position_embeddings=MAX_PROMPT_TOKENS + 1024)
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def text_of(content: Any) -> str:
    """Message content as text: a string, an OpenAI content part, or a list of parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, dict):
        return str(content.get("text", ""))
    if isinstance(content, list):
        return "".join(text_of(part) for part in content)
    return "" if content is None else str(content)


def create_app(model: LlamaForCausalLM, model_name: str, max_new_tokens: int) -> FastAPI:
    app = FastAPI(title="atb-probe example service")
    vocab = model.config.vocab_size

    def encode(messages: list[Message]) -> torch.Tensor:
        text = "".join(f"<{m.role}>{text_of(m.content)}\n" for m in messages) + "<assistant>"
        ids = [b % vocab for b in text.encode("utf-8")][-MAX_PROMPT_TOKENS:]
        return torch.tensor([ids], dtype=torch.long)

    def decode(ids) -> str:
        return "".join(chr(32 + int(i) % 95) for i in ids)

    @app.get("/health")
    def health() -> dict:
        return {"status": "ok"}

    @app.get("/v1/models")
    def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model",
                                            "owned_by": "atb-probe-example"}]}

    # A plain `def`: FastAPI runs it in a worker thread, so requests overlap as in a real server.
    @app.post("/v1/chat/completions")
    def chat_completions(request: ChatRequest) -> dict:
        if request.stream:
            raise HTTPException(400, "this example does not stream; send \"stream\": false")
        if not request.messages:
            raise HTTPException(400, "\"messages\" must not be empty")
        new_tokens = request.max_tokens or 16
        if not 1 <= new_tokens <= max_new_tokens:
            raise HTTPException(400, f"\"max_tokens\" must be between 1 and {max_new_tokens}")
        prompt = encode(request.messages)
        with torch.inference_mode():
            out = model.generate(prompt, attention_mask=torch.ones_like(prompt),
                                 max_new_tokens=new_tokens, do_sample=False)
        completion = out[0, prompt.shape[1]:].tolist()
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex[:24]}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": request.model or model_name,
            "choices": [{"index": 0,
                         "message": {"role": "assistant", "content": decode(completion)},
                         "finish_reason": "length"}],
            "usage": {"prompt_tokens": prompt.shape[1], "completion_tokens": len(completion),
                      "total_tokens": prompt.shape[1] + len(completion)},
        }

    return app


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="OpenAI-compatible chat-completions service on "
                                                 "a small random-weight Llama.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=1025)
    parser.add_argument("--model-name", default="tiny-llama")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers (default 2)")
    parser.add_argument("--hidden", type=int, default=64, help="hidden size (default 64)")
    parser.add_argument("--vocab", type=int, default=256, help="vocabulary size (default 256)")
    parser.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    parser.add_argument("--max-new-tokens", type=int, default=256,
                        help="the largest max_tokens a request may ask for (default 256)")
    parser.add_argument("--torch-threads", type=int, default=0,
                        help="torch intra-op threads (default: torch's choice)")
    args = parser.parse_args(argv)
    if args.torch_threads > 0:
        torch.set_num_threads(args.torch_threads)
    model = build_model(args.layers, args.hidden, args.vocab, args.seed)
    app = create_app(model, args.model_name, args.max_new_tokens)
    print(f"serving {args.model_name} ({args.layers} layers, hidden {args.hidden}) on "
          f"http://{args.host}:{args.port}/v1/chat/completions", file=sys.stderr, flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main())
