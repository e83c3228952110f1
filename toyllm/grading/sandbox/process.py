"""Submitted code runs in a sandbox process; the graded tests only see proxies.

While the grader runs (``TOYLLM_GRADE_SANDBOX=1`` in its pytest process),
``load_exercise("ex02")`` returns a ``RemoteModule``: calling
``ex02.kv_cache_bytes(...)`` sends the arguments to one sandbox process per
lesson and brings back the value (``wire`` says in which safe format). The
sandbox process

- runs as a user id of its own (no account, no other process) when the
  grader runs as root (as in a Gradescope container or CI), else as the
  grader's user;
- has its own process group, a scratch folder as its working directory and
  home, a copy of the submission's files and an environment with nothing
  but the basics;
- holds no model answer at all, as text or as code: toyllm's marked
  functions run the submission's own exercises there, in either edition
  (``toyllm.answers.run_submission``), so a graded test that runs the
  framework through another exercise (8.2 inside the paged cache in a
  test of 8.1) runs the student's own, as the student's ``check()`` does,
  and a test of 3.5 that calls the submission's 3.3 runs that 3.3. What
  fails because a neighbour is wrong names that neighbour
  (``toyllm.grading.expect.neighbours_note``);
- gets CPU-time, memory, file-size and process-count limits;
- cannot reach the graded tests, the grader's log or the results file (they
  live in the grader's private folder, which the sandbox user cannot open).

A call that does not return before the test's time is up stops the sandbox
(``SubmissionTimeout``, named after the call); so does a crash
(``SubmissionCrash``). The next call starts a fresh sandbox. A module whose
import timed out or failed is not imported again: one timeout, not one per
test. Every process the submission started ends with the sandbox: as root,
the sandbox is the only child of the init of its own PID namespace
(``launcher``), which dies with it and takes every process in the
namespace along; elsewhere the pytest process is a child subreaper, so
even processes that detached themselves come back to it and are ended.

Outside the grader (plain ``pytest tests/grading``) the same tests run the
submission in-process under the same rules (``toyllm.grading.sandbox.local``), which
keeps ``make test`` fast.

Test authors reach trusted helpers that must run next to the submission
(a model loop that records forward calls, the parallel engine) with
``sandboxed("toyllm.grading.sandbox.harness:function", *args)`` (in ``local``).
"""
from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import BinaryIO, Callable, NamedTuple

from . import guard
from ... import course
from ... import supervise
from ...supervise import become_subreaper, child_options, describe_exit, die_with_parent, signal_group
from ..settings import Settings
from .launcher import ID_RANGE, closed_folders, namespaces_work, unused_id

DEFAULT_MEMORY_MB = 8192
CPU_LIMIT_S = 900                             # CPU seconds per sandbox process
FILE_LIMIT_BYTES = 256 * 2**20
OUTPUT_KEEP_BYTES = 64 * 2**10                # of what one call printed: this much of its start and its end
PROCESS_LIMIT = 256


class SubmissionTimeout(Exception):
    """A call into the submission did not return in time."""


class SubmissionCrash(Exception):
    """The submission's process died during a call."""


class SubmissionError(Exception):
    """The submission raised an exception that is not one of Python's built-in ones."""


# --------------------------------------------------------------------------- what the current test is

class _Context:
    exercise: str | None = None       # "2.1" while a test of Exercise 2.1 runs
    forbidden: tuple = ()             # what it may not call (toyllm.answers.forbidden)
    deadline: float | None = None     # time.monotonic() by which a call must be back
    on_violation = None               # callback(exercise, message), set by the plugin
    more_exercises = False            # will a later test of this run grade another exercise?


context = _Context()


def _time_left(default_s: float | None = None) -> float:
    if context.deadline is not None:
        return max(context.deadline - time.monotonic(), 0.5)
    return default_s if default_s is not None else float(Settings.from_env(os.environ).timeout or "20")


def describe_call(name: str, args, kwargs) -> str:
    """``name(arg, ...)`` with tensors as their shapes and long values cut short."""
    def short(x):
        import torch

        if isinstance(x, torch.Tensor):
            return f"tensor{tuple(x.shape)}"
        if isinstance(x, torch.nn.Module):
            return type(x).__name__
        if isinstance(x, RemoteFunction):          # a submitted function (only proxies reach the sandbox)
            return x.__name__
        text = repr(x)
        return text if len(text) <= 40 else text[:37] + "..."
    parts = [short(a) for a in args] + [f"{k}={short(v)}" for k, v in kwargs.items()]
    return f"{name}({', '.join(parts)})"


