"""The explorers of lessons 06 and 07 and their figures: callbacks recompute what the simulator says."""
import pytest

from toyllm import viz, widgets
from toyllm.model import get_config
from toyllm.partition import (even_partition, exhaustive_search, hierarchical_grid_search, search_boundary_1d,
                              zigzag_chunks)
from toyllm.simulate import CostModel, simulate_prefill, ttft_cost

BENCH = get_config("bench")
CM = CostModel(qkv_s_per_token=4e-6, mlp_s_per_token=8e-6, attn_s_per_dot=2e-9, layer_overhead_s=1e-4,
               link_bandwidth_bytes_per_s=3e9, link_latency_s=5e-5, label="test values")


def test_partition_explorer_follows_its_sliders():
    ex = widgets.PartitionExplorer(BENCH, CM, context=960, world_size=3, plot=False)
    assert ex.chunks == even_partition(960, 3) and ex.ttft_s == pytest.approx(ex.even_ttft_s)
    ex.sliders[0].value, ex.sliders[1].value = 400, 700
    assert ex.chunks == [400, 300, 260]
    assert ex.ttft_s == simulate_prefill(BENCH, [400, 300, 260], "kvr", CM).ttft_s
    assert f"{1e3 * ex.ttft_s:.2f} ms" in ex.text.value
    ex.sliders[1].value = 300                                   # behind boundary 1: no valid partition
    assert ex.chunks is None and ex.ttft_s is None and "must increase" in ex.text.value
    with pytest.raises(ValueError, match="inner boundaries"):
        widgets.PartitionExplorer(BENCH, CM, context=960, world_size=3, boundaries=[100], plot=False)


def test_partition_explorer_draws_the_simulated_timeline():
    ex = widgets.PartitionExplorer(BENCH, CM, context=256, world_size=2)
    assert ex.figure is not None and "simulated" in ex.figure.axes[0].get_title()
    assert [t.get_text() for t in ex.figure.axes[0].get_yticklabels()] == ["rank 0", "rank 1"]


def test_network_explorer_recomputes_the_four_methods():
    ex = widgets.NetworkExplorer(BENCH, CM, context=2048, bandwidth_gbps=10.0, world_size=2, plot=False)
    cm = CM.with_(link_bandwidth_bytes_per_s=10e9)
    assert ex.times_s["TSP, p=2"] == simulate_prefill(BENCH, [1024, 1024], "tsp", cm).ttft_s
    assert ex.times_s["ring (zigzag), p=2"] == simulate_prefill(BENCH, zigzag_chunks(2048, 2), "ring", cm,
                                                                 balance="zigzag").ttft_s
    assert ex.speedup["one process"] == 1.0
    assert ex.fastest == min(ex.times_s, key=ex.times_s.get) and f"<b>{ex.fastest}</b>" in ex.text.value
    slow_kvr = ex.times_s["KVR-E, p=2"]
    ex.bandwidth.value = 0.01                                   # 10 MB/s: the link dominates
    assert ex.times_s["KVR-E, p=2"] > slow_kvr and ex.speedup["KVR-E, p=2"] < 1
    ex.world_size.value = 4
    assert set(ex.times_s) == {"one process", "TSP, p=4", "KVR-E, p=4", "ring (zigzag), p=4"}
    assert ex.fastest == "one process"                          # 10 MB/s: no split pays
    assert f"{ex.speedup['TSP, p=4']:.2f}x" in ex.text.value


def test_the_network_explorers_link_carries_tsps_all_gather_too():
    """A cost model fitted on this machine carries the all-gather it measured; the slider's link replaces
    it, so TSP's time follows the slider as KV-Runahead's does."""
    measured = CM.with_(allgather_bandwidth_bytes_per_s=0.5e9, allgather_latency_s=1e-3)
    ex = widgets.NetworkExplorer(BENCH, measured, context=2048, bandwidth_gbps=100.0, world_size=2, plot=False)
    assert ex.times_s["TSP, p=2"] == simulate_prefill(BENCH, [1024, 1024], "tsp", CM.with_link(100e9)).ttft_s
    assert ex.times_s["TSP, p=2"] < simulate_prefill(BENCH, [1024, 1024], "tsp", measured).ttft_s


def test_network_explorer_draws_bars():
    ex = widgets.NetworkExplorer(BENCH, CM, context=1024)
    assert len(ex.figure.axes[0].patches) == 4


def test_search_figures():
    cost = ttft_cost(BENCH, CM)
    fig = viz.plot_boundary_search({"model": search_boundary_1d(cost, 1024, min_stride=16)})
    assert fig.axes[0].get_xlabel().startswith("tokens on rank 0")
    grid = exhaustive_search(cost, 256, 3, stride=32)
    surface = {tuple(h["boundaries"][1:3]): h["cost_s"] for h in grid.history}
    fig = viz.plot_partition_heatmap(256, surface, path=hierarchical_grid_search(cost, 256, 3, min_stride=4))
    assert len(fig.axes) == 2                                   # the map and its colour bar
    with pytest.raises(ValueError, match="two-process"):
        viz.plot_boundary_search({"p=3": grid})
    fig = viz.plot_speedup_map([512, 1024], [1, 10, 100], [[0.5, 0.9, 1.2], [0.8, 1.3, 1.6]])
    assert fig.axes[0].get_xscale() == "log"
    with pytest.raises(ValueError, match="expected"):
        viz.plot_speedup_map([512], [1, 10], [[1.0]])


def test_winner_map_colours_each_cell_by_its_fastest_method():
    times = {"a": [[1.0, 4.0], [2.0, 2.0]], "b": [[2.0, 1.0], [1.0, 8.0]]}
    fig = viz.plot_winner_map([512, 1024], [1, 10], times, title="t")
    ax = fig.axes[0]
    assert ax.collections[0].get_array().tolist() == [[0, 1], [1, 0]]   # a, b / b, a
    assert [t.get_text() for t in ax.texts] == ["2", "4", "2", "4"]      # x faster than the runner-up
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["a", "b"]
    with pytest.raises(ValueError, match="at least two methods"):
        viz.plot_winner_map([512], [1], {"a": [[1.0]]})
    with pytest.raises(ValueError, match="expected"):
        viz.plot_winner_map([512], [1, 10], {"a": [[1.0]], "b": [[2.0]]})
