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
    raise NotImplementedError(
        "Exercise 5.1: implement kvr_layer_blocking (idea: the prefix of the earlier ranks arrives "
        "first; your keys go after it; the grown prefix goes on to the next rank; your queries see "
        "every key up to their own position)")


def kvr_layer(layer, x, pos, chain, attention):
    """Exercise 5.2 (3 points): the same layer, with communication overlapped with compute.

    ``chain.irecv()`` posts the receive and returns at once: None on rank 0,
    which receives nothing, and on every other rank a handle whose
    ``wait()`` gives the prefix (k, v); ``chain.isend(k, v)`` queues the
    send and returns. Post the receive *before* the q/k/v projection and
    wait for it only after, so the prefix travels while you compute.
    Returns the same as Exercise 5.1.
    """
    raise NotImplementedError(
        "Exercise 5.2: implement kvr_layer (idea: post the receive before the projection so that "
        "the prefix travels while you compute, and wait for it only when you need it)")


def kvr_counts(chunks: list[int]) -> tuple[list[int], int]:
    """Exercise 5.3 (2 points): KVR's dot products per rank and K/V rows sent, per head and layer.

    Rank i scores its c_i queries against s_i + c_i keys (dense kernel).
    Every rank but the last sends K and V of tokens [0, s_i + c_i) to the next:
    2 * (s_i + c_i) rows. Returns a tuple (list of Python ints, one per
    rank; total rows sent, a Python int).
    Raises ValueError for an empty list or a chunk below 1.
    """
    raise NotImplementedError(
        "Exercise 5.3: implement kvr_counts (idea: rank i scores c_i queries against the s_i + c_i "
        "keys it holds; every rank but the last forwards the whole prefix it holds, K and V)")


def ttft_lower_bound(ttft1_s: float, world_size: int) -> float:
    """Exercise 5.4 (1 point): the paper's TTFT*(p) = TTFT(1) / 2 * (1/p + 1/p^2), in seconds.

    ttft1_s: the one-process time to first token (seconds). Returns
    seconds as a float (no rounding). Raises ValueError for a world size
    below 1 or a negative time.
    """
    raise NotImplementedError(
        "Exercise 5.4: implement ttft_lower_bound (idea: the paper's bound halves the one-process "
        "time and scales it by 1/p + 1/p^2)")
