"""Disaggregated prefill: prefill on one worker, decode on another, the KV cache shipped between them.

The two halves of serving a request want different machines. A prefill
runs the whole prompt through the model at once: big matmuls, many FLOPs
per byte read, so it is *compute-bound*. A decode step feeds one token per
sequence and reads every weight and the whole KV cache for it: few FLOPs
per byte, so it is *memory-bound* (lesson 03). On one machine the two
share an iteration, and a long prompt makes every running sequence wait
for it: their time per output token jumps (chunked prefill, in
``toyllm.serving``, softens this by cutting prompts into pieces).

Disaggregation puts them on separate workers. The prefill worker computes
the prompt's KV cache and the first token; the decode worker receives the
cache and generates the rest. A decode iteration never waits behind a
prefill, and each pool of workers can be sized and tuned for its own job.
The price is shipping the KV cache (bytes: 2 * layers * kv_heads *
head_dim * tokens * bytes_per_value, lesson 02) over the link between
them, instead of recomputing it. Whether that pays depends on the link:
over NVLink the cache crosses in microseconds, over a slow network a
decode worker would have been quicker to recompute the prompt itself.
The prefill pool can itself be parallel: KV-Runahead or TSP (lessons
04-05) on p processes, whose last rank holds the whole cache and ships it.

What is here, and what is measured:

- ``transfer_bytes``: a request's KV cache on the wire, in bytes.
- ``ship_kv_cache``: a *real* run. Two processes in a gloo group on
  127.0.0.1 (``toyllm.launch``): rank 0 is the prefill worker, rank 1 the
  decode worker. Rank 0 prefills and sends every layer's K and V with
  ``torch.distributed``; rank 1 receives them into a ``DynamicKVCache`` and
  decodes. In the same run, rounds interleaved with the shipping
  (``toyllm.measure``), rank 1 also prefills the prompt itself: what
  recomputing would have cost. With method "tsp", "kvr" or "ring" the
  prefill runs first on p processes of its own (``parallel_prefill``) and
  the cache of its last rank (for ring, the shards gathered there) is handed to rank 0, which ships it: the two
  groups cannot run at once on a 2-core machine without spoiling each
  other's timings.
- ``shipping_pays``, ``break_even_bandwidth``, ``shipping_table``: the
  same question asked of the *simulator* (``toyllm.simulate``), for links
  and models this machine does not have. Simulated, not measured.
- ``serve_disaggregated``: a workload served by one prefill worker and one
  decode worker, to compare with the colocated schedulers of
  ``toyllm.serving``. Measured: every forward is real and its compute time
  is measured, as ``serve`` does. Modelled: the two workers are separate
  machines, so each has its own clock and the two run side by side (here
  they take turns on one CPU, each clock advanced by its own forwards
  only), and a cache crosses the link in ``CostModel.transfer_s`` of its
  bytes, not in a real transfer.

All times are in seconds, sizes in bytes, lengths in tokens.
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .answers import answer, exercise
from .cache import DynamicKVCache
from .checks import check_int, is_number
from .generation import generate
from .launch import RankContext, run_parallel
from .measure import Verdict, compare, interleaved_runs, load_average, spread
from .model import ModelConfig
from .parallel.runner import ModelSpec, check_prefill_request, parallel_prefill, single_prefill
from .serving import (POLICY, Request, RequestResult, Scheduler, ServeResult, Waiting, Worker, progress_bar,
                      serving_pool)
from .simulate import CostModel, simulate_prefill

LAYOUTS = ("flat", "per_layer")


def _check_tokens(tokens) -> int:
    return check_int(tokens, "tokens must be an int >= 1 (the prompt's length)", 1)


@answer("8.4", "The KV transfer's size")
def transfer_bytes(cfg: ModelConfig, tokens: int, bytes_per_value: float = 4, block_size: int | None = None) -> int:
    """Bytes of one request's KV cache on the wire: K and V of ``tokens`` tokens in every layer, rounded up
    to a whole byte; whole blocks of ``block_size`` tokens when a paged cache ships them.

    bytes_per_value: 4 for toyllm's float32, 2 for fp16/bf16. Nothing else
    travels with it but the first token's id (8 bytes, not counted).
    """
    return exercise("8.4")(cfg, tokens, bytes_per_value, block_size)


# --------------------------------------------------------------------------- real shipping over torch.distributed

@dataclass
class ShippingResult:
    """One real disaggregated run: prefill on rank 0, the cache shipped over gloo, decode on rank 1.

    The ``*_runs`` lists hold one time in seconds per timed round; shipping
    and recomputing took turns in each round, so a slow spell of the machine
    hits both alike. transfer: measured on the decode worker, from posting
    the receives (both workers leave a barrier together) until the last
    byte is in. recompute: the decode worker prefilling the prompt itself.
    prefill: the prefill worker's own prefill (with "tsp"/"kvr"/"ring": the TTFT
    runs of the parallel prefill, run before the shipping group).
    """

    method: str                       # how the prefill worker prefilled: "single", "tsp", "kvr" or "ring"
    prefill_ranks: int                # processes of the prefill (1 for "single")
    layout: str                       # "flat" (one message) or "per_layer" (one message per layer)
    context: int                      # prompt tokens
    messages: int                     # messages the KV cache travelled in
    transfer_bytes: int               # bytes of K and V received
    output_ids: list[int]             # every generated token, the first one (from the prefill worker) included
    first_logits: torch.Tensor = field(repr=False)    # (vocab,) float32: the prefill's last-position logits
    transfer_runs: list[float] = field(default_factory=list)
    recompute_runs: list[float] = field(default_factory=list)
    prefill_runs: list[float] = field(default_factory=list)
    decode_step_s: list[float] = field(default_factory=list)  # seconds of each decode step on rank 1
    load: float = math.nan            # the 1-minute load average when the run started
    kv_cache: DynamicKVCache | None = field(default=None, repr=False)   # what rank 1 received, if asked for

    @property
    def transfer_s(self) -> float:
        return statistics.median(self.transfer_runs)

    @property
    def recompute_s(self) -> float:
        return statistics.median(self.recompute_runs)

    @property
    def prefill_s(self) -> float:
        return statistics.median(self.prefill_runs)

    @property
    def tpot_s(self) -> float:
        """Median seconds per decode step on the decode worker (0 when only the first token was asked for)."""
        return statistics.median(self.decode_step_s) if self.decode_step_s else 0.0

    @property
    def bandwidth_bytes_per_s(self) -> float:
        """What the link delivered: transfer bytes over the median transfer time."""
        return self.transfer_bytes / self.transfer_s if self.transfer_s > 0 else math.inf

    @property
    def verdict(self) -> Verdict:
        """Shipping against recomputing, from their interleaved runs ("faster" = shipping won)."""
        return compare(self.transfer_runs, self.recompute_runs)

    def lines(self) -> list[str]:
        """What happened, in words: bytes, both times with their spread, the verdict, TPOT."""
        v = self.verdict
        return [f"{self.context} tokens, {self.transfer_bytes:,} bytes of K and V in {self.messages} message(s) "
                f"({self.layout}), measured; load average {self.load:.2f}",
                f"prefill ({self.method}, {self.prefill_ranks} process(es)): {spread(self.prefill_runs)}",
                v.sentence("shipping", "recomputing"),
                f"link delivered {self.bandwidth_bytes_per_s / 1e9:.2f} GB/s; decode TPOT "
                f"{self.tpot_s * 1e3:.2f} ms over {len(self.output_ids)} tokens"]


def _kv_shapes(cfg: ModelConfig, tokens: int, layout: str) -> list[tuple[int, ...]]:
    """The shape of each message: K and V stacked, per layer or all layers in one buffer."""
    one = (2, 1, cfg.n_kv_heads, tokens, cfg.head_dim)                  # K and V of one layer
    return [(cfg.n_layers, *one)] if layout == "flat" else [one] * cfg.n_layers


def _send_cache(layers: list[tuple[torch.Tensor, torch.Tensor]], layout: str, dst: int) -> None:
    if layout == "flat":
        buf = torch.stack([torch.stack([k, v]) for k, v in layers])    # (L, 2, 1, Hkv, T, D)
        dist.send(buf, dst)
        return
    # One message per layer: packing layer i+1 overlaps with sending layer i, and a receiver could
    # start on layer 0 before the last layer arrives (or a prefill could send each layer as it ends).
    works = [dist.isend(torch.stack([k, v]), dst) for k, v in layers]   # each (2, 1, Hkv, T, D)
    for w in works:
        w.wait()


def _recv_cache(shapes, dtype, src: int) -> list[torch.Tensor]:
    bufs = [torch.empty(s, dtype=dtype) for s in shapes]
    works = [dist.irecv(b, src) for b in bufs]          # all posted at once: no message waits for a receive
    for w in works:
        w.wait()
    return bufs


def _as_layers(bufs: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer (k, v) views of the received buffers, each (1, Hkv, T, D): no copy."""
    stacked = bufs[0] if len(bufs) == 1 else torch.stack(bufs)          # (L, 2, 1, Hkv, T, D)
    return [(layer[0], layer[1]) for layer in stacked]


