"""Grading a class: one folder (or zip) per student, graded side by side, into one gradebook.

    python -m toyllm grade --class SUBMISSIONS --gradebook grades.csv [--jobs N] [--only ...]
                           [--extra-tests DIR] [--results-dir DIR] [--regrade] [--student-timeout S]

``SUBMISSIONS`` holds one entry per student, named by the student: a folder, or a ``.zip``. The entry's
own name (``ann``, ``ann.zip``) is the student's key: two entries are two rows, whatever their names.
Each is graded exactly as ``grade --impl`` grades one folder, in a child process of its own
(``python -m toyllm grade --impl ... --results ... --hide ...``), whose sandboxes share nothing with
another grading's (docs/grading.md, "Gradings side by side") and see neither the class's folder nor the
gradebook's nor the results'.

What a student handed in is untrusted and often untidy: a zip of a folder, a whole checkout, a
notebook, stray files. ``prepare`` picks out the course's exercise files (the names of
``exercises/exNN_*.py``) from the folder that holds the most of them, copies only their text into a
fresh folder (through ``read_submission``: regular files only, no links, size caps), and says in one
note what it left out. A zip is read member by member, never extracted by its own paths.

The gradebook is a CSV, rewritten whole (in one step) after each student, so an interrupted run
leaves a complete file; a second run with the same gradebook grades only the students it does not
list as graded (``--regrade`` grades them all). Each graded student's Gradescope-format results are
``RESULTS_DIR/<student>.json``; the gradebook's rows are computed from those files. The gradebook and
the results are written mode 0600 (a submission runs as another user).
"""
from __future__ import annotations

import argparse
import concurrent.futures
import csv
import dataclasses
import hashlib
import io
import json
import os
import re
import signal
import stat
import struct
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
from .run import hideable
from .selection import lesson_files, select
from ..sandbox.submission import MAX_FILE_BYTES, MAX_TOTAL_BYTES, read_submission

GRADED, NO_FILES, CRASHED, TIMED_OUT = "graded", "no files", "crashed", "timed out"
GRADING_MB = 2048             # memory one grading takes at its peak (two torch processes, the engine's workers), MiB
MAX_DEPTH = 4                 # folder levels looked into for the exercise files (a zip of a checkout: 2)
MAX_ENTRIES = 10_000          # files and folders looked at in one submission
MAX_ZIP_BYTES = 256 * 2**20   # one submitted zip file
MAX_ZIP_ENTRIES = MAX_ENTRIES  # entries in one zip's central directory, by its end record and by count
MAX_ZIP_DIRECTORY_BYTES = 4 * 2**20   # one zip's central directory (zipfile reads it whole, one object per entry)
MAX_NAME_BYTES = 255          # a file name on the file systems we write results to
STOP_WAIT_S = 30              # seconds a stopped grading gets to end its processes before it is killed
NAMES_SHOWN = 5               # ignored files named in a note, then "and N more"
# Spreadsheets run a cell that starts like a formula; such a text is written with a leading apostrophe (as is
# one that starts with an apostrophe, so that ``=x`` and ``'=x`` stay two cells).
_FORMULA = re.compile(r"^[=+\-@\t\r]")
# What a student's name is written with as an escape in the gradebook: a backslash (so that every escape can be
# told from the name's own text), control characters, bidirectional overrides and the surrogates that stand for
# the bytes of a name that is not UTF-8 (os.fsdecode).
_ESCAPED = re.compile(r"[\\\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069\ud800-\udfff]")
_UNESCAPED = re.compile(r"\\(\\|x[0-9a-f]{2}|u[0-9a-f]{4})")
# The zip's end records (zipfile's own layouts): end of central directory, the zip64 locator and end record,
# and one central directory entry.
_EOCD, _EOCD_SIG = struct.Struct("<4s4H2LH"), b"PK\x05\x06"
_LOCATOR, _LOCATOR_SIG = struct.Struct("<4sLQL"), b"PK\x06\x07"
_EOCD64, _EOCD64_SIG = struct.Struct("<4sQ2H2L4Q"), b"PK\x06\x06"
_ENTRY, _ENTRY_SIG = struct.Struct("<4s4B4HL2L5H2L"), b"PK\x01\x02"


class _Refused(Exception):
    """Why a submission cannot be graded at all (a row says so; the class goes on)."""


