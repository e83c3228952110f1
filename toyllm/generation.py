"""Autoregressive generation, two ways.

``naive``: every step runs the model over the whole sequence so far and keeps
only the last position's logits. Step n costs as much as a prefill of n
tokens, so a whole generation is quadratic in the MLP and cubic in attention.

``cached``: one *prefill* over the prompt fills a KV cache and gives the first
token; then each *decode step* feeds just the newest token and attends over
the cache. Both give the same tokens (the cache only avoids recomputation).

Both take one prompt or a batch of prompts of equal length; a batch moves
through the model as one (B, T) tensor.
"""
from __future__ import annotations

import gc
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from .answers import answer, exercise, shortcut
from .cache import KVCache, make_cache
from .compiled import COMPILE_MODES, compiled_decoder
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


@answer("1.2", "Sampling", also=("1.1",))
def sample_next_token(logits: torch.Tensor, temperature: float = 0.0, top_k: int | None = None,
                      top_p: float | None = None, generator: torch.Generator | None = None) -> int:
    """Pick the next token id from one position's logits (vocab,) (Exercise 1.2).

    temperature 0 is greedy (argmax). Otherwise the logits are divided by the
    temperature, cut to the top_k most likely tokens and then to the smallest
    set whose probability reaches top_p, and one token is drawn.
    """
    return exercise("1.2")(logits, temperature, top_k, top_p, generator)


# at temperature 0 it is the greedy pick of Exercise 1.1
@shortcut("1.1",
          ships="a greedy batch is one torch.argmax, the call lesson 01 names; a sampled row calls "
                "sample_next_token, Exercise 1.2's entry")
