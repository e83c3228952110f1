"""Command line: ``python -m toyllm <command> ...``.

Commands: demo, generate, prefill, search, serve, bench, grade, cache. Every command that
measures something accepts ``--json`` and then prints one JSON object.

Each command is two functions: ``check_*`` turns the flags into what the work
needs and raises ValueError for every user error (one line on stderr, exit
code 2, no process started), using the library's own checks where the rule
lives there; ``cmd_*`` (in ``toyllm.commands``) does the work, where an
exception is a failure or a bug and keeps its traceback. This module only
parses, checks and dispatches.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch

from . import answers, grading
from .attention import ATTENTION_KERNELS
from .cache import CACHES
from .commands import cmd_bench, cmd_cache, cmd_demo, cmd_generate, cmd_grade, cmd_prefill, cmd_search, cmd_serve
from .measure import usable_cores
from .model import PRESETS, get_config
from .quant import WEIGHT_FORMATS
from .serving import POLICIES as SERVING_POLICIES
from .utils import random_prompt

# More processes than this per core only time-slice the same cores (and, with gloo,
# can run into the process-group timeout); --force lifts the limit.
MAX_PROCESSES_PER_CORE = 2
MAX_SEED = 2**63 - 1          # torch.manual_seed takes a 64-bit integer; seeds are 0 .. 2**63-1
MAX_TIMEOUT_S = 86400.0       # --timeout: at most one day (inf or a huge one overflows the process-group timeout)
MAX_NOISE = 1.0               # --noise: a standard deviation of 100 percent of the modelled time at most


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


def _check_output_file(path: str, flag: str) -> None:
    """Reject an output path that is a folder, or whose folder is missing, before any long work starts."""
    from pathlib import Path

    _check(not Path(path).is_dir(), f"{flag} {path} is a folder; give the path of a file to write")
    folder = Path(path).resolve().parent
    _check(folder.is_dir(), f"{flag} {path}: the folder {folder} does not exist; create it first")


def _check_seed(seed: int | None) -> None:
    _check(seed is None or 0 <= seed <= MAX_SEED, f"--seed {seed}: a seed is an integer from 0 to 2**63-1 "
                                                  f"({MAX_SEED})")


def _check_process_limit(p: int, force: bool) -> None:
    """The one rule the library does not know: how many local processes this machine can usefully run."""
    limit = MAX_PROCESSES_PER_CORE * (os.cpu_count() or 1)
    _check(p <= limit or force, f"--world-size {p} is more than {MAX_PROCESSES_PER_CORE} processes per core on this "
                                f"machine ({os.cpu_count()} cores, limit {limit}); add --force to start them anyway, "
                                "or use torchrun across machines")


def _check_context(C: int, cfg, model: str) -> None:
    """--context must be a prompt the model can hold; checked first, because the random prompt is built from it."""
    _check(1 <= C <= cfg.max_context, f"--context {C}: {model} runs contexts of 1 to {cfg.max_context} tokens")


def _check_request(what: str, check, *call_args, **kwargs):
    """Run a library check (one place per rule) and name the flags behind a failure."""
    try:
        return check(*call_args, **kwargs)
    except ValueError as e:
        raise ValueError(f"{what}: {e}") from None


def check_generate(args) -> tuple:
    """Every generate flag and the request itself, checked before any token is computed.

    Returns (model, tokenizer, prompt ids) for ``cmd_generate``.
    """
    from . import load_model
    from .generation import check_sampling

    n, vocab = args.max_new_tokens, get_config(args.model).vocab_size
    _check(n >= 1, f"--max-new-tokens {n}: generate at least 1 new token")
    _check_seed(args.seed)
    _check(args.top_k is None or 1 <= args.top_k <= vocab,
           f"--top-k {args.top_k}: top-k must be between 1 and {args.model}'s vocabulary size ({vocab})")
    if args.compile != "off":
        _check(args.method == "cached" and args.cache is None and args.headroom == 0,
               f"--compile {args.compile} runs the cached method with the compiled step's own fixed-size cache; "
               "leave out --method naive, --cache and --headroom")
        _check(args.attention == "dense", f"--compile {args.compile} runs PyTorch's fused attention kernel; "
                                          f"--attention {args.attention} applies to --compile off")
    _check(not args.no_cache or args.compile != "off",
           "--no-cache applies to a compiled step: give it with --compile jit or --compile ahead")
    args.cache = args.cache or ("dynamic" if args.compile == "off" else "static")   # the compiled step's is static
    if args.method == "naive":
        _check(args.cache == "dynamic", "--cache applies to --method cached; naive generation keeps no cache")
    _check(args.headroom >= 0, f"--headroom must be >= 0 rows, got {args.headroom}")
    _check(args.headroom == 0 or (args.method == "cached" and args.cache == "dynamic"),
           "--headroom applies to the growing cache: give it with --method cached --cache dynamic")
    check_sampling(args.temperature, args.top_k, args.top_p)
    if args.temperature == 0:
        unused = [flag for flag, value in (("--top-k", args.top_k), ("--top-p", args.top_p), ("--seed", args.seed))
                  if value is not None]
        _check(not unused, f"{' and '.join(unused)} only matter when sampling, and --temperature 0 decodes "
                           "greedily; give --temperature > 0 or leave them out")
    _check(bool(args.prompt), "prompt is empty: pass --prompt with some text")
    try:
        args.prompt.encode("utf-8")
    except UnicodeEncodeError as e:   # bytes that are not UTF-8 reach sys.argv as lone surrogates
        char = ord(e.object[e.start])
        what = f"byte 0x{char - 0xdc00:02x}" if 0xdc80 <= char <= 0xdcff else f"character U+{char:04X}"
        raise ValueError(f"--prompt is not valid UTF-8 text ({what} at position {e.start}); "
                         "pass UTF-8 text") from None
    model, tokenizer = _check_request(f"--model {args.model}", load_model, args.model, attention=args.attention,
                                      weights=args.weights)
    if args.compile == "ahead":
        from .compiled import check_ahead_of_time

        _check_request(f"--compile ahead --weights {args.weights}", check_ahead_of_time, model)
    # Only a real model's tokenizer carries a chat template; the byte tokenizer's "role: text" lines mean
    # nothing to a randomly initialised model.
    _check(not args.chat or getattr(tokenizer, "chat_template", None) is not None,
           f"--chat: {args.model}'s tokenizer has no chat template; leave out --chat to send the prompt as "
           "plain text, or pick a model that has one (smollm2-135m)")
    ids = tokenizer.encode_chat(args.prompt) if args.chat else tokenizer.encode(args.prompt)
    limit = model.config.max_context
    _check(len(ids) <= limit, f"--prompt is {len(ids)} tokens, longer than {args.model}'s max_context ({limit})")
    _check(len(ids) + n <= limit, f"--max-new-tokens {n}: the prompt ({len(ids)} tokens) + {n} new tokens exceed "
                                  f"{args.model}'s max_context ({limit}); ask for at most {limit - len(ids)}")
    return model, tokenizer, ids


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad command line is a ValueError: ``main`` prints it as one line, exit code 2."""

    def error(self, message):
        raise ValueError(f"{self.prog}: {message}")


