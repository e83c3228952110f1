"""Exercise stubs generated from the model answers, so the two never drift apart.

A model answer sits between two marker comments inside a function body::

    # BEGIN SOLUTION 1.2 hint: divide by the temperature, then torch.multinomial
    # idea: temperature reshapes the distribution; the cut-offs remove its tail
    ...
    # END SOLUTION

``make_stub`` replaces each marked region by
``raise NotImplementedError("Exercise 1.2: implement <function> (idea: ...)")``
and keeps everything else (signatures, docstrings). Hints come at two
levels: ``idea`` (the default: which operation, what shape, what to wait
for, never the code) or ``code`` (the ``hint:`` text, close to the lines
themselves); an instructor picks one for the student edition. ``python -m
toyllm.grading sync`` rewrites ``exercises/`` from ``solutions/``;
``sync --check`` only reports files that are out of date.
"""
from __future__ import annotations

import re
import textwrap
from pathlib import Path

from .course import exercises_dir as default_exercises_dir
from .course import solutions_dir as default_solutions_dir

_BEGIN = re.compile(r"^(?P<indent>[ \t]*)# BEGIN SOLUTION(?P<rest>.*)$")
_END = re.compile(r"^[ \t]*# END SOLUTION\s*$")
_BEGIN_REST = re.compile(r"^ (?P<id>\d+\.\d+)(?: hint: (?P<hint>.+?))?\s*$")
_IDEA = re.compile(r"^[ \t]*# idea: (?P<idea>.+?)\s*$")
HINT_LEVELS = ("idea", "code")
_DEF = re.compile(r"^(?P<indent>[ \t]*)(?:async )?def (?P<name>\w+)\s*\(")


def make_stub(source: str, hints: str = "idea") -> str:
    """The exercise version of a solution file: each marked model answer becomes a NotImplementedError.

    A region starts at ``# BEGIN SOLUTION N.M hint: ...`` (hint optional)
    and ends at ``# END SOLUTION``; both lines and everything between them
    are replaced by one ``raise NotImplementedError("Exercise N.M: implement
    <function> (idea: ...)")`` at the marker's indentation. The function is
    the nearest enclosing ``def``. hints: "idea" takes the ``# idea:`` line
    that follows the marker (every region needs one), "code" the marker's
    ``hint:``. Raises ValueError for unbalanced or malformed markers, naming
    the line.
    """
    if hints not in HINT_LEVELS:
        raise ValueError(f"hints must be one of {HINT_LEVELS}, got {hints!r}")
    lines = source.splitlines(keepends=True)
    out: list[str] = []
    region_start = None       # line number of an open BEGIN
    for no, line in enumerate(lines, start=1):
        text = line.rstrip("\r\n")
        begin, end = _BEGIN.match(text), _END.match(text)
        if begin:
            if region_start is not None:
                raise ValueError(f"line {no}: BEGIN SOLUTION inside the region opened on line {region_start}")
            rest = _BEGIN_REST.match(begin["rest"])
            if rest is None:
                raise ValueError(f"line {no}: expected '# BEGIN SOLUTION N.M hint: ...', got {text.strip()!r}")
            indent = begin["indent"]
            func = _enclosing_function(lines[:no - 1], indent)
            if func is None:
                raise ValueError(f"line {no}: a solution region must sit inside a function body")
            message = f"Exercise {rest['id']}: implement {func}"
            if hints == "code" and rest["hint"]:
                message += f" (hint: {rest['hint']})"
            elif hints == "idea":
                idea = _IDEA.match(lines[no].rstrip("\r\n")) if no < len(lines) else None
                if idea is None:
                    raise ValueError(f"line {no + 1}: Exercise {rest['id']} needs a '# idea: ...' line "
                                     f"right after its BEGIN SOLUTION marker")
                message += f" (idea: {idea['idea']})"
            out.append(_raise_statement(indent, message))
            region_start = no
        elif end:
            if region_start is None:
                raise ValueError(f"line {no}: END SOLUTION without a BEGIN SOLUTION before it")
            region_start = None
        elif region_start is None:
            out.append(line)
    if region_start is not None:
        raise ValueError(f"line {region_start}: BEGIN SOLUTION is never closed by END SOLUTION")
    return "".join(out)


