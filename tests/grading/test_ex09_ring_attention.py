"""Graded tests of lesson 09 (ex09_ring_attention): 10 points.

9.1 merge 2, 9.2 block_attention 2, 9.3 ring_pass_kv_layer 4, 9.4 ring_traffic 2.
References live here: attention over all the keys at once, written out
from its definition (one softmax, the mask by positions), for the merge and
the block; the one-process forward pass of the tiny model for the engine
runs; the bytes of each pass counted message by message.
"""
import math

import pytest
import torch

from toyllm.grading.expect import equal, raises, tensors_close
from toyllm.grading.references import reference
from toyllm.parallel import ModelSpec
from toyllm.partition import zigzag_chunks
from toyllm.utils import random_prompt

ATOL = 1e-5             # float32 outputs: the same sums in another order


@reference
def attention_over(q, k, v, q_pos, k_pos):
    """(out, lse) of q over all of k, v at once: one softmax, keys after a query's position hidden, H/Hkv groups."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1).double()
    v = v.repeat_interleave(group, dim=1).double()
    scores = torch.einsum("bhtd,bhsd->bhts", q.double(), k) / math.sqrt(q.shape[-1])
    seen = k_pos[None, :] <= q_pos[:, None]                              # (T, S)
    scores = torch.where(seen, scores, torch.tensor(float("-inf"), dtype=torch.float64))
    top = scores.amax(-1, keepdim=True).clamp(min=-1e300)                 # a row that sees nothing: no nan
    mass = torch.exp(scores - top).sum(-1)
    lse = (top.squeeze(-1) + torch.log(mass)).float()
    weights = torch.exp(scores - top) / mass.clamp(min=1e-300)[..., None]
    out = torch.einsum("bhts,bhsd->bhtd", weights, v)
    return out.float(), lse


def tensors(gen, B, H, Hkv, T, S, D):
    q = torch.randn(B, H, T, D, generator=gen)
    k = torch.randn(B, Hkv, S, D, generator=gen)
    v = torch.randn(B, Hkv, S, D, generator=gen)
    return q, k, v


def check_partial(got, want, call):
    if not (isinstance(got, tuple) and len(got) == 2):
        raise AssertionError(f"{call}: expected a pair (out, lse), got {type(got).__name__}")
    out, lse = got
    tensors_close(out, want[0], f"{call}: out", atol=ATOL)
    if not isinstance(lse, torch.Tensor) or lse.shape != want[1].shape:
        raise AssertionError(f"{call}: expected lse of shape {tuple(want[1].shape)}, got "
                             f"{tuple(lse.shape) if isinstance(lse, torch.Tensor) else type(lse).__name__}")
    if torch.isnan(lse).any():
        raise AssertionError(f"{call}: lse holds nan (a row that sees no key has lse -inf)")
    empty = torch.isinf(want[1])
    if not torch.equal(torch.isinf(lse) & (lse < 0), empty):
        raise AssertionError(f"{call}: lse must be -inf exactly for the rows that see no key")
    tensors_close(lse[~empty], want[1][~empty], f"{call}: lse", atol=ATOL)


# --------------------------------------------------------------------------- 9.1

def halves(q, k, v, pos, cut):
    """The partials of q over keys [0, cut) and [cut, S), from the reference."""
    return (attention_over(q, k[..., :cut, :], v[..., :cut, :], pos, pos[:cut]),
            attention_over(q, k[..., cut:, :], v[..., cut:, :], pos, pos[cut:]))


@pytest.mark.exercise("9.1")
@pytest.mark.points(1)
def test_ex9_1_two_halves_merge_into_attention_over_all_keys(ex09, drawn):
    gen = drawn.generator("9.1")
    rng = drawn.rng("9.1")
    for B, H, Hkv, S, D, cut in [(1, 2, 2, 9, 4, 4), (2, 4, 2, 16, 8, 1), (1, 3, 1, rng.randint(3, 24), 8, None)]:
        cut = cut or rng.randint(1, S - 1)
        q, k, v = tensors(gen, B, H, Hkv, S, S, D)
        pos = torch.zeros(S, dtype=torch.long)               # all at one position: every query sees every key
        a, b = halves(q, k, v, pos, cut)
        call = f"merge of the partials over keys [0, {cut}) and [{cut}, {S}) (B={B}, H={H}, D={D}; {drawn})"
        check_partial(ex09.merge(a, b), attention_over(q, k, v, pos, pos), call)
        # the order of the two sides does not matter
        check_partial(ex09.merge(b, a), attention_over(q, k, v, pos, pos), call + ", sides swapped")
    # large scores, a fixed case: every query-key score at least 120 (positive q and k, q scaled by 60), so every
    # lse is in the hundreds, where exp(lse) overflows float32 (above about 88)
    q, k, v = tensors(torch.Generator().manual_seed(91), 1, 2, 2, 8, 8, 4)
    q, k = 60.0 * (q.abs() + 1.0), k.abs() + 1.0
    pos = torch.zeros(8, dtype=torch.long)
    a, b = halves(q, k, v, pos, 3)
    top = float(torch.maximum(a[1], b[1]).max())
    check_partial(ex09.merge(a, b), attention_over(q, k, v, pos, pos),
                  f"merge of partials with large scores (lse up to {top:.0f}: exp(lse) overflows float32)")


@pytest.mark.exercise("9.1")
@pytest.mark.points(1)
def test_ex9_1_a_side_that_saw_nothing_weighs_nothing_and_dtypes_stay(ex09, drawn):
    gen = drawn.generator("9.1/empty")
    q, k, v = tensors(gen, 1, 2, 1, 6, 6, 4)
    pos = torch.arange(6)
    # causal: the first half of the queries see nothing of the second half of the keys
    a, b = halves(q, k, v, pos, 3)
    check_partial(ex09.merge(a, b), attention_over(q, k, v, pos, pos),
                  "merge with rows of lse -inf on one side (queries 0-2 see none of keys 3-5)")
    nothing = (torch.zeros(1, 2, 6, 4), torch.full((1, 2, 6), float("-inf")))
    out, lse = ex09.merge(nothing, nothing)
    if torch.isnan(out).any() or torch.isnan(lse).any():
        raise AssertionError("merge of two partials that saw no key at all: expected out 0 and lse -inf, got nan")
    tensors_close(out, torch.zeros(1, 2, 6, 4), "merge of two partials that saw no key: out", atol=0.0)
    half = (a[0].bfloat16(), a[1]), (b[0].bfloat16(), b[1])
    out, lse = ex09.merge(*half)
    equal(str(out.dtype), "torch.bfloat16", "merge of bfloat16 outputs (float32 lse): the dtype of out")
    equal(str(lse.dtype), "torch.float32", "merge of bfloat16 outputs (float32 lse): the dtype of lse")
    tensors_close(out.float(), attention_over(q, k, v, pos, pos)[0], "merge of bfloat16 outputs: out", atol=2e-2)


# --------------------------------------------------------------------------- 9.2

@pytest.mark.exercise("9.2")
@pytest.mark.points(1)
def test_ex9_2_a_block_before_on_and_across_the_diagonal(ex09, drawn):
    gen = drawn.generator("9.2")
    rng = drawn.rng("9.2")
    start = rng.randint(0, 40)
    cases = [("wholly visible keys", torch.arange(10, 16), torch.arange(0, 7)),
             ("a causal square", torch.arange(5, 12), torch.arange(5, 12)),
             ("keys straddling the queries", torch.arange(8, 14), torch.arange(4, 18)),
             ("a zigzag rank's two runs", torch.cat([torch.arange(0, 4), torch.arange(12, 16)]), torch.arange(2, 14)),
             ("drawn positions", torch.arange(start, start + 9), torch.arange(start + rng.randint(-8, 8),
                                                                             start + 20)[:rng.randint(1, 20)])]
    for name, q_pos, k_pos in cases:
        for H, Hkv in ((2, 2), (4, 2)):
            q, k, v = tensors(gen, 1, H, Hkv, len(q_pos), len(k_pos), 8)
            call = (f"block_attention, {name}: queries at {q_pos.tolist()}, keys at {k_pos.tolist()}, H={H}, "
                    f"Hkv={Hkv} ({drawn})")
            check_partial(ex09.block_attention(q, k, v, q_pos, k_pos), attention_over(q, k, v, q_pos, k_pos), call)


@pytest.mark.exercise("9.2")
@pytest.mark.points(1)
def test_ex9_2_queries_that_see_no_key_get_zero_and_minus_infinity(ex09, drawn):
    gen = drawn.generator("9.2/future")
    q, k, v = tensors(gen, 1, 2, 1, 4, 5, 8)
    q_pos, k_pos = torch.arange(3, 7), torch.arange(5, 10)      # queries 3 and 4 see none of these keys
    check_partial(ex09.block_attention(q, k, v, q_pos, k_pos), attention_over(q, k, v, q_pos, k_pos),
                  f"block_attention, queries at {q_pos.tolist()}, keys at {k_pos.tolist()}")
    future = torch.arange(20, 25)
    out, lse = ex09.block_attention(q, k, v, q_pos, future)
    if torch.isnan(out).any():
        raise AssertionError(f"block_attention, queries at {q_pos.tolist()}, every key in their future (at "
                             f"{future.tolist()}): out holds nan, expected 0")
    tensors_close(out, torch.zeros_like(q), "block_attention with every key in the future: out", atol=0.0)
    if not (torch.isinf(lse) & (lse < 0)).all():
        raise AssertionError("block_attention with every key in the future: expected lse -inf everywhere")
    # bfloat16 queries, keys and values: out in q's dtype, lse in float32 (the merge weighs by it)
    q, k, v = (t.bfloat16() for t in tensors(gen, 1, 2, 1, 4, 8, 8))
    q_pos, k_pos = torch.arange(6, 10), torch.arange(0, 8)
    out, lse = ex09.block_attention(q, k, v, q_pos, k_pos)
    equal(str(out.dtype), "torch.bfloat16", "block_attention of bfloat16 q, k, v: the dtype of out")
    equal(str(lse.dtype), "torch.float32", "block_attention of bfloat16 q, k, v: the dtype of lse")
    want = attention_over(q.float(), k.float(), v.float(), q_pos, k_pos)
    tensors_close(out.float(), want[0], "block_attention of bfloat16 q, k, v: out", atol=2e-2)
    tensors_close(lse, want[1], "block_attention of bfloat16 q, k, v: lse", atol=2e-2)


# --------------------------------------------------------------------------- 9.3

@pytest.mark.engine
@pytest.mark.exercise("9.3")
@pytest.mark.points(1)
@pytest.mark.timeout(180)
def test_ex9_3_two_and_three_ranks_give_equal_logits(ex09, engine_run, drawn):
    engine_run(ex09.ring_pass_kv_layer, "9.3", "ring", 2, [21, 16], seed=9)
    rng = drawn.rng("9.3")
    engine_run(ex09.ring_pass_kv_layer, "9.3", "ring", 3, [rng.randint(1, 20) for _ in range(3)],
               seed=rng.randrange(10 ** 6), note=str(drawn))


@pytest.mark.engine
@pytest.mark.exercise("9.3")
@pytest.mark.points(1)
@pytest.mark.timeout(180)
def test_ex9_3_zigzag_and_the_causal_kernel(ex09, engine_run):
    C = 30
    engine_run(ex09.ring_pass_kv_layer, "9.3", "ring", 3, zigzag_chunks(C, 3), seed=11, balance="zigzag")
    engine_run(ex09.ring_pass_kv_layer, "9.3", "ring", 2, [17, 12], seed=12, spec=ModelSpec("tiny", attention="causal"),
               note="the causal kernel")


@pytest.mark.engine
@pytest.mark.exercise("9.3")
@pytest.mark.points(1)
@pytest.mark.timeout(180)
def test_ex9_3_four_ranks_and_decoding_continues(ex09, engine_run):
    from toyllm import generate

    got, _ = engine_run(ex09.ring_pass_kv_layer, "9.3", "ring", 4, [9, 3, 11, 6], seed=13, decode=5)
    expected = generate(ModelSpec("tiny").build(), random_prompt(29, 256, 13), 5).output_ids
    assert got.decoded == expected, (f"Exercise 9.3, ring_pass_kv_layer, p=4: decoding from the gathered cache gave "
                                     f"{got.decoded}, one process gives {expected}")


@pytest.mark.engine
@pytest.mark.exercise("9.3")
@pytest.mark.points(1)
@pytest.mark.timeout(180)
def test_ex9_3_blocks_wholly_in_the_future_are_skipped(ex09, engine_run):
    """Blocks in a rank's future are skipped, its own never (rank 1 holds one token: its block is on its
    diagonal); each layer sends the block in hand on p - 1 times, each before attending over it."""
    chunks, p = [8, 1, 9], 3
    got, _ = engine_run(ex09.ring_pass_kv_layer, "9.3", "ring", p, chunks, seed=14)
    where = f"Exercise 9.3, ring_pass_kv_layer, p={p}, chunks {chunks}"
    for rank in range(p):
        attended, began, sends = {}, {}, {}
        for e in got.timeline:
            if e["rank"] != rank:
                continue
            if e["kind"] == "compute" and e["label"].startswith("attention over block "):
                origin = int(e["label"].split()[-1])
                attended.setdefault(e["layer"], []).append(origin)
                began[e["layer"], origin] = e["start_s"]
            elif e["kind"] == "send" and e["label"].startswith("ring step "):
                sends.setdefault(e["layer"], []).append((int(e["label"].split()[-1]), e["start_s"]))
        assert attended, f"{where}: rank {rank} never called ring.attend"
        for layer, origins in sorted(attended.items()):
            assert sorted(origins) == list(range(rank + 1)), (
                f"{where}: rank {rank} attended in layer {layer} to "
                f"the blocks of ranks {origins}; it holds the queries of tokens {sum(chunks[:rank])}-"
                f"{sum(chunks[:rank + 1]) - 1}, so it attends to the blocks of ranks 0 to {rank} (its own and those "
                "before it), once each, and skips the blocks wholly in its future without computing them "
                "(ring.attend called once per block it attends to)")
        for layer in sorted(attended):
            steps = sorted(step for step, _ in sends.get(layer, []))
            assert steps == list(range(p - 1)), (
                f"{where}: rank {rank} sent blocks on at ring steps {steps} in layer {layer}; each of the p - 1 = "
                f"{p - 1} first steps sends the block in hand on once (ring.pass_on), the last step sends nothing")
            for step, start in sends[layer]:
                origin = (rank - step) % p
                if (layer, origin) in began and start > began[layer, origin]:
                    raise AssertionError(
                        f"{where}: rank {rank}, layer {layer}, ring step {step}: the block of rank {origin} was sent "
                        "on after attending over it began; send it on first (ring.pass_on), so that it travels "
                        "while you compute, and wait for the next one after")


# --------------------------------------------------------------------------- 9.4

@reference
def traffic_counted(C, N, H, Hkv, D, p, nbytes):
    """Bytes of each pass, message by message (even chunks: each rank's share of the tokens)."""
    kv = q = 0
    for _sender in range(p):
        for _step in range(p - 1):               # every block reaches the p - 1 other ranks
            kv += (N + C) / p * 2 * Hkv * D * nbytes
            q += C / p * H * D * nbytes         # a block of queries out ...
            q += C / p * H * (D + 1) * nbytes   # ... and its partial output with one lse per head back
    kv, q = round(kv), round(q)
    return {"kv": kv, "q": q, "choose": "q" if q < kv else "kv"}


@pytest.mark.exercise("9.4")
@pytest.mark.points(1)
def test_ex9_4_smollm2_cases(ex09):
    # SmolLM2-135M: H = 9 query heads, Hkv = 3, D = 64
    got = ex09.ring_traffic(4096, 0, 9, 3, 64, 2)
    equal(got, {"kv": 4096 * 2 * 3 * 64 * 4, "q": 4096 * (9 * 64 + 9 * 65) * 4, "choose": "kv"},
          "ring_traffic(4096 new, 0 cached, H=9, Hkv=3, D=64, p=2): a whole prompt")
    got = ex09.ring_traffic(128, 8000, 9, 3, 64, 4)
    equal(got, {"kv": 3 * 8128 * 2 * 3 * 64 * 4, "q": 3 * 128 * (9 * 64 + 9 * 65) * 4, "choose": "q"},
          "ring_traffic(128 new, 8000 cached, H=9, Hkv=3, D=64, p=4): a short question after a long conversation")
    equal(ex09.ring_traffic(10, 5, 4, 4, 8, 1), {"kv": 0, "q": 0, "choose": "kv"},
          "ring_traffic on one rank: nothing travels, and a tie chooses kv")


@pytest.mark.exercise("9.4")
@pytest.mark.points(1)
def test_ex9_4_drawn_cases_and_bad_input(ex09, drawn):
    rng = drawn.rng("9.4")
    for _ in range(6):
        p = rng.choice([2, 4, 8])
        C, N = p * rng.randint(1, 2000), p * rng.randint(0, 20000)
        Hkv = rng.choice([1, 2, 4, 8])
        H, D, nbytes = Hkv * rng.choice([1, 2, 4, 8]), rng.choice([32, 64, 128]), rng.choice([2, 4])
        equal(ex09.ring_traffic(C, N, H, Hkv, D, p, nbytes), traffic_counted(C, N, H, Hkv, D, p, nbytes),
              f"ring_traffic({C} new, {N} cached, H={H}, Hkv={Hkv}, D={D}, p={p}, {nbytes} bytes per value; {drawn})")
    for args, why in [((0, 5, 4, 4, 8, 2), "a prompt with no new token"),
                      ((10, -1, 4, 4, 8, 2), "a negative number of cached tokens"),
                      ((10, 5, 4, 4, 8, 0), "a world of no rank"),
                      ((10, 5, 6, 4, 8, 2), "4 K/V heads cannot serve 6 query heads in equal groups"),
                      ((10.5, 5, 4, 4, 8, 2), "a token count that is not an integer")]:
        raises(ValueError, ex09.ring_traffic, *args, call=f"ring_traffic{args}", why=why)
