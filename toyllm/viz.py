"""Figures for the lessons, all in matplotlib.

Every function draws one picture and returns its ``matplotlib.figure.Figure``.
None of them calls ``plt.show()``: in Jupyter the inline backend shows the
figure at the end of the cell; in a script call ``fig.savefig(...)``. Each
takes an optional ``ax`` to draw into an existing axes (then the returned
figure is that axes' figure), so pictures can be combined in subplots.

- ``plot_step_times``: seconds per generation step against sequence length.
- ``plot_kv_memory``: KV-cache bytes against tokens, one line per layout (MHA, GQA, MQA).
- ``plot_roofline``: the roofline of a machine with measured or estimated points.
- ``plot_timeline``: a per-rank Gantt chart of ``toyllm.timeline.Event`` records.
- ``plot_coverage``: which query x key dot products each rank computes (TSP or KV-Runahead).
- ``plot_ttft_curves``: time to first token against context length, one line per method.
- ``plot_bars`` and ``plot_distribution``: small bar charts for widgets and tables.
- ``plot_speedup_map`` and ``plot_winner_map``: over context x link bandwidth, one method's speedup, or
  which of several methods is fastest.
"""
from __future__ import annotations

import textwrap
from typing import Iterable, Mapping, Sequence

import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from .analysis import GB   # 1e9 bytes: the inference chapter quotes KV caches in (decimal) GB
from .partition import dot_products, prefixes
from .timeline import EVENT_KINDS, Event

# One colour per timeline event kind, fixed so every timeline in the course reads the same way.
KIND_COLORS = {
    "compute": "#4C72B0",      # blue: useful work
    "recv_wait": "#DD8452",    # orange: idle, waiting for the previous rank's K,V
    "send": "#55A868",         # green: handing K,V to the next rank
    "send_wait": "#8C8C3C",    # olive: waiting until a send has left the buffer
    "allgather": "#8172B3",    # purple: TSP's collective
    "link_delay": "#9E9E9E",   # grey: the simulated slow link
}


def _new_axes(ax=None, figsize=(7, 4)):
    """(fig, ax): a fresh pyplot figure, or the figure that owns ``ax``."""
    if ax is not None:
        return ax.figure, ax
    fig, ax = plt.subplots(figsize=figsize)
    return fig, ax


def _finish(fig, ax, title: str) -> Figure:
    """The common last touches of a line plot: zero-based y axis, title, light grid, legend."""
    ax.set_ylim(bottom=0)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return fig


def _same_length(name_a: str, a: Sequence, name_b: str, b: Sequence) -> None:
    if len(a) != len(b):
        raise ValueError(f"{name_b} has {len(b)} values but {name_a} has {len(a)}; give one per entry of {name_a}")


# --------------------------------------------------------------------------- lesson 01-02: time per step

def plot_step_times(lengths: Sequence[int], naive_s: Sequence[float], cached_s: Sequence[float] | None = None,
                    *, ax=None, title: str = "Time per generation step") -> Figure:
    """Seconds per step against the sequence length at that step, naive and (optionally) cached.

    lengths: tokens in the sequence when the step runs; naive_s / cached_s:
    seconds of that step. Times are drawn in milliseconds.
    """
    _same_length("lengths", lengths, "naive_s", naive_s)
    fig, ax = _new_axes(ax)
    ax.plot(lengths, [1e3 * t for t in naive_s], "o-", ms=3, color="#C44E52",
            label="naive: whole prefix every step")
    if cached_s is not None:
        _same_length("lengths", lengths, "cached_s", cached_s)
        ax.plot(lengths, [1e3 * t for t in cached_s], "o-", ms=3, color="#4C72B0",
                label="cached: one new token per step")
    ax.set_xlabel("sequence length at this step (tokens)")
    ax.set_ylabel("time of the step (ms)")
    return _finish(fig, ax, title)


# --------------------------------------------------------------------------- lesson 02: KV-cache memory

