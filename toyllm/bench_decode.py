"""Decode speed: weight formats against the memory-bandwidth bound, and what the KV cache buys.

    python -m toyllm.bench_decode [--quick] [--only formats|batch1|blog] [--threads N] [--out FILE]

writes Markdown tables with the command next to the numbers:

1. ("formats") SmolLM2 decode tokens/s for each weight format (``toyllm.quant``) beside
   lesson 03's roofline: a decode step must read every weight once, so it
   takes at least (bytes read per token) / (memory bandwidth) seconds. The
   bandwidth is measured here, by copying a buffer much larger than the
   caches.
2. ("batch1") Naive vs cached generation at batch 1 on a toy model.
3. ("blog") The KV-cache blog's batched experiment (``BLOG_TOY``): 10000 prompts of
   50 tokens, 100 new tokens each, naive vs cached.

Timings are medians; formats and methods alternate within one run, so the
ratios compare runs made under the same load.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch

from .generation import generate
from .model import ModelConfig, build_model
from .quant import WEIGHT_FORMATS, linear_weight_bytes
from .utils import median_time, random_prompt

# The toy of the KV-cache blog post: vocabulary 100, width 32, one attention layer with
# one head. Ours is a Llama block, so it also has an MLP (kept as narrow as the width).
BLOG_TOY = ModelConfig(vocab_size=100, d_model=32, n_layers=1, n_heads=1, n_kv_heads=1, head_dim=32,
                       ffn_dim=32, max_context=256)
BLOG_PROMPTS, BLOG_PROMPT_LEN, BLOG_NEW_TOKENS = 10000, 50, 100

# A toy at batch 1 where a step's arithmetic, not its fixed per-operator cost, sets the pace.
BATCH1_TOY = ModelConfig(vocab_size=256, d_model=512, n_layers=4, n_heads=8, n_kv_heads=8, head_dim=64,
                         ffn_dim=2048, max_context=1024)

CHAT_PROMPT = "What is the capital of France?"


def copy_bandwidth(nbytes: int = 512 * 2**20, repeats: int = 5) -> float:
    """Measured memory bandwidth in bytes/s: bytes read plus bytes written by copying an nbytes buffer."""
    src = torch.ones(nbytes // 4)            # touched, so its pages are real memory, not the shared zero page
    dst = torch.empty_like(src)
    seconds, _ = median_time(lambda: dst.copy_(src), repeats, warmup=1)
    return 2 * nbytes / seconds


def decode_bytes_per_token(model, context: int, batch: int = 1) -> int:
    """Bytes one decode step reads at ``context`` tokens: every linear weight, one embedding row per
    sequence, and the K and V of every cached token (float32)."""
    cfg = model.config
    kv = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * context * 4 * batch
    return linear_weight_bytes(model) + batch * cfg.d_model * 4 + kv


def smollm2_formats(formats=WEIGHT_FORMATS, new_tokens: int = 32, rounds: int = 3, prompt: str = CHAT_PROMPT,
                    answer_tokens: int = 48, attention: str = "dense") -> dict:
    """Decode tokens/s of SmolLM2 per weight format, formats alternating round by round.

    Each round generates ``new_tokens`` greedy tokens after the chat prompt with
    every format in turn; a format's speed is 1 / (median seconds per token
    after the first), and its reported value is the median over rounds.
    Also records whether each format's greedy answer (up to ``answer_tokens``,
    stopping at end of turn) names Paris and equals float32's.
    attention: the model's attention kernel, the same for every format.
    """
    from .weights import load_model

    models, tokenizer = {}, None
    for fmt in formats:
        models[fmt], tokenizer = load_model("smollm2-135m", attention=attention, weights=fmt)
    ids = tokenizer.encode_chat(prompt)
    answers = {fmt: generate(m, ids, answer_tokens, eos_id=tokenizer.eos_id).output_ids for fmt, m in models.items()}
    tpot = {fmt: [] for fmt in formats}
    for _ in range(rounds):
        for fmt, m in models.items():
            tpot[fmt].append(generate(m, ids, new_tokens).tpot_s)
    context = len(ids) + new_tokens // 2
    rows = []
    for fmt, m in models.items():
        seconds = statistics.median(tpot[fmt])
        text = tokenizer.decode(answers[fmt], skip_special_tokens=True)
        rows.append({"format": fmt, "bytes_per_token": decode_bytes_per_token(m, context),
                     "tokens_per_s": 1 / seconds, "runs_s": tpot[fmt], "answer": text,
                     "paris": "Paris" in text, "same_as_fp32": answers[fmt] == answers[formats[0]]})
    return {"prompt_len": len(ids), "new_tokens": new_tokens, "rounds": rounds, "attention": attention, "rows": rows}


def naive_vs_cached(model, prompts, new_tokens: int, repeats: int, attention: str | None = None) -> dict:
    """Seconds of one generate() call per method (medians, methods alternating) on the same prompts."""
    if attention is not None:
        model.set_attention(attention)
    times, outs = {"naive": [], "cached": []}, {}
    for _ in range(repeats):
        for method in times:
            t = time.perf_counter()
            result = generate(model, prompts, new_tokens, method=method)
            times[method].append(time.perf_counter() - t)
            outs[method] = [r.output_ids for r in result] if isinstance(result, list) else result.output_ids
    naive, cached = statistics.median(times["naive"]), statistics.median(times["cached"])
    return {"naive_s": naive, "cached_s": cached, "speedup": naive / cached,
            "identical": outs["naive"] == outs["cached"], "repeats": repeats}


def bench_formats(quick: bool = False) -> dict:
    """SmolLM2 decode tokens/s per weight format beside the memory-bandwidth bound."""
    bandwidth = copy_bandwidth()
    formats = smollm2_formats(new_tokens=16 if quick else 32, rounds=2 if quick else 5)
    fp32 = formats["rows"][0]["tokens_per_s"]
    for row in formats["rows"]:
        row["bound_tokens_per_s"] = bandwidth / row["bytes_per_token"]
        row["vs_fp32"] = row["tokens_per_s"] / fp32
    return {"bandwidth_bytes_per_s": bandwidth, **formats}


def bench_batch1(quick: bool = False) -> dict:
    """Naive vs cached at batch 1 on ``BATCH1_TOY``."""
    n = 128 if quick else 256
    return {"config": BATCH1_TOY.to_dict(), "prompt_len": 64, "new_tokens": n,
            **naive_vs_cached(build_model(BATCH1_TOY), random_prompt(64, BATCH1_TOY.vocab_size), n,
                              repeats=1 if quick else 3)}


def bench_blog(quick: bool = False, n_prompts: int | None = None) -> dict:
    """The blog's batched experiment on ``BLOG_TOY`` (quick: 500 prompts instead of 10000)."""
    n_prompts = n_prompts or (500 if quick else BLOG_PROMPTS)
    prompts = torch.randint(0, BLOG_TOY.vocab_size, (n_prompts, BLOG_PROMPT_LEN),
                            generator=torch.Generator().manual_seed(0))
    # sdpa: the naive method's causal squares go to the fused kernel instead of a
    # (prompts, T, T) score tensor (900 MB at 10000 x 150 x 150 in float32)
    return {"config": BLOG_TOY.to_dict(), "prompts": n_prompts, "prompt_len": BLOG_PROMPT_LEN,
            "new_tokens": BLOG_NEW_TOKENS, "attention": "sdpa",
            **naive_vs_cached(build_model(BLOG_TOY), prompts, BLOG_NEW_TOKENS, repeats=1, attention="sdpa")}


