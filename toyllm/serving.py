"""Serving many users: continuous batching and chunked prefill over a paged KV cache.

Lessons 01-07 follow one request to its first token. A server holds many
requests at once, arriving whenever their users press enter, with prompts
and answers of every length. Three ways to schedule them, on the same model:

- ``"static"``: a batch is formed from the requests waiting, prefilled, and
  decoded together until its *last* sequence is done; only then does the
  next batch start. A short answer waits for the longest one in its batch,
  and a request that arrives meanwhile waits for the whole batch.
- ``"continuous"`` (iteration-level batching, as in Orca): every iteration
  is one forward over the sequences now running, one new token each; a
  sequence that finishes leaves at once and a waiting request joins the
  next iteration, its whole prompt in that iteration.
- ``"chunked"`` (chunked prefill, as in Sarathi-Serve): the same, but each
  iteration carries at most ``token_budget`` tokens: the decodes first (one
  each), then as much of the waiting prompts as fits. A long prompt is fed
  over several iterations, and the decodes never stall behind it.

An iteration's forward is *ragged*: the new tokens of all its sequences lie
in one row, (1, N, d_model). The matmuls (projections and MLP) see all N
tokens at once, which is what batching buys on a CPU as on a GPU, while
attention runs per sequence over that sequence's own paged KV cache, as a
variable-length attention kernel does. RoPE takes each token's own position.

A ``Scheduler`` runs the iterations: it seats waiting requests, plans each
iteration's tokens (``plan_iteration``), runs the forward and lets finished
sequences go; the three policies are ``Policy`` data that it reads. The
decode worker of ``toyllm.disagg`` is a ``Scheduler`` too.

Time is a clock in seconds: each iteration advances it by the iteration's
measured compute time, requests arrive on it (a seeded Poisson workload,
``poisson_workload``), and when nothing runs it jumps to the next arrival.
TTFT of a request: from its arrival to the end of the iteration that
produced its first token; TPOT: the mean time between its later tokens.
"""
from __future__ import annotations

import bisect
import math
import random
import time
from dataclasses import dataclass, field

import torch

from .answers import answer, exercise
from .cache import KVCache, copy_into
from .checks import check_int
from .paged import BlockPool, PagedKVCache


@dataclass(frozen=True)
class Request:
    """One user's request: a prompt, how many tokens to answer, when it arrives (seconds on the clock)."""

    id: int
    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    arrival_s: float = 0.0


@dataclass
class RequestResult:
    """What happened to one request (times in seconds on the serving clock)."""

    id: int
    output_ids: list[int]
    arrival_s: float
    first_token_s: float          # the end of the iteration that produced its first token
    finish_s: float               # the end of the iteration that produced its last token
    prompt_tokens_computed: int   # prompt tokens it ran through the model (fewer when a prefix was shared)

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.arrival_s

    @property
    def tpot_s(self) -> float:
        """Mean seconds per output token after the first (0 for a one-token answer)."""
        n = len(self.output_ids)
        return (self.finish_s - self.first_token_s) / (n - 1) if n > 1 else 0.0


@dataclass
class ServeResult:
    policy: str
    requests: list[RequestResult]
    clock_s: float                          # the clock when the last request finished
    compute_s: float                        # seconds spent in forwards (the clock without idle jumps)
    iteration_tokens: list[int] = field(default_factory=list)   # tokens in each iteration's forward

    @property
    def output_tokens(self) -> int:
        return sum(len(r.output_ids) for r in self.requests)

    @property
    def throughput(self) -> float:
        """Output tokens per second of compute."""
        return self.output_tokens / self.compute_s if self.compute_s > 0 else math.inf

    def percentile(self, what: str, q: float) -> float:
        """The q-th percentile (0-100, nearest rank) of ``"ttft_s"`` or ``"tpot_s"`` over the requests."""
        values = sorted(getattr(r, what) for r in self.requests)
        return values[min(len(values) - 1, max(0, math.ceil(q / 100 * len(values)) - 1))]


def poisson_workload(n_requests: int, rate_per_s: float, vocab_size: int, *, prompt_tokens=(16, 96),
                     new_tokens=(4, 32), shared_prefix: int = 0, seed: int = 0) -> list[Request]:
    """``n_requests`` requests arriving as a Poisson process of ``rate_per_s`` requests per second.

    Prompt and answer lengths are uniform in the given (low, high) ranges of
    tokens; the first ``shared_prefix`` tokens of every prompt are the same
    (a system prompt). The same seed gives the same workload.
    """
    if n_requests < 1 or not rate_per_s > 0 or not math.isfinite(rate_per_s):
        raise ValueError(f"need n_requests >= 1 and a finite rate > 0, got {n_requests}, {rate_per_s}")
    for name, (low, high) in (("prompt_tokens", prompt_tokens), ("new_tokens", new_tokens)):
        if not 1 <= low <= high:
            raise ValueError(f"{name} must be a range (low, high) with 1 <= low <= high, got ({low}, {high})")
    if shared_prefix < 0:
        raise ValueError(f"shared_prefix must be >= 0 tokens, got {shared_prefix}")
    rng = random.Random(seed)
    system = [rng.randrange(vocab_size) for _ in range(shared_prefix)]
    clock, requests = 0.0, []
    for i in range(n_requests):
        clock += rng.expovariate(rate_per_s)
        own = [rng.randrange(vocab_size) for _ in range(rng.randint(*prompt_tokens))]
        requests.append(Request(i, tuple(system + own), rng.randint(*new_tokens), clock))
    return requests


