"""docs/benchmarks.md is rendered from a template: every section renders, and its verdicts follow the numbers."""
import pytest

from toyllm.bench import SECTIONS, render_section


def _five(runs):
    """Three runs as five with the same lowest, median and highest: the fewest a side the verdict rule decides from."""
    low, mid, high = sorted(runs)
    return [low, (low + mid) / 2, mid, (mid + high) / 2, high]


def _prefill(tsp, kvr_best, single_2t, sdpa_single, sdpa_kvr, single_1t=8.0):
    """Prefill data as bench_prefill returns it, each configuration's runs spread +-1% around the given median."""
    from toyllm.bench.prefill import _prefill_row
    from toyllm.measure import ONE_THREAD, TWO_THREADS, MachineState, PrefillComparison, spread
    from toyllm.model import get_config

    def runs(t):
        return spread(_five([t * 0.99, t, t * 1.01]))

    state = MachineState(2, 0.1, runs(1.0), runs(0.55))
    medians = {ONE_THREAD: single_1t, TWO_THREADS: single_2t, "TSP": tsp, "KVR-E": 4.0, "KVR-best": kvr_best}
    cmp = PrefillComparison(8192, state, {k: runs(t) for k, t in medians.items()}, TWO_THREADS, "2 threads", {})
    row = _prefill_row(cmp, get_config("bench"), [5079, 3113], 3 / 8)
    sdpa = {ONE_THREAD: 2 * sdpa_single, TWO_THREADS: sdpa_single, "TSP": 2.2, "KVR": sdpa_kvr}
    scmp = PrefillComparison(8192, state, {k: runs(t) for k, t in sdpa.items()}, TWO_THREADS, "2 threads", {})
    sdpa_row = {"context": 8192, "chunks": [5079, 3113], "runs": scmp.runs, "baseline": TWO_THREADS,
                "vs_tsp": scmp.verdict("KVR", "TSP"), "vs_base": scmp.verdict("KVR")}
    return {"rounds": 3, "warm": 2, "sweep": ["0.50"], "sweep_repeats": 3, "machine": state.line,
            "one_thread": ONE_THREAD, "two_threads": TWO_THREADS, "rows": [row], "sdpa": [sdpa_row]}


def test_prefill_verdicts_are_computed_from_the_numbers():
    good = render_section("prefill", _prefill(tsp=4.2, kvr_best=3.2, single_2t=4.0, sdpa_single=0.9, sdpa_kvr=1.6))
    assert "is met: KVR-best 3.200 s [3.168-3.232 s] vs TSP 4.200 s [4.158-4.242 s]: KVR-best is 1.31x faster" in good
    assert "| 3.200 [3.168-3.232] [5079, 3113] |" in good and "| 1.31x faster |" in good
    assert "KVR 1.600 s [1.584-1.616 s] vs 1 process, 2 threads" in good and "1.78x slower" in good
    assert "One process wins here" in good and "below TTFT*(2)" not in good
    bad = render_section("prefill", _prefill(tsp=4.2, kvr_best=4.0, single_2t=3.0, sdpa_single=1.9, sdpa_kvr=1.6))
    assert "target at 8192 tokens (KVR-best against TSP) is not met" in bad and "| 1.05x faster |" in bad
    assert "KVR keeps its lead" in bad and "One process wins" not in bad
    close = render_section("prefill", _prefill(tsp=4.2, kvr_best=4.15, single_2t=3.0, sdpa_single=1.6, sdpa_kvr=1.6))
    assert "| tie (1.01x) |" in close and "a tie (1.01x, inside the noise of the runs" in close
    assert "Neither wins beyond the spread of the rounds" in close


def test_a_run_below_the_lower_bound_it_prints_is_flagged_and_explained():
    text = render_section("prefill", _prefill(tsp=4.2, kvr_best=2.5, single_2t=4.0, sdpa_single=0.9, sdpa_kvr=1.6,
                                              single_1t=8.0))            # TTFT*(2) = 3/8 * 8.0 = 3.0 s
    assert "| 3.000 [2.970-3.030] (beaten: see below) |" in text
    assert "KVR-best ran below TTFT*(2) (3.000 [2.970-3.030] s)" in text
    assert "(2147 MB)" in text and "here the bound is not a bound" in text       # 8 x 8192^2 x 4 bytes


