"""Lesson 07 exercises: networks and scale.

A message of n bytes over a link of bandwidth B bytes/s with latency L
seconds takes ``n / B + L`` seconds. One "row" is one token's key (or its
value) for all KV heads of one layer: ``row_bytes = n_kv_heads * head_dim *
bytes_per_value``. Partitions are chunk sizes ``[c_0, ..., c_{p-1}]`` with
prefixes s_i = c_0 + ... + c_{i-1}.

| exercise | function            | points |
|----------|---------------------|--------|
| 7.1      | chain_transfer_s    | 2      |
| 7.2      | ring_allgather_s    | 2      |
| 7.3      | kvr_ttft            | 3      |
| 7.4      | break_even_context  | 3      |

Reach this file with ``toyllm.grading.load_exercise("ex07")``; check your
work with ``python -m toyllm grade --only ex07``.

Write each exercise yourself: your answer to Exercise N.M may not call
toyllm's own implementation of it, which ``toyllm.answers.forbidden("N.M")``
lists (a per-layer step run in the engine may not even name it); one
that does scores 0 for that exercise.
"""
from __future__ import annotations


def chain_transfer_s(chunks: list[int], row_bytes: int, bandwidth_bytes_per_s: float,
                     latency_s: float) -> list[float]:
    """Exercise 7.1 (2 points): seconds each KV-Runahead message takes, per layer.

    Rank i < p-1 sends K and V of tokens [0, s_i + c_i) to rank i+1: 2 (s_i + c_i)
    rows. Returns a list of p-1 floats (seconds), the message from rank 0
    to 1 first (an empty list for one process). Raises ValueError for an
    empty partition, a chunk below 1, row_bytes below 1, a bandwidth <= 0
    or a negative latency.
    """
    raise NotImplementedError(
        "Exercise 7.1: implement chain_transfer_s (idea: each rank but the last sends the prefix it"
        " holds, K and V, over a link that costs latency plus bytes over bandwidth)")


def ring_allgather_s(chunks: list[int], row_bytes: int, bandwidth_bytes_per_s: float, latency_s: float) -> float:
    """Exercise 7.2 (2 points): seconds of TSP's all-gather of K and V as a ring, per layer.

    An all-gather needs pieces of equal size, so every rank pads its K and V
    to the largest chunk: a piece is 2 * max(c) rows. A ring takes p-1 steps;
    in each, every rank passes one piece to its neighbour, all links at
    once, so a step costs one piece's transfer time. Returns a float (0.0
    for one process). Raises ValueError as in Exercise 7.1.
    """
    raise NotImplementedError(
        "Exercise 7.2: implement ring_allgather_s (idea: a ring all-gather takes p - 1 steps, each "
        "as long as the largest chunk's transfer)")


def kvr_ttft(chunks: list[int], n_layers: int, row_bytes: int, cost_model) -> float:
    """Exercise 7.3 (3 points): the time to first token of overlapped KV-Runahead, simulated.

    cost_model: a ``toyllm.simulate.CostModel``; use its ``layer_overhead_s``,
    ``qkv_s_per_token``, ``attn_s_per_dot``, ``mlp_s_per_token`` and
    ``transfer_s(n_bytes)`` (= n_bytes / bandwidth + latency). Dense
    attention: rank i computes c_i (s_i + c_i) dot products.
    Every rank starts at time 0 and, for each layer l in order:
    1. computes for ``layer_overhead_s + qkv_s_per_token * c_i`` seconds;
    2. (i > 0) waits until rank i-1's layer-l message has arrived;
    3. (i < p-1) waits until its own previous send has arrived, then starts
       sending 2 (s_i + c_i) rows of ``row_bytes``; that message arrives
       ``transfer_s(bytes)`` later, while the rank goes on at once;
    4. computes attention, ``attn_s_per_dot * c_i * (s_i + c_i)``, then
       ``mlp_s_per_token * c_i``.
    The first token is ready when the last rank finishes its last layer:
    return that time in seconds (a float).
    """
    raise NotImplementedError(
        "Exercise 7.3: implement kvr_ttft (idea: walk the layers rank by rank: a rank starts a "
        "layer when its previous layer and its incoming message are both done, and its send waits "
        "for the link)")


def break_even_context(speedup, lo: int, hi: int) -> int | None:
    """Exercise 7.4 (3 points): the shortest context for which parallel prefill pays.

    speedup: a function ``speedup(context) -> TTFT on one process / TTFT in
    parallel``, assumed to grow with the context; call it with Python ints
    only. Return the smallest
    integer context in [lo, hi] with speedup(context) >= 1 (a Python int),
    or None when even ``hi`` does not reach 1. Bisect: about log2(hi - lo)
    calls, not one per context; the graded tests allow at most
    2 * (hi - lo).bit_length() + 4 distinct contexts (34 for lo=16,
    hi=32768). Raises ValueError when lo < 1 or hi < lo.
    """
    raise NotImplementedError(
        "Exercise 7.4: implement break_even_context (idea: the speedup crosses 1 somewhere in the "
        "interval: keep one end below 1 and one at or above, and halve the gap)")
