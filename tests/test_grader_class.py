"""A class's worth of grading: ``grade --class`` (toyllm/grading/grader/gradebook.py) and the Gradescope zip
(toyllm/grading/autograder.py).

The fast tests read submissions (folders, zips, untidy and hostile ones) and write gradebooks without
grading; the slow ones grade a small class from the command line, interrupted and resumed, beside a
hostile submission, and run the autograder zip's ``run_autograder`` unpacked in a temporary root.
"""
from __future__ import annotations

import csv
import json
import os
import signal
import stat
import struct
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path

import psutil
import pytest

from test_grader import ROOT, make_submission
from toyllm.grading import autograder
from toyllm.grading.grader import gradebook
from toyllm.grading.grader.gradebook import (CRASHED, GRADED, NO_FILES, TIMED_OUT, Options, Row, _Refused, default_jobs,
                                      find_submissions, grade_one, prepare, read_gradebook, write_gradebook)

ANSWER_01 = (ROOT / "solutions" / "ex01_naive_generation.py").read_text()
ANSWER_03 = (ROOT / "solutions" / "ex03_rooflines.py").read_text()


def _zip(path: Path, members: dict[str, bytes], links: tuple[str, ...] = ()) -> Path:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in members.items():
            z.writestr(name, data)
        for name in links:                       # a member whose Unix mode says symbolic link
            info = zipfile.ZipInfo(name)
            info.external_attr = (stat.S_IFLNK | 0o777) << 16
            z.writestr(info, "../../../solutions/ex02_kv_cache.py")
    return path


# --------------------------------------------------------------------------- reading what was handed in

@pytest.mark.timeout(30)
def test_a_zip_is_read_member_by_member_and_only_its_course_files_are_written(tmp_path):
    archive = _zip(tmp_path / "ann.zip", {
        "toyllm-student/exercises/ex01_naive_generation.py": ANSWER_01.encode(),
        "toyllm-student/exercises/ex03_rooflines.py": b"# -*- coding: latin-1 -*-\nNAME = '\xe9'\n",
        "toyllm-student/exercises/ex04_tsp.py": b"x = 0\n" + b"#" * (2 * 2**20),      # 2 MiB, deflated to little
        "toyllm-student/notes.ipynb": b"{}",
        "toyllm-student/ex02_kv_cache.py": b"print('a second copy, in another folder')\n",
        "__MACOSX/toyllm-student/exercises/._ex01_naive_generation.py": b"\x00\x05",
        "../../ex05_kv_runahead.py": b"escaped = True\n",
        "/etc/ex06_partition_search.py": b"escaped = True\n",
    }, links=("toyllm-student/exercises/ex02_kv_cache.py",))
    into = tmp_path / "out" / "files"
    into.mkdir(parents=True)
    count, notes = prepare(archive, into)
    assert sorted(p.name for p in into.iterdir()) == ["ex01_naive_generation.py", "ex03_rooflines.py"]
    assert count == 2 and (into / "ex01_naive_generation.py").read_text() == ANSWER_01
    # decoded as Python decodes source, and saved as UTF-8
    assert (into / "ex03_rooflines.py").read_text() == "# -*- coding: utf-8 -*-\nNAME = 'é'\n"
    assert not list(tmp_path.rglob("ex05_kv_runahead.py")) and not Path("/etc/ex06_partition_search.py").exists()
    text = "\n".join(notes)
    assert "graded the files in toyllm-student/exercises/" in text, text
    assert "refused 4 zip member(s)" in text and "(its path leaves the zip's folder)" in text, text
    assert "ex02_kv_cache.py' (a link or special file" in text and "ex04_tsp.py' (larger than 1 MiB" in text, text
    assert "ignored 3 file(s)" in text and "toyllm-student/ex02_kv_cache.py" in text and "notes.ipynb" in text, text


