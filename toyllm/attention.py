"""Attention kernels: the one function that differs between "dense", "sdpa" and friends.

An attention function takes q (B, H, T, D), k and v (B, H, S, D), the
absolute positions of the queries (T,) and of the keys (S,), and returns
(B, H, T, D).
Query at position p may see keys at positions <= p. The positions make a
kernel correct for any slice of the sequence: a decode step (T = 1), a
parallel rank's chunk, or a whole prompt.

Grouped-query attention: k and v have Hkv <= H heads, each serving H/Hkv
query heads. A kernel marked with ``@handles_gqa`` takes them as they are,
(B, Hkv, S, D), and shares them out without copying; any other function
(yours, for example) gets them copied out to H heads first, by the model.
Copying costs a full read and write of the cache per layer and throws away
what GQA buys in a decode step: every K/V byte read serving H/Hkv queries.

Kernels are registered in ``ATTENTION_KERNELS``; the model, the parallel
engine, the CLI and the lessons pick them by name, and a lesson or exercise
can pass its own function instead.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def handles_gqa(fn: AttentionFn) -> AttentionFn:
    """Mark a kernel that accepts k, v with fewer heads than q (grouped-query attention)."""
    fn.handles_gqa = True
    return fn


def group_queries(q: torch.Tensor, n_kv_heads: int) -> torch.Tensor:
    """View q (B, H, T, D) as (B, Hkv, G*T, D): the G query heads sharing a K/V head become extra rows.

    A view, not a copy (q is contiguous in heads). Row g*T + t is query head
    kv*G + g at token t, so its position is q_pos[t]: masks repeat G times.
    """
    B, H, T, D = q.shape
    return q.reshape(B, n_kv_heads, (H // n_kv_heads) * T, D)


def causal_mask(q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """Boolean (T, S) mask: query at position p may see keys at positions <= p."""
    return k_pos[None, :] <= q_pos[:, None]


@handles_gqa
def dense_attention(q, k, v, q_pos, k_pos):
    """Textbook attention: every dot product of QK^T, then mask, softmax, times V.

    This is the kernel the KV-Runahead paper counts (c_i * (s_i + c_i) dot
    products per rank), so every method in a comparison uses it by default.
    """
    B, H, T, D = q.shape
    G = H // k.shape[1]                                                  # query heads per K/V head
    qg = group_queries(q, k.shape[1])                                    # (B, Hkv, G*T, D)
    scores = qg @ k.transpose(-2, -1) / math.sqrt(D)                     # (B, Hkv, G*T, S)
    scores.masked_fill_(~causal_mask(q_pos, k_pos).repeat(G, 1), float("-inf"))   # in place: scores can be GBs
    return (torch.softmax(scores, dim=-1) @ v).view(B, H, T, D)          # (B, H, T, D)


@handles_gqa
def sdpa_attention(q, k, v, q_pos, k_pos):
    """PyTorch's fused kernel. With a plain causal square it may skip the masked half."""
    T, S = q.shape[-2], k.shape[-2]
    gqa = k.shape[1] != q.shape[1]
    if T == S and torch.equal(q_pos, k_pos):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_mask(q_pos, k_pos), enable_gqa=gqa)


ATTENTION_KERNELS: dict[str, AttentionFn] = {"dense": dense_attention, "sdpa": sdpa_attention}


def get_attention(kernel: str | AttentionFn) -> AttentionFn:
    if callable(kernel):
        return kernel
    if kernel not in ATTENTION_KERNELS:
        raise ValueError(f"unknown attention kernel {kernel!r}; choose one of {sorted(ATTENTION_KERNELS)}")
    return ATTENTION_KERNELS[kernel]
