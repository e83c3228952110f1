"""Checks for graded tests whose failure messages a student can act on.

Each check names the call in the exercise's words, what was expected and
what came back, e.g. ``cached_generate(prompt of 6 tokens, 20 new): token 3
differs: expected 118, got 97``. Types are checked exactly where the
docstring promises them (an int is not a float, a tensor is not an int)::

    from toyllm.grading.expect import close, equal, raises, same_tokens, tensors_close

    equal(ex02.kv_cache_bytes(40, 40, 128, 8192), 6_710_886_400, "kv_cache_bytes(LLaMA-2-13B, 8192 tokens)")
"""
from __future__ import annotations

import os

import torch

from ..checks import is_number

__all__ = ["close", "engine_cause", "equal", "neighbours_note", "raises", "same_tokens", "tensors_close"]


def _show(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"a tensor of shape {tuple(x.shape)}"
    text = repr(x)
    return text if len(text) <= 120 else text[:117] + "..."


def _kind(x) -> str:
    return "a tensor" if isinstance(x, torch.Tensor) else f"{type(x).__name__}"


def equal(got, expected, call: str) -> None:
    """``got == expected`` and of exactly the same type (int stays int, float stays float), inside lists, tuples
    and dicts too: ``{"kv": 1536.0}`` is not ``{"kv": 1536}``."""
    if type(got) is not type(expected):
        raise AssertionError(f"{call}: expected {_show(expected)} ({_kind(expected)}), "
                             f"got {_show(got)} ({_kind(got)})")
    if got != expected:
        raise AssertionError(f"{call}: expected {_show(expected)}, got {_show(got)}")
    where = _other_type_inside(got, expected)
    if where is not None:
        path, g, e = where
        raise AssertionError(f"{call}: {path} should be {_kind(e)} ({_show(e)}), got {_kind(g)} ({_show(g)})")


def _other_type_inside(got, expected, path: str = "the result"):
    """(where, got's item, expected's item) of the first item inside equal containers whose type differs."""
    if type(got) is not type(expected):
        return path, got, expected
    if isinstance(expected, dict):
        items = [(f"{path}[{k!r}]", got[k], v) for k, v in expected.items()]
    elif isinstance(expected, (list, tuple)):
        items = [(f"{path}[{i}]", g, e) for i, (g, e) in enumerate(zip(got, expected))]
    else:
        return None
    for where, g, e in items:
        found = _other_type_inside(g, e, where)
        if found is not None:
            return found
    return None


def close(got, expected: float, call: str, rel: float = 1e-9, abs_tol: float = 0.0) -> None:
    """A real number (float, int or Fraction; not a bool, a tensor or a string) within ``rel`` of ``expected``."""
    if not is_number(got):
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


# --------------------------------------------------------------------------- the engine: what each rank attended over

def _spans(values: list[int]) -> str:
    """[0, 1, 2, 7, 8] -> "0-2, 7-8": runs of consecutive integers."""
    runs: list[list[int]] = []
    for x in values:
        if runs and x == runs[-1][1] + 1:
            runs[-1][1] = x
        else:
            runs.append([x, x])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _tokens_of_rows(got: torch.Tensor, reference: torch.Tensor, atol: float) -> list[int | None]:
    """For each row of ``got`` (1, Hkv, S, D), the token whose row of ``reference`` (1, Hkv, C, D) it equals.

    Row t is taken for token t whenever it equals that token's row: a prompt that repeats a token id has
    equal values (no RoPE on them) at both places, and the right place is not a mistake.
    """
    flat_got = got[0].transpose(0, 1).reshape(got.shape[-2], -1).double()              # (S, Hkv * D)
    flat_ref = reference[0].transpose(0, 1).reshape(reference.shape[-2], -1).double()  # (C, Hkv * D)
    if flat_got.shape[-1] != flat_ref.shape[-1]:
        return [None] * got.shape[-2]
    dist = (flat_got[:, None, :] - flat_ref[None, :, :]).abs().amax(-1)                 # (S, C)
    best = dist.min(-1)
    tokens = []
    for row, (d, t) in enumerate(zip(best.values.tolist(), best.indices.tolist())):
        if row < dist.shape[1] and dist[row, row] <= atol:
            tokens.append(row)
        else:
            tokens.append(int(t) if d <= atol else None)
    return tokens


def _owners(tokens: list[int], starts: list[int], rank: int) -> str:
    """Who holds these tokens: "its own", "rank 0's" or "ranks 0-1's"."""
    ranks = sorted({max(r for r, s in enumerate(starts) if s <= t) for t in tokens})
    if ranks == [rank]:
        return "its own"
    return f"rank {ranks[0]}'s" if len(ranks) == 1 else f"ranks {_spans(ranks)}'s"


def _rows(first: int, last: int) -> str:
    return f"rows {first}-{last}" if last > first else f"row {first}"


def _describe_rows(tokens: list[int | None], starts: list[int], rank: int) -> str:
    """ "rows 0-9 hold its own tokens 25-34, rows 10-34 hold rank 0's tokens 0-24" """
    parts, row = [], 0
    while row < len(tokens):
        end = row
        if tokens[row] is None:
            while end + 1 < len(tokens) and tokens[end + 1] is None:
                end += 1
            parts.append(f"{_rows(row, end)} match{'' if end > row else 'es'} no token of the one-process run")
        else:
            while (end + 1 < len(tokens) and tokens[end + 1] is not None and tokens[end + 1] == tokens[end] + 1):
                end += 1
            held = tokens[row:end + 1]
            parts.append(f"{_rows(row, end)} hold{'' if end > row else 's'} {_owners(held, starts, rank)} "
                         f"token{'s' if end > row else ''} {_spans(held)}")
        row = end + 1
    return ", ".join(parts)


def engine_cause(trace: list[dict], reference: list[tuple[torch.Tensor, torch.Tensor]], chunks: list[int],
                 method: str, atol: float = 1e-4) -> str:
    """The first rank and layer whose attention inputs differ from the one-process run, and how; "" if none does.

    trace: ``toyllm.grading.sandbox.harness.engine_trace``'s records. reference: the
    one-process cache, (keys, values) per layer, each (1, Hkv, C, D).
    method: "kvr" (rank i should attend over tokens [0, s_i + c_i)) or
    "tsp" (over all C tokens). The row of key t is token t and its
    position is t. Layers are checked in order and, within one, ranks in
    order, so the first difference found is where the error starts.
    """
    starts = [sum(chunks[:r]) for r in range(len(chunks))]
    records = {(r["rank"], r["layer"]): r for r in trace}
    for layer, (k_ref, v_ref) in enumerate(reference):
        for rank, (start, c) in enumerate(zip(starts, chunks)):
            record = records.get((rank, layer))
            if record is None:
                continue
            where = f"rank {rank}, layer {layer}"
            want = start + c if method == "kvr" else sum(chunks)
            expected = list(range(want))
            q_pos = record["q_pos"]
            if q_pos is not None and q_pos.tolist() != list(range(start, start + c)):
                return (f"{where}: the query positions given to attend are {_spans(q_pos.tolist())}; the rank's own "
                        f"tokens are {_spans(list(range(start, start + c)))}, so those are their positions (pos.q_pos)")
            k = record["k"] if record["k"] is not None else record["k_out"]
            v = record["v"] if record["v"] is not None else record["v_out"]
            for label, got, ref in (("keys", k, k_ref), ("values", v, v_ref)):
                tokens = _tokens_of_rows(got, ref, atol)
                if tokens == expected:
                    continue
                ahead = ""
                own = set(range(start, start + c))
                held = [t for t in tokens if t is not None]
                if rank and held and held[0] in own and any(t < start for t in held):
                    ahead = f"; the prefix from ranks before it (tokens 0-{start - 1}) should come first"
                elif all(t is not None for t in tokens) and sorted(tokens) == expected:
                    ahead = "; row t should hold token t"
                elif all(t is None for t in tokens):
                    ahead = ("; at this layer the keys and values of the tokens themselves differ, so what the "
                             "layers before it returned (the hidden states after layer.finish) already differs"
                             if layer else "; at layer 0 every key is the projection of a token with RoPE at its "
                             "position (layer.qkv with pos.cos, pos.sin)")
                return (f"{where}: of the {got.shape[-2]} {label} it attended over, "
                        f"{_describe_rows(tokens, starts, rank)}; it should attend over tokens {_spans(expected)} "
                        f"in order{ahead}")
            k_pos = record["k_pos"]
            if k_pos is not None and k_pos.tolist() != expected:
                return (f"{where}: the key positions given to attend are {_spans(k_pos.tolist())}; its keys are "
                        f"tokens {_spans(expected)}, so they should be {_spans(expected)} (the position of a key is "
                        "its token's place in the prompt)")
    return ""


# --------------------------------------------------------------------------- the student edition: other exercises

_verdicts: dict[tuple, bool] = {}            # (exercise, implementation, its file's stamp) -> fails its own tests
_RAN_ALSO = "this test also ran Exercise "


def neighbours_note(exercise: str, ran, known: dict[str, bool] | None = None) -> str:
    """Which of the other exercises a failed test ran fail their own graded tests, as advice; "" if none does.

    Under the grader (either edition) and in the student edition no model
    answer stands in for the lesson's other exercises, so a test of
    ``exercise`` runs the student's own code for every exercise in ``ran``
    (``toyllm.answers.ran``: those found written; an unwritten one names
    itself in the test's error, or a stand-in that is no answer ran). Each of those is
    graded on its own (once per version of its file), and one that fails
    is named: "this test also ran your gather_rows (Exercise 8.2), which
    fails its own tests: fix 8.2 first".

    known: {exercise: fails its own tests} where that is known already (a test of it failed in this run having
    run no other exercise, or an earlier lesson of the grading showed it): those are not graded again to learn
    it (an untouched lesson 02 would be graded once more by each engine lesson).
    """
    from toyllm import answers

    known = known or {}
    marks = answers.answer_marks()
    failing = [n for n in sorted(set(ran) - {exercise})
               if n in marks and (known[n] if n in known else _fails_own_tests(n))]
    return "; ".join(f"this test also ran your {marks[n].function} (Exercise {n}), which fails its own tests: "
                     f"fix {n} first" for n in failing)


def ran_also(exercise: str, ran) -> str:
    """While a neighbour is graded for a note: "this test also ran Exercise 8.1", so that a test that failed
    through another exercise does not count against this one; "" when the test ran no other exercise."""
    others = sorted(set(ran) - {exercise})
    return _RAN_ALSO + ", ".join(others) if others else ""


def _fails_own_tests(number: str) -> bool:
    """Whether Exercise ``number`` fails a graded test of its own that ran no other exercise (which may be
    wrong too: in the student edition nothing stands in for it)."""
    from toyllm import answers

    from ..course import exercise_file, resolve_impl
    from .grader.grade import GradingError, grade
    from ..course import current_impl
    from .settings import Settings

    try:                          # read by name, never asked of the submission (under the grader it is a proxy)
        path = exercise_file(resolve_impl(), answers.lesson_module(number))
        stat = os.stat(path)
    except (OSError, ValueError):
        return False
    key = (number, current_impl(), path, stat.st_mtime_ns, stat.st_size)
    if key not in _verdicts:
        os.environ.update(Settings(neighbour="1").to_env())     # read by the graded tests' conftest
        try:
            report = grade(current_impl(), only=number)
            _verdicts[key] = any(t.status not in ("passed", "skipped") and _RAN_ALSO not in t.output
                                 for t in report.tests)
        except (GradingError, ValueError):
            _verdicts[key] = False
        finally:
            del os.environ[Settings.variable("neighbour")]
    return _verdicts[key]
