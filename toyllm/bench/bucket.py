"""What a capacity bucket costs: SmolLM2's compiled decode step over exactly n rows vs over its bucket.

A compiled step attends over its whole buffer, masked, at every step
(``toyllm.compiled``), so the rows between the last token and the end of the
bucket still cost a few dot products each. This times both steps in turns:
each round prefills a random prompt of n - steps tokens and then runs
``steps`` decode steps, which end exactly at capacity n, once with the step
built for n rows and once with the one built for ``capacity_bucket(n)``
rows; a round's figure is the median seconds per step. Both steps are
compiled ahead of time and kept in the cache folder.

    python -m toyllm.bench.bucket --weights int4 --tokens 69,300 --rounds 7
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from ..compiled import CompiledDecoder, capacity_bucket
from ..measure import compare


def _step_seconds(decoder: CompiledDecoder, prompt: torch.Tensor, steps: int) -> float:
    """Median seconds of ``steps`` decode steps after ``prompt`` (1, T)."""
    decoder.reset()
    decoder.prefill(prompt)
    token, times = torch.zeros(1, 1, dtype=torch.long), []
    for _ in range(steps):
        t0 = time.perf_counter()
        decoder.step(token)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bucket_cost(weights: str = "int4", tokens=(69,), rounds: int = 7, steps: int = 32, out=print) -> list[dict]:
    """Per n in ``tokens``: seconds per decode step at capacity exactly n and at its bucket, ``rounds``
    rounds in turns; "ratios" are bucket / exact per round, "verdict" is ``measure.compare`` of the two."""
    from ..weights import load_model

    model, _ = load_model("smollm2-135m", weights=weights)
    rows = []
    for n in tokens:
        bucket = capacity_bucket(n, model.config.max_context)
        if n <= steps or bucket == n:
            raise ValueError(f"--tokens {n}: needs more than {steps} tokens and a bucket ({bucket}) above it")
        exact = CompiledDecoder(model, n, ahead_of_time=True)
        rounded = CompiledDecoder(model, bucket, ahead_of_time=True)
        for decoder in (exact, rounded):
            out(f"capacity {decoder.capacity}: {decoder.build().line()}")
        prompt = torch.randint(0, model.config.vocab_size, (1, n - steps), generator=torch.Generator().manual_seed(0))
        _step_seconds(exact, prompt, steps), _step_seconds(rounded, prompt, steps)     # an untimed round
        exact_s, bucket_s = [], []
        for _ in range(rounds):
            exact_s.append(_step_seconds(exact, prompt, steps))
            bucket_s.append(_step_seconds(rounded, prompt, steps))
        ratios = [b / e for b, e in zip(bucket_s, exact_s)]
        row = {"tokens": n, "bucket": bucket, "exact_s": exact_s, "bucket_s": bucket_s, "ratios": ratios,
               "verdict": compare(bucket_s, exact_s)}
        out(f"{weights}, {n} tokens: {1 / statistics.median(exact_s):.1f} tokens/s at capacity {n}, "
            f"{1 / statistics.median(bucket_s):.1f} at capacity {bucket}; bucket / exact per step "
            f"{statistics.median(ratios):.3f} [{min(ratios):.3f}-{max(ratios):.3f}] over {rounds} rounds; "
            + row["verdict"].sentence(f"capacity {bucket}", f"capacity {n}"))
        rows.append(row)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m toyllm.bench.bucket", description=__doc__.splitlines()[0])
    p.add_argument("--weights", default="int4", choices=["fp32", "int8", "int4"])
    p.add_argument("--tokens", default="69", help="capacities n to compare with their buckets, e.g. 69,300")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=32, help="timed decode steps per run, ending at capacity n")
    args = p.parse_args(argv)
    torch.set_grad_enabled(False)
    bucket_cost(args.weights, [int(t) for t in args.tokens.split(",")], args.rounds, args.steps)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
