"""The two caches: same contents, and the static buffer's copy accounting."""
import math

import pytest
import torch

from toyllm import DynamicKVCache, StaticKVCache, build_model, make_cache
from toyllm.cache import KVCache, copy_into


def _fill(cache, steps, n_layers=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    for t in steps:
        for layer in range(n_layers):
            k, v = torch.randn(1, 2, t, 8, generator=g), torch.randn(1, 2, t, 8, generator=g)
            out_k, out_v = cache.update(layer, k, v)
    return out_k, out_v


@pytest.mark.parametrize("reserve", [2.0, 1.5, 1.1])
def test_static_equals_dynamic(reserve):
    steps = [5] + [1] * 14          # a 5-token prefill then 14 decode steps: 19 tokens = S - 1
    dyn = DynamicKVCache(2)
    sta = StaticKVCache(2, 2, 8, window=19, reserve=reserve)
    kd, vd = _fill(dyn, steps)
    ks, vs = _fill(sta, steps)
    assert torch.equal(kd, ks) and torch.equal(vd, vs)
    assert dyn.length == sta.length == 19


@pytest.mark.parametrize("headroom", [1, 4, 30])
def test_headroom_holds_what_concatenation_holds(headroom):
    steps = [5] + [1] * 10 + [3]                # a prefill, decode steps, then a 3-token chunk
    cat, roomy = DynamicKVCache(2), DynamicKVCache(2, headroom=headroom)
    kc, vc = _fill(cat, steps)
    kr, vr = _fill(roomy, steps)
    assert torch.equal(kc, kr) and torch.equal(vc, vr) and roomy.length == cat.length == 18
    assert torch.equal(roomy.keys(1), kc) and torch.equal(roomy.values(1), vc)
    assert kr.shape == (1, 2, 18, 8)                        # the rows held, never the spare ones
    assert all(torch.equal(a, b) for (a, _), (b, _) in zip(roomy, cat))


def test_headroom_copies_every_few_appends():
    """After a 5-token prefill, 10 single appends: concatenation copies on each of them, 5 + 6 + ... + 14
    rows; 4 rows of headroom copy when the buffer of 9 rows is full (9 rows), then at 14 (14 rows)."""
    cat, roomy = DynamicKVCache(2), DynamicKVCache(2, headroom=4)
    _fill(cat, [5] + [1] * 10)
    _fill(roomy, [5] + [1] * 10)
    assert (cat.copies, cat.copied_rows) == (2 * 10, 2 * sum(range(5, 15)))        # 2 layers
    assert (roomy.copies, roomy.copied_rows) == (2 * 2, 2 * (9 + 14))


def test_headroom_cache_filled_in_inference_mode_is_written_in_place_outside_it():
    cache = DynamicKVCache(2, headroom=3)
    with torch.inference_mode():
        _fill(cache, [2])
    k, _ = _fill(cache, [1, 1])                 # fits the spare rows: written in place, autograd on
    assert cache.length == 4 and cache.copies == 0 and not k.is_inference()


@pytest.mark.parametrize("headroom", [-1, 1.5, True, "4"])
def test_headroom_must_be_a_whole_number_of_rows(headroom):
    with pytest.raises(ValueError, match="headroom must be a whole number of rows >= 0"):
        DynamicKVCache(2, headroom=headroom)


def test_a_dynamic_cache_with_headroom_generates_the_same_tokens():
    from toyllm import generate

    model = build_model("tiny", seed=0)
    prompts = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]]
    cache = make_cache("dynamic", model.config, 20, headroom=4)
    assert cache.headroom == 4
    roomy = generate(model, prompts, 12, cache=cache, return_logits=True)
    plain = generate(model, prompts, 12, cache="dynamic", return_logits=True)
    assert [r.output_ids for r in roomy] == [r.output_ids for r in plain]
    for a, b in zip(roomy, plain):
        torch.testing.assert_close(a.logits, b.logits)     # float32 defaults: only the layout differs
    assert cache.copies == model.config.n_layers * 2      # 4 + 11 rows: it copies when full at 8 and at 13


def test_two_times_s_minus_1_reservation_never_copies():
    cache = StaticKVCache(2, 2, 8, window=19, reserve=2.0)
    _fill(cache, [5] + [1] * 14)
    assert cache.capacity == 38 and cache.copies == 0


def test_smaller_reservation_copies_and_counts_it():
    cache = StaticKVCache(2, 2, 8, window=20, reserve=1.5)    # 30 rows: 10 free appends, then a shift
    _fill(cache, [1] * 20)
    assert cache.capacity == 30
    assert cache.copies == 2            # one shift per layer (after 10 free appends), 2 layers
    assert cache.copied_rows > 0


def test_window_view_is_left_padded():
    cache = StaticKVCache(1, 1, 4, window=6)
    k = torch.ones(1, 1, 2, 4)
    cache.update(0, k, k)
    kw, _ = cache.window_view(0)
    assert kw.shape == (1, 1, 6, 4)
    assert torch.equal(kw[0, 0, :4], torch.zeros(4, 4)) and torch.equal(kw[0, 0, 4:], torch.ones(2, 4))


