"""TSP and KV-Runahead prefill across real processes (gloo on CPU) vs one process.

Tolerance: float32 logits and caches agree to 1e-4 (the parallel ranks sum
the same products, in a different order only where chunks are concatenated).
"""
import json
import os
import statistics
import subprocess
import sys

import pytest
import torch

from toyllm import generate
from toyllm.launch import WorkerError, WorkerPool, free_port
from toyllm.generation import random_prompt
from toyllm.parallel import LinkModel, ModelSpec, measure_link, parallel_prefill, single_prefill
from toyllm.parallel.link import fit_link
from toyllm.simulate import CostModel
from first_layers import FirstLayers
from workers_for_tests import failing_step, raise_on_rank, rank_info

ATOL = 1e-4
CONTEXT = 37
SPECS = {
    "gqa": ModelSpec("tiny"),                                   # 4 query heads share 2 K/V heads
    "mha": ModelSpec("tiny", overrides=(("n_kv_heads", 4),)),
    "mqa": ModelSpec("tiny", overrides=(("n_kv_heads", 1),)),
}
PARTITIONS = {
    2: [None, [30, 7], [1, 36], [36, 1]],
    3: [None, [20, 1, 16], [1, 1, 35]],
    4: [None, [10, 12, 14, 1], [1, 20, 8, 8]],
}
CASES = [(p, part) for p, parts in PARTITIONS.items() for part in parts]
# The engine's per-layer steps are exercises: TSP is 4.2, overlapped KV-Runahead 5.2, blocking 5.1. In the
# student edition a test marked with what it runs is skipped, naming the exercise, before it starts any work.
TSP, KVR, KVR_BLOCKING = pytest.mark.needs("4.2"), pytest.mark.needs("5.2"), pytest.mark.needs("5.1")
RING = pytest.mark.needs("9.1", "9.2", "9.3")          # ring attention runs the three ring exercises
METHODS = [pytest.param("tsp", marks=TSP), pytest.param("kvr", marks=KVR)]


@pytest.fixture(scope="module")
def pools():
    """One pool per world size, shared by every test in this file (start-up is the slow part).

    A failed task closes a pool for good (``WorkerPool.run``); the next test that asks gets a new one, so a
    test that fails, or is skipped on an unwritten exercise that a worker met, never fails the tests after it.
    """
    made = {}

    def get(p):
        if p not in made or made[p].closed:
            made[p] = WorkerPool(p, timeout_s=120)
        return made[p]

    yield get
    for pool in made.values():
        pool.close()


def _ids(n=CONTEXT, seed=0):
    return random_prompt(n, 256, seed)


@pytest.fixture(scope="module")
def references():
    out = {}
    for name, spec in SPECS.items():
        logits, cache = single_prefill(spec.build(), _ids())
        out[name] = (logits, cache)
    return out


def _assert_matches(result, reference):
    logits, cache = reference
    assert (result.logits - logits).abs().max().item() < ATOL
    assert result.first_token == int(logits.argmax())
    assert result.kv_cache.n_layers == cache.n_layers and result.kv_cache.length == cache.length == CONTEXT
    for (k, v), (k_ref, v_ref) in zip(result.kv_cache, cache):
        assert k.shape == k_ref.shape                       # the whole context: (1, Hkv, C, D)
        assert (k - k_ref).abs().max().item() < ATOL and (v - v_ref).abs().max().item() < ATOL


@pytest.mark.engine
@pytest.mark.timeout(300)
@pytest.mark.parametrize("p, partition", CASES)
@pytest.mark.parametrize("method", METHODS)
def test_parallel_prefill_equals_one_process(pools, references, p, partition, method):
    result = parallel_prefill(SPECS["gqa"], _ids(), method, p, partition, pool=pools(p), return_cache=True)
    _assert_matches(result, references["gqa"])
    assert result.partition == (partition or result.partition) and sum(result.partition) == CONTEXT


