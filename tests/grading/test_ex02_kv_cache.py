"""Graded tests of lesson 02 (ex02_kv_cache): 16 points.

2.1 attention_with_offset 6, 2.2 kv_cache_bytes 3, 2.3 static_buffer_bytes 4, 2.4 cached_generate 4.
References: ``toyllm.model.dense_attention``, the model's own logits without
a cache, ``toyllm.analysis`` and the byte counts of ``toyllm.cache``.
"""
import pytest
import torch

from toyllm import DynamicKVCache, StaticKVCache, build_model, generate
from toyllm import analysis
from toyllm.model import dense_attention

PROMPT = [3, 14, 15, 92, 65, 35, 89, 79]
LOGIT_ATOL = 1e-5       # float32 logits of the tiny model; only the summation order differs


def random_qkv(B=2, H=3, T=5, S=9, D=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, T, D, generator=gen), torch.randn(B, H, S, D, generator=gen),
            torch.randn(B, H, S, D, generator=gen))


# --------------------------------------------------------------------------- 2.1

@pytest.mark.exercise("2.1")
@pytest.mark.points(1)
def test_ex2_1_matches_dense_attention(ex02):
    q, k, v = random_qkv()
    q_pos, k_pos = torch.arange(4, 9), torch.arange(9)          # 5 new tokens after 4 cached ones
    got = ex02.attention_with_offset(q, k, v, q_pos, k_pos)
    assert got.shape == (2, 3, 5, 8)
    torch.testing.assert_close(got, dense_attention(q, k, v, q_pos, k_pos), atol=1e-5, rtol=0)


@pytest.mark.exercise("2.1")
@pytest.mark.points(1)
def test_ex2_1_hides_future_keys(ex02):
    q, k, v = random_qkv(T=1, S=6, seed=1)
    q_pos, k_pos = torch.tensor([2]), torch.arange(6)           # the query sits at position 2 of 6 keys
    got = ex02.attention_with_offset(q, k, v, q_pos, k_pos)
    only_past = dense_attention(q, k[:, :, :3], v[:, :, :3], q_pos, k_pos[:3])
    torch.testing.assert_close(got, only_past, atol=1e-5, rtol=0)
    v_changed = v.clone()
    v_changed[:, :, 3:] += 100.0                                # keys after position 2 must not matter
    torch.testing.assert_close(ex02.attention_with_offset(q, k, v_changed, q_pos, k_pos), got, atol=1e-5, rtol=0)


def reference_logits(ids):
    """Logits (T, vocab) of the whole sequence in one call, no cache, toyllm's own dense kernel."""
    return build_model("tiny", seed=0)(torch.tensor([ids]))[0]


@pytest.mark.exercise("2.1")
@pytest.mark.points(2)
def test_ex2_1_prefill_then_decode_in_the_model(ex02, tiny_model):
    ids = PROMPT + [7, 1, 200, 33]
    expected = reference_logits(ids)                            # (12, vocab)
    tiny_model.set_attention(ex02.attention_with_offset)
    cache = DynamicKVCache(tiny_model.config.n_layers)
    prefill = tiny_model(torch.tensor([PROMPT]), input_pos=0, cache=cache)[0]
    torch.testing.assert_close(prefill, expected[:8], atol=LOGIT_ATOL, rtol=0)
    for pos in range(8, 12):                                    # decode: one token at a time, q_pos = [pos]
        step = tiny_model(torch.tensor([[ids[pos]]]), input_pos=pos, cache=cache)[0, -1]
        torch.testing.assert_close(step, expected[pos], atol=LOGIT_ATOL, rtol=0)


@pytest.mark.exercise("2.1")
@pytest.mark.points(2)
def test_ex2_1_chunked_prefill_with_an_offset(ex02, tiny_model):
    ids = PROMPT + [7, 1, 200, 33]
    expected = reference_logits(ids)
    tiny_model.set_attention(ex02.attention_with_offset)
    cache = DynamicKVCache(tiny_model.config.n_layers)
    for start in (0, 4, 8):                                     # three chunks of 4: queries start at 0, 4, 8
        chunk = tiny_model(torch.tensor([ids[start:start + 4]]), input_pos=start, cache=cache)[0]
        torch.testing.assert_close(chunk, expected[start:start + 4], atol=LOGIT_ATOL, rtol=0)


# --------------------------------------------------------------------------- 2.2

@pytest.mark.exercise("2.2")
@pytest.mark.points(1)
def test_ex2_2_llama2_13b_8192_tokens_bf16(ex02):
    assert ex02.kv_cache_bytes(40, 40, 128, 8192) == 6_710_886_400
    assert ex02.kv_cache_bytes(40, 40, 128, 8192, bytes_per_value=2, batch=1) == analysis.kv_cache_bytes(40, 40, 128, 8192)


