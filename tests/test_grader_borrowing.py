"""No model answer is within a submission's reach, its own or another exercise's.

The sandbox holds no model answer at all, as text or as code: toyllm's marked
functions run the submission's own exercises there, in either edition
(``toyllm.answers.run_submission``). A probe handed in as a submission scans
a sandbox serving each exercise of the course (its modules, the strings and
code objects the garbage collector knows, and every writable page of its
memory) for the lines of every model answer. One grading run of
``tests/fixtures/submissions/borrowing/`` tries every way it knows to get
1.1 answered by 1.2's sampler and 5.1 by 5.2's step: each scores 0, and the
model answers keep full marks on both.
"""
from __future__ import annotations

import pytest

from test_grader import ROOT, make_submission, outputs
from toyllm.grading import grade


# Lines of the model answers, searched for in the sandbox's memory: each exercise's longest lines that occur
# nowhere in toyllm/ or exercises/ (which a sandbox holds legitimately).
def answer_lines(per_exercise: int = 3, shortest: int = 28) -> dict[str, list[str]]:
    import re

    elsewhere = "\n".join(p.read_text() for folder in ("toyllm", "exercises") for p in (ROOT / folder).rglob("*.py"))
    found: dict[str, list[str]] = {}
    for path in sorted((ROOT / "solutions").glob("ex*.py")):
        number, inside = None, False
        for line in path.read_text().splitlines():
            begin = re.match(r"\s*# BEGIN SOLUTION (\d+\.\d+)", line)
            if begin:
                number, inside = begin[1], True
            elif re.match(r"\s*# END SOLUTION", line):
                inside = False
            elif inside and not line.strip().startswith("#") and len(line.strip()) >= shortest \
                    and line.strip() not in elsewhere:
                found.setdefault(number, []).append(line.strip())
    return {n: sorted(lines, key=len, reverse=True)[:per_exercise] for n, lines in found.items()}


# Each byte + 1: the needles reach the sandbox encoded, and no transformed copy the scan makes holds one in
# clear (a rotation by one is not its own inverse), so only what the sandbox held before is found.
SHIFT = bytes((i + 1) % 256 for i in range(256))

SCANNER = '''import ctypes, gc, sys

SHIFT = bytes((i + 1) % 256 for i in range(256))


def scan(encoded):
    """Which needles this process holds (given shifted by one, returned by number): in a module's name or file,
    a string constant of a code object the garbage collector knows, or anywhere in its writable memory."""
    found = set()
    for name, module in list(sys.modules.items()):
        where = name + str(getattr(module, "__file__", "") or "")
        if "solutions" in where or "given" in where:
            found.add("module " + where)
    for obj in gc.get_objects():
        for text in getattr(obj, "co_consts", None) or ():
            if isinstance(text, str) and len(text) > 20:
                shifted = text.encode(errors="replace").translate(SHIFT)
                found.update(i for i, e in enumerate(encoded) if e in shifted)
    with open("/proc/self/maps") as maps:
        regions = [line.split() for line in maps]
    for fields in regions:                 # read in place (ctypes): the sandbox may not open /proc/self/mem
        if not fields[1].startswith("rw") or (len(fields) > 5 and fields[5].startswith(("/", "[v"))):
            continue                           # libraries and files are not data; [vvar] and [vsyscall] fault
        start, end = (int(x, 16) for x in fields[0].split("-"))
        shifted = ctypes.string_at(start, end - start).translate(SHIFT)
        found.update(i for i, e in enumerate(encoded) if e in shifted)
        del shifted
    return sorted(found, key=str)
'''


@pytest.mark.grader
@pytest.mark.timeout(600)
def test_no_sandbox_holds_any_model_answer_whatever_exercise_it_serves(tmp_path, monkeypatch):
    """A sandbox serving each exercise of the course in turn; the scan finds no line of any model answer.

    The scan is checked on itself: a line of a model answer planted in the probe's own file is found.
    """
    from toyllm.grading.sandbox import process
    from toyllm.grading.sandbox.process import Sandbox
    from toyllm.grading.settings import Settings

    lines = answer_lines()
    needles = [line for group in lines.values() for line in group]
    assert len(lines) >= 30, f"too few exercises with a line to look for: {sorted(lines)}"
    encoded = [n.encode().translate(SHIFT) for n in needles]
    submission = tmp_path / "submission"
    submission.mkdir()
    (submission / "ex01_naive_generation.py").write_text(SCANNER + f"\nPLANTED = {needles[0]!r}\n")
    monkeypatch.setenv(Settings.variable("impl"), str(submission))
    box = Sandbox(memory_mb=4096)
    try:
        lessons = {}
        for number in lines:                      # one exercise of each lesson: a sandbox serves one at a time
            lessons.setdefault(number.split(".")[0], number)
        for number in [*lessons.values(), *[n for n in ("2.1", "8.1", "9.3") if n in lines]]:
            monkeypatch.setattr(process.context, "exercise", number)    # what the grader sets while it grades
            box.load("ex01")
            found = box.call(("exercise", "ex01", "scan"), (encoded,), {}, f"scan() serving {number}")
            held = [needles[i] if isinstance(i, int) else i for i in found]
            assert held == [needles[0]], f"a sandbox serving Exercise {number} holds: {held[1:] or held}"
    finally:
        box.close()


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_another_exercises_model_answer_earns_nothing(tmp_path):
    submission = make_submission(tmp_path / "sub", "borrowing")
    report = grade(submission, only=["1.1", "5.1"])
    scores = report.by_exercise()
    for exercise in ("1.1", "5.1"):
        said = outputs(report, exercise)
        assert scores[exercise][0] == 0 < scores[exercise][1], (exercise, said)
        assert any("must be your own code" in out for out in said), (exercise, said)
    answers = grade("solutions", only=["1.1", "5.1"]).by_exercise()
    assert all(got == most for got, most in answers.values()), answers
