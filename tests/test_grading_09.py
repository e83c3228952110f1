"""The graded tests of lesson 09 can fail: each catches the mistake it is there for.

Each case edits the model answer into a typical mistake of ring attention
(a merge that forgets to rescale, a causal mask on the wrong diagonal, the
partial outputs' lses left out of the traffic, a block attended with the
positions of the one before it, future blocks computed anyway), grades
those exercises, and checks which tests fail and what they say.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from test_grader import grade_from_template

ROOT = Path(__file__).resolve().parent.parent
LESSON = "ex09_ring_attention.py"


def submission(tmp_path: Path, *edits: tuple[str, str]) -> Path:
    source = (ROOT / "solutions" / LESSON).read_text()
    for old, new in edits:
        assert source.count(old) == 1, f"the model answer no longer contains {old!r}"
        source = source.replace(old, new)
    (tmp_path / LESSON).write_text(source)
    return tmp_path


def statuses(report) -> dict[str, str]:
    return {t.nodeid.rpartition("::")[2]: t.status for t in report.tests}


@pytest.mark.grader
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_an_unscaled_merge_a_shifted_mask_and_a_forgotten_lse_lose_their_points(tmp_path):
    sub = submission(
        tmp_path,
        # 9.1: both sides added as they are, each still normalised over its own keys only
        ("    return (out_a * share_a + out_b * share_b).to(out_a.dtype), lse\n",
         "    return (out_a + out_b).to(out_a.dtype), lse\n"),
        # 9.2: the mask one diagonal off: a query no longer sees its own key
        ("~causal_mask(q_pos, k_pos)", "~causal_mask(q_pos - 1, k_pos)"),
        # 9.4: the partial outputs come back without their lses
        ("(n_heads * head_dim + n_heads * (head_dim + 1))", "(n_heads * head_dim + n_heads * head_dim)"))
    report = grade_from_template(sub, only=["9.1", "9.2", "9.4"])
    scores = report.by_exercise()
    assert scores["9.1"] == (0, 2) and scores["9.2"] == (0, 2) and scores["9.4"] == (0, 2), scores
    outputs = {t.nodeid.rpartition("::")[2]: t.output for t in report.tests}
    assert "merge of the partials over keys [0, 4) and [4, 9)" in outputs[
        "test_ex9_1_two_halves_merge_into_attention_over_all_keys"], outputs
    assert "block_attention, wholly visible keys" not in outputs[
        "test_ex9_2_a_block_before_on_and_across_the_diagonal"], "a block every query sees whole is right"
    assert "block_attention, a causal square" in outputs["test_ex9_2_a_block_before_on_and_across_the_diagonal"]
    assert "ring_traffic(4096 new, 0 cached" in outputs["test_ex9_4_smollm2_cases"], outputs


@pytest.mark.grader
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_block_attended_with_the_positions_of_the_step_before_fails_every_engine_run(tmp_path):
    sub = submission(tmp_path, ("        k_pos = pos.layout[ring.origin(step)]\n",
                                "        k_pos = pos.layout[ring.origin(step - 1)]\n"))
    report = grade_from_template(sub, only="9.3")
    status = statuses(report)
    assert status["test_ex9_3_two_and_three_ranks_give_equal_logits"] == "failed", status
    assert status["test_ex9_3_four_ranks_and_decoding_continues"] == "failed", status
    failed = next(t for t in report.tests if t.nodeid.endswith("two_and_three_ranks_give_equal_logits"))
    assert "Exercise 9.3, ring_pass_kv_layer in the engine, p=2" in failed.output, failed.output


@pytest.mark.grader
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_computing_future_blocks_gives_the_right_logits_and_loses_only_the_skip_point(tmp_path):
    sub = submission(tmp_path, ("        if int(k_pos[0]) <= int(pos.q_pos[-1]):", "        if True:"))
    report = grade_from_template(sub, only="9.3")
    status = statuses(report)
    assert status == {"test_ex9_3_two_and_three_ranks_give_equal_logits": "passed",
                      "test_ex9_3_zigzag_and_the_causal_kernel": "passed",
                      "test_ex9_3_four_ranks_and_decoding_continues": "passed",
                      "test_ex9_3_blocks_wholly_in_the_future_are_skipped": "failed"}, status
    failed = next(t for t in report.tests if t.status == "failed")
    assert "rank 0 attended in layer 0 to the blocks of ranks" in failed.output and "skip" in failed.output, \
        failed.output
