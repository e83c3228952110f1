"""Lesson 08 exercises: serving many users from one paged KV cache.

A server keeps the keys and values of many sequences at once. A paged cache
cuts its memory into blocks of ``block_size`` token rows, preallocated in a
``toyllm.paged.BlockPool``; each sequence lists its blocks in a *block
table*, and token t of a sequence lives in block ``table[t // block_size]``
at row ``t % block_size``. Sequences may share blocks (a forked sequence, a
common system prompt): ``pool.refs[b]`` counts the sequences using block b,
and a sequence copies a shared block before writing into it.

The two functions below are the paged cache's own steps: every call of
``PagedKVCache.update`` asks ``prepare_blocks`` for the blocks it writes
into, and every attention over the cache reads the rows back with
``gather_rows``. Lesson 08's serving runs (continuous batching, chunked
prefill, prefix sharing) all run through them, and each of their
iterations is planned by ``plan_iteration``: which sequences feed how many
tokens under the iteration's token budget. When prefill and decode run on
separate workers, each request's cache travels between them:
``transfer_bytes`` says how much that is.

| exercise | function       | points |
|----------|----------------|--------|
| 8.1      | prepare_blocks | 4      |
| 8.2      | gather_rows    | 3      |
| 8.3      | plan_iteration | 3      |
| 8.4      | transfer_bytes | 2      |

Reach this file with ``toyllm.grading.load_exercise("ex08")``; check your
work with ``python -m toyllm grade --only ex08``.

Write each exercise yourself: your answer to Exercise N.M may not call
toyllm's own implementation of it, which ``toyllm.answers.forbidden("N.M")``
lists (a per-layer step run in the engine may not even name it); one
that does scores 0 for that exercise.
"""
from __future__ import annotations

import math

import torch


def prepare_blocks(pool, table: list[int], start: int, tokens: int) -> list[int]:
    """Exercise 8.1 (4 points): the block table a sequence writes rows start .. start + tokens - 1 with.

    pool: a ``toyllm.paged.BlockPool``. ``pool.block_size``: token rows per
        block; ``pool.refs[b]``: how many sequences use block b;
        ``pool.allocate()``: a fresh block id, now used once (MemoryError
        when none is left); ``pool.release(b)``: one user less for block b;
        ``pool.k[b]``, ``pool.v[b]``: block b's keys and values, every layer
        (tensors you may copy rows between).
    table: the sequence's block table (block ids in token order). It holds
        rows 0 .. start - 1 already; its last block may have rows to spare.
    Return the table to write with: every block that will hold one of the
    rows start .. start + tokens - 1 must be used by this sequence alone. A block of the table
    another sequence also uses (refs > 1) is replaced by a copy
    (*copy-on-write*: a fresh block, the shared block's keys and values
    copied into it, this sequence's use of the shared block released); a
    block this sequence alone uses is kept as it is, without a copy. Then
    fresh blocks are appended until the table reaches row start + tokens -
    1, and not one block more. Blocks that hold only rows before ``start``
    stay shared. Raises ValueError when start < 0, tokens < 1, or start is
    beyond the rows the table holds (len(table) * block_size): a gap.
    """
    raise NotImplementedError(
        "Exercise 8.1: implement prepare_blocks (idea: find the blocks the new rows land in; a "
        "shared one among them becomes a private copy, the missing ones come fresh from the pool)")


def gather_rows(store: torch.Tensor, table: list[int], layer: int, length: int) -> torch.Tensor:
    """Exercise 8.2 (3 points): one layer's rows of a sequence, gathered from its blocks in token order.

    store: the pool's keys (or values), (n_blocks, n_layers, n_kv_heads,
        block_size, head_dim). table: the sequence's block table.
    layer: which layer. length: how many tokens the sequence holds in it
        (its last block may hold fewer than block_size of them).
    Returns a new contiguous tensor (1, n_kv_heads, length, head_dim), with
    no rows for length 0: row t
    is token t, read from block table[t // block_size], row t % block_size;
    the same dtype as ``store``. This is what attention over a block table
    reads: the model attends over it exactly as over lesson 02's cache.
    Raises ValueError when length < 0 or the table holds fewer than
    ``length`` rows.
    """
    raise NotImplementedError(
        "Exercise 8.2: implement gather_rows (idea: take the sequence's blocks of this layer in "
        "table order, lay their rows end to end per head, and cut at the sequence's length)")


def plan_iteration(prompt_left: list[int], done: list[bool], token_budget: int | None) -> list[int]:
    """Exercise 8.3 (3 points): how many tokens each running sequence feeds in one iteration of the server.

    One entry per running sequence, in the order they joined the batch:
    prompt_left[i]: tokens of sequence i's prompt not yet fed (0 once its
        whole prompt is in the cache: then it decodes, one token per
        iteration); done[i]: the sequence has all its output tokens (a
        static batch keeps such a sequence until the whole batch ends).
    token_budget: the most tokens one iteration may carry (chunked prefill),
        or None for no limit (every waiting prompt fed whole).
    Return a list of ints n, one per sequence: 0 for a done sequence; 1 for
    each decoding one, and the decodes come first (no prompt may take a
    decode's token); then the prompts, in order, each as many of its
    remaining tokens as the budget still leaves (all of them without a
    budget, possibly 0 when the budget is spent). The n add up to at most
    ``token_budget``. Raises ValueError when the lists differ in length, an
    entry of prompt_left is negative, a done sequence still has prompt
    left, token_budget < 1, or the budget cannot carry the decodes.
    """
    raise NotImplementedError(
        "Exercise 8.3: implement plan_iteration (idea: serve everyone who is decoding first, one "
        "token each, then hand what the budget has left to the waiting prompts in the order they "
        "came)")


def transfer_bytes(cfg, tokens: int, bytes_per_value: float = 4, block_size: int | None = None) -> int:
    """Exercise 8.4 (2 points): bytes a prefill worker ships to a decode worker for one request.

    cfg: a ``toyllm.model.ModelConfig`` (``cfg.n_layers``, ``cfg.n_kv_heads``,
    ``cfg.head_dim``). The decode worker needs the keys and values of every
    layer for the request's ``tokens`` tokens: for each token and layer, one
    key and one value vector of head_dim numbers per KV head, each number
    ``bytes_per_value`` bytes (4 for float32, 2 for fp16/bf16, 0.5 for int4).
    A paged cache ships whole blocks: with ``block_size`` given, the rows
    sent are ``tokens`` rounded up to a multiple of block_size. Return a
    Python int, the exact total rounded up to a whole byte (``math.ceil``:
    a part of a byte still has to be sent, unlike Exercise 2.2's estimate,
    which rounds to the nearest). Raises
    ValueError when tokens < 1, bytes_per_value <= 0 or block_size < 1.
    """
    raise NotImplementedError(
        "Exercise 8.4: implement transfer_bytes (idea: count the values the decode worker needs (K "
        "and V, every layer, every KV head, every row sent) and multiply by their size)")