@pytest.mark.engine
@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["mha", "mqa"])
@pytest.mark.parametrize("method", METHODS)
def test_parallel_prefill_other_head_layouts(pools, references, kind, method):
    result = parallel_prefill(SPECS[kind], _ids(), method, 3, [5, 20, 12], pool=pools(3), return_cache=True)
    _assert_matches(result, references[kind])


@pytest.mark.engine
@KVR
@KVR_BLOCKING
@pytest.mark.timeout(300)
@pytest.mark.parametrize("p, partition", [(2, [30, 7]), (4, [10, 12, 14, 1])])
def test_blocking_and_async_kvr_agree(pools, p, partition):
    a = parallel_prefill(SPECS["gqa"], _ids(), "kvr", p, partition, overlap=True, pool=pools(p))
    b = parallel_prefill(SPECS["gqa"], _ids(), "kvr", p, partition, overlap=False, pool=pools(p))
    assert torch.equal(a.logits, b.logits)


@pytest.mark.engine
@KVR
@pytest.mark.timeout(300)
@pytest.mark.parametrize("p", [2, 3])
def test_decoding_continues_from_the_kvr_cache(pools, p):
    model = SPECS["gqa"].build()
    expected = generate(model, _ids(), 12).output_ids
    result = parallel_prefill(SPECS["gqa"], _ids(), "kvr", p, pool=pools(p), decode_tokens=12)
    assert result.decoded == expected


@pytest.mark.engine
@TSP
@KVR
@pytest.mark.timeout(300)
def test_timelines_cover_every_rank_and_layer(pools):
    result = parallel_prefill(SPECS["gqa"], _ids(), "kvr", 3, [20, 1, 16], pool=pools(3))
    n_layers = SPECS["gqa"].build().config.n_layers
    by_rank = {r: [e for e in result.timeline if e["rank"] == r] for r in range(3)}
    for rank, events in by_rank.items():
        computed = {e["layer"] for e in events if e["kind"] == "compute" and e["layer"] is not None}
        assert computed == set(range(n_layers))
        assert all(e["end_s"] >= e["start_s"] >= 0 for e in events)
        waits = [e for e in events if e["kind"] == "recv_wait"]
        assert len(waits) == (n_layers if rank > 0 else 0)       # rank 0 never receives
    tsp = parallel_prefill(SPECS["gqa"], _ids(), "tsp", 3, pool=pools(3))
    assert sum(e["kind"] == "allgather" for e in tsp.timeline) == 3 * n_layers


@pytest.mark.engine
@KVR
@pytest.mark.timeout(300)
def test_ttft_is_when_the_last_rank_has_the_first_token(pools):
    """TTFT is the last rank's logits-ready time, as in the simulator and the lessons; not the slowest rank's end.

    Rank 0 holds 7/8 of the prompt: after sending its last layer's K,V it still
    attends and runs the MLP over 448 tokens while rank 1 finishes 64 and
    projects the first token. Only fields of the result are compared, no clock limits.
    """
    spec = ModelSpec("bench")
    result = parallel_prefill(spec, random_prompt(512, spec.config.vocab_size, 3), "kvr", 2, [448, 64],
                              pool=pools(2), repeat=3)
    head = [e for e in result.timeline if e["label"] == "lm_head"]
    assert [e["rank"] for e in head] == [1]                         # only the last rank projects the first token
    assert result.ttft_runs[-1] == head[0]["end_s"]                 # TTFT: the last rank's logits exist
    assert result.ttft_s == statistics.median(result.ttft_runs)
    ends = [max(e["end_s"] for e in result.timeline if e["rank"] == r) for r in range(2)]
    assert result.slowest_rank_runs[-1] >= max(ends)                # every rank's last event is over by then
    assert len(result.slowest_rank_runs) == len(result.ttft_runs) == 3
    assert all(slow >= t for slow, t in zip(result.slowest_rank_runs, result.ttft_runs))
    assert result.slowest_rank_s >= result.ttft_s
    # Rank 0 is still busy when the first token exists (in at least one of three runs): here the two differ.
    assert any(slow > t for slow, t in zip(result.slowest_rank_runs, result.ttft_runs))
    assert result.to_json()["slowest_rank_s"] == result.slowest_rank_s


