"""The demo (``python -m toyllm demo``, ``make demo``): SmolLM2 answers a question, then four timed parts.

The parts: decode speed per weight format (fewer bytes per weight, more
tokens per second), the fastest way that still answers (int4 weights with
the decode step compiled ahead of time) beside float32 eager, naive
generation against the KV cache, and a parallel prefill on two processes.
The compiled step is kept in the cache folder (``toyllm.compile_cache``):
the first demo compiles it (about a minute), later ones load it. Every comparison is decided from interleaved runs
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


# The fastest way that answered "Paris" in docs/benchmarks.md's weights section: int4 weights, the decode step
# compiled ahead of time. The demo measures it again beside float32 eager and decides from its own runs.
FAST_WEIGHTS = "int4"


def demo_fast_path(rounds: int = 5, new_tokens: int = 16, answer_tokens: int = 48, out=None) -> dict | None:
    """int4 with its decode step compiled ahead of time, beside float32 eager: what preparing the step cost
    (compiled, or loaded from the cache, in seconds), its answer, and both decode speeds from ``rounds``
    interleaved rounds of ``new_tokens`` tokens. Returns the numbers, or None where nothing compiles here."""
    import statistics

    from . import generate, load_model
    from .compiled import compiled_decoder
    from .measure import compare

    out = out or sys.stdout
    fp32, tokenizer = load_model("smollm2-135m")
    fast, _ = load_model("smollm2-135m", weights=FAST_WEIGHTS)
    ids = tokenizer.encode_chat(QUESTION)
    print(f"preparing {FAST_WEIGHTS}'s decode step compiled ahead of time (the first time about a minute on a "
          "laptop CPU, then loaded from the cache) ...", file=out, flush=True)
    try:
        report = compiled_decoder(fast, len(ids) + answer_tokens, ahead_of_time=True).build()
    except Exception as exc:               # no C++ compiler on this machine, say: the rest of the demo still runs
        print(f"  it does not compile here ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
              "the eager formats above are what this machine runs", file=out)
        return None
    print(f"  {report.line()}", file=out)
    answer = generate(fast, ids, answer_tokens, eos_id=tokenizer.eos_id, compile="ahead")
    text = tokenizer.decode(answer.output_ids, skip_special_tokens=True)
    eager_runs, fast_runs = [], []
    for _ in range(rounds):                # in turns, so a slow spell of the machine hits both
        eager_runs.append(generate(fp32, ids, new_tokens).tpot_s)
        fast_runs.append(generate(fast, ids, new_tokens, compile="ahead").tpot_s)
    verdict = compare(fast_runs, eager_runs)
    way, paris = f"{FAST_WEIGHTS}, compiled ahead", "names Paris" if "Paris" in text else "MISSES Paris"
    print(f"  {way}: {1 / statistics.median(fast_runs):5.1f} tokens/s, fp32 eager: "
          f"{1 / statistics.median(eager_runs):5.1f} tokens/s; answer {paris}: {text.strip()!r}", file=out)
    print(f"  per token, {verdict.sentence(way, 'fp32 eager')}", file=out)
    return {"report": report, "answer": text, "paris": "Paris" in text, "fast_runs_s": fast_runs,
            "eager_runs_s": eager_runs, "verdict": verdict}


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
                ("the fast path", f"The fastest way that answers: {FAST_WEIGHTS} weights, decode step compiled ahead "
                 "of time, beside fp32 eager", lambda: demo_fast_path(), ()),
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
