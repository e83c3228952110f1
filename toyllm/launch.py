"""Start p cooperating processes for torch.distributed, safely, from anywhere.

Parallel prefill needs p processes that each own one "rank" of a process
group and talk through collectives (send/recv, all_gather, all_reduce). This
module starts them, and above all makes sure a mistake never turns into a
hang or a pile of orphaned processes.

Three ways in:

- ``run_parallel(fn, p)`` starts p processes, runs ``fn(ctx, *args)`` once on
  every rank and returns the p return values (index = rank).
- ``WorkerPool(p)`` keeps p processes and their process group alive across
  many calls of ``pool.run(fn)``, so benchmarks and tests pay the start-up
  (joining the process group; on macOS and Windows also importing torch,
  about a second per process) only once.
- ``init_from_env()`` is for scripts started by ``torchrun``, which does the
  process management itself (many GPUs, many nodes).

How the launcher works, and why:

- Workers never start as a plain fork of the caller: fork would copy the
  caller's threads and locks (torch has both) into a child, where they can
  deadlock. On Linux they are forked from a *fork server*: a fresh,
  single-threaded interpreter that has imported torch and nothing else,
  started once per calling process, so a worker starts in milliseconds
  instead of a second and a half of importing torch. It takes the caller's
  environment, working folder and import path as they were when the pool
  started. On macOS and Windows they are *spawned*: each one a fresh
  interpreter that imports what it needs. Either way the child finds
  ``fn`` by importing its module and looking up its name, so ``fn`` must live
  in an importable ``.py`` module. A lambda, a nested function, or a
  function typed into a notebook cell or a script's ``__main__`` cannot be
  found that way; we reject those with a ValueError before starting
  anything. This is also what makes the launcher work from a Jupyter
  kernel: put the worker functions in a module next to the notebook, import
  them, and pass them in. A *script* that starts workers must do so under
  ``if __name__ == "__main__":``, because on macOS and Windows each spawned
  child imports the script's main module once more before running anything.
- Rendezvous: the parent creates the ``TCPStore`` (a tiny key-value server
  all ranks use to find each other) on 127.0.0.1, port 0, so the operating
  system picks a free port and no other program can grab it between choosing
  and using it. Every rank connects to that port. ``GLOO_SOCKET_IFNAME``
  keeps gloo on the loopback interface, whatever network the machine has:
  the interface holding 127.0.0.1 (``loopback_interface``: ``lo`` on Linux,
  ``lo0`` on macOS; on Windows it stays unset and gloo goes by the address).
- Each rank reports back through its own pipe: "ready" after joining the
  process group, then one "ok" (with the pickled result) or one "error" (with
  the formatted traceback) per task, each with the exercises the task ran
  (added to the parent's ``toyllm.answers.ran``). The parent waits on all pipes *and* on
  the process handles with a short poll, so it notices at once a rank that
  raised, a rank that died without a word (segfault, ``os._exit``, killed),
  and the wall-clock limit. It never blocks without a timeout.
- Any failure ends everything: a rank stuck in a collective waiting for a
  dead peer cannot be rescued, so all processes are terminated (then killed),
  and the parent raises ``WorkerError`` with the failing rank's traceback, or
  ``TimeoutError`` naming the limit. A pool that failed is closed for good.
- Belt and braces against orphans: pools close themselves when garbage
  collected and at interpreter exit, and each worker exits by itself when its
  parent disappears.

Results travel by pickling, so they must be picklable; tensors in the result
(also inside lists, tuples and dicts) are moved to the CPU first.
"""
from __future__ import annotations

import functools
import os
import pickle
import signal
import socket
import sys
import threading
import time
import traceback
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import wait
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from . import answers
from .checks import check_int, check_number
from . import supervise
from .supervise import KILL, describe_exit, signal_group

BACKENDS = ("auto", "gloo", "nccl")
HOST = "127.0.0.1"

