"""The figures of toyllm.viz and the explorers of toyllm.widgets, checked on small inputs.

Figures are inspected through matplotlib's objects (lines, patches, tick
labels, texts); widgets by setting their controls from code, the way a
learner's mouse would, and reading the numbers they show.
"""
import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
from matplotlib.collections import PolyCollection  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

from toyllm import viz, widgets  # noqa: E402
from toyllm.timeline import Event  # noqa: E402


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def texts(fig) -> list[str]:
    return [t.get_text() for ax in fig.axes for t in ax.texts]


# --------------------------------------------------------------------------- viz


def test_step_times_draws_naive_and_cached_in_ms():
    fig = viz.plot_step_times([10, 11, 12], [0.010, 0.012, 0.014], [0.002, 0.002, 0.002])
    assert isinstance(fig, Figure)
    ax = fig.axes[0]
    assert len(ax.lines) == 2
    assert list(ax.lines[0].get_ydata()) == pytest.approx([10, 12, 14])      # seconds -> ms
    assert list(ax.lines[0].get_xdata()) == [10, 11, 12]
    assert len(viz.plot_step_times([1, 2], [0.1, 0.2]).axes[0].lines) == 1   # naive only


def test_step_times_rejects_mismatched_lengths():
    with pytest.raises(ValueError, match="naive_s has 2 values but lengths has 3"):
        viz.plot_step_times([1, 2, 3], [0.1, 0.2])


def test_kv_memory_one_line_per_layout_in_gb():
    fig = viz.plot_kv_memory([0, 8192], {"MHA": [0, 6.7e9], "GQA": [0, 1.34e9], "MQA": [0, 0.1675e9]},
                             reference={"parameters": 26e9})
    ax = fig.axes[0]
    labels = [line.get_label() for line in ax.lines if not line.get_label().startswith("_")]
    assert labels == ["MHA", "GQA", "MQA"]
    assert ax.lines[0].get_ydata()[-1] == pytest.approx(6.7)
    assert "parameters" in texts(fig)
    with pytest.raises(ValueError, match="series is empty"):
        viz.plot_kv_memory([1], {})


def test_roofline_is_log_log_with_ridge_and_points():
    fig = viz.plot_roofline(1e11, 1e10, {"decode": (1.0, 5e9), "prefill": (100.0, 8e10)})
    ax = fig.axes[0]
    assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
    roof = ax.lines[0]
    xs, ys = roof.get_xdata(), roof.get_ydata()
    # Below the ridge (10 FLOP/byte) the roof is bandwidth * intensity, above it the peak (in GFLOP/s).
    assert ys[0] == pytest.approx(10 * xs[0]) and ys[-1] == pytest.approx(100)
    assert any("ridge: 10 FLOP/byte" in t for t in texts(fig))
    assert {"decode", "prefill"} <= set(texts(fig))
    with pytest.raises(ValueError, match="must be positive"):
        viz.plot_roofline(0, 1e10, {})


def test_timeline_one_row_per_rank_from_events_or_dicts():
    events = [Event(0, "compute", 0.0, 0.010, layer=0), Event(0, "send", 0.010, 0.011, layer=0),
              Event(1, "recv_wait", 0.0, 0.011, layer=0), Event(1, "compute", 0.011, 0.030, layer=0),
              Event(1, "compute", 0.030, 0.050, layer=1)]
    for given in (events, [e.to_dict() for e in events]):
        fig = viz.plot_timeline(given, title="2 ranks (simulated)")
        ax = fig.axes[0]
        assert [t.get_text() for t in ax.get_yticklabels()] == ["rank 0", "rank 1"]
        # one bar collection per (rank, kind) present: rank 0 compute, send; rank 1 recv_wait, compute
        assert len([c for c in ax.collections if isinstance(c, PolyCollection)]) == 4
        assert ax.get_title() == "2 ranks (simulated)"
        assert {"0", "1"} <= set(texts(fig))            # layer numbers on the wide bars
        legend = [t.get_text() for t in ax.get_legend().get_texts()]
        assert legend == ["compute", "recv_wait", "send"]


def test_timeline_rejects_unknown_kinds_and_empty_input():
    with pytest.raises(ValueError, match="unknown event kind"):
        viz.plot_timeline([Event(0, "nap", 0.0, 1.0)])
    with pytest.raises(ValueError, match="empty"):
        viz.plot_timeline([])


def test_coverage_kvr_rectangles_follow_the_paper_example():
    fig = viz.plot_coverage([4, 3, 2], "kvr")
    rects = [p for p in fig.axes[0].patches if isinstance(p, Rectangle)]
    assert len(rects) == 3
    # rank i: rows [s_i, s_i + c_i) x keys [0, s_i + c_i)
    assert [(r.get_x(), r.get_y(), r.get_width(), r.get_height()) for r in rects] == \
        [(0, 0, 4, 4), (0, 4, 7, 3), (0, 7, 9, 2)]
    joined = " ".join(texts(fig))
    assert "16 dot products" in joined and "21 dot products" in joined and "18 dot products" in joined


