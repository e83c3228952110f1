"""Disaggregated prefill: the cache shipped between two processes, the simulated links, serving on two workers.

No test asserts on a timing: only on structure, counts and equality.
"""
import math

import pytest
import torch

from toyllm import build_model
from toyllm.analysis import LLAMA2_13B, kv_cache_bytes
from toyllm.disagg import (LINKS, ShipOrRecompute, break_even_bandwidth, format_shipping_table, link,
                           serve_disaggregated, ship_kv_cache, shipping_pays, shipping_table, transfer_bytes)
from toyllm.generation import generate
from toyllm.model import get_config
from toyllm.parallel.runner import ModelSpec, single_prefill
from toyllm.serving import Request, poisson_workload
from toyllm.simulate import a100_like
from toyllm.utils import random_prompt

SPEC = ModelSpec("tiny")
IDS = random_prompt(40, 256, seed=1)
# A parallel prefill sums in another order than one process: its logits may differ by rounding.
ATOL = 1e-5


@pytest.fixture(scope="module")
def model():
    return SPEC.build()


@pytest.fixture(scope="module")
def reference(model):
    """One process, one thread (as each worker runs): the first logits, the cache and the greedy tokens."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        logits, cache = single_prefill(model, IDS)
        tokens = generate(model, IDS, 6, cache="dynamic").output_ids
    finally:
        torch.set_num_threads(before)
    return logits, cache, tokens


# --------------------------------------------------------------------------- real shipping

@pytest.mark.engine
@pytest.mark.needs("8.4")
@pytest.mark.timeout(120)
def test_a_shipped_cache_arrives_bit_for_bit_and_decodes_the_same_tokens(model, reference):
    logits, cache, tokens = reference
    r = ship_kv_cache(SPEC, IDS, 6, rounds=2, return_cache=True, timeout_s=90)
    assert torch.equal(r.first_logits, logits)
    assert r.output_ids == tokens
    for (k, v), (k2, v2) in zip(cache, r.kv_cache):
        assert torch.equal(k, k2) and torch.equal(v, v2)                 # (1, Hkv, C, D) each
    assert r.transfer_bytes == transfer_bytes(model.config, len(IDS), 4) == 2 * 2 * 2 * 16 * 40 * 4
    assert r.layout == "per_layer" and r.messages == model.config.n_layers
    assert len(r.transfer_runs) == len(r.recompute_runs) == len(r.prefill_runs) == 2
    assert len(r.decode_step_s) == 5 and r.verdict.word == "undecided"          # 2 rounds cannot decide


@pytest.mark.engine
@pytest.mark.needs("8.4", "5.2")
@pytest.mark.timeout(180)
def test_a_kv_runahead_prefill_ships_its_last_ranks_cache_in_one_message(model, reference):
    logits, _, tokens = reference
    r = ship_kv_cache(SPEC, IDS, 6, method="kvr", prefill_ranks=2, layout="flat", rounds=1, warmup=0,
                      timeout_s=120)
    assert (r.first_logits - logits).abs().max().item() < ATOL
    assert r.output_ids == tokens
    assert r.messages == 1 and r.transfer_bytes == transfer_bytes(model.config, len(IDS))
    assert r.prefill_ranks == 2 and len(r.prefill_runs) == len(r.transfer_runs) == 1


@pytest.mark.engine
@pytest.mark.needs("8.4", "9.1", "9.2", "9.3")
@pytest.mark.timeout(180)
def test_a_ring_prefill_ships_the_shards_gathered_on_its_last_rank(model, reference):
    logits, _, tokens = reference
    r = ship_kv_cache(SPEC, IDS, 6, method="ring", prefill_ranks=2, rounds=1, warmup=0, timeout_s=120)
    assert (r.first_logits - logits).abs().max().item() < ATOL
    assert r.output_ids == tokens
    assert r.transfer_bytes == transfer_bytes(model.config, len(IDS)) and r.prefill_ranks == 2


@pytest.mark.parametrize("kwargs, message", [
    ({"decode_tokens": 0}, "decode_tokens must be an int >= 1"),
    ({"layout": "zip"}, "unknown layout 'zip'"),
    ({"rounds": 0}, "rounds must be an int >= 1"),
    ({"method": "mesh"}, "unknown method 'mesh'"),
])
def test_bad_shipping_requests_are_refused_before_any_process_starts(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ship_kv_cache(SPEC, IDS, **{"decode_tokens": 4, **kwargs})
    with pytest.raises(ValueError, match="empty"):
        ship_kv_cache(SPEC, [], 4)


# --------------------------------------------------------------------------- bytes and the simulated links

@pytest.mark.needs("8.4")
def test_transfer_bytes_is_the_kv_cache_size_of_the_prompt():
    cfg = get_config("smollm2-135m")
    assert transfer_bytes(cfg, 1000, 2) == 2 * 30 * 3 * 64 * 1000 * 2
    assert transfer_bytes(cfg, 7, 4) == kv_cache_bytes(30, 3, 64, 7, 4)
    assert transfer_bytes(LLAMA2_13B, 8192, 2) == 6_710_886_400


@pytest.mark.needs("8.4")
def test_shipping_costs_bytes_over_bandwidth_plus_latency_and_breaks_even_exactly():
    cfg = get_config("bench")
    cm = a100_like(cfg, link_bandwidth_bytes_per_s=10e9)
    d = shipping_pays(cfg, 1024, cm)
    assert isinstance(d, ShipOrRecompute) and d.simulated
    assert d.transfer_bytes == 2 * 4 * 8 * 32 * 1024 * 2                       # fp16 on the wire
    assert d.transfer_s == d.transfer_bytes / 10e9 + 10e-6
    bw = break_even_bandwidth(cfg, 1024, cm)
    assert bw == d.break_even_bytes_per_s
    at = shipping_pays(cfg, 1024, cm.with_(link_bandwidth_bytes_per_s=bw))
    assert math.isclose(at.transfer_s, at.recompute_s, rel_tol=1e-9)
    assert shipping_pays(cfg, 1024, cm.with_(link_bandwidth_bytes_per_s=bw * 1.01)).pays
    assert not shipping_pays(cfg, 1024, cm.with_(link_bandwidth_bytes_per_s=bw * 0.99)).pays
    # a latency longer than the whole recompute: no link is fast enough
    assert break_even_bandwidth(cfg, 1024, cm.with_(link_latency_s=1.0)) == math.inf


@pytest.mark.needs("8.4")
def test_a_faster_link_never_stops_shipping_from_paying_and_the_table_says_simulated():
    cfg = get_config("smollm2-135m")
    cm = a100_like(cfg)
    rows = shipping_table(cfg, [256, 4096], cm)
    assert [r["context"] for r in rows] == [256, 4096] and all(r["simulated"] for r in rows)
    for r in rows:
        by_speed = sorted(LINKS, key=LINKS.get)
        times = [r["transfer_s"][n] for n in by_speed]
        assert times == sorted(times, reverse=True)
        pays = [r["pays"][n] for n in by_speed]
        assert pays == sorted(pays)                                            # False ... then True
        assert pays == [LINKS[n] > r["break_even_bytes_per_s"] for n in by_speed]
    assert rows[1]["transfer_s"]["0.1 GB/s"] == rows[1]["transfer_bytes"] / 0.1e9 + cm.link_latency_s
    assert format_shipping_table(rows).startswith("simulated, not measured")


@pytest.mark.parametrize("call, message", [
    (lambda cfg: transfer_bytes(cfg, 0), "tokens >= 1"),
    (lambda cfg: transfer_bytes(cfg, 5, 0), "bytes_per_value > 0"),
    (lambda cfg: link(0.0), "bandwidth must be a finite number of bytes/s > 0"),
    (lambda cfg: link(-1e9), "bandwidth must be"),
    (lambda cfg: shipping_table(cfg, [16], a100_like(cfg), {"bad": 0}), "bandwidth must be"),
    (lambda cfg: shipping_pays(cfg, 0, a100_like(cfg)), "tokens must be an int >= 1"),
    (lambda cfg: shipping_pays(cfg, 16, 10e9), "cost_model must be a CostModel"),
])
@pytest.mark.needs("8.4")
def test_bad_numbers_are_refused_with_a_clear_message(call, message):
    with pytest.raises(ValueError, match=message):
        call(get_config("tiny"))


# --------------------------------------------------------------------------- serving on two workers

@pytest.fixture(scope="module")
def served_model():
    return build_model("tiny", seed=0)


@pytest.mark.needs("8.1", "8.2", "8.4")
def test_disaggregated_serving_gives_the_tokens_of_one_request_at_a_time(served_model):
    m = served_model
    workload = poisson_workload(10, rate_per_s=400.0, vocab_size=m.config.vocab_size, prompt_tokens=(3, 40),
                                new_tokens=(1, 12), seed=3)
    want = {r.id: generate(m, list(r.prompt_ids), r.max_new_tokens, cache="dynamic").output_ids for r in workload}
    wire = link(1e9, latency_s=50e-6)
    result = serve_disaggregated(m, workload, wire, max_batch=4, block_size=4)
    assert result.policy == "disaggregated" and [r.id for r in result.requests] == [r.id for r in workload]
    for r in result.requests:
        assert r.output_ids == want[r.id], r.id
        assert r.arrival_s <= r.first_token_s <= r.finish_s and r.ttft_s >= 0 and r.tpot_s >= 0
    shipped = {r.id: r for r in workload if r.max_new_tokens > 1}
    assert set(result.transfer_s) == set(shipped)                        # a one-token answer ships nothing
    for rid, seconds in result.transfer_s.items():
        assert seconds == wire.transfer_s(transfer_bytes(m.config, len(shipped[rid].prompt_ids), 4))
    assert result.compute_s == result.prefill_compute_s + result.decode_compute_s
    assert result.output_tokens == sum(r.max_new_tokens for r in workload) and result.throughput > 0
    assert sum(result.iteration_tokens) == sum(len(r.prompt_ids) for r in workload) + \
        sum(r.max_new_tokens - 1 for r in workload)                       # every prompt once, every decode once


@pytest.mark.parametrize("kwargs, message", [
    ({"max_batch": 0}, "max_batch must be an int >= 1"),
    ({"block_size": 0}, "block_size must be an int >= 1"),
    ({"link_model": 1e9}, "link_model must be a CostModel"),
])
def test_bad_serving_settings_are_refused(served_model, kwargs, message):
    reqs = [Request(0, (1, 2, 3), 2)]
    with pytest.raises(ValueError, match=message):
        serve_disaggregated(served_model, reqs, **{"link_model": link(1e9), **kwargs})
    with pytest.raises(ValueError, match="no requests"):
        serve_disaggregated(served_model, [], link(1e9))
