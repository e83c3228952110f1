"""Lesson 05 exercises: KV-Runahead.

Rank i receives the keys and values of tokens [0, s_i) from rank i-1,
appends its own, attends over those s_i + c_i keys with the causal mask,
and sends the grown prefix on to rank i+1. The last rank ends up with the
KV cache of the whole context and produces the first token.

| exercise | function                 | points |
|----------|--------------------------|--------|
| 5.1      | kvr_layer_blocking       | 4      |
| 5.2      | kvr_layer                | 3      |
| 5.3      | kvr_counts               | 2      |
| 5.4      | ttft_lower_bound         | 1      |

Reach this file with ``toyllm.grading.load_exercise("ex05")``; check your
work with ``python -m toyllm grade --only ex05``.

Write each exercise yourself: your answer to Exercise N.M may not call
toyllm's own implementation of it, which ``toyllm.answers.forbidden("N.M")``
lists (a per-layer step run in the engine may not even name it); one
that does scores 0 for that exercise.
"""
from __future__ import annotations

import torch


def kvr_layer_blocking(layer, x, pos, chain, attention):
    """Exercise 5.1 (4 points): one KV-Runahead layer on one rank, blocking, inside the real engine.

    chain: ``chain.recv()`` blocks until rank i-1's prefix arrives and
    returns (k, v), each (B, Hkv, s_i, D), or None on rank 0;
    ``chain.send(k, v)`` sends to rank i+1 (it does nothing on the last rank).
    The other arguments are as in Exercise 4.2. Receive first, then project,
    concatenate the prefix before your own keys and values, send the result
    on, attend over keys at positions 0 .. s_i + c_i - 1, finish the layer.
    Returns (layer output (B, c_i, d_model), k and v (B, Hkv, s_i + c_i, D),
    row t holding token t). The last rank's k and v are the whole prompt's:
    decoding goes on from them.
    """
    # BEGIN SOLUTION 5.1 hint: prefix = chain.recv(); layer.qkv with pos.cos and pos.sin gives q, k, v; if prefix: k = torch.cat([prefix[0], k], -2) (same for v); chain.send(k, v); keys at torch.arange(k.shape[-2]); layer.finish(x, layer.attend(...))
    # idea: the prefix of the earlier ranks arrives first; your keys go after it; the grown prefix goes on to the next rank; your queries see every key up to their own position
    prefix = chain.recv()
    q, k, v = layer.qkv(x, pos.cos, pos.sin)
    if prefix is not None:
        k, v = torch.cat([prefix[0], k], dim=-2), torch.cat([prefix[1], v], dim=-2)
    chain.send(k, v)
    k_pos = torch.arange(k.shape[-2], device=x.device)
    out = layer.attend(q, k, v, pos.q_pos, k_pos, attention)
    return layer.finish(x, out), k, v
    # END SOLUTION


def kvr_layer(layer, x, pos, chain, attention):
    """Exercise 5.2 (3 points): the same layer, with communication overlapped with compute.

    ``chain.irecv()`` posts the receive and returns at once: None on rank 0,
    which receives nothing, and on every other rank a handle whose
    ``wait()`` gives the prefix (k, v); ``chain.isend(k, v)`` queues the
    send and returns. Post the receive *before* the q/k/v projection and
    wait for it only after, so the prefix travels while you compute.
    Returns the same as Exercise 5.1.
    """
    # BEGIN SOLUTION 5.2 hint: incoming = chain.irecv() before layer.qkv; after it: if incoming is not None: k_prev, v_prev = incoming.wait(); then concatenate, chain.isend(k, v), attend, finish
    # idea: post the receive before the projection so that the prefix travels while you compute, and wait for it only when you need it
    incoming = chain.irecv()
    q, k, v = layer.qkv(x, pos.cos, pos.sin)
    if incoming is not None:
        k_prev, v_prev = incoming.wait()
        k, v = torch.cat([k_prev, k], dim=-2), torch.cat([v_prev, v], dim=-2)
    chain.isend(k, v)
    k_pos = torch.arange(k.shape[-2], device=x.device)
    out = layer.attend(q, k, v, pos.q_pos, k_pos, attention)
    return layer.finish(x, out), k, v
    # END SOLUTION


def kvr_counts(chunks: list[int]) -> tuple[list[int], int]:
    """Exercise 5.3 (2 points): KVR's dot products per rank and K/V rows sent, per head and layer.

    Rank i scores its c_i queries against s_i + c_i keys (dense kernel).
    Every rank but the last sends K and V of tokens [0, s_i + c_i) to the next:
    2 * (s_i + c_i) rows. Returns a tuple (list of Python ints, one per
    rank; total rows sent, a Python int).
    Raises ValueError for an empty list or a chunk below 1.
    """
    # BEGIN SOLUTION 5.3 hint: running prefix s; dots c * (s + c); rows 2 * (s + c) for every rank but the last
    # idea: rank i scores c_i queries against the s_i + c_i keys it holds; every rank but the last forwards the whole prefix it holds, K and V
    if not chunks or any(int(c) != c or c < 1 for c in chunks):
        raise ValueError(f"chunks must be a non-empty list of positive integers, got {chunks!r}")
    dots, rows, s = [], 0, 0
    for i, c in enumerate(chunks):
        dots.append(int(c) * (s + int(c)))
        if i < len(chunks) - 1:
            rows += 2 * (s + int(c))
        s += int(c)
    return dots, rows
    # END SOLUTION


def ttft_lower_bound(ttft1_s: float, world_size: int) -> float:
    """Exercise 5.4 (1 point): the paper's TTFT*(p) = TTFT(1) / 2 * (1/p + 1/p^2), in seconds.

    ttft1_s: the one-process time to first token (seconds). Returns
    seconds as a float (no rounding). Raises ValueError for a world size
    below 1 or a negative time.
    """
    # BEGIN SOLUTION 5.4 hint: half of ttft1_s, times 1/p plus 1/p squared; validate first
    # idea: the paper's bound halves the one-process time and scales it by 1/p + 1/p^2
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1 process, got {world_size}")
    if ttft1_s < 0:
        raise ValueError(f"ttft1_s must be a non-negative time in seconds, got {ttft1_s}")
    return ttft1_s / 2 * (1 / world_size + 1 / world_size ** 2)
    # END SOLUTION
