"""``make test`` runs tests side by side (pytest-xdist); a test marked ``alone`` meets no other but a light one
(``side_by_side``).

A throwaway suite run with ``-n 2 --dist loadfile`` in a subprocess: each test writes when it started and
ended. One file holds two ``lone`` tests (2 s each); the other two light tests (0.5 s, no marker) and then four
tests marked ``slow`` (1 s). Without the mark, the slow tests run beside the lone ones (so the run is really
side by side and the check below can fail); with it, no slow test overlaps a lone one, none starts between the
two (the room is kept from one ``alone`` test to the next), and a light test does run beside one.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.library          # the test harness alone: no exercise runs here

TESTS = Path(__file__).resolve().parent

CONFTEST = f"""
import sys
sys.path.insert(0, {str(TESTS)!r})
from side_by_side import pytest_configure, pytest_runtest_protocol  # noqa: F401
"""

HELD = """
import json, time, pytest

def _held(name, seconds):
    start = time.time()
    time.sleep(seconds)
    with open("spans.jsonl", "a") as f:
        f.write(json.dumps([name, start, time.time()]) + "\\n")
"""

LONE = HELD + """
{mark}@pytest.mark.parametrize("i", range(2))
def test_lone(i):
    _held(f"lone-{{i}}", 2.0)
"""

OTHERS = HELD + """
@pytest.mark.parametrize("i", range(2))
def test_light(i):
    _held(f"light-{i}", 0.5)

@pytest.mark.slow
@pytest.mark.parametrize("i", range(4))
def test_heavy(i):
    _held(f"heavy-{i}", 1.0)
"""


def _spans(tmp_path: Path, mark_alone: bool) -> dict[str, tuple[float, float]]:
    (tmp_path / "conftest.py").write_text(CONFTEST)
    # loadfile hands out the files in this (alphabetical) order: the lone tests to one process, the rest to the other
    (tmp_path / "test_a_lone.py").write_text(LONE.format(mark="@pytest.mark.alone\n" if mark_alone else ""))
    (tmp_path / "test_b_others.py").write_text(OTHERS)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    alone: runs with no other test beside it\n"
                                         "    slow: takes seconds\n")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadfile", "-p",
                          "no:cacheprovider", "test_a_lone.py", "test_b_others.py"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    spans = {}
    for line in (tmp_path / "spans.jsonl").read_text().splitlines():
        name, start, end = json.loads(line)
        spans[name] = (start, end)
    assert len(spans) == 8, spans
    return spans


def _overlapping(spans: dict[str, tuple[float, float]], name: str) -> list[str]:
    start, end = spans[name]
    return sorted(other for other, (s, e) in spans.items() if other != name and s < end and start < e)


@pytest.mark.slow
@pytest.mark.skipif(sys.platform == "win32", reason="the lock between side-by-side tests is POSIX's flock")
@pytest.mark.timeout(300)
@pytest.mark.parametrize("mark_alone", [False, True], ids=["unmarked", "alone"])
def test_a_test_marked_alone_meets_no_other_but_a_light_one(tmp_path, mark_alone):
    spans = _spans(tmp_path, mark_alone)
    met = {name: [o for o in _overlapping(spans, name) if o.startswith("heavy-")] for name in ("lone-0", "lone-1")}
    if not mark_alone:
        assert any(met.values()), f"two processes, yet no slow test ran beside a lone one: {spans}"
        return
    assert met == {"lone-0": [], "lone-1": []}, met
    lone_end = max(spans["lone-0"][1], spans["lone-1"][1])
    early = [name for name, (start, _) in spans.items() if name.startswith("heavy-") and start < lone_end]
    assert not early, f"slow tests started between the two alone ones (the room was let go): {early}, {spans}"
    beside = {o for name in ("lone-0", "lone-1") for o in _overlapping(spans, name)}
    assert beside & {"light-0", "light-1"}, f"no light test ran beside an alone one: {spans}"


class _Item:
    """As much of a pytest item as the ordering reads: its file and its markers."""

    def __init__(self, path: str, **marks):
        self.path, self.nodeid, self.marks = path, path, marks

    def get_closest_marker(self, name):
        if name not in self.marks:
            return None
        return SimpleNamespace(name=name, args=tuple(self.marks[name]))     # what the ordering reads of a mark


def test_the_alone_file_goes_first_then_the_files_beside_it_then_the_costliest_a_takes_mark_counting_over_the_others():
    from side_by_side import UNMARKED_S, cost_s, costliest_files_first

    compile_ = _Item("compiled.py", slow=(), takes=(70,))
    assert cost_s(compile_) == 70 and cost_s(_Item("a.py", slow=(), engine=())) == 5.5
    assert cost_s(_Item("a.py")) == UNMARKED_S
    items = [_Item("small.py"), _Item("grader.py", grader=(), slow=()), _Item("small.py", engine=()), compile_,
             _Item("light.py"), _Item("compiled.py"), _Item("isolation.py", alone=(), slow=()), _Item("light.py"),
             _Item("isolation.py", alone=()), _Item("launch.py", library=(), beside_alone=(), engine=(), slow=()),
             _Item("launch.py", library=(), beside_alone=())]
    config = type("Config", (), {"workerinput": {}})()
    costliest_files_first(config, items)
    assert [i.path for i in items] == ["isolation.py", "isolation.py", "launch.py", "launch.py", "light.py", "light.py",
                                       "compiled.py", "compiled.py", "grader.py", "small.py", "small.py"]
    assert items[6] is compile_                          # a file's tests keep their order


def test_a_file_beside_the_alone_tests_must_be_library_and_start_no_grading():
    from side_by_side import check_beside_alone

    check_beside_alone([_Item("launch.py", library=(), beside_alone=(), engine=()), _Item("a.py", grader=())])
    for marks, why in [({}, "it is not library"), ({"library": (), "grader": ()}, "it is marked grader"),
                       ({"library": (), "notebook": ()}, "it is marked notebook")]:
        with pytest.raises(pytest.UsageError, match=f"a.py is marked beside_alone, so it must start no grading.*{why}"):
            check_beside_alone([_Item("a.py", beside_alone=(), **marks)])


def test_a_light_test_is_one_of_make_checks_tier():
    """``side_by_side.HEAVY`` names exactly the markers that the Makefile's FAST_TIER leaves out."""
    import re

    from side_by_side import HEAVY, light

    makefile = (TESTS.parent / "Makefile").read_text()
    tier = re.search(r"^FAST_TIER := (.+)$", makefile, re.M)[1]
    assert tier == " and ".join(f"not {name}" for name in HEAVY), tier
    assert light(_Item("a.py")) and light(_Item("a.py", library=()))
    assert not any(light(_Item("a.py", **{name: ()})) for name in (*HEAVY, "alone"))