@dataclass
class Submission:
    """One student's entry in the submissions folder."""

    name: str                 # the student's key: the entry's own name (os.fsdecode's, so any bytes), unique
    path: Path


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

    A student is a folder or a ``.zip``, keyed by the entry's own name, so no two share a key (``ann/`` and
    ``ann.zip`` are two students, ``ann`` and ``ann.zip``); a name that is not UTF-8 is kept as
    ``os.fsdecode`` gives it. A name starting with a dot (``.DS_Store``) is passed over silently, any
    other file or a link is named in a line.
    """
    found: list[Submission] = []
    skipped: list[str] = []
    with os.scandir(folder) as entries:
        for entry in sorted(entries, key=lambda e: e.name):
            if entry.name.startswith("."):
                continue
            if entry.is_symlink():
                skipped.append(f"{printable(entry.name)!r}: a symbolic link, not a submission (give the folder itself)")
            elif entry.is_dir(follow_symlinks=False) or \
                    (entry.is_file(follow_symlinks=False) and entry.name.lower().endswith(".zip")):
                found.append(Submission(entry.name, Path(entry.path)))
            else:
                skipped.append(f"{printable(entry.name)!r}: not a folder or a .zip, so not a student's submission")
    return found, skipped


def results_file(results_dir: Path, student: str) -> Path:
    """Where a student's results go: ``RESULTS_DIR/<entry name>.json`` (``ann.json``, ``ann.zip.json``); a name
    too long for that keeps its first 200 bytes and a hash of the whole name."""
    name = os.fsencode(student)
    if len(name) + len(b".json") > MAX_NAME_BYTES:
        name = name[:200] + b"~" + hashlib.sha256(name).hexdigest()[:16].encode()
    return results_dir / os.fsdecode(name + b".json")


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


def _read_at(raw, offset: int, size: int) -> bytes:
    raw.seek(offset)
    return raw.read(size)


def check_zip_directory(raw) -> None:
    """Refuse (``_Refused``) a zip whose central directory is too large to read, from its end records alone,
    before ``zipfile.ZipFile`` reads the whole directory (one object per entry) on opening it.

    The end of central directory record is found as zipfile finds it (the last 22 bytes, else the last
    signature in the last 64 KiB + 22 bytes), with its zip64 record if one is located before it. Its entry
    counts must be at most ``MAX_ZIP_ENTRIES`` and its directory size at most ``MAX_ZIP_DIRECTORY_BYTES``;
    then the directory that zipfile would read (that many bytes before the end records) is walked entry by
    entry, since zipfile goes by the size and not the counts, and must hold at most ``MAX_ZIP_ENTRIES``.
    A zip that zipfile cannot read either is left for zipfile to refuse.
    """
    size = os.fstat(raw.fileno()).st_size
    if size < _EOCD.size:
        return
    start = max(0, size - _EOCD.size - 0xFFFF)
    tail = _read_at(raw, start, size - start)
    if tail[-_EOCD.size:-_EOCD.size + 4] == _EOCD_SIG and tail[-2:] == b"\0\0":
        at = len(tail) - _EOCD.size
    else:
        at = tail.rfind(_EOCD_SIG)
        if at < 0 or at + _EOCD.size > len(tail):
            return
    _, _, _, entries_here, entries, directory, _, _ = _EOCD.unpack_from(tail, at)
    location = start + at                 # of the end record, in the file
    directory_at = location - directory
    if location >= _LOCATOR.size:
        locator = _read_at(raw, location - _LOCATOR.size, _LOCATOR.size)
        if locator[:4] == _LOCATOR_SIG and location >= _LOCATOR.size + _EOCD64.size:
            record = _read_at(raw, location - _LOCATOR.size - _EOCD64.size, _EOCD64.size)
            if record[:4] == _EOCD64_SIG:
                _, _, _, _, _, _, entries_here, entries, directory, _ = _EOCD64.unpack(record)
                directory_at = location - _LOCATOR.size - _EOCD64.size - directory
    if max(entries_here, entries) > MAX_ZIP_ENTRIES:
        raise _Refused(f"the zip holds more than {MAX_ZIP_ENTRIES} entries ({max(entries_here, entries)}, "
                       f"by its end record)")
    if directory > MAX_ZIP_DIRECTORY_BYTES:
        raise _Refused(f"the zip's central directory is larger than {MAX_ZIP_DIRECTORY_BYTES // 2**20} MiB "
                       f"({directory} bytes, by its end record)")
    if directory_at < 0:
        return
    data = _read_at(raw, directory_at, directory)
    count = offset = 0
    while offset + _ENTRY.size <= len(data) and data[offset:offset + 4] == _ENTRY_SIG:
        count += 1
        if count > MAX_ZIP_ENTRIES:
            raise _Refused(f"the zip holds more than {MAX_ZIP_ENTRIES} entries (in its central directory)")
        fields = _ENTRY.unpack_from(data, offset)
        offset += _ENTRY.size + fields[12] + fields[13] + fields[14]     # name, extra field, comment


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
        try:
            check_zip_directory(raw)
        except OSError as e:
            raise _Refused(f"it is not a zip file that can be read ({printable(str(e))})") from None
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
    hide: list[str] = field(default_factory=list)   # folders no submission may see (``grade --hide``)


def _command(impl: Path, results: Path, options: Options) -> list[str]:
    # toyllm.grading's own command line, not toyllm's: it starts without importing torch (which only the
    # lesson's pytest process and the sandbox need), a second or so of CPU saved per student
    cmd = [sys.executable, "-m", "toyllm.grading", "grade", "--impl", str(impl), "--results", str(results),
           "--timeout", str(options.timeout_s), "--memory-mb", str(options.memory_mb)]
    for part in options.only or []:
        cmd += ["--only", part]
    if options.extra_tests:
        cmd += ["--extra-tests", options.extra_tests]
    for folder in options.hide:
        cmd += ["--hide", folder]
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


def write_private(path: Path, text: str) -> None:
    """Replace ``path`` in one step by a file of ``text`` (UTF-8) that only its owner can read (mode 0600): a
    temporary file beside it, created 0600 (``mkstemp``), then renamed."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".toyllm-", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8", errors="backslashreplace", newline="") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def _add_notes(produced: Path, results: Path, notes: list[str], staged: Path, shown: str) -> None:
    """Write the results the grading ``produced`` to ``results`` (mode 0600), with the notes on what was handed
    in above their table, which the student sees, and the submission named ``shown`` there instead of the
    grader's temporary copy ``staged``."""
    data = json.loads(produced.read_text())
    data["output"] = "\n".join(notes + [data["output"]]).replace(str(staged), shown)
    write_private(results, json.dumps(data, indent=2) + "\n")


