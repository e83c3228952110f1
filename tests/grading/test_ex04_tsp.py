"""Graded tests of lesson 04 (ex04_tsp): 10 points.

4.1 tsp_dot_products 2, 4.2 tsp_layer 4, 4.3 tsp_kv_bytes_received 2, 4.4 tensor_parallel_bytes_sent 2.
References live here: counts written out from the definitions, and the
one-process forward pass of the tiny model for the engine runs.
"""
import pytest

from toyllm.grading.expect import raises
from toyllm.parallel import ModelSpec

ATOL = 1e-4      # float32 K/V: the ranks sum the same products in another order


# --------------------------------------------------------------------------- 4.1

@pytest.mark.exercise("4.1")
@pytest.mark.points(1)
def test_ex4_1_the_papers_example(ex04):
    got = ex04.tsp_dot_products([3, 3, 3])
    assert got == [27, 27, 27] and all(type(n) is int for n in got), \
        f"tsp_dot_products([3, 3, 3]) (C=9, p=3): expected [27, 27, 27] (ints), got {got!r}"


@pytest.mark.exercise("4.1")
@pytest.mark.points(1)
def test_ex4_1_uneven_chunks_and_bad_input(ex04):
    got = ex04.tsp_dot_products([5, 1, 11, 2])
    assert got == [95, 19, 209, 38], f"tsp_dot_products([5, 1, 11, 2]): every rank scores its c_i queries " \
                                     f"against all 19 keys: expected [95, 19, 209, 38], got {got!r}"
    for bad in ([], [4, 0, 2], [3, -1]):
        raises(ValueError, ex04.tsp_dot_products, bad, call=f"tsp_dot_products({bad!r})",
               why="every rank needs at least one token")


# --------------------------------------------------------------------------- 4.2

def run_tsp(engine_run, step, p, chunks, seed=0, n_kv_heads=2):
    spec = ModelSpec("tiny", overrides=(("n_kv_heads", n_kv_heads),)) if n_kv_heads != 2 else ModelSpec("tiny")
    got, ref_cache = engine_run(step, "4.2", "tsp", p, chunks, seed=seed, spec=spec)
    for layer, ((k, v), (k_ref, v_ref)) in enumerate(zip(got.kv_cache, ref_cache)):
        assert k.shape == k_ref.shape and (k - k_ref).abs().max() < ATOL and (v - v_ref).abs().max() < ATOL, \
            f"Exercise 4.2, tsp_layer, p={p}, chunks {chunks}: layer {layer}'s K/V should cover the whole context {tuple(k_ref.shape)}"


@pytest.mark.exercise("4.2")
@pytest.mark.points(1)
@pytest.mark.timeout(180)
def test_ex4_2_two_ranks_even_split(ex04, engine_run):
    run_tsp(engine_run, ex04.tsp_layer, 2, [20, 20])


@pytest.mark.exercise("4.2")
@pytest.mark.points(1)
@pytest.mark.timeout(180)
def test_ex4_2_three_ranks_uneven_chunks(ex04, engine_run):
    run_tsp(engine_run, ex04.tsp_layer, 3, [17, 2, 12], seed=1)


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
    expected = [2 * 4096 * 40 * 128 * 2.0] * 2                       # LLaMA-2-13B shape, 8k tokens on 2 ranks
    assert got == expected and all(type(b) is float for b in got), \
        f"tsp_kv_bytes_received([4096, 4096], 40 kv heads, head_dim 128, 2 bytes): expected {expected}, got {got!r}"


@pytest.mark.exercise("4.3")
@pytest.mark.points(1)
def test_ex4_3_uneven_chunks_and_half_byte_values(ex04):
    got = ex04.tsp_kv_bytes_received([3, 5, 1], n_kv_heads=3, head_dim=64, bytes_per_value=0.5)
    expected = [2 * 6 * 192 * 0.5, 2 * 4 * 192 * 0.5, 2 * 8 * 192 * 0.5]
    assert got == pytest.approx(expected, rel=1e-12), \
        f"tsp_kv_bytes_received([3, 5, 1], 3 kv heads, head_dim 64, 4-bit values): expected {expected}, got {got!r}"


# --------------------------------------------------------------------------- 4.4

@pytest.mark.exercise("4.4")
@pytest.mark.points(1)
def test_ex4_4_llama2_13b_on_eight_gpus(ex04):
    got = ex04.tensor_parallel_bytes_sent(8192, 5120, 8, bytes_per_value=2)
    expected = 2 * 2 * 7 / 8 * 8192 * 5120 * 2
    assert type(got) is float and got == pytest.approx(expected, rel=1e-12), \
        f"tensor_parallel_bytes_sent(8192 tokens, d_model 5120, p=8, 2 bytes): expected {expected:.6g}, got {got!r}"


@pytest.mark.exercise("4.4")
@pytest.mark.points(1)
def test_ex4_4_one_process_sends_nothing_and_three_do(ex04):
    assert ex04.tensor_parallel_bytes_sent(100, 64, 1) == 0, "tensor_parallel_bytes_sent with p=1: expected 0"
    got = ex04.tensor_parallel_bytes_sent(10, 6, 3, bytes_per_value=4)
    assert got == pytest.approx(2 * 2 * 2 / 3 * 10 * 6 * 4, rel=1e-12), \
        f"tensor_parallel_bytes_sent(10 tokens, d_model 6, p=3, 4 bytes): expected 640.0, got {got!r}"
