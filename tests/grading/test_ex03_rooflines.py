"""Graded tests of lesson 03 (ex03_rooflines): 12 points, 2 per exercise.

Test vectors: the scaling-book chapter's pop quiz (30B int8 model, 819.2 MB
of KV per sequence, TPU v5e 4x4: 2.5 ms at batch 4, 21 ms at batch 256) and
its LLaMA-2-13B tables on 8x TPU v5e (26 GB of weights, 6.7 GB of KV per
8192-token sequence, 8 x 8.2e11 B/s, 8 x 16 GiB of HBM). References are the
formulas written out below, plus cases no example shows. While an exercise
is graded, the lesson's other functions are the model answers, so a mistake
in 3.3 costs 3.3's points only, not 3.5's too.
"""
import math

import pytest

from toyllm.grading.expect import close, equal, raises
from toyllm.grading.references import reference

# The pop quiz
QUIZ_PARAM_BYTES = 30e9                 # 30B parameters in int8
QUIZ_PARAM_COUNT = 30e9
QUIZ_KV_PER_SEQ = 100e3 * 8192          # 100 kB per token, 8192 tokens: 819.2 MB
QUIZ_BANDWIDTH = 16 * 8.1e11            # 16 chips, bytes/s
QUIZ_FLOPS = 16 * 1.97e14               # bf16 FLOP/s

# The LLaMA-2-13B tables
PARAM_BYTES = 26e9                      # 13e9 parameters in bf16
KV_PER_SEQ = 6.7e9                      # 8192 tokens, 40 KV heads
KV_PER_SEQ_GQA = 1.34e9                 # 8 KV heads: five times smaller
BANDWIDTH = 8 * 8.2e11
HBM_BYTES = 8 * 16 * 2**30
BATCHES = (1, 8, 16, 32, 64, 240)


@reference
def intensity_reference(B, D, F, bytes_per_value):
    return 2 * B * D * F / (bytes_per_value * (B * D + D * F + B * F))


@reference
def attention_intensity_reference(S, T):
    return S * T / (S + T)


@reference
def memory_bound_step(param_bytes, kv, batch, bandwidth):
    return (batch * kv + param_bytes) / bandwidth


@reference
def throughput_reference(param_bytes, kv, batch, bandwidth):
    return batch / memory_bound_step(param_bytes, kv, batch, bandwidth)


def float_close(got, expected, call, rel=1e-12):
    """A Python float (the docstrings promise one) within ``rel`` of ``expected``."""
    equal(type(got), float, f"{call}: type of the result")
    close(got, expected, call, rel=rel)


# --------------------------------------------------------------------------- 3.1

@pytest.mark.exercise("3.1")
@pytest.mark.points(1)
def test_ex3_1_matches_the_formula(ex03, drawn):
    rng = drawn.rng("3.1")
    cases = [(1, 4096, 4096), (16, 5120, 13824, 2), (512, 4096, 4096, 2), (3, 7, 11, 4), (64, 8192, 8192, 1),
             (5, 3, 2, 0.5)]
    cases += [(rng.randint(1, 4096), rng.randint(1, 16384), rng.randint(1, 65536), rng.choice([0.5, 1, 2, 4]))
              for _ in range(6)]
    for i, args in enumerate(cases):
        B, D, F, *rest = args
        bpv = rest[0] if rest else 2
        note = f"; {drawn}" if i >= 6 else ""
        float_close(ex03.matmul_intensity(*args), intensity_reference(B, D, F, bpv),
                    f"matmul_intensity(B={B}, D={D}, F={F}, bytes_per_value={bpv}{note})")


@pytest.mark.exercise("3.1")
@pytest.mark.points(1)
def test_ex3_1_is_about_the_batch_when_it_is_small(ex03):
    for B in (1, 8, 64):
        close(ex03.matmul_intensity(B, 8192, 32768), B, f"matmul_intensity(B={B}, 8192, 32768) (about B)", rel=0.01)
        close(ex03.matmul_intensity(B, 8192, 32768, bytes_per_value=1), 2 * B,
              f"matmul_intensity(B={B}, 8192, 32768, int8) (about 2B)", rel=0.01)
    raises(ValueError, ex03.matmul_intensity, 0, 8192, 32768, call="matmul_intensity(B=0, ...)")
    raises(ValueError, ex03.matmul_intensity, 4, 8192, 32768, bytes_per_value=0, call="matmul_intensity(bytes_per_value=0)")


# --------------------------------------------------------------------------- 3.2

@pytest.mark.exercise("3.2")
@pytest.mark.points(1)
def test_ex3_2_prefill_is_half_the_prompt(ex03, drawn):
    for S, T in ((4096, 4096), (1, 1), (1000, 10), (3, 7), (513, 2)):
        float_close(ex03.attention_intensity(S, T), attention_intensity_reference(S, T),
                    f"attention_intensity(S={S}, T={T})")
    rng = drawn.rng("3.2")
    for _ in range(6):
        S = rng.randint(1, 100_000)
        T = rng.choice([1, S, rng.randint(1, S)])
        float_close(ex03.attention_intensity(S, T), attention_intensity_reference(S, T),
                    f"attention_intensity(S={S}, T={T}; {drawn})")


