"""Command line: ``python -m toyllm <command> ...``.

Commands: demo, generate, prefill, search, bench, grade. Every command that
measures something accepts ``--json`` and then prints one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from . import grading
from .model import get_config
from .utils import TextStreamer, random_prompt


def _encode_prompt(tokenizer, prompt: str, chat: bool) -> list[int]:
    if not prompt:
        raise ValueError("prompt is empty: pass --prompt with some text")
    return tokenizer.encode_chat(prompt) if chat else tokenizer.encode(prompt)


def cmd_generate(args) -> int:
    from . import generate, load_model

    model, tokenizer = load_model(args.model, attention=args.attention)
    ids = _encode_prompt(tokenizer, args.prompt, args.chat)
    streamer = None if args.json else TextStreamer(tokenizer)
    result = generate(model, ids, args.max_new_tokens, method=args.method, cache=args.cache,
                      temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                      eos_id=tokenizer.eos_id, on_token=streamer)
    text = tokenizer.decode(result.output_ids, skip_special_tokens=True)
    if args.json:
        print(json.dumps({"model": args.model, "method": args.method, "cache": args.cache,
                          "prompt_ids": result.prompt_ids, "output_ids": result.output_ids, "text": text,
                          "ttft_s": result.ttft_s, "tpot_s": result.tpot_s,
                          "stopped_on_eos": result.stopped_on_eos}))
    else:
        print(f"\n[{len(result.output_ids)} tokens, TTFT {result.ttft_s * 1e3:.1f} ms, "
              f"{result.tpot_s * 1e3:.1f} ms per token after the first]")
    return 0


def cmd_demo(args) -> int:
    from . import generate, load_model
    from .bench import ensure_resident_heap, naive_vs_cached

    ensure_resident_heap(["demo"])   # steadier timings (see toyllm/bench.py)
    print("== SmolLM2-135M-Instruct, read from its GGUF file, running in plain PyTorch ==")
    model, tokenizer = load_model("smollm2-135m")
    question = "What is the capital of France?"
    print(f"user: {question}\nassistant: ", end="", flush=True)
    result = generate(model, tokenizer.encode_chat(question), 48, eos_id=tokenizer.eos_id,
                      on_token=TextStreamer(tokenizer))
    print(f"\n[TTFT {result.ttft_s * 1e3:.0f} ms, {1 / max(result.tpot_s, 1e-9):.1f} tokens/s decoding]\n")

    print("== Naive generation vs KV cache (same greedy tokens, different cost) ==")
    row = naive_vs_cached(model, prompt_len=32, new_tokens=32, repeats=1)
    print(f"SmolLM2, 32-token prompt, 32 new tokens: naive {row['naive_s']:.2f} s, cached {row['cached_s']:.2f} s, "
          f"speedup {row['speedup']:.1f}x, identical tokens: {row['identical']}")
    try:
        from .parallel import demo_prefill
    except ImportError:
        return 0
    print("\n== Parallel prefill on 2 processes (gloo on this CPU) ==")
    demo_prefill()
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m toyllm", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)

    sub.add_parser("demo", help="the main job: a SmolLM2 chat answer, then what the KV cache buys")

    g = sub.add_parser("generate", help="generate text with a model")
    g.add_argument("--model", default="smollm2-135m", help="preset: tiny, bench or smollm2-135m")
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--method", choices=["naive", "cached"], default="cached")
    g.add_argument("--cache", choices=["dynamic", "static"], default="dynamic")
    g.add_argument("--attention", choices=["dense", "sdpa"], default="dense")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")

    f = sub.add_parser("prefill", help="prefill a random prompt on one or several processes (single, tsp, kvr)",
                       description="Run under torchrun too: torchrun --nproc-per-node=P -m toyllm prefill ...")
    f.add_argument("--model", default="tiny", help="preset: tiny, bench or smollm2-135m")
    f.add_argument("--context", type=int, required=True, help="prompt length in tokens")
    f.add_argument("--method", choices=["single", "tsp", "kvr"], default="kvr")
    f.add_argument("--world-size", type=int, default=2, help="number of processes (ignored for single)")
    f.add_argument("--partition", type=_int_list, default=None, help="tokens per rank, e.g. 5000,3192")
    f.add_argument("--partition-table", default=None, help="JSON table of searched partitions (KVR-P)")
    f.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=True,
                   help="KVR: overlap communication with compute (isend/irecv)")
    f.add_argument("--repeat", type=int, default=3, help="timed runs after one warm-up, in the same processes")
    f.add_argument("--threads", type=int, default=1, help="intra-op threads per process")
    f.add_argument("--attention", choices=["dense", "sdpa"], default="dense")
    f.add_argument("--bandwidth", type=float, default=None, help="simulated link bandwidth in GB/s")
    f.add_argument("--latency", type=float, default=0.0, help="simulated link latency in seconds")
    f.add_argument("--noise", type=float, default=0.0, help="relative noise on the link between ranks 0 and 1")
    f.add_argument("--backend", choices=["auto", "gloo", "nccl"], default="auto")
    f.add_argument("--decode", type=int, default=0, help="greedy tokens to decode after the prefill")
    f.add_argument("--seed", type=int, default=0, help="seed of the random prompt")
    f.add_argument("--check", action="store_true", help="also prefill on one process and report the logit difference")
    f.add_argument("--timeout", type=float, default=600.0, help="wall-clock limit in seconds")
    f.add_argument("--json", action="store_true")

    s = sub.add_parser("search", help="search the best KVR partition (simulated or measured cost)")
    s.add_argument("--model", default="bench", help="preset: tiny, bench or smollm2-135m")
    s.add_argument("--context", type=_int_list, required=True, help="prompt length(s) in tokens, e.g. 4096,8192")
    s.add_argument("--world-size", type=int, default=2)
    s.add_argument("--cost", choices=["simulated", "measured"], default="simulated")
    s.add_argument("--min-stride", type=int, default=None, help="finest boundary step in tokens (default C/256)")
    s.add_argument("--repeat", type=int, default=2, help="measured cost: timed runs per partition")
    s.add_argument("--cost-model", default=None, help="simulated cost: CostModel JSON (default: calibrate now)")
    s.add_argument("--bandwidth", type=float, default=None, help="link bandwidth in GB/s (simulated link)")
    s.add_argument("--table", default=None, help="add the results to this partition table (JSON; created if missing)")
    s.add_argument("--json", action="store_true")

    grading.add_arguments(sub.add_parser("grade", help="grade the exercises: points per exercise, Gradescope results.json"))

    b = sub.add_parser("bench", help="run the benchmarks and write their tables to a Markdown file")
    b.add_argument("--out", default="docs/benchmarks.md")
    b.add_argument("--only", choices=["generation", "first_token", "prefill", "search"], action="append",
                   help="run only these sections (repeatable); default: all")
    b.add_argument("--quick", action="store_true", help="fewer repeats and sizes (a smoke run, not for docs)")
    return p


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers like 5000,3192, got {text!r}")


def cmd_prefill(args) -> int:
    from .launch import launched_by_torchrun
    from .parallel import LinkModel, ModelSpec, parallel_prefill, single_prefill, torchrun_main
    from .partition import PartitionTable

    spec = ModelSpec(args.model, attention=args.attention)
    vocab = get_config(args.model).vocab_size
    if args.context < 1:
        raise ValueError(f"--context must be at least 1 token, got {args.context}")
    if args.repeat < 1:
        raise ValueError(f"--repeat must be at least 1, got {args.repeat}")
    ids = random_prompt(args.context, vocab, args.seed)
    p = 1 if args.method == "single" else args.world_size
    partition = args.partition
    if args.partition_table:
        if partition:
            raise ValueError("give either --partition or --partition-table, not both")
        table = PartitionTable.load(args.partition_table)
        if table.world_size != p:
            raise ValueError(f"the table is for {table.world_size} processes, not {p}")
        partition = table.predict(args.context)
    link = LinkModel(args.bandwidth, args.latency, (0, 1) if args.noise else None, args.noise) if args.bandwidth else None
    if launched_by_torchrun():
        from .parallel import check_prefill_request

        chunks = check_prefill_request(spec, ids, args.method, int(os.environ["WORLD_SIZE"]), partition)
        result = torchrun_main(spec, ids, args.method, chunks, overlap=args.overlap, link=link, repeat=args.repeat,
                               warmup=1, backend=args.backend, timeout_s=args.timeout)
        if result is None:      # not rank 0: rank 0 reports
            return 0
    else:
        result = parallel_prefill(spec, ids, args.method, p, partition, overlap=args.overlap, link=link,
                                  repeat=args.repeat, threads_per_rank=args.threads, backend=args.backend,
                                  decode_tokens=args.decode, timeout_s=args.timeout)
    if args.check:
        torch.set_num_threads(args.threads)
        ref, _ = single_prefill(spec.build(), ids)
        result.max_abs_logit_diff = (result.logits - ref).abs().max().item()
    if args.json:
        print(json.dumps(result.to_json()))
        return 0
    sim = " (simulated link: %g GB/s)" % args.bandwidth if link else ""
    print(f"{result.method} prefill of {result.context} tokens on {result.world_size} process(es), partition "
          f"{result.partition}, {result.threads_per_rank} thread(s) each{sim}")
    print(f"TTFT median {result.ttft_s:.4f} s over {len(result.ttft_runs)} run(s); first token {result.first_token}")
    if result.decoded:
        print(f"decoded after prefill: {result.decoded}")
    if result.max_abs_logit_diff is not None:
        print(f"max |logit - single-process logit| = {result.max_abs_logit_diff:.2e}")
    return 0


def cmd_search(args) -> int:
    from pathlib import Path

    from .partition import PartitionTable, hierarchical_grid_search, search_boundary_1d
    from .simulate import CostModel, ttft_cost

    cfg, p = get_config(args.model), args.world_size
    if p < 2:
        raise ValueError(f"--world-size must be at least 2 to have a partition to search, got {p}")
    table = None
    if args.table:
        table = PartitionTable.load(args.table) if Path(args.table).exists() else PartitionTable(p)
        if table.world_size != p:
            raise ValueError(f"{args.table} is a table for {table.world_size} processes, not {p}")
    pool, cost_model, results = None, None, []
    try:
        if args.cost == "simulated":
            if args.cost_model:
                cost_model = CostModel.from_dict(json.loads(Path(args.cost_model).read_text()))
            else:
                if not args.json:
                    print("calibrating the cost model on this machine (1 thread) ...", flush=True)
                cost_model = CostModel.calibrate(cfg)
            if args.bandwidth:
                cost_model = cost_model.with_(link_bandwidth_bytes_per_s=args.bandwidth * 1e9)
        else:
            from .launch import WorkerPool

            pool = WorkerPool(p, threads_per_rank=1, timeout_s=1800)
        for C in args.context:
            if C < p:
                raise ValueError(f"context {C} is shorter than the world size {p}")
            if pool is not None:
                from .parallel import ModelSpec, measured_cost

                ids = random_prompt(C, cfg.vocab_size)
                cost = measured_cost(ModelSpec(args.model), ids, pool, repeat=args.repeat)
            else:
                cost = ttft_cost(cfg, cost_model, "kvr")
            step = args.min_stride or max(1, C // 256)
            if p == 2:
                found = search_boundary_1d(cost, C, min_stride=step, progress=not args.json)
            else:
                found = hierarchical_grid_search(cost, C, p, min_stride=step, progress=not args.json)
            results.append({"model": args.model, "context": C, "world_size": p, "cost": args.cost,
                            "partition": found.partition, "boundaries": found.boundaries,
                            "ttft_s": found.cost_s, "evaluations": found.evaluations,
                            "simulated": args.cost == "simulated"})
            if table is not None:
                table.add(C, found.partition)
    finally:
        if pool is not None:
            pool.close()
    if table is not None:
        table.save(args.table)
    if args.json:
        print(json.dumps(results[0] if len(results) == 1 else results))
        return 0
    for r in results:
        kind = "simulated" if r["simulated"] else "measured"
        print(f"context {r['context']}: best partition {r['partition']} (boundaries {r['boundaries']}), "
              f"{kind} TTFT {r['ttft_s']:.4f} s, {r['evaluations']} evaluations")
    if table is not None:
        print(f"table {args.table}: contexts {table.contexts}")
    return 0


def cmd_bench(args) -> int:
    from .bench import run_benchmarks

    run_benchmarks(args.out, sections=args.only, quick=args.quick)
    return 0


COMMANDS = {"generate": cmd_generate, "demo": cmd_demo, "prefill": cmd_prefill, "search": cmd_search,
            "bench": cmd_bench, "grade": grading.main}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    torch.set_grad_enabled(False)
    try:
        return COMMANDS[args.command](args)
    except ValueError as e:   # bad input: one clear line, not a traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
