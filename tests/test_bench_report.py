"""docs/benchmarks.md is rendered from a template: every section renders, and its verdicts follow the numbers."""
import pytest

from toyllm.bench import SECTIONS, render_section


def _prefill(tsp, kvr_best, single_2t, sdpa_single, sdpa_kvr):
    row = {"context": 8192, "single_1t": 8.0, "single_2t": single_2t, "tsp": tsp, "kvr_even": 4.0,
           "kvr_best": kvr_best, "kvr_best_chunks": [5079, 3113], "lower_bound": 3.0}
    sdpa = {"context": 8192, "single_2t": sdpa_single, "tsp": 2.2, "kvr": sdpa_kvr, "chunks": [5079, 3113]}
    return {"repeats": 5, "warm": 2, "sweep": ["0.50"], "sweep_repeats": 3, "rows": [row], "sdpa": [sdpa]}


def test_prefill_verdicts_are_computed_from_the_numbers():
    good = render_section("prefill", _prefill(tsp=4.2, kvr_best=3.2, single_2t=4.0, sdpa_single=0.9, sdpa_kvr=1.6))
    assert "1.31x faster than TSP, which meets the 1.25x target" in good
    assert "1.78x slower than one process with two threads" in good and "One process wins here" in good
    bad = render_section("prefill", _prefill(tsp=4.2, kvr_best=4.0, single_2t=3.0, sdpa_single=1.9, sdpa_kvr=1.6))
    assert "1.05x faster than TSP, which does not meet the 1.25x target" in bad
    assert "KVR keeps its lead" in bad and "One process wins" not in bad


def test_first_token_section_renders():
    data = {"threads": 2, "repeats": 5, "vocab": 49152, "rows": [
        {"name": "random", "tokens": 1024, "all_s": 3.0, "last_s": 2.0, "head_gflop": 58.0, "total_gflop": 290.0}]}
    text = render_section("first_token", data)
    assert "| random | 1024 | 3.000 | 2.000 | 1.50x |" in text and "1.50x faster than before" in text


def test_every_section_has_a_template():
    from toyllm.bench import _template

    for name in SECTIONS:
        assert hasattr(_template().module, name), name


def test_missing_numbers_are_an_error_not_a_blank():
    with pytest.raises(Exception, match="no attribute .repeats."):
        render_section("first_token", {"threads": 2})


def test_a_difference_within_one_percent_is_called_a_tie():
    from toyllm.bench import _than

    assert _than(1.427 / 1.420) == "as fast (1.005x) as"
    assert _than(0.995) == "as fast (0.995x) as"
    assert _than(1.2) == "1.20x faster than" and _than(0.8) == "1.25x slower than"
