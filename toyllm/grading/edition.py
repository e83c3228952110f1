"""The student edition: the course without its answers, where the framework runs the student's code.

This repository is the instructor edition: the model answers live in
``solutions/`` and the framework runs them. ``build`` writes a copy for a
class (``make student OUT=../toyllm-student``), ready to ``git init`` and
hand out:

- ``exercises/`` holds the stubs, with hints at the level the instructor
  picks (``idea`` or ``code``, see ``stubs``);
- only files git tracks are copied (an instructor's untracked hidden tests
  or grades never ship); ``solutions/``, the grader's own tests, the sample
  submissions and the instructors' notes are left out;
- a ``@shortcut(..., student=f)`` library function's body becomes one call
  of ``f``, which runs the student's exercise: the edition holds no copy of
  the exercise's algorithm;
- ``toyllm.answers.EDITION`` is ``"student"``: every library function marked
  ``@answer`` runs the student's exercise, and a command that needs an
  unwritten one stops with a line naming it;
- the Makefile's ``make test`` runs against ``exercises/``: tests that need
  an unwritten exercise are skipped with its name (root ``conftest.py``).

``answer_texts`` and ``find_answers`` are the proof: no substantial statement
of any model answer (``SUBSTANTIAL_NODES``), names normalised, may occur in
a Python file (tests included) or a notebook cell (code or output) of the
edition. ``build`` checks that before it returns, and so does the test
suite; ``answers_in_hints`` checks the ``HINTS=code`` hints the same way.
``find_near_copies`` looks further: no function of the edition may do an
answer's work the answer's way, its steps rewritten a little (the rule is
written above it).
"""
from __future__ import annotations

import argparse
import ast
import builtins
import copy
import difflib
import functools
import json
import re
import shutil
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from .. import answers
from ..course import course_root
from .references import write_expected_values
from ..stubs import HINT_LEVELS, make_stub

# Files of the instructor edition that a class does not get: paths, and prefixes of paths (the grader's own
# tests, tests/test_grader*.py, grade the model answers and the hostile submissions of the fixtures).
# The tests of checking again and of step diagnostics are built from the model answers (they read solutions/,
# and the diagnostics' test carries answer lines of 4.2 and 5.1); so is the simulated platforms' test (it grades
# solutions/). The fixtures hold hostile submissions and correct answers in other words; .github/ holds the
# course repository's own workflow.
INSTRUCTOR_ONLY = ("solutions/", "tests/fixtures/", ".github/", "tests/test_grader", "tests/test_grading_04_05.py",
                   "tests/test_grading_09.py", "tests/test_platforms.py",
                   "tests/test_student_edition.py", "tests/test_checking_again.py", "tests/test_step_diagnostics.py",
                   "tests/test_stored_expected.py", "tests/test_messages.py", "docs/grading.md")

_BEGIN = re.compile(r"^[ \t]*# BEGIN SOLUTION (\d+\.\d+)")
_END = re.compile(r"^[ \t]*# END SOLUTION\s*$")
_HINT = re.compile(r"^[ \t]*# BEGIN SOLUTION (?P<id>\d+\.\d+) hint: (?P<hint>.+?)\s*$")


# --------------------------------------------------------------------------- answer text, normalised

# A statement is "substantial" when its normalised form has at least this many AST nodes (names,
# constants, operators and keywords count; the Load/Store markers do not). Below it lie statements too
# common to prove a copy: ``return x`` (2 nodes), ``i += 1`` (4), ``x = a + b`` (6), ``chain.send(k, v)``
# (6), ``T = k.shape[-2]`` (8), ``ids = [int(t) for t in ids]`` (9). At it and above:
# ``probs = torch.softmax(logits, dim=-1)`` (10), ``q, k, v = layer.qkv(x, pos.cos, pos.sin)`` (13).
SUBSTANTIAL_NODES = 10

# A loop or ``with`` counts by its header (``for offsets in itertools.product(...)``), the statements of
# its body each on their own; a loop over a written-out tuple or list is the usual check of named
# arguments and does not. An ``if``, a ``try`` or a definition does not count by itself: its header is
# a guard (``if p < 1: raise ...``) or a signature, which the stubs keep.
_HEADERS = (ast.For, ast.AsyncFor, ast.While, ast.With, ast.AsyncWith)
_BUILTINS = frozenset(dir(builtins))
# Statements whose value is compared on its own as well as whole (see ``answer_texts``).
_VALUED = (ast.Return, ast.Assign, ast.AugAssign, ast.AnnAssign)


