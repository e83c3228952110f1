"""Running a parallel prefill: build the model in each process, time repeated runs, gather the results.

``parallel_prefill`` checks the request in the calling process, starts (or
reuses) the worker processes, runs ``prefill_rank`` on every rank and merges
what they return into one ``PrefillResult``. ``prefill_rank`` is the
per-rank loop: embed this rank's tokens, call the step
(``toyllm.parallel.steps``) once per layer, and on the last rank project the
last position to logits and optionally keep decoding from the cache.
"""
from __future__ import annotations

import functools
import inspect
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from ..answers import shortcut
from ..attention import ATTENTION_KERNELS, get_attention
from ..cache import DynamicKVCache
from ..checks import check_int, is_int
from ..generation import generate
from ..launch import RankContext, WorkerPool, init_from_env, run_parallel, to_cpu
from ..model import get_config
from ..partition import even_partition, validate_partition, zigzag_chunks, zigzag_layout
from ..timeline import Timeline
from .comm import AllGather, Chain, LinkModel, Ring
from .plug import resolve_step, step_reference
from .ring import check_ring_request, gather_cache, ring_pass_kv_layer, ring_step
from .steps import TSP_BALANCES, RankPositions, default_step

METHODS = ("single", "tsp", "kvr", "ring")


# --------------------------------------------------------------------------- what to run

@dataclass(frozen=True)
class ModelSpec:
    """How each worker builds its copy of the model (models are rebuilt, not pickled)."""

    name: str = "tiny"
    seed: int = 0
    attention: str = "dense"
    overrides: tuple = ()        # ModelConfig fields to change, as (name, value) pairs

    @property
    def config(self):
        """The ModelConfig this spec builds (checked: unknown presets and bad overrides raise ValueError)."""
        cfg = get_config(self.name)
        return cfg.with_(**dict(self.overrides)) if self.overrides else cfg

    def build(self):
        return _build_model(self)


@functools.lru_cache(maxsize=4)
def _build_model(spec: ModelSpec):
    # Cached per process, so a pool worker builds a model once across many tasks.
    from ..model import build_model
    from ..weights import load_model

    if spec.overrides:
        return build_model(spec.config, spec.seed, spec.attention)
    return load_model(spec.name, attention=spec.attention, seed=spec.seed)[0]


@dataclass(kw_only=True)
class PrefillResult:
    method: str
    world_size: int
    context: int                           # tokens, the cached ones included
    partition: list[int]                   # tokens per rank (the new ones, after any cached)
    threads_per_rank: int
    # TTFT of a run: seconds from the common start (every rank leaves a barrier) until the rank
    # holding the last prompt token (the last rank; rank 0 with zigzag) has the first-token
    # logits. Other ranks may still be busy then (finishing their own last layer, draining a
    # send): that is slowest_rank_s, reported beside it, not the time to the first token.
    ttft_s: float                          # median over the timed runs (seconds)
    ttft_runs: list[float]                 # seconds, one per timed run
    first_token: int
    logits: torch.Tensor = field(repr=False)            # (vocab,) float32 at the last prompt position
    timeline: list[dict] = field(default_factory=list, repr=False)   # events of the last run, all ranks
    kv_cache: DynamicKVCache | None = field(default=None, repr=False)  # the last rank's, (1, Hkv, C, D) per layer
    decoded: list[int] | None = None       # tokens generated after the prefill (on the last rank)
    overlap: bool = True
    balance: str = "none"                  # TSP: "none", "trim" or "zigzag"; ring: "none" or "zigzag"
    ring_pass: str | None = None           # ring only: what travels, "kv" or "q"
    cached: int = 0                        # ring: prompt tokens already in the ranks' caches
    attention: str = "dense"               # the attention kernel every rank used
    link: dict | None = None
    max_abs_logit_diff: float | None = None
    slowest_rank_s: float | None = None    # median over the timed runs of the last rank to finish anything
    slowest_rank_runs: list[float] = field(default_factory=list)   # seconds, one per timed run

    def to_json(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k not in ("logits", "kv_cache")}


