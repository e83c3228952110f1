"""Checking again is quick, and still grades what the student has just written.

``check()`` leaves a standby pytest process with a sandbox started ahead
(``toyllm.grading.grader.run.Standby``, on Linux a copy of the grading's
template); the next check claims it. These tests prove that a claimed
standby grades the file as it is now (not as it was when the standby
started), that checks leave no zombie in the kernel, that a grading without
``keep_warm`` leaves no process behind, and that a standby nobody claims ends
with its grader.
A lesson's first cell calls ``prepare_check()``, which starts that standby
before the first check. The figures of how much quicker are measured by
``python -m toyllm.grading.grader.timing`` (docs/grading.md), never asserted here.
"""
from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from toyllm.grading import check, grade, prepare_check
from toyllm.grading.grader import run as grading_run

ROOT = Path(__file__).resolve().parent.parent
WRONG_31 = ("(B * D + D * F + B * F)", "(B * D + D * F)")        # forgets the output bytes


def _write(folder: Path, wrong: bool) -> Path:
    source = (ROOT / "solutions" / "ex03_rooflines.py").read_text()
    assert source.count(WRONG_31[0]) == 1
    (folder / "ex03_rooflines.py").write_text(source.replace(*WRONG_31) if wrong else source)
    return folder


def _standby_pid() -> int | None:
    s = grading_run._standby
    return s.proc.pid if s is not None and s.proc.poll() is None else None


@pytest.mark.grader
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_claimed_standby_grades_the_file_as_it_is_now(tmp_path):
    sub = _write(tmp_path, wrong=True)
    try:
        first = grade(sub, only="3.1", keep_warm=True)
        assert first.by_exercise()["3.1"] == (1, 2)          # one of the two tests catches the mistake
        waiting = _standby_pid()
        assert waiting is not None, "keep_warm leaves a standby process for the next check"
        _write(tmp_path, wrong=False)                      # the student fixes the mistake ...
        second = grade(sub, only="3.1", keep_warm=True)    # ... and checks again: the standby runs it
        assert second.by_exercise()["3.1"] == (2, 2)
        assert not psutil.pid_exists(waiting) or psutil.Process(waiting).status() == psutil.STATUS_ZOMBIE
        _write(tmp_path, wrong=True)
        assert grade(sub, only="3.1", keep_warm=True).by_exercise()["3.1"] == (1, 2)
    finally:
        grading_run.close_standby()
    assert _standby_pid() is None


@pytest.mark.grader
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_first_check_claims_the_process_prepare_check_started(tmp_path, capsys):
    sub = _write(tmp_path, wrong=True)
    try:
        prepare_check()
        prepared = grading_run._standby
        assert prepared is not None and prepared.proc.poll() is None, "prepare_check leaves a standby waiting"
        prepare_check()                                    # one is waiting: it stays, no second one starts
        assert grading_run._standby is prepared
        check("3.1", impl=sub)
        assert "Exercise 3.1: 1 / 2 points" in capsys.readouterr().out
        # claimed: it ran the lesson's pytest and exited with pytest's code (a test failed: 1); a standby
        # that did not fit would have been killed by a signal instead
        assert prepared.proc.wait(timeout=60) == 1
        assert _standby_pid() not in (None, prepared.proc.pid), "the check leaves the next standby"
    finally:
        grading_run.close_standby()
    assert _standby_pid() is None


def _zombies() -> set[int]:
    return {p.pid for p in psutil.Process().children() if p.status() == psutil.STATUS_ZOMBIE}


@pytest.mark.grader
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="copies of a template need a child subreaper (Linux)")
def test_checks_grade_in_copies_of_a_template_and_leave_no_zombie(tmp_path, capsys):
    """On Linux a kernel's checks are copies of one process that imported torch once (the grading's template),
    not fresh Pythons; the kernel becomes a child subreaper for them, so whatever dies below a check must have
    been waited for before it comes back to the kernel, which would never wait for it: below a check that ran,
    and below a standby ended unclaimed."""
    sub = _write(tmp_path, wrong=False)
    before = _zombies()
    try:
        prepare_check()
        assert grading_run._template.zygote is not None, "prepare_check starts the template its standby is copied from"
        for _ in range(3):
            check("3.1", impl=sub)
            assert capsys.readouterr().out.endswith("Exercise 3.1: 2 / 2 points\n")
        assert _standby_pid() is not None, "each check leaves a standby for the next"
        grading_run.close_standby(keep_template=True)      # ended unclaimed, as a kernel's other settings would
        time.sleep(1.0)                                    # what was ending has ended
        assert _zombies() - before == set()
    finally:
        grading_run.close_standby()
    assert _standby_pid() is None and grading_run._template.zygote is None


@pytest.mark.grader
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_grading_without_keep_warm_leaves_no_process(tmp_path):
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    report = grade("solutions", only=["3.1", "3.2"])
    assert report.by_exercise()["3.1"] == (2, 2)
    assert _standby_pid() is None
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before and p.is_running()
                and p.status() != psutil.STATUS_ZOMBIE]
        if not left:
            break
        time.sleep(0.2)
    assert not left, [p.cmdline() for p in left]


@pytest.mark.grader
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_standby_nobody_claims_ends_with_its_grader(tmp_path):
    """A notebook kernel that checked once and then exits: its standby and that standby's sandbox go too."""
    script = textwrap.dedent(f"""
        import os
        from toyllm.grading import grade
        from toyllm.grading.grader import run
        os.chdir({str(ROOT)!r})
        grade("solutions", only="3.1", keep_warm=True)
        print(run._standby.proc.pid, flush=True)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    pid = int(out.stdout.split()[-1])
    deadline = time.monotonic() + 20
    while psutil.pid_exists(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