def test_first_token_section_renders():
    from toyllm.measure import compare

    verdict = compare(_five([1.9, 2.0, 2.1]), _five([2.9, 3.0, 3.1]))
    data = {"threads": 2, "repeats": 3, "vocab": 49152, "rows": [
        {"name": "random", "tokens": 1024, "all_s": 3.0, "last_s": 2.0, "verdict": verdict, "head_gflop": 58.0,
         "total_gflop": 290.0}]}
    text = render_section("first_token", data)
    assert "| random | 1024 | 3.000 [2.900-3.100] | 2.000 [1.900-2.100] | 1.50x faster |" in text
    assert "last only 2.000 s [1.900-2.100 s] vs all positions 3.000 s [2.900-3.100 s]: last only is 1.50x faster" in text


def test_table_section_says_whether_kvr_p_is_within_two_percent_of_kvr_s():
    from toyllm.measure import compare

    entries = [{"context": 1024, "chunks": [560, 464], "ratios": [0.546875, 0.453125]},
               {"context": 2048, "chunks": [1176, 872], "ratios": [0.57421875, 0.42578125]}]
    s_runs = [3.00, 3.02, 3.05]

    def data(p_runs):
        p_vs_s = compare(p_runs, s_runs)
        return {"file": "smollm2-135m-causal-p2.json", "entries": entries, "about": "Searched with `x`.",
                "target": 1536, "predicted": [860, 676], "kvr_s": [868, 668], "evaluations": 12, "even": [768, 768],
                "repeats": 2, "rounds": 3, "p_vs_s": p_vs_s, "e_vs_s": compare([3.3, 3.31, 3.35], s_runs),
                "gap": (p_vs_s.ours.median - p_vs_s.base.median) / p_vs_s.base.median}

    text = render_section("table", data([3.01, 3.03, 3.04]))
    assert "| 2048 | [1176, 872] | 0.574 |" in text and "Searched with `x`." in text
    assert "+0.3% from KVR-S's: within the 2% the target allows" in text
    text = render_section("table", data([3.20, 3.21, 3.22]))
    assert "+6.3% from KVR-S's: more than the 2% the target allows" in text


def test_every_section_has_a_template():
    from toyllm.bench.report import _template

    for name in SECTIONS:
        assert hasattr(_template().module, name), name


def test_missing_numbers_are_an_error_not_a_blank():
    with pytest.raises(Exception, match="no attribute .repeats."):
        render_section("first_token", {"threads": 2})


def test_a_table_cell_says_what_measure_decided():
    from toyllm.bench.report import _short
    from toyllm.measure import compare

    close = compare(_five([1.419, 1.420, 1.421]), _five([1.426, 1.427, 1.428]))      # apart, but within 1%
    assert close.word == "tie" and _short(close) == "tie (1.00x)"
    assert _short(compare(_five([1.0, 1.01, 1.02]), _five([1.2, 1.212, 1.22]))) == "1.20x faster"
    assert _short(compare(_five([1.2, 1.212, 1.22]), _five([1.0, 1.01, 1.02]))) == "1.20x slower"
    assert _short(compare([1.0, 1.01, 1.02], [1.2, 1.212, 1.22])) == "undecided (1.20x)"    # 3 rounds: too few


def _decode_step(speedup):
    from toyllm.measure import compare

    eager = _five([0.049, 0.050, 0.051])
    compile_ = {"eager": {"ok": True, "step_s": 0.050, "speedup": 1.0},
                "whole": {"ok": False, "reason": "NameError: name 's0' is not defined"},
                "parts": {"ok": True, "compile_s": 9.0, "step_s": 0.050 / speedup, "speedup": speedup,
                          "verdict": compare([t / speedup for t in eager], eager)}}
    row = {"format": "fp32", "step_s": 0.050, "top_level_calls": 1997.0, "all_calls": 6500.0,
           "bytes_allocated": 2.07e6, "matmul_share": 0.85, "compile": compile_,
           "top": [{"op": "aten::mm", "calls": 211.0, "share": 0.83}, {"op": "aten::bmm", "calls": 60.0, "share": 0.02},
                   {"op": "aten::mul", "calls": 212.0, "share": 0.01}]}
    return {"threads": 2, "n_layers": 30, "rows": [row]}