def plot_kv_memory(tokens: Sequence[int], series: Mapping[str, Sequence[float]], *, ax=None,
                   reference: Mapping[str, float] | None = None, marker_at: int | None = None,
                   title: str = "KV-cache size") -> Figure:
    """One line per cache layout: KV bytes against the number of cached tokens, drawn in GB.

    series: label -> bytes for each entry of ``tokens`` (e.g. {"MHA": ..., "GQA": ..., "MQA": ...}).
    reference: label -> bytes drawn as a dashed horizontal line (e.g. the parameter bytes).
    marker_at: a token count to mark with a vertical dotted line.
    """
    if not series:
        raise ValueError("series is empty: give at least one {label: bytes per token count}")
    fig, ax = _new_axes(ax)
    for label, values in series.items():
        _same_length("tokens", tokens, f"series[{label!r}]", values)
        ax.plot(tokens, [v / GB for v in values], label=label)
    for label, nbytes in (reference or {}).items():
        ax.axhline(nbytes / GB, ls="--", color="black", lw=1)
        ax.annotate(label, (tokens[0], nbytes / GB), textcoords="offset points", xytext=(2, 3), fontsize=8)
    if marker_at is not None:
        ax.axvline(marker_at, ls=":", color="grey")
    ax.set_xlabel("tokens in the cache")
    ax.set_ylabel("KV cache (GB)")
    return _finish(fig, ax, title)


# --------------------------------------------------------------------------- lesson 03: roofline

def plot_roofline(peak_flops: float, bandwidth: float, points: Mapping[str, tuple[float, float]], *,
                  ax=None, title: str = "Roofline") -> Figure:
    """Log-log roofline: attainable FLOP/s = min(peak, bandwidth x intensity), with points on it.

    peak_flops: FLOP/s; bandwidth: bytes/s; points: label -> (intensity in
    FLOP/byte, achieved FLOP/s). The ridge point, peak / bandwidth, separates
    memory-bound (left) from compute-bound (right) operations.
    """
    if peak_flops <= 0 or bandwidth <= 0:
        raise ValueError(f"peak_flops and bandwidth must be positive, got {peak_flops} and {bandwidth}")
    fig, ax = _new_axes(ax)
    ridge = peak_flops / bandwidth                                       # FLOP/byte
    xs = [ridge] + [p[0] for p in points.values() if p[0] > 0]
    lo, hi = min(xs) / 8, max(xs) * 8
    grid = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    ax.loglog(grid, [min(peak_flops, bandwidth * x) / 1e9 for x in grid], color="black", lw=2, label="roofline")
    ax.axvline(ridge, ls=":", color="grey")
    ax.text(ridge, 0.03, f" ridge: {ridge:.3g} FLOP/byte", transform=ax.get_xaxis_transform(), fontsize=8)
    for label, (intensity, achieved) in points.items():
        ax.plot([intensity], [achieved / 1e9], "o", ms=6)
        ax.annotate(label, (intensity, achieved / 1e9), textcoords="offset points", xytext=(5, 4), fontsize=8)
    ax.set_xlabel("arithmetic intensity (FLOP / byte)")
    ax.set_ylabel("GFLOP/s")
    ax.set_title(title)
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    return fig


# --------------------------------------------------------------------------- lessons 05-07: timelines

def _as_event(e) -> Event:
    if isinstance(e, Event):
        return e
    if isinstance(e, Mapping):
        return Event.from_dict(dict(e))
    raise ValueError(f"timeline events must be toyllm.timeline.Event objects or their dicts, got {type(e).__name__}")


