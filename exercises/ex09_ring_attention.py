"""Lesson 09 exercises: ring attention.

Every rank keeps its own queries; blocks of keys and values travel round a
ring of p ranks, one step at a time, while each rank attends its queries to
the block in hand. Attention over one block gives a partial output and each
query's log-sum-exp; partials over disjoint sets of keys merge exactly, so
the ranks end with one process's result.

| exercise | function            | points |
|----------|---------------------|--------|
| 9.1      | merge               | 2      |
| 9.2      | block_attention     | 2      |
| 9.3      | ring_pass_kv_layer  | 4      |
| 9.4      | ring_traffic        | 2      |

Reach this file with ``toyllm.grading.load_exercise("ex09")``; check your
work with ``python -m toyllm grade --only ex09``.

Write each exercise yourself: your answer to Exercise N.M may not call
toyllm's own implementation of it, which ``toyllm.answers.forbidden("N.M")``
lists (a per-layer step run in the engine may not even name it); one
that does scores 0 for that exercise.
"""
from __future__ import annotations

import torch

from toyllm.attention import causal_mask


def merge(a, b):
    """Exercise 9.1 (2 points): two partial attentions over disjoint sets of keys, as one.

    a, b: pairs (out, lse). out (B, H, T, D) is the attention output over
    one set of keys (its softmax normalised over that set alone); lse
    (B, H, T, float32) is the log of that set's sum of exp(score). A row
    that saw no key of a set has out 0 and lse -inf there, and must weigh
    nothing. Returns (out, lse) over both sets: out in a's dtype, lse float32;
    a row that saw no key in either gets out 0 and lse -inf (never nan).
    """
    raise NotImplementedError(
        "Exercise 9.1: implement merge (idea: each side's softmax was divided by its own sum; the "
        "joint sum adds the two sums, so each side is rescaled by its share of the joint sum)")


def block_attention(q, k, v, q_pos, k_pos):
    """Exercise 9.2 (2 points): attention of q over one block of keys, causal by positions, with the lse.

    q (B, H, T, D); k, v (B, Hkv, S, D), where Hkv divides H (grouped-query
    attention: query head h reads K/V head h // (H // Hkv)). q_pos (T,) and
    k_pos (S,) are absolute positions: the query at position i sees the keys
    at positions <= i (``toyllm.attention.causal_mask`` from lesson 02). Scores
    are scaled by 1 / sqrt(D). Returns out (B, H, T, D) in q's dtype and
    lse (B, H, T) in float32, the log-sum-exp of each query's visible scores;
    a query that sees none of the keys gets out 0 and lse -inf, never nan.
    """
    raise NotImplementedError(
        "Exercise 9.2: implement block_attention (idea: the scores of every pair, the keys in a "
        "query's future set to -inf, then each row's log-sum-exp; the weights are exp(score - lse),"
        " and a row with no visible key gives nothing)")


def ring_pass_kv_layer(layer, x, pos, ring, attention):
    """Exercise 9.3 (4 points): one layer of ring attention (pass-KV) on one rank, inside the real engine.

    layer, x, pos and attention are as in Exercise 4.2 (``pos.q_pos``: this
    rank's positions; ``pos.layout[r]``: rank r's). ring: ``ring.world_size``
    (p); ``ring.origin(step)`` is the rank whose block is in hand at ring
    step ``step`` (your own at step 0); ``ring.pass_on(step, k, v)`` sends the
    block in hand to the next rank and posts the receive of the next one,
    returning a handle whose ``wait()`` gives it as (k, v);
    ``ring.attend(q, k, v, q_pos, k_pos, attention)`` is the attention of
    your queries over one block, (out, lse), as in Exercise 9.2;
    ``layer.project(out)`` turns the merged out (B, H, c_r, D) into the
    attention output (B, c_r, d_model) that ``layer.finish`` takes. Each of
    the p steps: first send the block on (except at the last step: p - 1
    sends per layer, each begun before the attention over that block, as
    the timeline shows), then attend to the block in hand, one
    ``ring.attend`` call, unless every key of it is in the
    future of all your queries (skip it: no call, no dot products), merge
    (Exercise 9.1), then take the block that arrived. Returns (layer output
    (B, c_r, d_model), this rank's own k and v (B, Hkv, c_r, D), which stay
    in its KV cache).
    """
    raise NotImplementedError(
        "Exercise 9.3: implement ring_pass_kv_layer (idea: your queries stay; each step, send the "
        "block in hand on before attending to it so that the next one travels while you compute; a "
        "block whose first key comes after your last query holds nothing you can see)")


def ring_traffic(new_tokens: int, cached_tokens: int, n_heads: int, n_kv_heads: int, head_dim: int,
                 world_size: int, bytes_per_value: int = 4) -> dict:
    """Exercise 9.4 (2 points): bytes all links carry in one layer for pass-KV and pass-Q, and the choice.

    C = new_tokens continue N = cached_tokens already cached on the p =
    world_size ranks (N = 0: a whole prompt). Pass-KV: the keys and values
    (2 * Hkv * D values per token) of all N + C tokens reach the p - 1 other
    ranks. Pass-Q: the queries of the C new tokens (H * D values each) reach
    the p - 1 other ranks, and their partial outputs come back with one lse
    per head (H * (D + 1) values each). Returns {"kv": int bytes, "q": int
    bytes, "choose": "kv" or "q"}: the pass that sends fewer bytes, "kv"
    on a tie. Raises ValueError for an argument that is not an int (a
    float such as 10.5 or a bool included), new_tokens or world_size below
    1, cached_tokens below 0, head counts or sizes below 1, or n_kv_heads
    that does not divide n_heads.
    """
    raise NotImplementedError(
        "Exercise 9.4: implement ring_traffic (idea: count what crosses the links: pass-KV moves "
        "every token's keys and values, cached ones too; pass-Q moves only the new tokens' queries,"
        " and their partial outputs back)")