# --------------------------------------------------------------------------- the sandbox process

def sandbox_user() -> tuple[int, int] | None:
    """(uid, gid) to run the submission as, or None to keep the grader's own user.

    As root with no user named in ``TOYLLM_SANDBOX_USER``, a fresh id per call (``launcher.unused_id``),
    so sandboxes graded side by side never share a process limit; where none can be had, ``nobody``.
    """
    if not supervise.linux() or os.geteuid() != 0:
        return None                   # elsewhere (macOS, Windows): the grader's user, see isolation()
    import pwd

    named = Settings.from_env(os.environ).user
    fresh = None if named else unused_id()
    if fresh is not None and not (closed_folders() and not namespaces_work()):
        return fresh, fresh
    name = named or "nobody"
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        raise RuntimeError(f"the grader runs as root but there is no user {name!r} to run submissions as; "
                           f"create one or set {Settings.variable('user')}") from None
    if entry.pw_uid == 0:
        raise RuntimeError(f"{Settings.variable('user')}={name} is root; submissions must run as an unprivileged user")
    if closed_folders() and not namespaces_work():
        return None                   # that user could not even start Python: see isolation()
    return entry.pw_uid, entry.pw_gid


def isolation() -> str:
    """One line saying who runs the submission (shown with every grade)."""
    if not supervise.linux() or os.geteuid() != 0:
        return "the submission runs in its own process, as the grader's user"
    named = Settings.from_env(os.environ).user
    name = named or "nobody"
    user = sandbox_user()
    if user is None:
        return (f"WARNING: the submission runs as root: user {name!r} cannot reach "
                f"{', '.join(map(str, closed_folders()))} to run Python, and mount namespaces are not available")
    who = f"user {name!r}" if named or user[0] < ID_RANGE.start else "a user id of its own"
    return f"the submission runs in its own process as {who}" + \
        (", with the course's tests out of sight and its own network, IPC and writable folders"
         if namespaces_work() else "")


class _Forked:
    """A process a zygote forked, as far as ``Sandbox`` and the grader use ``subprocess.Popen``: it was re-parented
    to this process (a child subreaper), so this process waits for it like for a child of its own."""

    def __init__(self, pid: int, stdin: BinaryIO | None = None):
        self.pid, self.stdin, self.returncode = pid, stdin, None

    def _reap(self, flags: int) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, flags)
            except ChildProcessError:          # reaped elsewhere: it is gone, how is unknown
                self.returncode = 1
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def poll(self) -> int | None:
        return self._reap(os.WNOHANG)

    def wait(self, timeout: float | None = None) -> int:
        """Its exit code, once it has ended; ``subprocess.TimeoutExpired`` after ``timeout`` seconds."""
        if timeout is None:
            return self._reap(0)
        deadline, pause = time.monotonic() + timeout, 0.0005
        while self.poll() is None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise subprocess.TimeoutExpired(f"process {self.pid}", timeout)
            time.sleep(min(pause, left))
            pause = min(pause * 2, 0.05)
        return self.returncode


