"""Formulas of toyllm.analysis against the worked numbers of the source documents."""
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from toyllm.analysis import (GB, LLAMA2_13B, LLAMA_7B, POP_QUIZ, TPU_V5E_X8, attention_bytes, attention_flops,
                             attention_intensity, critical_intensity, crossing_batch, kv_bytes_per_token, kv_cache_bytes,
                             llama2_13b_table, matmul_bytes, matmul_flops, matmul_intensity, max_batch_size,
                             max_throughput_tokens_per_s, min_step_time_s, model_flops_per_token,
                             param_bytes, pop_quiz_step_times_s, prefill_flops, roofline_time_s,
                             static_kv_buffer_bytes, step_time_s)
from toyllm.model import build_model, get_config


# --------------------------------------------------------------------------- KV cache sizes

def test_kv_cache_llama2_13b_8k_bf16_is_6_7_gb():
    assert kv_cache_bytes(40, 40, 128, 8192, bytes_per_value=2) == 6_710_886_400
    assert kv_bytes_per_token(LLAMA2_13B, 2) * 8192 == 6_710_886_400
    # GQA with 8 KV heads: five times smaller; MQA: forty times; a batch multiplies.
    assert kv_cache_bytes(40, 8, 128, 8192) * 5 == 6_710_886_400
    assert kv_cache_bytes(40, 1, 128, 8192) * 40 == 6_710_886_400
    assert kv_cache_bytes(40, 40, 128, 8192, batch=4) == 4 * 6_710_886_400


def test_kv_cache_bytes_matches_a_real_cache():
    cfg = get_config("tiny")
    model = build_model(cfg)
    from toyllm.cache import DynamicKVCache

    cache = DynamicKVCache(cfg.n_layers)
    model(torch.zeros(1, 37, dtype=torch.long), cache=cache)
    real = sum(cache.keys(i).numel() + cache.values(i).numel() for i in range(cfg.n_layers)) * 4
    assert real == kv_cache_bytes(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, 37, bytes_per_value=4)


def test_static_buffer_llama_7b():
    assert static_kv_buffer_bytes(32, 32, 128, 2048, bits=16) == 2_146_435_072
    assert static_kv_buffer_bytes(32, 32, 128, 2048, bits=16, reserve=1.5) == 1_609_826_304
    assert static_kv_buffer_bytes(LLAMA_7B.n_layers, LLAMA_7B.n_heads, LLAMA_7B.head_dim,
                                  LLAMA_7B.max_context) == 2_146_435_072
    # reserve=1 is just the S-1 window: half of the copy-free reservation.
    assert static_kv_buffer_bytes(32, 32, 128, 2048, reserve=1) * 2 == 2_146_435_072


@pytest.mark.parametrize("kwargs, message", [({"max_seq_len": 1}, ">= 2"), ({"reserve": 2.5}, "reserve"),
                                             ({"reserve": 0.5}, "reserve"), ({"bits": 0}, "bits")])
def test_static_buffer_errors(kwargs, message):
    args = {"n_layers": 32, "n_kv_heads": 32, "head_dim": 128, "max_seq_len": 2048, **kwargs}
    with pytest.raises(ValueError, match=message):
        static_kv_buffer_bytes(**args)


# --------------------------------------------------------------------------- intensity and rooflines

def test_matmul_counts_and_intensity():
    assert matmul_flops(2, 3, 4) == 48
    assert matmul_bytes(2, 3, 4) == 2 * (6 + 12 + 8)
    assert matmul_intensity(2, 3, 4) == pytest.approx(48 / 52)
    # B << D, F: intensity is about B (in bf16).
    assert matmul_intensity(4, 16384, 16384) == pytest.approx(4, rel=1e-3)
    assert matmul_intensity(240, 8192, 32768) == pytest.approx(240, rel=0.05)


def test_attention_intensity_prefill_and_decode():
    assert attention_intensity(4096, 4096) == 2048                # T/2 in prefill
    assert attention_intensity(8192, 1) == pytest.approx(1, rel=1e-3)   # about 1 in decode
    for S, T in [(4096, 4096), (8192, 1), (1000, 10)]:
        assert attention_flops(S, T, 128) / attention_bytes(S, T, 128) == pytest.approx(attention_intensity(S, T))
    with pytest.raises(ValueError, match="at least 1"):
        attention_intensity(0, 5)


