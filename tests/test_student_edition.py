"""The student edition: built by one command, free of answers, and the framework runs the student's code.

One edition is built per test run (``make student`` does the same; ``built_once``). Its
own tests run in a subprocess with the edition's ``toyllm`` first on the
path: once on the untouched stubs (tests that need an exercise are skipped
with its name), once with the model answers copied in (everything runs).
"""
from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from toyllm import answers
from toyllm.grading import edition
from toyllm.stubs import make_stub

ROOT = Path(__file__).resolve().parent.parent
SOLUTIONS = ROOT / "solutions"

# A few of the edition's own test files: the framework's answers, an engine lesson's graded tests, generation.
EDITION_TESTS = ["tests/test_analysis.py", "tests/test_partition.py", "tests/grading/test_ex05_kv_runahead.py",
                 "tests/grading/test_ex02_kv_cache.py"]


def solution_functions() -> dict[str, str]:
    """{"5.2": "kvr_layer"}: every exercise of solutions/ and its function."""
    out = {}
    for path in SOLUTIONS.glob("ex*.py"):
        for number, name in re.findall(r"Exercise (\d+\.\d+): implement (\w+)", make_stub(path.read_text())):
            out[number] = name
    return out


# --------------------------------------------------------------------------- the marks

def test_every_marked_answer_is_an_exercise_with_the_same_parameters():
    """... or the edition's stand-in for a shortcut (``student=``), which takes the shortcut's parameters."""
    functions = solution_functions()
    marks = answers.answer_marks()
    stand_ins = {m.student for m in answers.scan() if m.kind == "shortcut" and m.student}
    assert {"2.1", "4.2", "5.1", "5.2", "5.4", "6.1", "6.2", "6.3"} <= set(marks), sorted(marks)
    for number, mark in marks.items():
        assert functions.get(number) == mark.function, f"{mark.spec} is marked as Exercise {number}"
        module = __import__(mark.spec.partition(":")[0], fromlist=["_"])
        library = getattr(module, mark.spec.rpartition(":")[2])
        lesson = answers.lesson_module(number)
        solution = next(SOLUTIONS.glob(f"{lesson}_*.py"))
        node = next(n for n in ast.parse(solution.read_text()).body
                    if isinstance(n, ast.FunctionDef) and n.name == mark.function)
        assert library.__code__.co_argcount == len(node.args.args) or library.__name__ in stand_ins, \
            f"{mark.spec} and the exercise {mark.function} take different arguments"
    for mark in answers.scan():
        assert set(mark.exercises) <= set(functions), f"{mark.spec} names an exercise that does not exist"


def test_the_graded_tests_keep_no_forbidden_list_of_their_own():
    for path in (ROOT / "tests" / "grading").glob("*.py"):
        assert "FORBIDDEN" not in path.read_text(), f"{path.name} keeps a hand-made list"
    assert "toyllm.parallel.steps:kvr_layer" in answers.forbidden("5.2")
    assert "toyllm.parallel.steps:kvr_layer_blocking" in answers.forbidden("5.2")
    assert "toyllm.analysis:kv_cache_bytes" in answers.forbidden("2.2")
    assert "toyllm.simulate:CostModel.calibrate" in answers.forbidden("6.4")
    assert answers.forbidden("4.4") == []


def test_the_library_runs_the_model_answers_in_this_edition():
    from toyllm import analysis
    from toyllm.grading import load_exercise

    ex02 = load_exercise("ex02", impl="solutions")
    for args in [(40, 40, 128, 8192), (30, 3, 64, 1000, 4), (2, 1, 8, 3, 0.5, 3)]:
        assert analysis.kv_cache_bytes(*args) == ex02.kv_cache_bytes(*args)
    assert answers.written("5.2") and answers.EDITION == "instructor"


def test_an_edited_answer_runs_once_its_file_is_checked_again(tmp_path, monkeypatch):
    """exercise() keeps a found function and reads its file's stamp again at most every RECHECK_S
    seconds (the dense kernel asks on every layer of every step): an edit takes effect at the next check."""
    folder = tmp_path / "answers"
    folder.mkdir()
    shutil.copy(SOLUTIONS / "ex02_kv_cache.py", folder)
    monkeypatch.setenv("TOYLLM_ANSWERS", str(folder))
    first = answers.exercise("2.1")
    assert Path(first.__code__.co_filename).parent == folder
    with (folder / "ex02_kv_cache.py").open("a") as f:
        f.write("\n# edited: a new stamp\n")
    monkeypatch.setattr(answers, "RECHECK_S", 3600.0)
    assert answers.exercise("2.1") is first                     # checked moments ago: trusted
    monkeypatch.setattr(answers, "RECHECK_S", 0.0)
    again = answers.exercise("2.1")
    assert again is not first and Path(again.__code__.co_filename).parent == folder


