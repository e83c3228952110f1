"""Fixtures of the graded tests.

The tests reach exercise code only through the ``exNN`` fixtures here
(``toyllm.grading.load_exercise``), so ``TOYLLM_IMPL`` (or ``--impl``)
decides whether they check the stubs in ``exercises/``, the model answers in
``solutions/`` or a student's folder. Under the grader the fixture gives a
proxy whose functions run in the sandbox process; in a plain pytest run, the
module itself, wrapped so the same rules apply (toyllm's functions marked as
the exercise's answer or a shortcut to it, ``toyllm.answers``;
functions, the model answers standing in for the lesson's other exercises).
Loading happens inside a fixture: a submission that does not even import
fails its tests one by one instead of breaking collection.

Every test here carries ``@pytest.mark.exercise("N.M")`` and
``@pytest.mark.points(P)``; ``python -m toyllm grade`` adds them up.

Every exercise also has cases drawn at grading time (the ``drawn``
fixture), from a seed the grader picks per run (``$TOYLLM_GRADE_SEED``;
a fresh random one when it is unset), so that no table of the visible test
vectors passes. A failing drawn case names the seed: run the tests again
with ``TOYLLM_GRADE_SEED=<seed>`` to see the same inputs.
"""
from __future__ import annotations

import ast
import os
import random
import secrets
from pathlib import Path

import pytest
import torch

from toyllm import answers, build_model
from toyllm.grading import load_exercise
from toyllm.grading.references import EDITION_SEED
from toyllm.grading.sandbox.local import LocalModule
from toyllm.course import SANDBOX_ENV
from toyllm.grading.sandbox.submission import read_submission


@pytest.fixture(autouse=True)
def one_thread():
    """Run each graded test on one thread: on tensors this small, more threads only add waiting."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def submission(name: str):
    """The current implementation's module ``name`` ("ex01") as the graded tests must use it."""
    if os.environ.get(SANDBOX_ENV) == "1":
        return load_exercise(name)                      # a proxy: the code runs in the sandbox
    try:
        reference = load_exercise(name, impl="solutions")
    except ValueError:
        reference = None
    return LocalModule(load_exercise(name), reference)


def _fixture(name: str):
    @pytest.fixture(name=name)
    def get():
        return submission(name)
    return get


# ex01 ... ex09: one fixture per lesson, named like the exercise files.
for _n in range(1, 10):
    globals()[f"ex{_n:02d}"] = _fixture(f"ex{_n:02d}")


SEED_ENV = "TOYLLM_GRADE_SEED"


def grading_seed_value() -> int:
    """The seed of this grading run: ``$TOYLLM_GRADE_SEED``, else a fresh random one.

    The student edition draws with ``EDITION_SEED`` instead: it keeps the expected values of those cases only
    (``toyllm.grading.references``).
    """
    text = os.environ.get(SEED_ENV, "").strip()
    if text:
        return int(text)
    return EDITION_SEED if answers.EDITION == "student" else secrets.randbits(32)


class Drawn:
    """Inputs drawn from the grading seed: ``drawn.rng("4.1")`` is a ``random.Random`` of its own per name.

    ``str(drawn)`` ("drawn with TOYLLM_GRADE_SEED=1234") goes into every failure message of a drawn case,
    so that the case can be reproduced.
    """

    def __init__(self, seed: int):
        self.seed = int(seed)

    def rng(self, name: str) -> random.Random:
        return random.Random(f"{name}/{self.seed}")

    def generator(self, name: str) -> torch.Generator:
        return torch.Generator().manual_seed(self.rng(name).randrange(2 ** 62))

    def __str__(self) -> str:
        return f"drawn with {SEED_ENV}={self.seed}"


_SESSION_SEED: list[int] = []


@pytest.fixture(scope="session")
def grading_seed() -> int:
    """One seed for the whole run (the grader sets ``$TOYLLM_GRADE_SEED`` per run)."""
    if not _SESSION_SEED:
        _SESSION_SEED.append(grading_seed_value())
    return _SESSION_SEED[0]


@pytest.fixture
def drawn(grading_seed) -> Drawn:
    return Drawn(grading_seed)


ENGINE_ATOL = 1e-4      # float32 logits: the ranks sum the same products in another order
# Seconds one graded engine run may take before it counts as a deadlock. The tiny model's runs take
# milliseconds (the workers are already started: their start-up has its own limit), so 10 s leaves room
# for a machine a hundred times slower, and a deadlocked step costs 10 s, not the whole test's timeout.
ENGINE_LIMIT_S = 10


