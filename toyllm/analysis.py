"""Back-of-the-envelope formulas for inference: FLOPs, bytes, intensity, memory, step time.

Everything here is a pure function of numbers (or a ``ModelConfig``), with
its units in the docstring: FLOPs count a multiply and an add as two,
bytes are bytes, times are seconds. Lessons 02-03 use these, and the graded
exercises are checked against them.

The two questions behind most of it:

- Is an operation limited by arithmetic or by memory traffic? Compare its
  arithmetic intensity (FLOPs per byte moved) with the hardware's
  (peak FLOP/s divided by memory bandwidth). A [B, D] x [D, F] matmul has
  intensity about B in 16-bit (B/2 in float32), so decoding one token at a
  time is memory-bound; fused attention has intensity S*T/(S+T) in 16-bit:
  about T/2 in prefill, about 1 in decode (times the GQA group size), while
  a dense kernel that writes the score matrix stays near the head size.
- How long must a decode step take at least? Every step reads all the
  parameters and every sequence's KV cache once:
  (batch * KV bytes + parameter bytes) / bandwidth.

Presets reproduce the worked numbers of the scaling-book inference chapter
(LLaMA-2-13B on TPU v5e) so they can serve as test vectors.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .answers import answer, exercise, shortcut
from .model import ModelConfig

GB = 1e9           # bytes; the seed's tables count in these
GiB = 2 ** 30      # bytes


# --------------------------------------------------------------------------- presets

@dataclass(frozen=True)
class HardwareSpec:
    """An accelerator (or a group of ``chips`` identical ones) as a roofline sees it."""

    name: str
    chips: int
    hbm_bandwidth_bytes_per_s: float   # per chip
    peak_flops: float                  # per chip, FLOP/s at the compute precision
    hbm_bytes: float                   # per chip

    @property
    def total_bandwidth_bytes_per_s(self) -> float:
        return self.chips * self.hbm_bandwidth_bytes_per_s

    @property
    def total_flops(self) -> float:
        return self.chips * self.peak_flops

    @property
    def total_hbm_bytes(self) -> float:
        return self.chips * self.hbm_bytes


# 8x TPU v5e, as in the LLaMA-2-13B tables: 16 GiB of HBM and 8.2e11 B/s per chip,
# 1.97e14 bf16 FLOP/s per chip. (The chapter rounds the totals to "128 GiB,
# 6.5 TiB/s, 1600 TF/s"; its table is computed with 8 * 8.2e11 B/s.)
TPU_V5E_X8 = HardwareSpec("8x TPU v5e", chips=8, hbm_bandwidth_bytes_per_s=8.2e11,
                          peak_flops=1.97e14, hbm_bytes=16 * GiB)

# The chapter's pop quiz: a TPU v5e 4x4 slice, with 8.1e11 B/s per chip as the quiz states.
TPU_V5E_4X4_POP_QUIZ = HardwareSpec("TPU v5e 4x4 (pop quiz)", chips=16, hbm_bandwidth_bytes_per_s=8.1e11,
                                    peak_flops=1.97e14, hbm_bytes=16 * GiB)

# An A100 as the KV-Runahead paper's experiments used it (fp16). Assumed
# datasheet-style numbers, not measured here: 312 TFLOP/s dense fp16,
# about 2 TB/s of HBM bandwidth (80 GB part).
A100 = HardwareSpec("A100 80GB (assumed datasheet numbers)", chips=1, hbm_bandwidth_bytes_per_s=2.0e12,
                    peak_flops=312e12, hbm_bytes=80 * GB)

# LLaMA-2-13B in toyllm's config: 40 layers, d_model 5120, 40 heads of 128
# (no GQA), SwiGLU width 13824 (= 2.7 x 5120), 32k vocabulary, untied embeddings.
LLAMA2_13B = ModelConfig(vocab_size=32000, d_model=5120, n_layers=40, n_heads=40, n_kv_heads=40,
                         head_dim=128, ffn_dim=13824, rope_base=10000.0, norm_eps=1e-5, max_context=4096)

# Llama-7B, the static-buffer example of the KV cache note and the paper's main model.
LLAMA_7B = ModelConfig(vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=32,
                       head_dim=128, ffn_dim=11008, rope_base=10000.0, norm_eps=1e-6, max_context=2048)

# The pop quiz: a 30B dense model with int8 weights (1 byte per parameter),
# an 8192-token context and 100 kB of KV cache per token.
POP_QUIZ = {"param_count": 30e9, "param_bytes": 30e9, "context": 8192, "kv_bytes_per_token": 100e3,
            "hardware": TPU_V5E_4X4_POP_QUIZ}


# --------------------------------------------------------------------------- KV cache memory

@answer("2.2", "The KV-cache size")
def kv_cache_bytes(n_layers: int, n_kv_heads: int, head_dim: int, tokens: int,
                   bytes_per_value: float = 2, batch: int = 1) -> int | float:
    """Bytes of K and V for ``tokens`` tokens of ``batch`` sequences.

    2 (K and V) * layers * kv_heads * head_dim * tokens * bytes_per_value * batch.
    LLaMA-2-13B (40, 40, 128), 8192 tokens in bf16: 6,710,886,400 bytes (6.7 GB).
    Fewer KV heads (GQA, or MQA with one) shrink it by n_heads / n_kv_heads.
    """
    return exercise("2.2")(n_layers, n_kv_heads, head_dim, tokens, bytes_per_value, batch)


@shortcut("2.2",
          ships="calls kv_cache_bytes, Exercise 2.2's entry: the edition runs the student's answer here")
def kv_bytes_per_token(cfg: ModelConfig, bytes_per_value: float) -> int | float:
    """KV-cache bytes one token adds over all layers of ``cfg`` (4 for toyllm's float32, 2 for bf16)."""
    return kv_cache_bytes(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, 1, bytes_per_value)


@answer("2.3", "The static KV buffer's size", "static_buffer_bytes")
def static_kv_buffer_bytes(n_layers: int, n_kv_heads: int, head_dim: int, max_seq_len: int,
                           bits: int = 16, reserve: float = 2.0) -> int:
    """Bytes of a preallocated K/V buffer for a runtime without dynamic shapes.

    Each K or V of each head keeps ``reserve * (S - 1)`` rows of ``head_dim``
    values, S = ``max_seq_len``: the static graph reads a left-padded window
    of S-1 rows, and with reserve=2 the window can slide right until the
    cache is full without a single copy. Total:
    2 (K and V) * n_layers * n_kv_heads * reserve * (S - 1) * head_dim * bits / 8.
    Only key/value heads are cached: n_kv_heads < n_heads with grouped-query
    attention (SmolLM2: 3 of 9), equal for multi-head attention.

    Llama-7B (multi-head: 32 layers, 32 KV heads, D=128, S=2048, 16 bits): 2,146,435,072 bytes;
    with reserve 1.5, i.e. S-1 + (S-1)/2 rows, 1,609,826,304 bytes (half rows
    allowed, as in the note: the total is still a whole number of bytes).
    """
    return exercise("2.3")(n_layers, n_kv_heads, head_dim, max_seq_len, bits, reserve)


# --------------------------------------------------------------------------- arithmetic intensity

@shortcut("3.1",
          ships="2BDF, the count lesson 03 states before Exercise 3.1 asks for the ratio")
def matmul_flops(B: int, D: int, F: int) -> int:
    """FLOPs of a [B, D] x [D, F] matmul: 2 * B * D * F (a multiply and an add per term)."""
    return 2 * B * D * F


@shortcut("3.1",
          ships="BD + DF + BF values, the traffic lesson 03 states before Exercise 3.1")
def matmul_bytes(B: int, D: int, F: int, bytes_per_value: float = 2) -> float:
    """Bytes a [B, D] x [D, F] matmul moves: read both inputs, write the [B, F] output."""
    return bytes_per_value * (B * D + D * F + B * F)


@answer("3.1", "The intensity of a matmul")
def matmul_intensity(B: int, D: int, F: int, bytes_per_value: float = 2) -> float:
    """FLOPs per byte of a [B, D] x [D, F] matmul; about B in bf16 when B << D, F."""
    return exercise("3.1")(B, D, F, bytes_per_value)


@shortcut("3.2",
          ships="the count lesson 03 states before Exercise 3.2")
def attention_flops(S: int, T: int, head_dim: int, batch: int = 1, *, group: int = 1) -> int:
    """FLOPs of attention of ``group`` query heads sharing one K/V head, T queries over S keys each.

    2BGSTD for QK^T plus 2BGSTD for the weights times V (group=1: one head).
    Counts every query-key pair (dense); a causal prefill needs only about half.
    """
    return 4 * batch * group * S * T * head_dim


@shortcut("3.2",
          ships="the traffic lesson 03 states before Exercise 3.2, with GQA and the dense kernel's scores besides")
def attention_bytes(S: int, T: int, head_dim: int, bytes_per_value: float = 2, batch: int = 1, *,
                    group: int = 1, kernel: str = "fused") -> float:
    """Bytes one K/V head's attention moves for its ``group`` query heads (1: plain multi-head attention).

    "fused" (flash-style: the S x T scores stay in on-chip memory): read Q
    [B, G*T, D], K and V [B, S, D] once, write the output [B, G*T, D]:
    bytes_per_value * B * D * (2S + 2GT). Sharing K and V among the G query
    heads (GQA) is what keeps their bytes from growing with G.
    "dense" (score matrix materialised, toyllm's default kernel): the same
    plus writing and reading back the G*T x S scores once, 2GTS values; a
    real dense kernel makes more passes (mask, softmax), so this is a floor.
    """
    if kernel not in ("fused", "dense"):
        raise ValueError(f"kernel must be 'fused' or 'dense', got {kernel!r}")
    if min(S, T, head_dim, batch, group) < 1:
        raise ValueError(f"S, T, head_dim, batch and group must be at least 1, got S={S}, T={T}, "
                         f"head_dim={head_dim}, batch={batch}, group={group}")
    values = head_dim * (2 * S + 2 * group * T)
    if kernel == "dense":
        values += 2 * group * T * S
    return bytes_per_value * batch * values


@shortcut("3.2",
          ships="the ratio of the two counts above, for any GQA group and kernel; lesson 03 states ST/(S+T) before "
                "Exercise 3.2")
def attention_intensity(S: int, T: int, head_dim: int | None = None, *, group: int = 1, kernel: str = "fused",
                        bytes_per_value: float = 2) -> float:
    """FLOPs per byte of attention, T queries over S keys, ``group`` query heads per K/V head.

    Defaults (fused kernel, 16-bit, one query head per K/V head):
    4STD / (4SD + 4TD) = S*T / (S+T); head_dim cancels and may be left out.
    Prefill (S = T): T/2, grows with the prompt. Decode (T = 1, S large):
    about 1, memory-bound however long the context. With GQA the G query
    heads reuse every K/V byte: about G in decode, 2GST / (bytes_per_value (S + GT)) in general.
    kernel="dense" also counts the score matrix (head_dim required): about
    head_dim (in 16-bit) once T and S are much larger than head_dim, whatever the prompt length.
    """
    if S < 1 or T < 1:
        raise ValueError(f"S (keys) and T (queries) must be at least 1, got S={S}, T={T}")
    if kernel == "dense" and head_dim is None:
        raise ValueError("kernel='dense' needs head_dim: the score matrix's bytes do not cancel against it")
    D = 1 if head_dim is None else head_dim                               # cancels for the fused kernel
    return (attention_flops(S, T, D, group=group)
            / attention_bytes(S, T, D, bytes_per_value, group=group, kernel=kernel))


def critical_intensity(peak_flops: float, bandwidth_bytes_per_s: float) -> float:
    """The hardware's FLOPs per byte: above it an operation is compute-bound (TPU v5e bf16: about 240)."""
    return peak_flops / bandwidth_bytes_per_s


def crossing_batch(D: int, F: int, peak_flops: float, bandwidth_bytes_per_s: float,
                   bytes_per_value: float = 2) -> int | None:
    """Smallest B (tokens per step) at which a [B, D] x [D, F] matmul is compute-bound, or None if never.

    Solves 2BDF / (bytes_per_value (BD + DF + BF)) >= peak / bandwidth for B.
    The rule "intensity is about B" puts it at the ridge itself (in 16-bit);
    the exact crossing of a finite matmul is a little higher: 257 for
    LLaMA-2-13B's 5120 x 13824 MLP matmul on a TPU v5e (ridge 240), and 124
    for the pop quiz's 8192 x 32768 matmul with int8 weights (ridge 243, one
    byte per value halves the critical batch to about 120).
    """
    ridge = critical_intensity(peak_flops, bandwidth_bytes_per_s)
    spare = 2 * D * F - ridge * bytes_per_value * (D + F)                 # > 0 when large B can get there
    if spare <= 0:
        return None
    return max(1, math.ceil(ridge * bytes_per_value * D * F / spare))


@shortcut("3.4",
          ships="the roofline, max(compute time, memory time), which lesson 03 states and draws before Exercise "
                "3.4")
def roofline_time_s(flops: float, bytes_moved: float, peak_flops: float, bandwidth_bytes_per_s: float) -> float:
    """Lower bound on an operation's time (seconds) if compute and memory traffic overlap perfectly."""
    return max(flops / peak_flops, bytes_moved / bandwidth_bytes_per_s)


# --------------------------------------------------------------------------- model FLOPs

def model_flops_per_token(cfg: ModelConfig, include_head: bool = True) -> int:
    """Matmul FLOPs per token outside attention scores: 2 * (weights the token is multiplied by).

    Projections and MLP of every layer, plus the LM head if ``include_head``.
    The embedding lookup and the norms are not matmuls and are not counted;
    neither is attention over the context, which depends on its length
    (see ``prefill_flops``).
    """
    params = cfg.n_layers * cfg.matmul_params_per_layer
    if include_head:
        params += cfg.vocab_size * cfg.d_model
    return 2 * params


def prefill_flops(cfg: ModelConfig, tokens: int, attention: str = "dense", include_head: bool = True) -> int:
    """Matmul FLOPs of a forward pass over ``tokens`` prompt tokens.

    tokens * model_flops_per_token + per layer and query head 4 * D FLOPs per query-key pair.
    attention="dense" counts all T^2 pairs (toyllm's dense kernel computes
    them and masks afterwards); "causal" only the T(T+1)/2 a query may see.
    With include_head the LM head runs on every position, as
    ``Transformer.forward`` does.
    """
    if attention not in ("dense", "causal"):
        raise ValueError(f"attention must be 'dense' or 'causal', got {attention!r}")
    T = int(tokens)
    if T < 1:
        raise ValueError(f"tokens must be at least 1, got {tokens}")
    pairs = T * T if attention == "dense" else T * (T + 1) // 2
    attn = cfg.n_layers * cfg.n_heads * 4 * cfg.head_dim * pairs
    return T * model_flops_per_token(cfg, include_head) + attn


def param_bytes(cfg: ModelConfig, bytes_per_value: float) -> float:
    """Bytes of all of ``cfg``'s parameters at ``bytes_per_value`` (2 for bf16, 1 for int8)."""
    return cfg.n_params * bytes_per_value


# --------------------------------------------------------------------------- step time and throughput

@answer("3.3", "The memory-bound step time", also=("3.5",))
def min_step_time_s(param_bytes: float, kv_bytes_per_seq: float, batch: int,
                    hbm_bandwidth_bytes_per_s: float) -> float:
    """Lower bound on one decode step (seconds) when it is memory-bound.

    Each step reads every parameter once and every sequence's KV cache once:
    (batch * kv_bytes_per_seq + param_bytes) / bandwidth. Good for small batches.
    """
    return exercise("3.3")(param_bytes, kv_bytes_per_seq, batch, hbm_bandwidth_bytes_per_s)


@answer("3.5", "The decode throughput bound")
def max_throughput_tokens_per_s(param_bytes: float, kv_bytes_per_seq: float, batch: int,
                                hbm_bandwidth_bytes_per_s: float) -> float:
    """Upper bound on decode throughput: batch tokens per minimal step (tokens/s)."""
    return exercise("3.5")(param_bytes, kv_bytes_per_seq, batch, hbm_bandwidth_bytes_per_s)


@answer("3.4", "The decode step time")
def step_time_s(param_bytes: float, kv_bytes_per_seq: float, batch: int, hbm_bandwidth_bytes_per_s: float,
                param_count: float, peak_flops: float) -> float:
    """Decode step time (seconds) once large batches make the matmuls compute-bound.

    Attention reads the KV caches and is always bandwidth-bound:
    batch * kv / bandwidth. The matmuls take the larger of loading the
    weights (param_bytes / bandwidth) and doing the math
    (2 * batch * param_count / peak FLOP/s).
    """
    return exercise("3.4")(param_bytes, kv_bytes_per_seq, batch, hbm_bandwidth_bytes_per_s, param_count, peak_flops)


@shortcut("3.4",
          ships="calls step_time_s, Exercise 3.4's entry: the edition runs the student's answer here")
def pop_quiz_step_times_s(batches=(4, 256)) -> dict[int, float]:
    """The chapter's pop quiz: 30B int8 model, 8192-token contexts, 100 kB/token KV, TPU v5e 4x4.

    Returns seconds per decode step for each batch size, with the general
    formula (which equals the memory-bound one at small batches):
    about 2.5 ms at batch 4 (2.57 exactly) and 21 ms at batch 256.
    """
    q, hw = POP_QUIZ, POP_QUIZ["hardware"]
    kv = q["kv_bytes_per_token"] * q["context"]                           # 819.2 MB per sequence
    return {b: step_time_s(q["param_bytes"], kv, b, hw.total_bandwidth_bytes_per_s,
                           q["param_count"], hw.total_flops) for b in batches}


@answer("3.6", "The largest batch")
def max_batch_size(param_bytes: float, kv_bytes_per_seq: float, hbm_bytes: float) -> int:
    """Most sequences whose KV caches fit in memory next to the parameters (0 if the weights alone do not fit)."""
    return exercise("3.6")(param_bytes, kv_bytes_per_seq, hbm_bytes)


@shortcut("3.3", "3.5", "3.6",
          ships="calls min_step_time_s, Exercise 3.3's entry, for the chapter's table that lesson 03 prints")
def llama2_13b_table(batch_sizes=(1, 8, 16, 32, 64, 240), n_kv_heads: int = 40, rounded: bool = True,
                     hardware: HardwareSpec = TPU_V5E_X8) -> list[dict]:
    """The chapter's LLaMA-2-13B decode table on 8x TPU v5e, one dict per batch size.

    Keys: batch, kv_cache_gb, total_memory_gb (parameters + KV caches),
    fits_in_memory, step_time_ms (memory-bound minimum), throughput_tokens_per_s.
    GB are 1e9 bytes: the chapter labels its columns GiB but computes with
    6.7 GB of KV per 8192-token sequence and 26 GB of bf16 weights (13e9
    parameters), which is what ``rounded=True`` uses to reproduce its digits.
    ``rounded=False`` uses the exact counts instead (6.71 GB and 26.03 GB).
    n_kv_heads=8 gives the chapter's second table, a KV cache five times smaller.
    Memory: 8 x 16 GiB of HBM, so batch 16 fits (133.2 GB < 137.4 GB) and 32 does not.
    """
    if not 1 <= n_kv_heads <= LLAMA2_13B.n_heads or LLAMA2_13B.n_heads % n_kv_heads:
        raise ValueError(f"n_kv_heads must divide {LLAMA2_13B.n_heads}, got {n_kv_heads}")
    if rounded:
        kv = 6.7 * GB * n_kv_heads / LLAMA2_13B.n_kv_heads
        params = 26 * GB
    else:
        cfg = LLAMA2_13B.with_(n_kv_heads=n_kv_heads)
        kv = kv_cache_bytes(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, 8192, bytes_per_value=2)
        params = param_bytes(LLAMA2_13B, 2)
    bw = hardware.total_bandwidth_bytes_per_s
    rows = []
    for b in batch_sizes:
        step = min_step_time_s(params, kv, b, bw)
        rows.append({"batch": b,
                     "kv_cache_gb": b * kv / GB,
                     "total_memory_gb": (b * kv + params) / GB,
                     "fits_in_memory": b * kv + params <= hardware.total_hbm_bytes,
                     "step_time_ms": step * 1e3,
                     "throughput_tokens_per_s": b / step})
    return rows
