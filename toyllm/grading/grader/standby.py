"""A trusted pytest process started ahead, so that the next lesson, or checking again, does not wait for Python.

``run.Standby`` starts one with the settings that do not change between
lessons (the sandbox's memory limit, the folders it must not see). It has
imported torch, pytest, the grading plugin and the engine (``load``),
starts a sandbox ahead (``sandbox.prestart``: a process that has imported
torch and holds neither a submission nor an answer), and then waits for
one line on its standard input: the pytest arguments, the environment, the
working folder and the output file of the lesson to grade. It runs them
exactly as ``python -m pytest`` would, once, and exits (``serve``).

It starts one of two ways:

- a fresh Python, ``python -m toyllm.grading.grader.standby`` (``main``);
- a copy of the grading's *template* (``from_template``): a zygote
  (``toyllm.grading.sandbox.zygote``) that the grading process started
  once, which imported torch and toyllm's framework and nothing of the
  tests. The copy first forks its own zygote for its lesson's sandboxes,
  before it imports pytest or learns what it will grade, and only then
  loads the rest. So a lesson costs neither a Python that imports torch and
  pytest, nor a zygote that imports torch again (about 2.5 CPU-seconds a
  lesson on the course's reference machine). ``grade`` on the command
  line grades so (``grade(template=True)``); the copy runs
  ``python -m toyllm.grading.grader.standby --from-template`` as the
  template's ``module`` role.
"""
from __future__ import annotations

import gc
import json
import os
import sys
import time
from typing import BinaryIO, NoReturn

NAME = "toyllm-lesson"        # what ps -o comm shows for a copy of the template (its command line is the template's)


def load() -> None:
    """Import what a trusted pytest process needs, and read the answer marks: what takes the time."""
    import pytest  # noqa: F401
    import pytest_timeout  # noqa: F401
    import torch  # noqa: F401  (what takes the time)

    import toyllm.grading.sandbox.harness  # noqa: F401
    import toyllm.parallel  # noqa: F401

    from ... import answers
    from . import plugin  # noqa: F401

    answers.answer_marks()            # the marks are read from toyllm's source once per process


def serve(requests: BinaryIO) -> NoReturn:
    """Start a sandbox ahead, wait for one request on ``requests`` and run pytest as it says; exit with its code."""
    import pytest

    from ..sandbox import process as sandbox

    sandbox.prestart()
    gc.freeze()                       # what is imported stays: pytest's garbage collections skip it
    line = requests.readline()
    if not line:                          # nobody came: end quietly
        _end_children()
        os._exit(0)
    request = json.loads(line)
    os.chdir(request["cwd"])
    os.environ.update(request["env"])
    out = os.open(request["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    code = pytest.main(request["args"])
    sys.stdout.flush()
    sys.stderr.flush()
    _end_children()
    os._exit(int(code))


def _end_children() -> None:
    """End this process's sandbox and zygote and wait for what they leave: what died below this process
    unwaited would be re-parented to the grading process (a child subreaper, as this one is too) when this one
    exits, and stay there as a zombie for as long as that runs (a notebook's kernel)."""
    from ..sandbox import process as sandbox

    sandbox.close()
    sandbox.zygotes.end()
    deadline = time.monotonic() + 1.0            # they were killed: they are gone at once
    while time.monotonic() < deadline:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:                 # no child left
            return
        if pid == 0:
            time.sleep(0.002)


def from_template() -> NoReturn:
    """In a copy of the template: this lesson's zygote, forked before this process imports pytest or learns what
    it will grade, then the standby."""
    from ...supervise import name_process
    from ..sandbox import process as sandbox
    from ..sandbox import zygote

    name_process(NAME)
    sandbox.zygotes.use(sandbox.Zygote.fork(zygote.serve))
    load()
    serve(sys.stdin.buffer)


def main(argv: list[str]) -> None:
    if argv == ["--from-template"]:
        from_template()
    load()
    serve(sys.stdin.buffer)


if __name__ == "__main__":
    main(sys.argv[1:])
