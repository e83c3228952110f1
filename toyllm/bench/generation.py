"""Benchmark sections on one process: naive generation against the KV cache, and the first token's prefill."""
from __future__ import annotations

import statistics

import torch

from ..model import ModelConfig, build_model
from ..utils import random_prompt
from .common import progress


def naive_vs_cached(model, prompt_len: int = 64, new_tokens: int = 256, rounds: int = 5, seed: int = 0) -> dict:
    """Time a greedy generation both ways on the same random prompt (seconds), the two taking turns for
    ``rounds`` rounds after a warm-up round (``time_naive_and_cached``)."""
    ids = random_prompt(prompt_len, model.config.vocab_size, seed)
    return {"prompt_len": prompt_len, "new_tokens": new_tokens,
            **time_naive_and_cached(model, ids, new_tokens, rounds, warmup=1)}


def time_naive_and_cached(model, prompts, new_tokens: int, rounds: int, warmup: int,
                          caches: tuple = ("static",)) -> dict:
    """Greedy generation of ``prompts`` (one prompt or a batch, as ``generate`` takes them) naive and
    cached with each of ``caches``, all taking turns for ``rounds`` rounds after ``warmup`` untimed ones.
    A cache is a kind ("static", "dynamic") or a (name, function returning a new cache object) pair.
    Returns, for the first cache: each method's runs ("naive", "cached": ``measure.spread``) and medians
    (seconds), the medians' "speedup", "round_speedups" (each round's naive run over its cached run), the
    cache's "verdict" against naive (``measure.compare``) and whether both produced the same tokens;
    "other_caches": the same for each further cache (one dict each)."""
    from ..generation import generate
    from ..measure import compare, interleaved_runs, spread

    outs = {}
    named = dict((c, c) if isinstance(c, str) else c for c in caches)       # name -> kind or new-cache function

    def run(arm, **how):
        result = generate(model, prompts, new_tokens, **how)
        outs[arm] = [r.output_ids for r in result] if isinstance(result, list) else result.output_ids

    def cached(name):
        how = named[name]
        return lambda: run(name, method="cached", cache=how if isinstance(how, str) else how())

    arms = {"naive": lambda: run("naive", method="naive"), **{name: cached(name) for name in named}}
    runs = interleaved_runs(arms, rounds, warmup=warmup)
    naive = spread(runs["naive"])

    def against_naive(cache):
        cached = spread(runs[cache])
        return {"cache": cache, "cached": cached, "cached_s": cached.median, "speedup": naive.median / cached.median,
                "round_speedups": [a / b for a, b in zip(runs["naive"], runs[cache])],
                "verdict": compare(cached, naive), "identical": outs["naive"] == outs[cache]}

    first, *others = named
    return {"naive": naive, "naive_s": naive.median, **against_naive(first),
            "other_caches": [against_naive(c) for c in others]}


# A toy model wide enough that compute, not per-operator overhead, sets the cost of a step.
TOY_512 = ModelConfig(vocab_size=256, d_model=512, n_layers=4, n_heads=8, n_kv_heads=8, head_dim=64,
                      ffn_dim=2048, max_context=1024)


def bench_generation(quick: bool = False) -> dict:
    """Naive vs cached generation on three toy widths, and SmolLM2's decode speed (seconds, medians)."""
    from ..generation import generate
    from ..weights import load_model

    repeats = 2 if quick else 5        # 5 rounds: the fewest from which measure's rank test can decide
    new_tokens = 64 if quick else 512
    models = [(name, load_model(name)[0]) for name in ("tiny", "bench")]
    models.append((f"toy-512 ({TOY_512.d_model} wide, {TOY_512.n_layers} layers, MLP {TOY_512.ffn_dim})",
                   build_model(TOY_512)))
    rows = []
    for name, model in models:
        rows.append({"name": name, **naive_vs_cached(model, 64, new_tokens, repeats)})
        progress(rows[-1])
    # the target's own setting: the bench preset, 256 new tokens after 64 (`generate --model bench --method ...`)
    target = naive_vs_cached(models[1][1], 64, 64 if quick else 256, 2 if quick else 5)
    progress(target)
    model, tok = load_model("smollm2-135m")
    ids = tok.encode_chat("Write a short poem about the sea.")
    n = 16 if quick else 64
    results = [generate(model, ids, n) for _ in range(repeats + 1)][1:]
    smol = {"prompt_len": len(ids), "new_tokens": n, "ttft_s": statistics.median(r.ttft_s for r in results),
            "tpot_s": statistics.median(r.tpot_s for r in results)}
    progress(smol)
    return {"prompt_len": 64, "new_tokens": new_tokens, "threads": torch.get_num_threads(), "repeats": repeats,
            "rows": rows, "best": max(rows, key=lambda r: r["speedup"]), "target": target, "smol": smol}


def bench_first_token(quick: bool = False) -> dict:
    """SmolLM2 prefill with the whole T x vocab logits matrix vs the last position only (seconds)."""
    from ..analysis import prefill_flops
    from ..measure import compare, interleaved_runs
    from ..weights import load_model

    model, tok = load_model("smollm2-135m")
    repeats = 2 if quick else 5
    prompts = [("chat: What is the capital of France?", tok.encode_chat("What is the capital of France?")),
               ("random", random_prompt(256 if quick else 1024, model.config.vocab_size))]
    rows = []
    for name, ids in prompts:
        x = torch.tensor([ids])
        with torch.no_grad():                       # in turns, so drift hits both ways alike; a warm-up round first
            times = interleaved_runs({last_only: (lambda last_only=last_only: model(x, last_only=last_only))
                                      for last_only in (False, True)}, repeats, warmup=1)
        cfg = model.config
        head = 2 * len(ids) * cfg.vocab_size * cfg.d_model
        rows.append({"name": name, "tokens": len(ids), "all_s": statistics.median(times[False]),
                     "last_s": statistics.median(times[True]), "verdict": compare(times[True], times[False]),
                     "head_gflop": head / 1e9,
                     "total_gflop": prefill_flops(cfg, len(ids)) / 1e9})
        progress(rows[-1])
    return {"threads": torch.get_num_threads(), "repeats": repeats, "vocab": model.config.vocab_size, "rows": rows}
