"""Decode-speed measurements and the benchmark sections built on them: weight formats against the
memory-bandwidth floor, the blog's batched toy, and where a decode step's time goes.

SmolLM2's decode tokens/s for each weight format (``toyllm.quant``) beside
lesson 03's roofline: a decode step must read every weight once, so it
takes at least (bytes read per token) / (memory bandwidth) seconds. The
bandwidth is measured here, by copying a buffer much larger than the
caches. ``profile_decode_step`` shows where a step's time goes (the
torch.profiler's count of operator calls and bytes allocated, and the share
spent in the matrix products), and ``compile_trial`` whether torch.compile
makes the step faster. ``python -m toyllm bench --only
weights|batched|decode_step`` writes the tables of docs/benchmarks.md from
these (``bench_weights``, ``bench_batched``, ``bench_decode_step``); the demo
(``toyllm.demo``) prints a short version, and lesson 03 shows the profile.
Formats alternate round by round, so the ratios compare runs made under
the same load.
"""
from __future__ import annotations

import os
import statistics
import sys
import time
from contextlib import contextmanager
from typing import Sequence

import torch

from ..analysis import kv_cache_bytes
from ..cache import make_cache
from ..generation import generate
from ..model import ModelConfig, build_model
from ..measure import compare, interleaved_runs, spread
from ..quant import WEIGHT_FORMATS, linear_kernel, linear_layers, linear_weight_bytes
from ..utils import median_time
from .common import progress
from .generation import time_naive_and_cached
from .llama import LlamaCppError, start_llama

# The toy of the KV-cache blog post: vocabulary 100, width 32, one attention layer with
# one head. Ours is a Llama block, so it also has an MLP (kept as narrow as the width).
BLOG_TOY = ModelConfig(vocab_size=100, d_model=32, n_layers=1, n_heads=1, n_kv_heads=1, head_dim=32,
                       ffn_dim=32, max_context=256)
BLOG_PROMPTS, BLOG_PROMPT_LEN, BLOG_NEW_TOKENS = 10000, 50, 100
# Rows of headroom the experiment also tries on the growing cache: it copies itself every 2, 5 and 17 steps.
BLOG_HEADROOMS = (1, 4, 16)

CHAT_PROMPT = "What is the capital of France?"


@torch.inference_mode()
def window_products(batch: int, keys: int, gaps: Sequence[int], head_dim: int, rounds: int = 5) -> dict:
    """Seconds of one decode step's two attention products (q k^T, then the weights times v) for
    ``batch`` one-head sequences of ``keys`` cached tokens, for each layout in ``gaps``: each sequence's
    rows back to back, then ``gap`` rows of other memory before the next sequence's rows.

    Gap 0 is how a growing cache's ``torch.cat`` leaves them; a few rows, a growing cache with headroom;
    capacity - keys, a static cache's slots. Same rows, same arithmetic: only the layout differs. The
    layouts take turns for ``rounds`` rounds after a warm-up round. Returns "gaps", "runs" (one
    ``measure.spread`` per gap) and "verdict": the first gap against the last (``measure.compare``).
    """

    g = torch.Generator().manual_seed(0)
    q = torch.randn(batch, 1, 1, head_dim, generator=g)

    def products(gap):
        buffer = torch.randn(batch, 1, keys + gap, head_dim, generator=g)
        kv = buffer[:, :, :keys]                                          # (B, 1, S, D), keys + gap rows apart
        return lambda: torch.softmax(q @ kv.transpose(-2, -1), dim=-1) @ kv

    runs = interleaved_runs({gap: products(gap) for gap in gaps}, rounds)
    spreads = [spread(runs[gap]) for gap in gaps]
    return {"gaps": list(gaps), "runs": spreads, "verdict": compare(spreads[0], spreads[-1])}