@pytest.mark.parametrize("reserve", [2.0, 1.5])
def test_padding_reads_as_zeros_while_the_window_slides(monkeypatch, reserve):
    """The buffer is allocated without zeroing all of it (only the first window, the padding); a
    window view must still never show a byte of the rest before it is written: here fresh memory
    is NaN, and the view is checked after every append, across the shifts a small reserve makes."""
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: real_empty(*a, **kw).fill_(float("nan")))
    cache = StaticKVCache(1, 1, 2, window=6, reserve=reserve)
    for step in range(6):
        k = torch.full((1, 1, 1, 2), float(step + 1))
        cache.update(0, k, -k)
        kw, vw = cache.window_view(0)                                     # (1, 1, 6, 2)
        real = torch.arange(1.0, step + 2).repeat_interleave(2).view(step + 1, 2)
        expected = torch.cat([torch.zeros(5 - step, 2), real])
        assert torch.equal(kw[0, 0], expected) and torch.equal(vw[0, 0], -expected)
        assert torch.equal(cache.keys(0)[0, 0], real)
    assert (cache.copies > 0) == (reserve < 2)


def test_static_cache_too_small_is_rejected():
    cache = StaticKVCache(1, 1, 4, window=3)
    with pytest.raises(ValueError, match="static cache too small.*holds 3 tokens"):
        cache.update(0, torch.ones(1, 1, 4, 4), torch.ones(1, 1, 4, 4))


def test_static_buffer_bytes_match_the_formula():
    # 2 (reserve) * 2 (K and V) * layers * heads * (S-1) * D * 4 bytes
    cache = StaticKVCache(n_layers=2, n_kv_heads=3, head_dim=8, window=15, reserve=2.0)
    assert cache.nbytes == 2 * 2 * 2 * 3 * 15 * 8 * 4


def test_make_cache_rejects_unknown_kind():
    with pytest.raises(ValueError, match="unknown cache 'paged'"):
        make_cache("paged", build_model("tiny").config, 10)


def test_static_equals_dynamic_for_a_batch():
    g = torch.Generator().manual_seed(1)
    dyn, sta = DynamicKVCache(2), StaticKVCache(2, 2, 8, window=12, batch=3)
    for t in [4, 1, 1, 1]:
        for layer in range(2):
            k, v = torch.randn(3, 2, t, 8, generator=g), torch.randn(3, 2, t, 8, generator=g)
            kd, vd = dyn.update(layer, k, v)
            ks, vs = sta.update(layer, k, v)
            assert ks.shape == (3, 2, dyn.length if layer == 1 else kd.shape[-2], 8)
            assert torch.equal(kd, ks) and torch.equal(vd, vs)
    assert sta.length == dyn.length == 7 and sta.copies == 0


@pytest.mark.parametrize("kind", ["static", "dynamic"])
def test_a_cache_filled_by_generate_serves_later_calls_with_or_without_autograd(kind):
    """generate runs in inference mode (fewer checks per operator call); a cache it filled, and the
    logits it returns, must still work in plain PyTorch afterwards, gradients on or off."""
    from toyllm import generate

    model = build_model("tiny", seed=0)
    cache = make_cache(kind, model.config, 32)
    result = generate(model, [1, 2, 3], 4, cache=cache, return_logits=True)
    reference = model(torch.tensor([[1, 2, 3, *result.output_ids[:3]]]))[0, -1]
    torch.testing.assert_close(result.logits[3] * 1.0, reference, rtol=1e-5, atol=1e-5)
    assert cache.length == 6                    # the prompt and the answer but its last token, never fed back
    with torch.no_grad():
        model(torch.tensor([[result.output_ids[-1]]]), cache=cache)              # position 6
    with torch.enable_grad():
        logits = model(torch.tensor([[5]]), cache=cache)                        # position 7, autograd on
    assert cache.length == 8
    expected = model(torch.tensor([[1, 2, 3, *result.output_ids, 5]]))[0, -1]
    torch.testing.assert_close(logits[0, -1], expected, rtol=1e-5, atol=1e-5)


def test_both_caches_tell_their_batch_and_free_room_through_the_protocol():
    dyn, sta = DynamicKVCache(2), StaticKVCache(2, 2, 8, window=19, batch=1)
    assert isinstance(dyn, KVCache) and isinstance(sta, KVCache)
    assert dyn.batch_size is None and dyn.free_tokens == math.inf       # an empty dynamic cache takes any batch
    assert sta.batch_size == 1 and sta.free_tokens == 19
    _fill(dyn, [5, 1])
    _fill(sta, [5, 1])
    assert dyn.batch_size == 1 and sta.free_tokens == 13


def test_copying_a_cache_into_another_appends_every_layer_and_refuses_one_too_small():
    src = DynamicKVCache(2)
    _fill(src, [5, 1])
    dst = copy_into(src, StaticKVCache(2, 2, 8, window=9))
    assert dst.length == 6 and dst.free_tokens == 3
    for (k, v), (k2, v2) in zip(src, dst):
        assert torch.equal(k, k2) and torch.equal(v, v2)
    with pytest.raises(ValueError, match="the static cache has room for 3 more tokens, not the 6"):
        copy_into(src, dst)
    with pytest.raises(ValueError, match="cannot copy a cache of 2 layers into one of 3"):
        copy_into(src, DynamicKVCache(3))