# --------------------------------------------------------------------------- checking a request (before any process starts)

def check_prefill_request(spec: ModelSpec, ids, method: str, world_size: int, partition=None, *,
                          decode_tokens: int = 0, balance: str = "none", ring_pass: str = "kv",
                          cached: int = 0) -> list[int]:
    """Check everything about a request that can be checked in this process; return the partition.

    The partition shares out the tokens after the ``cached`` first ones (all of them when none is cached).

    Raises ValueError naming the parameter, the value and what is allowed.
    """
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose one of {list(METHODS)}")
    if spec.attention not in ATTENTION_KERNELS:
        raise ValueError(f"unknown attention kernel {spec.attention!r}; choose one of {sorted(ATTENTION_KERNELS)}")
    cfg = spec.config
    C = len(ids)
    if C < 1:
        raise ValueError("the prompt is empty: give at least one token")
    if C > cfg.max_context:
        raise ValueError(f"context of {C} tokens is longer than {spec.name}'s max_context ({cfg.max_context} tokens)")
    bad = [t for t in ids if not is_int(t) or not 0 <= t < cfg.vocab_size]
    if bad:
        raise ValueError(f"token ids must be integers in [0, {cfg.vocab_size}) for {spec.name}, got {bad[:5]}")
    check_int(decode_tokens, "decode_tokens must be an integer >= 0", 0)
    if C + decode_tokens > cfg.max_context:
        raise ValueError(f"context ({C} tokens) + decode_tokens ({decode_tokens}) exceeds {spec.name}'s "
                         f"max_context ({cfg.max_context}); decode at most {cfg.max_context - C} tokens")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world size must be an integer >= 1, got {world_size!r}")
    if method == "single" and world_size != 1:
        raise ValueError(f"method 'single' runs one process; got world size {world_size}")
    check_int(cached, "cached must be an integer >= 0 (prompt tokens already in the ranks' caches)", 0)
    if method != "ring" and (cached or ring_pass != "kv"):
        raise ValueError(f"ring_pass and cached choose how ring attention runs; method {method!r} takes neither "
                         "(give method='ring')")
    if cached >= C:
        raise ValueError(f"cached={cached} leaves no new token of the {C}-token prompt: give cached < {C}")
    C -= cached                                                   # from here on, the tokens to share out
    if world_size > C:
        what = f"{C} new tokens (after {cached} cached)" if cached else f"context {C}"
        raise ValueError(f"world size {world_size} > {what}: every rank needs at least one token")
    if method == "ring":
        check_ring_request(ring_pass, cached, balance, world_size, C)
    elif balance not in TSP_BALANCES:
        raise ValueError(f"unknown balance {balance!r}; choose one of {list(TSP_BALANCES)}")
    elif balance != "none" and method != "tsp":
        raise ValueError(f"balance={balance!r} shares out TSP's work (or ring attention's); method {method!r} "
                         "takes balance='none'")
    if balance == "zigzag":
        if partition is not None:
            raise ValueError("balance='zigzag' makes its own layout (2p equal pieces, rank r holds r and 2p-1-r); "
                             "leave the partition out")
        if 2 * world_size > C:
            raise ValueError(f"balance='zigzag' cuts the context into 2 x world size = {2 * world_size} pieces, "
                             f"more than its {C} tokens")
        return zigzag_chunks(C, world_size)
    if partition is None:
        return even_partition(C, world_size)
    return validate_partition(list(partition), context=C, world_size=world_size)


# --------------------------------------------------------------------------- one rank's work

class _TimedBlock:
    """A Block whose three steps record compute spans on the rank's timeline."""

    def __init__(self, block, timeline: Timeline, layer: int):
        self.block, self.tl, self.layer = block, timeline, layer

    def qkv(self, *args):
        with self.tl.span("compute", self.layer, "qkv"):
            return self.block.qkv(*args)

    def attend(self, *args):
        with self.tl.span("compute", self.layer, "attention"):
            return self.block.attend(*args)

    def project(self, *args):
        with self.tl.span("compute", self.layer, "out_proj"):
            return self.block.project(*args)

    def finish(self, *args):
        with self.tl.span("compute", self.layer, "mlp"):
            return self.block.finish(*args)


