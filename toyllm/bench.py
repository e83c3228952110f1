"""Benchmarks behind the numbers in docs/benchmarks.md.

Run ``python -m toyllm bench`` (or ``make bench``). Every table is written
together with the command that produced it and the conditions of the run.
Timings are medians of repeated runs after a warm-up; ratios are taken
between numbers measured in the same run. Nothing here is asserted by tests.
"""
from __future__ import annotations

import functools
import os
import platform
import signal
import stat
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from .attention import ATTENTION_KERNELS
from .launch import WorkerPool, run_parallel
from .model import ModelConfig, build_model, get_config
from .utils import random_prompt
from .parallel import ModelSpec, measured_cost, parallel_prefill
from .timeline import Event

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


def naive_vs_cached(model, prompt_len: int = 64, new_tokens: int = 256, rounds: int = 3, seed: int = 0) -> dict:
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
    from .generation import generate
    from .measure import compare, interleaved_runs, spread

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


# A toy model wide enough that compute, not per-operator overhead, sets the cost of a step.
TOY_512 = ModelConfig(vocab_size=256, d_model=512, n_layers=4, n_heads=8, n_kv_heads=8, head_dim=64,
                      ffn_dim=2048, max_context=1024)


def bench_generation(quick: bool = False) -> dict:
    """Naive vs cached generation on three toy widths, and SmolLM2's decode speed (seconds, medians)."""
    from .generation import generate
    from .weights import load_model

    repeats = 2 if quick else 3
    new_tokens = 64 if quick else 512
    models = [(name, load_model(name)[0]) for name in ("tiny", "bench")]
    models.append((f"toy-512 ({TOY_512.d_model} wide, {TOY_512.n_layers} layers, MLP {TOY_512.ffn_dim})",
                   build_model(TOY_512)))
    rows = []
    for name, model in models:
        rows.append({"name": name, **naive_vs_cached(model, 64, new_tokens, repeats)})
        _progress(rows[-1])
    # the target's own setting: the bench preset, 256 new tokens after 64 (`generate --model bench --method ...`)
    target = naive_vs_cached(models[1][1], 64, 64 if quick else 256, 2 if quick else 5)
    _progress(target)
    model, tok = load_model("smollm2-135m")
    ids = tok.encode_chat("Write a short poem about the sea.")
    n = 16 if quick else 64
    results = [generate(model, ids, n) for _ in range(repeats + 1)][1:]
    smol = {"prompt_len": len(ids), "new_tokens": n, "ttft_s": statistics.median(r.ttft_s for r in results),
            "tpot_s": statistics.median(r.tpot_s for r in results)}
    _progress(smol)
    return {"prompt_len": 64, "new_tokens": new_tokens, "threads": torch.get_num_threads(), "repeats": repeats,
            "rows": rows, "best": max(rows, key=lambda r: r["speedup"]), "target": target, "smol": smol}


def bench_first_token(quick: bool = False) -> dict:
    """SmolLM2 prefill with the whole T x vocab logits matrix vs the last position only (seconds)."""
    from .analysis import prefill_flops
    from .measure import compare
    from .weights import load_model

    model, tok = load_model("smollm2-135m")
    repeats = 2 if quick else 5
    prompts = [("chat: What is the capital of France?", tok.encode_chat("What is the capital of France?")),
               ("random", random_prompt(256 if quick else 1024, model.config.vocab_size))]
    rows = []
    for name, ids in prompts:
        x = torch.tensor([ids])
        times = {True: [], False: []}
        with torch.no_grad():
            for r in range(repeats + 1):            # alternate, so drift hits both ways alike; round 0 warms up
                for last_only in (False, True):
                    t0 = time.perf_counter()
                    model(x, last_only=last_only)
                    if r:
                        times[last_only].append(time.perf_counter() - t0)
        cfg = model.config
        head = 2 * len(ids) * cfg.vocab_size * cfg.d_model
        rows.append({"name": name, "tokens": len(ids), "all_s": statistics.median(times[False]),
                     "last_s": statistics.median(times[True]), "verdict": compare(times[True], times[False]),
                     "head_gflop": head / 1e9,
                     "total_gflop": prefill_flops(cfg, len(ids)) / 1e9})
        _progress(rows[-1])
    return {"threads": torch.get_num_threads(), "repeats": repeats, "vocab": model.config.vocab_size, "rows": rows}


@contextmanager
def _fresh_pool(spec, ids, settle: int = 3):
    """Two fresh one-thread workers, settled by ``settle`` untimed TSP runs on ``ids``: the first runs of
    new processes are often slow while this VM maps their memory."""

    with WorkerPool(2, threads_per_rank=1, timeout_s=3600) as pool:
        parallel_prefill(spec, ids, "tsp", pool.world_size, repeat=1, warmup=settle - 1, pool=pool)
        yield pool