@pytest.mark.engine
@pytest.mark.timeout(300)
def test_a_one_process_prefill_runs_in_a_one_worker_pool_on_its_threads(pools, references):
    """method="single" with a one-process pool runs there (a benchmark keeps its big scores out of its own
    heap), on the threads asked for, and equals the prefill in this process."""
    with WorkerPool(1, threads_per_rank=2, timeout_s=120) as solo:
        for threads in (1, 2):
            result = parallel_prefill(SPECS["gqa"], _ids(), "single", 1, threads_per_rank=threads, pool=solo,
                                      repeat=2, return_cache=True)
            assert result.method == "single" and result.world_size == 1 and result.threads_per_rank == threads
            assert len(result.ttft_runs) == 2
            _assert_matches(result, references["gqa"])
    with pytest.raises(ValueError, match="method 'single' runs in one process; the pool has 2"):
        parallel_prefill(SPECS["gqa"], _ids(), "single", 1, pool=pools(2))


@pytest.mark.engine
@pytest.mark.timeout(300)
@pytest.mark.parametrize("method", METHODS)
def test_simulated_link_delays_but_does_not_change_results(pools, references, method):
    link = LinkModel(bandwidth_gbps=1e-4, latency_s=1e-3, noisy_link=(0, 1), noise=0.5)   # ~50 ms a message
    result = parallel_prefill(SPECS["gqa"], _ids(), method, 2, pool=pools(2), link=link, return_cache=True)
    _assert_matches(result, references["gqa"])
    assert any(e["kind"] == "link_delay" for e in result.timeline)
    assert result.link["bandwidth_gbps"] == 1e-4


@KVR
@pytest.mark.engine
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_smollm2_kvr_on_two_processes_gives_the_single_process_token(smollm2, pools):
    model, tok = smollm2
    ids = tok.encode_chat("What is the capital of France?")
    ref_logits, _ = single_prefill(model, ids)
    result = parallel_prefill(ModelSpec("smollm2-135m"), ids, "kvr", 2, pool=pools(2), repeat=1, warmup=0,
                              decode_tokens=10)
    assert result.first_token == int(ref_logits.argmax())
    assert (result.logits - ref_logits).abs().max().item() < 1e-3
    assert result.decoded == generate(model, ids, 10).output_ids
    assert "Paris" in tok.decode(result.decoded)


@pytest.mark.parametrize("kwargs, message", [
    (dict(partition=[20, 10]), "covers 30 tokens but the context has 37"),
    (dict(partition=[20, 10, 7]), "3 chunks but the world size is 2"),
    (dict(partition=[37, 0]), "at least one token"),
    (dict(partition=[36.5, 0.5]), "integer"),
    (dict(world_size=0), "world size"),
    (dict(world_size=40), "world size 40 > context 37"),
    (dict(method="mesh"), "unknown method 'mesh'"),
    (dict(backend="mpi"), "backend"),
])
def test_bad_requests_fail_before_any_process_starts(kwargs, message):
    args = dict(method="kvr", world_size=2) | kwargs
    with pytest.raises(ValueError, match=message):
        parallel_prefill(SPECS["gqa"], _ids(), args.pop("method"), args.pop("world_size"), args.pop("partition", None),
                         **args, timeout_s=5)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has GPUs")
def test_nccl_without_gpus_is_rejected():
    with pytest.raises(ValueError, match="nccl"):
        parallel_prefill(SPECS["gqa"], _ids(), "kvr", 2, backend="nccl", timeout_s=5)