def token_layout(chunks: list[int], balance: str = "none") -> list[torch.Tensor]:
    """Positions each rank holds: contiguous chunks, or for zigzag pieces r and 2p-1-r of 2p."""
    if balance != "zigzag":
        ends = torch.tensor(chunks).cumsum(0).tolist()
        return [torch.arange(end - c, end) for c, end in zip(chunks, ends)]
    return [torch.cat([torch.arange(a, b) for a, b in runs]) for runs in zigzag_layout(sum(chunks), len(chunks))]


@torch.no_grad()
def prefill_rank(ctx: RankContext, spec: ModelSpec, ids: list[int], method: str, chunks: list[int], *,
                 overlap: bool = True, balance: str = "none", step: str | None = None, link: LinkModel | None = None,
                 repeat: int = 1, warmup: int = 1, return_cache: bool = False, decode_tokens: int = 0,
                 ring_pass: str = "kv", cached: int = 0) -> dict:
    """The worker function: one rank's part of a parallel prefill, run ``warmup + repeat`` times.

    Returns this rank's seconds per run (when it finished everything, sends
    included) and timeline; the rank holding the last prompt token (the last
    rank, or rank 0 with zigzag) also returns the first-token logits, when
    they existed in each run (``logits_s``: the TTFT), and optionally its KV
    cache and the tokens it decodes from that cache. Ring, continuing a
    cache (pass-KV or pass-Q): the first ``cached`` of ``ids`` are already
    cached on the ranks (a ring pass-KV prefill of them, untimed, puts them
    there) and ``chunks`` share out the rest.
    """
    model = spec.build().to(ctx.device)
    rank, p = ctx.rank, ctx.world_size
    if len(chunks) != p:
        raise ValueError(f"partition has {len(chunks)} chunks for world size {p}")
    if step:
        layer_step = resolve_step(step)
    else:
        layer_step = ring_step(ring_pass, cached) if method == "ring" else default_step(method, overlap, balance)
    layout = [t + cached for t in token_layout(chunks, balance)]
    pos, ids_t = _rank_tokens(model, ids, layout, rank, ctx.device)
    context = cached + sum(chunks)
    owner = next(r for r, t in enumerate(layout) if int(t[-1]) == context - 1)   # holds the last token
    held, held_layout = _held_cache(ctx, model, ids[:cached], balance) if cached else (None, [])
    cfg = model.config
    runs, ready, tl = [], [], Timeline(rank)
    for run in range(warmup + repeat):
        rng = random.Random(hash((link.seed if link else 0, run)))   # the same draws on every rank
        if method == "tsp":
            comm = AllGather(rank, chunks, tl, link, rng)
        elif method == "ring":
            held_pos = [t.to(ctx.device) for t in held_layout]
            blocks = [len(h) + c for h, c in zip(held_pos, chunks)] if cached and ring_pass == "kv" else None
            named = [torch.cat([h, t]) for h, t in zip(held_layout, layout)] if blocks else layout   # by first position
            comm = Ring(rank, chunks, tl, link, rng, held, held_pos, layout=named, block_tokens=blocks)
        else:
            comm = Chain(rank, chunks, tl, batch=1, n_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
                         dtype=model.rope_cos.dtype, device=ctx.device, link=link, rng=rng)
        dist.barrier()
        tl.reset()
        x, cache = _layers(model, ids_t, pos, layer_step, comm, tl, method, balance, chunks)
        logits = None
        if rank == owner:
            with tl.span("compute", None, "lm_head"):
                logits = model.head(x[:, -1:])[0, -1]                   # only the position that picks the token
            if run >= warmup:
                ready.append(tl.events[-1].end_s)                       # the first token exists: TTFT
        comm.drain()                                       # this rank's sends still in flight end here
        if run >= warmup:
            runs.append(tl.now())
    whole = method != "ring"                                # TSP's and KVR's last rank holds the whole cache
    if not whole and (return_cache or decode_tokens):       # ring: the shards go to the rank that decodes
        shards = [torch.cat([h, t]) for h, t in zip(held_layout, layout)] if cached else layout
        cache, whole = gather_cache(cache, [t.to(ctx.device) for t in shards], rank), True
    out = {"rank": rank, "runs_s": runs, "events": tl.to_dicts()}
    if rank == owner:
        if whole:
            _check_step_output(cache, context, cfg)
        out["logits"] = logits
        out["logits_s"] = ready
        if return_cache:
            out["kv_cache"] = [(k.clone(), v.clone()) for k, v in cache]
        if decode_tokens:
            out["decoded"] = generate(model, ids, decode_tokens, cache=cache, prefilled_logits=logits).output_ids
    return out


