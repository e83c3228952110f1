"""Deciding from timings: repeated, interleaved runs, their spread, and verdicts that can say "tie".

A timing on a shared machine moves from run to run, sometimes by tens of
percent. A comparison that reads "faster" from two single numbers can flip
when the cell runs again. Everything in the course that prints or writes a
comparison of timings goes through this module:

- ``interleaved_runs`` times several things in turns (a, b, c, a, b, c, ...),
  so that a slow spell of the machine hits all of them alike;
- ``compare`` decides from the runs of two things whether one is faster,
  slower, or whether they tie, by a rule with a stated false-verdict rate:
  a two-sided Mann-Whitney U test on the runs, exact for every number of
  runs (its null distribution counted, not approximated), must reject "the
  two are the same" at ``ALPHA`` = 0.01, *and* the medians must differ by
  more than ``MIN_EFFECT`` (1 percent). On pure noise (two samples of the
  same distribution, any spread, any number of runs) "faster" or "slower"
  then comes out at most 1% of the time; the effect rule only lowers that.
  Below 5 runs a side no outcome can reach p <= 0.01 (4 against 4: every
  run of one below every run of the other still has p = 2 / C(8, 4) =
  0.029), so ``compare`` says "undecided (4 rounds; a verdict needs 5)"
  rather than "a tie". ``Verdict.sentence`` prints both medians with the
  range of their runs, the number of runs and p beside the decision, so a
  reader can check it;
- ``check_machine`` looks at the machine before anything is timed: the load
  average against the cores this process may use, and whether two threads
  beat one on a small matmul. ``one_process_baseline`` picks, from measured
  one- and two-thread runs, the configuration a user would actually run.

All times are in seconds. Nothing here asserts on a timing.
"""
from __future__ import annotations

import contextlib
import functools
import math
import os
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from .checks import check_int

# Medians within 1 percent are a tie even when the rank test rejects: closer than that, a difference is
# smaller than what moves between two series of runs on an ordinary machine.
MIN_EFFECT = 0.01
# The rank test's significance: on pure noise, "faster" or "slower" comes out at most this often.
ALPHA = 0.01
# The words a verdict may have, from the point of view of the thing measured against a baseline.
WORDS = ("faster", "slower", "tie", "undecided")


@functools.lru_cache(maxsize=256)
def _u_counts(n: int, m: int) -> tuple[int, ...]:
    """How many of the C(n + m, n) orderings of n runs against m runs give each U = 0, 1, ..., n m
    (U: the pairs in which the first side's run is the lower). Counted exactly: the orderings
    ending in a run of the first side add m to U, those ending in one of the second side add nothing."""
    if n == 0 or m == 0:
        return (1,)
    last_first, last_second = _u_counts(n - 1, m), _u_counts(n, m - 1)
    counts = [0] * (n * m + 1)
    for u, c in enumerate(last_first):
        counts[u + m] += c
    for u, c in enumerate(last_second):
        counts[u] += c
    return tuple(counts)


def rank_test_p(ours: Sequence[float], base: Sequence[float]) -> float:
    """Two-sided p of the exact Mann-Whitney U test: how often two samples of one distribution,
    of these sizes, are at least as far apart in rank as ``ours`` and ``base`` are.

    U counts the pairs (a run of ours, a run of base) in which ours took less
    time, a tie between two runs counting a half. Ties make the exact
    distribution wider than the one counted here; U is rounded towards its
    middle, so that a tie never makes p smaller.
    """
    n, m = len(ours), len(base)
    u = sum(1.0 if a < b else 0.5 if a == b else 0.0 for a in ours for b in base)
    far = math.ceil(max(u, n * m - u))             # as far from the middle as u, or farther (either side)
    counts = _u_counts(n, m)
    return min(1.0, 2 * sum(counts[far:]) / math.comb(n + m, n))


def min_p(n: int, m: int) -> float:
    """The smallest two-sided p the rank test can give with n runs against m: every run of one side
    below every run of the other, 2 / C(n + m, n)."""
    return min(1.0, 2 / math.comb(n + m, n))


def runs_needed(alpha: float = ALPHA) -> int:
    """The fewest runs a side (equal sides) with which some outcome reaches ``alpha``: 5 for 0.01."""
    return next(n for n in range(1, 100) if min_p(n, n) <= alpha)


