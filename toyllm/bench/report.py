"""The Markdown of docs/benchmarks.md: one template macro per section (``toyllm/templates/benchmarks.md.j2``),
filled with the numbers of a run, and the filters its prose uses to print them and judge them."""
from __future__ import annotations

import functools
import os
import stat
import statistics
import tempfile
from pathlib import Path


def _runs(s) -> str:
    """A Spread as a table cell in seconds: "0.512 [0.498-0.530]" (median, fastest and slowest run)."""
    return f"{s.median:.3f}" if len(s.runs) == 1 else f"{s.median:.3f} [{s.low:.3f}-{s.high:.3f}]"


def _short(v) -> str:
    """The ``short`` filter: a measure.Verdict as a table cell, in measure's words (``Verdict.short``)."""
    return v.short


def _verdict(value: float, target: float) -> str:
    return "meets" if value >= target else "does not meet"


def _rounds_verdict(ratios: list[float], target: float) -> str:
    """A fixed target ratio (say 10x) judged on each round's own ratio: met or missed in every round,
    else within the spread of the machine. Two sets of runs against each other are ``measure.compare``'s
    to decide; this only says where a target lies among the rounds' ratios."""
    if min(ratios) >= target:
        return "met in every round"
    if max(ratios) < target:
        return "missed in every round"
    return f"met in some rounds and missed in others: at {target:g}x within the spread of this machine"


@functools.lru_cache(maxsize=1)
def _template():
    import jinja2

    env = jinja2.Environment(loader=jinja2.PackageLoader("toyllm", "templates"), undefined=jinja2.StrictUndefined,
                             trim_blocks=False, keep_trailing_newline=True)
    env.filters.update(verdict=_verdict, rounds_verdict=_rounds_verdict, median=statistics.median,
                       runs=_runs, short=_short)
    return env.get_template("benchmarks.md.j2")


def render_section(name: str, data: dict) -> str:
    """The Markdown of one section: its template macro filled with the numbers of this run."""
    return str(getattr(_template().module, name)(data)).strip()


def write_blocks(path: Path, blocks: dict[str, str]) -> None:
    """Put each section's Markdown (``blocks``: name -> text) between its markers in the file ``path``,
    ``<!-- bench:NAME -->`` and ``<!-- /bench:NAME -->``: in place of the old block, or at the end."""
    # read only now: a run takes a while, and the file may have been edited (or written by another run) meanwhile
    text = path.read_text() if path.exists() else "# Benchmarks\n\nEvery table says which command produced it.\n"
    for name, body in blocks.items():
        start, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
        block = f"{start}\n{body}\n{end}"
        if start in text and end in text:
            text = text[:text.index(start)] + block + text[text.index(end) + len(end):]
        else:
            text = text.rstrip() + "\n\n" + block + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, text)


def write_atomic(path: Path, text: str) -> None:
    """Replace ``path`` in one step: a temporary file in the same folder, then os.replace; none is left on failure."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}-", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, stat.S_IMODE(path.stat().st_mode) if path.exists() else 0o644)   # mkstemp makes it 0600
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
