"""The learner's path on macOS and Windows, simulated on Linux.

Each test runs a child Python whose every process (the child, the grader's trusted pytest process, the
submission's sandbox, the engine's spawned ranks) starts through a throwaway virtual environment that
reuses this one's packages and, before anything else is imported, takes away what the simulated system
lacks (``FAKES`` below):

- "darwin": the ``os.ST_*`` mount flags macOS has not (``ST_NODEV``, ``ST_NOEXEC``, ``ST_NOATIME``,
  ``ST_NODIRATIME``, ``ST_RELATIME``), ``os.sched_getaffinity``, ``prctl``/``unshare``/``mount`` in the C
  library; ``resource.setrlimit(RLIMIT_AS, ...)`` raises ValueError as macOS does; multiprocessing's
  default start method is spawn; the loopback interface is called ``lo0``;
- "win32": as well, no ``resource``, ``fcntl``, ``pwd`` or ``grp`` module, no ``signal.SIGKILL``
  (``psutil.Process.kill``, TerminateProcess on Windows, sends signal 9 by number), ``SIGHUP``, ``SIGQUIT``, no ``os.fork``, ``setpgid``, ``setsid``, ``killpg``, ``getpgid``, ``getsid``,
  ``getuid``, ``geteuid``; ``subprocess.Popen`` refuses ``preexec_fn`` and ``pass_fds`` (and takes
  ``creationflags``, ignoring ``start_new_session``) as on Windows; the loopback interface is called
  ``Loopback Pseudo-Interface 1``.

``sys.platform`` itself cannot be faked: the standard library and torch then load the other system's
modules (``_scproxy``, ``_winapi``) and fail. So only what toyllm reads is faked: ``toyllm.supervise.SYSTEM``
(what its code branches on) is set to the flavour as the module loads, and
``toyllm.grading.sandbox.launcher.LINUX`` to False. The interface name the fake reports
is mapped back to ``lo`` in each new process's environment, since the kernel underneath is still Linux.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent

FAKES = {
    "darwin": dict(remove_os=["ST_NODEV", "ST_NOEXEC", "ST_NOATIME", "ST_NODIRATIME", "ST_RELATIME",
                              "sched_getaffinity"],
                   remove_signal=[], hide_modules=[], loopback="lo0", windows_popen=False),
    "win32": dict(remove_os=["ST_NODEV", "ST_NOEXEC", "ST_NOATIME", "ST_NODIRATIME", "ST_RELATIME",
                             "sched_getaffinity", "fork", "forkpty", "setpgid", "setsid", "killpg", "getpgid",
                             "getsid", "getuid", "geteuid"],
                  remove_signal=["SIGKILL", "SIGHUP", "SIGQUIT"], hide_modules=["resource", "fcntl", "pwd", "grp"],
                  loopback="Loopback Pseudo-Interface 1", windows_popen=True),
}

# Runs first in every process of the simulated system (a .pth file of the throwaway environment imports it).
BOOTSTRAP = '''
import ctypes, os, signal, site, subprocess, sys
import multiprocessing, multiprocessing.context
FLAVOUR, FAKE, SITE = {flavour!r}, {fake!r}, {site!r}
site.addsitedir(SITE)                                 # this environment's packages (toyllm among them)

if os.environ.get("GLOO_SOCKET_IFNAME") == FAKE["loopback"]:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"          # the kernel underneath calls it so
    os.environ["TOYLLM_FAKE_GLOO_IFNAME"] = FAKE["loopback"]
for name in FAKE["remove_os"]:
    if hasattr(os, name):
        delattr(os, name)
for name in FAKE["remove_signal"]:
    if hasattr(signal, name):
        delattr(signal, name)
import psutil                                         # (psutil's Linux half needs resource: load it first)
_net_if_addrs = psutil.net_if_addrs
def net_if_addrs():
    found = _net_if_addrs()
    if "lo" in found:
        found[FAKE["loopback"]] = found.pop("lo")
    return found
psutil.net_if_addrs = net_if_addrs
if "SIGKILL" in FAKE["remove_signal"]:                # psutil's kill is TerminateProcess on Windows; its Linux half
    psutil.Process.kill = lambda self: self.send_signal(9)   # reads the signal.SIGKILL taken away above
for name in FAKE["hide_modules"]:
    sys.modules[name] = None                          # import raises ImportError

_CDLL = ctypes.CDLL
class CDLL(_CDLL):                                    # a C library without Linux's own calls
    def __getattr__(self, name):
        if name in ("prctl", "unshare", "mount", "umount2"):
            raise AttributeError(name)
        return super().__getattr__(name)
    def __getitem__(self, name):
        if name in ("prctl", "unshare", "mount", "umount2"):
            raise AttributeError(name)
        return super().__getitem__(name)
ctypes.CDLL = CDLL

multiprocessing.context._default_context = multiprocessing.context.DefaultContext(
    multiprocessing.context._concrete_contexts["spawn"])

if "resource" not in FAKE["hide_modules"]:
    import resource
    _setrlimit = resource.setrlimit
    def setrlimit(which, limits):
        if which == resource.RLIMIT_AS:
            raise ValueError("current limit exceeds maximum limit")
        return _setrlimit(which, limits)
    resource.setrlimit = setrlimit

if FAKE["windows_popen"]:
    _init = subprocess.Popen.__init__
    def __init__(self, *args, **kwargs):
        if kwargs.get("preexec_fn") is not None:
            raise ValueError("preexec_fn is not supported on Windows platforms")
        assert not kwargs.get("pass_fds"), "pass_fds not supported on Windows."
        kwargs.pop("creationflags", None)
        kwargs.pop("start_new_session", None)
        _init(self, *args, **kwargs)
    subprocess.Popen.__init__ = __init__

import importlib.abc, importlib.machinery
PATCHES = {{"toyllm.supervise": {{"SYSTEM": FLAVOUR}}, "toyllm.grading.sandbox.launcher": {{"LINUX": False}}}}
class Patcher(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in PATCHES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is None:
            return None
        exec_module = spec.loader.exec_module
        def patched(module):
            exec_module(module)
            for key, value in PATCHES[name].items():
                setattr(module, key, value)
        spec.loader.exec_module = patched
        return spec
sys.meta_path.insert(0, Patcher())
'''


def fake_python(tmp_path: Path, flavour: str) -> Path:
    """A Python that simulates ``flavour`` in every process it starts (see the module's docstring)."""
    env_dir = tmp_path / f"python-{flavour}"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True)
    site_dir = Path(subprocess.run([str(env_dir / "bin" / "python"), "-c", "import sysconfig; "
                                    "print(sysconfig.get_paths()['purelib'])"], check=True, capture_output=True,
                                   text=True).stdout.strip())
    (site_dir / "_toyllm_fake_platform.py").write_text(
        BOOTSTRAP.format(flavour=flavour, fake=FAKES[flavour], site=sysconfig.get_paths()["purelib"]))
    (site_dir / "00_toyllm_fake_platform.pth").write_text("import _toyllm_fake_platform\n")
    return env_dir / "bin" / "python"


