"""Running one lesson's graded tests: a trusted pytest process in the grader's private folder, watched."""
from __future__ import annotations

import atexit
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ...supervise import become_subreaper, child_options, signal_group
from ...course import course_root, grading_tests_dir, solutions_dir
from .outcome import outcome, read_log
from .report import TestResult, printable
from ..sandbox.process import Zygote, ZygoteSlot
from ..settings import Settings


class GradingError(RuntimeError):
    """Grading could not run at all (a broken test suite, not a broken submission)."""


def open_to_others(folder: Path) -> bool:
    """True when users other than the owner can reach ``folder``'s files (every parent and it are o+x)."""
    for part in (folder, *folder.parents):
        if not part.stat().st_mode & stat.S_IXOTH:
            return False
    return True


def needed_by_sandbox() -> list[Path]:
    """The folders the sandbox runs from: the course, Python and what it imports, the temporary folder."""
    paths = [course_root(), Path(sys.prefix), Path(sys.base_prefix), Path(sys.exec_prefix),
             Path(sys.executable).parent, Path(tempfile.gettempdir())]
    paths += [Path(p) for p in sys.path if p and os.path.isdir(p)]
    return [p.resolve() for p in paths]


def hideable(folder: Path) -> bool:
    """Whether ``folder`` can be hidden from the sandbox (an empty mount over it): it holds none of
    ``needed_by_sandbox``. ``folder`` is resolved."""
    return all(folder != need and folder not in need.parents for need in needed_by_sandbox())


# The reaper: a process of its own session that removes the grader's folders once the grader has ended,
# however it ended (SIGKILL runs no clean-up in the grader). It reads the folders' paths, NUL-separated,
# from a pipe whose only writer is the grader, and the pipe closes when the grader dies. Processes of
# the grader's that are still dying may write a file more into a folder, so it tries again for a while.
_REAPER = """
import os, shutil, sys, time
folders = [f for f in sys.stdin.buffer.read().split(b"\\0") if f]
deadline = time.monotonic() + 10
while any(os.path.lexists(f) for f in folders) and time.monotonic() < deadline:
    for f in folders:
        shutil.rmtree(f, ignore_errors=True)
    time.sleep(0.05)
"""
_reaper: subprocess.Popen | None = None


def remove_when_gone(folder: Path) -> None:
    """Have ``folder`` removed when this process ends, even if it is killed (a folder removed before is fine)."""
    global _reaper
    if _reaper is None or _reaper.poll() is not None:
        _reaper = subprocess.Popen([sys.executable, "-I", "-S", "-c", _REAPER], stdin=subprocess.PIPE,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, **child_options(die=False))
    _reaper.stdin.write(os.fsencode(folder) + b"\0")
    _reaper.stdin.flush()


def private_copy_of_tests(tmp: Path, extra_dir: Path | None) -> tuple[Path, Path | None]:
    """Copy the graded tests (and hidden ones) into the grader's own folder: what runs cannot be swapped.

    The folder is removed when this process ends, however it ends (``remove_when_gone``).
    """
    remove_when_gone(tmp)
    source = grading_tests_dir()
    local = tmp / "tests" / "grading"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(source, local, ignore=ignore)
    shared = source.parent / "conftest.py"              # tests/conftest.py: fixtures the graded tests share
    if shared.is_file():
        shutil.copyfile(shared, tmp / "tests" / "conftest.py")
    private_extra = None
    if extra_dir is not None:
        # Beside the graded tests, under their conftest.py: hidden tests use the same fixtures (ex05, tiny_model, ...).
        private_extra = local / "hidden"
        shutil.copytree(extra_dir, private_extra, ignore=ignore)
    return local, private_extra


