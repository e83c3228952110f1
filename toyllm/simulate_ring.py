"""Ring attention in the prefill simulator: pass-KV (contiguous chunks or zigzag, after a cache or not) and pass-Q.

``toyllm.simulate.simulate_prefill(..., method="ring")`` replays here the
steps of the real engine's ``ring_pass_kv_layer`` (``toyllm.parallel.ring``),
each charged with the same ``CostModel`` as TSP and KV-Runahead.

Every layer, rank r (chunk c_r) projects its c_r tokens to q, k, v, then
takes p ring steps. At step s it holds the keys and values of rank
o = (r - s) mod p (its own at step 0). Before a step's compute, if s < p - 1,
it sends that block, 2 c_o rows, on to rank r + 1, once its previous send
has been delivered (one block in flight per link); the block travels while
the rank attends. The rank attends its c_r queries over the block in hand,
charged for the pairs its kernel computes (``block_attention_s``): with
contiguous chunks its own block causally, an earlier rank's block fully, a
later rank's block not at all (it only passes it on). Step s + 1 starts
when the block from rank r - 1 has arrived. Then o_proj and the MLP.

With contiguous chunks rank r attends r + 1 blocks per layer, so the last
rank, which holds the last prompt token and gives the first token, has the
most work, as under KV-Runahead's even split; every rank sends p - 1 blocks
per layer, and they travel while it computes. ``balance="zigzag"`` lays the
tokens out as the engine does (``zigzag_layout``): rank r holds pieces r
and 2p-1-r of 2p, attends part of every block, and all ranks do equal work;
rank 0 then holds the last token.

Pass-Q (``ring_pass="q"``, the engine's ``ring_pass_q_layer``) continues
``cached`` tokens whose keys and values are already sharded over the ranks
as the engine leaves them (even chunks, or zigzag pieces with
``balance="zigzag"``): the C new tokens are the positions after them. Every
layer, rank r projects its c_r new tokens, then takes p ring steps: at step
s it holds the queries of rank o = (r - s) mod p, sends them on (c_o rows of
H x D values) once its previous send has been delivered, and attends them
over the keys it holds, its n_r cached tokens (every new query sees them
all) and its c_r new ones (causal where positions demand). No block is
skipped. Then every rank sends each partial output, c_o rows of H x (D + 1)
values (the lse included), straight back to its owner, all at once (the
engine's ``return_partials``). The model gives each pair of ranks a link of
its own at the full bandwidth, so a rank's p - 1 partial outputs travel side
by side rather than one after another on one link: for p > 2 that favours
pass-Q (on a network where a rank shares one link, they take up to p - 1
times as long). Then it waits for the p - 1 partials of its own
queries, merges them (not charged: a few element-wise operations per
query) and runs o_proj and the MLP. The bytes per layer are
``toyllm.parallel.ring.ring_traffic``'s.

Pass-KV continues ``cached`` tokens too (``ring_pass="kv", cached=N``, the
engine's ``ring_pass_kv_cached_layer``), from the same shards as pass-Q:
rank r's block is its n_r cached tokens followed by its c_r new ones, and
the whole block, 2 (n_r + c_r) rows, travels round the ring as above. The
rank attends its c_r new queries over every block (no block is skipped:
every new query sees the cached tokens), the pairs its kernel computes, then
merges (not charged) and runs o_proj and the MLP. Over a layer the ranks
compute the same query-key pairs as pass-Q's, though not always on the same
rank; the two passes differ in what travels: a block of keys and values, or
a block of queries and then the partial outputs.

The ranks are ``toyllm.simulate``'s clocks (``busy``, ``wait_until``,
``t``, ``events``), passed in, so that this module does not import it.
"""
from __future__ import annotations

from .checks import check_int
from .partition import even_partition, zigzag_chunks, zigzag_layout  # noqa: F401  (zigzag_chunks: what a zigzag run takes)
from .timeline import Event

Runs = list[tuple[int, int]]          # the position ranges [a, b) a rank holds, in increasing order

RING_PASSES = ("kv", "q")             # what travels round the ring: keys and values, or queries


def contiguous_layout(chunks: list[int]) -> list[Runs]:
    starts = [sum(chunks[:i]) for i in range(len(chunks))]
    return [[(s, s + c)] for s, c in zip(starts, chunks)]


def visible_pairs(q: tuple[int, int], k: tuple[int, int]) -> int:
    """Query-key pairs with the key at or before the query: queries [a, b) over keys [c, d)."""
    (a, b), (c, d) = q, k
    lo, hi = max(a, c), min(b, d)             # queries that see part of the keys: q - c + 1 each
    diagonal = (hi - lo) * (lo - c + 1 + hi - c) // 2 if hi > lo else 0
    return diagonal + max(0, b - max(a, d)) * (d - c)     # queries past the block see it all


