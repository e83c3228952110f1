"""The grader: one trusted pytest process per lesson, every test all of its points or none.

Graded tests live in ``tests/grading/test_exNN_*.py`` and carry
``@pytest.mark.exercise("N.M")`` and ``@pytest.mark.points(P)``. ``grade()``
copies them (and the instructor's hidden tests) into a private folder and
runs pytest there, one process per lesson. The submission never runs in
that process: its functions run in a sandbox process (``sandbox.py``) that
cannot read the tests, the log or the results. A call that hangs or
crashes costs the test that made it; a broken independence rule costs the
whole exercise. The result is a table per exercise and, if asked, a
``results.json`` in the Gradescope format. Instructors add hidden tests
with ``extra_tests=DIR`` (same markers).
"""
from __future__ import annotations

import ctypes
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from .course import course_root, grading_tests_dir
from .impl import IMPL_ENV, NAMED_IMPLS, current_impl, resolve_impl
from .course import COURSE_ENV
from .plugin import EXERCISE_ID, EXERCISES_ENV, LESSON_ENV, LOG_ENV
from .sandbox import DEFAULT_MEMORY_MB, MEMORY_ENV, SANDBOX_ENV, TIMEOUT_ENV, HIDE_ENV, namespaces_work, sandbox_user, isolation



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
    isolation: str = ""        # who ran the submission (sandbox.isolation())

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
        lines = [f"implementation: {self.impl}", *([self.isolation] if self.isolation else []),
                 f"{'exercise':<10}{'score':>8}{'max':>6}  tests passed"]
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
        """Write results.json atomically: a new file replaces whatever was there (even a file someone else made)."""
        path = Path(path)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".results-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(self.to_gradescope(), indent=2) + "\n")
        os.replace(tmp, path)
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
          per_test_timeout_s: float = 20, verbose: bool = False,
          memory_limit_mb: int = DEFAULT_MEMORY_MB) -> GradeReport:
    """Run the graded tests against ``impl`` and score them.

    impl: "exercises", "solutions" or a folder with a student's exNN_*.py files.
    only: lessons or single exercises to grade, e.g. "ex01", "ex01,ex03", "1.2" or
      ["ex01", "3.4"] (default: all). An exercise id grades just that exercise.
    extra_tests: a folder of the instructor's hidden tests, marked like the
      others; they run in the subprocess of the lesson their exercise ids name.
    results_path: where to write the Gradescope results.json (None: don't).
    per_test_timeout_s: seconds after which a test fails as timed out.
    verbose: print one progress line per lesson.
    memory_limit_mb: address-space limit of the submission's process (MiB).

    One pytest subprocess per lesson, one sandbox process for the
    submission beside it. A test whose call crashed the submission's process
    scores 0 with status "crashed"; one whose call did not return in time,
    status "timeout".
    """
    if per_test_timeout_s <= 0:
        raise ValueError(f"per_test_timeout_s must be positive seconds, got {per_test_timeout_s}")
    if memory_limit_mb < 1024:
        raise ValueError(f"memory_limit_mb must be at least 1024 (torch alone maps hundreds of MiB), "
                         f"got {memory_limit_mb}")
    impl_dir = resolve_impl(impl)
    impl_env = str(impl) if str(impl) in NAMED_IMPLS else str(impl_dir)
    extra_dir = None
    if extra_tests is not None:
        extra_dir = Path(extra_tests).expanduser().resolve()
        if not extra_dir.is_dir():
            raise ValueError(f"extra tests folder {str(extra_tests)!r} does not exist")
        if sandbox_user() is not None and not namespaces_work() and _open_to_others(extra_dir):
            raise ValueError(f"the hidden tests in {extra_dir} can be read by every user, so also by the "
                             f"submission (it runs as an unprivileged user): chmod -R o-rwx {extra_dir}")
    local = _lesson_files(grading_tests_dir())
    wanted, only_exercises = None, {}
    if only is not None:
        names = str(only).split(",") if isinstance(only, (str, int)) else only
        wanted = {_lesson_of(x) for x in names}
        exercise_ids = {str(x).strip() for x in names if EXERCISE_ID.match(str(x).strip())}
        # a lesson asked for as a whole is graded whole, even if one of its exercises is also named
        whole = {_lesson_of(x) for x in names if not EXERCISE_ID.match(str(x).strip())}
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
        raise GradingError(f"no graded tests found in {grading_tests_dir()}")

    report = GradeReport(impl=impl_env, isolation=isolation())
    start = time.perf_counter()
    done: set[int] = set()
    with tempfile.TemporaryDirectory(prefix="toyllm-grade-") as tmp:      # mode 0700: the grader's alone
        tmp = Path(tmp)
        private_local, private_extra = _private_copy_of_tests(tmp, extra_dir)
        settings = dict(impl_env=impl_env, timeout_s=per_test_timeout_s, tmp=tmp, memory_mb=memory_limit_mb,
                        extra_dir_original=extra_dir)
        while pending:
            lesson = pending.pop(0)
            files = [private_local / local[lesson].name] if lesson in local else []
            results, seen_lessons = _run_lesson(lesson, files, private_extra, exercises=only_exercises.get(lesson),
                                                **settings)
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


