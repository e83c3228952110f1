"""Reading verdicts back from printed text: does every "A ... vs B ...: verdict" follow the runs it prints?
(And does every ``check()`` of a lesson give full marks: ``check_problems``.)

``toyllm.measure.Verdict.sentence`` prints both medians with the range of
their runs and then its decision. ``verdict_problems`` finds every such
sentence in a lesson's output and checks the decision against the printed
numbers, the way a reader would (the rule is ``toyllm.measure.compare``'s):

- "faster" / "slower" only with a printed p of the rank test at most 0.01
  that the printed numbers of runs can give (at least 2 / C(n + m, n)), on
  the side the medians say, and with medians more than 1 percent apart;
- "a tie" only where p is above 0.01 or the medians are within 1 percent,
  and only with enough runs for a verdict to have been possible;
- "undecided" only where the printed numbers of runs are too few for any
  outcome to reach p = 0.01 (fewer than 5 a side; a single run always).

The shorter words of ``Verdict.than``, which tables and summaries print
without the runs ("as fast (1.05x, inside the noise of the runs, p = 0.84)
as", "not comparable (2.07x from 3 rounds; a verdict needs 5) with"), carry
their evidence too, and are read the same way: a tie only with p above 0.01
or a ratio within 1 percent, "not comparable" only from too few runs.
"""
from __future__ import annotations

import contextlib
import math
import re
import subprocess
import sys
import time

from toyllm.measure import usable_cores

# Lessons whose own cells time things and print verdicts: the notebook tests check that each prints some, and
# that every one follows from the runs it prints.
TIMING_LESSONS = ("01_naive_generation", "03_rooflines_and_memory", "06_partition_search", "08_serving")
# The one the notebook tests run beside a CPU hog: its verdicts are read under noise in a whole lesson. Every
# lesson decides with the same code (toyllm.measure's interleaved runs and compare); tests/test_verdicts.py runs
# lesson 05's and lesson 08's measurements beside a hog, in small sizes, so the hog need not cost a core for
# the length of every timing lesson.
HOG_LESSONS = ("01_naive_generation",)

UNITS = {"ms": 1e-3, "s": 1.0}
_NUMBER = r"\d+(?:\.\d+)?"
# "512.0 ms [498.0-530.0 ms]", "1.600 s [1.500-1.700 s]", "926.0 ms [128.8 ms-1.074 s]" or "12.3 ms (1 run)"
SPREAD = (rf"(?P<{{p}}med>{_NUMBER}) (?P<{{p}}mu>ms|s) (?:\[(?P<{{p}}lo>{_NUMBER})(?: (?P<{{p}}lu>ms|s))?-"
          rf"(?P<{{p}}hi>{_NUMBER}) (?P<{{p}}hu>ms|s)\]|(?P<{{p}}one>\(1 run\)))")
SENTENCE = re.compile(SPREAD.format(p="a") + r" vs [^\n]*?" + SPREAD.format(p="b") +
                      r": (?P<rest>[^\n]*)")
# "(5 rounds, p = 0.0079)", "(4 and 7 runs, p = 0.012)", "(4 rounds; a verdict needs 5)"
ROUNDS = re.compile(r"(?P<n>\d+)(?: and (?P<m>\d+))? (?:rounds?|runs)(?:, p = (?P<p>[0-9.e-]+)|; a verdict needs)")
# "as fast (1.05x, inside the noise of the runs, p = 0.84) as" and "not comparable (2.07x from 3 rounds; a verdict
# needs 5) with" (or "from 3 and 7 runs"): Verdict.than for a tie and for undecided
AS_FAST = re.compile(r"as fast \((?P<ratio>[0-9.]+)x, inside the noise of the runs, p = (?P<p>[0-9.e-]+)\) as")
NOT_COMPARABLE = re.compile(r"not comparable \([0-9.]+x from (?P<n>\d+)(?: and (?P<m>\d+))? (?:rounds?|runs); "
                            r"a verdict needs \d+\) with")
ALPHA = 0.01


def _side(m: re.Match, p: str) -> tuple[float, float, float, bool]:
    """(median, lowest, highest, single run) in seconds for side ``p`` of a matched sentence."""
    med = float(m[p + "med"]) * UNITS[m[p + "mu"]]
    if m[p + "one"]:
        return med, med, med, True
    low = float(m[p + "lo"]) * UNITS[m[p + "lu"] or m[p + "hu"]]
    return med, low, float(m[p + "hi"]) * UNITS[m[p + "hu"]], False


