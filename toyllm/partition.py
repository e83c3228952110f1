"""How to cut a prompt of C tokens into p chunks, one per process, and how to pick the cut.

A partition is a list of chunk sizes ``[c_0, ..., c_{p-1}]`` in tokens, rank i
taking tokens ``[s_i, s_i + c_i)`` where ``s_i = c_0 + ... + c_{i-1}`` is its
prefix. The KV-Runahead paper writes the same thing as boundaries
``[0, s_1, ..., C]``, e.g. ``[0, 9728, 16384]`` for two processes and 16k tokens;
``boundaries_from_chunks`` and ``chunks_from_boundaries`` convert.

Three parts:

1. Counting. With dense attention (all of QK^T, then a mask) rank i of
   KV-Runahead (KVR) computes ``c_i * (s_i + c_i)`` query-key dot products and
   sends its whole K,V prefix on to rank i+1; tensor/sequence parallel
   prefill (TSP) gives every rank all C keys (``c_i * C`` dot products) through
   an all-gather. The paper's 9-token, 3-process example: TSP 27 dot products
   per rank and 36 K/V rows moved; KVR with chunks [4, 3, 2] 16, 21 and 18
   dot products and 22 rows.
2. Searching. An even split is not best for KVR: later ranks attend over
   longer prefixes, earlier ranks must run ahead so later ones never wait.
   ``search_boundary_1d`` (two processes) and ``hierarchical_grid_search``
   (any number) find a good partition for any cost function
   ``cost(chunks) -> seconds``: a simulator (``toyllm.simulate.ttft_cost``)
   or real measured runs (``toyllm.parallel.measured_cost``), both returning
   the TTFT as the time the last rank has the first token.
3. Reusing. ``toyllm.partition_table.PartitionTable`` keeps the best
   partitions found per context length as ratios and interpolates new
   lengths between the two nearest entries (the paper's KVR-P); the
   ratios' rounding to whole chunks is ``partition_from_ratios`` here.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

from .answers import answer, exercise, shortcut
from .checks import check_int, is_int, is_number

METHODS = ("kvr", "tsp")

CostFn = Callable[[list[int]], float]   # chunks (tokens per rank) -> seconds


# --------------------------------------------------------------------------- partitions

def _check_int(value, name: str) -> int:
    """``value`` as an int, or "<name> must be an integer, got ..." (``checks.check_int``)."""
    return check_int(value, f"{name} must be an integer")


def _check_context_and_world(context, world_size) -> tuple[int, int]:
    C = _check_int(context, "context")
    p = _check_int(world_size, "world size")
    if p < 1:
        raise ValueError(f"world size must be at least 1 process, got {p}")
    if C < p:
        raise ValueError(f"world size ({p}) is larger than the context ({C} tokens): "
                         "every process needs at least one token")
    return C, p


def validate_partition(chunks: Sequence[int], context: int | None = None,
                       world_size: int | None = None) -> list[int]:
    """Check a partition and return it as a list of Python ints.

    chunks: tokens per rank, every one a positive integer.
    context: if given, the chunks must add up to it (tokens).
    world_size: if given, there must be exactly this many chunks.
    Raises ValueError saying what is wrong.
    """
    if isinstance(chunks, (str, bytes)) or not hasattr(chunks, "__len__"):
        raise ValueError(f"a partition is a list of chunk sizes (tokens per rank), got {chunks!r}")
    if world_size is not None:
        p = _check_int(world_size, "world size")
        if p < 1:
            raise ValueError(f"world size must be at least 1 process, got {p}")
        if context is not None and p > _check_int(context, "context"):
            raise ValueError(f"world size ({p}) is larger than the context ({context} tokens): "
                             "every process needs at least one token")
        if len(chunks) != p:
            raise ValueError(f"partition {list(chunks)} has {len(chunks)} chunks but the world size is {p}")
    if len(chunks) == 0:
        raise ValueError("a partition needs at least one chunk")
    out = []
    for i, c in enumerate(chunks):
        if not is_int(c):
            raise ValueError(f"chunk {i} of {list(chunks)} is not an integer number of tokens: {c!r}")
        if c < 1:
            raise ValueError(f"chunk {i} of {list(chunks)} is {c}: every rank needs at least one token")
        out.append(int(c))
    if context is not None:
        C = _check_int(context, "context")
        if sum(out) != C:
            raise ValueError(f"partition {out} covers {sum(out)} tokens but the context has {C}")
    return out


def even_partition(context: int, world_size: int) -> list[int]:
    """Split ``context`` tokens over ``world_size`` ranks as evenly as possible.

    Sizes differ by at most one token; the first ``context % world_size`` ranks
    get the extra token (earlier KVR ranks are the cheap ones, so they can
    best afford it). ``even_partition(10, 3) == [4, 3, 3]``.
    """
    C, p = _check_context_and_world(context, world_size)
    base, extra = divmod(C, p)
    return [base + 1 if i < extra else base for i in range(p)]


def zigzag_layout(context: int, world_size: int) -> list[list[tuple[int, int]]]:
    """The zigzag balance: rank r holds pieces r and 2p-1-r of 2p even pieces, as [start, end) token ranges.

    Each rank then owns one piece from each end of the causal triangle, so
    every rank has an equal share of the visible query-key pairs.
    """
    C, p = _check_context_and_world(context, world_size)
    ends = boundaries_from_chunks(even_partition(C, 2 * p))
    return [[(ends[r], ends[r + 1]), (ends[2 * p - 1 - r], ends[2 * p - r])] for r in range(p)]


def zigzag_chunks(context: int, world_size: int) -> list[int]:
    """Tokens per rank under the zigzag balance (``zigzag_layout``)."""
    return [sum(b - a for a, b in runs) for runs in zigzag_layout(context, world_size)]


@shortcut("6.3", student="_partition_by_exercise")
def partition_from_ratios(context: int, ratios: Sequence[float]) -> list[int]:
    """Chunk sizes in proportion to ``ratios`` that add up to exactly ``context``.

    Largest-remainder rounding: every rank gets the floor of its share, then
    the tokens left over go one each to the ranks with the largest fractional
    parts (earlier rank first on ties). A rank whose share rounds to zero is
    given one token, taken from the largest chunk, so every chunk is >= 1.
    Ratios need not sum to 1; they are normalised.
    """
    C, p, r = _checked_ratios(context, ratios)
    total = sum(r)
    shares = [C * x / total for x in r]
    chunks = [math.floor(s) for s in shares]
    left = C - sum(chunks)
    # Ranks sorted by fractional part, largest first; sorted() is stable so earlier ranks win ties.
    order = sorted(range(p), key=lambda i: -(shares[i] - chunks[i]))
    for i in order[:left]:
        chunks[i] += 1
    for i in range(p):
        while chunks[i] < 1:
            donor = max(range(p), key=lambda j: chunks[j])
            chunks[donor] -= 1
            chunks[i] += 1
    return chunks


def _checked_ratios(context: int, ratios: Sequence[float]) -> tuple[int, int, list[float]]:
    """(context, processes, the ratios as floats), or ValueError naming what is wrong."""
    if isinstance(ratios, (str, bytes)) or not hasattr(ratios, "__len__") or len(ratios) == 0:
        raise ValueError(f"ratios must be a non-empty list of positive numbers, got {ratios!r}")
    C, p = _check_context_and_world(context, len(ratios))
    r = []
    for i, x in enumerate(ratios):
        if not is_number(x) or not math.isfinite(x) or x <= 0:
            raise ValueError(f"ratio {i} is {x!r}: ratios must be positive finite numbers")
        r.append(float(x))
    return C, p, r


@answer("6.3", "Splitting a context by ratios", function="interpolate_partition")
def _partition_by_exercise(context: int, ratios: Sequence[float]) -> list[int]:
    """``partition_from_ratios`` in the student edition: Exercise 6.3 rounds the shares, given a lookup
    table whose one entry is these ratios at this context."""
    C, _, r = _checked_ratios(context, ratios)
    return exercise("6.3")({C: r}, C)


def align_boundaries(chunks: Sequence[int], multiple_of: int = 8) -> list[int]:
    """``chunks`` with every inner boundary moved to the nearest multiple of ``multiple_of`` tokens
    (ties round up); the last chunk takes what is left, so they still add up to the same context. Left
    as they are when a chunk would end up empty.

    >>> align_boundaries([1806, 1266])
    [1808, 1264]
    """
    m = _check_int(multiple_of, "multiple_of")
    if m < 1:
        raise ValueError(f"multiple_of must be at least 1 token, got {m}")
    chunks = validate_partition(chunks)
    bounds = boundaries_from_chunks(chunks)
    moved = [0, *(m * ((b + m // 2) // m) for b in bounds[1:-1]), bounds[-1]]
    if any(a >= b for a, b in zip(moved, moved[1:])):            # a chunk would vanish: too short to align
        return chunks
    return chunks_from_boundaries(moved)


def boundaries_from_chunks(chunks: Sequence[int]) -> list[int]:
    """``[4, 3, 2] -> [0, 4, 7, 9]``: where each rank's tokens start, then the end."""
    chunks = validate_partition(chunks)
    return [0, *itertools.accumulate(chunks)]


