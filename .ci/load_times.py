"""How long a new process takes to load SmolLM2: from the GGUF file, or from the copy kept in the cache folder.

    .venv/bin/python .ci/load_times.py [--rounds 7]

Each run is a fresh Python (``python -c``: import toyllm, then ``load_model("smollm2-135m")``), timed by the
wall clock around the load alone and reported by the child. "parsed": an empty cache folder, so the file is read,
dequantized and then kept (what the first notebook of a machine pays); "kept": a cache folder that already holds
the copy (every later one). The two take turns, after one untimed round each (``toyllm.measure.interleaved_runs``),
and the verdict comes from ``toyllm.measure.compare``. docs/testing.md has the figures.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from toyllm.compile_cache import CACHE_ENV
from toyllm.measure import compare, interleaved_runs, load_average, usable_cores

CHILD = ("import time; import toyllm; t = time.perf_counter(); toyllm.load_model('smollm2-135m'); "
         "print(time.perf_counter() - t)")


def _load_s(cache: Path) -> float:
    out = subprocess.run([sys.executable, "-c", CHILD], env={**os.environ, CACHE_ENV: str(cache)},
                         capture_output=True, text=True, timeout=300, check=True).stdout
    return float(out.split()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="toyllm-load-times-") as folder:
        kept, empty = Path(folder) / "kept", Path(folder) / "empty"

        def parsed() -> float:
            shutil.rmtree(empty, ignore_errors=True)
            return _load_s(empty)

        print(f"{usable_cores()} usable cores, load average {load_average():.2f} before")
        runs = interleaved_runs({"parsed": parsed, "kept": lambda: _load_s(kept)}, rounds=args.rounds)
        print(f"load average {load_average():.2f} after")
    verdict = compare(runs["kept"], runs["parsed"])
    print(verdict.sentence("kept", "parsed"))


if __name__ == "__main__":
    main()
