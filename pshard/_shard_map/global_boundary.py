"""Global tensors at the boundary of a map (§5 of the API, "Global tensors in and out").

- :func:`enter_global`: a :class:`~pshard.GlobalTensor` input. Laid out over the mapped axes as
  its spec asks, it reaches ``fn`` as its block with no communication, and its cotangent stays a
  block (summed only over the mapped axes it is replicated on, as for any replicated input).
  Laid out otherwise, it is resharded (gathered over the axes that split it, then sliced as the
  spec asks; exact and differentiable). Sharded over axes the map does not map, it passes into
  ``fn`` as a ``GlobalTensor`` over those axes (maps over different axes nest); one on a mesh
  of other axes only (a pipeline stage's parameters on its ``"tp"`` ranks, in a map over
  ``"dp"``) passes in as it is, replicated over the mapped axes.
- :func:`exit_global`: a ``GlobalTensor`` returned by ``fn`` (the nested case) passes out.
- :func:`sharded_outputs`: with ``gather_outputs=False``, the outputs whose spec splits them
  leave as ``GlobalTensor`` s, their global shapes learned in one exchange for the whole call.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence
from typing import Any

import torch

from .._core.global_tensor import (
    GlobalMeta,
    GlobalTensor,
    check_unmodified,
    full_spec,
    mesh_key,
)
from .._core.layout_rules import index_runs
from .._core.placements import P, Placement, Replicate, Shard, StridedShard, entry_of, entry_splits
from .._core.tree import describe
from .._runtime.tracing import outside_trace
from .._runtime.wire import all_gather
from .boundary import BlockLayout, FromBlocks, ToBlock, shape_row, whole_shape
from .global_ops import check_block, global_layout
from .mesh_view import MeshView, axes_of, block_layout

__all__ = ["as_spec", "enter_global", "exit_global", "sharded_outputs"]


def as_spec(
    spec: Placement | P, ndim: int, where: str, view: MeshView, *, trivial: bool = False
) -> P:
    """A map's spec leaf as a full ``P`` over the mapped axes of size > 1 (of any size with
    ``trivial=True``)."""
    if isinstance(spec, P):
        axes_of(spec, where, view)  # checks the axes
        entries = list(full_spec(spec, ndim)) if len(spec) <= ndim else list(spec)
    elif isinstance(spec, Shard):
        entries = [None] * ndim
        entries[spec.dim % ndim] = view.mapped
    elif isinstance(spec, StridedShard):
        raise ValueError(
            f"{view.fn} {where}: {spec!r} for a GlobalTensor; give its layout as a P over the "
            f"mapped axes {view.mapped}"
        )
    else:
        entries = [None] * ndim
    return _keep(
        P(*entries), lambda name: name in view.mapped and (trivial or view.sizes[name] > 1)
    )


def _keep(spec: P, wanted: Any) -> P:
    """``spec`` with only the axes ``wanted(name)`` accepts."""
    return P(*(entry_of((n, k) for n, k in entry_splits(e) if wanted(n)) for e in spec))


def _split_dims(spec: P) -> set[int]:
    return {d for d, entry in enumerate(spec) if entry is not None}


def _block_only(lay: BlockLayout) -> BlockLayout:
    """``lay`` for a value that already is the block: nothing to slice or gather, the
    replicated axes kept (their cotangents are summed, or divided on the way out)."""
    return dataclasses.replace(lay, shards=(), sizes=(), coord=(), perm=(), gather=None)


def _check_mesh(x: GlobalTensor, where: str, view: MeshView) -> None:
    key = mesh_key(view.mesh)
    if x.meta.key != key:
        raise ValueError(
            f"{view.fn} {where}: a GlobalTensor on mesh {x.meta.key.text()} (ranks "
            f"{list(x.meta.key.ranks)}), but this map runs on mesh {key.text()} (ranks "
            f"{list(key.ranks)}); move it with ps.reshard(x, spec, mesh=...) first"
        )
    _check_local(x, where, view)
    check_block(x.local, x.meta, view, view.fn, where)


def _check_local(x: GlobalTensor, where: str, view: MeshView) -> None:
    """``x``'s block is a tensor, unmodified since ``x`` was made."""
    if not isinstance(x.local, torch.Tensor):
        raise TypeError(f"{view.fn} {where}: the GlobalTensor's block is {describe(x.local)}")
    check_unmodified(x, view.fn, where)


