"""The grader: one trusted pytest process per lesson, every test all of its points or none.

Graded tests live in ``tests/grading/test_exNN_*.py`` and carry
``@pytest.mark.exercise("N.M")`` and ``@pytest.mark.points(P)``. ``grade()``
copies them (and the instructor's hidden tests) into a private folder and
runs pytest there, one process per lesson. The submission never runs in
that process: its functions run in a sandbox process (``sandbox.py``) that
cannot read the tests, the log or the results. A call that hangs or
crashes costs the test that made it; a broken independence rule costs the
whole exercise. The result is a table per exercise and, if asked, a
``results.json`` in the Gradescope format. Instructors add hidden tests
with ``extra_tests=DIR`` (same markers).
"""
from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

from ...course import NAMED_IMPLS, current_impl, grading_tests_dir, resolve_impl
from .report import GradeReport, TestResult, explain, format_points
from .run import (GradingError, close_standby, hideable, open_to_others, private_copy_of_tests, run_lesson,
                  start_standby)
from ..sandbox.process import DEFAULT_MEMORY_MB, isolation, namespaces_work, sandbox_user
from .selection import held_lessons, lesson_files, lesson_ranges, select
from ..sandbox.submission import read_submission


def grade(impl: str | os.PathLike = "exercises", only: str | list[str] | None = None,
          extra_tests: str | os.PathLike | None = None, results_path: str | os.PathLike | None = None,
          per_test_timeout_s: float = 20, verbose: bool = False,
          memory_limit_mb: int = DEFAULT_MEMORY_MB, keep_warm: bool = False, template: bool = False,
          hide: list[str | os.PathLike] | None = None) -> GradeReport:
    """Run the graded tests against ``impl`` and score them.

    impl: "exercises", "solutions" or a folder with a student's exNN_*.py files.
    only: lessons or single exercises to grade, e.g. "ex01", "ex01,ex03", "1.2" or
      ["ex01", "3.4"] (default: all). An exercise id grades just that exercise.
    extra_tests: a folder of the instructor's hidden tests, marked like the
      others; they run in the subprocess of the lesson their exercise ids name.
    results_path: where to write the Gradescope results.json (None: don't).
    per_test_timeout_s: seconds after which a test fails as timed out.
    verbose: print one progress line per lesson.
    memory_limit_mb: address-space limit of the submission's process (MiB).
    keep_warm: leave a trusted pytest process with a sandbox ready for the
      next call (what ``check()`` does, so checking again is quick).
    template: start each lesson's trusted pytest process, and its sandboxes,
      as copies of one process that imported torch once for the whole
      grading (``standby.from_template``), not a fresh Python each. This
      process becomes a child subreaper (what is orphaned below it comes
      back to it), so it suits a process that grades and ends, as
      ``python -m toyllm grade`` does.
    hide: more folders the submission must not see, beside the graded and hidden tests and the model
      answers (``grade --class`` names the class's submissions, gradebook and results folders). A folder
      that holds the course or Python cannot be hidden: ValueError.

    One pytest subprocess per lesson, one sandbox process for the
    submission beside it. A test whose call crashed the submission's process
    scores 0 with status "crashed"; one whose call did not return in time,
    status "timeout".
    """
    if per_test_timeout_s <= 0:
        raise ValueError(f"per_test_timeout_s must be positive seconds, got {per_test_timeout_s}")
    if memory_limit_mb < 1024:
        raise ValueError(f"memory_limit_mb must be at least 1024 (torch alone maps hundreds of MiB), "
                         f"got {memory_limit_mb}")
    impl_dir = resolve_impl(impl)
    impl_env = str(impl) if str(impl) in NAMED_IMPLS else str(impl_dir)
    extra_dir = None
    if extra_tests is not None:
        extra_dir = Path(extra_tests).expanduser().resolve()
        if not extra_dir.is_dir():
            raise ValueError(f"extra tests folder {str(extra_tests)!r} does not exist")
        if sandbox_user() is not None and not namespaces_work() and open_to_others(extra_dir):
            raise ValueError(f"the hidden tests in {extra_dir} can be read by every user, so also by the "
                             f"submission (it runs as an unprivileged user): chmod -R o-rwx {extra_dir}")
    hidden = [Path(p).expanduser().resolve() for p in hide or ()]
    for folder in hidden:
        if not hideable(folder):
            raise ValueError(f"--hide {folder}: it holds the course, Python or the temporary folder, which the "
                             f"submission needs; give a folder that holds none of them")
    local = lesson_files(grading_tests_dir())
    pending, wanted, only_exercises = select(only, local, extra_dir)
    if results_path is not None:
        target = Path(results_path).expanduser()
        if target.is_dir():
            raise ValueError(f"--results {results_path} is a folder; give the path of a file to write")
        if not target.resolve().parent.is_dir():
            raise ValueError(f"--results {results_path}: the folder {target.resolve().parent} does not exist; "
                             "create it first")
    if not pending:
        raise GradingError(f"no graded tests found in {grading_tests_dir()}")

    submitted, notes = read_submission(impl_dir)
    if only is None and impl_env not in NAMED_IMPLS:
        # A student's folder is graded on the lessons it holds; --only names a lesson to grade it anyway.
        pending, skipped = held_lessons(pending, submitted)
        if skipped:
            notes.append(f"not graded: {lesson_ranges(skipped)} (no exNN file for {'it' if len(skipped) == 1 else 'them'} "
                         f"in {impl_dir}; grade one anyway with --only)")
    report = GradeReport(impl=impl_env, isolation=isolation(), notes=notes)
    start = time.perf_counter()
    done: set[int] = set()
    verdicts: dict[str, bool] = {}     # exercise -> fails a test of its own: notes need not grade it again
    with tempfile.TemporaryDirectory(prefix="toyllm-grade-") as tmp:      # mode 0700: the grader's alone
        tmp = Path(tmp)
        private_local, private_extra = private_copy_of_tests(tmp, extra_dir)
        settings = dict(impl_env=impl_env, timeout_s=per_test_timeout_s, tmp=tmp, memory_mb=memory_limit_mb,
                        extra_dir_original=extra_dir, template=template, hide=tuple(hidden))
        while pending:
            lesson = pending.pop(0)
            files = [private_local / local[lesson].name] if lesson in local else []
            # While a lesson runs, the next one's pytest process starts (and the last, for the next call).
            results, seen_lessons, failed_alone = run_lesson(
                lesson, files, private_extra, exercises=only_exercises.get(lesson), warm=keep_warm or bool(pending),
                verdicts=verdicts, **settings)
            verdicts.update(_verdicts(results, failed_alone, only_exercises.get(lesson)))
            done.add(lesson)
            report.tests.extend(results)
            # Hidden tests may name a lesson without a local test file: give it its own run too.
            for other in sorted(seen_lessons - done - set(pending)):
                if wanted is None or other in wanted:
                    pending.append(other)
            if verbose:
                s, m = sum(t.score for t in results), sum(t.max_score for t in results)
                print(f"graded ex{lesson:02d}: {format_points(s)}/{format_points(m)} points, {len(results)} tests", flush=True)
    if not keep_warm:
        close_standby()
    report.tests.sort(key=lambda t: (t.lesson, t.hidden))
    report.execution_time_s = time.perf_counter() - start
    if results_path is not None:
        report.write(results_path)
    return report