def format_seconds(s: float, extra_digits: int = 0) -> str:
    """0.0123 -> "12.3 ms", 1.5 -> "1.500 s": milliseconds below a second, seconds above
    (``extra_digits`` more decimals where two close numbers must print apart)."""
    return f"{s * 1e3:.{1 + extra_digits}f} ms" if s < 1 else f"{s:.{3 + extra_digits}f} s"


def _as_printed(s: float, extra_digits: int) -> float:
    """``s`` seconds rounded as ``format_seconds`` prints it."""
    number, unit = format_seconds(s, extra_digits).split()
    return float(number) * (1e-3 if unit == "ms" else 1.0)


@dataclass(frozen=True)
class Spread:
    """The runs of one measurement (seconds): their median and their range."""

    runs: tuple[float, ...]

    def __post_init__(self):
        if not self.runs:
            raise ValueError("a measurement needs at least one run")
        if not all(isinstance(t, (int, float)) and math.isfinite(t) and t >= 0 for t in self.runs):
            raise ValueError(f"runs must be finite, non-negative seconds, got {list(self.runs)}")

    @property
    def median(self) -> float:
        return statistics.median(self.runs)

    @property
    def low(self) -> float:
        return min(self.runs)

    @property
    def high(self) -> float:
        return max(self.runs)

    def scaled(self, factor: float) -> "Spread":
        """Every run times ``factor`` (for example a lower bound computed from each run)."""
        return Spread(tuple(factor * t for t in self.runs))

    def __str__(self) -> str:
        """ "0.512 s [0.498-0.530 s]" (median, then lowest and highest run) or "0.512 s (1 run)". """
        return self.format()

    def format(self, extra_digits: int = 0) -> str:
        """``str(self)`` with ``extra_digits`` more decimals in every number."""
        median = format_seconds(self.median, extra_digits)
        if len(self.runs) == 1:
            return f"{median} (1 run)"
        low, high = format_seconds(self.low, extra_digits), format_seconds(self.high, extra_digits)
        if high.split()[1] == low.split()[1]:           # "[0.498-0.530 s]"; mixed units stay spelled out
            return f"{median} [{low.split()[0]}-{high}]"
        return f"{median} [{low}-{high}]"


def spread(runs: Sequence[float] | Spread) -> Spread:
    """``runs`` (seconds) as a Spread."""
    return runs if isinstance(runs, Spread) else Spread(tuple(float(t) for t in runs))


@dataclass(frozen=True)
class Verdict:
    """How one measurement compares with a baseline, decided from their runs (see ``compare``)."""

    word: str          # "faster", "slower", "tie" or "undecided" (too few runs for the rank test to decide)
    ratio: float       # median(baseline) / median(ours): above 1 means ours took less time
    ours: Spread
    base: Spread
    p: float = 1.0     # two-sided p of the exact rank test on the runs (``rank_test_p``)

    @property
    def decided(self) -> bool:
        """True for "faster" and "slower": the rank test rejects at ALPHA and the medians differ enough."""
        return self.word in ("faster", "slower")

    @property
    def _rounds(self) -> str:
        """ "5 rounds" ("1 round") or, sides unequal, "3 and 7 runs". """
        n, m = len(self.ours.runs), len(self.base.runs)
        return (f"{n} round" + "s" * (n != 1)) if n == m else f"{n} and {m} runs"

    @property
    def _undecided(self) -> str:
        """Why nothing was decided: "4 rounds; a verdict needs 5". """
        return f"{self._rounds}; a verdict needs {runs_needed()}"

    @property
    def _by_how_much(self) -> str:
        """A decided verdict's factor and word, "1.32x faster" or "1.25x slower" (always a factor >= 1)."""
        return f"{self.ratio:.2f}x faster" if self.word == "faster" else f"{1 / self.ratio:.2f}x slower"

    @property
    def than(self) -> str:
        """The comparison as words before the baseline's name: "1.32x faster than", "as fast (1.005x) as"."""
        if self.decided:
            return f"{self._by_how_much} than"
        if self.word == "tie":
            return f"as fast ({self.ratio:.2f}x, inside the noise of the runs, p = {self.p:.2g}) as"
        return f"not comparable ({self.ratio:.2f}x from {self._undecided}) with"

    @property
    def short(self) -> str:
        """The verdict as a table cell: "1.32x faster", "1.25x slower", "tie (1.02x)", "undecided (1.30x)"
        (the factor and the word where one side won, as ``than`` says them; the word and the ratio otherwise)."""
        return self._by_how_much if self.decided else f"{self.word} ({self.ratio:.2f}x)"

    @property
    def _digits(self) -> int:
        """Extra decimals a sentence needs so that a reader sees the medians of a "faster" or "slower"
        apart on the side the verdict says (1.8 ms vs 1.8 ms would hide a decided difference)."""
        if not self.decided:
            return 0
        slow, fast = (self.ours, self.base) if self.word == "slower" else (self.base, self.ours)
        return next((extra for extra in range(4)
                     if _as_printed(fast.median, extra) < _as_printed(slow.median, extra)), 4)

    @property
    def target(self) -> str:
        """The verdict read as a target met or not, where the baseline's runs were scaled to the slowest that
        would still meet it (llama.cpp's seconds over 0.6, say): "met", "not met", or why neither."""
        if self.decided:
            return "met" if self.word == "faster" else "not met"
        if self.word == "tie":
            return "neither met nor missed for certain: the difference is inside the noise of the runs"
        return f"not decided ({self._undecided})"

    def sentence(self, ours: str, base: str) -> str:
        """One line with both medians, the ranges of their runs, the rank test and the decision.

        "KVR 0.41 s [0.40-0.43 s] vs TSP 0.50 s [0.49-0.52 s]: KVR is 1.22x faster (5 rounds, p = 0.0079)"
        """
        numbers = f"{ours} {self.ours.format(self._digits)} vs {base} {self.base.format(self._digits)}"
        test = f"{self._rounds}, p = {self.p:.2g}"
        if self.decided:
            return f"{numbers}: {ours} is {self._by_how_much} ({test})"
        if self.word == "tie":
            return f"{numbers}: a tie ({self.ratio:.2f}x, inside the noise of the runs: {test})"
        return f"{numbers}: undecided ({self._undecided})"


