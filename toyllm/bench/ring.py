"""Benchmark section of ring attention: the three families of context-parallel prefill side by side, and
where pass-KV and pass-Q trade places when a conversation's earlier turns are already cached on the ranks."""
from __future__ import annotations

from ..parallel import LinkModel, ModelSpec, parallel_prefill, ring_traffic
from ..utils import random_prompt
from .common import fresh_pool, progress
from .prefill import _kvr_sweep


def bench_ring(quick: bool = False) -> dict:
    """Ring attention against zigzag TSP and KV-Runahead, then pass-KV against pass-Q after a cache.

    Families: the bench preset and SmolLM2 with the causal-aware kernel on 2
    processes; one process (PyTorch's fused causal kernel, 1 and 2 threads),
    TSP-zigzag, KVR-S (the best first-rank share of a sweep of single runs),
    ring and ring-zigzag take turns round by round (``measure.compare_prefills``).

    Passes: SmolLM2, a context of N cached + C new tokens with N + C fixed and
    the new share C / (N + C) swept; ring pass-KV (continuing the cache: the
    cached keys and values travel with the blocks) and pass-Q take turns on
    the loopback link and on a simulated 1 GB/s link (``LinkModel``).
    Every row keeps the runs (seconds) and the verdicts computed from them.
    """
    from ..measure import check_machine, compare, compare_prefills, interleaved_runs, spread

    machine = check_machine()
    print(f"  {machine.line}", flush=True)
    rounds = 2 if quick else 5
    families = []
    for model, C, shares in ([("bench", 2048, (0.66, 0.7)), ("smollm2-135m", 1024, (0.6, 0.63))] if quick else
                             [("bench", 8192, (0.66, 0.7, 0.74)), ("smollm2-135m", 4096, (0.6, 0.63, 0.66))]):
        spec = ModelSpec(model, attention="causal")
        ids = random_prompt(C, spec.config.vocab_size)
        chunks = _kvr_sweep(spec, ids, shares, warm=1, settle=1 if model != "bench" else 3)
        configs = {"TSP-zigzag": {"method": "tsp", "balance": "zigzag"}, "KVR-S": {"method": "kvr", "partition": chunks},
                   "ring": {"method": "ring"}, "ring-zigzag": {"method": "ring", "balance": "zigzag"}}
        cmp = compare_prefills(spec, ids, configs, single_spec=ModelSpec(model, attention="sdpa"), rounds=rounds,
                               warmup=1, timeout_s=3600, machine=machine, single_in_workers=True)
        row = {"model": model, "context": C, "chunks": chunks, "runs": cmp.runs, "baseline": cmp.baseline,
               "rounds": rounds, "verdicts": {"base": cmp.verdict("ring-zigzag"),
                                              "zigzag": cmp.verdict("ring-zigzag", "TSP-zigzag"),
                                              "kvr": cmp.verdict("ring-zigzag", "KVR-S"),
                                              "balance": cmp.verdict("ring-zigzag", "ring")}}
        families.append(row)
        progress({k: (str(v) if k == "runs" else v) for k, v in row.items() if k != "verdicts"})

    model = "smollm2-135m"
    spec = ModelSpec(model, attention="causal")
    cfg = spec.config
    total = 1024 if quick else 4096
    new_shares = (1 / 8, 1 / 2) if quick else (1 / 16, 1 / 8, 1 / 4, 1 / 2)
    links = {"loopback": None, "1 GB/s (simulated)": LinkModel(bandwidth_gbps=1.0)}
    passes = []
    ids = random_prompt(total, cfg.vocab_size)
    with fresh_pool(spec, ids, settle=1) as pool:
        for share in new_shares:
            C = int(total * share)
            N = total - C
            part = [C // 2, C - C // 2]
            bytes_ = ring_traffic(C, N, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, 2)
            for link_name, link in links.items():
                def run(ring_pass):
                    return lambda: parallel_prefill(spec, ids, "ring", 2, part, ring_pass=ring_pass, cached=N,
                                                    link=link, repeat=1, warmup=0, pool=pool).ttft_s
                runs = interleaved_runs({"kv": run("kv"), "q": run("q")}, rounds=rounds, warmup=1)
                v = compare(runs["q"], runs["kv"])
                row = {"new": C, "cached": N, "share": share, "link": link_name, "kv": spread(runs["kv"]),
                       "q": spread(runs["q"]), "q_vs_kv": v, "bytes": bytes_}
                passes.append(row)
                progress({k: str(row[k]) for k in ("new", "cached", "link", "kv", "q")} | {"verdict": v.word})
    # pass-Q's C * H * (2D + 1) values against pass-KV's (N + C) * 2 * Hkv * D: equal at this new share C / (N + C)
    rule = 2 * cfg.n_kv_heads * cfg.head_dim / (cfg.n_heads * (2 * cfg.head_dim + 1))
    return {"machine": machine.line, "families": families, "passes": passes, "rounds": rounds, "total": total,
            "rule_share": rule, "heads": (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim)}
