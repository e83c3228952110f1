"""Ring attention: the third way to split a prompt, with pass-KV and pass-Q.

TSP all-gathers every key and value; KV-Runahead hands a growing prefix
down a chain. In ring attention every rank keeps its own queries, and
blocks travel around a ring of p ranks in p - 1 steps (rank r sends to
r + 1 and receives from r - 1, all ranks at once). Each step a rank
computes the attention of what it holds against the block in hand while
the next block travels (``Ring.pass_on``: isend/irecv posted before the
compute). Attention over one block gives a partial output and each
query's log-sum-exp (lse); partials over disjoint sets of keys merge
exactly by their lses (``toyllm.attention.merge_partials``, the same merge
the causal kernel uses), so the result equals one process's.

- **pass-KV** (``ring_pass_kv_layer``, ``prefill --method ring``): the
  keys and values travel. A block wholly in the future of a rank's
  queries is passed on without a single dot product: with contiguous
  chunks rank r computes r + 1 blocks (its own and the r before it), so
  the last rank does p times the work of the first. ``balance="zigzag"``
  gives rank r pieces r and 2p-1-r of 2p (``token_layout``), and every rank
  then computes half of each of its p blocks: equal work.
- **pass-Q** (``ring_pass_q_layer``, ``prefill --method ring --pass q
  --cached N``): C new tokens continue N tokens whose KV cache is already
  sharded over the ranks (a ring prefill of those N tokens, or a
  conversation's earlier turns, left it there). Each rank appends its new
  tokens' keys and values to its shard; the queries travel, and each
  partial output, with its lse, goes straight back to the rank that owns
  the queries (``Ring.return_partials``), which merges them.

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

import torch

from ..attention import attention_with_lse, group_queries, merge_partials
from ..cache import DynamicKVCache
from ..timeline import Timeline
from .comm import AllGather

RING_PASSES = ("kv", "q")
RING_BALANCES = ("none", "zigzag")


# --------------------------------------------------------------------------- one block of keys

def runs(pos: torch.Tensor) -> list[tuple[int, int]]:
    """Index ranges [a, b) of the contiguous runs of increasing positions (a zigzag rank has two)."""
    breaks = (torch.nonzero(pos.diff() != 1).flatten() + 1).tolist()
    bounds = [0, *breaks, len(pos)]
    return list(zip(bounds, bounds[1:]))


def sees_any(q_pos: torch.Tensor, k_pos: torch.Tensor) -> bool:
    """False when every key is in the future of every query (positions increase along each)."""
    return int(k_pos[0]) <= int(q_pos[-1])


def merge(a: tuple, b: tuple) -> tuple:
    """Partials (out, lse) over two disjoint sets of keys as one: ``merge_partials``'s output, the joint lse."""
    return merge_partials(*a, *b), torch.logaddexp(a[1], b[1])