def _normalise(stmt: ast.stmt) -> str:
    """One statement with its names renamed in order of appearance and its strings blanked.

    Renaming variables, arguments or messages does not hide a copy; the
    attributes and calls that make up the algorithm (``layer.qkv``,
    ``chain.isend``) and the builtins (``max``, ``sorted``) stay as they are.
    The statement is changed in place: renaming is canonical, so a statement
    inside one normalised before gets the same text as from the source.
    """
    names: dict[str, str] = {}

    class Rename(ast.NodeTransformer):
        def visit_Name(self, node):
            if node.id not in _BUILTINS:
                node.id = names.setdefault(node.id, f"v{len(names)}")
            return node

        def visit_arg(self, node):
            node.arg = names.setdefault(node.arg, f"v{len(names)}")
            node.annotation = None
            return node

        def visit_Constant(self, node):
            return ast.Constant("") if isinstance(node.value, str) else node

        def visit_JoinedStr(self, node):
            return ast.Constant("")

    return ast.dump(Rename().visit(stmt), annotate_fields=False)


def _size(node: ast.AST) -> int:
    """The AST nodes of a statement as ``_normalise`` leaves it: Load/Store/Del markers left out, an f-string
    one node (it becomes a blank string)."""
    if isinstance(node, ast.JoinedStr):
        return 1
    return (not isinstance(node, ast.expr_context)) + sum(_size(child) for child in ast.iter_child_nodes(node))


def _statements(tree: ast.AST) -> list[ast.stmt]:
    """The statements of a tree that can be copied one by one, at any depth: every simple statement, and
    each loop and ``with`` as its header alone (its body replaced by ``pass``)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.For, ast.AsyncFor)) and isinstance(node.iter, (ast.Tuple, ast.List)):
            continue
        if isinstance(node, _HEADERS):
            header = copy.copy(node)          # shallow: the body stays in the tree, to be walked on its own
            header.body, header.orelse = [ast.Pass()], []
            out.append(header)
        elif isinstance(node, ast.stmt) and not hasattr(node, "body"):
            out.append(node)
    return out


@dataclass(frozen=True)
class AnswerText:
    label: str                  # "Exercise 5.2 (solutions/ex05_kv_runahead.py)"
    text: str                   # one substantial statement of it, normalised


def answer_texts(root: Path | None = None) -> list[AnswerText]:
    """Every substantial statement of every model answer of ``solutions/``, normalised (and the value of
    each return and assignment as a statement of its own)."""
    root = course_root() if root is None else Path(root)
    out = []
    for path in sorted((root / "solutions").glob("ex*.py")):
        source = path.read_text()
        regions, start = [], None
        for no, line in enumerate(source.splitlines(), start=1):
            if (m := _BEGIN.match(line)):
                start = (no, m[1])
            elif _END.match(line) and start:
                regions.append((*start, no))
                start = None
        statements = _statements(ast.parse(source))
        for begin, number, end in regions:
            label = f"Exercise {number} ({path.relative_to(root)})"
            for stmt in statements:
                if begin < stmt.lineno < end and _size(stmt) >= SUBSTANTIAL_NODES:
                    out.append(AnswerText(label, _normalise(stmt)))
                    # the value of a return or an assignment on its own too: a notebook cell (or a hint)
                    # that shows ``2 * B * D * F / (...)`` holds the answer as much as ``return`` does
                    value = getattr(stmt, "value", None)
                    if isinstance(stmt, _VALUED) and value is not None:
                        alone = ast.Expr(value)
                        if _size(alone) >= SUBSTANTIAL_NODES:
                            out.append(AnswerText(label, _normalise(alone)))
    return out


def _python_sources(folder: Path):
    """(where, source) of every .py file and every notebook code cell (magics left out) and output under
    ``folder``; ``where`` names the file, and the cell ("lesson.ipynb#cell3")."""
    for path in sorted(folder.rglob("*.py")):
        yield path.relative_to(folder).as_posix(), path.read_text(errors="replace")
    for path in sorted(folder.rglob("*.ipynb")):
        rel = path.relative_to(folder).as_posix()
        cells = json.loads(path.read_text()).get("cells", [])
        for i, cell in enumerate(cells):
            if cell.get("cell_type") == "code":
                text = "".join(cell.get("source", []))
                text = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith(("%", "!")))
                yield f"{rel}#cell{i}", text
            for output in cell.get("outputs", []):        # printed answers count too
                shown = "".join(output.get("text", [])) + "".join(output.get("data", {}).get("text/plain", []))
                if shown:
                    yield f"{rel}#output{i}", shown


def _parse(source: str) -> list[tuple[int, ast.AST]]:
    """[(0, the source as one tree)], or where it does not parse (printed output, a hint, code beside
    prose) (line number - 1, tree) of each line that parses alone."""
    try:
        return [(0, ast.parse(source))]
    except SyntaxError:
        pass
    trees = []
    for offset, line in enumerate(source.splitlines()):
        try:
            trees.append((offset, ast.parse(line.strip())))
        except SyntaxError:
            continue
    return trees


def answer_statements_in(source: str, index: dict[str, str]) -> list[tuple[int, str]]:
    """(line, label) of each substantial statement of ``source`` whose normalised text is in ``index``."""
    hits = []
    for offset, tree in _parse(source):
        for stmt in _statements(tree):
            if _size(stmt) < SUBSTANTIAL_NODES:
                continue
            line = offset + stmt.lineno              # read before _normalise rewrites the statement
            label = index.get(_normalise(stmt))
            # the value of a return or an assignment on its own too: ``return <expr>`` in the library holds
            # the answer's ``mask = <expr>`` as much as a copy of the whole line does
            value = getattr(stmt, "value", None)
            if not label and isinstance(stmt, _VALUED) and value is not None:
                alone = ast.Expr(value)
                if _size(alone) >= SUBSTANTIAL_NODES:
                    label = index.get(_normalise(alone))
            if label:
                hits.append((line, label))
    return hits


def answer_index(texts: list[AnswerText]) -> dict[str, str]:
    """{normalised statement: the first answer it belongs to} (5.1 and 5.2 share lines)."""
    index: dict[str, str] = {}
    for t in texts:
        index.setdefault(t.text, t.label)
    return index


def find_answers(folder: Path, texts: list[AnswerText]) -> list[str]:
    """"<answer> in <file>:<line>" for each statement of a model answer found in ``folder`` (empty:
    answer-free). Every .py file counts, tests included, and every notebook cell and output."""
    index = answer_index(texts)
    hits = set()
    for where, source in _python_sources(folder):
        for line, label in answer_statements_in(source, index):
            hits.add(f"{label} in {where}:{line}")
    return sorted(hits)


def _hint_snippets(hint: str) -> list[str]:
    """The pieces of a ``hint:`` text that may be code: each part between semicolons, without a leading
    label ("each step: ...") or a closing remark in brackets ("(same for v)"), each of those cut at
    every ", " (a statement followed by prose), and each cut's tails after a word (prose before code)."""
    out = []
    for part in re.split(r";\s*", hint):
        for text in {part, re.sub(r"^[\w ]+:\s+", "", part), re.sub(r"\s+\([^()]*\)$", "", part),
                     re.sub(r"\s+\([^()]*\)$", "", re.sub(r"^[\w ]+:\s+", "", part))}:
            pieces = text.split(", ")
            for n in range(len(pieces), 0, -1):
                snippet = ", ".join(pieces[:n])
                # and each tail after a word: "a key is visible when <expr>" holds <expr>
                words = snippet.split(" ")
                out += [" ".join(words[i:]) for i in range(len(words))]
    return out


