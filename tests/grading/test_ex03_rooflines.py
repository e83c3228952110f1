"""Graded tests of lesson 03 (ex03_rooflines): 12 points, 2 per exercise.

Test vectors: the scaling-book chapter's pop quiz (30B int8 model, 819.2 MB
of KV per sequence, TPU v5e 4x4: 2.5 ms at batch 4, 21 ms at batch 256) and
its LLaMA-2-13B tables on 8x TPU v5e (26 GB of weights, 6.7 GB of KV per
8192-token sequence, 8 x 8.2e11 B/s, 8 x 16 GiB of HBM), with
``toyllm.analysis`` as the reference.
"""
import pytest

from toyllm import analysis

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


# --------------------------------------------------------------------------- 3.1

@pytest.mark.exercise("3.1")
@pytest.mark.points(1)
def test_ex3_1_matches_the_formula(ex03):
    assert ex03.matmul_intensity(1, 4096, 4096) == pytest.approx(4096 / 4098, rel=1e-12)   # 2*D*F / (2*(D + D*F + F))
    for args in [(16, 5120, 13824, 2), (512, 4096, 4096, 2), (3, 7, 11, 4), (64, 8192, 8192, 1)]:
        assert ex03.matmul_intensity(*args) == pytest.approx(analysis.matmul_intensity(*args), rel=1e-12)


@pytest.mark.exercise("3.1")
@pytest.mark.points(1)
def test_ex3_1_is_about_the_batch_when_it_is_small(ex03):
    for B in (1, 8, 64):
        assert ex03.matmul_intensity(B, 8192, 32768) == pytest.approx(B, rel=0.01)
        assert ex03.matmul_intensity(B, 8192, 32768, bytes_per_value=1) == pytest.approx(2 * B, rel=0.01)
    with pytest.raises(ValueError):
        ex03.matmul_intensity(0, 8192, 32768)


# --------------------------------------------------------------------------- 3.2

@pytest.mark.exercise("3.2")
@pytest.mark.points(1)
def test_ex3_2_prefill_is_half_the_prompt(ex03):
    assert ex03.attention_intensity(4096, 4096) == pytest.approx(2048, rel=1e-12)
    assert ex03.attention_intensity(1, 1) == pytest.approx(0.5, rel=1e-12)
    assert ex03.attention_intensity(1000, 10) == pytest.approx(1000 * 10 / 1010, rel=1e-12)


@pytest.mark.exercise("3.2")
@pytest.mark.points(1)
def test_ex3_2_decode_is_about_one(ex03):
    got = ex03.attention_intensity(8192, 1)
    assert got == pytest.approx(8192 / 8193, rel=1e-12) and 0.99 < got < 1
    assert got == pytest.approx(analysis.attention_intensity(8192, 1), rel=1e-12)
    with pytest.raises(ValueError):
        ex03.attention_intensity(0, 1)


# --------------------------------------------------------------------------- 3.3

@pytest.mark.exercise("3.3")
@pytest.mark.points(1)
def test_ex3_3_pop_quiz_batch_4(ex03):
    got = ex03.min_step_time_s(QUIZ_PARAM_BYTES, QUIZ_KV_PER_SEQ, 4, QUIZ_BANDWIDTH)
    assert got == pytest.approx((4 * 819.2e6 + 30e9) / 12.96e12, rel=1e-12)
    assert abs(got - 2.5e-3) < 0.1e-3                               # "about 2.5 ms" (2.57 exactly)


@pytest.mark.exercise("3.3")
@pytest.mark.points(1)
def test_ex3_3_llama2_13b_step_times(ex03):
    table_ms = (4.98, 12.13, 20.30, 36.65, 69.33, 249.09)           # the chapter's row, 2 decimals
    reference = analysis.llama2_13b_table(BATCHES)
    for batch, ms, row in zip(BATCHES, table_ms, reference):
        got = ex03.min_step_time_s(PARAM_BYTES, KV_PER_SEQ, batch, BANDWIDTH)
        assert abs(got * 1e3 - ms) <= 0.005 + 1e-9, f"batch {batch}: {got * 1e3:.3f} ms, table {ms} ms"
        assert got * 1e3 == pytest.approx(row["step_time_ms"], rel=1e-12)
    with pytest.raises(ValueError):
        ex03.min_step_time_s(PARAM_BYTES, KV_PER_SEQ, 1, 0.0)


# --------------------------------------------------------------------------- 3.4