@torch.no_grad()
def ship_rank(ctx: RankContext, spec: ModelSpec, ids: list[int], decode_tokens: int, layout: str, rounds: int,
              warmup: int, prefilled=None, return_cache: bool = False) -> dict:
    """The worker function of ``ship_kv_cache``: rank 0 prefills and sends, rank 1 receives and decodes.

    Each round: rank 0 prefills (unless ``prefilled`` = (logits, layers) was
    handed to it) and sends the first token, both ranks leave a barrier, the
    K and V travel; then rank 1 prefills the prompt itself while rank 0
    waits at a barrier, so the two never compete for a core.
    """
    if ctx.world_size != 2:
        raise ValueError(f"shipping needs exactly 2 processes (prefill and decode), got {ctx.world_size}")
    model = spec.build()
    cfg = model.config
    C = len(ids)
    state: dict = {"prefill_s": []}

    def prefill_and_send() -> None:
        t0 = time.perf_counter()
        if prefilled is None:
            logits, cache = single_prefill(model, ids)
            layers = list(cache)
            state["prefill_s"].append(time.perf_counter() - t0)
        else:
            logits, layers = prefilled
        state["logits"] = logits
        dist.send(torch.tensor([int(logits.argmax())]), 1)   # the first token: the user has it already
        dist.barrier()                                        # both sides start the transfer together
        _send_cache(layers, layout, 1)

    def receive() -> float:
        first = torch.empty(1, dtype=torch.long)
        dist.recv(first, 0)
        dist.barrier()
        t0 = time.perf_counter()
        bufs = _recv_cache(_kv_shapes(cfg, C, layout), model.rope_cos.dtype, 0)
        spent = time.perf_counter() - t0
        state["first"], state["bufs"] = int(first), bufs
        return spent

    def recompute() -> float:
        t0 = time.perf_counter()
        single_prefill(model, ids)
        spent = time.perf_counter() - t0
        dist.barrier()
        return spent

    if ctx.rank == 0:
        fns = {"transfer": prefill_and_send, "recompute": lambda: dist.barrier()}
    else:
        fns = {"transfer": receive, "recompute": recompute}
    runs = interleaved_runs(fns, rounds, warmup=warmup)
    if ctx.rank == 0:
        return {"prefill_runs": state["prefill_s"][warmup:], "logits": state["logits"]}
    layers = _as_layers(state["bufs"])
    out = {"transfer_runs": runs["transfer"], "recompute_runs": runs["recompute"],
           "transfer_bytes": sum(b.nbytes for b in state["bufs"]), "messages": len(state["bufs"])}
    if return_cache:
        out["kv_cache"] = [(k.clone(), v.clone()) for k, v in layers]
    # Decode from the received cache: the first token goes in at position C, as any decode step would.
    rest = generate(model, [state["first"]], decode_tokens - 1, cache=DynamicKVCache.from_layers(layers))
    out["output_ids"] = [state["first"]] + rest.output_ids
    out["decode_step_s"] = rest.step_times_s
    return out


