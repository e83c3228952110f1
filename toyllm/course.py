"""Where the course lives: the folders of exercises, model answers and graded tests.

The grader needs ``exercises/`` and ``tests/grading/`` of a course
checkout (and ``solutions/`` in the instructor edition; the student edition
has none), wherever toyllm itself is installed. They are found, in this order: the folder named by ``TOYLLM_COURSE_DIR``; the current
directory or the nearest folder above it that holds all three (so a
notebook in ``notebooks/`` finds its course); the folder above the
installed package (an editable install inside the checkout).

It also says which implementation of the exercises runs: ``TOYLLM_IMPL``
is ``exercises`` (the default), ``solutions`` or a folder of ``exNN_*.py``
files (``resolve_impl``), and loads it: ``load_exercise("ex01")`` is THE
way notebooks, graded tests and the framework (``toyllm.answers``) reach
exercise code, so that one switch decides whose code runs.

This is the seam between the framework and the exercises, at the bottom of
the package: it imports nothing of toyllm. The grader, above it, registers
how exercise modules are reached while it grades (``load_remotely_with``).
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Callable

COURSE_ENV = "TOYLLM_COURSE_DIR"
ANSWERS_ENV = "TOYLLM_ANSWERS"     # where the model answers are, if not solutions/ (the grader's sandbox sets it)
# Set (to a file's path) while a test marked ``library`` runs, in its process and every process it starts: any
# exercise reached then is written to that file and raises ``RanAnExercise`` (tests/conftest.py fails the test).
LIBRARY_TEST_ENV = "TOYLLM_LIBRARY_TEST"
_PARTS = ("exercises", "tests/grading")


def _is_course(folder: Path) -> bool:
    return all((folder / part).is_dir() for part in _PARTS)


def course_root() -> Path:
    """The course checkout's top folder; a ValueError says how to point at it when none is found."""
    named = os.environ.get(COURSE_ENV)
    if named:
        folder = Path(named).expanduser().resolve()
        if not _is_course(folder):
            raise ValueError(f"{COURSE_ENV}={named} does not hold {', '.join(p + '/' for p in _PARTS)}")
        return folder
    here = Path.cwd().resolve()
    for folder in (here, *here.parents):
        if _is_course(folder):
            return folder
    beside = Path(__file__).resolve().parents[1]
    if _is_course(beside):
        return beside
    raise ValueError(f"no course folder found from {here}: run from inside a checkout of the course "
                     f"(a folder with {', '.join(p + '/' for p in _PARTS)}) or set {COURSE_ENV} to it")


def exercises_dir() -> Path:
    return course_root() / "exercises"


def solutions_dir() -> Path:
    folder = course_root() / "solutions"
    if not folder.is_dir():
        raise ValueError(f"{folder.parent} has no solutions/: this is the student edition, "
                         "which carries no model answers")
    return folder


def grading_tests_dir() -> Path:
    return course_root() / "tests" / "grading"


IMPL_ENV = "TOYLLM_IMPL"
DEFAULT_IMPL = "exercises"
NAMED_IMPLS = {"exercises": exercises_dir, "solutions": solutions_dir}


def resolve_impl(impl: str | os.PathLike | None = None) -> Path:
    """The folder of implementation ``impl`` (default: ``$TOYLLM_IMPL``, else ``exercises``).

    ``"exercises"`` and ``"solutions"`` name the repository's folders; any
    other value is a path to a folder (relative to the current directory)
    that holds ``exNN_*.py`` files.
    """
    if impl is None:
        impl = os.environ.get(IMPL_ENV) or DEFAULT_IMPL
    impl = str(impl)
    if impl in NAMED_IMPLS:
        folder = NAMED_IMPLS[impl]()
    else:
        folder = Path(impl).expanduser().resolve()
    if not folder.is_dir():
        raise ValueError(f"implementation {impl!r} is not a folder; use 'exercises', 'solutions' or the path "
                         f"of a folder that holds exNN_*.py files (set with {IMPL_ENV} or --impl)")
    return folder


def current_impl() -> str:
    """The implementation ``load_exercise`` uses now: ``exercises``, ``solutions`` or a folder path."""
    return os.environ.get(IMPL_ENV) or DEFAULT_IMPL


