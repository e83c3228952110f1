"""Where the course lives: the folders of exercises, model answers and graded tests.

The grader needs ``exercises/`` and ``tests/grading/`` of a course
checkout (and ``solutions/`` in the instructor edition; the student edition
has none), wherever toyllm itself is installed. They are found, in this order: the folder named by ``TOYLLM_COURSE_DIR``; the current
directory or the nearest folder above it that holds all three (so a
notebook in ``notebooks/`` finds its course); the folder above the
installed package (an editable install inside the checkout).

It also says which implementation of the exercises runs: ``TOYLLM_IMPL``
is ``exercises`` (the default), ``solutions`` or a folder of ``exNN_*.py``
files (``resolve_impl``).
"""
from __future__ import annotations

import os
import re
from pathlib import Path

COURSE_ENV = "TOYLLM_COURSE_DIR"
ANSWERS_ENV = "TOYLLM_ANSWERS"     # where the model answers are, if not solutions/ (the grader's sandbox sets it)
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
    beside = Path(__file__).resolve().parents[2]
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


# The exercises each lesson's graded tests run through toyllm's marked functions where the submission runs (the
# model's dense attention, the paged cache's steps, whatever the graded exercise): the grader's sandbox holds
# these model answers, and beyond them only those the graded exercise's own model answer calls
# (``sandbox.model_answers_for``). A missing entry fails the model answers' own tests there.
GRADED_TESTS_RUN: dict[str, tuple[str, ...]] = {
    "ex01": ("2.1",), "ex02": ("2.1",), "ex04": ("2.1",), "ex05": ("2.1",), "ex08": ("2.1", "8.1", "8.2"),
}