def answers_in_hints(root: Path | None = None) -> list[str]:
    """"<answer> in the hint of <exercise>" for each hint (``HINTS=code``) that holds one of the answer
    statements, names normalised (empty: every hint stops short of the answer)."""
    root = course_root() if root is None else Path(root)
    index = answer_index(answer_texts(root))
    hits = set()
    for path in sorted((root / "solutions").glob("ex*.py")):
        for line in path.read_text().splitlines():
            begin = _HINT.match(line)
            if begin is None:
                continue
            for snippet in _hint_snippets(begin["hint"]):
                for _, label in answer_statements_in(snippet, index):
                    hits.add(f"{label} in the hint of Exercise {begin['id']}: {snippet!r}")
    return sorted(hits)


# --------------------------------------------------------------------------- near-copies of a whole answer
#
# ``find_answers`` finds a model answer's statements as they are written. A near-copy rewrites them a
# little: the same steps in the same order with other names, ``torch.exp(x)`` for ``x.exp()``, a temporary
# inlined, a guard dropped. ``find_near_copies`` compares each function of the edition (and each notebook
# cell) with each answer, step by step:
#
# - a step is one statement's value (what an assignment, return or call computes; the names it is stored
#   in say nothing), or the header of an ``if``, a loop or a ``with`` (not a guard: an ``if`` that only
#   raises, which the docstrings state); names become ``_``, strings blank,
#   ``torch.f(x, ...)`` becomes ``x.f(...)`` and ``x[..., None]`` becomes ``x.unsqueeze(-1)`` (the same
#   operation written two ways), and a variable stored once and read once is replaced by its value;
# - two steps are the same when their tokens match at least ``NEAR_STEP`` (``difflib``'s ratio) and so do
#   their words (the tokens less the placeholders and punctuation: ``_(_, _, _)`` is no call of ``.attend``);
# - an answer's own steps are those no other answer has a step like (5.2 is judged on what it adds to 5.1,
#   not on the projection both make), of at least ``NEAR_MIN_TOKENS`` tokens, and not an idiom: a step
#   that ``NEAR_COMMON`` or more functions of the folder checked have (``_.append(_)``) is nobody's.
#
# A function is a near-copy of an answer when
#
# 1. it takes at least ``NEAR_SHARE`` of the answer's own steps, in order (two at least, and
#    ``NEAR_MIN_MATCHED`` tokens in all): the answer rewritten a little (Exercise 9.1's merge with
#    ``torch.exp`` and its guard dropped; 5.2's receive and send around a stand-in for the compute);
# 2. or it calls the methods the answer calls, in the same order, at least ``NEAR_SHARE`` of them
#    (``NEAR_MIN_CALLS`` at least), one of them a method no other answer calls: the answer's plan with
#    other arithmetic between (9.3's ring loop with the queries passed instead of the keys);
# 3. or it is a piece of the answer: every step of it is one of the answer's, and the answer's own steps
#    among them hold ``NEAR_MIN_PIECE`` words at least (a one-line helper that is 9.3's skip test).
NEAR_STEP = 0.8
NEAR_SHARE = 0.6
NEAR_MIN_TOKENS = 4          # ``_.wait()`` (5 tokens) counts; ``_`` or ``None`` alone does not
NEAR_MIN_MATCHED = 12
NEAR_MIN_PIECE = 5           # words, e.g. ``int``, ``0``, ``<``, ``=``, ``int``, ``-``, ``1``
NEAR_MIN_CALLS = 5
NEAR_COMMON = 8