def chunks_from_boundaries(boundaries: Sequence[int]) -> list[int]:
    """``[0, 9728, 16384] -> [9728, 6656]``. Boundaries start at 0 and strictly increase."""
    if isinstance(boundaries, (str, bytes)) or not hasattr(boundaries, "__len__") or len(boundaries) < 2:
        raise ValueError(f"boundaries are a list [0, s_1, ..., C] of at least two integers, got {boundaries!r}")
    b = [_check_int(x, f"boundary {i}") for i, x in enumerate(boundaries)]
    if b[0] != 0:
        raise ValueError(f"boundaries must start at 0, got {b}")
    chunks = [hi - lo for lo, hi in zip(b, b[1:])]
    if any(c < 1 for c in chunks):
        raise ValueError(f"boundaries must strictly increase (every rank needs a token), got {b}")
    return chunks


def prefixes(chunks: Sequence[int]) -> list[int]:
    """s_i, the number of tokens before rank i's chunk: ``[4, 3, 2] -> [0, 4, 7]``."""
    return boundaries_from_chunks(chunks)[:-1]


# --------------------------------------------------------------------------- analytic counts

def _check_method(method: str) -> str:
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose one of {list(METHODS)}")
    return method


@shortcut("4.1", "4.3", "5.3",
          ships="the counts lesson 04 and 05 state (c_i * C, c_i * (s_i + c_i)) before the exercises put them in "
                "code")
