"""The prefill simulator (toyllm.simulate) with synthetic cost models: exact small cases and trends."""
import math

import pytest
import torch

from toyllm.analysis import LLAMA_7B
from toyllm.model import get_config
from toyllm.partition import (dot_products, even_partition, exhaustive_search, hierarchical_grid_search,
                              kv_rows_sent, search_boundary_1d)
from toyllm.simulate import (CostModel, SimResult, a100_like, compare_methods, random_link_noise,
                             simulate_prefill, ttft_cost)
from toyllm.simulate_ring import visible_pairs, zigzag_chunks
from toyllm.timeline import EVENT_KINDS

BENCH = get_config("bench")          # 4 layers, 8 KV heads of 32: 1 KiB per token per layer for K (float32)

# Coefficients of the size measured for the bench model on a 2-core CPU, one thread
# (dense attention about 46 ns per query-key pair per layer); a gloo-like link.
CPU_LIKE = CostModel(qkv_s_per_token=4e-6, mlp_s_per_token=8e-6, attn_s_per_dot=4.6e-8, layer_overhead_s=1e-4,
                     link_bandwidth_bytes_per_s=3e9, link_latency_s=50e-6, bytes_per_value=4)

# Attention only, and a link so fast it costs nothing: times are exact multiples of dot products.
ATTN_ONLY = CostModel(qkv_s_per_token=0.0, mlp_s_per_token=0.0, attn_s_per_dot=1e-6,
                      link_bandwidth_bytes_per_s=1e30, link_latency_s=0.0)


def rank_kind_seconds(result: SimResult, rank: int, kind: str, label_start: str = "") -> float:
    return sum(e.duration_s for e in result.events
               if e.rank == rank and e.kind == kind and e.label.startswith(label_start))


# --------------------------------------------------------------------------- exact small cases

def test_single_process_ttft_is_the_sum_of_its_compute():
    C, L = 1000, BENCH.n_layers
    res = simulate_prefill(BENCH, [C], "single", CPU_LIKE)
    expected = L * (CPU_LIKE.layer_overhead_s + (CPU_LIKE.qkv_s_per_token + CPU_LIKE.mlp_s_per_token) * C + CPU_LIKE.attn_s_per_dot * C * C)
    assert res.ttft_s == pytest.approx(expected, rel=1e-12)
    assert res.ttft_s == pytest.approx(sum(e.duration_s for e in res.events if e.kind == "compute"), rel=1e-12)
    assert {e.kind for e in res.events} == {"compute"}
    # One chunk through kvr or tsp is the same single-process run.
    assert simulate_prefill(BENCH, [C], "kvr", CPU_LIKE).ttft_s == res.ttft_s
    assert simulate_prefill(BENCH, [C], "tsp", CPU_LIKE).ttft_s == res.ttft_s


def test_attention_time_per_rank_is_dot_products_times_cost():
    chunks = [4, 3, 2]                                    # the paper's Fig. 5 example
    for method in ("kvr", "tsp"):
        res = simulate_prefill(BENCH, chunks, method, ATTN_ONLY)
        for i, dots in enumerate(dot_products(chunks, method)):
            assert rank_kind_seconds(res, i, "compute", "attention") == pytest.approx(
                BENCH.n_layers * dots * ATTN_ONLY.attn_s_per_dot)


def test_kvr_chain_with_free_communication_matches_the_closed_form():
    L, C = BENCH.n_layers, 100
    # Rank 1 slower than rank 0 (c1*C >= c0^2): it never waits after layer 0, TTFT = L * c1 * C.
    res = simulate_prefill(BENCH, [50, 50], "kvr", ATTN_ONLY)
    assert res.ttft_s == pytest.approx(L * 50 * C * 1e-6)
    # Rank 0 slower (c0^2 > c1*C): rank 1 waits for each layer; TTFT = (L-1) * c0^2 + c1 * C.
    res = simulate_prefill(BENCH, [80, 20], "kvr", ATTN_ONLY)
    assert res.ttft_s == pytest.approx(((L - 1) * 80 * 80 + 20 * C) * 1e-6)
    assert rank_kind_seconds(res, 1, "recv_wait") > 0
    # TSP with free communication: every layer starts with an all-gather that waits for the
    # slowest rank (c_max * C dot products); the first token comes from the last rank.
    tsp = simulate_prefill(BENCH, [80, 20], "tsp", ATTN_ONLY)
    assert tsp.per_rank_finish_s[0] == pytest.approx(L * 80 * C * 1e-6)
    assert tsp.ttft_s == pytest.approx(((L - 1) * 80 + 20) * C * 1e-6)


def test_send_durations_follow_the_row_counts():
    cm = CostModel(qkv_s_per_token=1e-6, mlp_s_per_token=1e-6, attn_s_per_dot=1e-9,
                   link_bandwidth_bytes_per_s=1e9, link_latency_s=1e-5, bytes_per_value=4)
    chunks = [40, 30, 20, 10]
    row_bytes = BENCH.n_kv_heads * BENCH.head_dim * cm.bytes_per_value
    res = simulate_prefill(BENCH, chunks, "kvr", cm)
    for i, rows in enumerate(kv_rows_sent(chunks, "kvr")):
        sends = [e for e in res.events if e.rank == i and e.kind == "send"]
        assert len(sends) == (BENCH.n_layers if rows else 0)
        for e in sends:
            assert e.duration_s == pytest.approx(rows * row_bytes / 1e9 + 1e-5)


