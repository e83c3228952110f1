"""Graded tests of lesson 01 (ex01_naive_generation): 15 points.

1.1 greedy_next_token 2, 1.2 sample_next_token 8, 1.3 naive_generate 5.
References: ``torch.argmax``, exact softmax probabilities and
``toyllm.generation.generate(..., method="naive")`` on the tiny preset.
"""
import pytest
import torch

from toyllm import generate

PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]

# Probabilities chosen so that the top-k / top-p sets are easy to state and far from ties.
PROBS = torch.tensor([0.30, 0.22, 0.16, 0.12, 0.08, 0.05, 0.04, 0.03])
LOGITS = PROBS.log()


def frequencies(tokens, vocab):
    return torch.bincount(torch.tensor(tokens), minlength=vocab).double() / len(tokens)


# --------------------------------------------------------------------------- 1.1

@pytest.mark.exercise("1.1")
@pytest.mark.points(1)
def test_ex1_1_picks_the_highest_score(ex01):
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        logits = torch.randn(50, generator=gen) * 3 - 1
        got = ex01.greedy_next_token(logits)
        assert type(got) is int, f"return a Python int, not {type(got).__name__}"
        assert got == int(torch.argmax(logits))
    assert ex01.greedy_next_token(torch.tensor([-5.0, -1.0, -3.0])) == 1        # all scores negative
    assert ex01.greedy_next_token(torch.tensor([0.5, 2.0, 2.0, 1.0])) == 1      # a tie goes to the lowest id
    with pytest.raises(ValueError):
        ex01.greedy_next_token(torch.zeros(2, 5))                               # not one position's logits


@pytest.mark.exercise("1.1")
@pytest.mark.points(1)
def test_ex1_1_first_token_of_the_tiny_model(ex01, tiny_model):
    logits = tiny_model(torch.tensor([PROMPT]))[0, -1]                           # (vocab,)
    assert ex01.greedy_next_token(logits) == generate(tiny_model, PROMPT, 1).output_ids[0]


# --------------------------------------------------------------------------- 1.2

def sample_many(ex01, n, seed=0, logits=LOGITS, **kw):
    gen = torch.Generator().manual_seed(seed)
    return [ex01.sample_next_token(logits, generator=gen, **kw) for _ in range(n)]


@pytest.mark.exercise("1.2")
@pytest.mark.points(1)
def test_ex1_2_temperature_zero_is_greedy(ex01):
    gen = torch.Generator().manual_seed(1)
    for _ in range(10):
        logits = torch.randn(30, generator=gen)
        got = ex01.sample_next_token(logits, 0.0, generator=torch.Generator().manual_seed(0))
        assert type(got) is int and got == int(torch.argmax(logits))
        assert ex01.sample_next_token(logits, 0.0, top_k=5, top_p=0.5) == int(torch.argmax(logits))


@pytest.mark.exercise("1.2")
@pytest.mark.points(1)
def test_ex1_2_top_k_one_is_argmax(ex01):
    logits = torch.randn(30, generator=torch.Generator().manual_seed(2))
    for temperature in (0.5, 1.0, 3.0):
        got = set(sample_many(ex01, 30, temperature=temperature, top_k=1, logits=logits))
        assert got == {int(torch.argmax(logits))}, f"top_k=1 at temperature {temperature} drew {got}"


@pytest.mark.exercise("1.2")
@pytest.mark.points(1)
def test_ex1_2_never_samples_outside_the_top_k(ex01):
    assert set(sample_many(ex01, 400, temperature=1.0, top_k=3)) == {0, 1, 2}
    assert set(sample_many(ex01, 400, temperature=2.0, top_k=5)) == {0, 1, 2, 3, 4}
    assert set(sample_many(ex01, 50, temperature=1.0, top_k=100)) <= set(range(8))   # top_k > vocab keeps all


