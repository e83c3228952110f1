"""Tests of the multi-process launcher: results, failures, time limits, no leftovers."""
from __future__ import annotations

import gc
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import psutil
import pytest
import torch

import toyllm.launch as launch
from toyllm.launch import (RankContext, WorkerError, WorkerPool, free_port, init_from_env,
                           launched_by_torchrun, run_parallel)

# The library alone: no exercise runs here (tests/conftest.py checks it), so the student edition leaves it out.
pytestmark = [pytest.mark.library, pytest.mark.beside_alone]   # starts no grading (side_by_side)

try:  # tests/ is a plain folder that pytest puts on sys.path ...
    import workers_for_tests as W
except ImportError:  # ... or a package
    from tests import workers_for_tests as W

REPO_ROOT = Path(__file__).resolve().parent.parent
HAS_GPU = torch.cuda.is_available() and torch.cuda.device_count() > 0


def _started_by_multiprocessing(process: psutil.Process, how: str) -> bool:
    return any(how in part for part in process.cmdline())


def spawned_children() -> list[psutil.Process]:
    """Our worker processes: spawned ones, and those the fork server forked (neither the server itself, which
    lives as long as this process, nor the resource tracker is a worker)."""
    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            forked = _started_by_multiprocessing(child, "forkserver") and \
                _started_by_multiprocessing(child.parent(), "forkserver")
            if forked or _started_by_multiprocessing(child, "spawn_main"):
                found.append(child)
        except (psutil.NoSuchProcess, psutil.ZombieProcess, AttributeError):   # gone, or its parent gone
            pass
    return found


def assert_no_workers_left(pids=(), pid_dir: Path | None = None) -> None:
    pids = list(pids)
    if pid_dir is not None:
        pids += [int(p.read_text()) for p in pid_dir.glob("rank*.pid")]
    alive = [pid for pid in pids if psutil.pid_exists(pid)]
    assert alive == [], f"worker processes still exist: {alive}"
    assert spawned_children() == []


# ----------------------------------------------------------------------------
# run_parallel

@pytest.mark.engine
@pytest.mark.timeout(60)
@pytest.mark.parametrize("p", [1, 2, 3])
def test_run_parallel_returns_per_rank_results_in_order(p):
    results = run_parallel(W.rank_info, p, timeout_s=50)
    expected_sum = p * (p + 1) / 2   # all_reduce of rank + 1 over all ranks
    assert [r[:3] for r in results] == [(rank, p, expected_sum) for rank in range(p)]
    pids = [r[3] for r in results]
    assert len(set(pids)) == p and os.getpid() not in pids
    assert_no_workers_left(pids)


@pytest.mark.engine
@pytest.mark.timeout(60)
def test_run_parallel_passes_args_kwargs_and_returns_cpu_tensors():
    out = run_parallel(W.scaled_rank, 2, args=(10.0,), kwargs={"offset": 1.0}, backend="gloo", timeout_s=50)
    assert len(out) == 2
    torch.testing.assert_close(out[0], torch.tensor([1.0, 2.0]))
    torch.testing.assert_close(out[1], torch.tensor([11.0, 2.0]))


@pytest.mark.engine
@pytest.mark.timeout(40)
def test_rank_that_raises_fails_the_run_with_its_traceback(tmp_path):
    with pytest.raises(WorkerError) as info:
        run_parallel(W.raise_on_rank, 2, args=(1, str(tmp_path)), timeout_s=30)
    err = info.value
    assert isinstance(err, RuntimeError)
    assert err.rank == 1 and err.exitcode is None
    msg = str(err)
    assert "rank 1" in msg
    assert "Traceback (most recent call last)" in msg
    assert "in raise_on_rank" in msg                                # a frame of the worker function
    assert "ValueError: deliberate failure on rank 1" in msg       # the exception itself
    assert "deliberate failure on rank 1" in err.traceback
    # rank 0 was blocked in a barrier that could never complete: it must be gone too
    assert_no_workers_left(pid_dir=tmp_path)


