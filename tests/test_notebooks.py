"""The lesson notebooks: committed clean, and runnable from top to bottom.

Static checks (fast) on every notebook in ``notebooks/``:
- committed without outputs or execution counts;
- code cells never reach ``solutions`` (or ``exercises``) directly: exercise code
  comes only through ``toyllm.grading.load_exercise``, which honours TOYLLM_IMPL;
- every graded exercise of the lesson has its "### Exercise N.M — title"
  heading, followed by a cell that runs the grader for it, and no heading
  names an exercise the grader does not know;
- what the lesson builds on, the exercises its cells run (directly or through
  the framework) and without which it cannot run top to bottom, is said twice
  and alike: in its metadata (``metadata["toyllm"]["builds_on"]``) and in one
  sentence of its first cell ("This lesson builds on Exercises 4.2 and 5.2: ...");
  every number there is an exercise the grader knows.

Execution (slow): each notebook runs top to bottom in a fresh kernel of this
interpreter, in ``notebooks/``, with TOYLLM_FAST=1 (smaller experiments, no
skipped cells) and TOYLLM_IMPL=solutions (the model answers, so the exercise
cells pass), no cell may raise, every ``check("N.M")`` prints full marks
(so every exercise is graded there once, through ``check()``'s own
processes), and every verdict a cell prints follows from the runs it
prints (``tests/verdict_text.py``); each lesson that times things in its
own cells prints some, and lesson 01 runs beside processes spinning on every
core but one (on 2 cores, one). When the same pytest run also runs the browser test
(``tests/browser``, Chromium installed), that test already runs every
notebook top to bottom, in JupyterLab, with the same settings and the same
checks and more; running each one a second time here would only double the
suite's longest part, so this execution is then left to it.
A lesson that builds on an exercise still unwritten in the implementation the
run uses (the stubs of a student edition) is skipped before its kernel starts,
naming the exercises and the files to edit: it could only stop at the first
cell that needs one.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import time
from pathlib import Path

import pytest
from verdict_text import HOG_LESSONS, TIMING_LESSONS, check_problems, count_verdicts, cpu_hog, verdict_problems

from toyllm import answers

REPO_ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS_DIR = REPO_ROOT / "notebooks"
GRADING_DIR = REPO_ROOT / "tests" / "grading"
NOTEBOOKS = sorted(NOTEBOOKS_DIR.glob("*.ipynb"))
CELL_TIMEOUT_S = 300
KERNEL_NAME = "toyllm-notebook-test"
# The kernel checks the implementation this run names (make test: the model answers in the instructor edition,
# the student's exercises in the student edition).
RUN_ENV = {"TOYLLM_FAST": "1", "TOYLLM_IMPL": os.environ.get("TOYLLM_IMPL") or "exercises"}

HEADING = re.compile(r"^###\s+Exercise\s+(\d+\.\d+)\s+—\s+\S", re.MULTILINE)
# "This lesson builds on Exercise 1.2: ..." / "... on Exercises 2.2 and 2.3: ..." / "... on Exercises 4.2, 5.1 and 5.2: ..."
# (or "This lesson builds on none of your exercises: ...")
BUILDS_ON = re.compile(r"This lesson builds on (?:Exercises? (\d+\.\d+(?:(?:, | and )\d+\.\d+)*)|none of your exercises)"
                       r"(?=[:;,.])")
NUMBER = re.compile(r"\d+\.\d+")
DIRECT_IMPORT = re.compile(r"^\s*(?:from|import)\s+(?:solutions|exercises)\b|\bsolutions\b", re.MULTILINE)


def read(path: Path):
    import nbformat      # here, not at the top: its import (jsonschema's grammars) costs each collecting process ~1 s

    return nbformat.read(path, as_version=4)


def graded_exercises(lesson: int) -> set[str]:
    """Exercise ids the grader knows for a lesson, from the markers of its graded tests."""
    ids = set()
    for path in GRADING_DIR.glob(f"test_ex{lesson:02d}_*.py"):
        ids |= set(re.findall(r"""mark\.exercise\(\s*["'](\d+\.\d+)["']\s*\)""", path.read_text()))
    return ids


def builds_on(nb) -> list[str]:
    """The exercises a lesson runs and cannot run top to bottom without, from its metadata."""
    return list(nb.metadata.get("toyllm", {}).get("builds_on", []))


def number_key(number: str) -> tuple[int, int]:
    lesson, exercise = number.split(".")
    return int(lesson), int(exercise)


def and_list(items: list[str]) -> str:
    """["a"] -> "a"; ["a", "b", "c"] -> "a, b and c"."""
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"


def in_words(numbers: list[str]) -> str:
    """["4.2"] -> "Exercise 4.2"; ["2.2", "2.3", "3.1"] -> "Exercises 2.2, 2.3 and 3.1"."""
    return f"Exercise{'s' if len(numbers) > 1 else ''} {and_list(numbers)}"


def unwritten(numbers: list[str]) -> dict[str, Path]:
    """Those of ``numbers`` still a stub in the implementation this process names (TOYLLM_IMPL), with their files."""
    from toyllm.course import exercise_file, lesson_module, resolve_impl
    from toyllm.stubs import stub_exercises

    folder = resolve_impl()
    missing = {}
    for number in numbers:
        path = exercise_file(folder, lesson_module(number))
        if number in stub_exercises(path.read_text()):
            missing[number] = path
    return missing


def lesson_of(path: Path) -> int | None:
    m = re.match(r"(\d\d)_", path.name)
    return int(m.group(1)) if m else None


ids = [p.name for p in NOTEBOOKS]


def test_the_first_three_lessons_exist():
    names = {p.name for p in NOTEBOOKS}
    assert {"01_naive_generation.ipynb", "02_kv_cache.ipynb", "03_rooflines_and_memory.ipynb"} <= names


@pytest.mark.parametrize("path", NOTEBOOKS, ids=ids)
def test_committed_without_outputs(path):
    import nbformat

    nb = read(path)
    nbformat.validate(nb)
    dirty = [i for i, c in enumerate(nb.cells)
             if c.cell_type == "code" and (c.get("outputs") or c.get("execution_count") is not None)]
    assert not dirty, f"{path.name}: cells {dirty} have outputs or execution counts; strip them before committing"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=ids)
def test_no_direct_use_of_solutions_or_exercises(path):
    for i, cell in enumerate(read(path).cells):
        if cell.cell_type == "code":
            m = DIRECT_IMPORT.search(cell.source)
            assert m is None, (f"{path.name}, cell {i}: {m.group(0).strip()!r}; reach exercise code only "
                               f"through toyllm.grading.load_exercise (it honours TOYLLM_IMPL)")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=ids)