@pytest.mark.timeout(30)
def test_a_folder_is_graded_on_the_course_files_of_its_shallowest_folder_and_the_rest_is_named(tmp_path):
    sub = tmp_path / "bob"
    (sub / "exercises").mkdir(parents=True)
    (sub / "exercises" / "ex01_naive_generation.py").write_text(ANSWER_01)
    (sub / "exercises" / "ex09_extra.py").write_text("x = 1\n")                 # named for a lesson the course lacks
    (sub / "exercises" / "ex03_rooflines.py").symlink_to(ROOT / "solutions" / "ex03_rooflines.py")
    (sub / "exercises" / "ex03.ipynb").write_text("{}")
    (sub / "README.md").write_text("hello")
    into = tmp_path / "files"
    into.mkdir()
    count, notes = prepare(sub, into)
    assert count == 1 and [p.name for p in into.iterdir()] == ["ex01_naive_generation.py"]
    text = "\n".join(notes)
    assert "graded the files in exercises/" in text, text
    assert "'ex03_rooflines.py' was not graded: it is a symbolic link" in text, text
    assert "ignored 3 file(s)" in text and all(n in text for n in ("README.md", "ex09_extra.py", "ex03.ipynb")), text
    empty = tmp_path / "empty"
    empty.mkdir()
    assert prepare(empty, tmp_path / "files") == (0, [])


@pytest.mark.timeout(30)
def test_a_zip_that_is_not_one_is_refused_with_the_reason(tmp_path):
    bad = tmp_path / "carl.zip"
    bad.write_bytes(b"PK\x03\x04 not really")
    with pytest.raises(_Refused, match="not a zip file that can be read"):
        prepare(bad, tmp_path)


@pytest.mark.timeout(30)
def test_a_folder_holding_only_a_zip_is_read_as_that_zip_but_never_through_a_link(tmp_path):
    upload = tmp_path / "upload"                     # what Gradescope keeps of an uploaded zip
    upload.mkdir()
    _zip(upload / "mine.zip", {"exercises/ex01_naive_generation.py": ANSWER_01.encode()})
    into = tmp_path / "files"
    into.mkdir()
    assert prepare(upload, into) == (1, ["graded the files in exercises/"])
    answers = _zip(tmp_path / "answers.zip", {"ex01_naive_generation.py": ANSWER_01.encode()})
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / "mine.zip").symlink_to(answers)      # the grader's own zip of the model answers
    with pytest.raises(_Refused, match="'mine.zip' could not be opened .*a link is not followed"):
        prepare(linked, tmp_path / "files")


@pytest.mark.timeout(30)
def test_the_class_folder_holds_one_folder_or_zip_per_student(tmp_path):
    for name in ("ann", "bob", ".git"):
        (tmp_path / name).mkdir()
    _zip(tmp_path / "bob.zip", {"ex01_naive_generation.py": b""})
    _zip(tmp_path / "dan.zip", {"ex01_naive_generation.py": b""})
    (tmp_path / "grades.txt").write_text("")
    (tmp_path / "eve").symlink_to(tmp_path / "ann")
    found, skipped = find_submissions(tmp_path)
    # each entry is a student of its own, keyed by its own name: a folder and a zip named alike are two
    assert [s.name for s in found] == ["ann", "bob", "bob.zip", "dan.zip"]
    assert found[1].path == tmp_path / "bob" and found[3].path == tmp_path / "dan.zip"
    assert skipped == ["'eve': a symbolic link, not a submission (give the folder itself)",
                       "'grades.txt': not a folder or a .zip, so not a student's submission"]


def _results(folder: Path, student: str, tests: list[tuple[str, float, float]]) -> None:
    folder.mkdir(exist_ok=True)
    (folder / f"{student}.json").write_text(json.dumps(
        {"tests": [{"number": ex, "score": s, "max_score": m} for ex, s, m in tests]}))


@pytest.mark.timeout(30)
def test_the_gradebook_has_a_column_per_exercise_and_resumes_only_from_graded_rows_with_results(tmp_path):
    results = tmp_path / "results"
    _results(results, "ann", [("1.1", 3, 3), ("1.2", 0, 2), ("1.2", 2, 2)])
    _results(results, "=cmd()", [("3.1", 2, 2)])
    rows = {"ann": Row("ann", GRADED, {"1.1": 3, "1.2": 2}, {"1.1": 3, "1.2": 4}),
            "=cmd()": Row("=cmd()", GRADED, {"3.1": 2}, {"3.1": 2}, notes="-ignored"),
            "bob": Row("bob", GRADED, {"1.1": 3}, {"1.1": 3}),           # its results file is gone
            "eve": Row("eve", NO_FILES, notes="no exercise file of the course found")}
    book = tmp_path / "grades.csv"
    write_gradebook(book, rows)
    lines = list(csv.reader(book.open()))
    assert lines[0] == ["student", "total", "maximum", "1.1", "1.2", "3.1", "status", "notes"]
    assert lines[1] == ["'=cmd()", "2", "9", "", "", "2", "graded", "'-ignored"]     # no cell reads as a formula
    assert lines[2] == ["ann", "5", "9", "3", "2", "", "graded", ""]
    assert lines[4] == ["eve", "0", "9", "", "", "", "no files", "no exercise file of the course found"]
    again = read_gradebook(book, results)
    assert sorted(again) == ["=cmd()", "ann"] and again["ann"].scores == {"1.1": 3, "1.2": 2}
    assert again["=cmd()"].notes == "-ignored"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]        # written in one step