def compare(ours: Sequence[float] | Spread, base: Sequence[float] | Spread, *, min_effect: float = MIN_EFFECT,
            alpha: float = ALPHA) -> Verdict:
    """Is ``ours`` faster than ``base``? Both are runs in seconds (lower is better).

    "faster" when the exact two-sided Mann-Whitney U test on the runs gives
    p <= ``alpha`` with ours the lower in rank, and the medians differ by
    more than ``min_effect`` (a fraction) the same way; "slower" the other
    way round; "tie" otherwise. "undecided" when the sides have so few runs
    that no outcome could reach ``alpha`` (with 0.01: fewer than 5 a side;
    one run is never enough). On two samples of one distribution "faster"
    or "slower" comes out at most ``alpha`` of the time, whatever the number
    of runs: the test's own false-verdict rate.
    """
    a, b = spread(ours), spread(base)
    ratio = b.median / a.median if a.median > 0 else math.inf
    n, m = len(a.runs), len(b.runs)
    if min_p(n, m) > alpha:
        return Verdict("undecided", ratio, a, b)
    p = rank_test_p(a.runs, b.runs)
    lower = sum(x < y for x in a.runs for y in b.runs) > sum(x > y for x in a.runs for y in b.runs)
    if p <= alpha and lower and ratio > 1 + min_effect:
        word = "faster"
    elif p <= alpha and not lower and ratio < 1 / (1 + min_effect):
        word = "slower"
    else:
        word = "tie"
    return Verdict(word, ratio, a, b, p)


def interleaved_runs(fns: dict[str, Callable[[], float | None]], rounds: int, warmup: int = 1) -> dict[str, list[float]]:
    """Seconds of each ``fn()`` per round, the functions taking turns (a, b, c, a, b, c, ...).

    ``warmup`` untimed rounds come first. Taking turns makes a slow spell of a
    shared machine hit every function alike. A function that returns a
    number reports its own seconds (a parallel prefill's TTFT, timed inside
    the workers); otherwise the call is timed here, by the wall clock.
    """
    check_int(rounds, "rounds must be an int >= 1", 1)
    runs: dict[str, list[float]] = {name: [] for name in fns}
    for r in range(warmup + rounds):
        for name, fn in fns.items():
            t = time.perf_counter()
            reported = fn()
            elapsed = time.perf_counter() - t
            if r >= warmup:
                runs[name].append(float(reported) if isinstance(reported, (int, float)) else elapsed)
    return runs


# --------------------------------------------------------------------------- the machine

