"""The sandbox process: imports the submission and runs its functions for the grader.

Started by ``toyllm.grading.sandbox.process`` with one end of a socket pair as file
descriptor ``argv[1]``; the submission's files are in ``$TOYLLM_IMPL``. It
answers one request at a time:

- ``prepare`` (first, once): write the submission's files it is handed
  into its scratch folder. From then on toyllm's marked functions run the
  submission's own exercises (``answers.run_submission``): the sandbox
  holds no model answer. A sandbox can so be started ahead, before anyone
  knows which exercise it will serve;
- ``load``: import an exercise module; reply with its function names;
- ``call``: run a submitted function (``("exercise", module, name)``) or a
  trusted harness function (``("harness", "pkg.module:function")``) under
  the grading rules of the current exercise; reply with the value, or the
  error (type, message, the submission's last line), plus any violation of
  the independence rule, or any change the submission made to toyllm's own
  code (``guard.tampered``; recorded before the first submitted line runs).

While a call runs, the sandbox may ask the grader for the value of a
grading cost the call was given (``harness.Counted``, which crossed as
``("callback", number)``): it sends ``{"callback": number, "arg": the
argument}`` and waits for ``{"ok": True, "value": v}`` or the error to
raise, before the call's own reply. The cost, with its expected answer,
stays in the grader, which counts every evaluation; the sandbox only holds
a stub (``_TrustedCost``) that is dead once its call is over.

Nothing here is trusted by the grader: every reply is read with
``wire.from_sandbox``, which only rebuilds plain data.
"""
from __future__ import annotations

import builtins
import functools
import importlib
import itertools
import os
import socket
import sys
import threading
import traceback

from ... import supervise
from ...supervise import die_with_parent, name_process

NAME = "toyllm-sandbox"        # what ps shows for a sandbox, whether a fresh Python or a zygote's copy


def _error(exc: BaseException, files) -> dict:
    builtin = next((c.__name__ for c in type(exc).__mro__ if getattr(builtins, c.__name__, None) is c), "Exception")
    where = ""
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        if frame.filename in files:
            where = f"{os.path.basename(frame.filename)}, line {frame.lineno}, in {frame.name}: {frame.line}"
            break
    try:
        message = str(exc)
        if len(message) > 20_000:           # an engine failure carries its ranks' tracebacks: keep both ends
            message = message[:10_000] + "\n...\n" + message[-10_000:]
    except Exception:
        message = "?"
    return {"type": type(exc).__name__, "builtin": builtin, "message": message, "where": where}


class _TrustedCost:
    """What a submitted search holds for the grader's cost (``harness.Counted``): each call asks the grader."""

    __slots__ = ("_ask",)

    def __init__(self, ask):
        self._ask = ask

    def __call__(self, x):
        return self._ask(x)

    def __reduce__(self):
        raise TypeError("the grader's cost function cannot be sent to another process: call it here")

    def __repr__(self) -> str:
        return "<the grader's cost function>"


def _raise_answer(answer: dict):
    """Raise the error the grader's cost gave, as the built-in exception it was (else RuntimeError)."""
    cls = getattr(builtins, str(answer.get("type")), None)
    if not (isinstance(cls, type) and issubclass(cls, Exception)):
        cls = RuntimeError
    raise cls(str(answer.get("message", "")))


# What the harness runs: imported before any submitted code, so their state is the framework's own.
FRAMEWORK_MODULES = ("toyllm.grading.sandbox.harness", "toyllm.launch", "toyllm.parallel", "toyllm.simulate",
                     "toyllm.partition", "toyllm.partition_table", "toyllm.generation", "toyllm.analysis",
                     "toyllm.attention", "toyllm.model", "toyllm.cache", "toyllm.answers")


