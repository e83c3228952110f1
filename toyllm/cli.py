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
from .attention import ATTENTION_KERNELS
from .cache import CACHES
from .model import PRESETS, get_config
from .utils import TextStreamer, random_prompt

# More processes than this per core only time-slice the same cores (and, with gloo,
# can run into the process-group timeout); --force lifts the limit.
MAX_PROCESSES_PER_CORE = 2


def _check(ok: bool, message: str) -> None:
    """A user error: one line on stderr and exit code 2 (see ``main``)."""
    if not ok:
        raise ValueError(message)


def _json_file(path: str, what: str) -> dict:
    """The JSON object in ``path``; a one-line error naming the file and what is wrong with it."""
    from pathlib import Path

    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ValueError(f"{what} file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{what} file {path} cannot be read: {e}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{what} file {path} is not valid JSON: {e}") from None
    _check(isinstance(data, dict), f"{what} file {path} must hold a JSON object, found {type(data).__name__}")
    return data


def _from_file(build, path: str, what: str):
    """``build(json object)`` for the file ``path``; any malformed content becomes one line naming the file."""
    data = _json_file(path, what)
    try:
        return build(data)
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{what} file {path} is not a valid {what.lstrip('-').replace('-', ' ')}: "
                         f"{e.__class__.__name__}: {e}") from None


def _output_folder_exists(path: str, flag: str) -> None:
    """Reject an output path whose folder is missing before any long work starts, so no result is lost."""
    from pathlib import Path

    folder = Path(path).resolve().parent
    _check(folder.is_dir(), f"{flag} {path}: the folder {folder} does not exist; create it first")


def _check_world_size(p: int, force: bool) -> None:
    limit = MAX_PROCESSES_PER_CORE * (os.cpu_count() or 1)
    _check(p >= 1, f"--world-size must be at least 1, got {p}")
    _check(p <= limit or force, f"--world-size {p} is more than {MAX_PROCESSES_PER_CORE} processes per core on this "
                                f"machine ({os.cpu_count()} cores, limit {limit}); add --force to start them anyway, "
                                "or use torchrun across machines")


def _encode_prompt(tokenizer, prompt: str, chat: bool) -> list[int]:
    if not prompt:
        raise ValueError("prompt is empty: pass --prompt with some text")
    return tokenizer.encode_chat(prompt) if chat else tokenizer.encode(prompt)


