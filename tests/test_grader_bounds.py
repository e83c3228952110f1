"""What a submission cannot make the grader do: grow without bound, draw on the terminal, leave the hidden
tests behind, or exit with the wrong code.

The attacks live in tests/fixtures/submissions/ (``inflating``, ``flooding``, ``drawing``); each grades
Exercise 1.1 only, through ``python -m toyllm grade`` as an instructor runs it.
"""
from __future__ import annotations

import io
import json
import os
import pickle
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
import torch

from toyllm.grading.sandbox import wire
from toyllm.grading.grader.report import TestResult, printable

ROOT = Path(__file__).resolve().parent.parent
SUBMISSIONS = ROOT / "tests" / "fixtures" / "submissions"
PEAK_RSS_MIB = 700          # the grader and its trusted pytest process import torch: about 250 MiB each

# Reports the peak resident memory of every process the grade command started (they are all waited for).
PEAK = ("import resource, subprocess, sys; code = subprocess.run(sys.argv[1:]).returncode; "
        "print(f'peak_rss_mib={resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss // 1024}', file=sys.stderr); "
        "sys.exit(code)")


def grade_command(impl, *options) -> list[str]:
    return [sys.executable, "-m", "toyllm", "grade", "--impl", str(impl), *options]


def grade_measured(tmp_path, fixture) -> tuple[str, dict, int]:
    """Grade Exercise 1.1 of a fixture: (what the terminal shows, results.json's text, peak RSS in MiB)."""
    results = tmp_path / "results.json"
    done = subprocess.run([sys.executable, "-c", PEAK, *grade_command(SUBMISSIONS / fixture, "--only", "1.1",
                                                                       "--results", str(results))],
                          cwd=ROOT, capture_output=True, timeout=280)
    stderr = done.stderr.decode(errors="replace")
    assert done.returncode == 0, stderr[-3000:]
    peak = int(re.search(r"peak_rss_mib=(\d+)", stderr)[1])
    return done.stdout.decode(errors="replace") + stderr, results.read_bytes(), peak


# --------------------------------------------------------------------------- the reply and the output, unit by unit

def test_a_deflated_reply_is_refused_before_it_is_inflated():
    sys.path.insert(0, str(SUBMISSIONS / "inflating"))
    try:
        import ex01_naive_generation as inflating
    finally:
        sys.path.pop(0)
    frame = inflating._inflating_reply()
    assert len(frame) < 2**20                                  # 512 MiB once inflated
    with pytest.raises(wire.ReplyTooLarge, match="compressed records"):
        wire.from_sandbox(frame)


def test_shared_references_in_a_reply_cannot_multiply():
    """A pickle of a few KiB whose lists share one another would rebuild 2**40 values."""
    value = ["x"]
    for _ in range(40):
        value = {"~": "list", "v": [value, value]}
    frame = io.BytesIO()
    torch.save({"~": "dict", "v": [["ok", True], ["value", value]]}, frame)
    assert len(frame.getvalue()) < 2**14
    with pytest.raises(wire.ReplyTooLarge, match="values"):
        wire.from_sandbox(frame.getvalue())


def test_a_reply_over_the_size_limit_is_refused_from_its_length_alone():
    import socket

    grader, sandbox = socket.socketpair()
    with grader, sandbox:
        sandbox.sendall(wire._LENGTH.pack(wire.MAX_REPLY_BYTES + 1))       # the frame itself never comes
        with pytest.raises(wire.ReplyTooLarge, match=r"was 256 MiB; at most 256 MiB"):
            wire.recv_reply(grader)


def test_replies_of_ordinary_values_still_come_back():
    value = {"ids": [1, 2, 3], "t": torch.arange(6.0).view(2, 3), "b": b"\x00\xff", "name": "ok\n"}
    again = wire.from_sandbox(wire.to_grader(value))
    assert again["ids"] == [1, 2, 3] and again["b"] == b"\x00\xff" and torch.equal(again["t"], value["t"])
    assert pickle.dumps(again["name"]) == pickle.dumps("ok\n")


def test_control_characters_are_written_out_where_outcomes_enter_the_report():
    forged = "no\x1b[2K\x1b[1A\rTOTAL 15 15\x9b2J\u202e\x00\tend\n"
    result = TestResult(name="Exercise 1.1: x\x1b[31m", nodeid="n", exercise="1.1", score=0, max_score=1,
                        status="failed", output=forged)
    assert result.output == "no\\x1b[2K\\x1b[1A\\rTOTAL 15 15\\x9b2J\\u202e\\x00\tend\n"
    assert result.name == "Exercise 1.1: x\\x1b[31m"
    assert printable("plain text, tabs\tand newlines\n") == "plain text, tabs\tand newlines\n"


