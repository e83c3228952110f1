"""The grading's environment variables, in one object: ``toyllm.grading.settings.Settings``."""
import ast
import dataclasses
import re
from pathlib import Path

import pytest

from toyllm import course
from toyllm.grading.settings import Settings

# The library alone: no exercise runs here (tests/conftest.py checks it), so the student edition leaves it out.
pytestmark = pytest.mark.library

GRADING = Path(__file__).resolve().parents[1] / "toyllm" / "grading"


def test_from_env_reads_what_to_env_writes():
    env = {"TOYLLM_GRADE_LESSON": "3", "TOYLLM_GRADE_EXERCISES": "", "TOYLLM_IMPL": "solutions", "HOME": "/root"}
    settings = Settings.from_env(env)
    assert (settings.lesson, settings.exercises, settings.impl, settings.log) == ("3", "", "solutions", None)
    assert settings.to_env() == {"TOYLLM_GRADE_LESSON": "3", "TOYLLM_GRADE_EXERCISES": "", "TOYLLM_IMPL": "solutions"}
    assert Settings.from_env(settings.to_env()) == settings
    assert Settings().to_env() == {}


def test_it_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        Settings().lesson = "3"


def test_course_names_its_own_variables():
    assert [Settings.variable(f) for f in ("course", "answers", "impl", "sandbox")] == \
        [course.COURSE_ENV, course.ANSWERS_ENV, course.IMPL_ENV, course.SANDBOX_ENV]


def test_every_field_is_documented_and_names_a_variable_of_its_own():
    names = [Settings.variable(f.name) for f in dataclasses.fields(Settings)]
    assert len(set(names)) == len(names) and all(re.fullmatch(r"TOYLLM_[A-Z_]+", n) for n in names)
    source = (GRADING / "settings.py").read_text()
    for f in dataclasses.fields(Settings):
        assert re.search(rf"    {f.name}: .*\n    \"\"\"``{Settings.variable(f.name)}``: ", source), f.name


def test_no_grading_module_names_a_variable_itself():
    """Every grading module reads and writes the variables through ``Settings``."""
    found = []
    for path in sorted(GRADING.rglob("*.py")):
        if path.name == "settings.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                    and re.fullmatch(r"TOYLLM_[A-Z_]+", node.value):
                found.append(f"{path.relative_to(GRADING)}: {node.value}")
            if isinstance(node, ast.alias) and node.name.endswith("_ENV"):
                found.append(f"{path.relative_to(GRADING)}: imports {node.name}")
    assert not found, found