def engine_limit_s() -> float:
    """The limit of one graded engine run in seconds: ``TOYLLM_GRADE_ENGINE_LIMIT`` if set, else ENGINE_LIMIT_S."""
    import math

    from toyllm.grading.settings import Settings

    text = Settings.from_env(os.environ).engine_limit
    if text is None:
        return ENGINE_LIMIT_S
    try:
        limit = float(text)
    except ValueError:
        limit = math.nan
    if not (math.isfinite(limit) and limit > 0):
        raise ValueError(f"{Settings.variable('engine_limit')} must be a number of seconds above 0, got {text!r}")
    return limit


def _assert_independent(fn, exercise: str) -> None:
    """Fail when the source of submitted function ``fn`` names one of toyllm's own implementations.

    For code that runs where the runtime guard (``toyllm.grading.sandbox.guard``) cannot see it,
    such as a per-layer step inside the parallel engine's worker processes.
    The source is read by the grader from the submitted file, never asked of
    the submission. The names are those of toyllm's functions marked as the
    exercise's answer or a shortcut to it (``toyllm.answers``).
    """
    forbidden = {spec.rpartition(":")[2].rpartition(".")[2] for spec in answers.forbidden(exercise)}
    path = getattr(fn, "source_file", None)
    if path is None:
        return
    source = read_submission(Path(path).parent)[0].get(Path(path).name)
    if source is None:              # not a regular file: the sandbox never got it, so it ran nothing from it
        return
    tree = ast.parse(source)
    node = next((n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                 and n.name == fn.__name__), None)
    if node is None:
        return
    used = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
    used |= {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}
    used |= {a.name.rpartition(".")[2] for n in ast.walk(node) if isinstance(n, (ast.Import, ast.ImportFrom))
             for a in n.names}
    named = sorted(used & forbidden)
    assert not named, (f"Exercise {exercise} must be your own code, but {fn.__name__} calls toyllm's own "
                       f"{', '.join(named)}: this exercise scores 0")


def _root_cause(error: Exception) -> str:
    """The line a student needs: the last line of the failing rank's traceback (or the error itself).

    The engine reports the rank it blames first, then "other ranks also failed" with theirs.
    """
    text = (getattr(error, "traceback", "") or str(error)).split("\nother ranks also failed")[0].strip()
    return text.splitlines()[-1] if text else type(error).__name__


def _engine_cause(step, spec, ids, method, p, chunks, ref_cache) -> str:
    """"; rank 1, layer 0: ..." where the ranks' attention first differs from one process, or "" (see
    ``toyllm.grading.expect.engine_cause``): the step runs once more, recorded."""
    from toyllm.grading import sandboxed
    from toyllm.grading.expect import engine_cause

    try:
        trace = sandboxed("toyllm.grading.sandbox.harness:engine_trace", spec, ids, method, p, chunks, step=step)
    except Exception:           # the first run already said what it could
        return ""
    cause = engine_cause(trace, [(k, v) for k, v in ref_cache], chunks, method)
    return f"; {cause}" if cause else ""


def make_engine_run(explain: bool = True):
    """``engine_run(step, "4.2", "tsp", p, chunks, seed=..., spec=..., decode=..., note=..., **options)`` -> (result,
    one-process cache); ``options`` go to ``parallel_prefill`` (``balance``, ``ring_pass``, ``cached``).

    Checks that ``step`` is the student's own, runs it inside the real engine
    on p gloo processes started from the submission's side (a crash, a wrong
    shape or a deadlock fails within ``engine_limit_s()``) and compares the first-token
    logits with the one-process forward pass, computed here. When they differ, the
    failure says where the ranks' attention first went wrong (``_engine_cause``: the step
    runs once more, traced), unless ``explain`` is False.
    """
    from toyllm.grading import sandboxed
    from toyllm.parallel import ModelSpec, single_prefill
    from toyllm.utils import random_prompt

    def run(step, exercise, method, p, chunks, *, seed=0, spec=None, decode=0, note="", **options):
        _assert_independent(step, exercise)
        spec = spec or ModelSpec("tiny")
        ids = random_prompt(sum(chunks), 256, seed)
        limit_s = engine_limit_s()
        ref_logits, ref_cache = single_prefill(spec.build(), ids)
        where = f"Exercise {exercise}, {step.__name__} in the engine, p={p}, chunks {chunks}" + (f" ({note})" if note else "")
        try:
            partition = None if options.get("balance") == "zigzag" else chunks     # zigzag lays out its own
            got = sandboxed("toyllm.grading.sandbox.harness:parallel_prefill", spec, ids, method, p, partition, step=step,
                            warmup=0, return_cache=True, decode_tokens=decode, timeout_s=limit_s, **options)
        except Exception as e:
            pytest.fail(f"{where}: the run failed: {_root_cause(e)}")
        diff = (got.logits - ref_logits).abs().max().item()
        if not diff < ENGINE_ATOL:                # NaN logits (a query that sees no key) fail too
            # where the ranks' attention first differs: traced for the steps that call layer.attend (TSP, KVR)
            cause = "" if method == "ring" or not explain else _engine_cause(step, spec, ids, method, p, chunks,
                                                                            ref_cache)
            pytest.fail(f"{where}: first-token logits differ from one process by {diff:.2e} (allowed "
                        f"{ENGINE_ATOL:g}){cause}")
        return got, ref_cache

    return run


