"""Tests side by side (pytest-xdist, ``make test``'s ``-n 2``), and the ones that must run alone.

A test marked ``alone`` compares what exists on the whole machine before and after it: the processes, the
scratch folders in /tmp, the user ids in use. Another test running beside it would show up there, so while it
runs (its fixtures' setup and teardown included) no other test does, except the tests of ``make check``'s tier
(no marker of ``HEAVY``): those start no grading, sandbox or engine worker (``make check`` fails a test that
starts any process) and write only under pytest's own temporary folder, so they leave nothing an ``alone`` test
looks at. So do the files marked ``beside_alone``: files marked ``library`` too (a grading runs exercises, which
such a file cannot reach: ``toyllm.course.refuse_in_library_test``), none of whose tests is marked ``grader``,
``notebook`` or ``browser``; their engine workers and compilers are processes of this user, in no sandbox.

The worker processes share a
readers-writer lock: two files in a folder that the process that starts them makes (``pytest_configure``).

Waiting costs a core: while an ``alone`` test waits for the other process's test to end, and while it runs,
the other process can only run those tests. So the ``alone`` tests sit together in one file, which keeps
the lock from one to the next, and that file is handed out first, with the files that may run beside it after
it (``costliest_files_first``).

``tests/conftest.py`` installs the hooks; ``tests/test_side_by_side.py`` shows that an ``alone`` test meets no
other but a light one.
"""
from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import tempfile
from collections import defaultdict

import pytest

LOCKS_ENV = "TOYLLM_TEST_LOCKS"      # the folder of the lock files, inherited by the workers
# Roughly what a test costs (seconds on 2 cores), read from its markers; any other test: UNMARKED_S. A test that
# takes far longer than its markers say carries ``@pytest.mark.takes(seconds)`` instead.
COST_S = {"browser": 40.0, "slow": 5.0, "grader": 1.0, "engine": 0.5}
UNMARKED_S = 0.02
# The markers that take a test out of ``make check``'s tier (the Makefile's FAST_TIER leaves out each of them):
# a test with none of them is light, and may run beside an ``alone`` one.
HEAVY = ("slow", "engine", "grader", "notebook", "browser", "gpu")


def light(item) -> bool:
    """A test of ``make check``'s tier: none of the ``HEAVY`` markers, and not ``alone``."""
    return not any(item.get_closest_marker(name) for name in (*HEAVY, "alone"))


def beside_alone(item) -> bool:
    """Whether ``item`` may run while an ``alone`` test does: a light one, or one of a file marked ``beside_alone``."""
    return light(item) or item.get_closest_marker("beside_alone") is not None


def check_beside_alone(items) -> None:
    """A UsageError for a test marked ``beside_alone`` that could start a grading: its file is not marked
    ``library``, or the test is marked ``grader``, ``notebook``, ``browser`` or ``alone``."""
    for item in items:
        if item.get_closest_marker("beside_alone") is None:
            continue
        wrong = [name for name in ("grader", "notebook", "browser", "alone") if item.get_closest_marker(name)]
        if item.get_closest_marker("library") is None or wrong:
            raise pytest.UsageError(f"{item.nodeid} is marked beside_alone, so it must start no grading: its file "
                                    f"must be marked library and the test none of grader, notebook, browser or "
                                    f"alone{f' (it is marked {wrong[0]})' if wrong else ' (it is not library)'}")


def alone(item) -> bool:
    return item is not None and item.get_closest_marker("alone") is not None


def cost_s(item) -> float:
    """What ``item`` roughly costs, in seconds on the 2-core reference machine: its ``takes`` mark, else its markers'."""
    takes = item.get_closest_marker("takes")
    if takes is not None:
        return float(takes.args[0])
    return sum(s for name, s in COST_S.items() if item.get_closest_marker(name)) or UNMARKED_S


def pytest_configure(config):
    """In the process that starts pytest-xdist's workers: the folder for their locks, removed at its end."""
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        folder = tempfile.mkdtemp(prefix="pytest-side-by-side-")
        os.environ[LOCKS_ENV] = folder                     # the workers, started after this, inherit it
        atexit.register(shutil.rmtree, folder, ignore_errors=True)


def costliest_files_first(config, items) -> None:
    """In a worker: order the files by their cost, the costliest first, keeping each file's own order; but the
    files holding ``alone`` tests first of all, and the files whose every test may run beside them right after.

    Each worker is handed whole files in this order (``--dist loadfile --no-loadscope-reorder``): one process
    starts with the ``alone`` tests while the other runs the files that may run beside them (the compiled steps'
    file is the longest of those); then the longest ones (the browser's lessons, the grader's, the files of a
    long compile or 8k-token prefill) start at once instead of last, when the other process would have nothing
    left to do beside them.
    Both workers collect alike, so both order alike.
    """
    if not hasattr(config, "workerinput"):
        return
    cost: dict = defaultdict(float)
    has_alone: dict = defaultdict(bool)
    all_beside: dict = defaultdict(lambda: True)
    for item in items:
        cost[item.path] += cost_s(item)
        has_alone[item.path] |= alone(item)
        all_beside[item.path] &= beside_alone(item)
    # stable: a file's tests keep their order
    items.sort(key=lambda item: (not has_alone[item.path], not all_beside[item.path], -cost[item.path]))


@contextlib.contextmanager
def _locked(path: str, mode: int):
    import fcntl

    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, mode)                              # waits until granted; closing the file releases it
        yield
    finally:
        os.close(fd)


@contextlib.contextmanager
def room(folder: str, alone: bool):
    """Any number of tests side by side, or one ``alone``.

    A test to run alone takes the turnstile first, so that no other test starts while it waits for the running
    ones to end; every other test passes through the turnstile before it takes its shared place.
    """
    import fcntl

    turnstile, room_file = os.path.join(folder, "turnstile"), os.path.join(folder, "room")
    with contextlib.ExitStack() as held:
        with _locked(turnstile, fcntl.LOCK_EX):
            if alone:
                held.enter_context(_locked(room_file, fcntl.LOCK_EX))
        if not alone:
            held.enter_context(_locked(room_file, fcntl.LOCK_SH))
        yield


_held: contextlib.ExitStack | None = None   # the room, kept by an ``alone`` test for the next one that is alone too


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Under pytest-xdist, in a worker: a test marked ``alone`` runs with no other beside it but those that may
    (``beside_alone``).

    Only in the workers themselves (``workerinput``): the pytest processes the grader starts inherit the
    environment and load the same conftest, and must not wait for a lock their own test holds.
    """
    global _held
    folder = os.environ.get(LOCKS_ENV)
    if folder is None or not hasattr(item.config, "workerinput") or os.name != "posix" or beside_alone(item):
        yield
        return
    if not alone(item):
        with room(folder, alone=False):
            yield
        return
    if _held is None:
        _held = contextlib.ExitStack()
        _held.enter_context(room(folder, alone=True))
    try:
        yield
    finally:
        if not alone(nextitem):                  # this worker's next test is not alone: let the others in
            _held.close()
            _held = None