@pytest.mark.engine
@pytest.mark.timeout(40)
def test_hanging_rank_hits_the_wall_clock_limit(tmp_path):
    with pytest.raises(TimeoutError, match=r"limit of 8 s"):
        run_parallel(W.hang_on_rank, 2, args=(1, str(tmp_path)), timeout_s=8)
    assert_no_workers_left(pid_dir=tmp_path)


@pytest.mark.engine
@pytest.mark.timeout(40)
def test_rank_that_exits_without_exception_is_detected(tmp_path):
    with pytest.raises(WorkerError) as info:
        run_parallel(W.exit_on_rank, 2, args=(1, 3, str(tmp_path)), timeout_s=30)
    err = info.value
    assert err.rank == 1
    assert err.exitcode == 3
    assert "rank 1" in str(err) and "exited with code 3" in str(err)
    assert_no_workers_left(pid_dir=tmp_path)


# ----------------------------------------------------------------------------
# bad input: a ValueError before any process starts

@pytest.fixture
def no_spawning(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("a process was about to start")
    monkeypatch.setattr(launch.mp, "get_context", refuse)


def _nested():
    def inner(ctx):
        return ctx.rank
    return inner


def _pretend_main(ctx):
    return ctx.rank


_pretend_main.__module__ = "__main__"   # as if typed into a notebook cell


@pytest.mark.timeout(10)
@pytest.mark.parametrize("call, pattern", [
    (lambda: run_parallel(W.rank_info, 0), r"world_size must be an int >= 1.*got 0"),
    (lambda: run_parallel(W.rank_info, -2), r"world_size must be an int >= 1"),
    (lambda: run_parallel(W.rank_info, 2.0), r"world_size must be an int >= 1"),
    (lambda: run_parallel(W.rank_info, 2, backend="mpi"), r"unknown backend 'mpi'; allowed: 'auto', 'gloo', 'nccl'"),
    (lambda: run_parallel(W.rank_info, 2, backend="foo"), r"unknown backend 'foo'"),
    (lambda: run_parallel(lambda ctx: ctx.rank, 2), r"lambda or a nested function.*importable"),
    (lambda: run_parallel(_nested(), 2), r"lambda or a nested function"),
    (lambda: run_parallel(_pretend_main, 2), r"defined in __main__.*notebook"),
    (lambda: run_parallel("rank_info", 2), r"fn must be a callable"),
    (lambda: run_parallel(W.rank_info, 2, args=(threading.Lock(),)), r"arguments of fn must be picklable"),
    (lambda: run_parallel(W.rank_info, 2, args=5), r"args must be a tuple"),
    (lambda: run_parallel(W.rank_info, 2, timeout_s=0), r"timeout_s must be a positive number"),
    (lambda: run_parallel(W.rank_info, 2, threads_per_rank=0), r"threads_per_rank must be an int >= 1"),
    (lambda: run_parallel(W.rank_info, 2, env={"X": 1}), r"env must map"),
    (lambda: WorkerPool(0), r"world_size must be an int >= 1"),
    (lambda: WorkerPool(2, backend="mpi"), r"unknown backend"),
])
def test_bad_input_raises_value_error_before_starting(no_spawning, call, pattern):
    with pytest.raises(ValueError, match=pattern):
        call()


@pytest.mark.timeout(10)
@pytest.mark.skipif(HAS_GPU, reason="this machine has GPUs")
def test_nccl_without_gpus_is_refused(no_spawning):
    with pytest.raises(ValueError, match=r"nccl.*needs one CUDA GPU per rank.*0 GPU\(s\) visible"):
        run_parallel(W.rank_info, 2, backend="nccl")
    with pytest.raises(ValueError, match=r"0 GPU\(s\) visible"):
        WorkerPool(1, backend="nccl")


@pytest.mark.timeout(10)
@pytest.mark.skipif(HAS_GPU, reason="this machine has GPUs")
def test_auto_backend_is_gloo_without_gpus():
    assert launch._resolve_backend("auto", 2) == "gloo"


# ----------------------------------------------------------------------------
# WorkerPool

@pytest.mark.engine
@pytest.mark.timeout(60)
def test_pool_reuses_its_processes_across_tasks():
    with WorkerPool(2, timeout_s=50) as pool:
        assert len(pool.pids) == 2 and all(psutil.pid_exists(pid) for pid in pool.pids)
        assert pool.backend in ("gloo", "nccl") and pool.startup_s > 0
        for _ in range(3):
            out = pool.run(W.rank_info)
            assert [o[:3] for o in out] == [(0, 2, 3.0), (1, 2, 3.0)]
            assert [o[3] for o in out] == pool.pids   # same processes every time: one start-up
        out = pool.run(W.scaled_rank, args=(10.0,), kwargs={"offset": 1.0})
        torch.testing.assert_close(out[1], torch.tensor([11.0, 2.0]))
        pids = pool.pids
    assert pool.closed
    pool.close()   # idempotent
    pool.close()
    assert_no_workers_left(pids)
    with pytest.raises(RuntimeError, match="closed"):
        pool.run(W.rank_info)


@pytest.mark.engine
@pytest.mark.timeout(60)
def test_a_bad_request_to_a_running_pool_is_rejected_and_the_pool_goes_on():
    with WorkerPool(2, timeout_s=50) as pool:
        pids = list(pool.pids)
        for call, pattern in [
            (lambda: pool.run(lambda ctx: ctx.rank), r"lambda or a nested function"),
            (lambda: pool.run(_pretend_main), r"defined in __main__"),
            (lambda: pool.run(W.scaled_rank, args=(threading.Lock(),)), r"must be picklable"),
            (lambda: pool.run(W.scaled_rank, args=2.0), r"args must be a tuple"),
            (lambda: pool.run(W.scaled_rank, args=(1.0,), kwargs=[1]), r"kwargs must be a dict"),
            (lambda: pool.run(W.rank_info, timeout_s=0), r"timeout_s must be a positive number"),
            (lambda: pool.run(W.rank_info, timeout_s=float("nan")), r"timeout_s must be a positive number"),
        ]:
            with pytest.raises(ValueError, match=pattern):
                call()
            assert not pool.closed and pool.pids == pids and all(psutil.pid_exists(pid) for pid in pids)
        assert [o[:3] for o in pool.run(W.rank_info)] == [(0, 2, 3.0), (1, 2, 3.0)]
    assert_no_workers_left(pids)


@pytest.mark.engine
@pytest.mark.timeout(40)
def test_failure_in_pool_raises_and_closes_it(tmp_path):
    pool = WorkerPool(2, timeout_s=30)
    pids = pool.pids
    assert [o[2] for o in pool.run(W.rank_info)] == [3.0, 3.0]
    with pytest.raises(WorkerError, match=r"rank 0 of 2 failed(.|\n)*deliberate failure on rank 0") as info:
        pool.run(W.raise_on_rank, args=(0, str(tmp_path)))
    assert info.value.rank == 0
    assert pool.closed
    assert_no_workers_left(pids, tmp_path)
    with pytest.raises(RuntimeError, match="closed"):
        pool.run(W.rank_info)
    pool.close()   # still fine


@pytest.mark.engine
@pytest.mark.timeout(40)
def test_pool_task_timeout_kills_the_pool(tmp_path):
    pool = WorkerPool(2, timeout_s=30)
    with pytest.raises(TimeoutError, match=r"limit of 2 s \(rank\(s\) still running: \[0"):
        pool.run(W.hang_on_rank, args=(0, str(tmp_path)), timeout_s=2)
    assert pool.closed
    assert_no_workers_left(pool.pids, tmp_path)


@pytest.mark.engine
@pytest.mark.timeout(40)
def test_forgotten_pool_is_cleaned_up_by_garbage_collection():
    pool = WorkerPool(1, timeout_s=30)
    pids = pool.pids
    assert psutil.pid_exists(pids[0])
    del pool
    gc.collect()
    assert_no_workers_left(pids)


# ----------------------------------------------------------------------------
# torchrun and small utilities

@pytest.mark.engine
@pytest.mark.timeout(90)
def test_torchrun_script_with_init_from_env():
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
           "--master-addr=127.0.0.1", f"--master-port={free_port()}",
           str(Path(W.__file__).resolve())]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=80)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # The two ranks share stdout, so match each report wherever it landed.
    reports = re.findall(r"rank (\d)/2 backend=(?:gloo|nccl) sum=3(?!\d)", proc.stdout)
    assert sorted(reports) == ["0", "1"], proc.stdout


