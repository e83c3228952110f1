"""The pytest plugin: ``--impl``, the ``exercise`` and ``points`` markers, and the grader's event log.

The repository's root ``conftest.py`` loads it, and the grader passes it to
every pytest process it starts. While grading, it writes one JSON line per
collected item, per test phase and per broken independence rule to the log
file the grader names; the grader turns those lines into scores. This
process is the trusted side: the submission runs in the sandbox
(``sandbox.py``), which never sees the log.

It also tells the sandbox (or the in-process rules) which exercise the
running test grades, which functions that exercise may not call (the
``FORBIDDEN`` dicts of the graded test files, merged) and by when a call
must be back (the test's timeout).
"""
from __future__ import annotations

import json
import os
import re
import time

from . import sandbox
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
    sandbox.close()
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


_forbidden: dict[str, set[str]] = {}       # exercise -> "module:function" specs, from every FORBIDDEN dict


def _merge_forbidden(items) -> list[str]:
    """Collect the graded files' ``FORBIDDEN = {"2.1": ["toyllm.model:dense_attention"]}``; returns problems."""
    problems, seen = [], set()
    for item in items:
        module = getattr(item, "module", None)
        if module is None or id(module) in seen:
            continue
        seen.add(id(module))
        for ex, specs in (getattr(module, "FORBIDDEN", None) or {}).items():
            if not _EXERCISE_ID.match(str(ex)) or isinstance(specs, str) or \
                    not all(isinstance(x, str) and ":" in x for x in specs):
                problems.append(f"{item.path.name}: FORBIDDEN must map 'N.M' to a list of 'module:function'")
                continue
            _forbidden.setdefault(str(ex), set()).update(specs)
    return problems


def pytest_collection_modifyitems(session, config, items):
    problems = _merge_forbidden(items)
    if not os.environ.get(_LOG_ENV):
        if problems:
            import pytest

            raise pytest.UsageError("; ".join(problems))
        return
    lesson = os.environ.get(_LESSON_ENV)
    exercises = set(filter(None, os.environ.get(_EXERCISES_ENV, "").split(",")))
    selected, deselected, records = [], [], []
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

        raise pytest.UsageError("graded tests need @pytest.mark.exercise('N.M') and @pytest.mark.points(P > 0) "
                                f"(and a well-formed FORBIDDEN); problems with: {problems}")
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = selected
    _log({"event": "collected", "items": records})


def _timeout_of(item) -> float | None:
    marker = item.get_closest_marker("timeout")
    if marker is not None and marker.args:
        return float(marker.args[0])
    try:
        value = item.config.getoption("timeout", None) or item.config.getini("timeout")
        return float(value) if value else None
    except (ValueError, KeyError):
        return None


def _on_violation(item, exercise, message) -> None:
    """A submitted function called what its exercise forbids: the grader zeroes the exercise, the test fails."""
    item._toyllm_violations.append(message)
    _log({"event": "violation", "exercise": exercise, "nodeid": item.nodeid, "message": message})


def pytest_runtest_setup(item):
    """Tell the sandbox (or the in-process rules) what the coming test grades, and by when calls must be back."""
    ex = exercise_of(item)
    timeout = _timeout_of(item)
    sandbox.context.exercise = ex
    sandbox.context.forbidden = tuple(sorted(_forbidden.get(ex, ()))) if ex else ()
    sandbox.context.deadline = time.monotonic() + timeout - 1.0 if timeout else None
    item._toyllm_violations = []
    sandbox.context.on_violation = lambda exercise, message: _on_violation(item, exercise, message)


def _wrapper(fn):
    import pytest

    return pytest.hookimpl(wrapper=True)(fn)


@_wrapper
def pytest_runtest_call(item):
    """A broken independence rule fails the test even if the submission caught the error it raised."""
    result = yield
    violations = getattr(item, "_toyllm_violations", None)
    if violations:
        import pytest

        pytest.fail(violations[0], pytrace=False)
    return result


def pytest_runtest_teardown(item):
    if item.nodeid and getattr(item, "_toyllm_violations", None) is not None:
        sandbox.context.exercise, sandbox.context.forbidden = None, ()
        sandbox.context.deadline, sandbox.context.on_violation = None, None


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
