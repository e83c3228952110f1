"""Small interactive explorers for the notebooks (ipywidgets + matplotlib).

Each explorer is a class with:

- its controls as attributes (``calc.tokens``, ``explorer.batch``, ...), plain
  ipywidgets whose ``.value`` can be set from code as well as by hand;
- ``update()``, called by the controls' observers, which recomputes the
  numbers (with ``toyllm.analysis`` or ``toyllm.generation``, never a private
  copy of a formula), writes them to ``.text`` (an HTML widget) and redraws
  ``.figure`` into an output area;
- ``.widget``, the container to show: ``display(calc.widget)``, or just put
  ``calc.widget`` last in a cell.

The numbers a view shows are also kept as attributes (``calc.nbytes``,
``explorer.step_time_s``, ``sampler.frequencies``), so tests and curious
learners can check them without reading HTML.

- ``KVMemoryCalculator``: KV-cache bytes from layers, KV heads, head size, tokens, precision and batch.
- ``RooflineExplorer``: tokens per step -> matmul intensity, memory- or compute-bound, decode step time.
- ``SamplingExplorer``: temperature / top-k / top-p -> what the sampler draws from a fixed logits vector.
"""
from __future__ import annotations

from typing import Sequence

import ipywidgets as W
import matplotlib.pyplot as plt
import torch
from IPython import get_ipython
from IPython.display import display

from . import analysis, viz
from .generation import sample_next_token
from .model import get_config

_SLIDER = {"continuous_update": False, "style": {"description_width": "150px"}, "layout": W.Layout(width="480px")}


class _Explorer:
    """Shared plumbing: an HTML text, an output area for the figure, and redrawing."""

    def __init__(self, plot: bool):
        self.plot = plot
        self.text = W.HTML()
        self.out = W.Output()
        self.figure = None
        self._holding = False

    def _observe(self, *controls) -> None:
        for c in controls:
            c.observe(lambda change: self.update(), names="value")

    def _show(self, fig) -> None:
        """Put ``fig`` in the output area, replacing the previous one."""
        if self.figure is not None:
            plt.close(self.figure)
        self.figure = fig
        if get_ipython() is not None:   # in a plain script or a test there is nowhere to show it
            with self.out:
                self.out.clear_output(wait=True)
                display(fig)
        plt.close(fig)   # displayed as an image already; keep pyplot from showing it a second time

    def update(self) -> None:   # every explorer defines its own
        raise NotImplementedError


def _fmt_bytes(n: float) -> str:
    """'6,710,886,400 bytes = 6.71 GB = 6.25 GiB' (GB = 1e9 bytes, GiB = 2^30 bytes)."""
    whole = f"{n:,.0f}" if float(n).is_integer() else f"{n:,.1f}"
    return f"{whole} bytes = {n / analysis.GB:,.2f} GB = {n / analysis.GiB:,.2f} GiB"


# --------------------------------------------------------------------------- KV-cache memory

def _shape(cfg, n_kv_heads: int | None = None) -> dict:
    """The three model numbers the KV cache depends on, from a ModelConfig, and its context length."""
    return {"layers": cfg.n_layers, "kv_heads": n_kv_heads or cfg.n_kv_heads, "head_dim": cfg.head_dim,
            "context": cfg.max_context}