def test_exercise_headings_match_the_grader_and_are_graded(path):
    lesson = lesson_of(path)
    expected = graded_exercises(lesson) if lesson is not None else set()
    if not expected:
        pytest.skip(f"no graded exercises for {path.name} yet")
    cells = read(path).cells
    found = {}
    for i, cell in enumerate(cells):
        if cell.cell_type == "markdown":
            for ex in HEADING.findall(cell.source):
                found[ex] = i
    assert set(found) == expected, (f"{path.name}: exercise headings {sorted(found)} but the grader has "
                                    f"{sorted(expected)}")
    for ex, start in found.items():
        # the grader cell of ex: before the next exercise heading, it runs grade() or check() and names ex
        later = sorted(i for i in found.values() if i > start)
        end = later[0] if later else len(cells)
        graded = [c for c in cells[start:end]
                  if c.cell_type == "code" and ("grade(" in c.source or "check(" in c.source)
                  and f'"{ex}"' in c.source]
        assert graded, f"{path.name}: exercise {ex} has no cell that runs the grader for it"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=ids)
def test_builds_on_is_said_alike_in_metadata_and_first_cell(path):
    nb = read(path)
    listed = nb.metadata.get("toyllm", {}).get("builds_on")
    assert isinstance(listed, list) and all(isinstance(n, str) and NUMBER.fullmatch(n) for n in listed), (
        f"{path.name}: metadata toyllm.builds_on must list the exercises the lesson builds on, as strings "
        f"like \"4.2\"; got {listed!r}")
    assert listed == sorted(set(listed), key=number_key), f"{path.name}: builds_on {listed} is not in course order"
    first = nb.cells[0]
    assert first.cell_type == "markdown", f"{path.name}: the first cell is not markdown"
    said = BUILDS_ON.findall(first.source)
    assert len(said) == 1, (f"{path.name}: the first cell must say once 'This lesson builds on "
                            f"{in_words(listed) if listed else 'none of your exercises'}: ...', "
                            f"found {len(said)} such sentences")
    assert NUMBER.findall(said[0]) == listed, (f"{path.name}: the first cell says it builds on "
                                               f"{NUMBER.findall(said[0])}, the metadata says {listed}")
    from toyllm.answers import answer_marks

    known = set(answer_marks())
    for lesson in {int(n.split(".")[0]) for n in listed}:
        known |= graded_exercises(lesson)
    unknown = [n for n in listed if n not in known]
    assert not unknown, f"{path.name}: builds on {unknown}, which no grader or framework mark knows"


