"""Graded tests of lesson 04 (ex04_tsp): 10 points.

4.1 tsp_dot_products 2, 4.2 tsp_layer 4, 4.3 tsp_kv_bytes_received 2, 4.4 tensor_parallel_bytes_sent 2.
References live here: counts written out from the definitions, and the
one-process forward pass of the tiny model for the engine runs.
"""
import pytest

from toyllm.grading.expect import equal, raises
from toyllm.grading.references import reference
from toyllm.parallel import ModelSpec

ATOL = 1e-4      # float32 K/V: the ranks sum the same products in another order


@reference
def dot_products_reference(chunks):
    return [c * sum(chunks) for c in chunks]


@reference
def received_reference(chunks, n_kv_heads, head_dim, bytes_per_value):
    return [2.0 * (sum(chunks) - c) * n_kv_heads * head_dim * bytes_per_value for c in chunks]


@reference
def sent_reference(tokens, d_model, p, bytes_per_value):
    return 2 * 2 * (p - 1) / p * tokens * d_model * bytes_per_value


# --------------------------------------------------------------------------- 4.1

@pytest.mark.exercise("4.1")
@pytest.mark.points(1)
def test_ex4_1_the_papers_example(ex04):
    got = ex04.tsp_dot_products([3, 3, 3])
    assert got == [27, 27, 27] and all(type(n) is int for n in got), \
        f"tsp_dot_products([3, 3, 3]) (C=9, p=3): expected [27, 27, 27] (ints), got {got!r}"


@pytest.mark.exercise("4.1")
@pytest.mark.points(1)
def test_ex4_1_uneven_and_drawn_chunks_and_bad_input(ex04, drawn):
    got = ex04.tsp_dot_products([5, 1, 11, 2])
    assert got == [95, 19, 209, 38], f"tsp_dot_products([5, 1, 11, 2]): every rank scores its c_i queries " \
                                     f"against all 19 keys: expected [95, 19, 209, 38], got {got!r}"
    rng = drawn.rng("4.1")
    for _ in range(4):
        chunks = [rng.randint(1, 5000) for _ in range(rng.randint(1, 8))]
        got, expected = ex04.tsp_dot_products(chunks), dot_products_reference(chunks)
        assert got == expected and all(type(n) is int for n in got), \
            f"tsp_dot_products({chunks}; {drawn}): expected {expected} (ints), got {got!r}"
    for bad in ([], [4, 0, 2], [3, -1]):
        raises(ValueError, ex04.tsp_dot_products, bad, call=f"tsp_dot_products({bad!r})",
               why="every rank needs at least one token")


# --------------------------------------------------------------------------- 4.2

def run_tsp(engine_run, step, p, chunks, seed=0, n_kv_heads=2, note=""):
    spec = ModelSpec("tiny", overrides=(("n_kv_heads", n_kv_heads),)) if n_kv_heads != 2 else ModelSpec("tiny")
    got, ref_cache = engine_run(step, "4.2", "tsp", p, chunks, seed=seed, spec=spec, note=note)
    for layer, ((k, v), (k_ref, v_ref)) in enumerate(zip(got.kv_cache, ref_cache)):
        assert k.shape == k_ref.shape and (k - k_ref).abs().max() < ATOL and (v - v_ref).abs().max() < ATOL, \
            (f"Exercise 4.2, tsp_layer, p={p}, chunks {chunks}{f' ({note})' if note else ''}: layer {layer}'s K/V "
             f"should cover the whole context {tuple(k_ref.shape)}")


@pytest.mark.engine
@pytest.mark.exercise("4.2")
@pytest.mark.points(1)
@pytest.mark.timeout(180)
def test_ex4_2_three_ranks_uneven_chunks(ex04, engine_run):
    run_tsp(engine_run, ex04.tsp_layer, 3, [17, 2, 12], seed=1)


@pytest.mark.engine
@pytest.mark.exercise("4.2")
@pytest.mark.points(1)
@pytest.mark.timeout(180)
def test_ex4_2_two_ranks_even_split_and_three_ranks_on_drawn_chunks(ex04, engine_run, drawn):
    run_tsp(engine_run, ex04.tsp_layer, 2, [20, 20])
    rng = drawn.rng("4.2")
    chunks = [rng.randint(1, 20) for _ in range(3)]
    run_tsp(engine_run, ex04.tsp_layer, 3, chunks, seed=rng.randrange(10**6), note=str(drawn))