class Zygote:
    """A process that has imported torch and toyllm's framework and forks copies of itself (``zygote``): each
    sandbox, and, as a grading's *template*, each lesson's trusted pytest process, starts without importing
    torch again (about 1.5 CPU-seconds each on the course's reference machine). ``start`` runs a fresh Python;
    ``fork`` forks this process (a standby does, before it imports pytest); ``launch`` and
    ``launch_module`` return None where it cannot serve (then the caller starts a fresh Python as before)."""

    READY_TIMEOUT_S = 120          # its import of torch, on a busy machine
    REPLY_TIMEOUT_S = 30           # one fork

    def __init__(self, proc: subprocess.Popen | _Forked, control: socket.socket):
        self.proc, self.control = proc, control
        self.ready = False

    @classmethod
    def start(cls, env: dict[str, str]) -> "Zygote":
        """A zygote in a fresh Python with ``env``."""
        control, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("zygote.py")), str(child.fileno())],
                                    env=env, pass_fds=(child.fileno(),), stdin=subprocess.DEVNULL,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                                    preexec_fn=die_with_parent)
        finally:
            child.close()
        return cls(proc, control)

    @classmethod
    def fork(cls, serve: Callable[[socket.socket], None]) -> "Zygote":
        """A zygote forked from this process, which must hold what ``zygote.load`` loads and nothing it must not
        hand on (a standby, before it imports pytest or learns what it will grade): its own session, nothing open
        but its control socket, on which it runs ``serve`` (``zygote.serve``)."""
        control, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        pid = os.fork()
        if pid == 0:
            try:
                os.setsid()
                die_with_parent()
                fd = os.dup2(child.fileno(), 3, inheritable=False)
                null = os.open(os.devnull, os.O_RDWR)
                for target in (0, 1, 2):
                    os.dup2(null, target)
                os.closerange(4, os.sysconf("SC_OPEN_MAX"))
                serve(socket.socket(fileno=fd))
            finally:
                os._exit(0)
        child.close()
        return cls(_Forked(pid), control)

    def _request(self, request: dict, fds: list[int]) -> int | None:
        """Send one request; the pid of the copy, or None if the zygote failed (the caller ends it)."""
        try:
            if not self.ready:
                self.control.settimeout(self.READY_TIMEOUT_S)
                self.ready = json.loads(self.control.recv(4096) or b"{}").get("ready", False)
                if not self.ready:
                    raise ConnectionError("the zygote ended before it was ready")
            self.control.settimeout(self.REPLY_TIMEOUT_S)
            socket.send_fds(self.control, [json.dumps({**request, "parent": os.getpid()}).encode()], fds)
            reply = json.loads(self.control.recv(4096) or b"{}")
            if not reply.get("pid"):
                raise ConnectionError(reply.get("error", "no reply"))
            return reply["pid"]
        except (OSError, ValueError):
            return None

    def launch(self, argv: list[str], env: dict[str, str], cwd: Path, fds: tuple[int, int]) -> _Forked | None:
        """Fork a sandbox running ``launcher.py FD *argv`` with ``env`` in ``cwd``; ``fds``: its socket and the
        file for its output. None if the zygote failed."""
        pid = self._request({"role": "sandbox", "argv": argv, "env": env, "cwd": str(cwd)}, list(fds))
        return None if pid is None else _Forked(pid)

    def launch_module(self, module: str, args: list[str], env: dict[str, str], cwd: Path) -> _Forked | None:
        """Fork a copy that runs ``python -m module *args`` with ``env`` in ``cwd`` (as the grader's user, no
        namespaces: for trusted code only); its ``stdin`` is a pipe to its standard input. None if the zygote failed."""
        r, w = os.pipe()
        try:
            pid = self._request({"role": "module", "module": module, "args": args, "env": env, "cwd": str(cwd),
                                 "path0": str(cwd)}, [r])
        finally:
            os.close(r)
        if pid is None:
            os.close(w)
            return None
        return _Forked(pid, os.fdopen(w, "wb"))

    def close(self) -> None:
        self.control.close()
        signal_group(self.proc.pid)
        self.proc.wait()


class ZygoteSlot:
    """Where this process keeps one zygote of its own: started on first use (``get``), ended on request; one
    that failed is not started again, and the caller starts a fresh Python instead, as before zygotes."""

    def __init__(self):
        self.zygote: Zygote | None = None
        self.failed = False

    def get(self, start: Callable[[], Zygote]) -> Zygote | None:
        if self.zygote is None and not self.failed:
            self.zygote = start()
        return self.zygote

    def use(self, zygote: Zygote) -> None:
        """Keep ``zygote`` from now on (a standby's own, ``Zygote.fork``)."""
        self.end()
        self.zygote = zygote

    def end(self, failed: bool = False) -> None:
        if self.zygote is not None:
            zygote, self.zygote = self.zygote, None
            zygote.close()
        self.failed = self.failed or failed


# This process's sandboxes come from here; they are re-parented to this process (a child subreaper).
zygotes = ZygoteSlot()


class _Launched(NamedTuple):
    proc: subprocess.Popen | _Forked
    sock: socket.socket
    output: BinaryIO               # read end of its stdout and stderr
    scratch: Path


