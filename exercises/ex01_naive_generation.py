"""Lesson 01 exercises: from logits to the next token, and the naive generation loop.

A language model turns token ids into *logits*: one score per vocabulary
entry at every position. Generating text means looking at the last
position's scores, choosing a token, appending it and asking again. Here the
loop re-runs the model over the whole sequence at every step (no cache yet):
simple and correct, but step n costs as much as a prefill of n tokens.

| exercise | function            | points |
|----------|---------------------|--------|
| 1.1      | greedy_next_token   | 2      |
| 1.2      | sample_next_token   | 8      |
| 1.3      | naive_generate      | 5      |

Notebooks and tests reach this file with
``toyllm.grading.load_exercise("ex01")``, which returns your version
(``exercises/``) or the model answer (``solutions/``) depending on
``TOYLLM_IMPL``. Check your work with ``python -m toyllm grade --only ex01``.

Write each exercise yourself: your answer to Exercise N.M may not call
toyllm's own implementation of it, which ``toyllm.answers.forbidden("N.M")``
lists (a per-layer step run in the engine may not even name it); one
that does scores 0 for that exercise.
"""
from __future__ import annotations

import torch

from toyllm.generation import check_sampling


def greedy_next_token(logits: torch.Tensor) -> int:
    """Exercise 1.1 (2 points): the id of the highest-scoring token.

    logits: (vocab,) float scores of one position, of any float dtype; any
        real numbers or -inf, they need not be normalised (softmax would
        not change the winner).
    Returns a Python int in [0, vocab), not a tensor. On a tie the lowest id
    wins, as with ``torch.argmax``.
    Raises ValueError if logits is not a non-empty 1-D tensor.
    """
    raise NotImplementedError(
        "Exercise 1.1: implement greedy_next_token (idea: the most likely token is the largest "
        "logit; return it as a plain Python int)")


def sample_next_token(logits: torch.Tensor, temperature: float = 0.0, top_k: int | None = None,
                      top_p: float | None = None, generator: torch.Generator | None = None) -> int:
    """Exercise 1.2 (8 points): draw the next token id from one position's logits.

    logits: (vocab,) float scores.
    temperature: 0 means greedy (return the argmax and draw nothing).
        Otherwise divide the logits by it before the softmax: below 1
        sharpens the distribution, above 1 flattens it.
    top_k: keep only the top_k highest-scoring tokens (None, or a top_k
        above the vocabulary size: keep all).
    top_p: then keep the smallest set of most likely tokens whose
        probabilities (after the temperature, renormalised over the tokens
        top_k kept) add up to at least top_p ("nucleus"); a token is
        dropped when the more likely ones before it already reach top_p, so
        the most likely token always stays (None or 1.0: keep all).
    generator: a seeded ``torch.Generator``; pass it to ``torch.multinomial``
        so that the same seed gives the same draws.
    Returns a Python int. The kept tokens are drawn with probabilities
    proportional to softmax(logits / temperature) restricted to them.
    Raises ValueError if temperature < 0, top_k < 1 or top_p is outside (0, 1].
    """
    raise NotImplementedError(
        "Exercise 1.2: implement sample_next_token (idea: temperature rescales the logits before "
        "the softmax; top-k and top-p remove the unlikely tail before you draw one token with the "
        "generator)")


@torch.no_grad()
def naive_generate(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Exercise 1.3 (5 points): greedy generation that re-runs the whole sequence at every step.

    model: a toyllm ``Transformer``; ``model(ids)`` with ids of shape (1, T)
        returns logits of shape (1, T, vocab). Call it without a cache.
    prompt_ids: the prompt's token ids (at least one).
    max_new_tokens: how many tokens to generate (>= 0).
    Returns a list of max_new_tokens Python ints, the new ids only (not the prompt), each chosen
    with ``greedy_next_token``. Step i calls the model exactly once, on the
    prompt plus the i tokens generated so far: len(prompt) + i tokens. This
    is the slow baseline that the KV cache of lesson 02 speeds up.
    max_new_tokens = 0 returns [] without calling the model.
    Raises ValueError for an empty prompt (even when max_new_tokens is 0)
    or a negative max_new_tokens.
    """
    raise NotImplementedError(
        "Exercise 1.3: implement naive_generate (idea: each step runs the model over the whole "
        "sequence so far and keeps only the last position's logits)")
