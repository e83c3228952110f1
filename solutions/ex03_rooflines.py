"""Lesson 03 exercises: rooflines, step time and memory.

An operation is compute-bound when it does more FLOPs per byte it moves
(its *arithmetic intensity*) than the hardware's FLOP/s per byte/s of
memory bandwidth, and memory-bound otherwise. A decode step reads every
parameter and every sequence's KV cache once, so memory bandwidth sets a
floor under its time; batching shares the parameter reads, memory capacity
caps the batch. These functions recompute the numbers of the scaling-book
chapter's pop quiz and its LLaMA-2-13B tables.

Units: FLOPs count a multiply and an add as two; bytes are bytes; times
are seconds; bandwidths are bytes per second.

| exercise | function                     | points |
|----------|------------------------------|--------|
| 3.1      | matmul_intensity             | 2      |
| 3.2      | attention_intensity          | 2      |
| 3.3      | min_step_time_s              | 2      |
| 3.4      | step_time_s                  | 2      |
| 3.5      | max_throughput_tokens_per_s  | 2      |
| 3.6      | max_batch_size               | 2      |

Reach this file with ``toyllm.grading.load_exercise("ex03")``; check your
work with ``python -m toyllm grade --only ex03``.

Write each exercise yourself: your answer to Exercise N.M may not call
toyllm's own implementation of it, which ``toyllm.answers.forbidden("N.M")``
lists (a per-layer step run in the engine may not even name it); one
that does scores 0 for that exercise.
"""
from __future__ import annotations

import math


def matmul_intensity(B: int, D: int, F: int, bytes_per_value: float = 2) -> float:
    """Exercise 3.1 (2 points): FLOPs per byte of a [B, D] x [D, F] matmul.

    FLOPs: 2 * B * D * F (one multiply and one add per term).
    Bytes: read both inputs and write the [B, F] output, bytes_per_value
    each: bytes_per_value * (B*D + D*F + B*F).
    When B is much smaller than D and F the weight matrix dominates the
    traffic and the intensity is about 2B / bytes_per_value: about B in
    bf16 (a batch of one token does about one FLOP per byte), B/2 in float32.
    Returns a float (no rounding), e.g. matmul_intensity(2, 3, 4) = 48/52.
    Raises ValueError if a dimension is < 1 or bytes_per_value <= 0.
    """
    # BEGIN SOLUTION 3.1 hint: 2 x B x D x F FLOPs over the bytes moved: bytes_per_value for every element of the two inputs and the output (B x D, D x F, B x F)
    # idea: intensity is FLOPs divided by bytes moved: count the multiply-adds, and the bytes of both inputs and the output
    if min(B, D, F) < 1:
        raise ValueError(f"B, D and F must be at least 1, got B={B}, D={D}, F={F}")
    if bytes_per_value <= 0:
        raise ValueError(f"bytes_per_value must be positive, got {bytes_per_value}")
    return 2 * B * D * F / (bytes_per_value * (B * D + D * F + B * F))
    # END SOLUTION


def attention_intensity(S: int, T: int) -> float:
    """Exercise 3.2 (2 points): FLOPs per byte of one head's fused attention, T queries over S keys (16-bit).

    FLOPs: 2*S*T*D for q k^T plus 2*S*T*D for the weights times v.
    Bytes of a fused (flash-style) kernel, whose S x T scores stay in fast
    on-chip memory and are never written out: read q (T x D), k and v
    (S x D each), write the output (T x D), 2 bytes per value:
    4*S*D + 4*T*D. The head_dim D (and the batch) cancel: S*T / (S + T).
    Prefill (S = T): T/2, so long prompts are compute-bound with such a
    kernel (a dense kernel that writes the scores stays near D instead).
    Decode (T = 1, S large): about 1, memory-bound however long the context.
    Returns a float (no rounding): attention_intensity(10, 10) = 5.0.
    Raises ValueError if S or T is < 1.
    """
    # BEGIN SOLUTION 3.2 hint: 4*S*T*D FLOPs over 4*(S+T)*D bytes; D cancels
    # idea: with a fused kernel the scores never leave the chip, so only q, k, v and the output cost bytes; the head size cancels
    if S < 1 or T < 1:
        raise ValueError(f"S (keys) and T (queries) must be at least 1, got S={S}, T={T}")
    return S * T / (S + T)
    # END SOLUTION


def min_step_time_s(param_bytes: float, kv_bytes_per_seq: float, batch: int,
                    hbm_bandwidth_bytes_per_s: float) -> float:
    """Exercise 3.3 (2 points): lower bound on one decode step's time, in seconds, when memory-bound.

    Every step reads all parameters once and the KV cache of each of the
    batch sequences once, at hbm_bandwidth_bytes_per_s:
    (batch * kv_bytes_per_seq + param_bytes) / bandwidth.
    Example (the pop quiz): 30e9 bytes of int8 weights, 819.2e6 bytes of KV
    per sequence (100 kB/token x 8192 tokens), batch 4, 16 chips x 8.1e11 B/s:
    0.002567... s, 2.57 ms (the source rounds it to 2.5 ms).
    Returns seconds as a float (no rounding).
    Raises ValueError for a negative batch or a bandwidth that is not positive.
    """
    # BEGIN SOLUTION 3.3 hint: the bytes read per step (the parameters once, plus every sequence's KV cache) over the HBM bandwidth
    # idea: a memory-bound step reads every weight once and every sequence's KV cache once
    if batch < 0:
        raise ValueError(f"batch must be >= 0, got {batch}")
    if hbm_bandwidth_bytes_per_s <= 0:
        raise ValueError(f"hbm_bandwidth_bytes_per_s must be positive, got {hbm_bandwidth_bytes_per_s}")
    return (batch * kv_bytes_per_seq + param_bytes) / hbm_bandwidth_bytes_per_s
    # END SOLUTION


