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
from contextlib import contextmanager
from pathlib import Path

import torch

from .launch import WorkerPool
from .model import ModelConfig, build_model, get_config
from .utils import median_time, random_prompt
from .parallel import ModelSpec, measured_cost, parallel_prefill

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


def naive_vs_cached(model, prompt_len: int = 64, new_tokens: int = 256, repeats: int = 3, seed: int = 0) -> dict:
    """Time a greedy generation both ways on the same random prompt (seconds, medians)."""
    from .generation import generate

    ids = random_prompt(prompt_len, model.config.vocab_size, seed)
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


# A toy model wide enough that compute, not per-operator overhead, sets the cost of a step.
TOY_512 = ModelConfig(vocab_size=256, d_model=512, n_layers=4, n_heads=8, n_kv_heads=8, head_dim=64,
                      ffn_dim=2048, max_context=1024)


def bench_generation(quick: bool = False) -> str:
    from .weights import load_model

    repeats = 1 if quick else 3
    lines = ["## Naive generation vs KV cache", "",
             "Greedy generation of 256 new tokens after a 64-token random prompt, dense attention, "
             f"{torch.get_num_threads()} intra-op threads, median of {repeats} runs after a warm-up. Both methods produce the same tokens "
             "(checked in the same run).", "",
             "| model | naive (s) | cached (s) | speedup | identical tokens |", "|---|---|---|---|---|"]
    models = [(name, load_model(name)[0]) for name in ("tiny", "bench")]
    models.append((f"toy-512 ({TOY_512.d_model} wide, {TOY_512.n_layers} layers, MLP {TOY_512.ffn_dim})",
                   build_model(TOY_512)))
    speedups = {}
    for name, model in models:
        r = naive_vs_cached(model, 64, 64 if quick else 256, repeats)
        speedups[name] = r["speedup"]
        lines.append(f"| {name} | {r['naive_s']:.3f} | {r['cached_s']:.3f} | {r['speedup']:.1f}x | {r['identical']} |")
        print(lines[-1], flush=True)
    best = max(speedups, key=speedups.get)
    lines += ["", f"Target: the cache at least 10x faster than naive on a small toy model. Best here: "
              f"{speedups[best]:.1f}x on {best}, which {'meets' if speedups[best] >= 10 else 'does not meet'} it."]
    lines += ["", "A cached decode step pays a fixed cost per operator (Python and PyTorch dispatch) "
              "whatever the model's width; a naive step costs the whole prefix's compute. So the speedup grows with "
              "the work per token: modest on the 64-wide tiny model, large once a layer is a few hundred wide."]

    model, tok = load_model("smollm2-135m")
    from .generation import generate

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


@contextmanager
def _fresh_pool(spec, ids):
    """Two fresh one-thread workers, settled by untimed TSP runs on ``ids``: the first runs of new
    processes are often slow while this VM maps their memory."""

    with WorkerPool(2, threads_per_rank=1, timeout_s=3600) as pool:
        parallel_prefill(spec, ids, "tsp", pool.world_size, repeat=1, warmup=2, pool=pool)
        yield pool


def _single_s(spec, ids, threads: int, repeats: int, warmup: int = 1) -> float:
    """One-process prefill TTFT, run in a worker process of its own.

    A one-rank KVR prefill is exactly a single-process prefill. Running it in
    a short-lived process keeps its multi-GB attention scores out of this
    process's heap, which the resident-heap settings would never shrink.
    """

    with WorkerPool(1, threads_per_rank=threads, timeout_s=3600) as pool:
        return parallel_prefill(spec, ids, "kvr", 1, repeat=repeats, warmup=warmup, pool=pool).ttft_s