class KVMemoryCalculator(_Explorer):
    """KV-cache size = 2 x layers x kv_heads x head_dim x tokens x bytes_per_value x batch.

    ``calc = KVMemoryCalculator(); calc.widget`` shows sliders and the result;
    ``calc.nbytes`` is the current size in bytes. The plot draws the size
    against the number of tokens for the chosen KV heads next to multi-query
    attention (one KV head), with the chosen token count marked.
    """

    PRESETS = {
        "LLaMA-2-13B (MHA, 40 KV heads)": _shape(analysis.LLAMA2_13B),
        "LLaMA-2-13B with 8 KV heads (GQA)": _shape(analysis.LLAMA2_13B, n_kv_heads=8),
        "Llama-7B (MHA)": _shape(analysis.LLAMA_7B),
        "SmolLM2-135M (GQA, 3 KV heads)": _shape(get_config("smollm2-135m")),
    }
    PRECISIONS = [("float32 (4 bytes)", 4), ("bf16 / fp16 (2 bytes)", 2), ("int8 (1 byte)", 1),
                  ("int4 (0.5 bytes)", 0.5)]

    def __init__(self, preset: str = "LLaMA-2-13B (MHA, 40 KV heads)", tokens: int = 8192,
                 bytes_per_value: float = 2, batch: int = 1, plot: bool = True):
        super().__init__(plot)
        if preset not in self.PRESETS:
            raise ValueError(f"unknown preset {preset!r}; choose one of {list(self.PRESETS)}")
        shape = self.PRESETS[preset]
        self.preset = W.Dropdown(options=list(self.PRESETS), value=preset, description="model",
                                 style=_SLIDER["style"], layout=W.Layout(width="480px"))
        self.layers = W.IntSlider(shape["layers"], min=1, max=128, description="layers", **_SLIDER)
        self.kv_heads = W.IntSlider(shape["kv_heads"], min=1, max=128, description="KV heads", **_SLIDER)
        self.head_dim = W.IntSlider(shape["head_dim"], min=8, max=256, step=8, description="head_dim", **_SLIDER)
        self.tokens = W.IntSlider(tokens, min=1, max=131072, description="tokens per sequence", **_SLIDER)
        self.bytes_per_value = W.Dropdown(options=self.PRECISIONS, value=bytes_per_value,
                                          description="precision", style=_SLIDER["style"])
        self.batch = W.IntSlider(batch, min=1, max=256, description="batch (sequences)", **_SLIDER)
        self.preset.observe(self._apply_preset, names="value")
        self._observe(self.layers, self.kv_heads, self.head_dim, self.tokens, self.bytes_per_value, self.batch)
        self.widget = W.VBox([self.preset, self.layers, self.kv_heads, self.head_dim, self.tokens,
                              self.bytes_per_value, self.batch, self.text, self.out])
        self.update()

    def _apply_preset(self, change) -> None:
        shape = self.PRESETS[change["new"]]
        self._holding = True            # one update for the three sliders, not three
        try:
            self.layers.value, self.kv_heads.value, self.head_dim.value = (
                shape["layers"], shape["kv_heads"], shape["head_dim"])
        finally:
            self._holding = False
        self.update()

    def bytes_for(self, tokens: int, kv_heads: int | None = None) -> float:
        """KV bytes of the current settings at ``tokens`` tokens (and optionally another KV-head count)."""
        return analysis.kv_cache_bytes(self.layers.value, self.kv_heads.value if kv_heads is None else kv_heads,
                                       self.head_dim.value, tokens, self.bytes_per_value.value, self.batch.value)

    def update(self) -> None:
        if self._holding:
            return
        L, K, H = self.layers.value, self.kv_heads.value, self.head_dim.value
        T, b, B = self.tokens.value, self.bytes_per_value.value, self.batch.value
        self.nbytes = self.bytes_for(T)
        per_token = self.bytes_for(1) / B
        self.text.value = (
            f"<b>KV cache = 2 &times; {L} layers &times; {K} KV heads &times; {H} head_dim &times; {T:,} tokens "
            f"&times; {b} bytes &times; batch {B}</b><br>= {_fmt_bytes(self.nbytes)}"
            f"<br>{per_token:,.0f} bytes per token of one sequence")
        context = self.PRESETS[self.preset.value]["context"]
        if T > context:
            self.text.value += (f"<br><i>{self.preset.value} was built for {context:,} tokens: "
                                f"{T:,} is a hypothetical length for it</i>")
        if self.plot:
            xs = [round(2 * T * i / 50) for i in range(51)]   # up to twice the chosen length
            series = {f"{K} KV heads (this setting)": [self.bytes_for(x) for x in xs]}
            if K != 1:
                series["1 KV head (MQA)"] = [self.bytes_for(x, kv_heads=1) for x in xs]
            self._show(viz.plot_kv_memory(xs, series, marker_at=T,
                                          title=f"KV cache of {B} sequence(s), {b} bytes per value"))


# --------------------------------------------------------------------------- roofline

