"""Attention kernels alone, timed: where KV-Runahead's advantage comes from.

One process computes the causal square of a C-token prompt. A KV-Runahead
rank r > 0 computes a rectangle: the queries of its chunk [s, C) against the
keys [0, C). A kernel that skips masked pairs does half the square's work,
so the parallel ranks only keep their edge if their rectangles skip too.
This measures both shapes at the bench preset's attention shape, one thread,
with every registered kernel::

    python -m toyllm.bench_kernels [--quick]

"sdpa" takes the square with ``is_causal`` (it skips the masked half) and the
rectangle with an explicit mask (it computes every pair). Times are medians
in seconds after a warm-up, the kernels timed in turns; every ratio divides
two times of the same run.
Correctness is the tests' job (tests/test_attention.py), not this file's.
"""
from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager

import torch

from .attention import ATTENTION_KERNELS
from .model import get_config

KERNELS = ("dense", "sdpa", "blockwise", "causal")
SPLITS = (0.5, 0.707)        # rank 0's share of the context for p = 2; 0.707 balances skipping kernels


def interleaved_medians(fns: dict, repeats: int) -> dict:
    """Median seconds of each ``fn()``, one warm-up each, then timed in turns (a, b, c, a, b, c, ...).

    Taking turns makes a slow spell of a shared machine hit every kernel alike,
    so their ratios hold even when the absolute times drift.
    """
    runs = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(repeats):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            runs[name].append(time.perf_counter() - t)
    return {name: statistics.median(r) for name, r in runs.items()}


@contextmanager
def _threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def measure_attention_kernels(quick: bool = False, contexts: tuple[int, ...] | None = None, repeats: int = 5) -> dict:
    """Seconds (medians) of each kernel on each shape a p = 2 prefill of C tokens needs, one thread.

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
        fns = {n: lambda f=ATTENTION_KERNELS[n]: f(*args) for n in KERNELS}

        def sdpa_two_threads():                  # what one process gets from both cores
            with _threads(2):
                ATTENTION_KERNELS["sdpa"](*args)

        if (a, b) == (0, q.shape[-2]):
            fns["sdpa_2_threads"] = sdpa_two_threads
        with _threads(1):
            times = interleaved_medians(fns, repeats)
        print(f"  queries [{a}, {b}) x keys [0, {b}): " + ", ".join(f"{n} {t:.3f} s" for n, t in times.items()),
              flush=True)
        return times

    results = []
    for C in contexts:
        q, k, v = (torch.randn(1, H, C, D, generator=g) for _ in range(3))   # (1, H, C, D)
        splits = []
        for share in SPLITS:
            s = round(share * C)
            splits.append({"share": share, "rank0": timed(q, k, v, 0, s), "rank1": timed(q, k, v, s, C)})
        results.append({"context": C, "square": timed(q, k, v, 0, C), "splits": splits})
    return {"heads": H, "head_dim": D, "repeats": repeats, "contexts": results}


def bench_attention_kernels(quick: bool = False, command: str | None = None) -> str:
    """Measure (:func:`measure_attention_kernels`) and return the Markdown table, naming the command and machine."""
    command = command or "python -m toyllm.bench_kernels" + (" --quick" if quick else "")
    return attention_kernels_markdown(measure_attention_kernels(quick), command)


def attention_kernels_markdown(data: dict, command: str) -> str:
    """The Markdown table of :func:`measure_attention_kernels`'s numbers, with the command and the machine."""
    from .bench import machine_line   # here, not at the top: bench imports this module

    def row(C, work, t):
        return (f"| {C} | {work} | " + " | ".join(f"{t[n]:.3f}" for n in KERNELS)
                + f" | {t['dense'] / t['causal']:.2f}x | {t['sdpa'] / t['causal']:.2f}x |")

    lines = [f"Attention alone: {data['heads']} heads, head_dim {data['head_dim']}, batch 1, one thread, "
             f"median seconds of {data['repeats']} runs after a warm-up. Split s: rank 0 holds tokens [0, s), "
             "rank 1 the rest; rank 1's rectangle is its queries [s, C) against the keys [0, C).", "",
             "| C | work | " + " | ".join(f"{n} (s)" for n in KERNELS) + " | causal vs dense | causal vs sdpa |",
             "|---:|---|" + "---:|" * (len(KERNELS) + 2)]
    summary = []
    for c in data["contexts"]:
        C = c["context"]
        lines.append(row(C, "one process: causal square", c["square"]))
        kvr = []
        for sp in c["splits"]:
            s = round(sp["share"] * C)
            lines.append(row(C, f"split {s}: rank 0, causal square", sp["rank0"]))
            lines.append(row(C, f"split {s}: rank 1, rectangle", sp["rank1"]))
            kvr.append(f"{max(sp['rank0']['causal'], sp['rank1']['causal']):.3f} s at split {s} ({sp['share']} C)")
        summary.append(f"- C = {C}: one process with sdpa's causal kernel {c['square']['sdpa']:.3f} s on one thread, "
                       f"{c['square']['sdpa_2_threads']:.3f} s on two; the slower KVR rank with the causal kernel "
                       + ", ".join(kvr) + ".")
    lines += ["", "A p = 2 split against one process (attention of one layer only, no communication):", "", *summary,
              "", '"sdpa" skips the masked half of a causal square (`is_causal`) but takes a rectangle with an '
              'explicit mask and computes every pair of it; "causal" computes a rectangle as an unmasked fused '
              "call over the prefix plus a causal one over the chunk, merged by their log-sum-exps; \"blockwise\" "
              "is the plain-PyTorch online softmax (blocks of 256 keys).", "",
              f"Produced by `{command}`; {machine_line()}."]
    return "\n".join(lines)


if __name__ == "__main__":
    from .bench import RESIDENT_HEAP_ENV

    if any(os.environ.get(k) != v for k, v in RESIDENT_HEAP_ENV.items()):   # keep the heap resident (see bench.py)
        raise SystemExit(subprocess.call([sys.executable, "-m", "toyllm.bench_kernels", *sys.argv[1:]],
                                         env={**os.environ, **RESIDENT_HEAP_ENV}))
    print(bench_attention_kernels(quick="--quick" in sys.argv[1:]))
