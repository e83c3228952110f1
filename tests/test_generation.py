"""Generation: naive == cached (tokens and logits), sampling, streaming, bad input."""
import pytest
import torch

from toyllm import StaticKVCache, build_model, generate, get_config, sample_next_token
from toyllm.generation import random_prompt

LOGIT_ATOL = 1e-4   # float32; cached attention sums over the same keys in another order


@pytest.mark.parametrize("n_kv_heads", [2, 1])
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_naive_and_cached_agree_on_tiny(n_kv_heads, cache):
    model = build_model(get_config("tiny").with_(n_kv_heads=n_kv_heads))
    ids = random_prompt(64, 256)
    naive = generate(model, ids, 40, method="naive", return_logits=True)
    cached = generate(model, ids, 40, method="cached", cache=cache, return_logits=True)
    assert naive.output_ids == cached.output_ids
    diff = max((a - b).abs().max().item() for a, b in zip(naive.logits, cached.logits))
    assert diff < LOGIT_ATOL


def test_tiny_fits_a_64_token_prompt_and_256_new_tokens():
    model = build_model("tiny")
    out = generate(model, random_prompt(64, 256), 256, cache="static")
    assert len(out.output_ids) == 256 and out.ttft_s > 0 and out.tpot_s > 0


@pytest.mark.slow
def test_naive_and_cached_agree_on_smollm2(smollm2):
    model, tok = smollm2
    ids = tok.encode_chat("Name three colours.")
    naive = generate(model, ids, 12, method="naive", return_logits=True)
    cached = generate(model, ids, 12, method="cached", return_logits=True)
    static = generate(model, ids, 12, method="cached", cache="static", return_logits=True)
    assert naive.output_ids == cached.output_ids == static.output_ids
    assert max((a - b).abs().max().item() for a, b in zip(naive.logits, cached.logits)) < 1e-3


def test_seeded_sampling_is_reproducible():
    model = build_model("tiny")
    kw = dict(temperature=1.0, top_k=50, top_p=0.9)
    a = generate(model, random_prompt(8, 256), 30, seed=123, **kw).output_ids
    b = generate(model, random_prompt(8, 256), 30, seed=123, **kw).output_ids
    c = generate(model, random_prompt(8, 256), 30, seed=124, **kw).output_ids
    assert a == b and a != c


def test_sampling_respects_top_k_and_top_p():
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0, -1.0])
    g = torch.Generator().manual_seed(0)
    draws = {sample_next_token(logits, 1.0, top_k=2, generator=g) for _ in range(200)}
    assert draws == {0, 1}
    # p(0) = 0.64, p(1) = 0.24: top_p=0.8 keeps the two of them only
    draws = {sample_next_token(logits, 1.0, top_p=0.8, generator=g) for _ in range(200)}
    assert draws == {0, 1}
    assert sample_next_token(logits, 0.0) == 0
    assert {sample_next_token(logits, 1.0, top_p=0.01, generator=g) for _ in range(20)} == {0}


def test_sampling_frequencies_follow_the_softmax():
    logits = torch.tensor([1.0, 0.0, -1.0])
    g = torch.Generator().manual_seed(0)
    n = 4000
    counts = torch.bincount(torch.tensor([sample_next_token(logits, 2.0, generator=g) for _ in range(n)]), minlength=3)
    expected = torch.softmax(logits / 2.0, -1)
    assert torch.allclose(counts / n, expected, atol=0.03)


def test_stops_on_eos_and_streams_tokens():
    model = build_model("tiny")
    first = generate(model, random_prompt(10, 256), 5).output_ids
    streamed = []
    out = generate(model, random_prompt(10, 256), 50, eos_id=first[2], on_token=streamed.append)
    assert out.output_ids == first[:3] == streamed and out.stopped_on_eos


