"""llama.cpp beside toyllm: a client for ``llama_worker.py``, which runs llama.cpp in a process of its own.

llama.cpp comes from llama-cpp-python, an optional install that is never
in toyllm's lock: it compiles llama.cpp from source (10-25 minutes), so it
usually lives in a virtual environment of its own. Which interpreter runs
it (``llama_python``): the one named by the environment variable
``TOYLLM_LLAMA_PYTHON`` if set, else this one if it can import
``llama_cpp``, else none, and ``install_hint`` says how to get one.

``LlamaCpp`` starts the worker on a GGUF file and asks it to decode or to
prefill token ids; the benchmark sections give llama.cpp the same file and
the same ids as toyllm. Every read from the worker has a time limit, and a
worker that dies or hangs raises ``LlamaCppError`` naming what happened,
with the last lines it wrote to stderr: a llama.cpp built for instructions
this CPU lacks dies at its first token, and that must cost a benchmark one
row, not the report. All times are in seconds.
"""
from __future__ import annotations

import collections
import importlib.util
import json
import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Sequence

LLAMA_PYTHON_ENV = "TOYLLM_LLAMA_PYTHON"
WORKER = Path(__file__).with_name("llama_worker.py")

INSTALL = ("llama.cpp is not installed: it is optional and never in toyllm's lock. Install llama-cpp-python in "
           "an environment of its own, `python3.11 -m venv llama-venv && llama-venv/bin/pip install "
           "llama-cpp-python` (it compiles llama.cpp: 10-25 minutes; on an Intel host with AMX a native build "
           "died with an illegal instruction at the first token, and one built with "
           "`CMAKE_ARGS=\"-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON\"` "
           "before the pip command runs), then point toyllm at it: "
           f"`{LLAMA_PYTHON_ENV}=llama-venv/bin/python python -m toyllm bench --only weights`.")

# What a worker's error message quotes of its stderr: enough for a traceback's last frames and its message.
STDERR_TAIL_LINES = 20


def llama_python() -> str | None:
    """The interpreter that runs llama.cpp: ``$TOYLLM_LLAMA_PYTHON`` (a path) if set, else this interpreter if
    it can import ``llama_cpp``, else None. The variable is taken as given: a path that is not an
    interpreter with llama_cpp shows up when the worker starts (``LlamaCppError``)."""
    named = os.environ.get(LLAMA_PYTHON_ENV, "").strip()
    if named:
        return named
    if importlib.util.find_spec("llama_cpp") is not None:
        return sys.executable
    return None


def install_hint() -> str:
    """The sentence a benchmark prints where llama.cpp's row would be: how to install it and point toyllm at it."""
    return INSTALL


class LlamaCppError(RuntimeError):
    """The llama.cpp worker failed to start, died, hung past its time limit, or answered with an error."""


