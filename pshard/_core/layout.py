"""Layout math: which part of a global tensor each mesh coordinate holds.

Pure integer arithmetic over ``mesh_shape`` (a tuple of ints), ``coordinate`` (one index per mesh
dim) and ``placements`` (one placement per mesh dim, DTensor's convention); no process group.

The rules are DTensor's (torch 2.13), written once in :mod:`pshard._core.layout_rules` with the
checks of these arguments: ``Shard(d)`` splits like ``torch.chunk`` (trailing chunks may be short
or empty), ``StridedShard(d, split_factor=k)`` cuts each of ``k`` pieces in turn, placements act
left to right, mesh dim 0 first.

Negative dims count from the end of the tensor and are normalised before anything else, so
``Shard(-1)`` and ``Shard(ndim - 1)`` are the same placement. Every coordinate holds its
elements in ascending global order, so a block is fully described by the sorted global indices
it holds on each dim (:func:`local_indices`).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import cast

import torch

from .layout_rules import (
    Runs,
    check_coordinate,
    check_ints,
    check_mesh_shape,
    check_partials,
    check_placements,
    index_runs,
)
from .placements import Partial, Placement, Shard, StridedShard

__all__ = [
    "local_shape_and_offset",
    "local_indices",
    "explicit_order",
    "global_shape_and_stride",
    "local_stride",
    "shard_tensor",
    "unshard_tensor",
]


# ----------------------------------------------------------------------------- public


def local_shape_and_offset(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    coordinate: Sequence[int],
    placements: Sequence[Placement],
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shape of the block at ``coordinate`` and the global index of its first element.

    Returns exactly what DTensor's ``compute_local_shape_and_global_offset`` returns, uneven and
    strided layouts included: on a dim whose block is empty the offset is ``global_shape[dim]``,
    and on a strided dim it is the first of several runs (see :func:`local_indices` for all).

    Args:
        global_shape: shape of the whole tensor.
        mesh_shape: size of each mesh dim.
        coordinate: this block's index on each mesh dim.
        placements: one placement per mesh dim.

    Returns:
        ``(local_shape, global_offset)``, two tuples with one entry per tensor dim.

    Raises:
        TypeError, ValueError: when an argument is malformed or the arguments disagree.

    Example:
        >>> import pshard as ps
        >>> ps.local_shape_and_offset((5, 4), (2, 2), (1, 0), (ps.Shard(0), ps.Shard(1)))
        ((2, 2), (3, 0))
        >>> ps.local_shape_and_offset((3,), (4,), (3,), (ps.Shard(0),))  # empty trailing chunk
        ((0,), (3,))
    """
    fn = "local_shape_and_offset"
    shape = check_ints(fn, "global_shape", global_shape, minimum=0)
    mesh = check_mesh_shape(fn, mesh_shape)
    coord = check_coordinate(fn, coordinate, mesh)
    pl = check_placements(fn, placements, mesh, len(shape), f"global_shape {shape}")
    runs = index_runs(shape, mesh, coord, pl)
    local = tuple(sum(map(len, r)) for r in runs)
    offset = tuple(r[0].start if r else n for r, n in zip(runs, shape, strict=True))
    return local, offset


def local_indices(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    coordinate: Sequence[int],
    placements: Sequence[Placement],
) -> tuple[tuple[range, ...], ...]:
    """The exact global indices the block at ``coordinate`` holds, per tensor dim.

    Each dim's indices are given as maximal runs of consecutive indices, ascending, as
    ``range`` objects with step 1: one range for a contiguous block, several for a strided one,
    and the empty tuple ``()`` when the block is empty on that dim (an empty trailing chunk or
    a dim of size 0). The block is ``global[ix_(*indices)]`` in this order, so
    :func:`shard_tensor` and :func:`unshard_tensor` need nothing else.

    Args:
        global_shape: shape of the whole tensor.
        mesh_shape: size of each mesh dim.
        coordinate: this block's index on each mesh dim.
        placements: one placement per mesh dim.

    Returns:
        One tuple of ranges per tensor dim.

    Example:
        >>> import pshard as ps
        >>> ps.local_indices((8,), (2,), (1,), (ps.StridedShard(0, split_factor=2),))
        ((range(2, 4), range(6, 8)),)
        >>> ps.local_indices((3, 2), (4,), (3,), (ps.Shard(0),))
        ((), (range(0, 2),))
    """
    fn = "local_indices"
    shape = check_ints(fn, "global_shape", global_shape, minimum=0)
    mesh = check_mesh_shape(fn, mesh_shape)
    coord = check_coordinate(fn, coordinate, mesh)
    pl = check_placements(fn, placements, mesh, len(shape), f"global_shape {shape}")
    return index_runs(shape, mesh, coord, pl)


