"""The global norm of a tree of sharded values, and clipping by it.

The norm of the whole values, whatever their layouts: each leaf's block contributes the sum of
its squares, and those sums are added over exactly the mesh axes that split the leaf (never over
the axes it is replicated on, where every rank holds the same block). Leaves are grouped by the
axes that split them; each group's sum is one ``psum`` over its axes, so a tree of
``P("dp")``, ``P(None, "tp")``, ``P(("dp", "tp"))`` and replicated leaves costs three scalar
all-reduces, and every rank gets the same norm.

Outside a map the layouts are those of the :class:`~pshard.GlobalTensor` s (plain tensors are
whole values); inside a map (``shard_map``) blocks are plain tensors and ``specs=`` says which
mapped axes split each one.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import torch

from .._collectives.functions import psum
from .._core.global_tensor import GlobalMeta, MeshKey, mesh_key
from .._core.placements import P, Partial, Replicate, Shard, StridedShard
from .._core.tree import describe
from .._runtime import stage_parts
from .._runtime.mesh import mesh_for, resolve_axis
from . import _kernels as kernels
from ._base import EmptyState, GradientTransformation, check_number, traced
from ._leaves import Flat, flatten, groups, prefix_flat

__all__ = ["clip_by_global_norm", "global_norm"]


def _accumulator(dtype: torch.dtype) -> torch.dtype:
    """The dtype a leaf's squares are summed in: float64 for 64-bit leaves, else float32."""
    return torch.float64 if dtype in (torch.float64, torch.complex128) else torch.float32


def _split_axes(spec: P, key: MeshKey) -> tuple[str, ...]:
    """The axes of ``key``'s mesh (mesh order, size > 1) that ``spec`` splits a value over."""
    named = set(spec.axes)
    return tuple(n for n, s in zip(key.names, key.sizes, strict=True) if n in named and s > 1)


def _leaf_axes(
    flat: Flat, i: int, meta: GlobalMeta | None, spec: Any, fn: str
) -> tuple[Any, tuple[str, ...]]:
    """(mesh, axes that split leaf ``i``, whose layout is ``meta``) with ``spec`` its entry of
    ``specs`` (or ``None``)."""
    if meta is not None:
        if spec is not None and not isinstance(spec, Replicate) and spec != P():
            raise ValueError(
                f"{fn} specs for {flat.where(i)}: {spec!r}, but the leaf is a GlobalTensor, "
                f"whose layout ({meta.spec!r} on mesh {meta.key.text()}) says which axes split "
                f"it; give it None in specs"
            )
        return meta.mesh, _split_axes(meta.spec, meta.key)
    if spec is None or isinstance(spec, Replicate):
        return None, ()
    if isinstance(spec, P):
        mesh = mesh_for(fn)
        key = mesh_key(mesh)
        for name in spec.axes:
            if name not in key.names:
                raise ValueError(
                    f"{fn} specs for {flat.where(i)}: {spec!r} names mesh axis {name!r}, which "
                    f"is not in the current mesh (axes {key.text()})"
                )
        return mesh, _split_axes(spec, key)
    if isinstance(spec, (Shard, StridedShard)):
        raise TypeError(
            f"{fn} specs for {flat.where(i)}: {spec!r} does not name the mesh axes that split "
            f"the block; give the P(...) the map's in_specs gave it (e.g. P('dp'))"
        )
    if isinstance(spec, Partial):
        raise ValueError(
            f"{fn} specs for {flat.where(i)}: {spec!r} is a pending reduction, not a layout; "
            f"reduce it first (ps.psum) and give the result's spec"
        )
    raise TypeError(
        f"{fn} specs for {flat.where(i)}: expected a P over the mesh axes, Replicate() or None, "
        f"got {describe(spec)}"
    )


