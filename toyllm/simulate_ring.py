"""Ring attention in the prefill simulator: pass-KV with contiguous chunks.

``toyllm.simulate.simulate_prefill(..., method="ring")`` replays here the
steps of the real engine's ``ring_pass_kv_layer`` (``toyllm.parallel.ring``),
each charged with the same ``CostModel`` as TSP and KV-Runahead.

Every layer, rank r (chunk c_r) projects its c_r tokens to q, k, v, then
takes p ring steps. At step s it holds the keys and values of rank
o = (r - s) mod p (its own at step 0). Before a step's compute, if s < p - 1,
it sends that block, 2 c_o rows, on to rank r + 1, once its previous send
has been delivered (one block in flight per link); the block travels while
the rank attends. The rank attends its c_r queries over the block in hand:
its own block causally, an earlier rank's block fully, a later rank's block
not at all (it only passes it on). Step s + 1 starts when the block from
rank r - 1 has arrived. Then o_proj and the MLP.

With contiguous chunks rank r attends r + 1 blocks per layer, so the last
rank, which holds the last prompt token and gives the first token, has the
most work, as under KV-Runahead's even split; every rank sends p - 1 blocks
per layer, and they travel while it computes. Zigzag balance is not
simulated.

The ranks are ``toyllm.simulate``'s clocks (``busy``, ``wait_until``,
``t``, ``events``), passed in, so that this module does not import it.
"""
from __future__ import annotations

from .timeline import Event


def past_block_attention_s(cm, queries: int, keys: int) -> float:
    """Seconds of ``queries`` queries attending over a block of ``keys`` keys all in their past.

    Every pair is visible, so dense and causal kernels compute the same
    queries * keys pairs; the unaligned surcharge applies as in ``CostModel.attention_s``.
    """
    per_pair = cm.attn_s_per_dot + (cm.attn_unaligned_s_per_dot if keys % cm.key_alignment else 0.0)
    return per_pair * queries * keys


def simulate_ring(cfg, chunks: list[int], cm, noise, ranks) -> list[float]:
    """Each rank's finish time (seconds) of a pass-KV ring prefill; ``ranks`` record the events."""
    p, L = len(chunks), cfg.n_layers
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
                if origin == i:                                          # its own block: causal
                    attend = cm.attention_s(c, 0, c)
                elif origin < i:                                         # an earlier rank's: all visible
                    attend = past_block_attention_s(cm, c, chunks[origin])
                else:                                                    # in its future: skipped
                    continue
                r.busy("compute", cm.step_s(attend, block_bytes), layer, lambda: f"attention over block {origin}")
            arrived = next_arrived
        for r, c in zip(ranks, chunks):
            r.busy("compute", cm.step_s(cm.mlp_s_per_token * c, cm.mlp_weight_bytes), layer,
                   lambda: f"o_proj + MLP of {c} tokens")
    return [r.t for r in ranks]
