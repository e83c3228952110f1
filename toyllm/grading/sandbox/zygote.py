"""Starts sandbox processes by forking one that has imported torch already, so each starts in milliseconds.

Every exercise gets a fresh sandbox (``process``), and a fresh Python
spends about 1.5 CPU-seconds importing torch: six exercises of a lesson
paid that six times. This process (the zygote) imports torch once and
then, for each sandbox, forks a copy that runs ``launcher`` exactly as
the script would (namespaces, private view, sandbox user), except that
its last step calls ``server.serve`` in the same process instead of
starting Python again.

Run as a script (``python zygote.py CONTROL_FD``) by ``process.Zygote``,
with the grader's rights and the sandbox's base environment. It imports
the standard library, torch and ``toyllm.answers``, whose marks it reads
from toyllm's own source (every sandbox needs them, and parsing every
file took about 0.2 CPU-seconds a sandbox); no test and no answer, so a
copy holds nothing a fresh Python would not. It then freezes what it
imported for the garbage collector (``gc.freeze``): a copy's collections
skip torch's objects instead of walking them, and writing to every page
that holds one (about 0.3 CPU-seconds a sandbox). Requests come on the
control socket (a ``SOCK_SEQPACKET`` pair, one message each): a JSON
object with the launcher's arguments, the environment, the working folder
and the grader's pid, and two descriptors (the sandbox's socket and the
file for its output). The reply is ``{"pid": N}``.

Each sandbox is a grandchild: the child in between exits at once, so the
sandbox is re-parented to the grader's test process (a child subreaper),
which waits for it, reads its exit status and ends it, as it would a
process it had started itself. The copy closes the control socket before
anything else, so no sandbox can ask for another.
"""
from __future__ import annotations

import gc
import json
import os
import random
import socket
import sys
import time
import types

try:
    from . import launcher                        # imported as part of toyllm (a test, a tool)
except ImportError:
    import launcher                               # run as a script: its folder is on sys.path; stdlib only

SANDBOX_FD = 3                   # where the copy keeps the sandbox's socket (0-2: nothing in, output out)


def _become_sandbox(request: dict, sandbox_fd: int, output_fd: int) -> None:
    """In the copy: the state ``subprocess.Popen`` gives the launcher script, then the launcher itself."""
    os.setsid()                                        # its own session and process group, as start_new_session
    parent = int(request["parent"])
    deadline = time.monotonic() + 10
    while os.getppid() != parent:                      # the child in between is exiting: wait to be re-parented
        if time.monotonic() > deadline:
            os._exit(1)
        time.sleep(0.001)
    launcher.libc().prctl(launcher._PR_SET_PDEATHSIG, 9, 0, 0, 0)   # the grader's test process died: so do we
    if os.getppid() != parent:
        os._exit(1)
    # Descriptors: high numbers first, so no dup2 overwrites one still needed.
    high = [os.dup(fd) for fd in (sandbox_fd, output_fd)]
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(high[1], 1)
    os.dup2(high[1], 2)
    os.dup2(high[0], SANDBOX_FD, inheritable=True)
    os.closerange(SANDBOX_FD + 1, os.sysconf("SC_OPEN_MAX"))
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    random.seed()                                     # a fresh Python seeds from the system; so does each copy
    # As ``python -c``, which the launcher used to start: '' first on the path, and a ``__main__`` with no
    # file, so that workers started with multiprocessing's "spawn" do not run this script again.
    sys.path[0] = ""
    main_module = types.ModuleType("__main__")
    main_module.__spec__ = None
    sys.modules["__main__"] = main_module
    sys.argv = ["launcher.py", str(SANDBOX_FD), *request["argv"]]    # the launcher reads them, as the script does
    sys.argv = ["-c", *launcher.main(in_process=True)]              # now the sandbox user, in its namespaces
    from toyllm.grading.sandbox.server import serve

    serve()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _fork_sandbox(request: dict, fds: list[int], control: socket.socket) -> int:
    """Fork the copy that becomes the sandbox (a grandchild); its pid."""
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
                    _become_sandbox(request, *fds)
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


def main() -> None:
    control = socket.socket(fileno=int(sys.argv[1]))
    import torch  # noqa: F401  (what every sandbox needs, and what takes the time)
    from toyllm import answers

    answers.answer_marks()           # cached for every copy: toyllm's source, read once
    gc.freeze()                      # what is imported stays: the copies' collections skip it
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
            if len(fds) != 2:
                raise ValueError(f"expected 2 descriptors, got {len(fds)}")
            reply = {"pid": _fork_sandbox(request, fds, control)}
        except Exception as e:
            reply = {"error": f"{type(e).__name__}: {e}"}
        finally:
            for fd in fds:
                os.close(fd)
        control.send(json.dumps(reply).encode())


if __name__ == "__main__":
    main()
