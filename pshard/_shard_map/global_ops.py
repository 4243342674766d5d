"""Making, gathering and resharding :class:`~pshard.GlobalTensor` s outside a map.

``shard`` (whole -> blocks), ``from_local`` (blocks -> ``GlobalTensor``, no copy),
``from_callback`` (each rank builds its block), ``gather`` (blocks -> whole), ``reshard`` (one
layout or mesh to another) and the zero-copy DTensor conversions.

Gradient convention (§11 of the API, JAX's for global arrays): outside a map a value's cotangent
is the gradient of the result with respect to its elements, held the way the value is held: a
whole tensor's on every rank, a ``GlobalTensor`` 's block by block (replicas of a block hold the
same cotangent; nothing is summed over them). So the transpose of ``gather`` is this rank's
slice of the whole cotangent, of ``shard`` the gather of the blocks' cotangents, and of
``reshard`` the inverse reshard: the boundary Functions with an empty ``rep``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from .._collectives.cast_gather import BlockPlan, block_levels
from .._core.global_tensor import (
    GlobalMeta,
    GlobalTensor,
    MeshKey,
    applied_shards,
    block_runs,
    check_unmodified,
    dtensor_placements,
    full_spec,
    is_global,
    mesh_key,
    placements_spec,
)
from .._core.placements import (
    P,
    Placement,
    Replicate,
    Shard,
    from_torch_placement,
    to_torch_placement,
)
from .._core.specs import broadcast_prefix_flat
from .._core.tree import describe, keystr, tree_flatten_with_path, tree_map, tree_unflatten
from .._runtime.mesh import mesh_for
from .._runtime.wire import Comm
from .boundary import BlockLayout, FromBlocks, ToBlock, check_replicated, exchange_shapes
from .mesh_view import MeshView, block_layout
from .replicas import check_global_shapes, check_whole_values

__all__ = [
    "block_plan",
    "from_callback",
    "from_dtensor",
    "from_local",
    "gather",
    "global_layout",
    "global_spec",
    "reshard",
    "shard",
    "spec_over_key",
    "to_dtensor",
]


def global_spec(spec: Any, ndim: int, mesh: DeviceMesh, fn: str, where: str) -> P:
    """A spec leaf for a global value of ``ndim`` dims as a full :class:`~pshard.P` over
    ``mesh``'s axes: ``P`` as is, ``None`` / ``Replicate()`` as ``P()``, ``Shard(d)`` as dim
    ``d`` split over every mesh axis in mesh order.

    Raises:
        TypeError: another placement (``Partial``: no pending reduction outside a map;
            ``StridedShard``: use :func:`from_dtensor`).
        ValueError: more entries than dims, or an axis the mesh lacks.
    """
    return spec_over_key(spec, ndim, mesh_key(mesh), fn, where)


def spec_over_key(spec: Any, ndim: int, key: MeshKey, fn: str, where: str) -> P:
    """:func:`global_spec` over the mesh ``key`` describes (a mesh by value: its axis names
    alone matter)."""
    if spec is None or isinstance(spec, Replicate):
        spec = P()
    elif isinstance(spec, Shard):
        if not -ndim <= spec.dim < ndim:
            raise ValueError(f"{fn} {where}: {spec!r} but the value has {ndim} dims")
        entries: list[Any] = [None] * ndim
        entries[spec.dim % ndim] = key.names
        spec = P(*entries)
    elif not isinstance(spec, P):
        raise TypeError(
            f"{fn} {where}: expected a P over the mesh axes {key.names} (or None, Replicate(), "
            f"Shard(d)) as the spec of a global value, got {describe(spec)}"
        )
    for name in spec.axes:
        if name not in key.names:
            raise ValueError(
                f"{fn} {where}: {spec!r} names mesh axis {name!r}, which is not in the mesh "
                f"(axes {key.text()})"
            )
    try:
        return full_spec(spec, ndim)
    except ValueError as e:
        raise ValueError(f"{fn} {where}: {e}; give at most one entry per dim") from None


def global_layout(meta: GlobalMeta, view: MeshView, where: str) -> BlockLayout:
    """The boundary layout of a global value over every axis of its mesh, with no
    replication (cotangents of replicas are not summed)."""
    lay = block_layout(meta.spec, len(meta.shape), where, view, replicated=False)
    if not view.debug or view.all is None:
        return lay
    back_check = (
        view.all,
        f"{view.fn} {where}: debug mode: the cotangent of the whole value differs between the "
        f"ranks; outside a map every rank must compute the same result from the same whole "
        f"values (a block's gradient is this rank's block of that cotangent, never summed over "
        f"ranks). With data that differs per rank, map over the data axis: "
        f"ps.shard_map(..., in_specs=(..., P('dp')))",
    )
    return dataclasses.replace(lay, back_check=back_check)


def _view(mesh: DeviceMesh, fn: str) -> MeshView:
    return MeshView(mesh, None, fn)


def _mesh(mesh: DeviceMesh | None, fn: str) -> DeviceMesh:
    if mesh is None:
        return mesh_for(fn)
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"{fn}: mesh must be a DeviceMesh, got {describe(mesh)}")
    if not mesh.mesh_dim_names:
        raise ValueError(
            f"{fn}: the mesh has no axis names; specs name mesh axes, so build the mesh with "
            f"names (ps.init_mesh({{'dp': n}}) or init_device_mesh(..., mesh_dim_names=...))"
        )
    return mesh


def _owned(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a tensor holding only its own elements (a copy when it is a view of more)."""
    return x.clone(memory_format=torch.contiguous_format)


