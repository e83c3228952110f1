"""Graded tests of lesson 02 (ex02_kv_cache): 17 points.

2.1 attention_with_offset 6, 2.2 kv_cache_bytes 3, 2.3 static_buffer_bytes 4, 2.4 cached_generate 4.
References live here: attention written out in float64 from the definition,
byte counts from the formulas (exact integers, rounded up where a total is
fractional), the bytes the model's real caches hold, and a greedy loop
without a cache.
"""
import math

import pytest
import torch

from toyllm import DynamicKVCache, StaticKVCache, build_model
from toyllm.grading import sandboxed
from toyllm.grading.expect import equal, raises, same_tokens, tensors_close
from toyllm.grading.references import reference

PROMPT = [3, 14, 15, 92, 65, 35, 89, 79]
LOGIT_ATOL = 1e-5       # float32 logits of the tiny model; only the summation order differs


def random_qkv(B=2, H=3, T=5, S=9, D=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, T, D, generator=gen), torch.randn(B, H, S, D, generator=gen),
            torch.randn(B, H, S, D, generator=gen))


@reference
def reference_attention(q, k, v, q_pos, k_pos):
    """The definition, one query at a time, in float64: softmax over the visible keys of q.k / sqrt(D), times v."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    for t, p in enumerate(q_pos.tolist()):
        visible = k_pos <= p                                            # (S,)
        scores = q[:, :, t:t + 1].double() @ k[:, :, visible].double().transpose(-2, -1) / math.sqrt(q.shape[-1])
        out[:, :, t:t + 1] = torch.softmax(scores, dim=-1) @ v[:, :, visible].double()
    return out.to(q.dtype)


# --------------------------------------------------------------------------- 2.1

@pytest.mark.exercise("2.1")
@pytest.mark.points(1)
def test_ex2_1_queries_after_cached_tokens(ex02):
    q, k, v = random_qkv()
    q_pos, k_pos = torch.arange(4, 9), torch.arange(9)          # 5 new tokens after 4 cached ones
    tensors_close(ex02.attention_with_offset(q, k, v, q_pos, k_pos), reference_attention(q, k, v, q_pos, k_pos),
                  "attention_with_offset(5 queries at positions 4..8, 9 keys at 0..8)")


@pytest.mark.exercise("2.1")
@pytest.mark.points(1)
def test_ex2_1_hides_future_keys(ex02):
    q, k, v = random_qkv(T=1, S=6, seed=1)
    q_pos, k_pos = torch.tensor([2]), torch.arange(6)           # the query sits at position 2 of 6 keys
    call = "attention_with_offset(1 query at position 2, 6 keys at 0..5)"
    got = ex02.attention_with_offset(q, k, v, q_pos, k_pos)
    tensors_close(got, reference_attention(q, k, v, q_pos, k_pos), call)
    v_changed = v.clone()
    v_changed[:, :, 3:] += 100.0                                # keys after position 2 must not matter
    tensors_close(ex02.attention_with_offset(q, k, v_changed, q_pos, k_pos), got,
                  call + " with the values of future keys changed")


@pytest.mark.exercise("2.1")
@pytest.mark.points(2)
def test_ex2_1_positions_not_shapes(ex02, drawn):
    """Keys that do not start at 0, keys after the queries, keys out of order: the mask comes from the positions."""
    cases = [
        ("3 queries at 5..7, 10 keys at 2..11", torch.arange(5, 8), torch.arange(2, 12)),
        ("2 queries at 9, 10, 8 keys of a ring buffer at 8, 9, 10, 3, 4, 5, 6, 7",
         torch.tensor([9, 10]), torch.tensor([8, 9, 10, 3, 4, 5, 6, 7])),
        ("4 queries at 100..103, 6 keys at 98..103", torch.arange(100, 104), torch.arange(98, 104)),
    ]
    for seed, (words, q_pos, k_pos) in enumerate(cases):
        q, k, v = random_qkv(B=1, H=2, T=len(q_pos), S=len(k_pos), D=4, seed=10 + seed)
        tensors_close(ex02.attention_with_offset(q, k, v, q_pos, k_pos), reference_attention(q, k, v, q_pos, k_pos),
                      f"attention_with_offset({words})")
    rng = drawn.rng("2.1")
    for i in range(3):              # drawn: shapes, where the keys start, their order, how many queries are new
        S = rng.randint(1, 24)
        T, base = rng.randint(1, S), rng.randint(0, 500)
        k_pos = torch.tensor(rng.sample(range(base, base + S), S))          # keys at base..base+S-1, shuffled
        q_pos = torch.arange(base + S - T, base + S)                        # the newest T of them
        q, k, v = random_qkv(B=rng.randint(1, 3), H=rng.randint(1, 4), T=T, S=S, D=rng.choice([4, 8, 16]),
                             seed=rng.randrange(2 ** 31))
        tensors_close(ex02.attention_with_offset(q, k, v, q_pos, k_pos), reference_attention(q, k, v, q_pos, k_pos),
                      f"attention_with_offset({T} queries at {base + S - T}..{base + S - 1}, {S} keys at "
                      f"{k_pos.tolist()}, shape {tuple(q.shape)}; {drawn})")


@reference
def reference_logits(ids):
    """Logits (T, vocab) of the whole sequence in one call, no cache, the model's own kernel."""
    return build_model("tiny", seed=0)(torch.tensor([ids]))[0]