def build_parser() -> argparse.ArgumentParser:
    from .bench import SECTIONS as BENCH_SECTIONS
    from .generation import METHODS as GENERATION_METHODS
    from .launch import BACKENDS
    from .parallel import METHODS as PREFILL_METHODS
    from .parallel import RING_PASSES, TSP_BALANCES

    p = _Parser(prog="python -m toyllm", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser("demo", help="the main job: a SmolLM2 chat answer, then what the KV cache buys")
    d.add_argument("--weights", choices=list(WEIGHT_FORMATS), default="fp32", help="weight format of the chat answer")

    g = sub.add_parser("generate", help="generate text with a model")
    g.add_argument("--model", default="smollm2-135m", choices=sorted(PRESETS), help="model preset")
    g.add_argument("--prompt", default="Once upon a time",
                   help="the text to continue (default: %(default)r, the benchmarks' prompt)")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--method", choices=list(GENERATION_METHODS), default="cached")
    g.add_argument("--cache", choices=sorted(CACHES), default=None, help="the eager KV cache (default dynamic)")
    g.add_argument("--headroom", type=int, default=0, metavar="ROWS",
                   help="spare rows the growing cache keeps per sequence: it copies itself every ROWS + 1 "
                        "tokens instead of every token (0: torch.cat every token)")
    g.add_argument("--attention", choices=sorted(ATTENTION_KERNELS), default="dense")
    g.add_argument("--weights", choices=list(WEIGHT_FORMATS), default="fp32",
                   help="weight format of the linear layers (fewer bytes: faster decoding)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=None,
                   help="sample among the k most likely tokens (1 to the vocabulary size)")
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--seed", type=int, default=None, help="seed of the sampler, 0 to 2**63-1")
    g.add_argument("--compile", choices=["off", "jit", "ahead"], default="off",
                   help="run the decode steps compiled: jit (torch.compile) or ahead (AOTInductor, weights fp32, "
                        "int8 or int4); the compiled step is kept in the cache folder (python -m toyllm cache list)")
    g.add_argument("--no-cache", action="store_true",
                   help="compile the step afresh and keep nothing in the cache folder")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")

    f = sub.add_parser("prefill", help="prefill a random prompt on one or several processes (single, tsp, kvr, ring)",
                       description="Run under torchrun too: torchrun --nproc-per-node=P -m toyllm prefill ... "
                                   "(there without --world-size, --force, --decode, --bandwidth, --balance, "
                                   "--pass and --cached)")
    f.add_argument("--model", default="tiny", choices=sorted(PRESETS), help="model preset")
    f.add_argument("--context", type=int, required=True, help="prompt length in tokens (after any --cached ones)")
    f.add_argument("--method", choices=list(PREFILL_METHODS), default="kvr")
    f.add_argument("--world-size", type=int, default=None, help="number of processes (default 2; single: 1)")
    f.add_argument("--force", action="store_true", help=f"allow more than {MAX_PROCESSES_PER_CORE} processes per core")
    f.add_argument("--balance", choices=list(TSP_BALANCES), default="none",
                   help="TSP: attend over all keys (none), only visible ones (trim), or zigzag layout; "
                        "ring: none or zigzag")
    f.add_argument("--pass", dest="ring_pass", choices=list(RING_PASSES), default=None,
                   help="ring: what travels round the ring, keys and values (kv, the default) or queries (q)")
    f.add_argument("--cached", type=int, default=0,
                   help="ring: tokens of the prompt already cached on the ranks, before the --context new ones "
                        "(--pass q needs them; --pass kv sends them round with the new tokens' keys and values)")
    f.add_argument("--partition", type=_int_list, default=None, help="tokens per rank, e.g. 5000,3192")
    f.add_argument("--partition-table", default=None,
                   help="JSON table of searched partitions (KVR-P); default for --method kvr: the table shipped "
                        "for this model, kernel and number of processes, if there is one")
    f.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=True,
                   help="KVR: overlap communication with compute (isend/irecv)")
    f.add_argument("--repeat", type=int, default=3, help="timed runs after one warm-up, in the same processes")
    f.add_argument("--threads", type=int, default=1,
                   help="intra-op threads per process (at most the cores this process may use)")
    f.add_argument("--attention", choices=sorted(ATTENTION_KERNELS), default="dense")
    f.add_argument("--bandwidth", type=float, default=None, help="simulated link bandwidth in GB/s")
    f.add_argument("--latency", type=float, default=0.0, help="simulated link latency in seconds")
    f.add_argument("--noise", type=float, default=0.0,
                   help=f"noise on the link between ranks 0 and 1, 0 to {MAX_NOISE:g}: the standard deviation of "
                        "the relative slow-down (each message takes 1 + |N(0, noise)| times its modelled time)")
    f.add_argument("--backend", choices=list(BACKENDS), default=None, help="process group backend (default auto)")
    f.add_argument("--decode", type=int, default=0, help="greedy tokens to decode after the prefill")
    f.add_argument("--seed", type=int, default=0, help="seed of the random prompt, 0 to 2**63-1")
    f.add_argument("--check", action="store_true", help="also prefill on one process and compare the first-token logits: exit 1 when they "
                        "differ by more than 1e-4 x the largest |logit| (at least 1e-4)")
    f.add_argument("--timeout", type=float, default=None,
                   help=f"wall-clock limit in seconds, > 0 and at most {MAX_TIMEOUT_S:g} (default 600)")
    f.add_argument("--json", action="store_true")

    s = sub.add_parser("search", help="search the best KVR partition (simulated or measured cost)")
    s.add_argument("--model", default="bench", choices=sorted(PRESETS), help="model preset")
    s.add_argument("--context", type=_int_list, required=True, help="prompt length(s) in tokens, e.g. 4096,8192")
    s.add_argument("--world-size", type=int, default=2)
    s.add_argument("--force", action="store_true",
                   help=f"measured cost: allow more than {MAX_PROCESSES_PER_CORE} processes per core")
    s.add_argument("--attention", choices=sorted(ATTENTION_KERNELS), default=None,
                   help="the kernel whose cost is searched (measured runs, or the calibrated cost model; "
                        "default dense)")
    s.add_argument("--cost", choices=["simulated", "measured"], default="simulated")
    s.add_argument("--min-stride", type=int, default=None,
                   help="finest boundary step in tokens, 1 to the context (default C/256)")
    s.add_argument("--repeat", type=int, default=None, help="measured cost: timed runs per partition (default 2)")
    s.add_argument("--cost-model", default=None,
                   help="simulated cost: CostModel JSON (default: calibrate now and measure the link)")
    s.add_argument("--bandwidth", type=float, default=None, help="link bandwidth in GB/s (simulated link)")
    s.add_argument("--table", default=None, help="add the results to this partition table (JSON; created if missing)")
    s.add_argument("--json", action="store_true")

    v = sub.add_parser("serve", help="serve a seeded workload of many requests: static, continuous or chunked "
                                     "batching over a paged KV cache")
    v.add_argument("--model", default="tiny", choices=sorted(PRESETS), help="model preset")
    v.add_argument("--policy", choices=[*SERVING_POLICIES, "all"], default="all",
                   help="how requests share the iterations (default: all three, on the same workload)")
    v.add_argument("--requests", type=int, default=32, help="requests in the workload (1 to 10000)")
    v.add_argument("--rate", type=float, default=20.0, help="arrivals per second (a Poisson process), > 0")
    v.add_argument("--prompt-tokens", type=int, nargs=2, default=(16, 128), metavar=("MIN", "MAX"),
                   help="prompt lengths, uniform in [MIN, MAX] tokens")
    v.add_argument("--new-tokens", type=int, nargs=2, default=(8, 64), metavar=("MIN", "MAX"),
                   help="answer lengths, uniform in [MIN, MAX] tokens")
    v.add_argument("--shared-prefix", type=int, default=0, help="tokens of a system prompt every prompt starts with")
    v.add_argument("--share-prefixes", action="store_true", help="reuse the cached blocks of a shared prefix")
    v.add_argument("--max-batch", type=int, default=8, help="sequences running at once")
    v.add_argument("--token-budget", type=int, default=64, help="tokens per iteration (chunked policy)")
    v.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    v.add_argument("--seed", type=int, default=0, help="seed of the workload, 0 to 2**63-1")
    v.add_argument("--json", action="store_true", help="print one JSON object instead of a table")

    grading.add_arguments(sub.add_parser("grade", help="grade the exercises: points per exercise, Gradescope results.json"))

    c = sub.add_parser("cache", help="the compiled decode steps kept on disk: list them, or clear the folder",
                       description="The folder: $TOYLLM_CACHE, else the user's cache folder (toyllm.compile_cache).")
    c.add_argument("action", choices=["list", "clear"])
    c.add_argument("--json", action="store_true")

    b = sub.add_parser("bench", help="run the benchmarks and write their tables to a Markdown file")
    b.add_argument("--out", default="docs/benchmarks.md", help="the Markdown file to (re)write; its folder must exist")
    b.add_argument("--only", choices=list(BENCH_SECTIONS), action="append",
                   help="run only these sections (repeatable); default: all. weights and llama_prefill time "
                        "llama.cpp beside toyllm where llama-cpp-python is installed (the interpreter named by "
                        "$TOYLLM_LLAMA_PYTHON, else this one); without it they say how to install it")
    b.add_argument("--quick", action="store_true", help="fewer repeats and sizes (a smoke run, not for docs)")
    return p


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers like 5000,3192, got {text!r}")