def _foreign(x: GlobalTensor, view: MeshView) -> bool:
    """Whether ``x`` is laid out on a sub-mesh of the map's mesh (this rank's slice of some of
    its axes), none of whose axes the map maps: a pipeline stage's parameters on its own
    ``"tp"`` ranks, inside a map over ``"dp"``."""
    key = x.meta.key
    if key == mesh_key(view.mesh) or set(key.names) & set(view.mapped):
        return False
    if any(view.sizes.get(n) != s for n, s in zip(key.names, key.sizes, strict=True)):
        return False
    here = view.mesh.get_coordinate()
    mine = mesh_key(view.mesh).ranks[_flat_index(here, view)] if here is not None else None
    return mine in key.ranks


def _flat_index(coord: Sequence[int], view: MeshView) -> int:
    """The row-major index of ``coord`` on the map's mesh."""
    index = 0
    for n, c in zip(view.names, coord, strict=True):
        index = index * view.sizes[n] + c
    return index


def _hand_on(
    x: GlobalTensor, spec: Placement | P, where: str, view: MeshView, check: bool
) -> GlobalTensor:
    """A ``GlobalTensor`` on a mesh of other axes than the mapped ones: it passes into ``fn``
    as it is, replicated over the mapped axes (its cotangent summed over them, as any
    replicated input's)."""
    if as_spec(spec, x.ndim, where, view).axes:
        raise ValueError(
            f"{view.fn} {where}: a GlobalTensor on mesh {x.meta.key.text()} ({x.meta.spec!r}), "
            f"none of whose axes this map maps ({view.mapped}), under the spec {spec!r}; the map "
            f"hands it on as it is (the same on every rank of the mapped axes): give it None"
        )
    _check_local(x, where, view)
    lay = block_layout(P(), x.ndim, where, view)
    guard = None
    if check and lay.rep is not None:
        guard = (
            lay.rep,
            f"{view.fn} {lay.label}: check_rep: this GlobalTensor's blocks must be the same on "
            f"the ranks of axes {view.axes_text(lay.rep.name.split(','))}, but they differ",
        )
    return GlobalTensor(ToBlock.apply(x.local, _block_only(lay), 1.0, guard), x.meta)


def enter_global(
    x: GlobalTensor, spec: Placement | P, where: str, view: MeshView, check: bool
) -> Any:
    """What ``fn`` sees of the global input ``x`` under the spec leaf ``spec``."""
    if _foreign(x, view):
        return _hand_on(x, spec, where, view, check)
    _check_mesh(x, where, view)
    ndim = x.ndim
    want = as_spec(spec, ndim, where, view)
    mapped = _keep(x.meta.spec, lambda n: n in view.mapped and view.sizes[n] > 1)
    outer = _keep(x.meta.spec, lambda n: n not in view.mapped and view.sizes[n] > 1)
    lay = block_layout(want, ndim, where, view)
    if not outer.axes:
        if mapped == want:
            guard = None
            if check and lay.rep is not None:
                guard = (
                    lay.rep,
                    f"{view.fn} {lay.label}: check_rep: this GlobalTensor's blocks must be the "
                    f"same on the ranks of axes {view.axes_text(lay.rep.name.split(','))} "
                    f"(its spec {x.meta.spec!r} replicates it there), but they differ",
                )
            return ToBlock.apply(x.local, _block_only(lay), 1.0, guard)
        held = global_layout(x.meta, view, where)
        whole = FromBlocks.apply(x.local, held, False, 1.0, x.meta.shape, None)
        return ToBlock.apply(whole, lay, 1.0, None)
    if mapped != want:
        raise ValueError(
            f"{view.fn} {where}: this GlobalTensor ({x.meta.spec!r}) is split over axes the map "
            f"does not map ({outer.axes}) and laid out over the mapped axes as {mapped!r}, but "
            f"the spec asks for {want!r}; a nested map takes it as it is laid out: give "
            f"{mapped!r} as its spec, or ps.reshard it before the map"
        )
    both = _split_dims(outer) & _split_dims(mapped)
    if both:
        raise ValueError(
            f"{view.fn} {where}: this GlobalTensor ({x.meta.spec!r}) splits dim(s) "
            f"{sorted(both)} over both mapped axes {view.mapped} and other axes {outer.axes}; "
            f"a nested map needs each dim split by one of them: ps.reshard it first"
        )
    pairs = axes_of(mapped, where, view)
    runs = index_runs(
        x.meta.shape,
        tuple(view.sizes[n] for n, _ in pairs),
        tuple(view.coord[n] for n, _ in pairs),
        tuple(s for _, s in pairs),
    )
    inner_shape = tuple(sum(map(len, r)) for r in runs)
    inner_spec = _keep(x.meta.spec, lambda n: n not in view.mapped)
    local = ToBlock.apply(x.local, _block_only(lay), 1.0, None)
    return GlobalTensor(local, GlobalMeta(inner_spec, x.meta.key, inner_shape, x.meta.mesh))


