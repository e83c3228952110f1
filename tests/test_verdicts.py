"""Words against numbers: the verdicts a lesson prints must agree with the runs printed beside them.

Lessons 04 and 05 time one process (1 and 2 threads) and parallel prefills
with ``toyllm.measure.compare_prefills`` and print its lines. The slow test
runs that measurement, in fast-mode sizes, while a CPU hog spins on every
core (the machine a learner shares with other work), and checks the printed
text against the printed numbers:

- "faster than" / "slower than" only on the side the printed medians say,
  with at least 5 runs a side (fewer cannot reach the rank test's 1%), and
  exactly where measure's own decision on those runs says so;
- an "oversubscribed" line, and one thread as the baseline, exactly when two
  threads lost to one in the printed runs.

No assertion is about a timing itself: whichever way the runs come out, the
words must follow them.
"""
from __future__ import annotations

import re

import pytest

from toyllm.measure import (ONE_THREAD, TWO_THREADS, MachineState, PrefillComparison, check_machine, compare,
                            compare_prefills, spread)

UNITS = {"ms": 1e-3, "s": 1.0}
# "512.0 ms [498.0-530.0 ms]", "1.600 s [1.500-1.700 s]" or, units mixed, "926.0 ms [128.8 ms-1.074 s]"
SPREAD = re.compile(r"(\d+\.\d+) (ms|s) \[(\d+\.\d+)(?: (ms|s))?-(\d+\.\d+) (ms|s)\]")
RUNS = re.compile(r"median \[fastest-slowest run\] of (\d+) interleaved runs")
WORDS = {"faster than": "faster", "slower than": "slower", "as fast (": "tie", "not comparable": "undecided"}


def printed_spread(text: str) -> tuple[float, float, float]:
    """(median, lowest, highest run) in seconds, as a Spread printed them."""
    m = SPREAD.search(text)
    assert m, f"no range of runs in {text!r}"
    median, median_unit, low, low_unit, high, high_unit = m.groups()
    return (float(median) * UNITS[median_unit], float(low) * UNITS[low_unit or high_unit],
            float(high) * UNITS[high_unit])


def printed_word(text: str) -> str:
    found = [word for key, word in WORDS.items() if key in text]
    assert len(found) == 1, f"expected one verdict in {text!r}, found {found}"
    return found[0]


def check_consistency(machine: MachineState, measured: PrefillComparison, printed: list[str]) -> None:
    """The printed lines (machine line first) agree with the printed runs and with measure's decisions on them."""
    machine_line, baseline_line, *rest = printed
    assert machine_line == machine.line
    assert ("oversubscribed" in machine_line) == (machine.threads.word == "slower"), machine_line

    threads = compare(measured.runs[TWO_THREADS], measured.runs[ONE_THREAD])
    lost = threads.word == "slower"
    assert ("oversubscribed" in baseline_line) == lost, baseline_line
    assert measured.baseline == (ONE_THREAD if lost else TWO_THREADS), (measured.baseline, baseline_line)

    rows = {}
    for line in rest:
        for name in measured.runs:
            if line.strip().startswith(name + " ") and SPREAD.search(line):
                rows[name] = line
    assert set(rows) == set(measured.runs), (sorted(rows), printed)
    runs = int(next(RUNS.search(line)[1] for line in rest if RUNS.search(line)))
    base_median = printed_spread(rows[measured.baseline])[0]
    for name, line in rows.items():
        assert str(measured.runs[name]) in line, (name, line)        # the numbers printed are the runs
        if name == measured.baseline:
            assert line.rstrip().endswith("the baseline"), line
            continue
        word = printed_word(line)
        assert word == compare(measured.runs[name], measured.runs[measured.baseline]).word, line
        median = printed_spread(line)[0]
        if word in ("faster", "slower"):
            assert runs >= 5, f"'{word}' from {runs} runs a side, too few for the rank test: {line!r}"
            assert (median < base_median) == (word == "faster"), f"'{word}' against the printed medians: {line!r}"
        elif word == "undecided":
            assert runs < 5, f"'undecided' with {runs} runs a side, enough to decide: {line!r}"

    fastest = measured.fastest_line()
    first, second = sorted(measured.runs, key=lambda n: measured.runs[n].median)[:2]
    v = compare(measured.runs[first], measured.runs[second])
    assert fastest.startswith("fastest here") == v.decided, fastest
    assert fastest.endswith("no single fastest") == (not v.decided), fastest
    assert f"{first}, {v.than} {second}" in fastest, fastest      # a tie or undecided in measure's own words