class Sandbox:
    """One sandbox process (restarted after a crash or timeout, and for each exercise) for the submission.

    The submission is read when a sandbox starts serving (from ``$TOYLLM_IMPL``), so one can be started
    ahead (``prestart``) before anyone knows what it will grade.
    """

    def __init__(self, memory_mb: int, hide=()):
        self.memory_mb = memory_mb
        self.hide = [Path(p) for p in hide]       # folders the submission must not see (the tests)
        self.user = sandbox_user()
        self.proc: subprocess.Popen | None = None
        self._output = None                   # read end of the sandbox's stdout and stderr
        self.sock: socket.socket | None = None
        self.scratch: Path | None = None
        self.exercise: str | None = None       # the exercise the sandbox serves
        self.loaded: dict[str, dict] = {}          # module -> reply of its load
        self.failed: dict[str, Exception] = {}     # module -> why it cannot be loaded (not retried)
        self._others: set[int] = set()
        self._spare: _Launched | None = None        # a sandbox started ahead, for the next exercise

    # -- process management

    def _launch(self) -> _Launched:
        """A sandbox process that holds nothing yet (no submission, no answer): ``_start`` hands it its files."""
        # In a namespace the launcher copies the scratch folder into the sandbox's own /tmp, so it can stay in
        # the grader's private folder (removed with it, even after a SIGKILL of this process); otherwise the
        # sandbox user must reach it.
        private = self.user is None or namespaces_work()
        scratch = Path(tempfile.mkdtemp(prefix="toyllm-sandbox-", dir=Settings.from_env(os.environ).scratch if private else None))
        if self.user is not None:
            os.chown(scratch, *self.user)
        if supervise.windows():
            return self._launch_over_tcp(scratch)
        parent, child = socket.socketpair()
        env = self._environment(scratch)
        limits = self._limits()
        user = f"{self.user[0]},{self.user[1]}" if self.user else "-"
        hide = os.pathsep.join(str(p) for p in self.hide)
        args = [str(scratch / "reference"), str(os.getpid()), limits, user, hide]
        subreaper = become_subreaper()          # orphans below come back here: the zygote's copies too
        # Fresh descriptors for the sandbox's output: a write-only one on a file of the grader's (mode 0600),
        # never the trusted test process's own stdout and stderr, where pytest captures what a test printed.
        fd, path = tempfile.mkstemp(prefix="toyllm-sandbox-", suffix=".out")
        output = os.fdopen(fd, "rb")
        write_only = os.open(path, os.O_WRONLY | os.O_APPEND)
        os.unlink(path)
        try:
            # The zygote shares what no sandbox changes: everything but the scratch folder's paths.
            shared = {k: v for k, v in env.items() if str(scratch) not in v}
            zygote = zygotes.get(lambda: Zygote.start(shared)) if subreaper else None
            proc = zygote and zygote.launch(args, env, scratch, (child.fileno(), write_only))
            if zygote is not None and proc is None:
                zygotes.end(failed=True)
            if proc is None:
                proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("launcher.py")),
                                         str(child.fileno()), *args], cwd=scratch, env=env,
                                        pass_fds=(child.fileno(),), stdin=subprocess.DEVNULL, stdout=write_only,
                                        stderr=write_only, **child_options())
        finally:
            os.close(write_only)
            child.close()
        return _Launched(proc, parent, output, scratch)

    def _environment(self, scratch: Path) -> dict[str, str]:
        env = {"PATH": os.defpath, "HOME": str(scratch), "TMPDIR": str(scratch), "LANG": "C.UTF-8",
               "PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0", "PYTHONNOUSERSITE": "1",
               "OMP_NUM_THREADS": "1",
               # the submission's copy; the lesson's size switch, handed on if set
               **Settings(impl=str(scratch / "submission"), fast=Settings.from_env(os.environ).fast).to_env()}
        # where libpython is; Windows: what its Python needs to start (SYSTEMROOT) and where temporary files go
        for name in ("LD_LIBRARY_PATH", "SYSTEMROOT", "SystemRoot", "TEMP", "TMP"):
            if name in os.environ:
                env[name] = os.environ[name]
        if supervise.windows():
            env.update(TEMP=str(scratch), TMP=str(scratch), USERPROFILE=str(scratch))
        return env

    def _limits(self) -> str:
        return f"{self.memory_mb},{CPU_LIMIT_S},{FILE_LIMIT_BYTES},{PROCESS_LIMIT if self.user else 0}"

    STARTUP_TIMEOUT_S = 120        # a sandbox's Python, started over TCP, connecting back (it imports nothing first)

    def _launch_over_tcp(self, scratch: Path) -> _Launched:
        """Windows: no descriptor can be handed to a child (``pass_fds``), nor an output file removed while open,
        and there is no launcher to run (no user to become, no namespaces). The sandbox's Python is started
        directly, as the grader's user; it connects back to a one-time listener on 127.0.0.1 and proves
        itself with a token it was given; its output goes to a file in its scratch folder (removed with it)."""
        token = secrets.token_hex(16)
        listener = socket.create_server(("127.0.0.1", 0))
        fd, path = tempfile.mkstemp(prefix="toyllm-sandbox-", suffix=".out", dir=scratch)
        output = os.fdopen(fd, "rb")
        write_only = os.open(path, os.O_WRONLY | os.O_APPEND)
        try:
            address = f"tcp:{listener.getsockname()[1]}:{token}"
            proc = subprocess.Popen([sys.executable, "-c", "from toyllm.grading.sandbox.server import serve; serve()",
                                     address, str(scratch / "reference"), str(os.getpid()), self._limits()],
                                    cwd=scratch, env=self._environment(scratch), stdin=subprocess.DEVNULL,
                                    stdout=write_only, stderr=write_only, **child_options())
        finally:
            os.close(write_only)
        try:
            deadline = time.monotonic() + self.STARTUP_TIMEOUT_S
            while True:
                listener.settimeout(max(deadline - time.monotonic(), 0.001))
                try:
                    sock, _ = listener.accept()
                except socket.timeout:
                    raise SubmissionCrash("the submission's process did not start") from None
                sock.settimeout(10)
                try:
                    if sock.recv(len(token), socket.MSG_WAITALL).decode(errors="replace") == token:
                        sock.settimeout(None)
                        return _Launched(proc, sock, output, scratch)
                except OSError:
                    pass
                sock.close()                # not ours: someone else reached the port
        except BaseException:
            signal_group(proc.pid)
            proc.wait()
            output.close()
            raise
        finally:
            listener.close()

    def _files(self) -> dict[str, str]:
        """The submission as it is now: its files' text ({"submission/exNN_*.py": text})."""
        from ...course import resolve_impl
        from .submission import read_submission

        # Text read as regular files, never through a link; grade() reports what was skipped.
        submitted, _ = read_submission(resolve_impl())
        return {f"submission/{name}": text for name, text in submitted.items()}

    def _start(self) -> None:
        spare, self._spare = self._spare, None
        if spare is not None and spare.proc.poll() is not None:
            self._end(spare)
            spare = None
        self._others = {p.pid for p in _children()} - ({spare.proc.pid} if spare else set())
        launched = spare or self._launch()
        self.proc, self.sock, self._output, self.scratch = launched
        self.exercise = context.exercise
        self._request_started({"op": "prepare", "files": self._files()}, "starting the sandbox")
        if context.more_exercises:               # the next exercise's sandbox warms up while this one works
            self._spare = self._launch()
        for name in list(self.loaded):               # a restart: bring back what was loaded
            self.loaded.pop(name)
            self.load(name)

    def _end(self, launched: _Launched) -> None:
        signal_group(launched.proc.pid)
        launched.proc.wait()
        launched.output.close()
        launched.sock.close()
        shutil.rmtree(launched.scratch, ignore_errors=True)

    def close(self) -> None:
        """End the sandbox, the spare one and the zygote."""
        self.kill()
        if self._spare is not None:
            spare, self._spare = self._spare, None
            self._end(spare)
        zygotes.end()

    def kill(self) -> None:
        """End the sandbox and every process it started, however they detached."""
        if self.proc is None:
            return
        with _alarm_held():
            self._kill()

    def _kill(self) -> None:
        proc, self.proc = self.proc, None
        signal_group(proc.pid)
        proc.wait()
        self._end_descendants()
        self.relay_output()
        self._output.close()
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)
            self.scratch = None

    def _in_spare(self, pid: int) -> bool:
        """Is ``pid`` part of the spare sandbox? It ran no submitted code, so it is still in its own session."""
        if self._spare is None:
            return False
        try:
            return pid == self._spare.proc.pid or os.getsid(pid) == self._spare.proc.pid
        except (OSError, AttributeError):     # no sessions (Windows): only the spare itself is known
            return False

    def _end_descendants(self) -> None:
        import psutil

        for _ in range(5):                 # orphans keep arriving while their parents die
            zygote = {zygotes.zygote.proc.pid} if zygotes.zygote is not None else set()
            strays = [p for p in _children() if p.pid not in self._others | zygote and not self._in_spare(p.pid)]
            if not strays:
                return
            for p in strays:
                try:
                    p.kill()
                except psutil.Error:
                    pass
            psutil.wait_procs(strays, timeout=5)

    # -- requests

    def relay_output(self) -> None:
        """Show what the submission printed since the last relay as this test's own output (pytest captures it
        here): at most ``OUTPUT_KEEP_BYTES`` of its start and as many of its end, saying how much was left out.

        The file is emptied after, so the sandbox's file-size limit bounds what one call prints (what a
        process of the submission's writes while this runs may be lost).
        """
        if self._output is None or self._output.closed:
            return
        output = self._output
        start, end = output.tell(), os.fstat(output.fileno()).st_size
        if end - start > 2 * OUTPUT_KEEP_BYTES:
            head = output.read(OUTPUT_KEEP_BYTES)
            output.seek(end - OUTPUT_KEEP_BYTES)
            left_out = f"\n[... {end - start - 2 * OUTPUT_KEEP_BYTES} bytes of output left out ...]\n"
            printed = head + left_out.encode() + output.read(OUTPUT_KEEP_BYTES)
        else:
            printed = output.read(end - start)
        os.ftruncate(output.fileno(), 0)
        output.seek(0)
        if printed:
            sys.stdout.write(printed.decode(errors="replace"))

    def _request(self, message: dict, what: str, callbacks=None) -> dict:
        if self.proc is not None and self.exercise != context.exercise:
            self.kill()                # a new exercise starts afresh: nothing another one's calls left behind
        if self.proc is None:
            self._start()
        return self._request_started(message, what, callbacks)

    def _request_started(self, message: dict, what: str, callbacks=None) -> dict:
        """Send ``message``; answer the sandbox's requests for the values of ``callbacks`` ({number: Counted})
        until its reply comes, all within the test's time."""
        # imported here, not at the top: the grader's parent process imports this module for its isolation
        # checks and has no use for torch, which the wire format needs
        from . import wire
        timeout_s = _time_left()       # what is left once the sandbox is up
        deadline = time.monotonic() + timeout_s
        try:
            self.sock.settimeout(timeout_s)
            wire.send(self.sock, wire.to_sandbox(message))
            reply = wire.from_sandbox(wire.recv_reply(self.sock))
            while isinstance(reply, dict) and "callback" in reply:
                self.sock.settimeout(max(deadline - time.monotonic(), 0.001))
                wire.send(self.sock, wire.to_sandbox(_answer_callback(reply, callbacks or {})))
                reply = wire.from_sandbox(wire.recv_reply(self.sock))
            self.relay_output()
            return reply
        except socket.timeout:
            self.kill()
            raise SubmissionTimeout(f"timed out: {what} did not return within {timeout_s:.0f} s "
                                    "(the submission's process was stopped)") from None
        except (ConnectionError, OSError, EOFError) as e:
            code = self.proc.poll() if self.proc is not None else None
            if self.proc is not None:
                time.sleep(0.1)
                code = self.proc.poll()
            self.kill()
            why = describe_exit(code) if code is not None else str(e)
            raise SubmissionCrash(f"crashed: the submission's process died during {what} ({why}); look for "
                                  "os._exit, sys.exit in a worker, a segfault or running out of memory") from None
        except BaseException:                   # Ctrl-C, a test's own timeout: the sandbox is mid-call
            self.kill()
            raise

    def load(self, name: str) -> dict:
        if name in self.failed:
            raise self.failed[name]
        if name in self.loaded:
            return self.loaded[name]
        try:
            reply = self._request({"op": "load", "module": name}, f"importing {name}")
        except (SubmissionTimeout, SubmissionCrash) as e:
            self.failed[name] = type(e)(str(e).replace(f"importing {name}", f"importing your {name} file"))
            raise self.failed[name] from None
        if not reply["ok"]:
            self.failed[name] = _rebuild_error(reply["error"])
            raise self.failed[name]
        self.loaded[name] = reply["value"]
        return reply["value"]

    def call(self, target: tuple, args: tuple, kwargs: dict, what: str):
        from .counted import Counted

        message = {"op": "call", "target": target, "args": args, "kwargs": kwargs,
                   "exercise": context.exercise, "forbidden": list(context.forbidden)}
        callbacks = {id(a): a for a in (*args, *kwargs.values()) if isinstance(a, Counted)}   # costs stay here
        reply = self._request(message, what, callbacks)
        for violation in reply.get("violations", ()):
            if context.on_violation is not None:
                context.on_violation(context.exercise, violation)
        if reply.get("violations"):
            raise guard.IndependenceError(reply["violations"][0])
        if not reply["ok"]:
            raise _rebuild_error(reply["error"])
        return reply["value"]


