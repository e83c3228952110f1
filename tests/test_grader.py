"""The grading system itself: the implementation switch, stubs, and the grader on real and fake submissions.

The fake submissions live in tests/fixtures/submissions/. Most tests grade
through ``grade_from_template``, as ``python -m toyllm grade`` does: each
lesson's pytest process and sandboxes are copies of one template that
imported torch once, kept for the whole test process (one lesson's grading
about 1 s instead of 4). ``grade`` from Python without a template, as a
notebook's ``check()`` calls it, starts fresh Pythons (a few seconds a
lesson, mostly importing torch): the tests that compare the processes or
scratch folders before and after a grading use it, and grading twice
compares it with the template's grading test by test. Every exercise of the
model answers is graded that way too, with full marks asserted, where the
lessons call ``check()`` (``tests/test_notebooks.py`` and the browser test).
"""
from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from toyllm import answers
from toyllm.grading import GradeReport, grade, load_exercise, make_stub, resolve_impl, sync
from toyllm.grading.grader.run import close_standby
from toyllm.grading.sandbox.process import sandbox_user

ROOT = Path(__file__).resolve().parent.parent
SUBMISSIONS = ROOT / "tests" / "fixtures" / "submissions"
LESSONS = {int(p.name[7:9]): p.name[5:9] for p in (ROOT / "tests" / "grading").glob("test_ex[0-9][0-9]_*.py")}

HIDDEN_TESTS = {
    # named after its lesson: runs in lesson 03's process
    "test_ex03_hidden.py": '''
        import pytest
        from toyllm.grading import load_exercise

        @pytest.mark.exercise("3.2")
        @pytest.mark.points(3)
        def test_hidden_attention_intensity_of_a_short_prompt():
            assert load_exercise("ex03").attention_intensity(10, 10) == pytest.approx(5.0)

        # the fixtures of the visible graded tests (tests/grading/conftest.py) serve hidden tests too
        @pytest.mark.exercise("3.2")
        @pytest.mark.points(1)
        def test_hidden_decode_step_through_the_fixture(ex03):
            assert ex03.attention_intensity(99, 1) == pytest.approx(0.99)      # S = 99 keys, T = 1 query
        ''',
    # named after nothing: its marker sends it to lesson 01's process
    "test_more_checks.py": '''
        import pytest
        import torch
        from toyllm.grading import load_exercise

        @pytest.mark.exercise("1.1")
        @pytest.mark.points(1)
        def test_hidden_greedy_on_a_one_hot_vector():
            assert load_exercise("ex01").greedy_next_token(torch.eye(7)[4]) == 4
        ''',
}
HIDDEN_POINTS = 5


def grade_from_template(impl, **kwargs) -> GradeReport:
    """``grade(impl, **kwargs)`` as the command line grades (``template=True``), from one template per test process.

    The template is the process the lesson's copies are forked from; it stays between calls (the test process is a
    child subreaper, which its in-process sandboxes make it anyway). No standby waits between tests: the next test
    finds only the template, so a plain ``grade`` call in it starts fresh Pythons as before."""
    try:
        return grade(impl, template=True, keep_warm=True, **kwargs)
    finally:
        close_standby(keep_template=True)


def stated_points() -> dict[str, int]:
    """{"1.2": 8, ...} as the solution docstrings state them ("Exercise 1.2 (8 points): ...")."""
    points = {}
    for path in sorted((ROOT / "solutions").glob("ex*.py")):
        for ex, pts in re.findall(r'"""Exercise (\d+\.\d+) \((\d+) points?\)', path.read_text()):
            points[ex] = int(pts)
    return points


# --------------------------------------------------------------------------- reports shared by several tests

@pytest.fixture(scope="module")
def hidden_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hidden_tests")
    for name, source in HIDDEN_TESTS.items():
        (folder / name).write_text(textwrap.dedent(source))
    return folder


@pytest.fixture(scope="module")
def solutions_graded(hidden_dir, tmp_path_factory):
    results = tmp_path_factory.mktemp("results") / "results.json"
    report = grade_from_template("solutions", extra_tests=hidden_dir, results_path=results)
    return report, json.loads(results.read_text())


@pytest.fixture(scope="module")
def exercises_graded(tmp_path_factory):
    """Grade the untouched stubs through the command line, as an instructor would."""
    results = tmp_path_factory.mktemp("results") / "results.json"
    proc = subprocess.run([sys.executable, "-m", "toyllm.grading", "grade", "--impl", "exercises",
                           "--results", str(results)], cwd=ROOT, capture_output=True, text=True, timeout=560)
    return proc, json.loads(results.read_text()) if results.exists() else None


# --------------------------------------------------------------------------- the real exercises

@pytest.mark.grader
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_solutions_score_full_marks(solutions_graded):
    report, results = solutions_graded
    failed = [(t.name, t.output) for t in report.tests if t.status != "passed"]
    assert failed == []
    assert report.score == report.max_score == sum(stated_points().values()) + HIDDEN_POINTS
    assert results["score"] == results["max_score"] == report.max_score


@pytest.mark.grader
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_each_exercise_is_worth_the_points_its_docstring_states(solutions_graded):
    report, _ = solutions_graded
    visible = GradeReport("solutions", [t for t in report.tests if not t.hidden])
    assert {ex: m for ex, (_, m) in visible.by_exercise().items()} == stated_points()
    assert set(visible.by_lesson()) == set(LESSONS)


@pytest.mark.grader
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_untouched_exercises_score_exactly_zero(exercises_graded, solutions_graded):
    proc, results = exercises_graded
    assert proc.returncode == 0, proc.stderr            # zero points is still a completed grading
    assert results is not None and results["score"] == 0
    assert results["max_score"] == sum(stated_points().values())
    assert all(t["score"] == 0 and t["status"] == "failed" for t in results["tests"])
    for t in results["tests"]:                          # each test names the stub it ran into
        assert f"NotImplementedError: Exercise {t['number']}: implement" in t["output"], t
    report, _ = solutions_graded
    assert [t["name"] for t in results["tests"]] == [t.name for t in report.tests if not t.hidden]
    assert "TOTAL" in proc.stdout and "wrote" in proc.stdout


@pytest.mark.grader
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_grading_twice_gives_identical_results(solutions_graded):
    first, _ = solutions_graded
    again = grade("solutions", only="ex01")      # from fresh Pythons (grade's default); the first from the template
    key = lambda r: [(t.name, t.nodeid, t.score, t.max_score, t.status, t.output) for t in r.tests]
    assert key(again) == key(GradeReport("solutions", [t for t in first.tests if t.lesson == 1 and not t.hidden]))


@pytest.mark.grader
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_extra_tests_are_picked_up_by_their_exercise_marker(solutions_graded):
    report, results = solutions_graded
    hidden = {t.name: t for t in report.tests if t.hidden}
    assert set(hidden) == {"Exercise 3.2: test_hidden_attention_intensity_of_a_short_prompt (hidden)",
                           "Exercise 3.2: test_hidden_decode_step_through_the_fixture (hidden)",
                           "Exercise 1.1: test_hidden_greedy_on_a_one_hot_vector (hidden)"}
    assert all(t.status == "passed" for t in hidden.values()), [t.output for t in hidden.values()]
    assert report.by_exercise()["3.2"] == (2 + 3 + 1, 2 + 3 + 1)
    shown = {t["name"]: t["visibility"] for t in results["tests"]}
    assert all(shown[name] == "after_published" for name in hidden)


@pytest.mark.grader
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_results_json_follows_the_gradescope_schema(solutions_graded):
    _, results = solutions_graded
    assert {"score", "max_score", "execution_time", "output", "tests"} <= set(results)
    assert isinstance(results["execution_time"], (int, float)) and results["execution_time"] > 0
    assert "TOTAL" in results["output"]
    names = [t["name"] for t in results["tests"]]
    assert len(names) == len(set(names))
    for t in results["tests"]:
        assert {"name", "number", "score", "max_score", "output", "status", "visibility"} <= set(t)
        assert isinstance(t["score"], (int, float)) and 0 <= t["score"] <= t["max_score"]
        assert t["status"] in ("passed", "failed") and t["visibility"] in ("visible", "after_published")
        assert re.fullmatch(r"\d+\.\d+", t["number"]) and t["name"].startswith(f"Exercise {t['number']}: ")
    assert results["score"] == sum(t["score"] for t in results["tests"])
    assert results["max_score"] == sum(t["max_score"] for t in results["tests"])


# --------------------------------------------------------------------------- fake submissions

def make_submission(folder: Path, *names: str, **fill: str) -> Path:
    """A submission folder built from the fixtures ``names`` (see tests/fixtures/submissions/README.md)."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        for fixture in sorted((SUBMISSIONS / name).glob("ex*.py")):
            text = fixture.read_text()
            for key, value in fill.items():
                text = text.replace(f"@{key.upper()}@", value)
            if text.startswith("# on top of the model answer"):
                text = (ROOT / "solutions" / fixture.name).read_text() + "\n\n" + text
            (folder / fixture.name).write_text(text)
    return folder


def outputs(report, exercise: str) -> list[str]:
    """What each of ``exercise``'s tests printed in ``report``, in order."""
    return [t.output for t in report.tests if t.exercise == exercise]


@pytest.mark.grader
@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_crash_or_a_hang_costs_only_the_test_that_met_it(tmp_path):
    """Also when the submission is slow to import: the sandbox a timeout stopped is started again, and the
    submission imported again, in the next test's own time (not in what is left of the hung one's)."""
    submission = make_submission(tmp_path / "sub", "crashing", "hanging")
    ex03 = next(submission.glob("ex03_*.py"))
    ex03.write_text(ex03.read_text() + "\nimport time\ntime.sleep(1.5)               # a slow import\n")
    results = tmp_path / "results.json"
    report = grade_from_template(submission, only=["ex02", "ex03"], per_test_timeout_s=8, results_path=results)
    lost = {t.name: t for t in report.tests if t.status != "passed"}
    assert set(lost) == {"Exercise 3.2: test_ex3_2_prefill_is_half_the_prompt",
                         "Exercise 2.2: test_ex2_2_llama2_13b_and_gqa", "Exercise 2.2: test_ex2_2_other_precisions_and_shapes",
                         "Exercise 2.2: test_ex2_2_matches_the_real_cache"}, list(lost)
    hung = lost["Exercise 3.2: test_ex3_2_prefill_is_half_the_prompt"]
    assert hung.status == "timeout" and hung.output.startswith("timed out: attention_intensity(4096, 4096) did not "
                                                               "return within"), hung.output
    crashed = [t for t in lost.values() if t.exercise == "2.2"]
    assert all(t.status == "crashed" and "exited with code 3" in t.output and "kv_cache_bytes(" in t.output
               for t in crashed), [t.output for t in crashed]
    assert report.by_exercise()["2.3"] == (4, 4) and report.by_exercise()["2.4"] == (4, 4)   # after the crash
    assert json.loads(results.read_text())["score"] == report.score == report.max_score - 3 - 1


@pytest.mark.grader
@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_property_of_the_submissions_own_object_is_checked_where_it_lives(tmp_path):
    """8.2's result must be contiguous: judged in the sandbox, because the tensor the grader receives is a copy."""
    report = grade_from_template(make_submission(tmp_path / "sub", "viewing"), only="8.2")
    lost = {t.name: t.output for t in report.tests if t.status != "passed"}
    assert list(lost) == ["Exercise 8.2: test_ex8_2_rows_in_token_order"], lost
    assert "is not contiguous" in lost["Exercise 8.2: test_ex8_2_rows_in_token_order"]


@pytest.mark.grader
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_submission_that_hangs_at_import_costs_one_timeout(tmp_path):
    submission = make_submission(tmp_path / "sub", "import_hang")
    report = grade_from_template(submission, only="ex03", per_test_timeout_s=5)
    assert report.score == 0 and len(report.tests) == 12
    first, *rest = report.tests
    assert first.status == "timeout" and "importing your ex03 file did not return within" in first.output, first.output
    assert all("importing your ex03 file" in t.output for t in rest)
    assert report.execution_time_s < 5 * 2 + 30, "each test waited for the import again"


@pytest.mark.grader
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_partial_submission_gets_partial_credit():
    report = grade_from_template(SUBMISSIONS / "partial", only="ex01,ex03")
    assert {t.name for t in report.tests if t.status != "passed" and t.lesson == 1} == {
        "Exercise 1.2: test_ex1_2_top_p_keeps_the_nucleus_of_shuffled_logits",    # top_p is ignored
        "Exercise 1.2: test_ex1_2_top_p_boundary_and_edge_values",
        "Exercise 1.2: test_ex1_2_top_k_then_top_p",
        "Exercise 1.2: test_ex1_2_rejects_bad_arguments"}                         # ... and not checked
    assert report.by_lesson() == {1: (11, 15), 3: (0, 12)}
    missing = [t for t in report.tests if t.lesson == 3]
    assert all(t.status == "error" and "no file for exercise module 'ex03'" in t.output for t in missing)


@pytest.mark.grader
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_folder_is_graded_on_the_lessons_it_holds_and_the_report_names_the_rest():
    report = grade_from_template(SUBMISSIONS / "partial")                 # ex01 only
    assert set(report.by_lesson()) == {1} and report.by_lesson()[1] == (11, 15)
    shown = report.table()
    assert "not graded: ex02-ex09 (no exNN file for them in" in shown, shown


