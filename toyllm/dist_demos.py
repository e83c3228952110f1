"""Tiny torch.distributed programs that lesson 04 runs from the notebook.

A worker function must live in an importable module (the launcher starts
fresh processes that import it by name), never in a notebook cell; these are
the lesson's first ones. Each takes the ``RankContext`` the launcher passes
and returns a value to the notebook.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def hello(ctx) -> str:
    """Every process reports who it is in the group."""
    return f"rank {ctx.rank} of {ctx.world_size}, backend {ctx.backend}, device {ctx.device}"


def pass_a_tensor(ctx) -> list[float]:
    """Rank 0 sends [1, 2, 3] to rank 1; rank 1 receives it into a buffer of the right shape."""
    t = torch.zeros(3)
    if ctx.rank == 0:
        t = torch.tensor([1.0, 2.0, 3.0])
        dist.send(t, dst=1)
    elif ctx.rank == 1:
        dist.recv(t, src=0)          # blocks until the message is here
    return t.tolist()


def gather_everyones_rank(ctx) -> list[list[float]]:
    """all_gather: every rank contributes (rank, rank^2) and receives everyone's, in rank order."""
    mine = torch.tensor([float(ctx.rank), float(ctx.rank ** 2)])
    parts = [torch.empty(2) for _ in range(ctx.world_size)]
    dist.all_gather(parts, mine)
    return [p.tolist() for p in parts]


def sum_over_ranks(ctx) -> float:
    """all_reduce: every rank ends with the sum of everyone's value (what tensor parallelism needs)."""
    t = torch.tensor([float(ctx.rank + 1)])
    dist.all_reduce(t)
    return t.item()
