"""Failure messages name the cause: wrong submissions get the words that say what to fix.

Each case edits the model answer into a typical mistake and checks the message it gets:
the engine exercises name the first rank and layer whose keys, values or positions differ
from one process; 8.2 without the cut at ``length`` is told so; ``prefill --check``
fails a wrong step; and in the student edition, where no model answer stands in for the
other exercises, a test that failed through another exercise names it.
"""
from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import pytest
import torch
from test_grader import _graded_conftest, _run_exercise, _variant

from toyllm import answers
from toyllm.grading import load_exercise
from toyllm.grading.sandbox import harness
from toyllm.grading.sandbox import process as sandbox
from toyllm.grading.expect import engine_cause
from toyllm.grading.sandbox.local import LocalModule

ROOT = Path(__file__).resolve().parent.parent

# One line of 5.1's model answer, and what a mistake makes of it.
PREFIX = "k, v = torch.cat([prefix[0], k], dim=-2), torch.cat([prefix[1], v], dim=-2)"
PREFIX_AFTER = "k, v = torch.cat([k, prefix[0]], dim=-2), torch.cat([v, prefix[1]], dim=-2)"
# 5.1's positions line, with the lines that make it 5.1's and not 5.2's (the same line is in both).
POSITIONS = ("k_pos = torch.arange(k.shape[-2], device=x.device)\n"
             "    out = layer.attend(q, k, v, pos.q_pos, k_pos, attention)\n"
             "    return layer.finish(x, out), k, v\n    # END SOLUTION\n\n\ndef kvr_layer(")
POSITIONS_FROM_START = POSITIONS.replace("torch.arange(k.shape[-2], device=x.device)",
                                         "torch.arange(pos.start, pos.start + k.shape[-2], device=x.device)")
NO_CUT = "reshape(hkv, n * block_size, d)[:, :length].unsqueeze(0)"
CUT_MISSING = "reshape(hkv, n * block_size, d).unsqueeze(0)"


def engine_failure(impl: Path, exercise: str, function: str, chunks: list[int]) -> str:
    """The message of the graded engine check (``engine_run``) of ``impl``'s step on ``chunks``, in this process."""
    fixtures = _graded_conftest()
    module = LocalModule(load_exercise("ex05", impl=impl), load_exercise("ex05", impl="solutions"))
    sandbox.context.exercise, sandbox.context.forbidden = exercise, tuple(answers.forbidden(exercise))
    try:
        with pytest.raises(pytest.fail.Exception) as failed:
            fixtures.make_engine_run()(getattr(module, function), exercise, "kvr", len(chunks), chunks, seed=3)
    finally:
        sandbox.context.exercise, sandbox.context.forbidden = None, ()
        harness.close_pools()
    return str(failed.value)


@pytest.mark.grader
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_prefix_after_the_ranks_own_keys_is_named(tmp_path):
    why = engine_failure(_variant(tmp_path, "5.1", PREFIX, PREFIX_AFTER), "5.1", "kvr_layer_blocking", [5, 7])
    assert "first-token logits differ" in why, why
    assert ("rank 1, layer 0: of the 12 keys it attended over, rows 0-6 hold its own tokens 5-11, rows 7-11 hold "
            "rank 0's tokens 0-4; it should attend over tokens 0-11 in order; the prefix from ranks before it "
            "(tokens 0-4) should come first") in why, why


@pytest.mark.timeout(30)
def test_a_token_id_that_comes_again_is_no_mistake():
    # values carry no position: a prompt that repeats a token has equal value rows at both places
    keys, values = torch.randn(1, 2, 6, 4), torch.randn(1, 2, 6, 4)
    values[..., 4, :] = values[..., 1, :]
    trace = [{"rank": rank, "layer": 0, "q_pos": torch.arange(3 * rank, 3 * rank + 3),
              "k_pos": torch.arange(3 * rank + 3), "k": keys[..., :3 * rank + 3, :], "v": values[..., :3 * rank + 3, :]}
             for rank in (0, 1)]
    assert engine_cause(trace, [(keys, values)], [3, 3], "kvr") == ""
    trace[1]["v"] = values[..., [3, 4, 5, 0, 1, 2], :]
    assert engine_cause(trace, [(keys, values)], [3, 3], "kvr").startswith("rank 1, layer 0: of the 6 values")


