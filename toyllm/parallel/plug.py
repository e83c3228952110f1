"""Plugging a step into the engine: naming a per-layer step so that every worker process can import it.

Worker processes are started fresh (spawn), so a step travels by name, not
by value: ``step_reference`` turns a function into such a name (checking in
the calling process that it resolves) and ``resolve_step`` turns it back.
"""
from __future__ import annotations

import functools
import importlib
import importlib.machinery
import importlib.util
from pathlib import Path
from typing import Callable


def step_reference(step: str | Callable | None) -> str | None:
    """A step as a string every process can import: "package.module:function" or "path/file.py:function".

    Worker processes are started fresh (spawn), so a step travels by name,
    not by value; this checks in the calling process that the name resolves.
    """
    if step is None:
        return None
    if isinstance(step, str):
        ref = step
    elif callable(step) and getattr(step, "__name__", "<lambda>") != "<lambda>" and "<locals>" not in step.__qualname__:
        ref = f"{step.__module__}:{step.__qualname__}"
        # A new process finds the module only if it is on the path (not just registered in
        # sys.modules, as a module loaded from a file is).
        importable = importlib.machinery.PathFinder.find_spec(step.__module__.partition(".")[0]) is not None
        try:
            same = importable and resolve_step(ref) is step
        except (ImportError, AttributeError, ValueError):
            same = False
        if not same:   # e.g. a module loaded from a file: point at the file instead
            source = getattr(getattr(step, "__code__", None), "co_filename", "")
            if not source.endswith(".py") or not Path(source).is_file():
                raise ValueError(f"step {step!r} cannot be found by a new process; define it at the top level "
                                 "of a .py file")
            ref = f"{Path(source).resolve()}:{step.__qualname__}"
    else:
        raise ValueError(f"step must be a function defined at the top level of a .py file or a "
                         f"'module:function' string, got {step!r}")
    resolve_step(ref)   # fail here, with a clear message, rather than in every worker
    return ref


@functools.lru_cache(maxsize=16)
def resolve_step(ref: str) -> Callable:
    """The function a step reference names (see ``step_reference``)."""
    where, _, name = ref.rpartition(":")
    if not where or not name:
        raise ValueError(f"a step reference looks like 'package.module:function' or 'path/file.py:function', got {ref!r}")
    if where.endswith(".py"):
        spec = importlib.util.spec_from_file_location(f"_toyllm_step_{abs(hash(where))}", where)
        if spec is None or not Path(where).is_file():
            raise ValueError(f"step file {where} does not exist")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    fn = module
    for part in name.split("."):
        fn = getattr(fn, part, None)
    if not callable(fn):
        raise ValueError(f"{where} has no function {name!r}")
    return fn