def _shard_one(x: torch.Tensor, meta: GlobalMeta, view: MeshView, where: str) -> GlobalTensor:
    lay = global_layout(meta, view, where)
    guard = None
    if view.debug and view.all is not None:
        guard = (
            view.all,
            f"shard {where}: the whole value must be the same on every rank (each rank takes "
            f"its block of it), but it differs; pass the same value on every rank, or build "
            f"the blocks with ps.from_local",
        )
    block = ToBlock.apply(x, lay, 1.0, guard)
    if not lay.shards:  # the block is the whole value: a copy the GlobalTensor owns
        block = _owned(block)
    return GlobalTensor(block, meta)


def shard(tree: Any, specs: Any, *, mesh: DeviceMesh | None = None) -> Any:
    """Whole values -> :class:`~pshard.GlobalTensor` s holding this rank's blocks.

    Every rank passes the same whole values (always checked: a digest of each, compared in
    one all-gather; every rank calls); each keeps only its block, an owned copy (the whole
    value can be freed). Differentiable: the transpose gathers
    the blocks' cotangents (the gradient of a whole value from its blocks').

    Args:
        tree: a pytree of tensors (other leaves pass through under a ``None`` spec).
        specs: a prefix tree of ``tree``: a :class:`~pshard.P` over the mesh's axes per leaf
            (``None`` or ``Replicate()``: a ``GlobalTensor`` replicated on every rank;
            ``Shard(d)``: dim ``d`` split over every axis, in mesh order).
        mesh: the mesh; default :func:`pshard.current_mesh`.

    Example:
        >>> import torch, pshard as ps
        >>> mesh = ps.init_mesh({"dp": 1})
        >>> w = ps.shard({"w": torch.ones(4, 2)}, ps.P("dp"))["w"]
        >>> w.shape, w.spec, w.local.shape
        (torch.Size([4, 2]), P('dp', None), torch.Size([4, 2]))
    """
    fn = "shard"
    m = _mesh(mesh, fn)
    view = _view(m, fn)
    paths, leaves, treedef = tree_flatten_with_path(tree)
    flat = broadcast_prefix_flat(specs, treedef, leaves, name="specs", fn_name=fn)
    check_whole_values(paths, leaves, view)
    out = []
    for path, x, s in zip(paths, leaves, flat, strict=True):
        where = keystr(path, "tree")
        if is_global(x):
            raise TypeError(
                f"{fn} {where}: already a GlobalTensor ({describe(x)}); use ps.reshard to "
                f"change its layout"
            )
        if not isinstance(x, torch.Tensor):
            if s is not None and not isinstance(s, Replicate) and s != P():
                raise ValueError(
                    f"{fn} {where}: {s!r} but the value is {describe(x)}, not a tensor; only "
                    f"tensors can be sharded: give it None"
                )
            out.append(x)
            continue
        spec = global_spec(s, x.ndim, m, fn, where)
        meta = GlobalMeta(spec, mesh_key(m), tuple(x.shape), m)
        out.append(_shard_one(x, meta, view, where))
    return tree_unflatten(treedef, out)


