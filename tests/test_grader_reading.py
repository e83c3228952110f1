"""The grader reads a submission as regular files only: links, pipes, folders, devices and huge files are skipped.

The grader's own side runs as root, outside the sandbox. A submitted
``*.py`` that is a link to the model answers, the hidden tests, the grader's
environment or log, a named pipe, a folder or ``/dev/zero`` must give the
submission nothing: it is skipped with one line in the report, and the work
beside it is graded as usual. ``read_submission`` itself is tested first
(fast); one grading run of lessons 01 and 03 then checks the whole path, on
``tests/fixtures/submissions/linking/`` plus what only a running test can
make (links into ``/proc``, a pipe, a sparse file).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import tracemalloc
from pathlib import Path

import pytest

from toyllm.grading.sandbox.submission import MAX_FILE_BYTES, MAX_TOTAL_BYTES, read_submission

ROOT = Path(__file__).resolve().parent.parent
LINKING = ROOT / "tests" / "fixtures" / "submissions" / "linking"
SPARSE_BYTES = 300 * 2**20


def skipped(problems: list[str]) -> dict[str, str]:
    """{file name: why} from ``read_submission``'s lines."""
    out = {}
    for line in problems:
        name, _, why = line.partition(" was not graded: ")
        out[name.strip("'")] = why.split(";")[0]
    return out


# --------------------------------------------------------------------------- read_submission on its own

@pytest.mark.timeout(30)
def test_only_regular_files_are_read_and_everything_else_is_named_with_its_reason(tmp_path):
    (tmp_path / "ex03_rooflines.py").write_text("x = 1\n")
    (tmp_path / "linked.py").symlink_to(tmp_path / "ex03_rooflines.py")          # a link, even to a good file
    (tmp_path / "dangling.py").symlink_to(tmp_path / "nowhere.py")
    (tmp_path / "environ.py").symlink_to("/proc/self/environ")
    (tmp_path / "zero.py").symlink_to("/dev/zero")
    os.mkfifo(tmp_path / "pipe.py")
    (tmp_path / "notes.py").mkdir()
    (tmp_path / ".hidden.py").write_text("y = 2\n")
    (tmp_path / "readme.txt").write_text("not Python")
    files, problems = read_submission(tmp_path)
    assert files == {"ex03_rooflines.py": "x = 1\n"}
    assert skipped(problems) == {".hidden.py": "its name starts with a dot", "dangling.py": "it is a symbolic link",
                                 "environ.py": "it is a symbolic link", "linked.py": "it is a symbolic link",
                                 "notes.py": "it is a folder", "pipe.py": "it is a named pipe",
                                 "zero.py": "it is a symbolic link"}
    assert all("only regular .py files (no links) of at most 1 MiB each" in line for line in problems)