SECTIONS = {"formats": bench_formats, "batch1": bench_batch1, "blog": bench_blog}


def run(quick: bool = False, only: list[str] | None = None) -> dict:
    """The chosen sections (default all: a few minutes; ``quick``: about one)."""
    data = {name: SECTIONS[name](quick) for name in only or SECTIONS}
    return {**data, "threads": torch.get_num_threads(), "quick": quick}


def _target(value: float, target: float) -> str:
    return f"target >= {target:g}x: " + ("met" if value >= target else "**not met**")


def render_markdown(data: dict, command: str) -> str:
    """The tables of ``run``'s result, with the command and the conditions of the run."""
    load = os.getloadavg()[0]
    lines = [f"Command: `{command}` ({data['threads']} intra-op thread(s); load average {load:.1f} at the end "
             f"of the run on {os.cpu_count()} logical CPUs{', shared with other work' if load > 0.5 else ''})."]
    if "formats" in data:
        lines += ["", *_formats_markdown(data["formats"])]
    experiments = [(name, data[name]) for name in ("batch1", "blog") if name in data]
    if experiments:
        lines += ["", "## Naive vs cached generation", "",
                  "| experiment | naive (s) | cached (s) | speedup | same tokens | target |",
                  "|---|---:|---:|---:|---|---|"]
        for name, e in experiments:
            c = e["config"]
            if name == "batch1":
                what = (f"batch 1: toy {c['d_model']} wide, {c['n_layers']} layers, MLP {c['ffn_dim']}; "
                        f"{e['prompt_len']}-token prompt, {e['new_tokens']} new tokens")
                target = _target(e["speedup"], 10)
            else:
                what = (f"the blog's batch: vocab {c['vocab_size']}, width {c['d_model']}, {c['n_layers']} layer; "
                        f"{e['prompts']} prompts of {e['prompt_len']} tokens, {e['new_tokens']} new tokens "
                        f"(attention: {e['attention']})")
                target = _target(e["speedup"], 20) + " (the blog: 22x on a T4 GPU)"
            lines.append(f"| {what} | {e['naive_s']:.2f} | {e['cached_s']:.3f} | {e['speedup']:.1f}x | "
                         f"{'yes' if e['identical'] else 'no'} | {target} |")
    if data["quick"]:
        lines += ["", "Quick run (fewer prompts, tokens and repeats): a smoke test, not numbers for the docs."]
    return "\n".join(lines) + "\n"