def explicit_order(
    mesh_shape: Sequence[int], placements: Sequence[Placement]
) -> tuple[tuple[int, Placement], ...]:
    """Rewrite strided shards as plain shards, listed in the order they are applied.

    Returns ``(mesh_dim, placement)`` pairs: every non-strided placement in mesh order, and each
    run of ``StridedShard(d)`` placements completed by a later ``Shard(d)`` becomes ``Shard(d)``
    entries placed right after that ``Shard(d)``, the nearest strided one first (the shard the
    data was really cut by first). ``StridedShard(d, split_factor=k)`` is valid only when ``k``
    is the product of the sizes of the mesh dims that shard ``d`` before it in this order.

    Dims are compared as written: pass normalised (non-negative) dims when mixing signs.

    Args:
        mesh_shape: size of each mesh dim.
        placements: one placement per mesh dim.

    Returns:
        A tuple of ``(mesh_dim, placement)`` pairs, one per mesh dim.

    Raises:
        ValueError: a ``Shard(d)`` after the strided part of ``d`` has ended, a
            ``split_factor`` that does not match, or a ``StridedShard(d)`` with no later
            ``Shard(d)``.

    Example:
        >>> import pshard as ps
        >>> ps.explicit_order((2, 2, 2), (ps.Shard(0), ps.StridedShard(0, 2), ps.Shard(0)))
        ((0, Shard(0)), (2, Shard(0)), (1, Shard(0)))
    """
    fn = "explicit_order"
    mesh = check_mesh_shape(fn, mesh_shape)
    pl = check_placements(fn, placements, mesh, None)
    ordered: list[tuple[int, Placement]] = []
    pending: dict[int, list[tuple[int, StridedShard]]] = {}
    ended: dict[int, int] = {}  # tensor dim -> mesh dim of the Shard that ended its strided part
    for mesh_dim, p in enumerate(pl):
        if isinstance(p, StridedShard):
            pending.setdefault(p.dim, []).append((mesh_dim, p))
            continue
        ordered.append((mesh_dim, p))
        if not isinstance(p, Shard):
            continue
        if p.dim in ended:
            raise ValueError(
                f"{fn}: placements[{mesh_dim}] = {p!r} shards tensor dim {p.dim} again after "
                f"its strided part ended at placements[{ended[p.dim]}]; a strided layout "
                f"(StridedShard({p.dim}, ...) then Shard({p.dim})) must be the last sharding of "
                f"that dim (placements {pl}, mesh_shape {mesh})"
            )
        if p.dim not in pending:
            continue
        ended[p.dim] = mesh_dim
        aggregate = mesh[mesh_dim]
        for strided_dim, strided in reversed(pending.pop(p.dim)):
            if strided.split_factor != aggregate:
                raise ValueError(
                    f"{fn}: placements[{strided_dim}] = {strided!r} needs split_factor="
                    f"{aggregate} (the number of pieces the later mesh dims cut tensor dim "
                    f"{p.dim} into first), got {strided.split_factor} (placements {pl}, "
                    f"mesh_shape {mesh})"
                )
            aggregate *= mesh[strided_dim]
            ordered.append((strided_dim, Shard(p.dim)))
    for dim, strided_list in pending.items():
        strided_dim, strided = strided_list[0]
        raise ValueError(
            f"{fn}: placements[{strided_dim}] = {strided!r} has no later Shard({dim}) to "
            f"complete it; a StridedShard({dim}, ...) describes a dim that a later mesh dim "
            f"shards with Shard({dim}) (placements {pl}, mesh_shape {mesh})"
        )
    return tuple(ordered)


def _shards(placements: tuple[Placement, ...]) -> list[tuple[int, int]]:
    return [(m, p.dim) for m, p in enumerate(placements) if isinstance(p, (Shard, StridedShard))]


