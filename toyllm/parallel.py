"""Parallel prefill across processes: TSP and KV-Runahead (KVR).

The prompt of C tokens is cut into chunks c_0..c_{p-1}, one per rank; rank i
owns tokens [s_i, s_i + c_i) with s_i = c_0 + ... + c_{i-1}. Every rank runs
all layers on its own tokens, using the single-device model's three steps
(``Block.qkv``, ``Block.attend``, ``Block.finish``). The methods differ only
in how a rank gets the keys and values of the tokens before its chunk:

- **TSP** (tensor/sequence parallel): after computing its K,V, every rank
  all-gathers everyone's K,V, so every rank holds the whole context's K,V,
  and attends its c_i queries over all C keys, masking the future.
  Dot products per rank: c_i * C. Every rank must wait for the slowest.
- **KVR** (KV-Runahead): rank i receives the K,V of tokens [0, s_i) from
  rank i-1, appends its own, attends over those s_i + c_i keys, and sends
  the grown cache on to rank i+1. Dot products: c_i * (s_i + c_i); only
  point-to-point messages; the last rank ends up holding the KV cache of the
  whole context and produces the first token, then keeps decoding.

With ``overlap=True`` KVR posts the receive before the q/k/v projection and
waits for it only when it needs the prefix; it sends with ``isend`` right
after concatenating and only waits for that send before the next layer's.

A simulated link (``LinkModel``) can slow every transfer down to a chosen
bandwidth, to act out 10 GB/s or 1 GB/s networks on one machine. It is
applied on the receiving side: a message sent at time t is not handed over
before t + bytes / bandwidth + latency (+ noise). Clocks are compared across
processes, so the link model is for single-machine runs only.
"""
from __future__ import annotations

import functools
import random
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

from .cache import DynamicKVCache
from .generation import decode_step
from .launch import RankContext, WorkerPool, init_from_env, run_parallel, to_cpu
from .model import get_config
from .timeline import Timeline
from .utils import random_prompt

METHODS = ("single", "tsp", "kvr")


# --------------------------------------------------------------------------- what to run

@dataclass(frozen=True)
class ModelSpec:
    """How each worker builds its copy of the model (models are rebuilt, not pickled)."""

    name: str = "tiny"
    seed: int = 0
    attention: str = "dense"
    overrides: tuple = ()        # ModelConfig fields to change, as (name, value) pairs

    def build(self):
        return _build_model(self)


@functools.lru_cache(maxsize=4)
def _build_model(spec: ModelSpec):
    # Cached per process, so a pool worker builds a model once across many tasks.
    from .model import build_model
    from .weights import load_model

    if spec.overrides:
        return build_model(get_config(spec.name).with_(**dict(spec.overrides)), spec.seed, spec.attention)
    return load_model(spec.name, attention=spec.attention, seed=spec.seed)[0]


@dataclass(frozen=True)
class LinkModel:
    """A simulated network link: transfer time = bytes / bandwidth + latency, times a noise factor.

    bandwidth_gbps: gigabytes per second (1e9 bytes/s). latency_s: seconds per
    message. noisy_link: (src, dst) ranks whose link gets noise; noise: the
    standard deviation of the relative slow-down (0.5 = typically 50 percent
    slower); noise is never negative.
    """

    bandwidth_gbps: float
    latency_s: float = 0.0
    noisy_link: tuple[int, int] | None = None
    noise: float = 0.0
    seed: int = 0

    def __post_init__(self):
        if not self.bandwidth_gbps > 0:
            raise ValueError(f"bandwidth must be > 0 GB/s, got {self.bandwidth_gbps}")
        if self.latency_s < 0 or self.noise < 0:
            raise ValueError("latency_s and noise must be >= 0")

    def transfer_s(self, nbytes: int, src: int, dst: int, rng: random.Random) -> float:
        t = nbytes / (self.bandwidth_gbps * 1e9) + self.latency_s
        if self.noise and self.noisy_link in ((src, dst), (dst, src)):
            t *= 1.0 + abs(rng.gauss(0.0, self.noise))
        return t


