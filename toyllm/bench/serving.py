"""Benchmark section of serving: one workload served with static, continuous and chunked batching and
disaggregated prefill, rounds in turns."""
from __future__ import annotations

import torch

from .common import progress


def bench_serving(quick: bool = False) -> dict:
    """One seeded workload served four ways on SmolLM2: static, continuous and chunked batching on one
    machine, and disaggregated prefill (a prefill worker and a decode worker, the caches crossing a
    modelled link). Rounds in turns; each metric's runs with their spread, verdicts against continuous.

    quick: the tiny model, 12 requests, 2 rounds.
    """
    from ..disagg import link, serve_disaggregated
    from ..generation import generate
    from ..measure import compare, interleaved_runs, spread
    from ..serving import POLICIES, poisson_workload, serve
    from ..weights import load_model

    name = "tiny" if quick else "smollm2-135m"
    model, _ = load_model(name)
    n, rate = (12, 40.0) if quick else (32, 8.0)
    prompt_tokens, new_tokens = ((4, 96), (2, 24)) if quick else ((4, 400), (2, 48))
    workload = poisson_workload(n, rate, model.config.vocab_size, prompt_tokens=prompt_tokens,
                                new_tokens=new_tokens, seed=3)
    settings = {"max_batch": 8, "block_size": 16}
    budget = 32 if quick else 96
    bandwidth = 10e9                                   # bytes/s: assumed, a 100 Gb/s network between the workers
    link_model = link(bandwidth)
    ways = {p: (lambda p=p: serve(model, workload, p, token_budget=budget, **settings)) for p in POLICIES}
    ways["disaggregated"] = lambda: serve_disaggregated(model, workload, link_model, **settings)
    results: dict = {w: [] for w in ways}
    rounds = 2 if quick else 5          # the fewest from which measure's rank test can decide
    with torch.inference_mode():
        interleaved_runs({w: (lambda w=w, fn=fn: results[w].append(fn())) for w, fn in ways.items()}, rounds,
                         warmup=1)
        results = {w: rs[1:] for w, rs in results.items()}          # the warm-up round's results are not kept
        alone = {r.id: generate(model, list(r.prompt_ids), r.max_new_tokens, cache="dynamic").output_ids
                 for r in workload}
    identical = all(r.output_ids == alone[r.id] for runs in results.values() for run in runs for r in run.requests)
    metrics = {"ttft_p50": lambda r: r.percentile("ttft_s", 50), "ttft_p99": lambda r: r.percentile("ttft_s", 99),
               "tpot_p50": lambda r: r.percentile("tpot_s", 50), "tpot_p99": lambda r: r.percentile("tpot_s", 99),
               "clock": lambda r: r.clock_s}
    rows = []
    for w, rs in results.items():
        row = {"way": w, "throughput": [r.throughput for r in rs], "output_tokens": rs[-1].output_tokens,
               **{m: spread([f(r) for r in rs]) for m, f in metrics.items()}}
        if w != "continuous":
            row["verdicts"] = {m: compare([metrics[m](r) for r in rs], [metrics[m](r) for r in results["continuous"]])
                               for m in ("ttft_p99", "tpot_p99", "clock")}
        rows.append(row)
        progress({"way": w, "ttft_p99": str(row["ttft_p99"]), "tpot_p99": str(row["tpot_p99"])})
    return {"model": name, "requests": n, "rate": rate, "prompt_tokens": prompt_tokens, "new_tokens": new_tokens,
            "token_budget": budget, "bandwidth_gb_s": bandwidth / 1e9, "rounds": rounds, "identical": identical,
            "threads": torch.get_num_threads(), **settings, "rows": rows}
