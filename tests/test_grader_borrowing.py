"""No model answer that could answer the exercise under test is within its reach.

While Exercise X is graded, the sandbox holds only the model answers X needs
(``toyllm.grading.sandbox.process.model_answers_for``): those X's own model answer
calls and those its lesson's graded tests run through toyllm, compiled from
memory and never written to a file. One grading run of
``tests/fixtures/submissions/borrowing/`` tries every way it knows to get
1.1 answered by 1.2's sampler and 5.1 by 5.2's step: each scores 0, and the
model answers keep full marks on both.
"""
from __future__ import annotations

import pytest

from test_grader import ROOT, make_submission, outputs
from toyllm.grading import grade
from toyllm.grading.sandbox.guard import exercise_functions
from toyllm.grading.sandbox.process import model_answers_for


def test_the_sandbox_gets_only_what_the_graded_exercises_model_answer_and_tests_run():
    """3.5 calls 3.3; 1.1 and 5.1 call no neighbour, and their tests run only the model's dense attention."""
    for exercise, kept in [("1.1", {"ex02_kv_cache.py": {"2.1"}}), ("5.1", {"ex02_kv_cache.py": {"2.1"}}),
                           ("3.5", {"ex03_rooflines.py": {"3.3"}}),
                           ("8.3", {"ex02_kv_cache.py": {"2.1"}, "ex08_serving.py": {"8.1", "8.2"}})]:
        given, neighbours = model_answers_for(exercise, ROOT / "solutions")
        assert {name: set(exercise_functions(text)) for name, text in given.items()} == kept, exercise
        assert neighbours == ({"3.3"} if exercise == "3.5" else set()), exercise


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