def block_pairs(q_runs: Runs, k_runs: Runs, kernel: str = "dense") -> int:
    """Query-key pairs a rank's kernel computes for one block: 0 when every key is in every query's future.

    The dense kernel computes the whole rectangle (the engine masks it), the
    causal one only the visible pairs.
    """
    if k_runs[0][0] >= q_runs[-1][1]:
        return 0                                          # skipped: no dot products at all
    if kernel == "dense":
        return sum(b - a for a, b in q_runs) * sum(d - c for c, d in k_runs)
    return sum(visible_pairs(q, k) for q in q_runs for k in k_runs)


def block_attention_s(cm, q_runs: Runs, k_runs: Runs) -> float | None:
    """Seconds of one rank's queries attending over one block, or None if no query sees a key (skipped).

    Pairs as ``block_pairs`` counts them; the unaligned surcharge as in ``CostModel.attention_s``.
    """
    pairs = block_pairs(q_runs, k_runs, cm.attention_pairs)
    if not pairs:
        return None
    per_pair = cm.attn_s_per_dot
    if sum(d - c for c, d in k_runs) % cm.key_alignment:
        per_pair += cm.attn_unaligned_s_per_dot
    return per_pair * pairs


def check_ring_sim(ring_pass: str, cached: int, balance: str, chunks: list[int]) -> None:
    """The engine's rules of a ring request (``check_ring_request``), for the simulator; raises ValueError."""
    if ring_pass not in RING_PASSES:
        raise ValueError(f"unknown ring pass {ring_pass!r}; choose one of {list(RING_PASSES)} (what travels "
                         "round the ring: keys and values, or queries)")
    check_int(cached, "cached must be an integer >= 0 (tokens already in the ranks' caches)", 0)
    if ring_pass == "q" or cached:                        # pass-Q always continues a cache
        pieces = 2 * len(chunks) if balance == "zigzag" else len(chunks)
        if cached < pieces:
            raise ValueError(f"ring_pass={ring_pass!r} continues tokens already cached on every rank: give "
                             f"cached >= {pieces} (balance={balance!r} shares them out in {pieces} pieces), "
                             f"got {cached}")
        if sum(chunks) < pieces:
            raise ValueError(f"ring_pass={ring_pass!r} shares the {sum(chunks)} new token(s) out in {pieces} "
                             f"pieces (balance={balance!r}): give at least {pieces} new tokens")


def token_runs(chunks: list[int], balance: str, start: int = 0) -> list[Runs]:
    """The position ranges each rank holds, shifted by ``start``; checks that zigzag chunks are the layout's."""
    p = len(chunks)
    layout = zigzag_layout(sum(chunks), p) if balance == "zigzag" else contiguous_layout(chunks)
    held = [sum(b - a for a, b in runs) for runs in layout]
    if held != list(chunks):
        raise ValueError(f"balance='zigzag' makes its own layout (2p equal pieces, rank r holds r and 2p-1-r): "
                         f"give chunks={held} for {sum(chunks)} tokens on {p} ranks, got {list(chunks)}")
    return [[(a + start, b + start) for a, b in runs] for runs in layout]


def cached_layout(chunks: list[int], balance: str, cached: int) -> tuple[list[Runs], list[int], list[Runs]]:
    """Where a ring continuing ``cached`` tokens finds them, as the engine's ``_held_cache`` leaves them.

    Returns (new, shard, held): each rank's new tokens' positions (after the
    cached ones), how many cached tokens it holds (even chunks, or zigzag
    pieces), and every position it holds, its cached shard then its new tokens.
    """
    p = len(chunks)
    new = token_runs(chunks, balance, start=cached)                      # the new tokens follow the cached ones
    shard = zigzag_chunks(cached, p) if balance == "zigzag" else even_partition(cached, p)
    held = [old + mine for old, mine in zip(token_runs(shard, balance), new)]   # every key a rank holds
    return new, shard, held


def simulate_ring(cfg, chunks: list[int], cm, noise, ranks, balance: str = "none", ring_pass: str = "kv",
                  cached: int = 0) -> list[float]:
    """Each rank's finish time (seconds) of a ring prefill, pass-KV or pass-Q; ``ranks`` record the events."""
    check_ring_sim(ring_pass, cached, balance, chunks)
    if ring_pass == "q":
        return _simulate_pass_q(cfg, chunks, cm, noise, ranks, balance, cached)
    p, L = len(chunks), cfg.n_layers
    if cached:                         # queries: the new tokens; a block: the cached shard, then the new tokens
        queries, _, blocks = cached_layout(chunks, balance, cached)
    else:
        queries = blocks = token_runs(chunks, balance)
    row_bytes = cfg.n_kv_heads * cfg.head_dim * cm.bytes_per_value     # one token's K (or V) in one layer
    block_bytes = [2 * sum(b - a for a, b in runs) * row_bytes for runs in blocks]   # K and V of each block
    send_done = [0.0] * p              # when each rank's previous send is delivered

    def attend(i: int, origin: int):
        # never None after a cache: every new query sees the cached tokens at the start of every block
        seconds = block_attention_s(cm, queries[i], blocks[origin])
        return None if seconds is None else (seconds, block_bytes[origin])     # None: in its future, passed on

    for layer in range(L):
        for r, c in zip(ranks, chunks):
            r.busy("compute", cm.layer_overhead_s + cm.step_s(cm.qkv_s_per_token * c, cm.qkv_weight_bytes), layer,
                   lambda: f"qkv of {c} tokens")
        ring_steps(ranks, cm, noise, layer, send_done, block_bytes.__getitem__, attend, "block {}",
                   "attention over block {}")
        for r, c in zip(ranks, chunks):
            r.busy("compute", cm.step_s(cm.mlp_s_per_token * c, cm.mlp_weight_bytes), layer,
                   lambda: f"o_proj + MLP of {c} tokens")
    return [r.t for r in ranks]


