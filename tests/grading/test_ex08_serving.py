"""Graded tests of lesson 08 (ex08_serving): 12 points.

8.1 prepare_blocks 4, 8.2 gather_rows 3, 8.3 plan_iteration 3, 8.4 transfer_bytes 2.
The submitted steps run inside toyllm's paged cache (``harness.paged_run``,
in the submission's process) while the tiny model prefills and decodes
several sequences: growing ones, chunks that cross a block's end, forks that
share blocks and then write. References live here: the same sequences fed
to lesson 02's ``DynamicKVCache`` (logits within LOGIT_ATOL), the number of
blocks each length needs, the pool's use counts, and rows gathered one
token at a time.
"""
import copy
import math

import pytest
import torch

from toyllm import DynamicKVCache, build_model
from toyllm.grading import sandboxed
from toyllm.grading.expect import equal, raises, tensors_close
from toyllm.grading.sandbox.process import SubmissionCrash, SubmissionTimeout
from toyllm.grading.references import NotStored, reference
from toyllm.paged import BlockPool

LOGIT_ATOL = 1e-5       # float32 logits of the tiny model; the paged and the dynamic cache hold the same rows
BLOCK = 4               # tokens per block in these tests: small, so that short prompts cross block ends


@reference
def dynamic_cache_logits(ops) -> list[torch.Tensor]:
    """The last-token logits of every feed of ``ops``, each sequence in a DynamicKVCache of its own."""
    model = build_model("tiny", seed=0)
    caches, out = [], []
    with torch.inference_mode():
        for op in ops:
            if op[0] == "feed":
                if op[1] == len(caches):
                    caches.append(DynamicKVCache(model.config.n_layers))
                cache = caches[op[1]]
                out.append(model(torch.tensor([list(op[2])]), input_pos=cache.length, cache=cache)[0, -1].float())
            elif op[0] == "fork":
                caches.append(copy.deepcopy(caches[op[1]]))
            # "release": the sequence ends, and its cache is not used again
    return out


def run(ops, prepare=None, gather=None, n_blocks=32):
    try:
        return sandboxed("toyllm.grading.sandbox.harness:paged_run", ops, prepare=prepare, gather=gather, block_size=BLOCK,
                         n_blocks=n_blocks)
    except (SubmissionTimeout, SubmissionCrash):
        raise
    except Exception as e:
        cause = gather_cause(gather) if gather is not None else ""
        if not cause:
            raise
        raise AssertionError(f"{str(e).splitlines()[0] if str(e) else type(e).__name__}; {cause}") from None


def gather_cause(gather_rows) -> str:
    """What is wrong with a submitted gather_rows, from one small call: "" when that call is right."""
    store = torch.arange(4 * 2 * 1 * BLOCK * 1, dtype=torch.float32).reshape(4, 2, 1, BLOCK, 1)
    table, length = [2, 0], BLOCK + 2
    call = f"gather_rows(store (4, 2, 1, {BLOCK}, 1), table={table}, layer=1, length={length})"
    try:
        got = gather_rows(store, table, 1, length)
    except Exception as e:
        return f"{call} raised {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    try:
        want = gathered_one_by_one(store, table, 1, length)
    except NotStored:                   # the student edition stores the values of the checked cases only
        return ""
    if not isinstance(got, torch.Tensor):
        return f"{call} returned {type(got).__name__}, not a tensor"
    if got.dim() == 4 and got.shape[-2] != length:
        return f"{call} returned {got.shape[-2]} rows instead of {length}{cut_hint(got, length)}"
    if got.shape != want.shape:
        return f"{call} returned shape {tuple(got.shape)} instead of {tuple(want.shape)}"
    if not torch.equal(got, want):
        t = next(t for t in range(length) if not torch.equal(got[0, :, t], want[0, :, t]))
        return f"{call}: row {t} is not token {t}'s, which lives in block {table[t // BLOCK]} at row {t % BLOCK}"
    return ""


