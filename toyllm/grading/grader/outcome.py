"""Reading the trusted pytest process's event log into a status and a message per graded test."""
from __future__ import annotations

import json
from pathlib import Path


def read_log(log: Path) -> list[dict]:
    """The plugin's events, one JSON object per line (a line cut short by a crash is skipped)."""
    events = []
    if log.exists():
        for line in log.read_text().splitlines():
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:      # a line cut short by a crash
                pass
    return events


def classify(message: str, default: str) -> tuple[str, str]:
    """(status, message a student can act on) of a failed phase."""
    for prefix in ("AssertionError: ", "Failed: ", "toyllm.grading.sandbox.guard.IndependenceError: ",
                   "toyllm.grading.sandbox.wire.ReplyTooLarge: "):
        message = message.removeprefix(prefix)
    for name, status in (("SubmissionTimeout", "timeout"), ("SubmissionCrash", "crashed"),
                         ("SubmissionError", default)):
        prefix = f"toyllm.grading.sandbox.process.{name}: "
        if message.startswith(prefix):
            return status, message.removeprefix(prefix)
    if "Timeout (>" in message:
        return "timeout", message
    return default, message


def outcome(phases: dict[str, dict]) -> tuple[str, str]:
    """(status, message) of one test from its setup/call/teardown reports; "died" if the process ended in it."""
    setup, call, teardown = phases.get("setup"), phases.get("call"), phases.get("teardown")
    if setup and setup["outcome"] == "failed":
        return classify(setup["message"], "error")
    if setup and setup["outcome"] == "skipped":
        return "skipped", "skipped: " + setup["message"]
    if call is None or teardown is None:
        return "died", ""                    # the test process itself ended during this test
    if call["outcome"] == "failed":
        return classify(call["message"], "failed")
    if call["outcome"] == "skipped":
        return "skipped", "skipped: " + call["message"]
    if teardown["outcome"] == "failed":
        return "error", teardown["message"]
    return "passed", "passed"