_POLL_S = 0.2          # how often the parent wakes up while waiting (seconds)
_STOP_GRACE_S = 5.0    # how long a clean close waits for workers to exit (seconds)
_KILL_GRACE_S = 2.0    # how long to wait after SIGTERM before SIGKILL (seconds)
_FAILURE_GRACE_S = 0.5 # after a first failure, how long to listen for others (seconds)
_STOP = b"stop"        # the message that ends a worker's task loop


@dataclass(frozen=True)
class RankContext:
    """What a worker function learns about its place in the group (its first argument)."""

    rank: int
    world_size: int
    backend: str           # "gloo" or "nccl"
    device: torch.device   # cpu for gloo, this rank's own GPU for nccl


class WorkerError(RuntimeError):
    """A rank failed: raised an exception (``traceback`` holds it) or died (``exitcode``)."""

    def __init__(self, rank: int, message: str, *, traceback: str = "", exitcode: int | None = None):
        super().__init__(message)
        self.rank = rank
        self.traceback = traceback
        self.exitcode = exitcode


# ----------------------------------------------------------------------------
# small utilities

def loopback_interface() -> str | None:
    """The name of the network interface that holds 127.0.0.1, for ``GLOO_SOCKET_IFNAME``: found, not assumed
    ("lo" on Linux, "lo0" on macOS). None on Windows, where gloo is left to find its way by the address."""
    if supervise.windows():
        return None
    try:
        import psutil

        for name, addresses in psutil.net_if_addrs().items():
            if any(a.family == socket.AF_INET and a.address == HOST for a in addresses):
                return name
    except Exception:                           # no psutil, or a system it cannot read
        pass
    return "lo0" if supervise.SYSTEM == "darwin" else "lo"


def _loopback_env() -> dict[str, str]:
    name = loopback_interface()
    return {"GLOO_SOCKET_IFNAME": name} if name else {}


def free_port(host: str = HOST) -> int:
    """A TCP port on ``host`` that was free a moment ago (bind to port 0, read it, release it).

    Another program could take it before you use it; prefer letting the
    server bind port 0 itself when you can (``WorkerPool`` does).
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _resolve_backend(backend: str, n_local_ranks: int) -> str:
    """Check ``backend`` and turn "auto" into "nccl" (one GPU per local rank) or "gloo"."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; allowed: {', '.join(map(repr, BACKENDS))}")
    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend == "auto":
        return "nccl" if n_gpus >= n_local_ranks else "gloo"
    if backend == "nccl" and n_gpus < n_local_ranks:
        raise ValueError(
            f"backend 'nccl' needs one CUDA GPU per rank: {n_local_ranks} rank(s) on this machine "
            f"but {n_gpus} GPU(s) visible; use backend='gloo' (CPU) or 'auto'")
    return backend


def process_group_backend(backend: str) -> str:
    """What ``init_process_group`` gets for ``backend`` ("gloo" or "nccl").

    NCCL moves only CUDA tensors, and the engine also sends small CPU
    tensors beside its GPU data (the simulated link's timestamps travel with
    every KV-Runahead and ring message, link or not). So a "nccl" group is
    "cpu:gloo,cuda:nccl": each tensor goes through the backend of its device.
    """
    return "cpu:gloo,cuda:nccl" if backend == "nccl" else backend


def _check_world_size(world_size: int) -> None:
    check_int(world_size, "world_size must be an int >= 1 (the number of processes)", 1)


def _check_timeout(timeout_s: float) -> float:
    return check_number(timeout_s, "timeout_s must be a positive number of seconds")