def global_shape_and_stride(
    local_shape: Sequence[int],
    local_stride: Sequence[int],
    mesh_shape: Sequence[int],
    placements: Sequence[Placement],
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Global shape and stride of a tensor from one block's shape and stride.

    DTensor's ``compute_global_tensor_info``: each sharded dim is multiplied by the mesh dim's
    size, and every stride at least as large as the sharded dim's stride is multiplied too.
    This assumes even sharding: a block's shape alone cannot tell an uneven global shape
    (``(2,)`` on 2 coordinates may come from 3 or 4 elements), as in DTensor; pass the global
    shape explicitly wherever sharding may be uneven.

    Args:
        local_shape: shape of the block.
        local_stride: stride of the block.
        mesh_shape: size of each mesh dim.
        placements: one placement per mesh dim.

    Returns:
        ``(global_shape, global_stride)``.

    Example:
        >>> import pshard as ps
        >>> ps.global_shape_and_stride((4, 8, 2), (16, 1, 8), (2,), (ps.Shard(2),))
        ((4, 8, 4), (32, 1, 8))
    """
    fn = "global_shape_and_stride"
    shape = list(check_ints(fn, "local_shape", local_shape, minimum=0))
    stride = list(check_ints(fn, "local_stride", local_stride, minimum=0))
    if len(shape) != len(stride):
        raise ValueError(
            f"{fn}: local_shape {tuple(shape)} and local_stride {tuple(stride)} have "
            f"different lengths"
        )
    mesh = check_mesh_shape(fn, mesh_shape)
    pl = check_placements(fn, placements, mesh, len(shape), f"local_shape {tuple(shape)}")
    for mesh_dim, dim in _shards(pl):
        shape[dim] *= mesh[mesh_dim]
        stride = [
            s * mesh[mesh_dim] if i != dim and s >= stride[dim] else s for i, s in enumerate(stride)
        ]
    return tuple(shape), tuple(stride)


def local_stride(
    global_stride: Sequence[int], mesh_shape: Sequence[int], placements: Sequence[Placement]
) -> tuple[int, ...]:
    """Stride of a block, given the stride of the global tensor.

    Every stride larger than a sharded dim's stride is divided by that mesh dim's size: the
    block keeps the global memory order, packed densely. Exact for even sharding of a dense
    tensor (the inverse of :func:`global_shape_and_stride`); for uneven sharding the real
    block of a short chunk is packed to its own size instead.

    Args:
        global_stride: stride of the global tensor.
        mesh_shape: size of each mesh dim.
        placements: one placement per mesh dim.

    Returns:
        The block's stride.

    Example:
        >>> import pshard as ps
        >>> ps.local_stride((32, 1, 8), (2,), (ps.Shard(2),))
        (16, 1, 8)
    """
    fn = "local_stride"
    stride = check_ints(fn, "global_stride", global_stride, minimum=0)
    mesh = check_mesh_shape(fn, mesh_shape)
    pl = check_placements(fn, placements, mesh, len(stride), f"global_stride {stride}")
    divisors = [1] * len(stride)
    for mesh_dim, dim in _shards(pl):
        for j, s in enumerate(stride):
            if s > stride[dim]:
                divisors[j] *= mesh[mesh_dim]
    return tuple(s // d for s, d in zip(stride, divisors, strict=True))


def _index(runs: Runs, device: torch.device) -> torch.Tensor:
    return torch.cat([torch.arange(r.start, r.stop, device=device) for r in runs])


def shard_tensor(
    tensor: torch.Tensor,
    mesh_shape: Sequence[int],
    coordinate: Sequence[int],
    placements: Sequence[Placement],
) -> torch.Tensor:
    """The block of ``tensor`` that the mesh coordinate ``coordinate`` holds.

    Equal to the local tensor of ``distribute_tensor(tensor, mesh, placements)`` on that
    coordinate. Contiguous blocks are views of ``tensor`` (as ``torch.chunk``); strided blocks
    gather their exact indices into a new tensor. ``Partial`` mesh dims partition the value as
    DTensor does: ``Partial("sum")`` holds ``tensor / size`` (so an integer tensor becomes
    floating point), the other reductions hold the value itself.

    Args:
        tensor: the global tensor.
        mesh_shape: size of each mesh dim.
        coordinate: the block's index on each mesh dim.
        placements: one placement per mesh dim.

    Returns:
        The block, of shape ``local_shape_and_offset(tensor.shape, ...)[0]``.

    Example:
        >>> import torch, pshard as ps
        >>> ps.shard_tensor(torch.arange(8), (2, 2), (0, 1), (ps.StridedShard(0, 2), ps.Shard(0)))
        tensor([4, 5])
    """
    fn = "shard_tensor"
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{fn}: tensor must be a torch.Tensor, got {type(tensor).__name__}")
    mesh = check_mesh_shape(fn, mesh_shape)
    coord = check_coordinate(fn, coordinate, mesh)
    shape = tuple(tensor.shape)
    pl = check_placements(fn, placements, mesh, len(shape), f"tensor shape {shape}")
    check_partials(fn, pl)
    out = tensor
    for dim, runs in enumerate(index_runs(shape, mesh, coord, pl)):
        if len(runs) == 1:
            out = out.narrow(dim, runs[0].start, len(runs[0]))
        elif not runs:
            out = out.narrow(dim, 0, 0)
        else:
            out = out.index_select(dim, _index(runs, out.device))
    for p, n in zip(pl, mesh, strict=True):
        if isinstance(p, Partial) and p.reduce == "sum":
            out = out / n
    return out


def unshard_tensor(
    blocks: Mapping[tuple[int, ...], torch.Tensor],
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    placements: Sequence[Placement],
) -> torch.Tensor:
    """Assemble the global tensor from the block of every mesh coordinate.

    The inverse of :func:`shard_tensor`: each block is written at its :func:`local_indices`;
    on ``Replicate`` mesh dims the block at index 0 is used, and ``Partial`` mesh dims reduce
    their blocks (``"sum"``, ``"mean"``, ``"max"``, ``"min"``) as DTensor's ``full_tensor``
    would. ``unshard_tensor({c: shard_tensor(x, m, c, p) for c in coords}, x.shape, m, p)``
    gives ``x`` back exactly (up to rounding of the division for ``Partial("sum")``).

    Args:
        blocks: one tensor per mesh coordinate (every coordinate of ``mesh_shape``).
        global_shape: shape of the whole tensor.
        mesh_shape: size of each mesh dim.
        placements: one placement per mesh dim.

    Returns:
        A new tensor of shape ``global_shape``.

    Example:
        >>> import itertools, torch, pshard as ps
        >>> pl = (ps.Shard(0), ps.StridedShard(1, 2))
        >>> x = torch.arange(15).reshape(3, 5)
        >>> coords = itertools.product(range(2), range(2))
        >>> blocks = {c: ps.shard_tensor(x, (2, 2), c, pl) for c in coords}
        >>> torch.equal(ps.unshard_tensor(blocks, (3, 5), (2, 2), pl), x)
        True
    """
    fn = "unshard_tensor"
    shape = check_ints(fn, "global_shape", global_shape, minimum=0)
    mesh = check_mesh_shape(fn, mesh_shape)
    pl = check_placements(fn, placements, mesh, len(shape), f"global_shape {shape}")
    check_partials(fn, pl)
    if not isinstance(blocks, Mapping):
        raise TypeError(
            f"{fn}: blocks must be a mapping from mesh coordinate to tensor, "
            f"got {type(blocks).__name__}"
        )
    coords = list(itertools.product(*map(range, mesh)))
    keys = {tuple(k) if isinstance(k, (list, tuple)) else k: v for k, v in blocks.items()}
    missing = [c for c in coords if c not in keys]
    extra = [k for k in keys if k not in set(coords)]
    if missing or extra:
        what = f"misses coordinates {missing[:4]}" if missing else f"has extra keys {extra[:4]}"
        raise ValueError(
            f"{fn}: blocks {what}{' ...' if len(missing or extra) > 4 else ''}; give one block "
            f"for every coordinate of mesh_shape {mesh} ({len(coords)} in all)"
        )
    partial_dims = [m for m, p in enumerate(pl) if isinstance(p, Partial)]
    reduce = next((p.reduce for p in pl if isinstance(p, Partial)), "sum")
    out: torch.Tensor | None = None
    for coord in coords:
        if any(
            c and not isinstance(p, (Shard, StridedShard)) for c, p in zip(coord, pl, strict=True)
        ):
            continue  # read once per distinct block: index 0 on Replicate / Partial dims
        group: list[tuple[tuple[int, ...], torch.Tensor]] = []
        for sub in itertools.product(*(range(mesh[m]) for m in partial_dims)):
            full = list(coord)
            for m, s in zip(partial_dims, sub, strict=True):
                full[m] = s
            group.append((tuple(full), keys[tuple(full)]))
        runs = index_runs(shape, mesh, coord, pl)
        local = tuple(sum(map(len, r)) for r in runs)
        for c, block in group:
            if not isinstance(block, torch.Tensor):
                raise TypeError(
                    f"{fn}: blocks[{c}] must be a torch.Tensor, got {type(block).__name__}"
                )
            if tuple(block.shape) != local:
                raise ValueError(
                    f"{fn}: blocks[{c}] has shape {tuple(block.shape)} but placements {pl} "
                    f"on mesh_shape {mesh} give that coordinate shape {local} "
                    f"(global_shape {shape})"
                )
        if len(group) == 1:
            value = group[0][1]
        else:
            stacked = torch.stack([block for _, block in group])
            if reduce == "sum":
                value = stacked.sum(0)
            elif reduce == "mean":
                is_float = stacked.is_floating_point() or stacked.is_complex()
                value = stacked.mean(0) if is_float else stacked.sum(0) / len(group)
            else:
                value = stacked.amax(0) if reduce == "max" else stacked.amin(0)
        if out is None:
            out = value.new_empty(shape)
        if value.numel() == 0:
            continue
        if all(len(r) == 1 for r in runs):
            out[tuple(slice(r[0].start, r[0].stop) for r in runs)] = value
        else:
            idx = [_index(r, out.device) for r in runs]
            ndim = len(idx)
            out[
                tuple(i.view([-1 if k == d else 1 for k in range(ndim)]) for d, i in enumerate(idx))
            ] = value
    return cast(torch.Tensor, out)  # the mesh has at least one coordinate