class _Canonical(ast.NodeTransformer):
    """Names to ``_``, strings blank, and one spelling for operations PyTorch writes two ways."""

    def visit_Name(self, node):
        return ast.Name("_" if node.id not in _BUILTINS else node.id, ast.Load())

    def visit_arg(self, node):
        return ast.arg("_")

    def visit_Constant(self, node):
        return ast.Constant("") if isinstance(node.value, str) else node

    def visit_JoinedStr(self, node):
        return ast.Constant("")

    def visit_Call(self, node):
        f = node.func
        # torch.exp(x, ...) is x.exp(...)
        if (isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "torch"
                and node.args and not isinstance(node.args[0], ast.Starred)):
            node = ast.Call(ast.Attribute(node.args[0], f.attr, ast.Load()), node.args[1:], node.keywords)
        return self.generic_visit(node)

    def visit_Subscript(self, node):
        # x[..., None] is x.unsqueeze(-1)
        s = node.slice
        if (isinstance(s, ast.Tuple) and len(s.elts) == 2 and isinstance(s.elts[0], ast.Constant)
                and s.elts[0].value is Ellipsis and isinstance(s.elts[1], ast.Constant) and s.elts[1].value is None):
            node = ast.Call(ast.Attribute(node.value, "unsqueeze", ast.Load()), [ast.Constant(-1)], [])
        return self.generic_visit(node)


def _inline(stmts: list[ast.stmt]) -> list[ast.stmt]:
    """The statements with each variable that is stored once (``name = value``, at this level) and read
    once replaced by its value: splitting a formula into temporaries does not hide it. Rewrites the
    statements it is given (``_steps`` hands it its own copy)."""
    stores, loads = {}, {}
    for node in ast.walk(ast.Module(stmts, [])):
        if isinstance(node, ast.Name):
            (stores if isinstance(node.ctx, ast.Store) else loads).setdefault(node.id, []).append(node)
    values = {s.targets[0].id: s.value for s in stmts
              if isinstance(s, ast.Assign) and len(s.targets) == 1 and isinstance(s.targets[0], ast.Name)
              and len(stores.get(s.targets[0].id, ())) == 1 and len(loads.get(s.targets[0].id, ())) == 1}

    class Substitute(ast.NodeTransformer):
        def visit_Name(self, node):
            return values.get(node.id, node) if isinstance(node.ctx, ast.Load) else node

    kept = [s for s in stmts if not (isinstance(s, ast.Assign) and len(s.targets) == 1
                                     and isinstance(s.targets[0], ast.Name) and s.targets[0].id in values)]
    for _ in range(len(values)):                       # a value may hold another inlined name
        kept = [Substitute().visit(s) for s in kept]
    return kept


