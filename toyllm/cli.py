"""Command line: ``python -m toyllm <command> ...``.

Commands: demo, generate, prefill, search, bench, grade. Every command that
measures something accepts ``--json`` and then prints one JSON object.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch


class TextStreamer:
    """Prints text as tokens arrive, holding back bytes of an unfinished UTF-8 character."""

    def __init__(self, tokenizer, out=sys.stdout):
        self.tokenizer, self.out = tokenizer, out
        self.ids: list[int] = []
        self.printed = 0

    def __call__(self, token: int) -> None:
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return
        self.out.write(text[self.printed:])
        self.out.flush()
        self.printed = len(text)


def _encode_prompt(tokenizer, prompt: str, chat: bool) -> list[int]:
    if not prompt:
        raise ValueError("prompt is empty: pass --prompt with some text")
    return tokenizer.encode_chat(prompt) if chat else tokenizer.encode(prompt)


def cmd_generate(args) -> int:
    from . import generate, load_model

    model, tokenizer = load_model(args.model, attention=args.attention)
    ids = _encode_prompt(tokenizer, args.prompt, args.chat)
    streamer = None if args.json else TextStreamer(tokenizer)
    result = generate(model, ids, args.max_new_tokens, method=args.method, cache=args.cache,
                      temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                      eos_id=tokenizer.eos_id, on_token=streamer)
    text = tokenizer.decode(result.output_ids, skip_special_tokens=True)
    if args.json:
        print(json.dumps({"model": args.model, "method": args.method, "cache": args.cache,
                          "prompt_ids": result.prompt_ids, "output_ids": result.output_ids, "text": text,
                          "ttft_s": result.ttft_s, "tpot_s": result.tpot_s,
                          "stopped_on_eos": result.stopped_on_eos}))
    else:
        print(f"\n[{len(result.output_ids)} tokens, TTFT {result.ttft_s * 1e3:.1f} ms, "
              f"{result.tpot_s * 1e3:.1f} ms per token after the first]")
    return 0


def cmd_demo(args) -> int:
    from . import generate, load_model
    from .bench import naive_vs_cached

    print("== SmolLM2-135M-Instruct, read from its GGUF file, running in plain PyTorch ==")
    model, tokenizer = load_model("smollm2-135m")
    question = "What is the capital of France?"
    print(f"user: {question}\nassistant: ", end="", flush=True)
    result = generate(model, tokenizer.encode_chat(question), 48, eos_id=tokenizer.eos_id,
                      on_token=TextStreamer(tokenizer))
    print(f"\n[TTFT {result.ttft_s * 1e3:.0f} ms, {1 / max(result.tpot_s, 1e-9):.1f} tokens/s decoding]\n")

    print("== Naive generation vs KV cache (same greedy tokens, different cost) ==")
    row = naive_vs_cached(model, prompt_len=32, new_tokens=32, repeats=1)
    print(f"SmolLM2, 32-token prompt, 32 new tokens: naive {row['naive_s']:.2f} s, cached {row['cached_s']:.2f} s, "
          f"speedup {row['speedup']:.1f}x, identical tokens: {row['identical']}")
    try:
        from .parallel import demo_prefill
    except ImportError:
        return 0
    print("\n== Parallel prefill on 2 processes (gloo on this CPU) ==")
    demo_prefill()
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m toyllm", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)

    sub.add_parser("demo", help="the main job: a SmolLM2 chat answer, then what the KV cache buys")

    g = sub.add_parser("generate", help="generate text with a model")
    g.add_argument("--model", default="smollm2-135m", help="preset: tiny, bench or smollm2-135m")
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--method", choices=["naive", "cached"], default="cached")
    g.add_argument("--cache", choices=["dynamic", "static"], default="dynamic")
    g.add_argument("--attention", choices=["dense", "sdpa"], default="dense")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")

    b = sub.add_parser("bench", help="run the benchmarks and write their tables to a Markdown file")
    b.add_argument("--out", default="docs/benchmarks.md")
    b.add_argument("--only", choices=["generation", "prefill", "search"], action="append",
                   help="run only these sections (repeatable); default: all")
    b.add_argument("--quick", action="store_true", help="fewer repeats and sizes (a smoke run, not for docs)")
    return p


def cmd_bench(args) -> int:
    from .bench import run_benchmarks

    run_benchmarks(args.out, sections=args.only, quick=args.quick)
    return 0


COMMANDS = {"generate": cmd_generate, "demo": cmd_demo, "bench": cmd_bench}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    torch.set_grad_enabled(False)
    try:
        return COMMANDS[args.command](args)
    except ValueError as e:   # bad input: one clear line, not a traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