class RooflineExplorer(_Explorer):
    """How many tokens per step make the matmuls compute-bound, and what a decode step costs.

    The hardware: ``peak_flops`` (FLOP/s) and ``bandwidth`` (bytes/s). The
    matmul is [B, d_model] x [d_model, d_ff] at ``bytes_per_value``; B, the
    tokens processed per step (a decode batch, or a prefill chunk), is the
    slider ``batch``. If ``param_bytes`` is given, the text also shows the
    decode step time of a whole model with ``kv_bytes_per_seq`` of KV cache
    per sequence: the memory-bound minimum (batch x KV + params) / bandwidth,
    and, if ``param_count`` is given too, the general estimate in which the
    matmuls may turn compute-bound (``analysis.step_time_s``).
    ``crossing_batch`` is the smallest B at which the matmul is compute-bound
    (``analysis.crossing_batch``; None if it never is).
    """

    def __init__(self, peak_flops: float, bandwidth: float, d_model: int = 4096, d_ff: int = 16384,
                 bytes_per_value: float = 2, param_bytes: float | None = None, param_count: float | None = None,
                 kv_bytes_per_seq: float = 0.0, batch: int = 1, max_batch: int = 1024,
                 name: str = "hardware", plot: bool = True):
        super().__init__(plot)
        if peak_flops <= 0 or bandwidth <= 0:
            raise ValueError(f"peak_flops and bandwidth must be positive, got {peak_flops} and {bandwidth}")
        self.peak_flops, self.bandwidth, self.name = peak_flops, bandwidth, name
        self.d_model, self.d_ff, self.bytes_per_value = d_model, d_ff, bytes_per_value
        self.param_bytes, self.param_count, self.kv_bytes_per_seq = param_bytes, param_count, kv_bytes_per_seq
        self.batch = W.IntSlider(batch, min=1, max=max_batch, description="tokens per step (B)", **_SLIDER)
        self._observe(self.batch)
        self.widget = W.VBox([self.batch, self.text, self.out])
        self.update()

    @classmethod
    def pop_quiz(cls, batch: int = 4, plot: bool = True) -> "RooflineExplorer":
        """The inference chapter's pop quiz: 30B int8 model, 8192-token contexts at 100 kB/token, TPU v5e 4x4."""
        q, hw = analysis.POP_QUIZ, analysis.POP_QUIZ["hardware"]
        # The quiz gives no layer shapes; an 8192 x 32768 matmul stands in for the model's big ones.
        return cls(hw.total_flops, hw.total_bandwidth_bytes_per_s, d_model=8192, d_ff=32768, bytes_per_value=1,
                   param_bytes=q["param_bytes"], param_count=q["param_count"],
                   kv_bytes_per_seq=q["kv_bytes_per_token"] * q["context"], batch=batch, name=hw.name, plot=plot)

    def update(self) -> None:
        B, D, F = self.batch.value, self.d_model, self.d_ff
        self.ridge = analysis.critical_intensity(self.peak_flops, self.bandwidth)
        self.intensity = analysis.matmul_intensity(B, D, F, self.bytes_per_value)
        self.compute_bound = self.intensity >= self.ridge
        flops = analysis.matmul_flops(B, D, F)
        moved = analysis.matmul_bytes(B, D, F, self.bytes_per_value)
        self.matmul_time_s = analysis.roofline_time_s(flops, moved, self.peak_flops, self.bandwidth)
        self.crossing_batch = analysis.crossing_batch(D, F, self.peak_flops, self.bandwidth, self.bytes_per_value)
        verdict = "compute-bound" if self.compute_bound else "memory-bound"
        crossing = ("never compute-bound at any B" if self.crossing_batch is None
                    else f"compute-bound from B = {self.crossing_batch}")
        lines = [f"<b>{self.name}</b>: {self.peak_flops:.3g} FLOP/s, {self.bandwidth:.3g} bytes/s "
                 f"&rarr; ridge at {self.ridge:.1f} FLOP/byte",
                 f"matmul [{B}, {D}] &times; [{D}, {F}], {self.bytes_per_value} byte(s) per value: "
                 f"intensity {self.intensity:.1f} FLOP/byte &rarr; <b>{verdict}</b>, "
                 f"at least {self.matmul_time_s * 1e6:,.1f} &micro;s ({crossing})"]
        self.step_time_s = self.min_step_time_s = self.throughput_tokens_per_s = None
        if self.param_bytes is not None:
            self.min_step_time_s = analysis.min_step_time_s(self.param_bytes, self.kv_bytes_per_seq, B, self.bandwidth)
            self.step_time_s = self.min_step_time_s
            if self.param_count is not None:
                self.step_time_s = analysis.step_time_s(self.param_bytes, self.kv_bytes_per_seq, B, self.bandwidth,
                                                        self.param_count, self.peak_flops)
            self.throughput_tokens_per_s = B / self.step_time_s
            lines.append(f"decode step of the model for {B} sequence(s): memory-bound minimum "
                         f"{self.min_step_time_s * 1e3:,.2f} ms; with compute-bound matmuls "
                         f"{self.step_time_s * 1e3:,.2f} ms &rarr; at most "
                         f"{self.throughput_tokens_per_s:,.0f} tokens/s")
        self.text.value = "<br>".join(lines)
        if self.plot:
            attainable = min(self.peak_flops, self.bandwidth * self.intensity)
            self._show(viz.plot_roofline(self.peak_flops, self.bandwidth,
                                         {f"matmul, B={B}": (self.intensity, attainable)},
                                         title=f"Roofline of {self.name}"))