def cut_hint(got, length: int) -> str:
    """Why a gather returned ``got`` for ``length`` tokens, when the reason is clear: "" otherwise."""
    rows = got.shape[-2] if isinstance(got, torch.Tensor) and got.dim() == 4 else None
    if rows is not None and rows > length and rows % BLOCK == 0 and rows - length < BLOCK:
        return (f": the last block is returned whole; the sequence holds only {length} tokens, so the rows after "
                f"row {length - 1} (not yet written) must be cut")
    return ""


def check_logits(got, ops, what):
    for n, (g, want) in enumerate(zip(got["logits"], dynamic_cache_logits(ops))):
        feeds = [op for op in ops if op[0] == "feed"]
        seq, ids = feeds[n][1], feeds[n][2]
        tensors_close(g, want, f"{what}: logits after feed {n + 1} (sequence {seq}, {len(ids)} new tokens)",
                      atol=LOGIT_ATOL)


def tokens(n, start=1):
    return [(start + 7 * i) % 256 for i in range(n)]


def growing(chunks, seq=0, start=1):
    """Feeds of one sequence, chunk by chunk."""
    ops, fed = [], 0
    for c in chunks:
        ops.append(("feed", seq, tokens(c, start + fed)))
        fed += c
    return ops


# --------------------------------------------------------------------------- 8.1

@pytest.mark.exercise("8.1")
@pytest.mark.points(1)
def test_ex8_1_a_growing_sequence_gets_exactly_the_blocks_it_needs(ex08, drawn):
    rng = drawn.rng("8.1")
    for chunks, note in [([5, 3, 1, 6, 1], ""), ([4, 4, 1], ""),
                         ([rng.randint(1, 9) for _ in range(rng.randint(3, 6))], f"; {drawn}")]:
        ops = growing(chunks)
        what = f"prepare_blocks in the paged cache, one sequence fed chunks {chunks} (block_size {BLOCK}{note})"
        got = run(ops, prepare=ex08.prepare_blocks)
        fed = 0
        for c, tables in zip(chunks, got["tables"]):
            fed += c
            table = tables[0]
            if len(table) != math.ceil(fed / BLOCK):
                raise AssertionError(f"{what}: after {fed} tokens the table has {len(table)} blocks {table}, "
                                     f"expected ceil({fed} / {BLOCK}) = {math.ceil(fed / BLOCK)}")
            if len(set(table)) != len(table):
                raise AssertionError(f"{what}: after {fed} tokens the table {table} lists a block twice")
        check_logits(got, ops, what)


@pytest.mark.exercise("8.1")
@pytest.mark.points(1)
def test_ex8_1_a_fork_copies_the_block_it_writes_into(ex08):
    # sequence 0 holds 6 tokens: block 0 full, block 1 half full; sequence 1 forks it, both go on differently
    ops = [("feed", 0, tokens(6)), ("fork", 0), ("feed", 1, tokens(2, 100)), ("feed", 0, tokens(2, 200)),
           ("feed", 1, tokens(1, 150)), ("feed", 0, tokens(3, 250))]
    what = "prepare_blocks in the paged cache, a sequence of 6 tokens forked, then both fed different tokens"
    got = run(ops, prepare=ex08.prepare_blocks)
    parent, child = got["tables"][2]
    if child[0] != parent[0]:
        raise AssertionError(f"{what}: the fork's first block {child[0]} is not the parent's {parent[0]}: a full "
                             "block that nobody writes into stays shared")
    if child[1] == parent[1]:
        raise AssertionError(f"{what}: after the fork wrote rows 6-7, it still shares block {child[1]} with the "
                             "parent: a shared block must be copied before it is written into")
    parent_after = got["tables"][3][0]
    if parent_after[:2] != parent[:2]:
        raise AssertionError(f"{what}: the parent's blocks changed from {parent[:2]} to {parent_after[:2]} when it "
                             "wrote next; once the fork had its own copy, the parent used its block alone and needed "
                             "no copy")
    check_logits(got, ops, what)


