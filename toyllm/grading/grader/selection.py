"""Which graded tests run: the lessons' test files, and what ``--only`` picks among them."""
from __future__ import annotations

import re
from pathlib import Path

from .report import EXERCISE_ID, exercise_key


def lesson_of(name: str | int) -> int:
    """1 for "ex01", "ex01_naive_generation", "01", "1", 1 or an exercise id like "1.2"."""
    m = re.fullmatch(r"(?:ex)?(\d+)(?:_\w+|\.\d+)?", str(name).strip())
    if m is None:
        raise ValueError(f"--only takes lessons like 'ex01' or exercises like '1.2', got {name!r}")
    return int(m[1])


def lesson_files(folder: Path) -> dict[int, Path]:
    files = {}
    for path in sorted(folder.glob("test_ex[0-9][0-9]*.py")):
        files[int(path.name[7:9])] = path
    return files


def lesson_ranges(lessons: list[int]) -> str:
    """"ex01-ex03, ex05" for [1, 2, 3, 5]: runs of consecutive lessons as ranges."""
    runs: list[list[int]] = []
    for n in sorted(lessons):
        if runs and n == runs[-1][-1] + 1:
            runs[-1].append(n)
        else:
            runs.append([n])
    return ", ".join(f"ex{r[0]:02d}" + (f"-ex{r[-1]:02d}" if len(r) > 1 else "") for r in runs) or "none"


def graded_exercise_ids(files) -> set[str]:
    """Exercise ids named by ``@pytest.mark.exercise("N.M")`` in these test files."""
    ids = set()
    for path in files:
        ids |= set(re.findall(r"""mark\.exercise\(\s*["'](\d+\.\d+)["']\s*\)""", Path(path).read_text()))
    return ids


def select(only, local: dict[int, Path], extra_dir: Path | None) -> tuple[list[int], set[int] | None, dict[int, set[str]]]:
    """(lessons to run, lessons asked for or None, {lesson: the only exercises to run}) for ``only``.

    Raises ValueError naming a lesson or exercise that has no graded tests.
    """
    wanted, only_exercises, exercise_ids = None, {}, set()
    if only is not None:
        names = str(only).split(",") if isinstance(only, (str, int)) else only
        wanted = {lesson_of(x) for x in names}
        exercise_ids = {str(x).strip() for x in names if EXERCISE_ID.match(str(x).strip())}
        # a lesson asked for as a whole is graded whole, even if one of its exercises is also named
        whole = {lesson_of(x) for x in names if not EXERCISE_ID.match(str(x).strip())}
        only_exercises = {n: {e for e in exercise_ids if lesson_of(e) == n} for n in wanted - whole}
    pending = sorted(set(local) | (set(lesson_files(extra_dir)) if extra_dir else set()))
    if only is not None:
        known = graded_exercise_ids(list(local.values()) + (list(extra_dir.rglob("test_*.py")) if extra_dir else []))
        missing = sorted({e for e in exercise_ids if e not in known}, key=exercise_key)
        if missing:
            raise ValueError(f"no graded tests for exercise(s) {missing}; graded exercises: "
                             f"{sorted(known, key=exercise_key)}")
    if wanted is not None:
        unknown = wanted - set(pending)
        if unknown:
            modules = ", ".join(repr(f"ex{n:02d}") for n in sorted(unknown))
            raise ValueError(f"no graded tests for exercise module{'s' * (len(unknown) > 1)} {modules} (lessons with graded tests: "
                             f"{lesson_ranges(pending)})")
        pending = sorted(wanted)
    return pending, wanted, only_exercises


def held_lessons(pending: list[int], submitted_names) -> tuple[list[int], list[int]]:
    """(the lessons of ``pending`` a submission holds an ``exNN_*.py`` file for, the others).

    A submission with no lesson file at all keeps every lesson: it is graded, and scores nothing.
    """
    held = {int(m[1]) for name in submitted_names if (m := re.fullmatch(r"ex(\d\d)_\w*\.py", name))}
    if not held:
        return pending, []
    return [n for n in pending if n in held], [n for n in pending if n not in held]
