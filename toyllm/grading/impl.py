"""Which implementation runs: the learner's exercises, the model answers, or a submitted folder.

Every lesson's exercises exist twice with the same signatures:
``exercises/exNN_*.py`` (stubs the learner fills in) and
``solutions/exNN_*.py`` (model answers). ``load_exercise("ex01")`` returns
the module of the implementation chosen by the ``TOYLLM_IMPL`` environment
variable: ``exercises`` (the default), ``solutions``, or the path of a
folder holding a student's ``exNN_*.py`` files. Notebooks and graded tests
reach exercise code *only* through ``load_exercise``; in pytest, ``--impl``
overrides the variable.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

from .course import DEFAULT_IMPL, IMPL_ENV, NAMED_IMPLS, exercise_file, current_impl, resolve_impl  # noqa: F401

_loaded: dict[Path, tuple[tuple[int, int], ModuleType]] = {}


def load_exercise(name: str, impl: str | os.PathLike | None = None) -> ModuleType:
    """The module ``name`` ("ex01" or "ex01_naive_generation") of the chosen implementation.

    impl: "exercises", "solutions" or a folder; by default ``$TOYLLM_IMPL``
    (``exercises`` when unset). This is THE way notebooks and tests reach
    exercise code, so that one switch decides whose code runs.

    The file is imported from its path (no change to ``sys.path``) under a
    private module name. While the grader runs, the current implementation
    is never imported into the grader's process: you get a proxy whose
    functions run in the sandbox (``toyllm.grading.sandbox``). A file
    edited since its last load is loaded again, so re-running a notebook
    cell picks up your latest code.
    """
    if impl is None and os.environ.get("TOYLLM_GRADE_SANDBOX") == "1":
        # Inside the grader: the submission runs in the sandbox process, never here (see sandbox.py).
        from .sandbox import remote_module

        return remote_module(name)
    path = exercise_file(resolve_impl(impl), name)
    stat = path.stat()
    stamp = (stat.st_mtime_ns, stat.st_size)
    cached = _loaded.get(path)
    if cached is not None and cached[0] == stamp:
        return cached[1]
    # one module name per folder, so a student's ex01 and the model answers' ex01 never collide
    folder_tag = hashlib.sha1(str(path.parent).encode()).hexdigest()[:8]
    module_name = f"_toyllm_{folder_tag}_{path.stem}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module       # what the import system does too (dataclasses, pickling need it)
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(module_name, None)
        raise
    _loaded[path] = (stamp, module)
    return module