@pytest.mark.engine
@pytest.mark.timeout(120)
def test_a_failing_rank_stops_the_run_with_its_traceback():
    import multiprocessing

    before = set(multiprocessing.active_children())             # the shared pools may be running
    with pytest.raises(WorkerError, match="rank 1 gives up") as info:
        parallel_prefill(SPECS["gqa"], _ids(), "kvr", 2, step=failing_step, timeout_s=60)
    assert "Traceback" in info.value.traceback
    assert set(multiprocessing.active_children()) <= before   # none of this run's processes is left


@pytest.mark.engine
@pytest.mark.timeout(120)
def test_a_failed_task_on_a_shared_pool_leaves_the_next_test_a_running_one(pools, tmp_path):
    """A failed task closes its pool for good; the next test still gets a running pool of that size."""
    with pytest.raises(WorkerError, match="deliberate failure on rank 1"):
        pools(2).run(raise_on_rank, (1, str(tmp_path)), timeout_s=60)
    assert not pools(2).closed
    assert pools(2).run(rank_info) and pools(2).world_size == 2


@pytest.mark.engine
@pytest.mark.timeout(180)
@pytest.mark.parametrize("method", [pytest.param("kvr", marks=KVR), pytest.param("ring", marks=RING)])
def test_torchrun_runs_the_same_prefill(method):
    port = free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1",
           f"--master-port={port}", "-m", "toyllm", "prefill", "--model", "tiny", "--context", str(CONTEXT),
           "--method", method, "--partition", "30,7", "--repeat", "1", "--check", "--json"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=150, env=env)
    assert out.returncode == 0, out.stderr
    line = [l for l in out.stdout.splitlines() if l.startswith("{")]
    assert len(line) == 1, out.stdout          # only rank 0 reports
    result = json.loads(line[0])
    assert result["world_size"] == 2 and result["partition"] == [30, 7]
    assert result["max_abs_logit_diff"] < ATOL


# --------------------------------------------------------------------------- TSP balances and attention kernels

from toyllm.attention import ATTENTION_KERNELS  # noqa: E402


@pytest.fixture(scope="module")
def kernel_references():
    """One-process logits and caches with each kernel (they agree to ~1e-6; each method is compared with its own)."""
    return {name: single_prefill(ModelSpec("tiny", attention=name).build(), _ids()) for name in ATTENTION_KERNELS}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("kernel", sorted(ATTENTION_KERNELS))
@pytest.mark.parametrize("p, partition", [(2, [30, 7]), (3, [20, 1, 16]), (4, [10, 12, 14, 1])])
@pytest.mark.parametrize("method, balance", [pytest.param("tsp", balance, marks=TSP) for balance in
                                             ("none", "trim", "zigzag")] + [pytest.param("kvr", "none", marks=KVR)])
@pytest.mark.engine
def test_every_method_and_kernel_equals_one_process(pools, kernel_references, kernel, p, partition, method, balance):
    part = None if balance == "zigzag" else partition          # zigzag lays out its own 2p pieces
    result = parallel_prefill(ModelSpec("tiny", attention=kernel), _ids(), method, p, part, balance=balance,
                              pool=pools(p), return_cache=True, decode_tokens=4)
    _assert_matches(result, kernel_references[kernel])
    assert result.balance == balance and result.attention == kernel
    assert result.decoded[0] == result.first_token and len(result.decoded) == 4


def test_zigzag_gives_each_rank_a_piece_from_each_end():
    from toyllm.parallel.runner import token_layout

    layout = token_layout([10, 10], "zigzag")                   # 20 tokens, 4 pieces of 5
    assert [t.tolist() for t in layout] == [[0, 1, 2, 3, 4, 15, 16, 17, 18, 19], list(range(5, 15))]
    assert [t.tolist() for t in token_layout([3, 4])] == [[0, 1, 2], [3, 4, 5, 6]]