def test_decode_step_section_offers_compile_only_when_it_is_faster():
    slower = render_section("decode_step", _decode_step(0.94))
    assert "| fp32 | 50.0 | 1997 (67 per layer) | 6500 | 2.07 | 85% | aten::mm 83%, aten::bmm 2%, aten::mul 1% |" in slower
    assert "at most 1.18x faster" in slower and "1.06x slower than eager" in slower
    assert "| fp32 | 50.0 | failed: NameError: name 's0' is not defined | 53.2 ms, 1.06x slower than eager" in slower
    assert "toyllm does not offer it" in slower
    faster = render_section("decode_step", _decode_step(1.3))
    assert "1.30x faster than eager" in faster and "faster for fp32 here" in faster and "does not offer" not in faster


def _serving(continuous_ttft, chunked_ttft, identical=True):
    from toyllm.measure import compare, spread

    def row(way, ttft):
        out = {"way": way, "throughput": [100.0, 110.0, 120.0], "output_tokens": 500,
               **{m: spread(ttft) for m in ("ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99", "clock")}}
        if way != "continuous":
            out["verdicts"] = {m: compare(ttft, continuous_ttft) for m in ("ttft_p99", "tpot_p99", "clock")}
        return out

    return {"model": "tiny", "requests": 12, "rate": 40.0, "prompt_tokens": (4, 96), "new_tokens": (2, 24),
            "token_budget": 32, "bandwidth_gb_s": 10.0, "rounds": 3, "identical": identical, "threads": 2,
            "max_batch": 8, "block_size": 16,
            "rows": [row("continuous", continuous_ttft), row("chunked", chunked_ttft)]}


def test_serving_verdicts_follow_the_rounds():
    apart = render_section("serving", _serving(_five([1.0, 1.1, 1.2]), _five([0.5, 0.55, 0.6])))
    assert "| chunked | 550.0 ms [500.0-600.0 ms] |" in apart
    assert "- TTFT p99: chunked 550.0 ms [500.0-600.0 ms] vs continuous 1.100 s [1.000-1.200 s]: chunked is 2.00x faster" \
        in apart
    assert "| chunked | 550.0 ms [500.0-600.0 ms] | 550.0 ms" in apart and "110 [100-120]" in apart
    overlapping = render_section("serving", _serving(_five([1.0, 1.1, 1.2]), _five([0.9, 1.05, 1.3])))
    assert "a tie" in overlapping and "faster" not in overlapping.split("Against continuous")[1].split("The disagg")[0]
    assert "under every way: yes" in apart
    assert "under every way: NO" in render_section("serving", _serving([1.0], [1.0], identical=False))


@pytest.mark.slow
@pytest.mark.needs("8.1", "8.2", "8.3", "8.4")
def test_the_serving_benchmark_runs_each_way_in_turns(monkeypatch):
    """Every round runs each of the four ways once, in the same order, and each row holds its own runs."""
    from toyllm import disagg, serving
    from toyllm.bench import bench_serving

    calls = []
    real_serve, real_disagg = serving.serve, disagg.serve_disaggregated

    def serve(model, workload, policy, **kw):
        calls.append(policy)
        return real_serve(model, workload, policy, **kw)

    def serve_disaggregated(model, workload, link_model, **kw):
        calls.append("disaggregated")
        return real_disagg(model, workload, link_model, **kw)

    monkeypatch.setattr(serving, "serve", serve)
    monkeypatch.setattr(disagg, "serve_disaggregated", serve_disaggregated)
    data = bench_serving(quick=True)
    ways = [*serving.POLICIES, "disaggregated"]
    assert calls == ways * (1 + data["rounds"])                # a warm-up round, then the timed ones
    assert [r["way"] for r in data["rows"]] == ways and data["identical"]
    assert all(len(r["ttft_p99"].runs) == data["rounds"] for r in data["rows"])
    text = render_section("serving", data)
    assert text.count("- TTFT p99:") == 3 and "| disaggregated |" in text


