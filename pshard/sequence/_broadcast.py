"""Every rank's batch in turn to the whole axis, the next transfer overlapped with the current step.

With sequence parallelism the ranks of an axis work on one sequence together, but a data loader
gives each rank its own batch. :func:`broadcast_batches` lets the axis process all of them: step
``i`` yields rank ``i``'s batch on every rank.

How it moves data (no pickle anywhere):

1. One all-gather of a small int64 *description* of every rank's batch: a digest of its pytree
   structure and, per leaf, its dtype, device type and shape (or a digest of a non-tensor leaf,
   which must be the same on every rank). Ranks whose structures differ get a ``ValueError``.
2. Per step, the source packs its tensor leaves into one byte buffer per device (each leaf
   aligned to 16 bytes) and one ``broadcast`` moves it; the other ranks read their leaves as
   views of the received buffer, without copies.
3. The broadcast for step ``i + 1`` is issued asynchronously (``async_op=True``) before step
   ``i``'s batch is yielded, so it overlaps with the work done on step ``i``; it is waited for
   when the next batch is asked for.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from .._core.checks import WIRE_DTYPES
from .._core.tree import describe, keystr, leaf_path, tree_flatten, tree_unflatten
from .._runtime.mesh import Axis, resolve_axis
from .._runtime.wire import gather_into

__all__ = ["broadcast_batches"]

T = TypeVar("T")

_DEVICE_TYPES = ("cpu", "cuda")
_ALIGN = 16
_NOT_TENSOR = -1


def _digest(text: str) -> int:
    return zlib.crc32(text.encode())


def _describe_leaves(leaves: list[Any], treedef: Any, fn: str) -> list[int]:
    """This rank's description: [structure digest, leaves, then per leaf a record]."""
    out = [_digest(str(treedef)), len(leaves)]
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            if leaf.dtype not in WIRE_DTYPES:
                raise TypeError(
                    f"{fn}: {keystr(leaf_path(treedef, i), 'batch')} has dtype {leaf.dtype}, "
                    f"which broadcast_batches cannot send; convert it"
                )
            kind = leaf.device.type
            code = _DEVICE_TYPES.index(kind) if kind in _DEVICE_TYPES else len(_DEVICE_TYPES)
            out += [WIRE_DTYPES.index(leaf.dtype), code, leaf.dim(), *leaf.shape]
        else:
            out += [_NOT_TENSOR, _digest(repr(leaf))]
    return out


def _exchange(mine: list[int], group: dist.ProcessGroup, device: torch.device) -> list[list[int]]:
    """Every rank's description (two small all-gathers: the lengths, then the padded records)."""
    size = dist.get_world_size(group)
    head = torch.tensor([len(mine)], dtype=torch.int64, device=device)
    heads = torch.empty(size, dtype=torch.int64, device=device)
    gather_into(heads.view(size, 1), head, group)
    width = int(heads.max())
    body = torch.zeros(width, dtype=torch.int64, device=device)
    body[: len(mine)] = torch.tensor(mine, dtype=torch.int64)
    bodies = torch.empty(size * width, dtype=torch.int64, device=device)
    gather_into(bodies.view(size, width), body, group)
    rows = bodies.view(size, width).tolist()
    return [row[:n] for row, n in zip(rows, heads.tolist(), strict=True)]


#: One leaf of a rank's batch: (dtype, device code, shape) of a tensor, or another leaf's digest.
Record = tuple[torch.dtype, int, tuple[int, ...]] | int
#: Where a tensor leaf sits in its device's buffer: (leaf, byte offset, bytes, dtype, shape).
Slot = tuple[int, int, int, torch.dtype, tuple[int, ...]]


def _parse(desc: list[int]) -> list[Record]:
    """Per leaf: (dtype, device code, shape) of a tensor, or the digest of another leaf."""
    out: list[Record] = []
    i = 2
    for _ in range(desc[1]):
        if desc[i] == _NOT_TENSOR:
            out.append(desc[i + 1])
            i += 2
        else:
            ndim = desc[i + 2]
            out.append((WIRE_DTYPES[desc[i]], desc[i + 1], tuple(desc[i + 3 : i + 3 + ndim])))
            i += 3 + ndim
    return out


def _check(
    rows: list[list[int]], leaves: list[Any], treedef: Any, group: dist.ProcessGroup, fn: str
) -> list[list[Record]]:
    parsed = [_parse(row) for row in rows]
    if len({row[0] for row in rows}) > 1 or len({row[1] for row in rows}) > 1:
        ranks = [dist.get_global_rank(group, r) for r in range(len(rows))]
        counts = ", ".join(f"rank {g}: {row[1]} leaves" for g, row in zip(ranks, rows, strict=True))
        raise ValueError(
            f"{fn}: the ranks' batches have different pytree structures ({counts}; this rank's "
            f"is {treedef}); every rank must pass a batch with the same keys and nesting (the "
            f"shapes may differ)"
        )
    for i, leaf in enumerate(leaves):
        path = keystr(leaf_path(treedef, i), "batch")
        records = [p[i] for p in parsed]
        kinds = {r[0] if isinstance(r, tuple) else None for r in records}
        if isinstance(leaf, torch.Tensor):
            devices = {r[1] for r in records if isinstance(r, tuple)}
            if None in kinds or len(devices) > 1:
                raise ValueError(
                    f"{fn}: {path} is a tensor on some ranks and not on others, or on devices of "
                    f"different types; every rank must pass the same kind of leaf there"
                )
        elif len(set(records)) > 1:
            raise ValueError(
                f"{fn}: {path} is {describe(leaf)}, not a tensor, and differs between ranks; "
                f"only tensors are sent (never pickled): make it a tensor, or the same on every "
                f"rank"
            )
    return parsed