# --------------------------------------------------------------------------- the proof

def test_a_copied_answer_is_found_even_with_names_changed(tmp_path):
    source = (SOLUTIONS / "ex05_kv_runahead.py").read_text()
    start = source.index("    prefix = chain.recv()")
    end = source.index("    # END SOLUTION", start)
    body = source[start:end]
    for old, new in [("prefix", "got"), ("q", "queries"), ("k", "keys"), ("v", "vals"), ("out", "o")]:
        body = re.sub(rf"\b{old}\b", new, body)           # every variable renamed, consistently
    (tmp_path / "copy.py").write_text("def my_step(layer, x, pos, chain, attention):\n"
                                      "    '''my own work'''\n" + body)
    found = edition.find_answers(tmp_path, edition.answer_texts(ROOT))
    # one hit per substantial line, each naming the first answer that holds it (4.2, 5.1 and 5.2 share lines)
    assert len(found) >= 4 and all(re.fullmatch(r"Exercise \d\.\d \(solutions/\S+\) in copy\.py:\d+", f) for f in found)
    assert "Exercise 5.1 (solutions/ex05_kv_runahead.py) in copy.py:6" in found, found


# One statement of Exercise 6.3's answer (``shares = [context * r / total for r in ratios]``), every name changed.
PLANTED = "portions = [n_tokens * w / whole for w in weights]"


def test_one_renamed_answer_statement_is_found_in_tests_and_in_a_notebook(tmp_path):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_mine.py").write_text(f"def test_it(n_tokens, weights, whole):\n    {PLANTED}\n")
    cells = [{"cell_type": "markdown", "source": ["shares"]},
             {"cell_type": "code", "source": ["%time x = 1\n", PLANTED + "\n"], "outputs": []},
             {"cell_type": "code", "source": ["print(text)"],
              "outputs": [{"output_type": "stream", "text": ["a line of prose\n", f"  {PLANTED}\n"]}]}]
    (tmp_path / "lesson.ipynb").write_text(json.dumps({"cells": cells}))
    found = edition.find_answers(tmp_path, edition.answer_texts(ROOT))
    label = "Exercise 6.3 (solutions/ex06_partition_search.py)"
    assert found == [f"{label} in lesson.ipynb#cell1:1", f"{label} in lesson.ipynb#output2:2",
                     f"{label} in tests/test_mine.py:2"], found


def test_statements_below_the_threshold_do_not_count(tmp_path):
    texts = edition.answer_texts(ROOT)
    # answer statements found everywhere: 6.3's ``chunks[i] += 1`` and ``return chunks``, a bare loop
    (tmp_path / "common.py").write_text("def f(chunks, i, ids):\n    chunks[i] += 1\n    i += 1\n"
                                        "    for t in range(i):\n        pass\n    return chunks\n")
    assert edition.find_answers(tmp_path, texts) == []
    sizes = [edition._size(ast.parse(t).body[0]) for t in ("return x", "i += 1", "x = a + b", "chain.send(k, v)")]
    assert max(sizes) < edition.SUBSTANTIAL_NODES <= edition._size(ast.parse(PLANTED).body[0])


def test_the_value_of_an_answer_line_is_found_as_a_return_or_after_prose(tmp_path):
    """``return <expr>`` holds the answer's ``x = <expr>`` (and a hint's "... when <expr>" too), names changed."""
    value = PLANTED.split(" = ", 1)[1]
    (tmp_path / "lib.py").write_text(f"def share(n_tokens, weights, whole):\n    return {value}\n")
    found = edition.find_answers(tmp_path, edition.answer_texts(ROOT))
    assert found == ["Exercise 6.3 (solutions/ex06_partition_search.py) in lib.py:2"], found
    index = edition.answer_index(edition.answer_texts(ROOT))
    assert any(edition.answer_statements_in(snippet, index)
               for snippet in edition._hint_snippets(f"each share is {value}"))


