"""Starts sandbox processes (and the grader's own pytest processes) by forking one that has imported torch already.

Every exercise gets a fresh sandbox (``process``), and a fresh Python
spends about 1.5 CPU-seconds importing torch: six exercises of a lesson
paid that six times. This process (the zygote) imports torch once and
then, for each sandbox, forks a copy that runs ``launcher`` exactly as
the script would (namespaces, private view, sandbox user), except that
its last step calls ``server.serve`` in the same process instead of
starting Python again.

Run as a script (``python zygote.py CONTROL_FD``) by ``process.Zygote``,
with the grader's rights. It imports the standard library, torch, and
toyllm's framework: the modules the sandbox server imports before any
submitted code (``server.FRAMEWORK_MODULES``) and the answer marks,
which ``toyllm.answers`` reads from toyllm's own source (parsing every
file took about 0.2 CPU-seconds a sandbox). No test and no answer, so a
copy holds nothing a fresh sandbox would not have loaded before the
submission's first line. It then freezes what it imported for the
garbage collector (``gc.freeze``): a copy's collections skip torch's
objects instead of walking them, and writing to every page that holds
one (about 0.3 CPU-seconds a sandbox).

Requests come on the control socket (a ``SOCK_SEQPACKET`` pair, one
message each): a JSON object with the role of the copy, its arguments, the
environment, the working folder and the pid of the process that will own
it, and its descriptors. The reply is ``{"pid": N}``. Two roles:

- ``sandbox``: descriptors: the sandbox's socket and the file for its
  output. The copy becomes the sandbox (``_become_sandbox``);
- ``module``: descriptor: its standard input. The copy runs a module as
  ``python -m MODULE *ARGS`` would (``_become_module``), its output to
  /dev/null. A grading process (``grade`` on the command line) starts one
  zygote, its *template*, and runs each lesson's trusted pytest process
  so (``toyllm.grading.grader.standby --from-template``), instead of a
  fresh Python that imports torch and pytest again. Before it loads
  anything of the grader, that copy forks its own zygote for its lesson's
  sandboxes (``process.Zygote.fork``), which then serves as this script's
  zygote would.

Each copy is a grandchild: the child in between exits at once, so the
copy is re-parented to the process that owns it (a child subreaper: the
grader's test process for a sandbox, the grading process for a standby),
which waits for it, reads its exit status and ends it, as it would a
process it had started itself. The copy closes the control socket before
anything else, so no copy can ask for another.
"""
from __future__ import annotations

import gc
import importlib
import json
import os
import random
import runpy
import site
import socket
import sys
import time
import types

try:
    from . import launcher                        # imported as part of toyllm (a test, a tool)
except ImportError:
    import launcher                               # run as a script: its folder is on sys.path

SANDBOX_FD = 3                   # where the copy keeps the sandbox's socket (0-2: nothing in, output out)
ROLES = {"sandbox": 2, "module": 1}      # role -> the descriptors a request hands over


def _adopted(request: dict) -> None:
    """In a copy: its own session, re-parented to the process that owns it, and ending when that one dies."""
    os.setsid()                                        # its own session and process group, as start_new_session
    parent = int(request["parent"])
    deadline = time.monotonic() + 10
    while os.getppid() != parent:                      # the child in between is exiting: wait to be re-parented
        if time.monotonic() > deadline:
            os._exit(1)
        time.sleep(0.001)
    launcher.libc().prctl(launcher._PR_SET_PDEATHSIG, 9, 0, 0, 0)   # its owner died: so do we
    if os.getppid() != parent:
        os._exit(1)


def _fresh_python(request: dict, argv: list[str]) -> None:
    """In a copy: the working folder, environment, path and ``__main__`` a fresh Python started so would have."""
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.dont_write_bytecode = bool(request["env"].get("PYTHONDONTWRITEBYTECODE"))
    if request["env"].get("PYTHONNOUSERSITE") and site.ENABLE_USER_SITE and site.USER_SITE in sys.path:
        sys.path.remove(site.USER_SITE)
    random.seed()                                     # a fresh Python seeds from the system; so does each copy
    # As ``python -c``: a ``__main__`` with no file, so that workers started with multiprocessing's "spawn"
    # do not run this script again.
    sys.path[0] = request.get("path0", "")
    main_module = types.ModuleType("__main__")
    main_module.__spec__ = None
    sys.modules["__main__"] = main_module
    sys.argv = argv


