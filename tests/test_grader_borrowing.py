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

from test_grader import ROOT, grade_from_template, make_submission, outputs


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


READING_MEMORY = ROOT / "tests" / "fixtures" / "submissions" / "reading_memory"
# Each byte + 1: the needles reach the sandbox encoded, and no transformed copy the scan makes holds one in
# clear (a rotation by one is not its own inverse), so only what the sandbox held before is found.
SHIFT = bytes((i + 1) % 256 for i in range(256))



@pytest.mark.grader
@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.takes(35)
def test_no_sandbox_holds_any_model_answer_whatever_exercise_it_serves(tmp_path, monkeypatch):
    """A sandbox serving an exercise of each lesson in turn; the scan finds no line of any model answer.

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
    scanner = (READING_MEMORY / "ex01_naive_generation.py").read_text()
    (submission / "ex01_naive_generation.py").write_text(scanner + f"\nPLANTED = {needles[0]!r}\n")
    monkeypatch.setenv(Settings.variable("impl"), str(submission))
    box = Sandbox(memory_mb=4096)
    try:
        # A sandbox serves one exercise at a time: one of each lesson, where a lesson has them one whose graded
        # tests run other exercises through the framework (2.1's kernel, 3.3 in 3.5, 8.2 in 8.1, 9.1 and 9.2
        # in 9.3): a neighbour's model answer was once handed to the sandbox for those.
        for number in ("1.1", "2.4", "3.5", "4.2", "5.2", "6.1", "7.3", "8.1", "9.3"):
            monkeypatch.setattr(process.context, "exercise", number)    # what the grader sets while it grades
            box.load("ex01")
            found = box.call(("exercise", "ex01", "scan"), (encoded,), {}, f"scan() serving {number}")
            held = [needles[i] if isinstance(i, int) else i for i in found]
            assert held == [needles[0]], f"a sandbox serving Exercise {number} holds: {held[1:] or held}"
    finally:
        box.close()


@pytest.mark.grader
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_another_exercises_model_answer_earns_nothing(tmp_path):
    submission = make_submission(tmp_path / "sub", "borrowing")
    report = grade_from_template(submission, only=["1.1", "5.1"])
    scores = report.by_exercise()
    for exercise in ("1.1", "5.1"):
        said = outputs(report, exercise)
        assert scores[exercise][0] == 0 < scores[exercise][1], (exercise, said)
        assert any("must be your own code" in out for out in said), (exercise, said)
    answers = grade_from_template("solutions", only=["1.1", "5.1"]).by_exercise()
    assert all(got == most for got, most in answers.values()), answers