def bench_prefill(quick: bool = False) -> str:
    """TTFT of one process vs TSP vs KVR on 2 processes, bench preset, dense attention."""
    from .partition import partition_from_ratios, ttft_lower_bound

    spec = ModelSpec("bench")
    contexts = (1024, 2048) if quick else (1024, 2048, 4096, 8192)
    repeats = 1 if quick else 5
    warm = 1 if quick else 2      # this VM reclaims idle pages: a second warm-up steadies the first timed run
    sweep = (0.5, 0.55, 0.6) if quick else (0.5, 0.53, 0.56, 0.59, 0.62, 0.65)
    lines = ["## Parallel prefill: one process vs TSP vs KV-Runahead (p = 2)", "",
             "bench preset (d_model 256, 8 heads, 4 layers, MLP 256), dense attention (QK^T, then mask and "
             "softmax) for every method, random prompt. Two processes with one intra-op thread each, gloo over "
             f"loopback. TTFT in seconds, median of {repeats} runs after {warm} warm-up run(s) in the same processes. "
             "KVR-best: the best boundary of a sweep over first-rank shares "
             f"{', '.join(f'{r:.2f}' for r in sweep)} (each swept point timed with "
             f"{max(1, repeats - 2)} run(s), the best re-timed). TTFT*(2) is the paper's lower bound "
             "TTFT(1)/2 (1/2 + 1/4) from the one-thread single process.", "",
             "| context | 1 proc, 1 thread | 1 proc, 2 threads | TSP | KVR-E | KVR-best (split) | "
             "KVR-E vs TSP | KVR-best vs TSP | KVR-best vs 1 proc 2 threads | TTFT*(2) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    rows = []
    for C in contexts:
        ids = random_prompt(C, get_config("bench").vocab_size)
        one = _single_s(spec, ids, 1, repeats, warm)
        two = _single_s(spec, ids, 2, repeats, warm)
        with _fresh_pool(spec, ids) as pool:                               # fresh processes per context
            tsp = parallel_prefill(spec, ids, "tsp", 2, repeat=repeats, warmup=warm, pool=pool).ttft_s
            kvr_e = parallel_prefill(spec, ids, "kvr", 2, repeat=repeats, warmup=warm, pool=pool).ttft_s
            swept = {r: parallel_prefill(spec, ids, "kvr", 2, partition_from_ratios(C, [r, 1 - r]),
                                         repeat=max(1, repeats - 2), warmup=warm, pool=pool).ttft_s for r in sweep}
            best_r = min(swept, key=swept.get)
            best_chunks = partition_from_ratios(C, [best_r, 1 - best_r])
            best = parallel_prefill(spec, ids, "kvr", 2, best_chunks, repeat=repeats, warmup=warm, pool=pool).ttft_s
            rows.append({"context": C, "single_1t": one, "single_2t": two, "tsp": tsp, "kvr_even": kvr_e,
                         "kvr_best": best, "kvr_best_chunks": best_chunks})
            lines.append(f"| {C} | {one:.3f} | {two:.3f} | {tsp:.3f} | {kvr_e:.3f} | {best:.3f} {best_chunks} | "
                         f"{tsp / kvr_e:.2f}x | {tsp / best:.2f}x | {two / best:.2f}x | "
                         f"{ttft_lower_bound(one, 2):.3f} |")
            print(lines[-1], flush=True)
    last = rows[-1]
    verdict = ("meets" if last["tsp"] / last["kvr_best"] >= 1.25 else "does not meet")
    lines += ["", f"At {last['context']} tokens KVR with the best boundary is {last['tsp'] / last['kvr_best']:.2f}x "
              f"faster than TSP, which {verdict} the 1.25x target. Ratios above 1 mean faster than the named "
              "baseline. KVR wins because each rank computes only its own rectangle of the causal triangle "
              "(c_i (s_i + c_i) dot products instead of c_i C) and sends only to its neighbour; an uneven split "
              "(more tokens to rank 0) evens out the per-rank work."]
    lines += _sdpa_rows(contexts[-2:], repeats, warm, rows)
    return "\n".join(lines)


def _sdpa_rows(contexts, repeats: int, warm: int, dense_rows: list[dict]) -> list[str]:
    """The same comparison with PyTorch's fused kernel, which lets one process skip the masked half."""

    spec = ModelSpec("bench", attention="sdpa")
    lines = ["", "The same with `F.scaled_dot_product_attention` (`--attention sdpa`): a causal square "
             "(`is_causal=True`, the single process and KVR's rank 0) may skip the masked half; the other "
             "KVR ranks and every TSP rank pass an explicit mask for their rectangle.", "",
             "| context | 1 proc, 2 threads, sdpa | TSP, sdpa | KVR at the dense best split, sdpa | "
             "KVR vs TSP | KVR vs 1 proc 2 threads |", "|---|---|---|---|---|---|"]
    best = {r["context"]: r["kvr_best_chunks"] for r in dense_rows}
    for C in contexts:
        ids = random_prompt(C, get_config("bench").vocab_size)
        two = _single_s(spec, ids, 2, repeats, warm)
        with _fresh_pool(spec, ids) as pool:
            tsp = parallel_prefill(spec, ids, "tsp", 2, repeat=repeats, warmup=warm, pool=pool).ttft_s
            kvr = parallel_prefill(spec, ids, "kvr", 2, best[C], repeat=repeats, warmup=warm, pool=pool).ttft_s
        lines.append(f"| {C} | {two:.3f} | {tsp:.3f} | {kvr:.3f} {best[C]} | {tsp / kvr:.2f}x | {two / kvr:.2f}x |")
        print(lines[-1], flush=True)
    lines += ["", f"{_SDPA_LESSON} At {C} tokens one process with two threads takes {two:.3f} s against KVR's "
              f"{kvr:.3f} s."]
    return lines


_SDPA_LESSON = ("With a kernel that skips masked work the single process no longer pays for the upper "
                "triangle, which is exactly the waste KVR's rectangles avoid; the parallel ranks' masked "
                "rectangles get no such shortcut, so here KVR keeps its lead over TSP but can lose to one "
                "process.")


def bench_search(quick: bool = False) -> str:
    """Simulator vs measurement, measured vs simulated search, KVR-P vs KVR-S, simulated 8-GPU scaling."""
    from .analysis import LLAMA_7B
    from .partition import PartitionTable, partition_from_ratios, search_boundary_1d
    from .simulate import CostModel, a100_like, compare_methods, simulate_prefill, ttft_cost

    cfg, spec = get_config("bench"), ModelSpec("bench")
    repeats = 1 if quick else 3
    warm = 1 if quick else 2      # as in the prefill section: a second warm-up steadies the timed runs
    sizes = (1024, 2048, 4096) if not quick else (256, 512)
    CostModel.calibrate(cfg, contexts=sizes, repeats=1)        # untimed: a fresh process runs slow at first
    cm = CostModel.calibrate(cfg, contexts=sizes, repeats=3)
    lines = ["## Partition search: cost model, searches and the lookup table (p = 2)", "",
             f"Cost model {cm.label}: qkv {cm.qkv_s_per_token * 1e6:.2f} us/token, after-attention "
             f"{cm.mlp_s_per_token * 1e6:.2f} us/token, attention {cm.attn_s_per_dot * 1e9:.3f} ns per query-key "
             f"pair, {cm.layer_overhead_s * 1e3:.3f} ms per layer, per layer and rank; link "
             f"{cm.link_bandwidth_bytes_per_s / 1e9:g} GB/s + {cm.link_latency_s * 1e6:g} us (assumed). Measured "
             f"TTFT: bench preset, two processes with one thread each, median of {repeats} runs after {warm} "
             "warm-up run(s).", ""]
    contexts = (1024, 2048) if quick else (2048, 4096, 8192)
    lines += ["### Simulated vs measured TTFT", "", "| context | method | partition | simulated (s) | measured (s) | "
              "error |", "|---|---|---|---|---|---|"]
    errors = []
    for C in contexts:
        ids = random_prompt(C, cfg.vocab_size)
        with _fresh_pool(spec, ids) as pool:                               # fresh processes per context
            for method, ratio in [("tsp", 0.5), ("kvr", 0.5), ("kvr", 0.6), ("kvr", 0.7)]:
                chunks = partition_from_ratios(C, [ratio, 1 - ratio])
                sim = simulate_prefill(cfg, chunks, method, cm, record_events=False).ttft_s
                real = measured_cost(spec, ids, pool, method, repeat=repeats, warmup=warm)(chunks)
                errors.append(abs(sim - real) / real)
                lines.append(f"| {C} | {method.upper()} | {chunks} | {sim:.3f} | {real:.3f} | {(sim - real) / real:+.1%} |")
                print(lines[-1], flush=True)
    lines += ["", f"Largest error {max(errors):.1%}, median {statistics.median(errors):.1%} "
              f"(target: within 10%).", ""]

    # KVR-S found by searching real runs vs by searching the simulator, then KVR-P from a table.
    lines += ["### KVR-S: measured search vs simulated search; KVR-P from a lookup table", "",
              "| context | search | partition | evaluations | measured TTFT (s) |", "|---|---|---|---|---|"]
    target, table_contexts = (1536, (1024, 2048)) if quick else (4096, (2048, 6144))
    table = PartitionTable(2)
    kvr_s = None
    for C in sorted({*table_contexts, target}):
        ids = random_prompt(C, cfg.vocab_size)
        with _fresh_pool(spec, ids) as pool:
            measure = measured_cost(spec, ids, pool, repeat=repeats, warmup=warm)
            real = search_boundary_1d(measure, C, min_stride=max(1, C // 64), progress=True)
            lines.append(f"| {C} | measured | {real.partition} | {real.evaluations} | {real.cost_s:.3f} |")
            print(lines[-1], flush=True)
            if C in table_contexts:
                table.add(C, real.partition)
            else:
                kvr_s = real.partition
                sim = search_boundary_1d(ttft_cost(cfg, cm), C, min_stride=max(1, C // 64))
                lines.append(f"| {C} | simulated | {sim.partition} | {sim.evaluations} | {measure(sim.partition):.3f} |")
    # KVR-P: predict the target from the two neighbours, then time it side by side with KVR-S.
    predicted = table.predict(target)
    ids = random_prompt(target, cfg.vocab_size)
    with _fresh_pool(spec, ids) as pool:
        measure = measured_cost(spec, ids, pool, repeat=repeats, warmup=warm)
        rounds = [(measure(predicted), measure(kvr_s)) for _ in range(3)]   # alternate, so drift hits both
        t_p, t_s = (statistics.median(r[i] for r in rounds) for i in (0, 1))
    lines.append(f"| {target} | KVR-P (table {list(table_contexts)}) | {predicted} | 0 | {t_p:.3f} |")
    lines += ["", f"KVR-P at {target} tokens, interpolated between the searched partitions at "
              f"{' and '.join(map(str, table_contexts))}, is {(t_p - t_s) / t_s:+.1%} from KVR-S "
              f"(timed side by side in alternating rounds, medians: {t_p:.3f} s vs {t_s:.3f} s; target: within 2%).", ""]

    # Simulated scaling on assumed A100-class GPUs (the paper's setup), never measured here.
    lines += ["### Simulated scaling to 8 GPUs (simulated, assumed A100-class hardware)", "",
              f"Llama-7B shape, fp16, cost model: {a100_like(LLAMA_7B).label}. All numbers below are simulated.", "",
              "| context | GPUs | link | single (s) | TSP (s) | KVR-E (s) | KVR-S (s) | TTFT*(p) (s) | KVR-S vs TSP |",
              "|---|---|---|---|---|---|---|---|---|"]
    for C, p, bw in ([(4096, 2, 300e9), (4096, 4, 300e9)] if quick else
                     [(16384, 2, 300e9), (16384, 4, 300e9), (16384, 8, 300e9), (8192, 8, 300e9),
                      (4096, 8, 300e9), (16384, 8, 10e9), (16384, 8, 1e9)]):
        r = compare_methods(LLAMA_7B, C, p, a100_like(LLAMA_7B, link_bandwidth_bytes_per_s=bw))
        lines.append(f"| {C} | {p} | {bw / 1e9:g} GB/s | {r['single']:.3f} | {r['tsp']:.3f} | {r['kvr_even']:.3f} | "
                     f"{r['kvr_searched']:.3f} | {r['lower_bound']:.3f} | {r['tsp'] / r['kvr_searched']:.2f}x |")
        print(lines[-1], flush=True)
    lines += ["", "For orientation, the paper reports KVR-S 1.41x faster than TSP for Llama-7B on 8 A100s at 16k; "
              "the simulator is a model with assumed coefficients, not a reproduction."]
    return "\n".join(lines)


SECTIONS = {"generation": bench_generation, "prefill": bench_prefill, "search": bench_search}


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
