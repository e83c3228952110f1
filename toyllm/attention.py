"""Attention kernels: the one function that differs between "dense", "sdpa" and friends.

An attention function takes q (B, H, T, D), k and v (B, H, S, D), the
absolute positions of the queries (T,) and of the keys (S,), and returns
(B, H, T, D).
Query at position p may see keys at positions <= p. The positions make a
kernel correct for any slice of the sequence: a decode step (T = 1), a
parallel rank's chunk, or a whole prompt.

Grouped-query attention: k and v have Hkv <= H heads, each serving H/Hkv
query heads. A kernel marked with ``@handles_gqa`` takes them as they are,
(B, Hkv, S, D), and shares them out without copying; any other function
(yours, for example) gets them copied out to H heads first, by the model.
Copying costs a full read and write of the cache per layer and throws away
what GQA buys in a decode step: every K/V byte read serving H/Hkv queries.

Registered kernels (``ATTENTION_KERNELS``):

- "dense": all of QK^T, then the mask: the kernel the KV-Runahead paper
  counts, c_i * (s_i + c_i) pairs per rank; the default.
- "sdpa": PyTorch's fused kernel; a causal square (``is_causal``) skips
  the masked half, any other shape gets an explicit mask and computes all.
- "blockwise": online softmax over key blocks, future blocks skipped.
- "causal": the fast causal-aware kernel, a rank's rectangle as an unmasked
  prefix plus a causal square, merged by log-sum-exp.

Kernels are registered in ``ATTENTION_KERNELS``; the model, the parallel
engine, the CLI and the lessons pick them by name, and a lesson or exercise
can pass its own function instead.
"""
from __future__ import annotations

import functools
import math
import sys
from typing import Callable

import torch
import torch.nn.functional as F

from .answers import ExerciseNotWritten, answer, exercise, shortcut, written

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def handles_gqa(fn: AttentionFn) -> AttentionFn:
    """Mark a kernel that accepts k, v with fewer heads than q (grouped-query attention)."""
    fn.handles_gqa = True
    return fn


