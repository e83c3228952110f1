"""Graded tests of lesson 01 (ex01_naive_generation): 15 points.

1.1 greedy_next_token 2, 1.2 sample_next_token 8, 1.3 naive_generate 5.
References live here: ``torch.argmax``, probabilities worked out by hand
(several exactly representable, so a boundary is a boundary) and a greedy
loop over the tiny model written below. Sampling tests draw through
``toyllm.grading.sandbox.harness.repeat`` so thousands of draws cost one call.
"""
import pytest
import torch

from toyllm.grading import sandboxed
from toyllm.grading.expect import equal, raises, same_tokens
from toyllm.grading.references import reference

PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]

# Probabilities chosen so that the top-k / top-p sets are easy to state and far from ties, listed in a
# shuffled order (token ids by rank: 5, 2, 7, 0, 3, 6, 1, 4) so that an answer which forgets to map
# sorted positions back to token ids keeps the wrong tokens.
BY_RANK = [5, 2, 7, 0, 3, 6, 1, 4]
RANKED_PROBS = [0.30, 0.22, 0.16, 0.12, 0.08, 0.05, 0.04, 0.03]
PROBS = torch.zeros(8)
PROBS[BY_RANK] = torch.tensor(RANKED_PROBS)
LOGITS = PROBS.log()


def top(n):
    """The token ids of the n most likely tokens of LOGITS."""
    return set(BY_RANK[:n])


def draws(ex01, n, logits=LOGITS, seed=0, **kw):
    return sandboxed("toyllm.grading.sandbox.harness:repeat", ex01.sample_next_token, n, logits, seed=seed, **kw)


def kept(ex01, n=400, logits=LOGITS, **kw):
    got = draws(ex01, n, logits, **kw)
    bad = [x for x in got if type(x) is not int]
    assert not bad, f"sample_next_token({_kw(kw)}): must return a Python int, got {bad[0]!r} ({type(bad[0]).__name__})"
    return set(got)


def _kw(kw):
    return ", ".join(f"{k}={v}" for k, v in kw.items())


@reference
def highest_score(logits):
    """The token id of the highest logit (the lowest id of a tie)."""
    return int(torch.argmax(logits))


@reference
def top_k_tokens(logits, k):
    """The ids of the k most likely tokens, sorted."""
    return sorted(torch.topk(logits, k).indices.tolist())


@reference
def sampling_probabilities(logits, temperature, top_k=None):
    """Each token's probability (float64) after the temperature and top_k."""
    scaled = logits.double() / temperature
    if top_k is not None:
        scaled[scaled < scaled.topk(top_k).values[-1]] = float("-inf")
    return torch.softmax(scaled, dim=-1)


# --------------------------------------------------------------------------- 1.1

@pytest.mark.exercise("1.1")
@pytest.mark.points(1)
def test_ex1_1_picks_the_highest_score(ex01, drawn):
    gen = torch.Generator().manual_seed(0)
    for i in range(12):
        logits = torch.randn(50, generator=gen) * 3 - 1
        equal(ex01.greedy_next_token(logits), highest_score(logits), f"greedy_next_token(random logits #{i})")
    rng, gen = drawn.rng("1.1"), drawn.generator("1.1")
    for i in range(8):                                   # drawn: vocabulary size, scale, and sometimes a tie
        vocab = rng.randint(2, 300)
        logits = torch.randn(vocab, generator=gen) * rng.uniform(0.1, 20) + rng.uniform(-50, 50)
        if i % 2:
            logits[rng.randrange(vocab)] = logits[rng.randrange(vocab)] = logits.max() + 1.0
        equal(ex01.greedy_next_token(logits), highest_score(logits),
              f"greedy_next_token(logits of {vocab} tokens #{i}, {drawn})")
    equal(ex01.greedy_next_token(torch.tensor([-5.0, -1.0, -3.0])), 1, "greedy_next_token([-5, -1, -3]) (all negative)")
    equal(ex01.greedy_next_token(torch.tensor([0.5, 2.0, 2.0, 1.0])), 1,
          "greedy_next_token([0.5, 2, 2, 1]) (a tie: the lowest id wins)")
    equal(ex01.greedy_next_token(torch.tensor([-1.0, float("-inf"), 3.5])), 2, "greedy_next_token([-1, -inf, 3.5])")


