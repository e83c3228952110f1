"""Ring attention (pass-KV and pass-Q) across real processes (gloo on CPU) vs one process.

Tolerance as for TSP and KVR: float32 logits and caches agree to 1e-4 (the
ranks merge partial outputs by their log-sum-exps, the same sums in
another order).
"""
import pytest
import torch

from test_parallel import ATOL, CONTEXT, SPECS, _assert_matches, _ids, kernel_references, pools  # noqa: F401
from toyllm import generate
from toyllm.cli import main
from toyllm.parallel import ModelSpec, parallel_prefill, ring_traffic, single_prefill
from toyllm.attention import partial_attention

PARTITIONS = {2: [30, 7], 3: [20, 1, 16], 4: [10, 12, 14, 1]}


def _blocks_attended(result, n_layers):
    """{rank: [the origins of the key/value blocks it computed attention over, per layer]}."""
    out = {}
    for e in result.timeline:
        if e["kind"] == "compute" and e["label"].startswith("attention over block "):
            out.setdefault(e["rank"], [[] for _ in range(n_layers)])[e["layer"]].append(int(e["label"].split()[-1]))
    return out


@pytest.mark.engine
@pytest.mark.timeout(600)
@pytest.mark.parametrize("kernel", ["dense", "causal"])
@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("balance", ["none", "zigzag"])
def test_ring_pass_kv_equals_one_process(pools, kernel_references, kernel, p, balance):
    part = PARTITIONS[p] if balance == "none" else None          # zigzag lays out its own 2p pieces
    result = parallel_prefill(ModelSpec("tiny", attention=kernel), _ids(), "ring", p, part, balance=balance,
                              pool=pools(p), return_cache=True)
    _assert_matches(result, kernel_references[kernel])          # logits and the gathered cache
    assert result.method == "ring" and result.ring_pass == "kv" and result.balance == balance
    assert result.context == CONTEXT and result.cached == 0


@pytest.mark.engine
@pytest.mark.timeout(300)
@pytest.mark.parametrize("p", [2, 3, 4])
def test_blocks_in_a_ranks_future_are_skipped(pools, p):
    n_layers = SPECS["gqa"].config.n_layers
    plain = parallel_prefill(SPECS["gqa"], _ids(), "ring", p, pool=pools(p))
    attended = _blocks_attended(plain, n_layers)
    for rank in range(p):            # rank r computes its own block, then those of r-1, ..., 0: r + 1 blocks
        assert attended[rank] == [list(range(rank, -1, -1))] * n_layers
    zigzag = parallel_prefill(SPECS["gqa"], _ids(), "ring", p, balance="zigzag", pool=pools(p))
    attended = _blocks_attended(zigzag, n_layers)
    for rank in range(p):            # a head and a tail piece: part of every block is in the past, p blocks each
        assert attended[rank] == [[(rank - s) % p for s in range(p)]] * n_layers
    sends = [e for e in plain.timeline if e["kind"] == "send" and e["label"].startswith("ring step")]
    assert len(sends) == p * (p - 1) * n_layers          # every block still goes all the way round


@pytest.mark.engine
@pytest.mark.timeout(300)
@pytest.mark.parametrize("p, balance", [(2, "none"), (3, "zigzag")])
def test_decoding_continues_from_the_ring_caches(pools, p, balance):
    expected = generate(SPECS["gqa"].build(), _ids(), 10).output_ids
    result = parallel_prefill(SPECS["gqa"], _ids(), "ring", p, balance=balance, pool=pools(p), decode_tokens=10)
    assert result.decoded == expected


@pytest.mark.timeout(300)
@pytest.mark.parametrize("ring_pass, cached, new, p, balance, kernel", [
    ("q", 25, 12, 2, "none", "dense"),
    ("q", 30, 7, 3, "none", "causal"),
    ("q", 16, 21, 4, "zigzag", "causal"),
    ("q", 29, 8, 2, "zigzag", "dense"),
    ("kv", 25, 12, 2, "none", "dense"),             # pass-KV continuing a cache: the cached tokens travel too
    ("kv", 16, 21, 4, "zigzag", "causal"),
])
@pytest.mark.engine
def test_ring_continuing_a_cache_equals_one_process(pools, ring_pass, cached, new, p, balance, kernel):
    spec = ModelSpec("tiny", attention=kernel)
    ids = _ids(cached + new)
    logits, cache = single_prefill(spec.build(), ids)
    result = parallel_prefill(spec, ids, "ring", p, balance=balance, ring_pass=ring_pass, cached=cached,
                              pool=pools(p), return_cache=True, decode_tokens=3)
    assert (result.logits - logits).abs().max().item() < ATOL
    assert result.ring_pass == ring_pass and result.cached == cached and result.context == cached + new
    assert sum(result.partition) == new
    for (k, v), (k_ref, v_ref) in zip(result.kv_cache, cache):    # the shards, gathered in position order
        assert k.shape == k_ref.shape
        assert (k - k_ref).abs().max().item() < ATOL and (v - v_ref).abs().max().item() < ATOL
    assert result.decoded == generate(spec.build(), ids, 3).output_ids