def _tokens(node: ast.AST) -> tuple[str, ...]:
    """The tokens of ``node`` in its canonical form (rewrites ``node``: ``_steps`` hands it its own copy)."""
    text = ast.unparse(_Canonical().visit(node))
    return tuple(re.findall(r"\w+|[^\w\s]", text))


def _copy(node):
    """A copy of a syntax tree (or a list of them) without its source positions, which no step reads;
    several times faster than ``copy.deepcopy``."""
    if isinstance(node, list):
        return [_copy(child) for child in node]
    if isinstance(node, ast.AST):
        return type(node)(**{field: _copy(value) for field, value in ast.iter_fields(node)})
    return node                                     # a name, a constant's value, None


def _steps(stmts: list[ast.stmt]) -> list[tuple[str, ...]]:
    """The steps of a body (see above), in order, nested bodies included; definitions inside are left out."""
    return _steps_of_copy(_copy(stmts))             # one copy, which inlining and canonical forms rewrite


def _steps_of_copy(stmts: list[ast.stmt]) -> list[tuple[str, ...]]:
    out = []
    for stmt in _inline(stmts):
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        if isinstance(stmt, ast.If) and all(isinstance(s, ast.Raise) for s in stmt.body) and not stmt.orelse:
            continue                     # a guard: the docstring says what to raise, and the stubs keep it
        if isinstance(stmt, (ast.If, ast.While)):
            out.append(("if", *_tokens(stmt.test)))
        elif isinstance(stmt, (ast.For, ast.AsyncFor)):
            out.append(("for", *_tokens(stmt.target), "in", *_tokens(stmt.iter)))
        elif isinstance(stmt, (ast.With, ast.AsyncWith)):
            out.append(("with", *[t for item in stmt.items for t in _tokens(item.context_expr)]))
        elif isinstance(stmt, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Return, ast.Expr)):
            if getattr(stmt, "value", None) is not None and not isinstance(stmt.value, ast.Constant):
                out.append(_tokens(stmt.value))
        elif not isinstance(stmt, (ast.Try, ast.Match, ast.Pass, ast.Break, ast.Continue)):
            out.append(_tokens(stmt))
        for field in ("body", "orelse", "finalbody"):
            if isinstance(stmt, (ast.If, ast.While, ast.For, ast.AsyncFor, ast.With, ast.AsyncWith, ast.Try)):
                out += _steps_of_copy(getattr(stmt, field, []))
        for handler in getattr(stmt, "handlers", []):
            out += _steps_of_copy(handler.body)
    return out


def _calls(steps) -> tuple[str, ...]:
    """The methods the steps call, in order (``layer.qkv(...)`` gives ``qkv``)."""
    return tuple(step[i + 1] for step in steps for i in range(len(step) - 2)
                 if step[i] == "." and step[i + 2] == "(" and step[i + 1] != "_")


@dataclass(frozen=True)
class AnswerSteps:
    label: str                              # "Exercise 9.1 (solutions/ex09_ring_attention.py)"
    steps: tuple[tuple[str, ...], ...]      # every step of the answer
    own: tuple[tuple[str, ...], ...]        # the steps no other answer has, in order
    calls: tuple[str, ...] = ()             # the methods it calls, in order (``_calls``)
    own_calls: frozenset = frozenset()      # those no other answer calls


def answer_steps(root: Path | None = None) -> list[AnswerSteps]:
    """The steps of every model answer region of ``solutions/`` (see ``find_near_copies``)."""
    root = course_root() if root is None else Path(root)
    regions = []
    for path in sorted((root / "solutions").glob("ex*.py")):
        source = path.read_text()
        tree = ast.parse(source)
        start = None
        for no, line in enumerate(source.splitlines(), start=1):
            if (m := _BEGIN.match(line)):
                start = (no, m[1])
            elif _END.match(line) and start:
                begin, number = start
                start = None
                # the region's statements: those inside it whose parent is not
                stmts = [child for node in ast.walk(tree) for child in ast.iter_child_nodes(node)
                         if isinstance(child, ast.stmt) and begin < child.lineno < no
                         and not begin < getattr(node, "lineno", 0) < no]
                stmts.sort(key=lambda s: s.lineno)
                regions.append((f"Exercise {number} ({path.relative_to(root).as_posix()})", _steps(stmts)))
    out = []
    for label, steps in regions:
        others = {s for other, their in regions if other != label for s in their}
        own = tuple(s for s in steps if len(s) >= NEAR_MIN_TOKENS and not any(_same(s, t) for t in others))
        calls = _calls(steps)
        their_calls = {c for other, their in regions if other != label for c in _calls(their)}
        out.append(AnswerSteps(label, tuple(steps), own, calls, frozenset(calls) - their_calls))
    return out


