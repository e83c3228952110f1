"""Is this machine's GPU ready for the course? What ``make gpu-check`` runs besides the tests of ``tests/gpu``.

``python -m toyllm.gpu_check`` prints the GPUs, the CUDA, driver and NCCL
versions, then times a prefill of the bench model on CUDA: one process on
one GPU, and, with two GPUs or more, every parallel method with one rank
per GPU over NCCL, at a couple of context lengths. The configurations take
turns round by round (``measure.interleaved_runs``), and each is printed as
its median with the fastest and slowest round and its verdict against one
process (``measure.compare``: a rank test, "faster" or "slower" only at
p <= 0.01).

What a run is, on a GPU: every rank leaves a barrier with its GPU idle
(``torch.cuda.synchronize``), runs its part of the prefill, and synchronizes
again; the run takes as long as its slowest rank. CUDA kernels run behind
the Python that launches them, so a clock read without synchronizing
measures the launches, not the work.

``python -m toyllm.gpu_check --probe`` says whether there is a GPU to check
(exit code 0) or why not (exit code 3, one line): the CPU build of PyTorch
that ``requirements.lock`` pins has no CUDA at all.

The helpers the GPU tests share live here too: ``on_device`` (the model on
a device, its linear layers in float32, bfloat16 or float16),
``TOLERANCES`` and ``prefill_logits`` (one process, any device).
"""
from __future__ import annotations

import argparse
import copy
import shutil
import subprocess
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

NO_GPU_EXIT = 3       # --probe's exit code when there is nothing to check
FLOAT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Largest |logit difference| allowed against the CPU's float32 logits of the same model, by the dtype of
# the linear layers on the GPU. float32: the same products summed in another order (cuBLAS against the
# CPU's kernels, TF32 off); on the CPU, float32 against float64 differs by 4.5e-5 for SmolLM2 (logits up
# to 25, 30 layers) and 3e-7 for the bench model, so the limits leave 20x and 300x for the GPU's order.
# bfloat16 keeps 8 bits of mantissa and float16 11: every product's inputs are rounded to them. With the
# same conversion on the CPU (``on_device(model, "cpu", dtype)``) SmolLM2 moved by 0.32 in bfloat16
# (enough to swap its two best first tokens, 0.08 apart) and 0.051 in float16, the bench model by 0.0055
# and 0.00053; the limits leave about three times that for the GPU's own kernels.
TOLERANCES = {
    "smollm2-135m": {"float32": 1e-3, "bfloat16": 1.0, "float16": 0.15},
    "bench": {"float32": 1e-4, "bfloat16": 0.015, "float16": 0.0015},
}


# --------------------------------------------------------------------------- is there a GPU?

def cuda_status() -> str | None:
    """None when CUDA can run here; otherwise why not, in one line."""
    if torch.version.cuda is None:
        return (f"PyTorch {torch.__version__} is a build without CUDA (the lock pins the CPU build; "
                "docs/testing.md, \"GPU check\", says how to install the CUDA build)")
    if not torch.cuda.is_available():
        return f"PyTorch {torch.__version__} has CUDA {torch.version.cuda}, but no CUDA device is visible"
    return None


def gpu_count() -> int:
    return torch.cuda.device_count() if cuda_status() is None else 0


def missing_gpus(n: int = 1) -> str | None:
    """Why a check that needs ``n`` CUDA GPUs cannot run here (a skip's reason), or None when it can."""
    why = cuda_status()
    if why is None and gpu_count() < n:
        why = f"needs {n} CUDA GPUs (one rank per GPU), {gpu_count()} visible"
    return None if why is None else f"no CUDA GPU to test on: {why}"


def _driver_version() -> str:
    """The NVIDIA driver's version, from nvidia-smi where it is installed."""
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=30)
            if out.returncode == 0 and out.stdout.strip():
                return out.stdout.strip().splitlines()[0]
        except (OSError, subprocess.SubprocessError):
            pass
    get = getattr(torch._C, "_cuda_getDriverVersion", None)    # CUDA's own number, e.g. 12040 for 12.4
    if get is not None:
        try:
            v = int(get())
            return f"supports CUDA {v // 1000}.{v % 1000 // 10} (nvidia-smi not found)"
        except (RuntimeError, ValueError):
            pass
    return "unknown"


def describe_gpus() -> list[str]:
    """Lines naming PyTorch, CUDA, cuDNN, NCCL, the driver and every visible GPU."""
    import torch.distributed as dist

    nccl = torch.cuda.nccl.version() if dist.is_nccl_available() else "none"
    nccl = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
    lines = [f"PyTorch {torch.__version__}, CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}, "
             f"NCCL {nccl}, driver {_driver_version()}"]
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        lines.append(f"GPU {i}: {p.name}, {p.total_memory / 2**30:.1f} GiB, compute capability {p.major}.{p.minor}, "
                     f"bfloat16 {'yes' if dtype_supported(torch.bfloat16, i) else 'no'}")
    return lines