def grade_one(sub: Submission, work: Path, results: Path, options: Options, stop: threading.Event) -> Row | None:
    """Grade one student in a child process; None if ``stop`` was set before it finished."""
    if results.exists():
        results.unlink()                         # a result of an earlier run must not stand for this one
    staged = work / "files"
    staged.mkdir(mode=0o700)
    try:
        count, notes = prepare(sub.path, staged)
    except (_Refused, OSError) as why:
        return Row(sub.name, NO_FILES, notes=f"not graded: {printable(str(why))}")
    if count == 0:
        return Row(sub.name, NO_FILES, notes="; ".join(["no exercise file of the course found", *notes]))
    log = work / "output.txt"
    produced = work / "results.json"           # in the grader's own folder; the student's name is not on its path
    with open(log, "wb") as out:
        # Its own session: Ctrl-C reaches it through _stop only; it gets SIGTERM if the class grader is killed.
        proc = subprocess.Popen(_command(staged, produced, options), cwd=course_root(), stdin=subprocess.DEVNULL,
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
    if proc.returncode != 0 or not produced.is_file():
        return Row(sub.name, CRASHED, notes="; ".join([f"the grading stopped (exit code {proc.returncode}): "
                                                      f"{_last_line(log)}", *notes]))
    _add_notes(produced, results, notes, staged.resolve(), printable(sub.path.name))
    return row_from_results(sub.name, results, "; ".join(notes))


# --------------------------------------------------------------------------- the gradebook

def _cell(text: str) -> str:
    """``text`` as a spreadsheet shows it and never runs it: a leading ``'`` before a formula's first character,
    and before a leading ``'`` (so ``_uncell`` gives back exactly ``text``)."""
    return "'" + text if _FORMULA.match(text) or text.startswith("'") else text


def _uncell(text: str) -> str:
    return text[1:] if text.startswith("'") and (_FORMULA.match(text[1:]) or text[1:].startswith("'")) else text


def _shown(name: str) -> str:
    """A student's key as the gradebook writes it: printable UTF-8, and one text per key. A backslash is written
    ``\\\\``, a control character ``\\x1b``, a bidirectional override or a surrogate (a byte of a name that is
    not UTF-8, as os.fsdecode gives it) ``\\u202e``, ``\\udcff``; ``_unshown`` gives the key back."""
    return _ESCAPED.sub(lambda m: "\\\\" if m[0] == "\\" else
                        f"\\x{ord(m[0]):02x}" if ord(m[0]) < 0x100 else f"\\u{ord(m[0]):04x}", name)


def _unshown(text: str) -> str:
    return _UNESCAPED.sub(lambda m: "\\" if m[1] == "\\" else chr(int(m[1][1:], 16)), text)


def student_cell(student: str) -> str:
    """The gradebook's ``student`` cell of a key: readable (the entry's name), escaped where it is not printable,
    safe from formulas, and different for different keys."""
    return _cell(_shown(student))


def read_gradebook(path: Path, results_dir: Path) -> dict[str, Row]:
    """The graded students of an earlier run, by their exact key: those listed as graded whose results file is
    still there."""
    if not path.is_file():
        return {}
    rows = {}
    with open(path, newline="", encoding="utf-8", errors="replace") as f:
        for line in csv.DictReader(f):
            student = _unshown(_uncell(line.get("student") or ""))
            if line.get("status") != GRADED or not student or student_cell(student) != line.get("student"):
                continue                         # not written by write_gradebook: graded again
            try:
                results = results_file(results_dir, student)
                if results.is_file():
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
    text = io.StringIO(newline="")
    out = csv.writer(text)
    out.writerow(["student", "total", "maximum", *exercises, "status", "notes"])
    for name in sorted(rows):
        row = rows[name]
        out.writerow([student_cell(name), format_points(row.total), maximum,
                      *(format_points(row.scores[ex]) if ex in row.scores else "" for ex in exercises),
                      row.status, _cell(row.notes)])
    write_private(path, text.getvalue())      # mode 0600; a surrogate left in the notes written as \udcff


def default_jobs() -> tuple[int, str]:
    """(how many gradings to run at once, the reason in words): one per core, as many as memory holds."""
    import psutil

    cores = usable_cores()
    available_mb = psutil.virtual_memory().available // 2**20
    jobs = max(1, min(cores, available_mb // GRADING_MB))
    return jobs, (f"{cores} core(s), {available_mb / 1024:.1f} GiB of memory available, about "
                  f"{GRADING_MB / 1024:.0f} GiB per grading")


def _open_to_others(folder: Path) -> bool:
    return bool(folder.stat().st_mode & (stat.S_IROTH | stat.S_IXOTH))


def private_folders(submissions: Path, gradebook: Path, results_dir: Path) -> tuple[list[Path], str | None]:
    """(the folders no submission may see: the class's, the gradebook's and the results', those of them that
    can be hidden (``run.hideable``: not one the sandbox runs from, such as the course's when the gradebook
    is in it), resolved; a one-line warning when others can read any of them or a student's folder, else None).

    A submission runs as another user than the grader: where the sandbox cannot hide these folders (no mount
    namespaces), only their mode keeps other students' work, scores and hidden tests' messages from it.
    """
    folders = []
    for folder in (submissions, gradebook.parent, results_dir):
        folder = folder.resolve()
        if hideable(folder) and folder not in folders:
            folders.append(folder)
    students = 0
    if submissions.resolve() in folders:
        with os.scandir(submissions) as entries:
            students = sum(1 for e in entries if e.is_dir(follow_symlinks=False) and
                           e.stat(follow_symlinks=False).st_mode & (stat.S_IROTH | stat.S_IXOTH))
    readable = [f for f in folders if f.is_dir() and _open_to_others(f)]
    if not readable and not students:
        return folders, None
    named = [str(f) for f in readable] + ([f"{students} student folder(s) in {submissions.resolve()}"]
                                           if students else [])
    close = " ".join(dict.fromkeys(str(f) for f in readable + ([submissions.resolve()] if students else [])))
    return folders, (f"warning: other users can read {', '.join(named)} (mode o+r or o+x), and a submission runs "
                     f"as another user, so where the sandbox cannot hide them it could read other students' work "
                     f"and scores: run chmod -R o-rwx {close}")


def grade_class(submissions: Path, gradebook: Path, results_dir: Path, options: Options, jobs: int,
                regrade: bool = False, log=None) -> dict[str, Row]:
    """Grade every student of ``submissions`` not yet graded in ``gradebook``, ``jobs`` at a time.

    The gradebook is rewritten after each student. Ctrl-C (KeyboardInterrupt, or a stop signal that
    raises one) ends every running grading, keeps the gradebook of those finished, and propagates.
    Each grading hides the class's, the gradebook's and the results' folders from its sandbox
    (``private_folders``); a warning on stderr says when other users can read them.
    """
    from tqdm import tqdm

    log = log or sys.stdout                      # looked up now: a caller may have redirected it
    results_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    hide, warning = private_folders(submissions, gradebook, results_dir)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    options = dataclasses.replace(options, hide=list(dict.fromkeys([*options.hide, *map(str, hide)])))
    students, skipped = find_submissions(submissions)
    for line in skipped:
        print(f"skipped {line}", file=log)
    rows = {} if regrade else read_gradebook(gradebook, results_dir)
    keys = {s.name for s in students}
    rows = {name: row for name, row in rows.items() if name in keys}
    todo = [s for s in students if s.name not in rows]
    if rows:
        print(f"{len(rows)} student(s) already graded in {gradebook} (--regrade grades them again)", file=log)
    print(f"grading {len(todo)} student(s), {jobs} at a time", file=log, flush=True)
    stop = threading.Event()
    failures = 0
    with tempfile.TemporaryDirectory(prefix="toyllm-class-") as tmp, \
            tqdm(total=len(todo), unit="student", desc="graded", file=sys.stderr, dynamic_ncols=True) as bar, \
            concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        work = {}
        for i, sub in enumerate(todo):
            folder = Path(tmp) / str(i)
            folder.mkdir()
            work[pool.submit(grade_one, sub, folder, results_file(results_dir, sub.name), options, stop)] = sub
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
