"""The mesh as one call sees it, and the block layout of one leaf under a spec.

:class:`MeshView` resolves, once per call, what a map (or a global-tensor operation) needs of
its mesh: the axes' sizes, this rank's coordinates, the mapped axes and the process groups of
axis subsets. :func:`block_layout` turns a spec leaf into the :class:`BlockLayout` the boundary
Functions take.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from torch.distributed.device_mesh import DeviceMesh

from .._core.placements import P, Placement, Shard, StridedShard, entry_splits
from .._runtime.debug import debug_enabled
from .._runtime.mesh import resolve_axis
from .._runtime.wire import Comm, comm_of
from .boundary import BlockLayout

__all__ = ["MeshView", "axes_of", "block_layout"]


class MeshView:
    """Sizes, this rank's coordinates, the mapped axes (mesh order) and the process groups of
    axis subsets of ``mesh``; ``fn`` names the caller in errors."""

    def __init__(
        self, mesh: DeviceMesh, axis_names: Iterable[str] | None, fn: str = "shard_map"
    ) -> None:
        self.mesh = mesh
        self.fn = fn
        self.names: tuple[str, ...] = tuple(mesh.mesh_dim_names or ())
        self.sizes = {n: mesh.size(i) for i, n in enumerate(self.names)}
        if axis_names is None:
            self.mapped = self.names
        else:
            wanted = tuple(axis_names)
            for name in wanted:
                if name not in self.sizes:
                    raise ValueError(
                        f"{fn}: axis_names names {name!r}, which is not an axis of the mesh "
                        f"(axes {self.names} with sizes {tuple(mesh.shape)}); use mesh axis names"
                    )
            self.mapped = tuple(n for n in self.names if n in wanted)
        self.coord = {n: mesh.get_local_rank(n) for n in self.names if self.sizes[n] > 1}
        self.debug = debug_enabled()
        self._comms: dict[tuple[str, ...], Comm | None] = {}
        self.all = self.comm(self.mapped)

    def comm(self, axes: Iterable[str]) -> Comm | None:
        """The group over ``axes`` (put in mesh order; size-1 axes dropped); None for size 1."""
        wanted = set(axes)
        key = tuple(n for n in self.names if n in wanted and self.sizes[n] > 1)
        if key not in self._comms:
            if not key:
                self._comms[key] = None
            else:
                info = resolve_axis(key, mesh=self.mesh, fn=self.fn)
                self._comms[key] = comm_of(key, info, self.debug)
        return self._comms[key]

    def coordinate(self) -> dict[str, int]:
        """This rank's index on every axis (0 on size-1 axes)."""
        return {n: self.coord.get(n, 0) for n in self.names}

    @staticmethod
    def axes_text(axes: Iterable[str]) -> str:
        return repr(tuple(axes))


def axes_of(spec: P, where: str, view: MeshView) -> list[tuple[str, Shard | StridedShard]]:
    """``(axis, Shard(dim))`` for each axis a ``P`` names (``StridedShard(dim, k)`` after a
    number of parts ``k``), in the order they split, checked against the mapped axes."""
    out: list[tuple[str, Shard | StridedShard]] = []
    for d, entry in enumerate(spec):
        for name, parts in entry_splits(entry):
            if name not in view.sizes:
                raise ValueError(
                    f"{view.fn} {where}: {spec!r} names mesh axis {name!r}, which is not in the "
                    f"mesh (axes {view.names} with sizes {tuple(view.mesh.shape)}); use one of "
                    f"the mapped axes {view.mapped}"
                )
            if name not in view.mapped:
                raise ValueError(
                    f"{view.fn} {where}: {spec!r} names mesh axis {name!r}, which this "
                    f"{view.fn} does not map (axis_names={view.mapped}); add {name!r} to "
                    f"axis_names, or leave it out of the spec (unmapped axes are left to the "
                    f"caller)"
                )
            out.append((name, Shard(d) if parts == 1 else StridedShard(d, parts)))
    return out


def block_layout(
    spec: Placement | P, ndim: int, where: str, view: MeshView, *, replicated: bool = True
) -> BlockLayout:
    """The layout of one leaf of ``ndim`` dims under ``spec`` (not ``Partial``) over the mapped
    axes. ``replicated=False`` leaves ``rep`` empty: the value outside is one value whose
    cotangent is not summed over the axes it is replicated on (global tensors outside a map)."""
    pairs: list[tuple[str, Shard | StridedShard]]
    if isinstance(spec, P):
        pairs = axes_of(spec, where, view)
    elif isinstance(spec, (Shard, StridedShard)):
        placement = dataclasses.replace(spec, dim=spec.dim % ndim)
        pairs = [(name, placement) for name in view.mapped]
    else:
        pairs = []
    pairs = [(name, p) for name, p in pairs if view.sizes[name] > 1]
    split = [n for n in view.mapped if any(n == name for name, _ in pairs)]
    return BlockLayout(
        shards=tuple(p for _, p in pairs),
        sizes=tuple(view.sizes[name] for name, _ in pairs),
        coord=tuple(view.coord[name] for name, _ in pairs),
        perm=tuple(split.index(name) for name, _ in pairs),
        gather=view.comm(split),
        rep=view.comm(n for n in view.mapped if n not in split) if replicated else None,
        label=f"{where} ({spec!r})",
        fn=view.fn,
    )
