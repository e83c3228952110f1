"""The student edition: the course without its answers, where the framework runs the student's code.

This repository is the instructor edition: the model answers live in
``solutions/`` and the framework runs them. ``build`` writes a copy for a
class (``make student OUT=../toyllm-student``), ready to ``git init`` and
hand out:

- ``exercises/`` holds the stubs, with hints at the level the instructor
  picks (``idea`` or ``code``, see ``stubs``);
- ``solutions/``, the grader's own tests, the sample submissions and the
  instructors' notes are left out;
- ``toyllm.answers.EDITION`` is ``"student"``: every library function marked
  ``@answer`` runs the student's exercise, and a command that needs an
  unwritten one stops with a line naming it;
- the Makefile's ``make test`` runs against ``exercises/``: tests that need
  an unwritten exercise are skipped with its name (root ``conftest.py``).

``answer_texts`` and ``find_answers`` are the proof: every model answer, as
statements with names normalised, must occur in no Python file and no
notebook cell (code or output) of the edition. ``build`` checks
that before it returns, and so does the test suite.
"""
from __future__ import annotations

import argparse
import ast
import json
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from .course import course_root
from .references import write_expected_values
from .stubs import HINT_LEVELS, make_stub

# Files of the instructor edition that a class does not get.
# The tests of checking again and of step diagnostics are built from the model answers (they read solutions/,
# and the diagnostics' test carries answer lines of 4.2 and 5.1).
INSTRUCTOR_ONLY = ("solutions/", "tests/fixtures/submissions/", "tests/test_grader.py", "tests/test_grading_04_05.py",
                   "tests/test_student_edition.py", "tests/test_checking_again.py", "tests/test_step_diagnostics.py",
                   "tests/test_stored_expected.py", "tests/test_grader_reading.py", "tests/test_messages.py",
                   "docs/grading.md")

_BEGIN = re.compile(r"^[ \t]*# BEGIN SOLUTION (\d+\.\d+)")
_END = re.compile(r"^[ \t]*# END SOLUTION\s*$")


# --------------------------------------------------------------------------- answer text, normalised

def _normalise(stmts: list[ast.stmt]) -> str:
    """A statement sequence with its names renamed in order of appearance and its strings blanked.

    Renaming variables, arguments or messages does not hide a copy; the
    attributes and calls that make up the algorithm (``layer.qkv``,
    ``chain.isend``) stay as they are.
    """
    names: dict[str, str] = {}

    class Rename(ast.NodeTransformer):
        def visit_Name(self, node):
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

    copies = [Rename().visit(ast.parse(ast.unparse(s)).body[0]) for s in stmts]
    return "\n".join(ast.dump(s, annotate_fields=False) for s in copies)


def _bodies(tree: ast.AST):
    """Every list of statements in a tree: module, function, class, loop and branch bodies."""
    for node in ast.walk(tree):
        for field in ("body", "orelse", "finalbody"):
            block = getattr(node, field, None)
            if isinstance(block, list) and block and isinstance(block[0], ast.stmt):
                yield block
        for handler in getattr(node, "handlers", ()):
            yield handler.body


def _kinds(stmts: list[ast.stmt]) -> tuple[str, ...]:
    return tuple(type(s).__name__ for s in stmts)


def _without_docstring(body: list[ast.stmt]) -> list[ast.stmt]:
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        return body[1:]
    return body


@dataclass(frozen=True)
class AnswerText:
    label: str                  # "Exercise 5.2 (solutions/ex05_kv_runahead.py)"
    kinds: tuple[str, ...]      # the statements' node types ("Assign", "Return", ...)
    text: str                   # the normalised statements

    @property
    def size(self) -> int:
        return len(self.kinds)


