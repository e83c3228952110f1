"""Exercises and automatic grading.

Three pieces live here.

1. **Which implementation runs.** Every lesson's exercises exist twice with
   the same signatures: ``exercises/exNN_*.py`` (stubs the learner fills in)
   and ``solutions/exNN_*.py`` (model answers). ``load_exercise("ex01")``
   returns the module of the implementation chosen by the ``TOYLLM_IMPL``
   environment variable: ``exercises`` (the default), ``solutions``, or the
   path of a folder holding a student's ``exNN_*.py`` files. Notebooks and
   graded tests reach exercise code *only* through ``load_exercise``; in
   pytest, ``--impl`` overrides the variable.

2. **Stubs from solutions.** A model answer sits between two marker
   comments inside a function body::

       # BEGIN SOLUTION 1.2 hint: divide by the temperature, then torch.multinomial
       ...
       # END SOLUTION

   ``make_stub`` replaces each marked region by
   ``raise NotImplementedError("Exercise 1.2: implement <function> (hint: ...)")``
   and keeps everything else (signatures, docstrings). ``python -m
   toyllm.grading sync`` rewrites ``exercises/`` from ``solutions/``;
   ``sync --check`` only reports files that are out of date.

3. **The grader.** Graded tests live in ``tests/grading/test_exNN_*.py`` and
   carry ``@pytest.mark.exercise("N.M")`` and ``@pytest.mark.points(P)``.
   ``grade()`` runs pytest in one subprocess per lesson, so a submission that
   kills its interpreter (``os._exit``, a segfault) only loses that lesson's
   unfinished tests, and a per-test timeout stops infinite loops. Each test
   scores all of its points or none. The result is a table per exercise and
   a ``results.json`` in the Gradescope format. Instructors add hidden tests
   with ``extra_tests=DIR`` (same markers; they call ``load_exercise`` too).

Command line::

    python -m toyllm.grading grade [--impl exercises|solutions|DIR] [--only ex01]
                                   [--extra-tests DIR] [--results results.json] [--timeout S]
    python -m toyllm.grading sync [--check] [--force]

(``python -m toyllm grade ...`` takes the same options.)

This module is also the pytest plugin that registers ``--impl`` and the two
markers (the repository's root ``conftest.py`` loads it), and that records
each test's outcome while the grader runs.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

REPO_ROOT = Path(__file__).resolve().parent.parent
EXERCISES_DIR = REPO_ROOT / "exercises"
SOLUTIONS_DIR = REPO_ROOT / "solutions"
GRADING_TESTS_DIR = REPO_ROOT / "tests" / "grading"

IMPL_ENV = "TOYLLM_IMPL"
DEFAULT_IMPL = "exercises"
NAMED_IMPLS = {"exercises": EXERCISES_DIR, "solutions": SOLUTIONS_DIR}

# Set by the grader in each pytest subprocess; the plugin below reads them.
_LOG_ENV = "TOYLLM_GRADE_LOG"          # file the plugin appends one JSON line per event to
_LESSON_ENV = "TOYLLM_GRADE_LESSON"    # run only tests of this lesson (an int)
_EXERCISES_ENV = "TOYLLM_GRADE_EXERCISES"   # and, if set, only these exercises ("1.2,1.3")

_EXERCISE_ID = re.compile(r"^(\d+)\.(\d+)$")


# =========================================================================== 1. choosing the implementation

def resolve_impl(impl: str | os.PathLike | None = None) -> Path:
    """The folder of implementation ``impl`` (default: ``$TOYLLM_IMPL``, else ``exercises``).

    ``"exercises"`` and ``"solutions"`` name the repository's folders; any
    other value is a path to a folder (relative to the current directory)
    that holds ``exNN_*.py`` files.
    """
    if impl is None:
        impl = os.environ.get(IMPL_ENV) or DEFAULT_IMPL
    impl = str(impl)
    if impl in NAMED_IMPLS:
        folder = NAMED_IMPLS[impl]
    else:
        folder = Path(impl).expanduser().resolve()
    if not folder.is_dir():
        raise ValueError(f"implementation {impl!r} is not a folder; use 'exercises', 'solutions' or the path "
                         f"of a folder that holds exNN_*.py files (set with {IMPL_ENV} or --impl)")
    return folder


def current_impl() -> str:
    """The implementation ``load_exercise`` uses now: ``exercises``, ``solutions`` or a folder path."""
    return os.environ.get(IMPL_ENV) or DEFAULT_IMPL


def _exercise_file(folder: Path, name: str) -> Path:
    """``folder/exNN_*.py`` for ``name`` = "ex01", "ex01_naive_generation" or "1"."""
    stem = name[:-3] if name.endswith(".py") else name
    if stem.isdigit():
        stem = f"ex{int(stem):02d}"
    if not re.fullmatch(r"ex\d\d(_\w+)?", stem):
        raise ValueError(f"exercise module name must look like 'ex01' or 'ex01_naive_generation', got {name!r}")
    exact = folder / f"{stem}.py"
    if exact.is_file():
        return exact
    matches = sorted(folder.glob(f"{stem}_*.py")) if len(stem) == 4 else []
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise ValueError(f"no file for exercise module {name!r} in {folder} (expected {stem}_*.py)")
    raise ValueError(f"exercise module {name!r} is ambiguous in {folder}: {[m.name for m in matches]}")


_loaded: dict[Path, tuple[tuple[int, int], ModuleType]] = {}


def load_exercise(name: str, impl: str | os.PathLike | None = None) -> ModuleType:
    """The module ``name`` ("ex01" or "ex01_naive_generation") of the chosen implementation.

    impl: "exercises", "solutions" or a folder; by default ``$TOYLLM_IMPL``
    (``exercises`` when unset). This is THE way notebooks and tests reach
    exercise code, so that one switch decides whose code runs.

    The file is imported from its path (no change to ``sys.path``) under a
    private module name. A file edited since its last load is loaded again,
    so re-running a notebook cell picks up your latest code.
    """
    path = _exercise_file(resolve_impl(impl), name)
    stat = path.stat()
    stamp = (stat.st_mtime_ns, stat.st_size)
    cached = _loaded.get(path)
    if cached is not None and cached[0] == stamp:
        return cached[1]
    tag = path.parent.name if path.parent in NAMED_IMPLS.values() else \
        "dir_" + hashlib.sha1(str(path.parent).encode()).hexdigest()[:8]
    module_name = f"_toyllm_{tag}_{path.stem}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module       # what the import system does too (dataclasses, pickling need it)
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(module_name, None)
        raise
    _loaded[path] = (stamp, module)
    return module


# =========================================================================== 2. stubs from solutions

_BEGIN = re.compile(r"^(?P<indent>[ \t]*)# BEGIN SOLUTION(?P<rest>.*)$")
_END = re.compile(r"^[ \t]*# END SOLUTION\s*$")
_BEGIN_REST = re.compile(r"^ (?P<id>\d+\.\d+)(?: hint: (?P<hint>.+?))?\s*$")
_DEF = re.compile(r"^(?P<indent>[ \t]*)(?:async )?def (?P<name>\w+)\s*\(")


def make_stub(source: str) -> str:
    """The exercise version of a solution file: each marked model answer becomes a NotImplementedError.

    A region starts at ``# BEGIN SOLUTION N.M hint: ...`` (hint optional)
    and ends at ``# END SOLUTION``; both lines and everything between them
    are replaced by one ``raise NotImplementedError("Exercise N.M: implement
    <function> (hint: ...)")`` at the marker's indentation. The function is
    the nearest enclosing ``def``. Raises ValueError for unbalanced or
    malformed markers, naming the line.
    """
    lines = source.splitlines(keepends=True)
    out: list[str] = []
    region_start = None       # line number of an open BEGIN
    for no, line in enumerate(lines, start=1):
        text = line.rstrip("\r\n")
        begin, end = _BEGIN.match(text), _END.match(text)
        if begin:
            if region_start is not None:
                raise ValueError(f"line {no}: BEGIN SOLUTION inside the region opened on line {region_start}")
            rest = _BEGIN_REST.match(begin["rest"])
            if rest is None:
                raise ValueError(f"line {no}: expected '# BEGIN SOLUTION N.M hint: ...', got {text.strip()!r}")
            indent = begin["indent"]
            func = _enclosing_function(lines[:no - 1], indent)
            if func is None:
                raise ValueError(f"line {no}: a solution region must sit inside a function body")
            message = f"Exercise {rest['id']}: implement {func}"
            if rest["hint"]:
                message += f" (hint: {rest['hint']})"
            out.append(_raise_statement(indent, message))
            region_start = no
        elif end:
            if region_start is None:
                raise ValueError(f"line {no}: END SOLUTION without a BEGIN SOLUTION before it")
            region_start = None
        elif region_start is None:
            out.append(line)
    if region_start is not None:
        raise ValueError(f"line {region_start}: BEGIN SOLUTION is never closed by END SOLUTION")
    return "".join(out)


def _raise_statement(indent: str, message: str, width: int = 100) -> str:
    """``raise NotImplementedError("...")``, its message split over several string literals if long."""
    one_line = f"{indent}raise NotImplementedError({_quote(message)})\n"
    if len(one_line) <= width + 1:
        return one_line
    inner = indent + " " * 4
    chunks = textwrap.wrap(message, width - len(inner) - 2, break_long_words=False, drop_whitespace=False)
    body = "\n".join(inner + _quote(c) for c in chunks)
    return f"{indent}raise NotImplementedError(\n{body})\n"


def _quote(text: str) -> str:
    """A double-quoted Python string literal of ``text``."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _enclosing_function(previous_lines: list[str], indent: str) -> str | None:
    for line in reversed(previous_lines):
        m = _DEF.match(line)
        if m and len(m["indent"]) < len(indent):
            return m["name"]
    return None


def _stubs(source: str) -> dict[str, str]:
    """{exercise id: function} of the stubs (``raise NotImplementedError("Exercise N.M: implement f``) in ``source``."""
    found = re.findall(r"raise NotImplementedError\(\s*['\"]Exercise (\d+\.\d+): implement (\w+)", source)
    return dict(found)


def sync(check: bool = False, force: bool = False, solutions_dir: Path = SOLUTIONS_DIR,
         exercises_dir: Path = EXERCISES_DIR) -> list[Path]:
    """Write ``exercises/`` from ``solutions/`` (every ``*.py``); returns the files that were (or would be) changed.

    check: change nothing, only report. Without ``force`` a file whose stubs
    were already replaced by someone's work is left alone (ValueError), so a
    learner cannot wipe out their answers by running this by mistake.
    """
    changed = []
    for sol in sorted(solutions_dir.glob("*.py")):
        target = exercises_dir / sol.name
        new = make_stub(sol.read_text())
        old = target.read_text() if target.exists() else None
        if old == new:
            continue
        changed.append(target)
        if check:
            continue
        # A function that is in the old file but no longer raises its stub has been answered by someone.
        answered = set() if old is None else {
            ex for ex, func in _stubs(new).items()
            if ex not in _stubs(old) and re.search(rf"^\s*def {func}\(", old, re.MULTILINE)}
        if answered and not force:
            raise ValueError(f"{target} holds answers to exercise(s) {sorted(answered)} instead of their stubs; "
                             f"not overwriting it. Pass --force to replace it anyway")
        target.write_text(new)
    return changed


# =========================================================================== 3a. the pytest plugin

def pytest_addoption(parser):
    group = parser.getgroup("toyllm", "toyllm exercises")
    group.addoption("--impl", default=None, metavar="exercises|solutions|DIR",
                    help=f"implementation that load_exercise() returns (default: ${IMPL_ENV} or 'exercises')")


def pytest_configure(config):
    config.addinivalue_line("markers", "exercise(id): the graded exercise a test belongs to, e.g. '1.2'")
    config.addinivalue_line("markers", "points(n): points a graded test is worth (all or nothing)")
    impl = config.getoption("--impl", default=None)
    if impl:
        try:
            folder = resolve_impl(impl)
        except ValueError as e:
            import pytest

            raise pytest.UsageError(str(e)) from None
        config._toyllm_previous_impl = os.environ.get(IMPL_ENV)
        os.environ[IMPL_ENV] = impl if impl in NAMED_IMPLS else str(folder)


def pytest_unconfigure(config):
    if hasattr(config, "_toyllm_previous_impl"):
        previous = config._toyllm_previous_impl
        if previous is None:
            os.environ.pop(IMPL_ENV, None)
        else:
            os.environ[IMPL_ENV] = previous


def pytest_report_header(config):
    return f"toyllm exercises: implementation {current_impl()!r} (set {IMPL_ENV} or --impl)"


def exercise_of(item) -> str | None:
    """The exercise id ("1.2") of a collected test, from its ``exercise`` marker."""
    marker = item.get_closest_marker("exercise")
    return str(marker.args[0]) if marker and marker.args else None


def points_of(item) -> float | None:
    marker = item.get_closest_marker("points")
    return marker.args[0] if marker and marker.args else None


def _log(record: dict) -> None:
    path = os.environ.get(_LOG_ENV)
    if path:
        with open(path, "a") as f:              # reopened per record: a crash loses nothing written
            f.write(json.dumps(record) + "\n")


def pytest_collection_modifyitems(session, config, items):
    if not os.environ.get(_LOG_ENV):
        return
    lesson = os.environ.get(_LESSON_ENV)
    exercises = set(filter(None, os.environ.get(_EXERCISES_ENV, "").split(",")))
    selected, deselected, records, problems = [], [], [], []
    for item in items:
        ex, pts = exercise_of(item), points_of(item)
        if ex is None or not _EXERCISE_ID.match(ex) or not isinstance(pts, (int, float)) or pts <= 0:
            problems.append(item.nodeid)
            continue
        keep = (lesson is None or int(ex.split(".")[0]) == int(lesson)) and (not exercises or ex in exercises)
        (selected if keep else deselected).append(item)
        records.append({"nodeid": item.nodeid, "name": item.name, "path": str(item.path),
                        "exercise": ex, "points": pts, "selected": keep})
    if problems:
        import pytest

        raise pytest.UsageError("graded tests need @pytest.mark.exercise('N.M') and @pytest.mark.points(P > 0); "
                                f"missing or malformed on: {problems}")
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = selected
    _log({"event": "collected", "items": records})


def pytest_runtest_logreport(report):
    if not os.environ.get(_LOG_ENV):
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


# =========================================================================== 3b. the grader

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

    @property
    def lesson(self) -> int:
        return int(self.exercise.split(".")[0])


@dataclass
class GradeReport:
    impl: str
    tests: list[TestResult] = field(default_factory=list)
    execution_time_s: float = 0.0

    @property
    def score(self) -> float:
        return sum(t.score for t in self.tests)

    @property
    def max_score(self) -> float:
        return sum(t.max_score for t in self.tests)

    def by_exercise(self) -> dict[str, tuple[float, float]]:
        """{"1.2": (score, max_score), ...} in exercise order."""
        out: dict[str, list[float]] = {}
        for t in sorted(self.tests, key=lambda t: _exercise_key(t.exercise)):
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

    def table(self) -> str:
        """A plain-text table: one row per exercise, a subtotal per lesson, the total, then what failed."""
        lines = [f"implementation: {self.impl}", f"{'exercise':<10}{'score':>8}{'max':>6}  tests passed"]
        exercises = self.by_exercise()
        for lesson, (lesson_score, lesson_max) in self.by_lesson().items():
            for ex, (s, m) in exercises.items():
                if int(ex.split(".")[0]) == lesson:
                    tests = [t for t in self.tests if t.exercise == ex]
                    passed = sum(t.status == "passed" for t in tests)
                    lines.append(f"{ex:<10}{_num(s):>8}{_num(m):>6}  {passed}/{len(tests)}")
            lines.append(f"{'ex%02d' % lesson:<10}{_num(lesson_score):>8}{_num(lesson_max):>6}  (lesson total)")
        lines.append(f"{'TOTAL':<10}{_num(self.score):>8}{_num(self.max_score):>6}")
        failed = [t for t in self.tests if t.status != "passed"]
        if failed:
            lines.append("")
            lines.append("not passed:")
            for t in failed:
                first = t.output.strip().splitlines()[0] if t.output.strip() else t.status
                lines.append(f"  {t.name} [{t.status}]: {first[:160]}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def __repr__(self) -> str:
        return f"GradeReport(impl={self.impl!r}, score={_num(self.score)}/{_num(self.max_score)}, tests={len(self.tests)})"

    def to_gradescope(self) -> dict:
        """The report in Gradescope's results.json format (extra tests are shown after grades are published)."""
        return {
            "score": self.score,
            "max_score": self.max_score,
            "execution_time": round(self.execution_time_s, 3),
            "output": self.table(),
            "visibility": "visible",
            "stdout_visibility": "hidden",
            "tests": [{"name": t.name, "number": t.exercise, "score": t.score, "max_score": t.max_score,
                       "status": "passed" if t.status == "passed" else "failed", "output": t.output,
                       "visibility": "after_published" if t.hidden else "visible"}
                      for t in self.tests],
        }

    def write(self, path: str | os.PathLike) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.to_gradescope(), indent=2) + "\n")
        return path


