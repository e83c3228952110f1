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
    # BEGIN SOLUTION 7.1 hint: running end e = s_i + c_i; (2 * e * row_bytes) / bandwidth + latency for every rank but the last
    # idea: each rank but the last sends the prefix it holds, K and V, over a link that costs latency plus bytes over bandwidth
    if not chunks or any(c < 1 for c in chunks) or row_bytes < 1 or bandwidth_bytes_per_s <= 0 or latency_s < 0:
        raise ValueError(f"need positive chunks, row_bytes >= 1, bandwidth > 0 and latency >= 0; got chunks={chunks}, "
                         f"row_bytes={row_bytes}, bandwidth={bandwidth_bytes_per_s}, latency={latency_s}")
    out, end = [], 0
    for c in chunks[:-1]:
        end += c
        out.append(2 * end * row_bytes / bandwidth_bytes_per_s + latency_s)
    return out
    # END SOLUTION


def ring_allgather_s(chunks: list[int], row_bytes: int, bandwidth_bytes_per_s: float, latency_s: float) -> float:
    """Exercise 7.2 (2 points): seconds of TSP's all-gather of K and V as a ring, per layer.

    An all-gather needs pieces of equal size, so every rank pads its K and V
    to the largest chunk: a piece is 2 * max(c) rows. A ring takes p-1 steps;
    in each, every rank passes one piece to its neighbour, all links at
    once, so a step costs one piece's transfer time. Returns a float (0.0
    for one process). Raises ValueError as in Exercise 7.1.
    """
    # BEGIN SOLUTION 7.2 hint: (p - 1) * (2 * max(chunks) * row_bytes / bandwidth + latency)
    # idea: a ring all-gather takes p - 1 steps, each as long as the largest chunk's transfer
    if not chunks or any(c < 1 for c in chunks) or row_bytes < 1 or bandwidth_bytes_per_s <= 0 or latency_s < 0:
        raise ValueError(f"need positive chunks, row_bytes >= 1, bandwidth > 0 and latency >= 0; got chunks={chunks}, "
                         f"row_bytes={row_bytes}, bandwidth={bandwidth_bytes_per_s}, latency={latency_s}")
    p = len(chunks)
    return float((p - 1) * (2 * max(chunks) * row_bytes / bandwidth_bytes_per_s + latency_s))
    # END SOLUTION


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
    # BEGIN SOLUTION 7.3 hint: simulate the ranks one after the other (rank i only waits for rank i-1), keeping per layer when each message arrives; before a send t = max(t, previous send's arrival); the send arrives at t + transfer_s(bytes)
    # idea: walk the layers rank by rank: a rank starts a layer when its previous layer and its incoming message are both done, and its send waits for the link
    cm = cost_model
    p = len(chunks)
    prev_arrival = [0.0] * n_layers          # when rank i-1's layer-l message is at rank i
    t, s = 0.0, 0
    for i, c in enumerate(chunks):
        t, send_done = 0.0, 0.0
        arrival = [0.0] * n_layers
        for layer in range(n_layers):
            t += cm.layer_overhead_s + cm.qkv_s_per_token * c
            if i > 0:
                t = max(t, prev_arrival[layer])
            if i < p - 1:
                t = max(t, send_done)        # the previous layer's buffer must be delivered first
                send_done = arrival[layer] = t + cm.transfer_s(2 * (s + c) * row_bytes)
            t += cm.attn_s_per_dot * c * (s + c) + cm.mlp_s_per_token * c
        prev_arrival, s = arrival, s + c
    return float(t)
    # END SOLUTION


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
    # BEGIN SOLUTION 7.4 hint: if speedup(hi) < 1: None; if speedup(lo) >= 1: lo; else keep speedup(a) < 1 <= speedup(b) and halve [a, b] until b == a + 1
    # idea: the speedup crosses 1 somewhere in the interval: keep one end below 1 and one at or above, and halve the gap
    if lo < 1 or hi < lo:
        raise ValueError(f"need 1 <= lo <= hi, got lo={lo}, hi={hi}")
    if speedup(hi) < 1:
        return None
    if speedup(lo) >= 1:
        return int(lo)
    a, b = lo, hi                            # speedup(a) < 1 <= speedup(b)
    while b - a > 1:
        m = (a + b) // 2
        if speedup(m) >= 1:
            b = m
        else:
            a = m
    return int(b)
    # END SOLUTION