@pytest.mark.exercise("8.1")
@pytest.mark.points(1)
def test_ex8_1_every_block_returns_to_the_pool(ex08):
    ops = [("feed", 0, tokens(7)), ("fork", 0), ("fork", 0), ("feed", 1, tokens(3, 50)), ("feed", 2, tokens(5, 90)),
           ("release", 0), ("feed", 1, tokens(1, 60)), ("release", 1), ("release", 2)]
    what = "prepare_blocks, a 7-token sequence forked twice, the forks fed, then every sequence released"
    got = run(ops, prepare=ex08.prepare_blocks, n_blocks=12)
    check_logits(got, ops, what)
    used = {b: n for b, n in enumerate(got["refs"]) if n}
    if used or got["free"] != 12:
        raise AssertionError(f"{what}: {12 - got['free']} of 12 blocks are still in use (use counts {used}): a "
                             "copied block's original must be released, once")


@pytest.mark.exercise("8.1")
@pytest.mark.points(1)
def test_ex8_1_a_block_used_alone_is_not_copied_and_bad_input(ex08):
    ops = growing([3, 2, 2])
    got = run(ops, prepare=ex08.prepare_blocks)
    first = got["tables"][0][0]
    for n, tables in enumerate(got["tables"][1:], 2):
        if tables[0][:len(first)] != first:
            raise AssertionError(f"prepare_blocks, one sequence fed chunks [3, 2, 2]: after feed {n} its blocks "
                                 f"{tables[0]} no longer begin with {first}: a block only this sequence uses is "
                                 "written in place, never copied")
    pool = BlockPool(4, BLOCK, 1, 1, 2)
    raises(ValueError, ex08.prepare_blocks, pool, [], -1, 2, call="prepare_blocks(pool, [], start=-1, tokens=2)",
           why="start < 0")
    raises(ValueError, ex08.prepare_blocks, pool, [], 0, 0, call="prepare_blocks(pool, [], start=0, tokens=0)",
           why="tokens < 1")
    raises(ValueError, ex08.prepare_blocks, pool, [], 5, 1, call="prepare_blocks(pool, [], start=5, tokens=1)",
           why="an empty table holds no rows, so row 5 would leave a gap")
    one = pool.allocate()
    raises(ValueError, ex08.prepare_blocks, pool, [one], BLOCK + 1, 1,
           call=f"prepare_blocks(pool, [{one}], start={BLOCK + 1}, tokens=1)",
           why=f"one block holds rows 0 .. {BLOCK - 1}, so row {BLOCK + 1} would leave row {BLOCK} empty inside the next block")


# --------------------------------------------------------------------------- 8.2