def dtype_supported(dtype: torch.dtype, device: int = 0) -> bool:
    """Can this GPU multiply matrices in ``dtype``? (bfloat16 needs compute capability 8.0, Ampere, or later.)"""
    return dtype != torch.bfloat16 or torch.cuda.get_device_capability(device) >= (8, 0)


def strict_float32() -> None:
    """float32 products in full float32: no TF32 (10-bit mantissa) in cuBLAS matmuls or cuDNN.

    PyTorch leaves TF32 off for matmuls by default; saying it here keeps the
    comparisons fair whatever an environment or an earlier import set.
    """
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


# --------------------------------------------------------------------------- the model on a device

class CastLinear(nn.Module):
    """A bias-free linear layer whose weight and product are in a lower precision; float32 in and out.

    The same semantics as ``toyllm.quant``'s formats on the CPU: only the
    linear layers change; norms, RoPE, attention, the residual stream and
    the logits stay float32 (RoPE multiplies complex numbers, which PyTorch
    has no bfloat16 type for).
    """

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(weight.detach().to(dtype), requires_grad=False)

    def forward(self, x):
        return F.linear(x.to(self.weight.dtype), self.weight).float()


@torch.no_grad()
def on_device(model: nn.Module, device, dtype: torch.dtype = torch.float32) -> nn.Module:
    """``model`` (changed in place and returned) on ``device``, its linear layers' weights in ``dtype``.

    A tied output projection gets its own copy in ``dtype``; the embedding
    table stays float32.
    """
    if dtype not in FLOAT_DTYPES.values():
        raise ValueError(f"dtype must be one of {list(FLOAT_DTYPES)}, got {dtype}")
    if dtype != torch.float32:
        for module in list(model.modules()):
            for name, child in list(module.named_children()):
                if isinstance(child, nn.Linear):
                    if child.bias is not None:
                        raise ValueError(f"{name} has a bias; only bias-free linear layers are converted")
                    setattr(module, name, CastLinear(child.weight, dtype))
    return model.to(device)


@torch.no_grad()
def prefill_logits(model, ids: list[int]) -> torch.Tensor:
    """One process: the float32 logits (vocab,) at the prompt's last position, on the model's device.

    ``toyllm.parallel.single_prefill`` with the prompt put where the model is.
    """
    from .cache import DynamicKVCache

    device = model.rope_cos.device
    cache = DynamicKVCache(model.config.n_layers)
    return model(torch.tensor([ids], device=device), input_pos=0, cache=cache, last_only=True)[0, -1]


# --------------------------------------------------------------------------- timings

