"""Benchmarks behind the numbers in docs/benchmarks.md.

Run ``python -m toyllm bench`` (or ``make bench``). Every table is written
together with the command that produced it and the conditions of the run.
Timings are medians of repeated runs after a warm-up; ratios are taken
between numbers measured in the same run, and every comparison is decided
by ``toyllm.measure`` (interleaved runs, ``compare``'s rank test). Nothing
here is asserted by tests.

One module per kind of section (``generation``, ``prefill``, ``ring``,
``search``, ``attention``, ``decode``, ``serving``); ``report`` turns a section's
numbers into its Markdown and writes the file. This module runs them.
``llama`` runs llama.cpp in a process of its own (an optional install), which
the weights and llama_prefill sections put beside toyllm where it is found.
"""
from __future__ import annotations

import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from .attention import ATTENTION_BENCH_KERNELS, ATTENTION_BENCH_SPLITS, bench_attention
from .decode import add_floor_figures, bench_batched, bench_decode_step, bench_weights
from .generation import bench_first_token, bench_generation, naive_vs_cached, time_naive_and_cached
from .prefill import bench_kernels, bench_llama_prefill, bench_prefill, time_split
from .report import render_section, write_blocks
from .ring import bench_ring
from .search import bench_search, bench_table
from .serving import bench_serving

# What the command line, the demo and the tests use; the sections' helpers stay in their modules.
__all__ = ["RESIDENT_HEAP_ENV", "SECTIONS", "ensure_resident_heap", "cpu_name", "machine_line", "run_benchmarks",
           "render_section", "naive_vs_cached", "time_naive_and_cached", "time_split", "add_floor_figures",
           "ATTENTION_BENCH_KERNELS", "ATTENTION_BENCH_SPLITS", "bench_generation", "bench_first_token",
           "bench_prefill", "bench_search", "bench_table", "bench_kernels", "bench_attention", "bench_weights",
           "bench_batched", "bench_decode_step", "bench_serving", "bench_llama_prefill"]

# glibc gives big freed blocks back to the OS at once; on this kind of VM the
# page faults of mapping them again can double a timing. These settings keep
# the heap resident. They must be in the environment before Python starts,
# so the bench command re-executes itself with them (workers inherit them).
RESIDENT_HEAP_ENV = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": "100000000000"}


def ensure_resident_heap(argv: list[str]) -> None:
    """Re-run this command with RESIDENT_HEAP_ENV set, unless it already is (raises SystemExit with its status).

    The re-run does the work, so a request to stop reaches it: the command line raises SIGTERM and
    SIGHUP as ``supervise.Terminated``, and the same signal goes on to the re-run, which stops as
    the command would (its workers ended, its file unwritten); after Ctrl-C (a terminal's reaches
    both) it gets a few seconds to stop by itself before it is told to.
    """
    if all(os.environ.get(k) == v for k, v in RESIDENT_HEAP_ENV.items()):
        return
    env = {**os.environ, **RESIDENT_HEAP_ENV}
    sys.stdout.flush()
    rerun = subprocess.Popen([sys.executable, "-m", "toyllm", *argv], env=env)
    try:
        status = rerun.wait()
    except KeyboardInterrupt as stop:             # Ctrl-C, or a stop signal raised as Terminated
        signum = getattr(stop, "signum", signal.SIGINT)
        if signum != signal.SIGINT:
            rerun.send_signal(signum)
        try:
            status = rerun.wait(timeout=10)
        except subprocess.TimeoutExpired:
            rerun.terminate()
            status = rerun.wait()
    raise SystemExit(128 - status if status < 0 else status)


def cpu_name() -> str:
    """The CPU's model name (Linux: /proc/cpuinfo) and the vector instructions PyTorch's kernels use on it:
    the same code runs different kernels on an AVX2 and an AVX-512 machine, so a timing needs both."""
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), name)
    except OSError:
        pass
    return f"{name}, PyTorch CPU capability {torch.backends.cpu.get_cpu_capability()}"


def machine_line() -> str:
    return (f"{cpu_name()}, {platform.machine()}, {os.cpu_count()} logical CPUs, torch {torch.__version__}, "
            f"{torch.get_num_threads()} intra-op threads unless stated; heap kept resident "
            f"({' '.join(f'{k}={v}' for k, v in RESIDENT_HEAP_ENV.items())})")


SECTIONS = {"generation": bench_generation, "first_token": bench_first_token, "prefill": bench_prefill,
            "search": bench_search, "table": bench_table, "kernels": bench_kernels, "attention": bench_attention,
            "weights": bench_weights, "batched": bench_batched, "decode_step": bench_decode_step,
            "serving": bench_serving, "ring": bench_ring, "llama_prefill": bench_llama_prefill}


def run_benchmarks(out: str, sections: list[str] | None = None, quick: bool = False) -> None:
    """Run the chosen sections and (re)write their blocks in the Markdown file ``out``."""
    argv = ["bench", "--out", out] + sum((["--only", s] for s in sections or []), []) + (["--quick"] if quick else [])
    ensure_resident_heap(argv)
    command = "python -m toyllm " + " ".join(argv)
    blocks = {}
    for name in sections or list(SECTIONS):
        body = render_section(name, SECTIONS[name](quick))
        blocks[name] = (f"{body}\n\nProduced by `{command}` on {time.strftime('%Y-%m-%d')}; "
                        f"{machine_line()}.")
    path = Path(out)
    write_blocks(path, blocks)
    print(f"wrote {path}")