def _sums_of_squares(blocks: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each block's sum of squares, 0-dim, in its accumulator dtype."""
    out: dict[int, torch.Tensor] = {}
    keys: list[Hashable] = [(b.device, b.dtype) for b in blocks]
    for idx in groups(keys):
        first = blocks[idx[0]]
        acc = _accumulator(first.dtype)
        xs = [blocks[i] for i in idx]
        norms = kernels.norm(xs, 2, dtype=None if acc == first.dtype else acc)
        for i, n in zip(idx, norms, strict=True):
            out[i] = n.to(acc) * n.to(acc)
    return [out[i] for i in range(len(blocks))]


def norm_of(flat: Flat, specs: Any, fn: str) -> torch.Tensor:
    """The global norm of the flattened tree ``flat`` (see :func:`global_norm`)."""
    if not flat.blocks:
        return torch.zeros(())
    leaf_specs = (
        [None] * len(flat.blocks) if specs is None else prefix_flat(specs, flat, "specs", fn)
    )
    metas = flat.metas
    placed = [_leaf_axes(flat, i, metas[i], s, fn) for i, s in enumerate(leaf_specs)]
    squares = _sums_of_squares(flat.blocks)
    device = flat.blocks[0].device
    dtype = torch.float64 if any(s.dtype == torch.float64 for s in squares) else torch.float32
    total = torch.zeros((), dtype=dtype, device=device)
    stages = [_other_stages(b, mesh, axes) for b, (mesh, axes) in zip(flat.blocks, placed,
                                                                        strict=True)]  # fmt: skip
    keys: list[Hashable] = [
        (None if mesh is None else mesh_key(mesh), axes, None if st is None else id(st))
        for (mesh, axes), st in zip(placed, stages, strict=True)
    ]
    for idx in groups(keys):
        part = torch.stack([squares[i].to(device=device, dtype=dtype) for i in idx]).sum()
        mesh, axes = placed[idx[0]]
        group = resolve_axis(axes, mesh=mesh, fn=fn).group if axes else None
        if group is not None:
            part = psum(part, group)
        stage = stages[idx[0]]
        if stage is not None:  # one pipeline stage's part: add the other stages' squares
            part = psum(part, stage)
        total = total + part
    return total.sqrt()


def _other_stages(block: torch.Tensor, mesh: Any, axes: tuple[str, ...]) -> Any:
    """The process group of the pipeline axis over which ``block``, a gradient that
    ``pipeline_value_and_grad`` returned as one stage's part, is summed with the other stages'
    (``None`` for other blocks, with one stage, or where ``axes`` already sum over it: blocks
    of parameters stacked along the pipeline axis inside a map over it)."""
    part = stage_parts.part_of(block)
    if part is None or part.group is None:
        return None
    if mesh is not None and part.mesh is mesh and part.axis in axes:
        return None
    return part.group


def global_norm(tree: Any, *, specs: Any = None) -> torch.Tensor:
    """The L2 norm of all the values of ``tree`` together (optax's ``global_norm``), for
    sharded values the norm of the whole values, the same on every rank.

    Each block's sum of squares is added once over the mesh axes that split it and never over
    those it is replicated on: a :class:`~pshard.GlobalTensor`'s own layout says which; a plain
    tensor is a whole value unless ``specs`` says otherwise. It equals the total norm
    ``torch.nn.utils.clip_grad_norm_`` returns for the whole values (to rounding). Squares of
    16-bit blocks are summed in float32, of float64 blocks in float64.

    Args:
        tree: a tree of tensors and GlobalTensors.
        specs: inside a map, where blocks are plain tensors: a prefix tree of ``tree`` giving
            each block's spec over the mesh axes (the map's ``in_specs`` for those values:
            ``P(...)``, ``None`` or ``Replicate()``); axes are those of the current mesh.

    Returns:
        A 0-dim tensor (float64 if any leaf is float64, else float32) on the first leaf's
        device; 0 for an empty tree.

    Raises:
        ValueError: ``specs`` is not a prefix of ``tree``, names an axis the mesh lacks, or
            gives a GlobalTensor a layout (its own is used), naming the key path.

    Example:
        >>> import torch, pshard as ps
        >>> mesh = ps.init_mesh({"dp": 1})
        >>> ps.optim.global_norm({"a": torch.tensor([3.0]), "b": ps.shard(torch.tensor([4.0]),
        ...                                                              ps.P("dp"))})
        tensor(5.)
    """
    fn = "global_norm"
    return norm_of(flatten(tree, fn, "tree"), specs, fn)


def clip_by_global_norm(max_norm: float, *, specs: Any = None) -> GradientTransformation:
    """Scale the updates so that their global norm is at most ``max_norm`` (optax's
    ``clip_by_global_norm``)::

        norm = global_norm(updates, specs=specs)
        updates = updates if norm < max_norm else updates * (max_norm / norm)

    ``torch.nn.utils.clip_grad_norm_`` divides by ``norm + 1e-6`` and scales whenever the norm
    is above; this follows optax (no epsilon). The factor multiplies each block once (one
    rounding, where optax divides by the norm and then multiplies by ``max_norm``). The norm is
    that of the whole values, however they are sharded (:func:`global_norm`); inside a map pass
    the blocks' ``specs``. On a CPU norm the comparison is made in Python and updates below the
    threshold come back as they are; elsewhere, and while traced (``ps.jit``,
    ``torch.compile``: one program for every norm), the factor is a tensor (1 below the
    threshold: the values stay bit for bit), so the step never waits for the device.

    Args:
        max_norm: the largest global norm let through.
        specs: the blocks' spec tree inside a map (see :func:`global_norm`).

    Returns:
        A ``GradientTransformation`` with an empty state.

    Raises:
        ValueError: ``max_norm`` is not positive.

    Example:
        >>> import torch, pshard as ps
        >>> clip = ps.optim.clip_by_global_norm(1.0)
        >>> clip.update({"g": torch.tensor([3.0, 4.0])}, clip.init(None))[0]
        {'g': tensor([0.6000, 0.8000])}
    """
    fn = "clip_by_global_norm"
    limit = check_number(max_norm, fn, "max_norm")
    if not limit > 0:
        raise ValueError(f"{fn}: max_norm must be positive, got {max_norm!r}")

    def init(params: Any) -> EmptyState:
        return EmptyState()

    def update(
        updates: Any, state: Any, params: Any = None, *, donate: bool = False
    ) -> tuple[Any, EmptyState]:
        flat = flatten(updates, fn, "updates")
        norm = norm_of(flat, specs, fn)
        factor: float | torch.Tensor
        if norm.device.type == "cpu" and not traced(norm):
            value = float(norm)
            if value < limit:
                return updates, EmptyState()
            factor = limit / value
        else:
            factor = torch.where(norm < limit, torch.ones_like(norm), limit / norm)
        out = list(flat.blocks)
        for idx in groups([(b.device, b.dtype) for b in flat.blocks]):
            xs = [flat.blocks[i] for i in idx]
            f = factor
            if isinstance(f, torch.Tensor):
                f = f.to(device=xs[0].device, dtype=xs[0].dtype)
            if donate:
                with torch.no_grad():
                    kernels.mul_(xs, f)
                continue
            for i, y in zip(idx, kernels.mul(xs, f), strict=True):
                out[i] = y
        return flat.rebuild(out), EmptyState()

    return GradientTransformation(init, update)
