"""Autoregressive generation, two ways.

``naive``: every step runs the model over the whole sequence so far and keeps
only the last position's logits. Step n costs as much as a prefill of n
tokens, so a whole generation is quadratic in the MLP and cubic in attention.

``cached``: one *prefill* over the prompt fills a KV cache and gives the first
token; then each *decode step* feeds just the newest token and attends over
the cache. Both give the same tokens (the cache only avoids recomputation).
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from .cache import DynamicKVCache, StaticKVCache, make_cache
from .utils import random_prompt  # noqa: F401  (re-exported: tests and lessons use it from here)

METHODS = ("naive", "cached")


@dataclass
class GenerationResult:
    prompt_ids: list[int]
    output_ids: list[int]                       # the new tokens only
    ttft_s: float                               # seconds from the call to the first new token
    step_times_s: list[float]                   # seconds per new token, the first one included
    stopped_on_eos: bool = False
    logits: list[torch.Tensor] | None = field(default=None, repr=False)  # (vocab,) that chose each token

    @property
    def tpot_s(self) -> float:
        """Median seconds per output token after the first (0 if there is none)."""
        rest = self.step_times_s[1:]
        return statistics.median(rest) if rest else 0.0

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids


# --------------------------------------------------------------------------- choosing the next token

def check_sampling(temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None) -> None:
    """Raise a ValueError naming the bad sampling parameter and its allowed range."""
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature must be a finite number >= 0 (0 means greedy), got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be a positive integer or None, got {top_k}")
    if top_p is not None and not (isinstance(top_p, (int, float)) and 0.0 < top_p <= 1.0):
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


def sample_next_token(logits: torch.Tensor, temperature: float = 0.0, top_k: int | None = None,
                      top_p: float | None = None, generator: torch.Generator | None = None) -> int:
    """Pick the next token id from one position's logits (vocab,).

    temperature 0 is greedy (argmax). Otherwise the logits are divided by the
    temperature, cut to the top_k most likely tokens and then to the smallest
    set whose probability reaches top_p, and one token is drawn.
    """
    check_sampling(temperature, top_k, top_p)
    if temperature == 0:
        return int(torch.argmax(logits))
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        # drop a token when the ones before it already reach top_p (the top one always stays)
        drop = (cum - torch.softmax(sorted_logits, dim=-1)) >= top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


# --------------------------------------------------------------------------- the two building blocks of cached generation

@torch.no_grad()
def prefill(model, ids: torch.Tensor, cache) -> torch.Tensor:
    """Run prompt ids (1, T) through the model after what ``cache`` holds; returns the last logits (vocab,).

    The new tokens take positions ``cache.length`` onwards, so a prompt can be
    prefilled in several chunks and the result equals one pass over it all.
    """
    return model(ids, input_pos=cache.length, cache=cache, last_only=True)[0, -1]


@torch.no_grad()
def decode_step(model, token: int, cache) -> torch.Tensor:
    """Feed one new token at position ``cache.length``; returns its logits (vocab,)."""
    ids = torch.tensor([[token]], device=model.rope_cos.device)
    return model(ids, input_pos=cache.length, cache=cache)[0, -1]


# --------------------------------------------------------------------------- the loop

def _check_request(model, prompt_ids, max_new_tokens, method, cache, prefilled_logits):
    cfg = model.config
    if len(prompt_ids) == 0:
        raise ValueError("prompt is empty: give at least one token")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose one of {list(METHODS)}")
    if prefilled_logits is not None and (method != "cached" or isinstance(cache, str) or cache.length == 0):
        raise ValueError("prefilled_logits needs method='cached' and the cache object that holds the prompt")
    # tokens already in the cache come before this prompt, unless the prompt is what they are
    held = 0 if isinstance(cache, str) or method == "naive" or prefilled_logits is not None else cache.length
    total = held + len(prompt_ids)
    if total > cfg.max_context:
        cached = f" ({held} of them already cached)" if held else ""
        raise ValueError(f"prompt has {total} tokens{cached} but max_context is {cfg.max_context}")
    if total + max_new_tokens > cfg.max_context:
        raise ValueError(f"prompt ({total} tokens) + max_new_tokens ({max_new_tokens}) exceeds "
                         f"max_context={cfg.max_context}; ask for at most {cfg.max_context - total} new tokens")
    if isinstance(cache, StaticKVCache):
        needed = (0 if prefilled_logits is not None else len(prompt_ids)) + max_new_tokens - 1  # the last token is never fed back
        if needed > cache.window - cache.length:
            raise ValueError(f"cache too small: this request needs {needed} free rows but the static cache "
                             f"has {cache.window - cache.length} (window S-1 = {cache.window})")


@torch.no_grad()
def generate(model, prompt_ids: list[int], max_new_tokens: int = 32, *, method: str = "cached",
             cache: str | DynamicKVCache | StaticKVCache = "dynamic", temperature: float = 0.0,
             top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
             eos_id: int | None = None, on_token: Callable[[int], None] | None = None,
             return_logits: bool = False, prefilled_logits: torch.Tensor | None = None) -> GenerationResult:
    """Generate up to ``max_new_tokens`` tokens after ``prompt_ids``.

    method: "naive" (recompute the whole prefix each step) or "cached".
    cache: "dynamic", "static" or a cache object (cached method only); a
    cache object that already holds tokens is continued: the prompt goes
    after them.
    prefilled_logits: the prompt is already in ``cache`` (for example after a
    parallel prefill) and these are its last position's logits (vocab,);
    generation starts by choosing from them, with no prefill.
    seed: seeds the sampler so sampled runs are reproducible.
    eos_id: stop after this token is produced. on_token(id) is called for each
    new token as soon as it exists (streaming).
    """
    prompt_ids = [int(t) for t in prompt_ids]
    _check_request(model, prompt_ids, max_new_tokens, method, cache, prefilled_logits)
    check_sampling(temperature, top_k, top_p)
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    device = model.rope_cos.device
    t0 = time.perf_counter()
    if method == "cached" and isinstance(cache, str):
        cache = make_cache(cache, model.config, max(2, len(prompt_ids) + max_new_tokens))

    ids = list(prompt_ids)
    out, all_logits, step_times = [], [], []
    stopped = False
    ttft = 0.0
    for step in range(max_new_tokens):
        t_step = time.perf_counter()
        if method == "naive":
            logits = model(torch.tensor([ids], device=device), last_only=True)[0, -1]
        elif step > 0:
            logits = decode_step(model, ids[-1], cache)
        elif prefilled_logits is not None:
            logits = prefilled_logits
        else:
            logits = prefill(model, torch.tensor([ids], device=device), cache)
        token = sample_next_token(logits, temperature, top_k, top_p, gen)
        step_times.append(time.perf_counter() - t_step)
        if step == 0:
            ttft = time.perf_counter() - t0
        ids.append(token)
        out.append(token)
        if return_logits:
            all_logits.append(logits.clone())
        if on_token is not None:
            on_token(token)
        if eos_id is not None and token == eos_id:
            stopped = True
            break
    return GenerationResult(prompt_ids, out, ttft, step_times, stopped, all_logits if return_logits else None)