def group_queries(q: torch.Tensor, n_kv_heads: int) -> torch.Tensor:
    """View q (B, H, T, D) as (B, Hkv, G*T, D): the G query heads sharing a K/V head become extra rows.

    A view, not a copy (q is contiguous in heads). Row g*T + t is query head
    kv*G + g at token t, so its position is q_pos[t]: the same mask serves every g.
    """
    B, H, T, D = q.shape
    return q.reshape(B, n_kv_heads, (H // n_kv_heads) * T, D)


def causal_mask(q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """Boolean (T, S) mask: query at position p may see keys at positions <= p.

    Lesson 02 builds its masks with this before Exercise 2.1, which may use
    it too: the exercise is the attention around the mask.
    """
    return k_pos[None, :] <= q_pos[:, None]


@answer("2.1", "The dense attention kernel", "attention_with_offset")
@handles_gqa
def dense_attention(q, k, v, q_pos, k_pos):
    """Textbook attention: every dot product of QK^T, then mask, softmax, times V (Exercise 2.1).

    This is the kernel the KV-Runahead paper counts (c_i * (s_i + c_i) dot
    products per rank), so every method in a comparison uses it by default.
    With grouped-query attention each K/V head is copied out to the query
    heads that share it, as the exercise expects.
    """
    answer_2_1 = _exercise_2_1()
    if answer_2_1 is None:
        return sdpa_attention(q, k, v, q_pos, k_pos)
    return _dense_with(answer_2_1, q, k, v, q_pos, k_pos)


def _exercise_2_1() -> AttentionFn | None:
    """Exercise 2.1's function, or None while it is unwritten where the kernel runs (PyTorch's fused kernel then
    stands in). A model built where 2.1 is written may run where it is not: in the grader's sandbox, whose
    2.1 is the submission's, or in the engine's workers it starts."""
    try:
        return exercise("2.1")
    except ExerciseNotWritten:
        _say_once(_STAND_IN)
        return None


def _dense_with(answer: AttentionFn, q, k, v, q_pos, k_pos):
    """``dense_attention`` with Exercise 2.1's function already looked up (``answer``)."""
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)    # (B, H, S, D)
    return answer(q, k, v, q_pos, k_pos)                                             # (B, H, T, D)


def for_one_pass(kernel: AttentionFn) -> AttentionFn:
    """``kernel`` as one forward pass calls it, layer after layer (the same results, fewer lookups).

    The dense kernel finds Exercise 2.1's function on every call: a lookup
    reads the environment (which edition, which course) and now and then
    stats the file. That is microseconds, and a small model's decode step
    calls the kernel on every layer: on the bench preset, about 35 us of
    a 0.6 ms step (measured). Here it is looked up once for the pass.
    Under ``torch.compile`` the kernel is returned as it is: the compiler
    traces the lookup inside each call (measured: binding it here made
    inductor fail to compile SmolLM2's decode step in float32).
    """
    if kernel is not dense_attention or torch.compiler.is_compiling():
        return kernel
    answer_2_1 = _exercise_2_1()
    if answer_2_1 is None:
        return sdpa_attention
    return handles_gqa(functools.partial(_dense_with, answer_2_1))


@shortcut("2.1",
          ships="one call of PyTorch's fused kernel: Exercise 2.1 writes the scores, the mask and the softmax "
                "itself")
@handles_gqa
def sdpa_attention(q, k, v, q_pos, k_pos):
    """PyTorch's fused kernel. With a plain causal square it may skip the masked half."""
    T, S = q.shape[-2], k.shape[-2]
    gqa = k.shape[1] != q.shape[1]
    if T == S and torch.equal(q_pos, k_pos):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_mask(q_pos, k_pos), enable_gqa=gqa)


ATTENTION_KERNELS: dict[str, AttentionFn] = {"dense": dense_attention, "sdpa": sdpa_attention}


def get_attention(kernel: str | AttentionFn) -> AttentionFn:
    if callable(kernel):
        return kernel
    if kernel not in ATTENTION_KERNELS:
        raise ValueError(f"unknown attention kernel {kernel!r}; choose one of {sorted(ATTENTION_KERNELS)}")
    chosen = ATTENTION_KERNELS[kernel]
    if chosen is dense_attention and not written("2.1"):
        # Lesson 01 comes before Exercise 2.1 (lesson 02): until it is written, models run PyTorch's kernel.
        _say_once(_STAND_IN)
        return sdpa_attention
    return chosen


_said: set[str] = set()
_STAND_IN = ("toyllm: the dense attention kernel is Exercise 2.1 (exercises/ex02_kv_cache.py); until you write it, "
             "models use PyTorch's fused kernel (sdpa), which gives the same results")


def _say_once(message: str) -> None:
    if message not in _said:
        _said.add(message)
        print(message, file=sys.stderr)


# --------------------------------------------------------------------------- kernels that skip masked work
#
# Dense attention computes every query-key pair of its rectangle and masks the
# future afterwards, so half of a causal square is wasted work. The two
# kernels below compute only the pairs a query can see (and a few on the
# diagonal's blocks): "blockwise" in a screen of plain PyTorch, the
# flash-attention idea; "causal" from PyTorch's fused kernels, the fast one.

def skips_masked(fn: AttentionFn) -> AttentionFn:
    """Mark a kernel whose cost is the visible pairs only (the simulator and searches count those)."""
    fn.skips_masked = True
    return fn


@shortcut("2.1",
          ships="online softmax over blocks of keys, a route Exercise 2.1 does not take (it asks for the dense "
                "scores)")
@skips_masked
@handles_gqa
def blockwise_attention(q, k, v, q_pos, k_pos, block: int = 256):
    """Online-softmax attention over blocks of keys, skipping the blocks entirely in the future.

    For each block of queries keep a running max m, a running sum l of
    exp(score - m) and a running weighted sum of values; each key block
    rescales them by exp(m_old - m_new), so no full score row is ever
    stored. A key block whose first position is after the block's last query
    is skipped; one that crosses the diagonal is masked. Positions increase
    along q and k (every caller's do), so a block's ends are its extremes.
    Block size: 128 and 256 were the fastest of 64-512 at 2048-4096 tokens
    (one thread, bench preset shape); at 8192, 256 was faster, so 256 it is.
    """
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    qg = q.view(B, Hkv, H // Hkv, T, D)                                   # (B, Hkv, G, T, D): no copy
    kg, vg = k[:, :, None], v[:, :, None]                                # (B, Hkv, 1, S, D): broadcast over G
    scale = 1.0 / math.sqrt(D)
    out = torch.empty_like(qg)
    k_first = k_pos[::block].tolist()                                   # first and last position of each key block
    k_last = k_pos[block - 1::block].tolist() + ([int(k_pos[-1])] if len(k_pos) % block else [])
    for t0 in range(0, T, block):
        qb, qp = qg[..., t0:t0 + block, :], q_pos[t0:t0 + block]
        q_lo, q_hi = int(qp.min()), int(qp.max())
        m = qb.new_full((*qb.shape[:-1], 1), float("-inf"))
        l = torch.zeros_like(m)
        acc = torch.zeros_like(qb)
        for j, (first, last) in enumerate(zip(k_first, k_last)):
            if first > q_hi:                                             # every key here is in every query's future
                continue
            s0 = j * block
            scores = qb @ kg[..., s0:s0 + block, :].transpose(-2, -1) * scale    # (B, Hkv, G, Tb, Sb)
            if last > q_lo:                                              # the block crosses the diagonal: mask it
                scores.masked_fill_(~causal_mask(qp, k_pos[s0:s0 + block]), float("-inf"))
            m_new = torch.maximum(m, scores.amax(-1, keepdim=True))
            p = scores.sub_(m_new).exp_()                                 # in place: scores are not needed again
            correction = torch.exp(m - m_new)                            # rescale what was summed so far
            l = l * correction + p.sum(-1, keepdim=True)
            acc = acc * correction + p @ vg[..., s0:s0 + block, :]
            m = m_new
        out[..., t0:t0 + block, :] = acc / l
    return out.view(B, H, T, D)


# A private op of PyTorch (no promise it stays), so: looked up once, None where it is missing, and any
# failure of it falls back to plain operations.
_FLASH_CPU_OP = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _flash_cpu(q, k, v, causal: bool):
    """PyTorch's fused CPU kernel, returning the output and the log-sum-exp of each query's scores (B, H, T)."""
    out, lse = _FLASH_CPU_OP(q, k, v, 0.0, causal)[:2]
    return out, lse


def _plain(q, k, v, causal: bool):
    """The same result as ``_flash_cpu`` from plain operations: the fallback and the test reference.

    Written from the log-sum-exp (the weights are exp(score - lse)), not as Exercise 2.1's softmax, so the
    student edition holds no copy of the exercise's lines.
    """
    scores = torch.einsum("bhtd,bhsd->bhts", q, k) * q.shape[-1] ** -0.5      # (B, H, T, S)
    if causal:
        T, S = scores.shape[-2:]
        scores = scores.masked_fill(torch.ones(T, S, dtype=torch.bool, device=scores.device).triu(S - T + 1), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return torch.exp(scores - lse[..., None]) @ v, lse


@shortcut("2.1",
          ships="PyTorch's fused kernels and their log-sum-exps, not Exercise 2.1's dense route")
def attention_with_lse(q, k, v, causal: bool = False):
    """Attention of q (B, H, T, D) over k, v with as many heads, and each row's log-sum-exp (B, H, T).

    Uses PyTorch's private fused CPU op when it is there and the tensors
    suit it; anything else takes the plain route, with the same result.
    """
    if q.device.type == "cpu" and _FLASH_CPU_OP is not None:
        try:
            return _flash_cpu(q, k, v, causal)
        except (RuntimeError, TypeError):
            pass
    return _plain(q, k, v, causal)


@shortcut("9.1",
          ships="a softmax across the stacked log-sum-exps of the causal kernel's two fused calls (lesson 05 "
                "shows it), not the pairwise merge Exercise 9.1 asks for; ring attention merges through merge, "
                "Exercise 9.1's entry")
def merge_partials(out_a, lse_a, out_b, lse_b):
    """Combine attention over two disjoint sets of keys: weight each by its share of the softmax mass.

    The shares are a softmax across the sets' log-sum-exps: set i's share of
    a row's mass is exp(lse_i) / sum_j exp(lse_j). A row that saw no key in
    either set has no mass to share (a softmax over -infs is nan): it gets 0.
    """
    # (2, B, H, T), in float32 at least: a bf16 lse would round the shares coarsely
    lses = torch.stack([lse_a, lse_b]).to(torch.promote_types(lse_a.dtype, torch.float32))
    shares = torch.softmax(lses, dim=0)                                 # (2, B, H, T): sum to 1 down the sets
    shares = torch.where(lses.isneginf().all(dim=0), 0.0, shares)       # no key anywhere: no mass, not nan
    out = (shares[..., None] * torch.stack([out_a, out_b])).sum(dim=0)  # (B, H, T, D)
    return out.to(out_a.dtype)                                          # the LSEs may be float32 for bf16 outputs


def _contiguous(pos: torch.Tensor) -> bool:
    """Positions p, p+1, ..., p+n-1 (every step exactly one)."""
    return len(pos) > 0 and bool((pos.diff() == 1).all())


@shortcut("2.1",
          ships="fused kernels on a prefix and a causal square merged by log-sum-exps, not Exercise 2.1's dense "
                "route")
@skips_masked
@handles_gqa
def causal_attention(q, k, v, q_pos, k_pos):
    """Causal-aware attention from fused kernels: a rank's rectangle as prefix + causal square.

    When the queries are the last T of S contiguous keys (a prompt, a decode
    step, a KV-Runahead rank's chunk over its prefix), the first S - T keys
    are visible to every query (no mask needed) and the last T form a causal
    square; the two fused calls are merged by their log-sum-exps. Queries in
    several runs (a zigzag rank's two pieces) are done run by run, keys after
    the last query are dropped, and any other layout goes to the blockwise kernel.
    """
    T, S = q.shape[-2], k.shape[-2]
    if _contiguous(k_pos) and not _contiguous(q_pos):
        # Queries in several runs (a zigzag rank holds two pieces): each run sees the keys up to its end.
        breaks = [0, *((q_pos[1:] != q_pos[:-1] + 1).nonzero().flatten() + 1).tolist(), T]
        return torch.cat([causal_attention(q[..., a:b, :], k, v, q_pos[a:b], k_pos)
                          for a, b in zip(breaks, breaks[1:])], dim=-2)
    if _contiguous(k_pos) and _contiguous(q_pos) and int(k_pos[0]) <= int(q_pos[0]) and int(q_pos[-1]) < int(k_pos[-1]):
        keep = int(q_pos[-1]) - int(k_pos[0]) + 1                        # keys after the last query are all future
        k, v, k_pos, S = k[..., :keep, :], v[..., :keep, :], k_pos[:keep], keep
    if not (_contiguous(q_pos) and _contiguous(k_pos) and int(q_pos[-1]) == int(k_pos[-1]) and T <= S):
        return blockwise_attention(q, k, v, q_pos, k_pos)
    gqa = k.shape[1] != q.shape[1]
    if T == S:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    if T == 1:                                                          # a decode step sees every key
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
    group = q.shape[1] // k.shape[1]
    B, H, _, D = q.shape
    # Prefix: no mask, so the G query heads sharing a K/V head can ride along as extra rows.
    out_p, lse_p = attention_with_lse(group_queries(q, k.shape[1]), k[..., :S - T, :], v[..., :S - T, :])
    out_p, lse_p = out_p.reshape(B, H, T, D), lse_p.reshape(B, H, T)
    k_sq, v_sq = k[..., S - T:, :], v[..., S - T:, :]
    if group > 1:                                                       # the square is causal: heads must match
        k_sq, v_sq = k_sq.repeat_interleave(group, dim=1), v_sq.repeat_interleave(group, dim=1)
    out_s, lse_s = attention_with_lse(q, k_sq, v_sq, causal=True)
    return merge_partials(out_p, lse_p, out_s, lse_s)


ATTENTION_KERNELS.update(blockwise=blockwise_attention, causal=causal_attention)


# --------------------------------------------------------------------------- attention over one block of keys

# Ring attention (lesson 09) attends a rank's queries to one block of keys at a time and merges the
# partial outputs by their log-sum-exps. The two exercises of that merge and of one block's masked
# attention run inside the engine through the entries below; ``partial_attention`` picks the fused
# kernels where a pair of runs needs no mask.

def runs(pos: torch.Tensor) -> list[tuple[int, int]]:
    """Index ranges [a, b) of the contiguous runs of increasing positions (a zigzag rank has two)."""
    breaks = (torch.nonzero(pos.diff() != 1).flatten() + 1).tolist()
    bounds = [0, *breaks, len(pos)]
    return list(zip(bounds, bounds[1:]))


@answer("9.1", "Ring attention's merge of partial outputs")
def merge(a: tuple, b: tuple) -> tuple:
    """Partials (out, lse) over two disjoint sets of keys as one (out, lse) (Exercise 9.1)."""
    return exercise("9.1")(a, b)


@answer("9.2", "Ring attention's attention over one block", function="block_attention")
def masked_partial(q, k, v, q_pos, k_pos):
    """Attention of q (B, H, T, D) over one block k, v (B, Hkv, S, D), masked by positions: out, lse (Exercise 9.2).

    A query that sees none of these keys gets out 0 and lse -inf, which the merge weighs 0.
    """
    return exercise("9.2")(q, k, v, q_pos, k_pos)


@shortcut("9.2",
          ships="fused kernels for the pairs of runs that need no mask, which Exercise 9.2 does not teach; every "
                "pair that needs one goes to masked_partial, the exercise's entry")
def partial_attention(q, k, v, q_pos, k_pos, skip_masked: bool):
    """Attention of q (B, H, T, D) over one block k, v (B, Hkv, S, D): out (B, H, T, D), lse (B, H, T).

    skip_masked False (the dense kernel): the whole T x S rectangle, then
    the mask (``masked_partial``). True (the causal kernel): run by run, a
    pair of runs wholly in the future is skipped, one wholly in the past is
    attended without a mask by the fused kernel, a causal square (the same
    positions) with it too; anything else is masked. The caller skips a
    block no query sees.
    """
    if not skip_masked:
        return masked_partial(q, k, v, q_pos, k_pos)
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    out = q.new_zeros(B, H, T, D)
    lse = q.new_full((B, H, T), float("-inf"), dtype=torch.float32)
    for a, b in runs(q_pos):
        for c, d in runs(k_pos):
            kp, kr, vr = k_pos[c:d], k[..., c:d, :], v[..., c:d, :]
            # the queries of the run from the first one at or after the first key see some key; the ones
            # before it see none, and when that is all of them the pair costs no dot product at all
            lo = a + int(torch.searchsorted(q_pos[a:b], kp[0]))
            if lo == b:
                continue
            qp, qr = q_pos[lo:b], q[..., lo:b, :]
            if int(kp[-1]) <= int(qp[0]):                                 # every key visible: no mask
                o, l = attention_with_lse(group_queries(qr.contiguous(), Hkv), kr, vr)
                o, l = o.reshape(B, H, b - lo, D), l.reshape(B, H, b - lo)
            elif torch.equal(qp, kp):                                     # a causal square
                group = H // Hkv
                o, l = attention_with_lse(qr, kr.repeat_interleave(group, 1), vr.repeat_interleave(group, 1),
                                          causal=True)
            else:
                o, l = masked_partial(qr, kr, vr, qp, kp)
            out[..., lo:b, :], lse[..., lo:b] = merge((out[..., lo:b, :], lse[..., lo:b]), (o, l))
    return out, lse
