"""Verdicts from timings: "faster" only when the runs say so, "tie" inside the spread, never from one run."""
import math

import pytest

from toyllm.measure import (ONE_THREAD, TWO_THREADS, MachineState, Spread, compare, interleaved_runs,
                            one_process_baseline, spread)


def test_faster_only_when_every_run_is_below_every_run_of_the_baseline():
    v = compare([0.40, 0.41, 0.42], [0.50, 0.52, 0.55])
    assert v.word == "faster" and v.decided and v.ratio == pytest.approx(0.52 / 0.41)
    assert compare([0.50, 0.52, 0.55], [0.40, 0.41, 0.42]).word == "slower"


def test_overlapping_runs_or_close_medians_are_a_tie():
    assert compare([0.40, 0.45, 0.60], [0.50, 0.52, 0.55]).word == "tie"          # ranges overlap
    assert compare([0.4190, 0.4200], [0.4210, 0.4215]).word == "tie"              # apart, but within 1%
    assert "a tie" in compare([0.415, 0.421, 0.43], [0.418, 0.42]).sentence("2 processes", "1 process")


def test_one_run_on_a_side_decides_nothing():
    v = compare([0.1], [0.9, 1.0])
    assert v.word == "undecided" and not v.decided
    assert "undecided" in v.sentence("a", "b")


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
    assert one_process_baseline([1.0, 1.01, 1.02], [0.60, 0.61, 0.62])[0] == TWO_THREADS
    name, why = one_process_baseline([1.0, 1.01, 1.02], [2.30, 2.35, 2.40])     # 2 threads lose: oversubscribed
    assert name == ONE_THREAD and why.startswith("oversubscribed")


def test_the_machine_line_says_oversubscribed_when_two_threads_lose():
    busy = MachineState(cores=2, load=3.1, one_thread=spread([1.0, 1.01, 1.02]), two_threads=spread([2.3, 2.4, 2.5]))
    assert busy.oversubscribed and busy.busy and "oversubscribed" in busy.line
    quiet = MachineState(cores=2, load=0.1, one_thread=spread([1.0, 1.01, 1.02]), two_threads=spread([0.6, 0.61, 0.62]))
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
