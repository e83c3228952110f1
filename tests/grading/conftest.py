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


# toyllm's own answers to the engine exercises of lessons 04-05: a step naming one scores nothing.
ENGINE_STEPS = {"tsp_layer", "tsp_trimmed_layer", "tsp_zigzag_layer", "kvr_layer", "kvr_layer_blocking",
                "default_step", "single_prefill", "parallel_prefill"}
ENGINE_ATOL = 1e-4      # float32 logits: the ranks sum the same products in another order


def _assert_independent(fn, exercise: str, forbidden: set[str] = ENGINE_STEPS) -> None:
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


def _root_cause(error: Exception) -> str:
    """The line a student needs: the last line of the failing rank's traceback (or the error itself)."""
    text = (getattr(error, "traceback", "") or str(error)).strip()
    return text.splitlines()[-1] if text else type(error).__name__


@pytest.fixture
def engine_run(pools):
    """``engine_run(step, "4.2", "tsp", p, chunks, seed=..., spec=..., decode=...)`` -> (result, one-process cache).

    Checks that ``step`` is the student's own, runs it inside the real engine
    on p gloo processes (a crash, a wrong shape or a deadlock fails within 20 s)
    and compares the first-token logits with the one-process forward pass.
    """
    from toyllm.parallel import ModelSpec, parallel_prefill, single_prefill
    from toyllm.utils import random_prompt

    def run(step, exercise, method, p, chunks, *, seed=0, spec=None, decode=0):
        _assert_independent(step, exercise)
        spec = spec or ModelSpec("tiny")
        ids = random_prompt(sum(chunks), 256, seed)
        ref_logits, ref_cache = single_prefill(spec.build(), ids)
        where = f"{step.__name__} in the engine, p={p}, chunks {chunks}"
        try:
            got = parallel_prefill(spec, ids, method, p, chunks, step=step, pool=pools(p), warmup=0,
                                   return_cache=True, decode_tokens=decode, timeout_s=20)
        except Exception as e:
            pytest.fail(f"{where}: the run failed: {_root_cause(e)}")
        diff = (got.logits - ref_logits).abs().max().item()
        assert diff < ENGINE_ATOL, (f"{where}: first-token logits differ from one process by {diff:.2e} "
                                    f"(allowed {ENGINE_ATOL:g})")
        return got, ref_cache

    return run


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
