"""Grading a class: one folder (or zip) per student, graded side by side, into one gradebook.

    python -m toyllm grade --class SUBMISSIONS --gradebook grades.csv [--jobs N] [--only ...]
                           [--extra-tests DIR] [--results-dir DIR] [--regrade] [--student-timeout S]

``SUBMISSIONS`` holds one entry per student, named by the student: a folder, or a ``.zip`` (the
student's name is the zip's name without ``.zip``). Each is graded exactly as ``grade --impl`` grades
one folder, in a child process of its own (``python -m toyllm grade --impl ... --results ...``), whose
sandboxes share nothing with another grading's (docs/grading.md, "Gradings side by side").

What a student handed in is untrusted and often untidy: a zip of a folder, a whole checkout, a
notebook, stray files. ``prepare`` picks out the course's exercise files (the names of
``exercises/exNN_*.py``) from the folder that holds the most of them, copies only their text into a
fresh folder (through ``read_submission``: regular files only, no links, size caps), and says in one
note what it left out. A zip is read member by member, never extracted by its own paths.

The gradebook is a CSV, rewritten whole (in one step) after each student, so an interrupted run
leaves a complete file; a second run with the same gradebook grades only the students it does not
list as graded (``--regrade`` grades them all). Each graded student's Gradescope-format results are
``RESULTS_DIR/<student>.json``; the gradebook's rows are computed from those files.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import csv
import json
import os
import re
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from ...measure import usable_cores
from ...supervise import die_with_parent
from ...course import course_root, exercises_dir, grading_tests_dir
from .report import exercise_key, format_points, printable
from .selection import lesson_files, select
from ..sandbox.submission import MAX_FILE_BYTES, MAX_TOTAL_BYTES, read_submission

GRADED, NO_FILES, CRASHED, TIMED_OUT = "graded", "no files", "crashed", "timed out"
GRADING_MB = 2048             # memory one grading takes at its peak (two torch processes, the engine's workers), MiB
MAX_DEPTH = 4                 # folder levels looked into for the exercise files (a zip of a checkout: 2)
MAX_ENTRIES = 10_000          # files and folders looked at in one submission
MAX_ZIP_BYTES = 256 * 2**20   # one submitted zip file
STOP_WAIT_S = 30              # seconds a stopped grading gets to end its processes before it is killed
NAMES_SHOWN = 5               # ignored files named in a note, then "and N more"
# Spreadsheets run a cell that starts like a formula; such a text is written with a leading apostrophe.
_FORMULA = re.compile(r"^[=+\-@\t\r]")


class _Refused(Exception):
    """Why a submission cannot be graded at all (a row says so; the class goes on)."""


@dataclass
class Submission:
    """One student's entry in the submissions folder."""

    name: str                 # the student, as the gradebook names them
    path: Path
    problem: str = ""         # why it cannot be graded at all, if so


@dataclass
class Row:
    """One student's line of the gradebook."""

    student: str
    status: str
    scores: dict[str, float] = field(default_factory=dict)    # {"1.2": points}, graded exercises only
    maxima: dict[str, float] = field(default_factory=dict)    # {"1.2": points the exercise is worth}
    notes: str = ""

    @property
    def total(self) -> float:
        return sum(self.scores.values())


# --------------------------------------------------------------------------- what was handed in

def course_file_names() -> set[str]:
    """The file names a submission is graded on: those of the course's ``exercises/exNN_*.py``."""
    return {p.name for p in exercises_dir().glob("ex[0-9][0-9]_*.py")}


