"""Serving many requests: the same greedy tokens as one request at a time, under every policy."""
import pytest
import torch

from toyllm import build_model
from toyllm.cache import DynamicKVCache
from toyllm.generation import generate
from toyllm.paged import BlockPool, PagedKVCache
from toyllm.serving import POLICIES, POLICY, Request, Scheduler, Waiting, poisson_workload, ragged_forward, serve
from toyllm.utils import random_prompt

pytestmark = pytest.mark.needs("8.1", "8.2", "8.3")     # the paged cache's steps and the scheduler's plan


@pytest.fixture(scope="module")
def model():
    return build_model("tiny", seed=0)


@pytest.fixture(scope="module")
def workload(model):
    return poisson_workload(10, rate_per_s=400.0, vocab_size=model.config.vocab_size, prompt_tokens=(3, 40),
                            new_tokens=(1, 12), seed=3)


@pytest.fixture(scope="module")
def one_at_a_time(model, workload):
    return {r.id: generate(model, list(r.prompt_ids), r.max_new_tokens, cache="dynamic").output_ids for r in workload}


@torch.no_grad()
def test_a_ragged_forward_gives_each_sequence_its_own_logits(model):
    pool = BlockPool.for_model(model.config, 32, 4)
    prompts = [random_prompt(n, model.config.vocab_size, seed=n) for n in (5, 9, 1)]
    caches = [PagedKVCache(pool) for _ in prompts]
    got = ragged_forward(model, list(zip(caches, prompts)))
    for prompt, row in zip(prompts, got):
        want = model(torch.tensor([prompt]), cache=DynamicKVCache(model.config.n_layers))[0, -1]
        torch.testing.assert_close(row, want, rtol=0, atol=1e-5)
    nxt = ragged_forward(model, [(c, [7]) for c in caches])         # one decode token each, at its own position
    for prompt, row in zip(prompts, nxt):
        want = model(torch.tensor([prompt + [7]]))[0, -1]
        torch.testing.assert_close(row, want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_gives_the_tokens_of_one_request_at_a_time(model, workload, one_at_a_time, policy):
    result = serve(model, workload, policy, max_batch=4, token_budget=16, block_size=4)
    assert [r.id for r in result.requests] == [r.id for r in workload]
    for r in result.requests:
        assert r.output_ids == one_at_a_time[r.id], r.id
        assert r.arrival_s <= r.first_token_s <= r.finish_s and r.ttft_s >= 0 and r.tpot_s >= 0
    assert result.output_tokens == sum(r.max_new_tokens for r in workload)
    assert result.compute_s <= result.clock_s and result.throughput > 0


def test_chunked_prefill_keeps_every_iteration_within_the_token_budget(model, workload):
    result = serve(model, workload, "chunked", max_batch=4, token_budget=10, block_size=4)
    assert max(result.iteration_tokens) <= 10
    whole = serve(model, workload, "continuous", max_batch=4, block_size=4)
    assert max(whole.iteration_tokens) > 10                      # whole prompts: 40-token iterations exist


def test_a_finished_sequence_leaves_at_once_and_a_waiting_one_joins(model):
    v = model.config.vocab_size
    reqs = [Request(0, tuple(random_prompt(4, v, 1)), 2), Request(1, tuple(random_prompt(4, v, 2)), 9),
            Request(2, tuple(random_prompt(4, v, 3)), 2)]                  # all waiting at time 0, two seats
    cont = {r.id: r for r in serve(model, reqs, "continuous", max_batch=2, block_size=4).requests}
    static = {r.id: r for r in serve(model, reqs, "static", max_batch=2, block_size=4).requests}
    assert cont[2].first_token_s < cont[1].finish_s        # request 2 took request 0's seat while 1 still ran
    assert static[2].first_token_s > static[1].finish_s    # a static batch waits for its longest sequence
    assert static[0].finish_s == static[1].finish_s        # ... and leaves together


def _scheduler(model, policy, requests):
    pool = BlockPool.for_model(model.config, 4, 4)              # 4 blocks of 4 tokens
    sched = Scheduler(pool, POLICY[policy], max_batch=3)
    for r in requests:
        sched.add(Waiting(r, r.arrival_s))
    return sched


@pytest.mark.timeout(60)
def test_the_scheduler_seats_by_arrival_seats_and_blocks_and_retiring_gives_the_blocks_back(model):
    reqs = [Request(3, (9,), 1, arrival_s=1e6),                # arrives long after the rest
            Request(0, (1, 2, 3, 4, 5), 3), Request(1, (1, 2, 3), 1), Request(2, (6, 7, 8), 4)]   # 2, 1, 2 blocks
    sched = _scheduler(model, "continuous", reqs)
    sched.admit()
    assert [s.request.id for s in sched.running] == [0, 1] and sched.reserved == 3     # 2 does not fit beside them
    sched.step(model)                                           # both prompts whole: 1's one token, and it leaves
    assert [r.id for r in sched.finished] == [1] and [s.request.id for s in sched.running] == [0]
    assert sched.reserved == 2 and sched.pool.used_blocks == 2
    sched.step(model)                                           # its blocks went back: 2 takes the seat
    assert [s.request.id for s in sched.running] == [0, 2]
    while sched.busy:
        sched.step(model)
    assert sorted(r.id for r in sched.finished) == [0, 1, 2, 3]
    assert sched.reserved == 0 and sched.pool.used_blocks == 0
    assert next(r for r in sched.finished if r.id == 3).first_token_s > 1e6    # the clock waited for it


@pytest.mark.timeout(60)
def test_a_static_batch_is_seated_and_retired_as_one(model):
    sched = _scheduler(model, "static", [Request(0, (1, 2), 3), Request(1, (3, 4), 1), Request(2, (5,), 1)])
    sched.step(model)
    assert [s.request.id for s in sched.running] == [0, 1, 2] and sched.finished == []   # 1 and 2 wait for 0
    while sched.running:
        sched.step(model)
    assert sorted(r.id for r in sched.finished) == [0, 1, 2] and len({r.finish_s for r in sched.finished}) == 1


def test_a_shared_system_prompt_is_computed_once_and_changes_no_token(model):
    drawn = poisson_workload(6, rate_per_s=50.0, vocab_size=model.config.vocab_size, prompt_tokens=(2, 6),
                             new_tokens=(2, 6), shared_prefix=24, seed=5)
    # a second apart: each request runs alone, after the one before has finished and given its blocks back
    reqs = [Request(r.id, r.prompt_ids, r.max_new_tokens, arrival_s=float(r.id)) for r in drawn]
    shared = serve(model, reqs, "chunked", max_batch=3, token_budget=32, block_size=8, share_prefixes=True)
    plain = serve(model, reqs, "chunked", max_batch=3, token_budget=32, block_size=8)
    assert [r.output_ids for r in shared.requests] == [r.output_ids for r in plain.requests]
    computed = [r.prompt_tokens_computed for r in shared.requests]
    assert computed[0] == len(reqs[0].prompt_ids)                        # the first computes all of it
    assert computed[1:] == [len(r.prompt_ids) - 24 for r in reqs[1:]]    # the rest: three whole blocks found


def test_percentiles_are_nearest_rank(model, workload):
    result = serve(model, workload, "chunked", max_batch=4, token_budget=16, block_size=4)
    ttfts = sorted(r.ttft_s for r in result.requests)
    assert result.percentile("ttft_s", 50) == ttfts[4] and result.percentile("ttft_s", 100) == ttfts[-1]
    assert result.percentile("ttft_s", 0) == ttfts[0]


@pytest.mark.parametrize("kwargs, message", [
    ({"policy": "fastest"}, "unknown policy 'fastest'"),
    ({"max_batch": 0}, "max_batch must be an int >= 1"),
    ({"token_budget": 4, "max_batch": 4}, "token_budget 4 leaves no room"),
    ({"block_size": 0}, "block_size must be an int >= 1"),
])
def test_bad_settings_are_refused_before_any_work(model, workload, kwargs, message):
    with pytest.raises(ValueError, match=message):
        serve(model, workload, **kwargs)


def test_a_bad_workload_is_refused(model):
    with pytest.raises(ValueError, match="max_context"):
        serve(model, [Request(0, (1,) * model.config.max_context, 4)])
    with pytest.raises(ValueError, match="finite rate > 0"):
        poisson_workload(3, 0.0, 256)


def test_the_paging_explorer_counts_whole_blocks_and_the_static_reservation():
    from toyllm.model import get_config
    from toyllm.widgets import PagingExplorer

    cfg = get_config("smollm2-135m")
    e = PagingExplorer(cfg, [30, 70, 120, 9], max_tokens=2048, block_size=16, plot=False)
    per_token = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * 4          # float32 K and V, bytes
    assert e.used_bytes == 229 * per_token and e.paged_bytes == (32 + 80 + 128 + 16) * per_token
    assert e.static_bytes == 4 * 2 * 2047 * per_token and e.unused_share == pytest.approx(27 / 256)
    e.block_size.value = 1
    assert e.paged_bytes == e.used_bytes and e.unused_share == 0
    with pytest.raises(ValueError, match="lengths must be 1 to max_tokens"):
        PagingExplorer(cfg, [3000], max_tokens=2048, plot=False)
