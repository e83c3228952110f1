"""``make gpu-check`` without a GPU, and what of the GPU check can run on a CPU.

The GPU tests themselves (tests/gpu) need CUDA; here they must be collected
and skipped with the reason, and ``make gpu-check`` must say it ran nothing
and exit 0, so the wiring cannot rot unnoticed on machines without a GPU.
The dtype conversion, the timing code (on gloo) and the process group's
backends are checked on the CPU.
"""
import copy
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from toyllm.gpu_check import METHODS, ONE_PROCESS, TOLERANCES, cuda_status, on_device, prefill_logits, time_prefills
from toyllm.launch import process_group_backend
from toyllm.model import build_model
from toyllm.utils import random_prompt

ROOT = Path(__file__).resolve().parents[1]
no_gpu = pytest.mark.skipif(cuda_status() is None, reason="a CUDA GPU is here: make gpu-check runs the GPU tests")


@pytest.mark.engine
@no_gpu
def test_make_gpu_check_without_a_gpu_says_so_and_exits_0():
    # -o setup: the venv running this test is the one to use; never reinstall it from here
    # a make above this test (make -C DIR test) hands its flags down: without them, no "Entering directory" lines
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    out = subprocess.run(["make", "-s", "--no-print-directory", "-o", "setup", "gpu-check", f"PYTHON={sys.executable}"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.startswith("no CUDA GPU here: ") and "make gpu-check ran nothing" in out.stdout
    assert cuda_status() in out.stdout and "passed" not in out.stdout and "skipped" not in out.stdout


@pytest.mark.engine
@no_gpu
@pytest.mark.parametrize("marker", [[], ["-m", "gpu"]], ids=["all", "marked-gpu"])
def test_the_gpu_tests_are_collected_and_skipped_with_the_reason(marker):
    out = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rs", *marker,
                          "tests/gpu"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    summary = out.stdout.strip().splitlines()[-1]
    skipped = re.fullmatch(r"(\d+) skipped in [\d.]+s", summary)
    assert skipped and int(skipped[1]) >= 25, summary                  # every test, none run, none deselected
    reasons = [line for line in out.stdout.splitlines() if line.startswith("SKIPPED")]
    assert reasons and all(f"no CUDA GPU to test on: {cuda_status()}" in line for line in reasons)
    assert {"test_gpu_model.py", "test_gpu_parallel.py"} <= {re.search(r"(test_gpu_\w+\.py)", r)[1] for r in reasons}


def test_without_cuda_the_reason_names_the_build():
    if torch.version.cuda is None:
        assert cuda_status().startswith(f"PyTorch {torch.__version__} is a build without CUDA")


def test_a_nccl_group_sends_cpu_tensors_through_gloo():
    from torch.distributed.distributed_c10d import BackendConfig

    assert process_group_backend("gloo") == "gloo"
    assert BackendConfig(process_group_backend("nccl")).get_device_backend_map() == {"cpu": "gloo", "cuda": "nccl"}


@pytest.mark.parametrize("dtype, name", [(torch.bfloat16, "bfloat16"), (torch.float16, "float16")])
def test_half_precision_linears_on_the_cpu_stay_within_the_tolerance(dtype, name):
    model = build_model("bench")
    ids = random_prompt(300, 256)
    ref = prefill_logits(model, ids)
    half = on_device(copy.deepcopy(model), "cpu", dtype)
    assert {m.weight.dtype for m in half.modules() if hasattr(m, "weight") and m.weight.dim() == 2} == \
        {dtype, torch.float32}                                             # the linears; the embedding stays
    logits = prefill_logits(half, ids)
    assert logits.dtype == torch.float32
    assert 0 < (logits - ref).abs().max().item() <= TOLERANCES["bench"][name]
    assert prefill_logits(on_device(copy.deepcopy(model), "cpu"), ids).equal(ref)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_timings_run_on_gloo():
    out = io.StringIO()
    runs = time_prefills((48,), rounds=1, warmup=0, world_size=2, device="cpu", model="tiny", out=out)
    assert list(runs) == [48] and list(runs[48]) == [ONE_PROCESS, *METHODS]
    text = out.getvalue()
    assert "2 ranks, one per device, backend gloo" in text and "48 tokens" in text
    for name in METHODS:
        assert re.search(rf"  {re.escape(name)} +\S+ ms .*  not comparable \(.*\) with one process", text), text