@pytest.mark.parametrize("kwargs, message", [
    (dict(method="tsp", balance="diagonal"), "unknown balance 'diagonal'"),
    (dict(method="kvr", balance="zigzag"), "method 'kvr' takes balance='none'"),
    (dict(method="tsp", balance="zigzag", partition=[30, 7]), "leave the partition out"),
    (dict(method="tsp", balance="zigzag", world_size=19), "more than its 37 tokens"),
])
def test_bad_balances_are_rejected_before_any_process_starts(kwargs, message):
    args = dict(world_size=2) | kwargs
    with pytest.raises(ValueError, match=message):
        parallel_prefill(SPECS["gqa"], _ids(), args.pop("method"), args.pop("world_size"), args.pop("partition", None),
                         **args, timeout_s=5)


def test_unknown_kernels_are_rejected_before_any_process_starts():
    with pytest.raises(ValueError, match="unknown attention kernel 'flash9'"):
        parallel_prefill(ModelSpec("tiny", attention="flash9"), _ids(), "kvr", 2, timeout_s=5)


@TSP
@KVR
@pytest.mark.engine
@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("kernel", ["dense", "sdpa"])
def test_smollm2_long_prompt_every_method_equals_one_process(smollm2, pools, kernel):
    """SmolLM2 at 1024 tokens, p = 2: first token and logits (1e-4) as one process, and decoding continues alike."""
    model, _ = smollm2
    spec = ModelSpec("smollm2-135m", attention=kernel)
    ids = random_prompt(1024, model.config.vocab_size, seed=11)
    ref_logits, ref_cache = single_prefill(spec.build(), ids)
    expected = generate(spec.build(), ids, 6, cache=ref_cache, prefilled_logits=ref_logits).output_ids
    for method, partition, balance in [("tsp", None, "none"), ("tsp", None, "zigzag"), ("kvr", None, "none"),
                                       ("kvr", [600, 424], "none")]:
        r = parallel_prefill(spec, ids, method, 2, partition, balance=balance, pool=pools(2), warmup=0,
                             decode_tokens=6, timeout_s=600)
        diff = (r.logits - ref_logits).abs().max().item()
        assert diff < ATOL, f"{method} {partition or balance} with {kernel}: max |logit diff| {diff:.2e}"
        assert r.first_token == int(ref_logits.argmax()) and r.decoded == expected, (method, balance, kernel)


@KVR
@pytest.mark.engine
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_smollm2_at_its_full_8k_context_with_the_causal_kernel(smollm2_gguf, pools):
    """SmolLM2's whole context, p = 2, KV-Runahead at a causal-aware split: logits (1e-4) and decoding as one process.

    Its first 4 blocks of 30, real weights: what the length puts at stake (positions up to the last of the 8192,
    the second rank's chunk starting at 5730, the causal kernel over spans of thousands, decoding up to
    max_context) is the same in every block, and the whole stack is checked at 1024 tokens above.
    """
    spec = FirstLayers("smollm2-135m", attention="causal", layers=4)    # the whole model is not loaded here
    ids = random_prompt(8192 - 4, spec.config.vocab_size, seed=12)
    ref_logits, ref_cache = single_prefill(spec.build(), ids)
    assert len(spec.build().layers) == ref_cache.n_layers == 4 and spec.config.max_context == 8192
    expected = generate(spec.build(), ids, 4, cache=ref_cache, prefilled_logits=ref_logits).output_ids
    r = parallel_prefill(spec, ids, "kvr", 2, [5730, 8188 - 5730], pool=pools(2), warmup=0, decode_tokens=4,
                         timeout_s=300)
    diff = (r.logits - ref_logits).abs().max().item()
    assert diff < ATOL, f"max |logit diff| {diff:.2e}"
    assert r.first_token == int(ref_logits.argmax()) and r.decoded == expected


# --------------------------------------------------------------------------- the measured link and a cost model fitted to real runs

