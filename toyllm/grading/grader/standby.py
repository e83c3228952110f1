"""A trusted pytest process started ahead, so that checking an exercise again does not wait for Python.

``run.Standby`` starts ``python -m toyllm.grading.grader.standby`` with the
settings that do not change between checks (the sandbox's memory limit,
the folders it must not see). It imports torch, pytest, the grading plugin
and the engine, starts a sandbox ahead (``sandbox.prestart``: a process
that has imported torch and holds neither a submission nor an answer),
and then waits for one line on its standard input: the pytest arguments,
the environment, the working folder and the output file of the lesson to
grade. It runs them exactly as ``python -m pytest`` would, once, and exits.
"""
from __future__ import annotations

import gc
import json
import os
import sys


def main() -> None:
    import pytest
    import pytest_timeout  # noqa: F401
    import torch  # noqa: F401  (what takes the time)

    import toyllm.grading.sandbox.harness  # noqa: F401
    import toyllm.parallel  # noqa: F401

    from ... import answers
    from . import plugin  # noqa: F401
    from ..sandbox import process as sandbox

    answers.answer_marks()            # the marks are read from toyllm's source once per process
    sandbox.prestart()
    gc.freeze()                       # what is imported stays: pytest's garbage collections skip it
    line = sys.stdin.readline()
    if not line:                          # nobody came: end quietly (the sandbox ends with this process)
        sandbox.close()
        return
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
    os._exit(int(code))


if __name__ == "__main__":
    main()
