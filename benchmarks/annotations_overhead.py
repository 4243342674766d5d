"""Per-call overhead of taking specs from annotations instead of explicit spec trees.

A training step ``step(params: dict, batch: Batch) -> Annotated[Tensor, Partial("mean")]`` whose
``Batch`` dataclass annotates its fields (``Shard(1)``) runs through ``pmap_microbatch`` and
``shard_map`` (a one-rank mesh, so the map itself is free) twice: once reading its specs from the
annotations, once given the same spec trees explicitly (then nothing is read). Each round times
``--calls`` calls of
each in alternating order; the table gives the median per-call time of each, the median of the
per-round differences (the overhead), and the cost of the annotation look-up alone
(``default_in_specs`` + ``default_out_specs``, cached after the first call). The step itself is
tiny so that the per-call machinery dominates.

Usage: ``python benchmarks/annotations_overhead.py [--rounds 200 --calls 300]``.
Target: overhead under 20 microseconds per call.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path
from typing import Annotated

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
import pshard as ps  # noqa: E402
from pshard._core.annotations import default_in_specs, default_out_specs  # noqa: E402


@dataclasses.dataclass
class Batch:
    input_ids: Annotated[torch.Tensor, ps.Shard(1)]
    labels: Annotated[torch.Tensor, ps.Shard(1)]
    num_tokens: int


def step(params: dict, batch: Batch) -> Annotated[torch.Tensor, ps.Partial("mean")]:
    return (params["w"] * batch.input_ids).sum() + batch.labels.sum()


EXPLICIT_IN = (None, Batch(ps.Shard(1), ps.Shard(1), None))


def per_call(fn, args, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn(*args)
    return (time.perf_counter() - start) / calls


def lookup(args):
    default_in_specs(step, args, {}, transform="bench")
    default_out_specs(step, transform="bench")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args()
    torch.set_num_threads(1)
    params = {"w": torch.ones(8)}
    batch = Batch(torch.ones(2, 8), torch.ones(2, 8), 16)
    inputs = (params, batch)
    ps.init_mesh({"sp": 1})
    cases = {
        "pmap_microbatch": (
            ps.pmap_microbatch(step, num_microbatches=1),
            ps.pmap_microbatch(
                step,
                num_microbatches=1,
                in_specs=EXPLICIT_IN,
                out_specs=ps.Partial("mean"),
            ),
        ),
        "shard_map": (
            ps.shard_map(step),
            ps.shard_map(step, in_specs=EXPLICIT_IN, out_specs=ps.Partial("mean")),
        ),
    }
    print(
        f"torch {torch.__version__}, Python {sys.version.split()[0]}, 1 thread; medians of "
        f"{args.rounds} alternating rounds of {args.calls} calls"
    )
    print("| transform | annotations (us/call) | explicit specs (us/call) | overhead (us/call) |")
    print("|---|---|---|---|")
    for name, (annotated, explicit) in cases.items():
        torch.testing.assert_close(annotated(*inputs), explicit(*inputs))
        times: dict[str, list[float]] = {"annotated": [], "explicit": []}
        for r in range(args.rounds):
            order = [("annotated", annotated), ("explicit", explicit)]
            for label, fn in order if r % 2 == 0 else reversed(order):
                times[label].append(per_call(fn, inputs, args.calls) * 1e6)
        diff = statistics.median(
            a - b for a, b in zip(times["annotated"], times["explicit"], strict=True)
        )
        print(
            f"| {name} | {statistics.median(times['annotated']):.1f} | "
            f"{statistics.median(times['explicit']):.1f} | {diff:.1f} |"
        )
    lookups = [per_call(lookup, (inputs,), args.calls) * 1e6 for _ in range(args.rounds)]
    print(
        f"\nannotation look-up alone (default_in_specs + default_out_specs, cached): "
        f"{statistics.median(lookups):.2f} us/call"
    )


if __name__ == "__main__":
    main()
