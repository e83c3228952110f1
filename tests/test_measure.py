"""Verdicts from timings: "faster" only when a rank test says so at 1%, "tie" inside the noise, "undecided"
with too few runs to decide."""
import math
import random

import pytest

from toyllm.measure import (ALPHA, MIN_EFFECT, ONE_THREAD, TWO_THREADS, MachineState, Spread, _u_counts, compare,
                            interleaved_runs, min_p, one_process_baseline, rank_test_p, runs_needed, spread)


def test_a_clear_difference_with_enough_rounds_is_decided():
    v = compare([0.40, 0.41, 0.42, 0.43, 0.44], [0.50, 0.52, 0.55, 0.51, 0.53])
    assert v.word == "faster" and v.decided and v.ratio == pytest.approx(0.52 / 0.42)
    assert v.p == pytest.approx(2 / math.comb(10, 5))
    assert "faster (5 rounds, p = 0.0079)" in v.sentence("a", "b")
    assert compare([0.50, 0.52, 0.55, 0.51, 0.53], [0.40, 0.41, 0.42, 0.43, 0.44]).word == "slower"
    # one overlap of eight runs a side still decides: the rank test weighs every pair, not only the extremes
    assert compare([0.40, 0.41, 0.42, 0.43, 0.44, 0.45, 0.46, 0.51],
                   [0.50, 0.52, 0.53, 0.54, 0.55, 0.56, 0.57, 0.58]).word == "faster"


def test_too_few_rounds_say_undecided_whatever_the_runs_show():
    assert runs_needed() == 5 and min_p(4, 4) > ALPHA >= min_p(5, 5)
    for n in range(1, 5):                      # every run of one 10x below every run of the other
        v = compare([0.1 + 0.001 * i for i in range(n)], [1.0 + 0.001 * i for i in range(n)])
        assert v.word == "undecided" and not v.decided
        assert f"undecided ({n} round{'s' * (n > 1)}; a verdict needs 5)" in v.sentence("a", "b")   # "1 round"
    assert compare([0.1], [0.9, 1.0, 1.1, 1.2, 1.3, 1.4]).word == "undecided"
    assert "4 and 5 runs; a verdict needs 5" in compare([0.1] * 4, [0.9] * 5).than


def test_overlapping_runs_or_close_medians_are_a_tie():
    assert compare([0.40, 0.45, 0.60, 0.52, 0.50], [0.50, 0.52, 0.55, 0.49, 0.51]).word == "tie"
    close = compare([0.4190, 0.4192, 0.4195, 0.4198, 0.4200], [0.4210, 0.4212, 0.4215, 0.4217, 0.4220])
    assert close.p <= ALPHA and close.word == "tie"                   # apart in rank, but within 1%
    assert "a tie" in compare([0.415, 0.421, 0.43, 0.42, 0.425], [0.418, 0.42, 0.422, 0.43, 0.41]).sentence("x", "y")


def test_the_exact_null_distribution_and_p():
    assert _u_counts(2, 2) == (1, 1, 2, 1, 1)                        # the 6 orderings of 2 runs against 2
    for n, m in ((3, 4), (5, 5), (8, 6)):
        counts = _u_counts(n, m)
        assert sum(counts) == math.comb(n + m, n) and counts == counts[::-1]     # all orderings, symmetric
    assert rank_test_p([1, 2, 3], [4, 5, 6]) == pytest.approx(2 / 20)
    assert rank_test_p([1, 2, 3], [1, 2, 3]) == 1.0
    assert rank_test_p([1, 2, 4, 3, 5], [6, 7, 8, 9, 10]) == rank_test_p([6, 7, 8, 9, 10], [1, 2, 4, 3, 5])


@pytest.mark.parametrize("n", range(2, 9))
def test_the_false_verdict_rate_is_at_most_alpha_for_every_number_of_rounds(n):
    """Exactly: the share of the C(2n, n) equally likely orderings of two same-distribution samples whose p
    reaches ALPHA is at most ALPHA. Sampled: 20,000 pairs of samples from one log-normal distribution with 10%
    spread give "faster" or "slower" at most ALPHA of the time, plus three standard errors of a 20,000-trial
    estimate of ALPHA (0.21 percentage points) for the sampling's own noise."""
    counts = _u_counts(n, n)
    total = math.comb(2 * n, n)
    rejected = sum(c for u, c in enumerate(counts) if 2 * sum(counts[max(u, n * n - u):]) / total <= ALPHA)
    assert rejected / total <= ALPHA

    rng, trials = random.Random(n), 20_000
    false = sum(compare([rng.lognormvariate(0, 0.1) for _ in range(n)],
                        [rng.lognormvariate(0, 0.1) for _ in range(n)]).decided for _ in range(trials))
    margin = 3 * math.sqrt(ALPHA * (1 - ALPHA) / trials)
    assert false / trials <= ALPHA + margin, f"{n} rounds: {false} false verdicts in {trials}"