@dataclass
class PrefillResult:
    method: str
    world_size: int
    context: int
    partition: list[int]
    threads_per_rank: int
    ttft_s: float                          # median over the timed runs (seconds)
    ttft_runs: list[float]
    first_token: int
    logits: torch.Tensor = field(repr=False)            # (vocab,) float32 at the last prompt position
    timeline: list[dict] = field(default_factory=list, repr=False)   # events of the last run, all ranks
    kv_cache: list | None = field(default=None, repr=False)          # per layer (k, v), (1, Hkv, C, D)
    decoded: list[int] | None = None       # tokens generated after the prefill (on the last rank)
    overlap: bool = True
    link: dict | None = None
    max_abs_logit_diff: float | None = None

    def to_json(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k not in ("logits", "kv_cache")}


# --------------------------------------------------------------------------- validation (before any process starts)

def check_prefill_args(context: int, method: str, world_size: int, partition=None) -> list[int]:
    """Validate a request; return the partition (chunk sizes, tokens per rank) to use."""
    from .partition import even_partition, validate_partition

    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose one of {list(METHODS)}")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world size must be an integer >= 1, got {world_size!r}")
    if context < 1:
        raise ValueError(f"context must be at least 1 token, got {context}")
    if method == "single" and world_size != 1:
        raise ValueError(f"method 'single' runs one process; got world size {world_size}")
    if world_size > context:
        raise ValueError(f"world size {world_size} > context {context}: every rank needs at least one token")
    if partition is None:
        return even_partition(context, world_size)
    return validate_partition(list(partition), context=context, world_size=world_size)


# --------------------------------------------------------------------------- one rank's work

def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _tsp_layers(model, x, q_pos, cos, sin, chunks, tl, link, rng):
    """TSP: every layer all-gathers K and V; returns x and this rank's full-context cache."""
    cache = []
    cmax = max(chunks)
    for i, layer in enumerate(model.layers):
        with tl.span("compute", i, "qkv"):
            q, k, v = layer.qkv(x, cos, sin)                               # (B, Hkv, c_i, D)
            kv = torch.stack([k, v])                                       # (2, B, Hkv, c_i, D)
            if kv.shape[-2] < cmax:   # all_gather needs equal sizes: pad, trim afterwards
                kv = torch.cat([kv, kv.new_zeros(*kv.shape[:-2], cmax - kv.shape[-2], kv.shape[-1])], -2)
        t0 = tl.now()
        if link is not None:   # everyone learns when the last rank arrived
            stamps = [torch.zeros(1, dtype=torch.float64) for _ in chunks]
            dist.all_gather(stamps, torch.tensor([time.perf_counter()], dtype=torch.float64))
        parts = [torch.empty_like(kv) for _ in chunks]
        dist.all_gather(parts, kv.contiguous())
        tl.add("allgather", t0, tl.now(), i)
        if link is not None:   # ring all-gather: p-1 steps of one chunk each
            step = max(link.transfer_s(_nbytes(kv), r, (r + 1) % len(chunks), rng)
                       for r in range(len(chunks)))
            _sleep_until(max(s.item() for s in stamps) + (len(chunks) - 1) * step, tl, i)
        with tl.span("compute", i, "attention+mlp"):
            full = torch.cat([p[..., :c, :] for p, c in zip(parts, chunks)], dim=-2)   # (2, B, Hkv, C, D)
            k_pos = torch.arange(sum(chunks))
            x = layer.finish(x, layer.attend(q, full[0], full[1], q_pos, k_pos, model.attention))
        cache.append((full[0], full[1]))
    return x, cache


