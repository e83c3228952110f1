"""Bad input costs one clear line, at once: checked before any process starts, nothing silently ignored.

Every CLI case asserts that the message names the parameter, that no worker
was started (the launcher refuses to start processes for the test) and that
no child process is left.
"""
import json
import math
import subprocess
import sys

import psutil
import pytest

import toyllm
import toyllm.launch as launch
import toyllm.parallel
import toyllm.parallel.runner as runner
from toyllm.cli import main
from toyllm.generation import check_sampling
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
    (["generate", "--model", "tiny", "--prompt", "x", "--temperature", "nan"], "temperature must be a finite"),
    (["generate", "--model", "tiny", "--prompt", "x", "--temperature", "inf"], "temperature must be a finite"),
    (["generate", "--model", "tiny", "--prompt", "x", "--top-k", "5"], "--top-k only matter when sampling"),
    (["generate", "--model", "tiny", "--prompt", "x", "--seed", "1", "--top-p", "0.5"], "--top-p and --seed only"),
    (["generate", "--model", "tiny", "--prompt", "x", "--max-new-tokens", "2000"], "--max-new-tokens 2000: the "
                                                                                  "prompt (1 tokens) + 2000"),
    (["generate", "--model", "tiny", "--prompt", "x", "--method", "naive", "--cache", "static"], "--cache"),
])
def test_cli_rejects_bad_flags_before_any_work(capsys, no_workers, argv, names):
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


# --------------------------------------------------------------------------- user errors vs failures and bugs

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
