"""The rules a submitted function runs under while it is graded.

1. **Independence.** toyllm marks its own implementations of what each
   exercise asks for (``@answer`` and ``@shortcut`` in ``toyllm.answers``).
   While a test of Exercise 2.1 calls the submission, each function marked
   for 2.1 is guarded: a call that comes from the submission (its file is on the
   call stack, or the direct caller is not toyllm/torch/standard-library
   code, such as ``exec``'d text) raises ``IndependenceError`` and is
   recorded, and the whole exercise scores zero. The guard replaces the
   function's code object in place, so every alias (``from toyllm import
   generate``, a reference stored in a list) is guarded too. The library
   itself keeps working: toyllm code calling the function from toyllm code
   is allowed. A class is guarded through its ``__init__``.

2. **One exercise at a time.** While a test of Exercise 3.5 runs, the
   submission's functions of the other exercises of the same lesson that
   3.5's model answer calls (``exercises_called``) are swapped for their
   model answers, so a mistake in 3.3 costs only 3.3's points even when 3.5
   calls it. The others stay the submission's own: 1.1 calling the
   submission's 1.2 gets the student's 1.2, never a model answer.

3. **Hands off the framework.** ``framework_state()`` records every
   function, class and module that toyllm's imported modules bind (and the
   code object of each function) before the submission is imported;
   ``tampered(state)`` names what has changed since. The sandbox and the
   engine's workers check it around every call, so a submission that
   patches the harness, the engine or the guard itself scores zero
   instead of steering what judges it.
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import sys
import sysconfig
import threading
import types
from pathlib import Path

from ...stubs import exercise_functions, model_answer_source


class IndependenceError(Exception):
    """The submission called toyllm's own implementation of the exercise it is graded on."""


def framework_state() -> dict[str, tuple]:
    """{"toyllm.module:name" or "...:Class.attr": (object, its code object or None)} for toyllm's imported modules."""
    state: dict[str, tuple] = {}
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "toyllm" or name.startswith("toyllm.")):
            continue
        for attr, value in list(vars(module).items()):
            if attr == _GUARD_NAME or not (callable(value) or isinstance(value, types.ModuleType)):
                continue
            state[f"{name}:{attr}"] = (value, getattr(value, "__code__", None))
            if isinstance(value, type) and value.__module__ == name:
                for key, member in list(vars(value).items()):
                    member = getattr(member, "__func__", member)
                    if isinstance(member, types.FunctionType):
                        state[f"{name}:{attr}.{key}"] = (member, member.__code__)
    return state


def tampered(state: dict[str, tuple]) -> list[str]:
    """What of ``state`` (``framework_state()``) has been rebound or has had its code replaced since."""
    now = framework_state()
    changed = []
    for key, (value, code) in state.items():
        current = now.get(key)
        if current is None or current[0] is not value or (code is not None and value.__code__ is not code):
            changed.append(key.replace(":", "."))
    return sorted(changed)


def tampering_message(exercise: str | None, changed: list[str]) -> str:
    shown = ", ".join(changed[:3]) + (f" and {len(changed) - 3} more" if len(changed) > 3 else "")
    return (f"Exercise {exercise or '?'}: the submission changed toyllm's own code ({shown}), which runs and "
            f"checks the graded calls: this exercise scores 0")