@reference
def gathered_one_by_one(store, table, layer, length):
    """Row t of the answer is token t: block table[t // block_size], row t % block_size."""
    bs = store.shape[-2]
    rows = [store[table[t // bs], layer, :, t % bs] for t in range(length)]                  # each (Hkv, D)
    if not rows:
        return store.new_zeros(1, store.shape[2], 0, store.shape[-1])
    return torch.stack(rows, dim=1).unsqueeze(0)                                              # (1, Hkv, S, D)


@pytest.mark.exercise("8.2")
@pytest.mark.points(1)
def test_ex8_2_rows_in_token_order(ex08, drawn):
    gen = drawn.generator("8.2")
    rng = drawn.rng("8.2")
    blocks = rng.sample(range(8), 4)
    cases = [([5, 1, 6], 2, 10, ""), ([3], 0, 4, ""), ([7, 2], 1, 5, ""),
             (blocks, rng.randrange(3), rng.randint(1, 4 * BLOCK), f" ({drawn})")]
    for table, layer, length, note in cases:
        store = torch.randn(8, 3, 2, BLOCK, 5, generator=gen)
        call = f"gather_rows(store (8, 3, 2, {BLOCK}, 5), table={table}, layer={layer}, length={length}){note}"
        laid_out = sandboxed("toyllm.grading.sandbox.harness:with_layout", ex08.gather_rows, store, table, layer, length)
        got = laid_out["value"]
        want = gathered_one_by_one(store, table, layer, length)
        if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(want.shape) or got.dtype != store.dtype:
            raise AssertionError(f"{call}: expected a {store.dtype} tensor of shape {tuple(want.shape)} "
                                 f"(1, n_kv_heads, length, head_dim), got "
                                 f"{tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__}"
                                 f"{' ' + str(got.dtype) if isinstance(got, torch.Tensor) else ''}"
                                 f"{cut_hint(got, length)}")
        if not torch.equal(got, want):
            t = next(t for t in range(length) if not torch.equal(got[0, :, t], want[0, :, t]))
            raise AssertionError(f"{call}: row {t} is not token {t}'s, which lives in block "
                                 f"{table[t // BLOCK]} at row {t % BLOCK}")
        if not laid_out["contiguous"]:         # read where the tensor was made: a copy sent here is always contiguous
            raise AssertionError(f"{call}: the result is not contiguous (a view of the store's rows, not a new "
                                 "tensor: call .contiguous())")


@pytest.mark.exercise("8.2")
@pytest.mark.points(1)
def test_ex8_2_the_model_attends_over_the_blocks(ex08):
    ops = [("feed", 0, tokens(6)), ("feed", 0, tokens(1, 40)), ("fork", 0), ("feed", 1, tokens(5, 80)),
           ("feed", 0, tokens(2, 120)), ("feed", 2, tokens(9, 160)), ("feed", 1, tokens(1, 170))]
    got = run(ops, gather=ex08.gather_rows)
    try:
        check_logits(got, ops, "gather_rows in the paged cache, sequences of 6, 7, 9 and 12 tokens, one of them forked")
    except AssertionError as e:
        cause = gather_cause(ex08.gather_rows)
        raise AssertionError(f"{e}; {cause}" if cause else str(e)) from None


@pytest.mark.exercise("8.2")
@pytest.mark.points(1)
def test_ex8_2_no_rows_and_bad_input(ex08):
    store = torch.randn(4, 2, 3, BLOCK, 2, dtype=torch.float64)
    got = ex08.gather_rows(store, [2], 1, 0)
    call = "gather_rows(store (4, 2, 3, 4, 2) float64, table=[2], layer=1, length=0)"
    if not isinstance(got, torch.Tensor):
        raise AssertionError(f"{call}: expected a tensor, got {type(got).__name__}")
    equal(tuple(got.shape), (1, 3, 0, 2), call + ".shape")
    equal(got.dtype, torch.float64, call + ".dtype")
    raises(ValueError, ex08.gather_rows, store, [2, 0], 0, 9, call="gather_rows(store, table=[2, 0], layer=0, "
           "length=9)", why="two blocks of 4 rows hold 8 tokens at most")
    raises(ValueError, ex08.gather_rows, store, [2], 0, -1, call="gather_rows(store, table=[2], layer=0, length=-1)",
           why="length < 0")


# --------------------------------------------------------------------------- 8.3

@reference
def planned(prompt_left, done, budget):
    """The definition, one sequence at a time: done 0, decodes 1 (all of them first), then prompts in order."""
    left_over = None if budget is None else budget - sum(1 for n, d in zip(prompt_left, done) if n == 0 and not d)
    plan = []
    for n, d in zip(prompt_left, done):
        plan.append(0 if d else 1 if n == 0 else None)
    for i, n in enumerate(prompt_left):
        if plan[i] is None:
            plan[i] = n if left_over is None else max(0, min(n, left_over))
            left_over = None if left_over is None else left_over - plan[i]
    return plan


@reference
def generated_alone(workload):
    """{request id: its output tokens}: greedy generation of each request by itself, with no server."""
    from toyllm import generate

    model = build_model("tiny", seed=0)
    return {r.id: generate(model, list(r.prompt_ids), r.max_new_tokens, cache="dynamic").output_ids for r in workload}


def serving_with(plan):
    """The server plans every iteration with ``plan`` under each policy: the tokens of every request equal
    greedy generation of that request alone, and no chunked iteration carries more than its budget."""
    from toyllm.model import get_config
    from toyllm.serving import poisson_workload

    workload = poisson_workload(6, 200.0, get_config("tiny").vocab_size, prompt_tokens=(3, 20), new_tokens=(1, 6),
                                seed=3)
    want = generated_alone(workload)
    for policy, budget in (("static", 64), ("continuous", 64), ("chunked", 8)):
        got = sandboxed("toyllm.grading.sandbox.harness:serve_run", workload, policy, plan=plan, max_batch=3,
                        token_budget=budget, block_size=BLOCK)
        what = (f"serve(6 requests of 3-20 prompt and 1-6 new tokens, policy={policy!r}, max_batch=3, "
                f"token_budget={budget}) with your plan_iteration")
        for rid, tokens in want.items():
            if got["outputs"][rid] != tokens:
                raise AssertionError(f"{what}: request {rid} got tokens {got['outputs'][rid]}, alone it gives {tokens}")
        if policy == "chunked" and max(got["iteration_tokens"]) > budget:
            raise AssertionError(f"{what}: an iteration carried {max(got['iteration_tokens'])} tokens, over the "
                                 f"budget of {budget}")


def check_plan(ex08, prompt_left, done, budget, note=""):
    call = f"plan_iteration(prompt_left={prompt_left}, done={done}, token_budget={budget}){note}"
    got = ex08.plan_iteration(list(prompt_left), list(done), budget)
    if not isinstance(got, list) or any(type(n) is not int for n in got):
        raise AssertionError(f"{call}: expected a list of Python ints, got {got!r}")
    equal(got, planned(prompt_left, done, budget), call)


@pytest.mark.exercise("8.3")
@pytest.mark.points(1)
def test_ex8_3_decodes_first_then_prompts_in_order(ex08, drawn):
    F = False
    for prompt_left, done, budget in [([0, 0, 10, 5], [F, F, F, F], 8), ([0, 0, 10, 5], [F, F, F, F], None),
                                      ([3, 0, 4], [F, F, F], 9), ([7, 0, 2, 0], [F, F, F, F], 4),
                                      ([20], [F], 1), ([], [], 5)]:
        check_plan(ex08, prompt_left, done, budget)
    rng = drawn.rng("8.3")
    for _ in range(6):
        n = rng.randint(1, 8)
        prompt_left = [rng.choice([0, 0, rng.randint(1, 40)]) for _ in range(n)]
        done = [left == 0 and rng.random() < 0.3 for left in prompt_left]
        decodes = sum(1 for left, d in zip(prompt_left, done) if left == 0 and not d)
        budget = rng.choice([None, max(1, decodes) + rng.randint(0, 30)])
        check_plan(ex08, prompt_left, done, budget, f" ({drawn})")


@pytest.mark.exercise("8.3")
@pytest.mark.points(1)
def test_ex8_3_a_sequence_that_finished_mid_batch_feeds_nothing(ex08):
    F, T = False, True
    check_plan(ex08, [0, 0, 0, 6], [T, F, T, F], 3)
    check_plan(ex08, [0, 0], [T, T], 2)
    check_plan(ex08, [0, 12, 0], [T, F, F], None)
    serving_with(ex08.plan_iteration)


@pytest.mark.exercise("8.3")
@pytest.mark.points(1)
def test_ex8_3_bad_input(ex08):
    F, T = False, True
    for args, why in [(([0, 1], [F], 4), "one done flag per sequence"),
                      (([-1, 0], [F, F], 4), "a negative number of prompt tokens"),
                      (([3], [T], 4), "a done sequence with prompt left"),
                      (([0, 5], [F, F], 0), "a token budget of 0"),
                      (([5], [F], 0), "a token budget of 0, even with no decode to carry"),
                      (([0, 0, 0], [F, F, F], 2), "three decodes do not fit a budget of 2")]:
        raises(ValueError, ex08.plan_iteration, *args, call=f"plan_iteration{args}", why=why)
    equal(ex08.plan_iteration([0, 0, 3], [F, F, F], 2), [1, 1, 0],
          "plan_iteration([0, 0, 3], [False, False, False], 2) (two decodes fill a budget of 2 exactly: they fit)")


# --------------------------------------------------------------------------- 8.4

@reference
def shipped(cfg, tokens, bytes_per_value, block_size=None):
    """The definition in exact fractions: K and V, every layer and KV head, head_dim values per row sent."""
    from fractions import Fraction

    rows = tokens if block_size is None else math.ceil(tokens / block_size) * block_size
    return math.ceil(2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * rows * Fraction(bytes_per_value))


def check_transfer(ex08, cfg, name, tokens, bytes_per_value, block_size=None, note=""):
    call = (f"transfer_bytes({name} (layers {cfg.n_layers}, KV heads {cfg.n_kv_heads}, head_dim {cfg.head_dim}), "
            f"tokens={tokens}, bytes_per_value={bytes_per_value}, block_size={block_size}){note}")
    equal(ex08.transfer_bytes(cfg, tokens, bytes_per_value, block_size), shipped(cfg, tokens, bytes_per_value,
                                                                                block_size), call)


@pytest.mark.exercise("8.4")
@pytest.mark.points(1)
def test_ex8_4_rows_of_every_layer_and_whole_blocks(ex08, drawn):
    from toyllm.model import get_config

    smol, tiny = get_config("smollm2-135m"), get_config("tiny")
    equal(ex08.transfer_bytes(smol, 1000, 2), 23_040_000,
          "transfer_bytes(SmolLM2-135M, tokens=1000, bytes_per_value=2) (K and V x 30 layers x 3 KV heads x 64 "
          "values x 2 bytes = 23,040 bytes per token)")
    for cfg, name, tokens, bpv, bs in [(smol, "SmolLM2-135M", 4096, 4, None), (smol, "SmolLM2-135M", 100, 2, 16),
                                       (tiny, "tiny", 17, 4, 16), (tiny, "tiny", 32, 4, 16), (tiny, "tiny", 1, 2, 8)]:
        check_transfer(ex08, cfg, name, tokens, bpv, bs)
    rng = drawn.rng("8.4")
    import dataclasses

    for _ in range(3):
        kv = rng.choice([1, 2, 4, 8])
        cfg = dataclasses.replace(tiny, n_layers=rng.randint(1, 80), n_heads=kv * rng.randint(1, 4), n_kv_heads=kv,
                                  head_dim=2 * rng.randint(8, 80))
        check_transfer(ex08, cfg, "a drawn config", rng.randint(1, 50_000), rng.choice([4, 2, 1]),
                       rng.choice([None, 16, 32, 7]), f" ({drawn})")


@pytest.mark.exercise("8.4")
@pytest.mark.points(1)
def test_ex8_4_half_bytes_round_up_and_bad_input(ex08):
    import dataclasses

    from toyllm.model import get_config

    odd = dataclasses.replace(get_config("tiny"), n_layers=1, n_heads=1, n_kv_heads=1, head_dim=2)
    check_transfer(ex08, odd, "one layer, one KV head of 2", 1, 0.5)        # 4 values of half a byte: 2 bytes
    check_transfer(ex08, odd, "one layer, one KV head of 2", 3, 0.25)       # 12 quarter bytes: 3 bytes
    check_transfer(ex08, odd, "one layer, one KV head of 2", 1, 0.1)        # 0.4 bytes: 1 byte
    tiny = get_config("tiny")
    for args, why in [((tiny, 0, 2), "tokens < 1"), ((tiny, 10, 0), "bytes_per_value <= 0"),
                      ((tiny, 10, 2, 0), "block_size < 1")]:
        raises(ValueError, ex08.transfer_bytes, *args, call=f"transfer_bytes(tiny, {', '.join(map(str, args[1:]))})",
               why=why)
