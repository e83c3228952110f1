"""The pytest plugin: ``--impl``, the ``exercise`` and ``points`` markers, and the grader's event log.

The repository's root ``conftest.py`` loads it, and the grader passes it to
every pytest process it starts. While grading, it writes one JSON line per
collected item, per test phase and per broken independence rule to the log
file the grader names; the grader turns those lines into scores. This
process is the trusted side: the submission runs in the sandbox
(``sandbox.py``), which never sees the log.

It also tells the sandbox (or the in-process rules) which exercise the
running test grades, which functions that exercise may not call (toyllm's
functions marked as its answer or a shortcut to it, ``toyllm.answers``) and
by when a call must be back (the test's timeout).
"""
from __future__ import annotations

import functools
import json
import os
import re
import time

from ... import answers
from ..sandbox import process as sandbox
from ...course import NAMED_IMPLS, current_impl, resolve_impl
from ..settings import Settings
from .report import EXERCISE_ID


def _settings() -> Settings:
    """What the grader set in this pytest process (``Settings.log``, ``lesson``, ``exercises``); the hooks read it."""
    return Settings.from_env(os.environ)


def pytest_addoption(parser):
    group = parser.getgroup("toyllm", "toyllm exercises")
    group.addoption("--impl", default=None, metavar="exercises|solutions|DIR",
                    help=f"implementation that load_exercise() returns "
                         f"(default: ${Settings.variable('impl')} or 'exercises')")


def pytest_configure(config):
    config.addinivalue_line("markers", "exercise(id): the graded exercise a test belongs to, e.g. '1.2'")
    config.addinivalue_line("markers", "points(n): points a graded test is worth (all or nothing)")
    config.addinivalue_line("markers", "needs(*ids): exercises the framework must run for this test, e.g. '2.1'; "
                                       "the student edition skips it until they are written")
    impl = config.getoption("--impl", default=None)
    if impl:
        try:
            folder = resolve_impl(impl)
        except ValueError as e:
            import pytest

            raise pytest.UsageError(str(e)) from None
        config._toyllm_previous_impl = _settings().impl
        os.environ.update(Settings(impl=impl if impl in NAMED_IMPLS else str(folder)).to_env())


def pytest_unconfigure(config):
    sandbox.close()
    if hasattr(config, "_toyllm_previous_impl"):
        previous = config._toyllm_previous_impl
        if previous is None:
            os.environ.pop(Settings.variable("impl"), None)
        else:
            os.environ.update(Settings(impl=previous).to_env())


def pytest_report_header(config):
    return f"toyllm exercises: implementation {current_impl()!r} (set {Settings.variable('impl')} or --impl)"


def exercise_of(item) -> str | None:
    """The exercise id ("1.2") of a collected test, from its ``exercise`` marker."""
    marker = item.get_closest_marker("exercise")
    return str(marker.args[0]) if marker and marker.args else None


def points_of(item) -> float | None:
    marker = item.get_closest_marker("points")
    return marker.args[0] if marker and marker.args else None


def _log(record: dict) -> None:
    path = _settings().log
    if path:
        with open(path, "a") as f:              # reopened per record: a crash loses nothing written
            f.write(json.dumps(record) + "\n")


def verdicts_before() -> dict[str, bool]:
    """{exercise: fails a graded test of its own} as the earlier lessons of this grading showed it
    (``Settings.verdicts``); empty outside the grader."""
    return {str(k): bool(v) for k, v in json.loads(_settings().verdicts or "{}").items()}


def log_failed_alone(exercise: str) -> None:
    """Tell the grader that ``exercise`` failed a graded test of its own that ran no other exercise: the next
    lessons' notes need not grade it again (``Settings.verdicts``)."""
    _log({"event": "failed alone", "exercise": exercise})


@functools.lru_cache(maxsize=None)
def _forbidden(exercise: str) -> tuple[str, ...]:
    """What a submission may not call while graded on ``exercise``: toyllm's marked answers and shortcuts."""
    return tuple(answers.forbidden(exercise))


def pytest_collection_modifyitems(session, config, items):
    settings = _settings()
    if not settings.log:
        return
    problems = []
    lesson = settings.lesson
    exercises = set(filter(None, (settings.exercises or "").split(",")))
    selected, deselected, records = [], [], []
    for item in items:
        ex, pts = exercise_of(item), points_of(item)
        if ex is None or not EXERCISE_ID.match(ex) or not isinstance(pts, (int, float)) or pts <= 0:
            problems.append(item.nodeid)
            continue
        keep = (lesson is None or int(ex.split(".")[0]) == int(lesson)) and (not exercises or ex in exercises)
        (selected if keep else deselected).append(item)
        records.append({"nodeid": item.nodeid, "name": item.name, "path": str(item.path),
                        "exercise": ex, "points": pts, "selected": keep})
    if problems:
        import pytest

        raise pytest.UsageError("graded tests need @pytest.mark.exercise('N.M') and @pytest.mark.points(P > 0); "
                                f"problems with: {problems}")
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
    needs = item.get_closest_marker("needs")
    if needs is not None:
        try:
            answers.require(*needs.args)
        except answers.ExerciseNotWritten as e:
            import pytest

            pytest.skip(str(e))
    ex = exercise_of(item)
    timeout = _timeout_of(item)
    sandbox.context.exercise = ex
    sandbox.context.forbidden = _forbidden(ex) if ex else ()
    sandbox.context.deadline = time.monotonic() + timeout - 1.0 if timeout else None
    later = item.session.items[item.session.items.index(item) + 1:] if item in item.session.items else []
    sandbox.context.more_exercises = any(exercise_of(other) not in (None, ex) for other in later)
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


# What a test meets in the student edition before the exercise it needs is written.
_NEEDS = re.compile(r"[A-Z][^\n:]*? needs Exercise \d+\.\d+: write \w+ in [\w./-]+")
_STUB = re.compile(r"Exercise (\d+\.\d+): implement (\w+)")


@_wrapper
def pytest_runtest_makereport(item, call):
    """In the student edition, a test that needs an unwritten exercise is skipped with its name, not failed.

    Never while grading: there a stub scores zero.
    """
    report = yield
    if not report.failed or answers.EDITION != "student" or _settings().log:
        return report
    text = str(report.longrepr)
    needs, stub = _NEEDS.search(text), _STUB.search(text)
    if needs or stub:
        reason = needs[0] if needs else f"needs Exercise {stub[1]}: write {stub[2]}"
        report.outcome = "skipped"
        report.longrepr = (str(item.path), item.location[1] or 0, f"Skipped: {reason}")
    return report


def pytest_runtest_teardown(item):
    if item.nodeid and getattr(item, "_toyllm_violations", None) is not None:
        sandbox.context.exercise, sandbox.context.forbidden = None, ()
        sandbox.context.deadline, sandbox.context.on_violation = None, None


def pytest_runtest_logreport(report):
    if not _settings().log:
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