class GradingError(RuntimeError):
    """Grading could not run at all (a broken test suite, not a broken submission)."""


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:.2f}"


def _exercise_key(ex: str) -> tuple[int, int]:
    major, minor = ex.split(".")
    return int(major), int(minor)


def _lesson_of(name: str | int) -> int:
    """1 for "ex01", "ex01_naive_generation", "01", "1", 1 or an exercise id like "1.2"."""
    m = re.fullmatch(r"(?:ex)?(\d+)(?:_\w+|\.\d+)?", str(name).strip())
    if m is None:
        raise ValueError(f"--only takes lessons like 'ex01' or exercises like '1.2', got {name!r}")
    return int(m[1])


def _lesson_files(folder: Path) -> dict[int, Path]:
    files = {}
    for path in sorted(folder.glob("test_ex[0-9][0-9]*.py")):
        files[int(path.name[7:9])] = path
    return files


def grade(impl: str | os.PathLike = "exercises", only: str | list[str] | None = None,
          extra_tests: str | os.PathLike | None = None, results_path: str | os.PathLike | None = None,
          per_test_timeout_s: float = 20, verbose: bool = False) -> GradeReport:
    """Run the graded tests against ``impl`` and score them.

    impl: "exercises", "solutions" or a folder with a student's exNN_*.py files.
    only: lessons or single exercises to grade, e.g. "ex01", "ex01,ex03", "1.2" or
      ["ex01", "3.4"] (default: all). An exercise id grades just that exercise.
    extra_tests: a folder of the instructor's hidden tests, marked like the
      others; they run in the subprocess of the lesson their exercise ids name.
    results_path: where to write the Gradescope results.json (None: don't).
    per_test_timeout_s: seconds after which a test fails as timed out.
    verbose: print one progress line per lesson.

    One pytest subprocess per lesson. A test whose process died before the
    test finished scores 0 with status "crashed".
    """
    if per_test_timeout_s <= 0:
        raise ValueError(f"per_test_timeout_s must be positive seconds, got {per_test_timeout_s}")
    impl_dir = resolve_impl(impl)
    impl_env = str(impl) if str(impl) in NAMED_IMPLS else str(impl_dir)
    extra_dir = None
    if extra_tests is not None:
        extra_dir = Path(extra_tests).expanduser().resolve()
        if not extra_dir.is_dir():
            raise ValueError(f"extra tests folder {str(extra_tests)!r} does not exist")
    local = _lesson_files(GRADING_TESTS_DIR)
    wanted, only_exercises = None, {}
    if only is not None:
        names = str(only).split(",") if isinstance(only, (str, int)) else only
        wanted = {_lesson_of(x) for x in names}
        exercise_ids = {str(x).strip() for x in names if _EXERCISE_ID.match(str(x).strip())}
        # a lesson asked for as a whole is graded whole, even if one of its exercises is also named
        whole = {_lesson_of(x) for x in names if not _EXERCISE_ID.match(str(x).strip())}
        only_exercises = {n: {e for e in exercise_ids if _lesson_of(e) == n} for n in wanted - whole}
    if results_path is not None and not Path(results_path).expanduser().resolve().parent.is_dir():
        raise ValueError(f"--results {results_path}: the folder {Path(results_path).expanduser().resolve().parent} "
                         "does not exist; create it first")
    pending = sorted(set(local) | (set(_lesson_files(extra_dir)) if extra_dir else set()))
    if only is not None:
        known = _graded_exercise_ids(list(local.values()) + (list(extra_dir.rglob("test_*.py")) if extra_dir else []))
        missing = sorted({e for e in exercise_ids if e not in known}, key=_exercise_key)
        if missing:
            raise ValueError(f"no graded tests for exercise(s) {missing}; graded exercises: "
                             f"{sorted(known, key=_exercise_key)}")
    if wanted is not None:
        unknown = wanted - set(pending)
        if unknown:
            raise ValueError(f"no graded tests for lesson(s) {sorted(unknown)}; graded lessons: "
                             f"{['ex%02d' % n for n in pending]}")
        pending = sorted(wanted)
    if not pending:
        raise GradingError(f"no graded tests found in {GRADING_TESTS_DIR}")

    report = GradeReport(impl=impl_env)
    start = time.perf_counter()
    done: set[int] = set()
    with tempfile.TemporaryDirectory(prefix="toyllm-grade-") as tmp:
        while pending:
            lesson = pending.pop(0)
            files = [local[lesson]] if lesson in local else []
            results, seen_lessons = _run_lesson(lesson, files, extra_dir, impl_env, per_test_timeout_s, Path(tmp),
                                                only_exercises.get(lesson))
            done.add(lesson)
            report.tests.extend(results)
            # Hidden tests may name a lesson without a local test file: give it its own run too.
            for other in sorted(seen_lessons - done - set(pending)):
                if wanted is None or other in wanted:
                    pending.append(other)
            if verbose:
                s, m = sum(t.score for t in results), sum(t.max_score for t in results)
                print(f"graded ex{lesson:02d}: {_num(s)}/{_num(m)} points, {len(results)} tests", flush=True)
    report.tests.sort(key=lambda t: (t.lesson, t.hidden))
    report.execution_time_s = time.perf_counter() - start
    if results_path is not None:
        report.write(results_path)
    return report