def _plan(
    specs: list[Record], devices: list[torch.device | None]
) -> dict[torch.device, tuple[int, list[Slot]]]:
    """Each device's buffer: its size in bytes and where each tensor leaf sits in it."""
    plan: dict[torch.device, list[Slot]] = {}
    totals: dict[torch.device, int] = {}
    for i, (spec, device) in enumerate(zip(specs, devices, strict=True)):
        if not isinstance(spec, tuple) or device is None:  # a tensor on every rank, or on none
            continue
        dtype, _, shape = spec
        numel = 1
        for n in shape:
            numel *= n
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        start = totals.get(device, 0)
        plan.setdefault(device, []).append((i, start, nbytes, dtype, shape))
        totals[device] = start + -(-nbytes // _ALIGN) * _ALIGN
    return {d: (totals[d], items) for d, items in plan.items()}


def _pack(
    leaves: list[Any], plan: dict[torch.device, tuple[int, list[Slot]]]
) -> dict[torch.device, torch.Tensor]:
    buffers = {}
    for device, (total, items) in plan.items():
        buf = torch.empty(total, dtype=torch.uint8, device=device)
        for i, start, nbytes, _, _ in items:
            if nbytes:
                src = leaves[i].detach().contiguous().reshape(-1).view(torch.uint8)
                buf[start : start + nbytes].copy_(src)
        buffers[device] = buf
    return buffers


def _unpack(
    buffers: dict[torch.device, torch.Tensor],
    plan: dict[torch.device, tuple[int, list[Slot]]],
    leaves: list[Any],
) -> list[Any]:
    out = list(leaves)  # non-tensor leaves: equal on every rank, keep this rank's
    for device, (_, items) in plan.items():
        buf = buffers[device]
        for i, start, nbytes, dtype, shape in items:
            out[i] = buf[start : start + nbytes].view(dtype).view(shape)
    return out


def broadcast_batches(batch: T, axis: Axis = "sp") -> Iterator[T]:
    """Yield every rank's ``batch`` in turn, on every rank of ``axis``.

    Step ``i`` yields rank ``i``'s batch (rank ``i`` gets back its own object; the others get
    fresh tensors of the same structure, dtypes and shapes). While step ``i`` is being worked
    on, rank ``i + 1``'s batch is already on its way (an asynchronous broadcast issued before
    step ``i`` is yielded; a double buffer). Every rank must iterate the generator to the end
    together (or stop at the same step). Sequence-parallel ranks use it to work through all of
    their data loaders' batches as a group::

        for batch in ps.broadcast_batches(local_batch, "sp"):
            loss = sharded_loss(params, batch)       # e.g. a shard_map_seq function

    Batches are any pshard pytree (nested dicts, lists, dataclasses, Mappings) with the same
    structure on every rank; tensor shapes and dtypes may differ between ranks (they are
    exchanged as a small int64 tensor first; nothing is pickled). Non-tensor leaves must be
    the same on every rank. Each step moves one packed byte buffer per device type; the
    backend must support the tensors' device (NCCL: CUDA tensors, gloo: CPU).

    With one rank on the axis it yields ``batch`` once, without communicating.

    Args:
        batch: this rank's batch.
        axis: the sequence-parallel mesh axis (a name, tuple of names or ``ProcessGroup``).

    Yields:
        Each rank's batch, in rank order.

    Raises:
        ValueError: the ranks' batches differ in structure or in a non-tensor leaf.

    Example:
        >>> import torch, pshard as ps
        >>> mesh = ps.init_mesh({"sp": 1})
        >>> [b["ids"].tolist() for b in ps.broadcast_batches({"ids": torch.arange(3)}, "sp")]
        [[0, 1, 2]]
    """
    fn = "broadcast_batches"
    info = resolve_axis(axis, fn=fn)
    leaves, treedef = tree_flatten(batch)
    mine = _describe_leaves(leaves, treedef, fn)  # checks dtypes, also with one rank
    if info.group is None:
        yield batch
        return
    group = info.group
    backend = str(dist.get_backend(group)).lower()
    meta_device = (
        torch.device("cuda", torch.cuda.current_device())
        if "nccl" in backend
        else torch.device("cpu")
    )
    parsed = _check(_exchange(mine, group, meta_device), leaves, treedef, group, fn)
    devices = [leaf.device if isinstance(leaf, torch.Tensor) else None for leaf in leaves]

    def start(src: int) -> tuple[dict, Any, list]:
        plan = _plan(parsed[src], devices)
        if src == info.rank:
            buffers = _pack(leaves, plan)
        else:
            buffers = {
                d: torch.empty(total, dtype=torch.uint8, device=d) for d, (total, _) in plan.items()
            }
        peer = dist.get_global_rank(group, src)
        works = [
            dist.broadcast(buf, src=peer, group=group, async_op=True)
            for buf in buffers.values()
            if buf.numel()
        ]
        return buffers, plan, works

    pending = start(0)
    try:
        for step in range(info.size):
            buffers, plan, works = pending
            for work in works:
                work.wait()
            pending = start(step + 1) if step + 1 < info.size else ({}, None, [])
            if step == info.rank:
                yield batch
            else:
                yield tree_unflatten(treedef, _unpack(buffers, plan, leaves))
    finally:
        for work in pending[2]:
            work.wait()
