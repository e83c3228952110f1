"""Checks for graded tests whose failure messages a student can act on.

Each check names the call in the exercise's words, what was expected and
what came back, e.g. ``cached_generate(prompt of 6 tokens, 20 new): token 3
differs: expected 118, got 97``. Types are checked exactly where the
docstring promises them (an int is not a float, a tensor is not an int)::

    from toyllm.grading.expect import close, equal, raises, same_tokens, tensors_close

    equal(ex02.kv_cache_bytes(40, 40, 128, 8192), 6_710_886_400, "kv_cache_bytes(LLaMA-2-13B, 8192 tokens)")
"""
from __future__ import annotations

import numbers

import torch

__all__ = ["close", "equal", "raises", "same_tokens", "tensors_close"]


def _show(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"a tensor of shape {tuple(x.shape)}"
    text = repr(x)
    return text if len(text) <= 120 else text[:117] + "..."


def _kind(x) -> str:
    return "a tensor" if isinstance(x, torch.Tensor) else f"{type(x).__name__}"


def equal(got, expected, call: str) -> None:
    """``got == expected`` and of exactly the same type (int stays int, float stays float)."""
    if type(got) is not type(expected):
        raise AssertionError(f"{call}: expected {_show(expected)} ({_kind(expected)}), "
                             f"got {_show(got)} ({_kind(got)})")
    if got != expected:
        raise AssertionError(f"{call}: expected {_show(expected)}, got {_show(got)}")


def close(got, expected: float, call: str, rel: float = 1e-9, abs_tol: float = 0.0) -> None:
    """A real number (float, int or Fraction; not a bool, a tensor or a string) within ``rel`` of ``expected``."""
    if isinstance(got, bool) or not isinstance(got, numbers.Real):
        raise AssertionError(f"{call}: expected a number close to {expected!r}, got {_show(got)} ({_kind(got)})")
    if not _within(float(got), float(expected), rel, abs_tol):
        raise AssertionError(f"{call}: expected {expected!r}, got {float(got)!r} "
                             f"(off by {float(got) - float(expected):+.3g}; allowed relative error {rel:g})")


def _within(got: float, expected: float, rel: float, abs_tol: float) -> bool:
    return got == expected or abs(got - expected) <= max(rel * abs(expected), abs_tol)


def same_tokens(got, expected: list[int], call: str) -> None:
    """A list of Python ints equal to ``expected``; the message names the first token that differs."""
    if not isinstance(got, list):
        raise AssertionError(f"{call}: expected a list of {len(expected)} token ids, got {_show(got)} ({_kind(got)})")
    bad = [x for x in got if type(x) is not int]
    if bad:
        raise AssertionError(f"{call}: token ids must be Python ints, got {_show(bad[0])} ({_kind(bad[0])})")
    for i, (g, e) in enumerate(zip(got, expected)):
        if g != e:
            raise AssertionError(f"{call}: token {i} differs: expected {e}, got {g}")
    if len(got) != len(expected):
        raise AssertionError(f"{call}: expected {len(expected)} new tokens, got {len(got)}")


def tensors_close(got, expected: torch.Tensor, call: str, atol: float = 1e-5) -> None:
    """A tensor of ``expected``'s shape within ``atol`` everywhere; the message names the worst entry."""
    if not isinstance(got, torch.Tensor):
        raise AssertionError(f"{call}: expected a tensor of shape {tuple(expected.shape)}, got {_show(got)}")
    if got.shape != expected.shape:
        raise AssertionError(f"{call}: expected shape {tuple(expected.shape)}, got {tuple(got.shape)}")
    diff = (got.double() - expected.double()).abs()
    if not torch.isfinite(got).all():
        raise AssertionError(f"{call}: the result holds NaN or inf (expected finite values)")
    worst = diff.max().item() if diff.numel() else 0.0
    if worst > atol:
        where = tuple(int(i) for i in torch.unravel_index(diff.argmax(), diff.shape))
        raise AssertionError(f"{call}: differs by up to {worst:.3g} (allowed {atol:g}) at index {where}: "
                             f"expected {expected[where].item():.6g}, got {got[where].item():.6g}")


def raises(error: type[BaseException], fn, *args, call: str, why: str = "", **kwargs) -> None:
    """``fn(*args, **kwargs)`` must raise ``error`` (the docstring promises it)."""
    try:
        value = fn(*args, **kwargs)
    except error:
        return
    except Exception as e:
        raise AssertionError(f"{call}: expected {error.__name__}{' (' + why + ')' if why else ''}, "
                             f"got {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
    raise AssertionError(f"{call}: expected {error.__name__}{' (' + why + ')' if why else ''}, "
                         f"but it returned {_show(value)}")