def test_generation_and_weight_cells_show_their_rounds_and_decide_from_them():
    from toyllm.measure import compare, spread

    def gen_row(name, naive, cached):
        naive, cached = spread(naive), spread(cached)
        return {"name": name, "naive": naive, "cached": cached, "speedup": naive.median / cached.median,
                "round_speedups": [a / b for a, b in zip(naive.runs, cached.runs)],
                "verdict": compare(cached, naive), "identical": True}

    rows = [gen_row("tiny", _five([1.4, 1.5, 1.6]), _five([0.30, 0.31, 0.32])), gen_row("bench", [11.0, 11.3, 11.5], [1.3, 1.31, 1.4])]
    smol = {"prompt_len": 38, "new_tokens": 64, "ttft_s": 0.1, "tpot_s": 0.05}
    target = {**gen_row("bench", [2.0, 2.01, 2.05], [0.205, 0.21, 0.22]), "prompt_len": 64, "new_tokens": 256}
    text = render_section("generation", {"prompt_len": 64, "new_tokens": 512, "threads": 2, "repeats": 3,
                                         "rows": rows, "best": rows[1], "target": target, "smol": smol})
    assert "| tiny | 1.500 [1.400-1.600] | 0.310 [0.300-0.320] | 4.84x faster | True |" in text
    assert "256 new tokens after a 64-token prompt" in text
    assert "medians is 9.57x; round by round (each naive run over the cached run of its round) it ranges over " \
           "9.32-9.76x, so the 10x target is missed in every round." in text

    def with_target(naive, cached):
        return render_section("generation", {
            "prompt_len": 64, "new_tokens": 512, "threads": 2, "repeats": 3, "rows": rows, "best": rows[1],
            "target": {**target, **gen_row("bench", naive, cached)}, "smol": smol})

    assert "10.52x; round by round (each naive run over the cached run of its round) it ranges over 10.23-10.73x, " \
           "so the 10x target is met in every round." in with_target([2.2, 2.21, 2.25], [0.205, 0.21, 0.22])
    mixed = with_target([2.0, 2.1, 2.2], [0.21, 0.21, 0.21])
    assert "10.00x; round by round" in mixed and "ranges over 9.52-10.48x" in mixed
    assert "met in some rounds and missed in others: at 10x within the spread of this machine." in mixed

    from toyllm.bench import add_floor_figures

    def fmt_row(fmt, runs_s, fp32_runs):
        return add_floor_figures({"format": fmt, "kernel": "fbgemm" if fmt == "fp16" else "k", "bytes_per_token": 271e6,
                                  "linear_bytes": 270e6, "tokens_per_s": 1 / spread(runs_s).median, "runs_s": runs_s,
                                  "products_s": 0.015, "products_runs_s": [0.015], "calls_per_step": 1200,
                                  "vs_fp32": compare(runs_s, fp32_runs), "paris": True, "same_as_fp32": True}, 23.66e9)

    fp32 = _five([0.060, 0.059, 0.061])
    weights = [fmt_row("fp32", fp32, fp32), fmt_row("fp16", _five([0.023, 0.0225, 0.024]), fp32),
               fmt_row("bf16", _five([0.058, 0.062, 0.060]), fp32)]
    text = render_section("weights", {"bandwidth_bytes_per_s": 23.66e9, "threads": 2, "prompt_len": 37, "new_tokens": 32,
                                      "rounds": 3, "attention": "dense", "rows": weights, "best": weights[1],
                                      "at_floor": [], "capability": "AVX2", "floor_target": 0.65})
    assert "| fp32 | k | 271 | 87.3 | 16.7 [16.4-16.9] | 19% | - |" in text
    assert "| fp16 | fbgemm | 271 | 87.3 | 43.5 [41.7-44.4] | 50% | 2.61x faster |" in text
    assert "| bf16 | k | 271 | 87.3 | 16.7 [16.1-17.2] | 19% | tie (1.00x) |" in text      # the ranges overlap
    assert "fp16: 43.5 tokens/s, 2.61x faster than float32. No format reaches its floor." in text
    assert "PyTorch CPU capability AVX2" in text


