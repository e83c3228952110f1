"""Benchmark section of the attention kernels alone, on the shapes a two-process prefill needs."""
from __future__ import annotations

import statistics

import torch

from ..attention import ATTENTION_KERNELS
from ..measure import interleaved_runs
from ..model import get_config
from .common import intra_op_threads


ATTENTION_BENCH_KERNELS = ("dense", "sdpa", "blockwise", "causal")
ATTENTION_BENCH_SPLITS = (0.5, 0.707)        # rank 0's share of the context for p = 2; 0.707 balances skipping kernels


def bench_attention(quick: bool = False, contexts: tuple[int, ...] | None = None, repeats: int = 5) -> dict:
    """Attention kernels alone: seconds (medians) of each on each shape a p = 2 prefill of C tokens needs, one thread.

    Where KV-Runahead's advantage comes from: one process computes the causal
    square of the prompt, a rank r > 0 a rectangle (its chunk's queries
    against every key before them). A kernel that skips masked pairs does
    half the square's work, so the parallel ranks keep their edge only if
    their rectangles skip too. Kernels take turns for ``repeats`` rounds after
    a warm-up round (``measure.interleaved_runs``): a slow spell of a shared
    machine hits every kernel alike, so their ratios hold even when the
    absolute times drift.

    Per context C: the one-process causal square of C ("square", and sdpa's
    time for it on two threads: what one process gets from both cores); per
    split s = share * C, rank 0's causal square of s and rank 1's rectangle,
    queries [s, C) x keys [0, C). ``contexts`` overrides the quick/full choice.
    """
    cfg = get_config("bench")
    H, D = cfg.n_heads, cfg.head_dim
    contexts = contexts or ((1024, 2048, 4096) if quick else (2048, 4096, 8192))
    g = torch.Generator().manual_seed(0)

    def timed(q, k, v, a: int, b: int) -> dict:
        """Every kernel on queries [a, b) x keys [0, b), one thread; for the whole square also sdpa on two."""
        args = (q[..., a:b, :], k[..., :b, :], v[..., :b, :], torch.arange(a, b), torch.arange(b))
        fns = {n: lambda f=ATTENTION_KERNELS[n]: f(*args) for n in ATTENTION_BENCH_KERNELS}

        def sdpa_two_threads():                  # what one process gets from both cores
            with intra_op_threads(2):
                ATTENTION_KERNELS["sdpa"](*args)

        if (a, b) == (0, q.shape[-2]):
            fns["sdpa_2_threads"] = sdpa_two_threads
        with intra_op_threads(1):
            runs = interleaved_runs(fns, repeats, warmup=1)
        times = {name: statistics.median(r) for name, r in runs.items()}
        print(f"  queries [{a}, {b}) x keys [0, {b}): " + ", ".join(f"{n} {t:.3f} s" for n, t in times.items()),
              flush=True)
        return times

    results = []
    for C in contexts:
        q, k, v = (torch.randn(1, H, C, D, generator=g) for _ in range(3))   # (1, H, C, D)
        splits = []
        for share in ATTENTION_BENCH_SPLITS:
            s = round(share * C)
            splits.append({"share": share, "rank0": timed(q, k, v, 0, s), "rank1": timed(q, k, v, s, C)})
        results.append({"context": C, "square": timed(q, k, v, 0, C), "splits": splits})
    return {"heads": H, "head_dim": D, "repeats": repeats, "kernels": list(ATTENTION_BENCH_KERNELS),
            "contexts": results}