def plot_timeline(events: Iterable[Event | Mapping], *, title: str = "Timeline", ax=None,
                  show_layers: bool = True) -> Figure:
    """A Gantt chart: one row per rank, one bar per event, coloured by its kind.

    Works alike for a real run (times measured from a common barrier) and a
    simulated one (say so in ``title``). Bars of events that name a layer
    carry its number where the bar is wide enough to hold it.
    """
    evs = [_as_event(e) for e in events]
    if not evs:
        raise ValueError("no events to draw: the timeline is empty")
    unknown = sorted({e.kind for e in evs} - set(EVENT_KINDS))
    if unknown:
        raise ValueError(f"unknown event kind(s) {unknown}; allowed: {list(EVENT_KINDS)}")
    ranks = sorted({e.rank for e in evs})
    fig, ax = _new_axes(ax, figsize=(10, 1.0 + 0.7 * len(ranks)))
    row = {r: i for i, r in enumerate(ranks)}
    t0 = min(e.start_s for e in evs)
    span = max(e.end_s for e in evs) - t0 or 1.0
    # Width of the plotting area in points, to decide where a layer number fits.
    width_pt = fig.get_size_inches()[0] * ax.get_position().width * 72
    for kind in EVENT_KINDS:
        for r in ranks:
            bars = [(1e3 * (e.start_s - t0), 1e3 * e.duration_s) for e in evs if e.kind == kind and e.rank == r]
            if bars:
                ax.broken_barh(bars, (row[r] - 0.4, 0.8), facecolors=KIND_COLORS[kind], edgecolor="white", lw=0.3)
    if show_layers:
        for e in evs:
            if e.layer is None:
                continue
            text = str(e.layer)
            if e.duration_s / span * width_pt > 6 * len(text) + 2:
                ax.text(1e3 * (e.start_s - t0 + e.duration_s / 2), row[e.rank], text, ha="center",
                        va="center", fontsize=7, color="white")
    ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks])
    ax.set_ylim(len(ranks) - 0.5, -0.5)                                  # rank 0 on top
    ax.set_xlabel("time (ms)")
    ax.set_title(title)
    present = [k for k in EVENT_KINDS if any(e.kind == k for e in evs)]
    ax.legend(handles=[Patch(color=KIND_COLORS[k], label=k) for k in present], loc="upper left",
              bbox_to_anchor=(1.0, 1.0), fontsize=8)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    return fig


# --------------------------------------------------------------------------- lesson 05: attention coverage

def plot_coverage(chunks: Sequence[int], method: str = "kvr", *, ax=None,
                  title: str | None = None) -> Figure:
    """The C x C causal attention matrix and the rectangle of dot products each rank computes.

    Rows are queries, columns keys; the shaded lower triangle is what causal
    attention needs. With chunks c_i and s_i = c_0 + ... + c_{i-1}:
    KV-Runahead ("kvr") rank i computes rows [s_i, s_i + c_i) x keys [0, s_i + c_i);
    tensor/sequence parallel ("tsp") rank i computes its rows x all C keys.
    Each rectangle is labelled with its dot-product count (dense attention).
    """
    if method not in ("kvr", "tsp"):
        raise ValueError(f"method must be 'kvr' or 'tsp', got {method!r}")
    chunks = [int(c) for c in chunks]
    counts = dot_products(chunks, method)                               # validates the chunks
    C = sum(chunks)
    fig, ax = _new_axes(ax, figsize=(5.5, 5.5))
    needed = [[1.0 if k <= q else 0.0 for k in range(C)] for q in range(C)]
    ax.imshow(needed, cmap="Greys", vmin=0, vmax=3.5, extent=(0, C, C, 0), interpolation="nearest")
    colors = plt.get_cmap("tab10")
    for i, (c, start) in enumerate(zip(chunks, prefixes(chunks))):
        width = C if method == "tsp" else start + c
        ax.add_patch(Rectangle((0, start), width, c, fill=True, facecolor=colors(i), alpha=0.25,
                               edgecolor=colors(i), lw=2.5, label=f"rank {i}"))
        ax.text(width / 2, start + c / 2, f"rank {i}\n{counts[i]:,} dot products", ha="center",
                va="center", fontsize=8)
    if C <= 32:   # cell grid lines only while they stay readable
        ax.set_xticks(range(C + 1), minor=True)
        ax.set_yticks(range(C + 1), minor=True)
        ax.grid(which="minor", color="white", lw=0.5)
    ax.set_xlim(0, C)
    ax.set_ylim(C, 0)
    ax.set_xlabel("key position")
    ax.set_ylabel("query position")
    name = {"kvr": "KV-Runahead", "tsp": "TSP"}[method]
    ax.set_title(title or f"{name}, chunks {chunks}: {sum(counts):,} dot products "
                          f"(causal triangle needs {C * (C + 1) // 2:,})", fontsize=9)
    return fig


# --------------------------------------------------------------------------- lessons 05-07: TTFT

