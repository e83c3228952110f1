"""The grading rules in this process: what a plain pytest run of the graded tests uses instead of the sandbox.

Under the grader the submission runs in its sandbox (``toyllm.grading.sandbox.process``); in a plain pytest run
(``TOYLLM_IMPL=... pytest tests/grading``) it runs here, each call under the same rules
(``guard.rules``: the independence rule, one exercise at a time) for the test that runs.
"""
from __future__ import annotations

import importlib
import os
from pathlib import Path

from . import guard
from ..settings import Settings
from .process import _get_sandbox, context, describe_call, running_sandbox


def _report(violations: list) -> None:
    """Tell the plugin about the first rule a call broke (it fails the test with that message)."""
    if violations and context.on_violation is not None:
        context.on_violation(context.exercise, violations[0])


class LocalFunction:
    """A submitted function called in this process under the grading rules (plain pytest runs)."""

    def __init__(self, module: "LocalModule", fn):
        self._module, self._fn, self.__name__ = module, fn, fn.__name__
        self.__qualname__ = getattr(fn, "__qualname__", fn.__name__)
        self.__wrapped__ = fn

    @property
    def source_file(self) -> Path:
        return Path(self._module._module.__file__)

    def __call__(self, *args, **kwargs):
        with self._module._rules(self.__name__) as violations:
            try:
                return self._fn(*args, **kwargs)
            finally:
                _report(violations)


class LocalModule:
    """An exercise module whose functions run in-process under ``guard.rules`` for the current test."""

    def __init__(self, module, reference=None):
        self._module, self._reference = module, reference
        self.__file__ = module.__file__

    def _rules(self, called: str):
        swaps = guard.swaps_for(context.exercise, self._module, self._reference, called)
        return guard.rules(context.exercise, context.forbidden, [self._module.__file__], swaps)

    def __getattr__(self, attr: str):
        value = getattr(self._module, attr)
        return LocalFunction(self, value) if callable(value) and not isinstance(value, type) else value


def sandboxed(target: str, *args, **kwargs):
    """Run the trusted function ``"toyllm.module:function"`` where the submission runs; return its value.

    Under the grader that is the sandbox (submitted functions among the
    arguments are the sandbox's own copies); in a plain pytest run, this
    process, under the same rules. Use it for helpers that must call
    submitted code many times or hand it to other processes (see
    ``toyllm.grading.sandbox.harness``). The value must be plain data.
    """
    module_name, _, fn_name = target.partition(":")
    if not module_name.startswith("toyllm.") or not fn_name:
        raise ValueError(f"sandboxed() runs 'toyllm.module:function' helpers, got {target!r}")
    if Settings.from_env(os.environ).sandbox == "1":
        what = describe_call(fn_name, args, kwargs)
        return _get_sandbox().call(("harness", target), args, kwargs, what)
    fn = getattr(importlib.import_module(module_name), fn_name)
    local = [a for a in (*args, *kwargs.values()) if isinstance(a, LocalFunction)]
    args = tuple(a.__wrapped__ if isinstance(a, LocalFunction) else a for a in args)
    kwargs = {k: (v.__wrapped__ if isinstance(v, LocalFunction) else v) for k, v in kwargs.items()}
    files = [f.source_file for f in local]
    swaps = []
    for f in local:
        swaps += guard.swaps_for(context.exercise, f._module._module, f._module._reference, f.__name__)
    with guard.rules(context.exercise, context.forbidden, files, swaps) as violations:
        try:
            return fn(*args, **kwargs)
        finally:
            _report(violations)


def sandboxed_record(target: str, **kwargs):
    """``sandboxed(target, **kwargs)`` for a helper that reads what the submission's calls left in the sandbox,
    asked only of the sandbox that ran them; None if it is no longer up.

    A crash or a timeout stops the sandbox, and its record ends with it. Starting a fresh one just to ask
    would spend what is left of the test's time (none, after a timeout) on the restart and on importing the
    submission again; the next test starts one with its own time.
    """
    if Settings.from_env(os.environ).sandbox != "1":
        return sandboxed(target, **kwargs)
    sandbox = running_sandbox()
    if sandbox is None:
        return None
    return sandbox.call(("harness", target), (), kwargs, describe_call(target.partition(":")[2], (), kwargs))
