"""Sandboxes forked by the zygote (``toyllm.grading.sandbox.zygote``) hold nothing a fresh Python would not.

A zygote imports torch once and forks each sandbox from there. What a copy could inherit is what
matters: the zygote's control socket (with it a submission could ask for sandboxes of its own), the
modules it imported, and the state of Python's random numbers. What it prepares for every copy (toyllm's
answer marks, read from toyllm's own source; its objects frozen for the garbage collector) must be what
the copy would have computed itself. A zygote that dies must not stop a
grading: the next sandbox starts from a fresh Python, as it did before there was a zygote.
"""
from __future__ import annotations

import pytest

from toyllm.grading.sandbox import process
from toyllm.grading.sandbox.process import Sandbox, _Forked
from toyllm.grading.settings import Settings

from test_grader import ROOT

PROBES = '''import os, random, sys


def descriptors():
    """{descriptor: what it is}, as /proc says, without the one this listing opens."""
    found = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            found[int(name)] = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            pass
    return {fd: what for fd, what in found.items() if not what.startswith("/proc/")}


def modules_from(*folders):
    """The imported modules whose file lies under one of ``folders``."""
    return sorted(name for name, m in list(sys.modules.items())
                  if any(str(getattr(m, "__file__", None) or "").startswith(f) for f in folders))


def draw():
    return random.random()


def marks():
    from toyllm import answers
    return sorted(m.spec for m in answers.answer_marks().values())


def frozen():
    import gc
    return gc.get_freeze_count()
'''


@pytest.fixture
def sandbox(tmp_path, monkeypatch):
    submission = tmp_path / "submission"
    submission.mkdir()
    (submission / "ex01_naive_generation.py").write_text(PROBES)
    monkeypatch.setenv(Settings.variable("impl"), str(submission))
    monkeypatch.setattr(process.zygotes, "failed", False)
    # No spare sandbox started ahead from the zygote: a test that ran the grader's plugin in this process
    # may have left the grading context saying more exercises follow.
    monkeypatch.setattr(process.context, "more_exercises", False)
    box = Sandbox(memory_mb=4096)
    yield box
    box.close()


def _call(box: Sandbox, name: str, *args):
    box.load("ex01")
    return box.call(("exercise", "ex01", name), args, {}, f"{name}()")


@pytest.mark.grader
@pytest.mark.timeout(180)
def test_a_forked_sandbox_holds_its_own_socket_and_no_other(sandbox):
    found = _call(sandbox, "descriptors")
    assert isinstance(sandbox.proc, _Forked), "the sandbox did not come from the zygote"
    sockets = {fd: what for fd, what in found.items() if what.startswith("socket:")}
    assert list(sockets) == [3], f"the sandbox holds sockets {sockets}: the zygote's control socket must be closed"
    assert set(found) == {0, 1, 2, 3}, found


@pytest.mark.grader
@pytest.mark.timeout(180)
def test_a_forked_sandbox_has_no_module_of_the_tests_or_the_answers(sandbox):
    folders = [str(ROOT / "tests"), str(ROOT / "solutions")]
    assert _call(sandbox, "modules_from", *folders) == []


@pytest.mark.grader
@pytest.mark.timeout(180)
def test_each_forked_sandbox_draws_its_own_random_numbers(sandbox):
    first = _call(sandbox, "draw")
    sandbox.kill()                                  # the next call starts a new sandbox from the zygote
    second = _call(sandbox, "draw")
    assert isinstance(sandbox.proc, _Forked)
    assert first != second


@pytest.mark.grader
@pytest.mark.timeout(180)
def test_a_forked_sandbox_has_the_answer_marks_the_grader_reads_and_skips_the_zygotes_objects(sandbox):
    """The zygote reads the marks from toyllm's source and freezes what it imported, once for every copy."""
    from toyllm import answers

    assert _call(sandbox, "marks") == sorted(m.spec for m in answers.answer_marks().values())
    assert _call(sandbox, "frozen") > 10_000, "torch's objects are frozen: the copy's collections skip them"


@pytest.mark.grader
@pytest.mark.timeout(180)
def test_a_zygote_that_died_gives_way_to_a_fresh_python(sandbox):
    assert _call(sandbox, "draw") is not None and isinstance(sandbox.proc, _Forked)
    process.zygotes.zygote.proc.kill()
    process.zygotes.zygote.proc.wait()
    sandbox.kill()
    assert isinstance(_call(sandbox, "draw"), float)
    assert not isinstance(sandbox.proc, _Forked) and process.zygotes.zygote is None and process.zygotes.failed