def _raise_statement(indent: str, message: str, width: int = 100) -> str:
    """``raise NotImplementedError("...")``, its message split over several string literals if long."""
    one_line = f"{indent}raise NotImplementedError({_quote(message)})\n"
    if len(one_line) <= width + 1:
        return one_line
    inner = indent + " " * 4
    chunks = textwrap.wrap(message, width - len(inner) - 2, break_long_words=False, drop_whitespace=False)
    body = "\n".join(inner + _quote(c) for c in chunks)
    return f"{indent}raise NotImplementedError(\n{body})\n"


def _quote(text: str) -> str:
    """A double-quoted Python string literal of ``text``."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _enclosing_function(previous_lines: list[str], indent: str) -> str | None:
    for line in reversed(previous_lines):
        m = _DEF.match(line)
        if m and len(m["indent"]) < len(indent):
            return m["name"]
    return None


def stub_exercises(source: str) -> dict[str, str]:
    """{exercise id: function} of the stubs (``raise NotImplementedError("Exercise N.M: implement f``) in ``source``."""
    found = re.findall(r"raise NotImplementedError\(\s*['\"]Exercise (\d+\.\d+): implement (\w+)", source)
    return dict(found)


def sync(check: bool = False, force: bool = False, solutions_dir: Path | None = None,
         exercises_dir: Path | None = None, hints: str = "idea") -> list[Path]:
    """Write ``exercises/`` from ``solutions/`` (every ``*.py``); returns the files that were (or would be) changed.

    check: change nothing, only report. Without ``force`` a file whose stubs
    were already replaced by someone's work is left alone (ValueError), so a
    learner cannot wipe out their answers by running this by mistake.
    """
    solutions_dir = Path(solutions_dir) if solutions_dir is not None else default_solutions_dir()
    exercises_dir = Path(exercises_dir) if exercises_dir is not None else default_exercises_dir()
    changed = []
    for sol in sorted(solutions_dir.glob("*.py")):
        target = exercises_dir / sol.name
        new = make_stub(sol.read_text(), hints)
        old = target.read_text() if target.exists() else None
        if old == new:
            continue
        changed.append(target)
        if check:
            continue
        # A function that is in the old file but no longer raises its stub has been answered by someone.
        answered = set() if old is None else {
            ex for ex, func in stub_exercises(new).items()
            if ex not in stub_exercises(old) and re.search(rf"^\s*def {func}\(", old, re.MULTILINE)}
        if answered and not force:
            raise ValueError(f"{target} holds answers to exercise(s) {sorted(answered)} instead of their stubs; "
                             f"not overwriting it. Pass --force to replace it anyway")
        target.write_text(new)
    return changed


# Where each model answer sits: the marker's indentation and exercise, and every ``def`` with its indentation.
_SOLUTION_AT = re.compile(r"^([ \t]*)# BEGIN SOLUTION (\d+\.\d+)", re.MULTILINE)
_TOP_DEF = re.compile(r"^([ \t]*)(?:async )?def (\w+)\s*\(", re.MULTILINE)


def exercise_functions(reference_source: str) -> dict[str, list[str]]:
    """{"3.3": ["min_step_time_s"], ...}: the top-level functions holding each exercise's model answer."""
    out: dict[str, list[str]] = {}
    defs = [(m.start(), len(m[1]), m[2]) for m in _TOP_DEF.finditer(reference_source)]
    for m in _SOLUTION_AT.finditer(reference_source):
        enclosing = [(indent, name) for start, indent, name in defs if start < m.start() and indent < len(m[1])]
        top = [name for indent, name in enclosing if indent == 0]
        if top:
            out.setdefault(m[2], []).append(top[-1])
    return out


def model_answer_source(module) -> str:
    """The text of a module of model answers (its file's)."""
    return Path(module.__file__).read_text()
