"""Trusted helpers that graded tests run next to the submission, with ``sandboxed(...)``.

They exist for work that must not cross the process boundary once per
step: calling a submitted function thousands of times, recording every
forward pass a submitted generation loop makes, or handing a submitted
per-layer step to the parallel engine's worker processes. They return
plain data only (numbers, lists, tensors, dataclass fields), which the
graded test then checks against references of its own::

    from toyllm.grading import sandboxed
    draws = sandboxed("toyllm.grading.sandbox.harness:repeat", ex01.sample_next_token, 400, logits, seed=0, top_k=3)

A helper runs inside the submission's process, so it checks nothing
itself: every verdict is the graded test's, in the trusted process. What
it can do there is keep the grading rules in force where the graded test
cannot see: ``parallel_prefill`` runs a submitted step in the engine's
worker processes through ``guarded_step``, which applies ``guard``'s rules
to every call (toyllm's own answers and shortcuts are off limits, however
they are reached) and checks that toyllm's code was not changed.

The exception is what must not run next to the submission: the cost a
graded search of lessons 06-07 is given holds the expected answer, so the
graded test hands the search ``Counted(cost)``, which is evaluated, counted
and capped in the grader's process; the sandbox gets a stub that asks for
each value over its socket (``server``).
"""
from __future__ import annotations

import inspect
import json
import os

import torch

from ..settings import Settings
from .counted import MAX_EVALUATIONS, Counted, TooManyEvaluations, cost_argument, trusted_cost  # noqa: F401


