"""llama.cpp beside toyllm: the client of the llama.cpp worker, and the sections that use it.

No llama.cpp here: the real worker script (toyllm/bench/llama_worker.py) runs
against a stand-in ``llama_cpp`` module put first on its PYTHONPATH, which
answers like llama-cpp-python (greedy logits: the next token is the last one
plus one) and can be told to die, hang or fail. Nothing is timed.
"""
import os
import sys
import time
from types import SimpleNamespace

import pytest

from toyllm.bench import llama as llama_mod
from toyllm.bench.llama import LLAMA_PYTHON_ENV, LlamaCpp, LlamaCppError, install_hint, llama_python, start_llama
from toyllm.measure import compare, spread

FAKE_LLAMA_CPP = '''
"""A stand-in for llama-cpp-python: the parts of its API the worker uses. FAKE_LLAMA_MODE says how it behaves."""
import ctypes
import os
import signal
import sys
import time

__version__ = "0.0-fake"
VOCAB = 64
MODE = os.environ.get("FAKE_LLAMA_MODE", "ok")


def llama_print_system_info():
    return b"CPU : FAKE = 1 | "


class _Context:
    def __init__(self):
        self.logits = (ctypes.c_float * VOCAB)()
        self.ctx = ctypes.cast(self.logits, ctypes.POINTER(ctypes.c_float))


def llama_get_logits_ith(ctx, i):
    return ctx


class Llama:
    def __init__(self, path, n_ctx, n_batch, n_threads, n_threads_batch, verbose):
        print("fake llama.cpp: a line on stdout from the library", flush=True)   # must not reach the protocol
        self.n_ctx, self.n_tokens, self._ctx = n_ctx, 0, _Context()

    def n_vocab(self):
        return VOCAB

    def reset(self):
        self.n_tokens = 0

    def eval(self, ids):
        if MODE == "hang":
            time.sleep(3600)
        if MODE == "die_prefill" or (MODE == "die_step" and len(ids) == 1):
            sys.stderr.write("fake llama.cpp: illegal instruction\\n")
            sys.stderr.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        if self.n_tokens + len(ids) > self.n_ctx:
            raise RuntimeError("llama_decode returned 1")
        self.n_tokens += len(ids)
        for i in range(VOCAB):
            self._ctx.logits[i] = 0.0
        self._ctx.logits[(ids[-1] + 1) % VOCAB] = 1.0
'''


@pytest.fixture
def fake_llama(tmp_path, monkeypatch):
    """``start(mode, **kwargs)``: a LlamaCpp whose worker imports the stand-in llama_cpp module."""
    (tmp_path / "llama_cpp.py").write_text(FAKE_LLAMA_CPP)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])]))
    monkeypatch.setenv(LLAMA_PYTHON_ENV, sys.executable)
    gguf = tmp_path / "model.gguf"            # the stand-in never reads it

    def start(mode: str = "ok", **kwargs) -> LlamaCpp:
        monkeypatch.setenv("FAKE_LLAMA_MODE", mode)
        return LlamaCpp(gguf, **{"context": 64, "start_timeout_s": 60, "timeout_s": 60, **kwargs})
    start.gguf = gguf
    return start


@pytest.mark.engine
def test_decode_and_prefill_replies_parse(fake_llama):
    with fake_llama() as llama:
        assert llama.version == "0.0-fake" and "FAKE = 1" in llama.system_info and llama.threads == 2
        reply = llama.decode([5, 6, 7], 4)
        assert reply["tokens"] == [8, 9, 10, 11]                  # the first from the prefill, then 3 steps
        assert len(reply["step_s"]) == 3 and all(s >= 0 for s in reply["step_s"]) and reply["prefill_s"] >= 0
        assert isinstance(llama.prefill(list(range(40))), float)
        # a request the library refuses fails alone; the worker answers the next one
        with pytest.raises(LlamaCppError, match=r"failed at a prefill of 100 tokens: RuntimeError: llama_decode"):
            llama.prefill(list(range(100)))
        assert llama.decode([1], 2)["tokens"] == [2, 3]
        proc = llama._proc
    assert proc.poll() == 0                                      # quit on leaving the block


@pytest.mark.engine
def test_a_worker_that_dies_gives_an_error_naming_it(fake_llama):
    with fake_llama("die_step") as llama:
        with pytest.raises(LlamaCppError) as info:
            llama.decode([1, 2], 3)
        message = str(info.value)
        assert "died during a decode of 3 tokens after 2" in message and "SIGKILL" in message
        assert "fake llama.cpp: illegal instruction" in message      # its stderr's last lines
        with pytest.raises(LlamaCppError, match="died during a prefill"):   # and it stays dead, said as much
            llama.prefill([1])


@pytest.mark.engine
def test_a_hung_worker_hits_the_timeout_and_is_stopped(fake_llama):
    with fake_llama("hang", timeout_s=1) as llama:
        t0 = time.monotonic()
        with pytest.raises(LlamaCppError, match=r"gave no answer to a prefill of 3 tokens within 1 s"):
            llama.prefill([1, 2, 3])
        assert time.monotonic() - t0 < 30
        assert llama._proc.poll() is not None


