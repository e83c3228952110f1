"""Batched generation: B prompts in one call give what B single calls give; bad batches are rejected."""
import pytest
import torch

from toyllm import DynamicKVCache, GenerationResult, StaticKVCache, build_model, generate, get_config
from toyllm.bench.decode import BLOG_TOY
from toyllm.generation import sample_next_tokens
from toyllm.utils import random_prompt

LOGIT_ATOL = 1e-4   # float32; a batch's matmuls may sum in another order than one row's


@pytest.fixture(scope="module")
def tiny():
    return build_model(get_config("tiny").with_(n_kv_heads=1))


def _prompts(n, length=12, vocab=256):
    return [random_prompt(length, vocab, seed=s) for s in range(n)]


@pytest.mark.parametrize("method, cache", [("naive", "static"), ("cached", "static"), ("cached", "dynamic")])
def test_greedy_batch_equals_single_calls(tiny, method, cache):
    prompts = _prompts(3)
    batch = generate(tiny, prompts, 20, method=method, cache=cache, return_logits=True)
    assert isinstance(batch, list) and len(batch) == 3
    for p, got in zip(prompts, batch):
        one = generate(tiny, p, 20, method=method, cache=cache, return_logits=True)
        assert isinstance(got, GenerationResult) and got.prompt_ids == p
        assert got.output_ids == one.output_ids
        assert max((a - b).abs().max().item() for a, b in zip(got.logits, one.logits)) < LOGIT_ATOL


def test_naive_and_cached_batches_agree(tiny):
    prompts = _prompts(4)
    naive = generate(tiny, prompts, 16, method="naive")
    cached = generate(tiny, prompts, 16, method="cached")
    assert [r.output_ids for r in naive] == [r.output_ids for r in cached]
    assert len({tuple(r.output_ids) for r in cached}) > 1       # different prompts, different answers


def test_seeded_sampled_batch_is_reproducible_and_the_same_naive_or_cached(tiny):
    prompts = _prompts(4)
    kw = dict(temperature=1.0, top_k=20, top_p=0.95)
    a = [r.output_ids for r in generate(tiny, prompts, 16, seed=5, **kw)]
    b = [r.output_ids for r in generate(tiny, prompts, 16, seed=5, **kw)]
    c = [r.output_ids for r in generate(tiny, prompts, 16, seed=6, **kw)]
    naive = [r.output_ids for r in generate(tiny, prompts, 16, method="naive", seed=5, **kw)]
    assert a == b == naive and a != c


def test_batched_sampler_draws_each_row_from_its_own_softmax():
    g = torch.Generator().manual_seed(0)
    rows = torch.tensor([[1.0, 0.0, -1.0], [-1.0, 0.0, 1.0]])
    logits = rows.repeat(3000, 1)                                   # (6000, 3): the two rows alternate
    draws = sample_next_tokens(logits, 2.0, generator=g)
    assert draws.shape == (6000,)
    for r in range(2):
        freq = torch.bincount(draws[r::2], minlength=3) / 3000
        assert torch.allclose(freq, torch.softmax(rows[r] / 2.0, -1), atol=0.03)
    cut = sample_next_tokens(torch.tensor([[3.0, 2.0, 1.0, 0.0]] * 200), 1.0, top_k=2, generator=g)
    assert set(cut.tolist()) == {0, 1}
    assert sample_next_tokens(rows, 0.0).tolist() == [0, 2]         # greedy: argmax per row


def test_each_sequence_stops_at_its_own_eos(tiny):
    prompts = _prompts(3)
    free = generate(tiny, prompts, 12)
    eos = free[1].output_ids[3]                                     # sequence 1 produces it at step 3
    stopped = generate(tiny, prompts, 12, eos_id=eos)
    for f, s in zip(free, stopped):
        cut = f.output_ids.index(eos) + 1 if eos in f.output_ids else len(f.output_ids)
        assert s.output_ids == f.output_ids[:cut] and s.stopped_on_eos == (eos in f.output_ids)
    assert stopped[1].stopped_on_eos and len(stopped[1].output_ids) <= 4


