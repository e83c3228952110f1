"""Partitions, analytic counts, partition searches and the lookup table (toyllm.partition)."""
import json
import math

import numpy as np
import pytest

from toyllm import answers
from toyllm.partition import (SearchResult, align_boundaries, boundaries_from_chunks,
                              chunks_from_boundaries, dot_products, even_partition, exhaustive_search, hierarchical_grid_search,
                              kv_rows_sent, net_kvr_even, net_tsp, partition_from_ratios, prefixes,
                              search_boundary_1d, ttft_lower_bound, validate_partition)
from toyllm.partition_table import PartitionTable


# --------------------------------------------------------------------------- validation and construction

def test_validate_partition_accepts_and_normalises():
    assert validate_partition([4, 3, 2], context=9, world_size=3) == [4, 3, 2]
    out = validate_partition(np.array([5, 5]), context=10)
    assert out == [5, 5] and all(type(c) is int for c in out)


@pytest.mark.parametrize("chunks, kwargs, message", [
    ([4, 3, 2], {"world_size": 2}, "3 chunks but the world size is 2"),
    ([4, 0, 5], {}, "at least one token"),
    ([4, -1, 6], {}, "at least one token"),
    ([4.5, 4.5], {}, "not an integer"),
    ([True, 3], {}, "not an integer"),
    ([4, 3, 2], {"context": 10}, "covers 9 tokens but the context has 10"),
    ([1, 1], {"context": 2, "world_size": 3}, "larger than the context"),
    ([], {"world_size": 0}, "at least 1 process"),
    ([], {}, "at least one chunk"),
    ("432", {}, "list of chunk sizes"),
])
def test_validate_partition_errors(chunks, kwargs, message):
    with pytest.raises(ValueError, match=message):
        validate_partition(chunks, **kwargs)


def test_even_partition_spreads_the_remainder_over_the_first_ranks():
    assert even_partition(9, 3) == [3, 3, 3]
    assert even_partition(10, 3) == [4, 3, 3]
    assert even_partition(11, 3) == [4, 4, 3]
    assert even_partition(5, 1) == [5]
    for C, p in [(1000, 7), (17, 17), (16384, 8)]:
        chunks = even_partition(C, p)
        assert sum(chunks) == C and max(chunks) - min(chunks) <= 1 and chunks == sorted(chunks, reverse=True)


@pytest.mark.parametrize("C, p, message", [(3, 4, "larger than the context"), (8, 0, "at least 1"),
                                           (8.0, 2, "integer"), (8, 2.5, "integer")])
def test_even_partition_errors(C, p, message):
    with pytest.raises(ValueError, match=message):
        even_partition(C, p)


def test_partition_from_ratios_is_exact_and_positive():
    assert partition_from_ratios(10, [1, 1, 1]) == [4, 3, 3]
    assert partition_from_ratios(100, [0.5, 0.3, 0.2]) == [50, 30, 20]
    # Largest remainder: shares 3.33, 3.33, 3.33 -> one leftover token to rank 0 (ties go to the earlier rank).
    assert partition_from_ratios(10, [2, 2, 2]) == [4, 3, 3]
    # Shares 7.5, 1.5, 1.0 -> floors 7, 1, 1; the leftover token goes to the larger remainder (rank 0).
    assert partition_from_ratios(10, [0.75, 0.15, 0.10]) == [8, 1, 1]
    # A rank whose share rounds to zero still gets a token, taken from the largest chunk.
    assert partition_from_ratios(10, [1000, 1, 1]) == [8, 1, 1]
    chunks = partition_from_ratios(10240, [0.350, 0.255, 0.210, 0.185])
    assert sum(chunks) == 10240
    assert all(abs(c - r * 10240) < 1 for c, r in zip(chunks, [0.350, 0.255, 0.210, 0.185]))


@pytest.mark.parametrize("ratios, message", [([], "non-empty"), ([1, 0], "positive"), ([1, -1], "positive"),
                                             ([1, float("nan")], "positive finite"), ([1] * 11, "larger than")])
def test_partition_from_ratios_errors(ratios, message):
    with pytest.raises(ValueError, match=message):
        partition_from_ratios(10, ratios)