def ring_steps(ranks, cm, noise, layer: int, send_done: list[float], block_bytes, attend, block: str,
               work: str) -> None:
    """One layer's p ring steps, pass-KV or pass-Q: each rank waits for the block of step s (from rank r - 1),
    sends it on to rank r + 1 once its previous send is delivered (not at the last step), then computes on it.

    block_bytes(origin): bytes of the block that started on rank ``origin``; attend(rank, origin): (seconds,
    bytes read) of the rank's compute on it, or None to only pass it on; block, work: labels, "{}" the origin.
    ``send_done`` (when each rank's last send is delivered) is updated.
    """
    p = len(ranks)
    arrived = [0.0] * p                # when the block of the current step is at each rank
    for step in range(p):
        next_arrived = [0.0] * p
        for i, r in enumerate(ranks):
            origin = (i - step) % p
            r.wait_until("recv_wait", arrived[i], layer, lambda: f"{block.format(origin)} from rank {(i - 1) % p}")
            if step < p - 1:
                r.wait_until("send_wait", send_done[i], layer, lambda: "previous send still in flight")
                seconds = cm.transfer_s(block_bytes(origin), noise(i, (i + 1) % p, layer, step))
                if r.events is not None:
                    r.events.append(Event(i, "send", r.t, r.t + seconds, layer, f"ring step {step}"))
                send_done[i] = next_arrived[(i + 1) % p] = r.t + seconds
            cost = attend(i, origin)
            if cost is not None:
                r.busy("compute", cm.step_s(*cost), layer, lambda: work.format(origin))
        arrived = next_arrived


def _simulate_pass_q(cfg, chunks: list[int], cm, noise, ranks, balance: str, cached: int) -> list[float]:
    """Pass-Q: the new tokens' queries travel, the partial outputs return to their owners (module docstring)."""
    p, L = len(chunks), cfg.n_layers
    new, shard, held = cached_layout(chunks, balance, cached)
    row_bytes = cfg.n_kv_heads * cfg.head_dim * cm.bytes_per_value      # one token's K (or V) in one layer
    q_bytes = cfg.n_heads * cfg.head_dim * cm.bytes_per_value           # one token's query
    part_bytes = cfg.n_heads * (cfg.head_dim + 1) * cm.bytes_per_value  # one token's partial output and lse
    kv_read = [2 * (n + c) * row_bytes for n, c in zip(shard, chunks)]  # the keys and values each rank attends
    send_done = [0.0] * p
    for layer in range(L):
        for r, c in zip(ranks, chunks):
            r.busy("compute", cm.layer_overhead_s + cm.step_s(cm.qkv_s_per_token * c, cm.qkv_weight_bytes), layer,
                   lambda: f"qkv of {c} tokens")
        ring_steps(ranks, cm, noise, layer, send_done, lambda origin: chunks[origin] * q_bytes,
                   # the cached keys are seen by every query: no block is skipped
                   lambda i, origin: (block_attention_s(cm, new[origin], held[i]) or 0.0, kv_read[i]),
                   "queries {}", "attention of queries {}")
        back = [[0.0] * p for _ in range(p)]          # back[owner][sender]: when that partial output is home
        for i, r in enumerate(ranks):
            if p == 1:
                break
            r.wait_until("send_wait", send_done[i], layer, lambda: "previous send still in flight")
            for dst in range(p):
                if dst != i:
                    back[dst][i] = r.t + cm.transfer_s(chunks[dst] * part_bytes, noise(i, dst, layer, p - 1))
            send_done[i] = max(back[j][i] for j in range(p) if j != i)
            if r.events is not None:
                r.events.append(Event(i, "send", r.t, send_done[i], layer, "partial outputs"))
        for i, (r, c) in enumerate(zip(ranks, chunks)):
            r.wait_until("recv_wait", max(back[i]), layer, lambda: f"partial outputs of queries {i}")
            r.busy("compute", cm.step_s(cm.mlp_s_per_token * c, cm.mlp_weight_bytes), layer,
                   lambda: f"o_proj + MLP of {c} tokens")
    return [r.t for r in ranks]
