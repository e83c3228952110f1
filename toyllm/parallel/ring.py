"""Ring attention: the third way to split a prompt, with pass-KV and pass-Q.

TSP all-gathers every key and value; KV-Runahead hands a growing prefix
down a chain. In ring attention every rank keeps its own queries, and
blocks travel around a ring of p ranks in p - 1 steps (rank r sends to
r + 1 and receives from r - 1, all ranks at once). Each step a rank
computes the attention of what it holds against the block in hand while
the next block travels (``Ring.pass_on``: isend/irecv posted before the
compute). Attention over one block gives a partial output and each
query's log-sum-exp (lse); partials over disjoint sets of keys merge
exactly by their lses (``toyllm.attention.merge``), so the result equals
one process's.

- **pass-KV** (``ring_pass_kv_layer``, ``prefill --method ring``): the
  keys and values travel. A block wholly in the future of a rank's
  queries is passed on without a single dot product: with contiguous
  chunks rank r computes r + 1 blocks (its own and the r before it), so
  the last rank computes p times the blocks of the first: p times the
  pairs with the dense kernel, about 2p - 1 times with one that skips
  masked pairs (``simulate_ring.block_pairs``). ``balance="zigzag"``
  gives rank r pieces r and 2p-1-r of 2p (``token_layout``), and every rank
  then computes half of each of its p blocks: equal work. Continuing N
  tokens already cached on the ranks (``ring_pass_kv_cached_layer``,
  ``prefill --method ring --cached N``), each rank's block is its cached
  shard followed by its new tokens, and the cached keys and values travel too.
- **pass-Q** (``ring_pass_q_layer``, ``prefill --method ring --pass q
  --cached N``): C new tokens continue N tokens whose KV cache is already
  sharded over the ranks (a ring prefill of those N tokens, or a
  conversation's earlier turns, left it there). Each rank appends its new
  tokens' keys and values to its shard; the queries travel, and each
  partial output, with its lse, goes straight back to the rank that owns
  the queries (``Ring.return_partials``), which merges them. Which pass to
  run is first a question of overlap (pass-KV whenever its blocks travel
  while the ranks compute), and only then of bytes (``ring_traffic``).

Which to pass (Meta's "Context Parallelism for Scalable Million-Token
Inference", arXiv 2411.01783): count the bytes each sends per layer
(``ring_traffic``). Pass-KV sends the keys and values of every token the
queries attend to, the N cached ones too: (N + C) * 2 * Hkv * D values,
each to p - 1 ranks. Pass-Q sends the C new queries, H * D values per
token, to p - 1 ranks and the partial outputs (H * (D + 1) values per
token, the lse included) back. Pass-Q moves less when
C * H * (2D + 1) < (N + C) * 2 * Hkv * D, that is when the new share
C / (N + C) is below about Hkv / H: a full prefill (N = 0) passes KV
(with GQA, Hkv < H, K and V are smaller than Q); a short question after
a long cached conversation passes Q. Which one finishes first also depends
on whether the messages hide behind the compute; that is a measurement.

Decoding afterwards follows KV-Runahead's contract: one rank decodes
alone, the one holding the last prompt token (the last rank; rank 0 with
zigzag), because its hidden state gives the first token. The cache is
sharded, so after the timed prefill every rank sends its shard to it
(``gather_cache``: one all-gather per layer, outside the TTFT) and it
keeps decoding with ``generate`` as after KVR. Decoding on the shards
(pass-Q with one query, as the paper does) would save that copy; it is not
built here.
"""
from __future__ import annotations

import dataclasses
import functools

import torch

from ..answers import answer, exercise, require, shortcut
from ..attention import merge
from ..cache import DynamicKVCache
from ..timeline import Timeline
from .comm import AllGather

RING_PASSES = ("kv", "q")
RING_BALANCES = ("none", "zigzag")


# --------------------------------------------------------------------------- the two steps

@answer("9.3", "Ring attention (pass-KV)")
def ring_pass_kv_layer(layer, x, pos, ring, attention):
    """Ring pass-KV: keys and values go round the ring; this rank's queries stay (Exercise 9.3)."""
    return exercise("9.3")(layer, x, pos, ring, attention)


class _AfterCache:
    """A layer whose ``qkv`` puts this rank's cached keys and values before those of its new tokens."""

    def __init__(self, layer, ring):
        self._layer, self._ring = layer, ring

    def qkv(self, x, cos, sin):
        q, k, v = self._layer.qkv(x, cos, sin)                 # (B, H, c_r, D), (B, Hkv, c_r, D) x 2
        held_k, held_v, _ = self._ring.held_kv()               # (B, Hkv, n_r, D)
        return q, torch.cat([held_k, k], dim=-2), torch.cat([held_v, v], dim=-2)

    def __getattr__(self, name):
        return getattr(self._layer, name)


def ring_pass_kv_cached_layer(layer, x, pos, ring, attention):
    """Pass-KV continuing a cache: each rank's block is its cached shard followed by its new tokens.

    The same ring as a whole prompt's (``ring_pass_kv_layer``, Exercise 9.3):
    the blocks only grow by the cached tokens, which travel with them, and
    no block is skipped (every new query sees the cached tokens). Returns the
    rank's whole KV cache, as ``ring_pass_q_layer`` does.
    """
    blocks = tuple(torch.cat([held, new]) for held, new in zip(ring.held_layout, pos.layout))
    return ring_pass_kv_layer(_AfterCache(layer, ring), x, dataclasses.replace(pos, layout=blocks), ring, attention)


