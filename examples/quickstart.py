"""pshard quickstart: layouts, a spawned process group, and collectives under torch.func.

Runs on a laptop CPU:

    python examples/quickstart.py              # 2 gloo ranks
    python examples/quickstart.py --nprocs 4

It prints where each rank's block of an unevenly sharded tensor lives (the same answer as
DTensor), then spawns ``--nprocs`` processes that compute a data-parallel least-squares gradient
with ``torch.func.grad`` of a ``ps.shard_map``'d loss and checks it against the single-process
gradient.
"""

from __future__ import annotations

import argparse
import itertools

import torch

import pshard as ps


def show_layout(global_shape: tuple[int, ...], mesh_shape: tuple[int, ...], placements) -> None:
    print(f"\n{global_shape} on mesh {mesh_shape} with {list(placements)}")
    print(f"  {'coordinate':<12}{'local shape':<14}{'offset':<10}indices on dim 0")
    for coord in itertools.product(*map(range, mesh_shape)):
        shape, offset = ps.local_shape_and_offset(global_shape, mesh_shape, coord, placements)
        rows = ps.local_indices(global_shape, mesh_shape, coord, placements)[0]
        print(f"  {coord!s:<12}{shape!s:<14}{offset!s:<10}{[list(r) for r in rows]}")


def local_loss(w: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Inside shard_map: this rank's rows; psum makes the mean over the whole batch."""
    sq = ((x @ w - y) ** 2).sum()
    return ps.psum(sq, "dp") / ps.psum(torch.tensor(x.shape[0], dtype=sq.dtype), "dp")


def rank_main(x: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> tuple[float, torch.Tensor]:
    ps.init_mesh({"dp": torch.distributed.get_world_size()})
    # w replicated, the rows of x and y split over "dp" (torch.chunk's rule, as DTensor's
    # Shard(0)); the loss comes back replicated. The gradient of the mapped function is the
    # single-process gradient, the same on every rank: no manual all-reduce, no 1/N factor.
    loss = ps.shard_map(
        local_loss, in_specs=(None, ps.Shard(0), ps.Shard(0)), out_specs=ps.Replicate()
    )
    grad, value = torch.func.grad_and_value(loss)(w, x, y)
    return float(value), grad


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nprocs", type=int, default=2, help="number of local gloo ranks")
    args = parser.parse_args()

    show_layout((7,), (2,), [ps.Shard(0)])
    show_layout((8, 4), (2, 2), [ps.StridedShard(0, split_factor=2), ps.Shard(0)])

    torch.manual_seed(0)
    x = torch.randn(11, 3, dtype=torch.float64)
    y = torch.randn(11, dtype=torch.float64)
    w = torch.randn(3, dtype=torch.float64)
    results = ps.spawn(rank_main, x, y, w, nprocs=args.nprocs)

    ref_value, ref_grad = torch.func.grad_and_value(lambda w: ((x @ w - y) ** 2).mean())(w)[::-1]
    print(f"\n{args.nprocs} ranks, {x.shape[0]} rows split by torch.chunk's rule")
    print(f"  {'rank':<6}{'loss':<22}max |grad - single-process grad|")
    for rank, (value, grad) in enumerate(results):
        print(f"  {rank:<6}{value:<22.15f}{(grad - ref_grad).abs().max().item():.2e}")
    worst = max(abs(v - ref_value.item()) for v, _ in results)
    worst = max([worst] + [(g - ref_grad).abs().max().item() for _, g in results])
    print(f"single-process loss {ref_value.item():.15f}; max difference {worst:.2e}")
    if worst > 1e-12:
        raise SystemExit("mismatch against the single-process reference")


if __name__ == "__main__":
    main()
