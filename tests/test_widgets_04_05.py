"""The explorers of lessons 04 and 05: their callbacks recompute the counts the library defines."""
from toyllm import widgets
from toyllm.partition import dot_products, kv_rows_sent


def test_counts_explorer_follows_its_sliders():
    ex = widgets.ParallelCountsExplorer(context=9, world_size=3, plot=False)
    assert ex.tsp_chunks == [3, 3, 3] and ex.tsp_dots == [27, 27, 27] and ex.tsp_rows == 36
    ex.share.value = 4 / 9
    assert ex.kvr_chunks == [4, 3, 2] and ex.kvr_dots == [16, 21, 18] and ex.kvr_rows == 22
    assert ex.kvr_dots == dot_products(ex.kvr_chunks, "kvr")
    ex.context.value, ex.world_size.value = 4096, 2
    assert ex.tsp_dots == [2048 * 4096] * 2 and ex.tsp_rows == sum(kv_rows_sent([2048, 2048], "tsp"))
    assert f"{max(ex.kvr_dots):,}" in ex.text.value


def test_counts_explorer_draws_one_bar_per_rank_and_method():
    ex = widgets.ParallelCountsExplorer(context=64, world_size=4)
    assert len(ex.figure.axes[0].patches) == 8


def test_coverage_explorer_recomputes_and_rejects_equal_boundaries():
    ex = widgets.CoverageExplorer(context=9, first=4, second=7, plot=False)
    assert ex.chunks == [4, 3, 2] and ex.dots == [16, 21, 18]
    ex.method.value = "tsp"
    assert ex.dots == [36, 27, 18]
    ex.second.value = 4
    assert ex.chunks is None and "must differ" in ex.text.value
    ex.second.value = 8
    assert ex.chunks == [4, 4, 1]


def test_coverage_explorer_draws_the_rectangles():
    ex = widgets.CoverageExplorer(context=12, first=5, second=9)
    assert len(ex.figure.axes[0].patches) == 3
