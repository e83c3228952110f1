"""One grading shares nothing with another: no files, IPC or sockets cross between sandboxes, the host's
listeners are out of reach, and one sandbox's process count cannot starve another's.

The attacks are the fixtures ``sharing`` and ``starving`` (tests/fixtures/submissions/README.md). Student
A's grading runs as a command line process, held inside its graded call, while student B is graded here.
"""
from __future__ import annotations

import ctypes
import grp
import os
import pwd
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from test_grader import ROOT, make_submission
from toyllm.grading import grade
from toyllm.grading.sandbox.launcher import ID_RANGE, namespaces_work, unused_id, writable_folders
from toyllm.grading.sandbox.process import sandbox_user
from toyllm.grading.sandbox.server import NAME as SANDBOX_NAME

# The whole file looks at the whole machine (user ids and processes in use, what is left in /tmp and /dev/shm),
# and one test holds hundreds of processes: no other test runs beside it.
pytestmark = pytest.mark.alone

APART = pytest.mark.skipif(sandbox_user() is None or not namespaces_work(),
                           reason="sandboxes are kept apart (IPC, network, writable folders, a user id each) only "
                                  "when the grader runs as root on a kernel that allows namespaces")

HOLD_S = 120                 # how long student A holds its sandbox (the test ends it sooner)
SHARING = "toyllm-sharing"   # the sharing fixture's name for its files, queue and socket, and its process's
SHM_KEY = 0x746F796C         # the sharing fixture's SysV shared memory key


def _named(name: str) -> list:
    return [p for p in psutil.process_iter(["name"]) if p.info["name"] == name]


def _start_holding(submission: Path, only: str, name: str) -> subprocess.Popen:
    """Grade ``submission`` (``only``) from the command line until its graded call names a process ``name``."""
    proc = subprocess.Popen([sys.executable, "-m", "toyllm", "grade", "--impl", str(submission), "--only", only,
                             "--timeout", str(HOLD_S)], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not _named(name):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"student A's grading never reached its graded call (exit code {proc.poll()})")
        time.sleep(0.5)
    return proc


def _stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mq_open.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_uint, ctypes.c_void_p]
    return libc


def _host_traces() -> list[str]:
    """What the sharing fixture left on this machine: files, its shared memory segment, its message queue."""
    found = [str(p) for folder in ("/run/lock", "/var/lock", "/tmp", "/var/tmp", "/dev/shm")
             if Path(folder).is_dir() for p in Path(folder).glob(f"{SHARING}*")]
    libc = _libc()
    if libc.shmget(SHM_KEY, 0, 0) >= 0:
        found.append(f"SysV shared memory key {SHM_KEY:#x}")
    queue = libc.mq_open(f"/{SHARING}".encode(), os.O_RDONLY, 0, None)
    if queue >= 0:
        libc.mq_close(queue)
        found.append(f"POSIX message queue /{SHARING}")
    return sorted(set(found))


def _clean_host() -> None:
    """Remove what the sharing fixture may have left (only where the grader failed to contain it)."""
    for trace in _host_traces():
        if trace.startswith("/"):
            Path(trace).unlink(missing_ok=True)
    libc = _libc()
    shm = libc.shmget(SHM_KEY, 0, 0)
    if shm >= 0:
        libc.shmctl(shm, 0, None)                   # IPC_RMID
    libc.mq_unlink(f"/{SHARING}".encode())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _reported(report, prefix: str) -> list[str]:
    return [re.search(prefix + r".*", t.output).group(0) for t in report.tests if prefix in t.output]


# --------------------------------------------------------------------------- the sandbox's own user id

@pytest.mark.timeout(30)
def test_each_sandbox_gets_a_user_id_no_account_group_or_process_has():
    ids = {unused_id() for _ in range(5)}
    if None in ids:
        pytest.skip("this user namespace maps no id of the sandbox range")
    assert len(ids) == 5                            # drawn afresh each time
    in_use = {p.info["uids"].real for p in psutil.process_iter(["uids"]) if p.info["uids"]}
    for uid in ids:
        assert uid in ID_RANGE and uid not in in_use
        with pytest.raises(KeyError):
            pwd.getpwuid(uid)
        with pytest.raises(KeyError):
            grp.getgrgid(uid)


