"""Every parallel prefill method on NCCL, one rank per GPU, against one process on a GPU.

The same launcher as the CPU tests (``toyllm.launch.WorkerPool``), with
backend "nccl": rank r runs on GPU r. The model, the prompt and the
tolerance are those of tests/test_parallel.py and tests/test_ring.py
(float32 logits and caches agree to ``ATOL`` = 1e-4); TF32 is off on every
rank and here (``toyllm.gpu_check.strict_float32``), so the GPU's float32
products are as exact as the CPU's. The reference is one process on GPU 0.
"""
import copy

import pytest
import torch

from test_parallel import ATOL
from toyllm import generate
from toyllm.cache import DynamicKVCache
from toyllm.gpu_check import gpu_count, missing_gpus, on_device, rank_setup, strict_float32
from toyllm.launch import WorkerPool
from toyllm.parallel import ModelSpec, parallel_prefill
from toyllm.utils import random_prompt

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(missing_gpus(2) is not None, reason=str(missing_gpus(2)))]

CONTEXT = 37
DECODE = 3                                   # tokens decoded on the GPU from the parallel prefill's cache
WORLD_SIZES = sorted({2, min(gpu_count(), 4)} - {0, 1}) or [2]
TSP, KVR, KVR_BLOCKING = pytest.mark.needs("4.2"), pytest.mark.needs("5.2"), pytest.mark.needs("5.1")
# Every method the engine has, with its variants, as keyword arguments of parallel_prefill.
CASES = [
    pytest.param({"method": "tsp"}, id="tsp", marks=TSP),
    pytest.param({"method": "tsp", "balance": "trim"}, id="tsp-trim", marks=TSP),
    pytest.param({"method": "tsp", "balance": "zigzag"}, id="tsp-zigzag", marks=TSP),
    pytest.param({"method": "kvr"}, id="kvr", marks=KVR),
    pytest.param({"method": "kvr", "overlap": False}, id="kvr-blocking", marks=KVR_BLOCKING),
    pytest.param({"method": "ring"}, id="ring-pass-kv"),
    pytest.param({"method": "ring", "balance": "zigzag"}, id="ring-pass-kv-zigzag"),
    pytest.param({"method": "ring", "ring_pass": "q", "cached": 24}, id="ring-pass-q"),
    pytest.param({"method": "ring", "ring_pass": "q", "cached": 24, "balance": "zigzag"}, id="ring-pass-q-zigzag"),
]


@pytest.fixture(scope="module")
def pools():
    """One NCCL pool per world size, shared by the tests (a failed task closes a pool; the next test gets a new one)."""
    made = {}

    def get(p):
        if p not in made or made[p].closed:
            made[p] = WorkerPool(p, backend="nccl", timeout_s=120)
            made[p].run(rank_setup)                                  # TF32 off on every rank
        return made[p]

    yield get
    for pool in made.values():
        pool.close()


@pytest.fixture(scope="module")
def references():
    """{kernel: (one process's logits, its KV cache, its greedy tokens)} on GPU 0, float32, TF32 off."""
    strict_float32()
    out = {}
    for kernel in ("dense", "causal"):
        model = on_device(copy.deepcopy(ModelSpec("tiny", attention=kernel).build()), "cuda:0")
        ids = random_prompt(CONTEXT, model.config.vocab_size)
        cache = DynamicKVCache(model.config.n_layers)
        logits = model(torch.tensor([ids], device="cuda:0"), input_pos=0, cache=cache, last_only=True)[0, -1]
        out[kernel] = (logits.cpu(), [(k.cpu(), v.cpu()) for k, v in cache], generate(model, ids, DECODE).output_ids)
    return out


@pytest.mark.parametrize("p", WORLD_SIZES)
def test_every_rank_runs_on_its_own_gpu(pools, p):
    devices = [d.split()[0] for d in pools(p).run(rank_setup)]
    assert devices == [f"cuda:{r}" for r in range(p)] and pools(p).backend == "nccl"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("p", WORLD_SIZES)
@pytest.mark.parametrize("kernel", ["dense", "causal"])
@pytest.mark.parametrize("case", CASES)
def test_method_on_nccl_equals_one_process(pools, references, case, kernel, p):
    logits, cache, decoded = references[kernel]
    ids = random_prompt(CONTEXT, 256)
    result = parallel_prefill(ModelSpec("tiny", attention=kernel), ids, world_size=p, pool=pools(p),
                              return_cache=True, decode_tokens=DECODE, **case)
    diff = (result.logits - logits).abs().max().item()
    assert diff < ATOL, f"{case} on {p} GPUs: logits differ from one process by {diff:.3g}"
    assert result.first_token == int(logits.argmax())
    assert result.kv_cache.length == CONTEXT
    for (k, v), (k_ref, v_ref) in zip(result.kv_cache, cache):
        assert k.shape == k_ref.shape
        assert (k - k_ref).abs().max().item() < ATOL and (v - v_ref).abs().max().item() < ATOL
    assert result.decoded == decoded


@KVR
@pytest.mark.timeout(300)
def test_auto_backend_picks_nccl_with_a_gpu_per_rank(references):
    """Without a pool, parallel_prefill starts its own processes; backend "auto" then takes NCCL."""
    result = parallel_prefill(ModelSpec("tiny"), random_prompt(CONTEXT, 256), "kvr", 2, backend="auto", timeout_s=120)
    assert (result.logits - references["dense"][0]).abs().max().item() < ATOL