def repeat(fn, n: int, *args, seed: int = 0, **kwargs) -> list:
    """``[fn(*args, generator=g, **kwargs) for n calls]`` with one ``torch.Generator`` seeded ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    return [fn(*args, generator=gen, **kwargs) for _ in range(n)]


def traced(fn, model, *args, **kwargs) -> dict:
    """Call ``fn(model, *args, **kwargs)`` and record every forward pass of ``model``.

    Returns {"value": fn's value, "calls": [{"ids": row 0's token ids,
    "input_pos": int or None, "cache": a number per distinct cache object
    (None without one), "cache_length": tokens that cache held before the
    call}, ...]}. Both ``model(ids)`` and ``model.forward(ids)`` are seen.
    """
    calls: list[dict] = []
    caches: dict[int, int] = {}
    original = model.forward
    signature = inspect.signature(original)

    def recording_forward(*a, **kw):
        bound = signature.bind(*a, **kw)
        bound.apply_defaults()
        arg = bound.arguments
        cache = arg["cache"]
        input_pos = arg["input_pos"]
        calls.append({"ids": arg["ids"][0].tolist(),
                      "input_pos": int(input_pos) if isinstance(input_pos, (int, torch.Tensor)) else input_pos,
                      "cache": None if cache is None else caches.setdefault(id(cache), len(caches)),
                      "cache_length": cache.length if cache is not None else 0})
        return original(*a, **kw)

    model.forward = recording_forward
    try:
        value = fn(model, *args, **kwargs)
    finally:
        del model.forward
    return {"value": value, "calls": calls}


def with_layout(fn, *args, **kwargs) -> dict:
    """Call ``fn(*args, **kwargs)``; return {"value": its value, "contiguous": whether that tensor was contiguous}.

    The layout is a property of the submission's own object, so it is read here, where that object lives:
    a tensor crossing to the grader arrives as a fresh, contiguous copy. "contiguous" is None for a value
    that is not a tensor.
    """
    value = fn(*args, **kwargs)
    return {"value": value, "contiguous": value.is_contiguous() if isinstance(value, torch.Tensor) else None}


_pools: dict[tuple, object] = {}


def parallel_prefill(spec, ids, method: str, p: int, chunks, step=None, **kwargs):
    """``toyllm.parallel.parallel_prefill`` with a pool of ``p`` workers kept for the whole exercise.

    A submitted ``step`` runs in the workers through ``guarded_step``,
    under the rules the graded call runs under here.
    """
    from toyllm.parallel import parallel_prefill as run
    from toyllm.parallel.runner import step_reference

    from .guard import current

    rules = None                                       # what guarded_step runs, under which rules (Settings.step)
    if step is not None:
        exercise, forbidden, files = current()
        rules = json.dumps({"step": step_reference(step), "exercise": exercise,
                            "forbidden": list(forbidden), "files": list(files)})
        step = f"{__name__}:guarded_step"
    env = Settings(step=rules).to_env()
    key = (p, rules)
    if key not in _pools or _pools[key].closed:
        _pools[key] = _pool_running_submission(p, env)
    result = run(spec, ids, method, p, chunks, pool=_pools[key], step=step, **kwargs)
    if result.kv_cache is not None:                    # plain (keys, values) pairs per layer travel back
        result.kv_cache = [(k, v) for k, v in result.kv_cache]
    return result


def _pool_running_submission(p: int, env: dict):
    """A ``WorkerPool`` of ``p`` whose workers run the submission's exercises where toyllm's marked functions
    hand work to one, as this sandbox does (``toyllm.answers.run_submission``): no model answer there either."""
    from toyllm import answers
    from toyllm.launch import WorkerPool

    pool = WorkerPool(p, timeout_s=60, env=env)
    if answers.EDITION == "student":        # as this process: the sandbox, or the student edition's plain run
        pool.run(run_submission)
    return pool


def run_submission(ctx) -> None:
    """In an engine worker: ``toyllm.answers.run_submission``, as in the sandbox that started it."""
    from toyllm import answers

    answers.run_submission()


_guarded: dict = {}


def guarded_step(layer, x, pos, comm, attention):
    """The submitted per-layer step named in ``Settings.step`` (``$TOYLLM_GRADE_STEP``), called under the rules.

    Runs in an engine worker. The framework's state is recorded before the
    submitted file is first imported there, and checked after every call.
    """
    from toyllm.parallel.runner import resolve_step

    from . import guard

    if not _guarded:
        for name in ("toyllm.parallel", "toyllm.launch", "toyllm.answers", __name__):
            __import__(name)
        _guarded["state"] = guard.framework_state()
        _guarded["rules"] = json.loads(Settings.from_env(os.environ).step)
        _guarded["fn"] = guarded_step.__wrapped__ = resolve_step(_guarded["rules"]["step"])   # named in errors
    rules, fn = _guarded["rules"], _guarded["fn"]
    files = [*rules["files"], getattr(getattr(fn, "__code__", None), "co_filename", "")]
    with guard.rules(rules["exercise"], rules["forbidden"], files):
        out = fn(layer, x, pos, comm, attention)
    changed = guard.tampered(_guarded["state"])
    if changed:
        raise guard.IndependenceError(guard.tampering_message(rules["exercise"], changed))
    return out


def close_pools() -> None:
    """End the workers ``parallel_prefill`` kept (a lesson's graded tests are over)."""
    while _pools:
        _pools.popitem()[1].close()



def engine_trace(spec, ids, method: str, p: int, chunks, step, timeout_s: float = 20) -> list[dict]:
    """Run a submitted step in the engine as ``parallel_prefill`` does, and return what every rank attended over.

    One dict per rank and layer, in rank order then layer order: ``rank``,
    ``layer``, ``q_pos`` and ``k_pos`` (the positions the step gave
    ``layer.attend``, token indices into the prompt), ``k`` and ``v`` (the
    keys and values it gave ``layer.attend``, (1, Hkv, S, D); None if it
    never called it) and ``k_out``, ``v_out`` (the keys and values the step
    returned). For the graded tests' failure messages: data only, judged there.
    """
    import shutil
    import tempfile
    from pathlib import Path

    from toyllm.parallel import parallel_prefill as run
    from toyllm.parallel.runner import step_reference

    from .guard import current

    exercise, forbidden, files = current()
    folder = Path(tempfile.mkdtemp(prefix="toyllm-trace-"))
    env = Settings(step=json.dumps({"step": step_reference(step), "exercise": exercise,
                                    "forbidden": list(forbidden), "files": list(files)}),
                   trace=str(folder)).to_env()         # traced_step leaves what each rank attended over in folder
    pool = _pool_running_submission(p, env)
    try:
        run(spec, ids, method, p, chunks, pool=pool, step=f"{__name__}:traced_step", warmup=0,
            timeout_s=timeout_s)
        found = [torch.load(f) for f in folder.glob("*.pt")]
    finally:
        pool.close()
        shutil.rmtree(folder, ignore_errors=True)
    return sorted(found, key=lambda r: (r["rank"], r["layer"]))


class _RecordingLayer:
    """A layer that notes what the step hands to ``attend`` (everything else goes to the layer itself)."""

    def __init__(self, layer):
        self._layer, self.attended = layer, None

    def attend(self, q, k, v, q_pos, k_pos, attention):
        self.attended = {"q_pos": q_pos.detach().clone(), "k_pos": k_pos.detach().clone(),
                         "k": k.detach().clone(), "v": v.detach().clone()}
        return self._layer.attend(q, k, v, q_pos, k_pos, attention)

    def __getattr__(self, name):
        return getattr(self._layer, name)


def traced_step(layer, x, pos, comm, attention):
    """``guarded_step`` with the layer's ``attend`` recorded; one file per rank and layer in ``Settings.trace``."""
    from pathlib import Path

    recording = _RecordingLayer(layer)
    out = guarded_step(recording, x, pos, comm, attention)
    seen = recording.attended or {"q_pos": None, "k_pos": None, "k": None, "v": None}
    record = {"rank": comm.rank, "layer": comm.layer, **seen, "k_out": out[1].detach().clone(),
              "v_out": out[2].detach().clone()}
    torch.save(record, Path(Settings.from_env(os.environ).trace) / f"{comm.rank}-{comm.layer}.pt")
    return out


def exercises_ran(clear: bool = False) -> list[str]:
    """The exercises toyllm's marked functions handed work to in this process (``toyllm.answers.ran``), sorted;
    ``clear=True`` empties the record after reading it (a new test starts)."""
    from toyllm import answers

    found = sorted(answers.ran)
    if clear:
        answers.ran.clear()
    return found


# --------------------------------------------------------------------------- lesson 08: the paged cache

def paged_run(ops, *, prepare=None, gather=None, block_size: int = 4, n_blocks: int = 32, seed: int = 0) -> dict:
    """Run ``ops`` on sequences of one paged cache whose steps are the submitted ``prepare`` and ``gather``.

    ``prepare`` (Exercise 8.1) and ``gather`` (8.2) replace ``PagedKVCache``'s
    own steps; None keeps toyllm's. The model is the tiny preset built with
    ``seed``. ops, in order: ``("feed", i, ids)`` runs the model on new token
    ids of sequence i (i == the number of sequences so far starts one);
    ``("fork", i)`` starts a sequence sharing every block of sequence i;
    ``("release", i)`` gives sequence i's blocks back.

    Returns plain data: ``logits`` (the float32 logits of the last token of
    each feed, in order), ``tables`` (after each op, every sequence's block
    table), ``refs`` and ``free`` (the pool's use counts and free blocks at
    the end), ``lengths`` (tokens each sequence holds at the end).
    """
    from toyllm import build_model
    from toyllm.paged import BlockPool, PagedKVCache

    class Submitted(PagedKVCache):
        def _prepare(self, start: int, T: int) -> None:
            if prepare is None:
                return super()._prepare(start, T)
            self.table = [int(b) for b in prepare(self.pool, self.table, start, T)]

        def _gather(self, store, layer: int):
            if gather is None:
                return super()._gather(store, layer)
            return gather(store, self.table, layer, self._len[layer])

    model = build_model("tiny", seed=seed)
    pool = BlockPool.for_model(model.config, n_blocks, block_size)
    caches: list[PagedKVCache] = []
    logits, tables = [], []
    with torch.inference_mode():
        for op in ops:
            kind, i = op[0], op[1]
            if kind == "feed":
                if i == len(caches):
                    caches.append(Submitted(pool))
                cache = caches[i]
                ids = torch.tensor([list(op[2])])
                logits.append(model(ids, input_pos=cache.length, cache=cache)[0, -1].float().clone())
            elif kind == "fork":
                caches.append(caches[i].fork())
            elif kind == "release":
                caches[i].release()
            else:
                raise ValueError(f"unknown op {kind!r}")
            tables.append([list(c.table) for c in caches])
    return {"logits": logits, "tables": tables, "refs": list(pool.refs), "free": pool.free_blocks,
            "lengths": [c.length for c in caches]}


def serve_run(workload, policy: str, *, plan=None, max_batch: int, token_budget: int, block_size: int) -> dict:
    """``toyllm.serving.serve`` on the tiny model (seed 0) with a submitted ``plan`` (Exercise 8.3).

    Returns {"outputs": {request id: its tokens}, "iteration_tokens": tokens of each iteration}.
    """
    from toyllm import build_model
    from toyllm.serving import serve

    model = build_model("tiny", seed=0)
    with torch.inference_mode():
        result = serve(model, list(workload), policy, max_batch=max_batch, token_budget=token_budget,
                       block_size=block_size, plan=plan)
    return {"outputs": {r.id: [int(t) for t in r.output_ids] for r in result.requests},
            "iteration_tokens": [int(n) for n in result.iteration_tokens]}


# --------------------------------------------------------------------------- lessons 06-07: searches

# The cost a search is handed, counted here in the grader (``counted``); the costs below are marked to stay.
@trusted_cost
def bowl_cost(chunks, optimum) -> float:
    """A cost with a known best partition: 1 + the squared distance of the boundaries from ``optimum``'s."""
    b = c = 0
    total = 1.0
    for got, best in zip(chunks[:-1], optimum[:-1]):
        b, c = b + got, c + best
        total += ((b - c) / 16.0) ** 2
    return total


@trusted_cost
def kink_cost(chunks, best: int, left: float = 3.0, right: float = 1.0) -> float:
    """A two-process cost shaped like TTFT = max(rank 0's time, rank 1's): lowest at c_0 == ``best``."""
    b = chunks[0]
    return 1.0 + max(left * (b - best), right * (best - b)) / 1000.0


@trusted_cost
def simulated_ttft(chunks, cfg, cost_model, method: str = "kvr") -> float:
    """``toyllm.simulate.simulate_prefill``'s TTFT (seconds) of ``chunks``, as a cost for the searches."""
    from toyllm.simulate import simulate_prefill

    return simulate_prefill(cfg, list(chunks), method, cost_model, record_events=False).ttft_s


@trusted_cost
def step_speedup(context: int, crossing: int) -> float:
    """A speedup that reaches 1 exactly at ``crossing`` tokens and grows with the context."""
    return 0.5 + 0.5 * context / crossing


@trusted_cost
def simulated_speedup(context: int, cfg, cost_model, world_size: int) -> float:
    """Simulated one-process TTFT over KVR's with an even split: the speedup of parallel prefill."""
    from toyllm.partition import even_partition
    from toyllm.simulate import simulate_prefill

    single = simulate_prefill(cfg, [context], "single", cost_model, record_events=False).ttft_s
    kvr = simulate_prefill(cfg, even_partition(context, world_size), "kvr", cost_model, record_events=False).ttft_s
    return single / kvr