def test_boundaries_round_trip_with_the_papers_notation():
    assert chunks_from_boundaries([0, 9728, 16384]) == [9728, 6656]
    assert boundaries_from_chunks([9728, 6656]) == [0, 9728, 16384]
    assert boundaries_from_chunks([4, 3, 2]) == [0, 4, 7, 9]
    assert prefixes([4, 3, 2]) == [0, 4, 7]
    assert chunks_from_boundaries(boundaries_from_chunks([5, 1, 7, 3])) == [5, 1, 7, 3]


@pytest.mark.parametrize("bounds, message", [([5, 9], "start at 0"), ([0, 5, 5, 9], "strictly increase"),
                                             ([0, 6, 4, 9], "strictly increase"), ([0], "at least two"),
                                             ([0, 2.5, 5], "integer")])
def test_chunks_from_boundaries_errors(bounds, message):
    with pytest.raises(ValueError, match=message):
        chunks_from_boundaries(bounds)


# --------------------------------------------------------------------------- counts (paper Figs. 4-5)

def test_paper_example_tsp_counts():
    chunks = even_partition(9, 3)
    assert dot_products(chunks, "tsp") == [27, 27, 27]
    assert sum(kv_rows_sent(chunks, "tsp")) == 36


def test_paper_example_kvr_counts():
    assert dot_products([4, 3, 2], "kvr") == [16, 21, 18]
    assert kv_rows_sent([4, 3, 2], "kvr") == [8, 14, 0]
    assert sum(kv_rows_sent([4, 3, 2], "kvr")) == 22


def test_counts_general_cases():
    # One process: both methods compute the full C x C square and send nothing.
    assert dot_products([7], "kvr") == dot_products([7], "tsp") == [49]
    assert kv_rows_sent([7], "kvr") == kv_rows_sent([7], "tsp") == [0]
    # Uneven TSP: every rank still meets all C keys.
    assert dot_products([5, 3], "tsp") == [40, 24]
    assert kv_rows_sent([5, 3], "tsp") == [10, 6]
    # KVR's rectangles cover the lower triangle: total dots = C^2/2 + sum(c_i^2)/2 (paper Eq. 1 numerator).
    chunks = [40, 30, 20, 10]
    C = sum(chunks)
    assert sum(dot_products(chunks, "kvr")) == (C * C + sum(c * c for c in chunks)) // 2


@pytest.mark.parametrize("C, p", [(9, 3), (16, 2), (16384, 8), (12, 4), (100, 1)])
def test_net_formulas_match_row_counts_for_even_splits(C, p):
    chunks = even_partition(C, p)
    # kv_rows_sent counts K and V rows; the paper's Net counts one tensor.
    assert sum(kv_rows_sent(chunks, "tsp")) == 2 * net_tsp(C, p) == 2 * (p - 1) * C
    assert sum(kv_rows_sent(chunks, "kvr")) == 2 * net_kvr_even(C, p)
    assert net_kvr_even(C, p) == net_tsp(C, p) / 2


def test_count_errors():
    with pytest.raises(ValueError, match="unknown method"):
        dot_products([4, 3, 2], "ring")
    with pytest.raises(ValueError, match="unknown method"):
        kv_rows_sent([4, 3, 2], "single")
    with pytest.raises(ValueError, match="larger than the context"):
        net_tsp(2, 3)


def test_ttft_lower_bound():
    assert ttft_lower_bound(8.0, 1) == 8.0
    assert ttft_lower_bound(8.0, 2) == pytest.approx(3.0)        # 8/2 * (1/2 + 1/4): super-linear
    assert ttft_lower_bound(32.0, 4) == pytest.approx(5.0)       # 32/2 * (1/4 + 1/16)
    # It equals alpha * (C^2/2 + sum(c_i^2)/2) / p for an even split with TTFT(1) = alpha * C^2.
    alpha, C, p = 1e-9, 4096, 4
    per_rank = (C * C / 2 + sum(c * c for c in even_partition(C, p)) / 2) / p
    assert ttft_lower_bound(alpha * C * C, p) == pytest.approx(alpha * per_rank)
    with pytest.raises(ValueError, match="at least 1"):
        ttft_lower_bound(1.0, 0)
    with pytest.raises(ValueError, match="non-negative"):
        ttft_lower_bound(-1.0, 2)


# --------------------------------------------------------------------------- searches

class CountingCost:
    """A synthetic cost function that records how often it is called."""

    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, chunks):
        self.calls += 1
        return self.fn(chunks)