def test_gqa_raises_decode_attention_intensity_by_the_group_size():
    # 5 query heads per K/V head read each K/V byte for 5 queries: about 5 FLOPs per byte in decode.
    assert attention_intensity(8192, 1, group=5) == pytest.approx(5, rel=1e-3)
    assert attention_intensity(8192, 1, group=5) / attention_intensity(8192, 1) == pytest.approx(5, rel=1e-3)
    # float32 halves it; the exact formula 2GST / (bytes (S + GT)).
    assert attention_intensity(100, 3, group=3, bytes_per_value=4) == pytest.approx(2 * 3 * 100 * 3 / (4 * 109))
    assert attention_flops(64, 4, 32, group=3) / attention_bytes(64, 4, 32, group=3) == pytest.approx(
        attention_intensity(64, 4, group=3))


def test_dense_kernel_intensity_is_about_the_head_size():
    # Writing and reading the T x S scores caps prefill intensity near head_dim, however long the prompt.
    assert attention_intensity(4096, 4096, 128, kernel="dense") == pytest.approx(2 * 128 * 4096 / (4 * 128 + 2 * 4096))
    assert attention_intensity(2 ** 20, 2 ** 20, 128, kernel="dense") == pytest.approx(128, rel=1e-3)
    assert attention_intensity(4096, 4096, 128, kernel="dense") < attention_intensity(4096, 4096) / 10
    assert attention_bytes(10, 10, 8, kernel="dense") - attention_bytes(10, 10, 8) == 2 * 2 * 10 * 10
    with pytest.raises(ValueError, match="head_dim"):
        attention_intensity(16, 16, kernel="dense")
    with pytest.raises(ValueError, match="kernel"):
        attention_bytes(16, 16, 8, kernel="flash")


def test_crossing_batch_exact_and_by_precision():
    # LLaMA-2-13B's MLP matmul on a TPU v5e: the ridge is 240, the exact crossing 257.
    assert crossing_batch(5120, 13824, 1.97e14, 8.2e11) == 257
    assert matmul_intensity(256, 5120, 13824) < critical_intensity(1.97e14, 8.2e11) <= matmul_intensity(257, 5120, 13824)
    # int8 weights with bf16 compute (one byte per weight, same FLOP/s): about half, 124 for the quiz's matmul.
    assert crossing_batch(8192, 32768, 16 * 1.97e14, 16 * 8.1e11, bytes_per_value=1) == 124
    # A matmul too narrow to ever reach the ridge.
    assert crossing_batch(64, 64, 1.97e14, 8.2e11) is None


def test_critical_intensity_and_roofline():
    assert critical_intensity(1.97e14, 8.2e11) == pytest.approx(240, rel=0.002)
    assert roofline_time_s(2e12, 1e9, 1e12, 1e12) == pytest.approx(2.0)      # compute-bound
    assert roofline_time_s(1e9, 4e12, 1e12, 1e12) == pytest.approx(4.0)      # memory-bound


def test_llama2_13b_preset_has_13b_parameters():
    assert LLAMA2_13B.n_params == pytest.approx(13e9, rel=0.002)
    assert param_bytes(LLAMA2_13B, 2) == pytest.approx(26e9, rel=0.002)
    assert model_flops_per_token(LLAMA2_13B) == pytest.approx(2 * 13e9, rel=0.02)


@pytest.mark.needs("2.1")          # the dense kernel: QK^T and AV in full
@pytest.mark.parametrize("tokens", [1, 7, 32])
def test_prefill_flops_match_torch_flop_counter(tokens):
    cfg = get_config("tiny")
    model = build_model(cfg)                       # dense attention: QK^T and AV are counted in full
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        model(torch.zeros(1, tokens, dtype=torch.long))
    assert counter.get_total_flops() == prefill_flops(cfg, tokens)
    assert prefill_flops(cfg, tokens, attention="causal") < prefill_flops(cfg, tokens) or tokens == 1
    with pytest.raises(ValueError, match="dense"):
        prefill_flops(cfg, tokens, attention="flash")


# --------------------------------------------------------------------------- step time, throughput, tables