def _become_sandbox(request: dict, sandbox_fd: int, output_fd: int) -> None:
    """In the copy: the state ``subprocess.Popen`` gives the launcher script, then the launcher itself."""
    _adopted(request)
    # Descriptors: high numbers first, so no dup2 overwrites one still needed.
    high = [os.dup(fd) for fd in (sandbox_fd, output_fd)]
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(high[1], 1)
    os.dup2(high[1], 2)
    os.dup2(high[0], SANDBOX_FD, inheritable=True)
    os.closerange(SANDBOX_FD + 1, os.sysconf("SC_OPEN_MAX"))
    # The launcher reads its arguments as the script does.
    _fresh_python(request, ["launcher.py", str(SANDBOX_FD), *request["argv"]])
    sys.argv = ["-c", *launcher.main(in_process=True)]              # now the sandbox user, in its namespaces
    from toyllm.grading.sandbox.server import serve

    serve()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _become_module(request: dict, stdin_fd: int) -> None:
    """In the copy: what ``python -m MODULE *ARGS`` would run, standard input from ``stdin_fd``, no output."""
    _adopted(request)
    os.dup2(stdin_fd, 0)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.dup2(null, 2)
    os.closerange(3, os.sysconf("SC_OPEN_MAX"))
    _fresh_python(request, ["-m", *request["args"]])
    runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _fork(request: dict, fds: list[int], control: socket.socket) -> int:
    """Fork the copy a request asks for (a grandchild); its pid."""
    become = {"sandbox": _become_sandbox, "module": _become_module}[request.get("role", "sandbox")]
    r, w = os.pipe()
    middle = os.fork()
    if middle == 0:
        try:
            control.close()
            os.close(r)
            grandchild = os.fork()
            if grandchild == 0:
                os.close(w)
                try:
                    become(request, *fds)
                except BaseException:
                    import traceback

                    traceback.print_exc()
                    sys.stderr.flush()
                os._exit(1)
            os.write(w, str(grandchild).encode())
        finally:
            os._exit(0)
    os.close(w)
    os.waitpid(middle, 0)
    with os.fdopen(r, "rb") as f:
        return int(f.read() or 0)


def load() -> None:
    """What every copy needs, loaded once: torch, toyllm's framework and answer marks; then frozen."""
    import torch  # noqa: F401  (what every sandbox needs, and what takes the time)
    from toyllm import answers
    from toyllm.grading.sandbox.server import FRAMEWORK_MODULES

    for name in FRAMEWORK_MODULES:
        importlib.import_module(name)
    answers.answer_marks()           # cached for every copy: toyllm's source, read once
    gc.freeze()                      # what is loaded stays: the copies' collections skip it


def serve(control: socket.socket) -> None:
    """Say ready, then fork a copy for each request on ``control`` until it closes."""
    control.send(json.dumps({"ready": True}).encode())
    while True:
        try:
            message, fds, _, _ = socket.recv_fds(control, 1 << 20, 2)
        except OSError:
            return
        if not message:                               # the grader closed its end
            return
        try:
            request = json.loads(message)
            wanted = ROLES.get(request.get("role", "sandbox"))
            if wanted is None:
                raise ValueError(f"unknown role {request.get('role')!r}")
            if len(fds) != wanted:
                raise ValueError(f"expected {wanted} descriptor(s), got {len(fds)}")
            reply = {"pid": _fork(request, fds, control)}
        except Exception as e:
            reply = {"error": f"{type(e).__name__}: {e}"}
        finally:
            for fd in fds:
                os.close(fd)
        control.send(json.dumps(reply).encode())


def main() -> None:
    control = socket.socket(fileno=int(sys.argv[1]))
    load()
    serve(control)


if __name__ == "__main__":
    main()
