"""Standbys copied from the grading's template are what a fresh Python would be, and grade the same.

``grade`` on the command line starts one template (``toyllm.grading.sandbox.zygote``: a fresh Python that
imported torch and toyllm's framework, nothing of the tests) and takes a copy of it for each lesson's
trusted pytest process (``toyllm.grading.grader.standby.from_template``); the copy forks its lesson's
sandbox zygote from itself before it loads the grader. What a copy could inherit is what matters: the
template's control socket (with it a copy could ask for more), the grading process's pipes, its session.
``grade()`` from Python (a notebook's ``check``) starts a fresh Python, as before.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parent.parent

# Grades Exercise 1.1 with a standby left waiting, then reports on that standby.
SCRIPT = textwrap.dedent("""
    import json, os, signal, sys
    import psutil
    from toyllm.grading import grade
    from toyllm.grading.grader import run

    def open_files(pid):
        found = {}
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                found[int(fd)] = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                pass
        return found

    report = grade("solutions", only="1.1", keep_warm=True, template=sys.argv[1] == "template")
    standby = run._standby.proc
    mine = set(open_files(os.getpid()).values())
    template = run._template.zygote
    if template is not None:
        mine |= set(open_files(template.proc.pid).values())
    me = psutil.Process(standby.pid)
    children = me.children()
    print(json.dumps({
        "points": [report.score, report.max_score],
        "kind": type(standby).__name__,
        "name": me.name(),
        "pid": standby.pid,
        "template": template.proc.pid if template is not None else None,
        "shared": sorted(what for fd, what in open_files(standby.pid).items()
                         if what in mine and fd != 0 and what.startswith(("pipe:", "socket:"))),
        "session": os.getsid(standby.pid) == standby.pid,
        "children": len(children),
        "children_copies": all(c.cmdline() == me.cmdline() for c in children),
    }), flush=True)
    if sys.argv[2] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
""")


def _grade_and_report(how: str, then: str = "exit") -> dict:
    out = subprocess.run([sys.executable, "-c", SCRIPT, how, then], capture_output=True, text=True, timeout=240,
                         cwd=ROOT)
    assert out.returncode == (-signal.SIGKILL if then == "kill" else 0), out.stderr[-3000:]
    return json.loads(out.stdout.splitlines()[-1])


def _gone(pid: int) -> bool:
    deadline = time.monotonic() + 20
    while psutil.pid_exists(pid) and time.monotonic() < deadline:
        if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
            return True
        time.sleep(0.2)
    return not psutil.pid_exists(pid)


@pytest.mark.grader
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_standby_copied_from_the_template_shares_nothing_open_and_forks_its_own_zygote():
    found = _grade_and_report("template")
    assert found["kind"] == "_Forked", "grade(template=True) takes its standbys from the template"
    assert found["name"] == "toyllm-lesson", "ps shows what the copy is (its command line is the template's)"
    assert found["points"][0] == found["points"][1] > 0, found
    # Only its request pipe (descriptor 0) leads back: no pipe of the grading process, not the template's socket.
    assert found["shared"] == [], found
    assert found["session"], "the copy leads its own session, so ending its group ends all it started"
    # Its children (its lesson's zygote, and the sandbox started ahead) are copies too, none a fresh Python:
    # each runs the command line the template was started with.
    assert found["children"] >= 1 and found["children_copies"], found
    assert _gone(found["pid"]) and _gone(found["template"]), "both end with the grading that started them"


@pytest.mark.grader
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_without_the_template_a_standby_is_a_fresh_python_and_grades_the_same():
    found = _grade_and_report("fresh")
    assert found["kind"] == "Popen" and found["template"] is None
    assert found["children"] >= 1 and not found["children_copies"], found
    assert found["points"][0] == found["points"][1] > 0, found
    assert _gone(found["pid"])


@pytest.mark.grader
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_copied_standby_and_its_template_die_with_a_killed_grader():
    found = _grade_and_report("template", then="kill")
    assert found["kind"] == "_Forked"
    assert _gone(found["pid"]) and _gone(found["template"]), "SIGKILL runs no clean-up: they must end on their own"


@pytest.mark.grader
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_token_in_the_graders_environment_is_in_no_page_a_sandbox_can_read(tmp_path):
    """The template, the standby copied from it and the sandbox copied from that start with the grading's own
    variables and ``Settings``' ``PASSED_ON`` only: a sandbox finds nothing of the instructor's shell."""
    token = "instructor-token-" + os.urandom(12).hex()
    shifted = token.encode().translate(bytes((i + 1) % 256 for i in range(256)))
    source = (ROOT / "solutions" / "ex03_rooflines.py").read_text()
    reader = (ROOT / "tests" / "fixtures" / "submissions" / "reading_memory" / "ex03_rooflines.py").read_text()
    (tmp_path / "ex03_rooflines.py").write_text(f"{source}\n\nSHIFTED = {shifted!r}\n\n{reader}")
    script = textwrap.dedent("""
        import json, sys
        from toyllm.grading import grade
        report = grade(sys.argv[1], only="3.1", template=True)
        print(json.dumps([t.output for t in report.tests]))
    """)
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True,
                         timeout=240, cwd=ROOT, env={**os.environ, "INSTRUCTOR_TOKEN": token})
    assert out.returncode == 0, out.stderr[-3000:]
    said = json.loads(out.stdout.splitlines()[-1])
    assert said and all("the token is nowhere in this process" in text for text in said), said