@pytest.mark.exercise("1.2")
@pytest.mark.points(1)
def test_ex1_2_never_samples_outside_the_top_p_set(ex01):
    # T=1: probability ranked before each token is 0, .30, .52, .68: top_p=0.5 keeps {0, 1}, 0.6 keeps {0, 1, 2}.
    assert set(sample_many(ex01, 400, temperature=1.0, top_p=0.5)) == {0, 1}
    assert set(sample_many(ex01, 400, temperature=1.0, top_p=0.6)) == {0, 1, 2}
    # top_p applies after the temperature: at T=0.5 the probabilities are .474, .255, ... so 0.6 keeps {0, 1}.
    assert set(sample_many(ex01, 400, temperature=0.5, top_p=0.6)) == {0, 1}
    # The most likely token always stays, however small top_p is.
    assert set(sample_many(ex01, 50, temperature=1.0, top_p=0.01)) == {0}
    # Both: top_k first, then top_p among the survivors.
    assert set(sample_many(ex01, 400, temperature=1.0, top_k=4, top_p=0.9)) <= {0, 1, 2, 3}


@pytest.mark.exercise("1.2")
@pytest.mark.points(2)
def test_ex1_2_frequencies_match_the_softmax(ex01):
    """6000 seeded draws per setting; the largest gap to the exact probability must stay under 0.035 (> 4 sigma)."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0])
    for temperature in (0.8, 2.0):
        expected = torch.softmax(logits.double() / temperature, dim=-1)
        got = frequencies(sample_many(ex01, 6000, seed=3, logits=logits, temperature=temperature), 6)
        gap = (got - expected).abs().max().item()
        assert gap < 0.035, f"temperature {temperature}: frequencies {got.tolist()} vs softmax {expected.tolist()}"
    # top_k=3: the three kept tokens share all the probability in the same proportions.
    kept = torch.softmax(logits[:3].double(), dim=-1)
    expected = torch.cat([kept, torch.zeros(3, dtype=torch.float64)])
    got = frequencies(sample_many(ex01, 6000, seed=4, logits=logits, temperature=1.0, top_k=3), 6)
    assert (got - expected).abs().max().item() < 0.035, f"top_k=3: {got.tolist()} vs {expected.tolist()}"


@pytest.mark.exercise("1.2")
@pytest.mark.points(1)
def test_ex1_2_same_seed_same_draws(ex01):
    kw = dict(temperature=1.0, top_p=0.95)
    first = sample_many(ex01, 60, seed=7, **kw)
    assert sample_many(ex01, 60, seed=7, **kw) == first
    assert sample_many(ex01, 60, seed=8, **kw) != first, "a different seed should give different draws"


@pytest.mark.exercise("1.2")
@pytest.mark.points(1)
def test_ex1_2_rejects_bad_arguments(ex01):
    for kw in (dict(temperature=-1.0), dict(temperature=1.0, top_k=0), dict(temperature=1.0, top_p=0.0),
               dict(temperature=1.0, top_p=1.5)):
        with pytest.raises(ValueError):
            ex01.sample_next_token(LOGITS, **kw)


# --------------------------------------------------------------------------- 1.3

@pytest.mark.exercise("1.3")
@pytest.mark.points(2)
def test_ex1_3_matches_the_reference_loop(ex01, tiny_model):
    for prompt in (PROMPT, [42]):
        expected = generate(tiny_model, prompt, 10, method="naive").output_ids
        assert ex01.naive_generate(tiny_model, prompt, 10) == expected


@pytest.mark.exercise("1.3")
@pytest.mark.points(2)
def test_ex1_3_one_forward_per_token_over_the_whole_prefix(ex01, tiny_model, forward_calls):
    calls = forward_calls(tiny_model)
    out = ex01.naive_generate(tiny_model, PROMPT, 6)
    assert len(out) == 6
    assert len(calls) == 6, f"expected one model call per new token (6), got {len(calls)}"
    for i, call in enumerate(calls):
        assert call.ids == PROMPT + out[:i], f"step {i} must feed the prompt and the {i} tokens so far"
        assert call.cache is None and call.input_pos in (None, 0), "naive generation uses no cache"


@pytest.mark.exercise("1.3")
@pytest.mark.points(1)
def test_ex1_3_edge_cases(ex01, tiny_model, forward_calls):
    calls = forward_calls(tiny_model)
    assert ex01.naive_generate(tiny_model, PROMPT, 0) == [] and calls == []
    with pytest.raises(ValueError):
        ex01.naive_generate(tiny_model, [], 3)
    with pytest.raises(ValueError):
        ex01.naive_generate(tiny_model, PROMPT, -1)
