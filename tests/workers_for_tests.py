"""Worker functions for tests/test_launch.py.

They live in their own module because spawned processes find a worker
function by importing its module; the test module itself would do too, but a
small module keeps the worker side cheap to import and easy to read.

Run as a script under torchrun it is also the torchrun test program:
each rank all-reduces rank + 1 and prints the sum.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist


def rank_info(ctx) -> tuple:
    """(rank, world_size, all-reduced sum of rank + 1, pid): 1 + 2 + ... + p on every rank."""
    t = torch.tensor([float(ctx.rank + 1)])
    dist.all_reduce(t)
    return ctx.rank, ctx.world_size, t.item(), os.getpid()


def scaled_rank(ctx, scale: float, offset: float = 0.0) -> torch.Tensor:
    """A tensor result: [rank * scale + offset, world_size]."""
    return torch.tensor([ctx.rank * scale + offset, float(ctx.world_size)])


def _record_pid(pid_dir: str, rank: int) -> None:
    Path(pid_dir, f"rank{rank}.pid").write_text(str(os.getpid()))


def raise_on_rank(ctx, bad_rank: int, pid_dir: str) -> int:
    """Rank ``bad_rank`` raises; the others wait in a barrier that never completes."""
    _record_pid(pid_dir, ctx.rank)
    if ctx.rank == bad_rank:
        raise ValueError(f"deliberate failure on rank {ctx.rank}")
    dist.barrier()
    return ctx.rank


def hang_on_rank(ctx, stuck_rank: int, pid_dir: str) -> int:
    """Rank ``stuck_rank`` sleeps forever; the others return at once."""
    _record_pid(pid_dir, ctx.rank)
    while ctx.rank == stuck_rank:
        time.sleep(0.1)
    return ctx.rank


def exit_on_rank(ctx, bad_rank: int, code: int, pid_dir: str) -> int:
    """Rank ``bad_rank`` leaves with ``os._exit(code)`` (no exception); the others wait in a barrier."""
    _record_pid(pid_dir, ctx.rank)
    if ctx.rank == bad_rank:
        os._exit(code)
    dist.barrier()
    return ctx.rank


def start_grandchild(ctx) -> int:
    """Start a long sleep as a child of this worker; return its pid (the pool must end it too)."""
    import subprocess

    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"]).pid


def ignore_sigterm(ctx) -> int:
    """From now on this worker ignores SIGTERM, as a stubborn library might make it."""
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    return os.getpid()


def failing_step(layer, x, pos, comm, attention):
    """A parallel-prefill step that raises on rank 1 (the others then wait on it until the run is stopped)."""
    if comm.rank == 1:
        raise RuntimeError("rank 1 gives up in its first layer")
    from toyllm.parallel import kvr_layer
    return kvr_layer(layer, x, pos, comm, attention)


def asks_for_exercise(ctx, numbers: list[str], fail: bool = False):
    """Rank r asks toyllm for Exercise ``numbers[r]`` (as the engine's kernels and steps do), then raises if ``fail``."""
    from toyllm import answers

    try:
        answers.exercise(numbers[ctx.rank])
    except answers.ExerciseNotWritten:      # the student edition's stubs: asked for all the same
        pass
    if fail:
        raise RuntimeError(f"rank {ctx.rank} fails after asking for {numbers[ctx.rank]}")
    return ctx.rank


def main() -> None:
    from toyllm.launch import init_from_env, launched_by_torchrun

    assert launched_by_torchrun()
    ctx = init_from_env(timeout_s=30)
    try:
        t = torch.tensor([float(ctx.rank + 1)])
        dist.all_reduce(t)
        # One write per line: two ranks share the pipe, and with unbuffered output a
        # print() of text and newline as two writes can interleave with the other rank's.
        sys.stdout.write(f"rank {ctx.rank}/{ctx.world_size} backend={ctx.backend} sum={t.item():g}\n")
        sys.stdout.flush()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