def dot_products(chunks: Sequence[int], method: str) -> list[int]:
    """Query-key dot products per rank and per layer and head, with dense attention.

    kvr: rank i's c_i queries meet its s_i + c_i keys: ``c_i * (s_i + c_i)``.
    tsp: after the all-gather every rank holds all C keys: ``c_i * C``
    (``(C/p) * C`` with an even split). The masked upper triangle is computed
    too, as the dense kernel does; that waste is what KVR's chain trims.
    """
    chunks = validate_partition(chunks)
    _check_method(method)
    C = sum(chunks)
    if method == "tsp":
        return [c * C for c in chunks]
    return [c * (s + c) for c, s in zip(chunks, prefixes(chunks))]


@shortcut("4.3", "5.3",
          ships="the row counts lesson 04 and 05 state before the exercises turn them into bytes")
def kv_rows_sent(chunks: Sequence[int], method: str) -> list[int]:
    """Rows of K plus rows of V each rank puts on the network, per layer.

    A row is one token's key (or value) for every KV head of a layer.
    tsp (all-gather): rank i's c_i rows of K and of V reach each of the p-1
    other ranks: ``2 * c_i * (p - 1)``.
    kvr (chain): rank i < p-1 sends its whole prefix, tokens [0, s_i + c_i),
    to rank i+1: ``2 * (s_i + c_i)``; the last rank sends nothing.
    """
    chunks = validate_partition(chunks)
    _check_method(method)
    p = len(chunks)
    if method == "tsp":
        return [2 * c * (p - 1) for c in chunks]
    ends = boundaries_from_chunks(chunks)[1:]
    return [2 * e if i < p - 1 else 0 for i, e in enumerate(ends)]


def net_tsp(context: int, world_size: int) -> int:
    """Paper's Net_tsp: rows of one tensor (K, or V) that an even TSP all-gather moves, ``(p-1) * C``."""
    C, p = _check_context_and_world(context, world_size)
    return (p - 1) * C


