"""Graded tests of lesson 07 (ex07_networks): 10 points.

7.1 chain_transfer_s 2, 7.2 ring_allgather_s 2, 7.3 kvr_ttft 3, 7.4 break_even_context 3.
References live here: the transfer times and the KV-Runahead chain written
out from their definitions; the break-even search runs against a speedup
with a known crossing and against toyllm's simulator (checked at the answer
and one token before it), with a limit on the calls.
"""
import functools
import random

import pytest

from toyllm.grading.sandbox import harness
from toyllm.grading.expect import close, equal, raises
from toyllm.grading.references import reference
from toyllm.model import get_config
from toyllm.simulate import CostModel

BENCH = get_config("bench")
CPU_LIKE = CostModel(qkv_s_per_token=4e-6, mlp_s_per_token=8e-6, attn_s_per_dot=2e-9, layer_overhead_s=1e-4,
                     link_bandwidth_bytes_per_s=3e9, link_latency_s=5e-5, label="test values")


@reference
def chain_reference(chunks, row_bytes, bandwidth, latency):
    """Seconds of each message: rank i sends K and V of tokens 0 .. the end of its chunk."""
    return [2 * sum(chunks[:i + 1]) * row_bytes / bandwidth + latency for i in range(len(chunks) - 1)]


@reference
def ring_reference(chunks, row_bytes, bandwidth, latency):
    return (len(chunks) - 1) * (2 * max(chunks) * row_bytes / bandwidth + latency)


def check_floats(got, n, call):
    if type(got) is not list or len(got) != n or any(type(x) is not float for x in got):
        raise AssertionError(f"{call}: expected a list of {n} Python floats, got {got!r}")


# --------------------------------------------------------------------------- 7.1

@pytest.mark.exercise("7.1")
@pytest.mark.points(1)
def test_ex7_1_the_papers_example(ex07):
    # C = 9 on 3 processes, chunks [4, 3, 2]: rank 0 sends 8 rows, rank 1 sends 14 (22 in all)
    call = "chain_transfer_s([4, 3, 2], row_bytes=1024, bandwidth=1e9 B/s, latency=1e-5 s)"
    got = ex07.chain_transfer_s([4, 3, 2], 1024, 1e9, 1e-5)
    check_floats(got, 2, call)
    for i, (g, rows, want) in enumerate(zip(got, (8, 14), chain_reference([4, 3, 2], 1024, 1e9, 1e-5))):
        close(g, want, f"{call}: message {i} -> {i + 1} ({rows} rows)", rel=1e-12)


@pytest.mark.exercise("7.1")
@pytest.mark.points(1)
def test_ex7_1_other_and_drawn_partitions_and_bad_input(ex07, drawn):
    call = "chain_transfer_s([1000, 700, 500, 300], row_bytes=512, bandwidth=10e9, latency=2e-6)"
    got = ex07.chain_transfer_s([1000, 700, 500, 300], 512, 10e9, 2e-6)
    check_floats(got, 3, call)
    for i, (g, want) in enumerate(zip(got, chain_reference([1000, 700, 500, 300], 512, 10e9, 2e-6))):
        close(g, want, f"{call}: message {i} -> {i + 1}", rel=1e-12)
    rng = drawn.rng("7.1")
    for _ in range(4):
        chunks = [rng.randint(1, 5000) for _ in range(rng.randint(2, 8))]
        rb, bw, lat = rng.choice([64, 512, 1024, 4096, 8192]), 10 ** rng.uniform(7, 12), rng.choice([0.0, 10 ** rng.uniform(-7, -2)])
        call = f"chain_transfer_s({chunks}, {rb}, {bw:g}, {lat:g}; {drawn})"
        got = ex07.chain_transfer_s(chunks, rb, bw, lat)
        check_floats(got, len(chunks) - 1, call)
        for i, (g, want) in enumerate(zip(got, chain_reference(chunks, rb, bw, lat))):
            close(g, want, f"{call}: message {i} -> {i + 1}", rel=1e-12)
    equal(ex07.chain_transfer_s([64], 512, 1e9, 1e-6), [], "chain_transfer_s([64], ...) (one process sends nothing)")
    for args, why in [(([], 512, 1e9, 0.0), "empty partition"), (([3, 0], 512, 1e9, 0.0), "a chunk of 0"),
                      (([3, 3], 512, 0.0, 0.0), "bandwidth 0"), (([3, 3], 512, 1e9, -1.0), "negative latency")]:
        raises(ValueError, ex07.chain_transfer_s, *args, call=f"chain_transfer_s{args}", why=why)