# --------------------------------------------------------------------------- sampling

class SamplingExplorer(_Explorer):
    """What ``toyllm.generation.sample_next_token`` draws from one logits vector.

    The bars are the frequencies of each candidate in ``draws`` calls of the
    real sampler (seeded, so the same settings always give the same bars),
    next to the plain softmax at temperature 1 for comparison.
    temperature 0 means greedy; top_k 0 and top_p 1 mean "no cut".
    """

    def __init__(self, logits: torch.Tensor | Sequence[float], labels: Sequence[str] | None = None,
                 temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, draws: int = 2000,
                 seed: int = 0, plot: bool = True):
        super().__init__(plot)
        self.logits = torch.as_tensor(logits, dtype=torch.float32).flatten()
        if self.logits.numel() < 2:
            raise ValueError(f"give at least 2 logits, got {self.logits.numel()}")
        n = self.logits.numel()
        self.labels = [str(i) for i in range(n)] if labels is None else [str(s) for s in labels]
        if len(self.labels) != n:
            raise ValueError(f"{len(self.labels)} labels for {n} logits: give one label per logit")
        if draws < 1:
            raise ValueError(f"draws must be at least 1, got {draws}")
        self.draws, self.seed = draws, seed
        self.softmax = torch.softmax(self.logits, dim=-1).tolist()
        self.temperature = W.FloatSlider(temperature, min=0.0, max=2.0, step=0.05, description="temperature", **_SLIDER)
        self.top_k = W.IntSlider(top_k, min=0, max=n, description="top_k (0 = off)", **_SLIDER)
        self.top_p = W.FloatSlider(top_p, min=0.05, max=1.0, step=0.05, description="top_p (1 = off)", **_SLIDER)
        self._observe(self.temperature, self.top_k, self.top_p)
        self.widget = W.VBox([self.temperature, self.top_k, self.top_p, self.text, self.out])
        self.update()

    def settings(self) -> dict:
        """The current controls as ``sample_next_token`` keyword arguments."""
        return {"temperature": float(self.temperature.value), "top_k": self.top_k.value or None,
                "top_p": None if self.top_p.value >= 1.0 else float(self.top_p.value)}

    def update(self) -> None:
        kw = self.settings()
        gen = torch.Generator().manual_seed(self.seed)
        counts = [0] * self.logits.numel()
        for _ in range(self.draws):
            counts[sample_next_token(self.logits, generator=gen, **kw)] += 1
        self.frequencies = [c / self.draws for c in counts]
        kept = sum(c > 0 for c in counts)
        top = max(range(len(counts)), key=counts.__getitem__)
        self.text.value = (f"temperature={kw['temperature']}, top_k={kw['top_k']}, top_p={kw['top_p']}: "
                           f"{kept} of {len(counts)} candidates were ever drawn in {self.draws:,} draws; "
                           f"most frequent: {self.labels[top]!r} ({self.frequencies[top]:.1%})")
        if self.plot:
            fig, ax = plt.subplots(figsize=(8, 3.4))
            ax.plot(range(len(self.softmax)), self.softmax, "k_", ms=14, mew=2, label="softmax at temperature 1")
            viz.plot_distribution(self.labels, self.frequencies, ax=ax, highlight=top,
                                  title=f"frequencies in {self.draws:,} draws of sample_next_token")
            ax.legend(fontsize=8)
            self._show(fig)