@pytest.mark.exercise("2.1")
@pytest.mark.points(1)
def test_ex2_1_prefill_then_decode_in_the_model(ex02, tiny_model):
    ids = PROMPT + [7, 1, 200, 33]
    expected = reference_logits(ids)                            # (12, vocab)
    tiny_model.set_attention(ex02.attention_with_offset)
    cache = DynamicKVCache(tiny_model.config.n_layers)
    prefill = tiny_model(torch.tensor([PROMPT]), input_pos=0, cache=cache)[0]
    tensors_close(prefill, expected[:8], "the tiny model's prefill of 8 tokens with attention_with_offset",
                  atol=LOGIT_ATOL)
    for pos in range(8, 12):                                    # decode: one token at a time, q_pos = [pos]
        step = tiny_model(torch.tensor([[ids[pos]]]), input_pos=pos, cache=cache)[0, -1]
        tensors_close(step, expected[pos], f"the tiny model's decode step at position {pos} with attention_with_offset",
                      atol=LOGIT_ATOL)


@pytest.mark.exercise("2.1")
@pytest.mark.points(1)
def test_ex2_1_chunked_prefill_in_the_model(ex02, tiny_model):
    ids = PROMPT + [7, 1, 200, 33]
    expected = reference_logits(ids)
    tiny_model.set_attention(ex02.attention_with_offset)
    cache = DynamicKVCache(tiny_model.config.n_layers)
    for start in (0, 4, 8):                                     # three chunks of 4: queries start at 0, 4, 8
        chunk = tiny_model(torch.tensor([ids[start:start + 4]]), input_pos=start, cache=cache)[0]
        tensors_close(chunk, expected[start:start + 4],
                      f"the tiny model's chunk of tokens {start}..{start + 3} with attention_with_offset",
                      atol=LOGIT_ATOL)


# --------------------------------------------------------------------------- 2.2

@reference
def kv_reference(n_layers, n_kv_heads, head_dim, tokens, bytes_per_value=2, batch=1):
    return round(2 * n_layers * n_kv_heads * head_dim * tokens * batch * bytes_per_value)