def test_the_link_fit_recovers_bandwidth_and_latency():
    sizes = [4096 * 4 ** k for k in range(6)]
    bandwidth, latency = fit_link(sizes, [n / 2.5e9 + 40e-6 for n in sizes])
    assert bandwidth == pytest.approx(2.5e9, rel=1e-9) and latency == pytest.approx(40e-6, rel=1e-9)


@pytest.mark.parametrize("sizes, seconds, message", [
    ([4096], [1e-4], "at least two different message sizes"),
    ([4096, 4096], [1e-4, 2e-4], "at least two different message sizes"),
    ([4096, 8192], [1e-4, 0.0], "must be positive"),
    ([4096, 8192], [2e-4, 1e-4], "do not grow with size"),
])
def test_bad_link_samples_are_rejected(sizes, seconds, message):
    with pytest.raises(ValueError, match=message):
        fit_link(sizes, seconds)


@pytest.mark.parametrize("kwargs, message", [
    (dict(sizes_bytes=[4096]), "at least two different sizes"),
    (dict(sizes_bytes=[4096, 4098]), "multiple of 4 bytes"),
    (dict(repeats=0), "repeats must be an integer >= 1"),
])
def test_bad_link_requests_fail_before_any_process_starts(kwargs, message):
    with pytest.raises(ValueError, match=message):
        measure_link(**kwargs)


@pytest.mark.engine
@pytest.mark.timeout(120)
def test_the_link_is_measured_between_two_processes(pools):
    # Sizes far apart, so that a 16 MB message takes milliseconds: on a busy 2-core machine a small
    # message's round trip can wait a millisecond for a core, and with sizes up to 1 MB the medians of
    # three repeats once came out falling with size (a fit with no bandwidth, rightly refused).
    sizes = [4096, 1048576, 16777216]
    m = measure_link(sizes, repeats=3, warmup=1, pool=pools(2), timeout_s=60)
    assert m.sizes_bytes == sizes and [len(r) for r in m.runs_s] == [3, 3, 3]
    assert m.median_s == [statistics.median(r) for r in m.runs_s]
    assert all(t > 0 for r in m.runs_s for t in r)
    assert m.bandwidth_bytes_per_s > 0 and m.latency_s >= 0 and m.backend == "gloo"
    assert m.max_fit_error == pytest.approx(max(abs(m.predict_s(n) - t) / t for n, t in zip(sizes, m.median_s)))
    assert "measured, gloo ping-pong" in m.describe()
    assert CostModel(1e-6, 1e-6, 1e-9).with_(**m.cost_model_fields).link_latency_s == m.latency_s
    with pytest.raises(ValueError, match="at least 2 processes"):
        measure_link(sizes, pool=pools(1))


@pytest.mark.engine
@TSP
@KVR
@pytest.mark.timeout(300)
@pytest.mark.parametrize("kernel, pairs", [("dense", "dense"), ("causal", "causal")])
def test_a_cost_model_is_fitted_to_the_timelines_of_real_runs(pools, kernel, pairs):
    spec = ModelSpec("tiny", attention=kernel)
    runs = [parallel_prefill(spec, _ids(n), method, 2, part, pool=pools(2))
            for n, parts in ((37, [[20, 17], [30, 7]]), (64, [[32, 32], [40, 24]])) for part in parts
            for method in ("tsp", "kvr")]
    cm = CostModel.fit_runs(spec.config, runs, link_bandwidth_bytes_per_s=4e9, link_latency_s=60e-6)
    assert cm.attention_pairs == pairs
    assert (cm.link_bandwidth_bytes_per_s, cm.link_latency_s) == (4e9, 60e-6)
    assert "fitted to 8 real runs' timelines, contexts [37, 64]" in cm.label
    with pytest.raises(ValueError, match="'tsp' \\(balance 'none'\\) and 'kvr' runs"):
        zigzag = parallel_prefill(spec, _ids(), "tsp", 2, balance="zigzag", pool=pools(2))
        CostModel.fit_runs(spec.config, [zigzag], link_bandwidth_bytes_per_s=4e9, link_latency_s=0.0)