def copy_bandwidth(nbytes: int = 512 * 2**20, repeats: int = 5) -> float:
    """Measured memory bandwidth in bytes/s: bytes read plus bytes written by copying an nbytes buffer."""
    src = torch.ones(nbytes // 4)            # touched, so its pages are real memory, not the shared zero page
    dst = torch.empty_like(src)
    seconds, _ = median_time(lambda: dst.copy_(src), repeats, warmup=1)
    return 2 * nbytes / seconds


def decode_bytes_per_token(model, context: int, batch: int = 1) -> int:
    """Bytes one decode step reads at ``context`` tokens: every linear weight, one embedding row per
    sequence, and the K and V of every cached token (float32)."""
    cfg = model.config
    kv = kv_cache_bytes(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, context, bytes_per_value=4, batch=batch)
    return linear_weight_bytes(model) + batch * cfg.d_model * 4 + kv


def weight_products(model):
    """A function that runs every weight product of one decode step and nothing else: each linear
    layer of ``model`` once, in the order a step calls them, on one token's input (zeros of its width).

    Timing it gives the kernels' share of a step: the weights come from memory as in a step (the
    layers together are far larger than the CPU's caches), with none of the norms, RoPE, attention
    or cache work between the calls.
    """
    layers = linear_layers(model)
    inputs = {n: torch.zeros(1, 1, n) for n in {m.in_features for m in layers}}

    @torch.inference_mode()
    def run():
        for layer in layers:
            layer(inputs[layer.in_features])
    return run


def smollm2_formats(formats=WEIGHT_FORMATS, new_tokens: int = 32, rounds: int = 5, prompt: str = CHAT_PROMPT,
                    answer_tokens: int = 48, attention: str = "dense", floor: bool = False, llama=None,
                    compiled: bool = False) -> dict:
    """Decode tokens/s of SmolLM2 per weight format, formats alternating round by round.

    Each round generates ``new_tokens`` greedy tokens after the chat prompt with
    every format in turn; a format's speed is 1 / (median seconds per token
    after the first), and its reported value is the median over rounds.
    "kernel": what the layers' weight products run on (``quant.linear_kernel``).
    "vs_fp32": the format's verdict against the first format (float32),
    from the rounds (``measure.compare``). Also records whether each
    format's greedy answer (up to ``answer_tokens``, stopping at end of
    turn) names Paris and equals float32's.
    attention: the model's attention kernel, the same for every format.
    floor: also measure what a comparison with the memory floor needs (the
    benchmark's weights section; the demo skips it):
    - "bandwidth_runs" (bytes/s): ``copy_bandwidth`` at the start of every
      round; on a shared machine it moves from minute to minute, and with it
      the floor;
    - per row, "products_runs_s" and "products_s": in the same rounds, right
      after each format's generation, its weight products alone
      (``weight_products``), each round's median seconds of 5 runs, and
      their median;
    - per row, "calls_per_step": the operator calls a decode step makes from
      Python (torch.profiler).
    llama: a started ``toyllm.bench.llama.LlamaCpp`` on the same GGUF file,
    or None. It takes its turn in every round after the formats, on the same
    prompt ids and ``new_tokens``, and its speed is measured as theirs (its
    seconds per step after the first token, median per round). Adds "llama":
    version, system_info, tokens_per_s, runs_s, its greedy answer and whether
    it names Paris; or "llama_error" if the worker failed meanwhile (its
    rounds so far are dropped: a crash costs this row, not the section).
    compiled: also time each format's decode step compiled (``generate(...,
    compile=True)``, ``toyllm.compiled``) right after its eager run in every
    round. Adds per row "compiled": runs_s, tokens_per_s, "vs_eager" (its
    verdict against the same format's eager runs), "same_tokens" (its greedy
    tokens equal the eager ones) and "compile_s" (seconds of the first call);
    or "compiled_error" if it does not compile here (no C++ compiler, say).
    And "ahead": the same for the step compiled ahead of time
    (``compile="ahead"``), timed right after, with "vs_compiled" too.
    """
    from ..weights import load_model

    models, tokenizer = {}, None
    for fmt in formats:
        models[fmt], tokenizer = load_model("smollm2-135m", attention=attention, weights=fmt)
    ids = tokenizer.encode_chat(prompt)
    answers = {fmt: generate(m, ids, answer_tokens, eos_id=tokenizer.eos_id).output_ids for fmt, m in models.items()}
    products = {fmt: weight_products(m) for fmt, m in models.items()} if floor else {}
    compiled_rows = {fmt: _compile_decode(m, ids, new_tokens) for fmt, m in models.items()} if compiled else {}
    ahead_rows = {fmt: _compile_decode(m, ids, new_tokens, "ahead") for fmt, m in models.items()} if compiled else {}
    tpot = {fmt: [] for fmt in formats}
    products_s = {fmt: [] for fmt in formats}
    bandwidth_runs = []
    llama_row, llama_error = None, ""
    if llama is not None:
        try:
            llama_row = _llama_answer(llama, ids, answer_tokens, tokenizer)
        except LlamaCppError as exc:
            llama, llama_error = None, str(exc)
    for _ in range(rounds):
        if floor:
            bandwidth_runs.append(copy_bandwidth())
        for fmt, m in models.items():
            tpot[fmt].append(generate(m, ids, new_tokens).tpot_s)
            if floor:
                products_s[fmt].append(median_time(products[fmt], 5)[0])
            if "runs_s" in compiled_rows.get(fmt, {}):
                compiled_rows[fmt]["runs_s"].append(generate(m, ids, new_tokens, compile=True).tpot_s)
            if "runs_s" in ahead_rows.get(fmt, {}):
                ahead_rows[fmt]["runs_s"].append(generate(m, ids, new_tokens, compile="ahead").tpot_s)
        if llama is not None:
            try:
                llama_row["runs_s"].append(statistics.median(llama.decode(ids, new_tokens)["step_s"]))
            except LlamaCppError as exc:
                llama, llama_row, llama_error = None, None, str(exc)
    context = len(ids) + new_tokens // 2
    rows = []
    for fmt, m in models.items():
        seconds = statistics.median(tpot[fmt])
        text = tokenizer.decode(answers[fmt], skip_special_tokens=True)
        rows.append({"format": fmt, "kernel": linear_kernel(m), "bytes_per_token": decode_bytes_per_token(m, context),
                     "linear_bytes": linear_weight_bytes(m), "tokens_per_s": 1 / seconds, "runs_s": tpot[fmt],
                     "vs_fp32": compare(tpot[fmt], tpot[formats[0]]),
                     "answer": text, "paris": "Paris" in text, "same_as_fp32": answers[fmt] == answers[formats[0]]})
        if floor:
            rows[-1].update(products_s=statistics.median(products_s[fmt]), products_runs_s=products_s[fmt],
                            calls_per_step=profile_decode_step(m, len(ids), steps=2)["top_level_calls"])
        if fmt in compiled_rows:
            c = compiled_rows[fmt]
            if "runs_s" in c:
                c.update(tokens_per_s=1 / statistics.median(c["runs_s"]), vs_eager=compare(c["runs_s"], tpot[fmt]))
            rows[-1]["compiled"] = c
            a = ahead_rows[fmt]
            if "runs_s" in a:
                a.update(tokens_per_s=1 / statistics.median(a["runs_s"]), vs_eager=compare(a["runs_s"], tpot[fmt]))
                if "runs_s" in c:
                    a["vs_compiled"] = compare(a["runs_s"], c["runs_s"])
            rows[-1]["ahead"] = a
    if llama_row is not None:
        llama_row.update(tokens_per_s=1 / statistics.median(llama_row["runs_s"]),
                         vs_fp32=compare(llama_row["runs_s"], tpot[formats[0]]),
                         same_as_fp32=llama_row.pop("tokens") == answers[formats[0]])
    return {"prompt_len": len(ids), "new_tokens": new_tokens, "rounds": rounds, "attention": attention, "rows": rows,
            **({"bandwidth_runs": bandwidth_runs} if floor else {}),
            **({"llama": llama_row} if llama_row is not None else {}),
            **({"llama_error": llama_error} if llama_error else {})}


def _compile_decode(model, ids, new_tokens: int, mode: bool | str = True) -> dict:
    """Compile ``model``'s decode step for ``new_tokens`` tokens after ``ids`` (the first call; ``mode`` as
    ``generate``'s compile); its greedy tokens against the eager ones, and the seconds compiling took. A
    compiler that fails says why instead."""
    eager = generate(model, ids, new_tokens).output_ids
    t0 = time.perf_counter()
    try:
        out = generate(model, ids, new_tokens, compile=mode).output_ids
    except Exception as exc:                   # no C++ compiler, an operator it cannot compile, a compiler bug
        return {"compiled_error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}
    return {"compile_s": time.perf_counter() - t0, "same_tokens": out == eager, "runs_s": []}


def _llama_answer(llama, ids, answer_tokens: int, tokenizer) -> dict:
    """llama.cpp's greedy answer to ``ids`` (up to ``answer_tokens`` tokens, cut after its end of turn, as
    ``generate`` stops there) and the start of its row in ``smollm2_formats``; "runs_s" fills round by round."""
    tokens = llama.decode(ids, answer_tokens)["tokens"]
    if tokenizer.eos_id in tokens:
        tokens = tokens[:tokens.index(tokenizer.eos_id) + 1]
    text = tokenizer.decode(tokens, skip_special_tokens=True)
    return {"format": "llama.cpp", "version": llama.version, "system_info": llama.system_info,
            "threads": llama.threads, "tokens": tokens, "answer": text, "paris": "Paris" in text, "runs_s": []}


# The operators that multiply by the weight matrices, one per weight format's kernel (toyllm.quant).
MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "quantized::linear_dynamic_fp16",
              "mkldnn::_linear_pointwise", "aten::_weight_int8pack_mm", "aten::_weight_int4pack_mm_for_cpu")


def _decode_timer(model, prompt_len: int, steps: int):
    """``seconds(forward)``: median seconds of ``steps`` decode steps of ``forward`` (the model, or a compiled
    version of it) after a random ``prompt_len``-token prompt, each timing on a fresh static cache."""
    ids = torch.randint(0, model.config.vocab_size, (1, prompt_len), generator=torch.Generator().manual_seed(0))
    token = torch.tensor([[1]])

    def fresh():
        cache = make_cache("static", model.config, prompt_len + steps + 8)   # room for warm-up steps
        model(ids, cache=cache, last_only=True)
        return cache

    def seconds(forward, warmup: int = 1) -> float:
        cache = fresh()
        return median_time(lambda: forward(token, cache=cache), steps, warmup=warmup)[0]

    return seconds, fresh, token


@contextmanager
def _quiet_stderr():
    """Send file descriptor 2 to /dev/null for a while: the profiler's C++ side logs a line to it
    whenever it starts or stops, which would clutter a lesson's output."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


@torch.inference_mode()          # as generate runs its steps
def profile_decode_step(model, prompt_len: int = 38, steps: int = 8) -> dict:
    """Where a decode step's time goes, by torch.profiler, per step (averages over ``steps`` steps).

    Returns the operator calls the model's Python code makes (top level) and
    all calls (nested ones included), the bytes those calls allocate, the
    share of CPU time spent inside the operators that read the weights
    (``MATMUL_OPS``: the linear layers, and bmm, the attention's two
    products), the six operators with the most time, and the step's
    seconds without the profiler (median over the same number of steps).
    """
    from torch.profiler import ProfilerActivity, profile

    seconds, fresh, token = _decode_timer(model, prompt_len, steps)
    cache = fresh()
    model(token, cache=cache)                                   # warm-up
    with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for _ in range(steps):
            model(token, cache=cache)
    events = prof.events()
    table = prof.key_averages()
    total_us = sum(e.self_cpu_time_total for e in table)
    matmul_us = sum(e.self_cpu_time_total for e in table if e.key in MATMUL_OPS)
    top = sorted(table, key=lambda e: -e.self_cpu_time_total)[:6]
    step_s = seconds(model)
    return {"top_level_calls": sum(1 for e in events if e.cpu_parent is None and e.name != "[memory]") / steps,
            "all_calls": sum(1 for e in events if e.name != "[memory]") / steps,
            "bytes_allocated": sum(max(e.self_cpu_memory_usage, 0) for e in table) / steps,
            "matmul_share": matmul_us / total_us, "step_s": step_s,
            "top": [{"op": e.key, "calls": e.count / steps, "share": e.self_cpu_time_total / total_us} for e in top]}


@torch.no_grad()
def compile_trial(model, prompt_len: int = 38, steps: int = 16, rounds: int = 5) -> dict:
    """Is a decode step faster with torch.compile? Seconds per step, eager and compiled, alternating rounds.

    Two ways are tried. "whole": ``torch.compile(model)`` asked for the decode
    steps; the keys and values grow by a token every step, so it must compile
    for a changing length. "parts": what keeps its shape from step to step,
    each layer's projections and MLP (``Block.qkv``, ``Block.finish``), with
    the attention left eager. A way that fails (no C++ compiler, or the
    compiler's own error) is reported with its reason instead of a time; the
    model is left as it was either way.
    """
    import torch._dynamo

    seconds, _, _ = _decode_timer(model, prompt_len, steps)

    def use_parts(compiled: bool):
        for layer, (qkv, finish) in zip(model.layers, compiled_parts):
            if compiled:
                layer.qkv, layer.finish = qkv, finish
            else:                                               # back to the class's own methods
                layer.__dict__.pop("qkv", None), layer.__dict__.pop("finish", None)

    def step_s(way):
        use_parts(way == "parts")
        return seconds(whole if way == "whole" else model, warmup=2)

    def reason(exc):
        return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:160]}"

    result, ways, compiled_parts = {"eager": {"ok": True}}, ["eager"], []
    try:
        try:
            whole = torch.compile(model)
            compiled_parts = [(torch.compile(layer.qkv, dynamic=False), torch.compile(layer.finish, dynamic=False))
                              for layer in model.layers]
        except Exception as exc:                                # torch.compile itself unavailable
            result.update({way: {"ok": False, "reason": reason(exc)} for way in ("whole", "parts")})
            return result
        for way in ("whole", "parts"):
            t0 = time.perf_counter()
            try:
                step_s(way)                                     # compiles here
            except Exception as exc:                            # no compiler, unsupported op, compiler bug
                result[way] = {"ok": False, "reason": reason(exc)}
                continue
            result[way] = {"ok": True, "compile_s": time.perf_counter() - t0}
            ways.append(way)
        # in turns, round by round; a way that compiled must also run: no except here
        times = interleaved_runs({way: (lambda way=way: step_s(way)) for way in ways}, rounds, warmup=0)
    finally:
        use_parts(False)
        torch._dynamo.reset()
    eager_s = statistics.median(times["eager"])
    for way in ways:
        result[way]["step_s"] = statistics.median(times[way])
        result[way]["speedup"] = eager_s / result[way]["step_s"]
        result[way]["verdict"] = compare(times[way], times["eager"])     # decided from the rounds, not the ratio
    return result


FLOOR_TARGET = 0.65   # the decode target: the fastest format that answers Paris at this share of its floor's speed
LLAMA_TARGET = 0.6    # and against llama.cpp: the fastest way that answers Paris at this share of its tokens/s


def add_floor_figures(row: dict, bandwidth: float, lowest_bandwidth: float | None = None) -> dict:
    """Add to a row of ``smollm2_formats`` its floor and where its step goes, given the bandwidth (bytes/s):
    floor_tokens_per_s, rest_s (seconds per token outside the weight products), products_bytes_per_s
    (the products' read rate) and products_floor_share (the share of the floor's speed a step would
    reach if nothing but its products took time); products_floor_share_best is that share against
    ``lowest_bandwidth`` (the slowest round's copy: the floor most in the format's favour). Returns the row."""
    row["floor_tokens_per_s"] = bandwidth / row["bytes_per_token"]
    row["rest_s"] = 1 / row["tokens_per_s"] - row["products_s"]
    row["products_bytes_per_s"] = row["linear_bytes"] / row["products_s"]
    # the floor's seconds over the products' seconds, at the median bandwidth and at the lowest
    row["products_floor_share"] = row["bytes_per_token"] / (bandwidth * row["products_s"])
    lowest = bandwidth if lowest_bandwidth is None else lowest_bandwidth
    row["products_floor_share_best"] = row["bytes_per_token"] / (lowest * row["products_s"])
    return row


def bench_weights(quick: bool = False) -> dict:
    """SmolLM2 decode tokens/s per weight format beside the memory-bandwidth floor (lesson 03's roofline),
    and beside llama.cpp on the same GGUF file where it is installed (``toyllm.bench.llama``).

    "llama": llama.cpp's row (see ``smollm2_formats``); "vs_llama": the fastest format that answers Paris
    against it, decided from the rounds (``measure.compare``); "fastest": the fastest way, eager or
    compiled, that answers Paris; "vs_llama_target": the target (``LLAMA_TARGET`` of llama.cpp's speed)
    as a verdict, the fastest way's runs against llama.cpp's divided by the target, so that a miss or a
    hit inside the noise reads as neither; "llama_missing": why there is no llama.cpp row (how to install
    it, or the worker's error).
    """
    from ..measure import check_machine
    from ..weights import find_smollm2_gguf

    machine = check_machine()            # how busy the machine is before timing: the section prints it
    print(f"  {machine.line}", flush=True)
    # Started before the models load (it loads its own copy of the file), one process for every round.
    llama, missing = start_llama(find_smollm2_gguf(), threads=torch.get_num_threads(), context=512,
                                 timeout_s=600)
    try:
        # compiled steps take a minute each to compile: the full run only
        data = smollm2_formats(new_tokens=16 if quick else 32, rounds=2 if quick else 7, floor=True, llama=llama,
                               compiled=not quick)
    finally:
        if llama is not None:
            llama.close()
    data["llama_missing"] = data.pop("llama_error", missing)
    bandwidth = statistics.median(data["bandwidth_runs"])
    for row in data["rows"]:
        add_floor_figures(row, bandwidth, min(data["bandwidth_runs"]))
        progress({k: v for k, v in row.items()
                   if k in ("format", "tokens_per_s", "floor_tokens_per_s", "products_s", "calls_per_step")})
    data["at_floor"] = [r["format"] for r in data["rows"] if r["tokens_per_s"] >= r["floor_tokens_per_s"]]
    data["capability"] = torch.backends.cpu.get_cpu_capability()
    answering = [r for r in data["rows"] if r["paris"]]
    data["best"] = max(answering, key=lambda r: r["tokens_per_s"]) if answering else None
    # the fastest way of all, eager or compiled, among the formats that answer Paris (and whose compiled
    # step keeps their tokens)
    ways = [(r["format"], r["runs_s"]) for r in answering]
    ways += [(r["format"] + ", compiled" + suffix, r[key]["runs_s"]) for r in answering
             for key, suffix in (("compiled", ""), ("ahead", " ahead of time"))
             if r.get(key, {}).get("same_tokens") and r[key]["runs_s"]]
    if ways:
        name, runs = min(ways, key=lambda way: statistics.median(way[1]))
        data["fastest"] = {"way": name, "runs_s": runs, "tokens_per_s": 1 / statistics.median(runs)}
    if "llama" in data:
        progress({k: v for k, v in data["llama"].items() if k in ("format", "tokens_per_s", "paris", "version")})
        if data["best"] is not None:
            data["vs_llama"] = compare(data["best"]["runs_s"], data["llama"]["runs_s"])
            data["fastest_vs_llama"] = compare(data["fastest"]["runs_s"], data["llama"]["runs_s"])
            data["fastest"]["share_of_llama"] = data["fastest"]["tokens_per_s"] / data["llama"]["tokens_per_s"]
            # the target as a verdict: the fastest way against the slowest step that would still meet it
            data["llama_target"] = LLAMA_TARGET
            data["vs_llama_target"] = compare(data["fastest"]["runs_s"],
                                              [s / LLAMA_TARGET for s in data["llama"]["runs_s"]])
    else:
        print(f"  no llama.cpp row: {data['llama_missing']}", flush=True)
    return {"bandwidth_bytes_per_s": bandwidth, "threads": torch.get_num_threads(), "floor_target": FLOOR_TARGET,
            "machine": machine.line, **data}


def bench_batched(quick: bool = False) -> dict:
    """The KV-cache blog's experiment: a batch of prompts on its toy's shape, naive vs cached (seconds).

    Both methods use the dense kernel, the course's default and the blog's
    own attention (all of QK^T, then the causal mask); naive's score tensor
    reaches (prompts, 1, 150, 150), 900 MB in float32 at 10000 prompts.
    The first cache is the blog's own, one that grows by concatenation
    ("dynamic"); the same growing cache with ``BLOG_HEADROOMS`` rows of headroom
    and the static cache run in the same rounds as further rows.
    One run each would let a slow spell of the shared machine decide the
    ratio: all take turns for 3 rounds after an untimed round (the first
    runs of a process pay for mapping its memory, the cached ones most), and
    each round's ratio (naive over the cached run of the same round) is kept.
    "products": why the caches differ, the attention products of one step at
    the middle of the generation, rows laid out as each cache lays them out
    (``window_products``).
    quick: 500 prompts, one round, no warm-up.
    """
    from ..cache import DynamicKVCache

    n = 500 if quick else BLOG_PROMPTS
    prompts = torch.randint(0, BLOG_TOY.vocab_size, (n, BLOG_PROMPT_LEN), generator=torch.Generator().manual_seed(0))
    model = build_model(BLOG_TOY, attention="dense")
    # name -> a kind generate knows, or a function returning a new cache
    caches = {"dynamic": "dynamic",
              **{f"dynamic, headroom={h}": (lambda h=h: DynamicKVCache(BLOG_TOY.n_layers, headroom=h))
                 for h in BLOG_HEADROOMS},
              "static": "static"}
    row = {"prompts": n, "prompt_len": BLOG_PROMPT_LEN, "new_tokens": BLOG_NEW_TOKENS, "config": BLOG_TOY.to_dict(),
           "threads": torch.get_num_threads(), "warmup": 0 if quick else 1,
           **time_naive_and_cached(model, prompts, BLOG_NEW_TOKENS, 1 if quick else 5, warmup=0 if quick else 1,
                                   caches=tuple(caches.items()))}

    def copies(how) -> int:
        """Times the cache copied what it held during one generation of this length (one sequence is enough)."""
        cache = make_cache(how, BLOG_TOY, BLOG_PROMPT_LEN + BLOG_NEW_TOKENS) if isinstance(how, str) else how()
        generate(model, prompts[:1], BLOG_NEW_TOKENS, cache=cache)
        return cache.copies // BLOG_TOY.n_layers

    for entry in (row, *row["other_caches"]):
        entry["copies"] = copies(caches[entry["cache"]])
    progress({k: v for k, v in row.items() if k not in ("config", "naive", "cached", "verdict", "other_caches")})
    for other in row["other_caches"]:
        other["against_blog"] = compare(other["cached"], row["cached"])
        progress({k: v for k, v in other.items() if k not in ("cached", "verdict", "against_blog")})
    middle = BLOG_PROMPT_LEN + BLOG_NEW_TOKENS // 2
    # the rows per sequence of the static cache generate makes for this request (one sequence is enough to ask)
    capacity = make_cache("static", BLOG_TOY, BLOG_PROMPT_LEN + BLOG_NEW_TOKENS).capacity
    row["products"] = {"cached_tokens": middle, "capacity": capacity,
                       **window_products(n, middle, (0, 1, 2, 4, 8, 16, capacity - middle), BLOG_TOY.head_dim,
                                         2 if quick else 5)}
    progress({"cached_tokens": middle, **{f"gap {g}": r.median for g, r in zip(row["products"]["gaps"],
                                                                               row["products"]["runs"])}})
    return row


def bench_decode_step(quick: bool = False) -> dict:
    """Where SmolLM2's decode step spends its time (torch.profiler), and whether torch.compile speeds it up."""
    from ..weights import load_model

    rows = []
    for fmt in ("fp32", "fp16"):
        model, _ = load_model("smollm2-135m", weights=fmt)
        row = {"format": fmt, **profile_decode_step(model, steps=4 if quick else 16)}
        row["compile"] = compile_trial(model, steps=8 if quick else 16, rounds=2 if quick else 5)
        progress({k: v for k, v in row.items() if k in ("format", "top_level_calls", "matmul_share", "step_s")})
        progress({"format": fmt, **row["compile"]})
        rows.append(row)
    return {"threads": torch.get_num_threads(), "n_layers": model.config.n_layers, "rows": rows}