def usable_cores() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one, else the CPU count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def load_average() -> float:
    """The 1-minute load average (processes running or waiting for a CPU), or nan where the OS has none."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return math.nan


def busy_cpu_seconds() -> float:
    """CPU-seconds the whole machine has spent busy since it started (every process, this one or not),
    from /proc/stat; nan where there is none (not Linux). The difference over a run, divided by its
    wall-clock seconds, is how many cores were busy on average meanwhile."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return math.nan
    # user nice system idle iowait irq softirq steal (guest time is counted in user already)
    idle = sum(fields[3:5])
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class MachineState:
    """What the machine looked like just before a measurement (``check_machine``)."""

    cores: int                 # CPUs this process may use
    load: float                # 1-minute load average, nan if unknown
    one_thread: Spread         # seconds of the same matmuls on one intra-op thread ...
    two_threads: Spread        # ... and on two, runs interleaved

    @property
    def threads(self) -> Verdict:
        """Two threads against one on the same work."""
        return compare(self.two_threads, self.one_thread)

    @property
    def loaded(self) -> bool:
        """More processes want a CPU than this process may use."""
        return not math.isnan(self.load) and self.load > self.cores

    @property
    def oversubscribed(self) -> bool:
        """Two threads lost to one: another process holds a core, and parallel timings will mislead."""
        return self.cores >= 2 and self.threads.word == "slower"

    @property
    def busy(self) -> bool:
        return self.loaded or self.oversubscribed

    @property
    def line(self) -> str:
        """One line for the reader: cores, load, one thread vs two, and what that means for the timings."""
        load = "unknown" if math.isnan(self.load) else f"{self.load:.2f}"
        head = f"machine: {self.cores} usable core(s), load average {load}"
        if self.cores < 2:
            return f"{head}; one core: no thread or process can run beside another"
        t = self.threads.sentence("2 threads", "1 thread")
        if self.oversubscribed:
            return (f"{head}; oversubscribed: {t}. Another program holds a core: parallel timings below are "
                    "distorted, and a one-process baseline takes 1 thread where its own runs show 2 threads slower")
        if self.loaded:
            return (f"{head} (above the core count: busy); {t}. Expect noisy timings; ties are likely")
        return f"{head}; {t}"


def _matmul_work(n: int) -> Callable[[], None]:
    import torch

    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(n, n, generator=g), torch.randn(n, n, generator=g)

    def work():
        for _ in range(4):
            a @ b

    return work


def check_machine(rounds: int = 7, size: int = 512) -> MachineState:
    """Time the same matmuls on one and on two intra-op threads, interleaved, and read the load average.

    About 0.2-0.5 s on a quiet two-core machine. ``size``: the side of the square float32 matrices.
    """
    import torch

    work = _matmul_work(size)
    before = torch.get_num_threads()

    def on(n):
        def fn() -> float:
            torch.set_num_threads(n)
            work()                             # untimed: the first call after resizing the thread pool is slow
            t = time.perf_counter()
            work()
            return time.perf_counter() - t
        return fn

    try:
        runs = interleaved_runs({"one": on(1), "two": on(2)}, rounds, warmup=1)
    finally:
        torch.set_num_threads(before)
    return MachineState(usable_cores(), load_average(), spread(runs["one"]), spread(runs["two"]))


ONE_THREAD, TWO_THREADS = "1 process, 1 thread", "1 process, 2 threads"


def one_process_baseline(one_thread: Sequence[float] | Spread, two_threads: Sequence[float] | Spread) -> tuple[str, str]:
    """The one-process configuration a user would run, and why, from measured runs of both.

    Two threads is what a user gets by default; when they lose to one thread
    (beyond the spread of the runs), the machine is oversubscribed and a user
    would run one. Returns (ONE_THREAD or TWO_THREADS, a sentence saying why).
    """
    v = compare(two_threads, one_thread)
    if v.word == "slower":
        return ONE_THREAD, (f"oversubscribed: {v.sentence('2 threads', '1 thread')}; another program holds a "
                            "core, so the baseline is one process with 1 thread, what a user would run here")
    return TWO_THREADS, (f"{v.sentence('2 threads', '1 thread')}; the baseline is one process with 2 threads, "
                         "what a user gets by default")


# --------------------------------------------------------------------------- parallel prefill, as the lessons time it