def check_prefill(args) -> dict:
    """Every prefill flag checked before any process starts; nothing silently ignored.

    Returns what ``cmd_prefill`` needs: the model spec, the prompt, the chunks per rank and the link.
    """
    from .launch import _resolve_backend, launched_by_torchrun
    from .parallel import LinkModel, ModelSpec, check_prefill_request
    from .partition_table import PartitionTable, shipped_table, shipped_table_path

    torchrun, single = launched_by_torchrun(), args.method == "single"
    cfg = get_config(args.model)
    _check_context(args.context, cfg, args.model)
    _check(args.repeat >= 1, f"--repeat must be at least 1, got {args.repeat}")
    cores = usable_cores()
    _check(1 <= args.threads <= cores, f"--threads {args.threads}: threads per process must be 1 to {cores}, "
                                       "the cores this process may use")
    _check(args.timeout is None or 0 < args.timeout <= MAX_TIMEOUT_S,   # nan and inf fail too
           f"--timeout must be > 0 seconds and at most {MAX_TIMEOUT_S:g} (one day), got {args.timeout}")
    _check_seed(args.seed)
    if args.bandwidth is None:
        _check(not args.latency and not args.noise, "--latency and --noise describe the simulated link: "
                                                    "give --bandwidth too")
    else:
        _check(args.bandwidth > 0 and args.bandwidth != float("inf"),
               f"--bandwidth must be a finite number of GB/s > 0, got {args.bandwidth}")
        _check(0 <= args.latency < float("inf") and 0 <= args.noise < float("inf"),
               f"--latency and --noise must be finite numbers >= 0, got {args.latency} and {args.noise}")
        _check(args.noise <= MAX_NOISE, f"--noise {args.noise}: noise is the standard deviation of the relative "
                                        f"slow-down of a message, 0 to {MAX_NOISE:g} (1 + |N(0, noise)| times "
                                        "the modelled time)")
        _check(not single, "--bandwidth simulates the link between processes; --method single has none")
    _check(args.partition is None or args.partition_table is None,
           "give either --partition or --partition-table, not both")
    _check(args.overlap or args.method == "kvr", "--no-overlap applies to --method kvr only")
    _check(args.cached >= 0, f"--cached must be a number of tokens >= 0, got {args.cached}")
    _check(args.ring_pass is None or args.method == "ring", f"--pass {args.ring_pass} chooses what ring attention "
                                                            "sends round: give it with --method ring")
    _check(args.cached == 0 or args.method == "ring",
           f"--cached {args.cached}: tokens already cached on the ranks are continued by --method ring only")
    if single:
        _check(args.partition is None and args.partition_table is None,
               "--method single has nothing to partition; drop --partition / --partition-table")
        _check(args.backend is None and args.timeout is None and not args.force,
               "--backend, --timeout and --force apply to worker processes; --method single runs in this process")
    if torchrun:
        _check(args.world_size is None, "under torchrun the world size comes from --nproc-per-node; "
                                        "drop --world-size")
        _check(not args.force, "--force lifts the --world-size limit; under torchrun there is none")
        _check(args.decode == 0, "--decode is not supported under torchrun; run without torchrun to decode")
        _check(args.bandwidth is None, "--bandwidth (a simulated link on one machine) is not supported under torchrun")
        _check(args.balance == "none", "--balance is not supported under torchrun; run without torchrun")
        _check(args.ring_pass != "q", "--pass q is not supported under torchrun; run without torchrun")
    p = (int(os.environ["WORLD_SIZE"]) if torchrun else args.world_size if args.world_size is not None
         else 1 if single else 2)
    if args.backend not in (None, "auto"):   # nccl needs a GPU per rank of this machine
        local_ranks = (int(os.environ.get("LOCAL_WORLD_SIZE", int(os.environ["LOCAL_RANK"]) + 1)) if torchrun
                       else p)
        _check_request(f"--backend {args.backend}", _resolve_backend, args.backend, local_ranks)
    partition, partition_from = args.partition, "--partition" if args.partition else None
    if args.partition_table:
        table = _from_file(PartitionTable.from_dict, args.partition_table, "--partition-table")
        _check(table.world_size == p, f"--partition-table {args.partition_table} is for {table.world_size} "
                                      f"processes, not {p}")
        partition = _check_request(f"--partition-table {args.partition_table}", table.predict, args.context)
        partition_from = f"--partition-table {args.partition_table}"
    elif partition is None and args.method == "kvr" and args.balance == "none":
        table = shipped_table(args.model, args.attention, p)      # searched on real runs, shipped with toyllm
        if table is not None:
            partition = table.predict(args.context)
            partition_from = (f"the shipped table {shipped_table_path(args.model, args.attention, p).name} "
                              f"(contexts {table.contexts}; --partition or --partition-table to choose your own)")
    spec = ModelSpec(args.model, attention=args.attention)
    ids = random_prompt(args.cached + args.context, cfg.vocab_size, args.seed)
    flags = [f"--model {args.model}", f"--context {args.context}", f"--method {args.method}"]
    flags += [f"--world-size {args.world_size}"] if args.world_size is not None else []
    flags += [f"--partition {','.join(map(str, args.partition))}"] if args.partition else []
    flags += [f"--balance {args.balance}"] if args.balance != "none" else []
    flags += [f"--decode {args.decode}"] if args.decode else []
    flags += [f"--pass {args.ring_pass}"] if args.ring_pass else []
    flags += [f"--cached {args.cached}"] if args.cached else []
    chunks = _check_request(" ".join(flags), check_prefill_request, spec, ids, args.method, p, partition,
                            decode_tokens=args.decode, balance=args.balance, ring_pass=args.ring_pass or "kv",
                            cached=args.cached)
    if not torchrun and not single:
        _check_process_limit(p, args.force)
    link = (LinkModel(args.bandwidth, args.latency, (0, 1) if args.noise else None, args.noise)
            if args.bandwidth is not None else None)
    return dict(spec=spec, ids=ids, world_size=p, partition=partition, partition_from=partition_from, chunks=chunks,
                link=link, torchrun=torchrun)