def comparison(one, two, tsp, load=0.5, machine_two=None) -> tuple[MachineState, PrefillComparison]:
    from toyllm.measure import one_process_baseline

    machine = MachineState(2, load, spread([0.020, 0.021, 0.022, 0.023, 0.024]),
                           spread(machine_two or [0.012, 0.013, 0.014, 0.015, 0.016]))
    baseline, why = one_process_baseline(one, two)
    runs = {ONE_THREAD: spread(one), TWO_THREADS: spread(two), "TSP, 2 processes": spread(tsp)}
    return machine, PrefillComparison(1024, machine, runs, baseline, why, {})


@pytest.mark.parametrize("one, two, tsp, machine_two", [
    ([1.0, 1.02, 1.05, 1.03, 1.04], [0.60, 0.62, 0.64, 0.61, 0.63], [0.50, 0.52, 0.55, 0.51, 0.53], None),
    ([1.0, 1.02, 1.05, 1.03, 1.04], [2.0, 2.4, 2.6, 2.2, 2.3], [0.98, 1.01, 1.20, 1.05, 0.99],
     [0.05, 0.06, 0.07, 0.065, 0.055]),                                              # oversubscribed, TSP ties
    ([0.09, 0.1, 0.102, 0.095, 0.097], [0.0995, 0.1, 1.2, 0.11, 0.105], [0.2, 0.21, 0.4, 0.3, 0.25], None),
    ([1.0, 1.02, 1.05], [0.60, 0.62, 0.64], [0.50, 0.52, 0.55], None),              # 3 rounds: undecided
])
def test_the_checker_accepts_what_measure_prints(one, two, tsp, machine_two):
    machine, measured = comparison(one, two, tsp, machine_two=machine_two)
    check_consistency(machine, measured, [machine.line, *measured.lines()])


def test_the_checker_catches_a_verdict_the_ranges_do_not_support():
    one = [1.0, 1.02, 1.05, 1.03, 1.04]
    machine, measured = comparison(one, [0.60, 0.62, 0.64, 0.61, 0.63], [0.58, 0.61, 0.70, 0.62, 0.60])   # TSP ties
    lines = [machine.line, *measured.lines()]
    forged = [line.replace("as fast (", "1.02x faster than (") if "TSP" in line else line for line in lines]
    with pytest.raises(AssertionError):
        check_consistency(machine, measured, forged)
    machine, measured = comparison(one[:3], [0.60, 0.62, 0.64], [0.50, 0.52, 0.55])    # 3 rounds: undecided
    lines = [machine.line, *measured.lines()]
    forged = [line.replace("not comparable (", "1.20x faster than (") if "TSP" in line else line for line in lines]
    with pytest.raises(AssertionError):
        check_consistency(machine, measured, forged)
    machine, measured = comparison(one, [2.0, 2.4, 2.6, 2.2, 2.3], [0.5, 0.5, 0.5, 0.5, 0.5])
    quiet = [line.replace("oversubscribed: ", "") for line in [machine.line, *measured.lines()]]
    with pytest.raises(AssertionError):
        check_consistency(machine, measured, quiet)