def _children():
    import psutil

    try:
        return psutil.Process().children(recursive=True)
    except psutil.Error:
        return []



@contextlib.contextmanager
def _alarm_held():
    """pytest-timeout's alarm (SIGALRM) waits until the block is done, and fires right after.

    The sandbox is ended when a call times out, which is often just before the test's own limit: an end cut
    short there would leave the sandbox's processes and scratch folder behind for the next test.
    """
    if not hasattr(signal, "pthread_sigmask") or threading.current_thread() is not threading.main_thread():
        yield
        return
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def _answer_callback(request: dict, callbacks: dict) -> dict:
    """The reply to the sandbox asking for the value of a grading cost given to the call now running."""
    number = request.get("callback")
    cost = callbacks.get(number) if type(number) is int else None
    if cost is None:
        return {"ok": False, "type": "RuntimeError",
                "message": "the grader's cost function is only valid during the call it was given to"}
    return cost.answer(request.get("arg"))


def _rebuild_error(error: dict) -> Exception:
    """The submission's exception as a built-in exception of the same kind (so pytest.raises works)."""
    import builtins

    cls = getattr(builtins, str(error.get("builtin")), None)
    message = str(error.get("message", ""))
    if not (isinstance(cls, type) and issubclass(cls, Exception)) or cls is Exception and error.get("type") != "Exception":
        cls, message = SubmissionError, f"{error.get('type')}: {message}"
    where = error.get("where")
    exc = cls(message + (f"\n  at {where}" if where else ""))
    return exc