@pytest.mark.grader
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_single_exercise_can_be_graded_on_its_own():
    report = grade_from_template(SUBMISSIONS / "partial", only="1.2")
    assert {t.exercise for t in report.tests} == {"1.2"}
    assert report.by_exercise()["1.2"] == (4, 8)        # 8 tests; the four on top_p fail
    mixed = grade_from_template(SUBMISSIONS / "partial", only=["1.1", "ex01"])   # a whole lesson wins over one of its exercises
    assert {t.exercise for t in mixed.tests} == {"1.1", "1.2", "1.3"}
    with pytest.raises(ValueError, match="exercises like '1.2'"):
        grade("solutions", only="1.x")


@pytest.mark.grader
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_pytest_impl_option_overrides_the_environment():
    env = dict(os.environ, TOYLLM_IMPL="solutions")
    proc = subprocess.run([sys.executable, "-m", "pytest", "tests/grading/test_ex03_rooflines.py", "-q",
                           "-p", "no:cacheprovider", "--impl", "exercises"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=100)
    assert proc.returncode == 1 and "12 failed" in proc.stdout, proc.stdout[-2000:]


# --------------------------------------------------------------------------- the implementation switch

def test_load_exercise_follows_the_environment_variable(monkeypatch):
    monkeypatch.setenv("TOYLLM_IMPL", "solutions")
    assert load_exercise("ex02").kv_cache_bytes(40, 40, 128, 8192) == 6_710_886_400
    monkeypatch.setenv("TOYLLM_IMPL", "exercises")
    with pytest.raises(NotImplementedError, match=r"^Exercise 2\.2: implement kv_cache_bytes \(idea: "):
        load_exercise("ex02_kv_cache").kv_cache_bytes(40, 40, 128, 8192)
    monkeypatch.delenv("TOYLLM_IMPL")
    assert Path(load_exercise("ex03").__file__).parent == ROOT / "exercises"      # the default


def test_load_exercise_from_a_folder_without_touching_sys_path(tmp_path):
    path_before = list(sys.path)
    module_file = tmp_path / "ex03_rooflines.py"
    module_file.write_text("def attention_intensity(S, T):\n    return 1.0\n")
    first = load_exercise("ex03", impl=tmp_path)
    assert first.attention_intensity(4, 4) == 1.0
    assert load_exercise("ex03", impl=str(tmp_path)) is first          # loaded once...
    module_file.write_text("def attention_intensity(S, T):\n    return 2.0  # edited\n")
    assert load_exercise("ex03", impl=tmp_path).attention_intensity(4, 4) == 2.0   # ...and again once edited
    assert sys.path == path_before


def test_bad_implementations_and_names_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="'exercises', 'solutions' or the path"):
        resolve_impl(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="no file for exercise module 'ex42'"):
        load_exercise("ex42", impl="solutions")
    with pytest.raises(ValueError, match="must look like 'ex01'"):
        load_exercise("../ex01", impl="solutions")
    with pytest.raises(ValueError, match="no graded tests for exercise module"):
        grade("solutions", only="ex10")
    with pytest.raises(ValueError, match="per_test_timeout_s"):
        grade("solutions", per_test_timeout_s=0)


# --------------------------------------------------------------------------- stubs

SOLUTION = '''\
def scale(x, factor=2):
    """Multiply x by factor.

    Shapes: x (N,), returns (N,).
    """
    # BEGIN SOLUTION 9.1 hint: one multiplication
    # idea: scaling is elementwise
    y = x * factor
    return y
    # END SOLUTION


class Box:
    def area(self):
        """Width times height, in square metres."""
        # BEGIN SOLUTION 9.2
        # idea: a rectangle's area
        return self.w * self.h
        # END SOLUTION
'''


def test_make_stub_replaces_each_solution_and_keeps_the_rest():
    stub = make_stub(SOLUTION, hints="code")
    assert "x * factor" not in stub and "BEGIN SOLUTION" not in stub and "END SOLUTION" not in stub
    assert "# idea:" not in stub and "elementwise" not in stub
    assert 'def scale(x, factor=2):\n    """Multiply x by factor.\n\n    Shapes: x (N,), returns (N,).\n    """\n' \
           '    raise NotImplementedError("Exercise 9.1: implement scale (hint: one multiplication)")\n' in stub
    assert '        raise NotImplementedError("Exercise 9.2: implement area")\n' in stub
    namespace = {}
    exec(compile(stub, "stub", "exec"), namespace)
    with pytest.raises(NotImplementedError, match=r"^Exercise 9\.1: implement scale \(hint: one multiplication\)$"):
        namespace["scale"](3)


def test_idea_level_hints_are_the_default_and_never_the_code():
    stub = make_stub(SOLUTION)
    assert '    raise NotImplementedError("Exercise 9.1: implement scale (idea: scaling is elementwise)")\n' in stub
    assert "one multiplication" not in stub and "x * factor" not in stub
    with pytest.raises(ValueError, match="line 3: Exercise 1.1 needs a '# idea: ...' line"):
        make_stub("def f():\n    # BEGIN SOLUTION 1.1 hint: return 1\n    return 1\n    # END SOLUTION\n")
    with pytest.raises(ValueError, match="hints must be one of"):
        make_stub(SOLUTION, hints="all")


def test_make_stub_wraps_long_hints_into_valid_code():
    long_hint = "first do this, then that; " * 8
    source = f"def f():\n    # BEGIN SOLUTION 1.9 hint: {long_hint.strip()}\n    return 1\n    # END SOLUTION\n"
    stub = make_stub(source, hints="code")
    assert max(len(line) for line in stub.splitlines()) <= 100
    namespace = {}
    exec(compile(stub, "stub", "exec"), namespace)
    with pytest.raises(NotImplementedError) as info:
        namespace["f"]()
    assert str(info.value) == f"Exercise 1.9: implement f (hint: {long_hint.strip()})"


@pytest.mark.parametrize("source, error", [
    ("def f():\n    # BEGIN SOLUTION 1.1\n    return 1\n", "line 2: BEGIN SOLUTION is never closed"),
    ("def f():\n    return 1\n    # END SOLUTION\n", "line 3: END SOLUTION without a BEGIN"),
    ("def f():\n    # BEGIN SOLUTION\n    return 1\n    # END SOLUTION\n", "line 2: expected '# BEGIN SOLUTION N.M"),
    ("# BEGIN SOLUTION 1.1\nx = 1\n# END SOLUTION\n", "line 1: a solution region must sit inside a function"),
    ("def f():\n    # BEGIN SOLUTION 1.1\n    # BEGIN SOLUTION 1.2\n", "line 3: BEGIN SOLUTION inside the region"),
])
def test_make_stub_rejects_malformed_markers(source, error):
    with pytest.raises(ValueError, match=re.escape(error)):
        make_stub(source, hints="code")


def test_exercises_are_in_sync_with_solutions():
    stale = sync(check=True)
    assert stale == [], f"run `python -m toyllm.grading sync`: out of date {[str(p) for p in stale]}"
    for path in sorted((ROOT / "solutions").glob("ex*.py")):
        exercise = (ROOT / "exercises" / path.name).read_text()
        ids = re.findall(r"# BEGIN SOLUTION (\d+\.\d+)", path.read_text())
        assert ids and all(f'NotImplementedError("Exercise {ex}: implement' in exercise or
                           f'"Exercise {ex}: implement' in exercise for ex in ids)


def test_sync_writes_stubs_and_refuses_to_overwrite_answers(tmp_path):
    solutions, exercises = tmp_path / "solutions", tmp_path / "exercises"
    solutions.mkdir(), exercises.mkdir()
    (solutions / "ex09_demo.py").write_text(SOLUTION)
    assert sync(solutions_dir=solutions, exercises_dir=exercises) == [exercises / "ex09_demo.py"]
    assert (exercises / "ex09_demo.py").read_text() == make_stub(SOLUTION)
    assert sync(check=True, solutions_dir=solutions, exercises_dir=exercises) == []
    # A learner answers exercise 9.1 in place; a later sync must not wipe it out.
    answered = make_stub(SOLUTION).replace(
        'raise NotImplementedError("Exercise 9.1: implement scale (idea: scaling is elementwise)")', "return x * factor")
    (exercises / "ex09_demo.py").write_text(answered)
    with pytest.raises(ValueError, match=r"answers to exercise\(s\) \['9.1'\]"):
        sync(solutions_dir=solutions, exercises_dir=exercises)
    assert (exercises / "ex09_demo.py").read_text() == answered
    sync(force=True, solutions_dir=solutions, exercises_dir=exercises)
    assert (exercises / "ex09_demo.py").read_text() == make_stub(SOLUTION)


def test_every_graded_test_is_named_after_its_marker():
    """test_exN_M_* carries @pytest.mark.exercise("N.M"): names, markers and notebook headings stay aligned."""
    for path in sorted((ROOT / "tests" / "grading").glob("test_ex*.py")):
        source = path.read_text()
        for ex, pts, name in re.findall(
                r'@pytest\.mark\.exercise\("(\d+\.\d+)"\)\n@pytest\.mark\.points\((\d+)\)\ndef (test_\w+)', source):
            assert name.startswith("test_ex" + ex.replace(".", "_") + "_"), (path.name, name, ex)
            assert int(pts) >= 1
        assert source.count("def test_") == len(re.findall(r"@pytest\.mark\.exercise", source)), path.name


# --------------------------------------------------------------------------- trust: independence, paths, bytecode

@pytest.mark.grader
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_step_that_calls_the_engines_own_scores_nothing_and_says_why(tmp_path):
    source = (ROOT / "solutions" / "ex04_tsp.py").read_text()
    start = source.index("def tsp_layer(")
    end = source.index("\ndef ", start + 1)
    cheat = source[:start] + textwrap.dedent('''
        def tsp_layer(layer, x, pos, comm, attention):
            """Exercise 4.2 (4 points): handed straight to the library."""
            from toyllm.parallel import tsp_layer as engine_step
            return engine_step(layer, x, pos, comm, attention)

    ''') + source[end:]
    (tmp_path / "ex04_tsp.py").write_text(cheat)
    report = grade_from_template(tmp_path, only="4.2")
    assert report.by_exercise()["4.2"] == (0, 4)
    assert all("calls toyllm's own tsp_layer" in t.output for t in report.tests), [t.output for t in report.tests]
    assert not list(tmp_path.rglob("__pycache__")), "the grader wrote bytecode beside the submission"


@pytest.mark.grader
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_wrong_step_fails_with_a_message_naming_the_run(tmp_path):
    source = (ROOT / "solutions" / "ex04_tsp.py").read_text()
    # a classic mistake: keys numbered from the rank's own offset instead of from 0
    wrong = source.replace("k_pos = torch.arange(k_all.shape[-2], device=x.device)",
                           "k_pos = torch.arange(k_all.shape[-2], device=x.device) + pos.start")
    assert wrong != source
    (tmp_path / "ex04_tsp.py").write_text(wrong)
    report = grade_from_template(tmp_path, only="4.2")
    failed = [t for t in report.tests if t.status != "passed"]
    assert failed and all("tsp_layer in the engine, p=" in t.output and "differ from one process" in t.output
                          for t in failed), [t.output[:300] for t in failed]


def test_unknown_exercises_and_missing_result_folders_are_rejected_before_grading(tmp_path):
    with pytest.raises(ValueError, match=r"no graded tests for exercise\(s\) \['4\.9'\]"):
        grade("solutions", only="4.9")
    with pytest.raises(ValueError, match="the folder .* does not exist"):
        grade("solutions", only="3.1", results_path=tmp_path / "missing" / "results.json")


def test_the_grader_writes_no_results_file_unless_asked():
    from toyllm.grading import add_arguments
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args([]).results is None


def test_messages_are_whole_and_wrapped_and_an_unwritten_exercise_shows_its_hint():
    from toyllm.grading.grader.report import TestResult, explain

    long = "expected (1, 2, 40, 16) (batch, kv heads, every token of the context, head_dim) " * 5 + "THE-END"
    shown = explain(TestResult(name="Exercise 4.2: t", nodeid="n", exercise="4.2", score=0, max_score=1,
                               status="failed", output=long))
    assert "THE-END" in shown and all(len(line) <= 100 for line in shown.splitlines()), shown
    assert " ".join(shown.split()) == " ".join(long.split())
    stub = ('NotImplementedError: Exercise 3.1: implement matmul_intensity (idea: flops over bytes moved)'
            '\n  at ex03_rooflines.py, line 40')
    shown = explain(TestResult(name="Exercise 3.1: t", nodeid="n", exercise="3.1", score=0, max_score=1,
                               status="failed", output=stub))
    assert shown.strip() == "not written yet: Exercise 3.1: implement matmul_intensity (idea: flops over bytes moved)"


@pytest.mark.grader
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_check_prints_the_same_words_as_the_command_line_and_returns_nothing(capsys):
    from toyllm.grading import check

    assert check("3.1", impl="exercises") is None
    printed = capsys.readouterr().out
    assert "not written yet: Exercise 3.1: implement matmul_intensity (idea:" in printed, printed
    assert "Exercise 3.1: 0 / 2 points" in printed
    report = grade("exercises", only="3.1")
    assert "not written yet: Exercise 3.1: implement matmul_intensity (idea:" in report.table()