def check_search(args) -> dict:
    """Every search flag and file checked before the (possibly long) calibration or search starts."""
    from pathlib import Path

    from .parallel import ModelSpec, check_prefill_request
    from .partition_table import PartitionTable
    from .simulate import CostModel

    cfg, p, measured = get_config(args.model), args.world_size, args.cost == "measured"
    _check(p >= 2, f"--world-size must be at least 2 to have a partition to search, got {p}")
    spec = ModelSpec(args.model, attention=args.attention or "dense")
    _check(args.min_stride is None or args.min_stride >= 1, f"--min-stride must be >= 1 token, got {args.min_stride}")
    for C in args.context:   # the searched partition must be one prefill can run
        _check_context(C, cfg, args.model)
        _check_request(f"--context {C} --world-size {p}", check_prefill_request,
                       spec, random_prompt(C, cfg.vocab_size), "kvr", p)
        _check(args.min_stride is None or args.min_stride <= C,
               f"--min-stride {args.min_stride} is longer than --context {C}: the finest boundary step must be "
               f"1 to {C} tokens")
    if measured:
        _check(args.repeat is None or args.repeat >= 1, f"--repeat must be at least 1, got {args.repeat}")
        _check_process_limit(p, args.force)
        _check(args.cost_model is None and args.bandwidth is None,
               "--cost-model and --bandwidth shape the simulated cost; --cost measured times real runs")
    else:
        _check(args.repeat is None and not args.force,
               "--repeat and --force apply to --cost measured; the simulated search times no prefill")
        _check(args.bandwidth is None or 0 < args.bandwidth < float("inf"),
               f"--bandwidth must be a finite number of GB/s > 0, got {args.bandwidth}")
        _check(args.cost_model is None or args.attention is None,
               "--attention picks the kernel to calibrate; a --cost-model file was calibrated for its own kernel")
    table = None
    if args.table:
        _check_output_file(args.table, "--table")
        table = (_from_file(PartitionTable.from_dict, args.table, "--table") if Path(args.table).exists()
                 else PartitionTable(p))
        _check(table.world_size == p, f"--table {args.table} is a table for {table.world_size} processes, not {p}")
    cost_model = _from_file(CostModel.from_dict, args.cost_model, "--cost-model") if args.cost_model else None
    return dict(cfg=cfg, spec=spec, table=table, cost_model=cost_model)