def _rank_tokens(model, ids: list[int], layout: list[torch.Tensor], rank: int, device):
    """This rank's ``RankPositions`` and token ids (1, c_i), from every rank's positions ``layout``."""
    q_pos = layout[rank].to(device)
    ids_t = torch.tensor([[ids[i] for i in layout[rank].tolist()]], device=device)
    pos = RankPositions(q_pos, model.rope_cos[q_pos], model.rope_sin[q_pos], int(q_pos[0]),
                        int(layout[-1][-1]) + 1, tuple(t.to(device) for t in layout))
    return pos, ids_t


def _layers(model, ids_t, pos, layer_step, comm, tl, method, balance, chunks):
    """Embed this rank's tokens and run the step on every layer: the last hidden states and this rank's cache."""
    cfg = model.config
    cache = DynamicKVCache(cfg.n_layers)
    with tl.span("compute", None, "embed"):
        x = model.embed(ids_t)                                          # (1, c_i, d_model)
    for i, block in enumerate(model.layers):
        comm.layer = i
        x, k, v = _run_step(layer_step, (_TimedBlock(block, tl, i), x, pos, comm, model.attention),
                            comm.rank, i, method, balance, chunks, cfg)
        cache.update(i, k, v)
    return x, cache


def _held_cache(ctx: RankContext, model, ids: list[int], balance: str):
    """Ring pass-Q's starting point: this rank's shard of the cache of ``ids``, and every rank's positions.

    As a conversation's earlier turns would leave it: a ring pass-KV
    prefill of those tokens (untimed), with the same balance.
    """
    p = ctx.world_size
    chunks = zigzag_chunks(len(ids), p) if balance == "zigzag" else even_partition(len(ids), p)
    layout = token_layout(chunks, balance)
    pos, ids_t = _rank_tokens(model, ids, layout, ctx.rank, ctx.device)
    ring = Ring(ctx.rank, chunks, Timeline(ctx.rank), layout=layout)     # a timeline nobody reads
    _, cache = _layers(model, ids_t, pos, ring_pass_kv_layer, ring, ring.tl, "ring", balance, chunks)
    ring.drain()
    return cache, layout


class StepError(RuntimeError):
    """A per-layer step failed or returned the wrong amount of data; the message names the rank and the layer."""