_FIXED = {**Settings(sandbox="1").to_env(), "PYTHONHASHSEED": "0",
          "PYTHONDONTWRITEBYTECODE": "1",     # no __pycache__ beside a submission
          "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}   # only the plugins named on the command line


def sandbox_settings(memory_mb: int, extra_dir_original: Path | None, also_hide=()) -> dict[str, str]:
    """The environment of a trusted pytest process that does not change from one lesson or check to the next.

    also_hide: more folders the submission must not see (``grade --hide``: a class's submissions, gradebook
    and results, which ``grade --class`` names for each student)."""
    hide = [grading_tests_dir().parent, extra_dir_original]
    if (course_root() / "solutions").is_dir():
        hide.append(solutions_dir())                      # the sandbox gets its own copies, minus the graded answer
    hide.extend(Path(p) for p in also_hide)
    return Settings(course=str(course_root()), memory_mb=str(memory_mb),
                    hide=os.pathsep.join(str(p) for p in hide if p is not None),
                    fast=Settings.from_env(os.environ).fast or "").to_env()


class Standby:
    """A trusted pytest process started ahead (``toyllm.grading.grader.standby``), claimed by the next lesson or check.

    It has imported torch, pytest and the plugin, and has a sandbox warming
    up, before anyone knows what it will grade; it runs once. Its scratch
    folder (``home``) is its own, removed when it is closed. It is a copy of
    the grading's template where ``template`` says so and one can run
    (``standby.from_template``), else a fresh Python.
    """

    END_S = 3.0      # seconds an unclaimed copy gets to end by itself (it takes milliseconds), then a kill

    def __init__(self, settings: dict[str, str], template: bool = False):
        self.settings = settings
        self.home = Path(tempfile.mkdtemp(prefix="toyllm-standby-"))
        remove_when_gone(self.home)
        env = {**Settings.trusted_environment(os.environ), **settings, **_FIXED,
               **Settings(scratch=str(self.home)).to_env()}
        # The interpreter's own settings (the hash seed) are fixed when it starts: the trusted processes' own.
        zygote = _template.get(lambda: Zygote.start({**Settings.trusted_environment(os.environ), **_FIXED})) \
            if template and become_subreaper() else None
        self.proc = zygote and zygote.launch_module("toyllm.grading.grader.standby", ["--from-template"], env,
                                                    self.home)
        self.copy = self.proc is not None                 # a copy of the template, not a fresh Python
        if zygote is not None and self.proc is None:
            _template.end(failed=True)
        if self.proc is None:
            self.proc = subprocess.Popen([sys.executable, "-m", "toyllm.grading.grader.standby"], cwd=self.home,
                                         env=env, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                         stderr=subprocess.DEVNULL, **child_options())
        atexit.register(self.close)

    def fits(self, settings: dict[str, str]) -> bool:
        return settings == self.settings and self.proc.poll() is None

    def claim(self, args: list[str], env: dict[str, str], cwd: Path, out: Path) -> subprocess.Popen:
        """Run ``pytest args`` with ``env`` added, in ``cwd``, its output to ``out``; return the process."""
        self.proc.stdin.write((json.dumps({"args": args, "env": env, "cwd": str(cwd), "out": str(out)}) + "\n").encode())
        self.proc.stdin.close()
        return self.proc

    def close(self) -> None:
        if self.copy and self.proc.poll() is None and self.proc.stdin and not self.proc.stdin.closed:
            # An unclaimed copy: the end of its input tells it nobody comes, and it ends its sandbox and zygote and
            # waits for them (``standby.serve``). Killed, it would leave them to this process, a child subreaper,
            # where they would stay as zombies (in a kernel whose checks copy the template). A fresh Python (the
            # template's fallback) may still be importing torch for seconds: it is killed at once, as before.
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=self.END_S)
            except subprocess.TimeoutExpired:
                pass
        if self.proc.poll() is None:
            _kill_group(self.proc)
        if self.proc.stdin and not self.proc.stdin.closed:
            self.proc.stdin.close()
        shutil.rmtree(self.home, ignore_errors=True)
        atexit.unregister(self.close)


_standby: Standby | None = None
# The grading's template, which standbys are forked from (``Zygote.start``, once); its copies are re-parented to
# this process, so it must be a child subreaper.
_template = ZygoteSlot()


def close_standby(keep_template: bool = False) -> None:
    """End the standby pytest process, if one is waiting, and the template it came from (unless
    ``keep_template``: the next ``grade(template=True)`` of this process then forks its copies from it)."""
    global _standby
    if _standby is not None:
        _standby.close()
        _standby = None
    if not keep_template:
        _template.end()


def start_standby(memory_mb: int, template: bool = False) -> None:
    """Start the standby the next ``check()`` claims, unless one that fits is already waiting; ``template``:
    as a copy of this process's template (``Standby``).

    A lesson calls this (through ``prepare_check``) before its first check, so that check does not wait
    for a fresh Python to import torch and pytest and start a sandbox (about 4 s on the course's
    reference machine, against about 0.4 s with a standby ready)."""
    global _standby
    settings = sandbox_settings(memory_mb, None)
    if _standby is not None and _standby.fits(settings):
        return
    close_standby(keep_template=True)
    _standby = Standby(settings, template)


