"""Shared fixtures. The SmolLM2 weights are read once per test session.

``make check`` (``TOYLLM_CHECK=1``) is the fast tier: the tests that start no process. There every way of
starting one fails the test that tried, with the markers that take such a test out of the tier.

A file marked ``library`` (``pytestmark = pytest.mark.library``) tests the library alone: while its tests run,
in this process and every process they start, reaching an exercise fails the test
(``toyllm.course.refuse_in_library_test``). The student edition's ``make test`` leaves these files out, since
they cannot differ there; the course's run is what proves they run no exercise.

``make test`` runs the tests in two processes side by side (pytest-xdist, ``-n 2``). A test marked ``alone``
compares what exists on the whole machine before and after it (processes, scratch folders in /tmp), so it runs
with no other test beside it but those of ``make check``'s tier (``side_by_side``).
"""
import atexit
import os
import shutil
import tempfile

import pytest
import torch

try:                                   # the hooks that keep an ``alone`` test alone under pytest-xdist
    import side_by_side
    from side_by_side import pytest_configure, pytest_runtest_protocol  # noqa: F401
except ImportError:                     # this file's copy beside the grader's tests, which run one at a time
    side_by_side = None

torch.set_grad_enabled(False)

# Compiled steps the tests build go to a temporary folder of this test run (and its processes), never the user's cache.
# The folder is only named here, and made by the first compile: a process that loads this file and is then
# killed (the grader's trusted pytest processes load it too) leaves nothing behind. The pytest run that names
# it removes it at its end; the processes it starts inherit the name.
_CACHE = os.path.join(tempfile.gettempdir(), f"toyllm-test-cache-{os.getpid()}")
os.environ["TOYLLM_CACHE"] = _CACHE
atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)

CHECK_ENV = "TOYLLM_CHECK"
_SLICES = "slow, engine, grader, notebook, browser or gpu"
_REFUSAL = f"make check starts no process: mark this test {_SLICES} (pyproject.toml's markers)"


@pytest.fixture(autouse=True)
def _no_process_in_the_fast_tier(monkeypatch):
    """Under ``make check``: a test that starts a process (subprocess, multiprocessing, fork) fails at once, and
    fails at its end if it caught the refusal and went on (it would pass there without testing anything)."""
    if os.environ.get(CHECK_ENV) != "1":
        yield
        return
    import multiprocessing.process
    import subprocess

    tried = []

    def refused(*args, **kwargs):
        tried.append(True)
        raise RuntimeError(_REFUSAL)

    monkeypatch.setattr(subprocess.Popen, "__init__", refused)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refused)
    monkeypatch.setattr(os, "fork", refused)
    yield
    if tried:
        pytest.fail(f"this test tried to start a process and went on past the refusal; {_REFUSAL}", pytrace=False)


@pytest.hookimpl(trylast=True)                    # after tests/browser's, which puts the browser last
def pytest_collection_modifyitems(config, items):
    """``library`` marks whole files: its guard is set before the file's own fixtures start any worker. Under
    pytest-xdist the costliest files go first."""
    for item in items:
        module = item.getparent(pytest.Module)
        if item.get_closest_marker("library") and not (module and module.get_closest_marker("library")):
            raise pytest.UsageError(f"{item.nodeid} is marked library on its own: mark the whole file "
                                    "(pytestmark = pytest.mark.library), or none of it")
    if side_by_side is not None:
        side_by_side.check_beside_alone(items)
        side_by_side.costliest_files_first(config, items)


@pytest.fixture(scope="module", autouse=True)
def _library_files_run_no_exercise(request, tmp_path_factory):
    """In a file marked ``library``: any exercise reached, here or in a process started meanwhile, fails it.

    Module-scoped and autouse, so the variable is set before the file's own module fixtures start worker
    pools (they inherit it). The log file catches an error that a caller swallowed or a worker reported
    back in other words.
    """
    if request.node.get_closest_marker("library") is None:
        yield
        return
    from toyllm.course import LIBRARY_TEST_ENV

    log = tmp_path_factory.mktemp("library") / "exercises_reached.txt"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(LIBRARY_TEST_ENV, str(log))
        yield
    if log.exists() and log.read_text().strip():
        pytest.fail(f"{request.node.nodeid} is marked library, yet its tests reached: "
                    f"{'; '.join(sorted(set(log.read_text().split(chr(10))) - {''}))}", pytrace=False)


@pytest.fixture(scope="session")
def smollm2_gguf():
    """Path of the SmolLM2 GGUF file; the test is skipped (naming the install command) when it is missing."""
    from toyllm.weights import find_smollm2_gguf

    try:
        return find_smollm2_gguf()
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) of the real SmolLM2-135M-Instruct."""
    from toyllm import load_model

    return load_model("smollm2-135m")