def ship_kv_cache(spec: ModelSpec | str, ids: list[int], decode_tokens: int = 8, *, method: str = "single",
                  prefill_ranks: int = 2, layout: str = "per_layer", rounds: int = 3, warmup: int = 1,
                  return_cache: bool = False, timeout_s: float = 120.0) -> ShippingResult:
    """Prefill ``ids`` on one process, ship its KV cache over gloo to another, decode ``decode_tokens`` there.

    method: "single" (the prefill worker prefills alone) or "tsp"/"kvr"/"ring" on
    ``prefill_ranks`` processes (run first, by ``parallel_prefill``; its last
    rank's cache is what rank 0 ships). layout: "per_layer" sends one
    message per layer, "flat" the whole cache as one buffer. Per layer is
    the default because it measured faster: on the bench preset, 2048
    tokens (16.8 MB) over gloo loopback on 2 cores, about 5-9 ms against
    12-18 ms flat, since packing layer i+1 overlaps with sending layer i
    while the flat buffer must be packed whole before its first byte
    leaves; the extra messages cost microseconds each. rounds: timed
    rounds of shipping and recomputing, in turns, after ``warmup`` untimed
    ones. timeout_s: wall-clock limit in seconds for each group of
    processes; a rank that fails stops the run with its traceback
    (``toyllm.launch.WorkerError``). The cache arrives exactly as the prefill
    worker computed it: from one process, the one-process cache; from
    "tsp", "kvr" or "ring", that cache up to float32 rounding. Either way the greedy
    tokens equal one-process ``generate``.
    """
    spec = ModelSpec(spec) if isinstance(spec, str) else spec
    ids = [int(t) if not isinstance(t, bool) and hasattr(t, "__index__") else t for t in ids]
    check_int(decode_tokens, "decode_tokens must be an int >= 1 (the first token counts)", 1)
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; choose one of {', '.join(LAYOUTS)}")
    for name, value, low in (("rounds", rounds, 1), ("warmup", warmup, 0)):
        check_int(value, f"{name} must be an int >= {low}", low)
    ranks = 1 if method == "single" else prefill_ranks
    check_prefill_request(spec, ids, method, ranks, decode_tokens=decode_tokens)
    load = load_average()
    prefilled, prefill_runs = None, []
    if method != "single":
        pre = parallel_prefill(spec, ids, method, ranks, return_cache=True, repeat=rounds, warmup=warmup,
                               timeout_s=timeout_s)
        prefilled, prefill_runs = (pre.logits, list(pre.kv_cache)), pre.ttft_runs
    # gloo: the cache lives in CPU memory here (with NCCL it would travel GPU to GPU the same way).
    sender, receiver = run_parallel(ship_rank, 2, (spec, ids, decode_tokens, layout, rounds, warmup),
                                    {"prefilled": prefilled, "return_cache": return_cache},
                                    backend="gloo", timeout_s=timeout_s, threads_per_rank=1)
    return ShippingResult(method=method, prefill_ranks=ranks, layout=layout, context=len(ids),
                          messages=receiver["messages"], transfer_bytes=receiver["transfer_bytes"],
                          output_ids=receiver["output_ids"], first_logits=sender["logits"],
                          transfer_runs=receiver["transfer_runs"], recompute_runs=receiver["recompute_runs"],
                          prefill_runs=prefill_runs or sender["prefill_runs"],
                          decode_step_s=receiver["decode_step_s"], load=load,
                          kv_cache=DynamicKVCache.from_layers(receiver["kv_cache"]) if return_cache else None)