# --------------------------------------------------------------------------- the proxies tests see

_sandbox: Sandbox | None = None


def _get_sandbox() -> Sandbox:
    global _sandbox
    if _sandbox is None:
        settings = Settings.from_env(os.environ)
        hide = [p for p in (settings.hide or "").split(os.pathsep) if p]
        _sandbox = Sandbox(int(settings.memory_mb or DEFAULT_MEMORY_MB), hide)
    return _sandbox


def running_sandbox() -> Sandbox | None:
    """The sandbox serving the current test's exercise, if its process is up now; None before the test's first
    call, and after a crash or a timeout stopped it."""
    sandbox = _sandbox
    if sandbox is None or sandbox.proc is None or sandbox.exercise != context.exercise:
        return None
    return sandbox


def prestart() -> None:
    """Start a sandbox ahead (no submission, no answers yet), so the first test does not wait for Python."""
    sandbox = _get_sandbox()
    if sandbox._spare is None and sandbox.proc is None:
        sandbox._spare = sandbox._launch()


def close() -> None:
    """End the sandbox (the plugin calls this when pytest finishes)."""
    global _sandbox
    if _sandbox is not None:
        _sandbox.close()
        _sandbox = None


class RemoteFunction:
    """A submitted function, called in the sandbox."""

    def __init__(self, module: "RemoteModule", name: str):
        self._module, self.__name__ = module, name
        self.__qualname__ = name

    def _toyllm_remote_ref(self):
        return ("exercise", self._module._name, self.__name__)

    @property
    def source_file(self) -> Path:
        return self._module.__file__

    def __call__(self, *args, **kwargs):
        what = describe_call(self.__name__, args, kwargs)
        return _get_sandbox().call(self._toyllm_remote_ref(), args, kwargs, what)

    def __repr__(self) -> str:
        return f"<submitted function {self._module._name}.{self.__name__}>"


class RemoteModule:
    """The submission's exercise module as the graded tests see it: attribute access gives ``RemoteFunction``s."""

    def __init__(self, name: str):
        from ...course import exercise_file, resolve_impl

        self._name = name
        self.__file__ = exercise_file(resolve_impl(), name)
        self._functions = set(_get_sandbox().load(name)["functions"])

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        if attr not in self._functions:
            raise AttributeError(f"{self.__file__.name} has no function {attr!r}")
        return RemoteFunction(self, attr)

    def __repr__(self) -> str:
        return f"<submission {self.__file__.name} (runs in the sandbox)>"


def remote_module(name: str) -> RemoteModule:
    return RemoteModule(name)


course.load_remotely_with(remote_module)       # inside a grading, load_exercise(name) gives this proxy