@torch.no_grad()
def ragged_forward(model, segments: list[tuple[KVCache, list[int]]]) -> torch.Tensor:
    """One forward over several sequences' new tokens; the float32 logits of each one's last token.

    segments: (the sequence's cache, its new token ids); each cache gets its
    tokens' keys and values. Returns (len(segments), vocab).
    """
    lengths = [len(ids) for _, ids in segments]
    starts = [cache.length for cache, _ in segments]
    ids = torch.tensor([[t for _, seg in segments for t in seg]])                        # (1, N)
    pos = torch.cat([model.positions(s, n) for s, n in zip(starts, lengths)])            # (N,)
    cos, sin = model.rope_cos[pos], model.rope_sin[pos]                                  # (N, head_dim/2)
    ends = torch.tensor(lengths).cumsum(0).tolist()
    x = model.embed(ids)                                                                 # (1, N, d_model)
    for i, layer in enumerate(model.layers):
        q, k, v = layer.qkv(x, cos, sin)                          # (1, H, N, D), (1, Hkv, N, D)
        out = []
        for (cache, _), s, n, end in zip(segments, starts, lengths, ends):
            k_all, v_all = cache.update(i, k[:, :, end - n:end], v[:, :, end - n:end])   # (1, Hkv, s + n, D)
            out.append(layer.attend(q[:, :, end - n:end], k_all, v_all, pos[end - n:end],
                                    model.positions(0, s + n), model.attention))          # (1, n, d_model)
        x = layer.finish(x, torch.cat(out, dim=1))                # (1, N, d_model)
    return model.head(x[:, [e - 1 for e in ends]])[0]            # (len(segments), vocab)


@dataclass(frozen=True)
class Policy:
    """How a scheduler batches its requests (see the module docstring)."""

    name: str
    joins_running: bool       # a waiting request may join sequences already running (else: only an empty batch)
    chunks_prompts: bool      # an iteration carries at most ``token_budget`` tokens (else: whole prompts)
    leaves_together: bool     # a batch's sequences leave when the last one is done (else: each when it is)


POLICY = {p.name: p for p in (Policy("static", joins_running=False, chunks_prompts=False, leaves_together=True),
                              Policy("continuous", joins_running=True, chunks_prompts=False, leaves_together=False),
                              Policy("chunked", joins_running=True, chunks_prompts=True, leaves_together=False))}
POLICIES = tuple(POLICY)


@dataclass
class Waiting:
    """A request waiting for a seat. ready_s: when it may take one (its arrival, or when its cache is in).

    A request prefilled elsewhere (``toyllm.disagg``) brings its prompt's
    cache, copied into the scheduler's pool when it is seated, and the
    first token it gave at ``first_token_s``.
    """

    request: Request
    ready_s: float
    prefilled: KVCache | None = None
    first_token: int | None = None
    first_token_s: float = math.nan


@dataclass
class _Sequence:
    request: Request
    cache: PagedKVCache
    fed: int                              # prompt tokens in the cache
    computed: int = 0                     # prompt tokens run through the model
    output_ids: list[int] = field(default_factory=list)
    first_token_s: float = math.nan

    @property
    def prefilling(self) -> bool:
        return self.fed < len(self.request.prompt_ids)

    @property
    def done(self) -> bool:
        return len(self.output_ids) >= self.request.max_new_tokens


@answer("8.3", "The serving scheduler")
def plan_iteration(prompt_left: list[int], done: list[bool], token_budget: int | None) -> list[int]:
    """Tokens each running sequence feeds in one iteration: 0 when done, 1 per decode (decodes first),
    then the prompts in order, whole or the chunk ``token_budget`` (None: no limit) still leaves."""
    return exercise("8.3")(prompt_left, done, token_budget)