def test_event_invariants():
    for method, chunks in [("kvr", [300, 200, 100]), ("tsp", [200, 200, 200]), ("ring", [300, 200, 100])]:
        for overlap in (True, False):
            res = simulate_prefill(BENCH, chunks, method, CPU_LIKE, overlap=overlap)
            assert {e.kind for e in res.events} <= set(EVENT_KINDS)
            assert all(e.end_s > e.start_s >= 0 and 0 <= e.layer < BENCH.n_layers for e in res.events)
            blocking_sends = not overlap and method != "ring"        # the ring's sends always overlap
            for rank in range(len(chunks)):
                # A rank's own work (everything but an asynchronous send) never overlaps itself.
                own = sorted((e for e in res.events if e.rank == rank and (e.kind != "send" or blocking_sends)),
                             key=lambda e: e.start_s)
                assert all(a.end_s <= b.start_s + 1e-12 for a, b in zip(own, own[1:]))
                assert own[-1].end_s == pytest.approx(res.per_rank_finish_s[rank])
            assert res.ttft_s == res.per_rank_finish_s[-1]
    d = res.to_dict()
    assert d["simulated"] is True and len(d["events"]) == len(res.events)
    assert simulate_prefill(BENCH, [300, 300], "kvr", CPU_LIKE, record_events=False).events == []


def test_ttft_is_the_last_ranks_finish_even_when_an_earlier_rank_is_slower():
    """The first token comes from the last rank: TTFT is its finish, not the slowest rank's (as on real runs)."""
    chunks = [896, 128]                                        # rank 0 still attends over 896 tokens at the end
    res = simulate_prefill(BENCH, chunks, "kvr", CPU_LIKE)
    assert res.per_rank_finish_s[0] > res.per_rank_finish_s[-1]           # rank 0 is the slowest here
    assert res.ttft_s == res.per_rank_finish_s[-1] < res.slowest_rank_s == res.per_rank_finish_s[0]
    last_rank_events = [e for e in res.events if e.rank == len(chunks) - 1]
    assert res.ttft_s == max(e.end_s for e in last_rank_events)
    assert res.to_dict()["slowest_rank_s"] == res.slowest_rank_s
    # The searches and the method comparison optimise and report that same time.
    assert ttft_cost(BENCH, CPU_LIKE)(chunks) == res.ttft_s
    cmp = compare_methods(BENCH, 1024, 2, CPU_LIKE, min_stride=64)
    assert cmp["kvr_even"] == simulate_prefill(BENCH, even_partition(1024, 2), "kvr", CPU_LIKE).per_rank_finish_s[-1]
    found = simulate_prefill(BENCH, cmp["kvr_searched_chunks"], "kvr", CPU_LIKE)
    assert cmp["kvr_searched"] == found.per_rank_finish_s[-1]


# --------------------------------------------------------------------------- ring attention (pass-KV)

@pytest.mark.parametrize("pairs", ["dense", "causal"])
@pytest.mark.parametrize("p", [2, 3, 4])
def test_ring_with_an_instant_link_is_the_last_ranks_compute(p, pairs):
    """Nothing waits for a free link: the TTFT is the last rank's own work, p blocks of attention a layer."""
    cm = CPU_LIKE.with_(link_bandwidth_bytes_per_s=math.inf, link_latency_s=0.0, attention_pairs=pairs)
    C = 256 * p
    c = C // p
    res = simulate_prefill(BENCH, [c] * p, "ring", cm)
    own_pairs = c * c if pairs == "dense" else c * (c + 1) // 2          # its own block, causal
    per_layer = (cm.layer_overhead_s + cm.qkv_s_per_token * c
                 + cm.attn_s_per_dot * (own_pairs + (p - 1) * c * c) + cm.mlp_s_per_token * c)
    assert res.ttft_s == pytest.approx(BENCH.n_layers * per_layer, rel=1e-12)
    assert res.ttft_s == pytest.approx(rank_kind_seconds(res, p - 1, "compute"), rel=1e-12)
    assert rank_kind_seconds(res, p - 1, "recv_wait") == rank_kind_seconds(res, p - 1, "send_wait") == 0


def test_ring_on_one_process_is_the_single_run():
    C = 1000
    for cm in (CPU_LIKE, CPU_LIKE.with_(attention_pairs="causal")):
        single = simulate_prefill(BENCH, [C], "single", cm)
        ring = simulate_prefill(BENCH, [C], "ring", cm)
        assert ring.ttft_s == single.ttft_s
        assert [(e.kind, e.start_s, e.end_s) for e in ring.events] == [(e.kind, e.start_s, e.end_s)
                                                                      for e in single.events]


def test_ring_slows_down_on_a_slow_link():
    chunks = even_partition(4096, 4)
    times = {bw: simulate_prefill(BENCH, chunks, "ring", CPU_LIKE.with_(link_bandwidth_bytes_per_s=bw))
             for bw in (1e12, 3e9, 1e7)}
    assert times[1e12].ttft_s <= times[3e9].ttft_s < times[1e7].ttft_s
    slow = times[1e7]
    assert rank_kind_seconds(slow, 3, "recv_wait") > 0              # the blocks arrive late
    # a send moves the K and V of one chunk: 2 * 1024 rows of 1 KiB at 10 MB/s, plus the latency
    sends = [e.duration_s for e in slow.events if e.kind == "send"]
    assert sends and all(d == pytest.approx(2 * 1024 * 1024 / 1e7 + CPU_LIKE.link_latency_s) for d in sends)


@pytest.mark.parametrize("chunks", [[100, 100], [300, 200, 100], [64] * 4])
def test_ring_sends_p_minus_1_blocks_and_rank_r_attends_r_plus_1(chunks):
    p, L = len(chunks), BENCH.n_layers
    res = simulate_prefill(BENCH, chunks, "ring", CPU_LIKE)
    sends = [e for e in res.events if e.kind == "send"]
    assert len(sends) == p * (p - 1) * L
    for rank in range(p):
        for layer in range(L):
            mine = [e for e in res.events if e.rank == rank and e.layer == layer]
            assert sorted(e.label for e in mine if e.kind == "send") == [f"ring step {s}" for s in range(p - 1)]
            attended = [e.label for e in mine if e.label.startswith("attention")]
            # its own block first, then the earlier ranks' in ring order; later ones are skipped
            assert attended == [f"attention over block {(rank - s) % p}" for s in range(rank + 1)]
    assert res.ttft_s == res.per_rank_finish_s[-1]


