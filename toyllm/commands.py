"""What each command of ``python -m toyllm`` does, once ``toyllm.cli`` has parsed and checked its flags.

Each ``cmd_*`` takes the parsed flags and what the command's ``check_*``
prepared (a model, a plan), does the work and returns the exit code. An
exception here is a failure or a bug, and keeps its traceback; bad input
never gets this far.
"""
from __future__ import annotations

import json
import os
import time

import torch

from .cache import make_cache
from .utils import TextStreamer, random_prompt


def cmd_generate(args, prepared: tuple) -> int:
    from . import generate

    model, tokenizer, ids = prepared
    streamer = None if args.json else TextStreamer(tokenizer)
    cache = args.cache
    if args.headroom:                                   # check_generate allows it with the dynamic cache only
        cache = make_cache(args.cache, model.config, len(ids) + args.max_new_tokens, headroom=args.headroom)
    report, compile_mode = None, {"off": False, "jit": True, "ahead": "ahead"}[args.compile]
    if compile_mode is not False:
        from .compiled import compiled_decoder

        # compiled (or loaded) before the first token, so that TTFT times the generation alone
        decoder = compiled_decoder(model, len(ids) + args.max_new_tokens, ahead_of_time=compile_mode == "ahead",
                                   cache=not args.no_cache)
        if not args.json:
            print(f"preparing the decode step ({args.weights}, --compile {args.compile}) ...", flush=True)
        report = decoder.build()
        if not args.json:
            print(report.line(), flush=True)
    result = generate(model, ids, args.max_new_tokens, method=args.method, cache=cache,
                      temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                      eos_id=tokenizer.eos_id, on_token=streamer, compile=compile_mode)
    text = tokenizer.decode(result.output_ids, skip_special_tokens=True)
    if args.json:
        print(json.dumps({"model": args.model, "weights": args.weights, "method": args.method, "cache": args.cache,
                          "compile": args.compile, "compile_report": report.to_json() if report else None,
                          "headroom": args.headroom, "prompt_ids": result.prompt_ids,
                          "output_ids": result.output_ids, "text": text,
                          "ttft_s": result.ttft_s, "tpot_s": result.tpot_s,
                          "stopped_on_eos": result.stopped_on_eos}))
    else:
        print(f"\n[{len(result.output_ids)} tokens, TTFT {result.ttft_s * 1e3:.1f} ms, "
              f"{result.tpot_s * 1e3:.1f} ms per token after the first]")
    return 0


def cmd_cache(args, _prepared=None) -> int:
    from .compile_cache import cache_bytes, cache_root, clear_cache, list_entries

    root = cache_root()
    if args.action == "clear":
        freed = clear_cache()
        print(json.dumps({"folder": str(root), "freed_bytes": freed}) if args.json
              else f"cleared {root}: {freed} bytes freed")
        return 0
    entries = list_entries()
    if args.json:
        print(json.dumps({"folder": str(root), "bytes": cache_bytes(), "entries": entries}))
        return 0
    print(f"{root}: {cache_bytes()} bytes in all, {len(entries)} compiled step(s)")
    for e in entries:
        k = e["key"] or {}
        what = (f"{k.get('format')}, batch {k.get('batch')}, capacity {k.get('capacity')} tokens, torch {k.get('torch')}, "
                f"{k.get('cpu_capability')}" if k else "unreadable metadata")
        print(f"  {e['name']}  {e['bytes']:>12} bytes  {what}")
    return 0


def cmd_demo(args, _prepared=None) -> int:
    from .demo import run_demo

    return run_demo(args.weights)


# prefill --check: float32 ranks sum the same products in another order, which moves a logit by a few
# units in the last place; a wrong step (keys out of order, wrong positions) moves it by 1e-2 or more.
PREFILL_CHECK_RTOL = 1e-4


def cmd_prefill(args, plan: dict) -> int:
    from .parallel import parallel_prefill, single_prefill, torchrun_main

    spec, ids, link = plan["spec"], plan["ids"], plan["link"]
    backend, timeout_s = args.backend or "auto", 600.0 if args.timeout is None else args.timeout
    if plan["torchrun"]:
        torch.set_num_threads(args.threads)
        result = torchrun_main(spec, ids, args.method, plan["chunks"], overlap=args.overlap, link=link,
                               repeat=args.repeat, warmup=1, backend=backend, timeout_s=timeout_s)
        if result is None:      # not rank 0: rank 0 reports
            return 0
    else:
        result = parallel_prefill(spec, ids, args.method, plan["world_size"], plan["partition"], overlap=args.overlap,
                                  balance=args.balance, link=link, repeat=args.repeat, threads_per_rank=args.threads,
                                  backend=backend, decode_tokens=args.decode, timeout_s=timeout_s,
                                  ring_pass=args.ring_pass or "kv", cached=args.cached)
    allowed = None
    if args.check:
        torch.set_num_threads(args.threads)
        ref, _ = single_prefill(spec.build(), ids)
        result.max_abs_logit_diff = (result.logits - ref).abs().max().item()
        allowed = PREFILL_CHECK_RTOL * max(1.0, ref.abs().max().item())
    agrees = allowed is None or result.max_abs_logit_diff <= allowed
    if args.json:
        print(json.dumps({**result.to_json(), "partition_from": plan["partition_from"],
                          **({"allowed_logit_diff": allowed, "agrees": agrees} if args.check else {})}))
        return 0 if agrees else 1
    sim = " (simulated link: %g GB/s)" % args.bandwidth if link else ""
    print(f"{result.method} prefill of {result.context} tokens on {result.world_size} process(es), partition "
          f"{result.partition}, {result.threads_per_rank} thread(s) each{sim}")
    if result.ring_pass:
        print(f"ring pass-{result.ring_pass.upper()}" + (f", continuing {result.cached} tokens cached on the ranks"
                                                       if result.cached else ""))
    if plan["partition_from"] not in (None, "--partition"):
        print(f"partition from {plan['partition_from']}")
    print(f"TTFT median {result.ttft_s:.4f} s over {len(result.ttft_runs)} run(s); first token {result.first_token}")
    if result.decoded:
        print(f"decoded after prefill: {result.decoded}")
    if result.max_abs_logit_diff is not None:
        print(f"max |logit - single-process logit| = {result.max_abs_logit_diff:.2e}, allowed {allowed:.2e} "
              f"({PREFILL_CHECK_RTOL:g} x the largest |logit|, at least {PREFILL_CHECK_RTOL:g}): "
              + ("agrees with one process" if agrees else
                 "DIFFERS from one process: the parallel prefill computed something else"))
    return 0 if agrees else 1