@pytest.mark.exercise("1.1")
@pytest.mark.points(1)
def test_ex1_1_one_position_only_and_any_dtype(ex01):
    equal(ex01.greedy_next_token(torch.tensor([1.0, 4.0, 2.0], dtype=torch.float64)), 1,
          "greedy_next_token(float64 logits [1, 4, 2])")
    equal(ex01.greedy_next_token(torch.tensor([7.0])), 0, "greedy_next_token([7.0]) (a vocabulary of one)")
    raises(ValueError, ex01.greedy_next_token, torch.zeros(2, 5), call="greedy_next_token(logits of shape (2, 5))",
           why="not one position's logits")
    raises(ValueError, ex01.greedy_next_token, torch.zeros(0), call="greedy_next_token(empty logits)")


# --------------------------------------------------------------------------- 1.2

@pytest.mark.exercise("1.2")
@pytest.mark.points(1)
def test_ex1_2_temperature_zero_is_greedy(ex01):
    gen = torch.Generator().manual_seed(1)
    for i in range(4):
        logits = torch.randn(30, generator=gen)
        best = highest_score(logits)
        equal(ex01.sample_next_token(logits, 0.0), best, f"sample_next_token(random logits #{i}, temperature=0)")
        equal(ex01.sample_next_token(logits, 0.0, top_k=5, top_p=0.5), best,
              f"sample_next_token(random logits #{i}, temperature=0, top_k=5, top_p=0.5)")


@pytest.mark.exercise("1.2")
@pytest.mark.points(1)
def test_ex1_2_top_k_keeps_the_k_best_tokens(ex01, drawn):
    for k in (1, 3, 5):
        got = kept(ex01, temperature=1.0, top_k=k)
        assert got == top(k), f"sample_next_token(temperature=1, top_k={k}): drew {sorted(got)}, expected " \
                              f"exactly the {k} most likely tokens {sorted(top(k))}"
    got = kept(ex01, temperature=3.0, top_k=1)
    assert got == top(1), f"sample_next_token(temperature=3, top_k=1): drew {sorted(got)}, expected only {sorted(top(1))}"
    got = kept(ex01, temperature=1.0, top_k=100)
    assert got == top(8), f"sample_next_token(top_k=100 > vocabulary of 8): drew {sorted(got)}, expected all 8 tokens"
    rng = drawn.rng("1.2")
    for _ in range(2):              # drawn: distinct logits in a shuffled order, a temperature and a k
        vocab, k = rng.randint(6, 40), rng.randint(2, 5)
        logits = torch.tensor([v / 20 for v in rng.sample(range(-20, 21), vocab)])   # in [-1, 1], 0.05 apart
        temperature = round(rng.uniform(1.0, 2.0), 2)
        best = set(top_k_tokens(logits, k))
        got = kept(ex01, 1000, logits, temperature=temperature, top_k=k)
        assert got == best, (f"sample_next_token(logits of {vocab} tokens, temperature={temperature}, top_k={k}; "
                             f"{drawn}): drew {sorted(got)}, expected exactly the {k} most likely tokens {sorted(best)}")


@pytest.mark.exercise("1.2")
@pytest.mark.points(1)
def test_ex1_2_top_p_keeps_the_nucleus_of_shuffled_logits(ex01):
    # T=1: probability ranked before each token is 0, .30, .52, .68: top_p=0.5 keeps 2 tokens, 0.6 keeps 3.
    for top_p, n in ((0.5, 2), (0.6, 3), (0.01, 1), (0.9, 6)):
        got = kept(ex01, temperature=1.0, top_p=top_p)
        assert got == top(n), f"sample_next_token(temperature=1, top_p={top_p}): drew {sorted(got)}, expected " \
                              f"the {n} most likely tokens {sorted(top(n))}"
    # top_p applies after the temperature: at T=0.5 the probabilities are .474, .255, ... so 0.6 keeps 2.
    got = kept(ex01, temperature=0.5, top_p=0.6)
    assert got == top(2), f"sample_next_token(temperature=0.5, top_p=0.6): drew {sorted(got)}, expected {sorted(top(2))}"


