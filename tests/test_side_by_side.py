"""``make test`` runs tests side by side (pytest-xdist); a test marked ``alone`` meets no other (``side_by_side``).

A throwaway suite of one-second tests, run with ``-n 2`` in a subprocess: each test writes when it started and
ended. Without the mark, two of them overlap (so the run is really side by side and the check below can
fail); with it, no test overlaps an ``alone`` one.
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.library          # the test harness alone: no exercise runs here

TESTS = Path(__file__).resolve().parent

CONFTEST = f"""
import sys
sys.path.insert(0, {str(TESTS)!r})
from side_by_side import pytest_configure, pytest_runtest_protocol  # noqa: F401
"""

SUITE = """
import json, time, pytest

def _held(name):
    start = time.time()
    time.sleep(1.0)
    with open("spans.jsonl", "a") as f:
        f.write(json.dumps([name, start, time.time()]) + "\\n")

@pytest.mark.parametrize("i", range(4))
def test_beside(i):
    _held(f"beside-{i}")

@pytest.mark.parametrize("i", range(2))
def test_lone(i):
    _held(f"lone-{i}")
"""


def _spans(tmp_path: Path, mark_alone: bool) -> dict[str, tuple[float, float]]:
    suite = SUITE.replace("@pytest.mark.parametrize(\"i\", range(2))\ndef test_lone",
                          ("@pytest.mark.alone\n" if mark_alone else "") +
                          "@pytest.mark.parametrize(\"i\", range(2))\ndef test_lone")
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_suite.py").write_text(textwrap.dedent(suite))
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    alone: runs with no other test beside it\n")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "load", "-p", "no:cacheprovider",
                          "test_suite.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    spans = {}
    for line in (tmp_path / "spans.jsonl").read_text().splitlines():
        name, start, end = json.loads(line)
        spans[name] = (start, end)
    assert len(spans) == 6, spans
    return spans


def _overlapping(spans: dict[str, tuple[float, float]], name: str) -> list[str]:
    start, end = spans[name]
    return [other for other, (s, e) in spans.items() if other != name and s < end and start < e]


@pytest.mark.slow
@pytest.mark.skipif(sys.platform == "win32", reason="the lock between side-by-side tests is POSIX's flock")
@pytest.mark.timeout(300)
@pytest.mark.parametrize("mark_alone", [False, True], ids=["unmarked", "alone"])
def test_a_test_marked_alone_meets_no_other(tmp_path, mark_alone):
    spans = _spans(tmp_path, mark_alone)
    met = {name: _overlapping(spans, name) for name in spans if name.startswith("lone-")}
    if mark_alone:
        assert met == {"lone-0": [], "lone-1": []}, met
    else:
        assert any(met.values()), f"two processes, yet no test ran beside another: {spans}"


class _Item:
    """As much of a pytest item as the ordering reads: its file and its markers."""

    def __init__(self, path: str, **marks):
        self.path, self.marks = path, marks

    def get_closest_marker(self, name):
        if name not in self.marks:
            return None
        return pytest.mark.__getattr__(name)(*self.marks[name]).mark


def test_the_costliest_files_are_handed_out_first_a_takes_mark_counting_over_the_others():
    from side_by_side import UNMARKED_S, cost_s, costliest_files_first

    compile_ = _Item("compiled.py", slow=(), takes=(70,))
    assert cost_s(compile_) == 70 and cost_s(_Item("a.py", slow=(), engine=())) == 5.5
    assert cost_s(_Item("a.py")) == UNMARKED_S
    items = [_Item("small.py"), _Item("grader.py", grader=(), slow=()), _Item("small.py", engine=()), compile_,
             _Item("compiled.py")]
    config = type("Config", (), {"workerinput": {}})()
    costliest_files_first(config, items)
    assert [i.path for i in items] == ["compiled.py", "compiled.py", "grader.py", "small.py", "small.py"]
    assert items[0] is compile_                          # a file's tests keep their order