def plot_ttft_curves(contexts: Sequence[int], curves: Mapping[str, Sequence[float]],
                     bound: Sequence[float] | Mapping[str, Sequence[float]] | None = None, *,
                     ax=None, title: str = "Time to first token", logy: bool = False) -> Figure:
    """TTFT (drawn in seconds) against context length, one line per method.

    curves: method -> seconds per context. bound: a lower bound drawn dashed,
    either one sequence (labelled "lower bound") or label -> sequence.
    """
    if not curves:
        raise ValueError("curves is empty: give at least one {method: seconds per context}")
    fig, ax = _new_axes(ax)
    for label, secs in curves.items():
        _same_length("contexts", contexts, f"curves[{label!r}]", secs)
        ax.plot(contexts, secs, "o-", ms=4, label=label)
    if bound is not None:
        bounds = bound if isinstance(bound, Mapping) else {"lower bound": bound}
        for label, secs in bounds.items():
            _same_length("contexts", contexts, f"bound {label!r}", secs)
            ax.plot(contexts, secs, "--", color="black", lw=1, label=label)
    if logy:
        ax.set_yscale("log")
    else:
        ax.set_ylim(bottom=0)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("TTFT (s)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return fig


# --------------------------------------------------------------------------- small bar charts

# Widths (characters per line) tried, widest first, for names too long for the space under their bar.
_WRAP_WIDTHS = (16, 12, 8)


def _names_collide(fig: Figure, ax) -> bool:
    """Do any two of the x-axis names of ``ax``, as drawn, overlap?"""
    renderer = fig.canvas.get_renderer()
    boxes = [t.get_window_extent(renderer) for t in ax.get_xticklabels() if t.get_text()]
    return any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1:])


def plot_bars(values: Mapping[str, float], *, ax=None, ylabel: str = "", title: str = "",
              fmt: str = "{:.3g}", horizontal: bool = False) -> Figure:
    """One bar per entry of ``values`` (label -> number), each bar labelled with ``fmt``.

    The names under vertical bars never overlap: names too wide for their bars
    are wrapped at their spaces, and where even that leaves two touching, the
    bars are drawn horizontally instead, one name per row.
    """
    if not values:
        raise ValueError("values is empty: give at least one {label: number}")
    fig, ax = _new_axes(ax, figsize=(6, 3.2))
    labels, nums = [str(k) for k in values], list(values.values())
    if not horizontal:
        ax.bar_label(ax.bar(range(len(nums)), nums, color="#4C72B0"), labels=[fmt.format(v) for v in nums],
                     fontsize=8)
        ax.set_xticks(range(len(nums)), labels)
        fig.tight_layout()
        for width in _WRAP_WIDTHS:
            if not _names_collide(fig, ax):
                break
            ax.set_xticks(range(len(nums)), [textwrap.fill(name, width, break_long_words=False, break_on_hyphens=False)
                                              for name in labels])
            fig.tight_layout()
        else:
            if _names_collide(fig, ax):
                ax.clear()
                horizontal = True
    if horizontal:
        bars = ax.barh(range(len(nums)), nums, color="#4C72B0")
        ax.set_yticks(range(len(nums)), labels)
        ax.bar_label(bars, labels=[fmt.format(v) for v in nums], fontsize=8)
    ax.margins(**{"x" if horizontal else "y": 0.12})       # room for the number past the longest bar
    (ax.set_xlabel if horizontal else ax.set_ylabel)(ylabel)
    ax.set_title(title)
    fig.tight_layout()
    return fig


def plot_distribution(labels: Sequence[str], probs: Sequence[float], *, ax=None,
                      title: str = "Next-token distribution", highlight: int | None = None) -> Figure:
    """Probabilities of candidate tokens as bars; ``highlight`` (an index) is drawn in red."""
    _same_length("labels", labels, "probs", probs)
    fig, ax = _new_axes(ax, figsize=(7, 3.2))
    colors = ["#C44E52" if i == highlight else "#4C72B0" for i in range(len(probs))]
    ax.bar(range(len(probs)), probs, color=colors)
    ax.set_xticks(range(len(probs)), [repr(str(l))[1:-1] for l in labels], rotation=45, ha="right", fontsize=8)
    ax.set_ylim(0, 1)
    ax.set_ylabel("probability")
    ax.set_title(title)
    fig.tight_layout()
    return fig


