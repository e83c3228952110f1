"""How long grading takes: the figures of docs/grading.md, measured side by side in one run.

    python -m toyllm.grading.grader.timing [--rounds 5] [--course-rounds 1]

1. ``check("3.1")`` (arithmetic) in this warm process, again and again, against a cold start of
   ``python -c "import torch, toyllm"``. The first check starts the grader's processes; from the
   second on, a standby pytest process with its sandbox is waiting (``run.Standby``). A pause
   before each check stands for the student reading the last result.
2. ``check("5.2")`` (a step inside the engine, on several processes) in this warm process, against
   the same graded tests run here by plain pytest without the grader (no sandbox, no separate
   pytest process): the engine's own run of the same cases.
3. The whole course from the command line, ``python -m toyllm grade --impl solutions``.

Rounds interleave (a, b, a, b, ...), so a slow spell of the machine hits both sides. Every figure
is printed as median [lowest-highest run] in seconds, with the ratio of the medians. The load
average is printed first: on a busy machine the figures mean less, and the line says so.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import subprocess
import sys
import time

from ...measure import Spread, load_average, usable_cores
from ...course import course_root, grading_tests_dir
from ..settings import Settings
from .grade import check

READ_S = 5.0          # a student reads the result before checking again (and the standby gets ready)


def _quiet_check(exercise: str, impl: str) -> float:
    """Seconds of one ``check(exercise, impl)``; its printout is swallowed, a lost point stops the run."""
    t = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()) as out:
        check(exercise, impl)
    elapsed = time.perf_counter() - t
    last = out.getvalue().strip().splitlines()[-1]
    got, _, rest = last.rpartition(": ")[2].partition(" / ")
    if got != rest.split()[0]:
        raise SystemExit(f"check({exercise!r}, {impl!r}) lost points: {last}")
    return elapsed


def _cold_import() -> float:
    t = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch, toyllm"], check=True)
    return time.perf_counter() - t


def _plain_pytest(exercise: str) -> float:
    """Seconds of the graded tests of ``exercise`` run in this process by pytest, without the grader."""
    import pytest

    lesson = int(exercise.split(".")[0])
    files = sorted(grading_tests_dir().glob(f"test_ex{lesson:02d}_*.py"))
    before = Settings.from_env(os.environ).impl
    os.environ.update(Settings(impl="solutions").to_env())
    t = time.perf_counter()
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            code = pytest.main([*map(str, files), "-q", "-p", "no:cacheprovider", "--import-mode=importlib",
                                "-k", f"ex{exercise.replace('.', '_')}_"])
    finally:
        if before is None:
            os.environ.pop(Settings.variable("impl"))
        else:
            os.environ.update(Settings(impl=before).to_env())
    if code != 0:
        raise SystemExit(f"the graded tests of Exercise {exercise} did not pass under plain pytest (exit {code})")
    return time.perf_counter() - t


def _course() -> float:
    t = time.perf_counter()
    subprocess.run([sys.executable, "-m", "toyllm", "grade", "--impl", "solutions"], check=True,
                   stdout=subprocess.DEVNULL, cwd=course_root())
    return time.perf_counter() - t


def _line(what: str, ours: Spread, base: Spread | None = None, base_name: str = "") -> str:
    text = f"{what}: {ours}"
    if base is not None:
        text += f" vs {base_name} {base}: ratio of medians {ours.median / base.median:.2f}"
    return text


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m toyllm.grading.grader.timing", description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds of each check (default 5)")
    parser.add_argument("--course-rounds", type=int, default=1, help="whole-course gradings (default 1; 0 skips)")
    args = parser.parse_args(argv)
    if not 1 <= args.rounds <= 50 or not 0 <= args.course_rounds <= 10:
        parser.error("--rounds must be 1-50 and --course-rounds 0-10")
    print(f"machine: {usable_cores()} usable core(s), load average {load_average():.2f} before timing "
          f"(above {usable_cores()} means busy: the figures then mean less)", flush=True)

    _quiet_check("3.1", "solutions")                      # the first check starts the grader's processes
    warm, cold = [], []
    for _ in range(args.rounds):
        time.sleep(READ_S)
        cold.append(_cold_import())
        time.sleep(READ_S)
        warm.append(_quiet_check("3.1", "solutions"))
    print(_line('check("3.1"), warm', Spread(tuple(warm)), Spread(tuple(cold)),
                'cold `python -c "import torch, toyllm"`'), flush=True)

    engine, graded = [], []
    _quiet_check("5.2", "solutions")
    for _ in range(max(2, args.rounds // 2)):
        time.sleep(READ_S)
        engine.append(_plain_pytest("5.2"))
        time.sleep(READ_S)
        graded.append(_quiet_check("5.2", "solutions"))
    print(_line('check("5.2"), warm', Spread(tuple(graded)), Spread(tuple(engine)),
                "the same tests by plain pytest in this process"), flush=True)

    if args.course_rounds:
        course = Spread(tuple(_course() for _ in range(args.course_rounds)))
        print(_line("the whole course, `python -m toyllm grade --impl solutions`", course), flush=True)
    print(f"load average after timing: {load_average():.2f}")


if __name__ == "__main__":
    main()