def _zip_directory(path: Path, entries: int, claimed: int | None = None, zip64: bool = False) -> Path:
    """A zip of ``entries`` empty members whose central directory is written record by record (quick for
    200,000), its end record claiming ``claimed`` entries (default: the truth), in zip64 form if asked."""
    entry = struct.Struct("<4s4B4HL2L5H2L")
    with open(path, "wb") as f:
        for i in range(entries):
            name = b"f%d" % i
            f.write(entry.pack(b"PK\x01\x02", 20, 3, 20, 0, 0, 0, 0, 0, 0, 0, 0, len(name), 0, 0, 0, 0, 0, 0) + name)
        size = f.tell()
        count = entries if claimed is None else claimed
        if zip64:
            f.write(struct.pack("<4sQ2H2L4Q", b"PK\x06\x06", 44, 45, 45, 0, 0, count, count, size, 0))
            f.write(struct.pack("<4sLQL", b"PK\x06\x07", 0, size, 1))
            f.write(struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, 0xFFFF, 0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0))
        else:
            f.write(struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, count, count, size, 0, 0))
    return path


@pytest.mark.timeout(60)
def test_a_zip_with_a_huge_directory_is_refused_from_its_end_record_before_zipfile_reads_it(tmp_path, monkeypatch):
    import tracemalloc

    def no_zipfile(*args, **kwargs):
        raise AssertionError("zipfile.ZipFile opened a zip whose directory is too large")

    cases = {  # zip: what the row says
        _zip_directory(tmp_path / "many.zip", 200_000, zip64=True): "more than 10000 entries (200000, by its end record)",
        _zip_directory(tmp_path / "lying.zip", 200_000, claimed=5):
            "central directory is larger than 4 MiB (10488890 bytes, by its end record)",
        _zip_directory(tmp_path / "packed.zip", 40_000, claimed=5): "more than 10000 entries (in its central directory)",
    }
    monkeypatch.setattr(gradebook.zipfile, "ZipFile", no_zipfile)
    for archive, why in cases.items():
        (tmp_path / "files").mkdir()
        tracemalloc.start()
        try:
            with pytest.raises(_Refused) as refused:
                prepare(archive, tmp_path / "files")
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert why in str(refused.value), (archive.name, str(refused.value))
        assert peak < 100 * 2**20, (archive.name, peak)
        (tmp_path / "files").rmdir()
    monkeypatch.undo()
    # a zip within the limits, with a comment after its end record (found as zipfile finds it), is read as ever
    ok = _zip(tmp_path / "ok.zip", {"ex01_naive_generation.py": ANSWER_01.encode()})
    with zipfile.ZipFile(ok, "a") as z:
        z.comment = b"made by hand " * 100
    (tmp_path / "files").mkdir()
    assert prepare(ok, tmp_path / "files") == (1, [])
    # a grading keeps going: the zip's row says why
    sub = find_submissions(tmp_path)[0]
    many = next(s for s in sub if s.name == "many.zip")
    (tmp_path / "w").mkdir()
    row = grade_one(many, tmp_path / "w", tmp_path / "many.zip.json", Options(None, None, 20, 4096, 60),
                    threading.Event())
    assert row.status == NO_FILES and "more than 10000 entries" in row.notes, row


