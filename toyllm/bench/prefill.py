"""Benchmark sections of the parallel prefill: one process against TSP and KV-Runahead (dense and sdpa
attention), and every method with the causal-aware kernel, with where each rank's time goes."""
from __future__ import annotations

from ..parallel import ModelSpec, parallel_prefill
from ..timeline import Event
from ..utils import random_prompt
from .common import fresh_pool, progress


def bench_prefill(quick: bool = False) -> dict:
    """TTFT of one process (1 and 2 threads) vs TSP, KVR-E and KVR-best on 2 processes, bench preset, dense
    attention, all five taking turns round by round (``measure.compare_prefills``); then the same with sdpa.

    Each row keeps every configuration's runs (seconds) and the verdicts computed from them.
    """
    from ..measure import ONE_THREAD, TWO_THREADS, check_machine, compare_prefills
    from ..partition import partition_from_ratios, ttft_lower_bound

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
        with fresh_pool(spec, ids) as pool:                               # fresh processes per context
            swept = {r: parallel_prefill(spec, ids, "kvr", 2, partition_from_ratios(C, [r, 1 - r]),
                                         repeat=sweep_repeats, warmup=warm, pool=pool).ttft_s for r in sweep}
        best_r = min(swept, key=swept.get)
        best_chunks = partition_from_ratios(C, [best_r, 1 - best_r])
        rows.append(_prefill_row(compare_prefills(
            spec, ids, {"TSP": {"method": "tsp"}, "KVR-E": {"method": "kvr"},
                        "KVR-best": {"method": "kvr", "partition": best_chunks}},
            rounds=rounds, warmup=warm, timeout_s=3600, machine=machine, single_in_workers=True),
            spec.config, best_chunks, ttft_lower_bound(1.0, 2)))
        progress({"context": C, **{k: str(v) for k, v in rows[-1]["runs"].items()}})
    sdpa = []
    for C in contexts[-2:]:
        chunks = next(r["chunks"] for r in rows if r["context"] == C)
        sdpa_spec = ModelSpec("bench", attention="sdpa")
        cmp = compare_prefills(sdpa_spec, random_prompt(C, spec.config.vocab_size),
                               {"TSP": {"method": "tsp"}, "KVR": {"method": "kvr", "partition": chunks}},
                               rounds=rounds, warmup=warm, timeout_s=3600, machine=machine, single_in_workers=True)
        sdpa.append({"context": C, "chunks": chunks, "runs": cmp.runs, "baseline": cmp.baseline,
                     "vs_tsp": cmp.verdict("KVR", "TSP"), "vs_base": cmp.verdict("KVR")})
        progress({"context": C, "sdpa": True, **{k: str(v) for k, v in cmp.runs.items()}})
    return {"rounds": rounds, "warm": warm, "sweep": [f"{r:.2f}" for r in sweep], "sweep_repeats": sweep_repeats,
            "machine": machine.line, "one_thread": ONE_THREAD, "two_threads": TWO_THREADS, "rows": rows, "sdpa": sdpa}


def _prefill_row(cmp, cfg, chunks: list[int], bound_factor: float) -> dict:
    """One context of the prefill section: the runs, the verdicts, and the paper's lower bound TTFT*(2)
    computed from each one-thread run (``bound_factor`` = 3/8), with the configurations that beat it."""
    from ..measure import ONE_THREAD

    bound = cmp.runs[ONE_THREAD].scaled(bound_factor)
    below = [name for name in cmp.parallel if cmp.runs[name].median < bound.median]
    return {"context": cmp.context, "chunks": chunks, "runs": cmp.runs, "baseline": cmp.baseline, "why": cmp.why,
            "bound": bound, "below_bound": below,
            "scores_mb": cfg.n_heads * cmp.context ** 2 * 4 / 1e6,       # one layer's float32 scores, one process
            "verdicts": {"kvr_e_vs_tsp": cmp.verdict("KVR-E", "TSP"), "best_vs_tsp": cmp.verdict("KVR-best", "TSP"),
                         "best_vs_base": cmp.verdict("KVR-best")}}


def _kvr_sweep(spec, ids, shares, warm: int, settle: int) -> list[int]:
    """KVR-S for p = 2: the first-rank share of ``shares`` whose single timed run was fastest, as chunks."""
    from ..partition import partition_from_ratios

    C = len(ids)
    with fresh_pool(spec, ids, settle=settle) as pool:
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
    from ..measure import check_machine, compare, compare_prefills, spread

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
                                   rounds=2 if quick else 5, warmup=1, timeout_s=3600, machine=machine,
                                   single_in_workers=True)
            row.update(runs=cmp.runs, baseline=cmp.baseline, rounds=len(cmp.runs["TSP"].runs),
                       verdicts={"tsp": cmp.verdict("KVR-S", "TSP"), "zigzag": cmp.verdict("KVR-S", "TSP-zigzag"),
                                 "base": cmp.verdict("KVR-S")})
            # Where the time goes: one more run of the two closest configurations, read from their timelines.
            with fresh_pool(spec, ids, settle=1) as pool:
                row["where"] = {name: time_split(parallel_prefill(spec, ids, world_size=2, repeat=1, warmup=0,
                                                                  pool=pool, **configs[name]))
                                for name in ("KVR-S", "TSP-zigzag")}
        else:                           # one run per method, after the pool's settling run
            with fresh_pool(spec, ids, settle=1) as pool:
                runs = {name: spread([parallel_prefill(spec, ids, method, 2, part, repeat=1, warmup=0,
                                                       pool=pool).ttft_s])
                        for name, method, part in [("TSP", "tsp", None), ("KVR-E", "kvr", None),
                                                   ("KVR-S", "kvr", chunks)]}
            row.update(runs=runs, rounds=1, verdicts={"tsp": compare(runs["KVR-S"], runs["TSP"])})
        rows.append(row)
        progress({k: (str(v) if k == "runs" else v) for k, v in row.items() if k != "verdicts"})
    return {"rows": rows, "machine": machine.line}