def find_submissions(folder: Path) -> tuple[list[Submission], list[str]]:
    """(one ``Submission`` per student in ``folder``, in name order; one line per entry that is not one).

    A student is a folder or a ``.zip``; a name starting with a dot (``.DS_Store``) is passed over
    silently, any other file or a link is named in a line. Two entries for one student (``ann/`` and
    ``ann.zip``): the folder is graded, the zip gets a row saying why not.
    """
    found: dict[str, Submission] = {}
    skipped: list[str] = []
    for entry in sorted(os.scandir(folder), key=lambda e: e.name):
        if entry.name.startswith("."):
            continue
        if entry.is_symlink():
            skipped.append(f"{printable(entry.name)!r}: a symbolic link, not a submission (give the folder itself)")
        elif entry.is_dir(follow_symlinks=False):
            found.setdefault(entry.name, Submission(entry.name, Path(entry.path)))
        elif entry.is_file(follow_symlinks=False) and entry.name.lower().endswith(".zip"):
            name = entry.name[:-4]
            if name in found:
                found[f"{name} ({entry.name})"] = Submission(entry.name, Path(entry.path),
                                                            f"{name}/ is graded instead: one submission per student")
            else:
                found[name] = Submission(name, Path(entry.path))
        else:
            skipped.append(f"{printable(entry.name)!r}: not a folder or a .zip, so not a student's submission")
    return sorted(found.values(), key=lambda s: s.name), skipped


def _choose(paths: list[PurePosixPath], wanted: set[str]) -> tuple[PurePosixPath | None, list[PurePosixPath]]:
    """(the folder to grade: the one holding the most course files, then the shallowest, then the first by name;
    every path not graded). A stray copy beside a checkout's ``exercises/`` does not take its place."""
    held: dict[PurePosixPath, int] = {}
    for p in paths:
        if p.name in wanted:
            held[p.parent] = held.get(p.parent, 0) + 1
    folders = sorted(held, key=lambda f: (-held[f], len(f.parts), str(f)))
    chosen = folders[0] if folders else None
    ignored = [p for p in paths if p.parent != chosen or p.name not in wanted]
    return chosen, ignored


def _listing(root: Path) -> list[PurePosixPath]:
    """Every non-folder entry under ``root``, relative to it, at most ``MAX_DEPTH`` levels down; no link followed."""
    out: list[PurePosixPath] = []
    todo = [(root, PurePosixPath())]
    seen = 0
    while todo:
        folder, rel = todo.pop()
        with os.scandir(folder) as entries:
            for entry in entries:
                seen += 1
                if seen > MAX_ENTRIES:
                    raise _Refused(f"it holds more than {MAX_ENTRIES} files and folders")
                if entry.is_dir(follow_symlinks=False):
                    if len(rel.parts) + 1 < MAX_DEPTH:
                        todo.append((Path(entry.path), rel / entry.name))
                else:
                    out.append(rel / entry.name)
    return out


def _zip_listing(archive: zipfile.ZipFile) -> tuple[dict[PurePosixPath, zipfile.ZipInfo], list[str]]:
    """({safe member path: its entry} for every plain file in the zip, [one line per member refused])."""
    members: dict[PurePosixPath, zipfile.ZipInfo] = {}
    refused: list[str] = []
    infos = archive.infolist()
    if len(infos) > MAX_ENTRIES:
        raise _Refused(f"the zip holds more than {MAX_ENTRIES} entries")
    for info in infos:
        path = PurePosixPath(info.filename)
        kind = stat.S_IFMT(info.external_attr >> 16)
        if info.is_dir():
            continue
        if path.is_absolute() or ".." in path.parts or "\\" in info.filename or ":" in info.filename:
            refused.append(f"{printable(info.filename)!r} (its path leaves the zip's folder)")
        elif kind not in (0, stat.S_IFREG):
            refused.append(f"{printable(info.filename)!r} (a link or special file, not a regular file)")
        elif len(path.parts) > MAX_DEPTH:
            refused.append(f"{printable(info.filename)!r} (more than {MAX_DEPTH} folders deep)")
        elif path not in members:
            members[path] = info
    return members, refused


def _unzip(path: Path, into: Path, wanted: set[str]) -> tuple[str, list[PurePosixPath], list[str]]:
    """Write the course files of zip ``path`` (from the folder holding the most, ``_choose``) into ``into``.

    Returns (the folder they came from, the members not graded, the members refused). Each is read
    through zipfile at most ``MAX_FILE_BYTES`` (+1, to tell a larger one) and written under its own
    base name only, so no member path ever names where a file is written.
    """
    try:
        # O_NOFOLLOW: a link named like a zip could point at any zip of the grader's (the model answers, zipped).
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as e:
        raise _Refused(f"{printable(path.name)!r} could not be opened ({e.strerror}; a link is not followed)") from None
    with os.fdopen(fd, "rb") as raw:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise _Refused(f"{printable(path.name)!r} is not a regular file")
        if info.st_size > MAX_ZIP_BYTES:
            raise _Refused(f"the zip is larger than {MAX_ZIP_BYTES // 2**20} MiB")
        return _unzip_open(raw, into, wanted)


