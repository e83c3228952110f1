"""Reading verdicts back from printed text: does every "A ... vs B ...: verdict" follow the runs it prints?

``toyllm.measure.Verdict.sentence`` prints both medians with the range of
their runs and then its decision. ``verdict_problems`` finds every such
sentence in a lesson's output and checks the decision against the printed
ranges alone, the way a reader would:

- "faster" / "slower" only where the two ranges do not overlap, on the side
  the medians say, and with medians more than 1 percent apart;
- "a tie" only where the ranges overlap or the medians are within 1 percent;
- "undecided" only where a side printed a single run.
"""
from __future__ import annotations

import contextlib
import re
import subprocess
import sys
import time

from toyllm.measure import usable_cores

# Lessons whose cells time things and print verdicts, run beside a CPU hog by the notebook tests (lessons 04
# and 05 time through measure.compare_prefills, which tests/test_verdicts.py runs beside a hog itself).
BUSY_LESSONS = ("01_naive_generation", "03_rooflines_and_memory", "06_partition_search", "08_serving")

UNITS = {"ms": 1e-3, "s": 1.0}
_NUMBER = r"\d+(?:\.\d+)?"
# "512.0 ms [498.0-530.0 ms]", "1.600 s [1.500-1.700 s]", "926.0 ms [128.8 ms-1.074 s]" or "12.3 ms (1 run)"
SPREAD = (rf"(?P<{{p}}med>{_NUMBER}) (?P<{{p}}mu>ms|s) (?:\[(?P<{{p}}lo>{_NUMBER})(?: (?P<{{p}}lu>ms|s))?-"
          rf"(?P<{{p}}hi>{_NUMBER}) (?P<{{p}}hu>ms|s)\]|(?P<{{p}}one>\(1 run\)))")
SENTENCE = re.compile(SPREAD.format(p="a") + r" vs [^\n]*?" + SPREAD.format(p="b") +
                      r": (?P<rest>[^\n]*)")


def _side(m: re.Match, p: str) -> tuple[float, float, float, bool]:
    """(median, lowest, highest, single run) in seconds for side ``p`` of a matched sentence."""
    med = float(m[p + "med"]) * UNITS[m[p + "mu"]]
    if m[p + "one"]:
        return med, med, med, True
    low = float(m[p + "lo"]) * UNITS[m[p + "lu"] or m[p + "hu"]]
    return med, low, float(m[p + "hi"]) * UNITS[m[p + "hu"]], False


def verdict_problems(text: str, min_effect: float = 0.01) -> list[str]:
    """One line for each printed verdict that its own printed numbers do not support (empty: all agree)."""
    problems = []
    for m in SENTENCE.finditer(text):
        (a, a_lo, a_hi, a_one), (b, b_lo, b_hi, b_one) = _side(m, "a"), _side(m, "b")
        rest, line = m["rest"], m[0]
        apart = abs(b / a - 1) > min_effect if a > 0 else True
        if rest.startswith("undecided"):
            ok = a_one or b_one
        elif a_one or b_one:
            ok = False                                 # one run shows no spread: nothing can be decided
        elif " is " in rest and "x faster" in rest:
            ok = a_hi < b_lo and a < b and apart
        elif " is " in rest and "x slower" in rest:
            ok = a_lo > b_hi and a > b and apart
        elif rest.startswith("a tie"):
            ok = not (a_hi < b_lo or a_lo > b_hi) or not apart
        else:
            problems.append(f"a verdict this checker cannot read: {line!r}")
            continue
        if not ok:
            problems.append(f"the printed runs do not support the verdict: {line!r}")
    return problems


def count_verdicts(text: str) -> int:
    """How many "A ... vs B ...: verdict" sentences ``text`` holds."""
    return sum(1 for _ in SENTENCE.finditer(text))


@contextlib.contextmanager
def cpu_hog():
    """A process spinning on every usable core while the block runs (each also stops by itself after 15 minutes):
    the machine a learner shares with other work."""
    spin = "import time\nend = time.monotonic() + 900\nwhile time.monotonic() < end:\n    pass\n"
    hogs = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(usable_cores())]
    try:
        time.sleep(0.5)                       # let them start spinning
        yield len(hogs)
    finally:
        for p in hogs:
            p.kill()
        for p in hogs:
            p.wait(timeout=30)
