"""The pytest plugin: ``--impl``, the ``exercise`` and ``points`` markers, and the grader's event log.

The repository's root ``conftest.py`` loads it, and the grader passes it to
every pytest process it starts. While grading, it writes one JSON line per
collected item and per test phase to the log file the grader names; the
grader turns those lines into scores.
"""
from __future__ import annotations

import json
import os
import re

from .impl import IMPL_ENV, NAMED_IMPLS, current_impl, resolve_impl

_EXERCISE_ID = re.compile(r"^(\d+)\.(\d+)$")

# Set by the grader in each pytest subprocess; the hooks below read them.
_LOG_ENV = "TOYLLM_GRADE_LOG"          # file the plugin appends one JSON line per event to
_LESSON_ENV = "TOYLLM_GRADE_LESSON"    # run only tests of this lesson (an int)
_EXERCISES_ENV = "TOYLLM_GRADE_EXERCISES"   # and, if set, only these exercises ("1.2,1.3")

def pytest_addoption(parser):
    group = parser.getgroup("toyllm", "toyllm exercises")
    group.addoption("--impl", default=None, metavar="exercises|solutions|DIR",
                    help=f"implementation that load_exercise() returns (default: ${IMPL_ENV} or 'exercises')")


def pytest_configure(config):
    config.addinivalue_line("markers", "exercise(id): the graded exercise a test belongs to, e.g. '1.2'")
    config.addinivalue_line("markers", "points(n): points a graded test is worth (all or nothing)")
    impl = config.getoption("--impl", default=None)
    if impl:
        try:
            folder = resolve_impl(impl)
        except ValueError as e:
            import pytest

            raise pytest.UsageError(str(e)) from None
        config._toyllm_previous_impl = os.environ.get(IMPL_ENV)
        os.environ[IMPL_ENV] = impl if impl in NAMED_IMPLS else str(folder)


def pytest_unconfigure(config):
    if hasattr(config, "_toyllm_previous_impl"):
        previous = config._toyllm_previous_impl
        if previous is None:
            os.environ.pop(IMPL_ENV, None)
        else:
            os.environ[IMPL_ENV] = previous


def pytest_report_header(config):
    return f"toyllm exercises: implementation {current_impl()!r} (set {IMPL_ENV} or --impl)"


def exercise_of(item) -> str | None:
    """The exercise id ("1.2") of a collected test, from its ``exercise`` marker."""
    marker = item.get_closest_marker("exercise")
    return str(marker.args[0]) if marker and marker.args else None


def points_of(item) -> float | None:
    marker = item.get_closest_marker("points")
    return marker.args[0] if marker and marker.args else None


def _log(record: dict) -> None:
    path = os.environ.get(_LOG_ENV)
    if path:
        with open(path, "a") as f:              # reopened per record: a crash loses nothing written
            f.write(json.dumps(record) + "\n")


def pytest_collection_modifyitems(session, config, items):
    if not os.environ.get(_LOG_ENV):
        return
    lesson = os.environ.get(_LESSON_ENV)
    exercises = set(filter(None, os.environ.get(_EXERCISES_ENV, "").split(",")))
    selected, deselected, records, problems = [], [], [], []
    for item in items:
        ex, pts = exercise_of(item), points_of(item)
        if ex is None or not _EXERCISE_ID.match(ex) or not isinstance(pts, (int, float)) or pts <= 0:
            problems.append(item.nodeid)
            continue
        keep = (lesson is None or int(ex.split(".")[0]) == int(lesson)) and (not exercises or ex in exercises)
        (selected if keep else deselected).append(item)
        records.append({"nodeid": item.nodeid, "name": item.name, "path": str(item.path),
                        "exercise": ex, "points": pts, "selected": keep})
    if problems:
        import pytest

        raise pytest.UsageError("graded tests need @pytest.mark.exercise('N.M') and @pytest.mark.points(P > 0); "
                                f"missing or malformed on: {problems}")
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = selected
    _log({"event": "collected", "items": records})


def pytest_runtest_logreport(report):
    if not os.environ.get(_LOG_ENV):
        return
    message = ""
    if report.failed or report.skipped:
        crash = getattr(report.longrepr, "reprcrash", None)
        if crash is not None:
            message = crash.message
        elif isinstance(report.longrepr, tuple):           # skips: (file, line, reason)
            message = str(report.longrepr[-1])
        else:
            message = str(report.longrepr)
    _log({"event": "report", "nodeid": report.nodeid, "when": report.when, "outcome": report.outcome,
          "message": message[-2000:]})