@pytest.mark.timeout(10)
def test_launched_by_torchrun_reads_the_environment(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    assert not launched_by_torchrun()
    with pytest.raises(RuntimeError, match=r"not started by torchrun.*RANK"):
        init_from_env()
    for var, value in [("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"),
                       ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500")]:
        monkeypatch.setenv(var, value)
    assert launched_by_torchrun()


@pytest.mark.timeout(10)
def test_free_port_can_be_bound():
    import socket
    port = free_port()
    assert isinstance(port, int) and 0 < port < 65536
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_rank_context_fields():
    ctx = RankContext(rank=1, world_size=2, backend="gloo", device=torch.device("cpu"))
    assert (ctx.rank, ctx.world_size, ctx.backend, ctx.device.type) == (1, 2, "gloo", "cpu")


# --------------------------------------------------------------------------- no orphans in the corners

def _all_gone(pids, within_s: float = 10.0) -> bool:
    """True once every pid has exited (a zombie waiting for its new parent to reap it counts as exited)."""
    import time

    def alive(pid):
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    deadline = time.monotonic() + within_s
    while any(alive(pid) for pid in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


@pytest.mark.engine
@pytest.mark.timeout(120)
def test_processes_a_worker_starts_end_with_the_pool(tmp_path):
    with WorkerPool(2, timeout_s=60) as pool:
        pids = pool.run(W.start_grandchild)
        assert all(psutil.pid_exists(pid) for pid in pids)
    assert _all_gone(pids), "a process started by a worker outlived the pool"


@pytest.mark.engine
@pytest.mark.timeout(120)
def test_workers_that_ignore_sigterm_are_still_ended():
    pool = WorkerPool(2, timeout_s=60)
    pids = list(pool.pids)
    pool.run(W.ignore_sigterm)
    pool.close()
    assert _all_gone(pids)


@pytest.mark.engine
@pytest.mark.timeout(120)
def test_an_interrupted_shutdown_can_be_finished_with_close(monkeypatch):
    import toyllm.launch as launch

    pool = WorkerPool(2, timeout_s=60)
    pids = list(pool.pids)
    real = launch._join_all

    def interrupted(procs, grace_s):
        monkeypatch.setattr(launch, "_join_all", real)
        raise KeyboardInterrupt                 # a second Ctrl-C while the pool waits for its workers

    monkeypatch.setattr(launch, "_join_all", interrupted)
    with pytest.raises(KeyboardInterrupt):
        pool.close()
    pool.close()
    assert pool.closed
    assert _all_gone(pids)


@pytest.mark.engine
@pytest.mark.timeout(120)
def test_a_killed_idle_worker_shows_in_repr_and_fails_the_next_run():
    import signal as sig

    pool = WorkerPool(2, timeout_s=60)
    try:
        os.kill(pool.pids[1], sig.SIGKILL)
        pool._workers.procs[1].join(10)                      # the parent notices the death
        assert "broken: rank 1 was killed by SIGKILL" in repr(pool)
        with pytest.raises(WorkerError, match="rank 1"):
            pool.run(W.rank_info)
        assert pool.closed
    finally:
        pool.close()