def run_lesson(lesson: int, files: list[Path], extra_dir: Path | None, impl_env: str, timeout_s: float,
                tmp: Path, memory_mb: int, exercises: set[str] | None = None,
                extra_dir_original: Path | None = None, warm: bool = False,
                template: bool = False, hide=(), verdicts: dict[str, bool] | None = None
                ) -> tuple[list[TestResult], set[int], set[str]]:
    """One pytest process for one lesson; returns its results, every lesson its collection saw, and the
    exercises seen failing a test of their own that ran no other exercise (``plugin.log_failed_alone``).

    warm: start a standby pytest process for the next lesson or check while this one runs (and use
    the one a previous call started, if its settings fit).
    template: start each as a copy of the grading's template (``standby.from_template``).
    hide: more folders the submission must not see (``sandbox_settings``).
    verdicts: what the earlier lessons showed of their exercises, handed on (``Settings.verdicts``).
    """
    log = tmp / f"ex{lesson:02d}.jsonl"
    out = tmp / f"ex{lesson:02d}.out"
    cmd = [sys.executable, "-m", "pytest", *map(str, files), *([str(extra_dir)] if extra_dir else []),
           "-p", "pytest_timeout", "-p", "toyllm.grading.grader.plugin", "-p", "no:cacheprovider",
           f"--timeout={timeout_s:g}", "-q", "--no-header",
           # A failure's message is the exception's own line (the plugin logs ``reprcrash.message``, the same in
           # every style); pytest's own styles would parse each traceback entry's file for its statements first.
           "--tb=native",
           "--import-mode=importlib", f"--rootdir={tmp}", "-c", os.devnull, "-o", "console_output_style=classic"]
    # The grader's own folder (tmp) is not listed: it is the grader's alone (mode 0700), and in a
    # namespace it lies under the sandbox's fresh /tmp anyway; so the settings stay the same from one
    # check to the next, and a standby started for one fits the next.
    settings = sandbox_settings(memory_mb, extra_dir_original, hide)
    run = Settings(impl=impl_env, log=str(log), lesson=str(lesson), timeout=f"{timeout_s:g}",
                   exercises=",".join(sorted(exercises or ())), scratch=str(tmp),
                   verdicts=json.dumps(dict(sorted((verdicts or {}).items())))).to_env()
    global _standby
    standby, _standby = _standby, None
    if standby is not None and not standby.fits(settings):
        standby.close()
        standby = None
    if standby is None and template:
        standby = Standby(settings, template)      # a copy of the template starts faster than ``python -m pytest``
    if standby is not None:
        proc = standby.claim(cmd[3:], run, tmp, out)
    else:
        env = {**Settings.trusted_environment(os.environ), **settings, **run, **_FIXED}
        with open(out, "wb") as sink:
            proc = subprocess.Popen(cmd, cwd=tmp, env=env, stdout=sink, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, **child_options())
    try:
        if warm:                       # the next lesson or check finds Python, torch and a sandbox ready
            _standby = Standby(settings, template)
        # Tests that start worker processes carry their own, longer timeout marks: give them room.
        stalled = _watch(proc, log, timeout_s + 90)
    except BaseException:          # Ctrl-C or SIGTERM to the grader: end the test process group too
        _kill_group(proc)
        if _standby is not None:
            _standby.close()
            _standby = None
        raise
    finally:
        if standby is not None:
            standby.close()
    events = read_log(log)
    with open(out, "rb") as f:                  # its end only: what a test printed may be long
        f.seek(max(f.seek(0, os.SEEK_END) - 3000, 0))
        tail = f.read().decode(errors="replace")
    collected = [e for e in events if e["event"] == "collected"]
    if not collected:
        raise GradingError(f"pytest could not collect the graded tests of ex{lesson:02d} (exit code "
                           f"{proc.returncode}):\n{printable(tail)}")
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
        status, output = outcome(phases.get(item["nodeid"], {}))
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
    return results, seen_lessons, {e["exercise"] for e in events if e["event"] == "failed alone"}


def _kill_group(proc: subprocess.Popen) -> None:
    """End ``proc`` and everything it started (it leads its own session)."""
    signal_group(proc.pid)
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
            _kill_group(proc)
            return now - last_change
