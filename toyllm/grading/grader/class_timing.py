"""How long a class takes to grade: the figures of docs/grading.md's "How long a class takes", measured in one run.

    python -m toyllm.grading.grader.class_timing [--students 20] [--ratio-students 4] [--rounds 5]
                                                 [--lessons ex01,ex02,ex03]

1. A class of ``--students`` copies of the model answers of ``--lessons`` (default 01-03, the
   arithmetic lessons the target is for; ``--lessons ex04,ex05`` for the engine's), graded by ``grade --class``
   at the default ``--jobs``: seconds per student and lesson (the wall time over students x 3), and the
   machine's CPU-seconds per student (cores busy on average x the wall time, over the students).
2. A class of ``--ratio-students`` graded with ``--jobs 1`` and with ``--jobs 2``, in turns (1, 2, 1,
   2, ...) so a slow spell of the machine hits both: each as median [lowest-highest run] in seconds,
   the ratio of the medians, the lowest and highest ratio of the rounds, and the verdict on the target
   (``TARGET_GAIN``x), decided from the runs like every verdict of the course (``measure.compare``:
   ``--jobs 2``'s seconds against ``--jobs 1``'s divided by the target, the slowest that would meet it).
3. How many cores each run kept busy on average (the whole machine's, from /proc/stat), and so the
   most ``--jobs 2`` could gain: the cores there are over those ``--jobs 1`` already kept busy.

The load average is printed before and after: on a busy machine the figures mean less.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import statistics
import tempfile
import time
from pathlib import Path

from ...measure import Spread, busy_cpu_seconds, compare, load_average, usable_cores
from ...supervise import stop_signals_as_interrupt
from ...course import solutions_dir
from ..settings import Settings
from .gradebook import GRADED, Options, default_jobs, grade_class

LESSONS = ("ex01", "ex02", "ex03")     # the arithmetic lessons: the 1.5x target is theirs
TARGET_GAIN = 1.5              # --jobs 2 over --jobs 1 on a 2-core machine, for these arithmetic lessons


def _class(folder: Path, students: int, lessons: tuple[str, ...]) -> Path:
    """``students`` folders, each with the model answers of ``lessons``."""
    for i in range(students):
        student = folder / f"student{i:02d}"
        student.mkdir(parents=True)
        for lesson in lessons:
            for path in solutions_dir().glob(f"{lesson}_*.py"):
                (student / path.name).write_text(path.read_text())
    return folder


def _grade(folder: Path, jobs: int) -> tuple[float, float]:
    """Seconds to grade the class in ``folder`` with ``jobs`` at a time, and the cores busy on average
    meanwhile (the whole machine's: ``measure.busy_cpu_seconds``); a student not fully graded stops the run."""
    book = folder.parent / f"{folder.name}-{jobs}-{time.monotonic_ns()}.csv"
    options = Options(only=None, extra_tests=None, timeout_s=60, memory_mb=8192, student_timeout_s=1800)
    start, busy = time.perf_counter(), busy_cpu_seconds()
    with contextlib.redirect_stdout(io.StringIO()):
        rows = grade_class(folder, book, folder.parent / f"{book.stem}-results", options, jobs, regrade=True)
    elapsed = time.perf_counter() - start
    cores = (busy_cpu_seconds() - busy) / elapsed
    lost = [r.student for r in rows.values() if r.status != GRADED or r.total != sum(r.maxima.values())]
    if lost:
        raise SystemExit(f"the model answers lost points or were not graded: {lost} (see {book})")
    return elapsed, cores


def target_line(one: list[float], two: list[float]) -> str:
    """The verdict on ``TARGET_GAIN`` from the rounds' seconds with ``--jobs 1`` and ``--jobs 2``."""
    verdict = compare(two, [t / TARGET_GAIN for t in one])
    return f"target {TARGET_GAIN}x: {verdict.target} ({verdict.sentence('--jobs 2', f'--jobs 1 / {TARGET_GAIN}')})"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m toyllm.grading.grader.class_timing", description=__doc__.split("\n")[0])
    parser.add_argument("--students", type=int, default=20, help="the class graded at the default --jobs (default 20)")
    parser.add_argument("--ratio-students", type=int, default=4, help="the class graded at --jobs 1 and 2 (default 4)")
    parser.add_argument("--lessons", default=",".join(LESSONS),
                        help="the lessons each student hands in (default ex01,ex02,ex03)")
    parser.add_argument("--rounds", type=int, default=5,
                        help="rounds of --jobs 1 and --jobs 2 (default 5, the fewest a verdict can come from)")
    args = parser.parse_args(argv)
    if not (1 <= args.students <= 500 and 1 <= args.ratio_students <= 100 and 1 <= args.rounds <= 20):
        parser.error("--students must be 1-500, --ratio-students 1-100 and --rounds 1-20")
    lessons = tuple(part.strip() for part in args.lessons.split(",") if part.strip())
    known = {p.name[:4] for p in solutions_dir().glob("ex[0-9][0-9]_*.py")}
    if not lessons or not set(lessons) <= known:
        parser.error(f"--lessons {args.lessons!r}: give lessons of the course, comma-separated: {', '.join(sorted(known))}")
    named = f"lessons {lessons[0][2:]}-{lessons[-1][2:]}" if len(lessons) > 1 else f"lesson {lessons[0][2:]}"
    jobs, why = default_jobs()
    print(f"machine: {usable_cores()} usable core(s), load average {load_average():.2f} before timing; "
          f"default --jobs {jobs} ({why})", flush=True)
    with tempfile.TemporaryDirectory(prefix="toyllm-class-timing-") as tmp:
        tmp = Path(tmp)
        whole, cores = _grade(_class(tmp / "class", args.students, lessons), jobs)
        per = whole / (args.students * len(lessons))
        print(f"{args.students} students x {named} at --jobs {jobs}: {whole:.1f} s, {per:.2f} s per student "
              f"and lesson; {cores:.2f} cores busy on average, so {cores * whole / args.students:.1f} CPU-seconds "
              f"per student", flush=True)
        small = _class(tmp / "small", args.ratio_students, lessons)
        one, two, busy_one, busy_two = [], [], [], []
        for i in range(args.rounds):
            for runs, busy, jobs_now in ((one, busy_one, 1), (two, busy_two, 2)):
                seconds, cores = _grade(small, jobs_now)
                runs.append(seconds)
                busy.append(cores)
            print(f"  round {i + 1}: --jobs 1 {one[-1]:.1f} s ({busy_one[-1]:.2f} cores busy), "
                  f"--jobs 2 {two[-1]:.1f} s ({busy_two[-1]:.2f} cores busy)", flush=True)
        ratios = [a / b for a, b in zip(one, two)]
        a, b = Spread(tuple(one)), Spread(tuple(two))
        print(f"{args.ratio_students} students x {named}: --jobs 1 {a}, --jobs 2 {b}: --jobs 2 is "
              f"{a.median / b.median:.2f}x faster (ratio of medians; rounds {min(ratios):.2f}-{max(ratios):.2f})")
        print(target_line(one, two))
        # With the same work, --jobs 2 can at best keep every core busy: its gain is bounded by the
        # cores there are over the cores --jobs 1 already kept busy.
        busy = statistics.median(busy_one)
        print(f"--jobs 1 kept {busy:.2f} of {usable_cores()} cores busy on average (median of the rounds; the "
              f"whole machine's, from /proc/stat), so --jobs 2 could gain at most about "
              f"{usable_cores() / busy:.2f}x on this machine")
    print(f"load average after timing: {load_average():.2f}")


if __name__ == "__main__":
    os.environ.pop(Settings.variable("impl"), None)
    with stop_signals_as_interrupt():          # SIGTERM unwinds like Ctrl-C: every grading started is ended
        main()
