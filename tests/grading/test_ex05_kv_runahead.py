"""Graded tests of lesson 05 (ex05_kv_runahead): 10 points.

5.1 kvr_layer_blocking 4, 5.2 kvr_layer 3, 5.3 kvr_counts 2, 5.4 ttft_lower_bound 1.
References live here: the one-process forward pass of the tiny model for
the engine runs, counts and the bound written out from their definitions.
"""
import re

import pytest

from toyllm.grading.expect import raises
from toyllm.grading.references import reference
from toyllm.parallel import ModelSpec
from toyllm.utils import random_prompt


# --------------------------------------------------------------------------- 5.1

@pytest.mark.engine
@pytest.mark.exercise("5.1")
@pytest.mark.points(1)
@pytest.mark.timeout(180)
def test_ex5_1_three_ranks_uneven_chunks(ex05, engine_run):
    engine_run(ex05.kvr_layer_blocking, "5.1", "kvr", 3, [4, 19, 1], seed=3)


@pytest.mark.engine
@pytest.mark.exercise("5.1")
@pytest.mark.points(1)
@pytest.mark.timeout(180)
def test_ex5_1_two_ranks_and_three_ranks_on_drawn_chunks(ex05, engine_run, drawn):
    engine_run(ex05.kvr_layer_blocking, "5.1", "kvr", 2, [25, 15])
    rng = drawn.rng("5.1")
    engine_run(ex05.kvr_layer_blocking, "5.1", "kvr", 3, [rng.randint(1, 20) for _ in range(3)],
               seed=rng.randrange(10**6), note=str(drawn))


@pytest.mark.engine
@pytest.mark.exercise("5.1")
@pytest.mark.points(2)
@pytest.mark.timeout(180)
def test_ex5_1_four_ranks_and_the_last_rank_keeps_decoding(ex05, engine_run):
    from toyllm import generate

    got, _ = engine_run(ex05.kvr_layer_blocking, "5.1", "kvr", 4, [13, 1, 9, 8], seed=4, decode=5)
    expected = generate(ModelSpec("tiny").build(), random_prompt(31, 256, 4), 5).output_ids
    assert got.decoded == expected, (f"kvr_layer_blocking, p=4: decoding from the last rank's cache gave "
                                     f"{got.decoded}, one process gives {expected}")


# --------------------------------------------------------------------------- 5.2

def _order(result, p):
    """(posted before its layer's qkv, waited after it) for every layer of every rank > 0."""
    out = []
    for rank in range(1, p):
        events = [e for e in result.timeline if e["rank"] == rank]
        for layer in sorted({e["layer"] for e in events if e["layer"] is not None}):
            qkv = next(e for e in events if e["layer"] == layer and e["label"] == "qkv")
            wait = next(e for e in events if e["layer"] == layer and e["kind"] == "recv_wait")
            posted = re.match(r"irecv posted at ([0-9.]+) s", wait["label"])
            out.append((rank, layer, posted is not None and float(posted[1]) <= qkv["start_s"],
                        wait["start_s"] >= qkv["end_s"]))
    return out


@pytest.mark.engine
@pytest.mark.exercise("5.2")
@pytest.mark.points(1)
@pytest.mark.timeout(180)
def test_ex5_2_three_ranks_uneven_and_drawn_chunks_give_equal_logits(ex05, engine_run, drawn):
    engine_run(ex05.kvr_layer, "5.2", "kvr", 3, [20, 6, 11], seed=5)
    rng = drawn.rng("5.2")
    engine_run(ex05.kvr_layer, "5.2", "kvr", 3, [rng.randint(1, 20) for _ in range(3)], seed=rng.randrange(10**6),
               note=str(drawn))


