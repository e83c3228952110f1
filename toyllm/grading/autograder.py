"""Gradescope: the autograder zip (``make autograder OUT=autograder.zip``) and what it runs per submission.

    python -m toyllm.grading.autograder build --out autograder.zip [--extra-tests DIR] [--only ex03 ...]
    python -m toyllm.grading.autograder run [--root /autograder]

``build`` writes the zip Gradescope's "Configure Autograder" page takes: at its top ``setup.sh`` (run
once when Gradescope builds the image: Python 3.11, then ``make setup``) and ``run_autograder`` (run
for each submission), beside the course files the grader needs (the files git tracks in ``toyllm/``,
``exercises/``, ``solutions/``, ``tests/grading/``, and ``tests/conftest.py``, the Makefile, the lock,
``pyproject.toml``), the instructor's hidden tests as ``hidden_tests/`` and the lessons to grade in
``autograder.json``. Gradescope unpacks it into ``/autograder/source``.

``run`` grades ``ROOT/submission`` (what the student uploaded: files, a folder, a checkout) as
``grade --class`` grades one student (``gradebook.prepare``: only the course's exercise files, from the
folder holding the most of them) and writes ``ROOT/results/results.json`` in Gradescope's format.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import zipfile
from pathlib import Path

from ..course import course_root
from .edition import _git_files
from .grader.grade import GradingError, grade
from .grader.gradebook import _Refused, prepare
from .grader.report import GradeReport, printable
from .grader.selection import lesson_of

TEMPLATES = Path(__file__).resolve().parent.parent / "templates" / "autograder"
SCRIPTS = ("setup.sh", "run_autograder")
HIDDEN = "hidden_tests"
CONFIG = "autograder.json"
# What the grader needs of the course, as git tracks it (an instructor's untracked notes never ship).
COURSE_FOLDERS = ("toyllm/", "exercises/", "solutions/", "tests/grading/")
COURSE_FILES = ("tests/conftest.py", "Makefile", "requirements.lock", "pyproject.toml", "README.md")
_EXECUTABLE = (0o100755 << 16)      # a zip entry's Unix mode: a regular file, rwxr-xr-x


def build(out: Path, extra_tests: Path | None = None, only: list[str] | None = None,
          root: Path | None = None) -> list[str]:
    """Write the autograder zip to ``out`` (replaced in one step); returns the names it holds."""
    root = root or course_root()
    for part in only or []:
        lesson_of(part)                                    # a ValueError names a bad --only now, not on Gradescope
    if not out.resolve().parent.is_dir() or out.is_dir():
        raise ValueError(f"--out {out}: give the path of a .zip file in an existing folder")
    if extra_tests is not None and not extra_tests.is_dir():
        raise ValueError(f"--extra-tests {extra_tests}: not a folder")
    tracked = [f for f in _git_files(root, "--cached")
               if (f.startswith(COURSE_FOLDERS) or f in COURSE_FILES) and (root / f).is_file()]
    names = []
    fd, tmp = tempfile.mkstemp(dir=out.resolve().parent, prefix=f".{out.name}.", suffix=".tmp")
    os.close(fd)
    try:
        with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as z:
            for script in SCRIPTS:
                info = zipfile.ZipInfo(script, date_time=(2020, 1, 1, 0, 0, 0))
                info.external_attr = _EXECUTABLE
                info.compress_type = zipfile.ZIP_DEFLATED
                z.writestr(info, (TEMPLATES / script).read_text())
            for f in sorted(tracked):
                z.write(root / f, f)
            if extra_tests is not None:
                for path in sorted(extra_tests.rglob("*")):
                    if path.is_file() and "__pycache__" not in path.parts:
                        z.write(path, f"{HIDDEN}/{path.relative_to(extra_tests).as_posix()}")
            z.writestr(CONFIG, json.dumps({"only": only}) + "\n")
            names = z.namelist()
        os.replace(tmp, out)
    except BaseException:
        os.unlink(tmp)
        raise
    return names


def _failed(results: Path, message: str, notes: list[str]) -> None:
    """A results.json with no tests and ``message`` above the notes: what the student sees when nothing was graded."""
    GradeReport(impl="your submission", notes=[message, *notes]).write(results)


def run(root: Path) -> int:
    """Grade ``root/submission`` into ``root/results/results.json``; exit code 0 when it was graded."""
    source, submission = root / "source", root / "submission"
    results = root / "results" / "results.json"
    results.parent.mkdir(parents=True, exist_ok=True)
    config = json.loads((source / CONFIG).read_text()) if (source / CONFIG).is_file() else {}
    hidden = source / HIDDEN if (source / HIDDEN).is_dir() else None
    # Without namespaces the submission runs as another user on the same files: what only the grader
    # reads (the model answers, the graded and hidden tests) is closed to everyone else.
    for folder in (source / "solutions", source / "tests", hidden):
        if folder is not None and folder.is_dir():
            os.chmod(folder, 0o700)
    with tempfile.TemporaryDirectory(prefix="toyllm-autograder-") as tmp:
        staged = Path(tmp) / "files"
        staged.mkdir()
        try:
            count, notes = prepare(submission, staged)
        except (_Refused, OSError) as why:
            _failed(results, f"your submission could not be read: {printable(str(why))}", [])
            return 1
        if count == 0:
            _failed(results, "no exercise file of the course was found in your submission (exNN_name.py, named "
                             "as in exercises/)", notes)
            return 0
        try:
            report = grade(staged, only=config.get("only"), extra_tests=hidden)
        except (ValueError, GradingError) as e:
            _failed(results, f"grading failed: {printable(str(e))}", notes)
            return 1
    report.impl = "your submission"
    report.notes = notes + [note.replace(str(staged.resolve()), "your submission") for note in report.notes]
    report.write(results)
    print(report.table(show_hidden=False))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m toyllm.grading.autograder", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="write the autograder zip to upload to Gradescope")
    b.add_argument("--out", required=True, metavar="autograder.zip", help="the zip to write (replaced if there)")
    b.add_argument("--extra-tests", default=None, metavar="DIR", help="the hidden tests, shipped as hidden_tests/")
    b.add_argument("--only", action="append", metavar="exNN|N.M",
                   help="grade only this lesson or exercise (repeatable): one Gradescope assignment per lesson")
    r = sub.add_parser("run", help="grade ROOT/submission into ROOT/results/results.json (run_autograder does this)")
    r.add_argument("--root", default="/autograder", help="Gradescope's folder (default: /autograder)")
    args = parser.parse_args(argv)
    if args.command == "run":
        if not sys.platform.startswith("linux"):
            print("error: the autograder runs in Gradescope's Linux container (its sandbox needs Linux)",
                  file=sys.stderr)
            return 2
        return run(Path(args.root))
    only = [p.strip() for chunk in args.only for p in chunk.split(",") if p.strip()] if args.only else None
    try:
        names = build(Path(args.out), Path(args.extra_tests) if args.extra_tests else None, only)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    hidden = sum(n.startswith(HIDDEN + "/") for n in names)
    print(f"wrote {args.out}: {len(names)} files, {hidden} of them hidden tests"
          + (f", grading {', '.join(only)}" if only else ", grading the lessons each submission holds")
          + ". Upload it on Gradescope's Configure Autograder page (base image: Ubuntu 22.04).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