@pytest.mark.engine
def test_without_llama_cpp_the_install_sentence(monkeypatch, tmp_path):
    monkeypatch.delenv(LLAMA_PYTHON_ENV, raising=False)
    monkeypatch.setattr(llama_mod.importlib.util, "find_spec", lambda name: None)
    assert llama_python() is None
    hint = install_hint()
    assert "python3.11 -m venv llama-venv && llama-venv/bin/pip install llama-cpp-python" in hint
    assert "TOYLLM_LLAMA_PYTHON=llama-venv/bin/python python -m toyllm bench --only weights" in hint
    assert "-DGGML_NATIVE=OFF" in hint and "10-25 minutes" in hint
    with pytest.raises(LlamaCppError, match="llama.cpp is not installed"):
        LlamaCpp(tmp_path / "model.gguf")
    assert start_llama(tmp_path / "model.gguf") == (None, hint)
    # a named interpreter that is not there: the error says so, with the same sentence
    monkeypatch.setenv(LLAMA_PYTHON_ENV, str(tmp_path / "no-such-python"))
    llama, why = start_llama(tmp_path / "model.gguf")
    assert llama is None and "could not start the llama.cpp worker" in why and "no-such-python" in why


@pytest.mark.engine
def test_the_weight_formats_take_turns_with_llama_cpp(fake_llama, monkeypatch):
    import toyllm.weights
    from toyllm.bench.decode import smollm2_formats

    real_load = toyllm.weights.load_model          # the tiny model in SmolLM2's place: the loop is what is tested
    monkeypatch.setattr(toyllm.weights, "load_model", lambda name, **kwargs: real_load("tiny", **kwargs))

    with fake_llama(context=256) as llama:
        data = smollm2_formats(formats=("fp32",), new_tokens=3, rounds=2, answer_tokens=4, llama=llama)
    row = data["llama"]
    assert len(row["runs_s"]) == 2 and row["tokens_per_s"] > 0 and row["version"] == "0.0-fake"
    assert row["paris"] is False and row["same_as_fp32"] is False and row["vs_fp32"].word == "undecided"
    assert "llama_error" not in data
    with fake_llama("die_step", context=256) as llama:          # a crash costs the row, not the section
        data = smollm2_formats(formats=("fp32",), new_tokens=3, rounds=1, answer_tokens=4, llama=llama)
    assert "llama" not in data and "died during a decode" in data["llama_error"] and len(data["rows"]) == 1


def _weights_data(**more) -> dict:
    from test_bench_report import _five
    from toyllm.bench import add_floor_figures

    fp32_runs, int8_runs = _five([0.039, 0.040, 0.041]), _five([0.0105, 0.0110, 0.0115])
    rows = [add_floor_figures({"format": f, "kernel": "k", "bytes_per_token": 2.7e8, "linear_bytes": 2.7e8,
                               "tokens_per_s": 1 / spread(r).median, "runs_s": r, "products_s": 0.005,
                               "products_runs_s": [0.005], "calls_per_step": 1000, "vs_fp32": compare(r, fp32_runs),
                               "paris": True, "same_as_fp32": True}, 40e9)
            for f, r in (("fp32", fp32_runs), ("int8", int8_runs))]
    return {"bandwidth_bytes_per_s": 40e9, "threads": 2, "prompt_len": 37, "new_tokens": 32, "rounds": 5,
            "attention": "dense", "rows": rows, "best": rows[1], "at_floor": [], "capability": "AVX512",
            "floor_target": 0.65, **more}


def test_the_weights_section_renders_with_and_without_llama_cpp():
    from test_bench_report import _five
    from toyllm.bench import render_section

    data = _weights_data()
    llama_runs = _five([0.0084, 0.0085, 0.0086])
    llama = {"format": "llama.cpp", "version": "0.3.36", "system_info": "CPU : AVX2 = 1 | AVX512 = 1 |", "threads": 2,
             "answer": "L'Étoile, la Cité\nla Nation", "paris": False, "runs_s": llama_runs,
             "tokens_per_s": 1 / spread(llama_runs).median, "vs_fp32": compare(llama_runs, data["rows"][0]["runs_s"]),
             "same_as_fp32": False}
    text = render_section("weights", {**data, "llama": llama, "llama_missing": "",
                                      "vs_llama": compare(data["best"]["runs_s"], llama_runs)})
    assert ("| llama.cpp (Q4_1, its own kernels) | llama.cpp 0.3.36 | - | - | 117.6 [116.3-119.0] | - "
            "| 4.71x faster | no | no |") in text, text
    assert "which does not name Paris: \"L'Étoile, la Cité la Nation\"" in text
    assert "answers Paris against llama.cpp, seconds per token: int8 11.0 ms [10.5-11.5 ms] vs llama.cpp 8.5 ms " \
           "[8.4-8.6 ms]: int8 is 1.29x slower (5 rounds, p = 0.0079)" in text, text
    assert "built for: `CPU : AVX2 = 1 | AVX512 = 1 |`" in text
    # without llama.cpp: the install sentence in place of the row, the rest as before
    text = render_section("weights", {**data, "llama_missing": install_hint()})
    assert "llama.cpp (Q4_1" not in text and "no row in this run. llama.cpp is not installed" in text
    assert 'still answers "Paris" is int8' in text
    assert "Beside llama.cpp" not in render_section("weights", data)      # older data: no llama.cpp at all


