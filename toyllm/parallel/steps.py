"""The algorithms: one layer of TSP and of KV-Runahead on one rank, nothing else.

Each step reads like one iteration of ``Transformer.forward``: project this
rank's tokens, get the keys and values of the tokens before them, attend,
finish the layer. They differ only in how the earlier keys and values
arrive. Communication goes through a small object (``toyllm.parallel.comm``)
that also records the timeline and can act out a slow link, so none of that
clutters the algorithm; the runner (``toyllm.parallel.runner``) calls a step
once per layer.

A step has the signature ``step(layer, x, pos, comm, attention) -> (x, k, v)``:

- layer: a ``toyllm.model.Block`` (``qkv``, ``attend``, ``finish``);
- x: this rank's hidden states (B, c_i, d_model);
- pos: ``RankPositions`` of this rank's tokens;
- comm: ``AllGather`` for TSP, ``Chain`` for KVR;
- attention: the attention kernel (``toyllm.attention``);
- returns the layer's output (B, c_i, d_model) and the keys and values this
  rank attended over (B, Hkv, S, D), which become its KV cache.

Lessons 04 and 05 ask you to write these steps; ``parallel_prefill(step=...)``
runs yours inside the real engine.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RankPositions:
    """Where this rank's chunk sits in the context: tokens [start, start + length)."""

    q_pos: torch.Tensor      # (c_i,) absolute positions of this rank's tokens
    cos: torch.Tensor        # (c_i, D/2) RoPE tables picked for those positions
    sin: torch.Tensor
    start: int               # s_i: tokens before this chunk
    context: int             # C: tokens in the whole prompt


def tsp_layer(layer, x, pos: RankPositions, comm, attention):
    """TSP: every rank all-gathers everyone's K and V and attends over the whole context."""
    q, k, v = layer.qkv(x, pos.cos, pos.sin)               # q (B, H, c_i, D); k, v (B, Hkv, c_i, D)
    ks, vs = comm.all_gather(k, v)                         # one (B, Hkv, c_j, D) pair per rank, in rank order
    k, v = torch.cat(ks, dim=-2), torch.cat(vs, dim=-2)    # (B, Hkv, C, D)
    k_pos = torch.arange(pos.context, device=x.device)     # keys of the whole context; the mask hides the future
    out = layer.attend(q, k, v, pos.q_pos, k_pos, attention)
    return layer.finish(x, out), k, v


def kvr_layer(layer, x, pos: RankPositions, chain, attention):
    """KV-Runahead, overlapped: the prefix travels while this rank projects its own tokens."""
    incoming = chain.irecv()                               # rank i > 0: post the receive of tokens [0, s_i) first
    q, k, v = layer.qkv(x, pos.cos, pos.sin)               # (B, Hkv, c_i, D) ... meanwhile the prefix arrives
    if incoming is not None:
        k_prev, v_prev = incoming.wait()                   # (B, Hkv, s_i, D)
        k, v = torch.cat([k_prev, k], dim=-2), torch.cat([v_prev, v], dim=-2)   # (B, Hkv, s_i + c_i, D)
    chain.isend(k, v)                                      # rank i < p-1: tokens [0, s_i + c_i) go on to rank i+1
    k_pos = torch.arange(k.shape[-2], device=x.device)    # keys [0, s_i + c_i)
    out = layer.attend(q, k, v, pos.q_pos, k_pos, attention)
    return layer.finish(x, out), k, v


def kvr_layer_blocking(layer, x, pos: RankPositions, chain, attention):
    """KV-Runahead, blocking: wait for the prefix, then compute; the send holds this rank until delivered."""
    prefix = chain.recv()                                  # rank i > 0: (k, v) of tokens [0, s_i), else None
    q, k, v = layer.qkv(x, pos.cos, pos.sin)
    if prefix is not None:
        k, v = torch.cat([prefix[0], k], dim=-2), torch.cat([prefix[1], v], dim=-2)
    chain.send(k, v)
    k_pos = torch.arange(k.shape[-2], device=x.device)    # keys [0, s_i + c_i)
    out = layer.attend(q, k, v, pos.q_pos, k_pos, attention)
    return layer.finish(x, out), k, v


# The engine's own steps, by name: (method, overlapped) -> step.
STEPS = {("tsp", True): tsp_layer, ("tsp", False): tsp_layer,
         ("kvr", True): kvr_layer, ("kvr", False): kvr_layer_blocking}
