"""Pytest setup for the whole repository.

Loads toyllm's grading plugin, which adds the ``--impl exercises|solutions|DIR``
option (the implementation that ``toyllm.grading.load_exercise`` returns in
the graded tests of ``tests/grading``) and registers the ``exercise`` and
``points`` markers. It must sit here, in the root conftest: pytest only
accepts command-line options from conftest files it reads before parsing
the command line, and this is the one it always reads.
"""
pytest_plugins = ["toyllm.grading.grader.plugin", "pytester"]