def bowl(target_boundaries, weights=None):
    """Quadratic bowl over the inner boundaries with its minimum (0) at ``target_boundaries``."""
    weights = weights or [1.0] * len(target_boundaries)

    def cost(chunks):
        inner = boundaries_from_chunks(chunks)[1:-1]
        return sum(w * (b - t) ** 2 for w, b, t in zip(weights, inner, target_boundaries))

    return cost


# The student edition's searches run the student's Exercises 6.1 and 6.2, with steps and levels of their own.
instructor_search = pytest.mark.skipif(answers.EDITION == "student",
                                       reason="the strides and recentring of toyllm's own search")


@instructor_search
def test_boundary_search_finds_the_papers_16k_optimum_cheaply():
    cost = CountingCost(bowl([9728]))
    result = search_boundary_1d(cost, 16384)
    assert isinstance(result, SearchResult)
    assert result.partition == [9728, 6656] and result.boundaries == [0, 9728, 16384]
    assert result.cost_s == 0.0
    assert result.evaluations == cost.calls == len(result.history)
    assert result.evaluations <= 40          # exhaustive search: 16383 evaluations
    assert result.history[0]["stride"] == 2048 and result.history[-1]["stride"] == 1


def test_boundary_search_on_an_asymmetric_curve_and_coarse_min_stride():
    # Unimodal but skewed: waiting (too small a first chunk) costs more than imbalance.
    def ttft(chunks):
        b = chunks[0]
        return 3.0 * (6001 - b) if b < 6001 else 1.0 * (b - 6001)

    assert search_boundary_1d(ttft, 10000).partition == [6001, 3999]
    coarse = search_boundary_1d(ttft, 10000, min_stride=64)
    assert abs(coarse.partition[0] - 6001) < 64
    assert coarse.evaluations < search_boundary_1d(ttft, 10000).evaluations


def test_boundary_search_small_and_bad_inputs():
    assert search_boundary_1d(bowl([1]), 2).partition == [1, 1]
    assert search_boundary_1d(bowl([2]), 3).partition == [2, 1]
    with pytest.raises(ValueError, match="at least 2 tokens"):
        search_boundary_1d(bowl([1]), 1)
    with pytest.raises(ValueError, match="min_stride"):
        search_boundary_1d(bowl([5]), 10, min_stride=0)
    with pytest.raises(ValueError, match="cost must be a function"):
        search_boundary_1d("ttft", 10)
    with pytest.raises(ValueError, match="NaN"):
        search_boundary_1d(lambda chunks: float("nan"), 10)


@instructor_search
def test_grid_search_p3_finds_the_papers_fig6_partition():
    # Paper Fig. 6: 96 tokens, strides 8 -> 4 -> 2 -> 1, best boundaries [0, 28, 70, 96].
    cost = CountingCost(bowl([28, 70]))
    result = hierarchical_grid_search(cost, 96, 3)
    assert result.boundaries == [0, 28, 70, 96] and result.partition == [28, 42, 26]
    assert result.evaluations == cost.calls
    assert [h["stride"] for h in result.history][0] == 8
    assert sorted({h["stride"] for h in result.history}, reverse=True) == [8, 4, 2, 1]
    assert result.evaluations <= 4 * 25                     # 4 levels of 5^2 grid points at most
    assert result.evaluations * 40 < math.comb(95, 2)       # exhaustive: 4465 partitions
    assert result.history[0]["chunks"] == even_partition(96, 3)


def test_grid_search_p4_with_a_skewed_bowl():
    cost = CountingCost(bowl([300, 560, 800], weights=[1.0, 3.0, 0.5]))
    result = hierarchical_grid_search(cost, 1024, 4)
    assert result.boundaries == [0, 300, 560, 800, 1024]
    assert result.evaluations == cost.calls < 1000          # 7 levels of at most 5^3 = 125 points
    assert result.evaluations * 100_000 < math.comb(1023, 3)


@instructor_search
def test_grid_search_recenters_when_the_best_point_is_on_the_edge():
    # With span=1 the grid reaches only one stride each way; halving alone can
    # travel at most 128 + 64 + ... + 1 = 255 tokens from the even split (512).
    plain = hierarchical_grid_search(bowl([900]), 1024, 2, stride=128, span=1, recenter=False)
    assert plain.boundaries[1] <= 512 + 255
    moved = hierarchical_grid_search(bowl([900]), 1024, 2, stride=128, span=1, recenter=True)
    assert moved.boundaries == [0, 900, 1024]