class LlamaCpp:
    """llama.cpp on one GGUF file, in a worker process: a context manager.

    ::

        with LlamaCpp(find_smollm2_gguf()) as llama:
            reply = llama.decode(ids, 32)        # {"tokens": [...], "step_s": [...], "prefill_s": ...}
            seconds = llama.prefill(ids)

    python: the interpreter (default ``llama_python()``); threads: llama.cpp's
    threads, for decode and prefill alike; context: the tokens its context
    holds (a request longer than that fails with the worker's error);
    start_timeout_s: seconds to wait for the worker's ready line (loading
    the file); timeout_s: seconds to wait for each answer. ``version`` and
    ``system_info`` are llama.cpp's, from the ready line: the CPU features
    its kernels were built for.
    """

    def __init__(self, gguf: str | os.PathLike, *, python: str | None = None, threads: int = 2, context: int = 8192,
                 start_timeout_s: float = 120.0, timeout_s: float = 600.0, worker: str | os.PathLike = WORKER):
        python = python or llama_python()
        if python is None:
            raise LlamaCppError(install_hint())
        self.command = [python, str(worker), str(gguf), "--threads", str(threads), "--context", str(context)]
        self.threads, self.context = threads, context
        self.timeout_s = timeout_s
        self.version = self.system_info = ""
        self._stderr: collections.deque[str] = collections.deque(maxlen=STDERR_TAIL_LINES)
        self._lines: queue.Queue[str | None] = queue.Queue()
        try:
            # Its OpenMP threads keep their default, spinning between operators: with OMP_WAIT_POLICY=PASSIVE
            # they sleep at each of a step's many barriers, and its decode ran 2.6x slower here (measured).
            self._proc = subprocess.Popen(self.command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True, bufsize=1)
        except OSError as exc:                          # no such interpreter, or not executable
            raise LlamaCppError(f"could not start the llama.cpp worker with {python!r}: {exc}. {install_hint()}") \
                from exc
        # Two reader threads: a read with a time limit is a queue.get with a timeout, and stderr is drained
        # all along (a worker writing more than a pipe holds would otherwise block there).
        threading.Thread(target=self._pump, args=(self._proc.stdout, self._lines.put, True), daemon=True).start()
        self._stderr_reader = threading.Thread(target=self._pump, args=(self._proc.stderr, self._stderr.append),
                                               daemon=True)
        self._stderr_reader.start()
        try:
            ready = self._read("start (loading the GGUF file)", start_timeout_s)
            if not ready.get("ready"):
                raise LlamaCppError(f"the llama.cpp worker's first line was not its ready line: {ready}")
        except BaseException:
            self.close()
            raise
        self.version, self.system_info = str(ready.get("version", "")), str(ready.get("system_info", "")).strip()

    @staticmethod
    def _pump(stream, put, mark_end: bool = False) -> None:
        """Hand each line of ``stream`` to ``put``; at its end close it, and put None if ``mark_end``."""
        with stream:
            for line in stream:
                put(line.rstrip("\n"))
        if mark_end:                                    # stdout closed: the worker has ended
            put(None)

    def _tail(self) -> str:
        """The last lines the worker wrote to stderr, as the end of an error message."""
        if self._proc.poll() is not None:
            self._stderr_reader.join(timeout=2)         # an ended worker's last lines may still be in the pipe
        lines = [line for line in self._stderr if line.strip()]
        return "; its stderr ended with:\n  " + "\n  ".join(lines) if lines else "; it wrote nothing to stderr"

    def _died(self, during: str) -> LlamaCppError:
        try:
            status = self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:               # stdout closed, the process still there
            status = None
        if status is not None and status < 0:
            try:
                how = f"killed by signal {signal.Signals(-status).name}"   # SIGILL: built for another CPU
            except ValueError:
                how = f"killed by signal {-status}"
        else:
            how = f"exit status {status}" if status is not None else "its output closed"
        return LlamaCppError(f"the llama.cpp worker died during {during} ({how}){self._tail()}")

    def _read(self, during: str, timeout_s: float) -> dict:
        """The worker's next reply, waiting at most ``timeout_s`` seconds; a hung worker is killed."""
        try:
            line = self._lines.get(timeout=timeout_s)
        except queue.Empty:
            self._proc.kill()
            self._proc.wait()
            raise LlamaCppError(f"the llama.cpp worker gave no answer to {during} within {timeout_s:g} s, so it "
                                f"was stopped{self._tail()}") from None
        if line is None:
            raise self._died(during)
        try:
            reply = json.loads(line)
        except json.JSONDecodeError:
            raise LlamaCppError(f"the llama.cpp worker answered {during} with a line that is not JSON: "
                                f"{line[:200]!r}{self._tail()}") from None
        if isinstance(reply, dict) and "error" in reply:
            raise LlamaCppError(f"llama.cpp failed at {during}: {reply['error']}")
        return reply

    def _ask(self, request: dict, during: str) -> dict:
        if self._proc.poll() is not None:
            raise self._died(during)
        try:
            self._proc.stdin.write(json.dumps(request) + "\n")
            self._proc.stdin.flush()
        except (BrokenPipeError, ValueError):           # ValueError: stdin already closed
            raise self._died(during) from None
        return self._read(during, self.timeout_s)

    def decode(self, ids: Sequence[int], new_tokens: int) -> dict:
        """Greedy decode after prefilling ``ids`` into an empty cache: ``new_tokens`` tokens.

        Returns "tokens" (the ``new_tokens`` ids, the first from the prefill),
        "step_s" (seconds of each decode step after the first token, one token
        each: ``new_tokens - 1`` of them) and "prefill_s" (seconds).
        """
        reply = self._ask({"op": "decode", "ids": [int(t) for t in ids], "new_tokens": int(new_tokens)},
                          f"a decode of {new_tokens} tokens after {len(ids)}")
        return {"tokens": [int(t) for t in reply["tokens"]], "step_s": [float(s) for s in reply["step_s"]],
                "prefill_s": float(reply["prefill_s"])}

    def prefill(self, ids: Sequence[int]) -> float:
        """Seconds llama.cpp takes to prefill ``ids`` into an empty cache (in batches of 512 tokens)."""
        return float(self._ask({"op": "prefill", "ids": [int(t) for t in ids]}, f"a prefill of {len(ids)} tokens")
                     ["seconds"])

    def close(self, timeout_s: float = 10.0) -> None:
        """Ask the worker to quit; kill it if it has not ended within ``timeout_s`` seconds."""
        if self._proc.poll() is None:
            try:
                self._proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self._proc.stdin.close()
            except (BrokenPipeError, ValueError, OSError):
                pass
            try:
                self._proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        try:
            self._proc.stdin.close()          # stdout and stderr are closed by their reader threads at their end
        except (BrokenPipeError, OSError, ValueError):
            pass

    def __enter__(self) -> "LlamaCpp":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def start_llama(gguf, **kwargs) -> tuple[LlamaCpp | None, str]:
    """llama.cpp for a benchmark section: (a started ``LlamaCpp``, "") or (None, why not), the install
    sentence when no interpreter has it, the worker's error when it would not start."""
    if llama_python() is None:
        return None, install_hint()
    try:
        return LlamaCpp(gguf, **kwargs), ""
    except LlamaCppError as exc:
        return None, str(exc)