@pytest.mark.exercise("2.2")
@pytest.mark.points(1)
def test_ex2_2_llama2_13b_and_gqa(ex02):
    equal(ex02.kv_cache_bytes(40, 40, 128, 8192), 6_710_886_400, "kv_cache_bytes(40 layers, 40 KV heads, 128, 8192 tokens)")
    equal(ex02.kv_cache_bytes(40, 8, 128, 8192), 1_342_177_280, "kv_cache_bytes(40 layers, 8 KV heads (GQA), 128, 8192)")
    equal(ex02.kv_cache_bytes(40, 1, 128, 8192), 167_772_160, "kv_cache_bytes(40 layers, 1 KV head (MQA), 128, 8192)")
    equal(ex02.kv_cache_bytes(40, 40, 128, 8192, batch=4), 4 * 6_710_886_400, "kv_cache_bytes(LLaMA-2-13B, 8192, batch=4)")


@pytest.mark.exercise("2.2")
@pytest.mark.points(1)
def test_ex2_2_other_precisions_and_shapes(ex02, drawn):
    cases = [((40, 40, 128, 8192), dict(bytes_per_value=1)), ((30, 3, 64, 1001), dict(bytes_per_value=0.5)),
             ((30, 3, 64, 8192), dict(bytes_per_value=4)), ((32, 8, 128, 100), dict(bytes_per_value=2, batch=3)),
             ((2, 2, 16, 1), dict(bytes_per_value=0.5, batch=7)), ((24, 6, 80, 0), dict())]
    for args, kw in cases:
        equal(ex02.kv_cache_bytes(*args, **kw), kv_reference(*args, **kw),
              f"kv_cache_bytes{args + tuple(kw.values())} ({', '.join(f'{k}={v}' for k, v in kw.items()) or 'bf16'})")
    rng = drawn.rng("2.2")
    for _ in range(6):              # drawn shapes and precisions
        args = (rng.randint(1, 96), rng.randint(1, 64), rng.choice([16, 32, 64, 80, 96, 128, 256]), rng.randint(0, 40000))
        kw = dict(bytes_per_value=rng.choice([0.5, 1, 2, 4]), batch=rng.randint(1, 16))
        equal(ex02.kv_cache_bytes(*args, **kw), kv_reference(*args, **kw),
              f"kv_cache_bytes{args + tuple(kw.values())} ({drawn})")
    raises(ValueError, ex02.kv_cache_bytes, 40, 40, 128, -1, call="kv_cache_bytes(..., tokens=-1)")
    raises(ValueError, ex02.kv_cache_bytes, 40, 40, 128, 16, bytes_per_value=0, call="kv_cache_bytes(bytes_per_value=0)")


@pytest.mark.exercise("2.2")
@pytest.mark.points(1)
def test_ex2_2_matches_the_real_cache(ex02, tiny_model):
    cfg = tiny_model.config
    cache = DynamicKVCache(cfg.n_layers)
    tiny_model(torch.tensor([PROMPT + [1, 2, 9]]), input_pos=0, cache=cache)    # 11 tokens, float32
    held = sum(cache.keys(i).nbytes + cache.values(i).nbytes for i in range(cfg.n_layers))
    equal(ex02.kv_cache_bytes(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, 11, bytes_per_value=4), held,
          "kv_cache_bytes(the tiny model, 11 tokens, float32) vs the bytes its DynamicKVCache holds")


# --------------------------------------------------------------------------- 2.3

@reference
def static_reference(n_blocks, n_kv_heads, head_dim, max_seq_len, bits=16, reserve=2.0):
    """Exact: 2 x blocks x kv heads x reserve x (S - 1) x head_dim x bits / 8, rounded up to whole bytes."""
    from fractions import Fraction

    total = 2 * n_blocks * n_kv_heads * Fraction(reserve) * (max_seq_len - 1) * head_dim * bits / 8
    return math.ceil(total)