def _unzip_open(raw, into: Path, wanted: set[str]) -> tuple[str, list[PurePosixPath], list[str]]:
    """``_unzip`` on the zip file opened as ``raw``."""
    try:
        with zipfile.ZipFile(raw) as archive:
            members, refused = _zip_listing(archive)
            chosen, ignored = _choose(list(members), wanted)
            left = MAX_TOTAL_BYTES
            for member, info in sorted(members.items()):
                if chosen is None or member.parent != chosen or member.name not in wanted:
                    continue
                if info.file_size > min(MAX_FILE_BYTES, left):
                    refused.append(f"{printable(str(member))!r} (larger than {MAX_FILE_BYTES // 2**20} MiB, or "
                                   f"{MAX_TOTAL_BYTES // 2**20} MiB with the files before it)")
                    continue
                with archive.open(info) as f:
                    data = f.read(min(MAX_FILE_BYTES, left) + 1)
                if len(data) > min(MAX_FILE_BYTES, left):
                    refused.append(f"{printable(str(member))!r} (larger than it says)")
                    continue
                left -= len(data)
                (into / member.name).write_bytes(data)
    except (zipfile.BadZipFile, zipfile.LargeZipFile, NotImplementedError, RuntimeError, OSError, EOFError) as e:
        raise _Refused(f"it is not a zip file that can be read ({printable(str(e))})") from None
    return ("" if chosen is None else str(chosen)), ignored, refused


def _names(paths, limit: int = NAMES_SHOWN) -> str:
    shown = [printable(str(p)) for p in sorted(paths, key=str)]
    more = len(shown) - limit
    return ", ".join(shown[:limit]) + (f" and {more} more" if more > 0 else "")


def prepare(submission: Path, into: Path) -> tuple[int, list[str]]:
    """Copy the course's exercise files of one submission (a folder or a zip) into the empty folder ``into``.

    Returns (how many files were copied, notes on what was not graded and why). Raises ``_Refused``
    when nothing can be read at all. The files come from the folder that holds the most of them
    (``ann/``, ``ann/exercises/``, ``toyllm-student/exercises/`` inside a zip; a folder that holds none of
    them but one zip is read as that zip); they are read by
    ``read_submission``, so a link, a device or an oversized file there is not graded either.
    """
    wanted = course_file_names()
    notes: list[str] = []
    with tempfile.TemporaryDirectory(prefix="toyllm-unzipped-") as unzipped:
        listing = _listing(submission) if submission.is_dir() else []
        zips = [p for p in listing if len(p.parts) == 1 and p.suffix.lower() == ".zip"]
        if submission.is_dir() and not {p.name for p in listing} & wanted and len(zips) == 1:
            submission = submission / zips[0]          # a folder holding only the student's zip (a Gradescope upload)
        if submission.is_dir():
            chosen, ignored = _choose(listing, wanted)
            refused: list[str] = []
            source = submission if chosen is None else submission / chosen
            where = "" if chosen is None else str(chosen)
        else:
            source = Path(unzipped)
            where, ignored, refused = _unzip(submission, source, wanted)
        texts, problems = read_submission(source)
    texts = {name: text for name, text in texts.items() if name in wanted}
    problems = [p for p in problems if any(p.startswith(repr(n)) for n in wanted)]
    for name, text in texts.items():
        (into / name).write_text(text, encoding="utf-8")
    if where not in ("", "."):
        notes.append(f"graded the files in {printable(where)}/")
    if refused:
        notes.append(f"refused {len(refused)} zip member(s): {_names(refused)}")
    notes.extend(problems)
    if ignored:
        notes.append(f"ignored {len(ignored)} file(s) that are not the course's exercise files "
                     f"(exNN_name.py as in exercises/, in one folder): {_names(ignored)}")
    return len(texts), notes