@pytest.mark.exercise("1.2")
@pytest.mark.points(1)
def test_ex1_2_top_p_boundary_and_edge_values(ex01):
    # Four equal logits: each probability is exactly 0.25, the mass before each kept token 0, .25, .5, .75.
    # A token is dropped when the ones before it already reach top_p, so 0.5 keeps 2 tokens and 0.75 keeps 3.
    quarters = torch.tensor([0.0, 0.0, float("-inf"), 0.0, 0.0])
    for top_p, n in ((0.5, 2), (0.75, 3), (0.7, 3), (1.0, 4)):
        got = kept(ex01, 800, quarters, temperature=1.0, top_p=top_p)
        assert len(got) == n and got <= {0, 1, 3, 4}, (
            f"sample_next_token(four tokens of probability exactly 0.25, top_p={top_p}): drew {sorted(got)}, "
            f"expected {n} distinct tokens (a token is dropped once the ones before it reach top_p)")
    got = kept(ex01, temperature=1.0, top_p=1.0)
    assert got == top(8), f"sample_next_token(top_p=1.0): drew {sorted(got)}, expected all 8 tokens (1.0 keeps all)"


@pytest.mark.exercise("1.2")
@pytest.mark.points(1)
def test_ex1_2_top_k_then_top_p(ex01):
    # top_k=2 first: the two best renormalise to .577 and .423, so top_p=0.5 keeps only the best one.
    # (top_p first, on all tokens, would keep two.)
    got = kept(ex01, temperature=1.0, top_k=2, top_p=0.5)
    assert got == top(1), f"sample_next_token(temperature=1, top_k=2, top_p=0.5): drew {sorted(got)}, expected " \
                          f"only {sorted(top(1))}: top_k first, then top_p on the renormalised survivors"
    got = kept(ex01, temperature=1.0, top_k=4, top_p=0.9)
    assert got == top(4), f"sample_next_token(temperature=1, top_k=4, top_p=0.9): drew {sorted(got)}, " \
                          f"expected {sorted(top(4))}"


@pytest.mark.exercise("1.2")
@pytest.mark.points(1)
def test_ex1_2_frequencies_match_the_softmax(ex01):
    """6000 seeded draws per setting; the largest gap to the exact probability must stay under 0.035 (> 4 sigma)."""
    logits = torch.tensor([-0.5, 2.0, 0.0, 1.0, -1.0, 0.5])
    settings = [dict(temperature=0.8), dict(temperature=2.0), dict(temperature=1.0, top_k=3)]
    for i, kw in enumerate(settings):
        expected = sampling_probabilities(logits, **kw)
        got = draws(ex01, 6000, logits, seed=3 + i, **kw)
        freq = torch.bincount(torch.tensor([int(x) for x in got]), minlength=6).double() / len(got)
        gap = (freq - expected).abs().max().item()
        assert gap < 0.035, (f"sample_next_token({_kw(kw)}): after 6000 draws the frequencies "
                             f"{[round(f, 3) for f in freq.tolist()]} differ from the softmax "
                             f"{[round(e, 3) for e in expected.tolist()]} by up to {gap:.3f}")


@pytest.mark.exercise("1.2")
@pytest.mark.points(1)
def test_ex1_2_same_seed_same_draws(ex01):
    kw = dict(temperature=1.0, top_p=0.95)
    first = draws(ex01, 60, seed=7, **kw)
    assert draws(ex01, 60, seed=7, **kw) == first, "sample_next_token with the same seeded generator must repeat " \
                                                   "its draws: pass generator= to torch.multinomial"
    assert draws(ex01, 60, seed=8, **kw) != first, "sample_next_token: a different seed gave the same 60 draws"