def masked_partial(q, k, v, q_pos, k_pos):
    """Every dot product of q (B, H, T, D) with k (B, Hkv, S, D), the causal mask by positions, and the lse.

    Returns out (B, H, T, D) and lse (B, H, T) in float32; a query that sees
    none of these keys gets out 0 and lse -inf, which the merge weighs 0.
    """
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    qg = q.reshape(B, Hkv, H // Hkv, T, D)                               # the G heads sharing a K/V head
    scores = torch.einsum("bkgtd,bksd->bkgts", qg, k).float() * D ** -0.5   # (B, Hkv, G, T, S)
    hidden = k_pos[None, :] > q_pos[:, None]                             # (T, S): keys in a query's future
    scores = scores.masked_fill(hidden, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)                                # (B, Hkv, G, T)
    weights = torch.exp(scores - lse[..., None]).nan_to_num(0.0)         # a row with no key: 0, not nan
    out = torch.einsum("bkgts,bksd->bkgtd", weights, v.float())
    return out.reshape(B, H, T, D).to(q.dtype), lse.reshape(B, H, T)


def partial_attention(q, k, v, q_pos, k_pos, skip_masked: bool):
    """Attention of q (B, H, T, D) over one block k, v (B, Hkv, S, D): out (B, H, T, D), lse (B, H, T).

    skip_masked False (the dense kernel): the whole T x S rectangle, then
    the mask. True (the causal kernel): run by run, a pair of runs wholly in
    the future is skipped, one wholly in the past is attended without a
    mask by the fused kernel, a causal square (the same positions) with it
    too; anything else is masked. The caller skips a block no query sees.
    """
    if not skip_masked:
        return masked_partial(q, k, v, q_pos, k_pos)
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    out = q.new_zeros(B, H, T, D)
    lse = q.new_full((B, H, T), float("-inf"), dtype=torch.float32)
    for a, b in runs(q_pos):
        for c, d in runs(k_pos):
            kp, kr, vr = k_pos[c:d], k[..., c:d, :], v[..., c:d, :]
            if not sees_any(q_pos[a:b], kp):
                continue                                                  # no dot products at all
            lo = a + int(torch.searchsorted(q_pos[a:b], kp[0]))          # the first query that sees a key
            qp, qr = q_pos[lo:b], q[..., lo:b, :]
            if int(kp[-1]) <= int(qp[0]):                                 # every key visible: no mask
                o, l = attention_with_lse(group_queries(qr.contiguous(), Hkv), kr, vr)
                o, l = o.reshape(B, H, b - lo, D), l.reshape(B, H, b - lo)
            elif torch.equal(qp, kp):                                     # a causal square
                group = H // Hkv
                o, l = attention_with_lse(qr, kr.repeat_interleave(group, 1), vr.repeat_interleave(group, 1),
                                          causal=True)
            else:
                o, l = masked_partial(qr, kr, vr, qp, kp)
            # rows are merged only where this pair gave them keys: a merge of two empty partials is nan
            out[..., lo:b, :], lse[..., lo:b] = merge((out[..., lo:b, :], lse[..., lo:b]), (o, l))
    return out, lse


# --------------------------------------------------------------------------- the two steps

def ring_pass_kv_layer(layer, x, pos, ring, attention):
    """Ring pass-KV: keys and values go round the ring; this rank's queries stay (see the module docstring)."""
    cos, sin = pos.cos, pos.sin                               # RoPE angles of this rank's tokens
    q, k, v = layer.qkv(x, cos, sin)                          # (B, H, c_r, D), (B, Hkv, c_r, D) x 2
    skip = getattr(attention, "skips_masked", False)
    p = ring.world_size
    block, acc = (k, v), None
    for step in range(p):
        origin = ring.origin(step)                             # whose keys and values are in hand
        incoming = ring.pass_on(step, *block) if step < p - 1 else None   # the next block travels meanwhile
        k_pos = pos.layout[origin]
        if sees_any(pos.q_pos, k_pos):                         # a block wholly in the future costs nothing
            with ring.tl.span("compute", ring.layer, f"attention over block {origin}"):
                part = partial_attention(q, *block, pos.q_pos, k_pos, skip)
            # step 0 is this rank's own block, where every query sees itself: acc starts there
            acc = part if acc is None else merge(acc, part)
        if incoming is not None:
            block = incoming.wait()
    return layer.finish(x, layer.project(acc[0])), k, v


def ring_pass_q_layer(layer, x, pos, ring, attention):
    """Ring pass-Q: the queries go round; each partial output returns to its owner (see the module docstring).

    Returns this rank's whole KV cache: its shard of the earlier tokens
    followed by its new tokens (positions ``ring.held_pos``, then ``pos.q_pos``).
    """
    cos, sin = pos.cos, pos.sin
    q, k, v = layer.qkv(x, cos, sin)                          # this rank's new tokens
    held_k, held_v, held_pos = ring.held_kv()                 # (B, Hkv, n_r, D): its shard of the cache
    keys = torch.cat([held_k, k], dim=-2)                     # (B, Hkv, n_r + c_r, D)
    values = torch.cat([held_v, v], dim=-2)
    k_pos = torch.cat([held_pos, pos.q_pos])
    skip = getattr(attention, "skips_masked", False)
    p = ring.world_size
    block, partials = (q,), {}
    for step in range(p):
        origin = ring.origin(step)                             # whose queries are in hand
        incoming = ring.pass_on(step, *block) if step < p - 1 else None
        q_pos = pos.layout[origin]
        with ring.tl.span("compute", ring.layer, f"attention of queries {origin}"):
            # every rank holds cached tokens, which every new query sees: no block is skipped
            partials[origin] = partial_attention(block[0], keys, values, q_pos, k_pos, skip)
        if incoming is not None:
            block = incoming.wait()
    parts = ring.return_partials(partials)                     # this rank's queries, against every shard
    acc = parts[0]
    for part in parts[1:]:
        acc = merge(acc, part)
    return layer.finish(x, layer.project(acc[0])), keys, values


def ring_step(ring_pass: str = "kv"):
    """The engine's ring step: pass-KV or pass-Q."""
    return {"kv": ring_pass_kv_layer, "q": ring_pass_q_layer}[ring_pass]


# --------------------------------------------------------------------------- checks, the cache, the choice

def check_ring_request(ring_pass: str, cached: int, balance: str, world_size: int, new_tokens: int) -> None:
    """The rules of a ring request (raises ValueError naming the value and what is allowed)."""
    if ring_pass not in RING_PASSES:
        raise ValueError(f"unknown ring pass {ring_pass!r}; choose one of {list(RING_PASSES)} (what travels "
                         "round the ring: keys and values, or queries)")
    if balance not in RING_BALANCES:
        raise ValueError(f"balance={balance!r} is not one of ring's {list(RING_BALANCES)}: the ring skips the "
                         "blocks in a rank's future itself; zigzag evens out the work")
    if ring_pass == "kv" and cached:
        raise ValueError(f"cached={cached}: pass-KV prefills a whole prompt; tokens already cached on the ranks "
                         "are continued with ring_pass='q'")
    if ring_pass == "q":
        pieces = 2 * world_size if balance == "zigzag" else world_size
        if cached < pieces:
            raise ValueError(f"ring_pass='q' continues tokens already cached on every rank: give cached >= "
                             f"{pieces} (balance={balance!r} shares them out in {pieces} pieces), got {cached}")
        if new_tokens < pieces:
            raise ValueError(f"ring_pass='q' shares the {new_tokens} new token(s) out in {pieces} pieces "
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


def ring_traffic(new_tokens: int, cached_tokens: int, n_heads: int, n_kv_heads: int, head_dim: int,
                 world_size: int, bytes_per_value: int = 4) -> dict:
    """Bytes sent over all links in one layer by pass-KV and by pass-Q, and the pass that sends fewer.

    Pass-KV: every token's K and V (cached and new) reach the p - 1 other
    ranks. Pass-Q: every new token's query reaches them, and the partial
    outputs with their lses come back. Even chunks assumed.
    """
    p, C, N = world_size, new_tokens, cached_tokens
    kv = (p - 1) * (N + C) * 2 * n_kv_heads * head_dim * bytes_per_value
    q = (p - 1) * C * (n_heads * head_dim + n_heads * (head_dim + 1)) * bytes_per_value
    return {"kv": kv, "q": q, "choose": "q" if q < kv else "kv"}