# --------------------------------------------------------------------------- lessons 04-05: parallel prefill

class ParallelCountsExplorer(_Explorer):
    """Context length, processes and rank 0's share -> dot products and K/V rows per rank, TSP beside KVR.

    The numbers come from ``toyllm.partition`` (``dot_products``,
    ``kv_rows_sent``): dense attention, per head and layer. ``share`` is the
    fraction of the context on rank 0; the others split the rest evenly.
    """

    def __init__(self, context: int = 4096, world_size: int = 4, share: float | None = None, plot: bool = True):
        super().__init__(plot)
        self.context = W.IntSlider(context, min=2, max=32768, description="context C (tokens)", **_SLIDER)
        self.world_size = W.IntSlider(world_size, min=2, max=8, description="processes p", **_SLIDER)
        self.share = W.FloatSlider(1 / world_size if share is None else share, min=0.05, max=0.95, step=0.01,
                                   description="rank 0's share (KVR)", **_SLIDER)
        self._observe(self.context, self.world_size, self.share)
        self.widget = W.VBox([self.context, self.world_size, self.share, self.text, self.out])
        self.update()

    def update(self) -> None:
        from .partition import dot_products, even_partition, kv_rows_sent, partition_from_ratios

        C, p, r = self.context.value, self.world_size.value, self.share.value
        self.tsp_chunks = even_partition(C, p)
        self.kvr_chunks = partition_from_ratios(C, [r] + [(1 - r) / (p - 1)] * (p - 1))
        self.tsp_dots, self.kvr_dots = dot_products(self.tsp_chunks, "tsp"), dot_products(self.kvr_chunks, "kvr")
        self.tsp_rows, self.kvr_rows = sum(kv_rows_sent(self.tsp_chunks, "tsp")), sum(kv_rows_sent(self.kvr_chunks, "kvr"))
        self.text.value = (f"TSP, even split {self.tsp_chunks}: slowest rank {max(self.tsp_dots):,} dot products, "
                           f"{self.tsp_rows:,} K/V rows moved<br>"
                           f"KVR, split {self.kvr_chunks}: slowest rank {max(self.kvr_dots):,} dot products, "
                           f"{self.kvr_rows:,} K/V rows sent<br>"
                           f"the causal triangle needs {C * (C + 1) // 2:,} in all")
        if self.plot:
            fig, ax = plt.subplots(figsize=(7, 3.2))
            x = torch.arange(p).float()
            ax.bar(x - 0.2, self.tsp_dots, 0.4, label="TSP (even)")
            ax.bar(x + 0.2, self.kvr_dots, 0.4, label="KVR")
            ax.set_xticks(range(p), [f"rank {i}" for i in range(p)])
            ax.set_ylabel("dot products per head and layer")
            ax.legend()
            fig.tight_layout()
            self._show(fig)