def test_visible_pairs_counts_the_causal_pairs_of_two_ranges():
    for q in [(0, 5), (3, 9), (10, 12)]:
        for k in [(0, 5), (2, 4), (5, 11), (12, 20)]:
            brute = sum(1 for i in range(*q) for j in range(*k) if j <= i)
            assert visible_pairs(q, k) == brute, (q, k)


@pytest.mark.parametrize("p", [2, 4])
def test_ring_zigzag_gives_every_rank_the_same_work_and_rank_0_the_first_token(p):
    C = 512 * p
    free = CPU_LIKE.with_(link_bandwidth_bytes_per_s=math.inf, link_latency_s=0.0)
    zig = zigzag_chunks(C, p)
    causal = free.with_(attention_pairs="causal")
    res = simulate_prefill(BENCH, zig, "ring", causal, balance="zigzag")
    assert res.ttft_s == res.per_rank_finish_s[0]                     # rank 0 holds the last token
    for rank in range(p):
        # a kernel that skips masked pairs: each rank computes 1/p of the causal triangle, every block in part
        attention = rank_kind_seconds(res, rank, "compute", "attention")
        assert attention == pytest.approx(BENCH.n_layers * causal.attn_s_per_dot * C * (C + 1) / 2 / p, rel=1e-12)
        assert len([e for e in res.events if e.rank == rank and e.label.startswith("attention")]) == p * BENCH.n_layers
    assert res.ttft_s < simulate_prefill(BENCH, even_partition(C, p), "ring", causal).ttft_s
    # the dense kernel computes each block's whole rectangle: zigzag then saves nothing
    dense = simulate_prefill(BENCH, zig, "ring", free, balance="zigzag")
    assert dense.ttft_s == pytest.approx(simulate_prefill(BENCH, even_partition(C, p), "ring", free).ttft_s,
                                         rel=1e-12)


def test_ring_zigzag_errors():
    with pytest.raises(ValueError, match="balances only ring"):
        simulate_prefill(BENCH, [4, 4], "tsp", CPU_LIKE, balance="zigzag")
    with pytest.raises(ValueError, match="balances only ring"):
        simulate_prefill(BENCH, [4, 4], "ring", CPU_LIKE, balance="trim")
    with pytest.raises(ValueError, match=r"give chunks=\[75, 75\]"):
        simulate_prefill(BENCH, [100, 50], "ring", CPU_LIKE, balance="zigzag")


# --------------------------------------------------------------------------- ring after a cache (pass-Q, pass-KV)

GQA = BENCH.with_(n_kv_heads=2)      # 8 query heads share 2 KV heads: K and V are a quarter of Q's size


@pytest.mark.parametrize("ring_pass", ["q", "kv"])
@pytest.mark.parametrize("pairs", ["dense", "causal"])
def test_pass_q_on_one_process_continues_the_cache_like_a_single_run(pairs, ring_pass):
    """No messages: per layer the projections and MLP of the C new tokens and their attention over N + C keys."""
    N, C = 3000, 1000
    cm = CPU_LIKE.with_(attention_pairs=pairs, attn_unaligned_s_per_dot=1e-9)
    res = simulate_prefill(BENCH, [C], "ring", cm, ring_pass=ring_pass, cached=N)
    per_layer = (cm.layer_overhead_s + cm.qkv_s_per_token * C + cm.attention_s(C, N, N + C)
                 + cm.mlp_s_per_token * C)
    assert res.ttft_s == pytest.approx(BENCH.n_layers * per_layer, rel=1e-12)
    assert not [e for e in res.events if e.kind != "compute"]


@pytest.mark.parametrize("balance", ["none", "zigzag"])
@pytest.mark.parametrize("p", [2, 4])
def test_pass_q_with_an_instant_link(p, balance):
    """Dense kernel: every rank attends p blocks of c queries over its n + c keys (the closed form); a causal
    kernel: the ranks together compute the visible pairs, C N + C (C + 1) / 2 a layer, whatever the balance."""
    N, C = 512 * p, 256 * p
    n, c = N // p, C // p
    free = CPU_LIKE.with_(link_bandwidth_bytes_per_s=math.inf, link_latency_s=0.0)
    chunks = zigzag_chunks(C, p) if balance == "zigzag" else even_partition(C, p)
    res = simulate_prefill(BENCH, chunks, "ring", free, balance=balance, ring_pass="q", cached=N)
    per_layer = (free.layer_overhead_s + free.qkv_s_per_token * c + free.attn_s_per_dot * p * c * (n + c)
                 + free.mlp_s_per_token * c)
    assert res.ttft_s == pytest.approx(BENCH.n_layers * per_layer, rel=1e-12)
    assert res.ttft_s == res.per_rank_finish_s[0 if balance == "zigzag" else -1]
    causal = simulate_prefill(BENCH, chunks, "ring", free.with_(attention_pairs="causal"), balance=balance,
                              ring_pass="q", cached=N)
    attention = sum(rank_kind_seconds(causal, r, "compute", "attention") for r in range(p))
    assert attention == pytest.approx(BENCH.n_layers * free.attn_s_per_dot * (C * N + C * (C + 1) / 2), rel=1e-12)
    assert causal.ttft_s < res.ttft_s


