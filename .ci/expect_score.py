"""Check a grading's results.json (Gradescope format) against what CI expects of it.

    python .ci/expect_score.py results.json full     # every exercise got every point
    python .ci/expect_score.py results.json zero     # no exercise got a point

Prints one line per exercise that differs (with its tests' messages) and exits 1 if any does.
"""
import json
import sys


def main(path: str, expected: str) -> int:
    results = json.loads(open(path).read())
    by_exercise: dict[str, list] = {}
    for test in results["tests"]:
        by_exercise.setdefault(test["number"], []).append(test)
    wrong = []
    for number, tests in sorted(by_exercise.items(), key=lambda kv: [int(x) for x in kv[0].split(".")]):
        got, most = sum(t["score"] for t in tests), sum(t["max_score"] for t in tests)
        if (got != most) if expected == "full" else (got != 0):
            wrong.append(f"Exercise {number}: {got:g}/{most:g} (expected {'full marks' if expected == 'full' else 0})")
            wrong += [f"    {t['name']}: {t['output'][:600]}" for t in tests if t["score"] < t["max_score"] or got]
    print(f"{path}: {len(by_exercise)} exercises, {results['score']:g}/{results['max_score']:g} points; "
          f"expected {expected}: {'ok' if not wrong else f'{len(wrong)} lines differ'}")
    print("\n".join(wrong))
    return 1 if wrong else 0


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[2] not in ("full", "zero"):
        sys.exit("usage: python .ci/expect_score.py results.json full|zero")
    sys.exit(main(sys.argv[1], sys.argv[2]))
