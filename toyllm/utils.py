"""Small helpers every layer may use: timing, random prompts, streaming text.

This module imports nothing else from toyllm, so anything can import it
without creating a cycle.
"""
from __future__ import annotations

import statistics
import sys
import time

import torch


def median_time(fn, repeats: int = 5, warmup: int = 1) -> tuple[float, list[float]]:
    """Median seconds of ``fn()`` over ``repeats`` runs after ``warmup`` untimed ones, and the runs."""
    for _ in range(warmup):
        fn()
    runs = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - t)
    return statistics.median(runs), runs


def random_prompt(tokens: int, vocab_size: int, seed: int = 0) -> list[int]:
    """``tokens`` random token ids below ``vocab_size``, the same for the same seed (tests, benchmarks, CLI)."""
    return torch.randint(0, vocab_size, (tokens,), generator=torch.Generator().manual_seed(seed)).tolist()


class TextStreamer:
    """An ``on_token`` callback that prints text as tokens arrive.

    It decodes everything so far and prints only what is new, holding back
    an unfinished UTF-8 character (a byte-level token can be half of one).
    """

    def __init__(self, tokenizer, out=None):
        self.tokenizer, self.out = tokenizer, out if out is not None else sys.stdout
        self.ids: list[int] = []
        self.printed = 0     # characters already written

    def __call__(self, token: int) -> None:
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return
        self.out.write(text[self.printed:])
        self.out.flush()
        self.printed = len(text)
