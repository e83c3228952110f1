"""The costs of the graded searches (lessons 06-07) are evaluated and counted in the grader, never in the sandbox.

A graded search gets ``harness.Counted(cost)``: under the grader the
submission holds a stub that asks the grader for each value, so the
expected answer that the cost holds (``best=``, ``optimum=``,
``crossing=``) never reaches the submission's process, nothing there can
turn the count off, and a search that asks too often is stopped with a
clear failure. The fixture submissions are described in
tests/fixtures/submissions/README.md.
"""
from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from test_grader import grade_from_template
from toyllm.grading.sandbox.harness import MAX_EVALUATIONS

ROOT = Path(__file__).resolve().parent.parent
SUBMISSIONS = ROOT / "tests" / "fixtures" / "submissions"
SEARCHES = ["6.1", "6.2", "7.4"]


def submission(folder: Path, fixture: str | None = None, **extra: str) -> Path:
    """The model answers of lessons 06-07 with the fixture's (or ``extra``'s) functions appended."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("ex06_partition_search.py", "ex07_networks.py"):
        text = (ROOT / "solutions" / name).read_text()
        if fixture is not None:
            text += "\n\n" + (SUBMISSIONS / fixture / name).read_text()
        text += "\n\n" + textwrap.dedent(extra.get(name[:4], ""))
        (folder / name).write_text(text)
    return folder


@pytest.mark.grader
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_model_answers_of_the_searches_score_full_marks():
    report = grade_from_template("solutions", only=SEARCHES)
    assert report.score == report.max_score == 9, [(t.name, t.output) for t in report.tests if t.status != "passed"]


@pytest.mark.grader
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_reading_the_answer_out_of_the_cost_or_turning_the_count_off_scores_zero(tmp_path):
    """The cost's keywords, its closure, ``__reduce__``, the objects gc finds next to it and the old evaluation
    log's switch: none of them is in the sandbox, so each search is left with a wrong guess."""
    report = grade_from_template(submission(tmp_path / "sub", "reading_answers"), only=SEARCHES)
    assert {t.exercise for t in report.tests} == set(SEARCHES)
    assert report.score == 0, [(t.name, t.score) for t in report.tests if t.score]


@pytest.mark.grader
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_cost_is_dead_after_its_call_and_a_search_that_never_stops_is_stopped(tmp_path):
    kept = '''
        _calls = []

        def break_even_context(speedup, lo, hi):
            _calls.append(speedup)
            if len(_calls) == 1:                  # a fair answer, keeping the cost for later
                return _model_break_even(speedup, lo, hi)
            if len(_calls) == 2:                  # the first call's cost, in the second call
                return _calls[0](lo)
            while True:                           # asks for ever
                speedup(lo)
    '''
    folder = submission(tmp_path / "sub", ex07="_model_break_even = break_even_context\n" + textwrap.dedent(kept))
    report = grade_from_template(folder, only="7.4", per_test_timeout_s=60)
    outputs = {t.name.split(": ")[1]: (t.status, t.output) for t in report.tests}
    status, output = outputs["test_ex7_4_a_known_crossing_with_few_calls"]
    assert status == "failed" and "only valid during the call it was given to" in output, output
    status, output = outputs["test_ex7_4_none_lo_and_bad_input"]
    assert status == "failed" and f"more than {MAX_EVALUATIONS} times" in output, output
