"""Bad input costs one clear line, at once: checked before any process starts, nothing silently ignored.

Every CLI case asserts that the message names the parameter, that no worker
was started (the launcher refuses to start processes for the test) and that
no child process is left.
"""
import json
import math
import os
import signal
import subprocess
import sys
import time

import numpy as np
import psutil
import pytest

import toyllm
import toyllm.bench
import toyllm.grading.grader.cli as grading_cli
import toyllm.launch as launch
import toyllm.parallel
import toyllm.parallel.runner as runner
from toyllm.cli import main
from toyllm.generation import check_sampling
from toyllm.gguf_file import open_gguf
from toyllm.launch import WorkerError, WorkerPool
from toyllm.parallel import ModelSpec, parallel_prefill
from toyllm.simulate import CostModel
from toyllm.utils import random_prompt

TORCHRUN_ENV = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


@pytest.fixture
def no_workers(monkeypatch):
    """Fail the test if anything tries to start worker processes; check none is left afterwards."""
    def refuse(*args, **kwargs):
        raise AssertionError("a process was started for a request that should have been rejected")

    monkeypatch.setattr(launch.mp, "get_context", refuse)     # every process the launcher starts
    monkeypatch.setattr(runner, "init_from_env", refuse)      # joining a torchrun group
    before = _children()
    yield
    assert _children() <= before, f"child processes left behind: {_children() - before}"


def cli_error(capsys, argv) -> str:
    assert main(argv) == 2, argv
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    return err


TINY = ["--model", "tiny", "--context", "64"]