def exercise_file(folder: Path, name: str) -> Path:
    """``folder/exNN_*.py`` for ``name`` = "ex01", "ex01_naive_generation" or "1"."""
    stem = name[:-3] if name.endswith(".py") else name
    if stem.isdigit():
        stem = f"ex{int(stem):02d}"
    if not re.fullmatch(r"ex\d\d(_\w+)?", stem):
        raise ValueError(f"exercise module name must look like 'ex01' or 'ex01_naive_generation', got {name!r}")
    exact = folder / f"{stem}.py"
    if exact.is_file():
        return exact
    matches = sorted(folder.glob(f"{stem}_*.py")) if len(stem) == 4 else []
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise ValueError(f"no file for exercise module {name!r} in {folder} (expected {stem}_*.py)")
    raise ValueError(f"exercise module {name!r} is ambiguous in {folder}: {[m.name for m in matches]}")


def lesson_module(number: str) -> str:
    """"5.2" -> "ex05"."""
    return f"ex{int(number.split('.')[0]):02d}"


# --------------------------------------------------------------------------- loading an implementation

SANDBOX_ENV = "TOYLLM_GRADE_SANDBOX"     # "1" in the grader's pytest processes: exercises run in its sandbox
_remote_loader: Callable[[str], ModuleType] | None = None
_loaded: dict[Path, tuple[tuple[int, int], ModuleType]] = {}


def load_remotely_with(loader: Callable[[str], ModuleType]) -> None:
    """While the grader runs (``TOYLLM_GRADE_SANDBOX=1``), ``load_exercise(name)`` returns ``loader(name)``: a proxy
    whose functions run in the sandbox (``toyllm.grading.sandbox`` registers it when it is imported)."""
    global _remote_loader
    _remote_loader = loader


class RanAnExercise(RuntimeError):
    """A test marked ``library`` reached an exercise: it is no test of the library alone."""


def refuse_in_library_test(what: str) -> None:
    """Raise ``RanAnExercise`` (after writing ``what`` to the file ``$TOYLLM_LIBRARY_TEST`` names) inside a test
    marked ``library``; do nothing elsewhere.

    The student edition's ``make test`` leaves such tests out, because they
    cannot differ there: the two editions' libraries differ only where an
    exercise runs (this function's callers). The written line is what proves
    it even where a caller swallows the error or the exercise ran in a
    worker process.
    """
    log = os.environ.get(LIBRARY_TEST_ENV)
    if log:
        with open(log, "a", encoding="utf-8") as f:
            f.write(what + "\n")
        raise RanAnExercise(f"this test is marked library, yet it ran {what}; a test that runs an exercise is no "
                            "test of the library alone: take the mark off its file")


def file_stamp(path: str | os.PathLike) -> tuple[int, int]:
    """(modification time in ns, size in bytes) of a file: what says it changed since it was last read."""
    stat = os.stat(path)
    return stat.st_mtime_ns, stat.st_size


def load_exercise(name: str, impl: str | os.PathLike | None = None) -> ModuleType:
    """The module ``name`` ("ex01" or "ex01_naive_generation") of the chosen implementation.

    impl: "exercises", "solutions" or a folder; by default ``$TOYLLM_IMPL``
    (``exercises`` when unset).

    The file is imported from its path (no change to ``sys.path``) under a
    private module name. While the grader runs, the current implementation
    is never imported into the grader's process: you get a proxy whose
    functions run in the sandbox (``toyllm.grading.sandbox``). A file
    edited since its last load is loaded again, so re-running a notebook
    cell picks up your latest code.
    """
    refuse_in_library_test(f"the exercise file {name} (load_exercise)")
    if impl is None and os.environ.get(SANDBOX_ENV) == "1":
        # Inside the grader: the submission runs in the sandbox process, never here (see toyllm.grading.sandbox).
        if _remote_loader is None:
            raise RuntimeError(f"{SANDBOX_ENV}=1 (inside a grading) but toyllm.grading is not imported: "
                               "nothing says how to reach the sandbox")
        return _remote_loader(name)
    path = exercise_file(resolve_impl(impl), name)
    stamp = file_stamp(path)
    cached = _loaded.get(path)
    if cached is not None and cached[0] == stamp:
        return cached[1]
    # one module name per folder, so a student's ex01 and the model answers' ex01 never collide
    folder_tag = hashlib.sha1(str(path.parent).encode()).hexdigest()[:8]
    module_name = f"_toyllm_{folder_tag}_{path.stem}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module       # what the import system does too (dataclasses, pickling need it)
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(module_name, None)
        raise
    _loaded[path] = (stamp, module)
    return module