@pytest.mark.grader
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_key_positions_that_start_at_the_ranks_first_token_are_named(tmp_path):
    why = engine_failure(_variant(tmp_path, "5.1", POSITIONS, POSITIONS_FROM_START), "5.1", "kvr_layer_blocking",
                         [5, 7])
    assert ("rank 1, layer 0: the key positions given to attend are 5-16; its keys are tokens 0-11, so they should "
            "be 0-11") in why, why


@pytest.mark.grader
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_gather_rows_without_the_cut_is_told_to_cut(tmp_path):
    outcomes = _run_exercise(_variant(tmp_path, "8.2", NO_CUT, CUT_MISSING), "8.2")
    order = outcomes["test_ex8_2_rows_in_token_order"]
    assert "got (1, 2, 12, 5) torch.float32: the last block is returned whole; the sequence holds only 10 tokens, " \
           "so the rows after row 9 (not yet written) must be cut" in order, order
    model = outcomes["test_ex8_2_the_model_attends_over_the_blocks"]
    assert "returned 8 rows instead of 6: the last block is returned whole" in model, model


def prefill_check(answers_dir: Path | None) -> subprocess.CompletedProcess:
    env = {**os.environ, "TOYLLM_FAST": "1"}
    if answers_dir is not None:
        env["TOYLLM_ANSWERS"] = str(answers_dir)            # the engine's KVR step is this folder's 5.2
    return subprocess.run([sys.executable, "-m", "toyllm", "prefill", "--method", "kvr", "--world-size", "2",
                           "--context", "12", "--repeat", "1", "--check"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=240)


@pytest.mark.grader
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_prefill_check_fails_a_wrong_step_and_passes_the_right_one(tmp_path):
    for answer in (ROOT / "solutions").glob("ex*.py"):          # the engine's attention is 2.1 from here too
        (tmp_path / answer.name).write_text(answer.read_text())
    wrong = (ROOT / "solutions" / "ex05_kv_runahead.py").read_text()
    old = "k, v = torch.cat([k_prev, k], dim=-2), torch.cat([v_prev, v], dim=-2)"
    assert wrong.count(old) == 1, "the model answer of 5.2 changed"
    (tmp_path / "ex05_kv_runahead.py").write_text(wrong.replace(old, old.replace("[k_prev, k]", "[k, k_prev]")
                                                                    .replace("[v_prev, v]", "[v, v_prev]")))
    bad = prefill_check(tmp_path)
    assert bad.returncode == 1, (bad.returncode, bad.stdout, bad.stderr)
    assert "allowed 1.00e-04" in bad.stdout and "DIFFERS from one process" in bad.stdout, bad.stdout
    good = prefill_check(None)
    assert good.returncode == 0 and "agrees with one process" in good.stdout, (good.stdout, good.stderr)


# --------------------------------------------------------------------------- the student edition

AS_EDITION = "from toyllm import answers\nanswers.EDITION = \"student\"\n"


@pytest.mark.grader
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_in_the_edition_a_test_that_failed_through_8_2_names_it(tmp_path):
    """Model answers but a wrong 8.2, in a course without solutions/ and with the edition's switch: every test
    outside 8.2 that fails names 8.2 (and only 8.2)."""
    impl = tmp_path / "impl"
    impl.mkdir()
    _variant(impl, "8.2", NO_CUT, CUT_MISSING)
    for other in (ROOT / "solutions").glob("ex*.py"):
        if not (impl / other.name).exists():
            (impl / other.name).write_text(other.read_text())
    course = tmp_path / "course"
    (course / "tests").mkdir(parents=True)
    (course / "exercises").symlink_to(impl)
    (course / "tests" / "grading").symlink_to(ROOT / "tests" / "grading")
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (plugins / "as_edition.py").write_text(AS_EDITION)
    report = tmp_path / "report.xml"
    env = {**os.environ, "TOYLLM_COURSE_DIR": str(course), "TOYLLM_IMPL": str(impl), "TOYLLM_FAST": "1",
           "PYTHONPATH": str(plugins), "PYTEST_ADDOPTS": "-p as_edition"}   # the grading of 8.2 for the note too
    run = subprocess.run([sys.executable, "-m", "pytest", str(ROOT / "tests" / "grading" / "test_ex08_serving.py"),
                          "-q", "-p", "no:cacheprovider", "-k", "ex8_1 or ex8_3", f"--junitxml={report}"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=560)
    failed = [case.get("name") for case in ElementTree.parse(report).iter("testcase") if case.find("failure") is not None]
    assert failed, run.stdout[-3000:]
    # the notes come once every test has run (grading 8.2 takes seconds): one summary line per failed test
    notes = dict(line.split("::", 1)[1].split(": ", 1) for line in run.stdout.splitlines()
                 if line.startswith("tests/grading/test_ex08_serving.py::") and ": this test also ran" in line)
    note = "this test also ran your gather_rows (Exercise 8.2), which fails its own tests: fix 8.2 first"
    for name in failed:
        assert notes.get(name) == note, (name, notes, run.stdout[-3000:])


@pytest.mark.grader
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_under_the_grader_a_test_that_failed_through_8_2_names_it_and_an_unwritten_2_1_is_not_blamed(tmp_path):
    """The grader runs the submission's own neighbours in this edition too: model answers but a wrong 8.2 and an
    unwritten lesson 02 (PyTorch's kernel stands in for 2.1). 8.1's failed tests name 8.2 and never 2.1; 8.4,
    which runs no other exercise, keeps full marks."""
    from test_grader import grade_from_template, outputs

    _variant(tmp_path, "8.2", NO_CUT, CUT_MISSING)
    (tmp_path / "ex02_kv_cache.py").write_text((ROOT / "exercises" / "ex02_kv_cache.py").read_text())
    report = grade_from_template(tmp_path, only=["ex08"])
    scores = report.by_exercise()
    assert scores["8.2"][0] < scores["8.2"][1] and scores["8.4"][0] == scores["8.4"][1], scores
    said = outputs(report, "8.1")
    assert scores["8.1"][0] < scores["8.1"][1], (scores, said)
    note = "this test also ran your gather_rows (Exercise 8.2), which fails its own tests: fix 8.2 first"
    failed = [out for out in said if out]
    assert failed and all(note in out for out in failed), said
    assert not any("Exercise 2.1" in out for out in said), said



def test_a_neighbour_whose_verdict_is_known_is_not_graded_again(monkeypatch):
    from toyllm.grading import expect

    monkeypatch.setattr(expect, "_fails_own_tests", lambda number: pytest.fail(f"Exercise {number} graded again"))
    note = expect.neighbours_note("5.1", {"5.1", "2.1"}, known={"2.1": True, "5.1": True})
    assert note == "this test also ran your attention_with_offset (Exercise 2.1), which fails its own tests: fix 2.1 first"
    assert expect.neighbours_note("5.1", {"5.1", "2.1"}, known={"2.1": False}) == ""


@pytest.mark.grader
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_what_one_lesson_showed_of_its_exercises_is_handed_to_the_next(monkeypatch, tmp_path):
    """Lessons 02 and 04 untouched, lesson 03 the model answer: lesson 02's own tests fail 2.1 and lesson 03's
    all pass, so lesson 04's process is told both, and its failed engine tests name 2.1 without grading it
    again in a new process."""
    from test_grader import grade_from_template

    from toyllm.grading.grader import grade as grading

    for folder, lesson in (("exercises", "ex02"), ("solutions", "ex03"), ("exercises", "ex04")):
        source = next((ROOT / folder).glob(f"{lesson}_*.py"))
        (tmp_path / source.name).write_text(source.read_text())
    handed = {}
    real = grading.run_lesson

    def spy(lesson, *args, verdicts=None, **kwargs):
        handed[lesson] = dict(verdicts)
        return real(lesson, *args, verdicts=verdicts, **kwargs)

    monkeypatch.setattr(grading, "run_lesson", spy)
    report = grade_from_template(tmp_path, only="ex02,ex03,ex04")
    assert handed[2] == {}, handed
    assert handed[4]["2.1"] is True and all(handed[4][f"3.{n}"] is False for n in range(1, 7)), handed
    note = "this test also ran your attention_with_offset (Exercise 2.1), which fails its own tests: fix 2.1 first"
    named = [t.name for t in report.tests if t.lesson == 4 and note in t.output]
    assert named, [t.output for t in report.tests if t.lesson == 4]