def cmd_generate(args) -> int:
    from . import generate, load_model

    _check(args.max_new_tokens >= 0, f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    if args.method == "naive":
        _check(args.cache == "dynamic", "--cache applies to --method cached; naive generation keeps no cache")
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


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad command line is a ValueError: ``main`` prints it as one line, exit code 2."""

    def error(self, message):
        raise ValueError(f"{self.prog}: {message}")


def build_parser() -> argparse.ArgumentParser:
    from .bench import SECTIONS as BENCH_SECTIONS
    from .generation import METHODS as GENERATION_METHODS
    from .launch import BACKENDS
    from .parallel import METHODS as PREFILL_METHODS
    from .parallel import TSP_BALANCES

    p = _Parser(prog="python -m toyllm", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)

    sub.add_parser("demo", help="the main job: a SmolLM2 chat answer, then what the KV cache buys")

    g = sub.add_parser("generate", help="generate text with a model")
    g.add_argument("--model", default="smollm2-135m", choices=sorted(PRESETS), help="model preset")
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--method", choices=list(GENERATION_METHODS), default="cached")
    g.add_argument("--cache", choices=sorted(CACHES), default="dynamic")
    g.add_argument("--attention", choices=sorted(ATTENTION_KERNELS), default="dense")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")

    f = sub.add_parser("prefill", help="prefill a random prompt on one or several processes (single, tsp, kvr)",
                       description="Run under torchrun too: torchrun --nproc-per-node=P -m toyllm prefill ...")
    f.add_argument("--model", default="tiny", choices=sorted(PRESETS), help="model preset")
    f.add_argument("--context", type=int, required=True, help="prompt length in tokens")
    f.add_argument("--method", choices=list(PREFILL_METHODS), default="kvr")
    f.add_argument("--world-size", type=int, default=None, help="number of processes (default 2; single: 1)")
    f.add_argument("--force", action="store_true", help=f"allow more than {MAX_PROCESSES_PER_CORE} processes per core")
    f.add_argument("--balance", choices=list(TSP_BALANCES), default="none",
                   help="TSP: attend over all keys (none), only visible ones (trim), or zigzag layout")
    f.add_argument("--partition", type=_int_list, default=None, help="tokens per rank, e.g. 5000,3192")
    f.add_argument("--partition-table", default=None, help="JSON table of searched partitions (KVR-P)")
    f.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=True,
                   help="KVR: overlap communication with compute (isend/irecv)")
    f.add_argument("--repeat", type=int, default=3, help="timed runs after one warm-up, in the same processes")
    f.add_argument("--threads", type=int, default=1, help="intra-op threads per process")
    f.add_argument("--attention", choices=sorted(ATTENTION_KERNELS), default="dense")
    f.add_argument("--bandwidth", type=float, default=None, help="simulated link bandwidth in GB/s")
    f.add_argument("--latency", type=float, default=0.0, help="simulated link latency in seconds")
    f.add_argument("--noise", type=float, default=0.0, help="relative noise on the link between ranks 0 and 1")
    f.add_argument("--backend", choices=list(BACKENDS), default="auto")
    f.add_argument("--decode", type=int, default=0, help="greedy tokens to decode after the prefill")
    f.add_argument("--seed", type=int, default=0, help="seed of the random prompt")
    f.add_argument("--check", action="store_true", help="also prefill on one process and report the logit difference")
    f.add_argument("--timeout", type=float, default=600.0, help="wall-clock limit in seconds")
    f.add_argument("--json", action="store_true")

    s = sub.add_parser("search", help="search the best KVR partition (simulated or measured cost)")
    s.add_argument("--model", default="bench", choices=sorted(PRESETS), help="model preset")
    s.add_argument("--context", type=_int_list, required=True, help="prompt length(s) in tokens, e.g. 4096,8192")
    s.add_argument("--world-size", type=int, default=2)
    s.add_argument("--force", action="store_true", help=f"allow more than {MAX_PROCESSES_PER_CORE} processes per core")
    s.add_argument("--attention", choices=sorted(ATTENTION_KERNELS), default="dense",
                   help="the kernel whose cost is searched (measured runs, or the calibrated cost model)")
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
    b.add_argument("--only", choices=list(BENCH_SECTIONS), action="append",
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
    cfg = get_config(args.model)
    _check_prefill_flags(args, cfg, launched_by_torchrun())
    ids = random_prompt(args.context, cfg.vocab_size, args.seed)
    p = 1 if args.method == "single" else (args.world_size or 2)
    partition = args.partition
    if args.partition_table:
        table = _from_file(PartitionTable.from_dict, args.partition_table, "--partition-table")
        _check(table.world_size == p, f"--partition-table {args.partition_table} is for {table.world_size} "
                                      f"processes, not {p}")
        partition = table.predict(args.context)
    link = (LinkModel(args.bandwidth, args.latency, (0, 1) if args.noise else None, args.noise)
            if args.bandwidth is not None else None)
    if launched_by_torchrun():
        from .parallel import check_prefill_request

        chunks = check_prefill_request(spec, ids, args.method, int(os.environ["WORLD_SIZE"]), partition)
        result = torchrun_main(spec, ids, args.method, chunks, overlap=args.overlap, link=link, repeat=args.repeat,
                               warmup=1, backend=args.backend, timeout_s=args.timeout)
        if result is None:      # not rank 0: rank 0 reports
            return 0
    else:
        result = parallel_prefill(spec, ids, args.method, p, partition, overlap=args.overlap, balance=args.balance,
                                  link=link, repeat=args.repeat, threads_per_rank=args.threads,
                                  backend=args.backend, decode_tokens=args.decode, timeout_s=args.timeout)
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


def _check_prefill_flags(args, cfg, torchrun: bool) -> None:
    """Every prefill flag checked before any process starts; nothing silently ignored."""
    C = args.context
    _check(C >= 1, f"--context must be at least 1 token, got {C}")
    _check(C <= cfg.max_context, f"--context {C} is longer than {args.model}'s max_context ({cfg.max_context} tokens)")
    _check(args.decode >= 0, f"--decode must be >= 0 tokens, got {args.decode}")
    _check(C + args.decode <= cfg.max_context, f"--context {C} + --decode {args.decode} exceeds {args.model}'s "
                                                f"max_context ({cfg.max_context} tokens)")
    _check(args.repeat >= 1, f"--repeat must be at least 1, got {args.repeat}")
    _check(args.threads >= 1, f"--threads must be at least 1, got {args.threads}")
    _check(args.timeout > 0, f"--timeout must be > 0 seconds, got {args.timeout}")
    if args.bandwidth is None:
        _check(not args.latency and not args.noise, "--latency and --noise describe the simulated link: "
                                                    "give --bandwidth too")
    else:
        _check(args.bandwidth > 0 and args.bandwidth != float("inf"),
               f"--bandwidth must be a finite number of GB/s > 0, got {args.bandwidth}")
        _check(args.latency >= 0 and args.noise >= 0, "--latency and --noise must be >= 0")
        _check(args.method != "single", "--bandwidth simulates the link between processes; --method single has none")
    _check(args.partition is None or args.partition_table is None,
           "give either --partition or --partition-table, not both")
    if args.method == "single":
        _check(args.world_size in (None, 1), f"--method single runs one process; drop --world-size {args.world_size}")
        _check(args.partition is None and args.partition_table is None,
               "--method single has nothing to partition; drop --partition / --partition-table")
    _check(args.overlap or args.method == "kvr", "--no-overlap applies to --method kvr only")
    _check(args.balance == "none" or args.method == "tsp", "--balance applies to --method tsp only")
    if torchrun:
        _check(args.world_size is None, "under torchrun the world size comes from --nproc-per-node; "
                                        "drop --world-size")
        _check(args.decode == 0, "--decode is not supported under torchrun; run without torchrun to decode")
        _check(args.bandwidth is None, "--bandwidth (a simulated link on one machine) is not supported under torchrun")
    elif args.method != "single":
        _check_world_size(args.world_size or 2, args.force)


def cmd_search(args) -> int:
    from pathlib import Path

    from .partition import PartitionTable, search_partition
    from .simulate import CostModel, ttft_cost

    cfg, p = get_config(args.model), args.world_size
    _check(p >= 2, f"--world-size must be at least 2 to have a partition to search, got {p}")
    for C in args.context:
        _check(p <= C <= cfg.max_context, f"--context {C}: {args.model} runs contexts of {p} to "
                                          f"{cfg.max_context} tokens on {p} processes")
    _check(args.min_stride is None or args.min_stride >= 1, f"--min-stride must be >= 1 token, got {args.min_stride}")
    _check(args.repeat >= 1, f"--repeat must be at least 1, got {args.repeat}")
    if args.cost == "measured":
        _check_world_size(p, args.force)
        _check(args.cost_model is None and args.bandwidth is None,
               "--cost-model and --bandwidth shape the simulated cost; --cost measured times real runs")
    else:
        _check(args.bandwidth is None or args.bandwidth > 0, f"--bandwidth must be > 0 GB/s, got {args.bandwidth}")
    table = None
    if args.table:
        _output_folder_exists(args.table, "--table")
        table = (_from_file(PartitionTable.from_dict, args.table, "--table") if Path(args.table).exists()
                 else PartitionTable(p))
        _check(table.world_size == p, f"--table {args.table} is a table for {table.world_size} processes, not {p}")
    pool, cost_model, results = None, None, []
    try:
        if args.cost == "simulated":
            if args.cost_model:
                cost_model = _from_file(CostModel.from_dict, args.cost_model, "--cost-model")
            else:
                if not args.json:
                    print("calibrating the cost model on this machine (1 thread) ...", flush=True)
                cost_model = CostModel.calibrate(cfg, attention=args.attention)
            if args.bandwidth:
                cost_model = cost_model.with_(link_bandwidth_bytes_per_s=args.bandwidth * 1e9)
        else:
            from .launch import WorkerPool

            pool = WorkerPool(p, threads_per_rank=1, timeout_s=1800)
        for C in args.context:
            if pool is not None:
                from .parallel import ModelSpec, measured_cost

                ids = random_prompt(C, cfg.vocab_size)
                cost = measured_cost(ModelSpec(args.model, attention=args.attention), ids, pool, repeat=args.repeat)
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

    _output_folder_exists(args.out, "--out")
    run_benchmarks(args.out, sections=args.only, quick=args.quick)
    return 0


COMMANDS = {"generate": cmd_generate, "demo": cmd_demo, "prefill": cmd_prefill, "search": cmd_search,
            "bench": cmd_bench, "grade": grading.main}


def main(argv: list[str] | None = None) -> int:
    torch.set_grad_enabled(False)
    try:
        args = build_parser().parse_args(argv)
        return COMMANDS[args.command](args)
    except ValueError as e:   # bad input: one clear line, not a traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