def _min_p(n: int, m: int) -> float:
    """The smallest two-sided p of an exact rank test with n runs against m: 2 / C(n + m, n)."""
    return min(1.0, 2 / math.comb(n + m, n))


def verdict_problems(text: str, min_effect: float = 0.01) -> list[str]:
    """One line for each printed verdict that its own printed numbers do not support (empty: all agree)."""
    problems = []
    for m in SENTENCE.finditer(text):
        (a, _, _, a_one), (b, _, _, b_one) = _side(m, "a"), _side(m, "b")
        rest, line = m["rest"], m[0]
        apart = abs(b / a - 1) > min_effect if a > 0 else True
        rounds = ROUNDS.search(rest)
        if a_one or b_one:
            ok = rest.startswith("undecided")          # one run shows no spread: nothing can be decided
        elif rounds is None:
            problems.append(f"a verdict that does not say its numbers of runs: {line!r}")
            continue
        else:
            n = int(rounds["n"])
            possible = _min_p(n, int(rounds["m"] or n)) <= ALPHA
            p = float(rounds["p"]) if rounds["p"] else math.nan
            # p prints with 2 significant digits: allow its rounding against the smallest p
            reachable = possible and p >= 0.95 * _min_p(n, int(rounds["m"] or n))
            if rest.startswith("undecided"):
                ok = not possible
            elif " is " in rest and "x faster" in rest:
                ok = reachable and p <= ALPHA and a < b and apart
            elif " is " in rest and "x slower" in rest:
                ok = reachable and p <= ALPHA and a > b and apart
            elif rest.startswith("a tie"):
                ok = reachable and (p > ALPHA or not apart)
            else:
                problems.append(f"a verdict this checker cannot read: {line!r}")
                continue
        if not ok:
            problems.append(f"the printed runs do not support the verdict: {line!r}")
    for m in AS_FAST.finditer(text):
        # a tie with p <= 0.01 needs medians within 1 percent; the ratio prints with 2 decimals
        if float(m["p"]) <= ALPHA and abs(float(m["ratio"]) - 1) > min_effect + 0.005:
            problems.append(f"a tie whose own p and ratio say the rank test and the effect both decided: {m[0]!r}")
    for m in NOT_COMPARABLE.finditer(text):
        if _min_p(int(m["n"]), int(m["m"] or m["n"])) <= ALPHA:
            problems.append(f"'not comparable' from enough runs for a verdict: {m[0]!r}")
    return problems


# A notebook cell's ``check("2.1")`` and the line it ends with: "Exercise 2.1: 4 / 4 points" (toyllm.grading.check)
CHECK_CALL = re.compile(r"""\bcheck\(["'](?P<ex>\d+\.\d+)["']\)""")
POINTS = re.compile(r"^Exercise (?P<ex>\d+\.\d+): (?P<got>[0-9.]+) / (?P<most>[0-9.]+) points$", re.M)


def check_problems(source: str, text: str) -> list[str]:
    """One line for each ``check()`` in a cell's ``source`` whose printed ``text`` does not end in full marks.

    The lessons run with every exercise answered (the model answers, or a student's finished ones): a
    check that loses points, or prints none, is a lesson that does not work."""
    scores = {m["ex"]: (float(m["got"]), float(m["most"])) for m in POINTS.finditer(text)}
    problems = []
    for ex in CHECK_CALL.findall(source):
        if ex not in scores:
            problems.append(f"check({ex!r}) printed no points")
        elif scores[ex][0] != scores[ex][1] or scores[ex][1] == 0:
            problems.append(f"check({ex!r}) gave {scores[ex][0]:g} of {scores[ex][1]:g} points")
    return problems


def count_verdicts(text: str) -> int:
    """How many "A ... vs B ...: verdict" sentences ``text`` holds."""
    return sum(1 for _ in SENTENCE.finditer(text))


@contextlib.contextmanager
def cpu_hog():
    """A process spinning on every usable core but one while the block runs, and on one core of a machine that has
    one or two (each also stops by itself after 15 minutes): the machine a learner shares with other work.

    With the lesson's own threads, more threads want to run than there are cores, so its timings are noisy;
    a core is left to the rest of the test run (under ``make test`` another test runs beside this one)."""
    spin = "import time\nend = time.monotonic() + 900\nwhile time.monotonic() < end:\n    pass\n"
    hogs = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(max(1, usable_cores() - 1))]
    try:
        time.sleep(0.5)                       # let them start spinning
        yield len(hogs)
    finally:
        for p in hogs:
            p.kill()
        for p in hogs:
            p.wait(timeout=30)