def bench_prefill(quick: bool = False) -> dict:
    """TTFT of one process (1 and 2 threads) vs TSP, KVR-E and KVR-best on 2 processes, bench preset, dense
    attention, all five taking turns round by round (``measure.compare_prefills``); then the same with sdpa.

    Each row keeps every configuration's runs (seconds) and the verdicts computed from them.
    """
    from .measure import ONE_THREAD, TWO_THREADS, check_machine, compare_prefills
    from .partition import partition_from_ratios, ttft_lower_bound

    spec = ModelSpec("bench")
    # Not 8192: a dense one-process run there held nearly 11 GB (scores, mask, softmax), which the
    # resident heap keeps; beside the two-process pool in turns, that exceeded this machine's 23 GB.
    contexts = (1024, 2048) if quick else (1024, 2048, 4096)
    rounds = 2 if quick else 5
    warm = 1 if quick else 2      # this VM reclaims idle pages: a second warm-up steadies the first timed run
    sweep = (0.5, 0.55, 0.6) if quick else (0.5, 0.53, 0.56, 0.59, 0.62, 0.65)
    sweep_repeats = 1 if quick else 3
    machine = check_machine()
    print(f"  {machine.line}", flush=True)
    rows = []
    for C in contexts:
        ids = random_prompt(C, spec.config.vocab_size)
        with _fresh_pool(spec, ids) as pool:                               # fresh processes per context
            swept = {r: parallel_prefill(spec, ids, "kvr", 2, partition_from_ratios(C, [r, 1 - r]),
                                         repeat=sweep_repeats, warmup=warm, pool=pool).ttft_s for r in sweep}
        best_r = min(swept, key=swept.get)
        best_chunks = partition_from_ratios(C, [best_r, 1 - best_r])
        rows.append(_prefill_row(compare_prefills(
            spec, ids, {"TSP": {"method": "tsp"}, "KVR-E": {"method": "kvr"},
                        "KVR-best": {"method": "kvr", "partition": best_chunks}},
            rounds=rounds, warmup=warm, timeout_s=3600, machine=machine, single_in_workers=True),
            spec.config, best_chunks, ttft_lower_bound(1.0, 2)))
        _progress({"context": C, **{k: str(v) for k, v in rows[-1]["runs"].items()}})
    sdpa = []
    for C in contexts[-2:]:
        chunks = next(r["chunks"] for r in rows if r["context"] == C)
        sdpa_spec = ModelSpec("bench", attention="sdpa")
        cmp = compare_prefills(sdpa_spec, random_prompt(C, spec.config.vocab_size),
                               {"TSP": {"method": "tsp"}, "KVR": {"method": "kvr", "partition": chunks}},
                               rounds=rounds, warmup=warm, timeout_s=3600, machine=machine, single_in_workers=True)
        sdpa.append({"context": C, "chunks": chunks, "runs": cmp.runs, "baseline": cmp.baseline,
                     "vs_tsp": cmp.verdict("KVR", "TSP"), "vs_base": cmp.verdict("KVR")})
        _progress({"context": C, "sdpa": True, **{k: str(v) for k, v in cmp.runs.items()}})
    return {"rounds": rounds, "warm": warm, "sweep": [f"{r:.2f}" for r in sweep], "sweep_repeats": sweep_repeats,
            "machine": machine.line, "one_thread": ONE_THREAD, "two_threads": TWO_THREADS, "rows": rows, "sdpa": sdpa}


def _prefill_row(cmp, cfg, chunks: list[int], bound_factor: float) -> dict:
    """One context of the prefill section: the runs, the verdicts, and the paper's lower bound TTFT*(2)
    computed from each one-thread run (``bound_factor`` = 3/8), with the configurations that beat it."""
    from .measure import ONE_THREAD

    bound = cmp.runs[ONE_THREAD].scaled(bound_factor)
    below = [name for name in cmp.parallel if cmp.runs[name].median < bound.median]
    return {"context": cmp.context, "chunks": chunks, "runs": cmp.runs, "baseline": cmp.baseline, "why": cmp.why,
            "bound": bound, "below_bound": below,
            "scores_mb": cfg.n_heads * cmp.context ** 2 * 4 / 1e6,       # one layer's float32 scores, one process
            "verdicts": {"kvr_e_vs_tsp": cmp.verdict("KVR-E", "TSP"), "best_vs_tsp": cmp.verdict("KVR-best", "TSP"),
                         "best_vs_base": cmp.verdict("KVR-best")}}


def _calibrate_block(ctx, cfg: ModelConfig, sizes: tuple[int, ...]):
    """The worker of bench_search's Block calibration (one thread, as each rank of a run gets)."""
    from .simulate import CostModel

    CostModel.calibrate(cfg, contexts=sizes, repeats=1)        # untimed: a fresh process runs slow at first
    return CostModel.calibrate(cfg, contexts=sizes, repeats=3)


def scores_alignment(quick: bool = False, rounds: int = 5) -> list[dict]:
    """The scores q k^T of the bench preset's heads alone, on one thread (what each rank of a p = 2 run
    gets), for key counts that are a multiple of 8 and a few that are not: seconds per query-key pair
    and head, the shapes taking turns, each against the multiple of 8 at or below it."""
    from .measure import compare, interleaved_runs, spread

    cfg = get_config("bench")
    queries = 512 if quick else 2048
    key_counts = (1024, 1026, 1028, 1032) if quick else (4096, 4097, 4098, 4100, 4104, 5733, 5734, 5736)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, cfg.n_heads, queries, cfg.head_dim, generator=g)                    # (1, H, T, D)
    keys = {S: torch.randn(1, cfg.n_heads, S, cfg.head_dim, generator=g) for S in key_counts}  # (1, H, S, D)
    with _threads(1), torch.inference_mode():
        runs = interleaved_runs({S: (lambda k=k: q @ k.transpose(-2, -1)) for S, k in keys.items()}, rounds)
    per_pair = {S: [t / (queries * S * cfg.n_heads) for t in r] for S, r in runs.items()}
    rows = []
    for S in key_counts:
        below = max(A for A in key_counts if A % 8 == 0 and A <= S)       # the aligned count next to it
        rows.append({"keys": S, "queries": queries, "aligned": S % 8 == 0, "per_pair": spread(per_pair[S]),
                     "reference": below, "vs_reference": compare(per_pair[below], per_pair[S]) if S != below else None})
    return rows