# --------------------------------------------------------------------------- lessons 06-07: partition search and networks

def plot_boundary_search(results: Mapping[str, object], *, ax=None,
                         title: str = "Two processes: TTFT against the boundary") -> Figure:
    """TTFT against rank 0's chunk for two-process searches, one line per search, the best marked.

    results: label -> a ``toyllm.partition.SearchResult`` (its ``history``
    holds every partition evaluated, ``partition`` the best), e.g.
    {"measured": ..., "cost model (simulated)": ...}. Times drawn in ms.
    """
    if not results:
        raise ValueError("results is empty: give at least one {label: SearchResult}")
    fig, ax = _new_axes(ax)
    for label, res in results.items():
        points = sorted((h["chunks"][0], h["cost_s"]) for h in res.history)
        if any(len(h["chunks"]) != 2 for h in res.history):
            raise ValueError(f"results[{label!r}] is not a two-process search")
        line, = ax.plot([b for b, _ in points], [1e3 * t for _, t in points], "o-", ms=4,
                        label=f"{label}: best {res.partition}")
        ax.plot([res.partition[0]], [1e3 * res.cost_s], "*", ms=16, color=line.get_color())
    ax.set_xlabel("tokens on rank 0 (the boundary)")
    ax.set_ylabel("TTFT (ms)")
    return _finish(fig, ax, title)


def plot_partition_heatmap(context: int, surface: Mapping[tuple[int, int], float], *, path=None, ax=None,
                           title: str = "TTFT over the two boundaries of a 3-way split") -> Figure:
    """TTFT of three-process partitions as a heatmap over boundaries (b1, b2), with a search's path on it.

    surface: (b1, b2) -> seconds on a regular grid of boundaries (b1 < b2);
    path: optional ``SearchResult`` of a three-process search: its
    evaluations are drawn coloured by level (coarse to fine), its best as a star.
    """
    import numpy as np

    if not surface:
        raise ValueError("surface is empty: give {(b1, b2): seconds}")
    b1s, b2s = sorted({b for b, _ in surface}), sorted({b for _, b in surface})
    grid = np.full((len(b2s), len(b1s)), np.nan)
    col, row = {b: i for i, b in enumerate(b1s)}, {b: i for i, b in enumerate(b2s)}
    for (b1, b2), t in surface.items():
        grid[row[b2], col[b1]] = 1e3 * t
    fig, ax = _new_axes(ax, figsize=(6.5, 5.5))
    mesh = ax.pcolormesh(b1s, b2s, grid, shading="nearest", cmap="viridis_r")
    fig.colorbar(mesh, ax=ax, label="TTFT (ms)")
    if path is not None:
        levels = sorted({h["level"] for h in path.history})
        cmap = plt.get_cmap("autumn")
        for lv in levels:
            pts = [h["boundaries"][1:3] for h in path.history if h["level"] == lv]
            ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=10, color=cmap(lv / max(1, len(levels) - 1)),
                       label=f"level {lv} (stride {next(h['stride'] for h in path.history if h['level'] == lv)})")
        best = path.boundaries
        ax.plot([best[1]], [best[2]], "*", ms=18, color="white", mec="black", label=f"best {path.partition}")
        ax.legend(fontsize=7, loc="lower right")          # below the diagonal no partition exists
    ax.set_xlabel("boundary 1: end of rank 0's chunk (tokens)")
    ax.set_ylabel("boundary 2: end of rank 1's chunk (tokens)")
    ax.set_xlim(0, context)
    ax.set_ylim(0, context)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return fig


