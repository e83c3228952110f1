"""Where the course lives: the folders of exercises, model answers and graded tests.

The grader needs ``exercises/``, ``solutions/`` and ``tests/grading/`` of a
course checkout, wherever toyllm itself is installed. They are found, in
this order: the folder named by ``TOYLLM_COURSE_DIR``; the current
directory or the nearest folder above it that holds all three (so a
notebook in ``notebooks/`` finds its course); the folder above the
installed package (an editable install inside the checkout).
"""
from __future__ import annotations

import os
from pathlib import Path

COURSE_ENV = "TOYLLM_COURSE_DIR"
_PARTS = ("exercises", "solutions", "tests/grading")


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
    return course_root() / "solutions"


def grading_tests_dir() -> Path:
    return course_root() / "tests" / "grading"