@pytest.mark.parametrize("p", [2, 3, 4])
def test_pass_q_sends_p_minus_1_query_blocks_and_the_partials_back(p):
    N, C, L = 4000, 1200, BENCH.n_layers
    slow = CPU_LIKE.with_(link_bandwidth_bytes_per_s=1e8)
    chunks = even_partition(C, p)
    res = simulate_prefill(BENCH, chunks, "ring", slow, ring_pass="q", cached=N)
    q_row = BENCH.n_heads * BENCH.head_dim * 4                       # a query, float32
    part_row = BENCH.n_heads * (BENCH.head_dim + 1) * 4              # a partial output and its lse
    for rank in range(p):
        for layer in range(L):
            mine = [e for e in res.events if e.rank == rank and e.layer == layer]
            steps = {e.label: e.duration_s for e in mine if e.kind == "send" and e.label.startswith("ring step")}
            assert sorted(steps) == [f"ring step {s}" for s in range(p - 1)]
            for s, seconds in steps.items():
                origin = (rank - int(s.split()[-1])) % p
                assert seconds == pytest.approx(chunks[origin] * q_row / 1e8 + slow.link_latency_s)
            back = [e.duration_s for e in mine if e.label == "partial outputs"]
            longest = max(chunks[d] for d in range(p) if d != rank)
            assert back == [pytest.approx(longest * part_row / 1e8 + slow.link_latency_s)]
            attended = [e.label for e in mine if e.label.startswith("attention")]
            assert attended == [f"attention of queries {(rank - s) % p}" for s in range(p)]   # none skipped


@pytest.mark.parametrize("balance", ["none", "zigzag"])
@pytest.mark.parametrize("p", [2, 4])
def test_pass_kv_after_a_cache_with_an_instant_link_computes_what_pass_q_does(p, balance):
    """Every rank attends its c new queries over p blocks of n + c keys: pass-Q's closed form (dense kernel). A
    causal kernel: the ranks compute pass-Q's visible pairs, C N + C (C + 1) / 2 a layer (not always on the same
    rank)."""
    N, C = 512 * p, 256 * p
    n, c = N // p, C // p
    free = CPU_LIKE.with_(link_bandwidth_bytes_per_s=math.inf, link_latency_s=0.0)
    chunks = zigzag_chunks(C, p) if balance == "zigzag" else even_partition(C, p)
    kv = simulate_prefill(BENCH, chunks, "ring", free, balance=balance, ring_pass="kv", cached=N)
    per_layer = (free.layer_overhead_s + free.qkv_s_per_token * c + free.attn_s_per_dot * p * c * (n + c)
                 + free.mlp_s_per_token * c)
    assert kv.ttft_s == pytest.approx(BENCH.n_layers * per_layer, rel=1e-12)
    assert kv.ttft_s == kv.per_rank_finish_s[0 if balance == "zigzag" else -1]
    q = simulate_prefill(BENCH, chunks, "ring", free, balance=balance, ring_pass="q", cached=N)
    assert kv.ttft_s == pytest.approx(q.ttft_s, rel=1e-12)
    causal = free.with_(attention_pairs="causal")
    runs = {ring_pass: simulate_prefill(BENCH, chunks, "ring", causal, balance=balance, ring_pass=ring_pass,
                                        cached=N) for ring_pass in ("kv", "q")}
    attention = {ring_pass: sum(rank_kind_seconds(res, r, "compute", "attention") for r in range(p))
                 for ring_pass, res in runs.items()}
    assert attention["kv"] == pytest.approx(attention["q"], rel=1e-12)
    assert attention["kv"] == pytest.approx(BENCH.n_layers * free.attn_s_per_dot * (C * N + C * (C + 1) / 2),
                                            rel=1e-12)
    # continuing the cache beats the pass-KV prefill of all N + C tokens, which computes the cached ones again
    whole = zigzag_chunks(N + C, p) if balance == "zigzag" else even_partition(N + C, p)
    assert kv.ttft_s < simulate_prefill(BENCH, whole, "ring", free, balance=balance).ttft_s


@pytest.mark.parametrize("balance", ["none", "zigzag"])
@pytest.mark.parametrize("p", [2, 3, 4])
def test_pass_kv_after_a_cache_sends_each_ranks_cached_shard_and_new_tokens(p, balance):
    """A block is a rank's n cached and c new tokens' K and V, 2 (n + c) rows; every block is attended."""
    N, C, L = 4002, 1206, BENCH.n_layers
    slow = CPU_LIKE.with_(link_bandwidth_bytes_per_s=1e8)
    chunks, shard = ((zigzag_chunks(C, p), zigzag_chunks(N, p)) if balance == "zigzag" else
                     (even_partition(C, p), even_partition(N, p)))
    res = simulate_prefill(BENCH, chunks, "ring", slow, balance=balance, ring_pass="kv", cached=N)
    kv_row = BENCH.n_kv_heads * BENCH.head_dim * 4                    # one token's K (or V), float32
    assert len([e for e in res.events if e.kind == "send"]) == p * (p - 1) * L
    for rank in range(p):
        for layer in range(L):
            mine = [e for e in res.events if e.rank == rank and e.layer == layer]
            steps = {e.label: e.duration_s for e in mine if e.kind == "send"}
            assert sorted(steps) == [f"ring step {s}" for s in range(p - 1)]
            for s, seconds in steps.items():
                origin = (rank - int(s.split()[-1])) % p
                block = 2 * (shard[origin] + chunks[origin]) * kv_row
                assert seconds == pytest.approx(block / 1e8 + slow.link_latency_s)
            attended = [e.label for e in mine if e.label.startswith("attention")]
            assert attended == [f"attention over block {(rank - s) % p}" for s in range(p)]   # none skipped
    # all links together carry what ring_traffic counts for pass-KV, every layer
    from toyllm.parallel.ring import ring_traffic

    sent = sum((e.duration_s - slow.link_latency_s) * 1e8 for e in res.events if e.kind == "send")
    traffic = ring_traffic(C, N, BENCH.n_heads, BENCH.n_kv_heads, BENCH.head_dim, p)
    assert sent == pytest.approx(L * traffic["kv"], rel=1e-9)