@pytest.mark.engine
def test_a_long_run_keeps_what_was_written_to_the_file_meanwhile(monkeypatch, tmp_path):
    """run_benchmarks reads the file when it writes: an edit (or another run) during the work survives."""
    import toyllm.bench as bench

    for name, value in bench.RESIDENT_HEAP_ENV.items():
        monkeypatch.setenv(name, value)          # no re-run of the command in a fresh process
    target = tmp_path / "bench.md"
    target.write_text("# Benchmarks\n\nintro\n\n<!-- bench:generation -->\nold\n<!-- /bench:generation -->\n")

    def section(quick):                          # someone edits the introduction while this section runs
        target.write_text(target.read_text().replace("intro", "a better intro"))
        return {}

    monkeypatch.setitem(bench.SECTIONS, "generation", section)
    monkeypatch.setattr(bench, "render_section", lambda name, data: "a new table")
    bench.run_benchmarks(str(target), sections=["generation"], quick=True)
    text = target.read_text()
    assert "a better intro" in text and "a new table" in text and "old" not in text
    assert bench.cpu_name() in text and "PyTorch CPU capability" in text     # the line names the CPU


def _search(errors):
    """Search-section data as bench_search returns it; ``errors`` are the fitted model's relative errors."""
    from toyllm.measure import compare, spread
    from toyllm.parallel.link import LinkMeasurement
    from toyllm.simulate import CostModel

    sizes = [4096, 1048576]
    link = LinkMeasurement(sizes, [[60e-6, 62e-6], [300e-6, 310e-6]], [61e-6, 305e-6], 4.3e9, 60e-6, 0.02)
    cm = CostModel(4e-6, 1.3e-5, 2.5e-8, 7e-4, 4.3e9, 60e-6, label="fitted to 24 real runs' timelines, contexts [1536]")
    block = cm.with_(attn_s_per_dot=6.6e-8, label="calibrated on this machine: 1 thread(s)")
    accuracy = [{"context": 2048, "method": "kvr", "chunks": [1229, 819], "real": 1.0, "sim": 1.0 + e,
                 "sim_block": 1.5, "runs": spread([0.75, 1.0, 1.02]), "beyond": abs(e) > 0.10} for e in errors]
    return {"cm": cm, "block": block, "link": link,
            "link_rows": [{"size": "4 KB", "median": 61e-6, "low": 60e-6, "high": 62e-6, "fit": 61e-6}],
            "repeats": 3, "warm": 2, "accuracy": accuracy, "max_error": max(map(abs, errors)),
            "median_error": 0.05, "block_max_error": 0.5, "block_median_error": 0.5,
            "searches": [{"context": 4096, "search": "measured", "chunks": [2496, 1600], "evaluations": 13,
                          "ttft": 1.0}], "target": 4096, "table_contexts": [2048, 6144], "t_p": 1.01, "t_s": 1.0,
            "p_vs_s": compare([1.0, 1.01, 1.02], [0.99, 1.0, 1.01]), "same_partition": False, "gpu_label": "assumed",
            "scaling": []}


def test_search_section_shows_the_measured_link_and_both_cost_models():
    good = render_section("search", _search([0.08, -0.03]))
    assert "Fitted: 4.30 GB/s + 60 us per message (measured, gloo ping-pong between 2 processes" in good
    assert "| 4 KB | 61 us [60-62 us] | 61 us |" in good
    assert "attention (o_proj included) 25.000 ns per query-key pair" in good
    assert "attention 66.000 ns per query-key pair" in good
    assert "| 2048 | KVR | [1229, 819] | 1.080 | 1.000 [0.750-1.020] | +8.0% | no | 1.500 | +50.0% |" in good
    assert "largest error 8.0%, median 5.0%: the largest is within the 10% target. One Block" in good
    assert "(assumed)" not in good.split("### Simulated scaling")[0]
    bad = render_section("search", _search([0.12, -0.03, -0.2]))
    assert "largest error 20.0%, median 5.0%: the largest is not within the 10% target; 1 of 3 rows are." in bad
    assert ("2048 tokens, KVR [1229, 819] (+12.0%; outside that row's runs, 1.000 [0.750-1.020] s: a real miss "
            "of the model); 2048 tokens, KVR [1229, 819] (-20.0%; the simulated time lies inside that row's own "
            "runs, 1.000 [0.750-1.020] s, so the error is one this machine cannot resolve). One Block") in bad