def test_grid_search_keeps_every_rank_non_empty_and_handles_p1():
    seen = []

    def cost(chunks):
        seen.append(chunks)
        return -chunks[0]                    # wants rank 0 as large as possible

    result = hierarchical_grid_search(cost, 12, 3, stride=4)
    assert all(min(c) >= 1 and sum(c) == 12 for c in seen)
    assert result.partition == [10, 1, 1]
    single = hierarchical_grid_search(bowl([]), 7, 1)
    assert single.partition == [7] and single.evaluations == 1


def test_grid_search_errors():
    with pytest.raises(ValueError, match="larger than the context"):
        hierarchical_grid_search(bowl([1, 2]), 2, 3)
    with pytest.raises(ValueError, match="span"):
        hierarchical_grid_search(bowl([5]), 10, 2, span=0)
    with pytest.raises(ValueError, match="min_stride"):
        hierarchical_grid_search(bowl([5]), 10, 2, min_stride=-1)


def test_exhaustive_search_is_the_reference():
    cost = CountingCost(bowl([7, 15], weights=[1.0, 2.0]))
    result = exhaustive_search(cost, 20, 3)
    assert result.boundaries == [0, 7, 15, 20]
    assert result.evaluations == cost.calls == math.comb(19, 2)
    assert exhaustive_search(bowl([7, 15]), 20, 3, stride=4).boundaries == [0, 8, 16, 20]
    with pytest.raises(ValueError, match="multiples"):
        exhaustive_search(bowl([1, 2]), 8, 3, stride=8)


def test_progress_bar_option_runs(capsys):
    result = hierarchical_grid_search(bowl([28, 70]), 96, 3, progress=True)
    assert result.boundaries == [0, 28, 70, 96]
    assert search_boundary_1d(bowl([40]), 96, progress=True).partition == [40, 56]


# --------------------------------------------------------------------------- lookup table

def paper_like_table():
    """Entries at 8k and 12k whose ratios average to the paper's 10k prediction."""
    table = PartitionTable(4)
    table.add(8192, partition_from_ratios(8192, [0.36, 0.26, 0.21, 0.17]))
    table.add(12288, partition_from_ratios(12288, [0.34, 0.25, 0.21, 0.20]))
    return table


def test_table_interpolates_the_papers_10k_example():
    table = paper_like_table()
    ratios = table.predict_ratios(10240)                   # halfway between 8192 and 12288
    assert ratios == pytest.approx([0.350, 0.255, 0.210, 0.185], abs=1e-4)
    assert sum(ratios) == pytest.approx(1.0)
    chunks = table.predict(10240, multiple_of=1)
    assert sum(chunks) == 10240 and len(chunks) == 4
    assert all(abs(c - r * 10240) < 2 for c, r in zip(chunks, [0.350, 0.255, 0.210, 0.185]))
    aligned = table.predict(10240)                         # boundaries moved by at most 4 tokens each
    assert sum(aligned) == 10240 and all(b % 8 == 0 for b in boundaries_from_chunks(aligned)[:-1])
    assert all(abs(a - b) <= 4 for a, b in zip(boundaries_from_chunks(aligned), boundaries_from_chunks(chunks)))


def test_predicted_boundaries_land_on_multiples_of_8_tokens():
    assert align_boundaries([1806, 1266]) == [1808, 1264]
    assert align_boundaries([5734, 2458]) == [5736, 2456]
    assert align_boundaries([1228, 820]) == [1232, 816]          # a tie (1228 = 153.5 * 8) rounds up
    assert align_boundaries([5, 3, 4], 4) == [4, 4, 4]
    assert align_boundaries([3, 3, 3]) == [3, 3, 3]               # every boundary would be 0 or 8: left as is
    assert align_boundaries([1806, 1266], 1) == [1806, 1266]
    for bad in (0, -8, 2.5):
        with pytest.raises(ValueError, match="multiple_of"):
            align_boundaries([8, 8], bad)
    table = PartitionTable(2)
    table.add(2048, [1248, 800])
    table.add(6144, [3584, 2560])
    unaligned = partition_from_ratios(4096, table.predict_ratios(4096))
    assert unaligned == [2443, 1653]                               # what the rounded ratios alone give
    assert table.predict(4096) == [2440, 1656] and table.predict(4096, multiple_of=1) == unaligned
    assert table.predict(6144) == [3584, 2560]                     # a stored length is returned as stored
    assert table.predict(3001)[0] % 8 == 0 and sum(table.predict(3001)) == 3001