def test_a_check_that_loses_points_or_prints_none_is_a_problem():
    """What the execution below reads back from every cell that calls check()."""
    from toyllm.grading.grader.report import format_points

    def points(ex, got, most):           # the line check() ends with
        return f"Exercise {ex}: {format_points(got)} / {format_points(most)} points"

    source = 'check("2.1")\ncheck("2.3")   # grades just this exercise'
    full = f"  ok   test_ex2_1_matches (4 point(s))\n{points('2.1', 4, 4)}\n{points('2.3', 2.5, 2.5)}\n"
    assert check_problems(source, full) == []
    assert check_problems(source, full.replace(points("2.3", 2.5, 2.5), points("2.3", 1.5, 2.5))) == [
        "check('2.3') gave 1.5 of 2.5 points"]
    assert check_problems(source, full.split(points("2.3", 2.5, 2.5))[0]) == ["check('2.3') printed no points"]
    assert check_problems(source, points("2.1", 0, 0) + "\n" + points("2.3", 2.5, 2.5)) == [
        "check('2.1') gave 0 of 0 points"]
    assert check_problems("print(1)", points("2.1", 0, 4)) == []          # only the cell's own checks count


# --------------------------------------------------------------------------- execution

def _browser_runs(session, path: Path) -> bool:
    """Will the browser test of this session run ``path``? (collected, selenium installed, Chromium present)"""
    import importlib.util

    if importlib.util.find_spec("selenium") is None:
        return False
    if not (Path("/usr/bin/chromium").exists() and Path("/usr/bin/chromedriver").exists()):
        return False
    return any(item.get_closest_marker("browser") is not None and path.stem in item.nodeid for item in session.items)


@pytest.fixture(scope="module")
def kernel_spec_manager(tmp_path_factory):
    """A kernelspec that starts ipykernel with *this* interpreter (the venv's), whatever else is installed."""
    from jupyter_client.kernelspec import KernelSpecManager

    root = tmp_path_factory.mktemp("kernels")
    spec_dir = root / KERNEL_NAME
    spec_dir.mkdir()
    (spec_dir / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "toyllm notebook tests", "language": "python", "env": RUN_ENV}))
    return KernelSpecManager(kernel_dirs=[str(root)])


