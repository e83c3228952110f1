"""Where the framework meets the exercises: every library function that is an exercise's answer is marked here.

Students extend a real framework, as in minitorch: when lesson 05 runs a
KV-Runahead prefill, the per-layer step that runs is Exercise 5.2. Such a
function is marked where it is written and hands the work to the exercise::

    @answer("5.2", "KV-Runahead")
    def kvr_layer(layer, x, pos, chain, attention):
        return exercise("5.2")(layer, x, pos, chain, attention)

Its code is written once, as the model answer in ``solutions/`` (the
instructor edition runs that) or as the student's own in ``exercises/`` (the
student edition runs that, ``EDITION = "student"``). A library function that
would do an exercise's work another way (PyTorch's fused attention for
Exercise 2.1, ``generate`` for the generation loops) is marked
``@shortcut("2.1")``. Library code must never read like an answer: where
a variant of an exercise is needed (the zigzag TSP step), it is built on
the marked answer rather than written out again.

Everything that needs the list of answers reads these marks:

- the grader forbids a submission to call the marked functions of the
  exercise it is graded on (``forbidden``);
- the student edition is built without the answers' text (``toyllm.grading.edition``);
- a command that needs an exercise checks it first (``require``) and stops
  with one line naming the exercise and the file to edit.

The marks are read from the source (``scan``), so the list is known without
importing the modules it names.
"""
from __future__ import annotations

import ast
import functools
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

from .course import (ANSWERS_ENV, COURSE_ENV, IMPL_ENV, SANDBOX_ENV,  # noqa: F401
                     file_stamp, lesson_module, load_exercise, refuse_in_library_test, resolve_impl, solutions_dir)
from .stubs import stub_exercises

# Which implementation the marked functions call: "instructor" runs the model answers of solutions/,
# "student" the implementation being run, the student's exercises/ (the student edition's builder rewrites
# this line; the grader's sandbox switches to it in either edition, ``run_submission``).
EDITION = "instructor"

PACKAGE_DIR = Path(__file__).resolve().parent
_NUMBER = re.compile(r"\d+\.\d+")


class ExerciseNotWritten(NotImplementedError):
    """Something needs an exercise that is still a stub; the message names the exercise and the file."""


@dataclass(frozen=True)
class Mark:
    """One marked library function: ``spec`` is "toyllm.module:qualname"."""

    kind: str                  # "answer" or "shortcut"
    exercises: tuple[str, ...]
    spec: str
    feature: str = ""          # what needs it, in words ("KV-Runahead"): answers only
    function: str = ""         # the exercise's function name: answers only
    student: str = ""          # shortcuts only: what the student edition's body calls instead (see ``shortcut``)
    ships: str = ""            # shortcuts only: why the body ships in the student edition as it is
    path: Path | None = None
    lines: tuple[int, int] = (0, 0)    # first and last line of the definition, decorators included


# --------------------------------------------------------------------------- the marks

_ANSWERS: dict[str, tuple[str, str]] = {}     # "5.2" -> ("KV-Runahead", "kvr_layer"), filled as modules import


def _check_numbers(numbers) -> tuple[str, ...]:
    for n in numbers:
        if not (isinstance(n, str) and _NUMBER.fullmatch(n)):
            raise ValueError(f"an exercise number looks like '5.2', got {n!r}")
    return tuple(numbers)


def answer(number: str, feature: str, function: str | None = None, also: tuple[str, ...] = ()):
    """Mark the function as the library's entry to Exercise ``number``; its body calls ``exercise(number)``.

    feature: what the exercise makes work, in words (for "X needs Exercise N.M").
    function: the exercise's function name, when it differs from the library's.
    also: other exercises whose graded runs must not call this function.
    """
    _check_numbers((number, *also))

    def mark(fn):
        _ANSWERS[number] = (feature, function or fn.__name__)
        fn.exercise = number
        return fn
    return mark


