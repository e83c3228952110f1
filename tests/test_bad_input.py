"""Bad input costs one clear line, at once: checked before any process starts, nothing silently ignored.

Every case asserts that the message names the parameter, that no worker was
started (the launcher is replaced by one that fails the test if called) and
that no child process is left.
"""
import json
import math

import psutil
import pytest

import toyllm.parallel.runner as runner
from toyllm.cli import main
from toyllm.generation import check_sampling
from toyllm.launch import WorkerPool
from toyllm.parallel import ModelSpec, parallel_prefill
from toyllm.utils import random_prompt


@pytest.fixture
def no_workers(monkeypatch):
    """Fail the test if anything tries to start worker processes; check none is left afterwards."""
    def refuse(*args, **kwargs):
        raise AssertionError("a worker process was started for a request that should have been rejected")

    monkeypatch.setattr(runner, "run_parallel", refuse)
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    yield
    after = {p.pid for p in psutil.Process().children(recursive=True)}
    assert after <= before, f"child processes left behind: {after - before}"


def cli_error(capsys, argv) -> str:
    assert main(argv) == 2, argv
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("argv, names", [
    (["prefill", "--model", "tiny", "--context", "5000"], "--context 5000 is longer than tiny's max_context (1024"),
    (["prefill", "--model", "tiny", "--context", "1000", "--decode", "100"], "--context 1000 + --decode 100"),
    (["prefill", "--model", "tiny", "--context", "64", "--decode", "-2"], "--decode must be >= 0"),
    (["prefill", "--model", "tiny", "--context", "64", "--world-size", "64"], "--world-size 64 is more than"),
    (["prefill", "--model", "tiny", "--context", "64", "--bandwidth", "0"], "--bandwidth must be a finite number"),
    (["prefill", "--model", "tiny", "--context", "64", "--noise", "0.3"], "--latency and --noise"),
    (["prefill", "--model", "tiny", "--context", "64", "--latency", "0.01"], "give --bandwidth too"),
    (["prefill", "--model", "tiny", "--context", "64", "--method", "single", "--world-size", "2"], "--world-size 2"),
    (["prefill", "--model", "tiny", "--context", "64", "--method", "single", "--partition", "64"], "--partition"),
    (["prefill", "--model", "tiny", "--context", "64", "--method", "tsp", "--no-overlap"], "--no-overlap"),
    (["prefill", "--model", "tiny", "--context", "64", "--method", "kvr", "--balance", "zigzag"], "--balance"),
    (["prefill", "--model", "tiny", "--context", "64", "--attention", "flash9"], "--attention: invalid choice"),
    (["search", "--model", "tiny", "--context", "4096"], "--context 4096: tiny runs contexts of 2 to 1024"),
    (["search", "--model", "tiny", "--context", "64", "--cost", "measured", "--world-size", "64"], "--world-size 64"),
    (["search", "--model", "tiny", "--context", "64", "--cost", "measured", "--bandwidth", "10"], "--bandwidth"),
    (["generate", "--model", "tiny", "--prompt", "x", "--temperature", "nan"], "temperature must be a finite"),
    (["generate", "--model", "tiny", "--prompt", "x", "--temperature", "inf"], "temperature must be a finite"),
    (["generate", "--model", "tiny", "--prompt", "x", "--method", "naive", "--cache", "static"], "--cache"),
])
def test_cli_rejects_bad_flags_before_any_work(capsys, no_workers, argv, names):
    assert names in cli_error(capsys, argv)


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
    err = cli_error(capsys, ["prefill", "--model", "tiny", "--context", "64", "--partition-table", str(path)])
    assert str(path) in err and "--partition-table" in err and names in err
    err = cli_error(capsys, ["search", "--model", "tiny", "--context", "64", "--cost-model", str(path)])
    assert str(path) in err and "--cost-model" in err


def test_a_malformed_cost_model_names_the_file(capsys, tmp_path):
    path = tmp_path / "cm.json"
    path.write_text(json.dumps({"qkv_s_per_token": -1, "mlp_s_per_token": 0, "attn_s_per_dot": 0}))
    err = cli_error(capsys, ["search", "--model", "tiny", "--context", "64", "--cost-model", str(path)])
    assert str(path) in err and "qkv_s_per_token" in err


def test_an_output_path_in_a_missing_folder_is_rejected_before_the_work(capsys, no_workers, tmp_path, monkeypatch):
    import toyllm.simulate

    monkeypatch.setattr(toyllm.simulate.CostModel, "calibrate",
                        classmethod(lambda *a, **k: pytest.fail("the search started before the path was checked")))
    missing = tmp_path / "nope" / "table.json"
    assert "does not exist" in cli_error(capsys, ["search", "--model", "tiny", "--context", "64", "--table", str(missing)])
    assert "--out" in cli_error(capsys, ["bench", "--out", str(tmp_path / "nope" / "b.md"), "--quick"])


@pytest.mark.parametrize("kwargs, names", [
    (dict(ids=random_prompt(1100, 256)), "context of 1100 tokens is longer than tiny's max_context"),
    (dict(ids=[1, 2, 300, 4]), "token ids must be integers in [0, 256)"),
    (dict(ids=[1, 2, -1, 4]), "token ids must be integers in [0, 256)"),
    (dict(spec=ModelSpec("nano")), "unknown model preset 'nano'"),
    (dict(decode_tokens=-1), "decode_tokens must be an integer >= 0"),
    (dict(decode_tokens=1000), "decode at most"),
    (dict(spec=ModelSpec("tiny", attention="nope")), "unknown attention kernel 'nope'"),
    (dict(step=lambda *a: None), "step"),
])
def test_parallel_prefill_checks_the_request_in_the_caller(no_workers, kwargs, names):
    args = dict(spec=ModelSpec("tiny"), ids=random_prompt(40, 256)) | kwargs
    with pytest.raises(ValueError) as info:
        parallel_prefill(args.pop("spec"), args.pop("ids"), "kvr", 2, **args, timeout_s=10)
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
        for bad in (dict(ids=[999] * 10), dict(ids=random_prompt(40, 256), partition=[39, 2]),
                    dict(ids=random_prompt(1100, 256)), dict(ids=random_prompt(40, 256), decode_tokens=-5)):
            with pytest.raises(ValueError):
                parallel_prefill(ModelSpec("tiny"), bad.pop("ids"), "kvr", 2, pool=pool, **bad)
        result = parallel_prefill(ModelSpec("tiny"), random_prompt(40, 256), "kvr", 2, pool=pool, warmup=0)
        assert len(result.logits) == 256 and not pool.closed