# --------------------------------------------------------------------------- the attacks, graded

@pytest.mark.grader
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_inflating_reply_fails_its_test_and_the_grader_stays_small(tmp_path):
    shown, results, peak = grade_measured(tmp_path, "inflating")
    assert "1.1              0     2  0/2" in shown, shown[-2000:]
    assert "the submission's reply holds compressed records" in shown, shown[-2000:]
    assert peak < PEAK_RSS_MIB, f"a process of the grader reached {peak} MiB"


@pytest.mark.grader
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_300_mib_of_prints_keep_the_points_and_the_grader_stays_small(tmp_path):
    shown, results, peak = grade_measured(tmp_path, "flooding")
    assert "1.1              2     2  2/2" in shown, shown[-2000:]       # the sandbox's file-size limit is per call
    assert peak < PEAK_RSS_MIB, f"a process of the grader reached {peak} MiB"


@pytest.mark.grader
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_terminal_escapes_in_messages_reach_neither_the_terminal_nor_results_json(tmp_path):
    shown, results, peak = grade_measured(tmp_path, "drawing")
    results = json.loads(results)                 # what Gradescope shows is the decoded text
    for where, text in (("the terminal", shown), ("results.json", results["output"] + results["tests"][0]["output"])):
        assert not re.search("[\x1b\r\x9b]", text), f"an escape reached {where}"
        assert "\\x1b[32mTOTAL           15    15" in text, f"nothing written out in {where}"
    assert "TOTAL            0     2" in shown


# --------------------------------------------------------------------------- signals: what is left, the exit code

HIDDEN = '''
    import time

    import pytest


    @pytest.mark.exercise("1.1")
    @pytest.mark.points(1)
    def test_hidden_takes_its_time():
        time.sleep(120)
    '''


def start_grading(tmp_path) -> tuple[subprocess.Popen, Path]:
    """A grade run of lessons 01 and 02 with a hidden test that sleeps, caught once lesson 01's tests run
    (the hidden tests copied, the next lesson's standby started); its temporary folder is its own."""
    hidden, temp = tmp_path / "hidden", tmp_path / "temp"
    hidden.mkdir()
    temp.mkdir()
    (hidden / "test_ex01_hidden.py").write_text(textwrap.dedent(HIDDEN))
    proc = subprocess.Popen(grade_command("solutions", "--only", "1.1,2.1", "--extra-tests", str(hidden),
                                          "--timeout", "150"),
                            cwd=ROOT, env=dict(os.environ, TMPDIR=str(temp)), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 120
    # Lesson 01's pytest process has collected its tests once the grader's log of ex01 holds a line.
    while not (list(temp.glob("toyllm-grade-*/**/test_ex01_hidden.py")) and list(temp.glob("toyllm-standby-*"))
               and any(log.stat().st_size for log in temp.glob("toyllm-grade-*/ex01.jsonl"))):
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        assert time.monotonic() < deadline, "grading never reached lesson 01's tests"
        time.sleep(0.2)
    time.sleep(2)
    return proc, temp


def _alive(proc) -> list[psutil.Process]:
    try:
        return [p for p in psutil.Process(proc.pid).children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE]
    except psutil.Error:
        return []


def assert_nothing_left(started: list[psutil.Process], temp: Path) -> None:
    deadline = time.monotonic() + 10
    while True:
        alive = [p for p in started if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        left = sorted(p.name for p in temp.iterdir())
        if not alive and not left:
            return
        assert time.monotonic() < deadline, f"left behind: {left}, processes {[p.cmdline() for p in alive]}"
        time.sleep(0.2)


@pytest.mark.grader
@pytest.mark.slow
@pytest.mark.timeout(200)
def test_sigkill_to_the_grader_leaves_no_copy_of_the_hidden_tests(tmp_path):
    proc, temp = start_grading(tmp_path)
    started = _alive(proc)
    proc.kill()
    assert proc.wait(timeout=10) == -signal.SIGKILL
    assert_nothing_left(started, temp)


@pytest.mark.grader
@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130), (signal.SIGHUP, 129)])
def test_a_stop_signal_ends_grading_with_its_documented_exit_code(tmp_path, sig, code):
    proc, temp = start_grading(tmp_path)
    started = _alive(proc)
    proc.send_signal(sig)
    assert proc.wait(timeout=30) == code, proc.stderr.read().decode()[-2000:]
    assert "Traceback" not in proc.stderr.read().decode()
    assert_nothing_left(started, temp)
