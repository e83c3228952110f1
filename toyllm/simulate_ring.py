"""Ring attention in the prefill simulator: pass-KV, contiguous chunks or zigzag.

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

The ranks are ``toyllm.simulate``'s clocks (``busy``, ``wait_until``,
``t``, ``events``), passed in, so that this module does not import it.
"""
from __future__ import annotations

from .partition import zigzag_chunks, zigzag_layout  # noqa: F401  (zigzag_chunks: what a zigzag run takes)
from .timeline import Event

Runs = list[tuple[int, int]]          # the position ranges [a, b) a rank holds, in increasing order


def contiguous_layout(chunks: list[int]) -> list[Runs]:
    starts = [sum(chunks[:i]) for i in range(len(chunks))]
    return [[(s, s + c)] for s, c in zip(starts, chunks)]


def visible_pairs(q: tuple[int, int], k: tuple[int, int]) -> int:
    """Query-key pairs with the key at or before the query: queries [a, b) over keys [c, d)."""
    (a, b), (c, d) = q, k
    lo, hi = max(a, c), min(b, d)             # queries that see part of the keys: q - c + 1 each
    diagonal = (hi - lo) * (lo - c + 1 + hi - c) // 2 if hi > lo else 0
    return diagonal + max(0, b - max(a, d)) * (d - c)     # queries past the block see it all


def block_attention_s(cm, q_runs: Runs, k_runs: Runs) -> float | None:
    """Seconds of one rank's queries attending over one block, or None if no query sees a key (skipped).

    The dense kernel computes the whole rectangle (the engine masks it), the
    causal one only the visible pairs; the unaligned surcharge as in ``CostModel.attention_s``.
    """
    if k_runs[0][0] >= q_runs[-1][1]:
        return None                                       # every key in every query's future
    keys = sum(d - c for c, d in k_runs)
    if cm.attention_pairs == "dense":
        pairs = sum(b - a for a, b in q_runs) * keys
    else:
        pairs = sum(visible_pairs(q, k) for q in q_runs for k in k_runs)
    per_pair = cm.attn_s_per_dot
    if keys % cm.key_alignment:
        per_pair += cm.attn_unaligned_s_per_dot
    return per_pair * pairs


def simulate_ring(cfg, chunks: list[int], cm, noise, ranks, balance: str = "none") -> list[float]:
    """Each rank's finish time (seconds) of a pass-KV ring prefill; ``ranks`` record the events."""
    p, L = len(chunks), cfg.n_layers
    layout = zigzag_layout(sum(chunks), p) if balance == "zigzag" else contiguous_layout(chunks)
    held = [sum(b - a for a, b in runs) for runs in layout]
    if held != list(chunks):
        raise ValueError(f"balance='zigzag' makes its own layout (2p equal pieces, rank r holds r and 2p-1-r): "
                         f"give chunks={held} for {sum(chunks)} tokens on {p} ranks, got {list(chunks)}")
    row_bytes = cfg.n_kv_heads * cfg.head_dim * cm.bytes_per_value     # one token's K (or V) in one layer
    send_done = [0.0] * p              # when each rank's previous send is delivered
    for layer in range(L):
        for r, c in zip(ranks, chunks):
            r.busy("compute", cm.layer_overhead_s + cm.step_s(cm.qkv_s_per_token * c, cm.qkv_weight_bytes), layer,
                   lambda: f"qkv of {c} tokens")
        arrived = [0.0] * p            # when the block of the current step is at each rank
        for step in range(p):
            next_arrived = [0.0] * p
            for i, (r, c) in enumerate(zip(ranks, chunks)):
                origin = (i - step) % p
                block_bytes = 2 * chunks[origin] * row_bytes             # K and V of rank origin's tokens
                r.wait_until("recv_wait", arrived[i], layer, lambda: f"block {origin} from rank {(i - 1) % p}")
                if step < p - 1:
                    r.wait_until("send_wait", send_done[i], layer, lambda: "previous send still in flight")
                    seconds = cm.transfer_s(block_bytes, noise(i, (i + 1) % p, layer, step))
                    if r.events is not None:
                        r.events.append(Event(i, "send", r.t, r.t + seconds, layer, f"ring step {step}"))
                    send_done[i] = next_arrived[(i + 1) % p] = r.t + seconds
                attend = block_attention_s(cm, layout[i], layout[origin])
                if attend is None:                                       # in its future: only passed on
                    continue
                r.busy("compute", cm.step_s(attend, block_bytes), layer, lambda: f"attention over block {origin}")
            arrived = next_arrived
        for r, c in zip(ranks, chunks):
            r.busy("compute", cm.step_s(cm.mlp_s_per_token * c, cm.mlp_weight_bytes), layer,
                   lambda: f"o_proj + MLP of {c} tokens")
    return [r.t for r in ranks]