@pytest.mark.engine
@pytest.mark.exercise("5.2")
@pytest.mark.points(2)
@pytest.mark.timeout(180)
def test_ex5_2_posts_the_receive_before_the_projection(ex05, engine_run):
    got, _ = engine_run(ex05.kvr_layer, "5.2", "kvr", 2, [30, 10], seed=6)
    wrong = [(rank, layer) for rank, layer, posted_first, waited_after in _order(got, 2)
             if not (posted_first and waited_after)]
    assert not wrong, (f"Exercise 5.2, kvr_layer, p=2: in layers {[l for _, l in wrong]} of rank 1 the receive was not posted "
                       "with chain.irecv() before layer.qkv and waited for after it, so nothing overlaps")


# --------------------------------------------------------------------------- 5.3

@pytest.mark.exercise("5.3")
@pytest.mark.points(1)
def test_ex5_3_the_papers_example(ex05):
    got = ex05.kvr_counts([4, 3, 2])
    assert got == ([16, 21, 18], 22) and all(type(n) is int for n in got[0]) and type(got[1]) is int, \
        f"kvr_counts([4, 3, 2]): expected ([16, 21, 18], 22) with ints, got {got!r}"


@reference
def reference_counts(chunks):
    """(dot products per rank, K/V rows sent), counted from the definition."""
    dots, rows = [], 0
    for i, c in enumerate(chunks):
        s = sum(chunks[:i])
        dots.append(c * (s + c))
        rows += 2 * (s + c) if i < len(chunks) - 1 else 0
    return dots, rows


@pytest.mark.exercise("5.3")
@pytest.mark.points(1)
def test_ex5_3_other_and_drawn_partitions_and_bad_input(ex05, drawn):
    assert ex05.kvr_counts([7]) == ([49], 0), f"kvr_counts([7]): one rank sends nothing; got {ex05.kvr_counts([7])!r}"
    got = ex05.kvr_counts([1, 5, 2, 2])
    assert got == ([1, 30, 16, 20], 2 * (1 + 6 + 8)), f"kvr_counts([1, 5, 2, 2]): expected ([1, 30, 16, 20], 30), got {got!r}"
    rng = drawn.rng("5.3")
    for _ in range(4):
        chunks = [rng.randint(1, 5000) for _ in range(rng.randint(1, 8))]
        got, expected = ex05.kvr_counts(chunks), reference_counts(chunks)
        assert (type(got) is tuple and got == expected and all(type(n) is int for n in got[0])
                and type(got[1]) is int), f"kvr_counts({chunks}; {drawn}): expected {expected} with ints, got {got!r}"
    for bad in ([], [3, 0]):
        raises(ValueError, ex05.kvr_counts, bad, call=f"kvr_counts({bad!r})", why="every rank needs at least one token")


# --------------------------------------------------------------------------- 5.4

@reference
def bound_reference(t, p):
    return t / 2 * (1 / p + 1 / p ** 2)


@pytest.mark.exercise("5.4")
@pytest.mark.points(1)
def test_ex5_4_lower_bound(ex05, drawn):
    cases = {(12.0, 1): 12.0, (12.0, 2): 4.5, (8.0, 4): 1.25, (3.0, 3): 2 / 3}
    rng = drawn.rng("5.4")
    for _ in range(4):
        t, p = rng.uniform(0.001, 100.0), rng.randint(1, 64)
        cases[(t, p)] = bound_reference(t, p)
    for (t, p), expected in cases.items():
        got = ex05.ttft_lower_bound(t, p)
        assert type(got) is float and got == pytest.approx(expected, rel=1e-12), \
            f"ttft_lower_bound({t}, p={p}{'' if t in (12.0, 8.0, 3.0) else f'; {drawn}'}): expected {expected}, got {got!r}"
    raises(ValueError, ex05.ttft_lower_bound, 1.0, 0, call="ttft_lower_bound(1.0, world_size=0)",
           why="a world needs at least one process")
    raises(ValueError, ex05.ttft_lower_bound, -0.5, 2, call="ttft_lower_bound(-0.5, world_size=2)",
           why="a time to first token is never negative")