@dataclass(frozen=True)
class PrefillComparison:
    """One prompt prefilled by one process (1 and 2 threads) and by parallel configurations, runs interleaved.

    ``runs``: the TTFT runs (seconds) of every configuration, the two
    one-process ones first. ``baseline`` is the one-process configuration a
    user would run here (``one_process_baseline``), ``why`` says why.
    ``results``: the last PrefillResult of each configuration (timelines, logits).
    """

    context: int
    machine: MachineState
    runs: dict[str, Spread]
    baseline: str
    why: str
    results: dict

    @property
    def parallel(self) -> list[str]:
        """The names of the parallel configurations, in the order they were given."""
        return [name for name in self.runs if name not in (ONE_THREAD, TWO_THREADS)]

    def verdict(self, name: str, base: str | None = None) -> Verdict:
        """``name`` against ``base`` (default: the one-process baseline), from their runs."""
        return compare(self.runs[name], self.runs[base or self.baseline])

    def lines(self) -> list[str]:
        """What the lessons print after the machine's line: the baseline and why, then every
        configuration's runs with its verdict against the baseline."""
        width = max(map(len, self.runs))
        n = len(next(iter(self.runs.values())).runs)
        out = [f"baseline: {self.why}",
               f"{self.context} tokens, TTFT of each configuration, median [fastest-slowest run] of "
               f"{n} interleaved run{'s' * (n != 1)}:"]
        for name, s in self.runs.items():
            verdict = "the baseline" if name == self.baseline else f"{self.verdict(name).than} the baseline"
            out.append(f"  {name:<{width}}  {str(s):<26}  {verdict}")
        return out

    def fastest_line(self) -> str:
        """Which configuration has the lowest median, and whether its runs set it apart from the runner-up
        (a tie, or too few rounds to decide, leaves no single fastest)."""
        first, second = sorted(self.runs, key=lambda name: self.runs[name].median)[:2]
        v = compare(self.runs[first], self.runs[second])
        if v.decided:
            return f"fastest here: {first}, {v.than} {second}, the runner-up"
        return f"lowest median here: {first}, {v.than} {second}, the runner-up: no single fastest"


def compare_prefills(spec, ids: Sequence[int], parallel: dict[str, dict], *, single_spec=None, rounds: int = 3,
                     warmup: int = 1, world_size: int = 2, timeout_s: float = 120.0,
                     machine: MachineState | None = None, single_in_workers: bool = False) -> PrefillComparison:
    """Time one process (1 thread, 2 threads) and each parallel configuration on ``ids``, in turns.

    ``parallel``: a name for each configuration -> keyword arguments of
    ``toyllm.parallel.parallel_prefill`` besides the spec and the prompt
    (``method``, ``partition``, ``overlap``, ...). All of them run in one
    pool of ``world_size`` processes with one thread each, started once;
    ``timeout_s`` (seconds) is that pool's limit for one run. ``single_spec``:
    the model the one-process runs use (default ``spec``). Every round runs
    every configuration once (``warmup`` untimed rounds first), so a slow
    spell of the machine hits all alike; ``machine`` (``check_machine``,
    whose line a lesson prints before timing) is measured first unless given.
    ``single_in_workers``: run the one-process configurations in a worker
    process of their own, started once (it switches between 1 and 2
    threads as this process would), instead of in this one: a benchmark's
    long contexts then keep their attention scores (gigabytes at 8k tokens)
    out of this process's memory.
    """
    from .launch import WorkerPool
    from .parallel import parallel_prefill

    machine = check_machine() if machine is None else machine
    single_spec = spec if single_spec is None else single_spec
    results: dict = {}

    with contextlib.ExitStack() as stack:
        solo = stack.enter_context(WorkerPool(1, threads_per_rank=2, timeout_s=timeout_s)) if single_in_workers else None

        def single(threads: int, name: str):
            def run() -> float:
                results[name] = parallel_prefill(single_spec, ids, "single", 1, threads_per_rank=threads, warmup=0,
                                                 pool=solo, timeout_s=timeout_s)
                return results[name].ttft_runs[0]
            return run

        pool = stack.enter_context(WorkerPool(world_size, threads_per_rank=1, timeout_s=timeout_s))

        def on_pool(name: str, kwargs: dict):
            def run() -> float:
                results[name] = parallel_prefill(spec, ids, world_size=world_size, pool=pool, warmup=0,
                                                 timeout_s=timeout_s, **kwargs)
                return results[name].ttft_runs[0]
            return run

        fns = {ONE_THREAD: single(1, ONE_THREAD), TWO_THREADS: single(2, TWO_THREADS)}
        fns.update({name: on_pool(name, kwargs) for name, kwargs in parallel.items()})
        runs = interleaved_runs(fns, rounds, warmup=warmup)
    baseline, why = one_process_baseline(runs[ONE_THREAD], runs[TWO_THREADS])
    return PrefillComparison(len(ids), machine, {name: spread(ts) for name, ts in runs.items()}, baseline, why,
                             results)