def check(exercise: str, impl: str | os.PathLike | None = None) -> float:
    """Grade one exercise from a notebook cell: one line per graded test, then the points; returns them.

    ``check("2.1")`` runs just Exercise 2.1's graded tests against the
    current implementation (``TOYLLM_IMPL``, default your ``exercises/``),
    so the notebook keeps running whatever your function does.
    """
    report = grade(impl if impl is not None else current_impl(), only=exercise)
    for t in report.tests:
        mark = "ok  " if t.status == "passed" else "FAIL"
        why = "" if t.status == "passed" else ": " + (t.output.strip().splitlines() or [t.status])[0][:200]
        if "NotImplementedError" in why:
            why = ": not written yet"
        print(f"  {mark} {t.name.split(': ', 1)[-1]} ({_num(t.max_score)} point(s)){why}")
    print(f"Exercise {exercise}: {_num(report.score)} / {_num(report.max_score)} points")
    return report.score


def _graded_exercise_ids(files) -> set[str]:
    """Exercise ids named by ``@pytest.mark.exercise("N.M")`` in these test files."""
    ids = set()
    for path in files:
        ids |= set(re.findall(r"""mark\.exercise\(\s*["'](\d+\.\d+)["']\s*\)""", Path(path).read_text()))
    return ids


def _run_lesson(lesson: int, files: list[Path], extra_dir: Path | None, impl_env: str,
                timeout_s: float, tmp: Path, exercises: set[str] | None = None) -> tuple[list[TestResult], set[int]]:
    """One pytest subprocess for one lesson; returns its results and every lesson its collection saw."""
    log = tmp / f"ex{lesson:02d}.jsonl"
    out = tmp / f"ex{lesson:02d}.out"
    cmd = [sys.executable, "-m", "pytest", *map(str, files), *([str(extra_dir)] if extra_dir else []),
           "-p", "toyllm.grading", "-p", "no:cacheprovider", f"--timeout={timeout_s:g}", "-q", "--no-header",
           "--import-mode=importlib", f"--rootdir={REPO_ROOT}", "-o", "console_output_style=classic"]
    env = dict(os.environ, **{IMPL_ENV: impl_env, _LOG_ENV: str(log), _LESSON_ENV: str(lesson),
                              _EXERCISES_ENV: ",".join(sorted(exercises or ())), "PYTHONHASHSEED": "0",
                              "PYTHONDONTWRITEBYTECODE": "1"})   # no __pycache__ beside a submission
    with open(out, "wb") as sink:
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            # Tests that start worker processes carry their own, longer timeout marks: give them room.
            stalled = _watch(proc, log, timeout_s + 90)
        except BaseException:          # Ctrl-C or SIGTERM to the grader: end the test process group too
            _kill_group(proc)
            raise
    events = _read_log(log)
    tail = out.read_text(errors="replace")[-3000:]
    collected = [e for e in events if e["event"] == "collected"]
    if not collected:
        raise GradingError(f"pytest could not collect the graded tests of ex{lesson:02d} (exit code "
                           f"{proc.returncode}):\n{tail}")
    items = collected[-1]["items"]
    seen_lessons = {int(i["exercise"].split(".")[0]) for i in items}
    phases: dict[str, dict[str, dict]] = {}
    for e in events:
        if e["event"] == "report":
            phases.setdefault(e["nodeid"], {})[e["when"]] = e
    results = []
    first_crash = True
    for item in items:
        if not item["selected"]:
            continue
        started = item["nodeid"] in phases
        status, output = _outcome(phases.get(item["nodeid"], {}))
        if status == "crashed":
            if stalled and started:
                status = "timeout"
                output = f"stopped: the test process made no progress for {stalled:.0f} s and was killed"
            elif stalled:
                output = "crashed: not run, the test process had to be killed during an earlier test"
            elif first_crash:
                output = (f"crashed: the test process exited (code {proc.returncode}) during this test; look for "
                          f"os._exit, a segfault or a killed process in the code under test. Last output:\n"
                          f"{tail[-800:]}")
            else:
                output = "crashed: not run, the test process had died during an earlier test"
            first_crash = False
        hidden = extra_dir is not None and Path(item["path"]).is_relative_to(extra_dir)
        name = f"Exercise {item['exercise']}: {item['name']}" + (" (hidden)" if hidden else "")
        results.append(TestResult(name=name, nodeid=item["nodeid"], exercise=item["exercise"],
                                  score=item["points"] if status == "passed" else 0, max_score=item["points"],
                                  status=status, output=output, hidden=hidden))
    return results, seen_lessons