def _check_fn(fn: Callable) -> None:
    """Reject worker functions that a spawned process could not import."""
    if not callable(fn):
        raise ValueError(f"fn must be a callable taking (ctx, *args), got {fn!r}")
    target = fn.func if isinstance(fn, functools.partial) else fn
    module = getattr(target, "__module__", None)
    qualname = getattr(target, "__qualname__", None) or getattr(type(target), "__qualname__", "")
    why = ("worker processes are fresh interpreters that find fn by importing its module and "
           "looking up its name, so fn must be a top-level function of an importable .py module "
           "(in a notebook: put it in a module next to the notebook and import it)")
    if module in (None, "__main__", "__mp_main__"):
        raise ValueError(f"fn {qualname or fn!r} is defined in __main__ (a script or a notebook cell); {why}")
    if "<lambda>" in qualname or "<locals>" in qualname:
        raise ValueError(f"fn {module}.{qualname} is a lambda or a nested function; {why}")
    try:
        pickle.dumps(fn)
    except Exception as e:
        raise ValueError(f"fn {module}.{qualname} cannot be pickled ({e}); {why}") from None


def _pack_task(fn: Callable, args: tuple, kwargs: dict | None) -> bytes:
    """Check ``fn`` and pickle the task, so bad input fails here and not in a worker."""
    _check_fn(fn)
    if not isinstance(args, (tuple, list)):
        raise ValueError(f"args must be a tuple of positional arguments, got {type(args).__name__}")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise ValueError(f"kwargs must be a dict or None, got {type(kwargs).__name__}")
    try:
        return pickle.dumps((fn, tuple(args), dict(kwargs or {})))
    except Exception as e:
        raise ValueError(f"the arguments of fn must be picklable to reach the workers: {e}") from None


def _name(fn: Callable) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)


def to_cpu(obj: Any) -> Any:
    """Move tensors (also inside lists, tuples and dicts) to the CPU so results pickle anywhere."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
        return type(obj)(to_cpu(x) for x in obj)
    if isinstance(obj, dict) and type(obj) is dict:
        return {k: to_cpu(v) for k, v in obj.items()}
    return obj


@contextmanager
def _patched_environ(env: dict[str, str]):
    """Set environment variables for the duration of the block (spawned children inherit them)."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _join_all(procs: list, grace_s: float) -> None:
    """Wait for every process to exit, ``grace_s`` seconds for all of them together."""
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))


def _signal_groups(procs: list, sig: int) -> None:
    """Send ``sig`` to each worker's process group (the worker and whatever it started)."""
    for p in procs:
        signal_group(p.pid, sig)


# ----------------------------------------------------------------------------
# the worker side: runs in each spawned process

def _send(conn, msg: tuple) -> None:
    try:
        conn.send_bytes(pickle.dumps(msg))
    except OSError:     # the parent is gone (killed, or it closed the pipe): nobody to report to, exit quietly
        os._exit(1)


def _exit_when_orphaned(alive) -> None:
    """Background thread: if the pool's owner dies (even by SIGKILL), this worker exits too.

    ``alive`` is the reading end of a pipe whose only writer the owner holds
    and never writes to: when the owner is gone, the read ends at EOF. (The
    parent process is no sign: a fork server outlives the owner while its
    workers live.)
    """
    def watch():
        try:
            alive.recv_bytes()
        except (EOFError, OSError):
            pass
        os._exit(1)
    threading.Thread(target=watch, daemon=True, name="orphan-watch").start()


def _take_parents_state(state: dict) -> None:
    """Run with the owner's environment, working folder and import path as they were when the pool started.

    A worker forked by the fork server starts with the server's, fixed when
    the server started (``_start_method``); a spawned one inherits them.
    """
    os.environ.clear()
    os.environ.update(state["env"])
    os.chdir(state["cwd"])
    sys.path[:] = state["sys_path"]