# --------------------------------------------------------------------------- simulated links

# The links of lesson 07, in bytes per second (GB/s = 1e9 bytes/s). Assumed figures, not measurements
# of any machine: a loopback link is measured where it is used (``ShippingResult.bandwidth_bytes_per_s``,
# ``toyllm.parallel.measure_link``), since it depends on the CPU and its load.
LINKS = {
    "NVLink-like, 300 GB/s": 300e9,      # a100_like's default
    "10 GB/s (~100 Gb Ethernet)": 10e9,  # the paper's slow network
    "1 GB/s (~10 Gb Ethernet)": 1e9,
    "0.1 GB/s": 0.1e9,
}


def link(bandwidth_bytes_per_s: float, latency_s: float = 10e-6, bytes_per_value: int = 4) -> CostModel:
    """A CostModel that is only a link (no compute): for ``serve_disaggregated`` and ``CostModel.transfer_s``."""
    _check_bandwidth(bandwidth_bytes_per_s)
    return CostModel(0.0, 0.0, 0.0, link_bandwidth_bytes_per_s=bandwidth_bytes_per_s, link_latency_s=latency_s,
                     bytes_per_value=bytes_per_value,
                     label=f"assumed link: {bandwidth_bytes_per_s / 1e9:g} GB/s, {latency_s * 1e6:g} us")


def _check_bandwidth(bandwidth_bytes_per_s) -> None:
    if not (is_number(bandwidth_bytes_per_s) and 0 < bandwidth_bytes_per_s < math.inf):
        raise ValueError(f"bandwidth must be a finite number of bytes/s > 0, got {bandwidth_bytes_per_s!r}")