@pytest.mark.exercise("2.3")
@pytest.mark.points(1)
def test_ex2_3_llama_7b(ex02):
    equal(ex02.static_buffer_bytes(32, 32, 128, 2048), 2_146_435_072, "static_buffer_bytes(Llama-7B, S=2048)")
    equal(ex02.static_buffer_bytes(32, 32, 128, 2048, bits=16, reserve=1.5), 1_609_826_304,
          "static_buffer_bytes(Llama-7B, S=2048, reserve=1.5)")
    for kw in (dict(reserve=1.0), dict(reserve=1.25), dict(bits=8), dict(bits=4, reserve=1.5)):
        equal(ex02.static_buffer_bytes(32, 32, 128, 2048, **kw), static_reference(32, 32, 128, 2048, **kw),
              f"static_buffer_bytes(Llama-7B, S=2048, {', '.join(f'{k}={v}' for k, v in kw.items())})")


@pytest.mark.exercise("2.3")
@pytest.mark.points(1)
def test_ex2_3_counts_only_the_key_value_heads(ex02):
    """SmolLM2 caches 3 K/V heads for its 9 query heads: the buffer is 3x smaller than with 9."""
    for args, kw in (((30, 3, 64, 8192), dict()), ((40, 8, 128, 4096), dict(bits=8, reserve=1.25))):
        equal(ex02.static_buffer_bytes(*args, **kw), static_reference(*args, **kw),
              f"static_buffer_bytes({args[0]} blocks, n_kv_heads={args[1]}, head_dim {args[2]}, S={args[3]}"
              f"{''.join(f', {k}={v}' for k, v in kw.items())})")
    equal(ex02.static_buffer_bytes(n_blocks=30, n_kv_heads=3, head_dim=64, max_seq_len=8192), static_reference(30, 3, 64, 8192),
          "static_buffer_bytes(n_blocks=30, n_kv_heads=3, head_dim=64, max_seq_len=8192) by keyword")


@pytest.mark.exercise("2.3")
@pytest.mark.points(1)
def test_ex2_3_half_bytes_round_up(ex02, drawn):
    """4-bit and 2-bit values make fractional byte totals: the buffer needs the next whole byte."""
    for args, kw in (((1, 1, 5, 2), dict(bits=2, reserve=1.0)),          # 2.5 bytes -> 3
                     ((1, 1, 5, 2), dict(bits=4, reserve=1.25)),         # 6.25 -> 7
                     ((3, 1, 3, 4), dict(bits=4, reserve=1.5)),          # 40.5 -> 41
                     ((2, 3, 7, 6), dict(bits=4, reserve=1.75))):        # 367.5 -> 368
        equal(ex02.static_buffer_bytes(*args, **kw), static_reference(*args, **kw),
              f"static_buffer_bytes{args} with {', '.join(f'{k}={v}' for k, v in kw.items())} "
              "(a fractional total rounds up to whole bytes)")
    rng = drawn.rng("2.3")
    for _ in range(6):              # drawn: small shapes, so that the total is often fractional
        args = (rng.randint(1, 7), rng.randint(1, 5), rng.randint(1, 9), rng.randint(2, 40))
        kw = dict(bits=rng.choice([2, 4, 8, 16]), reserve=rng.choice([1.0, 1.25, 1.5, 1.75, 2.0]))
        equal(ex02.static_buffer_bytes(*args, **kw), static_reference(*args, **kw),
              f"static_buffer_bytes{args} with {', '.join(f'{k}={v}' for k, v in kw.items())} ({drawn})")


@pytest.mark.exercise("2.3")
@pytest.mark.points(1)
def test_ex2_3_matches_the_static_cache_and_checks_input(ex02):
    cfg = build_model("tiny").config
    for reserve in (2.0, 1.5):                  # S = 65: a window of 64 rows, 128 or 96 reserved
        cache = StaticKVCache.for_model(cfg, max_tokens=65, reserve=reserve)
        equal(ex02.static_buffer_bytes(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, 65, bits=32, reserve=reserve),
              cache.nbytes, f"static_buffer_bytes(the tiny model, S=65, float32, reserve={reserve}) vs a StaticKVCache")
    for kw, why in ((dict(reserve=2.5), "reserve outside [1, 2]"), (dict(reserve=0.5), "reserve outside [1, 2]"),
                    (dict(max_seq_len=1), "max_seq_len < 2"), (dict(bits=0), "bits not positive"),
                    (dict(bits=4.5), "bits not a whole number")):
        args = dict(n_blocks=32, n_kv_heads=32, head_dim=128, max_seq_len=2048) | kw
        raises(ValueError, ex02.static_buffer_bytes, **args, call=f"static_buffer_bytes({why})", why=why)