def _formats_markdown(f: dict) -> list[str]:
    rows = f["rows"]
    lines = [
        "## Decode speed: weight formats and the memory-bandwidth bound", "",
        f"Measured copy bandwidth: {f['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s (bytes read + written while "
        f"copying a 512 MiB buffer). SmolLM2-135M-Instruct, chat prompt of {f['prompt_len']} tokens, "
        f"{f['new_tokens']} greedy tokens, attention kernel {f['attention']!r}; median seconds per token over "
        f"{f['rounds']} rounds, formats alternating.",
        "",
        "| weights | MB read per token | bound (tokens/s) | measured (tokens/s) | share of bound | vs float32 | "
        "answer names Paris | same answer as float32 |",
        "|---|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['format']} | {r['bytes_per_token'] / 1e6:.0f} | {r['bound_tokens_per_s']:.1f} | "
                     f"{r['tokens_per_s']:.1f} | {r['tokens_per_s'] / r['bound_tokens_per_s']:.0%} | "
                     f"{r['vs_fp32']:.2f}x | {'yes' if r['paris'] else 'no'} | "
                     f"{'yes' if r['same_as_fp32'] else 'no'} |")
    lines.append("")
    bf16 = next((r for r in rows if r["format"] == "bf16"), None)
    if bf16:
        lines.append(f"- bf16 vs float32: {bf16['vs_fp32']:.2f}x ({_target(bf16['vs_fp32'], 1.6)}).")
    ok = [r for r in rows if r["paris"]]
    if ok:
        best = max(ok, key=lambda r: r["tokens_per_s"])
        lines.append(f"- Fastest format that answers Paris: {best['format']}, {best['vs_fp32']:.2f}x float32 "
                     f"({_target(best['vs_fp32'], 2.2)}).")
    return lines


def demo_decode_speed(formats=("fp32", "fp16", "bf16", "int8"), out=None) -> dict:
    """The demo's lines: SmolLM2 tokens/s in float32 and in the fastest format that still answers Paris."""
    out = out or sys.stdout
    data = smollm2_formats(formats, new_tokens=16, rounds=2)
    rows = {r["format"]: r for r in data["rows"]}
    ok = [r for r in data["rows"] if r["paris"]]
    for r in data["rows"]:
        print(f"  {r['format']:>4}: {r['tokens_per_s']:5.1f} tokens/s, {r['bytes_per_token'] / 1e6:4.0f} MB read per "
              f"token, answer {'names Paris' if r['paris'] else 'MISSES Paris'}", file=out)
    if ok and "fp32" in rows:
        best = max(ok, key=lambda r: r["tokens_per_s"])
        print(f"fastest format that still answers Paris: {best['format']}, "
              f"{best['tokens_per_s'] / rows['fp32']['tokens_per_s']:.1f}x float32's "
              f"{rows['fp32']['tokens_per_s']:.1f} tokens/s", file=out)
    return data


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m toyllm.bench_decode", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer prompts, tokens and repeats (a smoke run)")
    p.add_argument("--threads", type=int, default=None, help="intra-op threads (default: torch's)")
    p.add_argument("--out", default=None, help="write the Markdown here (default: print it)")
    p.add_argument("--only", choices=list(SECTIONS), action="append", help="run only these sections (repeatable)")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = p.parse_args(argv)
    from .bench import RESIDENT_HEAP_ENV

    if any(os.environ.get(k) != v for k, v in RESIDENT_HEAP_ENV.items()):
        # steadier timings with the heap kept resident (see toyllm/bench.py): re-run with it set
        sys.stdout.flush()
        env = {**os.environ, **RESIDENT_HEAP_ENV}
        return subprocess.call([sys.executable, "-m", "toyllm.bench_decode", *argv], env=env)
    if args.threads is not None:
        if args.threads < 1:
            raise SystemExit(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    command = " ".join(["python -m toyllm.bench_decode", *argv])
    text = render_markdown(run(args.quick, args.only), command)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text)
        print(f"wrote {args.out}")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
