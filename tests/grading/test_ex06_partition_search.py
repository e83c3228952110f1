"""Graded tests of lesson 06 (ex06_partition_search): 10 points.

6.1 search_boundary 3, 6.2 grid_search 3, 6.3 interpolate_partition 2, 6.4 fit_cost_model 2.
The searches run against cost functions whose best partition is known
(``toyllm.grading.sandbox.harness``: ``kink_cost``, ``bowl_cost``) and against
toyllm's simulator, with a limit on the distinct partitions they may try,
so that trying every partition does not pass as a search. References live
here: brute force over the same cost function, the rounding and the least
squares written out below. A cost function (a ``functools.partial`` holding
the expected answer) stays in the grader: the submission gets
``harness.Counted(cost)``, which counts every evaluation where it is made.
"""
import functools
import itertools
import math

import numpy as np
import pytest

from toyllm.grading.sandbox import harness
from toyllm.grading.expect import close, equal, raises
from toyllm.grading.references import reference
from toyllm.model import get_config
from toyllm.simulate import CostModel

BENCH = get_config("bench")
CPU_LIKE = CostModel(qkv_s_per_token=4e-6, mlp_s_per_token=8e-6, attn_s_per_dot=2e-9, layer_overhead_s=1e-4,
                     link_bandwidth_bytes_per_s=3e9, link_latency_s=5e-5, label="test values")


def run_search(fn, cost, *args, **kwargs):
    """(the search's answer, the distinct partitions it asked the cost of)."""
    counted = harness.Counted(cost)
    return fn(counted, *args, **kwargs), {tuple(c) for c in counted.calls}


def check_chunks(got, context: int, p: int, call: str) -> None:
    if type(got) is not list or len(got) != p or any(type(c) is not int for c in got):
        raise AssertionError(f"{call}: expected a list of {p} Python ints, got {got!r}")
    if sum(got) != context or min(got) < 1:
        raise AssertionError(f"{call}: {got} is not a partition of {context} tokens (every chunk >= 1, sum {context})")


def grid_search_finds(ex06, optimum: list[int], context: int, stride: int, most: int, note: str = "", **kwargs):
    """Run the student's grid search on a bowl lowest at ``optimum``: it must return exactly that partition,
    asking for the cost of at most ``most`` partitions. Returns the cost and the partitions tried."""
    p = len(optimum)
    cost = functools.partial(harness.bowl_cost, optimum=optimum)
    extra = "".join(f", {k}={v}" for k, v in kwargs.items())
    call = f"grid_search(cost lowest at {optimum}, context={context}, world_size={p}, stride={stride}{extra}{note})"
    got, tried = run_search(ex06.grid_search, cost, context, p, stride, **kwargs)
    check_chunks(got, context, p, call)
    equal(got, optimum, call)
    assert len(tried) <= most, f"{call}: tried {len(tried)} partitions; the grid search needs at most {most} here"
    return cost, tried, call


# --------------------------------------------------------------------------- 6.1

@pytest.mark.exercise("6.1")
@pytest.mark.points(1)
def test_ex6_1_finds_a_known_best_split_with_few_evaluations(ex06, drawn):
    rng = drawn.rng("6.1")
    cases = [(10_000, 6173, ""), (4096, 17, ""), (3001, 2990, "")]
    for _ in range(3):
        context = rng.randint(2, 10_000)
        cases.append((context, rng.randint(1, context - 1), f"; {drawn}"))
    for context, best, note in cases:
        cost = functools.partial(harness.kink_cost, best=best)
        call = f"search_boundary(cost lowest at c_0 = {best}, context={context}{note})"
        got, tried = run_search(ex06.search_boundary, cost, context)
        check_chunks(got, context, 2, call)
        equal(got, [best, context - best], call)
        assert len(tried) <= 100, (f"{call}: tried {len(tried)} different partitions; a search needs at most "
                                   f"100 here (trying all {context - 1} is not a search)")