def check_serve(args) -> tuple:
    """Every serve flag, the workload and the model, before any request runs; returns (model, workload, policies)."""
    from . import load_model
    from .serving import check_settings, poisson_workload

    _check(1 <= args.requests <= 10_000, f"--requests {args.requests}: give 1 to 10000 requests")
    _check(math.isfinite(args.rate) and args.rate > 0, f"--rate {args.rate}: arrivals per second must be finite "
                                                        "and > 0")
    _check_seed(args.seed)
    def as_flags(check, *call_args, **kwargs):      # the library's rule, its message in the flags' names
        try:
            return check(*call_args, **kwargs)
        except ValueError as e:
            message = str(e)
            for name in ("max_batch", "token_budget", "block_size", "prompt_tokens", "new_tokens", "shared_prefix"):
                message = message.replace(name, "--" + name.replace("_", "-"))
            raise ValueError(message) from None

    policies = list(SERVING_POLICIES) if args.policy == "all" else [args.policy]
    for policy in policies:
        as_flags(check_settings, policy, args.max_batch, args.token_budget, args.block_size)
    cfg = get_config(args.model)
    workload = as_flags(poisson_workload, args.requests, args.rate, cfg.vocab_size,
                        prompt_tokens=tuple(args.prompt_tokens), new_tokens=tuple(args.new_tokens),
                        shared_prefix=args.shared_prefix, seed=args.seed)
    longest = args.shared_prefix + args.prompt_tokens[1] + args.new_tokens[1]
    _check(longest <= cfg.max_context, f"--shared-prefix + --prompt-tokens MAX + --new-tokens MAX = {longest} "
                                       f"tokens, over {args.model}'s max_context ({cfg.max_context})")
    answers.require("8.1", "8.2", "8.3")           # every serving run plans its iterations, writes and reads a paged cache
    model, _ = _check_request(f"--model {args.model}", load_model, args.model)
    return model, workload, policies