def _kvr_layers(ctx, model, x, q_pos, cos, sin, chunks, tl, link, rng, overlap):
    """KV-Runahead: receive the prefix cache from rank-1, extend it, pass it on to rank+1."""
    rank, last = ctx.rank, len(chunks) - 1
    s = sum(chunks[:rank])                                  # tokens before this rank's chunk
    cfg = model.config
    prefix_shape = (2, x.shape[0], cfg.n_kv_heads, s, cfg.head_dim)
    stamp_in = torch.zeros(1, dtype=torch.float64)
    send_reqs: list = []
    cache = []
    for i, layer in enumerate(model.layers):
        recv_reqs = []
        if rank > 0 and overlap:   # post the receive first: the prefix can arrive while we project
            prefix = torch.empty(prefix_shape, dtype=x.dtype)
            recv_reqs = [dist.irecv(stamp_in, rank - 1), dist.irecv(prefix, rank - 1)]
        elif rank > 0:
            prefix = torch.empty(prefix_shape, dtype=x.dtype)
            t0 = tl.now()
            dist.recv(stamp_in, rank - 1)
            dist.recv(prefix, rank - 1)
            tl.add("recv_wait", t0, tl.now(), i)
        with tl.span("compute", i, "qkv"):
            q, k, v = layer.qkv(x, cos, sin)                               # (B, Hkv, c_i, D)
        if recv_reqs:
            t0 = tl.now()
            for r in recv_reqs:
                r.wait()
            tl.add("recv_wait", t0, tl.now(), i)
        if rank > 0 and link is not None:
            _sleep_until(stamp_in.item() + link.transfer_s(_nbytes(prefix), rank - 1, rank, rng), tl, i)
        with tl.span("compute", i, "concat"):
            kv = torch.stack([k, v]) if rank == 0 else torch.cat([prefix, torch.stack([k, v])], dim=-2)
        if rank < last:
            t0 = tl.now()
            for r in send_reqs:    # the previous layer's send must be done before we queue another
                r.wait()
            stamp_out = torch.tensor([time.perf_counter()], dtype=torch.float64)
            kv = kv.contiguous()
            if overlap:
                send_reqs = [dist.isend(stamp_out, rank + 1), dist.isend(kv, rank + 1)]
                tl.add("send_wait" if i else "send", t0, tl.now(), i)
            else:
                dist.send(stamp_out, rank + 1)
                dist.send(kv, rank + 1)
                if link is not None:   # a blocking send holds the sender for the whole transfer
                    time.sleep(link.transfer_s(_nbytes(kv), rank, rank + 1, rng))
                tl.add("send", t0, tl.now(), i)
        with tl.span("compute", i, "attention+mlp"):
            k_pos = torch.arange(s + chunks[rank])
            x = layer.finish(x, layer.attend(q, kv[0], kv[1], q_pos, k_pos, model.attention))
        cache.append((kv[0], kv[1]))
    if send_reqs:
        t0 = tl.now()
        for r in send_reqs:
            r.wait()
        tl.add("send_wait", t0, tl.now(), None)
    return x, cache


def _sleep_until(t_perf: float, tl: Timeline, layer: int) -> None:
    """Simulated link: hold the data until the modelled arrival time (a perf_counter value)."""
    t0 = tl.now()
    delay = t_perf - time.perf_counter()
    if delay > 0:
        time.sleep(delay)
        tl.add("link_delay", t0, tl.now(), layer)