@pytest.mark.timeout(30)
def test_the_results_a_student_gets_are_written_for_the_grader_alone(tmp_path):
    produced = tmp_path / "produced.json"
    produced.write_text(json.dumps({"output": "3.1 in /tmp/staged/files: failed", "tests": []}))
    results = tmp_path / "results"
    results.mkdir()
    earlier = results / "ann.json"
    earlier.write_text("{}")
    earlier.chmod(0o644)                                       # left by an older version, readable by all
    gradebook._add_notes(produced, earlier, ["ignored 1 file(s)"], Path("/tmp/staged/files"), "ann")
    assert stat.S_IMODE(earlier.stat().st_mode) == 0o600
    assert json.loads(earlier.read_text())["output"] == "ignored 1 file(s)\n3.1 in ann: failed"
    book = tmp_path / "grades.csv"
    book.write_text("")
    book.chmod(0o644)
    write_gradebook(book, {"ann": Row("ann", GRADED, {"3.1": 1}, {"3.1": 2})})
    assert stat.S_IMODE(book.stat().st_mode) == 0o600
    assert [p.name for p in results.iterdir()] == ["ann.json"] and not [
        p for p in tmp_path.iterdir() if p.name.startswith(".")]


NOT_UTF8 = os.fsdecode(b"\xff\xfe")          # a folder name that is not UTF-8, as os.scandir gives it


def _look_alikes(folder: Path) -> list[str]:
    """A class whose names collide under a careless key: ``alice`` and ``alice.zip``, ``=x`` and ``'=x`` (the
    first's cell is ``'=x``), a name that is not UTF-8 and one that spells its escape, a terminal escape."""
    folder.mkdir()
    for name in ("alice", "=x", "'=x", NOT_UTF8, "\\udcff\\udcfe", "bob\x1b[2J"):
        os.mkdir(os.path.join(os.fsencode(folder), os.fsencode(name)))
    _zip(folder / "alice.zip", {"README.md": b"no exercise here"})
    (folder / "alice" / os.fsdecode(b"notes\xff.py")).write_text("x = 1\n")
    return sorted(["alice", "alice.zip", "=x", "'=x", NOT_UTF8, "\\udcff\\udcfe", "bob\x1b[2J"])


@pytest.mark.timeout(60)
def test_every_entry_is_a_row_of_its_own_under_a_printable_name_and_resumes_by_its_exact_key(tmp_path, monkeypatch):
    folder, book, results = tmp_path / "class", tmp_path / "grades.csv", tmp_path / "grades-results"
    names = _look_alikes(folder)
    options = Options(None, None, 20, 4096, 60)
    rows = gradebook.grade_class(folder, book, results, options, jobs=2, log=open(os.devnull, "w"))
    assert sorted(rows) == names and {r.status for r in rows.values()} == {NO_FILES}
    cells = {line[0]: line for line in csv.reader(book.open(encoding="utf-8"))}
    assert sorted(cells) == sorted(["student", "alice", "alice.zip", "'=x", "''=x", "\\udcff\\udcfe",
                                    "\\\\udcff\\\\udcfe", "bob\\x1b[2J"])
    assert "ignored 1 file(s)" in cells["alice"][-1] and "notes\\udcff.py" in cells["alice"][-1], cells["alice"]

    def graded(sub, work, path, options, stop):        # a grading that gives everyone 1 of 2 points, quickly
        path.write_text(json.dumps({"tests": [{"number": "1.1", "score": 1, "max_score": 2}]}))
        return gradebook.row_from_results(sub.name, path)

    monkeypatch.setattr(gradebook, "grade_one", graded)
    rows = gradebook.grade_class(folder, book, results, options, jobs=2, regrade=True, log=open(os.devnull, "w"))
    assert sorted(rows) == names and {r.status for r in rows.values()} == {GRADED}
    assert sorted(p.name for p in results.iterdir()) == sorted(f"{n}.json" for n in names)
    assert read_gradebook(book, results).keys() == set(names)

    def not_again(*args):
        raise AssertionError("a graded student was graded again")

    monkeypatch.setattr(gradebook, "grade_one", not_again)
    out = tmp_path / "out.txt"
    with open(out, "w") as log:
        again = gradebook.grade_class(folder, book, results, options, jobs=2, log=log)
    assert sorted(again) == names and "7 student(s) already graded" in out.read_text()
    # a name too long for ``<name>.json`` gets a file name of its own, still one per student
    long = "x" * 251
    assert gradebook.results_file(results, long) != gradebook.results_file(results, long[:-1] + "y")
    assert len(gradebook.results_file(results, long).name.encode()) <= 255


