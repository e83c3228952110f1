"""The command line, called in-process (``main(argv)``) and once as a real subprocess."""
import json
import subprocess
import sys

import pytest

from toyllm.cli import main
from toyllm.partition_table import PartitionTable
from toyllm.simulate import CostModel


def run_json(capsys, argv):
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_generate_json_naive_equals_cached(capsys):
    base = ["generate", "--model", "tiny", "--prompt", "hello world", "--max-new-tokens", "12", "--json"]
    naive = run_json(capsys, base + ["--method", "naive"])
    cached = run_json(capsys, base + ["--method", "cached", "--cache", "static"])
    assert naive["output_ids"] == cached["output_ids"] and len(naive["output_ids"]) == 12
    assert naive["prompt_ids"] == list(b"hello world")
    for key in ("model", "method", "text", "ttft_s", "tpot_s"):
        assert key in naive


def test_generate_with_headroom_gives_the_same_tokens(capsys):
    base = ["generate", "--model", "tiny", "--prompt", "hello world", "--max-new-tokens", "12", "--json"]
    plain = run_json(capsys, base)
    roomy = run_json(capsys, base + ["--headroom", "4"])
    assert roomy["output_ids"] == plain["output_ids"] and (plain["headroom"], roomy["headroom"]) == (0, 4)


def test_generate_without_a_prompt_continues_the_benchmarks_one(capsys):
    out = run_json(capsys, ["generate", "--model", "tiny", "--max-new-tokens", "3", "--json"])
    assert out["prompt_ids"] == list(b"Once upon a time") and len(out["output_ids"]) == 3


@pytest.mark.needs("1.2")
def test_generate_sampling_is_seeded(capsys):
    argv = ["generate", "--model", "tiny", "--prompt", "abc", "--max-new-tokens", "20", "--json",
            "--temperature", "0.8", "--top-k", "40", "--top-p", "0.9", "--seed", "7"]
    assert run_json(capsys, argv)["output_ids"] == run_json(capsys, argv)["output_ids"]