def test_one_prompt_gives_a_result_and_a_batch_of_one_a_list(tiny):
    p = random_prompt(8, 256)
    one = generate(tiny, p, 5)
    batch = generate(tiny, [p], 5)
    tensor_batch = generate(tiny, torch.tensor([p]), 5)
    tensor_one = generate(tiny, torch.tensor(p, dtype=torch.int32), 5)      # any integer dtype
    assert isinstance(one, GenerationResult) and isinstance(tensor_one, GenerationResult)
    assert isinstance(batch, list) and batch[0].output_ids == one.output_ids == tensor_batch[0].output_ids
    assert tensor_one.output_ids == one.output_ids and tensor_one.prompt_ids == one.prompt_ids == p
    assert all(type(t) is int for t in tensor_batch[0].prompt_ids + tensor_batch[0].output_ids)


def test_a_batch_continues_after_a_prefilled_cache(tiny):
    prompts = _prompts(2, length=20)
    expected = [r.output_ids for r in generate(tiny, prompts, 6)]
    cache = StaticKVCache.for_model(tiny.config, 40, batch=2)
    tiny(torch.tensor([p[:15] for p in prompts]), cache=cache)    # 15 tokens of each already cached
    got = generate(tiny, [p[15:] for p in prompts], 6, cache=cache)
    assert [r.output_ids for r in got] == expected


def test_blog_configuration_naive_equals_cached():
    model = build_model(BLOG_TOY)
    prompts = torch.randint(0, BLOG_TOY.vocab_size, (64, 50), generator=torch.Generator().manual_seed(0))
    naive = generate(model, prompts, 10, method="naive")
    cached = generate(model, prompts, 10, method="cached")
    assert len(cached) == 64 and all(len(r.output_ids) == 10 for r in cached)
    assert [r.output_ids for r in naive] == [r.output_ids for r in cached]


@pytest.mark.parametrize("prompts, message", [
    ([[1, 2, 3], [4, 5]], r"prompts in prompt_ids have different lengths \[2, 3\].*equal length"),
    ([], "prompt is empty: prompt_ids needs at least one token"),
    (torch.empty(0, 5, dtype=torch.long), "prompt is empty"),
    (torch.empty(3, 0, dtype=torch.long), r"prompt is empty: prompt_ids has shape \(3, 0\)"),
    (torch.tensor([1.0, 2.5]), "token ids must be integers, got a tensor of dtype torch.float32"),
    ([[1, 2], []], "prompt 1 of the batch is empty"),
    ([[1, 2], 3], "prompt_ids mixes token ids and lists"),
    (torch.zeros(2, 2, 2, dtype=torch.long), "prompt_ids as a tensor must be 1-D .* or 2-D"),
    ([[1, 2], [3, 999]], r"token ids must lie in \[0, 256\)"),
])
def test_bad_batches_are_rejected(tiny, prompts, message):
    with pytest.raises(ValueError, match=message):
        generate(tiny, prompts, 4)


def test_batch_options_that_cannot_apply_are_rejected(tiny):
    with pytest.raises(ValueError, match="on_token streams one sequence; this batch has 2 prompts"):
        generate(tiny, _prompts(2), 4, on_token=print)
    with pytest.raises(ValueError, match="static cache was built for batch 1, but prompt_ids has 2 prompts"):
        generate(tiny, _prompts(2), 4, cache=StaticKVCache.for_model(tiny.config, 32))
    cache = DynamicKVCache(tiny.config.n_layers)
    tiny(torch.tensor(_prompts(2)), cache=cache)
    with pytest.raises(ValueError, match="the cache holds 2 sequence.s., but prompt_ids has 3 prompts"):
        generate(tiny, _prompts(3), 4, cache=cache)
    with pytest.raises(ValueError, match=r"prefilled_logits must have shape \(2, 256\)"):
        generate(tiny, _prompts(2), 4, cache=cache, prefilled_logits=torch.zeros(256))
