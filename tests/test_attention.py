"""Every attention kernel equals PyTorch's masked attention in float64 (1e-5), whatever the shapes and positions."""
import pytest
import torch
import torch.nn.functional as F

import toyllm.attention as A
from toyllm import build_model
from toyllm.attention import ATTENTION_KERNELS, attention_with_lse, get_attention, merge_partials

ATOL = 1e-5


def reference(q, k, v, q_pos, k_pos):
    """PyTorch's attention in float64 with the mask spelled out from the positions, K/V heads copied to every
    query head. Not written out by hand: that is Exercise 2.1, and this file ships in the student edition."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    allowed = q_pos[:, None] >= k_pos[None, :]                  # (T, S): a query sees the keys up to its position
    out = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=allowed)
    return out.to(q.dtype)


def case(B, H, Hkv, q_pos, k_pos, D=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, len(q_pos), D, generator=g)
    k, v = (torch.randn(B, Hkv, len(k_pos), D, generator=g) for _ in range(2))
    return q, k, v, torch.as_tensor(q_pos), torch.as_tensor(k_pos)


CASES = {
    "prompt": (1, 4, 4, range(0, 50), range(0, 50)),
    "rectangle": (2, 6, 2, range(300, 520), range(0, 520)),          # a KVR rank: queries after a prefix
    "decode": (1, 6, 1, [700], range(0, 701)),                        # T = 1, multi-query
    "one-token chunk": (1, 4, 2, [33], range(0, 34)),
    "keys not from 0": (1, 4, 2, range(40, 60), range(10, 60)),       # a sliding window's keys
    "queries inside the keys": (1, 4, 4, range(20, 30), range(0, 45)),
    "zigzag rank": (1, 6, 3, [*range(0, 64), *range(448, 512)], range(0, 512)),
    "odd lengths": (2, 2, 1, range(257, 600), range(0, 600)),         # not a multiple of the block size
}


@pytest.mark.parametrize("kernel", sorted(ATTENTION_KERNELS))
@pytest.mark.parametrize("name", sorted(CASES))
def test_every_kernel_equals_the_masked_reference(kernel, name):
    q, k, v, q_pos, k_pos = case(*CASES[name])
    got = get_attention(kernel)(q, k, v, q_pos, k_pos)
    assert got.shape == q.shape
    torch.testing.assert_close(got, reference(q, k, v, q_pos, k_pos), atol=ATOL, rtol=0)


# Small blocks on a small rectangle of the same kind (its lengths no multiple of 7): a Python loop per block.
@pytest.mark.parametrize("block, shape", [(1, (2, 6, 2, range(30, 52), range(0, 52))),
                                          (7, (2, 6, 2, range(30, 52), range(0, 52))),
                                          (64, CASES["rectangle"])], ids=["1", "7", "64"])
def test_blockwise_is_exact_for_any_block_size(block, shape):
    q, k, v, q_pos, k_pos = case(*shape)
    torch.testing.assert_close(A.blockwise_attention(q, k, v, q_pos, k_pos, block=block),
                               reference(q, k, v, q_pos, k_pos), atol=ATOL, rtol=0)


def test_blockwise_skips_the_future_blocks(monkeypatch):
    """Counting the score blocks computed: a causal square of 4 blocks needs 1 + 2 + 3 + 4 of the 16."""
    q, k, v, q_pos, k_pos = case(1, 2, 2, range(0, 64), range(0, 64))
    calls = []
    real = torch.Tensor.amax
    monkeypatch.setattr(torch.Tensor, "amax", lambda self, *a, **kw: calls.append(1) or real(self, *a, **kw))
    A.blockwise_attention(q, k, v, q_pos, k_pos, block=16)
    assert len(calls) == 10


def test_lse_route_and_its_fallback_agree(monkeypatch):
    q, k, v, *_ = case(2, 3, 3, range(0, 20), range(0, 20))
    fused = attention_with_lse(q, k, v, causal=True)
    monkeypatch.setattr(A, "_flash_cpu", lambda *a: (_ for _ in ()).throw(RuntimeError("no such op")))
    plain = attention_with_lse(q, k, v, causal=True)
    for a, b in zip(fused, plain):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=0)


def test_lse_route_without_the_private_op(monkeypatch):
    """A torch without the private op takes the plain route, and the causal kernel still matches."""
    q, k, v, q_pos, k_pos = case(*CASES["rectangle"])
    monkeypatch.setattr(A, "_FLASH_CPU_OP", None)
    monkeypatch.setattr(A, "_flash_cpu", lambda *a: pytest.fail("the private op was called"))
    torch.testing.assert_close(A.causal_attention(q, k, v, q_pos, k_pos), reference(q, k, v, q_pos, k_pos),
                               atol=ATOL, rtol=0)


def test_merging_two_key_sets_equals_attention_over_both():
    q, k, v, *_ = case(1, 2, 2, range(0, 5), range(0, 30))
    first, second = attention_with_lse(q, k[..., :12, :], v[..., :12, :]), attention_with_lse(q, k[..., 12:, :], v[..., 12:, :])
    merged = merge_partials(*first, *second)
    torch.testing.assert_close(merged, attention_with_lse(q, k, v)[0], atol=ATOL, rtol=0)


def test_the_causal_kernel_falls_back_to_blockwise_for_other_layouts(monkeypatch):
    seen = []
    monkeypatch.setattr(A, "blockwise_attention", lambda *a, **kw: seen.append(1) or reference(*a))
    A.causal_attention(*case(*CASES["zigzag rank"]))                 # two runs, each a prefix + square
    A.causal_attention(*case(*CASES["rectangle"]))
    A.causal_attention(*case(*CASES["queries inside the keys"]))      # later keys dropped, then prefix + square
    assert seen == []
    A.causal_attention(*case(1, 2, 2, range(0, 10), [0, 1, 2, 5, 6, 7, 8, 9, 11, 12]))   # keys with gaps
    assert seen == [1]


@pytest.mark.parametrize("kernel", sorted(ATTENTION_KERNELS))
def test_the_tiny_model_gives_the_same_logits_with_every_kernel(kernel):
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(1))
    dense = build_model("tiny")(ids)
    model = build_model("tiny")
    model.set_attention(kernel)
    torch.testing.assert_close(model(ids), dense, atol=ATOL, rtol=0)


def test_kernels_that_skip_masked_work_say_so():
    assert {n for n, f in ATTENTION_KERNELS.items() if getattr(f, "skips_masked", False)} == {"blockwise", "causal"}


def test_an_unknown_kernel_lists_the_choices():
    with pytest.raises(ValueError, match=r"unknown attention kernel 'flash9'; choose one of \['blockwise', 'causal'"):
        get_attention("flash9")


def test_the_attention_benchmark_has_a_row_per_shape():
    from toyllm.bench import ATTENTION_BENCH_KERNELS, ATTENTION_BENCH_SPLITS, bench_attention, render_section

    data = bench_attention(contexts=(64, 96), repeats=1)
    text = render_section("attention", data)
    rows = [line for line in text.splitlines() if line.startswith("| 64 |") or line.startswith("| 96 |")]
    assert len(rows) == 2 * (1 + 2 * len(ATTENTION_BENCH_SPLITS))   # the square, then rank 0 and rank 1 per split
    assert "| 96 | split 68: rank 1, rectangle |" in text             # round(0.707 * 96) = 68
    assert all(t > 0 for c in data["contexts"] for sp in c["splits"] for t in sp["rank1"].values())
    assert set(data["contexts"][0]["square"]) == {*ATTENTION_BENCH_KERNELS, "sdpa_2_threads"}
    assert "- C = 96: one process with sdpa's causal kernel takes" in text


def test_positions_with_a_repeat_are_not_taken_for_a_contiguous_run():
    assert A._contiguous(torch.arange(3, 9)) and A._contiguous(torch.tensor([7]))
    assert not A._contiguous(torch.tensor([0, 2, 2])) and not A._contiguous(torch.tensor([], dtype=torch.long))


@pytest.mark.needs("2.1")          # the dense kernel (until 2.1 is written, models run sdpa)
def test_a_forward_pass_looks_up_the_dense_answer_once_with_the_same_logits(monkeypatch):
    """The model binds Exercise 2.1 once per forward pass (``for_one_pass``), not once per layer,
    and gets exactly the logits of the dense kernel looked up layer by layer."""
    model = build_model("tiny", seed=3, attention="dense")
    ids = torch.tensor([[5, 7, 11, 13, 17, 19]])
    real, lookups = A.exercise, []
    monkeypatch.setattr(A, "exercise", lambda number: (lookups.append(number), real(number))[1])
    got = model(ids)
    assert lookups == ["2.1"]
    monkeypatch.setattr("toyllm.model.for_one_pass", lambda kernel: kernel)      # the kernel as it is
    lookups.clear()
    expected = model(ids)
    assert lookups == ["2.1"] * model.config.n_layers and model.config.n_layers > 1
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert A.for_one_pass(A.sdpa_attention) is A.sdpa_attention
    # under torch.compile the lookup stays inside each call, where the compiler copes with it
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert A.for_one_pass(A.dense_attention) is A.dense_attention