@pytest.fixture
def cpu_hog():
    """Processes spinning on every usable core but one (at least one) for the test's duration."""
    from verdict_text import cpu_hog as hog

    with hog() as n:
        yield n


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_lesson_05_verdicts_follow_the_runs_beside_a_cpu_hog(cpu_hog):
    from toyllm.parallel import ModelSpec
    from toyllm.partition import partition_from_ratios
    from toyllm.utils import random_prompt

    C = 256                                             # small: the verdicts matter here, not the sizes
    machine = check_machine()
    configurations = {"TSP": dict(method="tsp"), "KVR-E": dict(method="kvr"),
                      "KVR, 60% on rank 0": dict(method="kvr", partition=partition_from_ratios(C, [0.6, 0.4]))}
    measured = compare_prefills(ModelSpec("bench"), random_prompt(C, 256), configurations, rounds=5,
                                machine=machine, timeout_s=120)
    printed = [machine.line, *measured.lines()]
    print("\n".join(printed))
    assert list(measured.runs) == [ONE_THREAD, TWO_THREADS, *configurations]
    assert all(len(s.runs) == 5 for s in measured.runs.values())
    check_consistency(machine, measured, printed)
    for name in measured.parallel:                      # the sentence a lesson prints beside the table
        v = measured.verdict(name)
        sentence = v.sentence(name, measured.baseline)
        ours, base = (printed_spread(part)[0] for part in sentence.split(" vs ", 1))
        assert (f"{name} is" in sentence) == v.decided, sentence
        if v.word == "faster":
            assert ours < base and "faster" in sentence, sentence
        elif v.word == "slower":
            assert ours > base and "slower" in sentence, sentence
        else:
            assert v.word in sentence.replace("a tie", "tie") and "faster" not in sentence \
                and "slower" not in sentence, sentence


# --------------------------------------------------------------------------- any printed sentence, any lesson

FAST = [0.40, 0.41, 0.43, 0.42, 0.44]
BASE = [0.49, 0.50, 0.52, 0.51, 0.53]


@pytest.mark.parametrize("ours, base", [
    (FAST, BASE),                                                                 # faster
    ([0.60, 0.61, 0.63, 0.62, 0.64], BASE),                                      # slower
    ([0.48, 0.50, 0.55, 0.51, 0.49], BASE),                                      # tie: mixed in rank
    ([0.500, 0.501, 0.502, 0.5015, 0.5005], [0.503, 0.504, 0.505, 0.5035, 0.5045]),   # tie: apart, within 1%
    ([0.095, 0.1, 1.2, 0.097, 0.099], [0.2, 0.21, 0.4, 0.22, 0.3]),              # mixed units
    ([1.83e-3, 1.81e-3, 1.95e-3, 1.84e-3, 1.82e-3], [1.80e-3, 1.71e-3, 1.79e-3, 1.78e-3, 1.77e-3]),  # more digits
    ([1.1870, 1.2001, 1.1950, 1.1960, 1.1940], [1.2004, 1.2170, 1.2100, 1.2080, 1.2090]),  # faster, 4th decimal
    (FAST, BASE + [0.54, 0.55]),                                                 # faster, unequal sides
    ([0.40, 0.41, 0.43], [0.49, 0.50, 0.52]),                                    # undecided: 3 rounds
    ([0.4], BASE),                                                               # undecided: one run
])
def test_every_sentence_measure_prints_reads_back_as_its_verdict(ours, base):
    from verdict_text import count_verdicts, verdict_problems

    text = "some output\n" + compare(ours, base).sentence("KVR-P", "KVR-S") + " (the paper: within 1.3%)\nmore"
    assert count_verdicts(text) == 1 and verdict_problems(text) == [], text