class _Shape:
    """A global shape as one leaf of a prefix tree (a tuple would be a node)."""

    def __init__(self, dims: tuple[int, ...]) -> None:
        self.dims = dims


def _is_shape(s: Any) -> bool:
    return isinstance(s, (tuple, list, torch.Size)) and all(
        isinstance(i, int) and not isinstance(i, bool) for i in s
    )


def _shapes_flat(global_shapes: Any, treedef: Any, leaves: list[Any], fn: str) -> list[Any]:
    if global_shapes is None:
        return [None] * len(leaves)
    wrapped = tree_map(
        lambda s: _Shape(tuple(s)) if _is_shape(s) else s,
        global_shapes,
        is_leaf=_is_shape,
        none_is_leaf=True,
    )
    flat = broadcast_prefix_flat(wrapped, treedef, leaves, name="global_shapes", fn_name=fn)
    return [s.dims if isinstance(s, _Shape) else s for s in flat]


def from_local(
    tree: Any,
    specs: Any,
    *,
    mesh: DeviceMesh | None = None,
    global_shapes: Any = None,
) -> Any:
    """This rank's blocks -> :class:`~pshard.GlobalTensor` s, with no copy.

    Args:
        tree: a pytree of blocks (other leaves pass through under a ``None`` spec).
        specs: a prefix tree of ``tree``, as for :func:`shard`.
        mesh: the mesh; default :func:`pshard.current_mesh`.
        global_shapes: a prefix tree of ``tree`` of global shapes (tuples or lists of ints), or
            ``None`` to learn them by exchanging the blocks' shapes over the axes that split
            them (one small all-gather per leaf; every rank must call).

    Raises:
        ValueError: a block whose shape is not this rank's block of the global shape under its
            spec (the message names the key path, the shapes and this rank's coordinates), or
            ranks that disagree on a global shape or spec (always checked, in one all-gather;
            every rank calls).

    Example:
        >>> import torch, pshard as ps
        >>> mesh = ps.init_mesh({"dp": 1})
        >>> ps.from_local(torch.ones(3), ps.P("dp"), global_shapes=(3,)).shape
        torch.Size([3])
    """
    fn = "from_local"
    m = _mesh(mesh, fn)
    view = _view(m, fn)
    key = mesh_key(m)
    paths, leaves, treedef = tree_flatten_with_path(tree)
    flat = broadcast_prefix_flat(specs, treedef, leaves, name="specs", fn_name=fn)
    shapes = _shapes_flat(global_shapes, treedef, leaves, fn)
    out: list[Any] = []
    metas: list[tuple[str, GlobalMeta]] = []
    for path, x, s, whole in zip(paths, leaves, flat, shapes, strict=True):
        where = keystr(path, "tree")
        if not isinstance(x, torch.Tensor) or is_global(x):
            if is_global(x):
                raise TypeError(f"{fn} {where}: already a GlobalTensor ({describe(x)})")
            out.append(x)
            continue
        spec = global_spec(s, x.ndim, m, fn, where)
        probe = GlobalMeta(spec, key, tuple(x.shape), m)
        if whole is None:
            lay = global_layout(probe, view, where)
            whole = tuple(x.shape) if lay.gather is None else exchange_shapes(x, lay)
        whole = tuple(int(n) for n in whole)
        if len(whole) != x.ndim:
            raise ValueError(
                f"{fn} {where}: global shape {whole} has {len(whole)} dims but the block has "
                f"{x.ndim} (shape {tuple(x.shape)})"
            )
        metas.append((where, GlobalMeta(spec, key, whole, m)))
        out.append(x)
    check_global_shapes(metas, view)
    given = iter(metas)
    for i, x in enumerate(out):
        if isinstance(x, torch.Tensor) and not is_global(x):
            where, meta = next(given)
            check_block(x, meta, view, fn, where)
            out[i] = GlobalTensor(x, meta)
    return tree_unflatten(treedef, out)