_PUNCTUATION = frozenset("_(),.[]:")


@functools.lru_cache(maxsize=1 << 16)
def _words(step: tuple) -> tuple:
    """What a step does, without its placeholders and punctuation: operations, attributes, numbers."""
    return tuple(t for t in step if t not in _PUNCTUATION)


def _can_reach(a: tuple, b: tuple) -> bool:
    """Whether the lengths let ``_ratio(a, b)`` reach NEAR_STEP at all (it is at most 2 min / (len a + len b))."""
    return 2 * min(len(a), len(b)) >= NEAR_STEP * (len(a) + len(b))


def _ratio(a: tuple, b: tuple) -> float:
    if not _can_reach(a, b):
        return 0.0
    return difflib.SequenceMatcher(None, a, b, autojunk=False).ratio()


@functools.lru_cache(maxsize=1 << 16)
def _same(a: tuple, b: tuple) -> bool:
    """Two steps are the same when their tokens match at least ``NEAR_STEP`` and so do their words
    (``_(_, _, _, _, _)`` is not ``_.attend(_, *_, _.q_pos, _, _)``, however alike the punctuation)."""
    if a == b:
        return True
    if not _can_reach(a, b):                       # cheap first: the tokens' ratio cannot reach NEAR_STEP
        return False
    wa, wb = _words(a), _words(b)
    return bool(wa) and _ratio(wa, wb) >= NEAR_STEP and _ratio(a, b) >= NEAR_STEP


def _in_order(steps: list, own: tuple) -> list[int]:
    """Indices of ``own``'s steps that ``steps`` holds in the same order (a longest common subsequence,
    steps compared by ``_same``)."""
    n, m = len(steps), len(own)
    best = [[0] * (m + 1) for _ in range(n + 1)]
    for i in range(n - 1, -1, -1):
        for j in range(m - 1, -1, -1):
            best[i][j] = max(best[i + 1][j], best[i][j + 1],
                             best[i + 1][j + 1] + 1 if _same(steps[i], own[j]) else 0)
    i = j = 0
    taken = []
    while i < n and j < m:
        if best[i][j] == best[i + 1][j + 1] + 1 and _same(steps[i], own[j]):
            taken.append(j)
            i, j = i + 1, j + 1
        elif best[i + 1][j] >= best[i][j + 1]:
            i += 1
        else:
            j += 1
    return taken


def near_copy_of(steps: list[tuple[str, ...]], answer: AnswerSteps, common: frozenset = frozenset()) -> bool:
    """Whether a body with these steps is a near-copy of the answer (the rule above); ``common``: steps
    too common to count as the answer's own."""
    words = {t for s in steps for t in s}
    own = tuple(s for s in answer.own if s not in common)
    if len(own) >= 2:
        # cheap first: the own steps whose words the body holds at all
        possible = [s for s in own if sum(t in words for t in s) >= NEAR_STEP * len(s)]
        if len(possible) >= max(2, NEAR_SHARE * len(own)):
            taken = _in_order(steps, own)
            if (len(taken) >= max(2, NEAR_SHARE * len(own))
                    and sum(len(own[j]) for j in taken) >= NEAR_MIN_MATCHED):
                return True
    # the same calls in the same order, one of them the answer's own: its plan, the arithmetic between aside
    if len(answer.calls) >= NEAR_MIN_CALLS:
        calls = _calls(steps)
        taken = [answer.calls[j] for j in _in_order(calls, answer.calls)]
        if len(taken) >= max(NEAR_MIN_CALLS, NEAR_SHARE * len(answer.calls)) and set(taken) & set(answer.own_calls):
            return True
    # a piece of the answer: every step of the body is one of the answer's, and its own steps make a line
    if not steps or not all(any(_same(s, a) for a in answer.steps) for s in steps):
        return False
    return sum(len(_words(s)) for s in steps if any(_same(s, a) for a in own)) >= NEAR_MIN_PIECE


