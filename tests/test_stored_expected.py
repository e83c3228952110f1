"""The student edition's graded tests compare with stored values, never with a function that answers the exercise.

The run's one edition is read here (the build records the values; ``built_once``). Its
graded tests of lessons 02, 05 and 08 then run in a subprocess with the
edition's ``toyllm`` first on the path: with the model answers copied in
they pass, on the stubs they skip with the exercise's name, and a case the
edition did not store fails and says why.
"""
from __future__ import annotations

import ast
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from toyllm import build_model
from toyllm.grading import references
from toyllm.grading.settings import Settings

from test_student_edition import built_once

ROOT = Path(__file__).resolve().parent.parent
GRADED = ["tests/grading/test_ex02_kv_cache.py", "tests/grading/test_ex05_kv_runahead.py",
          "tests/grading/test_ex08_serving.py"]


def marked_references(path: Path) -> dict[str, ast.FunctionDef]:
    tree = ast.parse(path.read_text())
    return {fn.name: fn for fn in references._reference_functions(tree)}


def _in_edition(folder: Path, *args, seed: str | None = None) -> subprocess.CompletedProcess:
    """pytest on the edition's graded tests, with its toyllm; the engine's runs left out (they store nothing)."""
    env = {**os.environ, "PYTHONPATH": str(folder), "TOYLLM_FAST": "1"}
    for name in ("TOYLLM_IMPL", "TOYLLM_COURSE_DIR", "PYTEST_ADDOPTS", "TOYLLM_GRADE_SEED", Settings.variable("record")):
        env.pop(name, None)
    if seed is not None:
        env["TOYLLM_GRADE_SEED"] = seed
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                           "-p", "toyllm.grading.references", *args], cwd=folder, env=env, capture_output=True,
                          text=True, timeout=300)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return built_once(tmp_path_factory)                       # the edition tests/test_student_edition.py reads


@pytest.fixture(scope="module")
def filled(built, tmp_path_factory):
    """The edition with the model answers copied into exercises/."""
    out = tmp_path_factory.mktemp("stored-filled") / "toyllm-student"
    shutil.copytree(built, out)
    for path in (ROOT / "solutions").glob("ex*.py"):
        shutil.copy(path, out / "exercises" / path.name)
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_no_reference_body_survives_and_the_values_are_stored(built):
    lessons = 0
    for path in sorted((ROOT / "tests" / "grading").glob("test_ex*.py")):
        ours = marked_references(path)
        if not ours:
            continue
        lessons += 1
        lesson = references.lesson_of(path)
        theirs = marked_references(built / path.relative_to(ROOT))
        assert sorted(theirs) == sorted(ours), path.name
        for name, fn in theirs.items():
            assert ast.unparse(fn.body) == f"return stored({lesson!r}, {name!r}, locals())", \
                f"{path.name}: {name} keeps its body in the student edition"
        table = torch.load(built / references.EXPECTED_DIR / f"{lesson}.pt", weights_only=True)
        assert {key.partition(":")[0] for key in table} <= set(ours) and table, path.name
    assert lessons >= 8
    assert "2.0 * (sum(chunks) - c)" not in (built / "tests/grading/test_ex04_tsp.py").read_text()
    assert not (built / "tests" / "test_stored_expected.py").exists()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_graded_tests_pass_on_the_answers_and_skip_on_the_stubs(built, filled):
    run = _in_edition(filled, *GRADED)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert " skipped" not in run.stdout and " failed" not in run.stdout, run.stdout[-2000:]
    stubs = _in_edition(built, *GRADED)
    assert stubs.returncode == 0, stubs.stdout[-3000:] + stubs.stderr[-2000:]
    assert " failed" not in stubs.stdout and "needs Exercise 2.2: write kv_cache_bytes" in stubs.stdout, \
        stubs.stdout[-3000:]
    assert "needs Exercise 8.3" in stubs.stdout and "needs Exercise 5.3" in stubs.stdout, stubs.stdout[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_case_the_edition_did_not_store_fails_and_says_why(filled):
    run = _in_edition(filled, GRADED[1], "-k", "ex5_3_other", seed="7")
    assert run.returncode == 1, run.stdout[-3000:]
    assert "no stored expected value for this case of reference_counts" in run.stdout, run.stdout[-3000:]
    assert "TOYLLM_GRADE_SEED=" in run.stdout and "the instructor's grader checks the others" in run.stdout


def doubled(chunks):
    return [c * 2 for c in chunks]


def test_this_edition_computes_every_reference_live(monkeypatch):
    monkeypatch.delenv(Settings.variable("record"), raising=False)
    assert references.reference(doubled) is doubled

    def nested(chunks):
        return chunks

    with pytest.raises(ValueError, match="module-level functions"):
        references.reference(nested)


def test_argument_keys_follow_the_values_exactly():
    key = references.argument_key
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    assert key(t) == key(t.clone()) == key(t.t().contiguous().t().contiguous())
    assert key(t) != key(t.double()) and key(t) != key(t.reshape(3, 2)) and key(0.1) != key(math.nextafter(0.1, 1.0))
    assert key({"a": 1, "b": [2, 3.0]}) == key({"b": [2, 3.0], "a": 1}) != key({"a": 1, "b": [2, 3]})
    assert key(build_model("tiny", seed=0)) == key(build_model("tiny", seed=0)) != key(build_model("tiny", seed=1))
    with pytest.raises(TypeError, match="has no canonical form"):
        key(object())


def test_the_builder_keeps_the_signature_and_replaces_only_the_bodies():
    source = '''"""Graded tests of lesson 09."""
from toyllm.grading.references import (
    reference,
)
from toyllm.grading.expect import equal


@reference
def twice(chunks, scale=2):
    """The answer, written out."""
    total = 0
    for c in chunks:
        total += scale * c
    return total


def helper(x):
    return x + 1
'''
    out = references.without_reference_bodies(source, "ex09")
    assert '"""The answer, written out."""' not in out and "total" not in out
    assert "def twice(chunks, scale=2):\n    return stored('ex09', 'twice', locals())\n" in out
    assert ")\nfrom toyllm.grading.references import stored\nfrom toyllm.grading.expect import equal\n" in out
    assert "def helper(x):\n    return x + 1\n" in out
    with pytest.raises(ValueError, match="imported from toyllm.grading.references"):
        references.without_reference_bodies(source.replace("reference,", "other,").replace(
            "from toyllm.grading.references import", "from somewhere import"), "ex09")