@pytest.mark.parametrize("argv, names", [
    (["prefill", "--model", "tiny", "--context", "5000"], "--context 5000: tiny runs contexts of 1 to 1024 tokens"),
    (["prefill", "--model", "tiny", "--context", "0"], "--context 0: tiny runs contexts of 1 to 1024"),
    (["prefill", "--model", "tiny", "--context", "1000", "--decode", "100"], "--decode 100: context (1000 tokens) "
                                                                             "+ decode_tokens (100) exceeds"),
    (["prefill", *TINY, "--decode", "-2"], "--decode -2: decode_tokens must be an integer >= 0"),
    (["prefill", *TINY, "--world-size", "64"], "--world-size 64 is more than"),
    (["prefill", *TINY, "--world-size", "0"], "--world-size 0: world size must be an integer >= 1"),
    (["prefill", "--model", "tiny", "--context", "2", "--world-size", "3"], "--world-size 3: world size 3 > context 2"),
    (["prefill", *TINY, "--world-size", "3", "--partition", "32,32"], "--partition 32,32: partition [32, 32] has 2"),
    (["prefill", *TINY, "--bandwidth", "0"], "--bandwidth must be a finite number"),
    (["prefill", *TINY, "--bandwidth", "inf"], "--bandwidth must be a finite number"),
    (["prefill", *TINY, "--noise", "0.3"], "--latency and --noise"),
    (["prefill", *TINY, "--latency", "0.01"], "give --bandwidth too"),
    (["prefill", *TINY, "--bandwidth", "5", "--latency", "nan"], "--latency and --noise must be finite"),
    (["prefill", *TINY, "--method", "single", "--world-size", "2"], "--world-size 2: method 'single' runs one"),
    (["prefill", *TINY, "--method", "single", "--partition", "64"], "--partition"),
    (["prefill", *TINY, "--method", "single", "--timeout", "5"], "--timeout"),
    (["prefill", *TINY, "--method", "single", "--backend", "gloo"], "--backend"),
    (["prefill", *TINY, "--method", "single", "--force"], "--force"),
    (["prefill", *TINY, "--method", "tsp", "--no-overlap"], "--no-overlap"),
    (["prefill", *TINY, "--method", "kvr", "--balance", "zigzag"], "--balance zigzag: balance='zigzag' shares out"),
    (["prefill", *TINY, "--timeout", "0"], "--timeout must be > 0"),
    (["prefill", *TINY, "--timeout", "inf"], "--timeout must be > 0 seconds and at most 86400 (one day), got inf"),
    (["prefill", *TINY, "--timeout", "nan"], "--timeout must be > 0 seconds and at most 86400 (one day), got nan"),
    (["prefill", *TINY, "--timeout", "-1"], "--timeout must be > 0 seconds and at most 86400"),
    (["prefill", *TINY, "--threads", "100000"], "--threads 100000: threads per process must be 1 to "),
    (["prefill", *TINY, "--threads", "0"], "--threads 0: threads per process must be 1 to "),
    (["prefill", *TINY, "--seed", "1180591620717411303424"], "--seed 1180591620717411303424: a seed is an integer "
                                                             "from 0 to 2**63-1"),
    (["prefill", *TINY, "--bandwidth", "10", "--noise", "1e9"], "--noise 1000000000.0: noise is the standard "
                                                                 "deviation of the relative slow-down of a message, "
                                                                 "0 to 1"),
    (["prefill", *TINY, "--repeat", "0"], "--repeat must be at least 1"),
    (["prefill", *TINY, "--attention", "flash9"], "--attention: invalid choice"),
    (["search", "--model", "tiny", "--context", "4096"], "--context 4096: tiny runs contexts of 1 to 1024"),
    (["search", "--model", "tiny", "--context", "64,1"], "--context 1 --world-size 2: world size 2 > context 1"),
    (["search", "--model", "tiny", "--context", "64", "--world-size", "1"], "--world-size must be at least 2"),
    (["search", *TINY, "--cost", "measured", "--world-size", "64"], "--world-size 64"),
    (["search", *TINY, "--cost", "measured", "--bandwidth", "10"], "--bandwidth"),
    (["search", *TINY, "--repeat", "3"], "--repeat and --force apply to --cost measured"),
    (["search", *TINY, "--force"], "--repeat and --force apply to --cost measured"),
    (["search", *TINY, "--bandwidth", "0"], "--bandwidth must be a finite number"),
    (["search", *TINY, "--min-stride", "0"], "--min-stride must be >= 1"),
    (["search", "--model", "tiny", "--context", "512", "--min-stride", "100000"], "--min-stride 100000 is longer "
                                                                                  "than --context 512: the finest "
                                                                                  "boundary step must be 1 to 512"),
    (["serve", "--token-budget", "4"], "--token-budget 4 leaves no room for a prompt chunk beside 8 decodes"),
    (["serve", "--max-batch", "0"], "--max-batch must be an int >= 1, got 0"),
    (["serve", "--block-size", "0"], "--block-size must be an int >= 1"),
    (["serve", "--prompt-tokens", "9", "3"], "--prompt-tokens must be a range (low, high) with 1 <= low <= high"),
    (["serve", "--new-tokens", "0", "3"], "--new-tokens must be a range"),
    (["serve", "--shared-prefix", "-1"], "--shared-prefix must be >= 0 tokens"),
    (["serve", "--shared-prefix", "4000"], "--shared-prefix + --prompt-tokens MAX + --new-tokens MAX = 4192 tokens, "
                                           "over tiny's max_context (1024)"),
    (["serve", "--rate", "inf"], "--rate inf: arrivals per second must be finite and > 0"),
    (["serve", "--rate", "0"], "--rate 0.0: arrivals per second"),
    (["serve", "--requests", "0"], "--requests 0: give 1 to 10000 requests"),
    (["serve", "--seed", "-1"], "--seed -1: a seed is an integer from 0"),
    (["serve", "--policy", "fastest"], "--policy: invalid choice"),
    (["generate", "--model", "tiny", "--prompt", "x", "--temperature", "nan"], "temperature must be a finite"),
    (["generate", "--model", "tiny", "--prompt", "x", "--temperature", "inf"], "temperature must be a finite"),
    (["generate", "--model", "tiny", "--prompt", "x", "--top-k", "5"], "--top-k only matter when sampling"),
    (["generate", "--model", "tiny", "--prompt", "x", "--seed", "1", "--top-p", "0.5"], "--top-p and --seed only"),
    (["generate", "--model", "tiny", "--prompt", "x", "--max-new-tokens", "2000"], "--max-new-tokens 2000: the "
                                                                                  "prompt (1 tokens) + 2000"),
    (["generate", "--model", "tiny", "--prompt", "x", "--method", "naive", "--cache", "static"], "--cache"),
    (["generate", "--model", "tiny", "--prompt", "x", "--temperature", "1", "--seed", "1180591620717411303424"],
     "--seed 1180591620717411303424: a seed is an integer from 0 to 2**63-1 (9223372036854775807)"),
    (["generate", "--model", "tiny", "--prompt", "x", "--temperature", "1", "--seed", "-1"], "--seed -1: a seed is"),
    (["generate", "--model", "tiny", "--prompt", "x", "--temperature", "1", "--top-k", "100000"],
     "--top-k 100000: top-k must be between 1 and tiny's vocabulary size (256)"),
    (["generate", "--model", "tiny", "--prompt", "x", "--temperature", "1", "--top-k", "0"], "--top-k 0: top-k must"),
    (["generate", "--model", "smollm2-135m", "--prompt", "x", "--temperature", "1", "--top-k", "100000"],
     "--top-k 100000: top-k must be between 1 and smollm2-135m's vocabulary size (49152)"),
    (["generate", "--model", "tiny", "--prompt", "x", "--chat"], "--chat: tiny's tokenizer has no chat template"),
    (["generate", "--model", "tiny", "--prompt", "x", "--max-new-tokens", "0"], "--max-new-tokens 0: generate at "
                                                                               "least 1 new token"),
    (["bench", "--out", ".", "--quick"], "--out . is a folder; give the path of a file to write"),
])
def test_cli_rejects_bad_flags_before_any_work(capsys, monkeypatch, no_workers, argv, names):
    if argv[0] == "serve":              # every serve flag is checked before the model loads
        monkeypatch.setattr(toyllm, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    assert names in cli_error(capsys, argv)


@pytest.mark.parametrize("extra, names", [
    (["--world-size", "2"], "--world-size"),
    (["--force"], "--force"),
    (["--decode", "2"], "--decode"),
    (["--bandwidth", "5"], "--bandwidth"),
    (["--balance", "zigzag", "--method", "tsp"], "--balance"),
])
def test_flags_torchrun_cannot_honour_are_rejected(capsys, no_workers, monkeypatch, extra, names):
    for var, value in TORCHRUN_ENV.items():
        monkeypatch.setenv(var, value)
    assert names in cli_error(capsys, ["prefill", *TINY, *extra])


@pytest.mark.parametrize("content, names", [
    (None, "does not exist"),
    ("{not json", "is not valid JSON"),
    ("[1, 2]", "must hold a JSON object"),
    ('{"world_size": 2, "entries": [{"ctx": 5}]}', "is not a valid partition table"),
])
def test_a_missing_or_malformed_table_file_is_one_line_naming_it(capsys, no_workers, tmp_path, content, names):
    path = tmp_path / "table.json"
    if content is not None:
        path.write_text(content)
    err = cli_error(capsys, ["prefill", *TINY, "--partition-table", str(path)])
    assert str(path) in err and "--partition-table" in err and names in err
    err = cli_error(capsys, ["search", *TINY, "--cost-model", str(path)])
    assert str(path) in err and "--cost-model" in err
    if content is not None:   # a missing --table is created by the search
        err = cli_error(capsys, ["search", *TINY, "--cost-model", str(path), "--table", str(path)])
        assert str(path) in err and "--table" in err


def test_a_malformed_cost_model_names_the_file(capsys, no_workers, tmp_path):
    path = tmp_path / "cm.json"
    path.write_text(json.dumps({"qkv_s_per_token": -1, "mlp_s_per_token": 0, "attn_s_per_dot": 0}))
    err = cli_error(capsys, ["search", *TINY, "--cost-model", str(path)])
    assert str(path) in err and "qkv_s_per_token" in err


def test_a_cost_model_file_fixes_the_kernel(capsys, no_workers, tmp_path):
    path = tmp_path / "cm.json"
    path.write_text(json.dumps(CostModel(1e-6, 1e-6, 1e-8).to_dict()))
    assert "--attention" in cli_error(capsys, ["search", *TINY, "--cost-model", str(path), "--attention", "sdpa"])


def test_an_output_path_in_a_missing_folder_is_rejected_before_the_work(capsys, no_workers, tmp_path, monkeypatch):
    import toyllm.bench

    monkeypatch.setattr(CostModel, "calibrate",
                        classmethod(lambda *a, **k: pytest.fail("the search started before the path was checked")))
    monkeypatch.setattr(toyllm.bench, "run_benchmarks", lambda *a, **k: pytest.fail("the benchmarks started"))
    missing = tmp_path / "nope" / "table.json"
    assert "does not exist" in cli_error(capsys, ["search", *TINY, "--table", str(missing)])
    assert "--out" in cli_error(capsys, ["bench", "--out", str(tmp_path / "nope" / "b.md"), "--quick"])
    assert "is a folder" in cli_error(capsys, ["bench", "--out", str(tmp_path), "--quick"])
    assert "is a folder" in cli_error(capsys, ["search", *TINY, "--table", str(tmp_path)])
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("model", ["tiny", "smollm2-135m"])
def test_a_prompt_that_is_not_utf8_names_the_flag_before_the_model_loads(capsys, no_workers, monkeypatch, model):
    monkeypatch.setattr(toyllm, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    prompt = b"\xff\xfe hi".decode("utf-8", "surrogateescape")      # what sys.argv holds for those bytes
    err = cli_error(capsys, ["generate", "--model", model, "--prompt", prompt])
    assert "--prompt is not valid UTF-8 text (byte 0xff at position 0)" in err


def test_nccl_without_a_gpu_per_rank_is_one_line_before_any_worker(capsys, no_workers, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    err = cli_error(capsys, ["prefill", *TINY, "--backend", "nccl"])
    assert "--backend nccl: backend 'nccl' needs one CUDA GPU per rank: 2 rank(s)" in err and "gloo" in err


# --------------------------------------------------------------------------- the grader's command line

@pytest.fixture
def no_grading(monkeypatch):
    monkeypatch.setattr(grading_cli, "grade", lambda *a, **k: pytest.fail("grading started"))


def grade_errors(capsys, argv) -> list[str]:
    """The error line of both command lines (``python -m toyllm grade``, ``python -m toyllm.grading grade``)."""
    errors = [cli_error(capsys, ["grade", *argv])]
    assert grading_cli.cli_main(["grade", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    return errors + [err]


@pytest.mark.parametrize("argv, names", [
    (["--timeout", "nan"], "--timeout nan: the time limit of one test must be a number of seconds > 0 and at most "
                           "3600"),
    (["--timeout", "inf"], "--timeout inf: the time limit"),
    (["--timeout", "0"], "--timeout 0.0: the time limit"),
    (["--timeout", "3601"], "--timeout 3601.0: the time limit"),
    (["--memory-mb", "99999999999"], "--memory-mb 99999999999: the address-space limit must be 1024 MiB"),
    (["--memory-mb", "100"], "--memory-mb 100: the address-space limit must be 1024 MiB"),
])
def test_grade_rejects_bad_limits_before_grading(capsys, no_grading, argv, names):
    for err in grade_errors(capsys, argv):
        assert names in err


def test_grade_only_a_lesson_without_graded_tests_names_the_module(capsys, monkeypatch):
    import toyllm.grading.grader.grade as grader

    monkeypatch.setattr(grader, "run_lesson", lambda *a, **k: pytest.fail("a lesson started"))   # grade() checks first
    for err in grade_errors(capsys, ["--only", "ex99"]):
        assert "no graded tests for exercise module 'ex99' (lessons with graded tests: ex01-ex" in err


def test_grade_results_must_be_a_file_in_an_existing_folder(capsys, monkeypatch, tmp_path):
    import toyllm.grading.grader.grade as grader

    monkeypatch.setattr(grader, "run_lesson", lambda *a, **k: pytest.fail("a lesson started"))   # grade() checks first
    for err in grade_errors(capsys, ["--results", str(tmp_path)]):
        assert f"--results {tmp_path} is a folder" in err
    for err in grade_errors(capsys, ["--results", str(tmp_path / "nope" / "results.json")]):
        assert "does not exist" in err
    assert list(tmp_path.iterdir()) == []


def test_a_failed_write_of_the_results_leaves_no_file_behind(monkeypatch, tmp_path):
    from toyllm.grading.grader.report import GradeReport

    target = tmp_path / "results.json"
    GradeReport(impl="exercises").write(target)
    assert [p.name for p in tmp_path.iterdir()] == ["results.json"] and json.loads(target.read_text())["score"] == 0

    def fail(*args):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        GradeReport(impl="exercises").write(target)
    assert [p.name for p in tmp_path.iterdir()] == ["results.json"]          # no .results-*.json left beside it


@pytest.mark.engine
def test_a_failed_write_of_the_benchmarks_leaves_no_file_behind(monkeypatch, tmp_path):
    for name, value in toyllm.bench.RESIDENT_HEAP_ENV.items():
        monkeypatch.setenv(name, value)          # no re-run of the command in a fresh process
    monkeypatch.setitem(toyllm.bench.SECTIONS, "generation", lambda quick: {})
    monkeypatch.setattr(toyllm.bench, "render_section", lambda name, data: "a table")
    target = tmp_path / "bench.md"
    toyllm.bench.run_benchmarks(str(target), sections=["generation"], quick=True)
    assert [p.name for p in tmp_path.iterdir()] == ["bench.md"] and "a table" in target.read_text()
    before = target.read_text()

    def fail(*args):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        toyllm.bench.run_benchmarks(str(target), sections=["generation"], quick=True)
    assert [p.name for p in tmp_path.iterdir()] == ["bench.md"] and target.read_text() == before


# --------------------------------------------------------------------------- a truncated GGUF file

def _tiny_gguf(path) -> None:
    """A small GGUF file: some metadata and two float32 tensors."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint32("llama.block_count", 1)
    writer.add_token_list(["a", "b", "c"])
    writer.add_tensor("token_embd.weight", np.arange(8 * 64, dtype=np.float32).reshape(8, 64))
    writer.add_tensor("output_norm.weight", np.ones(64, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture
def gguf_bytes(tmp_path) -> bytes:
    path = tmp_path / "whole.gguf"
    _tiny_gguf(path)
    reader = open_gguf(path)            # the whole file reads
    assert [t.name for t in reader.tensors] == ["token_embd.weight", "output_norm.weight"]
    assert reader.tensors[0].data_offset == len(reader.data) - (8 * 64 + 64) * 4    # the tensors come last
    return path.read_bytes()


@pytest.mark.parametrize("cut, names", [
    (10, "its 2 tensors need {size}"),                      # inside the last tensor
    (64 * 4 + 8 * 64 * 4 - 4, "its 2 tensors need {size}"),  # inside the first tensor
    (64 * 4 + 8 * 64 * 4 + 3, "its 2 tensors need {size}"),  # in the padding before the tensors
    ("header", "reading its header and metadata needs at least"),
])
def test_a_truncated_gguf_file_is_named_before_any_tensor_is_read(tmp_path, gguf_bytes, cut, names):
    size = len(gguf_bytes)
    for keep in ([100, 30, 10, 3] if cut == "header" else [size - cut]):
        path = tmp_path / "cut.gguf"
        path.write_bytes(gguf_bytes[:keep])
        with pytest.raises(ValueError) as info:
            open_gguf(path)
        message = str(info.value)
        assert f"GGUF file {path} is truncated: it has {keep} bytes, but " in message
        assert names.format(size=size) in message and "\n" not in message


def test_a_file_that_is_not_gguf_is_one_clear_error(tmp_path):
    path = tmp_path / "empty.gguf"
    path.write_bytes(b"")
    with pytest.raises(ValueError, match="cannot be read, it is corrupt or not a GGUF file"):
        open_gguf(path)
    path.write_bytes(b"not a gguf file at all, but long enough")
    with pytest.raises(ValueError, match=f"GGUF file {path} .* cannot be read"):
        open_gguf(path)


def test_the_cli_names_a_truncated_model_file_in_one_line(capsys, no_workers, monkeypatch, tmp_path, gguf_bytes):
    import toyllm.weights

    path = tmp_path / "cut.gguf"
    path.write_bytes(gguf_bytes[:-10])
    monkeypatch.setattr(toyllm.weights, "find_smollm2_gguf", lambda: path)
    err = cli_error(capsys, ["generate", "--model", "smollm2-135m", "--prompt", "hi"])
    assert f"--model smollm2-135m: GGUF file {path} is truncated" in err


# --------------------------------------------------------------------------- user errors vs failures and bugs

@pytest.mark.engine
def test_a_user_error_is_one_line_from_the_real_command():
    out = subprocess.run([sys.executable, "-m", "toyllm", "prefill", "--model", "tiny", "--context", "5000"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.strip().splitlines() == ["error: --context 5000: tiny runs contexts of 1 to 1024 tokens"]


def test_a_bug_in_the_work_keeps_its_traceback(monkeypatch):
    """A ValueError raised once the work has started is not a user error: it escapes with its traceback."""
    def broken(*args, **kwargs):
        raise ValueError("a bug deep inside generation")

    monkeypatch.setattr(toyllm, "generate", broken)
    with pytest.raises(ValueError, match="a bug deep inside generation"):
        main(["generate", "--model", "tiny", "--prompt", "hi", "--max-new-tokens", "2"])


def _workers_joined(pid: int) -> list[int]:
    """The pids of ``pid``'s descendants once two of them hold a TCP connection (they joined the group), else []
    (the workers are the fork server's children)."""
    try:
        children = psutil.Process(pid).children(recursive=True)
        joined = [c.pid for c in children if any(k.status == psutil.CONN_ESTABLISHED for k in c.net_connections())]
    except psutil.Error:
        return []
    return joined if len(joined) >= 2 else []


@pytest.mark.engine
@pytest.mark.needs("5.2")
@pytest.mark.timeout(300)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_stop_signal_stops_a_parallel_prefill_like_ctrl_c(sig):
    """SIGTERM (kill, timeout) or SIGHUP (the terminal closed): one line, exit code 128 + the signal's
    number, no traceback from the command or a worker, no worker left."""
    cmd = [sys.executable, "-m", "toyllm", "prefill", "--model", "tiny", "--context", "1024", "--repeat", "100000"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 180
        while not (workers := _workers_joined(proc.pid)):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the workers did not start within 180 s"
            time.sleep(0.2)
        time.sleep(1.0)                          # into the timed runs
        started = [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]   # the workers and helpers
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 128 + sig, err
    assert "Traceback" not in err and err.strip().splitlines() == [f"prefill: stopped ({sig.name})"], err
    assert out == ""
    assert set(workers) <= set(started)
    gone_by = time.monotonic() + 10
    while any(map(_alive, started)):
        assert time.monotonic() < gone_by, f"processes left behind: {[p for p in started if _alive(p)]}"
        time.sleep(0.2)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.parametrize("failure, code, names", [
    (WorkerError(1, "rank 1 of 2 failed in task prefill_rank:\nTraceback ...\nRuntimeError: boom"), 1, "rank 1 of 2"),
    (TimeoutError("task prefill_rank did not finish within the limit of 5 s"), 1, "limit of 5 s"),
    (KeyboardInterrupt(), 130, "interrupted"),
])
def test_a_failing_run_is_reported_with_its_exit_code(capsys, monkeypatch, failure, code, names):
    def fail(*args, **kwargs):
        raise failure

    monkeypatch.setattr(toyllm.parallel, "parallel_prefill", fail)
    assert main(["prefill", *TINY]) == code
    assert names in capsys.readouterr().err


# --------------------------------------------------------------------------- the API: checked in the caller

@pytest.mark.parametrize("kwargs, names", [
    (dict(ids=random_prompt(1100, 256)), "context of 1100 tokens is longer than tiny's max_context"),
    (dict(ids=[1, 2, 300, 4]), "token ids must be integers in [0, 256)"),
    (dict(ids=[1, 2, -1, 4]), "token ids must be integers in [0, 256)"),
    (dict(spec=ModelSpec("nano")), "unknown model preset 'nano'"),
    (dict(method="pipeline"), "unknown method 'pipeline'"),
    (dict(world_size=0), "world size must be an integer >= 1"),
    (dict(partition=[39, 2]), "covers 41 tokens but the context has 40"),
    (dict(balance="zigzag"), "balance='zigzag' shares out TSP's work"),
    (dict(decode_tokens=-1), "decode_tokens must be an integer >= 0"),
    (dict(decode_tokens=1000), "decode at most"),
    (dict(spec=ModelSpec("tiny", attention="nope")), "unknown attention kernel 'nope'"),
    (dict(step=lambda *a: None), "step"),
    (dict(timeout_s=0), "timeout_s must be a positive number"),
])
def test_parallel_prefill_checks_the_request_in_the_caller(no_workers, kwargs, names):
    args = dict(spec=ModelSpec("tiny"), ids=random_prompt(40, 256), method="kvr", world_size=2,
                timeout_s=10) | kwargs
    with pytest.raises(ValueError) as info:
        parallel_prefill(args.pop("spec"), args.pop("ids"), args.pop("method"), args.pop("world_size"), **args)
    assert names in str(info.value)


def test_sampling_parameters_must_be_finite():
    for bad in (math.nan, math.inf, -1.0):
        with pytest.raises(ValueError, match="temperature must be a finite number >= 0"):
            check_sampling(bad)
    with pytest.raises(ValueError, match="top_p"):
        check_sampling(1.0, top_p=math.nan)


@pytest.mark.engine
@pytest.mark.timeout(180)
def test_a_bad_request_to_a_running_pool_leaves_it_usable():
    with WorkerPool(2, timeout_s=60) as pool:
        pids = list(pool.pids)
        for bad in (dict(ids=[999] * 10), dict(partition=[39, 2]), dict(ids=random_prompt(1100, 256)),
                    dict(decode_tokens=-5), dict(spec=ModelSpec("nano")), dict(method="pipeline"),
                    dict(world_size=3), dict(step=lambda *a: None), dict(timeout_s=-1)):
            args = dict(spec=ModelSpec("tiny"), ids=random_prompt(40, 256), method="kvr", world_size=2) | bad
            with pytest.raises(ValueError):
                parallel_prefill(args.pop("spec"), args.pop("ids"), args.pop("method"), args.pop("world_size"),
                                 pool=pool, **args)
            assert not pool.closed and pool.pids == pids, bad
        result = parallel_prefill(ModelSpec("tiny"), random_prompt(40, 256), "kvr", 2, pool=pool, warmup=0)
        assert len(result.logits) == 256 and not pool.closed
    assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE for pid in pids)


@pytest.mark.engine
@pytest.mark.timeout(120)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_signal_to_the_bench_command_stops_its_re_run_too(tmp_path, sig):
    """`bench` re-runs itself with the resident heap; a signal to the command must end that re-run as well,
    or it would go on alone and still write the file."""
    env = {k: v for k, v in os.environ.items() if k not in toyllm.bench.RESIDENT_HEAP_ENV}
    out = tmp_path / "bench.md"
    command = subprocess.Popen([sys.executable, "-m", "toyllm", "bench", "--quick", "--only", "generation",
                                "--out", str(out)], env=env, stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not psutil.Process(command.pid).children():
            assert command.poll() is None and time.monotonic() < deadline, "the re-run never started"
            time.sleep(0.02)
        rerun = psutil.Process(command.pid).children()[0]
        # a forked child shows its parent's environment until it runs its own program: look until it does
        while rerun.environ().get("MALLOC_MMAP_MAX_") != "0":
            assert command.poll() is None and time.monotonic() < deadline, \
                f"the re-run never ran with the resident heap's settings: {rerun.environ().get('MALLOC_MMAP_MAX_')!r}"
            time.sleep(0.02)
        command.send_signal(sig)
        assert command.wait(timeout=60) == 128 + sig
        _, alive = psutil.wait_procs([rerun], timeout=60)
        assert not alive and not out.exists()
    finally:
        command.kill()
        command.wait(timeout=30)