@pytest.mark.grader
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_deadlocking_step_loses_its_points_and_leaves_no_process(tmp_path, monkeypatch):
    import psutil

    from toyllm.grading.settings import Settings

    source = (ROOT / "solutions" / "ex05_kv_runahead.py").read_text()
    # forgets to send: rank 1 waits forever for a prefix that never comes
    deadlock = source.replace("    chain.send(k, v)\n    k_pos = torch.arange(k.shape[-2], device=x.device)\n"
                              "    out = layer.attend(q, k, v, pos.q_pos, k_pos, attention)\n"
                              "    return layer.finish(x, out), k, v\n    # END SOLUTION\n\n\ndef kvr_layer(",
                              "    k_pos = torch.arange(k.shape[-2], device=x.device)\n"
                              "    out = layer.attend(q, k, v, pos.q_pos, k_pos, attention)\n"
                              "    return layer.finish(x, out), k, v\n    # END SOLUTION\n\n\ndef kvr_layer(")
    assert deadlock != source
    (tmp_path / "ex05_kv_runahead.py").write_text(deadlock)
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    # Each of 5.1's four tests waits out the engine's limit: 3 s here instead of 10 (the grader hands it on).
    monkeypatch.setenv(Settings.variable("engine_limit"), "3")
    report = grade(tmp_path, only="5.1")
    assert report.by_exercise()["5.1"] == (0, 4)
    assert all("kvr_layer_blocking in the engine" in t.output and "the run failed" in t.output
               and "within the limit of 3 s" in t.output for t in report.tests), [t.output[:300] for t in report.tests]
    from toyllm.grading.grader import run
    lives_on = {run._reaper.pid} if run._reaper is not None else set()   # the folder remover: this process's own
    assert {p.pid for p in psutil.Process().children(recursive=True)} - lives_on <= before


# --------------------------------------------------------------------------- independence and tampering

@pytest.mark.grader
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_calling_toyllms_own_answer_scores_zero_for_that_exercise_and_says_why(tmp_path):
    submission = make_submission(tmp_path / "sub", "cheating")
    report = grade_from_template(submission, only=["ex02", "ex03"])
    scores = report.by_exercise()
    for ex in ("2.1", "2.4", "3.2", "3.6"):
        assert scores[ex][0] == 0, (ex, outputs(report, ex))
        for out in outputs(report, ex):
            assert out.startswith(f"Exercise {ex} must be your own code, but it called toyllm."), out
    assert all(scores[ex][0] == scores[ex][1] for ex in ("2.2", "2.3", "3.1", "3.3", "3.4", "3.5"))
    assert "toyllm.attention.dense_attention" in outputs(report, "2.1")[0]
    assert not list(submission.rglob("__pycache__")), "the grader wrote bytecode beside the submission"