def bench_search(quick: bool = False) -> dict:
    """The measured link, the cost model (fitted to real runs, and from one Block alone) vs measured TTFT,
    measured vs simulated search, KVR-P vs KVR-S, simulated 8-GPU scaling."""
    from .analysis import LLAMA_7B
    from .partition import PartitionTable, partition_from_ratios, search_boundary_1d
    from .measure import compare, interleaved_runs, spread
    from .parallel import measure_link
    from .parallel.link import size_label
    from .simulate import CostModel, a100_like, compare_methods, simulate_prefill, ttft_cost

    cfg, spec = get_config("bench"), ModelSpec("bench")
    repeats = 1 if quick else 3
    warm = 1 if quick else 2      # as in the prefill section: a second warm-up steadies the timed runs
    # The accuracy table's rows get more runs than a search's evaluations: a 2048-token run here takes
    # about 0.25 s and stalls now and then by a fifth, and a median of 3 lets two such runs decide a row.
    accuracy_repeats = 1 if quick else 7
    sizes = (1024, 2048, 4096) if not quick else (256, 512)
    # In a process of its own: with the heap kept resident, this one would hold the block's gigabytes of
    # scores through the 8192-token runs below, and those need all the memory there is.
    block = run_parallel(_calibrate_block, 1, (cfg, sizes), timeout_s=1800)[0]
    # The model the searches use is fitted to real runs at lengths and splits the accuracy table does not hold.
    fit_contexts = (768, 1536) if quick else (1536, 3072, 6144, 7168)
    fitted_on, link = [], None
    for C in fit_contexts:
        ids = random_prompt(C, cfg.vocab_size)
        with _fresh_pool(spec, ids) as pool:
            link = link or measure_link(pool=pool, repeats=5 if quick else 15)
            for method, ratio in (("tsp", 0.5), ("kvr", 0.55), ("kvr", 0.65)):
                chunks = partition_from_ratios(C, [ratio, 1 - ratio])
                for warmup in (1, 0, 0):            # three timelines of each, after one warm-up run
                    fitted_on.append(parallel_prefill(spec, ids, method, 2, chunks, repeat=1, warmup=warmup,
                                                      pool=pool))
    cm = CostModel.fit_runs(cfg, fitted_on, **link.cost_model_fields)
    block = block.with_(**link.cost_model_fields)
    accuracy, ragged = [], None
    contexts = (1024, 2048) if quick else (2048, 4096, 8192)
    for C in contexts:
        ids = random_prompt(C, cfg.vocab_size)
        rows = [(method, partition_from_ratios(C, [ratio, 1 - ratio]))
                for method, ratio in [("tsp", 0.5), ("kvr", 0.5), ("kvr", 0.6), ("kvr", 0.7)]]
        with _fresh_pool(spec, ids) as pool:                               # fresh processes per context
            # The rows take turns, one run each per round, so that a slow spell of the machine (its memory
            # bandwidth shifts from run to run) hits every row of the context alike.
            measure = {method: measured_cost(spec, ids, pool, method=method, repeat=1, warmup=0)
                       for method in ("tsp", "kvr")}
            runs = interleaved_runs({i: (lambda m=method, ch=chunks: measure[m](ch))
                                     for i, (method, chunks) in enumerate(rows)}, accuracy_repeats, warmup=warm)
            for i, (method, chunks) in enumerate(rows):
                sim, sim_block = (simulate_prefill(cfg, chunks, method, m, record_events=False).ttft_s
                                  for m in (cm, block))
                real = spread(runs[i])
                accuracy.append({"context": C, "method": method, "chunks": chunks, "sim": sim, "real": real.median,
                                 "sim_block": sim_block, "runs": real})
                _progress(accuracy[-1])
            if C == contexts[-1]:
                ragged = _ragged_vs_aligned(spec, cfg, ids, pool, cm, accuracy[-1]["chunks"], 2 if quick else 5, warm)
    errors = [abs(r["sim"] - r["real"]) / r["real"] for r in accuracy]
    for r, e in zip(accuracy, errors):
        r["beyond"] = e > 0.10                    # beyond the 10% target
    block_errors = [abs(r["sim_block"] - r["real"]) / r["real"] for r in accuracy]

    # KVR-S found by searching real runs vs by searching the simulator, then KVR-P from a table.
    target, table_contexts = (1536, (1024, 2048)) if quick else (4096, (2048, 6144))
    table, searches, kvr_s = PartitionTable(2), [], None
    for C in sorted({*table_contexts, target}):
        ids = random_prompt(C, cfg.vocab_size)
        with _fresh_pool(spec, ids) as pool:
            measure = measured_cost(spec, ids, pool, repeat=repeats, warmup=warm)
            real = search_boundary_1d(measure, C, min_stride=max(1, C // 64), progress=True)
            searches.append({"context": C, "search": "measured", "chunks": real.partition,
                             "evaluations": real.evaluations, "ttft": real.cost_s})
            if C in table_contexts:
                table.add(C, real.partition)
            else:
                kvr_s = real.partition
                sim = search_boundary_1d(ttft_cost(cfg, cm), C, min_stride=max(1, C // 64))
                searches.append({"context": C, "search": "simulated", "chunks": sim.partition,
                                 "evaluations": sim.evaluations, "ttft": measure(sim.partition)})
    # KVR-P: predict the target from the two neighbours, then time it side by side with KVR-S.
    predicted = table.predict(target)
    ids = random_prompt(target, cfg.vocab_size)
    with _fresh_pool(spec, ids) as pool:
        measure = measured_cost(spec, ids, pool, repeat=repeats, warmup=warm)
        runs = interleaved_runs({"p": lambda: measure(predicted), "s": lambda: measure(kvr_s)}, 5, warmup=0)
        p_vs_s = compare(runs["p"], runs["s"])          # in turns, so drift hits both
        t_p, t_s = p_vs_s.ours.median, p_vs_s.base.median
    searches.append({"context": target, "search": f"KVR-P (table {list(table_contexts)})", "chunks": predicted,
                     "evaluations": 0, "ttft": t_p})

    # Simulated scaling on assumed A100-class GPUs (the paper's setup), never measured here.
    scaling = []
    for C, p, bw in ([(4096, 2, 300e9), (4096, 4, 300e9)] if quick else
                     [(16384, 2, 300e9), (16384, 4, 300e9), (16384, 8, 300e9), (8192, 8, 300e9),
                      (4096, 8, 300e9), (16384, 8, 10e9), (16384, 8, 1e9)]):
        r = compare_methods(LLAMA_7B, C, p, a100_like(LLAMA_7B, link_bandwidth_bytes_per_s=bw))
        scaling.append({**r, "bandwidth": bw})
    alignment = scores_alignment(quick)        # why a ragged split costs more: the scores' product alone
    link_rows = [{"size": size_label(n), "median": m,
                  "low": min(r), "high": max(r), "fit": link.predict_s(n)}
                 for n, m, r in zip(link.sizes_bytes, link.median_s, link.runs_s)]
    return {"cm": cm, "block": block, "link": link, "link_rows": link_rows,
            "scores_alignment": alignment, "ragged": ragged,
            "repeats": repeats, "accuracy_repeats": accuracy_repeats, "warm": warm, "accuracy": accuracy,
            "max_error": max(errors),
            "median_error": statistics.median(errors), "block_max_error": max(block_errors),
            "block_median_error": statistics.median(block_errors), "searches": searches, "target": target,
            "table_contexts": list(table_contexts), "t_p": t_p, "t_s": t_s, "p_vs_s": p_vs_s,
            "same_partition": list(predicted) == list(kvr_s),
            "gpu_label": a100_like(LLAMA_7B).label, "scaling": scaling}


def _ragged_vs_aligned(spec, cfg, ids, pool, cm, chunks: list[int], rounds: int, warm: int) -> dict:
    """A split whose boundary is not a multiple of 8 tokens against the nearest one that is
    (``align_boundaries``), in turns, measured and simulated."""
    from .measure import compare, interleaved_runs
    from .partition import align_boundaries
    from .simulate import simulate_prefill

    aligned = align_boundaries(chunks)
    measure = measured_cost(spec, ids, pool, repeat=1, warmup=0)
    runs = interleaved_runs({"ragged": lambda: measure(chunks), "aligned": lambda: measure(aligned)}, rounds,
                            warmup=warm)
    sim = {name: simulate_prefill(cfg, ch, "kvr", cm, record_events=False).ttft_s
           for name, ch in (("ragged", chunks), ("aligned", aligned))}
    return {"chunks": chunks, "aligned_chunks": aligned, "verdict": compare(runs["aligned"], runs["ragged"]),
            "sim": sim}


TABLE_TARGET_MAX = 4096       # tokens: the longest length the table section searches (see bench_table)


def bench_table(quick: bool = False) -> dict:
    """The shipped SmolLM2 table (``toyllm/tables``): KVR-P at a length it does not hold vs KVR-S searched there.

    KVR-S is searched on measured runs at the target length; then KVR-P (the
    table's interpolation), KVR-S and the even split take turns round by
    round. Two processes with one thread each, causal-aware attention.
    """
    from .measure import compare, interleaved_runs
    from .partition import even_partition, search_boundary_1d, shipped_table, shipped_table_path

    model, attention = "smollm2-135m", "causal"
    path, table = shipped_table_path(model, attention, 2), shipped_table(model, attention, 2)
    if table is None:
        raise ValueError(f"no table shipped at {path}")
    spec = ModelSpec(model, attention=attention)
    repeats, warm, rounds = (1, 1, 2) if quick else (2, 1, 5)
    keys = table.contexts
    # Halfway between two entries, at most TABLE_TARGET_MAX tokens: a measured search of SmolLM2 at
    # 6144 tokens takes about 25 minutes on 2 cores, one at 3072 a few.
    gaps = [(a + b) // 2 for a, b in zip(keys, keys[1:])]
    target = gaps[0] if quick else max([g for g in gaps if g <= TABLE_TARGET_MAX] or gaps[:1])
    ids = random_prompt(target, get_config(model).vocab_size)
    predicted, even = table.predict(target), even_partition(target, 2)
    with _fresh_pool(spec, ids) as pool:
        measure = measured_cost(spec, ids, pool, repeat=repeats, warmup=warm)
        found = search_boundary_1d(measure, target, min_stride=max(1, target // 64), progress=True)
        runs = interleaved_runs({"p": lambda: measure(predicted), "s": lambda: measure(found.partition),
                                 "e": lambda: measure(even)}, rounds, warmup=0)
    p_vs_s = compare(runs["p"], runs["s"])
    t_p, t_s = p_vs_s.ours.median, p_vs_s.base.median
    return {"file": path.name, "entries": table.to_dict()["entries"], "about": table.about, "target": target, "predicted": predicted, "kvr_s": found.partition, "evaluations": found.evaluations,
            "even": even, "repeats": repeats, "rounds": rounds, "p_vs_s": p_vs_s,
            "e_vs_s": compare(runs["e"], runs["s"]), "gap": (t_p - t_s) / t_s}


def _kvr_sweep(spec, ids, shares, warm: int, settle: int) -> list[int]:
    """KVR-S for p = 2: the first-rank share of ``shares`` whose single timed run was fastest, as chunks."""
    from .partition import partition_from_ratios

    C = len(ids)
    with _fresh_pool(spec, ids, settle=settle) as pool:
        swept = {r: parallel_prefill(spec, ids, "kvr", 2, partition_from_ratios(C, [r, 1 - r]), repeat=1,
                                     warmup=warm, pool=pool).ttft_s for r in shares}
    best = min(swept, key=swept.get)
    return partition_from_ratios(C, [best, 1 - best])


def time_split(result) -> dict:
    """Seconds of one parallel run's timeline per rank: projections, attention, MLP, waiting, sending.

    Waiting is what a rank spent blocked on another: a receive (KVR), an
    all-gather (TSP) or its previous send still in flight. Sums over the layers.
    """
    kinds = {"qkv": "projections", "attention": "attention", "mlp": "mlp", "recv_wait": "waiting",
             "allgather": "waiting", "send_wait": "waiting", "send": "sending"}
    ranks = [dict.fromkeys(["projections", "attention", "mlp", "waiting", "sending"], 0.0)
             for _ in range(result.world_size)]
    for e in map(Event.from_dict, result.timeline):
        key = e.label if e.kind == "compute" else e.kind
        if key in kinds:
            ranks[e.rank][kinds[key]] += e.duration_s
    for seconds in ranks:
        seconds["compute"] = seconds["projections"] + seconds["attention"] + seconds["mlp"]
    return {"ttft": result.ttft_s, "ranks": ranks, "partition": result.partition,
            "imbalance": max(r["compute"] for r in ranks) - min(r["compute"] for r in ranks),
            "compute": sum(r["compute"] for r in ranks), "waiting": max(r["waiting"] for r in ranks)}


def bench_kernels(quick: bool = False) -> dict:
    """Causal-aware attention for every method: one process vs TSP (plain, zigzag) vs KVR, bench preset and SmolLM2.

    With the causal-aware kernel, one process (PyTorch's fused causal kernel, 1 and 2 threads), TSP,
    zigzag TSP, KVR-E and KVR-S take turns round by round (``measure.compare_prefills``). SmolLM2's dense
    row runs at 4k tokens (at 8k one rank outgrew the machine's memory), each method once.
    """
    from .measure import check_machine, compare, compare_prefills, spread

    machine = check_machine()
    print(f"  {machine.line}", flush=True)
    rows = []
    plan = ([("bench", 2048, "causal"), ("smollm2-135m", 1024, "dense"), ("smollm2-135m", 1024, "causal")] if quick
            # SmolLM2 dense at 8192 tokens: one rank's scores, mask and softmax passed 14 GB, out of this 23 GB machine
            else [("bench", 8192, "causal"), ("smollm2-135m", 4096, "dense"), ("smollm2-135m", 8192, "causal")])
    for model, C, kernel in plan:
        big = model != "bench"
        spec = ModelSpec(model, attention=kernel)
        ids = random_prompt(C, spec.config.vocab_size)
        shares = {("dense", True): (0.58, 0.62), ("causal", True): (0.6, 0.63, 0.66),
                  ("dense", False): (0.56, 0.6, 0.64), ("causal", False): (0.66, 0.7, 0.74)}[kernel, big]
        chunks = _kvr_sweep(spec, ids, shares, warm=0 if big else 1, settle=1 if big else 3)
        row = {"model": model, "context": C, "kernel": kernel, "chunks": chunks}
        if kernel == "causal":          # the best one-process alternative: PyTorch's fused causal kernel
            configs = {"TSP": {"method": "tsp"}, "TSP-zigzag": {"method": "tsp", "balance": "zigzag"},
                       "KVR-E": {"method": "kvr"}, "KVR-S": {"method": "kvr", "partition": chunks}}
            cmp = compare_prefills(spec, ids, configs, single_spec=ModelSpec(model, attention="sdpa"),
                                   rounds=2 if quick or big else 3, warmup=1, timeout_s=3600, machine=machine,
                                   single_in_workers=True)
            row.update(runs=cmp.runs, baseline=cmp.baseline, rounds=len(cmp.runs["TSP"].runs),
                       verdicts={"tsp": cmp.verdict("KVR-S", "TSP"), "zigzag": cmp.verdict("KVR-S", "TSP-zigzag"),
                                 "base": cmp.verdict("KVR-S")})
            # Where the time goes: one more run of the two closest configurations, read from their timelines.
            with _fresh_pool(spec, ids, settle=1) as pool:
                row["where"] = {name: time_split(parallel_prefill(spec, ids, world_size=2, repeat=1, warmup=0,
                                                                  pool=pool, **configs[name]))
                                for name in ("KVR-S", "TSP-zigzag")}
        else:                           # one run per method, after the pool's settling run
            with _fresh_pool(spec, ids, settle=1) as pool:
                runs = {name: spread([parallel_prefill(spec, ids, method, 2, part, repeat=1, warmup=0,
                                                       pool=pool).ttft_s])
                        for name, method, part in [("TSP", "tsp", None), ("KVR-E", "kvr", None),
                                                   ("KVR-S", "kvr", chunks)]}
            row.update(runs=runs, rounds=1, verdicts={"tsp": compare(runs["KVR-S"], runs["TSP"])})
        rows.append(row)
        _progress({k: (str(v) if k == "runs" else v) for k, v in row.items() if k != "verdicts"})
    return {"rows": rows, "machine": machine.line}


ATTENTION_BENCH_KERNELS = ("dense", "sdpa", "blockwise", "causal")
ATTENTION_BENCH_SPLITS = (0.5, 0.707)        # rank 0's share of the context for p = 2; 0.707 balances skipping kernels


def interleaved_medians(fns: dict, repeats: int) -> dict:
    """Median seconds of each ``fn()`` over ``repeats`` rounds in turns after a warm-up round
    (``measure.interleaved_runs``): a slow spell of a shared machine hits every kernel alike,
    so their ratios hold even when the absolute times drift."""
    from .measure import interleaved_runs

    return {name: statistics.median(r) for name, r in interleaved_runs(fns, repeats, warmup=1).items()}


@contextmanager
def _threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def bench_attention(quick: bool = False, contexts: tuple[int, ...] | None = None, repeats: int = 5) -> dict:
    """Attention kernels alone: seconds (medians) of each on each shape a p = 2 prefill of C tokens needs, one thread.

    Where KV-Runahead's advantage comes from: one process computes the causal
    square of the prompt, a rank r > 0 a rectangle (its chunk's queries
    against every key before them). A kernel that skips masked pairs does
    half the square's work, so the parallel ranks keep their edge only if
    their rectangles skip too. Kernels are timed in turns
    (``interleaved_medians``).

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
        for share in ATTENTION_BENCH_SPLITS:
            s = round(share * C)
            splits.append({"share": share, "rank0": timed(q, k, v, 0, s), "rank1": timed(q, k, v, s, C)})
        results.append({"context": C, "square": timed(q, k, v, 0, C), "splits": splits})
    return {"heads": H, "head_dim": D, "repeats": repeats, "kernels": list(ATTENTION_BENCH_KERNELS),
            "contexts": results}


FLOOR_TARGET = 0.65   # the decode target: the fastest format that answers Paris at this share of its floor's speed


def add_floor_figures(row: dict, bandwidth: float, lowest_bandwidth: float | None = None) -> dict:
    """Add to a row of ``smollm2_formats`` its floor and where its step goes, given the bandwidth (bytes/s):
    floor_tokens_per_s, rest_s (seconds per token outside the weight products), products_bytes_per_s
    (the products' read rate) and products_floor_share (the share of the floor's speed a step would
    reach if nothing but its products took time); products_floor_share_best is that share against
    ``lowest_bandwidth`` (the slowest round's copy: the floor most in the format's favour). Returns the row."""
    row["floor_tokens_per_s"] = bandwidth / row["bytes_per_token"]
    row["rest_s"] = 1 / row["tokens_per_s"] - row["products_s"]
    row["products_bytes_per_s"] = row["linear_bytes"] / row["products_s"]
    # the floor's seconds over the products' seconds, at the median bandwidth and at the lowest
    row["products_floor_share"] = row["bytes_per_token"] / (bandwidth * row["products_s"])
    lowest = bandwidth if lowest_bandwidth is None else lowest_bandwidth
    row["products_floor_share_best"] = row["bytes_per_token"] / (lowest * row["products_s"])
    return row


def bench_weights(quick: bool = False) -> dict:
    """SmolLM2 decode tokens/s per weight format beside the memory-bandwidth floor (lesson 03's roofline)."""
    from .bench_decode import smollm2_formats

    data = smollm2_formats(new_tokens=16 if quick else 32, rounds=2 if quick else 5, floor=True)
    bandwidth = statistics.median(data["bandwidth_runs"])
    for row in data["rows"]:
        add_floor_figures(row, bandwidth, min(data["bandwidth_runs"]))
        _progress({k: v for k, v in row.items()
                   if k in ("format", "tokens_per_s", "floor_tokens_per_s", "products_s", "calls_per_step")})
    data["at_floor"] = [r["format"] for r in data["rows"] if r["tokens_per_s"] >= r["floor_tokens_per_s"]]
    data["capability"] = torch.backends.cpu.get_cpu_capability()
    answering = [r for r in data["rows"] if r["paris"]]
    data["best"] = max(answering, key=lambda r: r["tokens_per_s"]) if answering else None
    return {"bandwidth_bytes_per_s": bandwidth, "threads": torch.get_num_threads(), "floor_target": FLOOR_TARGET,
            **data}


def bench_batched(quick: bool = False) -> dict:
    """The KV-cache blog's experiment: a batch of prompts on its toy's shape, naive vs cached (seconds).

    Both methods use the dense kernel, the course's default and the blog's
    own attention (all of QK^T, then the causal mask); naive's score tensor
    reaches (prompts, 1, 150, 150), 900 MB in float32 at 10000 prompts.
    The first cache is the blog's own, one that grows by concatenation
    ("dynamic"); the same growing cache with ``BLOG_HEADROOMS`` rows of headroom
    and the static cache run in the same rounds as further rows.
    One run each would let a slow spell of the shared machine decide the
    ratio: all take turns for 3 rounds after an untimed round (the first
    runs of a process pay for mapping its memory, the cached ones most), and
    each round's ratio (naive over the cached run of the same round) is kept.
    "products": why the caches differ, the attention products of one step at
    the middle of the generation, rows laid out as each cache lays them out
    (``window_products``).
    quick: 500 prompts, one round, no warm-up.
    """
    from .bench_decode import (BLOG_HEADROOMS, BLOG_NEW_TOKENS, BLOG_PROMPT_LEN, BLOG_PROMPTS, BLOG_TOY,
                               window_products)
    from .cache import DynamicKVCache, make_cache
    from .generation import generate
    from .measure import compare

    n = 500 if quick else BLOG_PROMPTS
    prompts = torch.randint(0, BLOG_TOY.vocab_size, (n, BLOG_PROMPT_LEN), generator=torch.Generator().manual_seed(0))
    model = build_model(BLOG_TOY, attention="dense")
    # name -> a kind generate knows, or a function returning a new cache
    caches = {"dynamic": "dynamic",
              **{f"dynamic, headroom={h}": (lambda h=h: DynamicKVCache(BLOG_TOY.n_layers, headroom=h))
                 for h in BLOG_HEADROOMS},
              "static": "static"}
    row = {"prompts": n, "prompt_len": BLOG_PROMPT_LEN, "new_tokens": BLOG_NEW_TOKENS, "config": BLOG_TOY.to_dict(),
           "threads": torch.get_num_threads(), "warmup": 0 if quick else 1,
           **time_naive_and_cached(model, prompts, BLOG_NEW_TOKENS, 1 if quick else 3, warmup=0 if quick else 1,
                                   caches=tuple(caches.items()))}

    def copies(how) -> int:
        """Times the cache copied what it held during one generation of this length (one sequence is enough)."""
        cache = make_cache(how, BLOG_TOY, BLOG_PROMPT_LEN + BLOG_NEW_TOKENS) if isinstance(how, str) else how()
        generate(model, prompts[:1], BLOG_NEW_TOKENS, cache=cache)
        return cache.copies // BLOG_TOY.n_layers

    for entry in (row, *row["other_caches"]):
        entry["copies"] = copies(caches[entry["cache"]])
    _progress({k: v for k, v in row.items() if k not in ("config", "naive", "cached", "verdict", "other_caches")})
    for other in row["other_caches"]:
        other["against_blog"] = compare(other["cached"], row["cached"])
        _progress({k: v for k, v in other.items() if k not in ("cached", "verdict", "against_blog")})
    middle = BLOG_PROMPT_LEN + BLOG_NEW_TOKENS // 2
    # the rows per sequence of the static cache generate makes for this request (one sequence is enough to ask)
    capacity = make_cache("static", BLOG_TOY, BLOG_PROMPT_LEN + BLOG_NEW_TOKENS).capacity
    row["products"] = {"cached_tokens": middle, "capacity": capacity,
                       **window_products(n, middle, (0, 1, 2, 4, 8, 16, capacity - middle), BLOG_TOY.head_dim,
                                         2 if quick else 5)}
    _progress({"cached_tokens": middle, **{f"gap {g}": r.median for g, r in zip(row["products"]["gaps"],
                                                                               row["products"]["runs"])}})
    return row


def bench_decode_step(quick: bool = False) -> dict:
    """Where SmolLM2's decode step spends its time (torch.profiler), and whether torch.compile speeds it up."""
    from .bench_decode import compile_trial, profile_decode_step
    from .weights import load_model

    rows = []
    for fmt in ("fp32", "fp16"):
        model, _ = load_model("smollm2-135m", weights=fmt)
        row = {"format": fmt, **profile_decode_step(model, steps=4 if quick else 16)}
        row["compile"] = compile_trial(model, steps=8 if quick else 16, rounds=2 if quick else 5)
        _progress({k: v for k, v in row.items() if k in ("format", "top_level_calls", "matmul_share", "step_s")})
        _progress({"format": fmt, **row["compile"]})
        rows.append(row)
    return {"threads": torch.get_num_threads(), "n_layers": model.config.n_layers, "rows": rows}


def bench_serving(quick: bool = False) -> dict:
    """One seeded workload served four ways on SmolLM2: static, continuous and chunked batching on one
    machine, and disaggregated prefill (a prefill worker and a decode worker, the caches crossing a
    modelled link). Rounds in turns; each metric's runs with their spread, verdicts against continuous.

    quick: the tiny model, 12 requests, 2 rounds.
    """
    from .disagg import link, serve_disaggregated
    from .generation import generate
    from .measure import compare, interleaved_runs, spread
    from .serving import POLICIES, poisson_workload, serve
    from .weights import load_model

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
    rounds = 2 if quick else 3
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
        _progress({"way": w, "ttft_p99": str(row["ttft_p99"]), "tpot_p99": str(row["tpot_p99"])})
    return {"model": name, "requests": n, "rate": rate, "prompt_tokens": prompt_tokens, "new_tokens": new_tokens,
            "token_budget": budget, "bandwidth_gb_s": bandwidth / 1e9, "rounds": rounds, "identical": identical,
            "threads": torch.get_num_threads(), **settings, "rows": rows}


SECTIONS = {"generation": bench_generation, "first_token": bench_first_token, "prefill": bench_prefill,
            "search": bench_search, "table": bench_table, "kernels": bench_kernels, "attention": bench_attention,
            "weights": bench_weights, "batched": bench_batched, "decode_step": bench_decode_step,
            "serving": bench_serving}


def _progress(row: dict) -> None:
    """Print a measured row as it comes in (a full run takes a while)."""
    shown = {k: v for k, v in row.items() if isinstance(v, (int, float, str, list, tuple))}   # not whole verdicts
    print("  " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in shown.items()),
          flush=True)


def _runs(s) -> str:
    """A Spread as a table cell in seconds: "0.512 [0.498-0.530]" (median, fastest and slowest run)."""
    return f"{s.median:.3f}" if len(s.runs) == 1 else f"{s.median:.3f} [{s.low:.3f}-{s.high:.3f}]"


def _short(v) -> str:
    """A Verdict as a table cell: "1.32x faster", "1.25x slower", "tie (1.02x)", "undecided (1.30x)"
    (``Verdict.than`` without the baseline's name)."""
    return v.than.removesuffix(" than") if v.decided else f"{v.word} ({v.ratio:.2f}x)"


def _verdict(value: float, target: float) -> str:
    return "meets" if value >= target else "does not meet"


def _rounds_verdict(ratios: list[float], target: float) -> str:
    """A target judged on each round's ratio: met or missed in every round, else a tie with it."""
    if min(ratios) >= target:
        return "met in every round"
    if max(ratios) < target:
        return "missed in every round"
    return f"met in some rounds and missed in others: at {target:g}x within the spread of this machine"


@functools.lru_cache(maxsize=1)
def _template():
    import jinja2

    env = jinja2.Environment(loader=jinja2.PackageLoader("toyllm", "templates"), undefined=jinja2.StrictUndefined,
                             trim_blocks=False, keep_trailing_newline=True)
    env.filters.update(verdict=_verdict, rounds_verdict=_rounds_verdict, median=statistics.median,
                       runs=_runs, short=_short)
    return env.get_template("benchmarks.md.j2")


def render_section(name: str, data: dict) -> str:
    """The Markdown of one section: its template macro filled with the numbers of this run."""
    return str(getattr(_template().module, name)(data)).strip()


def run_benchmarks(out: str, sections: list[str] | None = None, quick: bool = False) -> None:
    """Run the chosen sections and (re)write their blocks in the Markdown file ``out``."""
    argv = ["bench", "--out", out] + sum((["--only", s] for s in sections or []), []) + (["--quick"] if quick else [])
    ensure_resident_heap(argv)
    command = "python -m toyllm " + " ".join(argv)
    path = Path(out)
    blocks = {}
    for name in sections or list(SECTIONS):
        body = render_section(name, SECTIONS[name](quick))
        blocks[name] = (f"<!-- bench:{name} -->\n{body}\n\nProduced by `{command}` on {time.strftime('%Y-%m-%d')}; "
                        f"{machine_line()}.\n<!-- /bench:{name} -->")
    # read only now: a run takes a while, and the file may have been edited (or written by another run) meanwhile
    text = path.read_text() if path.exists() else "# Benchmarks\n\nEvery table says which command produced it.\n"
    for name, block in blocks.items():
        start, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
        if start in text and end in text:
            text = text[:text.index(start)] + block + text[text.index(end) + len(end):]
        else:
            text = text.rstrip() + "\n\n" + block + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, text)
    print(f"wrote {path}")


def write_atomic(path: Path, text: str) -> None:
    """Replace ``path`` in one step: a temporary file in the same folder, then os.replace; none is left on failure."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}-", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, stat.S_IMODE(path.stat().st_mode) if path.exists() else 0o644)   # mkstemp makes it 0600
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