@shortcut("5.3",
          ships="the paper's closed form (p - 1) * C / 2, which lesson 05 states")
def net_kvr_even(context: int, world_size: int) -> float:
    """Paper's Net_kvr for an even split: ``C/p + 2C/p + ... + (p-1)C/p = (p-1) * C / 2`` rows of one tensor.

    Exact when p divides C; half of ``net_tsp``.
    """
    C, p = _check_context_and_world(context, world_size)
    return (p - 1) * C / 2


@answer("5.4", "The TTFT lower bound")
def ttft_lower_bound(ttft1_s: float, world_size: int) -> float:
    """Paper's TTFT*(p) = TTFT(1)/2 * (1/p + 1/p^2), seconds (Exercise 5.4).

    The time on p processes if attention (cost ~ C^2) were perfectly
    balanced and communication free. It is super-linear: p=2 gives
    TTFT(1) * 3/8, better than TTFT(1)/2, because the rectangles of p ranks
    skip most of the masked upper triangle that one process computes.
    """
    return exercise("5.4")(ttft1_s, world_size)


# --------------------------------------------------------------------------- searching

@dataclass
class SearchResult:
    """What a partition search found.

    partition: best chunk sizes (tokens per rank).
    cost_s: the cost function's value there (seconds).
    evaluations: distinct partitions the cost function was called on.
    history: one dict per evaluation, in order: chunks, boundaries, cost_s,
    level (0 = coarsest) and stride (tokens) of the scan that asked for it.
    """

    partition: list[int]
    cost_s: float
    evaluations: int
    history: list[dict] = field(default_factory=list)

    @property
    def boundaries(self) -> list[int]:
        return boundaries_from_chunks(self.partition)


class _MemoCost:
    """Calls ``cost`` once per distinct partition and records every call."""

    def __init__(self, cost: CostFn, bar=None):
        if not callable(cost):
            raise ValueError(f"cost must be a function chunks -> seconds, got {cost!r}")
        self.cost, self.bar = cost, bar
        self.seen: dict[tuple[int, ...], float] = {}
        self.history: list[dict] = []
        self.level, self.stride = 0, 0

    def __call__(self, boundaries: Sequence[int]) -> float:
        key = tuple(boundaries)
        if key not in self.seen:
            chunks = chunks_from_boundaries(key)
            value = float(self.cost(chunks))
            if math.isnan(value):
                raise ValueError(f"cost function returned NaN for partition {chunks}")
            self.seen[key] = value
            self.history.append({"chunks": chunks, "boundaries": list(key), "cost_s": value,
                                 "level": self.level, "stride": self.stride})
            if self.bar is not None:
                self.bar.update(1)
                self.bar.set_postfix(stride=self.stride, best_s=f"{min(self.seen.values()):.4g}")
        return self.seen[key]

    def result(self, best: Sequence[int]) -> SearchResult:
        if self.bar is not None:
            self.bar.close()
        best = tuple(best)
        return SearchResult(chunks_from_boundaries(best), self.seen[best], len(self.seen), self.history)


def _progress_bar(enabled: bool, desc: str):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(desc=desc, unit="eval")