class CoverageExplorer(_Explorer):
    """Drag the boundaries of a p = 3 partition and see each rank's rectangle in the causal triangle."""

    def __init__(self, context: int = 24, first: int = 11, second: int = 19, method: str = "kvr", plot: bool = True):
        super().__init__(plot)
        self.context = context
        self.first = W.IntSlider(first, min=1, max=context - 2, description="boundary 1", **_SLIDER)
        self.second = W.IntSlider(second, min=2, max=context - 1, description="boundary 2", **_SLIDER)
        self.method = W.ToggleButtons(options=["kvr", "tsp"], value=method, description="method")
        self._observe(self.first, self.second, self.method)
        self.widget = W.VBox([self.method, self.first, self.second, self.text, self.out])
        self.update()

    def update(self) -> None:
        from .partition import dot_products

        a, b = sorted((self.first.value, self.second.value))
        if a == b:
            self.chunks = None
            self.text.value = "the two boundaries must differ: every rank needs at least one token"
            return
        self.chunks = [a, b - a, self.context - b]
        self.dots = dot_products(self.chunks, self.method.value)
        self.text.value = (f"chunks {self.chunks}: dot products per rank {self.dots}; the last rank produces the "
                           f"first token, and in every layer it waits for the keys and values of every earlier "
                           f"rank, so the first token comes no earlier than the busiest rank ({max(self.dots)}) has "
                           f"done all its work but its last layer's attention and MLP (those it may still be "
                           f"running after the first token is out)")
        if self.plot:
            self._show(viz.plot_coverage(self.chunks, self.method.value))


# --------------------------------------------------------------------------- lessons 06-07: partitions and networks

class PartitionExplorer(_Explorer):
    """Drag the boundaries of a KV-Runahead partition and watch the simulated TTFT and timeline change.

    cfg, cost_model: the model shape and the ``toyllm.simulate.CostModel``
    (calibrated or assumed) the simulator uses; everything shown is
    simulated. One slider per inner boundary (tokens). Kept as attributes:
    ``chunks`` (None while the boundaries do not increase), ``ttft_s``,
    ``even_ttft_s`` and ``result`` (the ``SimResult``).
    """

    def __init__(self, cfg, cost_model, context: int = 1024, world_size: int = 3,
                 boundaries: Sequence[int] | None = None, plot: bool = True):
        from .partition import boundaries_from_chunks, even_partition

        super().__init__(plot)
        if world_size < 2:
            raise ValueError(f"world_size must be at least 2 to have a boundary to drag, got {world_size}")
        self.cfg, self.cost_model, self.context = cfg, cost_model, context
        start = list(boundaries) if boundaries is not None else boundaries_from_chunks(even_partition(context, world_size))[1:-1]
        if len(start) != world_size - 1:
            raise ValueError(f"{world_size} processes have {world_size - 1} inner boundaries, got {start}")
        self.sliders = [W.IntSlider(b, min=1, max=context - 1, description=f"boundary {j + 1} (tokens)", **_SLIDER)
                        for j, b in enumerate(start)]
        self._observe(*self.sliders)
        self.widget = W.VBox([*self.sliders, self.text, self.out])
        self.update()

    def update(self) -> None:
        from .partition import chunks_from_boundaries, even_partition
        from .simulate import simulate_prefill

        bounds = [0, *(s.value for s in self.sliders), self.context]
        if any(lo >= hi for lo, hi in zip(bounds, bounds[1:])):
            self.chunks = self.result = self.ttft_s = None
            self.text.value = "the boundaries must increase from left to right: every rank needs at least one token"
            return
        self.chunks = chunks_from_boundaries(bounds)
        self.result = simulate_prefill(self.cfg, self.chunks, "kvr", self.cost_model)
        self.ttft_s = self.result.ttft_s
        self.even_ttft_s = simulate_prefill(self.cfg, even_partition(self.context, len(self.chunks)), "kvr",
                                            self.cost_model, record_events=False).ttft_s
        finish = ", ".join(f"{1e3 * t:.1f}" for t in self.result.per_rank_finish_s)
        self.text.value = (f"chunks {self.chunks}: simulated TTFT {1e3 * self.ttft_s:.2f} ms "
                           f"({self.even_ttft_s / self.ttft_s:.3f}x the speed of the even split, "
                           f"{1e3 * self.even_ttft_s:.2f} ms)<br>ranks finish at {finish} ms")
        if self.plot:
            self._show(viz.plot_timeline(self.result.events, show_layers=False,
                                         title=f"simulated KVR timeline, chunks {self.chunks}"))