def main(fd: int | socket.socket) -> None:
    import torch

    from toyllm import answers

    from . import guard, wire
    from .harness import cost_argument
    from ...course import exercise_file, lesson_module, load_exercise, resolve_impl

    for name in FRAMEWORK_MODULES:
        importlib.import_module(name)
    framework = guard.framework_state()

    torch.set_grad_enabled(False)           # as in the grader's own tests
    torch.set_num_threads(1)
    sock = fd if isinstance(fd, socket.socket) else socket.socket(fileno=fd)
    modules: dict[str, object] = {}          # "ex01" -> the submission's module

    def submission_files():
        return {m.__file__ for m in modules.values()}

    serials = itertools.count()
    serving = {"call": None}            # the number of the request being served: a cost stub works only during it
    channel = threading.Lock()          # one frame at a time on the socket, whichever thread asks

    def ask(call: int, number: int, x):
        if serving["call"] != call:
            raise RuntimeError("the grader's cost function is only valid during the call it was given to")
        x = cost_argument(x)
        with channel:
            wire.send(sock, wire.to_grader({"callback": number, "arg": x}))
            answer = wire.from_grader(wire.recv(sock), resolve)
        if not answer.get("ok"):
            _raise_answer(answer)
        return answer["value"]

    def resolve(ref):
        if len(ref) == 2 and ref[0] == "callback" and type(ref[1]) is int:
            return _TrustedCost(functools.partial(ask, serving["call"], ref[1]))
        kind, module, name = ref
        if kind != "exercise" or module not in modules:
            raise ValueError(f"unknown function reference {ref!r}")
        return getattr(modules[module], name)

    while True:
        serving["call"] = next(serials)
        try:
            request = wire.from_grader(wire.recv(sock), resolve)
        except ConnectionError:
            return
        reply: dict
        try:
            if request["op"] == "prepare":
                for relative, text in request["files"].items():
                    folder, _, name = relative.partition("/")
                    if folder != "submission" or not name or "/" in name or name.startswith("."):
                        raise ValueError(f"prepare: unexpected file {relative!r}")
                    os.makedirs(folder, exist_ok=True)
                    with open(os.path.join(folder, name), "w") as f:
                        f.write(text)
                answers.run_submission()
                reply = {"ok": True, "value": None}
            elif request["op"] == "load":
                name = request["module"]
                path = exercise_file(resolve_impl(), name)
                module = load_exercise(name)
                modules[name] = module
                functions = sorted(k for k, v in vars(module).items()
                                   if callable(v) and not k.startswith("_") and getattr(v, "__module__", None) == module.__name__)
                reply = {"ok": True, "value": {"functions": functions, "file": path.name}}
            elif request["op"] == "call":
                kind, *where = request["target"]
                exercise = request.get("exercise")
                # the submission's own functions of the lesson's other exercises note that they ran
                swaps = guard.recording_neighbours(exercise, modules.get(lesson_module(exercise)) if exercise else None)
                if kind == "exercise":
                    module_name, fn_name = where
                    fn = getattr(modules[module_name], fn_name)
                else:
                    module_name, _, fn_name = where[0].partition(":")
                    if not module_name.startswith("toyllm."):
                        raise ValueError(f"harness functions live in toyllm, got {where[0]!r}")
                    fn = getattr(importlib.import_module(module_name), fn_name)
                changed = guard.tampered(framework)
                if changed:
                    reply = {"ok": False, "error": _error(RuntimeError("toyllm was changed"), ())}
                    violations = [guard.tampering_message(request.get("exercise"), changed)]
                else:
                    forbidden = request.get("forbidden", ())
                    with guard.rules(exercise, forbidden, submission_files(), swaps) as violations:
                        try:
                            value = fn(*request["args"], **request["kwargs"])
                            reply = {"ok": True, "value": value}
                        except BaseException as e:        # SystemExit included: it is the submission's answer
                            reply = {"ok": False, "error": _error(e, submission_files())}
                    changed = guard.tampered(framework)
                    if changed:
                        violations.append(guard.tampering_message(request.get("exercise"), changed))
                reply["violations"] = list(violations)
            else:
                raise ValueError(f"unknown request {request.get('op')!r}")
        except BaseException as e:
            reply = {"ok": False, "error": _error(e, submission_files())}
        try:
            payload = wire.to_grader(reply)
        except Exception as e:
            payload = wire.to_grader({"ok": False, "error": _error(e, ())})
        sys.stdout.flush()
        sys.stderr.flush()
        with channel:
            serving["call"] = None
            wire.send(sock, payload)


def serve() -> None:
    """The sandbox process once it runs as the sandbox user (see ``launcher``): limits first, then serve.

    FD: the socket to the grader, a descriptor number, or on Windows ``tcp:PORT:TOKEN`` (connect to
    127.0.0.1:PORT and send TOKEN: ``process.Sandbox._launch_over_tcp``)."""
    fd, _, parent_pid, limits = sys.argv[1:5]        # argv[2]: the launcher's REFERENCE, no longer used
    memory_mb, cpu_s, file_bytes, nproc = (int(x) for x in limits.split(","))
    die_with_parent()                                               # the grader's test process died: so do we
    name_process(NAME)
    if os.getppid() != int(parent_pid):
        os._exit(1)
    set_limits(memory_mb, cpu_s, file_bytes, nproc)
    if fd.startswith("tcp:"):
        _, port, token = fd.split(":")
        sock = socket.create_connection(("127.0.0.1", int(port)))
        sock.sendall(token.encode())
        main(sock)
    else:
        main(int(fd))


def set_limits(memory_mb: int, cpu_s: int, file_bytes: int, nproc: int) -> None:
    """The sandbox's resource limits. On Linux every one is set or the sandbox does not start; elsewhere one
    the system refuses (macOS: the address space) or lacks (Windows: all, no ``resource`` module) is skipped,
    with one line on stderr saying so."""
    try:
        import resource
    except ImportError:
        if supervise.linux():
            raise
        print("toyllm sandbox: this system has no resource limits (no 'resource' module): the submission runs "
              "without memory, CPU-time, file-size and process limits", file=sys.stderr, flush=True)
        return
    wanted = [("RLIMIT_AS", (memory_mb * 2**20,) * 2, "memory"), ("RLIMIT_CPU", (cpu_s, cpu_s + 5), "CPU-time"),
              ("RLIMIT_FSIZE", (file_bytes,) * 2, "file-size"), ("RLIMIT_CORE", (0, 0), "core-file")]
    if nproc:
        wanted.append(("RLIMIT_NPROC", (nproc, nproc), "process"))
    skipped = []
    for name, limits, what in wanted:
        try:
            resource.setrlimit(getattr(resource, name), limits)
        except (ValueError, OSError, AttributeError) as e:
            if supervise.linux():              # there every limit is part of the sandbox: never without it
                raise
            skipped.append(f"{what} ({name}: {e})")
    if skipped:
        print(f"toyllm sandbox: this system refused some limits, skipped: {', '.join(skipped)}",
              file=sys.stderr, flush=True)
