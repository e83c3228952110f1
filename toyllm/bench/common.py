"""What the benchmark sections share: printing rows as they come, fresh worker pools, thread counts."""
from __future__ import annotations

from contextlib import contextmanager

import torch

from ..launch import WorkerPool
from ..parallel import parallel_prefill


def progress(row: dict) -> None:
    """Print a measured row as it comes in (a full run takes a while)."""
    shown = {k: v for k, v in row.items() if isinstance(v, (int, float, str, list, tuple))}   # not whole verdicts
    print("  " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in shown.items()),
          flush=True)


@contextmanager
def fresh_pool(spec, ids, settle: int = 3):
    """Two fresh one-thread workers, settled by ``settle`` untimed TSP runs on ``ids``: the first runs of
    new processes are often slow while this VM maps their memory."""

    with WorkerPool(2, threads_per_rank=1, timeout_s=3600) as pool:
        parallel_prefill(spec, ids, "tsp", pool.world_size, repeat=1, warmup=settle - 1, pool=pool)
        yield pool


@contextmanager
def intra_op_threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