@pytest.mark.timeout(30)
def test_open_class_folders_are_named_before_grading_and_every_grading_hides_them(tmp_path, monkeypatch, capsys):
    folder, book, results = tmp_path / "class", tmp_path / "marks" / "grades.csv", tmp_path / "results"
    (folder / "ann").mkdir(parents=True)
    book.parent.mkdir()
    for f in (tmp_path, folder, book.parent):
        f.chmod(0o700)
    (folder / "ann").chmod(0o755)                               # a student's folder others can read
    seen = []

    def record(sub, work, path, options, stop):
        seen.append(options.hide)
        return Row(sub.name, NO_FILES)

    monkeypatch.setattr(gradebook, "grade_one", record)
    gradebook.grade_class(folder, book, results, Options(None, None, 20, 4096, 60), jobs=1, log=sys.stdout)
    err = capsys.readouterr().err
    warnings = [line for line in err.splitlines() if line.startswith("warning:")]
    assert warnings == [f"warning: other users can read 1 student folder(s) in {folder} (mode o+r or o+x), and a "
                        f"submission runs as another user, so where the sandbox cannot hide them it could read "
                        f"other students' work and scores: run chmod -R o-rwx {folder}"], err
    assert seen == [[str(folder), str(book.parent), str(results)]]
    assert stat.S_IMODE(results.stat().st_mode) == 0o700
    # each student's grading is told to hide them: on its command line, and so in its sandbox's settings
    cmd = gradebook._command(Path("files"), Path("r.json"), Options(None, None, 20, 4096, 60, hide=seen[0]))
    assert [cmd[i + 1] for i, part in enumerate(cmd) if part == "--hide"] == seen[0]
    from toyllm.grading.grader.run import sandbox_settings
    from toyllm.grading.settings import Settings

    hidden = Settings.from_env(sandbox_settings(4096, None, [Path(p) for p in seen[0]])).hide.split(os.pathsep)
    assert set(seen[0]) < set(hidden)
    from toyllm.grading.grader.grade import grade

    with pytest.raises(ValueError, match="holds the course"):
        grade(folder / "ann", hide=[ROOT.parent])              # an empty mount there would hide the course too

    folder.chmod(0o755)
    results.chmod(0o711)
    book.parent.chmod(0o750)
    (folder / "ann").chmod(0o700)
    gradebook.grade_class(folder, book, results, Options(None, None, 20, 4096, 60), jobs=1, log=sys.stdout)
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and f"can read {folder}, {results} (mode" in warnings[0], warnings
    assert warnings[0].endswith(f"chmod -R o-rwx {folder} {results}"), warnings
    # where the gradebook lies in the course's folder, that folder cannot be hidden (the sandbox runs from it)
    hide, _ = gradebook.private_folders(folder, ROOT / "grades.csv", results)
    assert hide == [folder, results]


@pytest.mark.timeout(30)
def test_the_default_jobs_follow_the_cores_and_the_memory():
    jobs, why = default_jobs()
    assert 1 <= jobs <= os.cpu_count() and "core(s)" in why and "GiB of memory available" in why


@pytest.mark.grader
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_students_grading_process_starts_without_importing_torch():
    """Each student's grading is a process of its own; torch is for the lesson's pytest process and the sandbox."""
    cmd = gradebook._command(Path("files"), Path("results.json"), Options(None, None, 20, 4096, 60))
    assert cmd[1:4] == ["-m", "toyllm.grading", "grade"]
    probe = "import sys, runpy; sys.argv = ['grade', '--help']\ntry:\n    runpy.run_module('toyllm.grading', " \
            "run_name='__main__')\nexcept SystemExit:\n    pass\nprint('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "False", out.stdout


@pytest.mark.grader
def test_a_grading_that_stops_or_runs_too_long_gets_a_row_that_says_so(tmp_path):
    student = tmp_path / "ann"
    student.mkdir()
    (student / "ex03_rooflines.py").write_text(ANSWER_03)
    sub = find_submissions(tmp_path)[0][0]
    options = Options(only=None, extra_tests=str(tmp_path / "gone"), timeout_s=20, memory_mb=8192,
                      student_timeout_s=600)
    (tmp_path / "w1").mkdir()
    crashed = grade_one(sub, tmp_path / "w1", tmp_path / "ann.json", options, threading.Event())
    assert crashed.status == CRASHED and "exit code 2" in crashed.notes and "does not exist" in crashed.notes, crashed
    options.extra_tests, options.student_timeout_s = None, 1
    (tmp_path / "w2").mkdir()
    slow = grade_one(sub, tmp_path / "w2", tmp_path / "ann.json", options, threading.Event())
    assert slow.status == TIMED_OUT and "more than 1 s (--student-timeout)" in slow.notes, slow
    assert not (tmp_path / "ann.json").exists()