def test_every_shortcut_says_what_the_edition_holds_in_its_place():
    """A shortcut's body either becomes a call of the student's exercise (student=) or says why it ships."""
    shortcuts = [m for m in answers.scan() if m.kind == "shortcut"]
    assert len(shortcuts) > 30
    for mark in shortcuts:
        assert bool(mark.student) != bool(mark.ships), mark.spec
        assert not mark.ships or len(mark.ships.split()) >= 5, f"{mark.spec}: say why it ships, in words"
    for kwargs in ({}, {"student": "f", "ships": "because it is only a fused kernel call"}):
        with pytest.raises(ValueError, match="either student= .* or ships="):
            answers.shortcut("2.1", **kwargs)


def test_no_code_hint_is_an_answer_statement():
    assert edition.answers_in_hints(ROOT) == []
    # the check can fail: a hint that spells out one line of 6.3
    planted = edition._hint_snippets("first the keys; " + PLANTED.replace("portions", "share") + ", then round")
    index = edition.answer_index(edition.answer_texts(ROOT))
    assert any(edition.answer_statements_in(snippet, index) for snippet in planted)


@pytest.mark.slow
def test_only_tracked_files_ship(tmp_path):
    """Untracked files of an instructor's checkout (hidden tests, grades) are never part of the edition."""
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@example.com"]
    subprocess.run([*git, "init", "-q"], cwd=tmp_path, check=True)
    (tmp_path / "lesson.py").write_text("x = 1\n")
    (tmp_path / ".gitignore").write_text("*.log\n")
    subprocess.run([*git, "add", "lesson.py", ".gitignore"], cwd=tmp_path, check=True)
    subprocess.run([*git, "commit", "-q", "-m", "course"], cwd=tmp_path, check=True)
    for rel in ("hidden_tests/test_secret.py", "grades/alice.json", "run.log"):
        (tmp_path / rel).parent.mkdir(exist_ok=True)
        (tmp_path / rel).write_text("{}")
    tracked, untracked = edition._files(tmp_path)
    assert tracked == [".gitignore", "lesson.py"]
    assert untracked == ["grades/", "hidden_tests/"]
    line = edition._left_out(untracked)
    assert line.startswith("left out: solutions/, ") and "2 untracked files (grades/, hidden_tests/)" in line


def test_the_instructor_edition_is_not_answer_free():
    # the check can fail: this repository holds solutions/
    found = edition.find_answers(ROOT / "solutions", edition.answer_texts(ROOT))
    assert len(found) >= 25, found


# --------------------------------------------------------------------------- near-copies

# Exercise 9.1's answer rewritten: other names, torch.exp for .exp(), [..., None] for .unsqueeze(-1), the
# weights inlined and the guard for rows that saw nothing dropped. No statement of it is the answer's.
NEAR_MERGE = """
def combine(o1, l1, o2, l2):
    joint = torch.logaddexp(l1, l2)
    return (o1 * torch.exp(l1 - joint)[..., None] + o2 * torch.exp(l2 - joint)[..., None]).to(o1.dtype)
"""
# Exercise 5.2's order of messages, the compute replaced by sleeps.
NEAR_ORDER = """
def step(chain, k, tl):
    pending = chain.irecv()
    with tl.span("compute"):
        time.sleep(0.1)
    if pending is not None:
        pending.wait()
    chain.isend(k, k)
"""
# Not copies: the same operations for another purpose, and the argument checks the docstrings state.
UNLIKE = """
def softmax_of_stack(lses, outs):
    shares = torch.softmax(torch.stack(lses).float(), dim=0)
    return (shares[..., None] * torch.stack(outs)).sum(dim=0)

def checked(a, b):
    if len(a) != len(b):
        raise ValueError("one per entry")
    return [x * y for x, y in zip(a, b)]
"""


def test_a_near_copy_of_an_answer_is_found(tmp_path):
    (tmp_path / "lib.py").write_text("import time\nimport torch\n" + NEAR_MERGE + NEAR_ORDER + UNLIKE)
    steps = edition.answer_steps(ROOT)
    assert edition.find_answers(tmp_path, edition.answer_texts(ROOT)) == []     # no statement is an answer's
    found = edition.find_near_copies(tmp_path, steps)
    assert found == ["near-copy of Exercise 5.2 (solutions/ex05_kv_runahead.py): lib.py:8 step",
                     "near-copy of Exercise 9.1 (solutions/ex09_ring_attention.py): lib.py:4 combine"], found
    # the check can fail on the model answers themselves: every answer of more than a line is near itself
    own = edition.find_near_copies(ROOT / "solutions", steps)
    for number in ("4.2", "5.1", "5.2", "6.2", "6.3", "8.2", "9.1", "9.2", "9.3"):
        assert any(f"near-copy of Exercise {number} " in f for f in own), (number, own)