def test_the_faster_pass_after_a_cache_on_a_slow_link_is_the_one_ring_traffic_chooses():
    """Both passes continue the same N cached tokens and compute the same pairs; pass-KV moves ring_traffic's
    "kv" bytes, pass-Q its "q" bytes. On a slow link the pass that sends fewer bytes finishes first."""
    from toyllm.parallel.ring import ring_traffic

    p, C = 4, 512
    chunks = even_partition(C, p)
    for bandwidth in (1e7, 3e7):
        cm = CPU_LIKE.with_(link_bandwidth_bytes_per_s=bandwidth)
        for N, winner in ((7 * C, "q"), (15 * C, "q"), (p, "kv"), (C // 4, "kv")):   # new share 1/8, 1/16, ~1, 4/5
            traffic = ring_traffic(C, N, GQA.n_heads, GQA.n_kv_heads, GQA.head_dim, p)
            assert traffic["choose"] == winner
            q, kv = (simulate_prefill(GQA, chunks, "ring", cm, ring_pass=ring_pass, cached=N,
                                      record_events=False).ttft_s for ring_pass in ("q", "kv"))
            assert (q < kv) == (winner == "q"), (bandwidth, N, q, kv)


def test_pass_q_errors():
    with pytest.raises(ValueError, match=r"unknown ring pass 'k'; choose one of \['kv', 'q'\]"):
        simulate_prefill(BENCH, [4, 4], "ring", CPU_LIKE, ring_pass="k")
    with pytest.raises(ValueError, match="ring_pass='q' continues tokens already cached on every rank: give "
                                         "cached >= 2"):
        simulate_prefill(BENCH, [4, 4], "ring", CPU_LIKE, ring_pass="q")
    # pass-KV continues a cache too, under the same rules; without one it prefills a whole prompt
    with pytest.raises(ValueError, match="ring_pass='kv' continues tokens already cached on every rank: give "
                                         "cached >= 4"):
        simulate_prefill(BENCH, [4, 4], "ring", CPU_LIKE, cached=3, balance="zigzag")
    with pytest.raises(ValueError, match="ring_pass='kv' shares the 3 new token"):
        simulate_prefill(BENCH, [2, 1], "ring", CPU_LIKE, cached=8, balance="zigzag")
    with pytest.raises(ValueError, match=r"give chunks=\[4, 4\]"):
        simulate_prefill(BENCH, [5, 3], "ring", CPU_LIKE, cached=8, balance="zigzag")
    with pytest.raises(ValueError, match="give cached >= 4"):
        simulate_prefill(BENCH, [4, 4], "ring", CPU_LIKE, ring_pass="q", cached=3, balance="zigzag")
    with pytest.raises(ValueError, match="give at least 4 new tokens"):
        simulate_prefill(BENCH, [2, 1], "ring", CPU_LIKE, ring_pass="q", cached=8, balance="zigzag")
    with pytest.raises(ValueError, match=r"give chunks=\[4, 4\]"):
        simulate_prefill(BENCH, [5, 3], "ring", CPU_LIKE, ring_pass="q", cached=8, balance="zigzag")
    with pytest.raises(ValueError, match="cached must be an integer >= 0"):
        simulate_prefill(BENCH, [4, 4], "ring", CPU_LIKE, ring_pass="q", cached=-1)
    for method in ("tsp", "kvr"):
        with pytest.raises(ValueError, match="takes neither"):
            simulate_prefill(BENCH, [4, 4], method, CPU_LIKE, ring_pass="q", cached=8)


# --------------------------------------------------------------------------- trends the lessons rely on

def test_kvr_beats_tsp_for_a_long_context_and_searching_beats_even():
    C = 8192
    even = even_partition(C, 2)
    tsp = simulate_prefill(BENCH, even, "tsp", CPU_LIKE).ttft_s
    kvr_even = simulate_prefill(BENCH, even, "kvr", CPU_LIKE).ttft_s
    found = search_boundary_1d(ttft_cost(BENCH, CPU_LIKE), C, min_stride=32)
    assert kvr_even <= tsp
    assert found.cost_s < 0.85 * kvr_even                 # an uneven split is clearly better
    assert found.partition[0] > found.partition[1]        # the earlier rank takes more tokens
    assert found.evaluations < 40
    assert found.cost_s < tsp / 1.2
    single = simulate_prefill(BENCH, [C], "single", CPU_LIKE).ttft_s
    assert found.cost_s > single * 3 / 8 * 0.99          # never below the TTFT*(2) lower bound (minus overheads)


def test_parallel_prefill_does_not_pay_on_slow_links_or_short_contexts():
    slow = CPU_LIKE.with_(link_bandwidth_bytes_per_s=1e6)           # 1 MB/s
    C = 8192
    single = simulate_prefill(BENCH, [C], "single", slow).ttft_s
    assert single < simulate_prefill(BENCH, even_partition(C, 2), "kvr", slow).ttft_s
    assert single < simulate_prefill(BENCH, even_partition(C, 2), "tsp", slow).ttft_s
    laggy = CPU_LIKE.with_(link_latency_s=1e-3)                     # fine bandwidth, 1 ms per message
    C = 16
    single = simulate_prefill(BENCH, [C], "single", laggy).ttft_s
    assert single < simulate_prefill(BENCH, even_partition(C, 2), "kvr", laggy).ttft_s
    assert single < simulate_prefill(BENCH, even_partition(C, 2), "tsp", laggy).ttft_s


@pytest.mark.parametrize("method, chunks", [("kvr", [5000, 3192]), ("kvr", [2048] * 4), ("tsp", [2048] * 4),
                                           ("ring", [2048] * 4)])
def test_ttft_never_grows_with_bandwidth(method, chunks):
    times = [simulate_prefill(BENCH, chunks, method, CPU_LIKE.with_(link_bandwidth_bytes_per_s=bw)).ttft_s
             for bw in (1e6, 1e7, 1e8, 1e9, 1e10, 1e12)]
    assert all(a >= b for a, b in zip(times, times[1:]))
    assert times[0] > times[-1]


def test_overlap_helps_kvr():
    for chunks in ([5000, 3192], [3000, 2200, 1800, 1192]):
        for bw in (1e8, 3e9):
            cm = CPU_LIKE.with_(link_bandwidth_bytes_per_s=bw)
            blocking = simulate_prefill(BENCH, chunks, "kvr", cm, overlap=False).ttft_s
            assert simulate_prefill(BENCH, chunks, "kvr", cm, overlap=True).ttft_s < blocking


def test_noisy_link_hurts_tsp_more_than_kvr():
    cfg = LLAMA_7B.with_(max_context=16384)
    cm = a100_like(cfg)
    even = even_partition(16384, 4)
    noise = random_link_noise(0.5, seed=1)
    assert noise(0, 1, 3, 0) == noise(0, 1, 3, 0) >= 1.0            # deterministic, never speeds up
    slowdown = {}
    for method in ("tsp", "kvr"):
        quiet = simulate_prefill(cfg, even, method, cm).ttft_s
        noisy = simulate_prefill(cfg, even, method, cm, link_noise=noise).ttft_s
        assert noisy >= quiet
        assert simulate_prefill(cfg, even, method, cm, link_noise=noise).ttft_s == noisy
        slowdown[method] = noisy / quiet - 1
    assert slowdown["tsp"] > 2 * slowdown["kvr"]
    assert simulate_prefill(cfg, even, "kvr", cm, link_noise=0.5).ttft_s >= simulate_prefill(cfg, even, "kvr", cm).ttft_s


# --------------------------------------------------------------------------- searches on the simulator

def test_grid_search_on_the_simulator_matches_a_finer_exhaustive_search():
    cost = ttft_cost(BENCH, CPU_LIKE)
    grid = hierarchical_grid_search(cost, 1024, 3)
    reference = exhaustive_search(cost, 1024, 3, stride=4)            # 32,385 simulations
    assert grid.cost_s <= reference.cost_s * 1.001
    assert grid.evaluations * 50 < reference.evaluations
    assert grid.partition[0] > grid.partition[1] > grid.partition[2]


def test_compare_methods_orders_the_methods():
    out = compare_methods(BENCH, 4096, 2, CPU_LIKE)
    assert out["simulated"] is True
    assert out["kvr_searched"] <= out["kvr_even"] <= out["tsp"] < out["single"]
    assert out["lower_bound"] <= out["kvr_searched"]
    assert sum(out["kvr_searched_chunks"]) == 4096
    assert out["ring"] == simulate_prefill(BENCH, even_partition(4096, 2), "ring", CPU_LIKE).ttft_s
    assert out["lower_bound"] <= out["ring"] < out["single"]
    out4 = compare_methods(BENCH, 2048, 4, CPU_LIKE, min_stride=32)
    assert out4["kvr_searched"] <= out4["kvr_even"] and len(out4["kvr_searched_chunks"]) == 4


# --------------------------------------------------------------------------- cost models

def test_cost_model_round_trip_and_errors():
    d = CPU_LIKE.to_dict()
    assert CostModel.from_dict(d) == CPU_LIKE
    assert CPU_LIKE.qkv_s_per_token + CPU_LIKE.mlp_s_per_token == pytest.approx(12e-6)
    assert CPU_LIKE.transfer_s(3e6) == pytest.approx(1e-3 + 50e-6)
    with pytest.raises(ValueError, match="unknown CostModel fields"):
        CostModel.from_dict({**d, "flops": 1})
    with pytest.raises(ValueError, match="non-negative"):
        CPU_LIKE.with_(attn_s_per_dot=-1.0)
    with pytest.raises(ValueError, match="positive"):
        CPU_LIKE.with_(link_bandwidth_bytes_per_s=0)


def test_simulate_errors():
    with pytest.raises(ValueError, match=r"unknown method 'ulysses'; choose one of .*'ring'"):
        simulate_prefill(BENCH, [4, 4], "ulysses", CPU_LIKE)
    with pytest.raises(ValueError, match="one process"):
        simulate_prefill(BENCH, [4, 4], "single", CPU_LIKE)
    with pytest.raises(ValueError, match="at least one token"):
        simulate_prefill(BENCH, [4, 0], "kvr", CPU_LIKE)
    with pytest.raises(ValueError, match="CostModel"):
        simulate_prefill(BENCH, [4, 4], "kvr", {"attn_s_per_dot": 1.0})
    with pytest.raises(ValueError, match="link_noise"):
        simulate_prefill(BENCH, [4, 4], "kvr", CPU_LIKE, link_noise="loud")


def test_a100_like_preset_is_labelled_and_follows_flops():
    cfg = LLAMA_7B
    cm = a100_like(cfg)
    assert "assumed" in cm.label and cm.bytes_per_value == 2
    assert cm.attn_s_per_dot == pytest.approx(4 * 32 * 128 / (312e12 * 0.5))
    assert cm.link_bandwidth_bytes_per_s == 300e9
    with pytest.raises(ValueError, match="mfu"):
        a100_like(cfg, mfu=0)


def test_calibrate_smoke_on_tiny_sizes():
    threads = torch.get_num_threads()
    cm = CostModel.calibrate(get_config("tiny"), contexts=(8, 16, 32), repeats=1)
    assert torch.get_num_threads() == threads
    assert cm.bytes_per_value == 4 and cm.label.startswith("calibrated")
    assert min(cm.qkv_s_per_token, cm.mlp_s_per_token, cm.attn_s_per_dot, cm.layer_overhead_s) >= 0
    assert simulate_prefill(get_config("tiny"), [20, 12], "kvr", cm).ttft_s > 0
    with pytest.raises(ValueError, match="two context sizes"):
        CostModel.calibrate(get_config("tiny"), contexts=(16,))


def test_a_kernel_that_skips_masked_work_moves_the_best_split():
    from toyllm.partition import search_partition

    cfg = get_config("bench")
    dense = CPU_LIKE.with_(layer_overhead_s=0.0)
    causal = dense.with_(attention_pairs="causal")
    assert causal.pairs(4, 5, 9) == 4 * 5 + 10 and dense.pairs(4, 5, 9) == 36
    C = 8192
    best = {name: search_partition(ttft_cost(cfg, cm), C, 2).partition[0] / C
            for name, cm in [("dense", dense), ("causal", causal)]}
    assert best["causal"] > best["dense"] + 0.03     # masked pairs skipped: rank 1's rectangle is cheaper
    with pytest.raises(ValueError, match="attention_pairs"):
        CPU_LIKE.with_(attention_pairs="sparse")


# --------------------------------------------------------------------------- a cost model fitted to real runs' timelines

from types import SimpleNamespace  # noqa: E402


def _fake_run(method, chunks, cm_true, attention="dense", stall=None):
    """A PrefillResult-like run whose compute spans follow known coefficients exactly; ``stall`` =
    (rank, layer, label) makes that one span 100 times longer."""
    events, C = [], sum(chunks)
    for rank, c in enumerate(chunks):
        s = sum(chunks[:rank])
        t = 0.0
        for layer in range(BENCH.n_layers):
            attend_s = cm_true.attention_s(c, s, C if method == "tsp" else s + c)
            for label, seconds in (("qkv", cm_true.qkv_s_per_token * c), ("attention", attend_s),
                                   ("mlp", cm_true.mlp_s_per_token * c)):
                seconds *= 100 if stall == (rank, layer, label) else 1
                events.append({"rank": rank, "kind": "compute", "start_s": t, "end_s": t + seconds,
                               "layer": layer, "label": label})
                t += seconds
            events.append({"rank": rank, "kind": "recv_wait", "start_s": t, "end_s": t + 1.0, "layer": layer,
                           "label": "recv"})                   # not compute: left out of the fit
            if method == "tsp":                                # rank 0 also waits for rank 1 to arrive
                gather = cm_true.allgather_step_s(2 * max(chunks) * BENCH.n_kv_heads * BENCH.head_dim * 4)
                gather += 0.5 * gather if rank == 0 else 0.0
                events.append({"rank": rank, "kind": "allgather", "start_s": t, "end_s": t + gather, "layer": layer,
                               "label": ""})
        events.append({"rank": rank, "kind": "compute", "start_s": t, "end_s": t + 9.0, "layer": None,
                       "label": "lm_head"})                   # not a layer: left out of the fit
    return SimpleNamespace(method=method, partition=chunks, balance="none", attention=attention, timeline=events)


@pytest.mark.parametrize("attention, pairs", [("dense", "dense"), ("causal", "causal")])
def test_fit_runs_recovers_the_coefficients_behind_the_timelines(attention, pairs):
    truth = CPU_LIKE.with_(attention_pairs=pairs, layer_overhead_s=0.0)
    runs = [_fake_run(m, ch, truth, attention, stall) for m, ch, stall in
            [("kvr", [600, 400], (1, 2, "attention")), ("kvr", [500, 500], None), ("tsp", [1000, 1000], None),
             ("kvr", [1300, 700], (0, 0, "mlp"))]]
    cm = CostModel.fit_runs(BENCH, runs, link_bandwidth_bytes_per_s=4e9, link_latency_s=70e-6)
    assert cm.attention_pairs == pairs and cm.layer_overhead_s == 0.0
    # One stalled span in a run is outvoted by the same step's other layers.
    assert cm.qkv_s_per_token == pytest.approx(truth.qkv_s_per_token, rel=1e-9)
    assert cm.attn_s_per_dot == pytest.approx(truth.attn_s_per_dot, rel=1e-9)
    assert cm.mlp_s_per_token == pytest.approx(truth.mlp_s_per_token, rel=1e-9)
    assert (cm.link_bandwidth_bytes_per_s, cm.link_latency_s) == (4e9, 70e-6)
    # With those coefficients, the simulator's compute of a run is the run's compute, layer by layer.
    sim = simulate_prefill(BENCH, [500, 500], "kvr", cm.with_(link_bandwidth_bytes_per_s=1e30, link_latency_s=0))
    for rank in (0, 1):
        spans = sum(e["end_s"] - e["start_s"] for e in runs[1].timeline
                    if e["rank"] == rank and e["kind"] == "compute" and e["layer"] is not None)
        assert rank_kind_seconds(sim, rank, "compute") == pytest.approx(spans, rel=1e-9)


def test_attention_costs_more_per_pair_when_the_key_count_is_not_a_multiple_of_the_alignment():
    cm = ATTN_ONLY.with_(attn_unaligned_s_per_dot=0.5e-6)          # 1 us per pair, 1.5 us when ragged
    assert cm.attention_s(8, 0, 8) == pytest.approx(64 * 1e-6)
    assert cm.attention_s(6, 0, 6) == pytest.approx(36 * 1.5e-6)
    assert cm.attention_s(6, 10, 16) == pytest.approx(96 * 1e-6)   # 16 keys: aligned, whatever the chunk
    assert cm.with_(key_alignment=32).attention_s(6, 10, 16) == pytest.approx(96 * 1.5e-6)
    # The simulator charges it: two tokens moved between ranks change the rank's time by far more than 2 tokens' worth.
    ragged, even = (simulate_prefill(BENCH, ch, "kvr", cm.with_(link_latency_s=0.0)).ttft_s
                    for ch in ([94, 34], [96, 32]))
    assert ragged > 1.3 * even       # rank 0 ends about 94^2 * 1.5 / 96^2 = 1.44x later
    for bad in (0, -8, 2.5, True):
        with pytest.raises(ValueError, match="key_alignment"):
            cm.with_(key_alignment=bad)
    with pytest.raises(ValueError, match="attn_unaligned_s_per_dot"):
        cm.with_(attn_unaligned_s_per_dot=-1e-9)


def test_fit_runs_learns_what_ragged_key_counts_cost_with_the_dense_kernel():
    truth = CPU_LIKE.with_(layer_overhead_s=0.0, attn_unaligned_s_per_dot=0.3 * CPU_LIKE.attn_s_per_dot)
    chunks = [[600, 400], [500, 500], [1000, 1000], [1302, 698], [1228, 820]]
    runs = [_fake_run("kvr" if i else "tsp", ch, truth) for i, ch in enumerate(chunks)]
    link = dict(link_bandwidth_bytes_per_s=4e9, link_latency_s=70e-6)
    cm = CostModel.fit_runs(BENCH, runs, **link)
    assert cm.attn_s_per_dot == pytest.approx(truth.attn_s_per_dot, rel=1e-9)
    assert cm.attn_unaligned_s_per_dot == pytest.approx(truth.attn_unaligned_s_per_dot, rel=1e-9)
    # Aligned to 4 instead, 500 and 1228 are whole multiples and the two kinds of span mix: the fit cannot be exact.
    assert CostModel.fit_runs(BENCH, runs, key_alignment=4, **link).attn_s_per_dot != pytest.approx(
        truth.attn_s_per_dot, rel=1e-3)
    # Runs that are all aligned (or all ragged) cannot tell the two costs apart: one cost per pair, no surcharge.
    aligned = CostModel.fit_runs(BENCH, [runs[0], runs[2]], **link)      # keys 1000, 1000 and 2000
    assert aligned.attn_unaligned_s_per_dot == 0.0
    assert aligned.attn_s_per_dot == pytest.approx(truth.attn_s_per_dot, rel=1e-9)
    # A causal-aware kernel works in blocks: the surcharge is not fitted.
    causal = truth.with_(attention_pairs="causal", attn_unaligned_s_per_dot=0.0)
    cm = CostModel.fit_runs(BENCH, [_fake_run("kvr", ch, causal, "causal") for ch in chunks[1:]], **link)
    assert cm.attn_unaligned_s_per_dot == 0.0 and cm.attn_s_per_dot == pytest.approx(causal.attn_s_per_dot, rel=1e-9)


def test_fit_runs_gives_tsps_all_gather_its_own_cost_from_the_shortest_span_of_each_layer():
    truth = CPU_LIKE.with_(layer_overhead_s=0.0, allgather_bandwidth_bytes_per_s=1.2e9, allgather_latency_s=1.5e-3)
    runs = [_fake_run("tsp", [C // 2, C // 2], truth) for C in (1000, 2000, 3000)] + [_fake_run("kvr", [600, 400], truth)]
    link = dict(link_bandwidth_bytes_per_s=4e9, link_latency_s=70e-6)
    cm = CostModel.fit_runs(BENCH, runs, **link)
    assert cm.allgather_bandwidth_bytes_per_s == pytest.approx(1.2e9, rel=1e-9)
    assert cm.allgather_latency_s == pytest.approx(1.5e-3, rel=1e-9)
    piece = 2 * 1000 * BENCH.n_kv_heads * BENCH.head_dim * 4
    assert cm.allgather_step_s(piece) == pytest.approx(piece / 1.2e9 + 1.5e-3)
    assert cm.transfer_s(piece) == pytest.approx(piece / 4e9 + 70e-6)          # messages keep the link's cost
    # The simulator's TSP pays it once per layer; KV-Runahead does not use it.
    plain = cm.with_(allgather_bandwidth_bytes_per_s=None, allgather_latency_s=None)
    assert simulate_prefill(BENCH, [1000, 1000], "tsp", cm).ttft_s - simulate_prefill(
        BENCH, [1000, 1000], "tsp", plain).ttft_s == pytest.approx(
        BENCH.n_layers * (cm.allgather_step_s(piece) - cm.transfer_s(piece)))
    assert simulate_prefill(BENCH, [600, 400], "kvr", cm).ttft_s == simulate_prefill(BENCH, [600, 400], "kvr", plain).ttft_s
    # Fewer than two piece sizes: nothing to fit, the link serves the all-gather.
    one = CostModel.fit_runs(BENCH, runs[:1] + runs[3:], **link)
    assert (one.allgather_bandwidth_bytes_per_s, one.allgather_latency_s) == (None, None)
    # A what-if link carries the all-gather too: the measured cost goes, the link's own takes its place.
    faster = cm.with_link(40e9, latency_s=10e-6)
    assert (faster.allgather_bandwidth_bytes_per_s, faster.allgather_latency_s) == (None, None)
    assert faster.allgather_step_s(piece) == faster.transfer_s(piece) == pytest.approx(piece / 40e9 + 10e-6)
    assert cm.with_link(40e9).link_latency_s == cm.link_latency_s
    with pytest.raises(ValueError, match="give both or neither"):
        plain.with_(allgather_latency_s=1e-3)
    with pytest.raises(ValueError, match="allgather_bandwidth_bytes_per_s must be positive"):
        cm.with_(allgather_bandwidth_bytes_per_s=0.0)
    with pytest.raises(ValueError, match="allgather_latency_s must be a non-negative"):
        cm.with_(allgather_latency_s=-1.0)


def test_fit_runs_rejects_what_it_cannot_fit():
    one = _fake_run("kvr", [600, 400], CPU_LIKE)
    link = dict(link_bandwidth_bytes_per_s=4e9, link_latency_s=0.0)
    with pytest.raises(ValueError, match="at least one run"):
        CostModel.fit_runs(BENCH, [], **link)
    with pytest.raises(ValueError, match="too few different chunk sizes"):
        CostModel.fit_runs(BENCH, [_fake_run("kvr", [500, 500], CPU_LIKE)], **link)
    with pytest.raises(ValueError, match="different attention kernels"):
        CostModel.fit_runs(BENCH, [one, _fake_run("kvr", [500, 500], CPU_LIKE, attention="causal")], **link)
    with pytest.raises(ValueError, match="'tsp' \\(balance 'none'\\) and 'kvr' runs"):
        CostModel.fit_runs(BENCH, [SimpleNamespace(**{**vars(one), "method": "single"})], **link)
