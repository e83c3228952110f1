"""A trusted pytest process started ahead, so that the next lesson, or checking again, does not wait for Python.

``run.Standby`` starts one with the settings that do not change between
lessons (the sandbox's memory limit, the folders it must not see). It has
imported torch, pytest, the grading plugin and the engine (``load``),
starts a sandbox ahead (``sandbox.prestart``: a process that has imported
torch and holds neither a submission nor an answer), and then waits for
one line on its standard input: the pytest arguments, the environment, the
working folder and the output file of the lesson to grade. It runs them
exactly as ``python -m pytest`` would, once, and exits (``serve``).

It starts one of two ways:

- ``fork``: a copy of the grading process itself, which loaded the same
  modules once (about 2 CPU-seconds saved for every lesson after the
  first, and for the first lesson's start-up). Only where the copy can be
  what a fresh Python would be: the grading process runs with Python's
  hash seed fixed, as the trusted pytest processes do
  (``PYTHONHASHSEED=0``; ``grade --class`` starts every student's grading
  so), and it has no other thread (a fork copies only the calling one);
- otherwise a fresh Python: ``python -m toyllm.grading.grader.standby``.
"""
from __future__ import annotations

import gc
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import types
from pathlib import Path
from typing import BinaryIO, NoReturn


def load() -> None:
    """Import what a trusted pytest process needs, and read the answer marks: what takes the time."""
    import pytest  # noqa: F401
    import pytest_timeout  # noqa: F401
    import torch  # noqa: F401  (what takes the time)

    import toyllm.grading.sandbox.harness  # noqa: F401
    import toyllm.parallel  # noqa: F401

    from ... import answers
    from . import plugin  # noqa: F401

    answers.answer_marks()            # the marks are read from toyllm's source once per process


def serve(requests: BinaryIO) -> NoReturn:
    """Start a sandbox ahead, wait for one request on ``requests`` and run pytest as it says; exit with its code."""
    import pytest

    from ..sandbox import process as sandbox

    sandbox.prestart()
    gc.freeze()                       # what is imported stays: pytest's garbage collections skip it
    line = requests.readline()
    if not line:                          # nobody came: end quietly (the sandbox ends with this process)
        sandbox.close()
        os._exit(0)
    request = json.loads(line)
    os.chdir(request["cwd"])
    os.environ.update(request["env"])
    out = os.open(request["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    code = pytest.main(request["args"])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(int(code))


# --------------------------------------------------------------------------- a copy of the grading process

def can_fork() -> bool:
    """Whether ``fork`` gives a standby that a fresh Python would be (see the module's docstring)."""
    return (hasattr(os, "fork") and sys.platform == "linux" and os.environ.get("PYTHONHASHSEED") == "0"
            and threading.active_count() == 1)


class Forked:
    """A standby forked from this process, as far as ``run`` uses ``subprocess.Popen``: pid, stdin, poll, wait."""

    def __init__(self, pid: int, stdin: BinaryIO):
        self.pid, self.stdin, self.returncode = pid, stdin, None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:              # reaped elsewhere: it is gone, how is unknown
                self.returncode = 1
            else:
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        pause = 0.0005
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"standby {self.pid}", timeout)
            time.sleep(pause if deadline is None else max(0.0, min(pause, deadline - time.monotonic())))
            pause = min(pause * 2, 0.05)
        return self.returncode


def fork(env: dict[str, str], cwd: Path) -> Forked:
    """A standby forked from this process, with ``env`` (all of it) in ``cwd``; ``can_fork()`` must hold.

    The copy is what ``subprocess.Popen([python, "-m", ...standby], start_new_session=True,
    preexec_fn=die_with_parent, stdout=DEVNULL, stderr=DEVNULL)`` would start, less the imports:
    its own session, killed when this process dies, nothing open but its request pipe and /dev/null,
    the environment replaced, a fresh ``__main__``, its random numbers where a fresh Python has them.
    """
    from ...supervise import die_with_parent

    load()                                 # once in this process; every copy has them
    parent = os.getpid()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.setsid()
            die_with_parent()
            if os.getppid() != parent:     # it died before the line above
                os._exit(1)
            null = os.open(os.devnull, os.O_RDWR)
            os.dup2(r, 0)
            os.dup2(null, 1)
            os.dup2(null, 2)
            os.closerange(3, os.sysconf("SC_OPEN_MAX"))
            signal.signal(signal.SIGINT, signal.default_int_handler)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.chdir(cwd)
            os.environ.clear()
            os.environ.update(env)
            sys.dont_write_bytecode = env.get("PYTHONDONTWRITEBYTECODE", "") != ""
            sys.path[0] = str(cwd)         # as ``python -m`` started there
            main_module = types.ModuleType("__main__")
            main_module.__spec__ = None
            sys.modules["__main__"] = main_module
            random.seed()
            import torch

            torch.manual_seed(torch.initial_seed())
            serve(os.fdopen(0, "rb"))
        except BaseException:
            os._exit(1)
    os.close(r)
    return Forked(pid, os.fdopen(w, "wb"))


def main() -> None:
    load()
    serve(sys.stdin.buffer)


if __name__ == "__main__":
    main()