def test_a_block_in_the_future_gives_nothing_and_a_merge_of_halves_gives_the_whole():
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 6, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    pos = torch.arange(6)
    for skip in (False, True):
        out, lse = partial_attention(q[..., :3, :], k[..., 3:, :], v[..., 3:, :], pos[:3], pos[3:], skip)
        assert torch.equal(out, torch.zeros_like(out)) and torch.isinf(lse).all()   # weighed 0 by the merge


@pytest.mark.parametrize("new, cached, expected", [(4096, 0, "kv"), (64, 8192, "q"), (1024, 1024, "kv")])
def test_the_pass_with_fewer_bytes_is_chosen(new, cached, expected):
    # bench-like heads: 4 K/V heads shared by 16 query heads (GQA), so K and V are a quarter of Q's size
    traffic = ring_traffic(new, cached, n_heads=16, n_kv_heads=4, head_dim=64, world_size=4)
    assert traffic["choose"] == expected and traffic[expected] < traffic["q" if expected == "kv" else "kv"]
    assert ring_traffic(new, 0, 16, 4, 64, world_size=1) == {"kv": 0, "q": 0, "choose": "kv"}


@pytest.mark.parametrize("kwargs, message", [
    (dict(ring_pass="k"), r"unknown ring pass 'k'; choose one of \['kv', 'q'\]"),
    (dict(balance="trim"), r"balance='trim' is not one of ring's \['none', 'zigzag'\]"),
    (dict(ring_pass="q"), "give cached >= 2"),
    (dict(ring_pass="q", cached=1), "give cached >= 2 .* got 1"),
    (dict(ring_pass="q", balance="zigzag", cached=3), "give cached >= 4"),
    (dict(cached=1), "ring_pass='kv' continues tokens already cached on every rank: give cached >= 2"),
    (dict(ring_pass="q", cached=37), "cached=37 leaves no new token of the 37-token prompt"),
    (dict(ring_pass="q", cached=36), r"world size 2 > 1 new tokens \(after 36 cached\)"),
    (dict(ring_pass="q", cached=-1), "cached must be an integer >= 0"),
    (dict(method="kvr", ring_pass="q", cached=10), "method 'kvr' takes neither"),
    (dict(method="tsp", cached=10), "method 'tsp' takes neither"),
])
def test_bad_ring_requests_fail_before_any_process_starts(kwargs, message):
    args = dict(method="ring", world_size=2) | kwargs
    with pytest.raises(ValueError, match=message):
        parallel_prefill(SPECS["gqa"], _ids(), args.pop("method"), args.pop("world_size"), **args, timeout_s=5)


@pytest.mark.parametrize("argv, message", [
    (["--method", "kvr", "--pass", "q"], "--pass q chooses what ring attention sends round: give it with --method "
                                          "ring"),
    (["--method", "kvr", "--cached", "8"], "--cached 8: tokens already cached on the ranks are continued by"),
    (["--method", "ring", "--cached", "1"], "--cached 1: .*give cached >= 2"),
    (["--method", "ring", "--pass", "q"], "--pass q: .*give cached >= 2"),
    (["--method", "ring", "--pass", "q", "--cached", "-2"], "--cached must be a number of tokens >= 0"),
    (["--method", "ring", "--balance", "trim"], "--balance trim: balance='trim' is not one of ring's"),
])
def test_bad_ring_flags_exit_2_with_one_clear_line(capsys, argv, message):
    assert main(["prefill", "--model", "tiny", "--context", "20", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and pytest.importorskip("re").search(message, err)


@pytest.mark.engine
@pytest.mark.needs("9.1", "9.2", "9.3")
@pytest.mark.timeout(180)
@pytest.mark.parametrize("flags", [["--balance", "zigzag"], ["--pass", "q", "--cached", "24"], ["--cached", "24"]])
def test_prefill_ring_on_the_command_line(capsys, flags):
    import json

    argv = ["prefill", "--model", "tiny", "--context", "16", "--method", "ring", "--world-size", "2",
            "--repeat", "1", "--check", "--decode", "3", "--json", *flags]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["method"] == "ring" and out["agrees"] and out["max_abs_logit_diff"] < ATOL
    assert out["decoded"][0] == out["first_token"] and len(out["decoded"]) == 3
    assert out["ring_pass"] == ("q" if "q" in flags else "kv") and out["context"] == 16 + out["cached"]


def test_the_ring_explorer_counts_each_ranks_blocks_as_the_engine_skips_them():
    from toyllm import viz
    from toyllm.widgets import RingExplorer

    view = RingExplorer(context=24, world_size=3, plot=False)
    per_step = []
    for s in range(3):
        view.step.value = s
        per_step.append(view.pairs)
    # contiguous chunks of 8, dense kernel: rank r attends to r + 1 whole 8 x 8 blocks, the rest are skipped
    assert per_step == [[64, 64, 64], [0, 64, 64], [0, 0, 64]] and view.total == [64, 128, 192]
    view.balance.value, view.kernel.value = "zigzag", "causal"
    assert view.total == [100, 100, 100] and sum(view.total) == 24 * 25 // 2   # equal shares of the triangle
    view.world_size.value = 2                                 # the step slider follows the smaller ring
    assert view.step.max == 1 and view.step.value == 1
    with pytest.raises(ValueError, match="steps 0 .. 1"):
        viz.plot_ring_step(12, 2, 2)
