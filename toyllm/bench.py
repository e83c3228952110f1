"""Benchmarks behind the numbers in docs/benchmarks.md.

Run ``python -m toyllm bench`` (or ``make bench``). Every table is written
together with the command that produced it and the conditions of the run.
Timings are medians of repeated runs after a warm-up; ratios are taken
between numbers measured in the same run. Nothing here is asserted by tests.
"""
from __future__ import annotations

import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

# glibc gives big freed blocks back to the OS at once; on this kind of VM the
# page faults of mapping them again can double a timing. These settings keep
# the heap resident. They must be in the environment before Python starts,
# so the bench command re-executes itself with them (workers inherit them).
RESIDENT_HEAP_ENV = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": "100000000000"}


def ensure_resident_heap(argv: list[str]) -> None:
    """Re-run this command with RESIDENT_HEAP_ENV set, unless it already is."""
    if all(os.environ.get(k) == v for k, v in RESIDENT_HEAP_ENV.items()):
        return
    env = {**os.environ, **RESIDENT_HEAP_ENV}
    sys.stdout.flush()
    raise SystemExit(subprocess.call([sys.executable, "-m", "toyllm", *argv], env=env))


def median_time(fn, repeats: int = 5, warmup: int = 1) -> tuple[float, list[float]]:
    """Median seconds of ``fn()`` over ``repeats`` runs after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    runs = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - t)
    return statistics.median(runs), runs


def naive_vs_cached(model, prompt_len: int = 64, new_tokens: int = 256, repeats: int = 3, seed: int = 0) -> dict:
    """Time a greedy generation both ways on the same random prompt (seconds, medians)."""
    from .generate import generate

    prompt = torch.randint(0, model.config.vocab_size, (prompt_len,), generator=torch.Generator().manual_seed(seed))
    ids = prompt.tolist()
    outs = {}

    def run(method):
        outs[method] = generate(model, ids, new_tokens, method=method).output_ids

    naive_s, _ = median_time(lambda: run("naive"), repeats, warmup=0 if repeats == 1 else 1)
    cached_s, _ = median_time(lambda: run("cached"), repeats, warmup=1)
    return {"prompt_len": prompt_len, "new_tokens": new_tokens, "naive_s": naive_s, "cached_s": cached_s,
            "speedup": naive_s / cached_s, "identical": outs["naive"] == outs["cached"]}


def machine_line() -> str:
    return (f"{platform.machine()}, {os.cpu_count()} logical CPUs, torch {torch.__version__}, "
            f"{torch.get_num_threads()} intra-op threads unless stated; heap kept resident "
            f"({' '.join(f'{k}={v}' for k, v in RESIDENT_HEAP_ENV.items())})")


def bench_generation(quick: bool = False) -> str:
    from .weights import load_model

    repeats = 1 if quick else 3
    lines = ["## Naive generation vs KV cache", "",
             "Greedy generation of 256 new tokens after a 64-token random prompt, dense attention, "
             f"median of {repeats} runs after a warm-up. Both methods produce the same tokens "
             "(checked in the same run).", "",
             "| model | naive (s) | cached (s) | speedup | identical tokens |", "|---|---|---|---|---|"]
    for name in ("tiny", "bench"):
        model, _ = load_model(name)
        r = naive_vs_cached(model, 64, 64 if quick else 256, repeats)
        lines.append(f"| {name} | {r['naive_s']:.3f} | {r['cached_s']:.3f} | {r['speedup']:.1f}x | {r['identical']} |")
        print(lines[-1], flush=True)

    model, tok = load_model("smollm2-135m")
    from .generate import generate

    ids = tok.encode_chat("Write a short poem about the sea.")
    n = 16 if quick else 64
    results = [generate(model, ids, n) for _ in range(repeats + 1)][1:]
    tpot = statistics.median(r.tpot_s for r in results)
    ttft = statistics.median(r.ttft_s for r in results)
    lines += ["", "SmolLM2-135M (float32 weights dequantized from Q4_1/Q8_0), chat prompt of "
              f"{len(ids)} tokens, {n} new tokens, cached greedy decoding:", "",
              "| TTFT (ms) | time per output token (ms) | decode tokens/s |", "|---|---|---|",
              f"| {ttft * 1e3:.1f} | {tpot * 1e3:.1f} | {1 / tpot:.1f} |"]
    print(lines[-1], flush=True)
    return "\n".join(lines)


SECTIONS = {"generation": bench_generation}


def run_benchmarks(out: str, sections: list[str] | None = None, quick: bool = False) -> None:
    """Run the chosen sections and (re)write their blocks in the Markdown file ``out``."""
    argv = ["bench", "--out", out] + sum((["--only", s] for s in sections or []), []) + (["--quick"] if quick else [])
    ensure_resident_heap(argv)
    command = "python -m toyllm " + " ".join(argv)
    path = Path(out)
    text = path.read_text() if path.exists() else "# Benchmarks\n\nEvery table says which command produced it.\n"
    for name in sections or list(SECTIONS):
        body = SECTIONS[name](quick)
        block = (f"<!-- bench:{name} -->\n{body}\n\nProduced by `{command}` on {time.strftime('%Y-%m-%d')}; "
                 f"{machine_line()}.\n<!-- /bench:{name} -->")
        start, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
        if start in text and end in text:
            text = text[:text.index(start)] + block + text[text.index(end) + len(end):]
        else:
            text = text.rstrip() + "\n\n" + block + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(f"wrote {path}")