def step_time_s(param_bytes: float, kv_bytes_per_seq: float, batch: int, hbm_bandwidth_bytes_per_s: float,
                param_count: float, peak_flops: float) -> float:
    """Exercise 3.4 (2 points): decode step time in seconds once big batches make the matmuls compute-bound.

    Attention reads every KV cache and stays bandwidth-bound:
    batch * kv_bytes_per_seq / bandwidth. The matmuls take the longer of
    loading the weights (param_bytes / bandwidth) and doing the arithmetic
    (2 * batch * param_count FLOPs at peak_flops FLOP/s).
    Example (the pop quiz, 1.97e14 bf16 FLOP/s per chip): batch 4 2.57 ms
    (memory-bound, as before), batch 256 about 21 ms (21.05).
    Returns seconds as a float (no rounding).
    Raises ValueError for a negative batch or a non-positive bandwidth or peak_flops.
    """
    # BEGIN SOLUTION 3.4 hint: attention: every cache read once at the bandwidth; matmuls: the longer of their arithmetic (2 * batch * param_count FLOPs at peak) and loading the weights; add the two
    # idea: attention stays memory-bound; the matmuls take whichever is longer, loading the weights or doing the arithmetic
    if batch < 0:
        raise ValueError(f"batch must be >= 0, got {batch}")
    if hbm_bandwidth_bytes_per_s <= 0 or peak_flops <= 0:
        raise ValueError(f"bandwidth and peak_flops must be positive, got {hbm_bandwidth_bytes_per_s} "
                         f"and {peak_flops}")
    attention = batch * kv_bytes_per_seq / hbm_bandwidth_bytes_per_s
    matmuls = max(2 * batch * param_count / peak_flops, param_bytes / hbm_bandwidth_bytes_per_s)
    return attention + matmuls
    # END SOLUTION


def max_throughput_tokens_per_s(param_bytes: float, kv_bytes_per_seq: float, batch: int,
                                hbm_bandwidth_bytes_per_s: float) -> float:
    """Exercise 3.5 (2 points): upper bound on decode throughput in tokens per second.

    Each step produces one token for each of the batch sequences and takes
    at least ``min_step_time_s``: batch / min step time. More sequences
    share each read of the weights, so throughput grows with the batch,
    with diminishing returns once the KV caches dominate the bytes.
    Example (LLaMA-2-13B on 8 TPU v5e, 26 GB of bf16 weights, 6.7 GB of KV
    per sequence, 8 x 8.2e11 B/s): batch 1 about 200.6 tokens/s, batch 240
    about 963.5. This bound ignores the arithmetic: once the matmuls turn
    compute-bound, batch / ``step_time_s`` is the tighter one.
    Returns tokens per second as a float (no rounding).
    Raises ValueError for a batch < 1 or a bandwidth that is not positive.
    """
    # BEGIN SOLUTION 3.5 hint: batch / min_step_time_s(...)
    # idea: one step produces one token per sequence, and no step is faster than the memory-bound bound
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    return batch / min_step_time_s(param_bytes, kv_bytes_per_seq, batch, hbm_bandwidth_bytes_per_s)
    # END SOLUTION


def max_batch_size(param_bytes: float, kv_bytes_per_seq: float, hbm_bytes: float) -> int:
    """Exercise 3.6 (2 points): how many sequences' KV caches fit in memory next to the weights.

    The weights take param_bytes of the hbm_bytes of memory; each sequence
    adds kv_bytes_per_seq. Returns the largest whole batch that fits
    (0 when the weights alone do not fit).
    Example: LLaMA-2-13B on 8 x 16 GiB of HBM with 26 GB of weights and
    6.7 GB of KV per sequence fits 16 sequences; with a KV cache five
    times smaller (8 KV heads instead of 40), 83.
    Returns a Python int >= 0 (rounded down: a partial sequence does not
    fit; sequences that fill the memory exactly do).
    Raises ValueError if kv_bytes_per_seq is not positive.
    """
    # BEGIN SOLUTION 3.6 hint: floor((hbm_bytes - param_bytes) / kv_bytes_per_seq), never below 0
    # idea: whatever memory the weights leave free is shared out in whole sequences
    if kv_bytes_per_seq <= 0:
        raise ValueError(f"kv_bytes_per_seq must be positive, got {kv_bytes_per_seq}")
    return max(0, math.floor((hbm_bytes - param_bytes) / kv_bytes_per_seq))
    # END SOLUTION