def test_search_section_shows_what_key_counts_off_a_multiple_of_8_cost():
    from toyllm.measure import compare, spread

    d = _search([0.08, -0.03])
    d["cm"] = d["cm"].with_(attn_unaligned_s_per_dot=5e-9, allgather_bandwidth_bytes_per_s=1.2e9,
                            allgather_latency_s=1.5e-3)
    per_pair = {S: _five(r) for S, r in {4096: [3.0e-9, 3.1e-9, 3.2e-9], 4098: [4.4e-9, 4.5e-9, 4.6e-9],
                                         4104: [3.0e-9, 3.4e-9, 3.5e-9]}.items()}
    d["scores_alignment"] = [{"keys": S, "queries": 2048, "aligned": S % 8 == 0, "per_pair": spread(r),
                              "reference": 4096 if S < 4104 else 4104,
                              "vs_reference": None if S % 8 == 0 else compare(per_pair[4096], r)}
                             for S, r in per_pair.items()]
    d["ragged"] = {"chunks": [5734, 2458], "aligned_chunks": [5736, 2456], "sim": {"ragged": 3.9, "aligned": 3.5},
                   "verdict": compare(_five([3.6, 3.64, 3.7]), _five([4.05, 4.1, 4.2]))}
    text = render_section("search", d)
    assert "25.000 ns per query-key pair, 5.000 ns more (+20%) when the rank's key count is not a multiple of 8" in text
    assert "| 4096 | yes | 3.10 [3.00-3.20] | - |" in text
    assert "| 4098 | no | 4.50 [4.40-4.60] | 4096 keys: 1.45x as costly per pair |" in text
    assert "| 4104 | yes | 3.40 [3.00-3.50] | - |" in text
    assert ("In a real run at 8192 tokens, the table's last split and its nearest neighbour with a boundary that "
            "is a multiple of 8 took turns for 5 rounds: KVR [5736, 2456] 3.640 s [3.600-3.700 s] vs KVR [5734, 2458] "
            "4.100 s [4.050-4.200 s]: KVR [5736, 2456] is 1.13x faster (5 rounds, p = 0.0079). The fitted model gives "
            "3.500 s and 3.900 s.") in text
    gather_ms, message_ms = (4194304 / 1.2e9 + 1.5e-3) * 1e3, (4194304 / 4.3e9 + 60e-6) * 1e3
    assert (f"one ring step costs 1.20 GB/s + 1500 us. A 4 MB piece (2048 tokens of this preset's K and V) then "
            f"takes {gather_ms:.2f} ms, against {message_ms:.2f} ms as one message. The simulator charges TSP this.") in text
    # Without the measurements (an older report's data) the paragraphs are left out, and so is a zero surcharge.
    plain = render_section("search", _search([0.08, -0.03]))
    assert "Key counts that are not a multiple of 8" not in plain and "ns more (" not in plain
    assert "TSP's all-gather" not in plain


def test_time_split_sums_each_ranks_timeline_by_what_it_was_doing():
    from types import SimpleNamespace

    from toyllm.bench import time_split

    def ev(rank, kind, seconds, label=""):
        return {"rank": rank, "kind": kind, "start_s": 0.0, "end_s": seconds, "layer": 0, "label": label}

    timeline = [ev(0, "compute", 1.0, "qkv"), ev(0, "compute", 4.0, "attention"), ev(0, "compute", 2.0, "mlp"),
                ev(0, "send", 0.5), ev(0, "compute", 9.0, "embed"),                 # not a layer step: left out
                ev(1, "compute", 0.5, "qkv"), ev(1, "recv_wait", 1.5), ev(1, "compute", 3.0, "attention"),
                ev(1, "compute", 1.0, "mlp"), ev(1, "send_wait", 0.25), ev(1, "allgather", 0.25)]
    run = SimpleNamespace(world_size=2, timeline=timeline, ttft_s=7.5, partition=[600, 400])
    split = time_split(run)
    assert split["ranks"][0] == {"projections": 1.0, "attention": 4.0, "mlp": 2.0, "waiting": 0.0, "sending": 0.5,
                                 "compute": 7.0}
    assert split["ranks"][1] == {"projections": 0.5, "attention": 3.0, "mlp": 1.0, "waiting": 2.0, "sending": 0.0,
                                 "compute": 4.5}
    assert (split["imbalance"], split["compute"], split["waiting"]) == (2.5, 11.5, 2.0)
    assert split["ttft"] == 7.5 and split["partition"] == [600, 400]