@pytest.fixture
def engine_run():
    """See ``make_engine_run``."""
    return make_engine_run()


@pytest.fixture(scope="module", autouse=True)
def engine_workers_end_with_the_module():
    """The engine's worker processes, kept for a lesson's tests, end with its test file.

    Under the grader they live in the sandbox and end with it; in a plain
    pytest run they would otherwise outlive the graded tests.
    """
    yield
    from toyllm.grading.sandbox import harness

    harness.close_pools()


@pytest.fixture
def tiny_model():
    """A fresh, seeded copy of the "tiny" preset per test (exercises may swap its attention)."""
    return build_model("tiny", seed=0)


def _exercises_ran() -> set[str]:
    """The exercises the framework ran since the last call, here and in the sandbox; the record starts again."""
    ran = set(answers.ran)
    answers.ran.clear()
    if os.environ.get(SANDBOX_ENV) == "1":
        from toyllm.grading import sandboxed_record

        try:                        # none if a crash or a timeout stopped the sandbox: that test said so already
            ran |= set(sandboxed_record("toyllm.grading.sandbox.harness:exercises_ran", clear=True) or ())
        except Exception:           # one that crashed or hung while asked: the same
            pass
    return ran


_PENDING: list[tuple] = []      # (report, exercise, exercises it ran) of each failed test, noted at the end
_VERDICTS: dict[str, bool] | None = None   # see _verdicts
_NOTED: list[tuple[str, str]] = []  # (test, note) for the terminal's summary


def _verdicts() -> dict[str, bool]:
    """{exercise: fails a graded test of its own} for the exercises known without grading them: true for those
    seen failing a test that ran no other exercise, here, and under the grader also what the earlier lessons'
    processes showed (false: every test of it passed). A note about one of them needs no grading of it."""
    global _VERDICTS
    if _VERDICTS is None:
        from toyllm.grading.grader import plugin

        _VERDICTS = plugin.verdicts_before()
    return _VERDICTS


def _add_note(report, note: str) -> None:
    crash = getattr(report.longrepr, "reprcrash", None)
    if note and crash is not None:
        crash.message = f"{crash.message}\n{note}"
        report.longrepr.addsection("other exercises this test ran", note)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """Under the grader (either edition) and in the student edition, a failed test also names the other
    exercises it ran that fail their own tests.

    There no model answer stands in for them: the submission's own run (``toyllm.grading.expect.neighbours_note``).
    Which those are is worked out once the session ends (``pytest_sessionfinish``).
    """
    report = yield
    runs_submission = answers.EDITION == "student" or os.environ.get(SANDBOX_ENV) == "1"
    if not runs_submission or report.when not in ("setup", "call"):
        return report
    ran = _exercises_ran()                      # after setup: empty, so that the call's record is its own
    if not report.failed:
        return report
    from toyllm.grading.expect import ran_also
    from toyllm.grading.grader import plugin
    from toyllm.grading.settings import Settings

    exercise = plugin.exercise_of(item)
    if not ran - {exercise}:                    # it fails its own tests
        if not _verdicts().get(exercise):
            _verdicts()[exercise] = True
            plugin.log_failed_alone(exercise)   # the grader hands it on to the next lessons' processes
    elif report.when == "call" and Settings.from_env(os.environ).neighbour:   # graded for a note: say what else it ran
        _add_note(report, ran_also(exercise, ran))
    elif report.when == "call":
        _PENDING.append((report, exercise, ran))
    return report


def pytest_sessionfinish(session):
    """The student edition's notes, once every test has run: grading another exercise takes seconds, which
    must not count against a test's time limit. The grader's log gets each noted report again (the later
    one counts)."""
    from toyllm.grading.grader import plugin
    from toyllm.grading.expect import neighbours_note

    while _PENDING:
        report, exercise, ran = _PENDING.pop(0)
        note = neighbours_note(exercise, ran, known=_verdicts())
        if note:
            _add_note(report, note)
            plugin.pytest_runtest_logreport(report)
            _NOTED.append((report.nodeid, note))


def pytest_terminal_summary(terminalreporter):
    for test, note in _NOTED:
        terminalreporter.write_line(f"{test}: {note}")