def _strides(context: int, world_size: int, span: int, stride, min_stride) -> tuple[int, int]:
    """Check ``min_stride`` and pick the first stride: ``stride`` if given, else the largest power of
    two <= C / (2 * span * p), so the first grid spans about one even chunk each way."""
    min_stride = _check_int(min_stride, "min_stride")
    if min_stride < 1:
        raise ValueError(f"min_stride must be at least 1 token, got {min_stride}")
    if stride is None:
        target = max(1, context // (2 * span * world_size))
        stride = 1 << (target.bit_length() - 1)
    return max(min_stride, _check_int(stride, "stride")), min_stride


@shortcut("6.1", "6.2", student="_boundary_search_by_exercise")
def search_boundary_1d(cost: CostFn, context: int, min_stride: int = 1, stride: int | None = None,
                       progress: bool = False) -> SearchResult:
    """Best split of ``context`` tokens between two processes, ``[c_0, c_1]``.

    The paper calls this a binary search over the boundary. We do it coarse to
    fine: first scan the boundary at ``stride`` tokens over the whole range
    (default: a power of two near C/8, so about 8 points), keep the best
    point b, then repeatedly halve the stride and look at b - stride and
    b + stride, until the stride is ``min_stride``.

    Why not a pure bisection or ternary search? Each halving step *is* a
    bisection: if TTFT(b) is unimodal, the minimum lies within one stride of
    the best scanned point, and comparing the two neighbours halves that
    interval. The coarse scan first costs a few evaluations more but keeps a
    measured, noisy TTFT curve (not perfectly unimodal) from steering the
    bisection into a wrong half at the very first step.

    Evaluations: about C/stride + 2*log2(stride/min_stride) instead of C-1.
    """
    C = _check_int(context, "context")
    if C < 2:
        raise ValueError(f"two processes need a context of at least 2 tokens, got {C}")
    stride, min_stride = _strides(C, 2, 2, stride, min_stride)
    f = _MemoCost(cost, _progress_bar(progress, "boundary search"))

    # Level 0: the coarse scan, always including the even split.
    f.stride = stride
    candidates = sorted({even_partition(C, 2)[0], *range(stride, C, stride)})
    best = min(candidates, key=lambda b: f((0, b, C)))
    # Then halve the stride around the best point.
    level = 0
    while stride > min_stride:
        stride = max(min_stride, stride // 2)
        level += 1
        f.level, f.stride = level, stride
        for b in (best - stride, best + stride):
            if 0 < b < C and f((0, b, C)) < f((0, best, C)):
                best = b
    return f.result((0, best, C))


@answer("6.1", "The two-process partition search", function="search_boundary")
def _boundary_search_by_exercise(cost: CostFn, context: int, min_stride: int = 1, stride: int | None = None,
                                 progress: bool = False) -> SearchResult:
    """``search_boundary_1d`` in the student edition: Exercise 6.1 searches (``stride`` is unused: the
    exercise picks its own steps); every evaluation is recorded at level 0 and the first stride."""
    C = _check_int(context, "context")
    if C < 2:
        raise ValueError(f"two processes need a context of at least 2 tokens, got {C}")
    f = _MemoCost(cost, _progress_bar(progress, "boundary search"))
    f.stride, min_stride = _strides(C, 2, 2, stride, min_stride)
    first, _ = exercise("6.1")(lambda chunks: f((0, chunks[0], C)), C, min_stride)
    return f.result((0, first, C))


def _grid_setup(cost: CostFn, context: int, world_size: int, stride: int | None, min_stride: int, span: int,
                progress: bool) -> tuple[int, int, int, int, "_MemoCost"]:
    """The checks and the memo shared by both grid searches: (C, p, first stride, min stride, memoised cost)."""
    C, p = _check_context_and_world(context, world_size)
    span = _check_int(span, "span")
    if span < 1:
        raise ValueError(f"span must be at least 1 (grid offsets -span..span), got {span}")
    stride, min_stride = _strides(C, p, span, stride, min_stride)
    return C, p, stride, min_stride, _MemoCost(cost, _progress_bar(progress, f"grid search p={p}"))


@shortcut("6.1", "6.2", student="_grid_search_by_exercise")
def hierarchical_grid_search(cost: CostFn, context: int, world_size: int, stride: int | None = None,
                             min_stride: int = 1, span: int = 2, recenter: bool = True,
                             progress: bool = False) -> SearchResult:
    """Best partition of ``context`` tokens over ``world_size`` processes, by stride halving.

    Start from the even split. At each level, move each of the p-1 inner
    boundaries by ``{-span, ..., span} * stride`` tokens around the current
    best, all combinations at once (with span=2: five values per boundary,
    5^(p-1) grid points per level; the paper's Appendix D writes "(N-1)^5",
    which reads as a slip for 5^(N-1)). Keep the best point, halve the
    stride, scan the smaller grid around it, and stop after the level at
    ``min_stride``. Points whose boundaries are not strictly increasing
    (a rank with no tokens) are skipped.

    recenter: if the best point lies on the edge of the grid, the optimum may
    be outside it, so scan again around it at the same stride before halving.
    Each such repeat strictly lowers the best cost, so the search ends.

    stride: first stride in tokens; default a power of two near C / (2*span*p),
    so the first grid reaches about one even chunk either way
    (C=96, p=3 gives 8, as in the paper's Fig. 6).
    """
    C, p, stride, min_stride, f = _grid_setup(cost, context, world_size, stride, min_stride, span, progress)

    best = tuple(boundaries_from_chunks(even_partition(C, p)))
    if p == 1:
        f(best)
        return f.result(best)
    offsets = list(itertools.product(range(-span, span + 1), repeat=p - 1))
    level = 0
    while True:
        f.level, f.stride = level, stride
        center = best
        best_value = f(center)
        edge = False
        for off in offsets:
            inner = [b + o * stride for b, o in zip(center[1:-1], off)]
            point = (0, *inner, C)
            if any(lo >= hi for lo, hi in zip(point, point[1:])):
                continue                                   # some rank would get no tokens
            value = f(point)
            if value < best_value:
                best, best_value = point, value
                edge = any(abs(o) == span for o in off)
        level += 1
        if recenter and edge and best != center:
            continue                                       # optimum may lie beyond the grid
        if stride <= min_stride:
            break
        stride = max(min_stride, stride // 2)
    return f.result(best)


@answer("6.2", "The partition search", function="grid_search")
def _grid_search_by_exercise(cost: CostFn, context: int, world_size: int, stride: int | None = None,
                             min_stride: int = 1, span: int = 2, recenter: bool = True,
                             progress: bool = False) -> SearchResult:
    """``hierarchical_grid_search`` in the student edition: Exercise 6.2 searches from the same first stride
    (``recenter`` is unused: the exercise's levels are its own); every evaluation is recorded at level 0 and
    the first stride."""
    C, p, stride, min_stride, f = _grid_setup(cost, context, world_size, stride, min_stride, span, progress)
    f.stride = stride
    if p == 1:
        f((0, C))
        return f.result((0, C))
    chunks = exercise("6.2")(lambda chunks: f(boundaries_from_chunks(chunks)), C, p, stride, min_stride, span)
    return f.result(boundaries_from_chunks(chunks))


@shortcut("6.1", "6.2",
          ships="tries every partition: the brute force Exercises 6.1 and 6.2 replace")
def exhaustive_search(cost: CostFn, context: int, world_size: int, stride: int = 1) -> SearchResult:
    """Try every partition whose inner boundaries are multiples of ``stride``: the slow reference.

    There are about (C/stride)^(p-1) / (p-1)! of them; use it for small
    contexts, to check the faster searches, or to draw a whole TTFT surface.
    """
    C, p = _check_context_and_world(context, world_size)
    stride = _check_int(stride, "stride")
    if stride < 1:
        raise ValueError(f"stride must be at least 1 token, got {stride}")
    f = _MemoCost(cost)
    f.stride = stride
    points = [(0, *inner, C) for inner in itertools.combinations(range(stride, C, stride), p - 1)]
    if not points:
        raise ValueError(f"no partition of {C} tokens over {p} ranks has boundaries on multiples of {stride}")
    best = min(points, key=f)
    return f.result(best)


@shortcut("6.1", "6.2",
          ships="picks a search; the searches it calls run the student's 6.1 and 6.2 in the edition")
def search_partition(cost: CostFn, context: int, world_size: int, min_stride: int | None = None,
                     span: int | None = None, progress: bool = False) -> SearchResult:
    """The search to use for ``world_size`` processes: the 1-D boundary search for 2, the grid search above.

    min_stride: the finest step in tokens (default C/256, at least 1).
    span: grid half-width for 3+ processes (default 2 up to 4 processes,
    else 1: 5^7 = 78,125 points per level for 8 processes would take
    minutes even in the simulator, 3^7 = 2,187 take seconds).
    """
    C, p = _check_context_and_world(context, world_size)
    if p < 2:
        raise ValueError(f"a partition search needs at least 2 processes, got world size {p}")
    step = max(1, C // 256) if min_stride is None else min_stride
    if p == 2:
        return search_boundary_1d(cost, C, min_stride=step, progress=progress)
    span = (2 if p <= 4 else 1) if span is None else span
    return hierarchical_grid_search(cost, C, p, min_stride=step, span=span, progress=progress)