def _run_step(step: Callable, args: tuple, rank: int, layer: int, method: str, balance: str, chunks: list[int], cfg):
    """``step(*args)`` on one rank and layer; what it returns is checked against what the method implies.

    A failure inside the step is reported with the rank, the layer and the
    step's own line, not as a shape error from deep inside a kernel.
    """
    try:
        out = step(*args)
    except StepError:
        raise
    except Exception as e:
        where = _where(step, rank, layer)
        message = str(e).removeprefix(f"rank {rank}, layer {layer}: ")     # the engine's own errors name them
        raise StepError(f"{where}{_step_line(step, e)}: {type(e).__name__}: {message}") from e
    where = _where(step, rank, layer)
    if not (isinstance(out, tuple) and len(out) == 3):
        raise StepError(f"{where} must return (x, k, v), got {type(out).__name__}")
    x, k, v = out
    c, s = chunks[rank], sum(chunks[:rank])
    if tuple(x.shape) != (1, c, cfg.d_model):
        raise StepError(f"{where} returned hidden states of shape {tuple(x.shape)}, expected (1, c_{rank}, d_model) "
                        f"= (1, {c}, {cfg.d_model}): one row per token of this rank")
    expected = None
    if method == "kvr":
        expected = (s + c, f"s_{rank} + c_{rank} = {s} + {c} (the prefix of ranks 0..{rank - 1} and this rank's "
                           f"own tokens)" if rank else f"c_0 = {c} (rank 0 has no prefix)",
                    "is the prefix you pass on the grown one (what you received plus your own), not just your own?")
    elif method == "tsp" and balance == "none":
        expected = (sum(chunks), f"C = {sum(chunks)}, every token of the context",
                    "did you all-gather the keys and values of every rank, in rank order?")
    if expected is not None:
        for label, t in (("keys", k), ("values", v)):
            if t.dim() != 4 or t.shape[-2] != expected[0]:
                got = t.shape[-2] if t.dim() == 4 else f"a tensor of shape {tuple(t.shape)}"
                raise StepError(f"{where} returned {label} for {got} tokens, expected {expected[1]}: {expected[2]}")
    return x, k, v


def _where(step: Callable, rank: int, layer: int) -> str:
    """"rank r, layer l, name": the name of the step a person wrote, through any wrapper (``__wrapped__``)."""
    return f"rank {rank}, layer {layer}, {getattr(inspect.unwrap(step), '__name__', 'the step')}"


def _step_line(step: Callable, error: BaseException) -> str:
    """" (file.py, line N: code)" of the deepest frame of the step's own file in ``error``'s traceback."""
    import traceback

    source = getattr(getattr(inspect.unwrap(step), "__code__", None), "co_filename", None)
    frames = [f for f in traceback.extract_tb(error.__traceback__) if f.filename == source]
    if not frames:
        return ""
    f = frames[-1]
    return f" ({Path(f.filename).name}, line {f.lineno}: {f.line})"


def _check_step_output(cache: DynamicKVCache, context: int, cfg) -> None:
    """The last rank must hold keys and values of the whole context: a clear error if a step got it wrong."""
    k = cache.keys(0)
    expected = (1, cfg.n_kv_heads, context, cfg.head_dim)
    if tuple(k.shape) != expected:
        raise ValueError(f"after the prefill the last rank's keys have shape {tuple(k.shape)}, expected {expected} "
                         "(batch, kv heads, every token of the context, head_dim): a step must return the keys "
                         "and values of every token this rank attended over")


# --------------------------------------------------------------------------- the public entry points

@shortcut("4.2", "5.1", "5.2",
          ships="one forward pass of the model, the reference every parallel method is checked against")
@torch.no_grad()
def single_prefill(model, ids: list[int]) -> tuple[torch.Tensor, DynamicKVCache]:
    """The one-process reference: last-position logits (vocab,) and the KV cache of the whole prompt.

    It does only the work a user needs: the last position alone is projected
    to the vocabulary, as on the parallel ranks.
    """
    cache = DynamicKVCache(model.config.n_layers)
    logits = model(torch.tensor([ids]), input_pos=0, cache=cache, last_only=True)[0, -1]
    return logits, cache


@shortcut("4.2", "5.1", "5.2",
          ships="starts the processes; the steps it runs are the marked answers, the student's in the edition")