# --------------------------------------------------------------------------- the Gradescope zip

@pytest.mark.grader
@pytest.mark.timeout(60)
def test_the_autograder_zip_holds_the_scripts_the_course_and_the_hidden_tests(tmp_path):
    hidden = tmp_path / "hidden"
    hidden.mkdir()
    (hidden / "test_ex03_hidden.py").write_text("import pytest\n")
    out = tmp_path / "autograder.zip"
    names = autograder.build(out, hidden, ["ex03"])
    with zipfile.ZipFile(out) as z:
        assert set(names) == set(z.namelist())
        for script in ("setup.sh", "run_autograder"):
            assert z.getinfo(script).external_attr >> 16 == 0o100755
            (tmp_path / script).write_bytes(z.read(script))
            subprocess.run(["bash", "-n", str(tmp_path / script)], check=True)
        assert json.loads(z.read("autograder.json")) == {"only": ["ex03"]}
    assert {"hidden_tests/test_ex03_hidden.py", "solutions/ex03_rooflines.py", "tests/grading/conftest.py",
            "toyllm/grading/autograder.py", "requirements.lock", "Makefile", "tests/conftest.py"} <= set(names)
    assert not [n for n in names if n.startswith(("notebooks/", "tests/fixtures/", "tests/test_", "docs/"))]
    with pytest.raises(ValueError, match="in an existing folder"):
        autograder.build(tmp_path / "missing" / "a.zip")
    with pytest.raises(ValueError, match="lessons like 'ex01'"):
        autograder.build(out, only=["lesson three"])


def _autograde(tmp_path: Path, zip_path: Path, files: dict[str, str]) -> dict:
    root = tmp_path / "autograder"
    (root / "source").mkdir(parents=True)
    with zipfile.ZipFile(zip_path) as z:
        z.extractall(root / "source")
    (root / "submission").mkdir()
    for name, text in files.items():
        (root / "submission" / name).write_text(text)
    env = dict(os.environ, AUTOGRADER_ROOT=str(root), AUTOGRADER_PYTHON=sys.executable)
    env.pop("TOYLLM_IMPL", None)
    subprocess.run(["bash", str(root / "source" / "run_autograder")], env=env, check=True, timeout=400,
                   stdout=subprocess.DEVNULL)
    return json.loads((root / "results" / "results.json").read_text())


@pytest.mark.grader
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_run_autograder_gives_the_model_answers_full_marks_and_the_stubs_zero(tmp_path):
    out = tmp_path / "autograder.zip"
    autograder.build(out)
    answers = _autograde(tmp_path / "answers", out,
                         {"ex01_naive_generation.py": ANSWER_01, "ex03_rooflines.py": ANSWER_03})
    stubs = _autograde(tmp_path / "stubs", out,
                       {"ex03_rooflines.py": (ROOT / "exercises" / "ex03_rooflines.py").read_text()})
    for results, lessons in ((answers, {"1", "3"}), (stubs, {"3"})):        # Gradescope's schema
        assert {"score", "max_score", "output", "tests", "visibility"} <= set(results)
        assert {t["number"].split(".")[0] for t in results["tests"]} == lessons
        for t in results["tests"]:
            assert {"name", "score", "max_score", "output", "visibility", "status"} <= set(t)
            assert t["status"] in ("passed", "failed") and t["visibility"] in ("visible", "after_published")
    assert answers["score"] == answers["max_score"] == 15 + 12
    assert "no exNN file for them in your submission;" in answers["output"], answers["output"]
    assert stubs["score"] == 0 and stubs["max_score"] == 12


# --------------------------------------------------------------------------- a class from the command line

