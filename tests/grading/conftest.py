"""Fixtures of the graded tests.

The tests reach exercise code only through ``toyllm.grading.load_exercise``,
so ``TOYLLM_IMPL`` (or ``--impl``) decides whether they check the stubs in
``exercises/``, the model answers in ``solutions/`` or a student's folder.
Loading happens inside a fixture: a submission that does not even import
fails its tests one by one instead of breaking collection.

Every test here carries ``@pytest.mark.exercise("N.M")`` and
``@pytest.mark.points(P)``; ``python -m toyllm grade`` adds them up.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass

import pytest
import torch

from toyllm import build_model
from toyllm.grading import load_exercise


@pytest.fixture(autouse=True)
def one_thread():
    """Run each graded test on one thread: on tensors this small, more threads only add waiting."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def ex01():
    return load_exercise("ex01")


@pytest.fixture
def ex02():
    return load_exercise("ex02")


@pytest.fixture
def ex03():
    return load_exercise("ex03")


@pytest.fixture
def ex04():
    return load_exercise("ex04")


@pytest.fixture
def ex05():
    return load_exercise("ex05")


def _assert_independent(fn, forbidden: set[str], exercise: str) -> None:
    """Fail with a clear message when ``fn``'s source names one of toyllm's own implementations.

    A submission must do the work itself: calling the library's answer to the
    exercise (for example ``toyllm.parallel.tsp_layer`` inside Exercise 4.2)
    scores nothing. Helpers the exercise hands in (``layer``, ``comm``) are fine.
    """
    import ast
    import textwrap

    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    used |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    used |= {a.name.rpartition(".")[2] for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
             for a in n.names}
    named = sorted(used & forbidden)
    assert not named, (f"Exercise {exercise}: {fn.__name__} calls toyllm's own {', '.join(named)}; "
                       "write the steps yourself (this exercise scores 0 otherwise)")


@pytest.fixture
def assert_independent():
    """``assert_independent(fn, forbidden_names, "4.2")``: see ``_assert_independent``."""
    return _assert_independent


@pytest.fixture(scope="module")
def pools():
    """``pools(p)``: a WorkerPool of p one-thread processes, shared by a module's tests and
    replaced when a test's deadlock or crash closed it."""
    from toyllm.launch import WorkerPool

    made = {}

    def get(p):
        if p not in made or made[p].closed:
            made[p] = WorkerPool(p, timeout_s=60)
        return made[p]

    yield get
    for pool in made.values():
        pool.close()


@pytest.fixture
def tiny_model():
    """A fresh, seeded copy of the "tiny" preset per test (exercises may swap its attention)."""
    return build_model("tiny", seed=0)


@dataclass
class ForwardCall:
    ids: list[int]            # token ids of batch row 0 fed in this call
    input_pos: int | None
    cache: object | None
    cache_length: int         # tokens the cache held before the call (0 without a cache)


@pytest.fixture
def forward_calls():
    """``forward_calls(model)`` starts recording every forward pass of ``model`` into the list it returns.

    It replaces ``model.forward`` on the instance, so both ``model(ids)``
    and ``model.forward(ids)`` are seen, whatever mix of positional and
    keyword arguments the code under test uses.
    """
    def attach(model) -> list[ForwardCall]:
        calls: list[ForwardCall] = []
        original = model.forward
        signature = inspect.signature(original)

        def recording_forward(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            a = bound.arguments
            cache = a["cache"]
            calls.append(ForwardCall(ids=a["ids"][0].tolist(), input_pos=a["input_pos"], cache=cache,
                                     cache_length=cache.length if cache is not None else 0))
            return original(*args, **kwargs)

        model.forward = recording_forward
        return calls

    return attach
