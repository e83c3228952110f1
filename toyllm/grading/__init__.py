"""Exercises and automatic grading: a small package, one module per concern.

- ``course``: where the course's exercises, solutions and graded tests are;
- ``impl``: which implementation runs (``load_exercise``, ``TOYLLM_IMPL``);
- ``stubs``: exercise stubs generated from the model answers;
- ``plugin``: the pytest plugin (``--impl``, the markers, the grader's log);
- ``grader``: ``grade`` and ``check``, reports, Gradescope results;
- ``cli``: the command line.

1. **Which implementation runs.** Every lesson's exercises exist twice with
   the same signatures: ``exercises/exNN_*.py`` (stubs the learner fills in)
   and ``solutions/exNN_*.py`` (model answers). ``load_exercise("ex01")``
   returns the module of the implementation chosen by the ``TOYLLM_IMPL``
   environment variable: ``exercises`` (the default), ``solutions``, or the
   path of a folder holding a student's ``exNN_*.py`` files. Notebooks and
   graded tests reach exercise code *only* through ``load_exercise``; in
   pytest, ``--impl`` overrides the variable.

2. **Stubs from solutions.** A model answer sits between two marker
   comments inside a function body::

       # BEGIN SOLUTION 1.2 hint: divide by the temperature, then torch.multinomial
       ...
       # END SOLUTION

   ``make_stub`` replaces each marked region by
   ``raise NotImplementedError("Exercise 1.2: implement <function> (hint: ...)")``
   and keeps everything else (signatures, docstrings). ``python -m
   toyllm.grading sync`` rewrites ``exercises/`` from ``solutions/``;
   ``sync --check`` only reports files that are out of date.

3. **The grader.** Graded tests live in ``tests/grading/test_exNN_*.py`` and
   carry ``@pytest.mark.exercise("N.M")`` and ``@pytest.mark.points(P)``.
   ``grade()`` runs pytest in one subprocess per lesson, so a submission that
   kills its interpreter (``os._exit``, a segfault) only loses that lesson's
   unfinished tests, and a per-test timeout stops infinite loops. Each test
   scores all of its points or none. The result is a table per exercise and
   a ``results.json`` in the Gradescope format. Instructors add hidden tests
   with ``extra_tests=DIR`` (same markers; they call ``load_exercise`` too).

Command line::

    python -m toyllm.grading grade [--impl exercises|solutions|DIR] [--only ex01]
                                   [--extra-tests DIR] [--results results.json] [--timeout S]
    python -m toyllm.grading sync [--check] [--force]

(``python -m toyllm grade ...`` takes the same options.)

This module is also the pytest plugin that registers ``--impl`` and the two
markers (the repository's root ``conftest.py`` loads it), and that records
each test's outcome while the grader runs.
"""
from .course import course_root
from .grader import GradeReport, GradingError, TestResult, check, grade
from .impl import current_impl, load_exercise, resolve_impl
from .stubs import make_stub, sync
from .cli import add_arguments, main

__all__ = ["GradeReport", "GradingError", "TestResult", "add_arguments", "check", "course_root", "current_impl",
           "grade", "load_exercise", "main", "make_stub", "resolve_impl", "sync"]