def test_a_sentence_whose_words_its_numbers_do_not_support_is_caught():
    from verdict_text import verdict_problems

    tie = compare([0.48, 0.50, 0.55, 0.51, 0.49], BASE)
    assert tie.word == "tie"
    assert verdict_problems(tie.sentence("KVR", "TSP").split(": a tie")[0] + f": KVR is 1.00x faster (5 rounds, "
                                                                             f"p = {tie.p:.2g})")
    faster = compare(FAST, BASE).sentence("KVR", "TSP")
    assert verdict_problems(faster.split(": ")[0] + ": a tie (1.22x, inside the noise of the runs: 5 rounds, "
                                                    "p = 0.0079)")
    assert verdict_problems(faster.replace("faster", "slower"))
    assert verdict_problems(faster.replace("p = 0.0079", "p = 0.0016"))          # below what 5 runs a side can give
    three = compare([0.40, 0.41, 0.43], [0.49, 0.50, 0.52]).sentence("KVR", "TSP")
    assert verdict_problems(three.split(": ")[0] + ": KVR is 1.22x faster (3 rounds, p = 0.1)")
    assert verdict_problems(compare(FAST, BASE).sentence("KVR", "TSP").split(": ")[0] +
                            ": undecided (5 rounds; a verdict needs 5)")
    one = compare([0.4], [0.5]).sentence("KVR", "TSP")
    assert verdict_problems(one.split(": ")[0] + ": KVR is 1.25x faster (1 round, p = 1)")


def test_the_short_words_tables_and_summaries_print_are_read_too():
    """Verdict.than ("as fast (...) as", "not comparable (...) with") carries its p or its runs: both are checked."""
    from verdict_text import verdict_problems

    tie, undecided = compare([0.48, 0.50, 0.55, 0.51, 0.49], BASE), compare([0.40, 0.41, 0.43], [0.49, 0.50, 0.52])
    assert (tie.word, undecided.word) == ("tie", "undecided")
    assert verdict_problems(f"KVR {tie.than} TSP\nchunked's TTFT p99 was {undecided.than} continuous's") == []
    assert verdict_problems("KVR as fast (1.22x, inside the noise of the runs, p = 0.0079) as TSP")
    assert verdict_problems("KVR not comparable (1.22x from 5 rounds; a verdict needs 5) with TSP")


@pytest.mark.slow
@pytest.mark.needs("8.1", "8.2", "8.3", "8.4")
@pytest.mark.timeout(400)
def test_lesson_08_verdicts_follow_the_runs_beside_a_cpu_hog(cpu_hog):
    """Lesson 08 ships a KV cache against recomputing it (cell 27, whose verdict once flipped from "3.39x faster"
    to "1.67x slower" between two runs of 3 rounds) and compares serving policies. In small sizes, beside a CPU
    hog, every sentence it would print reads back as measure's own decision on the printed runs, and 3 rounds
    say "undecided"."""
    from verdict_text import count_verdicts, verdict_problems

    from toyllm.disagg import ship_kv_cache
    from toyllm.parallel import ModelSpec
    from toyllm.serving import poisson_workload, serve
    from toyllm.utils import random_prompt

    spec = ModelSpec("tiny")
    printed, verdicts = [], []
    for rounds in (3, 5):
        shipped = ship_kv_cache(spec, random_prompt(40, 256, seed=1), decode_tokens=4, method="single",
                                rounds=rounds, timeout_s=120)
        printed += shipped.lines()
        verdicts.append(shipped.verdict)
    model = spec.build()
    workload = poisson_workload(6, 40.0, model.config.vocab_size, prompt_tokens=(4, 32), new_tokens=(2, 8), seed=3)
    served = {p: [] for p in ("continuous", "chunked")}
    for _ in range(5):                                  # in turns, as the lesson runs them
        for p, runs in served.items():
            runs.append(serve(model, workload, p, max_batch=4, token_budget=16, block_size=16))
    for what in (lambda r: r.percentile("ttft_s", 99), lambda r: r.compute_s):
        v = compare([what(r) for r in served["chunked"]], [what(r) for r in served["continuous"]])
        printed.append(v.sentence("chunked", "continuous"))
        verdicts.append(v)
    text = "\n".join(printed)
    print(text)
    assert count_verdicts(text) == len(verdicts) and verdict_problems(text) == [], text
    assert verdicts[0].word == "undecided" and "a verdict needs 5" in text      # 3 rounds decide nothing
    sentences = [line for line in printed if " vs " in line]
    for v, line in zip(verdicts, sentences):
        assert (" is " in line.split(": ", 1)[1]) == v.decided, line