def parallel_prefill(spec: ModelSpec | str, ids: list[int], method: str = "kvr", world_size: int = 2,
                     partition: list[int] | None = None, *, overlap: bool = True, balance: str = "none",
                     step: str | Callable | None = None, ring_pass: str = "kv", cached: int = 0,
                     link: LinkModel | None = None, repeat: int = 1, warmup: int = 1, threads_per_rank: int = 1,
                     backend: str = "auto", return_cache: bool = False, decode_tokens: int = 0,
                     pool: WorkerPool | None = None, timeout_s: float | None = None) -> PrefillResult:
    """Prefill ``ids`` on ``world_size`` processes with "tsp", "kvr" or "ring" (or "single": one process on
    ``threads_per_rank`` threads, this one, or the worker of a one-process ``pool``).

    partition: tokens per rank (default: even split). overlap: KVR posts its
    receives early and sends without waiting (False: blocking). balance: how
    TSP shares out the work: "none" (the paper's baseline: every rank attends
    over all C keys), "trim" (only over the keys its queries can see) or
    "zigzag" (rank r holds pieces r and 2p-1-r of 2p, so every rank owns an
    equal share of the causal triangle); ring takes "none" or "zigzag".
    ring_pass: what travels round the ring, "kv" (keys and values) or "q"
    (queries). cached: ring only, the first ``cached`` tokens of ``ids`` are
    already in the ranks' caches and the rest continue them (pass-Q always
    continues a cache; see ``toyllm.parallel.ring``). step: your
    own per-layer step (see ``toyllm.parallel.steps``) instead of the
    engine's. repeat: timed runs, after ``warmup`` untimed ones, in the same
    processes. pool: reuse a running WorkerPool of the right size instead of
    starting processes. timeout_s: wall-clock limit in seconds (default: the
    pool's, or 300 for new processes). Everything is checked here, before any work starts.
    """
    spec = ModelSpec(spec) if isinstance(spec, str) else spec
    ids = [int(t) if not isinstance(t, bool) and hasattr(t, "__index__") else t for t in ids]
    chunks = check_prefill_request(spec, ids, method, world_size, partition, decode_tokens=decode_tokens,
                                   balance=balance, ring_pass=ring_pass, cached=cached)
    # A kernel or step that is an unwritten exercise stops the run here, in one line, not in every worker.
    get_attention(spec.attention)
    if step is None and method in ("tsp", "kvr"):
        default_step(method, overlap, balance)
    elif step is None and method == "ring":
        ring_step(ring_pass, cached)
    if method == "single":
        if step is not None:
            raise ValueError("step= plugs a per-layer step into a parallel method ('tsp' or 'kvr'), not 'single'")
        if pool is None:
            return _single(spec, ids, repeat=repeat, warmup=warmup, threads=threads_per_rank,
                           return_cache=return_cache, decode_tokens=decode_tokens)
        if pool.world_size != 1:
            raise ValueError(f"method 'single' runs in one process; the pool has {pool.world_size}")
        kwargs = dict(repeat=repeat, warmup=warmup, threads=threads_per_rank, return_cache=return_cache,
                      decode_tokens=decode_tokens)
        return pool.run(_single_rank, (spec, list(ids)), kwargs, timeout_s=timeout_s)[0]
    if pool is not None and pool.world_size != world_size:
        raise ValueError(f"the pool has {pool.world_size} processes but world size is {world_size}")
    kwargs = dict(overlap=overlap, balance=balance, step=step_reference(step), link=link, repeat=repeat,
                  warmup=warmup, return_cache=return_cache, decode_tokens=decode_tokens)
    if method == "ring":
        kwargs.update(ring_pass=ring_pass, cached=cached)
    args = (spec, list(ids), method, chunks)
    if pool is not None:
        outs = pool.run(prefill_rank, args, kwargs, timeout_s=timeout_s)
    else:
        outs = run_parallel(prefill_rank, world_size, args, kwargs, backend=backend,
                            timeout_s=300.0 if timeout_s is None else timeout_s, threads_per_rank=threads_per_rank)
    return _merge(outs, method=method, chunks=chunks, threads=threads_per_rank, overlap=overlap, link=link,
                  balance=balance, attention=spec.attention, ring_pass=ring_pass, cached=cached)


