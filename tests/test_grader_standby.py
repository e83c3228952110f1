"""Standbys forked from the grading process are what a fresh Python would be, and grade the same.

Where the grading process runs with Python's hash seed fixed and no other thread (``grade --class``
starts every student's grading so), it starts each lesson's trusted pytest process as a copy of itself
(``toyllm.grading.grader.standby.fork``) instead of a fresh Python that imports torch and pytest again.
What a copy could inherit is what matters here: the grading process's open files and pipes (the
reaper's, an earlier standby's), its environment, its signal handlers. Elsewhere (a notebook kernel has
threads; a hash seed left random) the standby is a fresh Python, as before.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parent.parent

# Grades lesson 01's first exercise with a standby left waiting, then reports on that standby.
SCRIPT = textwrap.dedent("""
    import json, os, signal, sys
    from toyllm.grading import grade
    from toyllm.grading.grader import run

    def pipes(pid):
        found = {}
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                found[int(fd)] = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                pass
        return found

    report = grade("solutions", only="1.1", keep_warm=True)
    standby = run._standby.proc
    mine = set(pipes(os.getpid()).values())
    theirs = pipes(standby.pid)
    print(json.dumps({
        "points": [report.score, report.max_score],
        "kind": type(standby).__name__,
        "pid": standby.pid,
        "shared": sorted(what for fd, what in theirs.items()
                         if what in mine and fd != 0 and what.startswith(("pipe:", "socket:"))),
        "session": os.getsid(standby.pid) == standby.pid,
    }), flush=True)
""")


def _grade_and_report(seed: str | None, kill: bool = False) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    if seed is not None:
        env["PYTHONHASHSEED"] = seed
    script = SCRIPT + ("os.kill(os.getpid(), signal.SIGKILL)\n" if kill else "")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=240, cwd=ROOT,
                         env=env)
    assert out.returncode == (-9 if kill else 0), out.stderr[-3000:]
    return json.loads(out.stdout.splitlines()[-1])


def _gone(pid: int) -> bool:
    deadline = time.monotonic() + 20
    while psutil.pid_exists(pid) and time.monotonic() < deadline:
        if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
            return True
        time.sleep(0.2)
    return not psutil.pid_exists(pid)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_with_a_fixed_hash_seed_the_standby_is_a_copy_that_shares_nothing_open():
    found = _grade_and_report("0")
    assert found["kind"] == "Forked", "a grading with PYTHONHASHSEED=0 forks its standbys"
    assert found["points"][0] == found["points"][1] > 0, found
    # Only its request pipe (descriptor 0) leads back to the grader: no reaper's pipe, no earlier standby's,
    # no socket of the grader's.
    assert found["shared"] == [], found
    assert found["session"], "the copy leads its own session, so ending its group ends all it started"
    assert _gone(found["pid"]), "the standby nobody claimed must end with its grader"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_random_hash_seed_gets_a_fresh_python_and_the_same_points():
    found = _grade_and_report(None)
    assert found["kind"] == "Popen", "a hash seed left random cannot be fixed in a copy: a fresh Python"
    assert found["points"][0] == found["points"][1] > 0, found
    assert _gone(found["pid"])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_forked_standby_dies_with_a_killed_grader():
    found = _grade_and_report("0", kill=True)
    assert found["kind"] == "Forked"
    assert _gone(found["pid"]), "SIGKILL runs no clean-up: the copy must end on its own (PR_SET_PDEATHSIG)"