@pytest.mark.slow
@pytest.mark.notebook
@pytest.mark.timeout(900)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=ids)
def test_notebook_runs_top_to_bottom(path, kernel_spec_manager, monkeypatch, request):
    from jupyter_client.manager import KernelManager
    from nbclient import NotebookClient

    if _browser_runs(request.session, path):
        pytest.skip(f"{path.name} runs top to bottom in JupyterLab in this session (tests/browser)")

    for key, value in RUN_ENV.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("MPLBACKEND", raising=False)          # let the kernel use its inline backend
    nb = read(path)
    with monkeypatch.context() as m:
        m.chdir(NOTEBOOKS_DIR)                                # where the kernel resolves TOYLLM_IMPL
        missing = unwritten(builds_on(nb))
    if missing:                                               # it would stop at the first cell that needs one
        files = sorted({f"{p.parent.name}/{p.name}" for p in missing.values()})
        pytest.skip(f"{path.name} builds on {in_words(sorted(missing, key=number_key))}, not written yet: "
                    f"write {'it' if len(missing) == 1 else 'them'} in {and_list(files)}")
    km = KernelManager(kernel_name=KERNEL_NAME, kernel_spec_manager=kernel_spec_manager)
    client = NotebookClient(nb, km=km, timeout=CELL_TIMEOUT_S, allow_errors=False,
                            resources={"metadata": {"path": str(NOTEBOOKS_DIR)}})
    start = time.perf_counter()
    times = path.stem in TIMING_LESSONS                       # its cells time things and print verdicts
    # ... lesson 01 beside a CPU hog, in the course. How the verdicts stand a busy machine is toyllm.measure's, the
    # same file in the student edition, whose run reads them without the hog (docs/testing.md, "The student
    # edition's filled run").
    busy = path.stem in HOG_LESSONS and answers.EDITION != "student"
    with cpu_hog() if busy else contextlib.nullcontext():
        client.execute()                                      # raises CellExecutionError on the first failing cell
    print(f"{path.name}: ran in {time.perf_counter() - start:.1f} s (TOYLLM_FAST=1)"
          f"{' beside a CPU hog' if busy else ''}")
    code_cells = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.execution_count is not None for c in code_cells), "some code cells were not executed"
    errors = [o for c in code_cells for o in c.outputs if o.output_type == "error"]
    assert not errors, f"{path.name}: {[(e.ename, e.evalue) for e in errors]}"
    printed = "\n".join(o.get("text", "") for c in code_cells for o in c.outputs if o.output_type == "stream")
    assert not verdict_problems(printed), f"{path.name}: {verdict_problems(printed)}"
    assert count_verdicts(printed) or not times, f"{path.name} printed no verdict to check"
    checks = [problem for c in code_cells for problem in check_problems(
        c.source, "".join(o.get("text", "") for o in c.outputs if o.output_type == "stream"))]
    assert not checks, f"{path.name}: {checks}"


@pytest.mark.slow
@pytest.mark.notebook
@pytest.mark.timeout(300)
def test_parallel_prefill_runs_from_a_jupyter_kernel(kernel_spec_manager):
    """Inside a kernel ``__main__`` is not a file: spawn must still start workers, and a failing rank must
    surface in the cell with its traceback rather than hang the kernel."""
    import nbformat
    from jupyter_client.manager import KernelManager
    from nbclient import NotebookClient

    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell(
            "import torch\n"
            "from toyllm.parallel import ModelSpec, parallel_prefill, single_prefill\n"
            "ids = list(range(3, 40))\n"
            "spec = ModelSpec('tiny')\n"
            "ref, _ = single_prefill(spec.build(), ids)\n"
            "kvr = parallel_prefill(spec, ids, 'kvr', 2, [25, 12], timeout_s=120)\n"
            "diff = (kvr.logits - ref).abs().max().item()\n"
            "assert diff < 1e-4, diff\n"
            "print('kvr ok', kvr.first_token, diff)"),
        nbformat.v4.new_code_cell(
            "from toyllm.launch import WorkerError\n"
            f"failing = {str(REPO_ROOT / 'tests' / 'workers_for_tests.py')!r} + ':failing_step'\n"
            "try:\n"
            "    parallel_prefill(spec, ids, 'kvr', 2, step=failing, timeout_s=120)\n"
            "except WorkerError as err:\n"
            "    assert 'Traceback' in err.traceback and 'rank 1 gives up' in str(err), str(err)\n"
            "    print('failure reported')\n"
            "else:\n"
            "    raise AssertionError('the failing rank went unnoticed')"),
    ])
    km = KernelManager(kernel_name=KERNEL_NAME, kernel_spec_manager=kernel_spec_manager)
    NotebookClient(nb, km=km, timeout=240, allow_errors=False,
                   resources={"metadata": {"path": str(NOTEBOOKS_DIR)}}).execute()
    printed = ["".join(o.get("text", "") for o in c.outputs) for c in nb.cells]
    assert printed[0].startswith("kvr ok") and printed[1].strip() == "failure reported", printed
