"""``import pshard`` against ``import torch``: wall time of a fresh interpreter.

    python benchmarks/import_time.py [--rounds 15]

Each round starts ``python -c "import torch"`` and ``python -c "import pshard"`` (in turn, so
both see the same machine), and times each from start to exit. Medians over the rounds, and
the median of the per-round differences (target: pshard at most 0.5 s more than torch).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time


def _run(module: str) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", f"import {module}"], check=True)
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    _run("pshard")  # warm the page cache and the bytecode caches
    torch_s, pshard_s = [], []
    for _ in range(args.rounds):
        torch_s.append(_run("torch"))
        pshard_s.append(_run("pshard"))
    diff = [p - t for p, t in zip(pshard_s, torch_s, strict=True)]
    print(f"medians of {args.rounds} interleaved rounds (s)")
    print("| import torch | import pshard | pshard - torch (per-round median) |")
    print("|---|---|---|")
    print(
        f"| {statistics.median(torch_s):.3f} | {statistics.median(pshard_s):.3f} | "
        f"{statistics.median(diff):+.3f} |"
    )


if __name__ == "__main__":
    main()
