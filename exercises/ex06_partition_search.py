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
    raise NotImplementedError(
        "Exercise 6.1: implement search_boundary (idea: the cost of the boundary falls and then "
        "rises, so narrow the interval around the cheapest point instead of trying every boundary)")


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
    raise NotImplementedError(
        "Exercise 6.2: implement grid_search (idea: start from the even split, try offsets of every"
        " boundary at the current stride, keep the cheapest, then halve the stride around it)")


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
    raise NotImplementedError(
        "Exercise 6.3: implement interpolate_partition (idea: store each searched partition as "
        "ratios of its context; a new length mixes the ratios of the two nearest lengths in "
        "proportion to its distance from each)")


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
    raise NotImplementedError(
        "Exercise 6.4: implement fit_cost_model (idea: time = a x tokens + b x dot products + c is "
        "linear in the unknowns: solve the least-squares problem)")
