"""Lesson 04 exercises: parallel prefill with TSP (tensor/sequence parallel).

The prompt of C tokens is cut into chunks c_0, ..., c_{p-1}; rank i owns
tokens [s_i, s_i + c_i), s_i = c_0 + ... + c_{i-1}. In TSP every rank
projects its own tokens, all-gathers every rank's keys and values, and
attends its queries over all C keys with the causal mask.

Units: dot products are query-key pairs summed over nothing else (one per
query token and key token, per head and layer); rows are token rows of K
or of V; bytes are bytes.

| exercise | function                    | points |
|----------|-----------------------------|--------|
| 4.1      | tsp_dot_products            | 2      |
| 4.2      | tsp_layer                   | 4      |
| 4.3      | tsp_kv_bytes_received       | 2      |
| 4.4      | tensor_parallel_bytes_sent  | 2      |

Reach this file with ``toyllm.grading.load_exercise("ex04")``; check your
work with ``python -m toyllm grade --only ex04``.

Write each exercise yourself: your answer to Exercise N.M may not call
toyllm's own implementation of it, which ``toyllm.answers.forbidden("N.M")``
lists (a per-layer step run in the engine may not even name it); one
that does scores 0 for that exercise.
"""
from __future__ import annotations

import torch


def tsp_dot_products(chunks: list[int]) -> list[int]:
    """Exercise 4.1 (2 points): query-key dot products each TSP rank computes, per head and layer.

    chunks: tokens per rank, positive ints. With the dense kernel a rank
    scores each of its c_i queries against all C = sum(chunks) keys (the
    mask is applied afterwards). Returns a list of ints, one per rank.
    Raises ValueError for an empty list or a chunk below 1.
    """
    # BEGIN SOLUTION 4.1 hint: C = sum(chunks); every rank: c_i * C; check the input first
    # idea: with TSP every rank scores its own queries against the keys of the whole context
    if not chunks or any(int(c) != c or c < 1 for c in chunks):
        raise ValueError(f"chunks must be a non-empty list of positive integers, got {chunks!r}")
    C = sum(chunks)
    return [int(c) * C for c in chunks]
    # END SOLUTION


def tsp_layer(layer, x, pos, comm, attention):
    """Exercise 4.2 (4 points): one TSP layer on one rank, run inside the real engine.

    layer: a ``toyllm.model.Block`` with ``qkv(x, cos, sin) -> q, k, v``,
    ``attend(q, k, v, q_pos, k_pos, attention)`` and ``finish(x, attn_out)``.
    x: this rank's hidden states (B, c_i, d_model). pos: ``RankPositions``
    (``q_pos`` (c_i,), ``cos``, ``sin``, ``start`` = s_i, ``context`` = C).
    comm: ``comm.all_gather(k, v)`` returns every rank's k and v, (B, Hkv, c_j, D)
    each, as two lists in rank order. attention: the kernel to pass to attend.
    Returns (layer output (B, c_i, d_model), k and v of the whole context
    (B, Hkv, C, D), row t holding token t: rank 0's tokens first).
    Test it with ``parallel_prefill(..., step=ex04.tsp_layer)``.
    """
    # BEGIN SOLUTION 4.2 hint: layer.qkv with pos.cos and pos.sin gives q, k, v; ks, vs = comm.all_gather(k, v); concatenate along the token dim (-2); keys sit at positions 0..C-1; layer.finish(x, layer.attend(...))
    # idea: project your own tokens, collect every rank's keys and values in rank order, attend with the causal mask at absolute positions, finish the layer
    q, k, v = layer.qkv(x, pos.cos, pos.sin)
    ks, vs = comm.all_gather(k, v)
    k_all, v_all = torch.cat(ks, dim=-2), torch.cat(vs, dim=-2)
    k_pos = torch.arange(k_all.shape[-2], device=x.device)
    out = layer.attend(q, k_all, v_all, pos.q_pos, k_pos, attention)
    return layer.finish(x, out), k_all, v_all
    # END SOLUTION


def tsp_kv_bytes_received(chunks: list[int], n_kv_heads: int, head_dim: int, bytes_per_value: float = 2) -> list[float]:
    """Exercise 4.3 (2 points): bytes of K and V each rank receives in one layer's all-gather.

    Rank i receives the K and V rows of every token it does not own: C - c_i
    rows of K and as many of V, each row n_kv_heads * head_dim values of
    bytes_per_value bytes (which may be fractional: 0.5 for 4-bit values).
    (A real all-gather pads unequal chunks; count only the real rows.)
    Returns a list of floats, one per rank.
    """
    # BEGIN SOLUTION 4.3 hint: 2 (K and V) * (C - c_i) * n_kv_heads * head_dim * bytes_per_value
    # idea: a rank receives the keys and values of every token it does not hold itself
    C = sum(chunks)
    return [float(2 * (C - c) * n_kv_heads * head_dim * bytes_per_value) for c in chunks]
    # END SOLUTION


def tensor_parallel_bytes_sent(tokens: int, d_model: int, world_size: int, bytes_per_value: float = 2) -> float:
    """Exercise 4.4 (2 points): bytes one rank sends per layer in Megatron tensor parallelism.

    Each layer ends its attention and its MLP with an all-reduce of the
    activations, tokens x d_model values. A ring all-reduce of N bytes sends
    2 * (p - 1) / p * N bytes from every rank (reduce-scatter, then
    all-gather). One process (p = 1) sends nothing. Returns a float.
    """
    # BEGIN SOLUTION 4.4 hint: 2 all-reduces per layer, each 2 * (p - 1) / p * tokens * d_model * bytes_per_value
    # idea: Megatron's tensor parallel layer ends its attention and its MLP with an all-reduce; a ring all-reduce moves 2(p - 1)/p of the data per process
    n_bytes = tokens * d_model * bytes_per_value
    return float(2 * 2 * (world_size - 1) / world_size * n_bytes)
    # END SOLUTION
