"""Measuring the link between two ranks: a ping-pong over the process group, fitted to bytes / bandwidth + latency.

The simulator (``toyllm.simulate``) charges a message of n bytes
``n / bandwidth + latency`` seconds. Those two numbers should describe the
link a real run uses, not a guess: here rank 0 sends a tensor of n bytes to
rank 1, which sends it straight back, and half the round trip is one
message's time. Timing on one clock (rank 0's) avoids comparing the clocks
of two processes. With gloo on one machine the "link" is TCP over loopback:
memory copies through the kernel, so its bandwidth and latency depend on the
CPU and its load, which is why it is measured where the runs happen.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from ..launch import RankContext, WorkerPool

# Message sizes in bytes: 4 KB to 16 MB by factors of 4 (a bench-preset layer's K,V at 4096 tokens is 8 MB).
DEFAULT_SIZES = tuple(4096 * 4 ** k for k in range(7))


@dataclass
class LinkMeasurement:
    """One message's time between two ranks, per size, and the line through it.

    sizes_bytes: the message sizes. runs_s: per size, the one-way seconds of
    each timed round trip (half of it). median_s: their medians.
    bandwidth_bytes_per_s, latency_s: the fit time = bytes / bandwidth +
    latency, by least squares on relative error (so the 4 KB messages that
    fix the latency count as much as the 16 MB ones that fix the bandwidth).
    max_fit_error: the largest relative difference between the fit and a median.
    """

    sizes_bytes: list[int]
    runs_s: list[list[float]]
    median_s: list[float]
    bandwidth_bytes_per_s: float
    latency_s: float
    max_fit_error: float
    backend: str = "gloo"

    @property
    def cost_model_fields(self) -> dict:
        """The link as ``toyllm.simulate.CostModel`` names it: ``cm.with_(**link.cost_model_fields)``."""
        return {"link_bandwidth_bytes_per_s": self.bandwidth_bytes_per_s, "link_latency_s": self.latency_s}

    def predict_s(self, n_bytes: float) -> float:
        """The fitted seconds for one message of ``n_bytes``."""
        return n_bytes / self.bandwidth_bytes_per_s + self.latency_s

    def describe(self) -> str:
        return (f"{self.bandwidth_bytes_per_s / 1e9:.2f} GB/s + {self.latency_s * 1e6:.0f} us per message "
                f"(measured, {self.backend} ping-pong between 2 processes, {len(self.sizes_bytes)} sizes "
                f"{size_label(self.sizes_bytes[0])}-{size_label(self.sizes_bytes[-1])}; the fit is within "
                f"{self.max_fit_error:.0%} of every median)")


def size_label(n: int) -> str:
    """Bytes as the tables show them: 4096 -> "4 KB", 16777216 -> "16 MB"."""
    return f"{n / 2 ** 20:g} MB" if n >= 2 ** 20 else f"{n / 2 ** 10:g} KB"


@torch.no_grad()
def ping_pong_rank(ctx: RankContext, sizes_bytes: list[int], repeats: int, warmup: int) -> list[list[float]] | None:
    """The worker: rank 0 times round trips of each size with rank 1; other ranks stay out of it."""
    runs = []
    for n in sizes_bytes:
        buf = torch.zeros(n // 4, dtype=torch.float32, device=ctx.device)
        times = []
        for r in range(warmup + repeats):
            dist.barrier()
            if ctx.rank == 0:
                t0 = time.perf_counter()
                dist.send(buf, 1)
                dist.recv(buf, 1)
                if r >= warmup:
                    times.append((time.perf_counter() - t0) / 2)
            elif ctx.rank == 1:
                dist.recv(buf, 0)
                dist.send(buf, 0)
        runs.append(times)
    return runs if ctx.rank == 0 else None


def fit_link(sizes_bytes, seconds) -> tuple[float, float]:
    """(bandwidth in bytes/s, latency in s) of time = bytes / bandwidth + latency, least squares on relative error."""
    x = np.asarray(sizes_bytes, dtype=float)
    y = np.asarray(seconds, dtype=float)
    if len(x) < 2 or len(set(x.tolist())) < 2:
        raise ValueError(f"fitting a link needs at least two different message sizes, got {list(sizes_bytes)}")
    if not np.all(y > 0):
        raise ValueError(f"message times must be positive seconds, got {list(seconds)}")
    rows = np.stack([x, np.ones_like(x)], axis=1) / y[:, None]      # divide by y: relative error
    (slope, latency), *_ = np.linalg.lstsq(rows, np.ones_like(y), rcond=None)
    if slope <= 0:
        raise ValueError("the message times do not grow with size: no bandwidth can be fitted "
                         f"(sizes {list(sizes_bytes)} bytes, times {list(seconds)} s)")
    return 1.0 / float(slope), max(0.0, float(latency))


def measure_link(sizes_bytes=DEFAULT_SIZES, repeats: int = 15, warmup: int = 3, *,
                 pool: WorkerPool | None = None, backend: str = "auto", timeout_s: float = 120.0) -> LinkMeasurement:
    """Time messages between two processes and fit bandwidth (bytes/s) and latency (seconds).

    sizes_bytes: message sizes, multiples of 4 bytes, at least two different.
    repeats: timed round trips per size, after ``warmup`` untimed ones.
    pool: a running WorkerPool of 2 or more processes (ranks 0 and 1 are
    measured); otherwise two processes are started for this and stopped.
    """
    sizes = [int(n) for n in sizes_bytes]
    if len(set(sizes)) < 2 or any(n < 4 or n % 4 for n in sizes):
        raise ValueError(f"sizes_bytes must hold at least two different sizes, each a multiple of 4 bytes "
                         f"(float32 messages), got {list(sizes_bytes)}")
    if not (isinstance(repeats, int) and repeats >= 1 and isinstance(warmup, int) and warmup >= 0):
        raise ValueError(f"repeats must be an integer >= 1 and warmup >= 0, got repeats={repeats!r}, "
                         f"warmup={warmup!r}")
    if pool is None:
        with WorkerPool(2, backend=backend, timeout_s=timeout_s) as own:
            return measure_link(sizes, repeats, warmup, pool=own, timeout_s=timeout_s)
    if pool.world_size < 2:
        raise ValueError(f"measuring a link needs a pool of at least 2 processes, this one has {pool.world_size}")
    runs = pool.run(ping_pong_rank, (sizes, repeats, warmup), timeout_s=timeout_s)[0]
    medians = [statistics.median(t) for t in runs]
    bandwidth, latency = fit_link(sizes, medians)
    worst = max(abs(n / bandwidth + latency - m) / m for n, m in zip(sizes, medians))
    return LinkMeasurement(sizes, runs, medians, bandwidth, latency, worst, backend=pool.backend)