# --------------------------------------------------------------------------- one student's grading

@dataclass
class Options:
    """What every student's grading is run with (the ``grade`` options)."""

    only: list[str] | None
    extra_tests: str | None
    timeout_s: float
    memory_mb: int
    student_timeout_s: float


def _command(impl: Path, results: Path, options: Options) -> list[str]:
    # toyllm.grading's own command line, not toyllm's: it starts without importing torch (which only the
    # lesson's pytest process and the sandbox need), a second or so of CPU saved per student
    cmd = [sys.executable, "-m", "toyllm.grading", "grade", "--impl", str(impl), "--results", str(results),
           "--timeout", str(options.timeout_s), "--memory-mb", str(options.memory_mb)]
    for part in options.only or []:
        cmd += ["--only", part]
    if options.extra_tests:
        cmd += ["--extra-tests", options.extra_tests]
    return cmd


def _running(proc: subprocess.Popen) -> bool:
    """Whether the grading process still runs, without reaping it: while it is unreaped, its process id (and
    so its process group's) cannot go to another process, so signalling the group never hits a stranger."""
    return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None


def _stop(proc: subprocess.Popen) -> None:
    """End a grading: SIGTERM (it ends its own processes and removes its folders), then SIGKILL to its group,
    then reap it."""
    if _running(proc):
        os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_WAIT_S
        while _running(proc) and time.monotonic() < deadline:
            time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)           # whatever of its session is left; the leader is ours, unreaped
    proc.wait()


def _last_line(path: Path, limit: int = 300) -> str:
    with open(path, "rb") as f:
        f.seek(max(0, os.fstat(f.fileno()).st_size - 4096))
        lines = [line for line in f.read().decode("utf-8", "replace").splitlines() if line.strip()]
    return printable(lines[-1][:limit]) if lines else "no message"


def row_from_results(student: str, results: Path, notes: str = "") -> Row:
    """The gradebook row of a graded student, from their results.json."""
    data = json.loads(results.read_text())
    row = Row(student, GRADED, notes=notes)
    for test in data["tests"]:
        ex = test["number"]
        row.scores[ex] = row.scores.get(ex, 0) + test["score"]
        row.maxima[ex] = row.maxima.get(ex, 0) + test["max_score"]
    return row