def _kill_group(proc: subprocess.Popen) -> None:
    """End ``proc`` and everything it started (it leads its own session)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def _watch(proc: subprocess.Popen, log: Path, timeout_s: float) -> float:
    """Wait for ``proc``; kill its process group if it stops making progress. Returns the stall in seconds (0: none).

    pytest-timeout interrupts a slow test after ``timeout_s``; this is the
    backstop for code it cannot interrupt (a hang inside a C call).
    """
    startup_s, stall_s = 180.0, 2 * timeout_s + 30
    last_size, last_change = -1, time.monotonic()
    while True:
        try:
            proc.wait(timeout=0.2)
            return 0.0
        except subprocess.TimeoutExpired:
            pass
        size = log.stat().st_size if log.exists() else 0
        now = time.monotonic()
        if size != last_size:
            last_size, last_change = size, now
        if now - last_change > (stall_s if size else startup_s):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
            return now - last_change


def _read_log(log: Path) -> list[dict]:
    events = []
    if log.exists():
        for line in log.read_text().splitlines():
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:      # a line cut short by a crash
                pass
    return events


def _outcome(phases: dict[str, dict]) -> tuple[str, str]:
    setup, call, teardown = phases.get("setup"), phases.get("call"), phases.get("teardown")
    if setup and setup["outcome"] == "failed":
        return "error", setup["message"]
    if setup and setup["outcome"] == "skipped":
        return "skipped", "skipped: " + setup["message"]
    if call is None or teardown is None:
        return "crashed", ""
    if call["outcome"] == "failed":
        timeout = "Timeout (>" in call["message"]
        return ("timeout" if timeout else "failed"), call["message"]
    if call["outcome"] == "skipped":
        return "skipped", "skipped: " + call["message"]
    if teardown["outcome"] == "failed":
        return "error", teardown["message"]
    return "passed", "passed"


# =========================================================================== command line

def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of the ``grade`` command (shared by ``python -m toyllm grade``)."""
    parser.add_argument("--impl", default="exercises", metavar="exercises|solutions|DIR",
                        help="implementation to grade: the exercises, the model answers or a student's folder")
    parser.add_argument("--only", action="append", metavar="exNN|N.M",
                        help="grade only this lesson or exercise (repeatable, or comma-separated), "
                             "e.g. --only ex01 or --only 1.2")
    parser.add_argument("--extra-tests", default=None, metavar="DIR",
                        help="folder of additional (hidden) graded tests, marked like tests/grading")
    parser.add_argument("--results", default=None, metavar="PATH",
                        help="also write the Gradescope-format results to this file (default: none)")
    parser.add_argument("--timeout", type=float, default=20, metavar="S",
                        help="seconds after which one test fails as timed out (default: 20)")


