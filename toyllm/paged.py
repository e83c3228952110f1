"""A paged KV cache: fixed-size blocks from one preallocated pool, a block table per sequence.

Lesson 02's static cache reserves rows for the longest sequence it will
serve, for every sequence. With many users of different lengths most of
those rows are never written. A paged cache (vLLM's PagedAttention) cuts
the memory into *blocks* of ``block_size`` token rows, all preallocated in
one ``BlockPool``, and gives a sequence a block only when it needs one. Its
*block table* lists its blocks in order: token ``t`` of the sequence lives
in block ``table[t // block_size]`` at row ``t % block_size``. A sequence
then reserves at most ``block_size - 1`` rows it does not use (the tail of
its last block).

Blocks can be shared. A sequence forked from another (``fork``), or one
whose prompt starts with a prefix another sequence already computed
(``PagedKVCache.for_prompt``), points at the same blocks; each block counts
the sequences that use it. Writing into a block that another sequence
still reads copies it first (*copy-on-write*), so sharing never changes
what another sequence sees; a block returns to the pool when its last user
releases it. A returned block that holds a registered prompt prefix keeps
its rows and stays findable until the pool needs its room (the least
recently returned goes first), so a system prompt computed once serves
the requests that come after, even when none is running in between.

``PagedKVCache`` implements ``toyllm.cache.KVCache``, the protocol of the
caches there (``update``, ``length``, ``keys``, ``values``, ``batch_size``,
``free_tokens``), so ``model(ids, cache=...)`` and ``generate`` use it unchanged. All sizes are in tokens (rows) unless a
name says bytes.
"""
from __future__ import annotations

import torch

from .answers import answer, exercise
from .checks import check_int
from .model import ModelConfig


@answer("8.1", "The paged KV cache")
def prepare_blocks(pool: "BlockPool", table: list[int], start: int, tokens: int) -> list[int]:
    """The block table to write rows start .. start + tokens - 1 with: blocks this sequence alone uses
    (a shared block copied first: copy-on-write), fresh ones appended as the sequence grows."""
    return exercise("8.1")(pool, table, start, tokens)


@answer("8.2", "Attention over a block table")
def gather_rows(store: torch.Tensor, table: list[int], layer: int, length: int) -> torch.Tensor:
    """One layer's ``length`` rows of a sequence from ``store`` (the pool's keys or values), in token
    order: (1, n_kv_heads, length, head_dim)."""
    return exercise("8.2")(store, table, layer, length)