def shortcut(*numbers: str, student: str | None = None, ships: str | None = None):
    """Mark a library function that does the work of these exercises another way (forbidden while grading them).

    Every shortcut says what the student edition holds in its place, one of:

    student: where the function holds an exercise's algorithm, the name of a
        function beside it, with the same parameters, that gets the result
        from the exercise (``exercise("6.2")(...)``) instead; the edition's
        builder makes the marked function's body one call of it, so the
        edition holds no copy of the algorithm and the library runs the
        student's code.
    ships: why the body may ship as it is, in words a reviewer can check:
        it calls the exercise's own entry (so the edition runs the student's
        answer there), or it is a formula the lesson's text states before
        the exercise, or it does the work a way the exercise does not teach
        (PyTorch's fused kernel, the engine's batched loop). The edition's
        answer check still holds every shipped body to the rule that no
        statement of a model answer appears in it.
    """
    _check_numbers(numbers)
    if (student is None) == (ships is None):
        raise ValueError(f"a shortcut for {', '.join(numbers)} names either student= (the edition calls the "
                         f"exercise) or ships= (why the body may ship), not {'both' if student else 'neither'}")

    def mark(fn):
        if student is None:
            return fn

        # The student edition's body of this function runs the exercise: a test of the library alone must not
        # reach it (``toyllm.course.refuse_in_library_test``).
        @functools.wraps(fn)
        def library_function(*args, **kwargs):
            refuse_in_library_test(f"{fn.__qualname__}, whose body in the student edition runs Exercise "
                                   f"{', '.join(numbers)}")
            return fn(*args, **kwargs)
        return library_function
    return mark


# The variables that decide which file answers an exercise (toyllm.course reads them).
_CHOICE_ENV = (IMPL_ENV, ANSWERS_ENV, COURSE_ENV, SANDBOX_ENV)
_found: dict[tuple, list] = {}     # choice -> [file, its stamp, the function, time.monotonic() of the last check]
# Seconds a found function is trusted before its file's stamp is read again. A stat is a system call
# (microseconds on a VM), and the dense kernel asks for Exercise 2.1 on every layer of every decode
# step; an edit to the file still takes effect within this long.
RECHECK_S = 0.1


# Every exercise ``exercise`` handed work to (found written) since this set was last cleared: a graded test that
# fails under the grader, or in the student edition, names those of them that fail their own tests
# (``toyllm.grading.expect.neighbours_note``). An unwritten one is not here: its error names it, or a stand-in
# that is no answer ran in its place (PyTorch's fused kernel for 2.1).
ran: set[str] = set()


def exercise(number: str):
    """The function that is Exercise ``number`` in the edition's implementation (model answers, or the student's).

    Raises ``ExerciseNotWritten`` while the student's function is still the stub.
    The paged cache asks for its steps hundreds of times per forward, so a
    function found once is kept while its file is unchanged: the file's
    stamp (one ``stat``) is read again at most every ``RECHECK_S`` seconds.
    """
    refuse_in_library_test(f"Exercise {number}")
    choice = (number, EDITION, os.getcwd(), *(os.environ.get(name) for name in _CHOICE_ENV))
    known = _found.get(choice)
    if known is not None:
        path, stamp, fn, checked = known
        now = time.monotonic()
        if now - checked < RECHECK_S:
            ran.add(number)
            return fn
        try:
            same = file_stamp(path) == stamp
        except OSError:
            same = False
        if same:
            known[3] = now
            ran.add(number)
            return fn
    module, fn = _find(number)
    path = getattr(module, "__file__", None)           # None: the grader's proxy, asked every time
    if path is not None:
        _found[choice] = [path, file_stamp(path), fn, time.monotonic()]
    ran.add(number)
    return fn


def _find(number: str):
    """(the module, the function) of Exercise ``number``, checked to be written."""
    feature, name = _entry(number)
    lesson = lesson_module(number)
    impl = _solutions_dir() if EDITION == "instructor" else None
    folder = resolve_impl(impl)
    if not any(folder.glob(f"{lesson}_*.py")):       # a submission without this lesson's file
        raise ExerciseNotWritten(f"{feature} needs Exercise {number}: write {name} in {lesson}_*.py "
                                 f"(there is no such file in {folder.name}/)")
    module = load_exercise(lesson, impl=impl)
    if _is_stub(module, number) or not callable(getattr(module, name, None)):
        raise ExerciseNotWritten(_not_written(number, feature, name, module))
    return module, getattr(module, name)


def _entry(number: str) -> tuple[str, str]:
    """(feature, function name) of exercise ``number``: from the imported marks, else read from the source."""
    if number not in _ANSWERS:          # its module is not imported yet (a test asked for it first)
        mark = answer_marks().get(number)
        if mark is None:
            raise ValueError(f"no toyllm function is marked @answer({number!r}); marked: {sorted(answer_marks())}")
        _ANSWERS[number] = (mark.feature, mark.function)
    return _ANSWERS[number]


def _solutions_dir() -> Path:
    """$TOYLLM_ANSWERS, else solutions/ beside the package (an editable install in the checkout), else the course
    found from here."""
    if os.environ.get(ANSWERS_ENV):
        return Path(os.environ[ANSWERS_ENV])
    beside = PACKAGE_DIR.parent / "solutions"
    if beside.is_dir():
        return beside
    return solutions_dir()


