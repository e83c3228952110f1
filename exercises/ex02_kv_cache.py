"""Lesson 02 exercises: the KV cache.

Naive generation recomputes the keys and values of every earlier token at
every step. A KV cache keeps them: a *prefill* runs the prompt once and
fills the cache, then each *decode step* feeds only the newest token, whose
query attends over all cached keys. Queries now sit at absolute positions
that do not start at 0, so attention needs the positions to apply the
causal mask. The price is memory, which the formulas below count.

| exercise | function               | points |
|----------|------------------------|--------|
| 2.1      | attention_with_offset  | 6      |
| 2.2      | kv_cache_bytes         | 3      |
| 2.3      | static_buffer_bytes    | 4      |
| 2.4      | cached_generate        | 4      |

Reach this file with ``toyllm.grading.load_exercise("ex02")``; check your
work with ``python -m toyllm grade --only ex02``.

Write each exercise yourself: your answer to Exercise N.M may not call
toyllm's own implementation of it, which ``toyllm.answers.forbidden("N.M")``
lists (a per-layer step run in the engine may not even name it); one
that does scores 0 for that exercise.
"""
from __future__ import annotations

import math

import torch

from toyllm.cache import DynamicKVCache
from toyllm.model import causal_mask


def attention_with_offset(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """Exercise 2.1 (6 points): causal attention of queries and keys at absolute positions.

    q: (B, H, T, D) queries of the T tokens of this call.
    k, v: (B, H, S, D) keys and values of every token the cache holds, this
        call's included (S >= T). With grouped-query attention the model
        copies each K/V head out to its H/Hkv query heads before calling a
        kernel like this one (toyllm's own kernels share them without copies).
    q_pos: (T,) absolute positions of the queries; k_pos: (S,) of the keys,
        which need not start at 0 nor be in order (a ring buffer).
        A decode step has T = 1 and q_pos = [S - 1]; a chunked prefill has
        q_pos starting at an offset (the tokens already cached).
    A query at position p may only see keys at positions <= p
    (``toyllm.model.causal_mask(q_pos, k_pos)`` is that mask, as in section 2).
    Returns softmax(q k^T / sqrt(D), masked) v of shape (B, H, T, D), computed
    densely: every dot product first, then the mask (-inf), then softmax.
    Plug it into a model with ``model.set_attention(attention_with_offset)``.
    """
    raise NotImplementedError(
        "Exercise 2.1: implement attention_with_offset (idea: score every query against every key, "
        "hide the keys whose position is after the query's, normalise the scores per query, then "
        "mix the values)")


def kv_cache_bytes(n_layers: int, n_kv_heads: int, head_dim: int, tokens: int,
                   bytes_per_value: float = 2, batch: int = 1) -> int:
    """Exercise 2.2 (3 points): bytes of the KV cache of ``batch`` sequences of ``tokens`` tokens.

    Every layer stores a key and a value vector of head_dim numbers per KV
    head and per token; each number takes bytes_per_value bytes (2 for
    bf16/fp16, 4 for float32, 1 for int8).
    Grouped-query attention (fewer KV heads than query heads) and
    multi-query attention (one KV head) shrink the cache in proportion.
    Example: LLaMA-2-13B (40 layers, 40 KV heads, head_dim 128) holding
    8192 tokens in bf16 needs 6,710,886,400 bytes (6.7 GB).
    Returns bytes as a Python int: the exact total passed to Python's
    ``round`` (the nearest whole byte, a half to the even one) when
    bytes_per_value is fractional, e.g. 0.5 for int4; it is an estimate of
    memory held, unlike Exercise 8.4's bytes sent, which round up. Raises ValueError for
    negative counts or a bytes_per_value that is not positive.
    """
    raise NotImplementedError(
        "Exercise 2.2: implement kv_cache_bytes (idea: count the numbers stored per token (K and V,"
        " every layer, every KV head), then scale by tokens, batch and bytes per value)")


def static_buffer_bytes(n_blocks: int, n_kv_heads: int, head_dim: int, max_seq_len: int,
                        bits: int = 16, reserve: float = 2.0) -> int:
    """Exercise 2.3 (4 points): bytes of a preallocated K/V buffer for a runtime without dynamic shapes.

    A static graph reads each layer's (and head's) past K or V as a window
    of S - 1 rows of head_dim values, S = max_seq_len, left-padded until the
    cache fills. Reserving ``reserve`` * (S - 1) rows per K or V lets that
    window slide right as tokens arrive: with reserve = 2 appending never
    copies anything; less memory (e.g. 1.5) means an occasional shift.
    Total = 2 (K and V) x n_blocks x n_kv_heads x reserve x (S - 1) x head_dim x bits / 8.
    Only the key/value heads are cached: with grouped-query attention n_kv_heads is smaller
    than the number of query heads (SmolLM2: 3 for 9); with multi-head attention they are equal.
    Example: Llama-7B (multi-head: 32 blocks, 32 KV heads, head_dim 128, S = 2048, 16 bits)
    needs 2,146,435,072 bytes; with reserve = 1.5, 1,609,826,304 bytes
    (reserve x (S - 1) may be a half row; the byte total is still whole).
    Returns bytes as a Python int, rounded up to a whole byte. Raises
    ValueError if max_seq_len < 2, reserve is outside [1, 2] or bits is not
    a positive integer.
    """
    raise NotImplementedError(
        "Exercise 2.3: implement static_buffer_bytes (idea: each K or V of each head reserves "
        "reserve x (S - 1) rows of head_dim values; count bits, then bytes, and round up)")


@torch.no_grad()
def cached_generate(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Exercise 2.4 (4 points): greedy generation with a KV cache.

    model: a toyllm ``Transformer``; ``model(ids, input_pos=p, cache=c)``
        runs ids (1, T) at absolute positions p .. p+T-1, appends their keys
        and values to cache c and returns logits (1, T, vocab).
    prompt_ids: the prompt's token ids (at least one).
    max_new_tokens: how many tokens to generate (>= 0).
    Use a ``toyllm.cache.DynamicKVCache(model.config.n_layers)``: one prefill
    call over the whole prompt (input_pos 0, an empty cache) gives the
    first new token, then one decode call per further token feeds only that
    single newest token, into the same cache, at input_pos = the number of
    tokens cached: max_new_tokens model calls in all.
    Returns the new ids only, a list of Python ints, the same as lesson
    01's naive greedy loop (the cache changes the cost, never the tokens);
    max_new_tokens = 0 returns [] without calling the model.
    Raises ValueError for an empty prompt or a negative max_new_tokens.
    """
    raise NotImplementedError(
        "Exercise 2.4: implement cached_generate (idea: run the prompt once to fill a cache, then "
        "feed only the newest token each step at the position right after the cached ones)")