@pytest.mark.timeout(30)
def test_every_world_writable_folder_within_reach_is_found():
    """The scan finds the conventional ones where they exist (followed through links), and only the topmost."""
    found = writable_folders()
    for folder in ("/tmp", "/var/tmp", "/dev/shm", "/run/lock", "/var/lock"):
        if Path(folder).is_dir():
            assert Path(folder).resolve() in found, (folder, found)
    assert not [p for p in found if any(q in p.parents for q in found)], found


# --------------------------------------------------------------------------- attacks through the real grader

@APART
@pytest.mark.grader
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_nothing_crosses_from_one_grading_to_the_next_while_it_lives_or_after(tmp_path):
    """Student A leaves a marker in /run/lock, /var/lock, the temporary folders, SysV shared memory and a
    POSIX message queue, serves it on an abstract unix socket and on 127.0.0.1, and sends it to a listener
    of the host's. Student B, graded while A still runs and again after A's grading ended, finds nothing;
    the host's listener heard nothing; nothing is left on the machine."""
    _clean_host()
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.setblocking(False)
        ports = {"host_port": str(listener.getsockname()[1]), "peer_port": str(_free_port())}
        writer = make_submission(tmp_path / "a", "sharing", hold_s=str(HOLD_S), **ports)
        reader = make_submission(tmp_path / "b", "sharing", hold_s="0", **ports)
        try:
            student_a = _start_holding(writer, "3.1", SHARING)
            try:
                during = _reported(grade(reader, only="3.2"), "sharing-found")
            finally:
                _stop(student_a)
            after = _reported(grade(reader, only="3.2"), "sharing-found")
            left = _host_traces()
            try:
                heard = listener.accept()[0].recv(4096)
            except BlockingIOError:
                heard = b""
        finally:
            _clean_host()
    assert during and all(found == "sharing-found nothing" for found in during), during
    assert after and all(found == "sharing-found nothing" for found in after), after
    assert heard == b"", f"the sandbox reached a listener of the host's and sent {heard!r}"
    assert left == [], left


# Appended to the model answer: Exercise 3.1 still right, its work done in a thread of its own (a thread counts
# against the process limit as a process does; the engine's lessons start processes, which cost more to grade).
IN_A_THREAD = """
import concurrent.futures

_by_the_formula = matmul_intensity


def matmul_intensity(*args, **kwargs):
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(_by_the_formula, *args, **kwargs).result()
"""


@APART
@pytest.mark.grader
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_grading_that_holds_every_process_it_may_does_not_starve_another(tmp_path):
    """Student A forks up to its process limit and holds the processes; student B's correct answer,
    which starts a thread, keeps full marks meanwhile, and A's processes end with A's grading."""
    starving = make_submission(tmp_path / "a", "starving", hold_s=str(HOLD_S))
    correct = tmp_path / "b"
    correct.mkdir()
    (correct / "ex03_rooflines.py").write_text((ROOT / "solutions" / "ex03_rooflines.py").read_text() + IN_A_THREAD)
    student_a = _start_holding(starving, "3.1", "toyllm-starving")
    try:
        held = len(_named("toyllm-starve"))
        assert held >= 200, f"the starving fixture held only {held} processes: did it reach its limit?"
        report = grade(correct, only="3.1")
    finally:
        _stop(student_a)
    assert report.by_exercise()["3.1"] == (2, 2), [t.output[:300] for t in report.tests]
    deadline = time.monotonic() + 20              # the kernel ends a namespace's processes one by one
    while _named("toyllm-starve") and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _named("toyllm-starve")


# --------------------------------------------------------------------------- what a grading leaves behind

CONTAINED = pytest.mark.skipif(sandbox_user() is None or not namespaces_work(),
                               reason="processes and temporary files are contained only when the grader runs as "
                                      "root on a kernel that allows PID and mount namespaces")


def _escaped(watch_s: float = 2.0) -> list[str]:
    """Command lines of the ``escaping`` fixture's processes seen anywhere on the machine within ``watch_s``.

    Each generation lives about 10 ms, so one look at the process table can miss them all: keep looking.
    """
    import psutil

    seen: list[str] = []
    deadline = time.monotonic() + watch_s
    while not seen and time.monotonic() < deadline:
        seen = [" ".join(p.info["cmdline"]) for p in psutil.process_iter(["cmdline"])
                if "toyllm-escape-marker" in (p.info["cmdline"] or [])]
    return seen