def _grade_class(folder: Path, book: Path, *more: str) -> subprocess.Popen:
    # --timeout 10: each test of the class's lessons 01 and 03 takes well under a second; what runs into the limit
    # is the hostile submission's hanging 3.2, whose two tests so cost 10 s each (each grading of it).
    env = dict(os.environ)
    env.pop("TOYLLM_IMPL", None)
    return subprocess.Popen([sys.executable, "-m", "toyllm", "grade", "--class", str(folder), "--gradebook", str(book),
                             "--jobs", "2", "--timeout", "10", *more], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            # Ctrl-C as in a terminal: a test run started in the background (CI's, with &)
                            # inherits SIGINT ignored, and Python then keeps it ignored
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def _rows(book: Path) -> dict[str, dict]:
    return {row["student"]: row for row in csv.DictReader(book.open())} if book.exists() else {}


def _a_class(folder: Path) -> None:
    # Named so that the hostile one and the model answers are graded first, side by side.
    make_submission(folder / "a_hostile", "escaping")
    for name, text in {"ex01_naive_generation.py": ANSWER_01, "ex03_rooflines.py": ANSWER_03}.items():
        (folder / "answers").mkdir(exist_ok=True)
        (folder / "answers" / name).write_text(text)
    make_submission(folder / "partial", "partial")
    (folder / "stubs").mkdir()
    stub = (ROOT / "exercises" / "ex01_naive_generation.py").read_text()
    (folder / "stubs" / "ex01_naive_generation.py").write_text(stub)
    (folder / "syntax").mkdir()
    (folder / "syntax" / "ex01_naive_generation.py").write_text(ANSWER_01.replace("def ", "def def ", 1))
    (folder / "empty").mkdir()
    _zip(folder / "zipped.zip", {"toyllm-student/exercises/ex01_naive_generation.py": ANSWER_01.encode(),
                                 "toyllm-student/exercises/01_naive_generation.ipynb": b"{}"})
    (folder / "stray").mkdir()
    for name, text in {"ex01_naive_generation.py": ANSWER_01, "ex09_extra.py": "x = 1\n", "notes.ipynb": "{}",
                       "README.md": "hi"}.items():
        (folder / "stray" / name).write_text(text)


@pytest.mark.grader
@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.takes(35)
def test_a_class_is_graded_resumed_after_ctrl_c_and_the_hostile_one_changes_no_other_row(tmp_path):
    folder, book = tmp_path / "submissions", tmp_path / "grades.csv"
    _a_class(folder)
    first = _grade_class(folder, book)
    deadline = time.monotonic() + 400
    while not any(r["status"] == GRADED for r in _rows(book).values()):
        assert first.poll() is None and time.monotonic() < deadline, first.communicate()[0]
        time.sleep(0.5)
    children = psutil.Process(first.pid).children(recursive=True)
    first.send_signal(signal.SIGINT)                         # Ctrl-C
    out, _ = first.communicate(timeout=120)
    assert first.returncode == 130, out
    gone, alive = psutil.wait_procs(children, timeout=30)
    assert not alive, [p.cmdline() for p in alive]            # every grading it started has ended
    before = _rows(book)
    graded_before = {name for name, r in before.items() if r["status"] == GRADED}
    assert graded_before and len(before) < 8, before
    stamps = {name: (tmp_path / "grades-results" / f"{name}.json").stat().st_mtime_ns for name in graded_before}

    second = _grade_class(folder, book)
    out, _ = second.communicate(timeout=800)
    assert second.returncode == 0, out
    assert f"{len(graded_before)} student(s) already graded in {book}" in out, out
    assert stamps == {name: (tmp_path / "grades-results" / f"{name}.json").stat().st_mtime_ns for name in graded_before}
    rows = _rows(book)
    assert sorted(rows) == ["a_hostile", "answers", "empty", "partial", "stray", "stubs", "syntax", "zipped.zip"]
    lesson_1 = [ex for ex in rows["answers"] if ex.startswith("1.")]
    lesson_3 = [ex for ex in rows["answers"] if ex.startswith("3.")]
    assert rows["answers"]["total"] == "27", rows["answers"]
    assert all(rows["answers"][ex] != "0" for ex in lesson_1 + lesson_3), rows["answers"]
    assert rows["a_hostile"]["status"] == GRADED and all(rows["a_hostile"][ex] == "" for ex in lesson_1)
    for name in ("zipped.zip", "stray"):
        assert rows[name]["total"] == "15" and rows[name]["status"] == GRADED, (rows[name]["status"], rows[name]["notes"])
    assert (rows["partial"]["total"], rows["stubs"]["total"], rows["syntax"]["total"]) == ("11", "0", "0")
    assert rows["empty"]["status"] == NO_FILES and rows["empty"]["total"] == "0"
    assert "graded the files in toyllm-student/exercises/" in rows["zipped.zip"]["notes"]
    assert "ignored 3 file(s)" in rows["stray"]["notes"] and "ex09_extra.py" in rows["stray"]["notes"]
    assert {row["maximum"] for row in rows.values()} == {"27"}
    shown = json.loads((tmp_path / "grades-results" / "stray.json").read_text())["output"]
    assert shown.startswith("ignored 3 file(s)"), shown                   # the student reads it too
    shown = json.loads((tmp_path / "grades-results" / "answers.json").read_text())["output"]
    assert "not graded: ex02, ex04-ex09 (no exNN file for them in answers;" in shown, shown   # not the grader's copy
    # what a student should not read is the grader's alone: the gradebook and every results file
    written = [book, *(tmp_path / "grades-results").iterdir()]
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in written} == {p.name: 0o600 for p in written}
    assert stat.S_IMODE((tmp_path / "grades-results").stat().st_mode) == 0o700