def cmd_search(args, plan: dict) -> int:
    from .partition import search_partition
    from .simulate import CostModel, ttft_cost

    cfg, spec, table, cost_model = plan["cfg"], plan["spec"], plan["table"], plan["cost_model"]
    p, results, pool = args.world_size, [], None
    try:
        if args.cost == "simulated":
            if cost_model is None:
                if not args.json:
                    print("calibrating the cost model on this machine (1 thread) ...", flush=True)
                cost_model = CostModel.calibrate(cfg, attention=spec.attention)
            if args.bandwidth:
                cost_model = cost_model.with_link(args.bandwidth * 1e9)
            elif not args.cost_model:
                from .parallel import measure_link

                link = measure_link()
                if not args.json:
                    print(f"link between two processes: {link.describe()}", flush=True)
                cost_model = cost_model.with_(**link.cost_model_fields)
        else:
            from .launch import WorkerPool

            pool = WorkerPool(p, threads_per_rank=1, timeout_s=1800)
        for C in args.context:
            if pool is not None:
                from .parallel import measured_cost

                ids = random_prompt(C, cfg.vocab_size)
                cost = measured_cost(spec, ids, pool, repeat=args.repeat or 2)
            else:
                cost = ttft_cost(cfg, cost_model, "kvr")
            found = search_partition(cost, C, p, min_stride=args.min_stride, progress=not args.json)
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
        from .bench import cpu_name

        command = (f"python -m toyllm search --model {args.model} --context {','.join(map(str, args.context))} "
                   f"--world-size {p} --attention {spec.attention} --cost {args.cost}")
        runs = ("simulated cost" if pool is None
                else f"{p} processes with 1 thread each, median of {args.repeat or 2} runs per partition")
        found = (f"Searched with `{command}` on {time.strftime('%Y-%m-%d')}: {runs}; {cpu_name()}, "
                 f"{os.cpu_count()} logical CPUs, torch {torch.__version__}.")
        # A table grown over several searches keeps how each of its entries was found.
        table.about = f"{table.about} Then: {found}" if table.about else found
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


def cmd_serve(args, prepared: tuple) -> int:
    from .serving import serve

    model, workload, policies = prepared
    results = {p: serve(model, workload, p, max_batch=args.max_batch, token_budget=args.token_budget,
                        block_size=args.block_size, share_prefixes=args.share_prefixes, progress=not args.json)
               for p in policies}
    rows = {p: {"throughput_tok_per_s": r.throughput, "clock_s": r.clock_s, "compute_s": r.compute_s,
                "ttft_p50_s": r.percentile("ttft_s", 50), "ttft_p99_s": r.percentile("ttft_s", 99),
                "tpot_p50_s": r.percentile("tpot_s", 50), "tpot_p99_s": r.percentile("tpot_s", 99),
                "iterations": len(r.iteration_tokens), "output_tokens": r.output_tokens}
            for p, r in results.items()}
    if args.json:
        print(json.dumps({"model": args.model, "requests": args.requests, "rate_per_s": args.rate,
                          "max_batch": args.max_batch, "token_budget": args.token_budget,
                          "block_size": args.block_size, "seed": args.seed, "policies": rows}))
        return 0
    print(f"{args.requests} requests at {args.rate:g}/s on {args.model} (seed {args.seed}), batch of "
          f"{args.max_batch}, times on a clock of measured compute (seconds)")
    print(f"{'policy':<11} {'tokens/s':>9} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} {'TPOT p99':>9} "
          f"{'iterations':>10}")
    for p, row in rows.items():
        print(f"{p:<11} {row['throughput_tok_per_s']:9.1f} {row['ttft_p50_s']:9.3f} {row['ttft_p99_s']:9.3f} "
              f"{row['tpot_p50_s']:9.4f} {row['tpot_p99_s']:9.4f} {row['iterations']:10d}")
    return 0


def cmd_bench(args, _prepared=None) -> int:
    from .bench import run_benchmarks

    run_benchmarks(args.out, sections=args.only, quick=args.quick)
    return 0


def cmd_grade(args, _prepared=None) -> int:
    from . import grading

    return grading.main(args)   # checks its own input: bad input is one line and exit code 2 there too