def _queries_in_hand(ring, q):
    """(origin, queries) at each ring step: the queries of rank ``origin``, which this rank answers next.

    The queries travel while the caller attends to them: the next ones are
    posted before these are handed out (``Ring.pass_on``), and waited for
    only when the caller asks for them.
    """
    travelling = None
    for step in range(ring.world_size):
        queries = q if travelling is None else travelling.wait()[0]
        travelling = ring.pass_on(step, queries) if step < ring.world_size - 1 else None
        yield ring.origin(step), queries


@shortcut("9.3",
          ships="pass-Q, which the lesson runs and no exercise asks for: the queries travel and every answer "
                "goes back to its owner, which merges them all at the end (no running merge, no skipped "
                "block); each block goes through Ring.attend and merge, the entries of Exercises 9.2 and 9.1")
def ring_pass_q_layer(layer, x, pos, ring, attention):
    """Ring pass-Q: the queries go round; each partial output returns to its owner (see the module docstring).

    Returns this rank's whole KV cache: its shard of the earlier tokens
    followed by its new tokens (positions ``ring.held_pos``, then ``pos.q_pos``).
    """
    cos, sin = pos.cos, pos.sin                               # RoPE angles of this rank's new tokens
    q, k, v = layer.qkv(x, cos, sin)                          # (B, H, c_r, D), (B, Hkv, c_r, D) x 2
    held_k, held_v, held_pos = ring.held_kv()                 # (B, Hkv, n_r, D): its shard of the cache
    keys = torch.cat([held_k, k], dim=-2)                     # (B, Hkv, n_r + c_r, D)
    values = torch.cat([held_v, v], dim=-2)
    k_pos = torch.cat([held_pos, pos.q_pos])
    # This rank's keys answer every rank's queries in turn. Every rank holds cached tokens, which every new
    # query sees, so no visit is skipped; the answers are kept by whose queries they are, not merged here.
    partials = {origin: ring.attend(queries, keys, values, pos.layout[origin], k_pos, attention,
                                    f"attention of queries {origin}")
                for origin, queries in _queries_in_hand(ring, q)}
    # Each answer goes home: this rank gets its own queries' p partials (one per shard) and merges them.
    out, _ = functools.reduce(merge, ring.return_partials(partials))
    return layer.finish(x, layer.project(out)), keys, values


def ring_step(ring_pass: str = "kv", cached: int = 0):
    """The engine's ring step: pass-KV (of a whole prompt, or continuing ``cached`` tokens) or pass-Q.

    Each runs Exercises 9.1-9.3 (a cached part is put on the ranks by a
    pass-KV prefill): an unwritten one stops the run here, in one line, not in every worker.
    """
    require("9.1", "9.2", "9.3")
    if ring_pass == "kv":
        return ring_pass_kv_cached_layer if cached else ring_pass_kv_layer
    return ring_pass_q_layer


# --------------------------------------------------------------------------- checks, the cache, the choice

def check_ring_request(ring_pass: str, cached: int, balance: str, world_size: int, new_tokens: int) -> None:
    """The rules of a ring request (raises ValueError naming the value and what is allowed)."""
    if ring_pass not in RING_PASSES:
        raise ValueError(f"unknown ring pass {ring_pass!r}; choose one of {list(RING_PASSES)} (what travels "
                         "round the ring: keys and values, or queries)")
    if balance not in RING_BALANCES:
        raise ValueError(f"balance={balance!r} is not one of ring's {list(RING_BALANCES)}: the ring skips the "
                         "blocks in a rank's future itself; zigzag evens out the work")
    if ring_pass == "q" or cached:                            # pass-Q always continues a cache
        pieces = 2 * world_size if balance == "zigzag" else world_size
        if cached < pieces:
            raise ValueError(f"ring_pass={ring_pass!r} continues tokens already cached on every rank: give "
                             f"cached >= {pieces} (balance={balance!r} shares them out in {pieces} pieces), got {cached}")
        if new_tokens < pieces:
            raise ValueError(f"ring_pass={ring_pass!r} shares the {new_tokens} new token(s) out in {pieces} pieces "
                             f"(balance={balance!r}): give at least {pieces} new tokens")


def gather_cache(cache: DynamicKVCache, positions: list[torch.Tensor], rank: int) -> DynamicKVCache:
    """Every rank's shard of the KV cache, put in position order: the whole context's cache, on every rank.

    positions: the positions each rank's cache holds, in rank order. One
    all-gather per layer; called after the timed prefill, only to decode or
    to return the cache.
    """
    order = torch.cat(positions).argsort()
    gather = AllGather(rank, [len(t) for t in positions], Timeline(rank))     # a timeline nobody reads
    whole = DynamicKVCache(cache.n_layers)
    for i, (k, v) in enumerate(cache):
        ks, vs = gather.all_gather(k, v)
        whole.update(i, torch.cat(ks, dim=-2)[..., order, :], torch.cat(vs, dim=-2)[..., order, :])
    return whole


@answer("9.4", "Choosing what travels round the ring")
def ring_traffic(new_tokens: int, cached_tokens: int, n_heads: int, n_kv_heads: int, head_dim: int,
                 world_size: int, bytes_per_value: int = 4) -> dict:
    """Bytes all links carry in one layer for pass-KV and pass-Q, and the pass that sends fewer (Exercise 9.4).

    Returns {"kv": bytes, "q": bytes, "choose": "kv" or "q"}; even chunks assumed.
    """
    return exercise("9.4")(new_tokens, cached_tokens, n_heads, n_kv_heads, head_dim, world_size, bytes_per_value)