def test_the_near_copies_a_review_found_are_what_the_check_finds(tmp_path):
    """Before they were rewritten, four pieces of the edition did an answer's work its way; the check finds
    each of them (the library code as it was) and nothing else there."""
    before = {
        "toyllm/attention.py": NEAR_MERGE.replace("combine", "merge_partials") + """
def sees_any(q_pos, k_pos):
    return int(k_pos[0]) <= int(q_pos[-1])
""",
        "toyllm/parallel/ring.py": """
def ring_pass_q_layer(layer, x, pos, ring, attention):
    q, k, v = layer.qkv(x, pos.cos, pos.sin)
    held_k, held_v, held_pos = ring.held_kv()
    keys = torch.cat([held_k, k], dim=-2)
    values = torch.cat([held_v, v], dim=-2)
    k_pos = torch.cat([held_pos, pos.q_pos])
    queries, partials = q, {}
    last = ring.world_size - 1
    for step in range(last + 1):
        origin = ring.origin(step)
        travelling = None if step == last else ring.pass_on(step, queries)
        partials[origin] = ring.attend(queries, keys, values, pos.layout[origin], k_pos, attention)
        if travelling is not None:
            (queries,) = travelling.wait()
    parts = ring.return_partials(partials)
    acc = parts[0]
    for part in parts[1:]:
        acc = merge(acc, part)
    out, _ = acc
    return layer.finish(x, layer.project(out)), keys, values
""",
        "tests/test_link_timeline.py": NEAR_ORDER}
    for rel, text in before.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    found = edition.find_near_copies(tmp_path, edition.answer_steps(ROOT))
    assert [f.split(": ", 1)[1].rsplit(" ", 1)[1] for f in found] == \
        ["step", "merge_partials", "sees_any", "ring_pass_q_layer"], found


# --------------------------------------------------------------------------- the library's own tests

def test_a_library_test_that_reaches_an_exercise_fails_and_says_which(tmp_path, monkeypatch):
    """The guard behind the marker ``library``: every place where the two editions' libraries differ."""
    from toyllm import partition
    from toyllm.course import LIBRARY_TEST_ENV, RanAnExercise, load_exercise

    assert answers.exercise("1.2")                      # outside a library test: nothing happens
    log = tmp_path / "reached.txt"
    monkeypatch.setenv(LIBRARY_TEST_ENV, str(log))
    with pytest.raises(RanAnExercise, match="marked library, yet it ran Exercise 1.2"):
        answers.exercise("1.2")
    with pytest.raises(RanAnExercise, match="load_exercise"):
        load_exercise("ex03")
    with pytest.raises(RanAnExercise, match="partition_from_ratios, whose body in the student edition runs "
                                            "Exercise 6.3"):
        partition.partition_from_ratios(10, [1, 1])
    assert log.read_text().splitlines() == [
        "Exercise 1.2", "the exercise file ex03 (load_exercise)",
        "partition_from_ratios, whose body in the student edition runs Exercise 6.3"]
    assert partition.boundaries_from_chunks([4, 6]) == [0, 4, 10]      # library code with no exercise still runs


def test_the_library_mark_fails_a_file_whose_tests_reach_an_exercise(pytester):
    """tests/conftest.py fails the file (a swallowed error included) and refuses the mark on a single test."""
    pytester.makeconftest((ROOT / "tests" / "conftest.py").read_text())
    pytester.makeini("[pytest]\nmarkers =\n    library: the library alone\n")
    pytester.makepyfile(test_reaches="""
        import pytest
        from toyllm import answers
        pytestmark = pytest.mark.library

        def test_swallows_it():
            try:
                answers.exercise("2.1")
            except RuntimeError:
                pass
        """)
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(["*test_reaches.py is marked library, yet its tests reached: Exercise 2.1*"])
    pytester.makepyfile(test_reaches="""
        import pytest

        @pytest.mark.library
        def test_alone():
            pass
        """)
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    result.stderr.fnmatch_lines(["*is marked library on its own: mark the whole file*"])


