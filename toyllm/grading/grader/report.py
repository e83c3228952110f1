"""What grading found: one ``TestResult`` per graded test, a ``GradeReport`` with tables and Gradescope's format."""
from __future__ import annotations

import json
import os
import re
import tempfile
import textwrap
from dataclasses import dataclass, field
from pathlib import Path


_STUB = re.compile(r"(?:NotImplementedError: )?(Exercise \d+\.\d+: implement \w+.*)")
# C0 and C1 control characters but newline and tab (ESC starts every terminal escape sequence; CR
# overwrites a line), DEL, and Unicode's bidirectional overrides, which reorder what a line shows.
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def printable(text: str) -> str:
    """``text`` with every control character but newline and tab written as a visible escape (``\\x1b``).

    What a submission printed or raised reaches the instructor's terminal and results.json; written out,
    an escape sequence cannot move the cursor, erase lines or draw a forged table.
    """
    return _CONTROL.sub(lambda m: repr(m[0])[1:-1] if ord(m[0]) < 0x100 else f"\\u{ord(m[0]):04x}", text)


def explain(test: "TestResult", indent: str = "  ", width: int = 100) -> str:
    """What a student reads about a test that did not pass: its whole message, wrapped to ``width`` columns.

    An unwritten exercise reads "not written yet", followed by the stub's hint. The command line
    and ``check()`` both print this, so they say the same words.
    """
    text = test.output.strip() or test.status
    stub = _STUB.search(text)
    if stub and "NotImplementedError" in text:
        text = "not written yet: " + stub[1]
    out = []
    for line in text.splitlines():
        lead = line[:len(line) - len(line.lstrip())]
        out.append(textwrap.fill(line.strip(), width, initial_indent=indent + lead,
                                 subsequent_indent=indent + lead + "  ", break_long_words=True,
                                 break_on_hyphens=False) if line.strip() else "")
    return "\n".join(out)


def format_points(x: float) -> str:
    """Points as a person writes them: 3, 2.50."""
    return str(int(x)) if float(x).is_integer() else f"{x:.2f}"


EXERCISE_ID = re.compile(r"^(\d+)\.(\d+)$")        # "3.2": an exercise's number, as the ``exercise`` marker gives it


def exercise_key(ex: str) -> tuple[int, int]:
    """"3.10" sorts after "3.9"."""
    major, minor = ex.split(".")
    return int(major), int(minor)


@dataclass
class TestResult:
    """One graded test: all of ``max_score`` when it passed, else 0."""

    __test__ = False           # not a pytest test class, despite its name

    name: str                  # "Exercise 1.2: test_ex1_2_top_k_one_is_argmax"
    nodeid: str
    exercise: str              # "1.2"
    score: float
    max_score: float
    status: str                # passed | failed | error | timeout | skipped | crashed
    output: str = ""
    hidden: bool = False       # came from the instructor's extra tests

    def __post_init__(self):
        # Every outcome enters the report here, so nothing a submission wrote reaches a terminal unescaped.
        self.name, self.output = printable(self.name), printable(self.output)

    @property
    def lesson(self) -> int:
        return int(self.exercise.split(".")[0])


@dataclass
class GradeReport:
    impl: str
    tests: list[TestResult] = field(default_factory=list)
    execution_time_s: float = 0.0
    isolation: str = ""        # who ran the submission (sandbox.isolation())
    notes: list[str] = field(default_factory=list)     # submitted files not graded, and why (submission.py)

    @property
    def score(self) -> float:
        return sum(t.score for t in self.tests)

    @property
    def max_score(self) -> float:
        return sum(t.max_score for t in self.tests)

    def by_exercise(self) -> dict[str, tuple[float, float]]:
        """{"1.2": (score, max_score), ...} in exercise order."""
        out: dict[str, list[float]] = {}
        for t in sorted(self.tests, key=lambda t: exercise_key(t.exercise)):
            row = out.setdefault(t.exercise, [0, 0])
            row[0] += t.score
            row[1] += t.max_score
        return {k: (v[0], v[1]) for k, v in out.items()}

    def by_lesson(self) -> dict[int, tuple[float, float]]:
        out: dict[int, list[float]] = {}
        for ex, (s, m) in self.by_exercise().items():
            row = out.setdefault(int(ex.split(".")[0]), [0, 0])
            row[0] += s
            row[1] += m
        return {k: (v[0], v[1]) for k, v in out.items()}

    def table(self, show_hidden: bool = True) -> str:
        """A plain-text table: one row per exercise, a subtotal per lesson, the total, then what failed.

        show_hidden=False (what a student may see) names no hidden test and
        shows none of its messages: only that one of an exercise did not pass.
        """
        lines = [f"implementation: {self.impl}", *([self.isolation] if self.isolation else []), *self.notes,
                 f"{'exercise':<10}{'score':>8}{'max':>6}  tests passed"]
        exercises = self.by_exercise()
        for lesson, (lesson_score, lesson_max) in self.by_lesson().items():
            for ex, (s, m) in exercises.items():
                if int(ex.split(".")[0]) == lesson:
                    tests = [t for t in self.tests if t.exercise == ex]
                    passed = sum(t.status == "passed" for t in tests)
                    lines.append(f"{ex:<10}{format_points(s):>8}{format_points(m):>6}  {passed}/{len(tests)}")
            lines.append(f"{'ex%02d' % lesson:<10}{format_points(lesson_score):>8}{format_points(lesson_max):>6}  (lesson total)")
        lines.append(f"{'TOTAL':<10}{format_points(self.score):>8}{format_points(self.max_score):>6}")
        failed = [t for t in self.tests if t.status != "passed"]
        if failed:
            lines.append("")
            lines.append("not passed:")
            for t in failed:
                if t.hidden and not show_hidden:
                    lines.append(f"  a hidden test of Exercise {t.exercise} [{t.status}]")
                    continue
                lines.append(f"  {t.name} [{t.status}]:")
                lines.append(explain(t, indent="    "))
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def __repr__(self) -> str:
        return f"GradeReport(impl={self.impl!r}, score={format_points(self.score)}/{format_points(self.max_score)}, tests={len(self.tests)})"

    def to_gradescope(self) -> dict:
        """The report in Gradescope's results.json format (extra tests are shown after grades are published)."""
        return {
            "score": self.score,
            "max_score": self.max_score,
            "execution_time": round(self.execution_time_s, 3),
            "output": self.table(show_hidden=False),        # shown to the student at once
            "visibility": "visible",
            "stdout_visibility": "hidden",
            "tests": [{"name": t.name, "number": t.exercise, "score": t.score, "max_score": t.max_score,
                       "status": "passed" if t.status == "passed" else "failed", "output": t.output,
                       "visibility": "after_published" if t.hidden else "visible"}
                      for t in self.tests],
        }

    def write(self, path: str | os.PathLike) -> Path:
        """Write results.json atomically: a new file replaces whatever was there (even a file someone else made)."""
        path = Path(path)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".results-", suffix=".json")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(self.to_gradescope(), indent=2) + "\n")
            os.replace(tmp, path)
        except BaseException:            # a folder in the way, a full disk: no stray temporary file stays
            os.unlink(tmp)
            raise
        return path