class BlockPool:
    """``n_blocks`` blocks of ``block_size`` token rows of K and V for every layer, allocated once.

    ``k`` and ``v`` are (n_blocks, n_layers, n_kv_heads, block_size, head_dim).
    ``refs[b]`` counts the sequences using block ``b`` (0: free). Full blocks
    of a prompt can be registered under the prompt's tokens up to their end,
    so a later prompt with the same beginning finds them (``prefix_blocks``).
    """

    def __init__(self, n_blocks: int, block_size: int, n_layers: int, n_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32):
        for name, value in (("n_blocks", n_blocks), ("block_size", block_size), ("n_layers", n_layers),
                            ("n_kv_heads", n_kv_heads), ("head_dim", head_dim)):
            check_int(value, f"{name} must be an int >= 1", 1)
        self.block_size, self.n_layers = block_size, n_layers
        shape = (n_blocks, n_layers, n_kv_heads, block_size, head_dim)
        self.k = torch.zeros(shape, dtype=dtype)
        self.v = torch.zeros(shape, dtype=dtype)
        self.refs = [0] * n_blocks
        self._free = list(range(n_blocks - 1, -1, -1))        # popped from the end: block 0 first
        self._cached: dict[int, None] = {}                     # free, but holding a registered prefix (oldest first)
        self._by_prefix: dict[tuple[int, ...], int] = {}       # tokens up to a block's end -> that block
        self._prefix_of: dict[int, tuple[int, ...]] = {}       # and back, to forget it when the block is freed

    @classmethod
    def for_model(cls, cfg: ModelConfig, n_blocks: int, block_size: int = 16,
                  dtype: torch.dtype = torch.float32) -> "BlockPool":
        return cls(n_blocks, block_size, cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, dtype)

    @property
    def n_blocks(self) -> int:
        return len(self.refs)

    @property
    def free_blocks(self) -> int:
        """Blocks no sequence uses (those holding a registered prefix included: they can be taken back)."""
        return len(self._free) + len(self._cached)

    @property
    def used_blocks(self) -> int:
        return self.n_blocks - self.free_blocks

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block: K and V of ``block_size`` tokens in every layer."""
        return 2 * self.k[0].nbytes

    @property
    def nbytes(self) -> int:
        """Bytes the pool reserves (all blocks, used or not)."""
        return self.k.nbytes + self.v.nbytes

    def allocate(self) -> int:
        """A free block, now used once: one never registered, else the longest-free registered one (its prefix
        forgotten); MemoryError when every block is in use."""
        if self._free:
            block = self._free.pop()
        elif self._cached:
            block = next(iter(self._cached))
            del self._cached[block]
            del self._by_prefix[self._prefix_of.pop(block)]
        else:
            raise MemoryError(f"the KV pool's {self.n_blocks} blocks of {self.block_size} tokens are all in use: "
                              "release finished sequences, or build a larger pool")
        self.refs[block] = 1
        return block

    def share(self, block: int) -> None:
        """One more sequence uses ``block``: one in use, or a free one still holding a registered prefix."""
        if self.refs[block] == 0:
            if block not in self._cached:
                raise ValueError(f"block {block} is free: only a block in use or holding a registered prefix "
                                 "can be shared")
            del self._cached[block]
        self.refs[block] += 1

    def release(self, block: int) -> None:
        """One sequence less uses ``block``; the last one gives it back to the pool."""
        if self.refs[block] < 1:
            raise ValueError(f"block {block} is already free")
        self.refs[block] -= 1
        if self.refs[block] == 0:
            if block in self._prefix_of:
                self._cached[block] = None         # keeps its rows, findable until its room is needed
            else:
                self._free.append(block)

    def register_prefix(self, tokens: tuple[int, ...], block: int) -> None:
        """Make ``block`` findable by the tokens from the sequence's start to the block's end."""
        if len(tokens) % self.block_size or not tokens:
            raise ValueError(f"a registered prefix ends at a block's end: {len(tokens)} tokens is not a "
                             f"multiple of {self.block_size}")
        if tokens not in self._by_prefix and block not in self._prefix_of:
            self._by_prefix[tokens] = block
            self._prefix_of[block] = tokens

    def prefix_blocks(self, ids: list[int]) -> list[int]:
        """The registered blocks that hold the longest whole-block prefix of ``ids``, in order."""
        blocks, bs = [], self.block_size
        for end in range(bs, len(ids) + 1, bs):
            block = self._by_prefix.get(tuple(ids[:end]))
            if block is None:
                break
            blocks.append(block)
        return blocks


class PagedKVCache:
    """One sequence's keys and values, in blocks of a ``BlockPool`` listed by ``table``.

    Holds one sequence (batch 1). ``update`` writes a call's rows into the
    sequence's blocks, taking new blocks from the pool as the sequence grows
    and copying a shared block before writing into it.
    """

    kind = "paged"

    def __init__(self, pool: BlockPool):
        self.pool = pool
        self.table: list[int] = []                 # block ids, in token order
        self._len = [0] * pool.n_layers            # tokens written, per layer

    @classmethod
    def for_prompt(cls, pool: BlockPool, ids: list[int]) -> "PagedKVCache":
        """A cache that already holds the longest prefix of ``ids`` found in ``pool``, by reference.

        At least the prompt's last token is left to compute (its logits give
        the first new token). ``cache.length`` says how many tokens were found.
        """
        ids = [int(t) for t in ids]
        cache = cls(pool)
        found = pool.prefix_blocks(ids)[: (len(ids) - 1) // pool.block_size]
        for block in found:
            pool.share(block)
        cache.table = list(found)
        cache._len = [len(found) * pool.block_size] * pool.n_layers
        return cache

    @property
    def length(self) -> int:
        return self._len[-1]

    @property
    def n_layers(self) -> int:
        return self.pool.n_layers

    @property
    def batch_size(self) -> int:
        """1: a paged cache holds one sequence."""
        return 1

    @property
    def free_tokens(self) -> int:
        """Tokens it can still take: the rest of its last block, then the pool's free blocks (a shared last
        block costs one of them: it is copied before the first write into it)."""
        tail = self.reserved_rows - self.length
        spare = self.pool.free_blocks * self.block_size
        if tail and self.pool.refs[self.table[-1]] > 1:
            spare -= self.block_size
        return max(0, tail + spare)

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    @property
    def reserved_rows(self) -> int:
        """Token rows held in this sequence's blocks, used or not."""
        return len(self.table) * self.block_size

    def _prepare(self, start: int, T: int) -> None:
        """Blocks for rows start..start+T-1, each one only this sequence writes to."""
        self.table = prepare_blocks(self.pool, self.table, start, T)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Append k, v (1, Hkv, T, D) to ``layer``; return the layer's keys and values (1, Hkv, S, D)."""
        if k.shape[0] != 1:
            raise ValueError(f"a paged cache holds one sequence (batch 1), got a batch of {k.shape[0]}")
        start, T, bs = self._len[layer], k.shape[-2], self.block_size
        self._prepare(start, T)
        done = 0
        while done < T:                             # block by block: a call's rows may cross a block's end
            pos = start + done
            block, row = self.table[pos // bs], pos % bs
            n = min(bs - row, T - done)
            self.pool.k[block, layer, :, row:row + n] = k[0, :, done:done + n]
            self.pool.v[block, layer, :, row:row + n] = v[0, :, done:done + n]
            done += n
        self._len[layer] += T
        return self.keys(layer), self.values(layer)

    def _gather(self, store: torch.Tensor, layer: int) -> torch.Tensor:
        return gather_rows(store, self.table, layer, self._len[layer])          # (1, Hkv, S, D)

    def keys(self, layer: int) -> torch.Tensor:
        """The layer's keys in token order, (1, Hkv, S, D): a copy gathered from the blocks."""
        return self._gather(self.pool.k, layer)

    def values(self, layer: int) -> torch.Tensor:
        return self._gather(self.pool.v, layer)

    def __iter__(self):
        """Per-layer (keys, values), each (1, Hkv, S, D)."""
        return ((self.keys(i), self.values(i)) for i in range(self.n_layers))

    def register_prompt(self, ids: list[int]) -> None:
        """Make this sequence's full blocks of ``ids`` (its prompt, already in the cache) findable."""
        ids = [int(t) for t in ids]
        if len(ids) > self.length:
            raise ValueError(f"the cache holds {self.length} tokens, fewer than the {len(ids)} of the prompt")
        bs = self.block_size
        for i in range(len(ids) // bs):
            self.pool.register_prefix(tuple(ids[:(i + 1) * bs]), self.table[i])

    def fork(self) -> "PagedKVCache":
        """A second sequence with the same tokens so far, sharing every block (copied only when written)."""
        other = type(self)(self.pool)
        for block in self.table:
            self.pool.share(block)
        other.table, other._len = list(self.table), list(self._len)
        return other

    def release(self) -> None:
        """Give this sequence's blocks back (a block shared with another sequence stays for it)."""
        for block in self.table:
            self.pool.release(block)
        self.table, self._len = [], [0] * self.pool.n_layers
