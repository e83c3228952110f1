"""The graded tests of lessons 04-05 can fail: each catches the mistake it is there for.

Each case edits one line of the model answer into a typical mistake, grades
that exercise alone, and checks which tests fail and what they say.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from test_grader import grade_from_template

ROOT = Path(__file__).resolve().parent.parent


def submission(tmp_path: Path, lesson_file: str, old: str, new: str) -> Path:
    source = (ROOT / "solutions" / lesson_file).read_text()
    assert source.count(old) == 1, f"the model answer no longer contains {old!r}"
    (tmp_path / lesson_file).write_text(source.replace(old, new))
    return tmp_path


@pytest.mark.grader
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_an_irecv_posted_after_the_projection_fails_the_overlap_test_only(tmp_path):
    # right logits, but the receive is posted once the projection is done: nothing overlaps
    sub = submission(tmp_path, "ex05_kv_runahead.py",
                     "    incoming = chain.irecv()\n    q, k, v = layer.qkv(x, pos.cos, pos.sin)\n",
                     "    q, k, v = layer.qkv(x, pos.cos, pos.sin)\n    incoming = chain.irecv()\n")
    report = grade_from_template(sub, only="5.2")
    status = {t.nodeid.rpartition("::")[2]: t.status for t in report.tests}
    assert status == {"test_ex5_2_three_ranks_uneven_and_drawn_chunks_give_equal_logits": "passed",
                      "test_ex5_2_posts_the_receive_before_the_projection": "failed"}, status
    failed = next(t for t in report.tests if t.status == "failed")
    assert "Exercise 5.2, kvr_layer, p=2" in failed.output and "not posted" in failed.output, failed.output


@pytest.mark.grader
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_counting_with_toyllms_own_functions_scores_zero(tmp_path):
    submission(tmp_path, "ex04_tsp.py", "    C = sum(chunks)\n    return [int(c) * C for c in chunks]\n",
               "    from toyllm.partition import dot_products\n    return dot_products(chunks, 'tsp')\n")
    submission(tmp_path, "ex05_kv_runahead.py",
               "    return ttft1_s / 2 * (1 / world_size + 1 / world_size ** 2)\n",
               "    from toyllm import partition\n    return partition.ttft_lower_bound(ttft1_s, world_size)\n")
    report = grade_from_template(tmp_path, only=["4.1", "4.3", "5.3", "5.4"])
    scores = report.by_exercise()
    assert scores["4.1"] == (0, 2) and scores["5.4"] == (0, 1), scores
    assert scores["4.3"] == (2, 2) and scores["5.3"] == (2, 2), scores      # untouched exercises keep their points
    assert all(t.output.startswith(f"Exercise {t.exercise} must be your own code") for t in report.tests
               if t.exercise in ("4.1", "5.4")), [t.output for t in report.tests]


@pytest.mark.grader
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_step_that_keeps_only_its_own_keys_gets_a_message_naming_the_exercise(tmp_path):
    sub = submission(tmp_path, "ex04_tsp.py", "    return layer.finish(x, out), k_all, v_all\n",
                     "    return layer.finish(x, out), k, v\n")
    report = grade_from_template(sub, only="4.2")
    assert report.by_exercise()["4.2"] == (0, 4)
    assert all(re.search(r"Exercise 4\.2, tsp_layer in the engine.*rank \d+, layer 0, tsp_layer returned keys "
                         r"for \d+ tokens, expected C = \d+.*did you all-gather", t.output)
               for t in report.tests), [t.output for t in report.tests]