def answer_texts(root: Path | None = None) -> list[AnswerText]:
    """Every model answer of ``solutions/``, normalised."""
    root = course_root() if root is None else Path(root)
    out = []
    for path in sorted((root / "solutions").glob("ex*.py")):
        source = path.read_text()
        lines = source.splitlines()
        tree = ast.parse(source)
        regions, start = [], None
        for no, line in enumerate(lines, start=1):
            if (m := _BEGIN.match(line)):
                start = (no, m[1])
            elif _END.match(line) and start:
                regions.append((*start, no))
                start = None
        for begin, number, end in regions:
            block = next(b for b in _bodies(tree) if any(begin < s.lineno < end for s in b))
            stmts = [s for s in block if begin < s.lineno < end]
            out.append(AnswerText(f"Exercise {number} ({path.relative_to(root)})", _kinds(stmts), _normalise(stmts)))
    return out


def _python_sources(folder: Path):
    """(path, source) of every .py file and every notebook code cell (magics left out) under ``folder``."""
    for path in sorted(folder.rglob("*.py")):
        yield path, path.read_text(errors="replace")
    for path in sorted(folder.rglob("*.ipynb")):
        cells = json.loads(path.read_text()).get("cells", [])
        for i, cell in enumerate(cells):
            if cell.get("cell_type") == "code":
                text = "".join(cell.get("source", []))
                text = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith(("%", "!")))
                yield path.with_name(f"{path.name}#cell{i}"), text
            for output in cell.get("outputs", []):        # printed answers count too
                shown = "".join(output.get("text", [])) + "".join(output.get("data", {}).get("text/plain", []))
                if shown:
                    yield path.with_name(f"{path.name}#output{i}"), shown


def find_answers(folder: Path, texts: list[AnswerText]) -> list[str]:
    """"<answer> in <file>" for each answer text that occurs in a file of ``folder`` (empty: answer-free)."""
    wanted: dict[tuple[str, ...], dict[str, str]] = {}      # statement kinds -> {normalised text: label}
    for t in texts:
        if t.size:
            wanted.setdefault(t.kinds, {})[t.text] = t.label
    hits = []
    for path, source in _python_sources(folder):
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        for block in _bodies(tree):
            kinds = tuple(type(s).__name__ for s in block)
            for shape, texts_of_shape in wanted.items():
                for i in range(len(block) - len(shape) + 1):
                    # the cheap test first: the same kinds of statements in the same order
                    if kinds[i:i + len(shape)] == shape:
                        label = texts_of_shape.get(_normalise(block[i:i + len(shape)]))
                        if label:
                            hits.append(f"{label} in {path.relative_to(folder)}")
    return sorted(set(hits))


# --------------------------------------------------------------------------- building the edition

def _files(root: Path) -> list[str]:
    """The course's files as git sees them (tracked, and new files it does not ignore)."""
    try:
        listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=root,
                                capture_output=True, check=True, timeout=60).stdout.decode()
    except (OSError, subprocess.SubprocessError) as e:
        raise ValueError(f"building the student edition needs the course as a git checkout ({root}): {e}") from None
    return sorted(f for f in listed.split("\0") if f and (root / f).is_file())


def _student_makefile(text: str) -> str:
    text = text.replace("TOYLLM_IMPL=solutions ", "").replace(
        "against the model answers.", "against your exercises (a test that needs an unwritten one is skipped).")
    # Targets that need the model answers go.
    text = re.sub(r"\n(?:# [^\n]*\n)*(?:exercises|student):[^\n]*\n(?:\t[^\n]*\n)*", "\n", text)
    return text.replace(" exercises student ", " ").replace(" student exercises ", " ")


def build(out: Path, hints: str = "idea", root: Path | None = None) -> list[str]:
    """Write the student edition to ``out`` (a new or empty folder); returns its files.

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
    written = []
    for rel in _files(root):
        if rel.startswith(INSTRUCTOR_ONLY):
            continue
        src, dst = root / rel, out / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        if rel.startswith("exercises/ex") and rel.endswith(".py") and (root / "solutions" / Path(rel).name).exists():
            dst.write_text(make_stub((root / "solutions" / Path(rel).name).read_text(), hints))
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