def test_naive_and_cached_timing_takes_cache_kinds_and_cache_factories():
    """Each cache is a kind or a (name, new-cache function) pair; every run gets a fresh cache."""
    import torch

    from toyllm import DynamicKVCache, build_model
    from toyllm.bench import time_naive_and_cached

    model = build_model("tiny", seed=0)
    made = []

    def roomy():
        made.append(DynamicKVCache(model.config.n_layers, headroom=2))
        return made[-1]

    prompts = torch.randint(0, model.config.vocab_size, (3, 6), generator=torch.Generator().manual_seed(0))
    row = time_naive_and_cached(model, prompts, 5, rounds=2, warmup=1, caches=("dynamic", ("roomy", roomy)))
    assert row["cache"] == "dynamic" and [c["cache"] for c in row["other_caches"]] == ["roomy"]
    assert len(made) == 3 and len({id(c) for c in made}) == 3          # a warm-up and two rounds, a cache each
    assert all(c.length == 6 + 4 for c in made)
    assert row["identical"] and row["other_caches"][0]["identical"]
    assert len(row["round_speedups"]) == len(row["other_caches"][0]["round_speedups"]) == 2


def test_window_products_times_each_layout_in_turns():
    from toyllm.bench.decode import window_products

    out = window_products(batch=4, keys=10, gaps=(0, 3, 20), head_dim=8, rounds=2)
    assert out["gaps"] == [0, 3, 20] and [len(r.runs) for r in out["runs"]] == [2, 2, 2]
    assert out["verdict"].ours is out["runs"][0] and out["verdict"].base is out["runs"][-1]


def test_ring_section_decides_each_comparison_and_each_link_from_the_rounds():
    from toyllm.measure import compare, spread

    def runs(*medians):
        return {name: spread([m * f for f in (0.98, 0.99, 1.0, 1.01, 1.02)]) for name, m in medians}

    family = runs(("1 process, 1 thread", 3.0), ("1 process, 2 threads", 2.0), ("TSP-zigzag", 1.8), ("KVR-S", 1.7),
                  ("ring", 2.4), ("ring-zigzag", 1.75))
    verdict = {"base": compare(family["ring-zigzag"], family["1 process, 2 threads"]),
               "zigzag": compare(family["ring-zigzag"], family["TSP-zigzag"]),
               "kvr": compare(family["ring-zigzag"], family["KVR-S"]),
               "balance": compare(family["ring-zigzag"], family["ring"])}
    fast, slow = spread([0.10, 0.11, 0.12, 0.105, 0.115]), spread([0.30, 0.31, 0.32, 0.305, 0.315])
    passes = [{"new": 256, "cached": 3840, "share": 1 / 16, "link": "1 GB/s (simulated)", "kv": slow, "q": fast,
               "q_vs_kv": compare(fast, slow), "bytes": {"kv": 3_145_728, "q": 297_984, "choose": "q"}},
              {"new": 2048, "cached": 2048, "share": 1 / 2, "link": "1 GB/s (simulated)", "kv": fast, "q": slow,
               "q_vs_kv": compare(slow, fast), "bytes": {"kv": 3_145_728, "q": 4_767_744, "choose": "kv"}}]
    text = render_section("ring", {"machine": "quiet", "rounds": 5, "total": 4096, "rule_share": 0.248,
                                   "heads": (9, 3, 64), "passes": passes,
                                   "families": [{"model": "bench", "context": 8192, "chunks": [5734, 2458],
                                                 "runs": family, "baseline": "1 process, 2 threads", "rounds": 5,
                                                 "verdicts": verdict}]})
    assert "vs contiguous ring 2.400 s [2.352-2.448 s]: ring-zigzag is 1.37x faster" in text, text
    assert "vs TSP-zigzag 1.800 s [1.764-1.836 s]: a tie" in text, text
    assert "1 GB/s (simulated): pass-Q is 2.82x faster than pass-KV at 6.2% new; 2.82x slower than pass-KV at 50.0% new." \
        in text, text
    assert "pass-Q wins below a new share of 24.8%" in text and "| pass-Q |" in text and "| pass-KV |" in text
