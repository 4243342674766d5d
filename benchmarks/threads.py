"""In-process ranks against gloo processes: spawn latency and a training step.

    python benchmarks/threads.py [--rounds 5] [--nprocs 4] [--steps 10]

1. Spawn latency: ``ps.spawn(fn, nprocs=n, backend=...)`` where ``fn`` makes a mesh and runs one
   ``psum``, timed from the call to its return (start-up, process group, the collective,
   teardown), interleaved rounds, medians.
2. A training step: the same per-rank function (data-parallel ``shard_map`` over ``"dp"`` of an
   MLP's loss, ``torch.func.grad``, an SGD update) timed inside the ranks over ``--steps`` steps
   after a warm-up, on threads and on gloo processes. Threads take turns, so they share the
   machine's cores one rank at a time (each rank computes with every core); gloo processes run
   at once with ``cores / n`` threads each.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch.func import grad

import pshard as ps


def _psum_once() -> float:
    ps.init_mesh({"dp": dist.get_world_size()})
    return ps.psum(torch.ones(1), "dp").item()


def _train(steps: int, width: int, rows: int) -> float:
    """Seconds per step (median) of a data-parallel MLP step on this rank."""
    ps.init_mesh({"dp": dist.get_world_size()})
    torch.manual_seed(0)
    params = {
        "w1": torch.randn(width, width) / width**0.5,
        "w2": torch.randn(width, width) / width**0.5,
        "w3": torch.randn(width, 1) / width**0.5,
    }
    x, y = torch.randn(rows, width), torch.randn(rows, 1)

    def local(p: dict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(x @ p["w1"])
        h = torch.tanh(h @ p["w2"])
        return ps.pmean(((h @ p["w3"] - y) ** 2).mean(), "dp")

    loss = ps.shard_map(local, in_specs=(None, ps.Shard(0), ps.Shard(0)), out_specs=ps.Replicate())
    step = grad(loss)
    times = []
    for i in range(steps + 2):
        t0 = time.perf_counter()
        g = step(params, x, y)
        params = {k: v - 0.01 * g[k] for k, v in params.items()}
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _spawn_latency(nprocs: int, rounds: int) -> dict[str, float]:
    out: dict[str, list[float]] = {"threads": [], "gloo": []}
    for _ in range(rounds):
        for backend in out:
            t0 = time.perf_counter()
            ps.spawn(_psum_once, nprocs=nprocs, backend=backend)
            out[backend].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in out.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--nprocs", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--rows", type=int, default=4096)
    args = parser.parse_args()

    lat = _spawn_latency(args.nprocs, args.rounds)
    print(f"spawn latency, {args.nprocs} ranks, medians of {args.rounds} interleaved rounds")
    print("| backend | seconds | threads / gloo |")
    print("|---|---|---|")
    print(f"| threads | {lat['threads']:.4f} | {lat['threads'] / lat['gloo']:.3f} |")
    print(f"| gloo processes | {lat['gloo']:.3f} | 1 |")

    print()
    print(
        f"training step (MLP {args.width} wide, {args.rows} rows over {args.nprocs} ranks), "
        f"median seconds per step over {args.steps} steps, {args.rounds} rounds"
    )
    rows: dict[str, list[float]] = {"threads": [], "gloo": []}
    for _ in range(args.rounds):
        for backend in rows:
            per_rank = ps.spawn(
                _train, args.steps, args.width, args.rows, nprocs=args.nprocs, backend=backend
            )
            rows[backend].append(max(per_rank))
    threads, gloo = statistics.median(rows["threads"]), statistics.median(rows["gloo"])
    print("| backend | s / step | threads / gloo |")
    print("|---|---|---|")
    print(f"| threads | {threads:.4f} | {threads / gloo:.2f} |")
    print(f"| gloo processes | {gloo:.4f} | 1 |")


if __name__ == "__main__":
    main()
