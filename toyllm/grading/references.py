"""Expected values of the graded tests: computed here, stored in the student edition.

A graded test's expected value that is an exercise's answer (the counts of
5.3, the greedy tokens of 1.3, the bytes of 2.2) is computed by a function
of the test file marked ``@reference``, from the test's inputs only::

    @reference
    def reference_counts(chunks):
        ...

In this edition the mark changes nothing: the grader computes every
expected value live, so the cases it draws from a fresh seed are checked
too. The student edition must not hand out these functions, which would
answer the exercises. Its builder (``write_expected_values``) runs the
visible graded tests once against the model answers, with the student
edition's seed (``EDITION_SEED``) and ``$TOYLLM_RECORD_EXPECTED`` set, so
that every reference stores what it returned under its name and a digest of
its arguments (``argument_key``) in ``tests/grading/expected/exNN.pt``. Then
it replaces each reference's body by a lookup,
``return stored("ex05", "reference_counts", locals())``. A case that is not
in the table (another seed, an edited test) fails and says why.
"""
from __future__ import annotations

import ast
import atexit
import dataclasses
import functools
import hashlib
import inspect
import io
import os
import re
import subprocess
import sys
import types
from fractions import Fraction
from pathlib import Path

import numpy as np
import torch

from ..course import course_root
from .settings import Settings

EDITION_SEED = 2024                        # the student edition's seed: the drawn cases it stores values for
EXPECTED_DIR = Path("tests") / "grading" / "expected"
_TEST_FILE = re.compile(r"test_(ex\d\d)_\w+\.py$")


# --------------------------------------------------------------------------- the key of a case

def _feed(h, obj) -> None:
    """Write a canonical serialisation of ``obj`` into the hash ``h``: equal values, equal bytes."""
    def put(*parts):
        h.update(("\x1f".join(map(str, parts)) + "\x1e").encode())

    if obj is None or isinstance(obj, (bool, int, str, Fraction)):
        put(type(obj).__name__, repr(obj))
    elif isinstance(obj, float):
        put("float", obj.hex())                                   # exact: every bit of the value
    elif isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        put("tensor", t.dtype, tuple(t.shape))
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(obj, np.ndarray):
        put("ndarray", obj.dtype.str, obj.shape)
        h.update(np.ascontiguousarray(obj).tobytes())
    elif isinstance(obj, torch.nn.Module):                       # a model: its class, config, kernel and weights
        put("module", type(obj).__qualname__)
        _feed(h, getattr(obj, "config", None))
        _feed(h, getattr(obj, "attention", None))
        _feed(h, dict(obj.state_dict()))
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        put("dataclass", type(obj).__module__, type(obj).__qualname__)
        for field in dataclasses.fields(obj):
            put(field.name)
            _feed(h, getattr(obj, field.name))
    elif isinstance(obj, (list, tuple)):
        put(type(obj).__name__, len(obj))
        for item in obj:
            _feed(h, item)
    elif isinstance(obj, dict):
        put("dict", len(obj))
        for k, v in sorted(obj.items(), key=lambda kv: argument_key(kv[0])):
            _feed(h, k)
            _feed(h, v)
    elif isinstance(obj, (set, frozenset)):
        put("set", len(obj))
        for digest in sorted(argument_key(item) for item in obj):
            put(digest)
    elif isinstance(obj, functools.partial):
        put("partial")
        _feed(h, obj.func)
        _feed(h, obj.args)
        _feed(h, obj.keywords)
    elif isinstance(obj, (types.FunctionType, types.BuiltinFunctionType, type)):
        put("function", obj.__module__, obj.__qualname__)
    else:
        raise TypeError(f"a reference's argument of type {type(obj).__qualname__} has no canonical form: pass "
                        "numbers, strings, tensors, arrays, lists, tuples, dicts, sets, dataclasses, models, "
                        "module-level functions or partials of them")


def argument_key(obj) -> str:
    """The sha256 (hex) of ``obj``'s canonical serialisation: tensors by dtype, shape and bytes, models by
    their config, kernel and weights, floats by every bit, containers and dataclasses by their contents."""
    h = hashlib.sha256()
    _feed(h, obj)
    return h.hexdigest()


def lesson_of(path) -> str:
    """"ex05" for tests/grading/test_ex05_*.py, where the lesson's references are written."""
    m = _TEST_FILE.search(str(path))
    if not m:
        raise ValueError(f"@reference marks functions of tests/grading/test_exNN_*.py, not of {path}")
    return m[1]


# --------------------------------------------------------------------------- recording (the builder's run)

_RECORDED: dict[str, dict[str, object]] = {}        # lesson -> {"name:key": value}


@functools.cache
def _save_at_exit(folder: Path) -> None:
    """Write the recorded tables to ``folder`` (one file per lesson) when the test run ends."""
    def save():
        folder.mkdir(parents=True, exist_ok=True)
        for lesson, table in _RECORDED.items():
            torch.save(table, folder / f"{lesson}.pt")
    atexit.register(save)


