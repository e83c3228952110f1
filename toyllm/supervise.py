"""Looking after child processes: one place for what the launcher, the grader and its sandbox all need.

- ``signal_group``: signal a process and everything it started (it leads its own group);
- ``die_with_parent``: in a child, ask the kernel to end it when its parent dies;
- ``become_subreaper``: orphans of this process's descendants come back to it, not to PID 1;
- ``describe_exit``: "was killed by SIGKILL (exit code -9)", for messages;
- ``name_process``: the name ``ps`` and ``top`` show for this process;
- ``stop_signals_as_interrupt``: SIGTERM and SIGHUP unwind like Ctrl-C (``Terminated``), so the same
  clean-up runs.

Linux only where the kernel is asked (``prctl``); elsewhere those calls do nothing.
"""
from __future__ import annotations

import ctypes
import os
import signal
import threading
from contextlib import contextmanager

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15
_PR_SET_CHILD_SUBREAPER = 36


def libc():
    """The C library of this process, with errno kept for error messages."""
    return ctypes.CDLL(None, use_errno=True)


def _prctl(option: int, value: int) -> bool:
    try:
        return libc().prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):          # not Linux
        return False


def die_with_parent(sig: int = signal.SIGKILL) -> bool:
    """End this process with ``sig`` when its parent dies (call it in the child, e.g. as a preexec_fn)."""
    return _prctl(_PR_SET_PDEATHSIG, sig)


def become_subreaper() -> bool:
    """Descendants orphaned below this process are re-parented to it, so it can still end them."""
    return _prctl(_PR_SET_CHILD_SUBREAPER, 1)


def name_process(name: str) -> bool:
    """Give this process the name ``ps`` and ``top`` show (at most 15 bytes: the kernel cuts the rest)."""
    try:
        return libc().prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0) == 0
    except (OSError, AttributeError):          # not Linux
        return False


def signal_group(pid: int | None, sig: int = signal.SIGKILL) -> None:
    """Send ``sig`` to the process group ``pid`` leads, or to ``pid`` alone if it leads none (yet); gone is fine."""
    if pid is None:
        return
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def describe_exit(exitcode: int | None) -> str:
    """How a process ended, for a message: "exited with code 3", "was killed by SIGKILL (exit code -9)"."""
    if exitcode is None:
        return "stopped responding"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"was killed by {name} (exit code {exitcode})"
    return f"exited with code {exitcode}"


# What asks a command to stop besides Ctrl-C: ``kill`` and ``timeout`` (SIGTERM), a closed terminal (SIGHUP).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


class Terminated(KeyboardInterrupt):
    """A stop signal, raised where the main thread is, so it unwinds like Ctrl-C (every ``finally`` runs).

    ``signum``: which signal (``STOP_SIGNALS``); a shell reports the command's end as 128 + signum.
    """

    def __init__(self, signum: int = signal.SIGTERM):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_terminated(signum, frame):
    raise Terminated(signum)


@contextmanager
def stop_signals_as_interrupt():
    """Within the block, SIGTERM and SIGHUP raise ``Terminated`` in the main thread; the previous
    handlers come back after."""
    if threading.current_thread() is not threading.main_thread():    # only the main thread may set handlers
        yield
        return
    previous = {sig: signal.signal(sig, _raise_terminated) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