def test_table_exact_match_and_clamping():
    table = paper_like_table()
    stored = table.chunks(8192)
    assert table.predict(8192) == stored                   # exact on a stored length
    assert table.predict_ratios(4096) == table.ratios(8192)   # clamped below the range
    assert table.predict_ratios(65536) == table.ratios(12288)  # clamped above the range
    assert sum(table.predict(4096)) == 4096
    # A quarter of the way from 8k to 12k.
    lo, hi = table.ratios(8192), table.ratios(12288)
    assert table.predict_ratios(9216) == pytest.approx([0.75 * a + 0.25 * b for a, b in zip(lo, hi)])


def test_table_json_round_trip(tmp_path):
    table = paper_like_table()
    path = tmp_path / "kvr_table.json"
    table.save(path)
    data = json.loads(path.read_text())
    assert data["world_size"] == 4 and [e["context"] for e in data["entries"]] == [8192, 12288]
    assert data["entries"][0]["ratios"] == pytest.approx([c / 8192 for c in data["entries"][0]["chunks"]])
    loaded = PartitionTable.load(path)
    assert loaded.to_dict() == table.to_dict()
    assert loaded.predict(10240) == table.predict(10240)
    assert PartitionTable.from_dict(table.to_dict()).contexts == [8192, 12288]


def test_table_errors():
    table = PartitionTable(2)
    with pytest.raises(ValueError, match="empty"):
        table.predict(100)
    with pytest.raises(ValueError, match="world size is 2"):
        table.add(9, [4, 3, 2])
    with pytest.raises(ValueError, match="covers 9 tokens"):
        table.add(10, [5, 4])
    with pytest.raises(ValueError, match="no entry"):
        table.chunks(10)
    with pytest.raises(ValueError, match="world_size"):
        PartitionTable.from_dict({"entries": []})
    with pytest.raises(ValueError, match="at least 1"):
        PartitionTable(0)


def test_search_partition_picks_the_search_by_world_size():
    from toyllm.partition import search_partition

    def cost(chunks):                     # KVR-like: the slowest rank's c_i * (s_i + c_i), optimum known
        return max(dot_products(chunks, "kvr"))

    two = search_partition(cost, 64, 2, min_stride=1)
    assert two.cost_s == 1600 and two.partition in ([39, 25], [40, 24])     # c_0^2 = 64 c_1 near c_0 = 39.5
    three = search_partition(cost, 60, 3, min_stride=1)
    assert three.cost_s <= cost([20, 20, 20]) and sum(three.partition) == 60
    with pytest.raises(ValueError, match="at least 2 processes"):
        search_partition(cost, 60, 1)


def test_the_shipped_tables_are_valid_and_give_the_first_rank_more():
    """Each table in toyllm/tables was searched on measured runs; KV-Runahead's first rank always runs ahead."""
    from toyllm.model import PRESETS
    from toyllm.partition_table import SHIPPED_TABLES, shipped_table

    files = sorted(SHIPPED_TABLES.glob("*.json"))
    assert files, f"no table shipped in {SHIPPED_TABLES}"
    for path in files:
        model, attention, procs = path.stem.rsplit("-", 2)
        table = shipped_table(model, attention, int(procs.removeprefix("p")))
        assert model in PRESETS and table is not None and table.world_size == int(procs[1:]), path.name
        for C in table.contexts:
            assert sum(table.chunks(C)) == C and table.chunks(C)[0] > C / table.world_size, (path.name, C)
    assert shipped_table("tiny", "dense", 2) is None


def test_a_table_keeps_how_it_was_found(tmp_path):
    table = PartitionTable(2, about="searched by hand")
    table.add(100, [60, 40])
    table.save(tmp_path / "t.json")
    loaded = PartitionTable.load(tmp_path / "t.json")
    assert loaded.about == "searched by hand" and loaded.chunks(100) == [60, 40]
    assert "about" not in PartitionTable(2).to_dict()