@torch.no_grad()
def prefill_rank(ctx: RankContext, spec: ModelSpec, ids: list[int], method: str, chunks: list[int],
                 overlap: bool = True, link: LinkModel | None = None, repeat: int = 1, warmup: int = 1,
                 return_cache: bool = False, decode_tokens: int = 0) -> dict:
    """The worker function: one rank's part of a parallel prefill, run ``warmup + repeat`` times.

    Returns this rank's seconds per run and timeline; the last rank also
    returns the first-token logits (and optionally its KV cache and the
    tokens it decodes afterwards).
    """
    model = spec.build()
    rank, p = ctx.rank, ctx.world_size
    if len(chunks) != p:
        raise ValueError(f"partition has {len(chunks)} chunks for world size {p}")
    start = sum(chunks[:rank])
    ids_t = torch.tensor([ids[start:start + chunks[rank]]])
    q_pos = model.positions(start, chunks[rank])
    cos, sin = model.rope_cos[q_pos], model.rope_sin[q_pos]
    runs, tl = [], Timeline(rank)
    for run in range(warmup + repeat):
        rng = random.Random(hash((link.seed if link else 0, run)))   # same draws on every rank
        dist.barrier()
        tl.reset()
        with tl.span("compute", None, "embed"):
            x = model.embed(ids_t)
        if method == "tsp":
            x, cache = _tsp_layers(model, x, q_pos, cos, sin, chunks, tl, link, rng)
        else:
            x, cache = _kvr_layers(ctx, model, x, q_pos, cos, sin, chunks, tl, link, rng, overlap)
        logits = None
        if rank == p - 1:
            with tl.span("compute", None, "lm_head"):
                logits = model.head(x[:, -1:])[0, -1]
        if run >= warmup:
            runs.append(tl.now())
    out = {"rank": rank, "runs_s": runs, "events": tl.to_dicts()}
    if rank == p - 1:
        out["logits"] = logits
        if return_cache:
            out["kv_cache"] = [(k.clone(), v.clone()) for k, v in cache]
        if decode_tokens:
            out["decoded"] = _continue_decoding(model, cache, int(logits.argmax()), decode_tokens)
    return out


def _continue_decoding(model, cache_layers, first_token: int, n: int) -> list[int]:
    """Greedy decoding on the last rank from the KV cache its prefill produced."""
    cache = DynamicKVCache(model.config.n_layers)
    for i, (k, v) in enumerate(cache_layers):
        cache.update(i, k, v)
    tokens = [first_token]
    for _ in range(n - 1):
        tokens.append(int(decode_step(model, tokens[-1], cache).argmax()))
    return tokens


# --------------------------------------------------------------------------- the public entry points

@torch.no_grad()
def single_prefill(model, ids: list[int]):
    """The one-process reference: (last-position logits (vocab,), per-layer (k, v) cache)."""
    cache = DynamicKVCache(model.config.n_layers)
    logits = model(torch.tensor([ids]), input_pos=0, cache=cache)[0, -1]
    return logits, [(cache.keys(i), cache.values(i)) for i in range(model.config.n_layers)]


def parallel_prefill(spec: ModelSpec | str, ids: list[int], method: str = "kvr", world_size: int = 2,
                     partition: list[int] | None = None, *, overlap: bool = True, link: LinkModel | None = None,
                     repeat: int = 1, warmup: int = 1, threads_per_rank: int = 1, backend: str = "auto",
                     return_cache: bool = False, decode_tokens: int = 0, pool: WorkerPool | None = None,
                     timeout_s: float = 300.0) -> PrefillResult:
    """Prefill ``ids`` on ``world_size`` processes with "tsp" or "kvr" (or "single": this process).

    partition: tokens per rank (default: even split). repeat: timed runs,
    after ``warmup`` untimed ones, in the same processes. pool: reuse a
    running WorkerPool of the right size instead of starting processes.
    """
    spec = ModelSpec(spec) if isinstance(spec, str) else spec
    chunks = check_prefill_args(len(ids), method, world_size, partition)
    if method == "single":
        return _single(spec, ids, repeat, warmup, threads_per_rank, return_cache, decode_tokens)
    if pool is not None and pool.world_size != world_size:
        raise ValueError(f"the pool has {pool.world_size} processes but world size is {world_size}")
    args = (spec, list(ids), method, chunks, overlap, link, repeat, warmup, return_cache, decode_tokens)
    if pool is not None:
        outs = pool.run(prefill_rank, args, timeout_s=timeout_s)
    else:
        outs = run_parallel(prefill_rank, world_size, args, backend=backend, timeout_s=timeout_s,
                            threads_per_rank=threads_per_rank)
    return _merge(outs, method, chunks, threads_per_rank, overlap, link)