def check_bench(args) -> None:
    _check_output_file(args.out, "--out")


def check_grade(args) -> None:
    from .grading.grader.cli import check_arguments

    check_arguments(args)


def _nothing_to_check(args) -> None:
    return None


# command -> (check, run): check raises ValueError for every user error before any work starts;
# run does the work, and an exception there is a failure (or a bug) and keeps its traceback.
COMMANDS = {"generate": (check_generate, cmd_generate), "demo": (_nothing_to_check, cmd_demo),
            "prefill": (check_prefill, cmd_prefill), "search": (check_search, cmd_search),
            "serve": (check_serve, cmd_serve), "bench": (check_bench, cmd_bench), "grade": (check_grade, cmd_grade),
            "cache": (_nothing_to_check, cmd_cache)}


def main(argv: list[str] | None = None) -> int:
    """Run one command. Exit code 0: done; 2: bad input (one line on stderr, nothing started);
    1: a worker process failed or the run hit its time limit (the message names the rank); 130: Ctrl-C;
    143: SIGTERM, 129: SIGHUP (unwound like Ctrl-C: every worker ended, one line, no traceback)."""
    from .supervise import Terminated, stop_signals_as_interrupt

    torch.set_grad_enabled(False)
    words = sys.argv[1:] if argv is None else argv
    try:
        with stop_signals_as_interrupt():
            return _main(argv)
    except Terminated as stop:                 # the launcher has already ended every worker
        print(f"{words[0] if words and words[0] in COMMANDS else 'toyllm'}: stopped ({stop})", file=sys.stderr)
        return 128 + stop.signum
    except KeyboardInterrupt:                  # the launcher has already ended every worker
        print("interrupted", file=sys.stderr)
        return 130


def _main(argv: list[str] | None) -> int:
    from .launch import WorkerError

    try:
        args = build_parser().parse_args(argv)
        check, run = COMMANDS[args.command]
        prepared = check(args)
    except (ValueError, answers.ExerciseNotWritten) as e:   # bad input: one clear line, not a traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        return run(args, prepared)
    except answers.ExerciseNotWritten as e:     # the student edition: the run needs an exercise not written yet
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (WorkerError, TimeoutError) as e:   # the message holds the failing rank's own traceback
        print(f"error: {e}", file=sys.stderr)
        return 1
