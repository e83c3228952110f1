"""A JupyterLab server from this venv and a headless Chromium driven by Selenium, for the browser tests.

Both are started once per test module and always stopped at the end, also when a
test fails. Nothing is downloaded at run time: the browser and its driver are
Debian's ``chromium`` and ``chromium-driver`` packages, named by path so that
Selenium never looks for a browser of its own.

The server runs on 127.0.0.1 with a random token, on a copy of the notebooks in
a temporary folder (the committed notebooks are never written, whatever the
page does), with its own settings, config, data and runtime folders. Its
environment carries ``TOYLLM_FAST=1`` and the run's ``TOYLLM_IMPL`` (``make test``:
the model answers in the instructor edition, the student's exercises in the
student edition), which each kernel inherits.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from toyllm.supervise import die_with_parent

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
INSTALL_HINT = ("the browser tests need Debian's Chromium and its driver: "
                "apt-get install chromium chromium-driver (as root), then make test-browser")
# OMP_WAIT_POLICY=PASSIVE: PyTorch's OpenMP threads sleep while they wait for each other instead of
# spinning. Lesson 01 runs beside a CPU hog started by pytest, in another session (another
# scheduling group) than the kernel's; spinning threads then burn the kernel's share of the CPU waiting
# for a descheduled partner, and a lesson ran several times slower (README, "Measuring honestly").
KERNEL_ENV = {"TOYLLM_IMPL": os.environ.get("TOYLLM_IMPL") or "exercises", "TOYLLM_FAST": "1",
              "OMP_WAIT_POLICY": "PASSIVE"}
SERVER_START_TIMEOUT_S = 90
WINDOW = (1400, 1000)   # pixels; wide enough for the explorers' 480-pixel sliders and their figures

# JupyterLab settings for the test server:
# - every cell stays in the page (no windowing), so the outputs of all cells can be checked;
# - the notebook's own kernel starts without asking (no "Select Kernel" dialog);
# - no autosave: the page never writes a notebook, even the temporary copy;
# - no news or update pop-ups over the notebook.
LAB_SETTINGS = {
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none",
                                                                    "autoStartDefaultKernel": True},
    "@jupyterlab/docmanager-extension/plugin.jupyterlab-settings": {"autosave": False},
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false",
                                                                         "checkForUpdates": False},
}


def pytest_configure(config):
    config.addinivalue_line("markers", "browser: runs notebooks in JupyterLab in a headless Chromium "
                                       "(needs: apt-get install chromium chromium-driver)")


def pytest_collection_modifyitems(config, items):
    """Run the browser tests after all the others, so that a broken module shows first in the quick tests."""
    items.sort(key=lambda item: item.get_closest_marker("browser") is not None)   # stable sort


def _die_with_parent() -> None:
    """Popen preexec_fn: the child gets SIGTERM when the test process dies, even when it is killed
    by a signal that skips the fixtures' teardown (the JupyterLab server then ends its kernels)."""
    die_with_parent(signal.SIGTERM)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout_s: float = 5.0):
    with urllib.request.urlopen(url, timeout=timeout_s) as r:
        return json.loads(r.read() or b"null")