# --------------------------------------------------------------------------- 7.2

@pytest.mark.exercise("7.2")
@pytest.mark.points(1)
def test_ex7_2_even_uneven_and_drawn_rings(ex07, drawn):
    rng = drawn.rng("7.2")
    cases = [([3, 3, 3], 1024, 1e9, 1e-5), ([5, 1, 2], 256, 3e9, 0.0), ([2048] * 8, 8192, 300e9, 1e-5),
             ([100, 900], 64, 1e8, 1e-3)]
    cases += [([rng.randint(1, 5000) for _ in range(rng.randint(2, 8))], rng.choice([64, 512, 4096]),
               10 ** rng.uniform(7, 12), rng.choice([0.0, 10 ** rng.uniform(-7, -2)])) for _ in range(4)]
    for i, (chunks, rb, bw, lat) in enumerate(cases):
        shown = '[2048] * 8' if i == 2 else chunks
        call = f"ring_allgather_s({shown}, {rb}, {bw:g}, {lat:g}{f'; {drawn}' if i >= 4 else ''})"
        got = ex07.ring_allgather_s(chunks, rb, bw, lat)
        equal(type(got), float, f"{call}: type of the result")
        close(got, ring_reference(chunks, rb, bw, lat), call, rel=1e-12)


@pytest.mark.exercise("7.2")
@pytest.mark.points(1)
def test_ex7_2_one_process_and_bad_input(ex07):
    equal(ex07.ring_allgather_s([77], 512, 1e9, 1e-5), 0.0, "ring_allgather_s([77], ...) (one process: no ring)")
    for args, why in [(([], 512, 1e9, 0.0), "empty partition"), (([3, -1], 512, 1e9, 0.0), "a negative chunk"),
                      (([3, 3], 0, 1e9, 0.0), "row_bytes 0"), (([3, 3], 512, -5.0, 0.0), "negative bandwidth")]:
        raises(ValueError, ex07.ring_allgather_s, *args, call=f"ring_allgather_s{args}", why=why)


# --------------------------------------------------------------------------- 7.3

@reference
def reference_kvr_ttft(chunks, n_layers, row_bytes, cm):
    arrived_prev = [0.0] * n_layers
    s = 0
    for i, c in enumerate(chunks):
        t, sent, arrived = 0.0, 0.0, [0.0] * n_layers
        for layer in range(n_layers):
            t += cm.layer_overhead_s + cm.qkv_s_per_token * c
            if i > 0:
                t = max(t, arrived_prev[layer])
            if i < len(chunks) - 1:
                t = max(t, sent)
                sent = arrived[layer] = t + cm.transfer_s(2 * (s + c) * row_bytes)
            t += cm.attn_s_per_dot * c * (s + c) + cm.mlp_s_per_token * c
        arrived_prev, s = arrived, s + c
    return t


def _ttft_case(ex07, chunks, layers, rb, cm, what):
    call = f"kvr_ttft({chunks}, n_layers={layers}, row_bytes={rb}, {what})"
    got = ex07.kvr_ttft(chunks, layers, rb, cm)
    equal(type(got), float, f"{call}: type of the result")
    close(got, reference_kvr_ttft(chunks, layers, rb, cm), call, rel=1e-9)


@pytest.mark.exercise("7.3")
@pytest.mark.points(1)
def test_ex7_3_one_and_two_processes(ex07):
    _ttft_case(ex07, [1000], 4, 1024, CPU_LIKE, "one process")
    _ttft_case(ex07, [600, 400], 4, 1024, CPU_LIKE, "a fast link")
    _ttft_case(ex07, [300, 700], 6, 1024, CPU_LIKE.with_(link_bandwidth_bytes_per_s=1e7), "a slow link: rank 1 waits")


@pytest.mark.exercise("7.3")
@pytest.mark.points(1)
def test_ex7_3_many_processes_slow_sends_and_latency(ex07):
    # So slow a link that a rank must wait for its previous send before the next one
    _ttft_case(ex07, [50, 40, 30, 20], 5, 4096, CPU_LIKE.with_(link_bandwidth_bytes_per_s=1e6),
               "1 MB/s: sends queue up")
    _ttft_case(ex07, [9, 8, 7, 6, 5, 4, 3, 2], 3, 64, CPU_LIKE.with_(link_latency_s=0.01), "10 ms latency")


