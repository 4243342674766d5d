"""Resharding a checkpoint between two placements with pshard's layout math (no process group).

    python examples/layouts.py

A weight saved by 2 ranks as row shards (``Shard(0)`` on a mesh of 2, uneven: torch.chunk's rule)
is loaded by a 2 x 2 mesh that holds it as ``[StridedShard(0, split_factor=2), Shard(0)]`` (the
layout of FSDP2 over tensor parallelism). Each new block is assembled from the old blocks using
only ``ps.local_indices`` (the exact global indices a coordinate holds), never the whole tensor.
The result is checked against ``ps.shard_tensor`` of the original and round-tripped through
``ps.unshard_tensor``.
"""

from __future__ import annotations

import itertools

import torch

import pshard as ps


def indices(global_shape, mesh_shape, coord, placements) -> list[torch.Tensor]:
    """Global indices held by ``coord``, one LongTensor per tensor dim."""
    ranges = ps.local_indices(global_shape, mesh_shape, coord, placements)
    return [torch.tensor([i for r in dim for i in r], dtype=torch.long) for dim in ranges]


def reshard(blocks: dict, global_shape, src_mesh, src_placements, dst_mesh, dst_placements) -> dict:
    """Blocks of a tensor under ``src_placements`` -> blocks under ``dst_placements``."""
    out = {}
    for dst in itertools.product(*map(range, dst_mesh)):
        want = indices(global_shape, dst_mesh, dst, dst_placements)
        shape = tuple(len(w) for w in want)
        block = torch.empty(shape, dtype=next(iter(blocks.values())).dtype)
        filled = torch.zeros(shape, dtype=torch.bool)
        for src, src_block in blocks.items():
            have = indices(global_shape, src_mesh, src, src_placements)
            dst_pos, src_pos = [], []
            for w, h in zip(want, have, strict=True):
                where = {g: i for i, g in enumerate(h.tolist())}  # global index -> local in src
                keep = [(i, where[g]) for i, g in enumerate(w.tolist()) if g in where]
                dst_pos.append(torch.tensor([a for a, _ in keep], dtype=torch.long))
                src_pos.append(torch.tensor([b for _, b in keep], dtype=torch.long))
            if all(len(p) for p in dst_pos):
                grid_dst = torch.meshgrid(*dst_pos, indexing="ij")
                block[grid_dst] = src_block[torch.meshgrid(*src_pos, indexing="ij")]
                filled[grid_dst] = True
        if not filled.all():
            raise RuntimeError(f"block {dst} not covered by the source blocks")
        out[dst] = block
    return out


def main() -> None:
    weight = torch.arange(11 * 3, dtype=torch.float32).reshape(11, 3)
    src_mesh, src_placements = (2,), [ps.Shard(0)]
    dst_mesh, dst_placements = (2, 2), [ps.StridedShard(0, split_factor=2), ps.Shard(0)]

    # The checkpoint: one block per saving rank.
    saved = {
        c: ps.shard_tensor(weight, src_mesh, c, src_placements)
        for c in itertools.product(*map(range, src_mesh))
    }
    print(f"saved {tuple(weight.shape)} as {src_placements} on mesh {src_mesh}:")
    for c, b in saved.items():
        rows = ps.local_indices(weight.shape, src_mesh, c, src_placements)[0]
        print(f"  {c}: shape {tuple(b.shape)}, rows {[list(r) for r in rows]}")

    loaded = reshard(saved, weight.shape, src_mesh, src_placements, dst_mesh, dst_placements)
    print(f"loaded as {dst_placements} on mesh {dst_mesh}:")
    worst = 0.0
    for c, b in loaded.items():
        rows, cols = ps.local_indices(weight.shape, dst_mesh, c, dst_placements)
        shape, offset = ps.local_shape_and_offset(weight.shape, dst_mesh, c, dst_placements)
        expect = ps.shard_tensor(weight, dst_mesh, c, dst_placements)
        worst = max(worst, (b - expect).abs().max().item())
        print(
            f"  {c}: shape {tuple(b.shape)} (DTensor: {tuple(shape)}, offset {tuple(offset)}), "
            f"rows {[list(r) for r in rows]}, cols {[list(r) for r in cols]}"
        )
    back = ps.unshard_tensor(loaded, weight.shape, dst_mesh, dst_placements)
    worst = max(worst, (back - weight).abs().max().item())
    print(f"max difference against shard_tensor and the round trip: {worst:.1e}")
    if worst != 0.0:
        raise SystemExit("resharding changed the values")


if __name__ == "__main__":
    main()
