"""The engine's simulated link keeps the simulator's timeline (lesson 07, section 3); the simulator's roofline.

Each rank of a real gloo group on 127.0.0.1 runs the engine's overlapped
KV-Runahead step (``kvr_layer``, Exercise 5.2) with the engine's ``Chain`` and
a slow ``LinkModel``, on a layer whose "compute" is sleeps of known length. ``toyllm.simulate`` is given the same
per-layer costs and the same link, and the two timelines must agree: every
compute span ends when the simulator says. A sleep never ends early and a
busy machine only delays, so no span may end before the simulator's time,
and none may end much after it. The link is slower than a layer's compute,
so a sender that did not wait for the modelled delivery of its previous
message (one message in flight per link) runs ahead of the simulator, and
its receivers with it.
"""
from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from toyllm.analysis import LLAMA_7B
from toyllm.launch import run_parallel
from toyllm.parallel.comm import Chain, LinkModel
from toyllm.parallel.steps import kvr_layer
from toyllm.partition import even_partition
from toyllm.simulate import CostModel, a100_like, simulate_prefill
from toyllm.timeline import Timeline

CHUNKS = [4, 4, 4]                 # tokens per rank
LAYERS = 3
KV_HEADS, HEAD_DIM = 1, 8          # rank 0 sends 2 * 4 * 8 * 4 = 256 bytes a layer, rank 1 twice that
QKV_S, REST_S = 0.03, 0.03         # seconds of "compute" per layer: projections, then attention and MLP
BANDWIDTH_BYTES_PER_S, LATENCY_S = 1e4, 0.08     # 256 bytes: 106 ms a message, longer than a layer's 60 ms
EARLY_S = 0.002                    # clock readings: no span may end more than this before the simulator's time
LATE_S = 0.15                      # sleeps and scheduling on a shared, busy 2-core machine, over the whole run


class SleepingLayer:
    """A layer whose compute is sleeps of known length, each a compute span: what the simulator is given."""

    def __init__(self, tl: Timeline, chunk: int):
        self.tl, self.layer = tl, 0
        self.own = torch.zeros(1, KV_HEADS, chunk, HEAD_DIM)          # this rank's keys (and values)

    def qkv(self, x, cos, sin):
        with self.tl.span("compute", self.layer, "qkv"):
            time.sleep(QKV_S)
        return self.own, self.own, self.own

    def attend(self, q, k, v, q_pos, k_pos, attention):
        with self.tl.span("compute", self.layer, "attention + MLP"):
            time.sleep(REST_S)
        return q

    def finish(self, x, out):
        return x


def sleeping_kvr_rank(ctx) -> list[dict]:
    """One rank of the engine's overlapped KV-Runahead step (``kvr_layer``) over the simulated link, its
    layers' compute replaced by sleeps: the step decides when the messages go, the timeline records it."""
    rank, chunks = ctx.rank, CHUNKS
    link = LinkModel(bandwidth_gbps=BANDWIDTH_BYTES_PER_S / 1e9, latency_s=LATENCY_S)
    tl = Timeline(rank)
    chain = Chain(rank, chunks, tl, batch=1, n_kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype=torch.float32,
                  link=link)
    layer = SleepingLayer(tl, chunks[rank])
    start = sum(chunks[:rank])
    x = torch.zeros(1, chunks[rank], 1)
    pos = SimpleNamespace(q_pos=torch.arange(start, start + chunks[rank]), cos=None, sin=None)
    for _ in range(2):                 # the first round sets up gloo's connections; the second is compared
        origin = torch.tensor([time.perf_counter() + 0.2], dtype=torch.float64)   # one clock for all ranks
        dist.broadcast(origin, 0)
        time.sleep(max(0.0, origin.item() - time.perf_counter()))
        tl.reset(origin.item())
        for i in range(LAYERS):
            chain.layer = layer.layer = i
            kvr_layer(layer, x, pos, chain, attention=None)
        chain.drain()
        dist.barrier()
    return tl.to_dicts()


@pytest.mark.engine
@pytest.mark.needs("5.2")
@pytest.mark.timeout(120)
def test_a_simulated_link_run_keeps_the_simulators_timeline():
    events = [e for rank_events in run_parallel(sleeping_kvr_rank, len(CHUNKS), backend="gloo", timeout_s=90)
              for e in rank_events]
    cfg = SimpleNamespace(n_layers=LAYERS, n_kv_heads=KV_HEADS, head_dim=HEAD_DIM)
    c = CHUNKS[0]
    cost = CostModel(QKV_S / c, REST_S / c, 0.0, link_bandwidth_bytes_per_s=BANDWIDTH_BYTES_PER_S,
                     link_latency_s=LATENCY_S, bytes_per_value=4)
    sim = simulate_prefill(cfg, CHUNKS, "kvr", cost)
    for rank in range(len(CHUNKS)):
        real = [e["end_s"] for e in events if e["rank"] == rank and e["kind"] == "compute"]
        modelled = [e.end_s for e in sim.events if e.rank == rank and e.kind == "compute"]
        assert len(real) == len(modelled) == 2 * LAYERS
        for i, (r, m) in enumerate(zip(real, modelled)):
            assert m - EARLY_S <= r <= m + LATE_S, (
                f"rank {rank}, compute span {i} (layer {i // 2}) ended at {r * 1e3:.1f} ms, the simulator "
                f"says {m * 1e3:.1f} ms; real {[round(t * 1e3) for t in real]} ms, "
                f"simulated {[round(t * 1e3) for t in modelled]} ms")
    assert sim.ttft_s - EARLY_S <= real[-1] <= sim.ttft_s + LATE_S


# --------------------------------------------------------------------------- the simulator's roofline (lesson 03)

def test_a100_like_steps_take_at_least_the_time_to_read_their_weights():
    gpu = a100_like(LLAMA_7B)
    flops_only = gpu.with_(memory_bandwidth_bytes_per_s=None)
    reads_s = LLAMA_7B.n_layers * (gpu.qkv_weight_bytes + gpu.mlp_weight_bytes) / gpu.memory_bandwidth_bytes_per_s
    assert reads_s > 6e-3                        # 13 GB of fp16 weights at 2 TB/s: every rank reads them all
    for C in (64, 128):
        for chunks in ([C], even_partition(C, 2), even_partition(C, 4)):
            method = "single" if len(chunks) == 1 else "kvr"
            assert simulate_prefill(LLAMA_7B, chunks, method, gpu).ttft_s >= reads_s
    assert simulate_prefill(LLAMA_7B, even_partition(64, 2), "kvr", flops_only).ttft_s < reads_s   # FLOPs alone
    one = simulate_prefill(LLAMA_7B, [64], "single", gpu).ttft_s
    assert simulate_prefill(LLAMA_7B, even_partition(64, 2), "kvr", gpu).ttft_s >= one   # splitting pays nothing
    for method, chunks in (("single", [16384]), ("kvr", even_partition(16384, 4)), ("tsp", even_partition(16384, 4))):
        assert simulate_prefill(LLAMA_7B, chunks, method, gpu).ttft_s == \
            simulate_prefill(LLAMA_7B, chunks, method, flops_only).ttft_s                 # long prompts: compute-bound