def _worker_main(rank: int, world_size: int, backend: str, port: int, pg_timeout_s: float,
                 threads_per_rank: int, parent_state: dict, alive, conn) -> None:
    """Join the process group, then run tasks from ``conn`` until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C is the parent's business; it kills us
    if hasattr(os, "setpgid"):
        os.setpgid(0, 0)                           # our own process group: shutdown reaches our children too
    _exit_when_orphaned(alive)
    if parent_state is not None:
        _take_parents_state(parent_state)
    torch.set_num_threads(threads_per_rank)        # p ranks share the cores: no oversubscription
    try:
        try:
            device = torch.device("cpu")
            if backend == "nccl":
                device = torch.device("cuda", rank)   # one machine: local rank == rank
                torch.cuda.set_device(device)
            timeout = timedelta(seconds=pg_timeout_s)
            store = dist.TCPStore(HOST, port, world_size, is_master=False, timeout=timeout)
            dist.init_process_group(process_group_backend(backend), store=store, rank=rank, world_size=world_size,
                                    timeout=timeout, device_id=device if backend == "nccl" else None)
            ctx = RankContext(rank, world_size, backend, device)
        except BaseException:
            _send(conn, ("error", traceback.format_exc()))
            return
        _send(conn, ("ready", os.getpid()))
        while True:
            try:
                data = conn.recv_bytes()
            except (EOFError, OSError):   # the parent went away
                return
            if data == _STOP:
                return
            answers.ran.clear()
            try:
                fn, args, kwargs = pickle.loads(data)
                reply = ("ok", pickle.dumps(to_cpu(fn(ctx, *args, **kwargs))))
            except BaseException:
                reply = ("error", traceback.format_exc())
            _send(conn, (*reply, sorted(answers.ran)))      # the exercises this task ran, for the parent's record
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# ----------------------------------------------------------------------------
# the parent side

def _start_method():
    """The multiprocessing context workers start from: on Linux, a fork server that has imported torch.

    Each spawned worker imports torch afresh (about 1.5 s of CPU); the fork
    server imports it once per owning process and forks every later worker
    from that clean, single-threaded copy. Elsewhere, spawn: Windows has no
    fork, and on macOS a process forked after system frameworks are loaded
    (torch loads Accelerate) may crash, which is why Python spawns there.
    """
    if supervise.SYSTEM != "linux":
        return mp.get_context("spawn")
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(["torch", "torch.distributed"])
    return context


class _Workers:
    """The processes, pipes and store of one pool; kept apart from the pool so a finalizer can own it."""

    def __init__(self):
        self.procs: list = []
        self.conns: list = []
        self.alive = None        # the writing end of the workers' orphan watch (``_exit_when_orphaned``)
        self.store = None
        self.done = False

    def shutdown(self, graceful: bool = True) -> None:
        """Stop every process: ask politely (if ``graceful``), then SIGTERM, then SIGKILL. Idempotent.

        Each worker leads its own process group, so the signals also reach
        processes a worker started. An interruption (a second Ctrl-C) during
        the polite part still ends with every process killed, and ``done`` is
        only set once that happened, so calling this again finishes the job.
        """
        if self.done:
            return
        try:
            if graceful:
                for conn in self.conns:
                    try:
                        conn.send_bytes(_STOP)
                    except OSError:
                        pass
                _join_all(self.procs, _STOP_GRACE_S)
            _signal_groups(self.procs, signal.SIGTERM)
            _join_all(self.procs, _KILL_GRACE_S)
        finally:
            _signal_groups(self.procs, KILL)               # workers ignoring SIGTERM, and their children
            for p in self.procs:
                p.join(_KILL_GRACE_S)
            for conn in [*self.conns, *([self.alive] if self.alive else [])]:
                conn.close()
            self.store = None   # closes the rendezvous server
            self.done = True


class WorkerPool:
    """``world_size`` processes in one process group, reused across many ``run`` calls.

    Use it as a context manager::

        with WorkerPool(2) as pool:
            for _ in range(5):
                out = pool.run(my_module.prefill_step, args=(n_tokens,))

    ``timeout_s`` (seconds) limits the start-up and, by default, each task; it
    is also the process group's timeout, so a collective never waits longer.
    ``threads_per_rank`` sets ``torch.set_num_threads`` in each worker. ``env``
    adds environment variables for the workers (it can override the defaults
    ``GLOO_SOCKET_IFNAME``, the loopback interface, and ``OMP_NUM_THREADS``).

    If a task fails on any rank, or runs past its limit, every process is
    killed and the pool is closed for good: the other ranks may be stuck in a
    collective waiting for the failed one, and there is no way to pull them
    out. Make a new pool to go on.
    """

    def __init__(self, world_size: int, *, backend: str = "auto", timeout_s: float = 120.0,
                 threads_per_rank: int = 1, env: dict[str, str] | None = None):
        _check_world_size(world_size)
        self.timeout_s = _check_timeout(timeout_s)
        self.backend = _resolve_backend(backend, world_size)
        check_int(threads_per_rank, "threads_per_rank must be an int >= 1", 1)
        env = dict(env or {})
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
            raise ValueError("env must map environment variable names (str) to values (str)")
        self.world_size = world_size
        self.threads_per_rank = threads_per_rank
        self.pids: list[int] = []
        self.startup_s: float | None = None   # seconds from start to every rank joined the group

        t0 = time.monotonic()
        self._workers = _Workers()
        # Registered before anything starts, so even a half-started pool is cleaned
        # up when it is garbage collected or the interpreter exits.
        self._finalizer = weakref.finalize(self, self._workers.shutdown)
        try:
            # The parent hosts the rendezvous store on port 0: the OS picks a free port.
            self._workers.store = dist.TCPStore(HOST, 0, world_size, is_master=True, wait_for_workers=False,
                                                timeout=timedelta(seconds=self.timeout_s))
            port = self._workers.store.port
            child_env = {**_loopback_env(), "OMP_NUM_THREADS": str(threads_per_rank), **env}
            start = _start_method()
            with _patched_environ(child_env):
                # A spawned child inherits these as they are now; a forked one has the fork server's.
                state = None if start.get_start_method() == "spawn" else \
                    {"env": dict(os.environ), "cwd": os.getcwd(), "sys_path": list(sys.path)}
                alive, self._workers.alive = start.Pipe(duplex=False)   # we keep the only writer
                for rank in range(world_size):
                    parent_conn, child_conn = start.Pipe()
                    p = start.Process(
                        target=_worker_main, name=f"toyllm-rank{rank}", daemon=True,
                        args=(rank, world_size, self.backend, port, self.timeout_s, threads_per_rank,
                              state, alive, child_conn))
                    p.start()
                    child_conn.close()   # the child has its own copy; ours would hide EOF
                    self._workers.procs.append(p)
                    self._workers.conns.append(parent_conn)
            alive.close()                # the workers hold the reading ends; EOF there means we are gone
            self.pids = self._collect(t0 + self.timeout_s, self.timeout_s,
                                      f"starting {world_size} worker process(es)", expect="ready")
        except BaseException:
            self.close(graceful=False)
            raise
        self.startup_s = time.monotonic() - t0

    # -- public ---------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._workers.done

    def run(self, fn: Callable, args: tuple = (), kwargs: dict | None = None,
            timeout_s: float | None = None) -> list:
        """Run ``fn(ctx, *args, **kwargs)`` on every rank; return the results in rank order.

        Raises WorkerError (with the failing rank's traceback) or TimeoutError
        (after ``timeout_s`` seconds, default the pool's); either closes the pool.
        A longer ``timeout_s`` than the pool's does not lengthen the process
        group's timeout: one collective still may wait at most the pool's.
        """
        payload = _pack_task(fn, args, kwargs)
        limit = self.timeout_s if timeout_s is None else _check_timeout(timeout_s)
        return self._run_packed(payload, time.monotonic() + limit, limit, _name(fn))

    def close(self, graceful: bool = True) -> None:
        """Stop all workers and wait for them to exit. Safe to call more than once."""
        if graceful:
            self._finalizer()           # runs shutdown once, then never again
        else:
            self._finalizer.detach()
        self._workers.shutdown(graceful=False)   # finishes a shutdown an interruption cut short

    def __enter__(self) -> "WorkerPool":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(graceful=exc_type is None)

    def __repr__(self) -> str:
        dead = [f"rank {r} {describe_exit(p.exitcode)}" for r, p in enumerate(self._workers.procs)
                if not self.closed and not p.is_alive()]
        state = "closed" if self.closed else ("broken: " + "; ".join(dead) if dead else "running")
        return f"WorkerPool(world_size={self.world_size}, backend={self.backend!r}, {state}, pids={self.pids})"

    # -- internals ------------------------------------------------------------

    def _run_packed(self, payload: bytes, deadline: float, limit_s: float, what: str) -> list:
        if self.closed:
            raise RuntimeError("this WorkerPool is closed (closed by the user, or after a failed task); "
                               "start a new one")
        try:
            for rank, (p, conn) in enumerate(zip(self._workers.procs, self._workers.conns)):
                if not p.is_alive():
                    raise self._died(rank)
                try:
                    conn.send_bytes(payload)
                except OSError:
                    raise self._died(rank) from None
            return self._collect(deadline, limit_s, f"task {what}", expect="ok")
        except BaseException:   # also KeyboardInterrupt: never leave workers behind
            self.close(graceful=False)
            raise

    def _died(self, rank: int, starting: bool = False) -> WorkerError:
        p = self._workers.procs[rank]
        p.join(_KILL_GRACE_S)
        message = (f"rank {rank} of {self.world_size} {describe_exit(p.exitcode)} without reporting an "
                   "error (a crash, os._exit() or a signal; no Python traceback)")
        if starting:
            message += ("; it died while starting, its stderr may say why (a script that starts workers "
                        "must do so under `if __name__ == \"__main__\":`)")
        return WorkerError(rank, message, exitcode=p.exitcode)

    def _collect(self, deadline: float, limit_s: float, what: str, expect: str) -> list:
        """Wait for one reply per rank; raise on errors, deaths or the deadline.

        After the first failure we listen ``_FAILURE_GRACE_S`` longer: when one
        rank dies its peers soon fail too ("connection closed by peer"), and the
        report should name the cause, not a consequence.
        """
        procs, conns = self._workers.procs, self._workers.conns
        results: list = [None] * self.world_size
        pending = set(range(self.world_size))
        failures: list[WorkerError] = []     # in the order we noticed them
        grace_end = None
        while pending:
            now = time.monotonic()
            if failures and now >= grace_end:
                break
            if not failures and now >= deadline:
                raise TimeoutError(
                    f"{what} did not finish within the limit of {limit_s:g} s (rank(s) still running: "
                    f"{sorted(pending)}); all worker processes were killed")
            waitables = [conns[r] for r in pending] + [procs[r].sentinel for r in pending]
            ready = set(wait(waitables, timeout=min((grace_end or deadline) - now, _POLL_S)))
            # Read messages before looking at deaths, so an error sent just before exiting is not lost.
            for rank in sorted(pending):
                if conns[rank] not in ready:
                    continue
                pending.discard(rank)
                try:
                    kind, payload, *ran = pickle.loads(conns[rank].recv_bytes())
                except (EOFError, OSError):
                    failures.append(self._died(rank, starting=expect == "ready"))
                    continue
                # What a task ran in the workers counts as run here: a failed test then names the exercises
                # the engine ran for it (toyllm.answers.ran), wherever they ran.
                answers.ran.update(*ran)
                if kind == "error":
                    failures.append(WorkerError(rank, f"rank {rank} of {self.world_size} failed in {what}:\n"
                                                      f"{payload}", traceback=payload))
                    continue
                assert kind == expect, (kind, expect)
                if kind == "ok":
                    try:
                        payload = pickle.loads(payload)
                    except Exception as e:
                        raise WorkerError(rank, f"the result of rank {rank} could not be unpickled: {e}") from None
                results[rank] = payload
            for rank in sorted(pending):
                if procs[rank].sentinel in ready and not conns[rank].poll():
                    pending.discard(rank)
                    failures.append(self._died(rank, starting=expect == "ready"))
            if failures and grace_end is None:
                grace_end = time.monotonic() + _FAILURE_GRACE_S
        if failures:
            raise _root_cause(failures)
        return results


def _root_cause(failures: list[WorkerError]) -> WorkerError:
    """Pick the failure to report and mention the others.

    A rank that died without a traceback is the likely cause (its peers then
    lose their connections); otherwise the first error noticed.
    """
    deaths = [e for e in failures if e.exitcode is not None]
    main = (deaths or failures)[0]
    others = [e for e in failures if e is not main]
    if not others:
        return main
    lines = [f"rank {e.rank}: " + (e.traceback.strip().splitlines()[-1] if e.traceback else str(e))
             for e in others]
    message = f"{main}\nother ranks also failed (often as a consequence):\n  " + "\n  ".join(lines)
    return WorkerError(main.rank, message, traceback=main.traceback, exitcode=main.exitcode)


def run_parallel(fn: Callable, world_size: int, args: tuple = (), kwargs: dict | None = None, *,
                 backend: str = "auto", timeout_s: float = 120.0, threads_per_rank: int = 1,
                 env: dict[str, str] | None = None) -> list:
    """Start ``world_size`` processes, run ``fn(ctx, *args, **kwargs)`` once on each, return the results.

    ``fn`` must be a top-level function of an importable module (not a lambda,
    not defined in ``__main__`` or a notebook cell). ``ctx`` is a RankContext.
    The results come back in rank order, tensors moved to the CPU.

    ``timeout_s`` is a wall-clock limit (seconds) on everything, start-up
    included. Raises WorkerError if a rank raises or dies, TimeoutError past
    the limit, ValueError on bad input (before any process starts). In every
    case all processes are gone when this returns or raises.
    """
    start = time.monotonic()
    payload = _pack_task(fn, args, kwargs)
    timeout_s = _check_timeout(timeout_s)
    with WorkerPool(world_size, backend=backend, timeout_s=timeout_s,
                    threads_per_rank=threads_per_rank, env=env) as pool:
        return pool._run_packed(payload, start + timeout_s, timeout_s, _name(fn))


# ----------------------------------------------------------------------------
# torchrun

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def launched_by_torchrun() -> bool:
    """True if the environment describes a rank the way torchrun does (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_*)."""
    return all(v in os.environ for v in _TORCHRUN_VARS)


def init_from_env(backend: str = "auto", timeout_s: float = 120.0) -> RankContext:
    """Join the process group described by torchrun's environment variables (env:// rendezvous).

    Run your script with ``torchrun --nproc-per-node=N script.py``; each copy
    calls this once and ``dist.destroy_process_group()`` in a ``finally`` at the
    end. With nccl each process uses GPU ``LOCAL_RANK`` of its machine.
    ``timeout_s`` (seconds) is the process group's timeout.
    """
    if not launched_by_torchrun():
        missing = [v for v in _TORCHRUN_VARS if v not in os.environ]
        raise RuntimeError(f"not started by torchrun: environment variable(s) {', '.join(missing)} missing; "
                           "launch with `torchrun --nproc-per-node=N script.py`, or use run_parallel")
    if dist.is_initialized():
        raise RuntimeError("the default process group is already initialized in this process")
    timeout_s = _check_timeout(timeout_s)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", local_rank + 1))
    backend = _resolve_backend(backend, max(local_world_size, local_rank + 1))
    if os.environ["MASTER_ADDR"] in ("127.0.0.1", "localhost"):
        for name, value in _loopback_env().items():         # one machine: stay on loopback
            os.environ.setdefault(name, value)
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    dist.init_process_group(process_group_backend(backend), init_method="env://", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s),
                            device_id=device if backend == "nccl" else None)
    return RankContext(rank, world_size, backend, device)