@pytest.mark.parametrize("two, word", [
    ([50.0, 51.0, 52.0, 50.5, 51.5], "met"),                               # 2.0x: above 1.5x in every round
    ([80.0, 81.0, 82.0, 80.5, 81.5], "not met"),                           # 1.25x, like the first measurement
    ([66.0, 67.5, 66.5, 67.0, 68.0], "neither met nor missed for certain"),  # 1.5x, inside the noise
])
def test_the_class_timing_target_is_a_verdict_from_the_rounds(two, word):
    from toyllm.grading.grader.class_timing import target_line

    one = [100.0, 101.0, 102.0, 100.5, 101.5]
    line = target_line(one, two)
    assert line.startswith(f"target 1.5x: {word}"), line
    assert "5 rounds" in line


def test_the_class_timing_target_needs_five_rounds():
    from toyllm.grading.grader.class_timing import target_line

    assert target_line([100.0, 101.0], [50.0, 51.0]).startswith("target 1.5x: not decided (2 rounds; a verdict needs 5)")


@pytest.mark.grader
@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.skipif(os.geteuid() != 0, reason="the submission runs as the grader's own user: only root grades as another")
def test_a_submission_sees_neither_the_class_nor_the_gradebook_nor_the_results():
    import shutil
    import tempfile

    from toyllm.grading.sandbox.launcher import namespaces_work
    from toyllm.grading.sandbox.process import sandbox_user

    if sandbox_user() is None or not namespaces_work():
        pytest.skip("no mount namespaces here: the sandbox cannot hide folders")
    # Not under /tmp, which the sandbox gets a fresh one of, but where it could look: beside the course (build/,
    # which git ignores), open to every user.
    made = not (ROOT / "build").exists()
    (ROOT / "build").mkdir(exist_ok=True)
    tmp_path = Path(tempfile.mkdtemp(prefix="test-grader-class-", dir=ROOT / "build"))
    try:
        _snoop(tmp_path)
    finally:
        shutil.rmtree(tmp_path)
        if made:
            (ROOT / "build").rmdir()


def _snoop(tmp_path: Path) -> None:
    folder, book = tmp_path / "class", tmp_path / "marks" / "grades.csv"
    results = book.parent / "grades-results"
    (folder / "a_answers").mkdir(parents=True)
    (folder / "a_answers" / "ex03_rooflines.py").write_text(ANSWER_03)
    make_submission(folder / "b_snooping", "snooping", class_dir=str(folder), results_dir=str(results),
                    gradebook_dir=str(book.parent), gradebook=str(book))
    book.parent.mkdir()
    for f in (tmp_path, folder, *folder.iterdir(), book.parent):
        f.chmod(0o755)                                 # open to all: only the sandbox's view keeps them out of sight
    proc = _grade_class(folder, book, "--jobs", "1", "--only", "3.3")
    out, _ = proc.communicate(timeout=500)
    assert proc.returncode == 0, out
    assert f"chmod -R o-rwx {folder}" in out, out      # the warning came first
    rows = _rows(book)
    assert rows["a_answers"]["status"] == rows["b_snooping"]["status"] == GRADED, rows
    assert rows["b_snooping"]["total"] == "0"
    said = [t["output"] for t in json.loads((results / "b_snooping.json").read_text())["tests"]
            if "snooped:" in t["output"]]
    assert said, json.loads((results / "b_snooping.json").read_text())
    for secret in ("a_answers", "b_snooping", "grades.csv", "graded", "score", "grades-results'"):
        assert all(secret not in text for text in said), (secret, said)
