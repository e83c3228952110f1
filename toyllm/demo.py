"""The demo (``python -m toyllm demo``, ``make demo``): SmolLM2 answers a question, then three timed parts.

The parts: decode speed per weight format (fewer bytes per weight, more
tokens per second), naive generation against the KV cache, and a parallel
prefill on two processes. Every comparison is decided from interleaved runs
by ``toyllm.measure`` and printed with the runs behind it. In the student
edition a part that needs an exercise not written yet is named up front and
left out; the rest runs.
"""
from __future__ import annotations

import sys

from . import answers
from .utils import TextStreamer

QUESTION = "What is the capital of France?"


def demo_decode_speed(formats=("fp32", "fp16", "bf16", "int8", "int4"), out=None) -> dict:
    """The decode-speed lines: SmolLM2 tokens/s in each format, and the fastest that still answers Paris."""
    from .bench.decode import smollm2_formats

    out = out or sys.stdout
    data = smollm2_formats(formats, new_tokens=16, rounds=3)
    rows = {r["format"]: r for r in data["rows"]}
    ok = [r for r in data["rows"] if r["paris"]]
    for r in data["rows"]:
        print(f"  {r['format']:>4}: {r['tokens_per_s']:5.1f} tokens/s, {r['bytes_per_token'] / 1e6:4.0f} MB read per "
              f"token, answer {'names Paris' if r['paris'] else 'MISSES Paris'}", file=out)
    if ok and "fp32" in rows:
        best = max(ok, key=lambda r: r["tokens_per_s"])
        verdict = best["vs_fp32"]
        print(f"{'fastest' if verdict.word == 'faster' else 'lowest median'} of the formats that still answer "
              f"Paris: {best['format']}; per token, {verdict.sentence(best['format'], 'fp32')}", file=out)
    return data


def demo_prefill(context: int = 2048, rounds: int = 3) -> None:
    """One process vs TSP vs KVR on 2 processes, in turns for ``rounds`` rounds, with each
    configuration's runs, its verdict against the one-process baseline and its first token."""
    from .measure import check_machine, compare_prefills
    from .parallel import ModelSpec
    from .utils import random_prompt

    spec = ModelSpec("bench")
    ids = random_prompt(context, spec.config.vocab_size)
    cut = int(context * 0.56)
    machine = check_machine()
    print(machine.line)
    cmp = compare_prefills(spec, ids, {"TSP, even split": {"method": "tsp"}, "KVR, even split": {"method": "kvr"},
                                       f"KVR, split [{cut}, {context - cut}]": {"method": "kvr",
                                                                                "partition": [cut, context - cut]}},
                           rounds=rounds, machine=machine)
    print(f"bench preset, {context}-token prompt, dense attention, 2 processes with 1 thread each (every method "
          "projects only the last position to logits)")
    print("\n".join(cmp.lines()))
    print(cmp.fastest_line())
    base = cmp.results[cmp.baseline]
    for name, r in cmp.results.items():
        diff = (r.logits - base.logits).abs().max().item()
        print(f"  {name:<26} first token {r.first_token:3d}   max |logit diff| against the baseline {diff:.1e}")


def run_demo(weights: str = "fp32") -> int:
    """The whole demo; ``weights``: the weight format of the chat answer. Returns the exit code (0)."""
    from . import generate, load_model
    from .bench import ensure_resident_heap, naive_vs_cached

    def naive_and_cached():
        row = naive_vs_cached(model, prompt_len=32, new_tokens=32, rounds=5)     # fewer decide nothing (measure)
        print(f"SmolLM2, 32-token prompt, 32 new tokens, 5 rounds in turns: {row['verdict'].sentence('cached', 'naive')}"
              f"; identical tokens: {row['identical']}")

    ensure_resident_heap(["demo", "--weights", weights])   # steadier timings (see toyllm/bench/__init__.py)
    # The exercises each timed section runs (the student edition runs the student's code for them): the
    # decode-speed lines count each format's bytes per token with the KV-cache size, the parallel prefill
    # runs TSP and KV-Runahead. All are checked here, before anything is timed.
    sections = [("the decode speed", "Decode speed: fewer bytes per weight, more tokens per second",
                 demo_decode_speed, ("2.2",)),
                ("naive vs cached", "Naive generation vs KV cache (same greedy tokens, different cost)",
                 naive_and_cached, ()),
                ("the parallel prefill", "Parallel prefill on 2 processes (gloo on this CPU)", demo_prefill,
                 ("4.2", "5.2"))]
    missing = {}
    for number in sorted({n for *_, needs in sections for n in needs}):
        try:
            answers.require(number)
        except answers.ExerciseNotWritten as e:
            missing[number] = str(e)
    for number, message in missing.items():
        left_out = " and ".join(name for name, *_, needs in sections if number in needs)
        print(f"not yet: {message}; until then the demo leaves out {left_out}")
    print("== SmolLM2-135M-Instruct, read from its GGUF file, running in plain PyTorch ==")
    model, tokenizer = load_model("smollm2-135m", weights=weights)
    print(f"user: {QUESTION}\nassistant: ", end="", flush=True)
    result = generate(model, tokenizer.encode_chat(QUESTION), 48, eos_id=tokenizer.eos_id,
                      on_token=TextStreamer(tokenizer))
    print(f"\n[TTFT {result.ttft_s * 1e3:.0f} ms, {1 / max(result.tpot_s, 1e-9):.1f} tokens/s decoding]\n")

    for _, title, run, needs in sections:
        print(f"\n== {title} ==")
        if any(n in missing for n in needs):
            print(f"(not yet: needs Exercise {', '.join(n for n in needs if n in missing)}; it unlocks once you "
                  "have written it)")
            continue
        try:
            run()
        except answers.ExerciseNotWritten as e:     # the student edition: this part runs the student's code
            print(f"(not yet: {e}; it unlocks once you have written it)")
    return 0