def main(args: argparse.Namespace) -> int:
    """Grade, print the table, write the results file. Exit code 0 whenever grading ran, whatever the score."""
    only = None
    if args.only:
        only = [part for chunk in args.only for part in chunk.split(",") if part.strip()]
    # SIGTERM (a CI job cancelled, a container stopped) unwinds like Ctrl-C, so the test processes end too.
    signal.signal(signal.SIGTERM, lambda signum, frame: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        report = grade(args.impl, only=only, extra_tests=args.extra_tests, results_path=args.results,
                       per_test_timeout_s=args.timeout, verbose=True)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except GradingError as e:
        print(f"grading failed: {e}", file=sys.stderr)
        return 1
    print(report.table())
    if args.results:
        print(f"\nwrote {args.results}")
    return 0


def _cli(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m toyllm.grading", description="Grade exercises; keep stubs in sync.")
    sub = parser.add_subparsers(dest="command", required=True)
    add_arguments(sub.add_parser("grade", help="run the graded tests and score them"))
    s = sub.add_parser("sync", help="write exercises/ from solutions/ (stubs from model answers)")
    s.add_argument("--check", action="store_true", help="change nothing; exit 1 if exercises/ is out of date")
    s.add_argument("--force", action="store_true", help="overwrite exercise files even if they hold answers")
    args = parser.parse_args(argv)
    if args.command == "grade":
        return main(args)
    try:
        changed = sync(check=args.check, force=args.force)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for path in changed:
        print(("out of date: " if args.check else "wrote ") + str(path.relative_to(REPO_ROOT)))
    if args.check and changed:
        print("run `python -m toyllm.grading sync` to update exercises/", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(_cli())