def test_one_run_or_too_few_decide_nothing():
    v = compare([0.1], [0.9, 1.0])
    assert v.word == "undecided" and not v.decided
    assert "undecided" in v.sentence("a", "b")
    assert MIN_EFFECT == 0.01


def test_a_spread_prints_its_median_and_range_and_rejects_nonsense():
    assert str(Spread((0.498, 0.512, 0.530))) == "512.0 ms [498.0-530.0 ms]"
    assert str(Spread((1.5, 1.6, 1.7))) == "1.600 s [1.500-1.700 s]"
    assert str(spread([2.0])) == "2.000 s (1 run)"
    for bad in ((), (math.nan,), (-1.0,)):
        with pytest.raises(ValueError):
            Spread(bad)


def test_runs_take_turns_and_a_function_may_report_its_own_seconds():
    order = []
    runs = interleaved_runs({"a": lambda: order.append("a") or 0.25, "b": lambda: order.append("b")},
                            rounds=2, warmup=1)
    assert order == ["a", "b"] * 3
    assert runs["a"] == [0.25, 0.25] and len(runs["b"]) == 2
    with pytest.raises(ValueError, match="rounds"):
        interleaved_runs({"a": lambda: None}, rounds=0)


def test_the_baseline_is_what_a_user_would_run():
    one = [1.0, 1.01, 1.02, 1.03, 1.04]
    assert one_process_baseline(one, [0.60, 0.61, 0.62, 0.63, 0.64])[0] == TWO_THREADS
    name, why = one_process_baseline(one, [2.30, 2.35, 2.40, 2.45, 2.50])     # 2 threads lose: oversubscribed
    assert name == ONE_THREAD and why.startswith("oversubscribed")


def test_the_machine_line_says_oversubscribed_when_two_threads_lose():
    one = spread([1.0, 1.01, 1.02, 1.03, 1.04])
    busy = MachineState(cores=2, load=3.1, one_thread=one, two_threads=spread([2.3, 2.4, 2.5, 2.6, 2.7]))
    assert busy.oversubscribed and busy.busy and "oversubscribed" in busy.line
    quiet = MachineState(cores=2, load=0.1, one_thread=one, two_threads=spread([0.6, 0.61, 0.62, 0.63, 0.64]))
    assert not quiet.busy and "oversubscribed" not in quiet.line


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("single_in_workers", [False, True])
def test_compare_prefills_times_every_configuration_in_turns_with_equal_answers(single_in_workers):
    """Every configuration gets its rounds, the one-process ones on 1 and 2 threads (in this process or in
    workers of their own), and every run computes the same first token as one process."""
    from toyllm.measure import compare_prefills
    from toyllm.parallel import ModelSpec
    from toyllm.utils import random_prompt

    machine = MachineState(2, 0.0, spread([0.02, 0.02]), spread([0.01, 0.01]))     # not measured: not a timing test
    measured = compare_prefills(ModelSpec("tiny"), random_prompt(40, 256, 5), {"KVR, [30, 10]": dict(
        method="kvr", partition=[30, 10])}, rounds=2, warmup=1, machine=machine, timeout_s=120,
        single_in_workers=single_in_workers)
    assert list(measured.runs) == [ONE_THREAD, TWO_THREADS, "KVR, [30, 10]"]
    assert all(len(s.runs) == 2 for s in measured.runs.values())
    assert [measured.results[n].threads_per_rank for n in (ONE_THREAD, TWO_THREADS)] == [1, 2]
    assert len({r.first_token for r in measured.results.values()}) == 1
    assert measured.baseline in (ONE_THREAD, TWO_THREADS) and measured.parallel == ["KVR, [30, 10]"]


def test_busy_cpu_seconds_counts_this_process_spinning(monkeypatch):
    import time

    import toyllm.measure
    from toyllm.measure import busy_cpu_seconds, usable_cores

    if math.isnan(busy_cpu_seconds()):
        pytest.skip("no /proc/stat here")
    start, wall, cpu = busy_cpu_seconds(), time.perf_counter(), time.process_time()
    while time.process_time() - cpu < 0.3:          # 0.3 CPU-seconds of this process alone
        pass
    busy, wall = busy_cpu_seconds() - start, time.perf_counter() - wall
    # at least most of our own spin (the kernel counts in ticks), at most every core for the whole time
    assert 0.2 <= busy <= usable_cores() * wall + 0.05

    def no_proc_stat(path, *args, **kwargs):
        raise FileNotFoundError(path)

    monkeypatch.setattr(toyllm.measure, "open", no_proc_stat, raising=False)   # found before the builtin
    assert math.isnan(busy_cpu_seconds())