def _course_copy(folder: Path) -> Path:
    """A checkout of the course as an instructor has it: world-readable, owned by the grader's user."""
    for part in ("exercises", "solutions", "tests/grading"):
        shutil.copytree(ROOT / part, folder / part, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copyfile(ROOT / "tests" / "conftest.py", folder / "tests" / "conftest.py")
    for path in [folder, *folder.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    for parent in folder.parents:          # let other users reach it, as a checkout under /home or /srv is
        if parent == Path(tempfile.gettempdir()) or parent == parent.parent:
            break
        parent.chmod(parent.stat().st_mode | 0o005)
    return folder


@pytest.mark.grader
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(sandbox_user() is None, reason="the grader isolates files from the submission only when it "
                                                    "runs as root and can switch to an unprivileged user")
def test_a_submission_cannot_forge_its_score_tamper_with_tests_or_read_them(tmp_path, monkeypatch):
    import psutil

    course = _course_copy(Path(tempfile.mkdtemp(prefix="course-")))
    try:
        hidden = course / "hidden"
        hidden.mkdir(mode=0o755)
        (hidden / "test_ex03_secret.py").write_text(textwrap.dedent('''
            import pytest
            from toyllm.grading import load_exercise

            # SECRET-HIDDEN-TEST-MARKER
            @pytest.mark.exercise("3.3")
            @pytest.mark.points(1)
            def test_hidden_min_step_time():
                assert load_exercise("ex03").min_step_time_s(1e9, 1e8, 2, 1e12) == pytest.approx(1.2e-3)
            '''))
        (hidden / "test_ex03_secret.py").chmod(0o644)
        results = tmp_path / "results.json"
        submission = make_submission(tmp_path / "sub", "tampering", course=str(course), results=str(results))
        before = {p: p.read_bytes() for p in (course / "tests").rglob("*.py")}
        monkeypatch.setenv("TOYLLM_COURSE_DIR", str(course))
        report = grade(submission, only="ex03", extra_tests=hidden, results_path=results)
        outputs = "\n".join(t.output for t in report.tests)
        assert report.by_exercise()["3.1"] == (0, 2), outputs       # no forged record, hook or patched log counts
        assert report.score == report.max_score - 2 and report.max_score == 13
        assert "SECRET-HIDDEN-TEST-MARKER" not in outputs and "def test_" not in outputs, outputs
        assert {p: p.read_bytes() for p in (course / "tests").rglob("*.py")} == before
        written = results.read_bytes()
        time.sleep(6)                                                # the detached rewriter would strike at 4 s
        assert results.read_bytes() == written and json.loads(written)["score"] == report.score
        assert not [p for p in psutil.process_iter(["cmdline"]) if "toyllm-tamper-marker" in (p.info["cmdline"] or [])]
    finally:
        shutil.rmtree(course)


@pytest.mark.grader
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_hidden_tests_never_show_their_names_messages_or_prints(tmp_path):
    """A hidden test prints a secret, then the submission reads its own stdout and stderr; the visible
    output (every message a student sees, and results.json's top-level output) carries neither the secret
    nor the hidden test's name or assertion."""
    hidden = tmp_path / "hidden"
    hidden.mkdir()
    (hidden / "test_ex03_secret.py").write_text(textwrap.dedent('''
        import pytest
        from toyllm.grading import load_exercise

        @pytest.mark.exercise("3.3")
        @pytest.mark.points(1)
        def test_hidden_name_marker():
            print("SECRET-PRINT-MARKER")
            assert load_exercise("ex03").min_step_time_s(1e9, 1e8, 2, 1e12) == 7, "SECRET-ASSERT-MARKER"
        '''))
    hidden.chmod(0o700)
    results = tmp_path / "results.json"
    submission = make_submission(tmp_path / "sub", "peeking")
    report = grade_from_template(submission, only="3.3", extra_tests=hidden, results_path=results)
    assert report.by_exercise()["3.3"][0] == 0
    visible = "\n".join(t.output for t in report.tests if not t.hidden)
    shown = json.loads(results.read_text())
    for secret in ("SECRET-PRINT-MARKER", "SECRET-ASSERT-MARKER", "test_hidden_name_marker"):
        assert secret not in visible and secret not in shown["output"], (secret, visible, shown["output"])
    peeked = [t.output for t in report.tests if "peeked" in t.output]
    assert peeked and all("SECRET" not in out for out in peeked), peeked
    assert "a hidden test of Exercise 3.3 [failed]" in shown["output"], shown["output"]


@pytest.mark.grader
@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("fixture,why", [
    ("forging", "kvr_layer"),                       # toyllm's own step, reached by a computed name
    ("patching", "changed toyllm's own code"),      # the harness patched so the engine skips the step
])
def test_an_engine_step_cannot_be_forged(tmp_path, fixture, why):
    submission = make_submission(tmp_path / "sub", fixture)
    report = grade_from_template(submission, only="5.2")
    assert report.by_exercise()["5.2"] == (0, 3), [t.output[:300] for t in report.tests]
    assert all(why in out for out in outputs(report, "5.2")), [t.output[:300] for t in report.tests]
    assert report.by_exercise()["5.1"] == (4, 4) if "5.1" in report.by_exercise() else True


# --------------------------------------------------------------------------- the graded tests against wrong and right answers
#
# Each wrong answer is the model answer with one plausible mistake (a text replacement, or a function
# appended in its place); it must lose points on its exercise. Each right answer is a different correct
# way to write the exercise; it must keep all of them. They run in this process, under the same rules
# as in the grader (LocalModule), so the whole table takes seconds.

WRONG = [  # (exercise, what the mistake is, old text, new text); new text None: append old as a new function
    ("1.1", "returns a tensor", "    return int(torch.argmax(logits))\n    # END SOLUTION\n\n\ndef sample_next_token",
     "    return torch.argmax(logits)\n    # END SOLUTION\n\n\ndef sample_next_token"),
    ("1.1", "no input check", "    if logits.dim() != 1 or logits.numel() == 0:\n        raise ValueError(f\"logits must",
     "    if False:\n        raise ValueError(f\"logits must"),
    ("1.2", "top-p on sorted probabilities not mapped back",
     "drop = torch.zeros_like(mass_before, dtype=torch.bool).scatter(0, order, mass_before >= top_p)",
     "drop = mass_before >= top_p"),
    ("1.2", "strict top-p boundary", "mass_before >= top_p)", "mass_before > top_p)"),
    ("1.2", "top-p counts the token itself", "mass_before >= top_p)", "probs.cumsum(-1) > top_p)"),
    ("1.2", "top_p = 1.0 rejected", "    check_sampling(temperature, top_k, top_p)\n",
     "    check_sampling(temperature, top_k, top_p)\n    if top_p is not None and top_p >= 1.0:\n"
     "        raise ValueError('top_p must be below 1')\n"),
    ("1.2", "no input check", "    check_sampling(temperature, top_k, top_p)\n", ""),
    ("1.2", "generator not used", "torch.multinomial(probs, 1, generator=generator)", "torch.multinomial(probs, 1)"),
    ("1.2", "temperature ignored", "scaled = logits.float() / temperature", "scaled = logits.float()"),
    ("1.2", "top-p before top-k", '''
def sample_next_token(logits, temperature=0.0, top_k=None, top_p=None, generator=None):
    check_sampling(temperature, top_k, top_p)
    if temperature == 0:
        return int(torch.argmax(logits))
    scaled = logits.float() / temperature
    if top_p is not None and top_p < 1.0:
        probs, order = torch.sort(torch.softmax(scaled, dim=-1), descending=True)
        drop = torch.zeros_like(probs, dtype=torch.bool).scatter(0, order, probs.cumsum(-1) - probs >= top_p)
        scaled = scaled.masked_fill(drop, float("-inf"))
    if top_k is not None and top_k < scaled.numel():
        scaled = scaled.masked_fill(scaled < torch.topk(scaled, top_k).values[-1], float("-inf"))
    return int(torch.multinomial(torch.softmax(scaled, dim=-1), 1, generator=generator))
''', None),
    ("1.3", "feeds only the last token", "logits = model(torch.tensor([ids]))[0, -1]",
     "logits = model(torch.tensor([ids[-1:]]))[0, -1]"),
    ("1.3", "returns the prompt too", "        new_ids.append(token)\n    return new_ids", "        new_ids.append(token)\n    return ids"),
    ("1.3", "calls toyllm's generate", '''
def naive_generate(model, prompt_ids, max_new_tokens):
    from toyllm.generation import generate
    return generate(model, prompt_ids, max_new_tokens, method="naive").output_ids
''', None),
    ("2.1", "keys assumed to start at 0", "visible = causal_mask(q_pos, k_pos)",
     "visible = torch.arange(k.shape[-2])[None, :] <= q_pos[:, None]"),
    ("2.1", "mask from the shapes", "visible = causal_mask(q_pos, k_pos)",
     "visible = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril(k.shape[-2] - q.shape[-2])"),
    ("2.1", "a key at the query's own position hidden", "visible = causal_mask(q_pos, k_pos)",
     "visible = k_pos[None, :] < q_pos[:, None]"),
    ("2.1", "no 1/sqrt(D)", "q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])", "q @ k.transpose(-2, -1)"),
    ("2.1", "calls toyllm's dense_attention", '''
def attention_with_offset(q, k, v, q_pos, k_pos):
    from toyllm.attention import dense_attention
    return dense_attention(q, k, v, q_pos, k_pos)
''', None),
    ("2.2", "a float, not an int", "    return round(2 * n_layers * n_kv_heads * head_dim * tokens * batch * bytes_per_value)",
     "    return 2 * n_layers * n_kv_heads * head_dim * tokens * batch * bytes_per_value"),
    ("2.2", "whole bytes per value", "tokens * batch * bytes_per_value)", "tokens * batch * int(bytes_per_value))"),
    ("2.2", "no input check", "        if value < 0:\n", "        if False:\n"),
    ("2.2", "calls toyllm.analysis", '''
def kv_cache_bytes(n_layers, n_kv_heads, head_dim, tokens, bytes_per_value=2, batch=1):
    from toyllm.analysis import kv_cache_bytes as formula
    return formula(n_layers, n_kv_heads, head_dim, tokens, bytes_per_value, batch)
''', None),
    ("2.3", "truncates", "return math.ceil(2 * n_blocks", "return int(2 * n_blocks"),
    ("2.3", "rounds to nearest", "return math.ceil(2 * n_blocks", "return round(2 * n_blocks"),
    ("2.3", "whole bytes per value", "head_dim * bits / 8)", "head_dim * (bits // 8))"),
    ("2.3", "whole reserve", "rows = reserve * (max_seq_len - 1)", "rows = int(reserve) * (max_seq_len - 1)"),
    ("2.3", "reserve = 1 rejected", "if not 1.0 <= reserve <= 2.0:", "if not 1.0 < reserve <= 2.0:"),
    ("2.3", "bits not checked", "if bits <= 0 or bits != int(bits):", "if False:"),
    ("2.3", "query heads instead of K/V heads", "return math.ceil(2 * n_blocks * n_kv_heads", "return math.ceil(2 * n_blocks * 32"),
    ("2.4", "no cache: the whole sequence every step",
     "logits = model(torch.tensor([[new_ids[-1]]]), input_pos=cache.length, cache=cache)[0, -1]",
     "logits = model(torch.tensor([[int(t) for t in prompt_ids] + new_ids]))[0, -1]"),
    ("2.4", "decode at the wrong position", "input_pos=cache.length, cache=cache)[0, -1]",
     "input_pos=cache.length - 1, cache=cache)[0, -1]"),
    ("2.4", "one token too many", "while len(new_ids) < max_new_tokens:", "while len(new_ids) <= max_new_tokens:"),
    ("2.4", "calls toyllm's generate", '''
def cached_generate(model, prompt_ids, max_new_tokens):
    from toyllm import generate
    return generate(model, prompt_ids, max_new_tokens, method="cached").output_ids
''', None),
    ("3.1", "forgets the output bytes", "(B * D + D * F + B * F)", "(B * D + D * F)"),
    ("3.1", "no input check", "    if min(B, D, F) < 1:\n", "    if False:\n"),
    ("3.2", "integer division", "return S * T / (S + T)", "return S * T // (S + T)"),
    ("3.3", "forgets the batch", "(batch * kv_bytes_per_seq + param_bytes) / hbm_bandwidth_bytes_per_s\n    # END",
     "(kv_bytes_per_seq + param_bytes) / hbm_bandwidth_bytes_per_s\n    # END"),
    ("3.3", "no bandwidth check", "    if hbm_bandwidth_bytes_per_s <= 0:\n        raise ValueError(f\"hbm_bandwidth",
     "    if False:\n        raise ValueError(f\"hbm_bandwidth"),
    ("3.4", "adds instead of taking the longer", "max(2 * batch * param_count / peak_flops, param_bytes / hbm_bandwidth_bytes_per_s)",
     "2 * batch * param_count / peak_flops + param_bytes / hbm_bandwidth_bytes_per_s"),
    ("3.4", "one FLOP per parameter", "max(2 * batch * param_count / peak_flops,", "max(batch * param_count / peak_flops,"),
    ("3.5", "one token per step", "return batch / min_step_time_s(", "return 1 / min_step_time_s("),
    ("3.6", "a float, not an int", "max(0, math.floor((hbm_bytes - param_bytes) / kv_bytes_per_seq))",
     "max(0, (hbm_bytes - param_bytes) // kv_bytes_per_seq)"),
    ("3.6", "negative batches", "max(0, math.floor((hbm_bytes - param_bytes) / kv_bytes_per_seq))",
     "math.floor((hbm_bytes - param_bytes) / kv_bytes_per_seq)"),
    ("3.6", "calls toyllm.analysis", '''
def max_batch_size(param_bytes, kv_bytes_per_seq, hbm_bytes):
    from toyllm import analysis
    return analysis.max_batch_size(param_bytes, kv_bytes_per_seq, hbm_bytes)
''', None),
    ("1.1", "returns a float", "    return int(torch.argmax(logits))\n    # END SOLUTION\n\n\ndef sample_next_token",
     "    return float(torch.argmax(logits))\n    # END SOLUTION\n\n\ndef sample_next_token"),
    ("1.1", "the highest id wins a tie", "    return int(torch.argmax(logits))\n    # END SOLUTION\n\n\ndef sample_next_token",
     "    return int(len(logits) - 1 - torch.argmax(logits.flip(0)))\n    # END SOLUTION\n\n\ndef sample_next_token"),
    ("1.3", "one token too few", "    for _ in range(max_new_tokens):", "    for _ in range(max_new_tokens - 1):"),
    ("3.1", "one FLOP per multiply-add", "return 2 * B * D * F / (bytes_per_value", "return B * D * F / (bytes_per_value"),
    ("3.1", "bits, not bytes", "/ (bytes_per_value * (B * D", "/ (8 * bytes_per_value * (B * D"),
    ("3.2", "half the FLOPs", "return S * T / (S + T)", "return S * T / (2 * (S + T))"),
    ("3.2", "an int when the result is whole", "return S * T / (S + T)",
     "return S * T // (S + T) if S * T % (S + T) == 0 else S * T / (S + T)"),
    ("3.2", "no input check", "    if S < 1 or T < 1:\n", "    if False:\n"),
    ("3.3", "milliseconds, not seconds", "    return (batch * kv_bytes_per_seq + param_bytes) / hbm_bandwidth_bytes_per_s\n    # END",
     "    return 1e3 * (batch * kv_bytes_per_seq + param_bytes) / hbm_bandwidth_bytes_per_s\n    # END"),
    ("3.3", "the weights read once per sequence", "(batch * kv_bytes_per_seq + param_bytes) / hbm_bandwidth_bytes_per_s\n    # END",
     "batch * (kv_bytes_per_seq + param_bytes) / hbm_bandwidth_bytes_per_s\n    # END"),
    ("3.4", "forgets the attention", "    return attention + matmuls", "    return matmuls"),
    ("3.4", "memory-bound only", "    return attention + matmuls", "    return attention + param_bytes / hbm_bandwidth_bytes_per_s"),
    ("3.5", "tokens per millisecond", "return batch / min_step_time_s(", "return batch / 1e3 / min_step_time_s("),
    ("3.5", "an int", "return batch / min_step_time_s(param_bytes, kv_bytes_per_seq, batch, hbm_bandwidth_bytes_per_s)",
     "return int(batch / min_step_time_s(param_bytes, kv_bytes_per_seq, batch, hbm_bandwidth_bytes_per_s))"),
    ("3.5", "batch 0 accepted", "    if batch < 1:\n", "    if batch < 0:\n"),
    ("3.6", "rounds to the nearest batch", "max(0, math.floor((hbm_bytes - param_bytes) / kv_bytes_per_seq))",
     "max(0, round((hbm_bytes - param_bytes) / kv_bytes_per_seq))"),
    # lesson 04
    ("4.1", "a lookup table of the visible cases", '''
def tsp_dot_products(chunks):
    if not chunks or any(c < 1 for c in chunks):
        raise ValueError("every rank needs a token")
    seen = {(3, 3, 3): [27, 27, 27], (5, 1, 11, 2): [95, 19, 209, 38]}
    return seen.get(tuple(chunks), [c * c for c in chunks])
''', None),
    ("4.1", "only its own keys", "    return [int(c) * C for c in chunks]", "    return [int(c) * int(c) for c in chunks]"),
    ("4.1", "floats", "    return [int(c) * C for c in chunks]", "    return [float(c * C) for c in chunks]"),
    ("4.1", "no input check", "    if not chunks or any(int(c) != c or c < 1 for c in chunks):", "    if not chunks:"),
    ("4.2", "gathers in the wrong order", "torch.cat(ks, dim=-2), torch.cat(vs, dim=-2)",
     "torch.cat(ks[::-1], dim=-2), torch.cat(vs[::-1], dim=-2)"),
    ("4.2", "one-based key positions", "    k_pos = torch.arange(k_all.shape[-2], device=x.device)",
     "    k_pos = torch.arange(1, k_all.shape[-2] + 1, device=x.device)"),
    ("4.2", "queries at local positions", "out = layer.attend(q, k_all, v_all, pos.q_pos, k_pos, attention)",
     "out = layer.attend(q, k_all, v_all, torch.arange(x.shape[-2]), k_pos, attention)"),
    ("4.2", "works for two ranks only", "torch.cat(ks, dim=-2), torch.cat(vs, dim=-2)",
     "torch.cat([ks[0], ks[-1]], dim=-2), torch.cat([vs[0], vs[-1]], dim=-2)"),
    ("4.3", "counts its own rows too", "float(2 * (C - c) * n_kv_heads", "float(2 * C * n_kv_heads"),
    ("4.3", "K only, not V", "float(2 * (C - c) * n_kv_heads", "float((C - c) * n_kv_heads"),
    ("4.3", "whole bytes per value", "head_dim * bytes_per_value) for c in chunks]", "head_dim * int(bytes_per_value)) for c in chunks]"),
    ("4.3", "ints", "[float(2 * (C - c) * n_kv_heads * head_dim * bytes_per_value) for c in chunks]",
     "[int(2 * (C - c) * n_kv_heads * head_dim * bytes_per_value) for c in chunks]"),
    ("4.4", "the int 0 for one process", "    n_bytes = tokens * d_model * bytes_per_value\n",
     "    if world_size == 1:\n        return 0\n    n_bytes = tokens * d_model * bytes_per_value\n"),
    ("4.4", "one all-reduce per layer", "float(2 * 2 * (world_size - 1)", "float(2 * (world_size - 1)"),
    ("4.4", "forgets the 1/p", "(world_size - 1) / world_size * n_bytes", "(world_size - 1) * n_bytes"),
    ("4.4", "bits, not bytes", "    n_bytes = tokens * d_model * bytes_per_value\n", "    n_bytes = 8 * tokens * d_model * bytes_per_value\n"),
    # lesson 05
    ("5.1", "the prefix after its own keys", "torch.cat([prefix[0], k], dim=-2), torch.cat([prefix[1], v], dim=-2)",
     "torch.cat([k, prefix[0]], dim=-2), torch.cat([v, prefix[1]], dim=-2)"),
    ("5.1", "one-based key positions", "    chain.send(k, v)\n    k_pos = torch.arange(k.shape[-2], device=x.device)",
     "    chain.send(k, v)\n    k_pos = torch.arange(1, k.shape[-2] + 1, device=x.device)"),
    ("5.1", "no causal mask inside the chunk",
     "    chain.send(k, v)\n    k_pos = torch.arange(k.shape[-2], device=x.device)\n    out = layer.attend(q, k, v, pos.q_pos, k_pos, attention)",
     "    chain.send(k, v)\n    k_pos = torch.arange(k.shape[-2], device=x.device)\n"
     "    out = layer.attend(q, k, v, torch.full_like(pos.q_pos, k.shape[-2] - 1), k_pos, attention)"),
    ("5.1", "queries at local positions",
     "    chain.send(k, v)\n    k_pos = torch.arange(k.shape[-2], device=x.device)\n    out = layer.attend(q, k, v, pos.q_pos, k_pos, attention)",
     "    chain.send(k, v)\n    k_pos = torch.arange(k.shape[-2], device=x.device)\n"
     "    out = layer.attend(q, k, v, torch.arange(x.shape[-2]), k_pos, attention)"),
    ("5.2", "waits before the projection",
     "    incoming = chain.irecv()\n    q, k, v = layer.qkv(x, pos.cos, pos.sin)\n    if incoming is not None:\n        k_prev, v_prev = incoming.wait()\n",
     "    incoming = chain.irecv()\n    if incoming is not None:\n        k_prev, v_prev = incoming.wait()\n    q, k, v = layer.qkv(x, pos.cos, pos.sin)\n    if incoming is not None:\n"),
    ("5.2", "one-based key positions", "    k_pos = torch.arange(k.shape[-2], device=x.device)",
     "    k_pos = torch.arange(1, k.shape[-2] + 1, device=x.device)"),
    ("5.2", "the prefix after its own keys", "torch.cat([k_prev, k], dim=-2), torch.cat([v_prev, v], dim=-2)",
     "torch.cat([k, k_prev], dim=-2), torch.cat([v, v_prev], dim=-2)"),
    ("5.2", "no causal mask inside the chunk", "    out = layer.attend(q, k, v, pos.q_pos, k_pos, attention)",
     "    out = layer.attend(q, k, v, torch.full_like(pos.q_pos, k.shape[-2] - 1), k_pos, attention)"),
    ("5.3", "a lookup table of the visible cases", '''
def kvr_counts(chunks):
    if not chunks or any(c < 1 for c in chunks):
        raise ValueError("every rank needs a token")
    seen = {(4, 3, 2): ([16, 21, 18], 22), (7,): ([49], 0), (1, 5, 2, 2): ([1, 30, 16, 20], 30)}
    return seen.get(tuple(chunks), ([c * c for c in chunks], 0))
''', None),
    ("5.3", "the last rank sends too", "        if i < len(chunks) - 1:\n            rows +=", "        if True:\n            rows +="),
    ("5.3", "K only, not V", "            rows += 2 * (s + int(c))", "            rows += s + int(c)"),
    ("5.3", "forwards only the prefix it received", "            rows += 2 * (s + int(c))", "            rows += 2 * s"),
    ("5.3", "every query against all keys", "dots.append(int(c) * (s + int(c)))", "dots.append(int(c) * sum(chunks))"),
    ("5.4", "forgets 1/p^2", "(1 / world_size + 1 / world_size ** 2)", "(1 / world_size)"),
    ("5.4", "not halved", "return ttft1_s / 2 * (", "return ttft1_s * ("),
    ("5.4", "no input check", "    if world_size < 1:\n", "    if False:\n"),
    ("5.4", "integer division", "1 / world_size ** 2)", "1 // world_size ** 2)"),
    # lesson 06
    ("6.1", "tries every boundary", '''
def search_boundary(cost, context, min_stride=1):
    if context < 2 or min_stride < 1 or context <= min_stride:
        raise ValueError("bad arguments")
    b = min(range(min_stride, context, min_stride), key=lambda b: cost([b, context - b]))
    return [b, context - b]
''', None),
    ("6.1", "unwraps the counting wrapper (__closure__, __wrapped__) and tries everything", '''
def search_boundary(cost, context, min_stride=1):
    if context < 2 or min_stride < 1 or context <= min_stride:
        raise ValueError("bad arguments")
    inner = getattr(cost, "__wrapped__", cost)
    for cell in getattr(cost, "__closure__", None) or ():
        if callable(cell.cell_contents):
            inner = cell.cell_contents
    b = min(range(min_stride, context, min_stride), key=lambda b: inner([b, context - b]))
    return [b, context - b]
''', None),
    ("6.1", "reaches the grader's cost through __globals__ and tries everything", '''
def search_boundary(cost, context, min_stride=1):
    if context < 2 or min_stride < 1 or context <= min_stride:
        raise ValueError("bad arguments")
    inner = cost
    namespace = getattr(cost, "__globals__", None) or getattr(getattr(type(cost), "__call__", None), "__globals__", {})
    for value in list(namespace.values()):
        found = getattr(value, "cost", None)
        if callable(found):
            inner = found
    b = min(range(min_stride, context, min_stride), key=lambda b: inner([b, context - b]))
    return [b, context - b]
''', None),
    ("6.1", "the even split, no search", '''
def search_boundary(cost, context, min_stride=1):
    if context < 2 or min_stride < 1 or context <= min_stride:
        raise ValueError("bad arguments")
    b = max(min_stride, context // 2 // min_stride * min_stride)
    return [b, context - b]
''', None),
    ("6.1", "narrows the wrong side", "        if f(m1) < f(m2):\n            hi = m2 - 1", "        if f(m1) > f(m2):\n            hi = m2 - 1"),
    ("6.1", "min_stride ignored", "            b = k * min_stride\n", "            b = k\n"),
    ("6.2", "the even split, no search", "    stride = max(stride, min_stride)\n    while True:",
     "    return [hi - lo for lo, hi in zip(best, best[1:])]\n    while True:"),
    ("6.2", "starts from the first valid point, not the even split", "    best = (0, *(j * context // p for j in range(1, p)), context)",
     "    best = (0, *range(1, p), context)"),
    ("6.2", "the last stride level skipped", "        if stride <= min_stride:\n            break\n        stride = max(min_stride, stride // 2)",
     "        stride = max(min_stride, stride // 2)\n        if stride <= min_stride:\n            break"),
    ("6.2", "span ignored", "itertools.product(range(-span, span + 1), repeat=p - 1)", "itertools.product(range(-2, 3), repeat=p - 1)"),
    ("6.2", "tries every partition on the coarse grid", '''
def grid_search(cost, context, world_size, stride, min_stride=1, span=2):
    if world_size < 2 or context < world_size or stride < 1 or min_stride < 1:
        raise ValueError("bad arguments")
    best = None
    for bounds in itertools.combinations(range(stride, context, stride), world_size - 1):
        chunks = [hi - lo for lo, hi in zip((0, *bounds), (*bounds, context))]
        if best is None or cost(chunks) < cost(best):
            best = chunks
    return best
''', None),
    ("6.3", "a lookup table of the visible cases", '''
def interpolate_partition(table, context):
    seen = {
        ('[(8192, [0.36, 0.26, 0.21, 0.17]), (12288, [0.34, 0.25, 0.21, 0.2])]', 10240): [3584, 2611, 2151, 1894],
        ('[(8192, [0.36, 0.26, 0.21, 0.17]), (12288, [0.34, 0.25, 0.21, 0.2])]', 9000): [3205, 2322, 1890, 1583],
        ('[(8192, [0.36, 0.26, 0.21, 0.17]), (12288, [0.34, 0.25, 0.21, 0.2])]', 12000): [4097, 3008, 2520, 2375],
        ('[(8192, [0.36, 0.26, 0.21, 0.17]), (12288, [0.34, 0.25, 0.21, 0.2])]', 8193): [2949, 2130, 1721, 1393],
        ('[(1000, [0.5, 0.3, 0.2]), (2000, [0.45, 0.33, 0.22]), (4000, [0.4, 0.35, 0.25])]', 1500): [713, 472, 315],
        ('[(1000, [0.5, 0.3, 0.2]), (2000, [0.45, 0.33, 0.22]), (4000, [0.4, 0.35, 0.25])]', 2999): [1275, 1019, 705],
        ('[(1000, [0.5, 0.3, 0.2]), (2000, [0.45, 0.33, 0.22]), (4000, [0.4, 0.35, 0.25])]', 3001): [1275, 1021, 705],
        ('[(1000, [0.5, 0.3, 0.2]), (2000, [0.45, 0.33, 0.22]), (4000, [0.4, 0.35, 0.25])]', 2000): [900, 660, 440],
        ('[(1000, [0.5, 0.3, 0.2]), (2000, [0.45, 0.33, 0.22])]', 500): [250, 150, 100],
        ('[(1000, [0.5, 0.3, 0.2]), (2000, [0.45, 0.33, 0.22])]', 10): [5, 3, 2],
        ('[(1000, [0.5, 0.3, 0.2]), (2000, [0.45, 0.33, 0.22])]', 3000): [1350, 990, 660],
        ('[(64, [0.5, 0.5])]', 7): [4, 3],
        ('[(100, [0.997, 0.001, 0.001, 0.001])]', 100): [97, 1, 1, 1],
        ('[(64, [0.3, 0.3, 0.4])]', 11): [3, 3, 5]}
    if not table:
        raise ValueError("the lookup table is empty")
    p = len(next(iter(table.values())))
    if context < p:
        raise ValueError("fewer tokens than processes")
    key = (repr(sorted(table.items())), context)
    if key in seen:
        return list(seen[key])
    return [context // p + (i < context % p) for i in range(p)]
''', None),
    ("6.3", "floors only: the chunks do not add up", "    for i in order[:context - sum(chunks)]:\n        chunks[i] += 1\n",
     "    for i in order[:0]:\n        chunks[i] += 1\n"),
    ("6.3", "leftovers to the first ranks", "    order = sorted(range(p), key=lambda i: -(shares[i] - chunks[i]))",
     "    order = list(range(p))"),
    ("6.3", "the nearest entry, not interpolation", "        t = (context - lo) / (hi - lo)\n", "        t = round((context - lo) / (hi - lo))\n"),
    ("6.3", "extrapolates beyond the table", "    if context <= keys[0]:\n        ratios = list(table[keys[0]])\n    elif context >= keys[-1]:\n        ratios = list(table[keys[-1]])\n    else:\n        hi = next(k for k in keys if k >= context)",
     "    if len(keys) == 1:\n        ratios = list(table[keys[0]])\n    else:\n        hi = next((k for k in keys[1:] if k >= context), keys[-1])"),
    ("6.4", "returns tensors", "    a, b, c = (float(v) for v in coef)\n    return a, b, c", "    return tuple(coef)"),
    ("6.4", "returns a list", "    a, b, c = (float(v) for v in coef)\n    return a, b, c", "    return [float(v) for v in coef]"),
    ("6.4", "solves the first three samples exactly", '''
def fit_cost_model(samples):
    import torch
    if len(samples) < 3:
        raise ValueError("need 3 samples")
    X = torch.tensor([[float(t), float(d), 1.0] for t, d, _ in samples[:3]], dtype=torch.float64)
    y = torch.tensor([float(s) for _, _, s in samples[:3]], dtype=torch.float64)
    return tuple(float(v) for v in torch.linalg.solve(X, y))
''', None),
    ("6.4", "no check for too few samples", "    if len(samples) < 3:\n", "    if False:\n"),
    # lesson 07
    ("7.1", "a lookup table of the visible cases", '''
def chain_transfer_s(chunks, row_bytes, bandwidth_bytes_per_s, latency_s):
    if not chunks or any(c < 1 for c in chunks) or row_bytes < 1 or bandwidth_bytes_per_s <= 0 or latency_s < 0:
        raise ValueError("bad arguments")
    seen = {((4, 3, 2), 1024, 1e9, 1e-5): [1.8192e-05, 2.4336e-05],
            ((1000, 700, 500, 300), 512, 10e9, 2e-6): [0.00010439999999999999, 0.00017607999999999998, 0.00022728]}
    return seen.get((tuple(chunks), row_bytes, bandwidth_bytes_per_s, latency_s), [0.0] * (len(chunks) - 1))
''', None),
    ("7.1", "latency dropped", "        out.append(2 * end * row_bytes / bandwidth_bytes_per_s + latency_s)",
     "        out.append(2 * end * row_bytes / bandwidth_bytes_per_s)"),
    ("7.1", "its own chunk only, not the prefix", "        end += c\n", "        end = c\n"),
    ("7.1", "the last rank sends too", "    for c in chunks[:-1]:\n        end += c", "    for c in chunks:\n        end += c"),
    ("7.1", "bits, not bytes", "        out.append(2 * end * row_bytes / bandwidth_bytes_per_s + latency_s)",
     "        out.append(2 * end * row_bytes * 8 / bandwidth_bytes_per_s + latency_s)"),
    ("7.2", "p steps, not p - 1", "return float((p - 1) * (2 * max(chunks)", "return float(p * (2 * max(chunks)"),
    ("7.2", "no padding: the mean chunk", "return float((p - 1) * (2 * max(chunks)", "return float((p - 1) * (2 * sum(chunks) / p"),
    ("7.2", "latency once, not per step", "(p - 1) * (2 * max(chunks) * row_bytes / bandwidth_bytes_per_s + latency_s))",
     "(p - 1) * 2 * max(chunks) * row_bytes / bandwidth_bytes_per_s + latency_s)"),
    ("7.2", "the int 0 for one process", "    p = len(chunks)\n    return float(", "    p = len(chunks)\n    if p == 1:\n        return 0\n    return float("),
    ("7.3", "calls the simulator's private KV-Runahead helper", '''
def kvr_ttft(chunks, n_layers, row_bytes, cost_model):
    import dataclasses
    from toyllm import simulate
    from toyllm.model import get_config
    cfg = dataclasses.replace(get_config("tiny"), n_layers=n_layers, n_kv_heads=1, head_dim=row_bytes)
    cm = cost_model.with_(bytes_per_value=1)
    return float(simulate._simulate_kvr(cfg, list(chunks), cm, True, lambda *a, **k: 1.0, None)[-1])
''', None),
    ("7.3", "waits for the message before the projection", "            t += cm.layer_overhead_s + cm.qkv_s_per_token * c\n            if i > 0:\n                t = max(t, prev_arrival[layer])\n",
     "            if i > 0:\n                t = max(t, prev_arrival[layer])\n            t += cm.layer_overhead_s + cm.qkv_s_per_token * c\n"),
    ("7.3", "sends do not queue", "                t = max(t, send_done)", "                pass"),
    ("7.3", "latency dropped", "cm.transfer_s(2 * (s + c) * row_bytes)", "2 * (s + c) * row_bytes / cm.link_bandwidth_bytes_per_s"),
    ("7.3", "attention over its own chunk only", "cm.attn_s_per_dot * c * (s + c)", "cm.attn_s_per_dot * c * c"),
    ("7.4", "a linear scan", '''
def break_even_context(speedup, lo, hi):
    if lo < 1 or hi < lo:
        raise ValueError("need 1 <= lo <= hi")
    return next((n for n in range(lo, hi + 1) if speedup(n) >= 1), None)
''', None),
    ("7.4", "the last context below 1", "    return int(b)\n", "    return int(a)\n"),
    ("7.4", "never None", "    if speedup(hi) < 1:\n        return None\n", ""),
    ("7.4", "a float", "    return int(b)\n", "    return float(b)\n"),
    ("7.4", "no input check", "    if lo < 1 or hi < lo:\n", "    if False:\n"),
    # lesson 08
    ("8.1", "writes into a shared block", "        if pool.refs[shared] > 1:", "        if False:"),
    ("8.1", "keeps its use of the block it copied", "            pool.release(shared)\n", ""),
    ("8.1", "frees the shared block while the other sequence still uses it", "            pool.release(shared)\n",
     "            while pool.refs[shared] > 0:\n                pool.release(shared)\n"),
    ("8.1", "a fresh block without the shared rows", "            pool.k[own] = pool.k[shared]\n            pool.v[own] = pool.v[shared]\n", ""),
    ("8.1", "one block too many at a block's end", "first, last = start // bs, (start + tokens - 1) // bs",
     "first, last = start // bs, (start + tokens) // bs"),
    ("8.1", "copies a block it uses alone", "        if pool.refs[shared] > 1:", "        if pool.refs[shared] >= 1:"),
    ("8.1", "no gap check", "    if start > len(table) * bs:\n", "    if False:\n"),
    ("8.2", "blocks in the order of their ids", "store[table[:n], layer]", "store[sorted(table[:n]), layer]"),
    ("8.2", "reshapes without moving the block axis", "rows.transpose(0, 1).reshape(", "rows.reshape("),
    ("8.2", "whole blocks, not cut at the length", "[:, :length].unsqueeze(0)", ".unsqueeze(0)"),
    ("8.2", "the first layer always", "store[table[:n], layer]", "store[table[:n], 0]"),
    ("8.2", "one block too few", "n = -(-length // block_size)", "n = max(1, length // block_size)"),
    ("8.3", "prompts before decodes", "    for i in decoding:\n        plan[i] = 1\n    for i, left in enumerate(prompt_left):\n        if left > 0:\n            plan[i] = left if budget is None else min(left, budget)\n            if budget is not None:\n                budget -= plan[i]\n",
     "    for i, left in enumerate(prompt_left):\n        if left > 0:\n            plan[i] = left if budget is None else max(0, min(left, budget - len(decoding)))\n            if budget is not None:\n                budget -= plan[i]\n    for i in decoding:\n        plan[i] = 1\n"),
    ("8.3", "a finished sequence decodes on", "if left == 0 and not d]", "if left == 0]"),
    ("8.3", "the whole prompt whatever the budget", "            plan[i] = left if budget is None else min(left, budget)", "            plan[i] = left"),
    ("8.3", "the budget's decodes not counted", "        budget -= len(decoding)\n", ""),
    ("8.3", "one prompt per iteration", "        if left > 0:\n            plan[i] = left", "        if left > 0 and not any(plan[j] > 1 or (plan[j] == 1 and prompt_left[j] > 0) for j in range(i)):\n            plan[i] = left"),
    ("8.3", "no check that the decodes fit", "        if len(decoding) > budget:\n", "        if False:\n"),
    ("8.4", "K only, not V", "values = 2 * cfg.n_layers", "values = cfg.n_layers"),
    ("8.4", "query heads, not KV heads", "cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * rows", "cfg.n_layers * cfg.n_heads * cfg.head_dim * rows"),
    ("8.4", "rows not rounded to whole blocks", "rows = tokens if block_size is None else -(-tokens // block_size) * block_size", "rows = tokens"),
    ("8.4", "truncated, not rounded up", "return math.ceil(values * bytes_per_value)", "return int(values * bytes_per_value)"),
    ("8.4", "a float", "return math.ceil(values * bytes_per_value)", "return float(math.ceil(values * bytes_per_value))"),
    ("8.4", "bits, not bytes", "return math.ceil(values * bytes_per_value)", "return math.ceil(8 * values * bytes_per_value)"),
    ("8.2", "no check of the length", "    if length < 0 or length > len(table) * block_size:", "    if length < 0:"),
    # Mistakes a class made that once kept full marks: input checks, edge cases of the searches, a view
    ("1.3", "an empty prompt refused only once a token is asked for",
     '    if len(prompt_ids) == 0:\n        raise ValueError("prompt_ids is empty: give at least one token")\n', ""),
    ("5.4", "a negative time accepted", "    if ttft1_s < 0:\n", "    if False:\n"),
    ("8.1", "a gap inside the next block not caught", "    if start > len(table) * bs:", "    if start // bs > len(table):"),
    ("8.2", "a view of the rows, not a contiguous tensor", ".unsqueeze(0).contiguous()", ".unsqueeze(0)"),
    ("8.3", "a budget of 0 accepted when nothing decodes", "if token_budget is not None and token_budget < 1:",
     "if token_budget is not None and token_budget < 0:"),
    ("8.3", "decodes that exactly fill the budget refused", "        if len(decoding) > budget:",
     "        if len(decoding) >= budget:"),
    ("6.1", "offers b = context when the stride divides it", "    n = (context - 1) // min_stride",
     "    n = context // min_stride"),
    ("6.2", "starts from j * (C // p), off the even split when p does not divide C",
     "    best = (0, *(j * context // p for j in range(1, p)), context)",
     "    best = (0, *(j * (context // p) for j in range(1, p)), context)"),
    ("6.3", "ratios not normalised by their sum", "    shares = [context * r / total for r in ratios]",
     "    shares = [context * r for r in ratios]"),
    ("9.1", "the sides added without rescaling", "    return (out_a * share_a + out_b * share_b).to(out_a.dtype), lse\n",
     "    return (out_a + out_b).to(out_a.dtype), lse\n"),
    ("9.1", "the larger lse kept, not their log-sum", "    lse = torch.logaddexp(lse_a, lse_b)",
     "    lse = torch.maximum(lse_a, lse_b)"),
    ("9.1", "nan where neither side saw a key", "    share_a = (lse_a - lse).exp().nan_to_num(0.0).unsqueeze(-1)",
     "    share_a = (lse_a - lse).exp().unsqueeze(-1)"),
    ("9.1", "out in float32 whatever came in", "    return (out_a * share_a + out_b * share_b).to(out_a.dtype), lse\n",
     "    return out_a * share_a + out_b * share_b, lse\n"),
    ("9.2", "the mask one diagonal off: a query misses its own key", "~causal_mask(q_pos, k_pos)",
     "~causal_mask(q_pos - 1, k_pos)"),
    ("9.2", "the mask by index in the block, not by position", "~causal_mask(q_pos, k_pos)",
     "~causal_mask(torch.arange(len(q_pos)), torch.arange(len(k_pos)))"),
    ("9.2", "scores not scaled by 1/sqrt(D)", "    scores = q.float() @ keys.transpose(-2, -1) / q.shape[-1] ** 0.5",
     "    scores = q.float() @ keys.transpose(-2, -1)"),
    ("9.2", "nan for a query that sees no key", "    weights = (scores - lse.unsqueeze(-1)).exp().nan_to_num(0.0)",
     "    weights = (scores - lse.unsqueeze(-1)).exp()"),
    ("9.2", "K/V heads repeated as a block, not per group", "    keys = k.repeat_interleave(group, dim=1).float()",
     "    keys = k.repeat(1, group, 1, 1).float()"),
    ("9.3", "a block read with the positions of the step before", "        k_pos = pos.layout[ring.origin(step)]",
     "        k_pos = pos.layout[ring.origin(step - 1)]"),
    ("9.3", "blocks wholly in the future computed anyway", "        if int(k_pos[0]) <= int(pos.q_pos[-1]):",
     "        if True:"),
    ("9.3", "only the last block kept, none merged", "            acc = part if acc is None else merge(acc, part)",
     "            acc = part"),
    ("9.3", "the block in hand returned as the rank's cache", "    return layer.finish(x, layer.project(acc[0])), k, v",
     "    return layer.finish(x, layer.project(acc[0])), *block"),
    ("9.1", "no max subtracted: the shares as exp(lse) over exp(joint lse), which overflow for large scores",
     "    share_a = (lse_a - lse).exp().nan_to_num(0.0).unsqueeze(-1)",
     "    share_a = (lse_a.exp() / lse.exp()).nan_to_num(0.0).unsqueeze(-1)"),
    ("9.2", "the lse returned in the query's dtype", "    return (weights @ vals).to(q.dtype), lse\n",
     "    return (weights @ vals).to(q.dtype), lse.to(q.dtype)\n"),
    ("9.3", "the block sent on after attending over it: nothing overlaps",
     "        handle = ring.pass_on(step, *block) if step < p - 1 else None   # the next block travels meanwhile\n"
     "        k_pos = pos.layout[ring.origin(step)]\n"
     "        if int(k_pos[0]) <= int(pos.q_pos[-1]):                # else every key is in the future: skip\n"
     "            part = ring.attend(q, *block, pos.q_pos, k_pos, attention)\n",
     "        k_pos = pos.layout[ring.origin(step)]\n"
     "        if int(k_pos[0]) <= int(pos.q_pos[-1]):\n"
     "            part = ring.attend(q, *block, pos.q_pos, k_pos, attention)\n"
     "        handle = ring.pass_on(step, *block) if step < p - 1 else None\n"
     "        if int(k_pos[0]) <= int(pos.q_pos[-1]):\n"),
    ("9.3", "a block sent at the last step too", "ring.pass_on(step, *block) if step < p - 1 else None",
     "ring.pass_on(step, *block)"),
    ("9.3", "the skip by < : a one-token rank skips its own block", "        if int(k_pos[0]) <= int(pos.q_pos[-1]):",
     "        if int(k_pos[0]) < int(pos.q_pos[-1]):"),
    ("9.4", "byte counts as floats", 'return {"kv": kv, "q": q, "choose": "q" if q < kv else "kv"}',
     'return {"kv": float(kv), "q": float(q), "choose": "q" if q < kv else "kv"}'),
    ("9.4", "the partial outputs' lses left out", "(n_heads * head_dim + n_heads * (head_dim + 1))",
     "(n_heads * head_dim + n_heads * head_dim)"),
    ("9.4", "pass-KV sends only the new tokens", "    kv_values = others * (cached_tokens + new_tokens) * 2 * n_kv_heads * head_dim",
     "    kv_values = others * new_tokens * 2 * n_kv_heads * head_dim"),
    ("9.4", "query heads counted for K and V", "    kv_values = others * (cached_tokens + new_tokens) * 2 * n_kv_heads * head_dim",
     "    kv_values = others * (cached_tokens + new_tokens) * 2 * n_heads * head_dim"),
    ("9.4", "one link, not p - 1", "    others = world_size - 1", "    others = 1"),
    ("9.4", "a tie chooses pass-Q", 'return {"kv": kv, "q": q, "choose": "q" if q < kv else "kv"}',
     'return {"kv": kv, "q": q, "choose": "q" if q <= kv else "kv"}'),
]

RIGHT = [  # (exercise, which way, the function)
    ("1.1", "max over the ids", '''
def greedy_next_token(logits):
    if logits.dim() != 1 or len(logits) == 0:
        raise ValueError("one position's logits, please")
    values = logits.tolist()
    return max(range(len(values)), key=values.__getitem__)
'''),
    ("1.2", "Gumbel-max", '''
def sample_next_token(logits, temperature=0.0, top_k=None, top_p=None, generator=None):
    check_sampling(temperature, top_k, top_p)
    if temperature == 0:
        return int(logits.argmax())
    scaled = logits.double() / temperature
    if top_k is not None and top_k < len(scaled):
        scaled[scaled < scaled.topk(top_k).values[-1]] = float("-inf")
    if top_p is not None:
        order = scaled.argsort(descending=True)
        p = scaled[order].softmax(-1)
        keep = torch.zeros(len(scaled), dtype=torch.bool)
        keep[order] = (p.cumsum(-1) - p) < top_p
        scaled[~keep] = float("-inf")
    u = torch.rand(len(scaled), generator=generator, dtype=torch.float64).clamp_min(1e-300)
    return int((scaled - torch.log(-torch.log(u))).argmax())
'''),
    ("1.2", "inverse CDF with exact fractions", '''
def sample_next_token(logits, temperature=0.0, top_k=None, top_p=None, generator=None):
    from fractions import Fraction
    import math
    if temperature < 0 or (top_k is not None and top_k < 1) or (top_p is not None and not 0 < top_p <= 1):
        raise ValueError("bad sampling parameters")
    if temperature == 0:
        return int(logits.argmax())
    ranked = sorted(range(len(logits)), key=lambda i: -float(logits[i]))
    if top_k is not None:
        ranked = ranked[:top_k]
    weights = [math.exp((float(logits[i]) - float(logits[ranked[0]])) / temperature) for i in ranked]
    if top_p is not None:
        total, before, kept = sum(weights), 0.0, []
        for w in weights:
            if before / total >= top_p:
                break
            kept.append(w)
            before += w
        weights = kept
    u = float(torch.rand(1, generator=generator)) * sum(weights)
    for i, w in zip(ranked, weights):
        u -= w
        if u < 0:
            return i
    return ranked[len(weights) - 1]
'''),
    ("2.1", "einsum", '''
def attention_with_offset(q, k, v, q_pos, k_pos):
    scores = torch.einsum("bhtd,bhsd->bhts", q, k) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
    return torch.einsum("bhts,bhsd->bhtd", scores.softmax(-1), v)
'''),
    ("2.1", "SDPA", '''
def attention_with_offset(q, k, v, q_pos, k_pos):
    import torch.nn.functional as F
    return F.scaled_dot_product_attention(q, k, v, attn_mask=k_pos[None, :] <= q_pos[:, None])
'''),
    ("2.2", "math.prod", '''
def kv_cache_bytes(n_layers, n_kv_heads, head_dim, tokens, bytes_per_value=2, batch=1):
    if min(n_layers, n_kv_heads, head_dim, tokens, batch) < 0 or bytes_per_value <= 0:
        raise ValueError("counts must be >= 0 and bytes_per_value > 0")
    return int(round(math.prod([2, n_layers, n_kv_heads, head_dim, tokens, batch]) * bytes_per_value))
'''),
    ("2.3", "exact fractions", '''
def static_buffer_bytes(n_blocks, n_kv_heads, head_dim, max_seq_len, bits=16, reserve=2.0):
    from fractions import Fraction
    if max_seq_len < 2 or not 1 <= reserve <= 2 or bits <= 0 or bits % 1:
        raise ValueError("bad buffer parameters")
    return math.ceil(2 * n_blocks * n_kv_heads * Fraction(reserve) * (max_seq_len - 1) * head_dim * Fraction(bits, 8))
'''),
    ("3.2", "exact fractions, returned as a float", '''
def attention_intensity(S, T):
    from fractions import Fraction
    if S < 1 or T < 1:
        raise ValueError("S and T must be at least 1")
    return float(Fraction(S * T, S + T))
'''),
    ("3.6", "integer division of exact values", '''
def max_batch_size(param_bytes, kv_bytes_per_seq, hbm_bytes):
    from fractions import Fraction
    if kv_bytes_per_seq <= 0:
        raise ValueError("kv_bytes_per_seq must be positive")
    return max(0, int((Fraction(hbm_bytes) - Fraction(param_bytes)) // Fraction(kv_bytes_per_seq)))
'''),
    ("1.3", "the sequence kept as a tensor", '''
def naive_generate(model, prompt_ids, max_new_tokens):
    if len(prompt_ids) == 0 or max_new_tokens < 0:
        raise ValueError("a prompt of at least one token and max_new_tokens >= 0, please")
    ids = torch.tensor([[int(t) for t in prompt_ids]])
    for _ in range(max_new_tokens):
        nxt = model(ids)[0, -1].argmax()
        ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
    return ids[0, len(prompt_ids):].tolist()
'''),
    ("2.4", "one loop for prefill and decode", '''
def cached_generate(model, prompt_ids, max_new_tokens):
    if len(prompt_ids) == 0 or max_new_tokens < 0:
        raise ValueError("a prompt of at least one token and max_new_tokens >= 0, please")
    cache = DynamicKVCache(model.config.n_layers)
    out, feed, pos = [], [int(t) for t in prompt_ids], 0
    while len(out) < max_new_tokens:
        logits = model(torch.tensor([feed]), input_pos=pos, cache=cache)[0, -1]
        pos += len(feed)
        out.append(int(logits.argmax()))
        feed = [out[-1]]
    return out
'''),
    ("3.1", "exact fractions, returned as a float", '''
def matmul_intensity(B, D, F, bytes_per_value=2):
    from fractions import Fraction
    if min(B, D, F) < 1 or bytes_per_value <= 0:
        raise ValueError("dimensions >= 1 and bytes_per_value > 0, please")
    return float(Fraction(2 * B * D * F) / (Fraction(bytes_per_value) * (B * D + D * F + B * F)))
'''),
    ("3.3", "two reads added up", '''
def min_step_time_s(param_bytes, kv_bytes_per_seq, batch, hbm_bandwidth_bytes_per_s):
    if batch < 0 or hbm_bandwidth_bytes_per_s <= 0:
        raise ValueError("batch >= 0 and a positive bandwidth, please")
    return float(param_bytes / hbm_bandwidth_bytes_per_s + batch * kv_bytes_per_seq / hbm_bandwidth_bytes_per_s)
'''),
    ("3.4", "memory or compute bound written with if", '''
def step_time_s(param_bytes, kv_bytes_per_seq, batch, hbm_bandwidth_bytes_per_s, param_count, peak_flops):
    if batch < 0 or hbm_bandwidth_bytes_per_s <= 0 or peak_flops <= 0:
        raise ValueError("bad arguments")
    load, compute = param_bytes / hbm_bandwidth_bytes_per_s, 2 * batch * param_count / peak_flops
    return float(batch * kv_bytes_per_seq / hbm_bandwidth_bytes_per_s + (compute if compute > load else load))
'''),
    ("3.5", "bytes per token over the bandwidth", '''
def max_throughput_tokens_per_s(param_bytes, kv_bytes_per_seq, batch, hbm_bandwidth_bytes_per_s):
    if batch < 1 or hbm_bandwidth_bytes_per_s <= 0:
        raise ValueError("batch >= 1 and a positive bandwidth, please")
    return float(hbm_bandwidth_bytes_per_s * batch / (batch * kv_bytes_per_seq + param_bytes))
'''),
    ("4.1", "a comprehension over the total", '''
def tsp_dot_products(chunks):
    if not chunks or min(chunks) < 1:
        raise ValueError("every rank needs a token")
    total = sum(int(c) for c in chunks)
    return [total * int(c) for c in chunks]
'''),
    ("4.2", "key positions from pos.context", '''
def tsp_layer(layer, x, pos, comm, attention):
    q, k, v = layer.qkv(x, pos.cos, pos.sin)
    ks, vs = comm.all_gather(k, v)
    k_all, v_all = torch.cat(list(ks), dim=2), torch.cat(list(vs), dim=2)
    out = layer.attend(q, k_all, v_all, pos.q_pos, torch.arange(pos.context), attention)
    return layer.finish(x, out), k_all, v_all
'''),
    ("4.3", "all rows minus its own", '''
def tsp_kv_bytes_received(chunks, n_kv_heads, head_dim, bytes_per_value=2):
    row = n_kv_heads * head_dim * bytes_per_value
    total = 2.0 * sum(chunks) * row
    return [total - 2.0 * c * row for c in chunks]
'''),
    ("4.4", "reduce-scatter plus all-gather", '''
def tensor_parallel_bytes_sent(tokens, d_model, world_size, bytes_per_value=2):
    piece = tokens * d_model * bytes_per_value / world_size
    one_all_reduce = (world_size - 1) * piece + (world_size - 1) * piece
    return 2.0 * one_all_reduce
'''),
    ("5.1", "key positions from pos.start", '''
def kvr_layer_blocking(layer, x, pos, chain, attention):
    prefix = chain.recv()
    q, k, v = layer.qkv(x, pos.cos, pos.sin)
    if prefix is not None:
        k, v = torch.cat((prefix[0], k), 2), torch.cat((prefix[1], v), 2)
    chain.send(k, v)
    out = layer.attend(q, k, v, pos.q_pos, torch.arange(pos.start + x.shape[1]), attention)
    return layer.finish(x, out), k, v
'''),
    ("5.2", "key positions from pos.start", '''
def kvr_layer(layer, x, pos, chain, attention):
    pending = chain.irecv()
    q, k, v = layer.qkv(x, pos.cos, pos.sin)
    if pending is not None:
        before = pending.wait()
        k, v = torch.cat((before[0], k), 2), torch.cat((before[1], v), 2)
    chain.isend(k, v)
    out = layer.attend(q, k, v, pos.q_pos, torch.arange(pos.start + x.shape[1]), attention)
    return layer.finish(x, out), k, v
'''),
    ("5.3", "prefix sums", '''
def kvr_counts(chunks):
    import itertools
    if not chunks or min(chunks) < 1:
        raise ValueError("every rank needs a token")
    ends = list(itertools.accumulate(int(c) for c in chunks))
    return [int(c) * e for c, e in zip(chunks, ends)], sum(2 * e for e in ends[:-1])
'''),
    ("5.4", "one fraction", '''
def ttft_lower_bound(ttft1_s, world_size):
    if world_size < 1 or ttft1_s < 0:
        raise ValueError("world_size >= 1 and a time >= 0, please")
    return float(ttft1_s * (world_size + 1) / (2 * world_size ** 2))
'''),
    ("6.1", "bisection on the slope", '''
def search_boundary(cost, context, min_stride=1):
    if context < 2 or min_stride < 1 or context <= min_stride:
        raise ValueError("bad arguments")
    n = (context - 1) // min_stride
    memo = {}

    def f(k):
        if k not in memo:
            memo[k] = cost([k * min_stride, context - k * min_stride])
        return memo[k]

    lo, hi = 1, n
    while lo < hi:
        m = (lo + hi) // 2
        if f(m) <= f(m + 1):
            hi = m
        else:
            lo = m + 1
    return [lo * min_stride, context - lo * min_stride]
'''),
    ("6.2", "the cheapest of each level's grid", '''
def grid_search(cost, context, world_size, stride, min_stride=1, span=2):
    p = world_size
    if p < 2 or context < p or stride < 1 or min_stride < 1:
        raise ValueError("bad arguments")
    memo = {}

    def f(b):
        if b not in memo:
            memo[b] = cost([y - x for x, y in zip(b, b[1:])])
        return memo[b]

    best = tuple([0] + [j * context // p for j in range(1, p)] + [context])
    stride = max(stride, min_stride)
    while True:
        points = []
        for off in itertools.product(range(-span, span + 1), repeat=p - 1):
            b = (0,) + tuple(x + o * stride for x, o in zip(best[1:-1], off)) + (context,)
            if all(x < y for x, y in zip(b, b[1:])):
                points.append(b)
        best = min(points, key=lambda b: (f(b), b != best))
        if stride == min_stride:
            break
        stride = max(min_stride, stride // 2)
    return [y - x for x, y in zip(best, best[1:])]
'''),
    ("6.3", "bisect for the neighbours", '''
def interpolate_partition(table, context):
    import bisect
    if not table:
        raise ValueError("the lookup table is empty")
    keys = sorted(table)
    p = len(table[keys[0]])
    if context < p:
        raise ValueError("fewer tokens than processes")
    j = bisect.bisect_left(keys, context)
    if j == 0:
        ratios = table[keys[0]]
    elif j == len(keys):
        ratios = table[keys[-1]]
    elif keys[j] == context:
        ratios = table[context]
    else:
        lo, hi = keys[j - 1], keys[j]
        t = (context - lo) / (hi - lo)
        ratios = [(1 - t) * a + t * b for a, b in zip(table[lo], table[hi])]
    total = sum(ratios)
    shares = [context * r / total for r in ratios]
    chunks = [int(math.floor(s)) for s in shares]
    left = context - sum(chunks)
    for i in sorted(range(p), key=lambda i: (-(shares[i] - chunks[i]), i))[:left]:
        chunks[i] += 1
    for i in range(p):
        while chunks[i] < 1:
            donor = chunks.index(max(chunks))
            chunks[donor] -= 1
            chunks[i] += 1
    return chunks
'''),
    ("6.4", "NumPy least squares on scaled columns", '''
def fit_cost_model(samples):
    import numpy as np
    if len(samples) < 3:
        raise ValueError("three coefficients need three samples")
    X = np.array([[t, d, 1.0] for t, d, _ in samples], dtype=float)
    y = np.array([s for _, _, s in samples], dtype=float)
    scale = np.abs(X).max(axis=0)
    coef = np.linalg.lstsq(X / scale, y, rcond=None)[0] / scale
    return tuple(float(v) for v in coef)
'''),
    ("7.1", "prefix sums", '''
def chain_transfer_s(chunks, row_bytes, bandwidth_bytes_per_s, latency_s):
    import itertools
    if not chunks or min(chunks) < 1 or row_bytes < 1 or bandwidth_bytes_per_s <= 0 or latency_s < 0:
        raise ValueError("bad arguments")
    ends = list(itertools.accumulate(chunks))[:-1]
    return [latency_s + 2 * e * row_bytes / bandwidth_bytes_per_s for e in ends]
'''),
    ("7.2", "step by step", '''
def ring_allgather_s(chunks, row_bytes, bandwidth_bytes_per_s, latency_s):
    if not chunks or min(chunks) < 1 or row_bytes < 1 or bandwidth_bytes_per_s <= 0 or latency_s < 0:
        raise ValueError("bad arguments")
    step = 2 * max(chunks) * row_bytes / bandwidth_bytes_per_s + latency_s
    return float(sum(step for _ in range(len(chunks) - 1)))
'''),
    ("7.3", "layer by layer, all ranks", '''
def kvr_ttft(chunks, n_layers, row_bytes, cost_model):
    cm, p = cost_model, len(chunks)
    starts = [sum(chunks[:i]) for i in range(p)]
    clock, link_free, inbox = [0.0] * p, [0.0] * p, [0.0] * p
    for layer in range(n_layers):
        for i, (c, s) in enumerate(zip(chunks, starts)):
            t = clock[i] + cm.layer_overhead_s + cm.qkv_s_per_token * c
            if i > 0:
                t = max(t, inbox[i])
            if i < p - 1:
                t = max(t, link_free[i])
                link_free[i] = inbox[i + 1] = t + cm.transfer_s(2 * (s + c) * row_bytes)
            clock[i] = t + cm.attn_s_per_dot * c * (s + c) + cm.mlp_s_per_token * c
    return float(clock[-1])
'''),
    ("7.4", "bisection on a half-open interval", '''
def break_even_context(speedup, lo, hi):
    if lo < 1 or hi < lo:
        raise ValueError("need 1 <= lo <= hi")
    if speedup(hi) < 1:
        return None
    a, b = lo, hi
    while a < b:
        m = (a + b) // 2
        if speedup(m) >= 1:
            b = m
        else:
            a = m + 1
    return int(a)
'''),
    ("8.1", "a loop over the whole table, copying with copy_", '''
def prepare_blocks(pool, table, start, tokens):
    if start < 0 or tokens < 1:
        raise ValueError("start >= 0 and tokens >= 1, please")
    bs = pool.block_size
    if start > len(table) * bs:
        raise ValueError("that would leave a gap")
    out = []
    for i, b in enumerate(table):
        written = i * bs + bs > start and i * bs < start + tokens
        if written and pool.refs[b] > 1:
            new = pool.allocate()
            pool.k[new].copy_(pool.k[b])
            pool.v[new].copy_(pool.v[b])
            pool.release(b)
            b = new
        out.append(b)
    while len(out) * bs < start + tokens:
        out.append(pool.allocate())
    return out
'''),
    ("8.3", "two passes over a copy of the budget", '''
def plan_iteration(prompt_left, done, token_budget):
    if len(prompt_left) != len(done) or min(prompt_left, default=0) < 0:
        raise ValueError("one entry per sequence, none negative")
    if any(d and n for n, d in zip(prompt_left, done)) or (token_budget is not None and token_budget < 1):
        raise ValueError("bad state or budget")
    decodes = sum(1 for n, d in zip(prompt_left, done) if n == 0 and not d)
    room = float("inf") if token_budget is None else token_budget - decodes
    if room < 0:
        raise ValueError("the decodes do not fit")
    out = []
    for n, d in zip(prompt_left, done):
        if d:
            out.append(0)
        elif n == 0:
            out.append(1)
        else:
            take = int(min(n, room))
            room -= take
            out.append(take)
    return out
'''),
    ("8.4", "exact fractions", '''
def transfer_bytes(cfg, tokens, bytes_per_value=4, block_size=None):
    from fractions import Fraction
    if tokens < 1 or bytes_per_value <= 0 or (block_size is not None and block_size < 1):
        raise ValueError("tokens >= 1, bytes_per_value > 0, block_size >= 1, please")
    sent = tokens if block_size is None else math.ceil(tokens / block_size) * block_size
    per_row = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim
    return math.ceil(Fraction(per_row * sent) * Fraction(bytes_per_value))
'''),
    ("8.2", "the blocks concatenated, then cut", '''
def gather_rows(store, table, layer, length):
    bs = store.shape[-2]
    if length < 0 or length > len(table) * bs:
        raise ValueError("length out of range")
    if length == 0:
        return store.new_zeros(1, store.shape[2], 0, store.shape[-1])
    return torch.cat([store[b, layer] for b in table], dim=1)[:, :length].unsqueeze(0).contiguous()
'''),
    ("9.1", "weights from the larger lse, by hand", '''
def merge(a, b):
    (oa, la), (ob, lb) = a, b
    top = torch.maximum(la, lb)
    safe = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    wa, wb = torch.exp(la - safe), torch.exp(lb - safe)
    total = wa + wb
    lse = safe + torch.log(total)
    out = (oa * (wa / total.clamp_min(1e-30))[..., None] + ob * (wb / total.clamp_min(1e-30))[..., None])
    return out.to(oa.dtype), torch.where(total > 0, lse, torch.full_like(lse, float("-inf")))
'''),
    ("9.2", "einsum over the groups, softmax with a guard", '''
def block_attention(q, k, v, q_pos, k_pos):
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    qg = q.float().reshape(B, Hkv, H // Hkv, T, D)
    s = torch.einsum("bkgtd,bksd->bkgts", qg, k.float()) / D ** 0.5
    s = s.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    seen = torch.isfinite(lse)[..., None]
    w = torch.where(seen, torch.softmax(torch.where(seen, s, torch.zeros_like(s)), dim=-1), torch.zeros_like(s))
    out = torch.einsum("bkgts,bksd->bkgtd", w, v.float())
    return out.reshape(B, H, T, D).to(q.dtype), lse.reshape(B, H, T)
'''),
    ("9.3", "a while loop that stops at the last step, the skip by the block's smallest position", '''
def ring_pass_kv_layer(layer, x, pos, ring, attention):
    q, k, v = layer.qkv(x, pos.cos, pos.sin)
    held, total, step = (k, v), None, 0
    while True:
        last = step == ring.world_size - 1
        handle = None if last else ring.pass_on(step, *held)
        keys_at = pos.layout[ring.origin(step)]
        if int(keys_at.min()) <= int(pos.q_pos.max()):
            part = ring.attend(q, *held, pos.q_pos, keys_at, attention)
            total = part if total is None else merge(total, part)
        if last:
            break
        held, step = handle.wait(), step + 1
    return layer.finish(x, layer.project(total[0])), k, v
'''),
    ("9.4", "counted per rank and summed", '''
def ring_traffic(new_tokens, cached_tokens, n_heads, n_kv_heads, head_dim, world_size, bytes_per_value=4):
    for value, low in ((new_tokens, 1), (cached_tokens, 0), (n_heads, 1), (n_kv_heads, 1), (head_dim, 1),
                       (world_size, 1), (bytes_per_value, 1)):
        if type(value) is not int or value < low:
            raise ValueError(f"expected an integer >= {low}, got {value!r}")
    if n_heads % n_kv_heads != 0:
        raise ValueError("n_kv_heads must divide n_heads")
    kv = q = 0
    for _rank in range(world_size):
        kv += (world_size - 1) * (cached_tokens + new_tokens) * 2 * n_kv_heads * head_dim * bytes_per_value
        q += (world_size - 1) * new_tokens * n_heads * (2 * head_dim + 1) * bytes_per_value
    kv, q = kv // world_size, q // world_size
    return {"kv": kv, "q": q, "choose": "kv" if kv <= q else "q"}
'''),
]

def _engine_exercises() -> frozenset[str]:
    """The exercises whose graded tests are marked ``engine`` (they start the engine's worker processes)."""
    found = set()
    for path in (ROOT / "tests" / "grading").glob("test_ex*.py"):
        for node in ast.parse(path.read_text()).body:
            if not isinstance(node, ast.FunctionDef):
                continue
            marks = [ast.unparse(d) for d in node.decorator_list]
            if "pytest.mark.engine" in marks:
                found |= {ast.literal_eval(m[len("pytest.mark.exercise("):-1]) for m in marks
                          if m.startswith("pytest.mark.exercise(")}
    return frozenset(found)


ENGINE_EXERCISES = _engine_exercises()


def _marked_like_its_tests(case: tuple, name: str):
    """A case of an exercise whose graded tests start the engine's processes is marked ``engine`` as they are:
    ``make check`` (which refuses every process) leaves it out instead of seeing each of its tests fail."""
    return pytest.param(*case, id=name, marks=[pytest.mark.engine] if case[0] in ENGINE_EXERCISES else [])


_LESSON_FILES = {n: name for n, name in LESSONS.items()}


def _variant(tmp_path: Path, exercise: str, old: str, new: str | None) -> Path:
    lesson = int(exercise.split(".")[0])
    name = next((ROOT / "solutions").glob(f"ex{lesson:02d}_*.py")).name
    source = (ROOT / "solutions" / name).read_text()
    if new is None:
        source += "\n\n" + textwrap.dedent(old)
    else:
        assert source.count(old) >= 1, f"the model answer changed: {old!r} is gone"
        head, _, tail = source.rpartition(old)         # the code, not the hint that may quote it
        source = head + new + tail
    (tmp_path / name).write_text(source)
    return tmp_path


def _run_exercise(impl: Path, exercise: str, explain: bool = True) -> dict[str, str]:
    """Run the graded tests of one exercise in this process against ``impl``: {test name: "passed" or why not}.
    ``explain=False``: a failed engine run does not run the step again to say where it went wrong."""
    import importlib.util
    import inspect

    from toyllm import build_model
    from toyllm.grading.sandbox import harness
    from toyllm.grading.sandbox import process as sandbox
    from toyllm.grading.sandbox.local import LocalModule

    lesson = int(exercise.split(".")[0])
    path = next((ROOT / "tests" / "grading").glob(f"test_ex{lesson:02d}_*.py"))
    spec = importlib.util.spec_from_file_location(f"_graded_{path.stem}", path)
    tests = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tests)
    fixtures = _graded_conftest()
    name = f"ex{lesson:02d}"
    module = LocalModule(load_exercise(name, impl=impl), load_exercise(name, impl="solutions"))
    seed = fixtures.grading_seed_value()
    _SEEDS_USED.append(seed)
    provided = {name: lambda: module, "tiny_model": lambda: build_model("tiny", seed=0),
                "engine_run": lambda: fixtures.make_engine_run(explain), "drawn": lambda: fixtures.Drawn(seed), "grading_seed": lambda: seed}
    outcomes = {}
    try:
        for test_name, fn in vars(tests).items():
            marks = {m.name: m.args for m in getattr(fn, "pytestmark", [])}
            if not test_name.startswith("test_") or marks.get("exercise") != (exercise,):
                continue
            violations = []
            sandbox.context.exercise = exercise
            sandbox.context.forbidden = tuple(answers.forbidden(exercise))
            sandbox.context.on_violation = lambda ex, message: violations.append(message)
            args = {p: provided[p]() for p in inspect.signature(fn).parameters}
            try:
                fn(**args)
                outcomes[test_name] = violations[0] if violations else "passed"
            except (Exception, pytest.fail.Exception) as e:    # pytest.fail raises a BaseException
                outcomes[test_name] = f"{type(e).__name__}: {e}"
            finally:
                sandbox.context.exercise, sandbox.context.forbidden, sandbox.context.on_violation = None, (), None
    finally:
        harness.close_pools()                      # engine workers that ran this variant's step
    assert outcomes, f"no graded tests for exercise {exercise}"
    return outcomes


def _graded_conftest():
    """tests/grading/conftest.py as a module: its fixtures' factories (``make_engine_run``, ``Drawn``)."""
    import importlib.util

    path = ROOT / "tests" / "grading" / "conftest.py"
    spec = importlib.util.spec_from_file_location("_graded_conftest", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("exercise, mistake, old, new", [_marked_like_its_tests(w, f"{w[0]} {w[1]}") for w in WRONG])
def test_every_kind_of_mistake_loses_points(tmp_path, exercise, mistake, old, new):
    # Without the traced second run that says where a failed engine run went wrong (a third of an engine
    # exercise's time here): what it says is checked in test_messages.py and test_grading_04_05.py.
    outcomes = _run_exercise(_variant(tmp_path, exercise, old, new), exercise, explain=False)
    failed = {name: why for name, why in outcomes.items() if why != "passed"}
    assert failed, (f"Exercise {exercise} with the mistake '{mistake}' still passes every graded test "
                    f"({_seed_note()})")
    for why in failed.values():                    # each message names the call, not just `assert 0 == 8`
        assert not why.startswith("AssertionError: assert "), why


@pytest.mark.grader
@pytest.mark.parametrize("exercise, way, source", [_marked_like_its_tests(r, f"{r[0]} {r[1]}") for r in RIGHT])
def test_every_correct_alternative_keeps_full_marks(tmp_path, exercise, way, source):
    outcomes = _run_exercise(_variant(tmp_path, exercise, source, None), exercise)
    assert all(why == "passed" for why in outcomes.values()), (outcomes, _seed_note())


_SEEDS_USED: list[int] = []                        # the grading seed of each _run_exercise, the last one last


def _seed_note() -> str:
    """How to draw the same cases again: the seed the last graded run used."""
    seed = _SEEDS_USED[-1] if _SEEDS_USED else os.environ.get("TOYLLM_GRADE_SEED")
    return f"drawn with TOYLLM_GRADE_SEED={seed}"


def test_the_engines_limit_in_graded_tests_is_a_setting_and_a_bad_one_a_clear_error(monkeypatch):
    from toyllm.grading.settings import Settings

    limit = _graded_conftest().engine_limit_s
    name = Settings.variable("engine_limit")
    monkeypatch.delenv(name, raising=False)
    assert limit() == 10
    monkeypatch.setenv(name, "2.5")
    assert limit() == 2.5
    for bad in ("0", "-3", "nan", "inf", "ten seconds", ""):
        monkeypatch.setenv(name, bad)
        with pytest.raises(ValueError, match=f"{name} must be a number of seconds above 0, got {bad!r}"):
            limit()


def test_a_mistake_in_one_exercise_costs_no_other_exercise(tmp_path):
    """3.5 calls 3.3's min_step_time_s: while 3.5 is graded, 3.3 is the model answer."""
    impl = _variant(tmp_path, "3.3", "(batch * kv_bytes_per_seq + param_bytes) / hbm_bandwidth_bytes_per_s\n    # END",
                    "(kv_bytes_per_seq + param_bytes) / hbm_bandwidth_bytes_per_s\n    # END")
    assert any(why != "passed" for why in _run_exercise(impl, "3.3").values())
    assert all(why == "passed" for why in _run_exercise(impl, "3.5").values())


def test_failure_messages_say_what_was_called_expected_and_got(tmp_path):
    impl = _variant(tmp_path, "2.4", "logits = model(torch.tensor([[new_ids[-1]]]), input_pos=cache.length",
                    "logits = model(torch.tensor([[new_ids[0]]]), input_pos=cache.length")
    outcomes = _run_exercise(impl, "2.4")
    why = outcomes["test_ex2_4_same_tokens_as_without_a_cache"]
    assert re.fullmatch(r"AssertionError: cached_generate\(prompt of 8 tokens, 12 new\): token \d+ differs: "
                        r"expected \d+, got \d+", why), why
    impl = _variant(tmp_path, "2.2", "    return round(2 * n_layers * n_kv_heads * head_dim * tokens * batch * bytes_per_value)",
                    "    return 2 * n_layers * n_kv_heads * head_dim * tokens * batch * bytes_per_value")
    why = _run_exercise(impl, "2.2")["test_ex2_2_other_precisions_and_shapes"]
    assert "expected 5765760 (int), got 5765760.0 (float)" in why, why


# Mistakes of lessons 04-05 that tests/test_grading_04_05.py grades through the real grader (exercise, test there).
MISTAKES_GRADED_BY_THE_GRADER = [
    ("5.2", "test_an_irecv_posted_after_the_projection_fails_the_overlap_test_only"),
    ("4.1", "test_counting_with_toyllms_own_functions_scores_zero"),
    ("5.4", "test_counting_with_toyllms_own_functions_scores_zero"),
    ("4.2", "test_a_step_that_keeps_only_its_own_keys_gets_a_message_naming_the_exercise"),
]


def test_every_exercise_has_four_wrong_answers_and_a_right_one():
    """The tables above cannot shrink unseen: every exercise of solutions/ has >= 4 mistakes and >= 1 alternative."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_grading_04_05", ROOT / "tests" / "test_grading_04_05.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    missing = [name for _, name in MISTAKES_GRADED_BY_THE_GRADER if not callable(getattr(module, name, None))]
    assert not missing, f"tests/test_grading_04_05.py no longer has {missing}"
    exercises = set()
    for path in (ROOT / "solutions").glob("ex*.py"):
        exercises |= set(re.findall(r"# BEGIN SOLUTION (\d+\.\d+)", path.read_text()))
    assert len(exercises) >= 29, sorted(exercises)
    wrong = {ex: sum(w[0] == ex for w in WRONG) + sum(m[0] == ex for m in MISTAKES_GRADED_BY_THE_GRADER)
             for ex in exercises}
    right = {ex: sum(r[0] == ex for r in RIGHT) for ex in exercises}
    few = {ex: n for ex, n in sorted(wrong.items()) if n < 4}
    none = sorted(ex for ex, n in right.items() if n < 1)
    assert not few, f"exercises with fewer than 4 wrong answers to check the graded tests with: {few}"
    assert not none, f"exercises without a correct alternative: {none}"
    assert {w[0] for w in WRONG} | {r[0] for r in RIGHT} <= exercises