@pytest.mark.timeout(30)
def test_a_huge_file_is_skipped_without_being_read(tmp_path):
    with open(tmp_path / "sparse.py", "wb") as f:
        f.truncate(SPARSE_BYTES)                      # 300 MiB of zeros that take no disk space
    (tmp_path / "ex01.py").write_text("x = 1\n")
    tracemalloc.start()
    try:
        files, problems = read_submission(tmp_path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert files == {"ex01.py": "x = 1\n"}
    assert skipped(problems) == {"sparse.py": "it is larger than 1 MiB"}
    assert peak < MAX_FILE_BYTES, f"reading a submission with a 300 MiB file allocated {peak / 2**20:.1f} MiB"


@pytest.mark.timeout(30)
def test_the_files_together_are_capped_too(tmp_path):
    n = MAX_TOTAL_BYTES // MAX_FILE_BYTES
    for i in range(n + 1):
        (tmp_path / f"part{i}.py").write_bytes(b"#" * (MAX_FILE_BYTES - 1) + b"\n")
    files, problems = read_submission(tmp_path)
    assert sorted(files) == [f"part{i}.py" for i in range(n)]
    assert skipped(problems) == {f"part{n}.py": "with the files before it, the submission holds more than 4 MiB"}


@pytest.mark.timeout(30)
def test_source_is_decoded_as_python_decodes_it(tmp_path):
    (tmp_path / "latin.py").write_bytes("# -*- coding: latin-1 -*-\nname = 'café'\n".encode("latin-1"))
    (tmp_path / "bom.py").write_bytes("\ufeffname = 'café'\n".encode("utf-8"))
    (tmp_path / "plain.py").write_bytes("name = 'café'\n".encode("utf-8"))
    (tmp_path / "broken.py").write_bytes("name = 'café'\n".encode("latin-1"))      # no declaration: not UTF-8
    (tmp_path / "unknown.py").write_bytes(b"# coding: no-such-codec\nname = 1\n")
    files, problems = read_submission(tmp_path)
    # Saved as UTF-8 wherever it goes next, so the declaration says utf-8, on the same line.
    assert files["latin.py"] == "# -*- coding: utf-8 -*-\nname = 'café'\n"
    assert files["bom.py"] == files["plain.py"] == "name = 'café'\n"
    for name in ("latin.py", "bom.py", "plain.py"):
        scope = {}
        exec(compile(files[name].encode("utf-8"), name, "exec"), scope)          # as Python reads the saved file
        assert scope["name"] == "café", name
    reasons = skipped(problems)
    assert set(reasons) == {"broken.py", "unknown.py"}
    assert all(why.startswith("it is not Python source text") for why in reasons.values()), reasons


# --------------------------------------------------------------------------- one grading run

HIDDEN_PRINT = "hidden-test-printed-this-7d1f"
HIDDEN_SOURCE = "hidden-test-source-3b9e"
HIDDEN_TEST = f'''
    # {HIDDEN_SOURCE}
    import pytest
    from toyllm.grading import load_exercise

    @pytest.mark.exercise("3.3")
    @pytest.mark.points(1)
    def test_hidden_step_time():
        print("{HIDDEN_PRINT}")
        assert load_exercise("ex03").min_step_time_s(2e9, 1e6, 1, 1e12) == pytest.approx(2.001e-3)
    '''
ENV_SECRET = "TOYLLM_READING_TEST_SECRET"

# Run in a fresh process, so that its children's peak memory is this grading run's alone. Its own peak is read
# from /proc (VmHWM, this program's memory since it started): its ru_maxrss would still hold the resident size
# of the pytest process it was forked from, which a whole test session grows past a gigabyte.
GRADE = """
import json, resource, sys
from toyllm.grading import grade

report = grade(sys.argv[1], only=["ex01", "ex03"], extra_tests=sys.argv[2], results_path=sys.argv[3])
own_kib = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
peak_kib = max(own_kib, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
print(json.dumps({"table": report.table(show_hidden=False), "notes": report.notes, "peak_mib": peak_kib / 1024,
                  "points": {ex: list(points) for ex, points in report.by_exercise().items()},
                  "outputs": {t.name: t.output for t in report.tests}}))
"""


def make_linking_submission(folder: Path) -> Path:
    """``linking/`` with its lesson 03 in latin-1, and the links, pipe, folder and huge file a test can make."""
    folder.mkdir()
    (folder / "ex01_naive_generation.py").symlink_to(LINKING / "ex01_naive_generation.py")    # -> the model answer
    trick = (LINKING / "ex03_rooflines.py").read_text(encoding="utf-8")
    answer = (ROOT / "solutions" / "ex03_rooflines.py").read_text(encoding="utf-8")
    (folder / "ex03_rooflines.py").write_bytes(
        ("# -*- coding: latin-1 -*-\n" + answer + "\n\n" + trick).encode("latin-1"))
    links = {"environ.py": "/proc/self/environ", "shadow.py": "/etc/shadow", "stdout.py": "/proc/self/fd/1",
             "hidden.py": "/proc/self/cwd/hidden/test_ex03_hidden.py", "log.py": "/proc/self/cwd/ex03.jsonl",
             "course.py": str(ROOT / "tests" / "grading" / "conftest.py"), "zero.py": "/dev/zero",
             "dangling.py": "/nonexistent/file.py"}
    for name, target in links.items():
        (folder / name).symlink_to(target)
    os.mkfifo(folder / "pipe.py")
    (folder / "notes.py").mkdir()
    with open(folder / "sparse.py", "wb") as f:
        f.truncate(SPARSE_BYTES)
    return folder


@pytest.mark.grader
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_links_and_odd_files_give_the_submission_nothing_and_cost_nothing(tmp_path):
    submission = make_linking_submission(tmp_path / "submission")
    hidden = tmp_path / "hidden_tests"
    hidden.mkdir()
    (hidden / "test_ex03_hidden.py").write_text(textwrap.dedent(HIDDEN_TEST))
    results = tmp_path / "results.json"
    env = dict(os.environ, **{ENV_SECRET: "environment-secret-5c2a"})
    run = subprocess.run([sys.executable, "-c", GRADE, str(submission), str(hidden), str(results)], env=env,
                         capture_output=True, text=True, timeout=280)
    assert run.returncode == 0, run.stderr[-3000:]
    graded = json.loads(run.stdout.strip().splitlines()[-1])
    points = {ex: tuple(p) for ex, p in graded["points"].items()}

    # The model answer behind the link scores nothing: the sandbox never got it.
    assert all(points[ex][0] == 0 for ex in points if ex.startswith("1.")), points
    # The work beside the junk, in latin-1 with its declaration, keeps every point (3.3 shows what it was given).
    for ex in ("3.1", "3.2", "3.4", "3.6"):
        assert points[ex][0] == points[ex][1] > 0, (ex, points[ex])
    shown = [out for name, out in graded["outputs"].items() if name.startswith("Exercise 3.3: test_ex3_3")]
    assert shown and all("beside me: {}" in out for out in shown), shown
    # 3.5 runs this submission's own 3.3 (no model answer stands in), so it fails with it, and says why.
    assert points["3.5"][0] == 0, points["3.5"]
    through = [out for name, out in graded["outputs"].items() if name.startswith("Exercise 3.5:")]
    assert through and all("beside me: {}" in out and "(Exercise 3.3), which fails its own tests" in out
                           for out in through), through

    # Nothing of what the links point at reaches a message, the table or results.json.
    visible = "\n".join([graded["table"], *graded["outputs"].values(), results.read_text()])
    shadow = Path("/etc/shadow").read_bytes()[:12].decode(errors="replace") if os.access("/etc/shadow", os.R_OK) else None
    for secret in ("environment-secret-5c2a", HIDDEN_PRINT, HIDDEN_SOURCE, "def _assert_independent(",
                   '"event": "collected"', "Lesson 01 exercises", shadow):
        assert secret is None or secret not in visible, f"{secret!r} leaked"

    # The grader's side read no more than the cap: /dev/zero and 300 MiB were skipped, not read.
    assert graded["peak_mib"] < 600, f"a process of the grading run reached {graded['peak_mib']:.0f} MiB"

    # The report names each skipped file and why, where the student sees it.
    reasons = skipped(graded["notes"])
    assert reasons == {"course.py": "it is a symbolic link", "dangling.py": "it is a symbolic link",
                       "environ.py": "it is a symbolic link", "ex01_naive_generation.py": "it is a symbolic link",
                       "hidden.py": "it is a symbolic link", "log.py": "it is a symbolic link",
                       "notes.py": "it is a folder", "pipe.py": "it is a named pipe",
                       "shadow.py": "it is a symbolic link", "sparse.py": "it is larger than 1 MiB",
                       "stdout.py": "it is a symbolic link", "zero.py": "it is a symbolic link"}, reasons
    assert all(line in graded["table"] and line in json.loads(results.read_text())["output"]
               for line in graded["notes"])