def _bodies(source: str):
    """(line, name, statements) of every function of ``source``, and of the module's own statements."""
    trees = _parse(source)
    for offset, tree in trees:
        yield offset + 1, "<module>", [s for s in tree.body
                                        if not isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                body = node.body[1:] if ast.get_docstring(node, clean=False) is not None else node.body
                yield offset + node.lineno, node.name, body


def find_near_copies(folder: Path, answers_: list[AnswerSteps] | None = None) -> list[str]:
    """"near-copy of <answer>: <file>:<line> <function>" for each function (or module, or notebook cell)
    under ``folder`` that is a near-copy of a model answer (empty: none is). See the rule above."""
    answers_ = answer_steps() if answers_ is None else answers_
    bodies = []
    for where, source in _python_sources(folder):
        if "#output" not in where:
            bodies += [(where, line, name, steps) for line, name, body in _bodies(source) if (steps := _steps(body))]
    # a step that many bodies of the folder write (``_.append(_)``) is an idiom, whichever answer has it too
    seen = Counter(s for *_, steps in bodies for s in set(steps))
    common = frozenset(s for s, n in seen.items() if n >= NEAR_COMMON)
    hits = set()
    for where, line, name, steps in bodies:
        for answer in answers_:
            if near_copy_of(steps, answer, common):
                hits.add(f"near-copy of {answer.label}: {where}:{line} {name}")
    return sorted(hits)


# --------------------------------------------------------------------------- building the edition

def _git_files(root: Path, *which: str) -> list[str]:
    """``git ls-files -z <which>`` in ``root``: paths relative to it."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z", *which], cwd=root,
                                capture_output=True, check=True, timeout=60).stdout.decode()
    except (OSError, subprocess.SubprocessError) as e:
        raise ValueError(f"building the student edition needs the course as a git checkout ({root}): {e}") from None
    return sorted(f for f in listed.split("\0") if f)


def _files(root: Path) -> tuple[list[str], list[str]]:
    """(the course's tracked files, the untracked ones git does not ignore).

    Only tracked files ship: an instructor's checkout also holds what was
    never meant for a class (hidden tests, grades, notes), and a file that
    is not committed is not part of the course.
    """
    tracked = [f for f in _git_files(root, "--cached") if (root / f).is_file()]
    untracked = _git_files(root, "--others", "--exclude-standard", "--directory")
    return tracked, untracked


def _left_out(untracked: list[str]) -> str:
    """The line ``build`` prints about what the edition does not hold."""
    line = "left out: " + ", ".join(p if p.endswith(("/", ".py", ".md")) else f"{p}*.py" for p in INSTRUCTOR_ONLY)
    if untracked:
        shown = ", ".join(untracked[:5]) + (", ..." if len(untracked) > 5 else "")
        line += f" and {len(untracked)} untracked file{'s' * (len(untracked) > 1)} ({shown})"
    return line + ": the edition is built from tracked files only"


def _parameters(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    """The parameters of a definition as they are passed on: ``a``, ``*args``, ``key=key``, ``**kw``."""
    a = fn.args
    out = [p.arg for p in (*a.posonlyargs, *a.args)]
    out += [f"*{a.vararg.arg}"] if a.vararg else []
    out += [f"{p.arg}={p.arg}" for p in a.kwonlyargs]
    out += [f"**{a.kwarg.arg}"] if a.kwarg else []
    return out


def _without_shortcut_bodies(text: str, marks: list[answers.Mark]) -> str:
    """A library file's source with the body of each ``@shortcut(..., student=f)`` function replaced by
    ``return f(<its parameters>)``: the edition runs the student's exercise there and holds no copy of the
    algorithm. The docstring stays. Raises ValueError when ``f`` is not a function of the same file with
    the same parameters, or the mark is on a class."""
    tree = ast.parse(text)
    defs = {min([d.lineno for d in node.decorator_list] + [node.lineno]): node for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    top = {node.name: node for node in tree.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
    lines = text.splitlines(keepends=True)
    for mark in sorted(marks, key=lambda m: -m.lines[0]):          # from the bottom: line numbers stay valid
        fn = defs[mark.lines[0]]
        if isinstance(fn, ast.ClassDef):
            raise ValueError(f"{mark.spec}: student= marks a function, not a class")
        helper = top.get(mark.student)
        if helper is None or _parameters(helper) != _parameters(fn):
            raise ValueError(f"{mark.spec} is marked student={mark.student!r}, which must be a function of the "
                             f"same module with the same parameters {_parameters(fn)}")
        body = fn.body[1:] if ast.get_docstring(fn, clean=False) is not None else fn.body
        indent = " " * body[0].col_offset
        call = f"{indent}return {mark.student}({', '.join(_parameters(fn))})\n"
        lines[body[0].lineno - 1:fn.end_lineno] = [call]
    return "".join(lines)


# The course's `make test` command, and the edition's: there the library's own tests (files marked `library`,
# which reach no exercise: the course's run checks it while they run) are left out, since the edition's library
# is the course's wherever no exercise runs, so they pass there as they pass in the course.
_COURSE_TEST = "\tTOYLLM_IMPL=solutions TOYLLM_FAST=1 $(PYTHON) -m pytest tests --durations"
_EDITION_TEST = "\tTOYLLM_FAST=1 $(PYTHON) -m pytest tests -m \"not library\" --durations"


def _student_makefile(text: str) -> str:
    if text.count(_COURSE_TEST) != 1:
        raise ValueError(f"the Makefile's test target no longer runs {_COURSE_TEST!r}; update the builder")
    text = text.replace(_COURSE_TEST, _EDITION_TEST).replace("TOYLLM_IMPL=solutions ", "").replace(
        "against the model answers.", "against your exercises (a test that needs an unwritten one is skipped),\n"
        "# leaving out the library's own tests (marked library: they run none of your code).")
    # Targets that need the model answers, or are the instructor's (the Gradescope zip), go.
    text = re.sub(r"\n(?:# [^\n]*\n)*(?:exercises|student|autograder):[^\n]*\n(?:\t[^\n]*\n)*", "\n", text)
    return text.replace(" exercises student autograder ", " ").replace(" exercises student ", " ")


def build(out: Path, hints: str = "idea", root: Path | None = None, log=sys.stdout) -> list[str]:
    """Write the student edition to ``out`` (a new or empty folder) from the course's tracked files; returns
    them. Prints to ``log`` one line on what was left out (instructor-only files, untracked ones).

    Raises ValueError for a bad hint level, an ``out`` that is not empty or
    lies inside the course, and (after writing) if any answer text is found
    in the edition.
    """
    if hints not in HINT_LEVELS:
        raise ValueError(f"hints must be one of {list(HINT_LEVELS)}, got {hints!r}")
    root = course_root() if root is None else Path(root).resolve()
    out = Path(out).expanduser().resolve()
    if out == root or root in out.parents:
        raise ValueError(f"OUT={out} is inside the course itself; pick a folder outside {root}")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"OUT={out} exists and is not an empty folder; pick a new one")
    tracked, untracked = _files(root)
    shortcuts: dict[str, list[answers.Mark]] = {}          # "toyllm/partition.py" -> its shortcuts with student=
    for mark in answers.scan(root / "toyllm"):
        if mark.kind == "shortcut" and mark.student:
            shortcuts.setdefault(mark.path.relative_to(root).as_posix(), []).append(mark)
    print(_left_out(untracked), file=log)
    written = []
    for rel in tracked:
        if rel.startswith(INSTRUCTOR_ONLY):
            continue
        src, dst = root / rel, out / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        if rel.startswith("exercises/ex") and rel.endswith(".py") and (root / "solutions" / Path(rel).name).exists():
            dst.write_text(make_stub((root / "solutions" / Path(rel).name).read_text(), hints))
        elif rel in shortcuts:
            dst.write_text(_without_shortcut_bodies(src.read_text(), shortcuts[rel]))
        elif rel == "toyllm/answers.py":
            text = src.read_text()
            if 'EDITION = "instructor"' not in text:
                raise ValueError("toyllm/answers.py no longer sets EDITION = \"instructor\"; update the builder")
            dst.write_text(text.replace('EDITION = "instructor"', 'EDITION = "student"', 1))
        elif rel == "Makefile":
            dst.write_text(_student_makefile(src.read_text()))
        elif rel == "README.md":
            dst.write_text((root / "toyllm" / "templates" / "student_README.md").read_text())
        elif rel == ".ci/run":          # the instructor's CI also tests this edition; a student's runs make test
            dst.write_text((root / "toyllm" / "templates" / "student_ci_run").read_text())
            dst.chmod(src.stat().st_mode)
        else:
            shutil.copy2(src, dst)
        written.append(rel)
    written += write_expected_values(out, root)        # the graded tests keep values, not reference functions
    found = find_answers(out, answer_texts(root))
    if found:
        raise ValueError(f"answer text found in the student edition at {out}: {found}")
    near = find_near_copies(out, answer_steps(root))
    if near:
        raise ValueError(f"a near-copy of a model answer found in the student edition at {out}: {near}")
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m toyllm.grading.edition",
                                     description="Build the student edition: the course without its answers.")
    parser.add_argument("--out", required=True, metavar="DIR", help="a new (or empty) folder outside the course")
    parser.add_argument("--hints", default="idea", choices=HINT_LEVELS,
                        help="idea: which operation, what shape, what to wait for; code: close to the lines "
                             "themselves (default: idea)")
    args = parser.parse_args(argv)
    try:
        files = build(Path(args.out), args.hints)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote the student edition ({len(files)} files, hints: {args.hints}) to {args.out}; "
          f"no model answer occurs in it. Next: cd {args.out} && git init && make test")
    return 0


if __name__ == "__main__":
    sys.exit(main())