@pytest.mark.engine
@pytest.mark.exercise("4.2")
@pytest.mark.points(2)
@pytest.mark.timeout(180)
def test_ex4_2_four_ranks_one_token_chunk_and_multi_query(ex04, engine_run):
    run_tsp(engine_run, ex04.tsp_layer, 4, [9, 1, 14, 6], seed=2, n_kv_heads=1)


# --------------------------------------------------------------------------- 4.3

@pytest.mark.exercise("4.3")
@pytest.mark.points(1)
def test_ex4_3_bytes_received_per_rank(ex04):
    got = ex04.tsp_kv_bytes_received([4096, 4096], n_kv_heads=40, head_dim=128, bytes_per_value=2)
    expected = received_reference([4096, 4096], 40, 128, 2)          # LLaMA-2-13B shape, 8k tokens on 2 ranks
    assert got == expected and all(type(b) is float for b in got), \
        f"tsp_kv_bytes_received([4096, 4096], 40 kv heads, head_dim 128, 2 bytes): expected {expected}, got {got!r}"


def check_bytes(got, expected, call):
    if type(got) is not list or len(got) != len(expected) or any(type(b) is not float for b in got):
        raise AssertionError(f"{call}: expected a list of {len(expected)} Python floats, got {got!r}")
    assert got == pytest.approx(expected, rel=1e-12), f"{call}: expected {expected}, got {got!r}"


@pytest.mark.exercise("4.3")
@pytest.mark.points(1)
def test_ex4_3_uneven_drawn_chunks_and_half_byte_values(ex04, drawn):
    check_bytes(ex04.tsp_kv_bytes_received([3, 5, 1], n_kv_heads=3, head_dim=64, bytes_per_value=0.5),
                received_reference([3, 5, 1], 3, 64, 0.5),
                "tsp_kv_bytes_received([3, 5, 1], 3 kv heads, head_dim 64, 4-bit values)")
    rng = drawn.rng("4.3")
    for _ in range(4):
        chunks = [rng.randint(1, 5000) for _ in range(rng.randint(1, 8))]
        heads, dim, bpv = rng.randint(1, 64), rng.choice([32, 64, 80, 128]), rng.choice([0.5, 1, 2, 4])
        check_bytes(ex04.tsp_kv_bytes_received(chunks, heads, dim, bpv),
                    received_reference(chunks, heads, dim, bpv),
                    f"tsp_kv_bytes_received({chunks}, {heads} kv heads, head_dim {dim}, {bpv} bytes; {drawn})")


# --------------------------------------------------------------------------- 4.4

@pytest.mark.exercise("4.4")
@pytest.mark.points(1)
def test_ex4_4_llama2_13b_on_eight_gpus(ex04):
    got = ex04.tensor_parallel_bytes_sent(8192, 5120, 8, bytes_per_value=2)
    expected = sent_reference(8192, 5120, 8, 2)
    assert type(got) is float and got == pytest.approx(expected, rel=1e-12), \
        f"tensor_parallel_bytes_sent(8192 tokens, d_model 5120, p=8, 2 bytes): expected {expected:.6g}, got {got!r}"


@pytest.mark.exercise("4.4")
@pytest.mark.points(1)
def test_ex4_4_one_process_sends_nothing_and_others_do(ex04, drawn):
    equal(ex04.tensor_parallel_bytes_sent(100, 64, 1), 0.0, "tensor_parallel_bytes_sent(100 tokens, d_model 64, p=1)")
    cases = [(10, 6, 3, 4)]
    rng = drawn.rng("4.4")
    cases += [(rng.randint(1, 32768), rng.choice([768, 2048, 4096, 5120, 8192]), rng.randint(1, 16),
               rng.choice([0.5, 1, 2, 4])) for _ in range(4)]
    for i, (tokens, d, p, bpv) in enumerate(cases):
        call = f"tensor_parallel_bytes_sent({tokens} tokens, d_model {d}, p={p}, {bpv} bytes{f'; {drawn}' if i else ''})"
        got = ex04.tensor_parallel_bytes_sent(tokens, d, p, bytes_per_value=bpv)
        expected = sent_reference(tokens, d, p, bpv)
        equal(type(got), float, f"{call}: type of the result")
        assert got == pytest.approx(expected, rel=1e-12), f"{call}: expected {expected!r}, got {got!r}"