@pytest.mark.parametrize("kwargs, message", [
    (dict(prompt_ids=[]), "prompt is empty"),
    (dict(prompt_ids=[1] * 1025), "prompt has 1025 tokens but max_context is 1024"),
    (dict(max_new_tokens=-1), "max_new_tokens must be >= 0"),
    (dict(max_new_tokens=1020), r"exceeds max_context=1024"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
    (dict(temperature=-0.5), "temperature must be a finite number >= 0"),
    (dict(top_k=0), "top_k must be a positive integer"),
    (dict(method="magic"), "unknown method 'magic'"),
    (dict(cache="paged"), "unknown cache 'paged'"),
    (dict(cache=StaticKVCache(2, 2, 16, window=8)), "cache too small"),
])
def test_bad_requests_are_rejected(kwargs, message):
    model = build_model("tiny")
    args = dict(prompt_ids=[1, 2, 3, 4, 5], max_new_tokens=10) | kwargs
    with pytest.raises(ValueError, match=message):
        generate(model, args.pop("prompt_ids"), args.pop("max_new_tokens"), **args)


def test_chunked_prefill_through_the_public_api_equals_one_pass():
    from toyllm import DynamicKVCache, prefill

    model = build_model("tiny")
    ids = torch.tensor([random_prompt(40, 256, seed=3)])
    whole = prefill(model, ids, DynamicKVCache(model.config.n_layers))
    for cache in (DynamicKVCache(model.config.n_layers), StaticKVCache.for_model(model.config, 64)):
        prefill(model, ids[:, :17], cache)
        prefill(model, ids[:, 17:30], cache)
        last = prefill(model, ids[:, 30:], cache)
        assert cache.length == 40
        torch.testing.assert_close(last, whole, atol=1e-5, rtol=0)


def test_generate_continues_after_a_prefilled_cache():
    from toyllm import DynamicKVCache, prefill

    model = build_model("tiny")
    ids = random_prompt(30, 256, seed=4)
    expected = generate(model, ids, 8).output_ids
    cache = DynamicKVCache(model.config.n_layers)
    prefill(model, torch.tensor([ids[:20]]), cache)          # the first 20 tokens are already cached
    assert generate(model, ids[20:], 8, cache=cache).output_ids == expected


@pytest.mark.parametrize("start", [0, 5])
@pytest.mark.parametrize("with_cache", [False, True])
def test_last_only_logits_equal_the_last_row_of_full_logits(start, with_cache):
    from toyllm import DynamicKVCache

    model = build_model("tiny")
    ids = torch.tensor([random_prompt(12, 256, seed=5)])
    caches = [DynamicKVCache(model.config.n_layers) if with_cache else None for _ in range(2)]
    if with_cache:   # a cache already holding `start` tokens puts the new ones at an offset
        for c in caches:
            model(ids[:, :start] if start else ids[:, :1], cache=c)
    pos = caches[0].length if with_cache else start
    full = model(ids, input_pos=pos, cache=caches[0])                       # (1, 12, vocab)
    last = model(ids, input_pos=pos, cache=caches[1], last_only=True)       # (1, 1, vocab)
    assert last.shape == (1, 1, 256)
    torch.testing.assert_close(last[:, 0], full[:, -1], atol=1e-6, rtol=0)


@pytest.mark.slow
def test_last_only_logits_on_smollm2(smollm2):
    model, _ = smollm2
    ids = torch.tensor([random_prompt(20, model.config.vocab_size, seed=6)])
    full = model(ids, input_pos=3)
    last = model(ids, input_pos=3, last_only=True)
    # One row goes through a matrix-vector product, 20 rows through a matrix product: the
    # 576-term sums are added in another order, so logits of size ~10 differ in the 6th digit.
    torch.testing.assert_close(last[:, 0], full[:, -1], atol=5e-5, rtol=1e-6)
    assert int(last.argmax()) == int(full[0, -1].argmax())


def test_prefill_and_naive_steps_project_only_the_last_position(monkeypatch):
    from toyllm import DynamicKVCache, prefill

    model = build_model("tiny")
    shapes = []
    real_head = model.head
    monkeypatch.setattr(model, "head", lambda x: shapes.append(tuple(x.shape)) or real_head(x))
    prefill(model, torch.tensor([random_prompt(30, 256)]), DynamicKVCache(model.config.n_layers))
    generate(model, random_prompt(30, 256), 3, method="naive")
    assert shapes and all(s[1] == 1 for s in shapes), shapes


def test_cached_steps_feed_one_token_from_one_preallocated_buffer(monkeypatch):
    model = build_model("tiny")
    seen = []
    real_embed = model.embed
    monkeypatch.setattr(model, "embed", lambda ids: seen.append((tuple(ids.shape), ids.untyped_storage().data_ptr()))
                        or real_embed(ids))
    out = generate(model, random_prompt(10, 256), 6)
    assert seen[0][0] == (1, 10) and all(shape == (1, 1) for shape, _ in seen[1:])
    assert len(seen) == 6 and len({ptr for _, ptr in seen}) == 1     # every step reads the same buffer
    assert out.output_ids == generate(model, random_prompt(10, 256), 6, cache="dynamic").output_ids
