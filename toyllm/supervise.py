"""Looking after child processes: one place for what the launcher, the grader and its sandbox all need.

- ``signal_group``: signal a process and everything it started (it leads its own group);
- ``die_with_parent``: in a child, ask the kernel to end it when its parent dies;
- ``become_subreaper``: orphans of this process's descendants come back to it, not to PID 1;
- ``describe_exit``: "was killed by SIGKILL (exit code -9)", for messages;
- ``name_process``: the name ``ps`` and ``top`` show for this process;
- ``stop_signals_as_interrupt``: SIGTERM and SIGHUP unwind like Ctrl-C (``Terminated``), so the same
  clean-up runs.

Linux only where the kernel is asked (``prctl``); elsewhere those calls do nothing. Nothing here needs
more than Python's portable names at import: on macOS and Windows a process group is ended by walking the
process tree (``end_tree``) where ``killpg`` is missing, and ``child_options`` gives ``subprocess.Popen`` the
arguments the system accepts.
"""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
from contextlib import contextmanager

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15
_PR_SET_CHILD_SUBREAPER = 36

# The system the code below branches on ("linux", "darwin", "win32"): read at call time, never at import.
SYSTEM = sys.platform
# The signal that cannot be caught; Windows has none (there a process is ended with TerminateProcess).
KILL = getattr(signal, "SIGKILL", signal.SIGTERM)


def linux() -> bool:
    return SYSTEM.startswith("linux")


def windows() -> bool:
    return SYSTEM == "win32"


def child_options(die: bool = True) -> dict:
    """``subprocess.Popen`` arguments for a child that leads its own process group (so ``signal_group``
    reaches what it starts) and, where the kernel can (Linux), dies with this process (``die``)."""
    if windows():
        return {"creationflags": getattr(subprocess, "CREATE_NEW_PROCESS_GROUP", 0x200)}
    if die and linux():
        return {"start_new_session": True, "preexec_fn": die_with_parent}
    return {"start_new_session": True}


def libc():
    """The C library of this process, with errno kept for error messages."""
    return ctypes.CDLL(None, use_errno=True)


def _prctl(option: int, value: int) -> bool:
    try:
        return libc().prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):          # not Linux
        return False


def die_with_parent(sig: int = KILL) -> bool:
    """End this process with ``sig`` when its parent dies (call it in the child, e.g. as a preexec_fn)."""
    return linux() and _prctl(_PR_SET_PDEATHSIG, sig)


def become_subreaper() -> bool:
    """Descendants orphaned below this process are re-parented to it, so it can still end them."""
    return linux() and _prctl(_PR_SET_CHILD_SUBREAPER, 1)


def name_process(name: str) -> bool:
    """Give this process the name ``ps`` and ``top`` show (at most 15 bytes: the kernel cuts the rest)."""
    try:
        return libc().prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0) == 0
    except (OSError, AttributeError):          # not Linux
        return False


def signal_group(pid: int | None, sig: int = KILL) -> None:
    """Send ``sig`` to the process group ``pid`` leads, or to ``pid`` alone if it leads none (yet); gone is fine.
    Without process groups to signal (Windows) ``pid`` and its descendants are ended (``end_tree``)."""
    if pid is None:
        return
    if windows() or not hasattr(os, "killpg"):
        end_tree(pid)
        return
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def end_tree(pid: int) -> None:
    """End ``pid`` and every process below it (what ``signal_group`` does where there are no process groups)."""
    try:
        import psutil
    except ImportError:                        # without it: the process alone
        try:
            os.kill(pid, KILL)
        except OSError:
            pass
        return
    try:
        top = psutil.Process(pid)
        procs = [top, *top.children(recursive=True)]
    except psutil.Error:
        return
    for p in reversed(procs):
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=5)


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
STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))


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