def _left_behind() -> list[str]:
    """Files the ``escaping`` fixture wrote that outlived its sandbox, and sandbox scratch folders."""
    found = []
    for folder in ("/tmp", "/var/tmp", "/dev/shm", tempfile.gettempdir()):
        found += [str(p) for p in Path(folder).glob("toyllm-escape-marker*")]
    return sorted(set(found))


def _scratch_folders() -> set[str]:
    return {str(p) for p in Path(tempfile.gettempdir()).glob("toyllm-sandbox-*")} | \
        {str(p) for p in Path(tempfile.gettempdir()).glob("toyllm-grade-*")}


@CONTAINED
@pytest.mark.grader
@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_process_that_keeps_reforking_dies_with_its_sandbox_and_temporary_files_vanish(tmp_path):
    """The submission starts a process that forks a new generation every 10 ms in a new session, and fills
    /tmp, /var/tmp and /dev/shm: nothing of it is left once grading is over, and each folder took only
    what its size limit allows."""
    scratch_before, files_before = _scratch_folders(), set(_left_behind())     # an older run's, not this one's
    submission = make_submission(tmp_path / "sub", "escaping")
    report = grade(submission, only="3.1")
    assert report.by_exercise()["3.1"][0] == 0
    filled = dict(re.findall(r"(/[\w/]+)=(\d+)MiB", next(t.output for t in report.tests if "fill-report" in t.output)))
    assert set(filled) == {"/tmp", "/var/tmp", "/dev/shm"}, filled
    assert all(int(mib) <= 256 for mib in filled.values()), filled        # the private folders' size limit
    time.sleep(1)
    assert not _escaped()
    assert not set(_left_behind()) - files_before
    assert _scratch_folders() <= scratch_before
    again = grade("solutions", only="3.1")                                   # the next student is untouched
    assert again.by_exercise()["3.1"] == (2, 2)


def _spinning(grader: subprocess.Popen, within_s: float = 30.0) -> bool:
    """Whether a sandbox of this grading keeps a core busy (the ``hanging`` fixture's loop) within ``within_s``:
    at least half of a 0.5 s look."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        sandboxes = []
        for p in psutil.Process(grader.pid).children(recursive=True):
            try:
                if p.name() == SANDBOX_NAME:
                    sandboxes.append((p, sum(p.cpu_times()[:2])))
            except psutil.Error:
                pass
        time.sleep(0.5)
        for p, before in sandboxes:
            try:
                if sum(p.cpu_times()[:2]) - before >= 0.25:
                    return True
            except psutil.Error:
                pass
    return False


def _serving(grader: subprocess.Popen) -> bool:
    """Has a sandbox of this grading started serving? (``server.serve`` names its process ``NAME``.)"""
    import psutil

    for p in psutil.Process(grader.pid).children(recursive=True):
        try:
            if p.name() == SANDBOX_NAME:
                return True
        except psutil.Error:                        # gone, or a zombie, meanwhile
            pass
    return False


@pytest.mark.grader
@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("fixture", ["hanging", "escaping"])
def test_sigterm_to_the_grader_ends_every_process_it_started(tmp_path, fixture):
    """SIGTERM while a submission's call hangs: the grader, its test process, the sandbox and whatever the
    submission started (``escaping`` keeps re-forking in new sessions) are gone, and so are the scratch
    folders."""
    import psutil

    if fixture == "escaping" and (sandbox_user() is None or not namespaces_work()):
        pytest.skip("a re-forking process is contained only as root with PID namespaces")
    scratch_before = _scratch_folders()
    submission = make_submission(tmp_path / "sub", fixture)
    proc = subprocess.Popen([sys.executable, "-m", "toyllm", "grade", "--impl", str(submission), "--only", "3.2",
                             "--timeout", "60"], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        started = []
        while time.monotonic() < deadline:          # wait until the sandbox serves (then runs the hanging call)
            if _serving(proc):
                break
            time.sleep(0.5)
        else:
            pytest.fail("the grader never started its sandbox within 60 s")
        if fixture == "escaping":
            assert _escaped(watch_s=30), "the re-forking process never started"
        else:
            assert _spinning(proc), "the sandbox never started the hanging call (a loop that keeps a core busy)"
        started = psutil.Process(proc.pid).children(recursive=True)
        assert len(started) >= 2, "expected the pytest process and the sandbox"
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        gone, alive = psutil.wait_procs(started, timeout=10)
        assert not alive, [p.cmdline() for p in alive]
        time.sleep(1)
        assert not _escaped()
        assert _scratch_folders() <= scratch_before
    finally:
        proc.kill()