def check_settings(policy: str, max_batch: int, token_budget: int, block_size: int) -> None:
    """A ValueError naming the first setting of ``serve`` that cannot work."""
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; choose one of {', '.join(POLICIES)}")
    for name, value in (("max_batch", max_batch), ("token_budget", token_budget), ("block_size", block_size)):
        check_int(value, f"{name} must be an int >= 1", 1)
    if POLICY[policy].chunks_prompts and token_budget < max_batch + 1:
        raise ValueError(f"token_budget {token_budget} leaves no room for a prompt chunk beside {max_batch} "
                         f"decodes: give at least max_batch + 1 = {max_batch + 1}")


def serving_pool(model, requests: list[Request], max_batch: int, block_size: int) -> BlockPool:
    """A paged pool for ``requests``, checked first: room for ``max_batch`` of the longest one (in whole blocks
    of ``block_size`` tokens), in the model's dtype. A ValueError when a request cannot be served."""
    if not requests:
        raise ValueError("no requests to serve")
    if any(r.max_new_tokens < 1 or not r.prompt_ids for r in requests):
        raise ValueError("every request needs a prompt and max_new_tokens >= 1")
    cfg = model.config
    longest = max(len(r.prompt_ids) + r.max_new_tokens for r in requests)
    if longest > cfg.max_context:
        raise ValueError(f"a request needs {longest} positions, over the model's max_context {cfg.max_context}")
    return BlockPool.for_model(cfg, max_batch * math.ceil(longest / block_size), block_size,
                               dtype=model.lm_head.weight.dtype)


@dataclass
class Worker:
    """One machine's clock, in seconds: it advances by the measured time of each forward the machine runs."""

    clock: float = 0.0
    compute: float = 0.0                     # seconds in forwards (the clock without its idle waits)
    iteration_tokens: list[int] = field(default_factory=list)    # tokens in each forward

    def forward(self, model, segments: list[tuple[KVCache, list[int]]]) -> torch.Tensor:
        """``ragged_forward`` over ``segments``, timed onto this clock; the logits (len(segments), vocab)."""
        t0 = time.perf_counter()
        logits = ragged_forward(model, segments)
        spent = time.perf_counter() - t0
        self.clock += spent
        self.compute += spent
        self.iteration_tokens.append(sum(len(ids) for _, ids in segments))
        return logits