def test_pop_quiz_2_5_ms_and_21_ms():
    times = pop_quiz_step_times_s()
    # The chapter writes "2.5 ms": (4 * 819.2e6 + 30e9) / (16 * 8.1e11) = 2.568 ms.
    assert times[4] == pytest.approx(2.5677e-3, rel=1e-4)
    assert 2.5e-3 <= times[4] < 2.6e-3
    # Batch 256 is compute-bound in the matmuls: 16.18 ms of KV reads + 4.87 ms of math = 21 ms.
    assert times[256] == pytest.approx(21.05e-3, rel=1e-3)
    hw = POP_QUIZ["hardware"]
    kv = POP_QUIZ["kv_bytes_per_token"] * POP_QUIZ["context"]
    assert kv == pytest.approx(819.2e6)
    small = min_step_time_s(POP_QUIZ["param_bytes"], kv, 4, hw.total_bandwidth_bytes_per_s)
    assert small == pytest.approx(times[4])       # memory-bound formula agrees at small batch
    assert step_time_s(30e9, kv, 256, hw.total_bandwidth_bytes_per_s, 30e9, hw.total_flops) > \
        min_step_time_s(30e9, kv, 256, hw.total_bandwidth_bytes_per_s)


SEED_TABLE_MHA = {  # batch: (KV GB, total GB, step ms, tokens/s), as printed in the chapter
    1: (6.7, 32.7, 4.98, 200.61), 8: (53.6, 79.6, 12.13, 659.30), 16: (107.2, 133.2, 20.30, 787.99),
    32: (214.4, 240.4, 36.65, 873.21), 64: (428.8, 454.8, 69.33, 923.13), 240: (1608, 1634, 249.09, 963.53)}
SEED_TABLE_GQA = {
    1: (1.34, 27.34, 4.17, 239.94), 8: (10.72, 36.72, 5.60, 1429.19), 16: (21.44, 47.44, 7.23, 2212.48),
    32: (42.88, 68.88, 10.50, 3047.62), 64: (85.76, 111.76, 17.04, 3756.62), 240: (321.6, 347.6, 52.99, 4529.34)}


@pytest.mark.parametrize("n_kv_heads, seed_table", [(40, SEED_TABLE_MHA), (8, SEED_TABLE_GQA)])
def test_llama2_13b_tables_reproduce_every_printed_number(n_kv_heads, seed_table):
    rows = llama2_13b_table(n_kv_heads=n_kv_heads)
    assert [r["batch"] for r in rows] == [1, 8, 16, 32, 64, 240]
    for r in rows:
        kv, total, step, tput = seed_table[r["batch"]]
        assert r["kv_cache_gb"] == pytest.approx(kv, abs=1e-9)
        assert r["total_memory_gb"] == pytest.approx(total, abs=1e-9)
        assert round(r["step_time_ms"], 2) == step
        assert round(r["throughput_tokens_per_s"], 2) == tput


def test_llama2_13b_memory_limits():
    rows = {r["batch"]: r for r in llama2_13b_table()}
    # 8 x 16 GiB = 137.4 GB: batch 16 fits, 32 does not ("beyond batch 16 we run out of memory").
    assert [rows[b]["fits_in_memory"] for b in (1, 8, 16, 32, 64, 240)] == [True, True, True, False, False, False]
    assert max_batch_size(26 * GB, 6.7 * GB, TPU_V5E_X8.total_hbm_bytes) == 16
    assert max_batch_size(26 * GB, 1.34 * GB, TPU_V5E_X8.total_hbm_bytes) == 83   # GQA fits batch 64
    assert max_batch_size(200 * GB, 1 * GB, TPU_V5E_X8.total_hbm_bytes) == 0


def test_llama2_13b_exact_counts_and_throughput_formula():
    exact = llama2_13b_table(batch_sizes=(1,), rounded=False)[0]
    assert exact["kv_cache_gb"] == pytest.approx(6.7108864)
    assert exact["step_time_ms"] == pytest.approx(4.99, abs=0.01)
    bw = TPU_V5E_X8.total_bandwidth_bytes_per_s
    assert max_throughput_tokens_per_s(26e9, 6.7e9, 8, bw) == pytest.approx(8 / min_step_time_s(26e9, 6.7e9, 8, bw))
    with pytest.raises(ValueError, match="divide"):
        llama2_13b_table(n_kv_heads=7)
    with pytest.raises(ValueError, match="bandwidth"):
        min_step_time_s(1, 1, 1, 0)