def run_in(python: Path, code: str, timeout_s: float, tmp_path: Path) -> dict:
    """Run ``code`` with the simulated Python (it prints one JSON line last); return that line."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(TOYLLM_IMPL="solutions", TOYLLM_FAST="1", OMP_NUM_THREADS="1")
    env.pop("GLOO_SOCKET_IFNAME", None)
    done = subprocess.run([str(python), "-c", textwrap.dedent(code)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=timeout_s)
    assert done.returncode == 0, f"exit code {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


FLAVOURS = [pytest.param("darwin", id="macos"), pytest.param("win32", id="windows")]


@pytest.fixture(scope="module")
def simulated(tmp_path_factory):
    """flavour -> its simulated Python, made once per run (each test starts its own processes of it)."""
    made: dict[str, Path] = {}

    def python(flavour: str) -> Path:
        if flavour not in made:
            made[flavour] = fake_python(tmp_path_factory.mktemp("pythons"), flavour)
        return made[flavour]
    return python


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("flavour", FLAVOURS)
def test_the_simulation_is_what_it_says(tmp_path, simulated, flavour):
    """The simulated system lacks what it should, and toyllm sees the flavour, before toyllm is imported."""
    python = simulated(flavour)
    got = run_in(python, """
        import json, os, signal, sys
        missing_os = [n for n in ("ST_NODEV", "ST_RELATIME", "fork", "killpg", "getuid") if not hasattr(os, n)]
        try:
            import resource
            try:
                resource.setrlimit(resource.RLIMIT_AS, resource.getrlimit(resource.RLIMIT_AS))
                rlimit_as = "ok"
            except ValueError:
                rlimit_as = "ValueError"
        except ImportError:
            rlimit_as = "no resource module"
        import psutil
        import toyllm.supervise
        print(json.dumps({"missing_os": missing_os, "sigkill": hasattr(signal, "SIGKILL"), "rlimit_as": rlimit_as,
                          "loopback": [n for n, a in psutil.net_if_addrs().items()
                                       if any(x.address == "127.0.0.1" for x in a)],
                          "system": toyllm.supervise.SYSTEM, "toyllm_loaded_early": False}))
    """, 60, tmp_path)
    assert got["system"] == flavour
    assert got["loopback"] == [FAKES[flavour]["loopback"]]
    if flavour == "darwin":
        assert got["missing_os"] == ["ST_NODEV", "ST_RELATIME"] and got["sigkill"] and got["rlimit_as"] == "ValueError"
    else:
        assert got["missing_os"] == ["ST_NODEV", "ST_RELATIME", "fork", "killpg", "getuid"]
        assert not got["sigkill"] and got["rlimit_as"] == "no resource module"


@pytest.mark.slow
@pytest.mark.engine
@pytest.mark.timeout(300)
@pytest.mark.parametrize("flavour", FLAVOURS)
def test_lessons_run(tmp_path, simulated, flavour):
    """import toyllm, toyllm.grading, toyllm.launch; a model; naive and cached generation agree; a 2-process
    prefill (TSP and KVR on gloo over 127.0.0.1) equals one process."""
    python = simulated(flavour)
    got = run_in(python, """
        import json, os
        import torch
        import toyllm, toyllm.grading, toyllm.launch
        from toyllm.model import build_model
        from toyllm.generation import generate
        from toyllm.parallel.runner import parallel_prefill

        model = build_model("tiny")
        prompt = [1, 2, 3, 4, 5]
        naive = generate(model, prompt, max_new_tokens=6, method="naive")
        cached = generate(model, prompt, max_new_tokens=6, method="cached")
        ids = list(range(1, 17))
        single = parallel_prefill("tiny", ids, method="single", world_size=1, repeat=1, warmup=0)
        out = {"naive_is_cached": naive.output_ids == cached.output_ids and len(naive.output_ids) == 6, "ifname": toyllm.launch.loopback_interface()}
        for method in ("tsp", "kvr"):
            run = parallel_prefill("tiny", ids, method=method, world_size=2, repeat=1, warmup=0, timeout_s=120)
            out[method] = bool(torch.allclose(run.logits, single.logits, atol=1e-4))
        print(json.dumps(out))
    """, 280, tmp_path)
    assert got["naive_is_cached"]
    assert got["ifname"] == (None if flavour == "win32" else FAKES[flavour]["loopback"])
    assert got["tsp"] and got["kvr"]


@pytest.mark.slow
@pytest.mark.grader
@pytest.mark.timeout(420)
@pytest.mark.parametrize("flavour", FLAVOURS)
def test_a_student_grades_their_work(tmp_path, simulated, flavour):
    """grade(impl="solutions", only="ex03") gives full marks, unsandboxed (the grader's user, no namespaces)."""
    python = simulated(flavour)
    got = run_in(python, """
        import json
        from toyllm.grading import grade
        report = grade(impl="solutions", only="ex03")
        print(json.dumps({"score": report.score, "max": report.max_score, "isolation": report.isolation,
                          "bad": [(t.name, t.status, t.output[-1500:]) for t in report.tests if t.status != "passed"]}))
    """, 400, tmp_path)
    assert not got["bad"], got["bad"]
    assert got["max"] > 0 and got["score"] == got["max"]
    assert got["isolation"] == "the submission runs in its own process, as the grader's user"