def reference(fn):
    """Mark ``fn`` as computing an exercise's expected value from a test's inputs (never the submission's output).

    Unchanged in this edition; with ``$TOYLLM_RECORD_EXPECTED`` set, each value it returns is also stored
    for the student edition, which keeps the values instead of the function.
    """
    if fn.__qualname__ != fn.__name__:
        raise ValueError(f"@reference marks module-level functions of a graded test file, not {fn.__qualname__}")
    folder = Settings.from_env(os.environ).record
    if not folder:
        return fn
    lesson, signature = lesson_of(fn.__code__.co_filename), inspect.signature(fn)
    _save_at_exit(Path(folder))

    @functools.wraps(fn)
    def recording(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        key = f"{fn.__qualname__}:{argument_key(dict(bound.arguments))}"   # as locals() holds them on entry
        value = fn(*args, **kwargs)
        buffer = io.BytesIO()
        try:
            torch.save(value, buffer)
            buffer.seek(0)
            torch.load(buffer, weights_only=True)
        except Exception as e:
            raise TypeError(f"{fn.__qualname__} returned a {type(value).__qualname__}, which cannot be stored "
                            f"(use numbers, lists, tuples, dicts, sets and tensors): {e}") from None
        table = _RECORDED.setdefault(lesson, {})
        if key in table and argument_key(table[key]) != argument_key(value):
            raise ValueError(f"{fn.__qualname__} returned two different values for the same arguments: its "
                             "value must follow from its arguments alone to be stored")
        table[key] = value
        return value

    return recording


def pytest_collection_modifyitems(config, items):
    """In the recording run (``-p toyllm.grading.references``), leave out the tests that run the parallel engine.

    They compare with the one-process forward pass, which every edition
    computes itself, and would add a minute of process starts to the build.
    """
    engine = [item for item in items if "engine_run" in getattr(item, "fixturenames", ())]
    if engine:
        config.hook.pytest_deselected(items=engine)
        items[:] = [item for item in items if item not in engine]


# --------------------------------------------------------------------------- looking up (the student edition)

_TABLES: dict[str, dict] = {}


class NotStored(AssertionError):
    """The student edition has no stored value for a reference's arguments: the test fails with this message."""


def stored(lesson: str, name: str, arguments: dict):
    """The value reference ``name`` of lesson ``lesson`` returned for ``arguments``, from the stored table."""
    if lesson not in _TABLES:
        path = course_root() / EXPECTED_DIR / f"{lesson}.pt"
        if not path.is_file():
            raise NotStored(f"no stored expected values for lesson {lesson}: {path} is missing")
        _TABLES[lesson] = torch.load(path, weights_only=True)
    key = f"{name}:{argument_key(dict(arguments))}"
    if key not in _TABLES[lesson]:
        seed = (Settings.from_env(os.environ).seed or "").strip()
        raise NotStored(f"no stored expected value for this case of {name}: this edition stores the visible "
                        f"cases (drawn ones with {Settings.variable('seed')}={EDITION_SEED}"
                        f"{f', not {seed}' if seed and seed != str(EDITION_SEED) else ''}); "
                        "the instructor's grader checks the others")
    return _TABLES[lesson][key]


# --------------------------------------------------------------------------- the builder's step

def _reference_functions(tree: ast.Module) -> list[ast.FunctionDef]:
    def marked(d):
        return (isinstance(d, ast.Name) and d.id == "reference") or \
            (isinstance(d, ast.Attribute) and d.attr == "reference")
    return [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and any(marked(d) for d in n.decorator_list)]


def without_reference_bodies(source: str, lesson: str) -> str:
    """``source`` of a graded test file with every ``@reference`` function's body replaced by a lookup."""
    tree = ast.parse(source)
    functions = _reference_functions(tree)
    if not functions:
        return source
    imports = [n for n in tree.body if isinstance(n, ast.ImportFrom) and n.module == __name__]
    if not imports:
        raise ValueError(f"test_{lesson}: a reference is marked with @reference, imported from {__name__}")
    lines = source.splitlines(keepends=True)
    edits = [(fn.body[0].lineno, fn.end_lineno,
              f"{' ' * fn.body[0].col_offset}return stored({lesson!r}, {fn.name!r}, locals())\n") for fn in functions]
    edits.append((imports[0].end_lineno + 1, imports[0].end_lineno, f"from {__name__} import stored\n"))
    for first, last, text in sorted(edits, reverse=True):           # bottom up: the line numbers above hold
        lines[first - 1:last] = [text]
    return "".join(lines)


def write_expected_values(out: Path, root: Path, timeout_s: float = 600) -> list[str]:
    """Store the expected values of the graded tests of edition ``out`` and take the references' bodies out.

    Runs ``root``'s copies of those tests that use a reference against the
    model answers, with the edition's seed, recording into
    ``out/tests/grading/expected/``; returns the tables written (paths
    relative to ``out``). Raises ValueError when the model answers fail a
    test, since its values would be wrong.
    """
    tests = [path.relative_to(out) for path in sorted((out / "tests" / "grading").glob("test_ex*.py"))
             if _reference_functions(ast.parse(path.read_text()))]
    folder = out / EXPECTED_DIR
    env = {**os.environ, **Settings(record=str(folder), impl="solutions", seed=str(EDITION_SEED), course=str(root),
                                    fast="1").to_env()}
    env.pop("PYTEST_ADDOPTS", None)
    if tests:
        try:
            run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                  "-p", "toyllm.grading.references", *map(str, tests)],
                                 cwd=root, env=env, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise ValueError(f"recording the graded tests' expected values took over {timeout_s:g} s") from None
        if run.returncode != 0:
            raise ValueError("recording the graded tests' expected values: the model answers fail them:\n"
                             + run.stdout[-3000:] + run.stderr[-2000:])
    for path in tests:
        (out / path).write_text(without_reference_bodies((out / path).read_text(), lesson_of(path)))
    return sorted(str(p.relative_to(out)) for p in folder.glob("*.pt"))
