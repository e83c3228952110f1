"""How long a class takes to grade: the figures of docs/grading.md's "Grading a class", measured in one run.

    python -m toyllm.grading.grader.class_timing [--students 20] [--ratio-students 4] [--rounds 2]

1. A class of ``--students`` copies of the model answers of lessons 01-03, graded by ``grade --class``
   at the default ``--jobs``: seconds per student and lesson (the wall time over students x 3).
2. A class of ``--ratio-students`` graded with ``--jobs 1`` and with ``--jobs 2``, in turns (1, 2, 1,
   2, ...) so a slow spell of the machine hits both: each as median [lowest-highest run] in seconds,
   the ratio of the medians, and the lowest and highest ratio of the rounds.

The load average is printed before and after: on a busy machine the figures mean less.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import tempfile
import time
from pathlib import Path

from ...measure import Spread, load_average, usable_cores
from ...supervise import stop_signals_as_interrupt
from ...course import solutions_dir
from ..settings import Settings
from .gradebook import GRADED, Options, default_jobs, grade_class

LESSONS = ("ex01", "ex02", "ex03")


def _class(folder: Path, students: int) -> Path:
    """``students`` folders, each with the model answers of ``LESSONS``."""
    for i in range(students):
        student = folder / f"student{i:02d}"
        student.mkdir(parents=True)
        for lesson in LESSONS:
            for path in solutions_dir().glob(f"{lesson}_*.py"):
                (student / path.name).write_text(path.read_text())
    return folder


def _grade(folder: Path, jobs: int) -> float:
    """Seconds to grade the class in ``folder`` with ``jobs`` at a time; a student not fully graded stops the run."""
    book = folder.parent / f"{folder.name}-{jobs}-{time.monotonic_ns()}.csv"
    options = Options(only=None, extra_tests=None, timeout_s=60, memory_mb=8192, student_timeout_s=1800)
    start = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        rows = grade_class(folder, book, folder.parent / f"{book.stem}-results", options, jobs, regrade=True)
    elapsed = time.perf_counter() - start
    lost = [r.student for r in rows.values() if r.status != GRADED or r.total != sum(r.maxima.values())]
    if lost:
        raise SystemExit(f"the model answers lost points or were not graded: {lost} (see {book})")
    return elapsed


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m toyllm.grading.grader.class_timing", description=__doc__.split("\n")[0])
    parser.add_argument("--students", type=int, default=20, help="the class graded at the default --jobs (default 20)")
    parser.add_argument("--ratio-students", type=int, default=4, help="the class graded at --jobs 1 and 2 (default 4)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of --jobs 1 and --jobs 2 (default 2)")
    args = parser.parse_args(argv)
    if not (1 <= args.students <= 500 and 1 <= args.ratio_students <= 100 and 1 <= args.rounds <= 20):
        parser.error("--students must be 1-500, --ratio-students 1-100 and --rounds 1-20")
    jobs, why = default_jobs()
    print(f"machine: {usable_cores()} usable core(s), load average {load_average():.2f} before timing; "
          f"default --jobs {jobs} ({why})", flush=True)
    with tempfile.TemporaryDirectory(prefix="toyllm-class-timing-") as tmp:
        tmp = Path(tmp)
        whole = _grade(_class(tmp / "class", args.students), jobs)
        per = whole / (args.students * len(LESSONS))
        print(f"{args.students} students x lessons 01-03 at --jobs {jobs}: {whole:.1f} s, {per:.2f} s per student "
              f"and lesson", flush=True)
        small = _class(tmp / "small", args.ratio_students)
        one, two = [], []
        for i in range(args.rounds):
            one.append(_grade(small, 1))
            two.append(_grade(small, 2))
            print(f"  round {i + 1}: --jobs 1 {one[-1]:.1f} s, --jobs 2 {two[-1]:.1f} s", flush=True)
        ratios = [a / b for a, b in zip(one, two)]
        a, b = Spread(tuple(one)), Spread(tuple(two))
        print(f"{args.ratio_students} students x lessons 01-03: --jobs 1 {a}, --jobs 2 {b}: --jobs 2 is "
              f"{a.median / b.median:.2f}x faster (ratio of medians; rounds {min(ratios):.2f}-{max(ratios):.2f})")
    print(f"load average after timing: {load_average():.2f}")


if __name__ == "__main__":
    os.environ.pop(Settings.variable("impl"), None)
    with stop_signals_as_interrupt():          # SIGTERM unwinds like Ctrl-C: every grading started is ended
        main()
