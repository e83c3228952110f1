"""Where the test suite's time goes: a pytest JUnit report, summed by file and by cause.

    .venv/bin/python -m pytest tests --junitxml=build/tests.xml ...
    .venv/bin/python .ci/test_times.py build/tests.xml [--top 25]

Prints two Markdown tables (docs/testing.md, "How long it takes, and where the time goes"): seconds by
cause and by file, each test's setup, call and teardown together. The cause of
a test is read from its markers and fixtures, collected again here (the report
has neither), the first that applies in this order: the browser, a notebook in
nbclient, the sandboxed grader, the engine's processes (gloo worker pools,
torchrun, the command line or a compiler in a subprocess), the real SmolLM2 in
this process, other ``slow`` tests (pip, an edition's build, long work in this
process), and everything else.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

import pytest

CAUSES = ("the browser", "notebooks in nbclient", "the sandboxed grader", "the engine's processes",
          "SmolLM2 in process", "other slow tests (pip, an edition's build, long work in process)", "in process")


class _Collector:
    """A pytest plugin that keeps each collected test's markers and fixture names."""

    def __init__(self):
        self.tests: dict[str, tuple[set[str], set[str]]] = {}

    def pytest_collection_modifyitems(self, items):
        for item in items:
            markers = {mark.name for mark in item.iter_markers()}
            self.tests[item.nodeid] = (markers, set(getattr(item, "fixturenames", ())))


def cause(markers: set[str], fixtures: set[str], slow: bool) -> str:
    if "browser" in markers:
        return CAUSES[0]
    if "notebook" in markers:
        return CAUSES[1]
    if "grader" in markers:
        return CAUSES[2]
    if "engine" in markers:
        return CAUSES[3]
    if any("smollm2" in name for name in fixtures):
        return CAUSES[4]
    if slow:
        return CAUSES[5]
    return CAUSES[6]


def read_report(path: Path) -> dict[str, float]:
    """nodeid -> seconds, from a JUnit report (pytest writes classname ``tests.test_x.Class`` and the name)."""
    seconds: dict[str, float] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        parts = case.get("classname", "").split(".")
        # the module path ends at the first part that starts with "test_" (then classes follow)
        end = next((i for i, part in enumerate(parts) if part.startswith("test_")), len(parts) - 1) + 1
        nodeid = "/".join(parts[:end]) + ".py::" + "::".join(parts[end:] + [case.get("name", "")])
        seconds[nodeid] = seconds.get(nodeid, 0.0) + float(case.get("time", 0) or 0)
    return seconds


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report", type=Path, help="pytest's --junitxml file")
    parser.add_argument("--top", type=int, default=25, help="files listed (the rest are summed in one row)")
    args = parser.parse_args(argv)
    seconds = read_report(args.report)
    collector = _Collector()
    listing = io.StringIO()
    with contextlib.redirect_stdout(listing):           # the collection's own listing is not part of the tables
        status = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", "tests"], plugins=[collector])
    if status != 0:
        print(listing.getvalue()[-3000:], file=sys.stderr)
        print(f"test_times: collecting the tests again failed (pytest exit {status}): causes unknown",
              file=sys.stderr)
    by_cause: dict[str, list[float]] = defaultdict(list)
    by_file: dict[str, list[float]] = defaultdict(list)
    for nodeid, took in seconds.items():
        markers, fixtures = collector.tests.get(nodeid, (set(), set()))
        by_cause[cause(markers, fixtures, "slow" in markers)].append(took)
        by_file[nodeid.split("::")[0]].append(took)
    total = sum(seconds.values())
    print(f"| cause | tests | seconds | share |\n|---|---:|---:|---:|")
    for name in CAUSES:
        if by_cause[name]:
            s = sum(by_cause[name])
            print(f"| {name} | {len(by_cause[name])} | {s:.0f} | {s / total:.0%} |")
    print(f"| all | {len(seconds)} | {total:.0f} | |\n")
    print(f"| file | tests | seconds | share |\n|---|---:|---:|---:|")
    ranked = sorted(by_file.items(), key=lambda kv: -sum(kv[1]))
    for name, times in ranked[:args.top]:
        print(f"| `{name}` | {len(times)} | {sum(times):.0f} | {sum(times) / total:.0%} |")
    rest = [t for _, times in ranked[args.top:] for t in times]
    if rest:
        print(f"| {len(ranked) - args.top} other files | {len(rest)} | {sum(rest):.0f} | {sum(rest) / total:.0%} |")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:          # the reader stopped early (`| head`): what it read is all it wanted
        # Python's own advice: point stdout at /dev/null, so the flush at exit cannot fail again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)