@pytest.mark.exercise("1.2")
@pytest.mark.points(1)
def test_ex1_2_rejects_bad_arguments(ex01):
    for kw in (dict(temperature=-1.0), dict(temperature=1.0, top_k=0), dict(temperature=1.0, top_p=0.0),
               dict(temperature=1.0, top_p=1.5), dict(temperature=1.0, top_p=-0.2)):
        raises(ValueError, ex01.sample_next_token, LOGITS, **kw, call=f"sample_next_token({_kw(kw)})",
               why="the docstring's allowed range")
    equal(type(ex01.sample_next_token(LOGITS, 1.0, top_k=8, top_p=1.0, generator=torch.Generator().manual_seed(0))),
          int, "type of sample_next_token(temperature=1, top_k=8, top_p=1.0) (valid edge values)")


# --------------------------------------------------------------------------- 1.3

@reference
def reference_greedy(model, prompt, n):
    """The naive loop, written out: the whole sequence through the model at every step."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.mark.exercise("1.3")
@pytest.mark.points(2)
def test_ex1_3_matches_the_reference_loop(ex01, tiny_model, drawn):
    for prompt, n in ((PROMPT, 10), ([42], 7), ([200, 3, 3, 3, 9], 13)):
        same_tokens(ex01.naive_generate(tiny_model, prompt, n), reference_greedy(tiny_model, prompt, n),
                    f"naive_generate(prompt of {len(prompt)} tokens, {n} new)")
    rng = drawn.rng("1.3")
    prompt, n = [rng.randrange(256) for _ in range(rng.randint(1, 12))], rng.randint(1, 9)
    same_tokens(ex01.naive_generate(tiny_model, prompt, n), reference_greedy(tiny_model, prompt, n),
                f"naive_generate(prompt {prompt}, {n} new; {drawn})")


@pytest.mark.exercise("1.3")
@pytest.mark.points(2)
def test_ex1_3_one_forward_per_token_over_the_whole_prefix(ex01, tiny_model):
    traced = sandboxed("toyllm.grading.sandbox.harness:traced", ex01.naive_generate, tiny_model, PROMPT, 6)
    out, calls = traced["value"], traced["calls"]
    same_tokens(out, reference_greedy(tiny_model, PROMPT, 6), "naive_generate(prompt of 8 tokens, 6 new)")
    assert len(calls) == 6, f"naive_generate(prompt of 8 tokens, 6 new): expected one model call per new token (6), " \
                            f"got {len(calls)}"
    for i, call in enumerate(calls):
        assert call["ids"] == PROMPT + out[:i], (f"naive_generate: step {i} must feed the prompt and the {i} tokens so "
                                                 f"far ({8 + i} tokens), fed {len(call['ids'])} tokens {call['ids']}")
        assert call["cache"] is None and call["input_pos"] in (None, 0), \
            f"naive_generate: step {i} passed a cache or input_pos={call['input_pos']}; the naive loop uses no cache"


@pytest.mark.exercise("1.3")
@pytest.mark.points(1)
def test_ex1_3_edge_cases(ex01, tiny_model):
    traced = sandboxed("toyllm.grading.sandbox.harness:traced", ex01.naive_generate, tiny_model, PROMPT, 0)
    equal(traced["value"], [], "naive_generate(prompt of 8 tokens, 0 new)")
    equal(len(traced["calls"]), 0, "model calls made by naive_generate(prompt of 8 tokens, 0 new)")
    raises(ValueError, ex01.naive_generate, tiny_model, [], 3, call="naive_generate(empty prompt, 3 new)")
    raises(ValueError, ex01.naive_generate, tiny_model, [], 0, call="naive_generate(empty prompt, 0 new)",
           why="an empty prompt is refused before the loop, even when no token is asked for")
    raises(ValueError, ex01.naive_generate, tiny_model, PROMPT, -1, call="naive_generate(prompt of 8 tokens, -1 new)")