def _verdicts(results: list[TestResult], failed_alone: set[str], selected: set[str] | None) -> dict[str, bool]:
    """{exercise: fails a graded test of its own} as far as one lesson's results show it: true for those that
    failed a test that ran no other exercise (the lesson's process logs them), false for those whose every
    test ran (the lesson graded whole, or the exercise named) and passed."""
    verdicts = {}
    for exercise in {t.exercise for t in results}:
        if exercise in failed_alone:
            verdicts[exercise] = True
        elif (selected is None or exercise in selected) and all(t.status == "passed" for t in results
                                                                if t.exercise == exercise):
            verdicts[exercise] = False
    return verdicts


def check(exercise: str, impl: str | os.PathLike | None = None) -> None:
    """Grade one exercise from a notebook cell: one line per graded test (with the whole message of each
    that did not pass), then the points. Returns nothing, so a notebook shows only what it printed; use
    ``grade(only=...)`` for the numbers.

    ``check("2.1")`` runs just Exercise 2.1's graded tests against the
    current implementation (``TOYLLM_IMPL``, default your ``exercises/``),
    so the notebook keeps running whatever your function does.
    """
    report = grade(impl if impl is not None else current_impl(), only=exercise, keep_warm=True, template=True)
    for t in report.tests:
        mark = "ok  " if t.status == "passed" else "FAIL"
        print(f"  {mark} {t.name.split(': ', 1)[-1]} ({format_points(t.max_score)} point(s))")
        if t.status != "passed":
            print(explain(t, indent="       "))
    print(f"Exercise {exercise}: {format_points(report.score)} / {format_points(report.max_score)} points")


def prepare_check() -> None:
    """Start the process the next ``check()`` grades in now, so a lesson's first check answers in about a
    second instead of waiting for Python and torch to start (about 4 s). A lesson calls it in its first
    cell; the process waits, idle, until a check claims it, and ends with the notebook's kernel.
    Nothing happens if one is already waiting."""
    start_standby(DEFAULT_MEMORY_MB, template=True)
