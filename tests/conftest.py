"""Shared fixtures. The SmolLM2 weights are read once per test session.

``make check`` (``TOYLLM_CHECK=1``) is the fast tier: the tests that start no process. There every way of
starting one fails the test that tried, with the markers that take such a test out of the tier.
"""
import atexit
import os
import shutil
import tempfile

import pytest
import torch

torch.set_grad_enabled(False)

# Compiled steps the tests build go to a temporary folder of this test run (and its processes), never the user's cache.
_CACHE = tempfile.mkdtemp(prefix="toyllm-test-cache-")
os.environ["TOYLLM_CACHE"] = _CACHE
atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)

CHECK_ENV = "TOYLLM_CHECK"
_SLICES = "slow, engine, grader, notebook, browser or gpu"


def _refused(*args, **kwargs):
    raise RuntimeError(f"make check starts no process: mark this test {_SLICES} (pyproject.toml's markers)")


@pytest.fixture(autouse=True)
def _no_process_in_the_fast_tier(monkeypatch):
    """Under ``make check``: a test that starts a process (subprocess, multiprocessing, fork) fails at once."""
    if os.environ.get(CHECK_ENV) == "1":
        import multiprocessing.process
        import subprocess

        monkeypatch.setattr(subprocess.Popen, "__init__", _refused)
        monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", _refused)
        monkeypatch.setattr(os, "fork", _refused)
    yield


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