def _merge(outs, *, method, chunks, threads, overlap, link, balance="none", attention="dense", ring_pass="kv",
           cached=0) -> PrefillResult:
    # All ranks start together (after a barrier). TTFT of a run: when the rank holding the last
    # prompt token had the first-token logits, the definition the simulator and the lessons use.
    # The slowest rank's end (other ranks finishing their last layer or draining a send) is kept apart.
    last = next(o for o in outs if "logits" in o)          # the rank that held the last prompt token
    runs = list(last["logits_s"])
    slowest = [max(o["runs_s"][r] for o in outs) for r in range(len(runs))]
    cache = DynamicKVCache.from_layers(last["kv_cache"]) if last.get("kv_cache") else None
    return PrefillResult(method=method, world_size=len(chunks), context=cached + sum(chunks), partition=list(chunks),
                         threads_per_rank=threads, ttft_s=statistics.median(runs), ttft_runs=runs,
                         slowest_rank_s=statistics.median(slowest), slowest_rank_runs=slowest,
                         first_token=int(last["logits"].argmax()), logits=last["logits"],
                         timeline=[e for o in outs for e in o["events"]], kv_cache=cache,
                         decoded=last.get("decoded"), overlap=overlap, balance=balance, attention=attention,
                         link=asdict(link) if link else None, cached=cached,
                         ring_pass=ring_pass if method == "ring" else None)


def _single(spec, ids, *, repeat, warmup, threads, return_cache, decode_tokens) -> PrefillResult:
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
        decoded = (generate(model, ids, decode_tokens, cache=cache, prefilled_logits=logits).output_ids
                   if decode_tokens else None)
    finally:
        torch.set_num_threads(old)
    events = [{"rank": 0, "kind": "compute", "start_s": 0.0, "end_s": runs[-1], "layer": None, "label": "prefill"}]
    return PrefillResult(method="single", world_size=1, context=len(ids), partition=[len(ids)],
                         threads_per_rank=threads, ttft_s=statistics.median(runs), ttft_runs=runs,
                         slowest_rank_s=statistics.median(runs), slowest_rank_runs=list(runs),
                         first_token=int(logits.argmax()), logits=logits, timeline=events,
                         kv_cache=cache if return_cache else None, decoded=decoded, attention=spec.attention)


def _single_rank(ctx: RankContext, spec: ModelSpec, ids: list[int], **kwargs) -> PrefillResult:
    """The worker function of a one-process prefill in a pool's only worker."""
    return _single(spec, ids, **kwargs)


def torchrun_main(spec: ModelSpec, ids, method, chunks, *, overlap=True, link=None, repeat=1, warmup=1,
                  backend="auto", timeout_s=120.0):
    """Entry under ``torchrun``: this process is one rank; rank 0 returns the merged result, others None."""
    ctx = init_from_env(backend, timeout_s)
    try:
        if ctx.world_size != len(chunks):
            raise ValueError(f"torchrun started {ctx.world_size} processes but the partition has {len(chunks)} chunks")
        out = prefill_rank(ctx, spec, ids, method, chunks, overlap=overlap, link=link, repeat=repeat, warmup=warmup)
        out = to_cpu(out)   # gather_object pickles: no GPU tensors
        gathered = [None] * ctx.world_size if ctx.rank == 0 else None
        dist.gather_object(out, gathered, dst=0)
        if ctx.rank == 0:
            return _merge(gathered, method=method, chunks=chunks, threads=torch.get_num_threads(),
                          overlap=overlap, link=link, attention=spec.attention)
        return None
    finally:
        dist.destroy_process_group()


def measured_cost(spec: ModelSpec | str, ids: list[int], pool: WorkerPool, method: str = "kvr",
                  repeat: int = 3, **kw):
    """A cost function for the partition searches: median TTFT (seconds) of real runs in ``pool``.

    TTFT as everywhere in toyllm: when the last rank has the first-token
    logits (``PrefillResult.ttft_s``), not when the slowest rank finishes.

    The pool's processes and model copies stay alive across evaluations, so
    a search pays the start-up once.
    """
    def cost(chunks: list[int]) -> float:
        return parallel_prefill(spec, ids, method, pool.world_size, list(chunks), repeat=repeat,
                                pool=pool, **kw).ttft_s

    return cost
