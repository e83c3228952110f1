"""Decode-speed measurements: weight formats against the memory-bandwidth floor, and the blog's toy.

SmolLM2's decode tokens/s for each weight format (``toyllm.quant``) beside
lesson 03's roofline: a decode step must read every weight once, so it
takes at least (bytes read per token) / (memory bandwidth) seconds. The
bandwidth is measured here, by copying a buffer much larger than the
caches. ``python -m toyllm bench --only weights|batched`` writes the
tables of docs/benchmarks.md from these; the demo prints a short version.
Formats alternate round by round, so the ratios compare runs made under
the same load.
"""
from __future__ import annotations

import statistics
import sys

import torch

from .analysis import kv_cache_bytes
from .generation import generate
from .model import ModelConfig
from .quant import WEIGHT_FORMATS, linear_weight_bytes
from .utils import median_time

# The toy of the KV-cache blog post: vocabulary 100, width 32, one attention layer with
# one head. Ours is a Llama block, so it also has an MLP (kept as narrow as the width).
BLOG_TOY = ModelConfig(vocab_size=100, d_model=32, n_layers=1, n_heads=1, n_kv_heads=1, head_dim=32,
                       ffn_dim=32, max_context=256)
BLOG_PROMPTS, BLOG_PROMPT_LEN, BLOG_NEW_TOKENS = 10000, 50, 100

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
    kv = kv_cache_bytes(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, context, bytes_per_value=4, batch=batch)
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