@pytest.mark.exercise("3.2")
@pytest.mark.points(1)
def test_ex3_2_decode_is_about_one(ex03):
    got = ex03.attention_intensity(8192, 1)
    float_close(got, attention_intensity_reference(8192, 1), "attention_intensity(S=8192, T=1) (decode)")
    raises(ValueError, ex03.attention_intensity, 0, 1, call="attention_intensity(S=0, T=1)")
    raises(ValueError, ex03.attention_intensity, 16, 0, call="attention_intensity(S=16, T=0)")


# --------------------------------------------------------------------------- 3.3

@pytest.mark.exercise("3.3")
@pytest.mark.points(1)
def test_ex3_3_pop_quiz_batch_4(ex03):
    got = ex03.min_step_time_s(QUIZ_PARAM_BYTES, QUIZ_KV_PER_SEQ, 4, QUIZ_BANDWIDTH)
    float_close(got, memory_bound_step(QUIZ_PARAM_BYTES, QUIZ_KV_PER_SEQ, 4, QUIZ_BANDWIDTH),
                "min_step_time_s(the pop quiz, batch 4) in seconds")
    assert abs(got - 2.5e-3) < 0.1e-3, f"min_step_time_s(the pop quiz, batch 4): about 2.5 ms expected, got {got!r} s"


@pytest.mark.exercise("3.3")
@pytest.mark.points(1)
def test_ex3_3_llama2_13b_step_times_and_other_cases(ex03, drawn):
    table_ms = (4.98, 12.13, 20.30, 36.65, 69.33, 249.09)           # the chapter's row, 2 decimals
    for batch, ms in zip(BATCHES, table_ms):
        got = ex03.min_step_time_s(PARAM_BYTES, KV_PER_SEQ, batch, BANDWIDTH)
        float_close(got, memory_bound_step(PARAM_BYTES, KV_PER_SEQ, batch, BANDWIDTH),
                    f"min_step_time_s(LLaMA-2-13B, batch {batch}) (the table says {ms} ms)")
    for args in ((7e9, 3e8, 0, 1e12), (1.5e10, 2.5e9, 3, 2e12)):
        float_close(ex03.min_step_time_s(*args), memory_bound_step(*args), f"min_step_time_s{args}")
    rng = drawn.rng("3.3")
    for _ in range(6):
        args = (rng.uniform(1e8, 2e11), rng.uniform(1e6, 1e10), rng.randint(0, 512), rng.uniform(1e11, 5e13))
        float_close(ex03.min_step_time_s(*args), memory_bound_step(*args), f"min_step_time_s{args} ({drawn})")
    raises(ValueError, ex03.min_step_time_s, PARAM_BYTES, KV_PER_SEQ, 1, 0.0, call="min_step_time_s(bandwidth=0)")
    raises(ValueError, ex03.min_step_time_s, PARAM_BYTES, KV_PER_SEQ, -1, BANDWIDTH, call="min_step_time_s(batch=-1)")


# --------------------------------------------------------------------------- 3.4

@reference
def step_reference(param_bytes, kv, batch, bandwidth, param_count, flops):
    return batch * kv / bandwidth + max(2 * batch * param_count / flops, param_bytes / bandwidth)


@pytest.mark.exercise("3.4")
@pytest.mark.points(1)
def test_ex3_4_pop_quiz_batch_256(ex03):
    args = (QUIZ_PARAM_BYTES, QUIZ_KV_PER_SEQ, 256, QUIZ_BANDWIDTH, QUIZ_PARAM_COUNT, QUIZ_FLOPS)
    got = ex03.step_time_s(*args)
    float_close(got, step_reference(*args), "step_time_s(the pop quiz, batch 256) in seconds")
    assert abs(got - 21e-3) < 0.1e-3, f"step_time_s(the pop quiz, batch 256): about 21 ms expected, got {got!r} s"


@pytest.mark.exercise("3.4")
@pytest.mark.points(1)
def test_ex3_4_memory_or_compute_bound(ex03, drawn):
    for batch in (0, 4, 64, 100, 1000):        # memory-bound below about 128, compute-bound above
        args = (QUIZ_PARAM_BYTES, QUIZ_KV_PER_SEQ, batch, QUIZ_BANDWIDTH, QUIZ_PARAM_COUNT, QUIZ_FLOPS)
        float_close(ex03.step_time_s(*args), step_reference(*args), f"step_time_s(the pop quiz, batch {batch})")
    args = (2e9, 5e7, 12, 1e12, 1e9, 5e12)     # a small model on a slow chip: compute-bound already at 12
    float_close(ex03.step_time_s(*args), step_reference(*args), f"step_time_s{args}")
    rng = drawn.rng("3.4")
    for _ in range(6):                         # drawn: some memory-bound, some compute-bound
        count = rng.uniform(1e8, 1e11)
        args = (count * rng.choice([0.5, 1, 2]), rng.uniform(1e6, 1e10), rng.randint(0, 2048), rng.uniform(1e11, 5e13),
                count, rng.uniform(1e13, 1e16))
        float_close(ex03.step_time_s(*args), step_reference(*args), f"step_time_s{args} ({drawn})")
    raises(ValueError, ex03.step_time_s, 1e9, 1e6, 1, 1e12, 1e9, 0.0, call="step_time_s(peak_flops=0)")