# --------------------------------------------------------------------------- 2.4

@reference
def reference_greedy(model, prompt, n):
    """Greedy decoding without a cache: the whole sequence through the model at every step."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.mark.exercise("2.4")
@pytest.mark.points(2)
def test_ex2_4_same_tokens_as_without_a_cache(ex02, tiny_model, drawn):
    for prompt, n in ((PROMPT, 12), ([42], 6), ([5, 250, 17, 17, 3, 90], 20)):
        same_tokens(ex02.cached_generate(tiny_model, prompt, n), reference_greedy(tiny_model, prompt, n),
                    f"cached_generate(prompt of {len(prompt)} tokens, {n} new)")
    same_tokens(ex02.cached_generate(tiny_model, PROMPT, 1), reference_greedy(tiny_model, PROMPT, 1),
                "cached_generate(prompt of 8 tokens, 1 new) (the prefill alone)")
    rng = drawn.rng("2.4")
    prompt, n = [rng.randrange(256) for _ in range(rng.randint(1, 12))], rng.randint(2, 12)
    same_tokens(ex02.cached_generate(tiny_model, prompt, n), reference_greedy(tiny_model, prompt, n),
                f"cached_generate(prompt {prompt}, {n} new; {drawn})")
    raises(ValueError, ex02.cached_generate, tiny_model, [], 3, call="cached_generate(empty prompt, 3 new)")
    raises(ValueError, ex02.cached_generate, tiny_model, PROMPT, -2, call="cached_generate(prompt of 8 tokens, -2 new)")


@pytest.mark.exercise("2.4")
@pytest.mark.points(2)
def test_ex2_4_one_token_per_decode_call(ex02, tiny_model):
    traced = sandboxed("toyllm.grading.sandbox.harness:traced", ex02.cached_generate, tiny_model, PROMPT, 7)
    out, calls = traced["value"], traced["calls"]
    call = "cached_generate(prompt of 8 tokens, 7 new)"
    same_tokens(out, reference_greedy(tiny_model, PROMPT, 7), call)
    assert len(calls) == 7, f"{call}: expected 1 prefill + 6 decode calls of the model, got {len(calls)} calls"
    prefill, decodes = calls[0], calls[1:]
    assert prefill["ids"] == PROMPT and prefill["cache"] is not None and prefill["cache_length"] == 0, \
        f"{call}: the first model call must be the prefill: the whole prompt into an empty cache"
    for i, c in enumerate(decodes):
        assert c["ids"] == [out[i]], \
            f"{call}: decode step {i + 1} must feed only the newest token {out[i]}, fed {c['ids']}"
        assert c["cache"] == prefill["cache"], f"{call}: decode step {i + 1} must reuse the prefill's cache"
        assert c["cache_length"] == len(PROMPT) + i and c["input_pos"] in (None, len(PROMPT) + i), (
            f"{call}: decode step {i + 1} should run at position {len(PROMPT) + i} with {len(PROMPT) + i} tokens "
            f"cached; got input_pos={c['input_pos']} with {c['cache_length']} cached")
    empty = sandboxed("toyllm.grading.sandbox.harness:traced", ex02.cached_generate, tiny_model, PROMPT, 0)
    assert empty["value"] == [] and empty["calls"] == [], \
        "cached_generate(prompt of 8 tokens, 0 new): expected [] and no model call"