def built_once(tmp_path_factory) -> Path:
    """This checkout's student edition (``make student``'s idea hints), built once per test run and only read.

    ``tests/test_stored_expected.py`` reads it too; under ``make test``'s two test processes the one that
    asks first builds it in the run's shared temporary folder, and the other waits for it.
    """
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):                 # each process's folder sits in the run's own
        base = base.parent
    out = base / "student-edition" / "toyllm-student"
    with FileLock(str(base / "student-edition.lock"), timeout=600):
        if not (out.parent / "built").exists():
            shutil.rmtree(out.parent, ignore_errors=True)     # what a build that failed left
            edition.build(out, hints="idea", root=ROOT)
            (out.parent / "built").touch()
    return out


@pytest.fixture(scope="module")
def student_edition(tmp_path_factory):
    return built_once(tmp_path_factory)


def test_the_searches_stand_ins_give_the_librarys_results():
    """Here the stand-ins run the model answers: the same partitions as toyllm's own code."""
    from toyllm import partition

    def bowl(target):
        return lambda chunks: sum((b - t) ** 2 for b, t in zip(partition.boundaries_from_chunks(chunks)[1:-1],
                                                                 target))

    for context, ratios in [(10, [1, 1, 1]), (10, [0.75, 0.15, 0.10]), (10, [1000, 1, 1]),
                            (10240, [0.35, 0.255, 0.21])]:
        assert partition._partition_by_exercise(context, ratios) == partition.partition_from_ratios(context, ratios)
    found = partition._grid_search_by_exercise(bowl([28, 70]), 96, 3)
    assert found.partition == partition.hierarchical_grid_search(bowl([28, 70]), 96, 3).partition
    assert found.evaluations == len(found.history) and found.history[0]["stride"] == 8
    assert partition._boundary_search_by_exercise(bowl([9728]), 16384).partition == [9728, 6656]


@pytest.mark.slow
def test_the_edition_holds_no_answer_and_no_instructor_file(student_edition):
    out = student_edition
    assert edition.find_answers(out, edition.answer_texts(ROOT)) == []
    assert edition.find_near_copies(out, edition.answer_steps(ROOT)) == []
    for gone in edition.INSTRUCTOR_ONLY:
        assert not (out / gone).exists() and not list(out.glob(gone + "*")), gone
    assert 'EDITION = "student"' in (out / "toyllm" / "answers.py").read_text()
    for path in (out / "exercises").glob("ex*.py"):
        text = path.read_text()
        assert "(idea: " in text and "(hint: " not in text, path.name
    makefile = (out / "Makefile").read_text()
    assert "TOYLLM_IMPL=solutions" not in makefile and "student:" not in makefile and "exercises:" not in makefile
    assert "autograder" not in makefile
    # make test leaves out the files marked library (the course's run proves they reach no exercise)
    assert re.search(r'^\tTOYLLM_FAST=1 \$\(PYTHON\) -m pytest tests -m "not library" ', makefile, re.M), makefile
    assert "student edition" in (out / "README.md").read_text()
    steps = (out / "toyllm" / "parallel" / "steps.py").read_text()
    assert "layer.qkv" not in steps and "chain.irecv" not in steps       # every step is an exercise's


@pytest.mark.slow
def test_every_test_of_the_edition_collects_there(student_edition):
    """A test module the edition ships may not lean on one it leaves out (a helper of the grader's tests)."""
    run = _in_edition(student_edition, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "tests",
                      timeout=300)
    assert run.returncode == 0 and " error" not in run.stdout, run.stdout[-3000:] + run.stderr[-2000:]


@pytest.mark.slow
def test_a_shortcut_with_a_stand_in_calls_it_in_the_edition(student_edition):
    marks = [m for m in answers.scan() if m.kind == "shortcut" and m.student]
    assert {m.spec.rpartition(":")[2] for m in marks} >= {"hierarchical_grid_search", "partition_from_ratios"}
    for mark in marks:
        rel = mark.path.relative_to(answers.PACKAGE_DIR.parent)
        tree = ast.parse((student_edition / rel).read_text())
        name = mark.spec.rpartition(":")[2]
        fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)
        body = fn.body[1:] if ast.get_docstring(fn) is not None else fn.body
        assert len(body) == 1 and ast.unparse(body[0]).startswith(f"return {mark.student}("), \
            f"{mark.spec} in the edition: {ast.unparse(fn)[:300]}"
    text = (student_edition / "toyllm" / "partition.py").read_text()
    assert "for off in offsets" not in text and "order = sorted(range(p)" not in text