def test_coverage_tsp_rectangles_span_all_keys():
    fig = viz.plot_coverage([3, 3, 3], "tsp")
    rects = [p for p in fig.axes[0].patches if isinstance(p, Rectangle)]
    assert [(r.get_y(), r.get_width(), r.get_height()) for r in rects] == [(0, 9, 3), (3, 9, 3), (6, 9, 3)]
    assert " ".join(texts(fig)).count("27 dot products") == 3
    with pytest.raises(ValueError, match="method must be"):
        viz.plot_coverage([3, 3], "ring")


def test_ttft_curves_with_bound():
    fig = viz.plot_ttft_curves([1024, 2048], {"TSP": [1.0, 3.0], "KVR": [0.8, 2.5]}, bound=[0.5, 1.9])
    ax = fig.axes[0]
    assert [line.get_label() for line in ax.lines] == ["TSP", "KVR", "lower bound"]
    assert ax.lines[2].get_linestyle() == "--"
    fig = viz.plot_ttft_curves([1, 2], {"a": [1, 2]}, bound={"TTFT*(2)": [0.4, 0.8], "TTFT*(4)": [0.2, 0.4]})
    assert len(fig.axes[0].lines) == 3


def test_bars_and_distribution():
    fig = viz.plot_bars({"a": 1.0, "b": 2.5})
    assert len(fig.axes[0].patches) == 2
    fig = viz.plot_distribution(["x", "\n", "z"], [0.5, 0.3, 0.2], highlight=0)
    bars = fig.axes[0].patches
    assert [b.get_height() for b in bars] == pytest.approx([0.5, 0.3, 0.2])
    assert bars[0].get_facecolor() != bars[1].get_facecolor()
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()][1] == "\\n"   # control characters made visible


@pytest.mark.parametrize("names", [
    ["1 process, 1 thread", "1 process, 2 threads", "TSP", "KVR-E", "KVR, 60% on rank 0"],   # lesson 05's runs
    [f"configuration_without_spaces_{i}" for i in range(6)],                                # no place to wrap
])
def test_bar_names_never_overlap(names):
    fig = viz.plot_bars({name: 0.1 * (i + 1) for i, name in enumerate(names)}, ylabel="TTFT (s)")
    ax = fig.axes[0]
    renderer = fig.canvas.get_renderer()
    drawn = [t for t in ax.get_xticklabels() + ax.get_yticklabels() if t.get_text().replace("\n", " ") in names]
    assert len(drawn) == len(names) and len(ax.patches) == len(names)
    boxes = [t.get_window_extent(renderer) for t in drawn]
    assert not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1:]), [t.get_text() for t in drawn]
    plt.close(fig)


@pytest.mark.parametrize("bandwidths", [[1, 10, 100, 1000], [0.5, 300], [3.0], [300, 10, 1]])
def test_speedup_map_axes_span_the_given_values_not_decades_more(bandwidths):
    contexts = [512, 1024, 4096]
    speedup = [[0.5 + 0.4 * i + 0.1 * j for j in range(len(bandwidths))] for i in range(len(contexts))]
    ax = viz.plot_speedup_map(contexts, bandwidths, speedup).axes[0]
    assert ax.get_xscale() == "log"
    lo, hi = sorted(ax.get_xlim())
    assert min(bandwidths) / 2 <= lo <= min(bandwidths) and max(bandwidths) <= hi <= max(bandwidths) * 2
    lo, hi = sorted(ax.get_ylim())
    assert min(contexts) / 2 <= lo <= min(contexts) and max(contexts) <= hi <= max(contexts) * 2
    # One cell per value, each containing its value (in log space, edges at geometric means).
    mesh = ax.collections[0]
    assert mesh.get_array().size == len(contexts) * len(bandwidths)
    if len(bandwidths) == 4:
        assert viz._log_cell_edges(bandwidths, "b")[1:-1] == pytest.approx([10 ** 0.5, 10 ** 1.5, 10 ** 2.5])


def test_speedup_map_rejects_a_bandwidth_a_log_axis_cannot_show():
    with pytest.raises(ValueError, match="positive"):
        viz.plot_speedup_map([512], [0, 10], [[1.0, 1.2]])


def test_plots_draw_into_a_given_axes():
    fig, (a, b) = plt.subplots(1, 2)
    assert viz.plot_coverage([2, 2], ax=a) is fig
    assert viz.plot_step_times([1, 2], [0.1, 0.2], ax=b) is fig


# --------------------------------------------------------------------------- widgets