@pytest.mark.exercise("2.2")
@pytest.mark.points(1)
def test_ex2_2_gqa_mqa_batch_and_precision(ex02):
    assert ex02.kv_cache_bytes(40, 8, 128, 8192) == 1_342_177_280       # GQA, 8 KV heads: 5x smaller
    assert ex02.kv_cache_bytes(40, 1, 128, 8192) == 167_772_160         # MQA: one KV head
    assert ex02.kv_cache_bytes(40, 40, 128, 8192, batch=4) == 4 * 6_710_886_400
    assert ex02.kv_cache_bytes(40, 40, 128, 8192, bytes_per_value=1) == 3_355_443_200   # int8
    for args in [(30, 3, 64, 8192, 4, 1), (32, 8, 128, 100, 2, 3), (2, 2, 16, 1, 4, 1)]:
        assert ex02.kv_cache_bytes(*args) == analysis.kv_cache_bytes(*args)
    with pytest.raises(ValueError):
        ex02.kv_cache_bytes(40, 40, 128, -1)


@pytest.mark.exercise("2.2")
@pytest.mark.points(1)
def test_ex2_2_matches_the_real_cache(ex02, tiny_model):
    cfg = tiny_model.config
    cache = DynamicKVCache(cfg.n_layers)
    tiny_model(torch.tensor([PROMPT + [1, 2]]), input_pos=0, cache=cache)    # 10 tokens, float32
    held = sum(cache.keys(i).nbytes + cache.values(i).nbytes for i in range(cfg.n_layers))
    assert ex02.kv_cache_bytes(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, 10, bytes_per_value=4) == held


# --------------------------------------------------------------------------- 2.3

@pytest.mark.exercise("2.3")
@pytest.mark.points(1)
def test_ex2_3_llama_7b_with_the_full_reserve(ex02):
    assert ex02.static_buffer_bytes(32, 32, 128, 2048) == 2_146_435_072
    assert ex02.static_buffer_bytes(32, 32, 128, 2048, bits=16, reserve=2.0) == 2_146_435_072


@pytest.mark.exercise("2.3")
@pytest.mark.points(1)
def test_ex2_3_llama_7b_with_a_smaller_reserve(ex02):
    assert ex02.static_buffer_bytes(32, 32, 128, 2048, reserve=1.5) == 1_609_826_304
    for reserve in (1.0, 1.25):
        assert ex02.static_buffer_bytes(32, 32, 128, 2048, reserve=reserve) == \
            analysis.static_kv_buffer_bytes(32, 32, 128, 2048, reserve=reserve)
    assert ex02.static_buffer_bytes(32, 32, 128, 2048, bits=8) == 2_146_435_072 // 2


@pytest.mark.exercise("2.3")
@pytest.mark.points(1)
def test_ex2_3_matches_the_static_cache(ex02):
    cfg = build_model("tiny").config
    for reserve in (2.0, 1.5):                  # S = 65: a window of 64 rows, 128 or 96 reserved
        cache = StaticKVCache.for_model(cfg, max_tokens=65, reserve=reserve)
        assert ex02.static_buffer_bytes(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, 65, bits=32,
                                        reserve=reserve) == cache.nbytes
    with pytest.raises(ValueError):
        ex02.static_buffer_bytes(32, 32, 128, 2048, reserve=2.5)
    with pytest.raises(ValueError):
        ex02.static_buffer_bytes(32, 32, 128, 1)


@pytest.mark.exercise("2.3")
@pytest.mark.points(1)
def test_ex2_3_counts_only_the_key_value_heads(ex02):
    """SmolLM2 caches 3 K/V heads for its 9 query heads: the buffer is 3x smaller than with 9."""
    got = ex02.static_buffer_bytes(30, 3, 64, 8192, bits=16)
    expected = 2 * 30 * 3 * 2 * 8191 * 64 * 2
    assert got == expected and type(got) is int, (
        f"static_buffer_bytes(30 blocks, 3 KV heads, head_dim 64, S=8192, 16 bits): expected {expected:,}, got {got!r}")


# --------------------------------------------------------------------------- 2.4

@pytest.mark.exercise("2.4")
@pytest.mark.points(2)
def test_ex2_4_same_tokens_as_naive(ex02, tiny_model):
    for prompt in (PROMPT, [42]):
        naive = generate(tiny_model, prompt, 12, method="naive").output_ids
        assert ex02.cached_generate(tiny_model, prompt, 12) == naive
        assert ex02.cached_generate(tiny_model, prompt, 1) == naive[:1]     # the prefill alone


@pytest.mark.exercise("2.4")
@pytest.mark.points(2)
def test_ex2_4_one_token_per_decode_call(ex02, tiny_model, forward_calls):
    calls = forward_calls(tiny_model)
    out = ex02.cached_generate(tiny_model, PROMPT, 7)
    assert len(out) == 7
    assert len(calls) == 7, f"expected 1 prefill + 6 decode calls, got {len(calls)} model calls"
    prefill, decodes = calls[0], calls[1:]
    assert prefill.ids == PROMPT and prefill.cache is not None and prefill.cache_length == 0, \
        "the first call is the prefill: the whole prompt into an empty cache"
    for i, call in enumerate(decodes):
        assert call.ids == [out[i]], f"decode step {i + 1} must feed only the newest token {out[i]}, got {call.ids}"
        assert call.cache is prefill.cache, "every decode step must reuse the prefill's cache"
        assert call.cache_length == len(PROMPT) + i
        assert call.input_pos in (None, len(PROMPT) + i)
    calls.clear()
    assert ex02.cached_generate(tiny_model, PROMPT, 0) == [] and calls == []