# The parallel configurations timed, as keyword arguments of toyllm.parallel.parallel_prefill.
METHODS = {
    "TSP": {"method": "tsp"},
    "TSP zigzag": {"method": "tsp", "balance": "zigzag"},
    "KVR (even split)": {"method": "kvr"},
    "ring pass-KV": {"method": "ring"},
    "ring pass-KV zigzag": {"method": "ring", "balance": "zigzag"},
}
ONE_PROCESS = "one process"


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _release(device: torch.device) -> None:
    """Give the memory a run cached back to the GPU (after the clock): the one process and rank 0 share GPU 0."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


def rank_setup(ctx) -> str:
    """First task of a timing or test pool: TF32 off, and the device this rank runs on."""
    strict_float32()
    return str(ctx.device) + (f" ({torch.cuda.get_device_name(ctx.device)})" if ctx.device.type == "cuda" else "")


@torch.no_grad()
def timed_prefill(ctx, spec, ids: list[int], method: str, chunks: list[int], options: dict) -> float:
    """Seconds of one run of this rank's part of a parallel prefill, from a common start until its device is idle.

    The worker function of the timings: all ranks leave a barrier with their
    GPU idle, run ``prefill_rank`` once (no warm-up inside), and synchronize.
    """
    import torch.distributed as dist

    from .parallel.runner import prefill_rank

    spec.build().to(ctx.device)               # moved before the clock starts (the model is cached per process)
    _synchronize(ctx.device)
    dist.barrier()
    t0 = time.perf_counter()
    prefill_rank(ctx, spec, ids, method, chunks, warmup=0, repeat=1, **options)
    _synchronize(ctx.device)
    seconds = time.perf_counter() - t0
    _release(ctx.device)
    return seconds


def time_prefills(contexts=(4096, 16384), *, rounds: int = 7, warmup: int = 2, world_size: int | None = None,
                  device: str = "cuda", model: str = "bench", out=sys.stdout) -> dict:
    """Time one process and every method of ``METHODS`` at each context; print the table; return the runs.

    device "cuda": one process on GPU 0, the methods on ``world_size`` GPUs
    (default: every visible GPU, at most 8) over NCCL. device "cpu" runs the
    same code on gloo, to check it on a machine without a GPU.
    Returns {context: {configuration: Spread}}.
    """
    from .launch import WorkerPool
    from .measure import compare, interleaved_runs, spread
    from .parallel import ModelSpec
    from .parallel.runner import check_prefill_request
    from .utils import random_prompt

    spec = ModelSpec(model)
    cuda = device == "cuda"
    if cuda:
        strict_float32()
        world_size = min(torch.cuda.device_count(), 8) if world_size is None else world_size
    else:
        world_size = 2 if world_size is None else world_size
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    single = on_device(copy.deepcopy(spec.build()), dev)    # this process's own copy (the workers build theirs)
    results = {}
    with WorkerPool(world_size, backend="nccl" if cuda else "gloo", timeout_s=1800) if world_size >= 2 \
            else _NoPool() as pool:
        if pool is not None:
            ranks = pool.run(rank_setup)
            print(f"{world_size} ranks, one per device, backend {pool.backend}: " + ", ".join(ranks), file=out)
        else:
            print("one GPU: only the one-process prefill is timed (the methods need 2 GPUs or more)", file=out)
        for C in contexts:
            ids = random_prompt(C, spec.config.vocab_size)

            def one_process() -> float:
                _synchronize(dev)
                t0 = time.perf_counter()
                prefill_logits(single, ids)
                _synchronize(dev)
                seconds = time.perf_counter() - t0
                _release(dev)
                return seconds

            fns = {ONE_PROCESS: one_process}
            if pool is not None:
                for name, options in METHODS.items():
                    options = dict(options)
                    method = options.pop("method")
                    chunks = check_prefill_request(spec, ids, method, world_size, balance=options.get("balance", "none"))
                    fns[name] = _on_pool(pool, spec, ids, method, chunks, options)
            runs = {name: spread(ts) for name, ts in interleaved_runs(fns, rounds, warmup=warmup).items()}
            results[C] = runs
            base = runs[ONE_PROCESS]
            where = f"GPU 0 against {world_size} GPUs" if cuda else f"1 process against {world_size} on {device}"
            print(f"\n{model} model, {C} tokens, {where}; median [fastest-slowest] of {rounds} interleaved "
                  f"rounds after {warmup} warm-up, each run from a common start until every rank's device is idle:",
                  file=out)
            width = max(map(len, runs))
            for name, s in runs.items():
                if name == ONE_PROCESS:
                    tail = "the baseline"
                else:
                    tail = f"{compare(s, base).than} one process"
                print(f"  {name:<{width}}  {str(s):<28}  {tail}", file=out)
            out.flush()
    return results


class _NoPool:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return None


def _on_pool(pool, spec, ids, method, chunks, options):
    def run() -> float:
        return max(pool.run(timed_prefill, (spec, ids, method, chunks, options)))
    return run


# --------------------------------------------------------------------------- command line

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m toyllm.gpu_check",
                                     description="The GPUs, CUDA and driver versions, and CUDA timings of one "
                                                 "process and each parallel prefill method.")
    parser.add_argument("--probe", action="store_true",
                        help=f"only say whether there is a CUDA GPU to check (exit 0) or why not (exit {NO_GPU_EXIT})")
    parser.add_argument("--contexts", default="4096,16384", help="prompt lengths in tokens, comma-separated")
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds (a verdict needs at least 5)")
    parser.add_argument("--world-size", type=int, default=None, help="ranks for the methods (default: every GPU, at most 8)")
    args = parser.parse_args(argv)
    why = cuda_status()
    if why is not None:
        print(f"no CUDA GPU here: {why}; " + ("make gpu-check ran nothing" if args.probe else "nothing timed"))
        return NO_GPU_EXIT
    if args.probe:
        print(f"{torch.cuda.device_count()} CUDA GPU(s): " + ", ".join(
            torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())))
        return 0
    try:
        contexts = tuple(int(c) for c in args.contexts.split(","))
    except ValueError:
        parser.error(f"--contexts must be whole numbers separated by commas, got {args.contexts!r}")
    for line in describe_gpus():
        print(line)
    time_prefills(contexts, rounds=args.rounds, world_size=args.world_size)
    return 0


if __name__ == "__main__":
    sys.exit(main())