def sample_next_tokens(logits: torch.Tensor, temperature: float = 0.0, top_k: int | None = None,
                       top_p: float | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """``sample_next_token`` for a batch: logits (B, vocab) -> token ids (B,), each row on its own.

    Greedy picks are one argmax over the batch; sampled ones draw row by row,
    in order, from the same generator.
    """
    if temperature == 0:
        return torch.argmax(logits, dim=-1)
    return torch.tensor([sample_next_token(row, temperature, top_k, top_p, generator) for row in logits],
                        device=logits.device)


# --------------------------------------------------------------------------- the two building blocks of cached generation

@shortcut("1.3", "2.4",
          ships="one call of the engine's batched prefill; the one-sequence loops of Exercises 1.3 and 2.4 are not "
                "in it")
@torch.no_grad()
def prefill(model, ids: torch.Tensor, cache) -> torch.Tensor:
    """Run prompt ids (1, T) through the model after what ``cache`` holds; returns the last logits (vocab,).

    The new tokens take positions ``cache.length`` onwards, so a prompt can be
    prefilled in several chunks and the result equals one pass over it all.
    """
    return _prefill_batch(model, ids, cache)[0]


def _prefill_batch(model, ids: torch.Tensor, cache) -> torch.Tensor:
    """``prefill`` for prompts ids (B, T): the last logits of each, (B, vocab)."""
    return model(ids, input_pos=cache.length, cache=cache, last_only=True)[:, -1]


@shortcut("1.3", "2.4",
          ships="one call of the engine's batched decode step; the loops of Exercises 1.3 and 2.4 are not in it")
@torch.no_grad()
def decode_step(model, token: int, cache) -> torch.Tensor:
    """Feed one new token at position ``cache.length``; returns its logits (vocab,)."""
    return _decode_batch(model, torch.tensor([[token]], device=model.rope_cos.device), cache)[0]


def _decode_batch(model, tokens: torch.Tensor, cache) -> torch.Tensor:
    """``decode_step`` for one new token per sequence, tokens (B, 1): logits (B, vocab)."""
    return model(tokens, input_pos=cache.length, cache=cache)[:, -1]


# --------------------------------------------------------------------------- the loop

def _as_batch(prompt_ids) -> tuple[torch.Tensor, bool]:
    """(the prompts as one (B, T) tensor of token ids, True if one prompt was given); ValueError for a
    malformed batch. A tensor stays a tensor: 10000 prompts of 50 tokens cost about a tenth of a second
    on their way through Python lists of ints and back."""
    if isinstance(prompt_ids, torch.Tensor):
        if prompt_ids.dim() not in (1, 2):
            raise ValueError(f"prompt_ids as a tensor must be 1-D (one prompt) or 2-D (a batch), "
                             f"got shape {tuple(prompt_ids.shape)}")
        if prompt_ids.is_floating_point() or prompt_ids.is_complex() or prompt_ids.dtype == torch.bool:
            raise ValueError(f"token ids must be integers, got a tensor of dtype {prompt_ids.dtype}")
        if prompt_ids.numel() == 0:
            raise ValueError(f"prompt is empty: prompt_ids has shape {tuple(prompt_ids.shape)}, and every "
                             "prompt needs at least one token")
        return prompt_ids.reshape(-1, prompt_ids.shape[-1]).long(), prompt_ids.dim() == 1
    prompt_ids = list(prompt_ids)
    if len(prompt_ids) == 0:
        raise ValueError("prompt is empty: prompt_ids needs at least one token (or, for a batch, one prompt)")
    nested = [isinstance(p, (list, tuple, torch.Tensor)) for p in prompt_ids]
    if not any(nested):
        return torch.tensor([[int(t) for t in prompt_ids]], dtype=torch.long), True
    if not all(nested):
        raise ValueError("prompt_ids mixes token ids and lists: give one prompt (a list of ints) "
                         "or a batch (a list of lists of ints)")
    batch = [[int(t) for t in p] for p in prompt_ids]
    lengths = sorted({len(p) for p in batch})
    if lengths[0] == 0:
        raise ValueError(f"prompt {[len(p) for p in batch].index(0)} of the batch is empty: "
                         "every prompt in prompt_ids needs at least one token")
    if len(lengths) > 1:
        raise ValueError(f"the prompts in prompt_ids have different lengths {lengths[:5]}: a batch needs "
                         "prompts of equal length (there is no padding); group prompts by length")
    return torch.tensor(batch, dtype=torch.long), False


def _check_request(model, prompts, max_new_tokens, method, cache, prefilled_logits, on_token):
    cfg = model.config
    B, T = prompts.shape
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose one of {list(METHODS)}")
    if on_token is not None and B > 1:
        raise ValueError(f"on_token streams one sequence; this batch has {B} prompts (read the results instead)")
    if prefilled_logits is not None:
        if method != "cached" or isinstance(cache, str) or cache.length == 0:
            raise ValueError("prefilled_logits needs method='cached' and the cache object that holds the prompt")
        if prefilled_logits.shape[-1] != cfg.vocab_size or prefilled_logits.reshape(-1, cfg.vocab_size).shape[0] != B:
            raise ValueError(f"prefilled_logits must have shape ({B}, {cfg.vocab_size}) for {B} prompt(s), "
                             f"got {tuple(prefilled_logits.shape)}")
    if not isinstance(cache, str) and cache.batch_size not in (None, B):
        if cache.length:
            raise ValueError(f"the cache holds {cache.batch_size} sequence(s), but prompt_ids has {B} prompts")
        raise ValueError(f"the {cache.kind} cache was built for batch {cache.batch_size}, but prompt_ids has "
                         f"{B} prompts")
    # tokens already in the cache come before this prompt, unless the prompt is what they are
    held = 0 if isinstance(cache, str) or method == "naive" or prefilled_logits is not None else cache.length
    total = held + T
    if total > cfg.max_context:
        cached = f" ({held} of them already cached)" if held else ""
        raise ValueError(f"prompt has {total} tokens{cached} but max_context is {cfg.max_context}")
    if total + max_new_tokens > cfg.max_context:
        raise ValueError(f"prompt ({total} tokens) + max_new_tokens ({max_new_tokens}) exceeds "
                         f"max_context={cfg.max_context}; ask for at most {cfg.max_context - total} new tokens")
    if not isinstance(cache, str):
        needed = (0 if prefilled_logits is not None else T) + max_new_tokens - 1  # the last token is never fed back
        if needed > cache.free_tokens:
            raise ValueError(f"cache too small: this request needs {needed} free rows but the {cache.kind} cache "
                             f"has {cache.free_tokens}")


@shortcut("1.1", "1.2", "1.3", "2.4",
          ships="the engine's batched loop (caches, stopping, streaming, sampling by sample_next_token); the "
                "exercises write the one-sequence loops")
@torch.inference_mode()
def generate(model, prompt_ids: list[int] | list[list[int]], max_new_tokens: int = 32, *, method: str = "cached",
             cache: str | KVCache = "static", temperature: float = 0.0,
             top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
             eos_id: int | None = None, on_token: Callable[[int], None] | None = None,
             return_logits: bool = False, prefilled_logits: torch.Tensor | None = None,
             compile: bool | str = False) -> GenerationResult | list[GenerationResult]:
    """Generate up to ``max_new_tokens`` tokens after ``prompt_ids``.

    prompt_ids: one prompt (a list of token ids) -> one ``GenerationResult``;
    or a batch, a list of B prompts of equal length -> a list of B results.
    A batch runs as one (B, T) tensor through the model, so each weight read
    from memory serves B tokens at once.
    method: "naive" (recompute the whole prefix each step) or "cached".
    cache: "static" (preallocated, written in place), "dynamic" (grows by
    concatenation) or a cache object (cached method only), for example
    ``DynamicKVCache(n_layers, headroom=4)``; a cache object that already
    holds tokens is continued: the prompt goes after them.
    prefilled_logits: the prompt is already in ``cache`` (for example after a
    parallel prefill) and these are its last position's logits, (vocab,) or
    (B, vocab); generation starts by choosing from them, with no prefill.
    seed: seeds the sampler so sampled runs are reproducible.
    eos_id: a sequence stops after producing this token (a batch runs until
    every sequence has stopped). on_token(id) is called for each new token as
    soon as it exists (streaming; one prompt only).
    compile: True runs the decode steps as one compiled function with fixed
    shapes (``toyllm.compiled``): the same greedy tokens, less time per
    token; the first call for a model compiles (tens of seconds), once per
    batch size and capacity bucket (prompt + new tokens rounded up to the next
    of 64, 96, 128, 192, 256, ...). "ahead" builds that function ahead of time instead
    (``torch.export`` and AOTInductor; weight formats fp32, int8 and int4)
    and keeps it in the cache folder, where the next process loads it
    (``toyllm.compile_cache``). Either needs the
    cached method and the default static cache, and no prefilled_logits.
    It runs in ``torch.inference_mode``, which makes each operator call
    cheaper than under ``no_grad``; the logits it returns are inference
    tensors: read them freely, ``.clone()`` one before writing into it.
    """
    prompts, single = _as_batch(prompt_ids)                        # (B, T)
    _check_request(model, prompts, max_new_tokens, method, cache, prefilled_logits, on_token)
    check_sampling(temperature, top_k, top_p)
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    device = model.rope_cos.device
    B, T = prompts.shape
    t0 = time.perf_counter()
    decoder = None
    if compile is not False:
        if compile not in COMPILE_MODES:
            raise ValueError(f"compile must be False, True (compile when first called) or 'ahead' (torch.export "
                             f"and AOTInductor), got {compile!r}")
        if method != "cached" or cache != "static" or prefilled_logits is not None:
            raise ValueError(f"compile={compile!r} needs method='cached', cache='static' and no prefilled_logits: "
                             "the compiled step keeps its own fixed-size cache")
        decoder = compiled_decoder(model, T + max_new_tokens, batch=B, ahead_of_time=compile == "ahead")
    elif method == "cached" and isinstance(cache, str):
        cache = make_cache(cache, model.config, max(2, T + max_new_tokens), batch=B, device=device)   # where the model is

    # One buffer holds prompt and answer: the naive method reads growing slices of it, the
    # cached one feeds back the newest column; no step allocates its input.
    seq = torch.empty(B, T + max_new_tokens, dtype=torch.long, device=device)   # (B, T + n)
    seq[:, :T] = prompts
    n_out = torch.full((B,), max_new_tokens, dtype=torch.long)   # tokens each sequence keeps (cut after EOS)
    stopped = torch.zeros(B, dtype=torch.bool)
    all_logits, step_times = [], []
    ttft = 0.0
    steps = 0
    for step in range(max_new_tokens):
        t_step = time.perf_counter()
        end = T + step                                              # tokens so far
        if method == "naive":
            logits = model(seq[:, :end], input_pos=0, last_only=True)[:, -1]             # (B, vocab)
        elif decoder is not None:
            logits = decoder.step(seq[:, end - 1:end]) if step > 0 else decoder.prefill(seq[:, :T])
        elif step > 0:
            logits = _decode_batch(model, seq[:, end - 1:end], cache)
        elif prefilled_logits is not None:
            logits = prefilled_logits.reshape(B, -1)
        else:
            logits = _prefill_batch(model, seq[:, :T], cache)
        tokens = sample_next_tokens(logits, temperature, top_k, top_p, gen)            # (B,)
        seq[:, end] = tokens
        step_times.append(time.perf_counter() - t_step)
        if step == 0:
            ttft = time.perf_counter() - t0
        steps = step + 1
        if return_logits:
            all_logits.append(logits.clone())
        if on_token is not None:
            on_token(int(tokens[0]))
        if eos_id is not None:
            hit = (tokens.cpu() == eos_id) & ~stopped
            n_out[hit] = step + 1
            stopped |= hit
            if bool(stopped.all()):
                break
    n_out.clamp_(max=steps)
    return _results(prompts, seq[:, T:], n_out, stopped, ttft, step_times, all_logits if return_logits else None,
                    single)


def _results(prompts, out, n_out, stopped, ttft, step_times, all_logits, single):
    """One ``GenerationResult`` per sequence from the (B, T) prompts and (B, n) outputs.

    The tensors become Python lists in one call each: indexing them per sequence would cost a large
    batch more than its generation loop. Python's cycle collector is paused meanwhile: tens of
    thousands of new lists would set off its passes over every object alive (up to 0.1 s for 10000
    sequences, measured), and they hold no cycles for it to find.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        out, kept, ended = out.tolist(), n_out.tolist(), stopped.tolist()
        results = [GenerationResult(p, out[b][:kept[b]], ttft, list(step_times), ended[b],
                                    [l[b] for l in all_logits[:kept[b]]] if all_logits is not None else None)
                   for b, p in enumerate(prompts.tolist())]
    finally:
        if was_enabled:
            gc.enable()
    return results[0] if single else results