def _open_to_others(folder: Path) -> bool:
    """True when users other than the owner can reach ``folder``'s files (every parent and it are o+x)."""
    for part in (folder, *folder.parents):
        if not part.stat().st_mode & stat.S_IXOTH:
            return False
    return True


def _private_copy_of_tests(tmp: Path, extra_dir: Path | None) -> tuple[Path, Path | None]:
    """Copy the graded tests (and hidden ones) into the grader's own folder: what runs cannot be swapped."""
    source = grading_tests_dir()
    local = tmp / "tests" / "grading"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(source, local, ignore=ignore)
    shared = source.parent / "conftest.py"              # tests/conftest.py: fixtures the graded tests share
    if shared.is_file():
        shutil.copyfile(shared, tmp / "tests" / "conftest.py")
    private_extra = None
    if extra_dir is not None:
        private_extra = tmp / "hidden"
        shutil.copytree(extra_dir, private_extra, ignore=ignore)
    return local, private_extra


def _end_with_parent() -> None:
    """In the pytest child, before exec: die if the grader dies (a SIGKILL to it leaves nothing behind)."""
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)       # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _run_lesson(lesson: int, files: list[Path], extra_dir: Path | None, impl_env: str, timeout_s: float,
                tmp: Path, memory_mb: int, exercises: set[str] | None = None,
                extra_dir_original: Path | None = None) -> tuple[list[TestResult], set[int]]:
    """One pytest subprocess for one lesson; returns its results and every lesson its collection saw."""
    log = tmp / f"ex{lesson:02d}.jsonl"
    out = tmp / f"ex{lesson:02d}.out"
    cmd = [sys.executable, "-m", "pytest", *map(str, files), *([str(extra_dir)] if extra_dir else []),
           "-p", "toyllm.grading.plugin", "-p", "no:cacheprovider", f"--timeout={timeout_s:g}", "-q", "--no-header",
           "--import-mode=importlib", f"--rootdir={tmp}", "-c", os.devnull, "-o", "console_output_style=classic"]
    env = dict(os.environ, **{IMPL_ENV: impl_env, LOG_ENV: str(log), LESSON_ENV: str(lesson),
                              EXERCISES_ENV: ",".join(sorted(exercises or ())), "PYTHONHASHSEED": "0",
                              "PYTHONDONTWRITEBYTECODE": "1",      # no __pycache__ beside a submission
                              COURSE_ENV: str(course_root()), SANDBOX_ENV: "1", TIMEOUT_ENV: f"{timeout_s:g}",
                              MEMORY_ENV: str(memory_mb),
                              HIDE_ENV: os.pathsep.join(str(p) for p in (grading_tests_dir().parent, extra_dir_original,
                                                                         tmp) if p is not None)})
    with open(out, "wb") as sink:
        proc = subprocess.Popen(cmd, cwd=tmp, env=env, stdout=sink, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=_end_with_parent)
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
    violated = {}
    for e in events:
        if e["event"] == "violation":
            violated.setdefault(e["exercise"], e["message"])
    results = []
    first_crash = True
    for item in items:
        if not item["selected"]:
            continue
        started = item["nodeid"] in phases
        status, output = _outcome(phases.get(item["nodeid"], {}))
        if item["exercise"] in violated:                 # the independence rule costs the whole exercise
            status, output = "failed", violated[item["exercise"]]
        if status == "died":
            status = "crashed"
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
        hidden = extra_dir is not None and Path(item["path"]).resolve().is_relative_to(extra_dir.resolve())
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


def _classify(message: str, default: str) -> tuple[str, str]:
    """(status, message a student can act on) of a failed phase."""
    for prefix in ("AssertionError: ", "Failed: ", "toyllm.grading.guard.IndependenceError: "):
        message = message.removeprefix(prefix)
    for name, status in (("SubmissionTimeout", "timeout"), ("SubmissionCrash", "crashed"),
                         ("SubmissionError", default)):
        prefix = f"toyllm.grading.sandbox.{name}: "
        if message.startswith(prefix):
            return status, message.removeprefix(prefix)
    if "Timeout (>" in message:
        return "timeout", message
    return default, message


def _outcome(phases: dict[str, dict]) -> tuple[str, str]:
    setup, call, teardown = phases.get("setup"), phases.get("call"), phases.get("teardown")
    if setup and setup["outcome"] == "failed":
        return _classify(setup["message"], "error")
    if setup and setup["outcome"] == "skipped":
        return "skipped", "skipped: " + setup["message"]
    if call is None or teardown is None:
        return "died", ""                    # the test process itself ended during this test
    if call["outcome"] == "failed":
        return _classify(call["message"], "failed")
    if call["outcome"] == "skipped":
        return "skipped", "skipped: " + call["message"]
    if teardown["outcome"] == "failed":
        return "error", teardown["message"]
    return "passed", "passed"