def test_building_refuses_a_folder_that_is_not_empty(tmp_path):
    (tmp_path / "x").write_text("mine")
    with pytest.raises(ValueError, match="not an empty folder"):
        edition.build(tmp_path, root=ROOT)
    with pytest.raises(ValueError, match="hints"):
        edition.build(tmp_path / "new", hints="all", root=ROOT)


def _in_edition(folder: Path, *args, timeout=600) -> subprocess.CompletedProcess:
    """Run python with the edition's toyllm (not this checkout's) in the edition's folder."""
    env = {**os.environ, "PYTHONPATH": str(folder), "TOYLLM_FAST": "1"}
    for name in ("TOYLLM_IMPL", "TOYLLM_COURSE_DIR", "PYTEST_ADDOPTS"):
        env.pop(name, None)
    return subprocess.run([sys.executable, *args], cwd=folder, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_untouched_stubs_skip_with_the_exercise_and_commands_say_which(student_edition):
    out = student_edition
    which = _in_edition(out, "-c", "import toyllm; print(toyllm.__file__)")
    assert which.stdout.strip() == str(out / "toyllm" / "__init__.py"), which.stdout + which.stderr
    run = _in_edition(out, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *EDITION_TESTS)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert " failed" not in run.stdout and "skipped" in run.stdout, run.stdout[-2000:]
    assert "needs Exercise 5.2: write kvr_layer" in run.stdout, run.stdout[-3000:]
    assert "needs Exercise 2.2: write kv_cache_bytes" in run.stdout, run.stdout[-3000:]
    prefill = _in_edition(out, "-m", "toyllm", "prefill", "--model", "tiny", "--context", "64", "--method", "kvr",
                          "--world-size", "2", timeout=120)
    assert prefill.returncode == 2, prefill.stderr
    assert prefill.stderr.strip().splitlines()[-1] == \
        "error: KV-Runahead needs Exercise 5.2: write kvr_layer in exercises/ex05_kv_runahead.py", prefill.stderr
    search = _in_edition(out, "-c", "from toyllm.partition import hierarchical_grid_search as s; s(sum, 96, 3)",
                         timeout=120)
    assert search.stderr.strip().splitlines()[-1].endswith(
        "The partition search needs Exercise 6.2: write grid_search in exercises/ex06_partition_search.py"), \
        search.stderr


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_with_the_answers_filled_in_everything_runs_and_the_engine_runs_the_students_step(student_edition,
                                                                                          tmp_path):
    out = tmp_path / "filled"
    shutil.copytree(student_edition, out)
    for path in SOLUTIONS.glob("ex*.py"):
        shutil.copy(path, out / "exercises" / path.name)
    # the student's own KV-Runahead step leaves a trace of every call it gets
    trace = tmp_path / "calls.txt"
    step = out / "exercises" / "ex05_kv_runahead.py"
    step.write_text(step.read_text().replace(
        "    incoming = chain.irecv()\n",
        f"    open({str(trace)!r}, 'a').write('layer\\n')\n    incoming = chain.irecv()\n", 1))
    run = _in_edition(out, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *EDITION_TESTS)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    # skipped only: the tests of toyllm's own search steps (the edition's searches are the student's 6.1, 6.2)
    skipped = [line for line in run.stdout.splitlines() if line.startswith("SKIPPED")]
    assert all("toyllm's own search" in line for line in skipped), run.stdout[-2000:]
    assert "Exercise" not in run.stdout.split("passed")[-1], run.stdout[-2000:]
    trace.unlink(missing_ok=True)
    prefill = _in_edition(out, "-m", "toyllm", "prefill", "--model", "tiny", "--context", "64", "--method", "kvr",
                          "--world-size", "2", "--check", timeout=180)
    assert prefill.returncode == 0, prefill.stdout + prefill.stderr
    calls = trace.read_text().count("layer")
    per_run = 2 * _tiny_layers()                                   # 2 ranks x layers
    assert calls and calls % per_run == 0, f"{calls} calls of the student's step, expected runs of {per_run}"


def _tiny_layers() -> int:
    from toyllm.model import get_config

    return get_config("tiny").n_layers