def _log_cell_edges(centres: Sequence[float], name: str):
    """Edges of cells centred (in log space) on ``centres``: geometric means of neighbours.

    The outer edges sit half a cell beyond the first and last centres, at most a
    factor of 2 away, so the axis spans the given values and not decades more.
    """
    import numpy as np

    v = np.asarray(centres, dtype=float)
    if v.ndim != 1 or len(v) == 0 or not np.all(np.isfinite(v)) or not np.all(v > 0):
        raise ValueError(f"{name} must be positive numbers for a log axis, got {list(centres)}")
    if len(v) > 1 and not (np.all(np.diff(v) > 0) or np.all(np.diff(v) < 0)):
        raise ValueError(f"{name} must be strictly increasing (or decreasing), got {list(centres)}")
    if len(v) == 1:
        return np.array([v[0] / 2 ** 0.5, v[0] * 2 ** 0.5])
    inner = np.sqrt(v[:-1] * v[1:])
    # Mirror the nearest inner edge about the outer centre (in log space), at most a factor of 2 away.
    first = v[0] * np.clip(v[0] / inner[0], 0.5, 2.0)
    last = v[-1] * np.clip(v[-1] / inner[-1], 0.5, 2.0)
    return np.concatenate([[first], inner, [last]])


def plot_speedup_map(contexts: Sequence[int], bandwidths_gbps: Sequence[float], speedup, *, ax=None,
                     title: str = "Speedup of parallel prefill over one process") -> Figure:
    """A map of speedup (one process's TTFT / the parallel TTFT) over context x bandwidth.

    speedup: rows per context, columns per bandwidth (a nested list or
    array). Green where parallel prefill wins, red where it loses; the black
    line is speedup = 1, the break-even.
    """
    import numpy as np
    from matplotlib.colors import TwoSlopeNorm

    values = np.asarray(speedup, dtype=float)
    if values.shape != (len(contexts), len(bandwidths_gbps)):
        raise ValueError(f"speedup has shape {values.shape}, expected (contexts, bandwidths) = "
                         f"({len(contexts)}, {len(bandwidths_gbps)})")
    x_edges = _log_cell_edges(bandwidths_gbps, "bandwidths_gbps")
    y_edges = _log_cell_edges(contexts, "contexts")
    fig, ax = _new_axes(ax, figsize=(6, 4.5))
    ax.set_xscale("log")
    ax.set_yscale("log", base=2)
    lo, hi = min(values.min(), 0.99), max(values.max(), 1.01)
    # Cell edges halfway between neighbours in log space (geometric means): on log axes,
    # shading="nearest" would put the first edge at a linear midpoint, possibly <= 0.
    mesh = ax.pcolormesh(x_edges, y_edges, values, shading="flat", cmap="RdYlGn",
                         norm=TwoSlopeNorm(vcenter=1.0, vmin=lo, vmax=hi))
    fig.colorbar(mesh, ax=ax, label="speedup (x)")
    if values.min() < 1 < values.max() and min(values.shape) > 1:
        ax.contour(bandwidths_gbps, contexts, values, levels=[1.0], colors="black", linewidths=1.5)
    ax.set_xlim(min(x_edges[0], x_edges[-1]), max(x_edges[0], x_edges[-1]))
    ax.set_ylim(min(y_edges[0], y_edges[-1]), max(y_edges[0], y_edges[-1]))
    ax.set_xlabel("link bandwidth (GB/s)")
    ax.set_ylabel("context (tokens)")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return fig