def exit_global(y: GlobalTensor, spec: Placement | P, where: str, view: MeshView) -> Any:
    """A ``GlobalTensor`` returned by ``fn``: it passes out when ``spec`` replicates it over
    the mapped axes (its cotangent then comes back divided among them), also one on a mesh of
    other axes than the mapped ones."""
    if not _foreign(y, view):
        _check_mesh(y, where, view)
    if as_spec(spec, y.ndim, where, view).axes or not isinstance(spec, (Replicate, P)):
        raise ValueError(
            f"{view.fn} {where}: fn returned a GlobalTensor ({y.meta.spec!r}) under the spec "
            f"{spec!r}; a GlobalTensor leaves a map as it is: give it None (replicated over "
            f"the mapped axes), or return its block"
        )
    lay = _block_only(block_layout(P(), y.ndim, where, view))
    if lay.rep is None:
        return y
    return GlobalTensor(FromBlocks.apply(y.local, lay, False, 1.0, None, None), y.meta)


def sharded_outputs(
    items: list[tuple[torch.Tensor, Placement | P, str, tuple[Any, str] | None]],
    view: MeshView,
) -> list[GlobalTensor]:
    """``GlobalTensor`` s of the outputs ``(block, spec, where, guard)`` whose specs split
    them, with their global shapes from one exchange of block shapes over the mapped axes."""
    lays = [block_layout(s, y.ndim, where, view) for y, s, where, _ in items]
    wholes = _exchange([y for y, *_ in items], lays, view)
    key = mesh_key(view.mesh)
    out = []
    for (y, s, where, guard), lay, whole in zip(items, lays, wholes, strict=True):
        spec = as_spec(s, y.ndim, where, view, trivial=True)
        local = FromBlocks.apply(y, _block_only(lay), False, 1.0, None, guard)
        out.append(GlobalTensor(local, GlobalMeta(spec, key, whole, view.mesh)))
    return out


def _exchange(
    ys: list[torch.Tensor], lays: list[BlockLayout], view: MeshView
) -> list[tuple[int, ...]]:
    """The whole shape of each block ``ys[i]`` under ``lays[i]``: one all-gather of every
    block's shape over all mapped axes, then each layout reads its gather group's rows."""
    if view.all is None or not ys:
        return [tuple(y.shape) for y in ys]
    with outside_trace():  # metadata: exchanged when a program is made, not in it
        rows = [shape_row(y) for y in ys]
        widths = [len(r) for r in rows]
        table = all_gather(torch.cat(rows), view.all, 0, False).tolist()  # (ranks, sum(widths))
    axes = [n for n in view.mapped if view.sizes[n] > 1]  # view.all's order, row-major
    sizes = [view.sizes[n] for n in axes]
    mine = [view.coord[n] for n in axes]
    out = []
    start = 0
    for y, lay, width in zip(ys, lays, widths, strict=True):
        cols = slice(start, start + width)
        start += width
        if lay.gather is None:
            out.append(tuple(y.shape))
            continue
        group = lay.gather.name.split(",")
        picked = []
        for sub in itertools.product(*(range(view.sizes[n]) for n in group)):
            coord = list(mine)
            for n, c in zip(group, sub, strict=True):
                coord[axes.index(n)] = c
            flat = sum(c * math.prod(sizes[i + 1 :]) for i, c in enumerate(coord))
            picked.append(tuple(table[flat][cols]))
        out.append(whole_shape(picked, lay))
    return out
