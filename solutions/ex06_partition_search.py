"""Lesson 06 exercises: searching for a good KV-Runahead partition.

A partition of C tokens over p processes is a list of chunk sizes
``[c_0, ..., c_{p-1}]`` (every c_i >= 1, summing to C); its boundaries are
``[0, c_0, c_0 + c_1, ..., C]``. A cost function ``cost(chunks) -> seconds``
gives the time to first token of a partition: real measured runs, the
simulator, or anything else. The searches below may call it only a limited
number of times: the grader counts the distinct partitions you evaluate.

| exercise | function               | points |
|----------|------------------------|--------|
| 6.1      | search_boundary        | 3      |
| 6.2      | grid_search            | 3      |
| 6.3      | interpolate_partition  | 2      |
| 6.4      | fit_cost_model         | 2      |

Reach this file with ``toyllm.grading.load_exercise("ex06")``; check your
work with ``python -m toyllm grade --only ex06``.

Write each exercise yourself: your answer to Exercise N.M may not call
toyllm's own implementation of it, which ``toyllm.answers.forbidden("N.M")``
lists (a per-layer step run in the engine may not even name it); one
that does scores 0 for that exercise.
"""
from __future__ import annotations

import itertools
import math

from toyllm.partition import chunks_from_boundaries


def search_boundary(cost, context: int, min_stride: int = 1) -> list[int]:
    """Exercise 6.1 (3 points): the best split of ``context`` tokens between two processes.

    cost: a function ``cost([c_0, c_1]) -> seconds`` of a list of two
    Python ints. The boundary b = c_0 may take the values min_stride,
    2 * min_stride, ... below ``context``; ask the cost of no other b.
    Assume the cost, as a function of b, falls and then rises (unimodal,
    no flat stretches). Return ``[b, context - b]`` (Python ints) for the b
    with the lowest cost among those values. Use far fewer evaluations than
    trying every b: a scan of the whole range at a coarse stride, then
    halving the stride around the best point, or a ternary search, both
    need far fewer than the graded limits: at most 100 distinct partitions
    for any context up to 10,000 tokens at min_stride=1, and at most 60
    for 2048 tokens at min_stride=8 (255 candidate boundaries).
    Raises ValueError when context < 2 or min_stride < 1, or when no
    multiple of min_stride lies strictly between 0 and context.
    """
    # BEGIN SOLUTION 6.1 hint: candidates b = k * min_stride, k = 1 .. (context - 1) // min_stride; ternary search on k (or a coarse scan, then halve the stride around the best), remembering costs already computed; stop when 3 or fewer candidates are left and take the best
    # idea: the cost of the boundary falls and then rises, so narrow the interval around the cheapest point instead of trying every boundary
    if context < 2 or min_stride < 1:
        raise ValueError(f"need context >= 2 and min_stride >= 1, got context={context}, min_stride={min_stride}")
    n = (context - 1) // min_stride                       # candidates k = 1 .. n, boundary k * min_stride
    if n < 1:
        raise ValueError(f"no multiple of min_stride={min_stride} lies strictly inside (0, {context})")
    seen: dict[int, float] = {}

    def f(k: int) -> float:
        if k not in seen:
            b = k * min_stride
            seen[k] = cost([b, context - b])
        return seen[k]

    lo, hi = 1, n                                         # the best k lies in [lo, hi]
    while hi - lo > 2:
        m1 = lo + (hi - lo) // 3
        m2 = hi - (hi - lo) // 3
        if f(m1) < f(m2):
            hi = m2 - 1                                   # unimodal: the minimum is left of m2
        else:
            lo = m1 + 1                                   # ... or right of m1
    best = min(range(lo, hi + 1), key=f)
    return [best * min_stride, context - best * min_stride]
    # END SOLUTION