def check_block(x: Any, meta: GlobalMeta, view: MeshView, fn: str, where: str) -> None:
    """Raise ``ValueError`` unless ``x`` has this rank's block shape under ``meta``."""
    if x.dim() != len(meta.shape):
        raise ValueError(
            f"{fn} {where}: the block has {x.dim()} dims but the GlobalTensor {len(meta.shape)} "
            f"(shape {meta.shape}, block shape {tuple(x.shape)}); a GlobalTensor returned by "
            f"torch.func.vmap (per-example gradients) holds vmap's batch dim in its block: use "
            f"it inside the vmap, or make a GlobalTensor of the stacked value with "
            f"ps.from_local(block, P(None, *spec))"
        )
    coord = view.coordinate()
    want = tuple(sum(map(len, runs)) for runs in block_runs(meta, coord))
    if tuple(x.shape) != want:
        at = ", ".join(f"{n}={coord[n]}" for n in meta.key.names)
        raise ValueError(
            f"{fn} {where}: the block has shape {tuple(x.shape)}, but {meta.spec!r} over mesh "
            f"{meta.key.text()} gives this rank ({at}) a block of shape {want} of the global "
            f"shape {meta.shape} (torch.chunk sizes); pass that block, or the right spec or "
            f"global shape"
        )


def from_callback(
    global_shape: tuple[int, ...] | torch.Size,
    spec: Any,
    fn: Callable[[tuple[slice, ...]], Any],
    *,
    mesh: DeviceMesh | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> GlobalTensor:
    """A :class:`~pshard.GlobalTensor` whose block each rank builds: ``fn(index)`` returns the
    elements ``whole[index]`` of the global value, ``index`` a tuple of one ``slice`` per dim
    (this rank's block; empty slices where its block is empty).

    Args:
        global_shape: the shape of the global value.
        spec: its :class:`~pshard.P` over the mesh's axes (``None``: replicated).
        fn: ``index -> tensor`` (anything ``torch.as_tensor`` takes).
        mesh: the mesh; default :func:`pshard.current_mesh`.
        dtype, device: convert the block to these when given.

    Example:
        >>> import torch, pshard as ps
        >>> mesh = ps.init_mesh({"dp": 1})
        >>> whole = torch.arange(12.0).reshape(4, 3)
        >>> x = ps.from_callback((4, 3), ps.P("dp"), lambda index: whole[index])
        >>> torch.equal(x.local, whole)
        True
    """
    name = "from_callback"
    m = _mesh(mesh, name)
    view = _view(m, name)
    shape = tuple(int(n) for n in global_shape)
    full = global_spec(spec, len(shape), m, name, "spec")
    meta = GlobalMeta(full, mesh_key(m), shape, m)
    runs = block_runs(meta, view.coordinate())
    index = tuple(
        slice(r[0].start, r[-1].stop) if r else slice(n, n)
        for r, n in zip(runs, shape, strict=True)
    )
    block = torch.as_tensor(fn(index), dtype=dtype, device=device)
    check_block(block, meta, view, name, f"fn({index})")
    return GlobalTensor(block, meta)


def gather(tree: Any) -> Any:
    """:class:`~pshard.GlobalTensor` s -> whole tensors (an all-gather over the axes that split
    each); other leaves pass through. Every rank gets the whole value. Differentiable: the
    transpose takes this rank's block of the whole cotangent.

    Example:
        >>> import torch, pshard as ps
        >>> mesh = ps.init_mesh({"dp": 1})
        >>> ps.gather(ps.shard(torch.arange(3.0), ps.P("dp")))
        tensor([0., 1., 2.])
    """
    paths, leaves, treedef = tree_flatten_with_path(tree)
    views: dict[Any, MeshView] = {}
    out = []
    for path, x in zip(paths, leaves, strict=True):
        out.append(_gather_one(x, keystr(path, "tree"), views) if is_global(x) else x)
    return tree_unflatten(treedef, out)


def _gather_one(
    x: GlobalTensor, where: str, views: dict[Any, MeshView], fn: str = "gather"
) -> torch.Tensor:
    view = views.get(x.meta.key)
    if view is None:
        view = views[x.meta.key] = _view(x.meta.mesh, fn)
    _check_local(x, fn, where, view)
    lay = global_layout(x.meta, view, where)
    out: torch.Tensor = FromBlocks.apply(x.local, lay, False, 1.0, x.meta.shape, None)
    return out


def block_plan(
    x: GlobalTensor, where: str, fn: str, views: dict[Any, MeshView] | None = None
) -> BlockPlan:
    """How :func:`pshard._collectives.cast_gather.cast_gather` gathers the block of ``x`` into
    its whole value, and the transpose of :func:`gather` (this rank's block of the replicated
    cotangent, checked to be the same on every rank in debug mode): the levels of
    :func:`gather`'s one all-gather, one mesh axis at a time (the innermost split first).
    ``views``: the meshes already resolved in this call, by key."""
    views = {} if views is None else views
    view = views.get(x.meta.key)
    if view is None:
        view = views[x.meta.key] = _view(x.meta.mesh, fn)
    _check_local(x, fn, where, view)
    back = global_layout(x.meta, view, where).back_check if view.debug else None
    splits = [(view.comm((axis,)) or _single(axis), p) for axis, p in applied_shards(x.spec)]
    shape, levels = block_levels(x.meta.shape, splits)
    check = (
        None if back is None else functools.partial(check_replicated, c=back[0], message=back[1])
    )
    return BlockPlan(shape, x.meta.shape, levels, "slice", check)


def _single(axis: str) -> Comm:
    """An axis of size 1 (nothing to communicate)."""
    return Comm(None, 1, 0, axis, False)


def _check_local(x: GlobalTensor, fn: str, where: str, view: MeshView) -> None:
    """A GlobalTensor's block is a tensor of this rank's block shape, not written in place
    under a transform."""
    if not isinstance(x.local, torch.Tensor):
        raise TypeError(f"{fn} {where}: the GlobalTensor's block is {describe(x.local)}")
    check_unmodified(x, fn, where)
    check_block(x.local, x.meta, view, fn, where)


def reshard(tree: Any, specs: Any, *, mesh: DeviceMesh | None = None) -> Any:
    """:class:`~pshard.GlobalTensor` s (or whole tensors) -> ``GlobalTensor`` s with the layout
    ``specs`` on ``mesh`` (default: each value's own mesh; for whole tensors the current one).

    Exact for any pair of layouts, another mesh over the same ranks included: the blocks are
    gathered into the whole value and each rank takes its new block (the whole is held for the
    moment of the exchange). Differentiable: the transpose is the inverse reshard.

    Example:
        >>> import torch, pshard as ps
        >>> mesh = ps.init_mesh({"dp": 1, "tp": 1})
        >>> x = ps.shard(torch.ones(4, 6), ps.P("dp"))
        >>> ps.reshard(x, ps.P(None, "tp")).spec
        P(None, 'tp')
    """
    fn = "reshard"
    target = None if mesh is None else _mesh(mesh, fn)
    paths, leaves, treedef = tree_flatten_with_path(tree)
    flat = broadcast_prefix_flat(specs, treedef, leaves, name="specs", fn_name=fn)
    views: dict[Any, MeshView] = {}
    out = []
    for path, x, s in zip(paths, leaves, flat, strict=True):
        where = keystr(path, "tree")
        if not is_global(x) and not isinstance(x, torch.Tensor):
            out.append(x)
            continue
        m = target if target is not None else x.meta.mesh if is_global(x) else mesh_for(fn)
        ndim = x.ndim
        spec = global_spec(s, ndim, m, fn, where)
        meta = GlobalMeta(spec, mesh_key(m), tuple(x.shape), m)
        if is_global(x) and x.meta == meta:
            out.append(x)
            continue
        whole = _gather_one(x, where, views, fn) if is_global(x) else x
        view = views.get(meta.key)
        if view is None:
            view = views[meta.key] = _view(m, fn)
        out.append(_shard_one(whole, meta, view, where))
    return tree_unflatten(treedef, out)


def to_dtensor(x: GlobalTensor) -> Any:
    """The ``DTensor`` with ``x``'s block, mesh and layout (no copy: the DTensor's local tensor
    is ``x.local``).

    Example:
        >>> import torch, pshard as ps
        >>> mesh = ps.init_mesh({"dp": 1})
        >>> d = ps.to_dtensor(ps.shard(torch.ones(4, 2), ps.P("dp")))
        >>> d.shape, d.placements
        (torch.Size([4, 2]), (Shard(dim=0),))
    """
    from torch.distributed.tensor import DTensor

    if not is_global(x):
        raise TypeError(f"to_dtensor: expected a GlobalTensor, got {describe(x)}")
    _check_local(x, "to_dtensor", "x", _view(x.meta.mesh, "to_dtensor"))
    shape = x.meta.shape
    stride = tuple(torch.empty(shape, device="meta").stride())
    placements = tuple(to_torch_placement(p) for p in dtensor_placements(x.meta))
    return DTensor.from_local(
        x.local, x.meta.mesh, placements, run_check=False, shape=torch.Size(shape), stride=stride
    )


def from_dtensor(d: Any) -> GlobalTensor:
    """The :class:`~pshard.GlobalTensor` of a ``DTensor``: its local tensor (no copy), mesh and
    layout (``StridedShard`` placements from FSDP2 + TP included).

    Raises:
        ValueError: a ``Partial`` placement (a pending reduction is not a layout: redistribute
            first), a mesh without axis names, or a layout whose blocks are not the
            ``torch.chunk`` blocks of its spec.

    Example:
        >>> import torch, pshard as ps
        >>> from torch.distributed.tensor import Shard, distribute_tensor
        >>> mesh = ps.init_mesh({"dp": 1})
        >>> ps.from_dtensor(distribute_tensor(torch.ones(4, 2), mesh, [Shard(1)])).spec
        P(None, 'dp')
    """
    from torch.distributed.tensor import DTensor

    fn = "from_dtensor"
    if not isinstance(d, DTensor):
        raise TypeError(f"{fn}: expected a DTensor, got {describe(d)}")
    mesh = _mesh(d.device_mesh, fn)
    key = mesh_key(mesh)
    placements: list[Placement] = [from_torch_placement(p) for p in d.placements]
    spec = placements_spec(placements, key, d.ndim)
    meta = GlobalMeta(spec, key, tuple(d.shape), mesh)
    try:
        dtensor_placements(meta)
    except ValueError as e:
        raise ValueError(f"{fn}: {e}") from None
    local = d.to_local()
    view = _view(mesh, fn)
    check_block(local, meta, view, fn, "d")
    return GlobalTensor(local, meta)