class Scheduler:
    """Iteration-level scheduling of requests over one paged pool, under a ``Policy``.

    ``add`` queues a request; each ``step`` seats the waiting requests that
    are ready (``admit``), asks ``plan`` for each running sequence's tokens,
    runs them as one timed forward on ``worker`` (``segments``), appends the
    new tokens (``record``) and lets finished sequences go (``retire``). A
    request is seated only when a seat is free and the blocks it can reach
    (prompt and answer, in whole blocks) are not promised to another, so a
    running sequence never finds the pool full. Finished requests are in
    ``finished``, in the order they finished.

    token_budget: tokens per iteration (read only by a policy that chunks
    prompts). plan: what plans an iteration's tokens, as ``plan_iteration``
    (the default). worker: the clock it runs on (a new one by default).
    bar: a progress bar, ticked once per finished request.
    """

    def __init__(self, pool: BlockPool, policy: Policy, max_batch: int, token_budget: int | None = None, *,
                 plan=None, share_prefixes: bool = False, worker: Worker | None = None, bar=None):
        self.pool, self.policy, self.max_batch = pool, policy, max_batch
        self.token_budget = token_budget if policy.chunks_prompts else None       # None: whole prompts
        self.plan_fn = plan_iteration if plan is None else plan
        self.share_prefixes, self.bar = share_prefixes, bar
        self.worker = Worker() if worker is None else worker
        self.waiting: list[Waiting] = []          # by ready_s, then request id
        self.running: list[_Sequence] = []
        self.finished: list[RequestResult] = []
        self.reserved = 0                         # blocks promised to running sequences

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def next_s(self) -> float:
        """When it can next run a forward: now while a sequence runs, else when the first waiting one is ready
        (``math.inf``: nothing is queued)."""
        if self.running:
            return self.worker.clock
        return max(self.worker.clock, self.waiting[0].ready_s) if self.waiting else math.inf

    def add(self, waiting: Waiting) -> None:
        bisect.insort(self.waiting, waiting, key=lambda w: (w.ready_s, w.request.id))

    def _blocks_for(self, request: Request) -> int:
        return math.ceil((len(request.prompt_ids) + request.max_new_tokens) / self.pool.block_size)

    def admit(self) -> None:
        """Seat the waiting requests that are ready, first come first served, while seats and blocks last."""
        if self.running and not self.policy.joins_running:
            return
        while self.waiting and self.waiting[0].ready_s <= self.worker.clock and len(self.running) < self.max_batch:
            need = self._blocks_for(self.waiting[0].request)
            if self.reserved + need > self.pool.n_blocks:
                break
            w = self.waiting.pop(0)
            if w.prefilled is not None:                    # its prompt's K and V, computed elsewhere
                cache = copy_into(w.prefilled, PagedKVCache(self.pool))
            elif self.share_prefixes:                      # whole blocks of an earlier prompt it begins with
                cache = PagedKVCache.for_prompt(self.pool, list(w.request.prompt_ids))
            else:
                cache = PagedKVCache(self.pool)
            self.reserved += need
            self.running.append(_Sequence(w.request, cache, fed=cache.length,
                                          computed=cache.length if w.prefilled is not None else 0,
                                          output_ids=[] if w.first_token is None else [w.first_token],
                                          first_token_s=w.first_token_s))

    def plan(self) -> list[int]:
        """Tokens each running sequence feeds in this iteration (the plan function's answer)."""
        return self.plan_fn([len(seq.request.prompt_ids) - seq.fed for seq in self.running],
                            [seq.done for seq in self.running], self.token_budget)

    def segments(self, counts: list[int]) -> list[tuple[_Sequence, list[int]]]:
        """The new token ids of each sequence that feeds any: its prompt's next ``n`` tokens, or its last token."""
        out = []
        for seq, n in zip(self.running, counts):
            if n and seq.prefilling:                       # a prompt: whole, or the chunk the budget leaves
                out.append((seq, list(seq.request.prompt_ids[seq.fed:seq.fed + n])))
            elif n:                                        # a decode: the token it produced last
                out.append((seq, [seq.output_ids[-1]]))
        return out

    def record(self, segments: list[tuple[_Sequence, list[int]]], logits: torch.Tensor) -> None:
        """Advance each sequence by the tokens it fed; one that reached its prompt's end gets a new token."""
        for (seq, ids), row in zip(segments, logits):
            if seq.prefilling:
                seq.fed += len(ids)
                seq.computed += len(ids)
                if seq.prefilling:
                    continue                               # a chunk that did not reach the prompt's end
                if self.share_prefixes:
                    seq.cache.register_prompt(list(seq.request.prompt_ids))
                seq.first_token_s = self.worker.clock
            seq.output_ids.append(int(row.argmax()))

    def retire(self) -> None:
        """Let the finished sequences go, their blocks back to the pool (a whole batch at once if it leaves
        together)."""
        done = [seq for seq in self.running if seq.done]
        if self.policy.leaves_together and len(done) < len(self.running):
            return
        for seq in done:
            self.running.remove(seq)
            seq.cache.release()
            self.reserved -= self._blocks_for(seq.request)
            r = seq.request
            self.report(RequestResult(r.id, seq.output_ids, r.arrival_s, seq.first_token_s, self.worker.clock,
                                      seq.computed))

    def report(self, result: RequestResult) -> None:
        """Count a finished request (also one finished elsewhere, as a one-token answer of a prefill worker)."""
        self.finished.append(result)
        if self.bar is not None:
            self.bar.update(1)

    def step(self, model) -> None:
        """One iteration: seat who is ready, then one forward; with nothing to run, wait for the next arrival."""
        self.admit()
        if not self.running:
            self.worker.clock = self.next_s                 # nothing to do until the next request is ready
            return
        segments = self.segments(self.plan())
        logits = self.worker.forward(model, [(seq.cache, ids) for seq, ids in segments])
        self.record(segments, logits)
        self.retire()


def serve(model, requests: list[Request], policy: str = "chunked", *, max_batch: int = 8, token_budget: int = 64,
          block_size: int = 16, share_prefixes: bool = False, progress: bool = False,
          plan=None) -> ServeResult:
    """Run ``requests`` on ``model`` under ``policy`` (see the module docstring); greedy decoding.

    max_batch: sequences running at once. token_budget: tokens per iteration
    (``"chunked"`` only). block_size: tokens per KV block; the pool holds
    enough blocks for ``max_batch`` of the longest request, and a request is
    admitted only when the blocks it can reach are free. share_prefixes: a
    prompt that begins like an earlier one reuses its cached whole blocks.
    plan: what plans each iteration's tokens (default ``plan_iteration``,
    Exercise 8.3; the grader passes a submitted one).
    """
    check_settings(policy, max_batch, token_budget, block_size)
    pool = serving_pool(model, requests, max_batch, block_size)
    bar = progress_bar(len(requests), "serving") if progress else None
    scheduler = Scheduler(pool, POLICY[policy], max_batch, token_budget, plan=plan, share_prefixes=share_prefixes,
                          bar=bar)
    for r in requests:
        scheduler.add(Waiting(r, r.arrival_s))
    while scheduler.busy:
        scheduler.step(model)
    if bar is not None:
        bar.close()
    w = scheduler.worker
    return ServeResult(policy, sorted(scheduler.finished, key=lambda r: r.id), w.clock, w.compute, w.iteration_tokens)


def progress_bar(total: int, desc: str):
    """A progress bar of ``total`` requests."""
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="request", desc=desc)
