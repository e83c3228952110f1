"""The cost a graded search is handed: evaluated, counted and capped in the grader's process.

A graded search of lessons 06-07 runs in the sandbox, but its cost function
holds the expected answer (the best partition, the crossing point). So the
graded test hands the search ``Counted(cost)``: the sandbox gets a stub
(``server``) that asks for each value over its socket, and this object, on
the trusted side, evaluates the real cost, records the argument and stops a
search past its limit. ``sandbox`` keeps such arguments on the trusted side;
``wire`` refuses to send a cost marked ``trusted_cost``. A low module (the
standard library only), so that ``sandbox`` can know the type without
importing ``harness`` and the engine behind it.
"""
from __future__ import annotations

import operator

MAX_EVALUATIONS = 10_000         # evaluations one search may ask for; the graded searches need at most a few hundred
MAX_PARTITION = 64               # chunks in a partition a grading cost accepts
MAX_TOKENS = 2**31               # the largest |value| of a context or a chunk, in tokens


class TooManyEvaluations(AssertionError):
    """A graded search asked for the cost more often than ``Counted``'s limit allows."""


def cost_argument(x):
    """``x`` as a grading cost takes it: a context (an int) or a partition (a list of at most 64 ints), in tokens.

    Anything with ``__index__`` (a NumPy integer) counts as an int. Raises TypeError, saying what is allowed.
    """
    try:
        if isinstance(x, (list, tuple)) and len(x) <= MAX_PARTITION:
            value = [operator.index(c) for c in x]
            if all(abs(c) < MAX_TOKENS for c in value):
                return value
        elif not isinstance(x, (list, tuple)):
            value = operator.index(x)
            if abs(value) < MAX_TOKENS:
                return value
    except TypeError:
        pass
    shown = repr(x) if len(repr(x)) <= 60 else repr(x)[:57] + "..."
    raise TypeError(f"the cost takes a context (an int) or a partition (a list of at most {MAX_PARTITION} ints), "
                    f"each below {MAX_TOKENS} in size; got {shown}")


def trusted_cost(fn):
    """Mark a cost function of this module: it, or a partial of it, holds the expected answer of a graded search,
    so ``wire`` refuses to send it to the sandbox (hand the submission ``Counted(cost)`` instead)."""
    fn.stays_trusted = True
    return fn


class Counted:
    """The cost function a graded search is given; evaluated, counted and capped where the graded test runs.

    Under the grader the search runs in the sandbox, where it gets a stub (``server``) that asks this object
    for each value over the sandbox's socket while the grader waits for the call's reply (``sandbox``):
    ``cost``, which holds the expected answer, never leaves the grader's process, and nothing in the sandbox
    can see it or stop the count. In a plain pytest run the search calls this object itself.

    calls: the argument of every evaluation, in order (``cost_argument``: an int or a list of ints).
    limit: evaluations allowed; one more raises ``TooManyEvaluations`` (under the grader the call is stopped).
    """

    def __init__(self, cost, limit: int = MAX_EVALUATIONS):
        self.cost, self.limit = cost, limit
        self.calls: list = []

    def __call__(self, x) -> float:
        x = cost_argument(x)
        if len(self.calls) >= self.limit:
            raise TooManyEvaluations(f"the search asked for the cost more than {self.limit} times; "
                                     f"a search needs far fewer evaluations")
        self.calls.append(x)
        return float(self.cost(x))

    def answer(self, x) -> dict:
        """The reply to the sandbox's request for ``cost(x)``: {"ok": True, "value": float} or the error
        (type and message) for the stub to raise. ``TooManyEvaluations`` is raised here, in the grader."""
        try:
            return {"ok": True, "value": self(x)}
        except TooManyEvaluations:
            raise
        except Exception as e:          # the search asked for a value the cost cannot give: its error to handle
            return {"ok": False, "type": type(e).__name__, "message": str(e)[:1000]}

    def _toyllm_remote_ref(self):
        """How it crosses to the sandbox (``wire``): a callback number, never its contents."""
        return ("callback", id(self))

    def __repr__(self) -> str:
        return "<the grader's cost function>"