@dataclass(frozen=True)
class ShipOrRecompute:
    """Shipping a prompt's KV cache vs the decode worker recomputing it. Simulated, not measured.

    transfer_s: bytes / bandwidth + latency (one message). recompute_s: the
    simulated TTFT of a one-process prefill with the cost model's compute.
    break_even_bytes_per_s: the slowest link on which shipping still wins
    (inf: none does, the latency alone costs more than the recompute).
    """

    tokens: int
    transfer_bytes: float
    transfer_s: float
    recompute_s: float
    break_even_bytes_per_s: float
    label: str = ""
    simulated: bool = True

    @property
    def pays(self) -> bool:
        """True when shipping takes less time than recomputing."""
        return self.transfer_s < self.recompute_s


def _recompute_s(cfg: ModelConfig, tokens: int, cost_model: CostModel) -> float:
    return simulate_prefill(cfg, [tokens], "single", cost_model, record_events=False).ttft_s


def break_even_bandwidth(cfg: ModelConfig, tokens: int, cost_model: CostModel) -> float:
    """Bytes/s at which shipping ``tokens`` tokens' cache takes exactly as long as recomputing it (simulated).

    Closed form: bytes / bw + latency = recompute, so bw = bytes / (recompute
    - latency). Any faster link ships in less time. ``math.inf`` when the
    link's latency alone is as long as the recompute.
    """
    _check_tokens(tokens)
    spare = _recompute_s(cfg, tokens, cost_model) - cost_model.link_latency_s
    return transfer_bytes(cfg, tokens, cost_model.bytes_per_value) / spare if spare > 0 else math.inf


def shipping_pays(cfg: ModelConfig, tokens: int, cost_model: CostModel) -> ShipOrRecompute:
    """Does shipping a ``tokens``-token prompt's cache over ``cost_model``'s link beat recomputing it? Simulated.

    The decode worker's compute and the link both come from ``cost_model``
    (e.g. ``a100_like(cfg, link_bandwidth_bytes_per_s=10e9)``), its
    ``bytes_per_value`` sizes the cache.
    """
    _check_tokens(tokens)
    if not isinstance(cost_model, CostModel):
        raise ValueError(f"cost_model must be a CostModel, got {type(cost_model).__name__}")
    n_bytes = transfer_bytes(cfg, tokens, cost_model.bytes_per_value)
    return ShipOrRecompute(tokens, n_bytes, cost_model.transfer_s(n_bytes), _recompute_s(cfg, tokens, cost_model),
                           break_even_bandwidth(cfg, tokens, cost_model), cost_model.label)


def shipping_table(cfg: ModelConfig, contexts, cost_model: CostModel, links: dict[str, float] | None = None) -> list[dict]:
    """For each context: recompute seconds, the break-even bandwidth, and transfer seconds on each link. Simulated.

    links: name -> bandwidth in bytes/s (default ``LINKS``); the latency and
    the compute are ``cost_model``'s. One dict per context, ``simulated`` True.
    """
    links = LINKS if links is None else links
    for bw in links.values():
        _check_bandwidth(bw)
    rows = []
    for C in contexts:
        base = shipping_pays(cfg, C, cost_model)
        row = {"context": C, "transfer_bytes": base.transfer_bytes, "recompute_s": base.recompute_s,
               "break_even_bytes_per_s": base.break_even_bytes_per_s, "transfer_s": {}, "pays": {}, "simulated": True}
        for name, bw in links.items():
            s = cost_model.with_(link_bandwidth_bytes_per_s=bw).transfer_s(base.transfer_bytes)
            row["transfer_s"][name], row["pays"][name] = s, s < base.recompute_s
        rows.append(row)
    return rows


def format_shipping_table(rows: list[dict]) -> str:
    """``shipping_table`` as text: one line per context; per link, the transfer time and the quicker way."""
    names = list(rows[0]["transfer_s"]) if rows else []
    head = f"{'tokens':>7} {'KV MB':>8} {'recompute':>10} {'break-even':>11}  " + "  ".join(names)
    out = ["simulated, not measured; under each link: the transfer time, then the quicker way (ship or recompute)",
           head]
    for r in rows:
        be = r["break_even_bytes_per_s"]
        cells = [f"{r['transfer_s'][n] * 1e3:.3g} ms: " + ("ship" if r["pays"][n] else "recompute") for n in names]
        out.append(f"{r['context']:>7} {r['transfer_bytes'] / 1e6:>8.3g} {r['recompute_s'] * 1e3:>7.3g} ms "
                   f"{'never' if math.isinf(be) else f'{be / 1e9:.3g} GB/s':>11}  " + "  ".join(cells))
    return "\n".join(out)