def plot_winner_map(contexts: Sequence[float], bandwidths_gbps: Sequence[float], times: Mapping[str, object], *,
                    ax=None, title: str = "Fastest method", ylabel: str = "context (tokens)") -> Figure:
    """Which method has the shortest time in each cell of a map over ``contexts`` x link bandwidth.

    times: method name -> its times (seconds), rows per context, columns per
    bandwidth, as ``plot_speedup_map``'s speedups. Each cell is coloured by
    its fastest method and labelled with how many times faster it is than
    the runner-up; the legend lists the methods in the order given.
    """
    import numpy as np
    from matplotlib.colors import ListedColormap

    names = list(times)
    if len(names) < 2:
        raise ValueError(f"a winner map needs at least two methods, got {names}")
    values = np.stack([np.asarray(times[n], dtype=float) for n in names])     # (methods, contexts, bandwidths)
    if values.shape[1:] != (len(contexts), len(bandwidths_gbps)):
        raise ValueError(f"times have shape {values.shape[1:]}, expected (contexts, bandwidths) = "
                         f"({len(contexts)}, {len(bandwidths_gbps)})")
    x_edges = _log_cell_edges(bandwidths_gbps, "bandwidths_gbps")
    y_edges = _log_cell_edges(contexts, "contexts")
    order = values.argsort(axis=0)
    best = order[0]
    ratio = np.take_along_axis(values, order[1][None], 0)[0] / np.take_along_axis(values, best[None], 0)[0]
    colours = [f"C{i}" for i in range(len(names))]
    fig, ax = _new_axes(ax, figsize=(6, 4.5))
    ax.set_xscale("log")
    ax.set_yscale("log", base=2)
    ax.pcolormesh(x_edges, y_edges, best, shading="flat", cmap=ListedColormap(colours), vmin=-0.5,
                  vmax=len(names) - 0.5)
    for i, y in enumerate(contexts):
        for j, x in enumerate(bandwidths_gbps):
            ax.text(x, y, f"{ratio[i, j]:.2g}", ha="center", va="center", fontsize=7)
    ax.legend(handles=[Patch(color=c, label=n) for c, n in zip(colours, names)], fontsize=8, loc="upper left",
              bbox_to_anchor=(1.01, 1.0))
    ax.set_xlim(min(x_edges[0], x_edges[-1]), max(x_edges[0], x_edges[-1]))
    ax.set_ylim(min(y_edges[0], y_edges[-1]), max(y_edges[0], y_edges[-1]))
    ax.set_xlabel("link bandwidth (GB/s)")
    ax.set_ylabel(ylabel)
    ax.set_title(title + " (number: x faster than the next)", fontsize=10)
    fig.tight_layout()
    return fig


# --------------------------------------------------------------------------- lesson 09: ring attention

def plot_ring_step(context: int, world_size: int, step: int, balance: str = "none", kernel: str = "dense", *,
                   ax=None) -> Figure:
    """Which query-key blocks each rank attends to at one step of ring pass-KV, over the causal triangle.

    Rows are queries, columns keys. At ring step s rank r holds its own
    queries and the keys and values that started on rank (r - s) mod p: the
    block is drawn in the rank's colour, solid for this step, faint for the
    steps before it; a block wholly in the queries' future is outlined only
    (skipped, no dot products). Each rank's label gives the pairs its kernel
    computes at this step (``toyllm.simulate_ring.block_pairs``).
    """
    from .partition import even_partition, zigzag_chunks
    from .simulate_ring import block_pairs, token_runs

    if not 0 <= step < world_size:
        raise ValueError(f"a ring of {world_size} ranks has steps 0 .. {world_size - 1}, got step {step}")
    chunks = zigzag_chunks(context, world_size) if balance == "zigzag" else even_partition(context, world_size)
    layout = token_runs(chunks, balance)
    C, p = context, world_size
    fig, ax = _new_axes(ax, figsize=(5.5, 5.5))
    needed = [[1.0 if k <= q else 0.0 for k in range(C)] for q in range(C)]
    ax.imshow(needed, cmap="Greys", vmin=0, vmax=3.5, extent=(0, C, C, 0), interpolation="nearest")
    colors = plt.get_cmap("tab10")
    for s in range(step + 1):
        for r in range(p):
            q_runs, k_runs = layout[r], layout[(r - s) % p]
            pairs = block_pairs(q_runs, k_runs, kernel)
            for a, b in q_runs:
                for c, d in k_runs:
                    if s < step and not pairs:
                        continue
                    ax.add_patch(Rectangle((c, a), d - c, b - a, fill=bool(pairs), facecolor=colors(r),
                                           alpha=0.55 if s == step else 0.12, edgecolor=colors(r),
                                           lw=2 if s == step else 0.5, ls="-" if pairs else "--"))
            if s == step:
                a, b = q_runs[0]
                ax.text(C + 0.5, (a + b) / 2, f"rank {r}: {pairs:,} pairs" if pairs else f"rank {r}: skipped",
                        va="center", fontsize=8, color=colors(r))
    ax.set_xlim(0, C)
    ax.set_ylim(C, 0)
    ax.set_xlabel("key position")
    ax.set_ylabel("query position")
    ax.set_title(f"ring pass-KV, step {step} of {p - 1}, {balance} layout, {kernel} kernel", fontsize=9)
    fig.tight_layout()
    return fig