def _prefill_runs(one, parallel, llama=None):
    from test_bench_report import _five

    from toyllm.bench.prefill import LLAMA, ONE_PROCESS, PARALLEL
    runs = {ONE_PROCESS: spread(_five(one)), PARALLEL: spread(_five(parallel))}
    if llama:
        runs[LLAMA] = spread(_five(llama))
    return runs


def test_the_llama_prefill_section_renders_with_and_without_llama_cpp():
    from toyllm.bench import render_section
    from toyllm.bench.prefill import LLAMA, ONE_PROCESS, PARALLEL

    def row(C, runs):
        verdicts = {"parallel_vs_one": compare(runs[PARALLEL], runs[ONE_PROCESS])}
        if LLAMA in runs:
            verdicts.update(one_vs_llama=compare(runs[ONE_PROCESS], runs[LLAMA]),
                            parallel_vs_llama=compare(runs[PARALLEL], runs[LLAMA]))
        return {"context": C, "runs": runs, "verdicts": verdicts}

    base = {"machine": "quiet", "rounds": 5, "warmup": 1, "contexts": [1024, 8192],
            "names": {"one": ONE_PROCESS, "parallel": PARALLEL, "llama": LLAMA}}
    rows = [row(1024, _prefill_runs([0.50, 0.51, 0.52], [0.45, 0.46, 0.47], [1.10, 1.12, 1.14])),
            row(8192, _prefill_runs([27.0, 27.5, 28.0], [25.0, 25.5, 26.0]))]     # llama.cpp failed before 8k
    text = render_section("llama_prefill", {**base, "rows": rows, "llama_missing": "the worker died",
                                            "llama": {"version": "0.3.36", "system_info": "CPU : AVX2 = 1 |",
                                                      "threads": 2}})
    assert "| 1024 | 0.510 [0.500-0.520] | 0.460 [0.450-0.470] | 1.120 [1.100-1.140] | 2.20x faster | 2.43x faster |" \
        in text, text
    assert "| 8192 | 27.500 [27.000-28.000] | 25.500 [25.000-26.000] | - | - | - | 1.08x faster |" in text, text
    assert "toyllm (1 process) is 2.20x faster (5 rounds" in text and "llama.cpp 0.3.36 with 2 threads" in text
    assert "llama.cpp failed during this run, so its column stops there: the worker died" in text
    text = render_section("llama_prefill", {**base, "rows": rows[1:], "llama": None, "llama_missing": install_hint()})
    assert "No llama.cpp column in this run. llama.cpp is not installed" in text and "| 8192 | 27.500" in text


@pytest.mark.engine
def test_the_llama_prefill_section_takes_turns_and_survives_a_dying_llama(fake_llama, monkeypatch):
    """The section's loop with its toyllm runs stubbed (no worker processes): llama.cpp's runs come in per
    round beside toyllm's, and a llama.cpp that dies loses its column, not the section."""
    import contextlib

    import toyllm.bench.prefill as prefill
    import toyllm.launch
    import toyllm.measure
    import toyllm.weights

    calls = []

    def fake_prefill(spec, ids, method, world_size, **kwargs):
        calls.append((method, len(ids)))
        return SimpleNamespace(ttft_runs=[0.5 if method == "single" else 0.4])

    monkeypatch.setattr(prefill, "parallel_prefill", fake_prefill)
    monkeypatch.setattr(toyllm.launch, "WorkerPool", lambda *a, **k: contextlib.nullcontext())
    monkeypatch.setattr(toyllm.measure, "check_machine", lambda: SimpleNamespace(line="quiet"))
    monkeypatch.setattr(toyllm.weights, "find_smollm2_gguf", lambda: fake_llama.gguf)
    monkeypatch.setenv("FAKE_LLAMA_MODE", "ok")
    data = prefill.bench_llama_prefill(contexts=(16, 32), rounds=2)
    assert calls == [("single", 16), ("tsp", 16)] * 3 + [("single", 32), ("tsp", 32)] * 3     # 1 untimed + 2
    assert [len(r["runs"][prefill.LLAMA].runs) for r in data["rows"]] == [2, 2]
    assert data["llama"]["version"] == "0.0-fake" and data["llama_missing"] == ""
    assert "| 16 |" in prefill_text(data)
    monkeypatch.setenv("FAKE_LLAMA_MODE", "die_prefill")
    data = prefill.bench_llama_prefill(quick=True, contexts=(16,))
    assert prefill.LLAMA not in data["rows"][0]["runs"]
    assert "died during a prefill of 16 tokens" in data["llama_missing"]
    assert "llama.cpp failed during this run" in prefill_text(data)


def prefill_text(data) -> str:
    from toyllm.bench import render_section

    return render_section("llama_prefill", data)