class NetworkExplorer(_Explorer):
    """Bandwidth, context and processes -> simulated TTFT of one process, TSP, KVR (even split) and ring.

    cfg, cost_model: the model shape and the ``CostModel`` whose link
    bandwidth the slider replaces (GB/s = 1e9 bytes/s). Ring is pass-KV with
    the zigzag balance (``simulate_prefill(..., "ring", balance="zigzag")``).
    Everything shown is simulated. Kept as attributes: ``times_s`` (method ->
    seconds), ``speedup`` (method -> one process's TTFT / the method's) and
    ``fastest`` (the method with the shortest TTFT).
    """

    def __init__(self, cfg, cost_model, context: int = 4096, bandwidth_gbps: float = 10.0, world_size: int = 2,
                 plot: bool = True):
        super().__init__(plot)
        self.cfg, self.cost_model = cfg, cost_model
        self.bandwidth = W.FloatLogSlider(bandwidth_gbps, base=10, min=-2, max=3, step=0.1,
                                          description="link (GB/s)", **_SLIDER)
        self.context = W.IntSlider(context, min=64, max=cfg.max_context, step=64, description="context (tokens)",
                                   **_SLIDER)
        self.world_size = W.IntSlider(world_size, min=2, max=8, description="processes p", **_SLIDER)
        self._observe(self.bandwidth, self.context, self.world_size)
        self.widget = W.VBox([self.bandwidth, self.context, self.world_size, self.text, self.out])
        self.update()

    def update(self) -> None:
        from .partition import even_partition, zigzag_chunks
        from .simulate import simulate_prefill

        cm = self.cost_model.with_link(self.bandwidth.value * 1e9)
        C, p = self.context.value, self.world_size.value
        even = even_partition(C, p)
        self.times_s = {
            "one process": simulate_prefill(self.cfg, [C], "single", cm, record_events=False).ttft_s,
            f"TSP, p={p}": simulate_prefill(self.cfg, even, "tsp", cm, record_events=False).ttft_s,
            f"KVR-E, p={p}": simulate_prefill(self.cfg, even, "kvr", cm, record_events=False).ttft_s,
            f"ring (zigzag), p={p}": simulate_prefill(self.cfg, zigzag_chunks(C, p), "ring", cm, record_events=False,
                                                      balance="zigzag").ttft_s}
        single = self.times_s["one process"]
        self.speedup = {k: single / t for k, t in self.times_s.items()}
        self.fastest = min(self.times_s, key=self.times_s.get)
        self.text.value = ("simulated: " + "; ".join(f"{k} {1e3 * t:.2f} ms ({self.speedup[k]:.2f}x)"
                                                     for k, t in self.times_s.items())
                           + f"<br>fastest here: <b>{self.fastest}</b>")
        if self.plot:
            self._show(viz.plot_bars({k: 1e3 * t for k, t in self.times_s.items()}, ylabel="TTFT (ms)",
                                     title=f"simulated, {C} tokens, {self.bandwidth.value:.3g} GB/s links"))


# --------------------------------------------------------------------------- lesson 08: serving