class LabServer:
    """A running ``jupyter lab``: ``url(path)`` gives a page address with the token."""

    def __init__(self, root: Path, work: Path):
        self.root, self.port, self.token = root, _free_port(), secrets.token_hex(16)
        self.pending: list[threading.Thread] = []     # kernels being ended (``shutdown_kernels(wait=False)``)
        settings = work / "settings"
        for name, value in LAB_SETTINGS.items():
            (settings / name).parent.mkdir(parents=True, exist_ok=True)
            (settings / name).write_text(json.dumps(value))
        env = {**os.environ, **KERNEL_ENV,
               "JUPYTER_CONFIG_DIR": str(work / "config"), "JUPYTER_DATA_DIR": str(work / "data"),
               "JUPYTER_RUNTIME_DIR": str(work / "runtime"), "IPYTHONDIR": str(work / "ipython"),
               "JUPYTER_PLATFORM_DIRS": "1"}
        env.pop("MPLBACKEND", None)   # the kernels use matplotlib's inline backend, as for a learner
        cmd = [str(Path(sys.executable).with_name("jupyter-lab")), "--no-browser",
               "--ip=127.0.0.1", f"--port={self.port}", "--ServerApp.port_retries=0",
               f"--IdentityProvider.token={self.token}", f"--ServerApp.root_dir={root}",
               f"--LabApp.user_settings_dir={settings}", f"--LabApp.workspaces_dir={work / 'workspaces'}",
               "--LabApp.news_url=", "--LabApp.extension_manager=readonly", "--ServerApp.terminals_enabled=False",
               "--allow-root"]   # CI runs as root
        self.log = open(work / "jupyterlab.log", "wb")
        # its own process group, so that stop() can end anything it left behind
        self.proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True, preexec_fn=_die_with_parent)
        self._wait_ready(work / "jupyterlab.log")

    def url(self, path: str = "lab") -> str:
        return f"http://127.0.0.1:{self.port}/{path}?token={self.token}"

    def api(self, path: str):
        return _get(f"http://127.0.0.1:{self.port}/api/{path}?token={self.token}")

    def _wait_ready(self, log: Path) -> None:
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"jupyter lab exited with code {self.proc.returncode}:\n"
                                   f"{log.read_text(errors='replace')[-3000:]}")
            try:
                self.api("status")
                return
            except (urllib.error.URLError, ConnectionError, OSError):
                time.sleep(0.5)
        raise TimeoutError(f"jupyter lab did not answer within {SERVER_START_TIMEOUT_S} s:\n"
                           f"{log.read_text(errors='replace')[-3000:]}")

    def shutdown_kernels(self, wait: bool = True) -> None:
        """End every kernel now. ``wait=False``: ask for it and go on; the server answers each request once the
        kernel has ended (it ends its engine workers and the grader's standby first, about 2 s), and the
        next notebook's page loads meanwhile."""
        requests = [urllib.request.Request(f"http://127.0.0.1:{self.port}/api/kernels/{kernel['id']}"
                                           f"?token={self.token}", method="DELETE")
                    for kernel in self.api("kernels") or []]

        def delete():
            for req in requests:
                try:
                    urllib.request.urlopen(req, timeout=30).close()
                except (urllib.error.URLError, OSError):
                    pass   # already gone

        if wait:
            delete()
            return
        thread = threading.Thread(target=delete, name="shutdown-kernels", daemon=True)
        thread.start()
        self.pending.append(thread)

    def stop(self) -> None:
        """Ask the server to shut down (it ends its kernels), then make sure it and its group are gone."""
        for thread in self.pending:
            thread.join(timeout=30)
        try:
            self.shutdown_kernels()
        except (urllib.error.URLError, OSError):
            pass
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)   # the server ends its kernels, then exits
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)   # whatever is left in its group
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=10)
        self.log.close()


@pytest.fixture(scope="module")
def chromium_paths():
    """(browser, driver) paths; the test is skipped, naming the install command, when either is missing."""
    pytest.importorskip("selenium", reason="selenium is missing: run make setup")
    missing = [str(p) for p in (CHROMIUM, CHROMEDRIVER) if not p.exists()]
    if missing:
        pytest.skip(f"{', '.join(missing)} not found; {INSTALL_HINT}")
    return CHROMIUM, CHROMEDRIVER


@pytest.fixture(scope="module")
def lab_root(tmp_path_factory):
    """The folder the server shows: the notebooks are copied there by each test module."""
    return tmp_path_factory.mktemp("lab_root")


@pytest.fixture(scope="module")
def lab(chromium_paths, lab_root, tmp_path_factory):
    server = LabServer(lab_root, tmp_path_factory.mktemp("lab_state"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def browser(chromium_paths, tmp_path_factory):
    """A headless Chromium under chromedriver, both Debian's; quit at the end whatever happened."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    chromium, chromedriver = chromium_paths
    options = webdriver.ChromeOptions()
    options.binary_location = str(chromium)
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--no-first-run", "--disable-extensions", f"--window-size={WINDOW[0]},{WINDOW[1]}",
                f"--user-data-dir={tmp_path_factory.mktemp('chromium_profile')}"):
        options.add_argument(arg)
    # an explicit driver path: Selenium then skips selenium-manager, which would try to download one
    service = Service(executable_path=str(chromedriver), log_output=subprocess.DEVNULL,
                      popen_kw={"preexec_fn": _die_with_parent})
    driver = webdriver.Chrome(service=service, options=options)
    driver.set_page_load_timeout(60)
    driver.set_script_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture(scope="module")
def copy_into_lab(lab_root):
    """copy(path) -> the name under which the server shows it."""
    def copy(path: Path) -> str:
        shutil.copy(path, lab_root / path.name)
        return path.name
    return copy
