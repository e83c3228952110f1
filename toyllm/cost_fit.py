"""Fitting a cost model's compute coefficients to timings: least squares on measured spans.

``toyllm.simulate.CostModel.calibrate`` times one Block on this machine and
``CostModel.fit_runs`` takes the spans of real parallel prefills; both fit
seconds per token and per query-key pair with ``least_squares``. The counts
the fits and the simulator share (``query_key_pairs``,
``allgather_piece_bytes``) live here too, so both count alike.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from .model import ModelConfig
from .timeline import Event


def fit_to_runs(cfg: ModelConfig, runs, key_alignment: int = 8) -> dict:
    """The compute coefficients of ``CostModel.fit_runs``, as its fields: ``qkv_s_per_token``,
    ``mlp_s_per_token``, ``attn_s_per_dot``, ``attn_unaligned_s_per_dot`` (seconds), the all-gather's
    ``allgather_bandwidth_bytes_per_s`` and ``allgather_latency_s`` (None, None when not measured) and the
    kernel's ``attention_pairs``.

    The compute spans of the runs (``qkv``, ``attention``, ``mlp`` of each
    layer on each rank) are the samples: one per step, rank and
    configuration, the median of its spans over the layers (all alike) and
    over the runs given, so that one stalled span (another process, a page
    fault) does not pull the fit. The model is the simplest that fits them:
    seconds per token for the projections and for the MLP, seconds per
    query-key pair for attention (o_proj, which ``Block.attend`` runs, folds
    into it), no fixed cost per layer. On a shared 2-core VM the spans of
    short chunks vary by 2x from run to run, and fits with per-layer
    constants took those swings for fixed costs of milliseconds; the long
    spans that dominate an unweighted least squares are measured best.
    With the dense kernel, attention spans over a key count that is not a
    multiple of ``key_alignment`` get a second coefficient (q k^T's matrix
    product is slower per pair there); a causal-aware kernel works in
    blocks, so only its last block is ragged and the term is left at 0.
    TSP runs of two or more piece sizes also give TSP's all-gather its own
    bandwidth and latency per ring step, from the shortest span of the ranks
    in each layer (the last rank to arrive waits for no one): gloo's
    collective is slower than the point-to-point messages the link measures.
    """
    from .attention import get_attention

    runs = list(runs)
    if not runs:
        raise ValueError("fit_runs needs at least one run (a PrefillResult of method 'tsp' or 'kvr')")
    kernels = {r.attention for r in runs}
    if len(kernels) != 1:
        raise ValueError(f"the runs used different attention kernels {sorted(kernels)}: fit one kernel at a time")
    mode = "causal" if getattr(get_attention(kernels.pop()), "skips_masked", False) else "dense"
    spans: dict[tuple, list[float]] = {}
    # TSP's all-gather: per layer, the rank that arrived last waited for no one, so the shortest span
    # of the ranks is the collective itself; one list of those per piece size (bytes per rank).
    allgather: dict[int, list[float]] = {}
    for run in runs:
        if run.method not in ("tsp", "kvr") or run.balance != "none":
            raise ValueError(f"fit_runs takes 'tsp' (balance 'none') and 'kvr' runs, got method "
                             f"{run.method!r} with balance {run.balance!r}")
        chunks, C = list(run.partition), sum(run.partition)
        gathers: dict[int, list[float]] = {}
        for e in run.timeline:
            e = e if isinstance(e, Event) else Event.from_dict(e)
            if e.kind == "allgather" and e.layer is not None:
                gathers.setdefault(e.layer, []).append(e.duration_s)
            if e.kind != "compute" or e.layer is None or e.label not in ("qkv", "attention", "mlp"):
                continue
            c, s = chunks[e.rank], sum(chunks[:e.rank])
            keys = C if run.method == "tsp" else s + c
            pairs = query_key_pairs(mode, c, s, keys)
            unaligned = mode == "dense" and keys % key_alignment != 0
            spans.setdefault((e.label, c, pairs, unaligned), []).append(e.duration_s)
        if run.method == "tsp" and gathers and len(chunks) > 1:   # p - 1 ring steps of the largest chunk's K, V
            allgather.setdefault(allgather_piece_bytes(cfg, chunks, 4), []).extend(     # float32 runs
                min(seconds) / (len(chunks) - 1) for seconds in gathers.values())
    samples = {"qkv": ([], []), "attention": ([], []), "mlp": ([], [])}
    for (step, c, pairs, unaligned), seconds in spans.items():
        samples[step][0].append([pairs, pairs * unaligned] if step == "attention" else [c])
        samples[step][1].append(float(np.median(seconds)))
    if any(len({r[0] for r in rows}) < 2 for rows, _ in samples.values()):
        raise ValueError("the runs hold too few different chunk sizes to fit: give runs with at least "
                         "two different chunk sizes, e.g. two partitions or two contexts")
    (a,), (m,) = (least_squares(*samples[step]) for step in ("qkv", "mlp"))
    rows, times = samples["attention"]
    if any(r[1] for r in rows) and any(not r[1] for r in rows):
        alpha, extra = least_squares(rows, times)
    else:       # all aligned or none: nothing to tell the two costs apart, so one per-pair cost
        (alpha,), extra = least_squares([r[:1] for r in rows], times), 0.0
    ag_bw = ag_lat = None
    if len(allgather) >= 2:
        sizes = sorted(allgather)
        seconds_per_byte, latency = least_squares([[n, 1.0] for n in sizes],
                                                   [float(np.median(allgather[n])) for n in sizes])
        if seconds_per_byte > 0:
            ag_bw, ag_lat = 1.0 / seconds_per_byte, latency
    return {"qkv_s_per_token": a, "mlp_s_per_token": m, "attn_s_per_dot": alpha, "attn_unaligned_s_per_dot": extra,
            "allgather_bandwidth_bytes_per_s": ag_bw, "allgather_latency_s": ag_lat, "attention_pairs": mode}


def allgather_piece_bytes(cfg: ModelConfig, chunks: Sequence[int], bytes_per_value: int) -> int:
    """Bytes each rank sends per ring step of TSP's all-gather: the K and V of the largest chunk
    (all_gather needs equal-sized pieces, so the shorter ones are padded)."""
    return 2 * max(chunks) * cfg.n_kv_heads * cfg.head_dim * bytes_per_value


def query_key_pairs(mode: str, queries: int, before: int, keys: int) -> int:
    """Pairs a kernel computes for ``queries`` tokens after ``before`` others, over ``keys`` keys:
    every pair of the rectangle ("dense") or only those the queries can see ("causal")."""
    if mode == "causal":
        return queries * before + queries * (queries + 1) // 2
    return queries * keys


def least_squares(rows, times) -> list[float]:
    """Coefficients of times ~ rows @ coef (numpy least squares), negative ones clipped to 0."""
    coef, *_ = np.linalg.lstsq(np.asarray(rows, dtype=float), np.asarray(times, dtype=float), rcond=None)
    return [max(0.0, float(c)) for c in coef]


