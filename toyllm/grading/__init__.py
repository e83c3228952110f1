"""Exercises and automatic grading, grouped by the boundary between trusted and submitted code.

- (below it, in ``toyllm.course``: where the course's exercises, solutions and
  graded tests are, and which implementation runs: ``load_exercise``,
  ``TOYLLM_IMPL``; in ``toyllm.stubs``: the stubs generated from the model
  answers, ``sync``);
- ``settings``: every environment variable the grader and its sandbox hand
  each other, in one frozen object (``Settings.from_env``, ``to_env``);
- ``sandbox/``: the untrusted side and its boundary: the submission's own
  process (``process``, ``launcher``, ``server``), what crosses to it and
  back (``wire``), the rules a submitted call runs under (``guard``), the
  same rules in this process (``local``: a plain pytest run, and
  ``sandboxed``, ``sandboxed_record``), trusted helpers that graded tests run next to the
  submission (``harness``, ``counted``) and a submission's files read within
  bounds (``submission``);
- ``grader/``: the trusted side: ``grade`` and ``check`` (``grade``),
  ``selection`` (which tests run), ``run`` (one lesson's trusted pytest
  process, watched) and ``standby``, ``plugin`` (the pytest plugin:
  ``--impl``, the markers, the grader's log), ``outcome`` (its event log read
  into a status per test), ``report`` (tables and Gradescope results),
  ``cli`` (the command line), ``gradebook`` (a class folder graded side by
  side into one CSV, ``grade --class``), ``timing`` and ``class_timing``
  (how long grading takes);
- course authoring, what an instructor writes graded tests with and builds
  from them: ``expect`` (checks whose failure messages a student can act
  on), ``references`` (expected values, stored for the student edition),
  ``edition`` (the student edition, ``make student``) and ``autograder``
  (the Gradescope zip, ``make autograder``).

1. **Which implementation runs.** Every lesson's exercises exist twice with
   the same signatures: ``exercises/exNN_*.py`` (stubs the learner fills in)
   and ``solutions/exNN_*.py`` (model answers). ``load_exercise("ex01")``
   returns the module of the implementation chosen by the ``TOYLLM_IMPL``
   environment variable: ``exercises`` (the default), ``solutions``, or the
   path of a folder holding a student's ``exNN_*.py`` files.

2. **Stubs from solutions.** A model answer sits between
   ``# BEGIN SOLUTION 1.2 hint: ...`` and ``# END SOLUTION``; ``python -m
   toyllm.grading sync`` turns each into a ``NotImplementedError`` in
   ``exercises/`` (``sync --check`` only reports).

3. **The grader.** Graded tests live in ``tests/grading/test_exNN_*.py`` and
   carry ``@pytest.mark.exercise("N.M")`` and ``@pytest.mark.points(P)``.
   ``grade()`` runs them in a trusted pytest process per lesson, and the
   submission in a sandbox process beside it (see ``sandbox``). Each test
   scores all of its points or none. ``check("2.1")`` grades one exercise
   from a notebook cell; ``prepare_check()``, in a lesson's first cell,
   starts its process ahead. docs/grading.md is the instructors' guide.

Command line::

    python -m toyllm grade [--impl exercises|solutions|DIR] [--only ex01|1.2] [--extra-tests DIR]
                           [--results results.json] [--timeout S] [--memory-mb MB]
    python -m toyllm.grading sync [--check] [--force]
"""
from ..course import course_root, current_impl, load_exercise, resolve_impl
from .grader.grade import GradingError, check, grade, prepare_check
from .grader.report import GradeReport, TestResult
from .sandbox.local import sandboxed, sandboxed_record
from ..stubs import make_stub, sync
from .grader.cli import add_arguments, main

__all__ = ["GradeReport", "GradingError", "TestResult", "add_arguments", "check", "course_root", "current_impl",
           "grade", "load_exercise", "main", "make_stub", "resolve_impl", "sandboxed",
           "sandboxed_record", "sync"]