# --------------------------------------------------------------------------- 3.5

@pytest.mark.exercise("3.5")
@pytest.mark.points(1)
def test_ex3_5_llama2_13b_throughput_row(ex03, drawn):
    table = (200.61, 659.30, 787.99, 873.21, 923.13, 963.53)
    for batch, expected in zip(BATCHES, table):
        got = ex03.max_throughput_tokens_per_s(PARAM_BYTES, KV_PER_SEQ, batch, BANDWIDTH)
        float_close(got, throughput_reference(PARAM_BYTES, KV_PER_SEQ, batch, BANDWIDTH),
                    f"max_throughput_tokens_per_s(LLaMA-2-13B, batch {batch}) (the table says {expected})")
    rng = drawn.rng("3.5")
    for _ in range(6):
        args = (rng.uniform(1e8, 2e11), rng.uniform(1e6, 1e10), rng.randint(1, 512), rng.uniform(1e11, 5e13))
        float_close(ex03.max_throughput_tokens_per_s(*args), throughput_reference(*args),
                    f"max_throughput_tokens_per_s{args} ({drawn})")


@pytest.mark.exercise("3.5")
@pytest.mark.points(1)
def test_ex3_5_five_times_smaller_kv_cache_and_bad_batches(ex03):
    table = (239.94, 1429.19, 2212.48, 3047.62, 3756.62, 4529.34)
    for batch, expected in zip(BATCHES, table):
        got = ex03.max_throughput_tokens_per_s(PARAM_BYTES, KV_PER_SEQ_GQA, batch, BANDWIDTH)
        assert abs(got - expected) <= 0.005 + 1e-9, \
            f"max_throughput_tokens_per_s(LLaMA-2-13B with 8 KV heads, batch {batch}): expected {expected}, got {got!r}"
    float_close(ex03.max_throughput_tokens_per_s(5e9, 1e8, 3, 4e11), throughput_reference(5e9, 1e8, 3, 4e11),
                "max_throughput_tokens_per_s(5e9, 1e8, batch 3, 4e11)")
    raises(ValueError, ex03.max_throughput_tokens_per_s, PARAM_BYTES, KV_PER_SEQ, 0, BANDWIDTH,
           call="max_throughput_tokens_per_s(batch=0)")


# --------------------------------------------------------------------------- 3.6

@reference
def batch_reference(param_bytes, kv, hbm):
    return max(0, math.floor((hbm - param_bytes) / kv))


@reference
def whole_batch_reference(param_bytes, kv, hbm):
    """``batch_reference`` for whole byte counts, in exact integers."""
    return max(0, (hbm - param_bytes) // kv)


@pytest.mark.exercise("3.6")
@pytest.mark.points(1)
def test_ex3_6_llama2_13b_on_8_tpus(ex03):
    equal(ex03.max_batch_size(PARAM_BYTES, KV_PER_SEQ, HBM_BYTES), 16,
          "max_batch_size(LLaMA-2-13B on 8 x 16 GiB): batch 16 fits, 32 does not")
    equal(ex03.max_batch_size(PARAM_BYTES, KV_PER_SEQ_GQA, HBM_BYTES), 83, "max_batch_size(LLaMA-2-13B, 8 KV heads)")


@pytest.mark.exercise("3.6")
@pytest.mark.points(1)
def test_ex3_6_exact_fits_and_no_room(ex03, drawn):
    for args in ((10e9, 1e9, 15e9), (10e9, 1e9, 15.999e9), (12e9, 5e8, 12e9), (3e9, 7e8, 8 * 2**30)):
        equal(ex03.max_batch_size(*args), batch_reference(*args), f"max_batch_size{args}")
    rng = drawn.rng("3.6")
    for i in range(6):              # drawn whole byte counts; every other case fits exactly
        param, kv = rng.randint(10**8, 10**12), rng.randint(10**6, 10**10)
        hbm = param + kv * rng.randint(0, 500) + (0 if i % 2 else rng.randint(-kv // 2, kv - 1))
        equal(ex03.max_batch_size(param, kv, hbm), whole_batch_reference(param, kv, hbm),
              f"max_batch_size({param}, {kv}, {hbm}; {drawn})")
    equal(ex03.max_batch_size(200e9, KV_PER_SEQ, HBM_BYTES), 0, "max_batch_size(200 GB of weights in 128 GiB)")
    raises(ValueError, ex03.max_batch_size, PARAM_BYTES, 0, HBM_BYTES, call="max_batch_size(kv_bytes_per_seq=0)")
