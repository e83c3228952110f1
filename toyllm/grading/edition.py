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
"""
from __future__ import annotations

import argparse
import ast
import builtins
import copy
import json
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from .. import answers
from ..course import course_root
from .references import write_expected_values
from ..stubs import HINT_LEVELS, make_stub

# Files of the instructor edition that a class does not get: paths, and prefixes of paths (the grader's own
# tests, tests/test_grader*.py, grade the model answers and the hostile submissions of the fixtures).
# The tests of checking again and of step diagnostics are built from the model answers (they read solutions/,
# and the diagnostics' test carries answer lines of 4.2 and 5.1).
INSTRUCTOR_ONLY = ("solutions/", "tests/fixtures/", "tests/test_grader", "tests/test_grading_04_05.py",
                   "tests/test_grading_09.py",
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


def _student_makefile(text: str) -> str:
    text = text.replace("TOYLLM_IMPL=solutions ", "").replace(
        "against the model answers.", "against your exercises (a test that needs an unwritten one is skipped).")
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
