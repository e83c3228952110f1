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
    """Where this rank's tokens sit in the context: usually one chunk [start, start + c_i)."""

    q_pos: torch.Tensor      # (c_i,) absolute positions of this rank's tokens, increasing
    cos: torch.Tensor        # (c_i, D/2) RoPE tables picked for those positions
    sin: torch.Tensor
    start: int               # s_i: tokens before this rank's (first) chunk
    context: int             # C: tokens in the whole prompt
    layout: tuple = ()       # every rank's q_pos, in rank order (needed when chunks are not contiguous)


def tsp_layer(layer, x, pos: RankPositions, comm, attention):
    """TSP: every rank all-gathers everyone's K and V and attends over the whole context."""
    q, k, v = layer.qkv(x, pos.cos, pos.sin)               # q (B, H, c_i, D); k, v (B, Hkv, c_i, D)
    ks, vs = comm.all_gather(k, v)                         # one (B, Hkv, c_j, D) pair per rank, in rank order
    k, v = torch.cat(ks, dim=-2), torch.cat(vs, dim=-2)    # (B, Hkv, C, D)
    k_pos = torch.arange(pos.context, device=x.device)     # keys of the whole context; the mask hides the future
    out = layer.attend(q, k, v, pos.q_pos, k_pos, attention)
    return layer.finish(x, out), k, v


def tsp_trimmed_layer(layer, x, pos: RankPositions, comm, attention):
    """TSP that attends only over the keys its queries can see, [0, s_i + c_i): KVR's work, TSP's traffic."""
    q, k, v = layer.qkv(x, pos.cos, pos.sin)
    ks, vs = comm.all_gather(k, v)
    k, v = torch.cat(ks, dim=-2), torch.cat(vs, dim=-2)    # (B, Hkv, C, D): all of it is cached
    seen = pos.start + x.shape[1]                          # keys after this chunk are all in the future
    k_pos = torch.arange(seen, device=x.device)
    out = layer.attend(q, k[..., :seen, :], v[..., :seen, :], pos.q_pos, k_pos, attention)
    return layer.finish(x, out), k, v


def tsp_zigzag_layer(layer, x, pos: RankPositions, comm, attention):
    """Balanced TSP: rank r holds chunks r and 2p-1-r of 2p, so each rank owns an equal share of the triangle.

    The all-gather returns tokens in rank order; putting them back in position
    order gives the same keys as plain TSP. Only a kernel that skips masked
    work profits from the balance (with the dense kernel every rank computes
    c_i * C dot products whatever it holds).
    """
    q, k, v = layer.qkv(x, pos.cos, pos.sin)
    ks, vs = comm.all_gather(k, v)
    order = torch.cat(pos.layout).argsort()                # rank order -> position order
    k, v = torch.cat(ks, dim=-2)[..., order, :], torch.cat(vs, dim=-2)[..., order, :]   # (B, Hkv, C, D)
    k_pos = torch.arange(pos.context, device=x.device)
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


# How TSP may share out the work (see ``default_step``).
TSP_BALANCES = ("none", "trim", "zigzag")


def default_step(method: str, overlap: bool = True, balance: str = "none"):
    """The engine's own step for a method: KVR overlapped or blocking; TSP as in the paper, trimmed or zigzag."""
    if method == "kvr":
        return kvr_layer if overlap else kvr_layer_blocking
    return {"none": tsp_layer, "trim": tsp_trimmed_layer, "zigzag": tsp_zigzag_layer}[balance]
