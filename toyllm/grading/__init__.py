"""Exercises and automatic grading: a small package, one module per concern.

- (below it, in ``toyllm.course``: where the course's exercises, solutions and
  graded tests are, and which implementation runs: ``load_exercise``,
  ``TOYLLM_IMPL``; in ``toyllm.stubs``: the stubs generated from the model
  answers, ``sync``);
- ``edition``: the student edition, without the answers (``make student``);
- ``plugin``: the pytest plugin (``--impl``, the markers, the grader's log);
- ``sandbox``, ``server``, ``wire``: the submission's own process, and what
  crosses to it and back; ``local``: the same rules in this process (a plain
  pytest run), and ``sandboxed``;
- ``guard``: the rules a submitted call runs under (independence, one
  exercise at a time);
- ``harness``: trusted helpers that graded tests run next to the submission;
- ``expect``: checks whose failure messages a student can act on;
- ``grader``: ``grade`` and ``check``; ``selection`` (which tests run),
  ``run`` (one lesson's trusted pytest process, watched), ``outcome`` (its
  event log read into a status per test), ``report`` (tables and Gradescope
  results);
- ``gradebook``: a class folder graded side by side into one CSV (``grade --class``);
  ``autograder``: the Gradescope zip (``make autograder``); ``class_timing`` and
  ``timing``: how long grading takes;
- ``cli``: the command line.

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
   from a notebook cell. docs/grading.md is the instructors' guide.

Command line::

    python -m toyllm grade [--impl exercises|solutions|DIR] [--only ex01|1.2] [--extra-tests DIR]
                           [--results results.json] [--timeout S] [--memory-mb MB]
    python -m toyllm.grading sync [--check] [--force]
"""
from ..course import course_root, current_impl, load_exercise, resolve_impl
from .grader import GradingError, check, grade
from .report import GradeReport, TestResult
from .local import sandboxed
from ..stubs import make_stub, sync
from .cli import add_arguments, main

__all__ = ["GradeReport", "GradingError", "TestResult", "add_arguments", "check", "course_root", "current_impl",
           "grade", "load_exercise", "main", "make_stub", "resolve_impl", "sandboxed", "sync"]
