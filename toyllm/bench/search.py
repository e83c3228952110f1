"""Benchmark sections of the partition search: the cost model against measured runs, searches on real
runs and on the simulator, KVR-P against KVR-S, the shipped SmolLM2 table, and simulated scaling."""
from __future__ import annotations

import statistics

import torch

from ..launch import run_parallel
from ..model import ModelConfig, get_config
from ..parallel import ModelSpec, measured_cost, parallel_prefill
from ..utils import random_prompt
from .common import fresh_pool, intra_op_threads, progress


def _calibrate_block(ctx, cfg: ModelConfig, sizes: tuple[int, ...]):
    """The worker of bench_search's Block calibration (one thread, as each rank of a run gets)."""
    from ..simulate import CostModel

    CostModel.calibrate(cfg, contexts=sizes, repeats=1)        # untimed: a fresh process runs slow at first
    return CostModel.calibrate(cfg, contexts=sizes, repeats=3)


def scores_alignment(quick: bool = False, rounds: int = 5) -> list[dict]:
    """The scores q k^T of the bench preset's heads alone, on one thread (what each rank of a p = 2 run
    gets), for key counts that are a multiple of 8 and a few that are not: seconds per query-key pair
    and head, the shapes taking turns, each against the multiple of 8 at or below it."""
    from ..measure import compare, interleaved_runs, spread

    cfg = get_config("bench")
    queries = 512 if quick else 2048
    key_counts = (1024, 1026, 1028, 1032) if quick else (4096, 4097, 4098, 4100, 4104, 5733, 5734, 5736)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, cfg.n_heads, queries, cfg.head_dim, generator=g)                    # (1, H, T, D)
    keys = {S: torch.randn(1, cfg.n_heads, S, cfg.head_dim, generator=g) for S in key_counts}  # (1, H, S, D)
    with intra_op_threads(1), torch.inference_mode():
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
    from ..analysis import LLAMA_7B
    from ..partition import partition_from_ratios, search_boundary_1d
    from ..partition_table import PartitionTable
    from ..measure import compare, interleaved_runs, spread
    from ..parallel import measure_link
    from ..parallel.link import size_label
    from ..simulate import CostModel, a100_like, compare_methods, simulate_prefill, ttft_cost

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
        with fresh_pool(spec, ids) as pool:
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
        with fresh_pool(spec, ids) as pool:                               # fresh processes per context
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
                progress(accuracy[-1])
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
        with fresh_pool(spec, ids) as pool:
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
    with fresh_pool(spec, ids) as pool:
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
    from ..measure import compare, interleaved_runs
    from ..partition import align_boundaries
    from ..simulate import simulate_prefill

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
    from ..measure import compare, interleaved_runs
    from ..partition import even_partition, search_boundary_1d
    from ..partition_table import shipped_table, shipped_table_path

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
    with fresh_pool(spec, ids) as pool:
        measure = measured_cost(spec, ids, pool, repeat=repeats, warmup=warm)
        found = search_boundary_1d(measure, target, min_stride=max(1, target // 64), progress=True)
        runs = interleaved_runs({"p": lambda: measure(predicted), "s": lambda: measure(found.partition),
                                 "e": lambda: measure(even)}, rounds, warmup=0)
    p_vs_s = compare(runs["p"], runs["s"])
    t_p, t_s = p_vs_s.ours.median, p_vs_s.base.median
    return {"file": path.name, "entries": table.to_dict()["entries"], "about": table.about, "target": target, "predicted": predicted, "kvr_s": found.partition, "evaluations": found.evaluations,
            "even": even, "repeats": repeats, "rounds": rounds, "p_vs_s": p_vs_s,
            "e_vs_s": compare(runs["e"], runs["s"]), "gap": (t_p - t_s) / t_s}
