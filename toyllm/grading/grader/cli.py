"""``python -m toyllm grade`` and ``python -m toyllm.grading grade|sync``."""
from __future__ import annotations

import argparse
import math
import os
import signal
import sys

from ... import supervise
from ...supervise import Terminated, stop_signals_as_interrupt
from ...course import course_root
from .grade import GradingError, grade
from ..sandbox.process import DEFAULT_MEMORY_MB
from ...stubs import sync

MAX_TIMEOUT_S = 3600      # --timeout: one test may take at most an hour
MIN_MEMORY_MB = 1024      # --memory-mb: the sandbox must be able to import torch (grade() refuses less)


def _physical_memory_mb() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of the ``grade`` command (shared by ``python -m toyllm grade``)."""
    parser.add_argument("--impl", default="exercises", metavar="exercises|solutions|DIR",
                        help="implementation to grade: the exercises, the model answers or a student's folder")
    parser.add_argument("--only", action="append", metavar="exNN|N.M",
                        help="grade only this lesson or exercise (repeatable, or comma-separated), "
                             "e.g. --only ex01 or --only 1.2")
    parser.add_argument("--extra-tests", default=None, metavar="DIR",
                        help="folder of additional (hidden) graded tests, marked like tests/grading")
    parser.add_argument("--results", default=None, metavar="PATH",
                        help="also write the Gradescope-format results to this file, in an existing folder "
                             "(default: none)")
    parser.add_argument("--timeout", type=float, default=20, metavar="S",
                        help=f"seconds after which one test fails as timed out, > 0 and at most {MAX_TIMEOUT_S} "
                             "(default: 20)")
    parser.add_argument("--memory-mb", type=int, default=DEFAULT_MEMORY_MB, metavar="MB",
                        help=f"address-space limit of the submission's process in MiB, {MIN_MEMORY_MB} to this "
                             f"machine's memory (default: {DEFAULT_MEMORY_MB})")
    parser.add_argument("--hide", action="append", default=None, metavar="DIR",
                        help="a folder the submission must not see (repeatable); grade --class names its "
                             "submissions, gradebook and results folders so for each student")
    group = parser.add_argument_group("a whole class (docs/grading.md, 'Grading a class')")
    group.add_argument("--class", dest="class_dir", default=None, metavar="SUBMISSIONS",
                       help="grade every student of this folder: one folder or .zip per student, named by the student")
    group.add_argument("--gradebook", default=None, metavar="PATH.csv",
                       help="the class's gradebook to write, and to resume from (students graded there are skipped)")
    group.add_argument("--results-dir", default=None, metavar="DIR",
                       help="where each student's results.json goes (default: GRADEBOOK-results/ beside the gradebook)")
    group.add_argument("--jobs", type=int, default=None, metavar="N",
                       help="students graded at once (default: one per core, as many as memory holds; printed)")
    group.add_argument("--regrade", action="store_true", help="grade every student again, even those already graded")
    group.add_argument("--student-timeout", type=float, default=3600, metavar="S",
                       help="seconds after which one student's grading stops as timed out (default: 3600)")


def check_arguments(args: argparse.Namespace) -> None:
    """Every grade option checked before any test runs: a ValueError is one line naming the option."""
    t = args.timeout
    if not (math.isfinite(t) and 0 < t <= MAX_TIMEOUT_S):     # nan would disable every timeout
        raise ValueError(f"--timeout {t}: the time limit of one test must be a number of seconds > 0 and at "
                         f"most {MAX_TIMEOUT_S}")
    top = max(_physical_memory_mb(), DEFAULT_MEMORY_MB)
    if not MIN_MEMORY_MB <= args.memory_mb <= top:
        raise ValueError(f"--memory-mb {args.memory_mb}: the address-space limit must be {MIN_MEMORY_MB} MiB "
                         f"(enough to import torch) to {top} MiB (this machine's memory, or the default "
                         f"{DEFAULT_MEMORY_MB} if larger)")
    # --results is checked by grade() itself, before any test runs (a folder, a missing folder).


def main(args: argparse.Namespace) -> int:
    """Grade, print the table, write the results file. Exit code 0 whenever grading ran, whatever the score.

    A stop signal (SIGTERM, SIGHUP) or Ctrl-C unwinds grading, which ends every process it started, and
    propagates: the caller (``cli_main``, ``toyllm.cli.main``) turns it into exit code 128 + the signal.
    """
    only = None
    if args.only:
        only = [part for chunk in args.only for part in chunk.split(",") if part.strip()]
    try:
        check_arguments(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.class_dir is not None:
        if not supervise.linux():
            print("error: grading a class (--class) needs Linux: its sandboxes run as users of their own in "
                  "namespaces of their own; grade one submission here with --impl DIR", file=sys.stderr)
            return 2
        from .gradebook import run as grade_class
        return grade_class(args)
    if args.gradebook or args.results_dir or args.jobs is not None or args.regrade:
        print("error: --gradebook, --results-dir, --jobs and --regrade grade a class: add --class SUBMISSIONS",
              file=sys.stderr)
        return 2
    try:
        report = grade(args.impl, only=only, extra_tests=args.extra_tests, results_path=args.results,
                       per_test_timeout_s=args.timeout, verbose=True, memory_limit_mb=args.memory_mb,
                       template=True, hide=args.hide)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except GradingError as e:
        print(f"grading failed: {e}", file=sys.stderr)
        return 1
    print(report.table())
    if args.results:
        print(f"\nwrote {args.results}")
    return 0


def cli_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m toyllm.grading", description="Grade exercises; keep stubs in sync.")
    sub = parser.add_subparsers(dest="command", required=True)
    add_arguments(sub.add_parser("grade", help="run the graded tests and score them"))
    s = sub.add_parser("sync", help="write exercises/ from solutions/ (stubs from model answers)")
    s.add_argument("--check", action="store_true", help="change nothing; exit 1 if exercises/ is out of date")
    s.add_argument("--force", action="store_true", help="overwrite exercise files even if they hold answers")
    args = parser.parse_args(argv)
    if args.command == "grade":
        try:
            with stop_signals_as_interrupt():
                return main(args)
        except KeyboardInterrupt as stop:            # Ctrl-C, or a stop signal (Terminated, which says which)
            print(f"grade: stopped ({stop})" if isinstance(stop, Terminated) else "interrupted", file=sys.stderr)
            return 128 + getattr(stop, "signum", signal.SIGINT)
    try:
        changed = sync(check=args.check, force=args.force)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for path in changed:
        print(("out of date: " if args.check else "wrote ") + str(path.relative_to(course_root())))
    if args.check and changed:
        print("run `python -m toyllm.grading sync` to update exercises/", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(cli_main())