def _merge(outs, method, chunks, threads, overlap, link) -> PrefillResult:
    # TTFT of a run: the slowest rank's time (all ranks started together after a barrier).
    runs = [max(o["runs_s"][r] for o in outs) for r in range(len(outs[0]["runs_s"]))]
    lastr = outs[-1]
    return PrefillResult(method, len(chunks), sum(chunks), list(chunks), threads, statistics.median(runs), runs,
                         int(lastr["logits"].argmax()), lastr["logits"],
                         [e for o in outs for e in o["events"]], lastr.get("kv_cache"), lastr.get("decoded"),
                         overlap, asdict(link) if link else None)


def _single(spec, ids, repeat, warmup, threads, return_cache, decode_tokens) -> PrefillResult:
    model = spec.build()
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        runs = []
        for r in range(warmup + repeat):
            t0 = time.perf_counter()
            logits, cache = single_prefill(model, ids)
            if r >= warmup:
                runs.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(old)
    events = [{"rank": 0, "kind": "compute", "start_s": 0.0, "end_s": runs[-1], "layer": None, "label": "prefill"}]
    decoded = _continue_decoding(model, cache, int(logits.argmax()), decode_tokens) if decode_tokens else None
    return PrefillResult("single", 1, len(ids), [len(ids)], threads, statistics.median(runs), runs,
                         int(logits.argmax()), logits, events, cache if return_cache else None, decoded)


def torchrun_main(spec: ModelSpec, ids, method, chunks, overlap, link, repeat, warmup, backend, timeout_s):
    """Entry under ``torchrun``: this process is one rank; rank 0 returns the merged result, others None."""
    ctx = init_from_env(backend, timeout_s)
    try:
        if ctx.world_size != len(chunks):
            raise ValueError(f"torchrun started {ctx.world_size} processes but the partition has {len(chunks)} chunks")
        out = prefill_rank(ctx, spec, ids, method, chunks, overlap, link, repeat, warmup)
        out = to_cpu(out)   # gather_object pickles: no GPU tensors
        gathered = [None] * ctx.world_size if ctx.rank == 0 else None
        dist.gather_object(out, gathered, dst=0)
        if ctx.rank == 0:
            return _merge(gathered, method, chunks, torch.get_num_threads(), overlap, link)
        return None
    finally:
        dist.destroy_process_group()


def demo_prefill(context: int = 2048, spec: ModelSpec | None = None) -> None:
    """The demo's last part: one process vs TSP vs KVR on 2 processes, same first token."""
    spec = spec or ModelSpec("bench")
    ids = random_prompt(context, 256)
    single = parallel_prefill(spec, ids, "single", 1, repeat=2)
    with WorkerPool(2, threads_per_rank=1) as pool:
        tsp = parallel_prefill(spec, ids, "tsp", 2, repeat=2, pool=pool)
        kvr = parallel_prefill(spec, ids, "kvr", 2, repeat=2, pool=pool)
        cut = int(context * 0.56)
        kvr_s = parallel_prefill(spec, ids, "kvr", 2, [cut, context - cut], repeat=2, pool=pool)
    print(f"bench preset, {context}-token prompt, dense attention, 1 thread per process:")
    for name, r in [("one process", single), ("TSP, even split", tsp), ("KVR, even split", kvr),
                    (f"KVR, split {kvr_s.partition}", kvr_s)]:
        diff = (r.logits - single.logits).abs().max().item()
        print(f"  {name:<26} TTFT {r.ttft_s:6.3f} s   first token {r.first_token:3d}   max |logit diff| {diff:.1e}")


def measured_cost(spec: ModelSpec | str, ids: list[int], pool: WorkerPool, method: str = "kvr",
                  repeat: int = 3, **kw):
    """A cost function for the partition searches: median TTFT (seconds) of real runs in ``pool``.

    The pool's processes and model copies stay alive across evaluations, so
    a search pays the start-up once.
    """
    def cost(chunks: list[int]) -> float:
        return parallel_prefill(spec, ids, method, pool.world_size, list(chunks), repeat=repeat,
                                pool=pool, **kw).ttft_s

    return cost