class PagingExplorer(_Explorer):
    """Block size -> KV memory a batch of sequences reserves: a static buffer each, or blocks of a paged pool.

    lengths: tokens each sequence holds now; max_tokens: the longest sequence
    the static buffer must fit (S). A static cache (lesson 02) reserves
    2(S-1) rows per sequence (``reserve=2``); a paged one reserves whole
    blocks, ``ceil(length / block_size)`` of them. Kept as attributes:
    ``used_bytes``, ``paged_bytes``, ``static_bytes`` and ``unused_share``
    (the share of the paged reservation no token uses).
    """

    def __init__(self, cfg, lengths: Sequence[int], max_tokens: int, block_size: int = 16,
                 bytes_per_value: float = 4, plot: bool = True):
        super().__init__(plot)
        if not lengths or min(lengths) < 1 or max(lengths) > max_tokens:
            raise ValueError(f"lengths must be 1 to max_tokens ({max_tokens}) tokens each, got {list(lengths)[:8]}")
        self.cfg, self.lengths, self.max_tokens, self.bytes_per_value = cfg, list(lengths), max_tokens, bytes_per_value
        self.block_size = W.IntSlider(block_size, min=1, max=256, description="block size (tokens)", **_SLIDER)
        self._observe(self.block_size)
        self.widget = W.VBox([self.block_size, self.text, self.out])
        self.update()

    def _bytes(self, tokens: int) -> float:
        cfg = self.cfg
        return analysis.kv_cache_bytes(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, tokens, self.bytes_per_value)

    def update(self) -> None:
        import math

        bs = self.block_size.value
        used = sum(self.lengths)
        paged = sum(math.ceil(n / bs) * bs for n in self.lengths)
        static = len(self.lengths) * 2 * (self.max_tokens - 1)
        self.used_bytes, self.paged_bytes, self.static_bytes = self._bytes(used), self._bytes(paged), self._bytes(static)
        self.unused_share = 1 - used / paged
        self.text.value = (f"{len(self.lengths)} sequences, {used:,} tokens: the tokens need "
                           f"{_fmt_bytes(self.used_bytes)}<br>paged, blocks of {bs}: {_fmt_bytes(self.paged_bytes)} "
                           f"reserved ({100 * self.unused_share:.1f}% of it unused, the tails of last blocks)<br>"
                           f"static, 2(S-1) rows each for S = {self.max_tokens}: {_fmt_bytes(self.static_bytes)} "
                           f"({self.static_bytes / self.paged_bytes:.1f}x the paged reservation)")
        if self.plot:
            mb = 1e6                                                   # bytes per MB
            self._show(viz.plot_bars({"tokens": self.used_bytes / mb, f"paged ({bs})": self.paged_bytes / mb,
                                      "static": self.static_bytes / mb}, ylabel="KV cache (MB)",
                                     title=f"{len(self.lengths)} sequences, KV memory reserved"))


# --------------------------------------------------------------------------- lesson 09: ring attention

class RingExplorer(_Explorer):
    """Step through ring pass-KV: which blocks each rank attends to, and the work each rank has done so far.

    Kept as attributes: ``pairs`` (pairs each rank's kernel computes at this
    step) and ``total`` (each rank's pairs from step 0 through this one),
    from ``toyllm.simulate_ring.block_pairs``.
    """

    def __init__(self, context: int = 24, world_size: int = 3, step: int = 0, balance: str = "none",
                 kernel: str = "dense", plot: bool = True):
        super().__init__(plot)
        self.context = context
        self.world_size = W.IntSlider(world_size, min=2, max=6, description="ranks p", **_SLIDER)
        self.step = W.IntSlider(step, min=0, max=world_size - 1, description="ring step", **_SLIDER)
        self.balance = W.ToggleButtons(options=["none", "zigzag"], value=balance, description="layout")
        self.kernel = W.ToggleButtons(options=["dense", "causal"], value=kernel, description="kernel")
        self._observe(self.world_size, self.step, self.balance, self.kernel)
        self.widget = W.VBox([self.world_size, self.step, self.balance, self.kernel, self.text, self.out])
        self.update()

    def update(self) -> None:
        from .partition import even_partition, zigzag_chunks
        from .simulate_ring import block_pairs, token_runs

        p = self.world_size.value
        self.step.max = p - 1                      # clamps the step when the ring shrinks
        s, balance, kernel = self.step.value, self.balance.value, self.kernel.value
        chunks = zigzag_chunks(self.context, p) if balance == "zigzag" else even_partition(self.context, p)
        layout = token_runs(chunks, balance)
        done = [[block_pairs(layout[r], layout[(r - t) % p], kernel) for r in range(p)] for t in range(s + 1)]
        self.pairs = done[-1]
        self.total = [sum(col) for col in zip(*done)]
        skipped = [r for r in range(p) if not self.pairs[r]]
        self.text.value = (f"step {s}: rank r attends to the block that started on rank (r - {s}) mod {p}; pairs "
                           f"computed per rank at this step {self.pairs}"
                           + (f" (ranks {skipped} skip a block wholly in their future)" if skipped else "")
                           + f"<br>so far, per rank: {self.total}; the busiest rank has done "
                             f"{max(self.total) / max(1, min(self.total)):.2f}x the work of the idlest")
        if self.plot:
            self._show(viz.plot_ring_step(self.context, p, s, balance, kernel))