# llama_prefill: the contexts (tokens) and, for each, the toyllm configurations beside llama.cpp.
LLAMA_PREFILL_CONTEXTS = (1024, 4096, 8192)
ONE_PROCESS, PARALLEL, LLAMA = "toyllm, 1 process, 2 threads", "toyllm, TSP-zigzag, 2 processes", "llama.cpp"


def bench_llama_prefill(quick: bool = False, contexts=None, rounds: int | None = None) -> dict:
    """SmolLM2 prefill (TTFT, seconds) by toyllm and by llama.cpp on the same token ids, taking turns.

    For each context of ``contexts`` (default ``LLAMA_PREFILL_CONTEXTS``; quick: 1k only) the same random
    ids go to three configurations, each round running every one in turn after an untimed round:
    toyllm in one process with 2 intra-op threads (PyTorch's fused causal kernel, ``sdpa``, in a worker
    process of its own, as the other prefill sections run their baseline); toyllm's parallel prefill on 2
    processes with 1 thread each, zigzag TSP with the causal-aware kernel (the kernels section found
    it tied with KV-Runahead's best split on SmolLM2 at 8k, and it needs no sweep of splits: the production
    baseline); and llama.cpp with 2 threads in its own process (``toyllm.bench.llama``, batches of 512
    tokens). ``rounds`` defaults to 5, the fewest the rank test decides on (quick: 1). Each row keeps the
    runs and the verdicts computed from them (``measure.compare``): each toyllm configuration against
    llama.cpp, and the parallel one against the one process. Without llama.cpp, "llama_missing" says how
    to install it and the rows hold toyllm's configurations only; a llama.cpp worker that fails meanwhile
    costs its column from that context on (and "llama_missing" says why), not the section.
    """
    from ..launch import WorkerPool
    from ..measure import check_machine, compare, spread
    from ..weights import find_smollm2_gguf
    from .llama import LlamaCppError, start_llama

    contexts = tuple(contexts or ((1024,) if quick else LLAMA_PREFILL_CONTEXTS))
    rounds = rounds or (1 if quick else 5)
    warmup, timeout_s = 1, 3600
    machine = check_machine()
    print(f"  {machine.line}", flush=True)
    single_spec, spec = ModelSpec("smollm2-135m", attention="sdpa"), ModelSpec("smollm2-135m", attention="causal")
    # One llama.cpp process for every context: its context holds the longest prompt.
    llama, missing = start_llama(find_smollm2_gguf(), threads=2, context=max(contexts), timeout_s=timeout_s)
    about = {"version": llama.version, "system_info": llama.system_info, "threads": llama.threads} if llama else None
    rows = []
    try:
        for C in contexts:
            ids = random_prompt(C, spec.config.vocab_size)
            runs = {ONE_PROCESS: [], PARALLEL: [], **({LLAMA: []} if llama else {})}
            # fresh toyllm processes per context, as the other prefill sections start them
            with WorkerPool(1, threads_per_rank=2, timeout_s=timeout_s) as solo, \
                    WorkerPool(2, threads_per_rank=1, timeout_s=timeout_s) as pool:
                for r in range(warmup + rounds):
                    runs_here = {
                        ONE_PROCESS: parallel_prefill(single_spec, ids, "single", 1, threads_per_rank=2, warmup=0,
                                                      pool=solo, timeout_s=timeout_s).ttft_runs[0],
                        PARALLEL: parallel_prefill(spec, ids, "tsp", 2, balance="zigzag", warmup=0, pool=pool,
                                                   timeout_s=timeout_s).ttft_runs[0]}
                    if llama is not None:
                        try:
                            runs_here[LLAMA] = llama.prefill(ids)
                        except LlamaCppError as exc:             # this column ends; toyllm's go on
                            llama.close()
                            llama, missing = None, str(exc)
                            print(f"  llama.cpp failed: {missing}", flush=True)
                            runs.pop(LLAMA, None)          # this context's column; earlier contexts keep theirs
                    if r >= warmup:
                        for name, seconds in runs_here.items():
                            if name in runs:
                                runs[name].append(seconds)
            row = {"context": C, "runs": {name: spread(ts) for name, ts in runs.items()}, "verdicts": {}}
            row["verdicts"]["parallel_vs_one"] = compare(runs[PARALLEL], runs[ONE_PROCESS])
            if LLAMA in runs:
                row["verdicts"]["one_vs_llama"] = compare(runs[ONE_PROCESS], runs[LLAMA])
                row["verdicts"]["parallel_vs_llama"] = compare(runs[PARALLEL], runs[LLAMA])
            rows.append(row)
            progress({"context": C, **{k: str(v) for k, v in row["runs"].items()}})
    finally:
        if llama is not None:
            llama.close()
    return {"machine": machine.line, "rounds": rounds, "warmup": warmup, "contexts": list(contexts), "rows": rows,
            "names": {"one": ONE_PROCESS, "parallel": PARALLEL, "llama": LLAMA},
            "llama": about, "llama_missing": missing}