@pytest.mark.parametrize("argv, message", [
    (["generate", "--model", "tiny", "--prompt", ""], "prompt is empty"),
    (["generate", "--model", "nano", "--prompt", "x"], "--model: invalid choice: 'nano'"),
    (["generate", "--model", "tiny", "--prompt", "x", "--top-p", "2"], r"top_p must be in \(0, 1\]"),
    (["generate", "--model", "tiny", "--prompt", "x", "--max-new-tokens", "-3"], "--max-new-tokens -3: generate at least 1 new token"),
    (["generate", "--model", "tiny", "--prompt", "x", "--headroom", "-1"], "--headroom must be >= 0 rows, got -1"),
    (["generate", "--model", "tiny", "--prompt", "x", "--cache", "static", "--headroom", "4"],
     "--headroom applies to the growing cache"),
    (["generate", "--model", "tiny", "--prompt", "x", "--method", "naive", "--headroom", "4"],
     "--headroom applies to the growing cache"),
    (["prefill", "--model", "tiny", "--context", "10", "--world-size", "3", "--partition", "5,5"], "2 chunks"),
    (["prefill", "--model", "tiny", "--context", "2", "--world-size", "3"], "world size 3 > context 2"),
    (["search", "--model", "tiny", "--context", "64", "--world-size", "1"], "at least 2"),
])
def test_bad_input_exits_2_with_one_clear_line(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and pytest.importorskip("re").search(message, err)


@pytest.mark.engine
@pytest.mark.needs("5.2")
@pytest.mark.timeout(120)
def test_prefill_json_check(capsys):
    out = run_json(capsys, ["prefill", "--model", "tiny", "--context", "40", "--method", "kvr", "--world-size", "2",
                            "--partition", "25,15", "--repeat", "2", "--check", "--decode", "3", "--json"])
    assert out["method"] == "kvr" and out["partition"] == [25, 15] and len(out["ttft_runs"]) == 2
    assert out["max_abs_logit_diff"] < 1e-4 and len(out["decoded"]) == 3 and out["timeline"]
    single = run_json(capsys, ["prefill", "--model", "tiny", "--context", "40", "--method", "single", "--json"])
    assert single["first_token"] == out["first_token"] == out["decoded"][0]


@pytest.mark.engine
@pytest.mark.needs("5.2")
@pytest.mark.timeout(120)
def test_search_builds_a_table_that_prefill_uses(capsys, tmp_path):
    cm = CostModel(qkv_s_per_token=1e-6, mlp_s_per_token=1e-6, attn_s_per_dot=1e-8, link_latency_s=1e-5,
                   label="synthetic")
    (tmp_path / "cm.json").write_text(json.dumps(cm.to_dict()))
    table = tmp_path / "table.json"
    out = run_json(capsys, ["search", "--model", "tiny", "--context", "256,512", "--world-size", "2",
                            "--cost-model", str(tmp_path / "cm.json"), "--table", str(table), "--json"])
    assert [r["context"] for r in out] == [256, 512] and all(r["simulated"] for r in out)
    assert all(r["partition"][0] > r["partition"][1] for r in out)   # KVR gives the first rank more tokens
    loaded = PartitionTable.load(table)
    assert loaded.contexts == [256, 512] and "--cost simulated" in loaded.about and "logical CPUs" in loaded.about
    pre = run_json(capsys, ["prefill", "--model", "tiny", "--context", "384", "--method", "kvr", "--world-size", "2",
                            "--partition-table", str(table), "--repeat", "1", "--json"])
    assert pre["partition"] == loaded.predict(384)
    run_json(capsys, ["search", "--model", "tiny", "--context", "768", "--world-size", "2",
                      "--cost-model", str(tmp_path / "cm.json"), "--table", str(table), "--json"])
    grown = PartitionTable.load(table)           # a later search adds its entry and says how it was found
    assert grown.contexts == [256, 512, 768]
    assert grown.about.startswith(loaded.about + " Then: Searched with `python -m toyllm search --model tiny "
                                  "--context 768 ")


@pytest.mark.engine
@pytest.mark.needs("5.2")
@pytest.mark.timeout(120)
def test_measured_search_runs_real_processes(capsys):
    out = run_json(capsys, ["search", "--model", "tiny", "--context", "48", "--world-size", "2", "--cost", "measured",
                            "--min-stride", "8", "--repeat", "1", "--json"])
    assert out["cost"] == "measured" and not out["simulated"] and sum(out["partition"]) == 48
    assert out["evaluations"] < 47                                   # far fewer than trying every boundary


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_cli_chat_answer_names_paris():
    out = subprocess.run([sys.executable, "-m", "toyllm", "generate", "--model", "smollm2-135m", "--chat",
                          "--prompt", "What is the capital of France?", "--max-new-tokens", "24", "--json"],
                         capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert "Paris" in result["text"]


@pytest.mark.needs("8.1", "8.2", "8.3")
def test_serve_json_runs_every_policy_on_the_same_workload(capsys):
    out = run_json(capsys, ["serve", "--requests", "6", "--rate", "100", "--prompt-tokens", "4", "12",
                            "--new-tokens", "2", "6", "--max-batch", "3", "--token-budget", "8", "--json"])
    assert list(out["policies"]) == ["static", "continuous", "chunked"]
    tokens = {p: row["output_tokens"] for p, row in out["policies"].items()}
    assert len(set(tokens.values())) == 1                      # the same requests, the same answers' lengths
    for row in out["policies"].values():
        assert 0 < row["compute_s"] <= row["clock_s"] and row["ttft_p50_s"] <= row["ttft_p99_s"]
        assert row["throughput_tok_per_s"] > 0 and row["iterations"] >= 6


@pytest.mark.needs("8.1", "8.2", "8.3")
def test_serve_prints_a_table_with_one_row_per_policy(capsys):
    assert main(["serve", "--requests", "3", "--prompt-tokens", "4", "8", "--new-tokens", "2", "3",
                 "--policy", "chunked"]) == 0
    out = capsys.readouterr().out
    assert "TTFT p50" in out and out.strip().splitlines()[-1].startswith("chunked")


def test_prefill_kvr_uses_the_shipped_smollm2_table_unless_told_otherwise(tmp_path):
    from toyllm.cli import build_parser, check_prefill
    from toyllm.partition_table import shipped_table, shipped_table_path

    table = shipped_table("smollm2-135m", "causal", 2)
    assert table is not None and table.world_size == 2 and len(table.contexts) >= 3

    def plan(*flags):
        return check_prefill(build_parser().parse_args(["prefill", "--model", "smollm2-135m", "--context", "3000",
                                                        *flags]))

    shipped = plan("--attention", "causal")
    assert shipped["partition"] == table.predict(3000) and shipped["chunks"] == table.predict(3000)
    assert shipped_table_path("smollm2-135m", "causal", 2).name in shipped["partition_from"]
    # another kernel, another method, or a partition of your own: the shipped table is not used
    assert plan()["partition"] is None and plan()["partition_from"] is None           # dense: no table shipped
    assert plan("--attention", "causal", "--method", "tsp")["partition_from"] is None
    mine = plan("--attention", "causal", "--partition", "2000,1000")
    assert mine["chunks"] == [2000, 1000] and mine["partition_from"] == "--partition"
    own = tmp_path / "own.json"
    own_table = PartitionTable(2)
    own_table.add(3000, [1500, 1500])
    own_table.save(own)
    theirs = plan("--attention", "causal", "--partition-table", str(own))
    assert theirs["chunks"] == [1500, 1500] and str(own) in theirs["partition_from"]
