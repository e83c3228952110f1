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
    assert [(s.name, bool(s.problem)) for s in found] == [("ann", False), ("bob", False), ("bob.zip", True),
                                                          ("dan", False)]
    assert found[3].path == tmp_path / "dan.zip"
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


@pytest.mark.timeout(30)
def test_the_default_jobs_follow_the_cores_and_the_memory():
    jobs, why = default_jobs()
    assert 1 <= jobs <= os.cpu_count() and "core(s)" in why and "GiB of memory available" in why


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
    env = dict(os.environ)
    env.pop("TOYLLM_IMPL", None)
    return subprocess.Popen([sys.executable, "-m", "toyllm", "grade", "--class", str(folder), "--gradebook", str(book),
                             "--jobs", "2", "--timeout", "30", *more], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


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


@pytest.mark.slow
@pytest.mark.timeout(900)
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
    assert sorted(rows) == ["a_hostile", "answers", "empty", "partial", "stray", "stubs", "syntax", "zipped"]
    lesson_1 = [ex for ex in rows["answers"] if ex.startswith("1.")]
    lesson_3 = [ex for ex in rows["answers"] if ex.startswith("3.")]
    assert rows["answers"]["total"] == "27", rows["answers"]
    assert all(rows["answers"][ex] != "0" for ex in lesson_1 + lesson_3), rows["answers"]
    assert rows["a_hostile"]["status"] == GRADED and all(rows["a_hostile"][ex] == "" for ex in lesson_1)
    for name in ("zipped", "stray"):
        assert rows[name]["total"] == "15" and rows[name]["status"] == GRADED, (rows[name]["status"], rows[name]["notes"])
    assert (rows["partial"]["total"], rows["stubs"]["total"], rows["syntax"]["total"]) == ("11", "0", "0")
    assert rows["empty"]["status"] == NO_FILES and rows["empty"]["total"] == "0"
    assert "graded the files in toyllm-student/exercises/" in rows["zipped"]["notes"]
    assert "ignored 3 file(s)" in rows["stray"]["notes"] and "ex09_extra.py" in rows["stray"]["notes"]
    assert {row["maximum"] for row in rows.values()} == {"27"}
    shown = json.loads((tmp_path / "grades-results" / "stray.json").read_text())["output"]
    assert shown.startswith("ignored 3 file(s)"), shown                   # the student reads it too
    shown = json.loads((tmp_path / "grades-results" / "answers.json").read_text())["output"]
    assert "not graded: ex02, ex04-ex09 (no exNN file for them in answers;" in shown, shown   # not the grader's copy


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