@pytest.mark.exercise("7.3")
@pytest.mark.points(1)
def test_ex7_3_random_and_drawn_cases(ex07, drawn):
    for rng, what in ((random.Random(7), "random cost model"), (drawn.rng("7.3"), f"a cost model {drawn}")):
        for _ in range(12):
            cm = CostModel(qkv_s_per_token=rng.uniform(1e-7, 1e-4), mlp_s_per_token=rng.uniform(1e-7, 1e-4),
                           attn_s_per_dot=rng.uniform(1e-10, 1e-7), layer_overhead_s=rng.uniform(0, 1e-3),
                           link_bandwidth_bytes_per_s=10 ** rng.uniform(5, 11), link_latency_s=rng.uniform(0, 1e-3))
            chunks = [rng.randint(1, 400) for _ in range(rng.randint(1, 6))]
            _ttft_case(ex07, chunks, rng.randint(1, 5), rng.choice([64, 1024, 4096]), cm, what)


# --------------------------------------------------------------------------- 7.4

def run_break_even(ex07, speedup, lo, hi):
    counted = harness.Counted(speedup)
    return ex07.break_even_context(counted, lo, hi), set(counted.calls)


@pytest.mark.exercise("7.4")
@pytest.mark.points(1)
def test_ex7_4_a_known_crossing_with_few_calls(ex07, drawn):
    rng = drawn.rng("7.4")
    cases = [(12_345, 1, 100_000, ""), (2, 1, 10, ""), (99_999, 1, 100_000, ""), (4096, 4000, 5000, "")]
    for _ in range(3):
        lo = rng.randint(1, 50_000)
        hi = lo + rng.randint(1, 200_000)
        cases.append((rng.randint(lo + 1, hi), lo, hi, f"; {drawn}"))
    for crossing, lo, hi, note in cases:
        call = f"break_even_context(speedup reaching 1 at {crossing} tokens, lo={lo}, hi={hi}{note})"
        got, tried = run_break_even(ex07, functools.partial(harness.step_speedup, crossing=crossing), lo, hi)
        equal(got, crossing, call)
        assert len(tried) <= 2 * (hi - lo).bit_length() + 4, (
            f"{call}: called speedup for {len(tried)} contexts; bisection needs about {(hi - lo).bit_length()}")


@pytest.mark.exercise("7.4")
@pytest.mark.points(1)
def test_ex7_4_none_lo_and_bad_input(ex07):
    got, _ = run_break_even(ex07, functools.partial(harness.step_speedup, crossing=5000), 1, 4999)
    equal(got, None, "break_even_context(speedup reaching 1 at 5000 tokens, lo=1, hi=4999) (never pays)")
    got, _ = run_break_even(ex07, functools.partial(harness.step_speedup, crossing=50), 64, 1000)
    equal(got, 64, "break_even_context(speedup reaching 1 at 50 tokens, lo=64, hi=1000) (pays from lo on)")
    speedup = harness.Counted(functools.partial(harness.step_speedup, crossing=50))
    raises(ValueError, ex07.break_even_context, speedup, 0, 10, call="break_even_context(speedup, lo=0, hi=10)",
           why="lo must be at least 1")
    raises(ValueError, ex07.break_even_context, speedup, 20, 10, call="break_even_context(speedup, lo=20, hi=10)",
           why="hi < lo")


@pytest.mark.exercise("7.4")
@pytest.mark.points(1)
def test_ex7_4_on_the_simulator(ex07):
    # A link with milliseconds of latency: short prompts lose, long ones win
    for latency, p in [(5e-3, 2), (2e-3, 4)]:
        cm = CPU_LIKE.with_(link_latency_s=latency)
        speedup = functools.partial(harness.simulated_speedup, cfg=BENCH, cost_model=cm, world_size=p)
        call = f"break_even_context(simulated speedup of KVR on {p} processes, {latency * 1e3:g} ms latency, 16, 32768)"
        got, tried = run_break_even(ex07, speedup, 16, 32768)
        if type(got) is not int:
            raise AssertionError(f"{call}: expected a Python int, got {got!r}")
        assert speedup(got) >= 1 > speedup(got - 1), (
            f"{call}: returned {got}, but the simulated speedup there is {speedup(got):.4f} and at {got - 1} "
            f"tokens {speedup(got - 1):.4f}: the answer is where it first reaches 1")
        assert len(tried) <= 34, f"{call}: called speedup for {len(tried)} contexts, more than the 34 allowed"