@pytest.mark.exercise("6.1")
@pytest.mark.points(1)
def test_ex6_1_only_multiples_of_min_stride(ex06):
    # (4096, 4090, 512): the stride divides the context, so the last candidate is 3584, never b = 4096 = context
    for context, best, stride in [(5000, 2345, 64), (777, 100, 10), (4096, 3000, 512), (4096, 4090, 512)]:
        cost = functools.partial(harness.kink_cost, best=best, left=1.0, right=2.0)
        expected_b = min(range(stride, context, stride), key=lambda b: cost([b, context - b]))
        call = f"search_boundary(cost lowest at c_0 = {best}, context={context}, min_stride={stride})"
        got, tried = run_search(ex06.search_boundary, cost, context, min_stride=stride)
        check_chunks(got, context, 2, call)
        equal(got, [expected_b, context - expected_b], call)
        off = sorted(c[0] for c in tried if c[0] % stride)
        assert not off, f"{call}: tried boundaries that are not multiples of {stride}: {off[:5]}"
        outside = sorted(c[0] for c in tried if not 0 < c[0] < context)
        assert not outside, (f"{call}: asked the cost of boundaries {outside[:5]}, which leave a process no token "
                             f"(b must lie strictly between 0 and {context})")
    raises(ValueError, ex06.search_boundary, harness.Counted(functools.partial(harness.kink_cost, best=1)), 1,
           call="search_boundary(cost, context=1)", why="two processes need 2 tokens")
    raises(ValueError, ex06.search_boundary, harness.Counted(functools.partial(harness.kink_cost, best=1)), 100, min_stride=0,
           call="search_boundary(cost, 100, min_stride=0)", why="min_stride must be at least 1")


@pytest.mark.exercise("6.1")
@pytest.mark.points(1)
def test_ex6_1_on_the_simulator(ex06):
    context, stride = 2048, 8
    cost = functools.partial(harness.simulated_ttft, cfg=BENCH, cost_model=CPU_LIKE)
    best = min(cost([b, context - b]) for b in range(stride, context, stride))
    call = f"search_boundary(simulated TTFT of the bench preset, context={context}, min_stride={stride})"
    got, tried = run_search(ex06.search_boundary, cost, context, min_stride=stride)
    check_chunks(got, context, 2, call)
    close(cost(got), best, f"{call}: simulated TTFT of your split {got}", rel=1e-9)
    assert len(tried) <= 60, f"{call}: tried {len(tried)} partitions, more than the 60 allowed"


# --------------------------------------------------------------------------- 6.2

