"""The grading system itself: the implementation switch, stubs, and the grader on real and fake submissions.

The fake submissions live in tests/fixtures/submissions/. Each ``grade`` call
starts one pytest process per lesson (a few seconds each, mostly importing
torch), so the expensive reports are computed once per module.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from toyllm.grading import GradeReport, grade, load_exercise, make_stub, resolve_impl, sync

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
HIDDEN_POINTS = 4


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
    report = grade("solutions", extra_tests=hidden_dir, results_path=results)
    return report, json.loads(results.read_text())


@pytest.fixture(scope="module")
def exercises_graded(tmp_path_factory):
    """Grade the untouched stubs through the command line, as an instructor would."""
    results = tmp_path_factory.mktemp("results") / "results.json"
    proc = subprocess.run([sys.executable, "-m", "toyllm.grading", "grade", "--impl", "exercises",
                           "--results", str(results)], cwd=ROOT, capture_output=True, text=True, timeout=560)
    return proc, json.loads(results.read_text()) if results.exists() else None


# --------------------------------------------------------------------------- the real exercises

@pytest.mark.slow
@pytest.mark.timeout(600)
def test_solutions_score_full_marks(solutions_graded):
    report, results = solutions_graded
    failed = [(t.name, t.output) for t in report.tests if t.status != "passed"]
    assert failed == []
    assert report.score == report.max_score == sum(stated_points().values()) + HIDDEN_POINTS
    assert results["score"] == results["max_score"] == report.max_score


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_each_exercise_is_worth_the_points_its_docstring_states(solutions_graded):
    report, _ = solutions_graded
    visible = GradeReport("solutions", [t for t in report.tests if not t.hidden])
    assert {ex: m for ex, (_, m) in visible.by_exercise().items()} == stated_points()
    assert set(visible.by_lesson()) == set(LESSONS)


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


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_grading_twice_gives_identical_results(solutions_graded):
    first, _ = solutions_graded
    again = grade("solutions", only="ex01")
    key = lambda r: [(t.name, t.nodeid, t.score, t.max_score, t.status, t.output) for t in r.tests]
    assert key(again) == key(GradeReport("solutions", [t for t in first.tests if t.lesson == 1 and not t.hidden]))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_extra_tests_are_picked_up_by_their_exercise_marker(solutions_graded):
    report, results = solutions_graded
    hidden = {t.name: t for t in report.tests if t.hidden}
    assert set(hidden) == {"Exercise 3.2: test_hidden_attention_intensity_of_a_short_prompt (hidden)",
                           "Exercise 1.1: test_hidden_greedy_on_a_one_hot_vector (hidden)"}
    assert all(t.status == "passed" for t in hidden.values())
    assert report.by_exercise()["3.2"] == (2 + 3, 2 + 3)
    shown = {t["name"]: t["visibility"] for t in results["tests"]}
    assert all(shown[name] == "after_published" for name in hidden)


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

@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_hanging_function_loses_only_its_test(tmp_path):
    report = grade(SUBMISSIONS / "hanging", only="ex03", per_test_timeout_s=8, results_path=tmp_path / "r.json")
    lost = {t.name: t for t in report.tests if t.status != "passed"}
    assert list(lost) == ["Exercise 3.2: test_ex3_2_prefill_is_half_the_prompt"]
    hung = lost["Exercise 3.2: test_ex3_2_prefill_is_half_the_prompt"]
    assert hung.status == "timeout" and hung.score == 0 and "Timeout" in hung.output
    assert report.score == report.max_score - hung.max_score


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_crashing_function_loses_only_the_rest_of_its_lesson(tmp_path):
    results = tmp_path / "results.json"
    report = grade(SUBMISSIONS / "crashing", only=["ex02", "ex03"], results_path=results)
    by_lesson = report.by_lesson()
    assert by_lesson[3] == (12, 12)                     # the other lesson keeps everything
    ex02 = [t for t in report.tests if t.lesson == 2]
    statuses = {ex: {t.status for t in ex02 if t.exercise == ex} for ex in ("2.1", "2.2", "2.3", "2.4")}
    assert statuses == {"2.1": {"passed"}, "2.2": {"crashed"}, "2.3": {"crashed"}, "2.4": {"crashed"}}
    assert by_lesson[2] == (6, 17)                      # 2.1 finished before the crash and keeps its points
    first_crash = next(t for t in ex02 if t.status == "crashed")
    assert "exited (code 3)" in first_crash.output
    written = json.loads(results.read_text())
    assert written["score"] == report.score == 18


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_partial_submission_gets_partial_credit():
    report = grade(SUBMISSIONS / "partial", only="ex01,ex03")
    assert {t.name for t in report.tests if t.status != "passed" and t.lesson == 1} == {
        "Exercise 1.2: test_ex1_2_never_samples_outside_the_top_p_set",    # top_p is ignored
        "Exercise 1.2: test_ex1_2_rejects_bad_arguments"}                   # ... and not checked
    assert report.by_lesson() == {1: (13, 15), 3: (0, 12)}
    missing = [t for t in report.tests if t.lesson == 3]
    assert all(t.status == "error" and "no file for exercise module 'ex03'" in t.output for t in missing)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_single_exercise_can_be_graded_on_its_own():
    report = grade(SUBMISSIONS / "partial", only="1.2")
    assert {t.exercise for t in report.tests} == {"1.2"}
    assert report.by_exercise()["1.2"] == (6, 8)        # 7 tests; the two top-p ones fail
    mixed = grade(SUBMISSIONS / "partial", only=["1.1", "ex01"])   # a whole lesson wins over one of its exercises
    assert {t.exercise for t in mixed.tests} == {"1.1", "1.2", "1.3"}
    with pytest.raises(ValueError, match="exercises like '1.2'"):
        grade("solutions", only="1.x")


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
    with pytest.raises(NotImplementedError, match=r"^Exercise 2\.2: implement kv_cache_bytes \(hint: "):
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
    with pytest.raises(ValueError, match="no file for exercise module 'ex07'"):
        load_exercise("ex07", impl="solutions")
    with pytest.raises(ValueError, match="must look like 'ex01'"):
        load_exercise("../ex01", impl="solutions")
    with pytest.raises(ValueError, match="no graded tests for lesson"):
        grade("solutions", only="ex09")
    with pytest.raises(ValueError, match="per_test_timeout_s"):
        grade("solutions", per_test_timeout_s=0)


# --------------------------------------------------------------------------- stubs

SOLUTION = '''\
def scale(x, factor=2):
    """Multiply x by factor.

    Shapes: x (N,), returns (N,).
    """
    # BEGIN SOLUTION 9.1 hint: one multiplication
    y = x * factor
    return y
    # END SOLUTION


class Box:
    def area(self):
        """Width times height, in square metres."""
        # BEGIN SOLUTION 9.2
        return self.w * self.h
        # END SOLUTION
'''


def test_make_stub_replaces_each_solution_and_keeps_the_rest():
    stub = make_stub(SOLUTION)
    assert "x * factor" not in stub and "BEGIN SOLUTION" not in stub and "END SOLUTION" not in stub
    assert 'def scale(x, factor=2):\n    """Multiply x by factor.\n\n    Shapes: x (N,), returns (N,).\n    """\n' \
           '    raise NotImplementedError("Exercise 9.1: implement scale (hint: one multiplication)")\n' in stub
    assert '        raise NotImplementedError("Exercise 9.2: implement area")\n' in stub
    namespace = {}
    exec(compile(stub, "stub", "exec"), namespace)
    with pytest.raises(NotImplementedError, match=r"^Exercise 9\.1: implement scale \(hint: one multiplication\)$"):
        namespace["scale"](3)


def test_make_stub_wraps_long_hints_into_valid_code():
    long_hint = "first do this, then that; " * 8
    source = f"def f():\n    # BEGIN SOLUTION 1.9 hint: {long_hint.strip()}\n    return 1\n    # END SOLUTION\n"
    stub = make_stub(source)
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
        make_stub(source)


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
        'raise NotImplementedError("Exercise 9.1: implement scale (hint: one multiplication)")', "return x * factor")
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
    report = grade(tmp_path, only="4.2")
    assert report.by_exercise()["4.2"] == (0, 4)
    assert all("calls toyllm's own tsp_layer" in t.output for t in report.tests), [t.output for t in report.tests]
    assert not list(tmp_path.rglob("__pycache__")), "the grader wrote bytecode beside the submission"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_wrong_step_fails_with_a_message_naming_the_run(tmp_path):
    source = (ROOT / "solutions" / "ex04_tsp.py").read_text()
    # a classic mistake: keys numbered from the rank's own offset instead of from 0
    wrong = source.replace("k_pos = torch.arange(k_all.shape[-2], device=x.device)",
                           "k_pos = torch.arange(k_all.shape[-2], device=x.device) + pos.start")
    assert wrong != source
    (tmp_path / "ex04_tsp.py").write_text(wrong)
    report = grade(tmp_path, only="4.2")
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


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_deadlocking_step_loses_its_points_and_leaves_no_process(tmp_path):
    import psutil

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
    report = grade(tmp_path, only="5.1")
    assert report.by_exercise()["5.1"] == (0, 4)
    assert all("kvr_layer_blocking in the engine" in t.output and "the run failed" in t.output
               for t in report.tests), [t.output[:200] for t in report.tests]
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before
