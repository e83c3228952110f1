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

Lessons 04 and 05 ask you to write the plain TSP step and both KV-Runahead
steps: the functions here hand the work to those exercises
(``toyllm.answers``), so the engine runs your code; ``parallel_prefill(step=...)``
runs any other step you give it.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..answers import answer, exercise, require, shortcut


@dataclass(frozen=True)
class RankPositions:
    """Where this rank's tokens sit in the context: usually one chunk [start, start + c_i)."""

    q_pos: torch.Tensor      # (c_i,) absolute positions of this rank's tokens, increasing
    cos: torch.Tensor        # (c_i, D/2) RoPE tables picked for those positions
    sin: torch.Tensor
    start: int               # s_i: tokens before this rank's (first) chunk
    context: int             # C: tokens in the whole prompt
    layout: tuple = ()       # every rank's q_pos, in rank order (needed when chunks are not contiguous)


@answer("4.2", "TSP")
def tsp_layer(layer, x, pos: RankPositions, comm, attention):
    """TSP: every rank all-gathers everyone's K and V and attends over the whole context (Exercise 4.2)."""
    return exercise("4.2")(layer, x, pos, comm, attention)


@shortcut("4.2", "5.1", "5.2",
          ships="calls tsp_layer, Exercise 4.2's entry: the edition runs the student's step here")
def tsp_trimmed_layer(layer, x, pos: RankPositions, comm, attention):
    """TSP that attends only over the keys its queries can see, [0, s_i + c_i): KVR's work, TSP's traffic.

    It is the TSP step shown only the chunks up to this rank's own: every key
    after them is in the future of all of this rank's queries. The last
    rank, which decodes afterwards, still sees (and keeps) the whole context.
    """
    seen = pos.start + x.shape[1]
    return tsp_layer(layer, x, dataclasses.replace(pos, context=seen), _FirstChunks(comm), attention)


@shortcut("4.2", "5.1", "5.2",
          ships="calls tsp_layer, Exercise 4.2's entry: the edition runs the student's step here")
def tsp_zigzag_layer(layer, x, pos: RankPositions, comm, attention):
    """Balanced TSP: rank r holds chunks r and 2p-1-r of 2p, so each rank owns an equal share of the triangle.

    It is the TSP step given the all-gathered pieces in position order
    rather than rank order, so their concatenation is the context's keys as
    in plain TSP. Only a kernel that skips masked work profits from the
    balance (with the dense kernel every rank computes c_i * C dot products
    whatever it holds).
    """
    return tsp_layer(layer, x, pos, _InPositionOrder(comm, pos.layout), attention)


class _FirstChunks:
    """An all-gather that hands back only the chunks up to this rank's own (rank order is position order)."""

    def __init__(self, comm):
        self.comm = comm

    def all_gather(self, k, v):
        ks, vs = self.comm.all_gather(k, v)
        return ks[:self.comm.rank + 1], vs[:self.comm.rank + 1]


class _InPositionOrder:
    """An all-gather that hands back every rank's contiguous runs of tokens sorted by position."""

    def __init__(self, comm, layout):
        self.comm, self.layout = comm, layout

    def all_gather(self, k, v):
        ks, vs = self.comm.all_gather(k, v)
        runs = []                                              # (first position, k piece, v piece)
        for positions, rank_k, rank_v in zip(self.layout, ks, vs):
            breaks = (torch.nonzero(positions.diff() != 1).flatten() + 1).tolist()
            bounds = [0, *breaks, len(positions)]
            runs += [(int(positions[a]), rank_k[..., a:b, :], rank_v[..., a:b, :])
                     for a, b in zip(bounds, bounds[1:])]
        runs.sort(key=lambda run: run[0])
        return [r[1] for r in runs], [r[2] for r in runs]


@answer("5.2", "KV-Runahead", also=("5.1",))
def kvr_layer(layer, x, pos: RankPositions, chain, attention):
    """KV-Runahead, overlapped: the prefix travels while this rank projects its own tokens (Exercise 5.2)."""
    return exercise("5.2")(layer, x, pos, chain, attention)


@answer("5.1", "Blocking KV-Runahead", also=("5.2",))
def kvr_layer_blocking(layer, x, pos: RankPositions, chain, attention):
    """KV-Runahead, blocking: wait for the prefix, then compute; the send holds this rank (Exercise 5.1)."""
    return exercise("5.1")(layer, x, pos, chain, attention)


# How TSP may share out the work (see ``default_step``).
TSP_BALANCES = ("none", "trim", "zigzag")


@shortcut("4.2", "5.1", "5.2",
          ships="picks among the marked steps and holds none of its own")
def default_step(method: str, overlap: bool = True, balance: str = "none"):
    """The engine's own step for a method: KVR overlapped or blocking; TSP as in the paper, trimmed or zigzag."""
    if method == "kvr":
        chosen = kvr_layer if overlap else kvr_layer_blocking
    else:
        chosen = {"none": tsp_layer, "trim": tsp_trimmed_layer, "zigzag": tsp_zigzag_layer}[balance]
    if hasattr(chosen, "exercise"):
        require(chosen.exercise)        # a step that is an exercise stops here, not inside a worker
    return chosen
