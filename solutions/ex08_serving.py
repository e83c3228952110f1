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
    # BEGIN SOLUTION 8.1 hint: bs = pool.block_size; the first block is start // bs, the last the block of position start + tokens - 1; for i in first .. min(last, len(table) - 1): if pool.refs[table[i]] > 1: new = pool.allocate(); pool.k[new] = pool.k[old]; pool.v[new] = pool.v[old]; pool.release(old); then append pool.allocate() while len(table) <= last
    # idea: find the blocks the new rows land in; a shared one among them becomes a private copy, the missing ones come fresh from the pool
    if start < 0 or tokens < 1:
        raise ValueError(f"need start >= 0 and tokens >= 1, got start={start}, tokens={tokens}")
    bs = pool.block_size
    if start > len(table) * bs:
        raise ValueError(f"start={start} leaves a gap: the table's {len(table)} blocks hold rows "
                         f"0 .. {len(table) * bs - 1}")
    table = list(table)
    first, last = start // bs, (start + tokens - 1) // bs        # the blocks the new rows land in
    for i in range(first, min(last + 1, len(table))):
        shared = table[i]
        if pool.refs[shared] > 1:                                # another sequence reads it: copy, then write
            own = pool.allocate()
            pool.k[own] = pool.k[shared]
            pool.v[own] = pool.v[shared]
            pool.release(shared)
            table[i] = own
    while len(table) <= last:
        table.append(pool.allocate())
    return table
    # END SOLUTION


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
    # BEGIN SOLUTION 8.2 hint: n = ceil(length / block_size) blocks; rows = store[table[:n], layer] is (n, Hkv, bs, D); move the block axis next to the rows (transpose(0, 1)), reshape to (Hkv, n * bs, D), keep the first length rows, add the batch axis, .contiguous()
    # idea: take the sequence's blocks of this layer in table order, lay their rows end to end per head, and cut at the sequence's length
    block_size = store.shape[-2]
    if length < 0 or length > len(table) * block_size:
        raise ValueError(f"length must be in 0 .. {len(table) * block_size} (the table's rows), got {length}")
    n = -(-length // block_size)                                         # blocks that hold the rows
    rows = store[table[:n], layer]                                       # (n, Hkv, block_size, D)
    hkv, d = rows.shape[1], rows.shape[-1]
    return rows.transpose(0, 1).reshape(hkv, n * block_size, d)[:, :length].unsqueeze(0).contiguous()  # (1, Hkv, S, D)
    # END SOLUTION


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
    # BEGIN SOLUTION 8.3 hint: decoding = [not d and left == 0 ...]; budget -= their count (ValueError if it goes below 0); n[i] = 1 for them; then for each prefilling i in order: n[i] is all that is left when budget is None, else no more than the budget; budget -= n[i]
    # idea: serve everyone who is decoding first, one token each, then hand what the budget has left to the waiting prompts in the order they came
    if len(prompt_left) != len(done):
        raise ValueError(f"prompt_left has {len(prompt_left)} entries and done {len(done)}: one each per sequence")
    if any(left < 0 for left in prompt_left):
        raise ValueError(f"prompt_left must be >= 0, got {list(prompt_left)}")
    if any(d and left > 0 for left, d in zip(prompt_left, done)):
        raise ValueError("a done sequence cannot have prompt tokens left")
    if token_budget is not None and token_budget < 1:
        raise ValueError(f"token_budget must be None or >= 1, got {token_budget}")
    plan = [0] * len(prompt_left)
    decoding = [i for i, (left, d) in enumerate(zip(prompt_left, done)) if left == 0 and not d]
    budget = token_budget
    if budget is not None:
        if len(decoding) > budget:
            raise ValueError(f"{len(decoding)} decodes do not fit a token budget of {budget}")
        budget -= len(decoding)
    for i in decoding:
        plan[i] = 1
    for i, left in enumerate(prompt_left):
        if left > 0:
            plan[i] = left if budget is None else min(left, budget)
            if budget is not None:
                budget -= plan[i]
    return plan
    # END SOLUTION


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
    # BEGIN SOLUTION 8.4 hint: rows = tokens, or ceil(tokens / block_size) * block_size; bytes = 2 * n_layers * n_kv_heads * head_dim * rows * bytes_per_value; math.ceil of it as an int (exact for fractions like 0.5)
    # idea: count the values the decode worker needs (K and V, every layer, every KV head, every row sent) and multiply by their size
    if tokens < 1 or bytes_per_value <= 0 or (block_size is not None and block_size < 1):
        raise ValueError(f"need tokens >= 1, bytes_per_value > 0 and block_size None or >= 1, got tokens={tokens}, "
                         f"bytes_per_value={bytes_per_value}, block_size={block_size}")
    rows = tokens if block_size is None else -(-tokens // block_size) * block_size
    values = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * rows
    return math.ceil(values * bytes_per_value)
    # END SOLUTION