@pytest.mark.exercise("3.4")
@pytest.mark.points(1)
def test_ex3_4_pop_quiz_batch_256(ex03):
    got = ex03.step_time_s(QUIZ_PARAM_BYTES, QUIZ_KV_PER_SEQ, 256, QUIZ_BANDWIDTH, QUIZ_PARAM_COUNT, QUIZ_FLOPS)
    assert abs(got - 21e-3) < 0.1e-3                                # "about 21 ms"
    assert got == pytest.approx(analysis.pop_quiz_step_times_s()[256], rel=1e-12)


@pytest.mark.exercise("3.4")
@pytest.mark.points(1)
def test_ex3_4_small_batches_stay_memory_bound(ex03):
    got = ex03.step_time_s(QUIZ_PARAM_BYTES, QUIZ_KV_PER_SEQ, 4, QUIZ_BANDWIDTH, QUIZ_PARAM_COUNT, QUIZ_FLOPS)
    assert got == pytest.approx(analysis.min_step_time_s(QUIZ_PARAM_BYTES, QUIZ_KV_PER_SEQ, 4, QUIZ_BANDWIDTH),
                                rel=1e-12)
    assert abs(got - 2.5e-3) < 0.1e-3
    # at batch 256 the arithmetic, not the weight loading, sets the matmul time
    memory_bound = analysis.min_step_time_s(QUIZ_PARAM_BYTES, QUIZ_KV_PER_SEQ, 256, QUIZ_BANDWIDTH)
    assert ex03.step_time_s(QUIZ_PARAM_BYTES, QUIZ_KV_PER_SEQ, 256, QUIZ_BANDWIDTH, QUIZ_PARAM_COUNT,
                            QUIZ_FLOPS) > memory_bound * 1.1


# --------------------------------------------------------------------------- 3.5

@pytest.mark.exercise("3.5")
@pytest.mark.points(1)
def test_ex3_5_llama2_13b_throughput_row(ex03):
    table = (200.61, 659.30, 787.99, 873.21, 923.13, 963.53)
    for batch, expected in zip(BATCHES, table):
        got = ex03.max_throughput_tokens_per_s(PARAM_BYTES, KV_PER_SEQ, batch, BANDWIDTH)
        assert abs(got - expected) <= 0.005 + 1e-9, f"batch {batch}: {got:.3f} tokens/s, table {expected}"


@pytest.mark.exercise("3.5")
@pytest.mark.points(1)
def test_ex3_5_five_times_smaller_kv_cache(ex03):
    table = (239.94, 1429.19, 2212.48, 3047.62, 3756.62, 4529.34)
    reference = analysis.llama2_13b_table(BATCHES, n_kv_heads=8)
    for batch, expected, row in zip(BATCHES, table, reference):
        got = ex03.max_throughput_tokens_per_s(PARAM_BYTES, KV_PER_SEQ_GQA, batch, BANDWIDTH)
        assert abs(got - expected) <= 0.005 + 1e-9, f"batch {batch}: {got:.3f} tokens/s, table {expected}"
        assert got == pytest.approx(row["throughput_tokens_per_s"], rel=1e-12)


# --------------------------------------------------------------------------- 3.6

@pytest.mark.exercise("3.6")
@pytest.mark.points(1)
def test_ex3_6_llama2_13b_on_8_tpus(ex03):
    got = ex03.max_batch_size(PARAM_BYTES, KV_PER_SEQ, HBM_BYTES)
    assert got == 16                                                # batch 16 fits, 32 runs out of memory
    assert got == analysis.max_batch_size(PARAM_BYTES, KV_PER_SEQ, HBM_BYTES)
    fits = {row["batch"]: row["fits_in_memory"] for row in analysis.llama2_13b_table(BATCHES)}
    assert all(fits[b] == (b <= got) for b in BATCHES)


@pytest.mark.exercise("3.6")
@pytest.mark.points(1)
def test_ex3_6_smaller_kv_cache_and_no_room(ex03):
    assert ex03.max_batch_size(PARAM_BYTES, KV_PER_SEQ_GQA, HBM_BYTES) == 83      # batch 64 fits now
    assert ex03.max_batch_size(200e9, KV_PER_SEQ, HBM_BYTES) == 0                 # the weights alone do not fit
    with pytest.raises(ValueError):
        ex03.max_batch_size(PARAM_BYTES, 0, HBM_BYTES)