def _is_stub(module, number: str) -> bool:
    """True while ``module``'s file still raises the stub of exercise ``number``."""
    path = getattr(module, "__file__", None)
    if path is None:                 # a proxy of the grader's sandbox: the student's code answers for itself
        return False
    return number in _stubs_in(path, *file_stamp(path))


@functools.lru_cache(maxsize=64)
def _stubs_in(path: str, mtime_ns: int, size: int) -> frozenset[str]:
    """The exercises still stubbed in a file, read once per version of it (the engine asks once per layer)."""
    return frozenset(stub_exercises(Path(path).read_text()))


def _not_written(number: str, feature: str, name: str, module) -> str:
    path = Path(getattr(module, "__file__", "exercises"))
    shown = f"{path.parent.name}/{path.name}"
    return f"{feature} needs Exercise {number}: write {name} in {shown}"


# --------------------------------------------------------------------------- the grader's sandbox

def run_submission() -> None:
    """From now on the marked functions call the implementation being run (``$TOYLLM_IMPL``), in either edition.

    The grader's sandbox calls it before any submitted code runs, and so does
    every engine worker it starts: there a graded test that runs the
    framework through another exercise (the paged cache's 8.2 in a test of
    8.1, the ring's merge 9.1 in a test of 9.3) runs the submission's own
    answer to it, as in the student edition, and no model answer is in the
    process at all, as text or as code. Where that answer is unwritten, a
    stand-in that is no answer runs if the library has one (PyTorch's fused
    kernel for 2.1); otherwise ``ExerciseNotWritten`` names the exercise.
    """
    global EDITION
    EDITION = "student"
    _found.clear()


def written(number: str) -> bool:
    """Whether Exercise ``number`` (a marked answer) is written in the edition's implementation."""
    try:
        exercise(number)
    except ExerciseNotWritten:
        return False
    return True


def require(*numbers: str) -> None:
    """Stop at once, with one line per missing exercise, unless every one of ``numbers`` is written."""
    missing = []
    for number in numbers:
        try:
            exercise(number)
        except ExerciseNotWritten as e:
            missing.append(str(e))
    if missing:
        raise ExerciseNotWritten("; ".join(missing))


# --------------------------------------------------------------------------- reading the marks from the source

def scan(package_dir: Path = PACKAGE_DIR, package: str = "toyllm") -> list[Mark]:
    """Every ``@answer``/``@shortcut`` mark in the package's source, in file order."""
    marks = []
    for path in sorted(package_dir.rglob("*.py")):
        module = ".".join((package, *path.relative_to(package_dir).with_suffix("").parts))
        module = module.removesuffix(".__init__")
        tree = ast.parse(path.read_text(), filename=str(path))
        marks += _marks_in(tree.body, module, "", path)
    return marks


def _marks_in(body, module: str, prefix: str, path: Path) -> list[Mark]:
    out = []
    for node in body:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        qualname = prefix + node.name
        first = min([d.lineno for d in node.decorator_list] + [node.lineno])
        for deco in node.decorator_list:
            if not (isinstance(deco, ast.Call) and isinstance(deco.func, ast.Name)
                    and deco.func.id in ("answer", "shortcut")):
                continue
            args = [ast.literal_eval(a) for a in deco.args]
            kw = {k.arg: ast.literal_eval(k.value) for k in deco.keywords}
            common = dict(spec=f"{module}:{qualname}", path=path, lines=(first, node.end_lineno))
            if deco.func.id == "answer":
                number, feature, *rest = args
                function = rest[0] if rest else kw.get("function") or node.name
                out.append(Mark("answer", (number, *kw.get("also", ())), feature=feature, function=function,
                                **common))
            else:
                out.append(Mark("shortcut", tuple(args), student=kw.get("student") or "", ships=kw.get("ships") or "",
                                **common))
        if isinstance(node, ast.ClassDef):
            out += _marks_in(node.body, module, qualname + ".", path)
    return out


@functools.lru_cache(maxsize=1)
def _scan_once() -> tuple[Mark, ...]:
    return tuple(scan())


def forbidden(number: str, marks: list[Mark] | None = None) -> list[str]:
    """The "module:qualname" specs a submission must not call while it is graded on Exercise ``number``."""
    marks = _scan_once() if marks is None else marks
    return sorted({m.spec for m in marks if number in m.exercises})


def answer_marks(marks: list[Mark] | None = None) -> dict[str, Mark]:
    """{"5.2": its answer Mark}: the exercises the framework runs."""
    marks = _scan_once() if marks is None else marks
    return {m.exercises[0]: m for m in marks if m.kind == "answer"}