def exercises_called(reference_source: str, exercise: str) -> set[str]:
    """The lesson's other exercises whose model answers Exercise ``exercise``'s model answer runs: those whose
    functions are named inside its function, or inside any function of the file that one names, and so on.

    3.5's ``batch / min_step_time_s(...)`` gives {"3.3"}; 1.1's ``argmax`` gives nothing, though 1.2's sampler
    would answer it too.
    """
    import ast

    tree = ast.parse(reference_source)
    names_in = {node.name: {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
                for node in tree.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
    owners = exercise_functions(reference_source)
    reached, todo = set(), list(owners.get(exercise, ()))
    while todo:
        name = todo.pop()
        if name not in reached:
            reached.add(name)
            todo += [n for n in names_in.get(name, ()) if n in names_in]
    return {other for other, names in owners.items() if other != exercise and reached & set(names)}


# --------------------------------------------------------------------------- independence

_TRUSTED_DIRS = tuple({str(Path(p).resolve()) + os.sep for p in (
    Path(__file__).resolve().parents[2],                          # toyllm
    Path(importlib.util.find_spec("torch").origin).resolve().parent,     # found, not imported
    sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["platstdlib"])})

_state = threading.local()
_installed: dict[str, tuple[types.FunctionType, types.CodeType, types.FunctionType]] = {}
_GUARD_NAME = "__toyllm_guard__"


def _target(spec: str):
    """The function object ``"pkg.module:name"`` (or ``name.attr``) names; a class gives its ``__init__``."""
    module_name, _, attr = spec.partition(":")
    if not attr:
        raise ValueError(f"a forbidden function looks like 'package.module:function', got {spec!r}")
    obj = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    if isinstance(obj, type):
        obj = obj.__init__
    obj = getattr(obj, "__func__", obj)
    while isinstance(getattr(obj, "__wrapped__", None), types.FunctionType):    # @torch.no_grad() and friends
        obj = obj.__wrapped__
    if not isinstance(obj, types.FunctionType):
        raise ValueError(f"forbidden {spec!r} is not a Python function or class")
    return obj


def _install(spec: str) -> None:
    if spec in _installed:
        return
    fn = _target(spec)
    if fn.__closure__:
        raise ValueError(f"forbidden {spec!r} is a closure; list the module-level function instead")
    original_code = fn.__code__
    real = types.FunctionType(original_code, fn.__globals__, fn.__name__, fn.__defaults__)
    real.__kwdefaults__ = fn.__kwdefaults__
    fn.__globals__.setdefault(_GUARD_NAME, _check)
    # A code object with no free variables, so it can replace any module-level function's code.
    stub = compile(f"lambda *args, **kwargs: {_GUARD_NAME}({spec!r}, args, kwargs)", "<toyllm guard>", "eval")
    fn.__code__ = eval(stub, {}).__code__
    _installed[spec] = (fn, original_code, real)


def current() -> tuple[str | None, tuple[str, ...], tuple[str, ...]]:
    """(exercise, forbidden specs, submission files) of the rules in force on this thread (None, (), ())."""
    return (getattr(_state, "exercise", None) if getattr(_state, "active", None) is not None else None,
            tuple(sorted(getattr(_state, "active", None) or ())), tuple(sorted(getattr(_state, "files", ()))))


def _uninstall_all() -> None:
    for fn, code, _ in _installed.values():
        fn.__code__ = code
    _installed.clear()


def _from_submission(frame) -> bool:
    """True when the guarded function was called by the submission, directly or through any helper."""
    caller = frame.f_back.f_back              # frame: _check; f_back: the guard's lambda; then its caller
    if caller is not None and not caller.f_code.co_filename.startswith(_TRUSTED_DIRS):
        return True
    files = getattr(_state, "files", ())
    f = caller
    while f is not None:
        if f.f_code.co_filename in files:
            return True
        f = f.f_back
    return False


def _check(spec, args, kwargs):
    active = getattr(_state, "active", None)
    if active and spec in active and _from_submission(sys._getframe()):
        exercise = _state.exercise
        message = (f"Exercise {exercise} must be your own code, but it called {spec.replace(':', '.')}, "
                   f"toyllm's own implementation of what the exercise asks for: this exercise scores 0")
        _state.violations.append(message)
        raise IndependenceError(message)
    return _installed[spec][2](*args, **kwargs)


@contextlib.contextmanager
def rules(exercise: str | None, forbidden=(), submission_files=(), swaps=()):
    """Apply the grading rules for one call of submitted code; yields the list of violations it records.

    forbidden: "module:function" specs guarded for this exercise.
    submission_files: the files of the submission (their frames count as the submission's).
    swaps: (module, name, replacement) to set for the call and undo afterwards.
    """
    saved = []
    for module, name, replacement in swaps:
        saved.append((module, name, module.__dict__.get(name, _MISSING)))
        setattr(module, name, replacement)
    violations: list[str] = []
    try:
        for spec in forbidden:
            _install(spec)
        _state.active, _state.exercise, _state.violations = set(forbidden), exercise, violations
        _state.files = frozenset(str(f) for f in submission_files)
        yield violations
    finally:
        _state.active, _state.files = None, ()
        _uninstall_all()
        for module, name, value in reversed(saved):
            if value is _MISSING:
                module.__dict__.pop(name, None)
            else:
                setattr(module, name, value)


_MISSING = object()


def recording_neighbours(exercise: str | None, module: types.ModuleType | None) -> list[tuple]:
    """(module, name, recorder) for the submission's own functions of its lesson's other marked exercises (3.5's
    module holds 3.3's ``min_step_time_s``), as ``rules`` swaps: a call records that exercise in
    ``toyllm.answers.ran``, as toyllm's own marked functions do, so that a test that failed through it names it
    (``toyllm.grading.expect.neighbours_note``). The call itself runs the submission's function unchanged."""
    from toyllm import answers

    if exercise is None or module is None:
        return []
    lesson = answers.lesson_module(exercise)
    out = []
    for number, mark in answers.answer_marks().items():
        fn = module.__dict__.get(mark.function)
        if number != exercise and answers.lesson_module(number) == lesson and callable(fn):
            out.append((module, mark.function, _recorder(number, fn)))
    return out


def _recorder(number: str, fn):
    def recorded(*args, **kwargs):
        from toyllm import answers

        answers.ran.add(number)
        return fn(*args, **kwargs)
    recorded.__name__, recorded.__qualname__, recorded.__wrapped__ = fn.__name__, fn.__qualname__, fn
    return recorded


def swaps_for(exercise: str | None, submission: types.ModuleType, reference: types.ModuleType | None,
              called: str, neighbours: set[str] | None = None) -> list[tuple]:
    """(module, name, model answer) for every function of the lesson's other exercises that ``exercise``'s own
    model answer runs: 3.5 calling the submission's 3.3 gets the model answer, 1.1 calling the submission's 1.2
    gets the submission's own. neighbours: those exercises, where ``reference`` no longer shows them (the
    sandbox's copy, with ``exercise`` stubbed); by default ``exercises_called`` reads them from it."""
    if exercise is None or reference is None:
        return []
    source = model_answer_source(reference)
    if neighbours is None:
        neighbours = exercises_called(source, exercise)
    out = []
    for other, names in exercise_functions(source).items():
        if other not in neighbours:
            continue
        for name in names:
            if name != called and hasattr(reference, name) and name in submission.__dict__:
                out.append((submission, name, getattr(reference, name)))
    return out