def even_boundaries(context, p):
    return [j * context // p for j in range(1, p)]


@pytest.mark.exercise("6.2")
@pytest.mark.points(1)
def test_ex6_2_three_processes_known_and_drawn_best(ex06, drawn):
    rng = drawn.rng("6.2")
    context = rng.randint(600, 1200)
    # within reach of stride 32; the first offset is odd, so only the last level (stride 1) lands on it
    offsets = [2 * rng.randint(-40, 39) + 1, rng.randint(-80, 80)]
    moved = [b + o for b, o in zip(even_boundaries(context, 3), offsets)]
    drawn_optimum = [hi - lo for lo, hi in zip([0, *moved], [*moved, context])]
    for context, optimum, note in [(960, [390, 210, 360], ""), (context, drawn_optimum, f"; {drawn}")]:
        _, tried, call = grid_search_finds(ex06, optimum, context, 32, most=300, note=note)
        even = [hi - lo for lo, hi in zip([0, *even_boundaries(context, 3)], [*even_boundaries(context, 3), context])]
        assert tuple(even) in tried, f"{call}: never evaluated the even split {even}, where the search starts"


@pytest.mark.exercise("6.2")
@pytest.mark.points(1)
def test_ex6_2_four_processes_and_span_one(ex06):
    grid_search_finds(ex06, [300, 260, 240, 200], 1000, 16, most=1500)
    # span=1: 3 values per boundary and level; the optimum's boundaries are -15 = -(8 + 4 + 2 + 1) and
    # +13 = 8 + 4 + 1 tokens from the even split's, so every level, the one at stride 1 too, has to move them
    cost, _, _ = grid_search_finds(ex06, [235, 278, 237, 250], 1000, 8, most=4 * 27, span=1)   # 4 levels of 27
    cost = harness.Counted(cost)
    # 3 processes do not divide 1001 tokens: the even split's boundaries are j * 1001 // 3 = 333, 667, not
    # j * (1001 // 3) = 333, 666; one level at stride 16 reaches only the lattice around the start
    grid_search_finds(ex06, [333, 334, 334], 1001, 16, most=25, min_stride=16)
    raises(ValueError, ex06.grid_search, cost, 100, 1, 8, call="grid_search(cost, 100, world_size=1, stride=8)",
           why="a search needs at least 2 processes")
    raises(ValueError, ex06.grid_search, cost, 3, 4, 1, call="grid_search(cost, context=3, world_size=4, stride=1)",
           why="every process needs a token")
    raises(ValueError, ex06.grid_search, cost, 100, 3, 0, call="grid_search(cost, 100, 3, stride=0)",
           why="stride must be at least 1")


@pytest.mark.exercise("6.2")
@pytest.mark.points(1)
def test_ex6_2_on_the_simulator(ex06):
    context, p = 512, 3
    cost = functools.partial(harness.simulated_ttft, cfg=BENCH, cost_model=CPU_LIKE)
    reference = min(cost([a, b - a, context - b]) for a, b in itertools.combinations(range(4, context, 4), 2))
    call = f"grid_search(simulated TTFT of the bench preset, context={context}, world_size={p}, stride=16)"
    got, tried = run_search(ex06.grid_search, cost, context, p, 16)
    check_chunks(got, context, p, call)
    value = cost(got)
    assert value <= reference * 1.001, (f"{call}: your partition {got} gives a simulated TTFT of {value:.6g} s; "
                                        f"the best on a 4-token grid gives {reference:.6g} s")
    assert len(tried) <= 400, f"{call}: tried {len(tried)} partitions, more than the 400 allowed"


# --------------------------------------------------------------------------- 6.3

@reference
def reference_partition(table, context):
    keys = sorted(table)
    if context <= keys[0]:
        r = table[keys[0]]
    elif context >= keys[-1]:
        r = table[keys[-1]]
    else:
        hi = min(k for k in keys if k >= context)
        lo = max(k for k in keys if k < context)
        t = (context - lo) / (hi - lo)
        r = [(1 - t) * a + t * b for a, b in zip(table[lo], table[hi])]
    shares = [context * x / sum(r) for x in r]
    chunks = [math.floor(s) for s in shares]
    for i in sorted(range(len(r)), key=lambda i: -(shares[i] - chunks[i]))[:context - sum(chunks)]:
        chunks[i] += 1
    for i in range(len(r)):
        while chunks[i] < 1:
            donor = chunks.index(max(chunks))
            chunks[donor] -= 1
            chunks[i] += 1
    return chunks


@pytest.mark.exercise("6.3")
@pytest.mark.points(1)
def test_ex6_3_the_papers_example_between_entries_and_drawn_tables(ex06, drawn):
    # Entries whose midpoint is the paper's 10k result on 4 processes: [0.350, 0.255, 0.210, 0.185].
    table = {8192: [0.36, 0.26, 0.21, 0.17], 12288: [0.34, 0.25, 0.21, 0.20]}
    for context in (10240, 9000, 12000, 8193):
        call = f"interpolate_partition({table}, {context})"
        got = ex06.interpolate_partition(table, context)
        check_chunks(got, context, 4, call)
        equal(got, reference_partition(table, context), call)
    table3 = {1000: [0.5, 0.3, 0.2], 2000: [0.45, 0.33, 0.22], 4000: [0.4, 0.35, 0.25]}
    for context in (1500, 2999, 3001, 2000):
        equal(ex06.interpolate_partition(table3, context), reference_partition(table3, context),
              f"interpolate_partition({table3}, {context})")
    rng = drawn.rng("6.3")
    for _ in range(3):              # drawn: a table of 1-4 lengths for 2-6 processes, contexts inside and outside it
        p = rng.randint(2, 6)
        table = {}
        for length in sorted(rng.sample(range(256, 32768), rng.randint(1, 4))):
            weights = [rng.uniform(0.2, 1.0) for _ in range(p)]
            # stored rounded, as a table written to a file is: the ratios sum to 1 only roughly
            table[length] = [round(w / sum(weights), 3) for w in weights]
        keys = sorted(table)
        for context in (rng.randint(p, keys[0]), rng.randint(keys[0], keys[-1]), rng.randint(keys[-1], 40000)):
            got = ex06.interpolate_partition(table, context)
            call = f"interpolate_partition({table}, {context}; {drawn})"
            check_chunks(got, context, p, call)
            equal(got, reference_partition(table, context), call)


@pytest.mark.exercise("6.3")
@pytest.mark.points(1)
def test_ex6_3_clamping_rounding_and_bad_input(ex06, drawn):
    table = {1000: [0.5, 0.3, 0.2], 2000: [0.45, 0.33, 0.22]}
    for context, expected in [(500, [250, 150, 100]), (10, [5, 3, 2]), (3000, [1350, 990, 660])]:
        equal(ex06.interpolate_partition(table, context), expected,
              f"interpolate_partition({table}, {context}) (outside the table: the nearest entry's ratios)")
    equal(ex06.interpolate_partition({64: [0.5, 0.5]}, 7), [4, 3],
          "interpolate_partition({64: [0.5, 0.5]}, 7) (a tie: the earlier rank gets the token)")
    equal(ex06.interpolate_partition({100: [0.997, 0.001, 0.001, 0.001]}, 100), [97, 1, 1, 1],
          "interpolate_partition({100: [0.997, 0.001, 0.001, 0.001]}, 100) (every rank needs a token)")
    equal(ex06.interpolate_partition({64: [0.3, 0.3, 0.4]}, 11), reference_partition({64: [0.3, 0.3, 0.4]}, 11),
          "interpolate_partition({64: [0.3, 0.3, 0.4]}, 11)")
    rng = drawn.rng("6.3 clamping")
    for _ in range(3):              # drawn: one or two entries, contexts below and above them, small enough for ties
        p = rng.randint(2, 5)
        entries = {n: [round(rng.uniform(0.1, 1.0), 2) for _ in range(p)] for n in sorted(rng.sample(range(64, 4096), 2))}
        for context in (rng.randint(p, min(entries)), rng.randint(max(entries), 9000)):
            equal(ex06.interpolate_partition(entries, context), reference_partition(entries, context),
                  f"interpolate_partition({entries}, {context}; {drawn})")
    equal(ex06.interpolate_partition({4096: [0.33, 0.33, 0.33]}, 999), [333, 333, 333],
          "interpolate_partition({4096: [0.33, 0.33, 0.33]}, 999) (ratios that sum to 0.99: share = "
          "context * r / sum(r))")
    raises(ValueError, ex06.interpolate_partition, {}, 100, call="interpolate_partition({}, 100)",
           why="the table is empty")
    raises(ValueError, ex06.interpolate_partition, table, 2, call=f"interpolate_partition({table}, 2)",
           why="2 tokens cannot cover 3 processes")


# --------------------------------------------------------------------------- 6.4

def samples_from(a, b, c, noise=0.0, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for tokens, before in [(64, 0), (128, 0), (256, 256), (512, 0), (300, 700), (1024, 1024), (90, 2000),
                           (700, 300), (2048, 0), (1500, 2500)]:
        dots = tokens * (before + tokens)
        seconds = a * tokens + b * dots + c
        out.append((tokens, dots, float(seconds * (1 + noise * rng.standard_normal()))))
    return out


@pytest.mark.exercise("6.4")
@pytest.mark.points(1)
def test_ex6_4_recovers_exact_coefficients(ex06, drawn):
    rng = drawn.rng("6.4")
    cases = [(2e-5, 3e-8, 1e-3, ""), (1e-6, 5e-10, 0.0, ""), (4e-4, 1e-9, 2e-2, "")]
    cases += [(10 ** rng.uniform(-7, -3), 10 ** rng.uniform(-11, -7), rng.uniform(0, 0.05), f"; {drawn}")
              for _ in range(3)]
    for a, b, c, note in cases:
        call = f"fit_cost_model(exact samples of {a:g} s/token + {b:g} s/dot + {c:g} s{note})"
        got = ex06.fit_cost_model(samples_from(a, b, c))
        if type(got) is not tuple or len(got) != 3 or any(type(x) is not float for x in got):
            raise AssertionError(f"{call}: expected a tuple of 3 Python floats, got {got!r}")
        for name, value, expected in zip("abc", got, (a, b, c)):
            close(value, expected, f"{call}: {name}", rel=1e-6, abs_tol=1e-12)


@reference
def least_squares(samples):
    """[a, b, c] of the least-squares fit, with the columns scaled to 1 for a well-conditioned solve."""
    X = np.array([[t, d, 1.0] for t, d, _ in samples])
    y = np.array([s for _, _, s in samples])
    return (np.linalg.lstsq(X / X.max(0), y, rcond=None)[0] / X.max(0)).tolist()


@pytest.mark.exercise("6.4")
@pytest.mark.points(1)
def test_ex6_4_least_squares_on_noisy_samples(ex06):
    samples = samples_from(3e-5, 2e-8, 5e-3, noise=0.05, seed=4)
    expected = least_squares(samples)
    got = ex06.fit_cost_model(samples)
    if type(got) is not tuple or len(got) != 3 or any(type(x) is not float for x in got):
        raise AssertionError(f"fit_cost_model(10 noisy samples): expected a tuple of 3 Python floats, got {got!r}")
    for name, value, e in zip("abc", got, expected):
        close(value, float(e), f"fit_cost_model(10 noisy samples): {name} (the least-squares value)", rel=1e-6,
              abs_tol=1e-12)
    raises(ValueError, ex06.fit_cost_model, samples[:2], call="fit_cost_model(2 samples)",
           why="three coefficients need at least 3 samples")
