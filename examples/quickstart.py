"""pshard quickstart: layouts, a spawned process group, and collectives under torch.func.

Runs on a laptop CPU:

    python examples/quickstart.py              # 2 gloo ranks
    python examples/quickstart.py --nprocs 4

It prints where each rank's block of an unevenly sharded tensor lives (the same answer as
DTensor), then spawns ``--nprocs`` processes that compute a data-parallel least-squares gradient
with ``torch.func.grad`` through ``ps.psum`` and checks it against the single-process gradient.
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


def loss(w: torch.Tensor, x: torch.Tensor, y: torch.Tensor, n_total: int) -> torch.Tensor:
    """Mean squared error over the whole batch: local sum, then psum over the data axis."""
    local = ((x @ w - y) ** 2).sum()
    return ps.psum(local, "dp") / n_total


def rank_main(x: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> tuple[float, torch.Tensor]:
    mesh = ps.init_mesh({"dp": torch.distributed.get_world_size()})
    rank = mesh.get_local_rank("dp")
    coord = (rank,)
    # This rank's rows of the batch (torch.chunk's rule, the same as DTensor's Shard(0)).
    x_local = ps.shard_tensor(x, (mesh.size(),), coord, [ps.Shard(0)])
    y_local = ps.shard_tensor(y, (mesh.size(),), coord, [ps.Shard(0)])
    value, grad = torch.func.grad_and_value(loss)(w, x_local, y_local, x.shape[0])[::-1]
    # Each rank holds its own copy of w, and grad differentiates the sum of every rank's (equal)
    # loss with respect to this rank's copy. The gradient of the loss with respect to the one
    # shared w is the sum over the copies, divided by the number of copies.
    return float(value), ps.psum(grad, "dp") / mesh.size()


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