def test_kv_calculator_llama2_13b_8192_tokens_bf16():
    calc = widgets.KVMemoryCalculator(tokens=1024, plot=False)
    calc.tokens.value = 8192
    assert calc.nbytes == 6_710_886_400
    assert "6,710,886,400 bytes = 6.71 GB" in calc.text.value
    assert "2 &times; 40 layers &times; 40 KV heads &times; 128 head_dim" in calc.text.value
    calc.batch.value = 4
    assert calc.nbytes == 4 * 6_710_886_400
    calc.bytes_per_value.value = 1
    assert calc.nbytes == 2 * 6_710_886_400


def test_kv_calculator_presets_set_the_sliders():
    calc = widgets.KVMemoryCalculator(tokens=8192, plot=False)
    calc.preset.value = "SmolLM2-135M (GQA, 3 KV heads)"
    assert (calc.layers.value, calc.kv_heads.value, calc.head_dim.value) == (30, 3, 64)
    assert calc.nbytes == 2 * 30 * 3 * 64 * 8192 * 2
    calc.preset.value = "LLaMA-2-13B with 8 KV heads (GQA)"
    assert calc.nbytes == 6_710_886_400 // 5
    assert "4,096 tokens: 8,192 is a hypothetical length" in calc.text.value     # LLaMA-2's context is 4096
    calc.tokens.value = 4096
    assert "hypothetical" not in calc.text.value


def test_kv_calculator_plot_marks_the_chosen_length():
    calc = widgets.KVMemoryCalculator(tokens=8192)
    ax = calc.figure.axes[0]
    assert len([line for line in ax.lines if not line.get_label().startswith("_")]) == 2   # 40 heads and MQA
    assert ax.lines[0].get_ydata()[25] == pytest.approx(6.7108864)                         # at 8192 tokens, in GB


def test_roofline_explorer_pop_quiz_step_times():
    ex = widgets.RooflineExplorer.pop_quiz(batch=4, plot=False)
    assert ex.step_time_s == pytest.approx(2.57e-3, rel=2e-3)
    assert not ex.compute_bound
    assert "2.57 ms" in ex.text.value and "memory-bound" in ex.text.value
    ex.batch.value = 256
    assert ex.step_time_s == pytest.approx(21.05e-3, rel=2e-3)
    assert ex.min_step_time_s == pytest.approx(18.50e-3, rel=2e-3)
    assert ex.compute_bound
    assert "21.05 ms" in ex.text.value and "compute-bound" in ex.text.value
    # int8 weights: the quiz's 8192 x 32768 matmul turns compute-bound from B = 124, not 240
    assert ex.crossing_batch == 124 and "compute-bound from B = 124" in ex.text.value


def test_roofline_explorer_without_a_model_and_its_plot():
    ex = widgets.RooflineExplorer(peak_flops=1e11, bandwidth=1e10, d_model=1000, d_ff=1000, bytes_per_value=1,
                                  batch=1, name="toy")
    assert ex.ridge == pytest.approx(10)
    assert ex.intensity == pytest.approx(2 * 1000 * 1000 / (1000 + 1000 * 1000 + 1000))
    assert ex.step_time_s is None and "decode step" not in ex.text.value
    assert "matmul, B=1" in texts(ex.figure)
    with pytest.raises(ValueError, match="must be positive"):
        widgets.RooflineExplorer(peak_flops=1e11, bandwidth=0)


def test_sampling_explorer_matches_the_sampler():
    s = widgets.SamplingExplorer([2.0, 1.0, 0.0, -1.0], labels=["a", "b", "c", "d"], draws=4000, plot=False)
    assert sum(s.frequencies) == pytest.approx(1.0)
    assert s.frequencies == pytest.approx(s.softmax, abs=0.03)       # temperature 1, no cut: the softmax
    s.temperature.value = 0.0
    assert s.frequencies == [1.0, 0.0, 0.0, 0.0]                     # greedy
    s.temperature.value = 1.0
    s.top_k.value = 2
    assert s.frequencies[2:] == [0.0, 0.0]
    assert s.frequencies[0] == pytest.approx(s.softmax[0] / (s.softmax[0] + s.softmax[1]), abs=0.03)
    s.top_k.value = 0
    s.top_p.value = 0.5                                              # the top token alone holds 64%
    assert s.frequencies == [1.0, 0.0, 0.0, 0.0]
    assert "1 of 4 candidates" in s.text.value


def test_sampling_explorer_is_reproducible_and_validates():
    a = widgets.SamplingExplorer([1.0, 0.5, 0.0], temperature=1.5, plot=False)
    b = widgets.SamplingExplorer([1.0, 0.5, 0.0], temperature=1.5, plot=False)
    assert a.frequencies == b.frequencies
    with pytest.raises(ValueError, match="one label per logit"):
        widgets.SamplingExplorer([1.0, 2.0], labels=["x"])
    s = widgets.SamplingExplorer([1.0, 2.0, 3.0], draws=100)
    assert len(s.figure.axes[0].patches) == 3
