"""A cost model and event simulator of one parallel prefill: single process, TSP, KV-Runahead or ring.

Why simulate? Searching for a good KV-Runahead partition needs hundreds of
TTFT measurements, and lessons want to ask "what if the link were 10 GB/s?"
or "what about 8 GPUs?" on a 2-core laptop. The simulator replays, layer by
layer and rank by rank, the same steps the real engine (``toyllm.parallel``)
takes, with each step's duration taken from a ``CostModel``:

- compute: ``qkv_s_per_token`` per token for the q, k, v projections,
  ``attn_s_per_dot`` per query-key pair for dense attention (QK^T, mask,
  softmax, times V, all heads), plus ``attn_unaligned_s_per_dot`` more per
  pair when the key count is not a multiple of ``key_alignment`` (QK^T's
  matrix product then leaves its fast path), ``mlp_s_per_token`` per token
  for o_proj and the MLP, plus ``layer_overhead_s`` per layer;
- network: a message of n bytes takes ``n / link_bandwidth_bytes_per_s +
  link_latency_s`` seconds, optionally slowed by random noise.

The coefficients come either from timing toyllm's own blocks on this machine
(``CostModel.calibrate``) or from assumed hardware numbers (``a100_like``).
Results of the simulator are always *simulated*: say so when you show them.

KV-Runahead on rank i (chunk c_i, prefix s_i), for each layer, as the engine does:
post the receive (i > 0), project its c_i tokens to q, k, v, wait for rank
i-1's K,V of tokens [0, s_i), concatenate, wait until its previous send is
done and start sending tokens [0, s_i + c_i) to rank i+1 (i < p-1), attend
with c_i queries over s_i + c_i keys, then o_proj and MLP. The first token
comes out of the last rank after its last layer (the LM head is ignored).
With ``overlap=False`` the receive blocks before the projections and the
send blocks the sender for the whole transfer.

TSP, every layer on every rank: project its chunk, all-gather K,V (everyone
waits for the slowest rank, then a ring of p-1 steps, each moving the
largest chunk), attend with c_i queries over all C keys, o_proj and MLP.

Ring attention (pass-KV, contiguous chunks or zigzag), every layer on every
rank: project its chunk, then p ring steps, each attending over the block in
hand while that block travels on to the next rank; ``toyllm.simulate_ring``.
Ring pass-Q (``ring_pass="q"``, ``cached=N``) continues N tokens whose keys
and values are already sharded over the ranks: the new tokens' queries go
round the ring instead, and each partial output returns to its owner.
Pass-KV continues them too (``cached=N``): each rank's block is its cached
shard followed by its new tokens, and the whole block travels.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from .answers import shortcut
from .checks import check_int
from .cost_fit import allgather_piece_bytes, fit_to_runs, least_squares, query_key_pairs
from .model import ModelConfig
from .partition import even_partition, prefixes, search_partition, ttft_lower_bound, validate_partition
from .simulate_ring import simulate_ring
from .timeline import Event

SIM_METHODS = ("single", "tsp", "kvr", "ring")

# A link-noise function returns the factor (>= 1) by which a transfer's
# bandwidth time is stretched: noise(src_rank, dst_rank, layer, step).
LinkNoise = Callable[[int, int, int, int], float]


# --------------------------------------------------------------------------- cost model

@dataclass(frozen=True)
class CostModel:
    """Seconds per unit of work for one rank, per layer, and the link between ranks.

    qkv_s_per_token: q, k, v projections (with the norm and RoPE), seconds per token per layer.
    mlp_s_per_token: everything after attention (o_proj, residuals, norm, MLP), seconds per token per layer.
    attn_s_per_dot: attention, seconds per query-key pair per layer (all heads together).
    attn_unaligned_s_per_dot: extra seconds per pair when a rank attends over a
    number of keys that is not a multiple of ``key_alignment`` tokens (8). The
    scores q k^T come from a matrix product whose output rows are that many
    floats long, and its CPU kernel is slower per pair when a row is not a
    whole number of 8-float vectors (the benchmark's search section measures
    by how much). 0 means the kernel does not care.
    attention_pairs: which pairs the kernel computes: "dense" (every pair of
    its rectangle, masked ones too: c_i (s_i + c_i) for KVR, c_i C for TSP) or
    "causal" (a kernel that skips masked work: only the c_i s_i + c_i (c_i + 1) / 2
    pairs a rank's queries can see, whatever the method).
    layer_overhead_s: fixed seconds per layer (kernel launches, Python).
    link_bandwidth_bytes_per_s, link_latency_s: the point-to-point link between ranks.
    bytes_per_value: size of one K or V number on the wire (4 for float32, 2 for fp16/bf16).
    label: where the numbers come from ("calibrated on ...", "assumed ...").
    allgather_bandwidth_bytes_per_s, allgather_latency_s: one ring step of
    TSP's all-gather, when it is not one message over the link (gloo's
    collective is slower than a point-to-point message: ``fit_runs`` measures
    it from the runs' own all-gather spans); None, None: one message.
    memory_bandwidth_bytes_per_s: bytes/s a rank reads from its memory, for
    lesson 03's roofline: each step (the projections, the attention, o_proj
    and the MLP) takes max(its compute, the bytes it reads / this), the bytes
    being ``qkv_weight_bytes`` and ``mlp_weight_bytes`` of a layer's weights
    and the keys and values the attention reads. None: compute alone (a model
    calibrated on real runs has the reads in its measured seconds already).
    """

    qkv_s_per_token: float
    mlp_s_per_token: float
    attn_s_per_dot: float
    layer_overhead_s: float = 0.0
    link_bandwidth_bytes_per_s: float = 3e9
    link_latency_s: float = 50e-6
    bytes_per_value: int = 4
    attention_pairs: str = "dense"
    label: str = ""
    attn_unaligned_s_per_dot: float = 0.0
    key_alignment: int = 8
    allgather_bandwidth_bytes_per_s: float | None = None
    allgather_latency_s: float | None = None
    memory_bandwidth_bytes_per_s: float | None = None
    qkv_weight_bytes: float = 0.0
    mlp_weight_bytes: float = 0.0

    def __post_init__(self):
        for name in ("qkv_s_per_token", "mlp_s_per_token", "attn_s_per_dot", "attn_unaligned_s_per_dot",
                     "layer_overhead_s", "link_latency_s"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"CostModel.{name} must be a non-negative number of seconds, got {v!r}")
        bw = self.link_bandwidth_bytes_per_s
        if not (isinstance(bw, (int, float)) and bw > 0):
            raise ValueError(f"CostModel.link_bandwidth_bytes_per_s must be positive (bytes/s), got {bw!r}")
        check_int(self.key_alignment, "CostModel.key_alignment must be a whole number of tokens >= 1", 1)
        if self.bytes_per_value <= 0:
            raise ValueError(f"CostModel.bytes_per_value must be positive, got {self.bytes_per_value!r}")
        ag_bw, ag_lat = self.allgather_bandwidth_bytes_per_s, self.allgather_latency_s
        if (ag_bw is None) != (ag_lat is None):
            raise ValueError("CostModel.allgather_bandwidth_bytes_per_s and allgather_latency_s go together: "
                             f"give both or neither, got {ag_bw!r} and {ag_lat!r}")
        if ag_bw is not None and not (isinstance(ag_bw, (int, float)) and ag_bw > 0 and math.isfinite(ag_bw)):
            raise ValueError(f"CostModel.allgather_bandwidth_bytes_per_s must be positive (bytes/s), got {ag_bw!r}")
        if ag_lat is not None and not (isinstance(ag_lat, (int, float)) and ag_lat >= 0 and math.isfinite(ag_lat)):
            raise ValueError(f"CostModel.allgather_latency_s must be a non-negative number of seconds, got {ag_lat!r}")
        mem = self.memory_bandwidth_bytes_per_s
        if mem is not None and not (isinstance(mem, (int, float)) and mem > 0 and math.isfinite(mem)):
            raise ValueError(f"CostModel.memory_bandwidth_bytes_per_s must be positive (bytes/s) or None, got {mem!r}")
        for name in ("qkv_weight_bytes", "mlp_weight_bytes"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"CostModel.{name} must be a non-negative number of bytes, got {v!r}")
        if self.attention_pairs not in ("dense", "causal"):
            raise ValueError(f"CostModel.attention_pairs must be 'dense' or 'causal', got {self.attention_pairs!r}")

    def pairs(self, queries: int, before: int, keys: int) -> int:
        """Query-key pairs a rank computes: ``queries`` tokens after ``before`` others, over ``keys`` keys."""
        return query_key_pairs(self.attention_pairs, queries, before, keys)

    def attention_s(self, queries: int, before: int, keys: int) -> float:
        """Seconds of one layer's attention on a rank: its pairs at ``attn_s_per_dot`` each, plus
        ``attn_unaligned_s_per_dot`` each when ``keys`` is not a multiple of ``key_alignment``."""
        per_pair = self.attn_s_per_dot
        if keys % self.key_alignment:
            per_pair += self.attn_unaligned_s_per_dot
        return per_pair * self.pairs(queries, before, keys)

    def step_s(self, compute_s: float, bytes_read: float) -> float:
        """Seconds of one step that computes for ``compute_s`` and reads ``bytes_read`` bytes: the larger of
        the two times (lesson 03's roofline), or the compute alone without a memory bandwidth."""
        if self.memory_bandwidth_bytes_per_s is None:
            return compute_s
        return max(compute_s, bytes_read / self.memory_bandwidth_bytes_per_s)

    def with_(self, **changes) -> "CostModel":
        """A copy with some fields changed, e.g. ``cm.with_(link_bandwidth_bytes_per_s=10e9)``."""
        return dataclasses.replace(self, **changes)

    def with_link(self, bandwidth_bytes_per_s: float, latency_s: float | None = None) -> "CostModel":
        """A what-if link between the processes: this bandwidth (bytes/s), and this latency (seconds) if
        given. Any all-gather cost measured on this machine is dropped: the new link carries TSP's
        all-gather too, so its ring steps cost what the link's messages cost (``allgather_step_s``)."""
        changes = {"link_bandwidth_bytes_per_s": bandwidth_bytes_per_s,
                   "allgather_bandwidth_bytes_per_s": None, "allgather_latency_s": None}
        if latency_s is not None:
            changes["link_latency_s"] = latency_s
        return self.with_(**changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "CostModel":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown CostModel fields {sorted(unknown)}; known: {sorted(known)}")
        return cls(**d)

    def transfer_s(self, n_bytes: float, slowdown: float = 1.0) -> float:
        """Seconds to move ``n_bytes`` over one link, ``slowdown`` >= 1 stretching the bandwidth term."""
        return n_bytes / self.link_bandwidth_bytes_per_s * slowdown + self.link_latency_s

    def allgather_step_s(self, n_bytes: float, slowdown: float = 1.0) -> float:
        """Seconds of one ring step of TSP's all-gather moving ``n_bytes`` per rank."""
        if self.allgather_bandwidth_bytes_per_s is None:
            return self.transfer_s(n_bytes, slowdown)
        return n_bytes / self.allgather_bandwidth_bytes_per_s * slowdown + self.allgather_latency_s

    @classmethod
    @shortcut("6.4",
              ships="times a Block and fits the simulator's own features with numpy (toyllm.cost_fit), not Exercise "
                    "6.4's three-term fit")
    def calibrate(cls, cfg: ModelConfig, contexts: Sequence[int] = (256, 512, 1024), threads: int = 1,
                  repeats: int = 3, attention="dense", link_bandwidth_bytes_per_s: float = 3e9,
                  link_latency_s: float = 50e-6, seed: int = 0) -> "CostModel":
        """Fit the compute coefficients by timing one ``Block`` of ``cfg`` on this machine.

        For each T in ``contexts``: ``Block.qkv`` and ``Block.finish`` on T
        tokens; ``Block.attend`` with T/4, T/2 and T queries over T keys.
        Medians of ``repeats`` runs after a warm-up, with ``threads`` intra-op
        threads (1 = what each of p=2 ranks gets on a 2-core machine). Then
        least squares (numpy): qkv(T) = a T + b, finish(T) = m T + d,
        attend(T, S) = alpha T S + beta T + g, giving qkv_s_per_token = a,
        mlp_s_per_token = beta + m (o_proj lives in attend), attn_s_per_dot =
        alpha, layer_overhead_s = b + d + g (negative fits are clipped to 0).

        The link is not measured here: pass what ``toyllm.parallel.measure_link``
        measured. The defaults, 3 GB/s and 50 us, are an assumption, not a
        measurement of this machine's link (gloo over TCP loopback has been
        measured anywhere from about 0.6 to 4.5 GB/s on small shared VMs,
        depending on message size and load).
        """
        import torch

        from .utils import median_time
        from .model import Block, get_attention, rope_tables

        sizes = sorted({int(T) for T in contexts})
        if len(sizes) < 2 or sizes[0] < 4:
            raise ValueError(f"calibrate needs at least two context sizes of 4 or more tokens, got {contexts}")
        if threads < 1 or repeats < 1:
            raise ValueError(f"threads and repeats must be at least 1, got threads={threads}, repeats={repeats}")
        attend_fn = get_attention(attention)
        # A kernel that skips masked work costs what its queries can see, not its whole rectangle.
        mode = "causal" if getattr(attend_fn, "skips_masked", False) else "dense"
        old_threads = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            torch.manual_seed(seed)
            block = Block(cfg).eval()
            cos, sin = rope_tables(cfg.head_dim, sizes[-1], cfg.rope_base)
            qkv_rows, qkv_t, fin_rows, fin_t, att_rows, att_t = [], [], [], [], [], []
            with torch.no_grad():
                for T in sizes:
                    x = torch.randn(1, T, cfg.d_model)                                  # (1, T, d_model)
                    qkv_t.append(median_time(lambda: block.qkv(x, cos[:T], sin[:T]), repeats)[0])
                    qkv_rows.append([T, 1.0])
                    fin_t.append(median_time(lambda: block.finish(x, x), repeats)[0])
                    fin_rows.append([T, 1.0])
                    S = T
                    k = torch.randn(1, cfg.n_kv_heads, S, cfg.head_dim)                 # (1, Hkv, S, D)
                    v = torch.randn(1, cfg.n_kv_heads, S, cfg.head_dim)
                    k_pos = torch.arange(S)
                    for Tq in sorted({max(1, S // 4), max(1, S // 2), S}):
                        q = torch.randn(1, cfg.n_heads, Tq, cfg.head_dim)               # (1, H, Tq, D)
                        q_pos = torch.arange(S - Tq, S)
                        att_t.append(median_time(lambda: block.attend(q, k, v, q_pos, k_pos, attend_fn),
                                                 repeats)[0])
                        pairs = Tq * (S - Tq) + Tq * (Tq + 1) // 2 if mode == "causal" else Tq * S
                        att_rows.append([pairs, Tq, 1.0])
        finally:
            torch.set_num_threads(old_threads)

        a, b = least_squares(qkv_rows, qkv_t)
        m, d = least_squares(fin_rows, fin_t)
        alpha, beta, g = least_squares(att_rows, att_t)
        name = attention if isinstance(attention, str) else getattr(attention, "__name__", "custom")
        return cls(qkv_s_per_token=a, mlp_s_per_token=beta + m, attn_s_per_dot=alpha,
                   layer_overhead_s=b + d + g, link_bandwidth_bytes_per_s=link_bandwidth_bytes_per_s,
                   link_latency_s=link_latency_s, bytes_per_value=4, attention_pairs=mode,
                   label=f"calibrated on this machine: {threads} thread(s), {name} attention, "
                         f"contexts {sizes}")


    @classmethod
    def fit_runs(cls, cfg: ModelConfig, runs, *, link_bandwidth_bytes_per_s: float, link_latency_s: float,
                 label: str = "", key_alignment: int = 8) -> "CostModel":
        """Fit the compute coefficients to the timelines of real parallel prefills (``PrefillResult`` s).

        ``calibrate`` times one Block alone in this process, with the other
        core idle; in a real run every rank computes at once, sharing the
        memory bandwidth and the caches, and a long context's tensors are
        larger than any calibrated one. Here the compute spans of real runs
        are the samples (``toyllm.cost_fit.fit_to_runs`` says how): seconds
        per token for the projections and for the MLP, seconds per query-key
        pair for attention (and more per pair when the dense kernel attends
        over a key count that is not a multiple of ``key_alignment``), no
        fixed cost per layer; TSP runs of two or more piece sizes also give
        TSP's all-gather its own bandwidth and latency per ring step.
        Runs must be "tsp" (not zigzag or trimmed) or "kvr", all with one
        attention kernel; the link is not in the spans, so pass it
        (``toyllm.parallel.measure_link``).
        """
        runs = list(runs)
        fitted = fit_to_runs(cfg, runs, key_alignment)
        contexts = sorted({sum(r.partition) for r in runs})
        return cls(**fitted, layer_overhead_s=0.0, key_alignment=key_alignment,
                   link_bandwidth_bytes_per_s=link_bandwidth_bytes_per_s, link_latency_s=link_latency_s,
                   bytes_per_value=4, label=label or f"fitted to {len(runs)} real runs' timelines, contexts {contexts}")


def a100_like(cfg: ModelConfig, mfu: float = 0.5, link_bandwidth_bytes_per_s: float = 300e9,
              link_latency_s: float = 10e-6, layer_overhead_s: float = 50e-6,
              memory_bandwidth_bytes_per_s: float = 2e12) -> CostModel:
    """Assumed costs of ``cfg`` on an A100-class GPU in fp16, in the spirit of the paper's setup.

    Compute: FLOPs at 312 TFLOP/s times ``mfu`` (the fraction of peak a real
    kernel reaches; 0.5 assumed). q, k, v projections 2 * d_model * head_dim
    * (H + 2 Hkv) FLOPs per token; o_proj and SwiGLU MLP 2 * d_model *
    (H * head_dim + 3 * ffn) per token; attention 4 * H * head_dim FLOPs per
    query-key pair (QK^T and times V; softmax ignored). Memory: 2 TB/s of
    HBM (an A100 80GB reads about 2.0); each step takes at least the time to
    read its fp16 weights and the keys and values it attends over (a rank
    reads every weight whatever its share of the tokens). Link: 300 GB/s
    (NVLink-like, the paper's "high bandwidth"); try 10e9 or 1e9 for its
    slow setups. None of this is measured: label results as simulated.
    """
    if not 0 < mfu <= 1:
        raise ValueError(f"mfu must be in (0, 1], got {mfu}")
    flops = 312e12 * mfu
    qkv = cfg.qkv_params_per_layer
    return CostModel(qkv_s_per_token=2 * qkv / flops,
                     mlp_s_per_token=2 * (cfg.matmul_params_per_layer - qkv) / flops,   # o_proj and the MLP
                     attn_s_per_dot=4 * cfg.n_heads * cfg.head_dim / flops,
                     layer_overhead_s=layer_overhead_s,
                     link_bandwidth_bytes_per_s=link_bandwidth_bytes_per_s,
                     link_latency_s=link_latency_s, bytes_per_value=2,
                     memory_bandwidth_bytes_per_s=memory_bandwidth_bytes_per_s, qkv_weight_bytes=2 * qkv,
                     mlp_weight_bytes=2 * (cfg.matmul_params_per_layer - qkv),
                     label=f"assumed A100-like: 312 TFLOP/s fp16 at {mfu:.0%} of peak, "
                           f"{memory_bandwidth_bytes_per_s / 1e12:g} TB/s memory, "
                           f"{link_bandwidth_bytes_per_s / 1e9:g} GB/s link")


def random_link_noise(sigma: float, seed: int = 0) -> LinkNoise:
    """A noisy link: each transfer's bandwidth time is stretched by exp(|N(0, sigma)|) >= 1.

    The factor depends only on (seed, src, dst, layer, step), so the same
    partition always sees the same noise and searches stay deterministic.
    A stand-in for other traffic sharing the links, not a model of a real network.
    """
    if sigma < 0:
        raise ValueError(f"sigma must be non-negative, got {sigma}")

    def noise(src: int, dst: int, layer: int, step: int = 0) -> float:
        rng = np.random.default_rng([seed, src, dst, layer, step])
        return float(np.exp(abs(rng.normal(0.0, sigma))))

    return noise


# --------------------------------------------------------------------------- the simulator

@dataclass
class SimResult:
    """One simulated prefill. Times in seconds from the common start.

    ttft_s: when the last rank (rank 0 for ring's zigzag: the rank holding the
    last prompt token) finishes its last layer: the first token comes from
    that rank, so this is the TTFT, as in a real run
    (``PrefillResult.ttft_s``), even when an earlier rank is still computing.
    per_rank_finish_s: when each rank finishes its own compute.
    slowest_rank_s: the latest of those (not the TTFT; kept for comparison).
    events: per-rank intervals (compute, recv_wait, send, send_wait, allgather),
    the same ``Event`` objects a real run records, so one plot draws both.
    """

    ttft_s: float
    per_rank_finish_s: list[float]
    events: list[Event] = field(default_factory=list)
    method: str = ""
    chunks: list[int] = field(default_factory=list)

    @property
    def slowest_rank_s(self) -> float:
        return max(self.per_rank_finish_s)

    def to_dict(self) -> dict:
        return {"ttft_s": self.ttft_s, "slowest_rank_s": self.slowest_rank_s,
                "per_rank_finish_s": self.per_rank_finish_s, "method": self.method,
                "chunks": self.chunks, "simulated": True, "events": [e.to_dict() for e in self.events]}


class _Rank:
    """One rank's clock and (if ``events`` is a list) its recorded intervals during a simulation.

    Labels are passed as functions so that searches, which only need the
    time, skip formatting thousands of strings.
    """

    def __init__(self, rank: int, events: list[Event] | None):
        self.rank, self.t, self.events = rank, 0.0, events

    def busy(self, kind: str, seconds: float, layer: int, label: Callable[[], str]) -> None:
        if seconds > 0:
            if self.events is not None:
                self.events.append(Event(self.rank, kind, self.t, self.t + seconds, layer, label()))
            self.t += seconds

    def wait_until(self, kind: str, when: float, layer: int, label: Callable[[], str]) -> None:
        if when > self.t:
            self.busy(kind, when - self.t, layer, label)


def _noise_fn(link_noise) -> LinkNoise:
    if link_noise is None:
        return lambda src, dst, layer, step=0: 1.0
    if isinstance(link_noise, (int, float)):
        return random_link_noise(float(link_noise))
    if callable(link_noise):
        return link_noise
    raise ValueError(f"link_noise must be None, a sigma (float) or a function (src, dst, layer, step) -> factor, "
                     f"got {link_noise!r}")


@shortcut("7.3",
          ships="dispatches to the timelines lessons 06 and 07 draw; Exercise 7.3 asks for the TTFT alone")
def simulate_prefill(cfg: ModelConfig, chunks: Sequence[int], method: str, cost_model: CostModel,
                     overlap: bool = True, link_noise: float | LinkNoise | None = None,
                     record_events: bool = True, balance: str = "none", ring_pass: str = "kv",
                     cached: int = 0) -> SimResult:
    """Simulate one prefill of sum(chunks) tokens on len(chunks) ranks; see the module docstring.

    method: "single" (one rank, chunks=[C]), "tsp", "kvr" or "ring" (pass-KV,
    contiguous chunks). With one chunk, each is the single-process run.
    overlap: KVR only; False makes receive and send blocking.
    link_noise: None, a sigma for ``random_link_noise`` (seed 0), or a
    function (src, dst, layer, step) -> slowdown factor >= 1.
    record_events: False skips building the timeline (several times faster,
    for searches that only need ``ttft_s``).
    balance: ring only: "none" or "zigzag" (chunks as the engine's zigzag
    layout gives them, ``toyllm.simulate_ring.zigzag_chunks``; rank 0 gives the first token).
    ring_pass, cached: ring only, as the engine's ``prefill --method ring
    [--pass q] [--cached N]``: "kv" (keys and values travel: of a whole
    prompt with cached=0, or each rank's cached shard and new tokens) or "q"
    (the queries of the sum(chunks) new tokens travel). ``cached`` tokens are
    already sharded over the ranks, at least one per piece of the balance
    (pass-Q always continues some); chunks then share out the new tokens.
    """
    if method not in SIM_METHODS:
        raise ValueError(f"unknown method {method!r}; choose one of {list(SIM_METHODS)}")
    if not isinstance(cost_model, CostModel):
        raise ValueError(f"cost_model must be a CostModel, got {type(cost_model).__name__}")
    chunks = validate_partition(chunks)
    if balance not in ("none", "zigzag") or (balance == "zigzag" and method != "ring"):
        raise ValueError(f"balance={balance!r}: the simulator balances only ring, with 'none' or 'zigzag'")
    if method == "single" and len(chunks) != 1:
        raise ValueError(f"method 'single' runs on one process: chunks must be [C], got {chunks}")
    if method != "ring" and (cached or ring_pass != "kv"):
        raise ValueError(f"ring_pass and cached choose how ring attention runs; method {method!r} takes neither "
                         "(give method='ring')")
    noise = _noise_fn(link_noise)
    events: list[Event] | None = [] if record_events else None
    if method == "tsp" and len(chunks) > 1:
        finish = _simulate_tsp(cfg, chunks, cost_model, noise, events)
    elif method == "ring":
        finish = simulate_ring(cfg, chunks, cost_model, noise, [_Rank(i, events) for i in range(len(chunks))],
                               balance, ring_pass, cached)
    else:
        finish = _simulate_kvr(cfg, chunks, cost_model, overlap, noise, events)
    if events is not None:
        events.sort(key=lambda e: (e.start_s, e.rank))
    return SimResult(finish[0 if balance == "zigzag" else -1], finish, events or [], method, list(chunks))


# the KV-Runahead timing itself: off limits to Exercise 7.3 like simulate_prefill
@shortcut("7.3",
          ships="the event-recording, roofline-charged timeline lessons 06 and 07 draw; Exercise 7.3's text states "
                "its steps and asks for the TTFT alone")
def _simulate_kvr(cfg, chunks, cm: CostModel, overlap: bool, noise: LinkNoise, events) -> list[float]:
    p, L = len(chunks), cfg.n_layers
    row_bytes = cfg.n_kv_heads * cfg.head_dim * cm.bytes_per_value     # one token's K (or V) in one layer
    arrival = [[0.0] * L for _ in range(p)]       # when rank i's layer-l message is fully at rank i+1
    finish = []
    # Rank i depends only on rank i-1, so ranks can be simulated one after the other.
    for i, (c, s) in enumerate(zip(chunks, prefixes(chunks))):
        r = _Rank(i, events)
        send_done = 0.0                           # when this rank's previous send completes
        n_bytes = 2 * (s + c) * row_bytes         # K and V of tokens [0, s + c)
        recv_label = lambda: f"K,V [0, {s}) from rank {i - 1}"
        send_label = lambda: f"K,V [0, {s + c}) to rank {i + 1}, {n_bytes / 1e6:.3g} MB"
        for layer in range(L):
            if i > 0 and not overlap:
                r.wait_until("recv_wait", arrival[i - 1][layer], layer, recv_label)
            r.busy("compute", cm.layer_overhead_s + cm.step_s(cm.qkv_s_per_token * c, cm.qkv_weight_bytes), layer,
                   lambda: f"qkv of {c} tokens")
            if i > 0 and overlap:
                r.wait_until("recv_wait", arrival[i - 1][layer], layer, recv_label)
            if i < p - 1:
                seconds = cm.transfer_s(n_bytes, noise(i, i + 1, layer, 0))
                if overlap:
                    r.wait_until("send_wait", send_done, layer, lambda: "previous send still in flight")
                    if events is not None:
                        events.append(Event(i, "send", r.t, r.t + seconds, layer, send_label()))
                    send_done = arrival[i][layer] = r.t + seconds
                else:
                    r.busy("send", seconds, layer, send_label)
                    arrival[i][layer] = r.t
            r.busy("compute", cm.step_s(cm.attention_s(c, s, s + c), 2 * (s + c) * row_bytes), layer,
                   lambda: f"attention {c} x {s + c}")
            r.busy("compute", cm.step_s(cm.mlp_s_per_token * c, cm.mlp_weight_bytes), layer,
                   lambda: f"o_proj + MLP of {c} tokens")
        finish.append(r.t)
    return finish


def _simulate_tsp(cfg, chunks, cm: CostModel, noise: LinkNoise, events) -> list[float]:
    p, L, C = len(chunks), cfg.n_layers, sum(chunks)
    ranks = [_Rank(i, events) for i in range(p)]
    piece_bytes = allgather_piece_bytes(cfg, chunks, cm.bytes_per_value)
    kv_bytes = 2 * C * cfg.n_kv_heads * cfg.head_dim * cm.bytes_per_value    # the keys and values attended over
    before = prefixes(chunks)
    for layer in range(L):
        for r, c in zip(ranks, chunks):
            r.busy("compute", cm.layer_overhead_s + cm.step_s(cm.qkv_s_per_token * c, cm.qkv_weight_bytes), layer,
                   lambda: f"qkv of {c} tokens")
        # Everyone waits for the slowest rank; then p-1 ring steps, each as slow as its slowest link.
        start = max(r.t for r in ranks)
        ring = sum(max(cm.allgather_step_s(piece_bytes, noise(j, (j + 1) % p, layer, step)) for j in range(p))
                   for step in range(p - 1))
        for r in ranks:
            r.wait_until("allgather", start + ring, layer, lambda: f"all-gather K,V of {C} tokens")
        for r, c, s in zip(ranks, chunks, before):
            r.busy("compute", cm.step_s(cm.attention_s(c, s, C), kv_bytes), layer, lambda: f"attention {c} x {C}")
            r.busy("compute", cm.step_s(cm.mlp_s_per_token * c, cm.mlp_weight_bytes), layer,
                   lambda: f"o_proj + MLP of {c} tokens")
    return [r.t for r in ranks]


# --------------------------------------------------------------------------- glue for searches and lessons

@shortcut("7.3",
          ships="wraps simulate_prefill as a search's cost function")
def ttft_cost(cfg: ModelConfig, cost_model: CostModel, method: str = "kvr", overlap: bool = True,
              link_noise: float | LinkNoise | None = None) -> Callable[[list[int]], float]:
    """``cost(chunks) -> simulated TTFT in seconds``, ready for the searches in ``toyllm.partition``.

    TTFT: when the last rank has the first token (``SimResult.ttft_s``), the
    same definition as ``toyllm.parallel.measured_cost`` on real runs, so a
    search against the simulator and one against measurements optimise the same thing.
    """
    def cost(chunks: list[int]) -> float:
        return simulate_prefill(cfg, chunks, method, cost_model, overlap, link_noise, record_events=False).ttft_s

    return cost


@shortcut("7.3",
          ships="runs the simulator and the searches for every method")
def compare_methods(cfg: ModelConfig, context: int, world_size: int, cost_model: CostModel,
                    min_stride: int | None = None, span: int | None = None,
                    link_noise: float | LinkNoise | None = None) -> dict:
    """Simulated TTFT (seconds) of every method for one context and process count.

    Keys: single, tsp, ring (pass-KV, even split), kvr_even (KVR-E), kvr_searched (KVR-S, the best
    partition the search finds in the simulator), kvr_searched_chunks,
    search_evaluations, lower_bound (the paper's TTFT*(p) from the
    single-process time), and simulated=True.
    min_stride: the search's finest step in tokens (default C/256).
    span: grid half-width of the hierarchical search (default 2 up to 4
    processes, else 1: 5^7 = 78,125 points per level for 8 processes would
    take minutes even in the simulator, 3^7 = 2,187 take seconds).
    """
    even = even_partition(context, world_size)
    cost = ttft_cost(cfg, cost_model, "kvr", link_noise=link_noise)
    found = search_partition(cost, context, world_size, min_stride=min_stride, span=span)
    single = simulate_prefill(cfg, [context], "single", cost_model, record_events=False).ttft_s
    tsp = simulate_prefill(cfg, even, "tsp", cost_model, link_noise=link_noise, record_events=False).ttft_s
    ring = simulate_prefill(cfg, even, "ring", cost_model, link_noise=link_noise, record_events=False).ttft_s
    return {"context": context, "world_size": world_size, "single": single, "tsp": tsp, "ring": ring,
            "kvr_even": cost(even), "kvr_searched": found.cost_s, "kvr_searched_chunks": found.partition,
            "search_evaluations": found.evaluations,
            "lower_bound": ttft_lower_bound(single, world_size), "simulated": True}