# --------------------------------------------------------------------------- serving with a prefill and a decode worker

@dataclass
class DisaggServeResult(ServeResult):
    """``ServeResult`` of ``serve_disaggregated``. ``compute_s`` adds both workers' compute (machine-seconds),
    so ``throughput`` is output tokens per second of compute of either machine, as for one colocated one."""

    prefill_compute_s: float = 0.0          # seconds of forwards on the prefill worker
    decode_compute_s: float = 0.0           # seconds of forwards on the decode worker
    transfer_s: dict[int, float] = field(default_factory=dict)   # request id -> modelled seconds on the link


def _decodes_only(prompt_left: list[int], done: list[bool], token_budget: int | None) -> list[int]:
    """The decode worker's plan: its sequences arrive prefilled, so each feeds its last token (none when done)."""
    return [0 if d else 1 for d in done]


def serve_disaggregated(model, requests: list[Request], link_model: CostModel, *, max_batch: int = 8,
                        block_size: int = 16, progress: bool = False) -> DisaggServeResult:
    """Serve ``requests`` with one prefill worker and one decode worker; greedy decoding.

    Prefill worker: each iteration, one ragged forward over the whole
    prompts of up to ``max_batch`` requests that have arrived (first come,
    first served); the first token of each exists at the iteration's end
    (TTFT). Its cache then crosses the link: ready ``link_model.transfer_s(
    transfer_bytes)`` seconds later (the model's own dtype sizes the bytes).
    Decode worker: a ``Scheduler`` batching decodes only, continuously, up to
    ``max_batch`` sequences in a paged pool sized as ``serve`` sizes it; a
    ready cache is copied into its blocks when a seat is free. Each worker's
    clock advances by the measured seconds of its own forwards; the next step
    is always the one of the worker whose clock is behind, so neither sees a
    handover before it exists. The greedy tokens equal one request at a time.
    """
    if not isinstance(link_model, CostModel):
        raise ValueError(f"link_model must be a CostModel (e.g. toyllm.disagg.link(10e9)), "
                         f"got {type(link_model).__name__}")
    for name, value in (("max_batch", max_batch), ("block_size", block_size)):
        check_int(value, f"{name} must be an int >= 1", 1)
    pool = serving_pool(model, requests, max_batch, block_size)
    cfg, dtype = model.config, model.lm_head.weight.dtype
    bar = progress_bar(len(requests), "serving (disaggregated)") if progress else None
    iteration_tokens: list[int] = []                                 # both workers' forwards, in turn
    prefill = Worker(iteration_tokens=iteration_tokens)
    decode = Scheduler(pool, POLICY["continuous"], max_batch, plan=_decodes_only,
                       worker=Worker(iteration_tokens=iteration_tokens), bar=bar)
    waiting = sorted(requests, key=lambda r: (r.arrival_s, r.id))   # not yet prefilled
    transfer: dict[int, float] = {}
    while waiting or decode.busy:
        p_next = max(prefill.clock, waiting[0].arrival_s) if waiting else math.inf
        if p_next >= decode.next_s:                             # the decode worker is behind: it goes
            decode.step(model)
            continue
        prefill.clock = p_next
        batch = []
        while waiting and waiting[0].arrival_s <= prefill.clock and len(batch) < max_batch:
            batch.append(waiting.pop(0))
        caches = [DynamicKVCache(cfg.n_layers) for _ in batch]
        logits = prefill.forward(model, [(c, list(r.prompt_ids)) for c, r in zip(caches, batch)])
        for r, cache, row in zip(batch, caches, logits):
            first, now = int(row.argmax()), prefill.clock
            if r.max_new_tokens == 1:                           # nothing left to decode: nothing to ship
                decode.report(RequestResult(r.id, [first], r.arrival_s, now, now, len(r.prompt_ids)))
                continue
            transfer[r.id] = link_model.transfer_s(transfer_bytes(cfg, len(r.prompt_ids), dtype.itemsize))
            decode.add(Waiting(r, now + transfer[r.id], prefilled=cache, first_token=first, first_token_s=now))
    if bar is not None:
        bar.close()
    finished = sorted(decode.finished, key=lambda r: r.id)
    p, d = prefill.compute, decode.worker.compute
    return DisaggServeResult("disaggregated", finished, max(r.finish_s for r in finished), p + d, iteration_tokens,
                             prefill_compute_s=p, decode_compute_s=d, transfer_s=transfer)