def grid_search(cost, context: int, world_size: int, stride: int, min_stride: int = 1,
                span: int = 2) -> list[int]:
    """Exercise 6.2 (3 points): the hierarchical grid search (stride halving) for any number of processes.

    cost: a function ``cost(chunks) -> seconds`` of a list of world_size
    Python ints. Start at the even split: boundary j (j = 1 .. p-1) at
    ``j * context // world_size``. One level: move each of the p-1 inner
    boundaries by ``o * stride`` tokens, o in {-span, ..., span}, all
    combinations around the best point so far; skip points whose boundaries do not strictly
    increase from 0 to context; keep the cheapest point (the centre itself
    is one of them). Then halve the stride (integer division, never below
    ``min_stride``) and scan again around the new best; the level scanned at
    ``min_stride`` is the last. Return the best chunks (Python ints).
    Evaluate each point once: the graded tests count the distinct
    partitions you try, at most (2 * span + 1) ** (p - 1) per level, and
    allow at most 300 for 3 processes at stride 32 (up to 1200 tokens), 400
    for 3 processes at stride 16 (512 tokens), 1500 for 4 processes at
    stride 16 (1000 tokens), and 4 * 27 for 4 processes at stride 8 with
    span=1 (4 levels of 27 points).
    Raises ValueError when world_size < 2, context < world_size,
    stride < 1 or min_stride < 1.
    """
    # BEGIN SOLUTION 6.2 hint: best = even boundaries; loop: for offsets in itertools.product(range(-span, span + 1), repeat=p - 1) build 0, b_j + o_j * stride ..., context; skip non-increasing; keep the cheapest (remember costs); stop after the level at min_stride, else stride = max(min_stride, stride // 2)
    # idea: start from the even split, try offsets of every boundary at the current stride, keep the cheapest, then halve the stride around it
    p = world_size
    if p < 2 or context < p or stride < 1 or min_stride < 1:
        raise ValueError(f"need world_size >= 2, context >= world_size, stride >= 1 and min_stride >= 1; got "
                         f"context={context}, world_size={world_size}, stride={stride}, min_stride={min_stride}")
    seen: dict[tuple, float] = {}

    def f(bounds: tuple) -> float:
        if bounds not in seen:
            seen[bounds] = cost(chunks_from_boundaries(bounds))
        return seen[bounds]

    best = (0, *(j * context // p for j in range(1, p)), context)
    stride = max(stride, min_stride)
    while True:
        center = best
        for offsets in itertools.product(range(-span, span + 1), repeat=p - 1):
            point = (0, *(b + o * stride for b, o in zip(center[1:-1], offsets)), context)
            if all(lo < hi for lo, hi in zip(point, point[1:])) and f(point) < f(best):
                best = point
        if stride <= min_stride:
            break
        stride = max(min_stride, stride // 2)
    return chunks_from_boundaries(best)
    # END SOLUTION


def interpolate_partition(table: dict[int, list[float]], context: int) -> list[int]:
    """Exercise 6.3 (2 points): chunk sizes for ``context`` tokens from a lookup table (KVR-P).

    table: context length (tokens) -> the best partition found for it, as
    ratios (chunk / context, one per process, summing to 1).
    1. Ratios: the stored ones on an exact match; between two stored lengths
       lo < context < hi, linear interpolation r = (1 - t) r_lo + t r_hi
       with t = (context - lo) / (hi - lo); below the smallest or above the
       largest stored length, that entry's ratios (clamped, never extrapolated).
    2. Chunks that add up to exactly ``context``: share_i = context * r_i / sum(r);
       every rank gets floor(share_i); the tokens left over go one each to
       the ranks with the largest fractional parts (the earlier rank first
       on ties); then any chunk still 0 takes one token from the largest
       chunk (the earliest of equals), so that every rank has a token.
    Returns a list of Python ints. Raises ValueError for an empty table or
    when context is smaller than the number of processes.
    """
    # BEGIN SOLUTION 6.3 hint: keys = sorted(table); clamp with keys[0] / keys[-1]; else find lo < context < hi and mix; floors, then sorted(range(p), key=lambda i: -(share[i] - floor[i])) gets the leftovers; fix zeros from the largest chunk
    # idea: store each searched partition as ratios of its context; a new length mixes the ratios of the two nearest lengths in proportion to its distance from each
    if not table:
        raise ValueError("the lookup table is empty")
    keys = sorted(table)
    p = len(table[keys[0]])
    if context < p:
        raise ValueError(f"context ({context} tokens) is smaller than the number of processes ({p})")
    if context <= keys[0]:
        ratios = list(table[keys[0]])
    elif context >= keys[-1]:
        ratios = list(table[keys[-1]])
    else:
        hi = next(k for k in keys if k >= context)
        lo = keys[keys.index(hi) - 1]
        t = (context - lo) / (hi - lo)
        ratios = [(1 - t) * a + t * b for a, b in zip(table[lo], table[hi])]
    total = sum(ratios)
    shares = [context * r / total for r in ratios]
    chunks = [math.floor(s) for s in shares]
    order = sorted(range(p), key=lambda i: -(shares[i] - chunks[i]))     # stable: earlier rank first on ties
    for i in order[:context - sum(chunks)]:
        chunks[i] += 1
    for i in range(p):
        while chunks[i] < 1:
            donor = max(range(p), key=lambda j: chunks[j])
            chunks[donor] -= 1
            chunks[i] += 1
    return [int(c) for c in chunks]
    # END SOLUTION


def fit_cost_model(samples: list[tuple[float, float, float]]) -> tuple[float, float, float]:
    """Exercise 6.4 (2 points): fit seconds = a * tokens + b * dot_products + c by least squares.

    samples: measurements (tokens, dot_products, seconds), e.g. one rank's
    time for one layer with c_i tokens and c_i (s_i + c_i) query-key pairs.
    Returns a tuple (a, b, c) of Python floats: seconds per token, per dot
    product, and per layer, minimising the sum of squared errors (no
    clipping). Samples without noise must give a, b and c back within a
    relative 1e-6 (or 1e-12 absolute), so work in float64: tokens, dot
    products and 1 differ by orders of magnitude.
    Raises ValueError for fewer than 3 samples.
    """
    # BEGIN SOLUTION 6.4 hint: X = tensor of rows [tokens, dots, 1.0] (float64), y = seconds; torch.linalg.lstsq(X, y[:, None]).solution; return floats
    # idea: time = a x tokens + b x dot products + c is linear in the unknowns: solve the least-squares problem
    import torch

    if len(samples) < 3:
        raise ValueError(f"three coefficients need at least 3 samples, got {len(samples)}")
    X = torch.tensor([[float(t), float(d), 1.0] for t, d, _ in samples], dtype=torch.float64)   # (n, 3)
    y = torch.tensor([[float(s)] for _, _, s in samples], dtype=torch.float64)                  # (n, 1)
    # Scale the columns first: tokens, dot products and 1 differ by orders of magnitude.
    scale = X.abs().amax(dim=0).clamp_min(1e-300)
    coef = torch.linalg.lstsq(X / scale, y, driver="gelsd").solution[:, 0] / scale
    a, b, c = (float(v) for v in coef)
    return a, b, c
    # END SOLUTION