def _add_notes(results: Path, notes: list[str], staged: Path, shown: str) -> None:
    """Put the notes on what was handed in above the results' table, which the student sees, and name the
    submission ``shown`` there instead of the grader's temporary copy ``staged``."""
    data = json.loads(results.read_text())
    data["output"] = "\n".join(notes + [data["output"]]).replace(str(staged), shown)
    tmp = results.with_name(f".{results.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, results)


def grade_one(sub: Submission, work: Path, results: Path, options: Options, stop: threading.Event) -> Row | None:
    """Grade one student in a child process; None if ``stop`` was set before it finished."""
    if results.exists():
        results.unlink()                         # a result of an earlier run must not stand for this one
    if sub.problem:
        return Row(sub.name, NO_FILES, notes=sub.problem)
    staged = work / "files"
    staged.mkdir(mode=0o700)
    try:
        count, notes = prepare(sub.path, staged)
    except (_Refused, OSError) as why:
        return Row(sub.name, NO_FILES, notes=f"not graded: {printable(str(why))}")
    if count == 0:
        return Row(sub.name, NO_FILES, notes="; ".join(["no exercise file of the course found", *notes]))
    log = work / "output.txt"
    with open(log, "wb") as out:
        # Its own session: Ctrl-C reaches it through _stop only; it gets SIGTERM if the class grader is killed.
        proc = subprocess.Popen(_command(staged, results, options), cwd=course_root(), stdin=subprocess.DEVNULL,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=lambda: die_with_parent(signal.SIGTERM))
    deadline = time.monotonic() + options.student_timeout_s
    try:
        while _running(proc):
            if stop.wait(0.2):
                return None
            if time.monotonic() > deadline:
                limit = format_points(options.student_timeout_s)
                return Row(sub.name, TIMED_OUT,
                           notes="; ".join([f"the grading took more than {limit} s (--student-timeout)", *notes]))
    finally:
        _stop(proc)
    if proc.returncode != 0 or not results.is_file():
        return Row(sub.name, CRASHED, notes="; ".join([f"the grading stopped (exit code {proc.returncode}): "
                                                      f"{_last_line(log)}", *notes]))
    _add_notes(results, notes, staged.resolve(), sub.path.name)
    return row_from_results(sub.name, results, "; ".join(notes))


# --------------------------------------------------------------------------- the gradebook

def _cell(text: str) -> str:
    return "'" + text if _FORMULA.match(text) else text


def _uncell(text: str) -> str:
    return text[1:] if text.startswith("'") and _FORMULA.match(text[1:]) else text


def read_gradebook(path: Path, results_dir: Path) -> dict[str, Row]:
    """The graded students of an earlier run: those listed as graded whose results file is still there."""
    if not path.is_file():
        return {}
    rows = {}
    with open(path, newline="") as f:
        for line in csv.DictReader(f):
            student = _uncell(line.get("student") or "")
            results = results_dir / f"{student}.json"
            if line.get("status") != GRADED or not student or not results.is_file():
                continue
            try:
                rows[student] = row_from_results(student, results, _uncell(line.get("notes") or ""))
            except (ValueError, KeyError, TypeError, OSError):
                pass                             # a results file that cannot be read: graded again
    return rows


def write_gradebook(path: Path, rows: dict[str, Row]) -> None:
    """The whole gradebook, replaced in one step: student, total, maximum, one column per exercise, status, notes.

    An exercise's column is empty for a student who handed in no file for its lesson. ``maximum`` is
    the class's: the sum of what every exercise in the gradebook is worth.
    """
    worth: dict[str, float] = {}
    for row in rows.values():
        for ex, m in row.maxima.items():
            worth[ex] = max(worth.get(ex, 0), m)
    exercises = sorted(worth, key=exercise_key)
    maximum = format_points(sum(worth.values()))
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", newline="") as f:
            out = csv.writer(f)
            out.writerow(["student", "total", "maximum", *exercises, "status", "notes"])
            for name in sorted(rows):
                row = rows[name]
                out.writerow([_cell(name), format_points(row.total), maximum,
                              *(format_points(row.scores[ex]) if ex in row.scores else "" for ex in exercises),
                              row.status, _cell(row.notes)])
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def default_jobs() -> tuple[int, str]:
    """(how many gradings to run at once, the reason in words): one per core, as many as memory holds."""
    import psutil

    cores = usable_cores()
    available_mb = psutil.virtual_memory().available // 2**20
    jobs = max(1, min(cores, available_mb // GRADING_MB))
    return jobs, (f"{cores} core(s), {available_mb / 1024:.1f} GiB of memory available, about "
                  f"{GRADING_MB / 1024:.0f} GiB per grading")


def grade_class(submissions: Path, gradebook: Path, results_dir: Path, options: Options, jobs: int,
                regrade: bool = False, log=None) -> dict[str, Row]:
    """Grade every student of ``submissions`` not yet graded in ``gradebook``, ``jobs`` at a time.

    The gradebook is rewritten after each student. Ctrl-C (KeyboardInterrupt, or a stop signal that
    raises one) ends every running grading, keeps the gradebook of those finished, and propagates.
    """
    from tqdm import tqdm

    log = log or sys.stdout                      # looked up now: a caller may have redirected it
    students, skipped = find_submissions(submissions)
    for line in skipped:
        print(f"skipped {line}", file=log)
    rows = {} if regrade else read_gradebook(gradebook, results_dir)
    rows = {name: row for name, row in rows.items() if any(s.name == name for s in students)}
    todo = [s for s in students if s.name not in rows]
    if rows:
        print(f"{len(rows)} student(s) already graded in {gradebook} (--regrade grades them again)", file=log)
    print(f"grading {len(todo)} student(s), {jobs} at a time", file=log, flush=True)
    results_dir.mkdir(parents=True, exist_ok=True)
    stop = threading.Event()
    failures = 0
    with tempfile.TemporaryDirectory(prefix="toyllm-class-") as tmp, \
            tqdm(total=len(todo), unit="student", desc="graded", file=sys.stderr, dynamic_ncols=True) as bar, \
            concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        work = {}
        for i, sub in enumerate(todo):
            folder = Path(tmp) / str(i)
            folder.mkdir()
            work[pool.submit(grade_one, sub, folder, results_dir / f"{sub.name}.json", options, stop)] = sub
        try:
            for done in concurrent.futures.as_completed(work):
                try:
                    row = done.result()
                except Exception as e:      # the class grader's own fault with one student: a row, and the rest go on
                    row = Row(work[done].name, CRASHED, notes=f"not graded: {type(e).__name__}: {printable(str(e))}")
                if row is None:
                    continue
                rows[row.student] = row
                write_gradebook(gradebook, rows)
                failures += row.status != GRADED
                bar.set_postfix_str(f"not graded: {failures}", refresh=False)
                bar.update()
        except BaseException:
            stop.set()                    # every running grading is stopped; those not started never start
            pool.shutdown(wait=True, cancel_futures=True)
            raise
    return rows


def run(args: argparse.Namespace) -> int:
    """``grade --class``: the options checked, the class graded, a summary printed. Exit code 0 once graded."""
    submissions = Path(args.class_dir).expanduser()
    if not submissions.is_dir():
        print(f"error: --class {args.class_dir}: not a folder (give the folder that holds one folder or zip per "
              f"student)", file=sys.stderr)
        return 2
    if not args.gradebook:
        print("error: --class needs --gradebook PATH.csv, the gradebook to write (and to resume from)", file=sys.stderr)
        return 2
    if args.impl != "exercises" or args.results:
        print("error: --class grades a whole folder: leave out --impl and --results (each student's results go "
              "to --results-dir)", file=sys.stderr)
        return 2
    gradebook = Path(args.gradebook).expanduser()
    if not gradebook.resolve().parent.is_dir() or gradebook.is_dir():
        print(f"error: --gradebook {args.gradebook}: give the path of a file in an existing folder", file=sys.stderr)
        return 2
    results_dir = Path(args.results_dir).expanduser() if args.results_dir else \
        gradebook.resolve().parent / f"{gradebook.stem}-results"
    if args.extra_tests and not Path(args.extra_tests).is_dir():
        print(f"error: --extra-tests {args.extra_tests}: not a folder", file=sys.stderr)
        return 2
    if not 1 <= args.student_timeout <= 86400:
        print(f"error: --student-timeout {args.student_timeout}: one student's grading may take 1 to 86400 s",
              file=sys.stderr)
        return 2
    jobs, why = default_jobs()
    if args.jobs is not None:
        if not 1 <= args.jobs <= 64:
            print(f"error: --jobs {args.jobs}: run 1 to 64 gradings at once", file=sys.stderr)
            return 2
        print(f"--jobs {args.jobs} (the default here would be {jobs}: {why})")
        jobs = args.jobs
    else:
        print(f"--jobs {jobs} by default: {why}")
    only = [part for chunk in args.only for part in chunk.split(",") if part.strip()] if args.only else None
    try:                                  # a bad --only is one line now, not a crashed row per student
        select(only, lesson_files(grading_tests_dir()), Path(args.extra_tests).resolve() if args.extra_tests else None)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    options = Options(only=only, extra_tests=str(Path(args.extra_tests).resolve()) if args.extra_tests else None,
                      timeout_s=args.timeout, memory_mb=args.memory_mb, student_timeout_s=args.student_timeout)
    rows = grade_class(submissions, gradebook, results_dir, options, jobs, regrade=args.regrade)
    counts = {status: sum(r.status == status for r in rows.values())
              for status in (GRADED, NO_FILES, CRASHED, TIMED_OUT)}
    print(f"wrote {gradebook} ({len(rows)} student(s): " + ", ".join(f"{n} {s}" for s, n in counts.items() if n)
          + f") and the results of each graded student in {results_dir}/")
    return 0
