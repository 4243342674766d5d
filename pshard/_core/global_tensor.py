"""``GlobalTensor``: this rank's block of a value plus the layout of the whole.

A pytree node, not a tensor subclass: its one child is ``local`` (a plain tensor, this rank's
block) and everything else is static metadata (:class:`GlobalMeta`: the spec, the mesh and the
global shape). Registered with ``torch.utils._pytree`` and optree (its global namespace and
``"pshard"``), so ``torch.func`` transforms, ``functional_call`` and ``optree.tree_map`` see the
blocks and rebuild ``GlobalTensor`` s of the same layout around what they compute. pshard's own
tree walks treat a ``GlobalTensor`` as a leaf (:func:`pshard._core.tree.tree_flatten`).

The metadata compares by value: the mesh is identified by :class:`MeshKey` (axis names, sizes,
the ranks in mesh order and the device type), not by the ``DeviceMesh`` object, whose equality
also compares the thread that built it; so the trees of parameters, gradients and optimizer
moments of one model have equal structures (``optree.tree_map(f, params, grads, m, v)``). The
block's dtype and device are read from ``local``: a float32 moment and its bfloat16 parameter
have the same layout.

Layout: ``spec`` is a :class:`~pshard.P` with one entry per tensor dim naming the mesh axes that
split it, applied in order (the first axis major), each split following ``torch.chunk``
(DTensor's rule, uneven and empty blocks included). :func:`spec_placements` gives DTensor's
placement list for it (``StridedShard`` where a dim is split by mesh axes out of mesh order, as
FSDP2 + TP lays out), :func:`placements_spec` the way back.

This module is pure: no process group. Operations that communicate live in
:mod:`pshard._shard_map.global_ops`.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import math
from collections.abc import Sequence
from typing import Any

import optree
import torch

from .._compat import get_attr_key, innermost, is_wrapped, register_torch_pytree
from .caches import WeakCache
from .layout import explicit_order
from .layout_rules import index_runs
from .placements import (
    P,
    Placement,
    Replicate,
    Shard,
    StridedShard,
    entry_of,
    entry_splits,
)

__all__ = [
    "GlobalMeta",
    "GlobalTensor",
    "MeshKey",
    "applied_shards",
    "block_runs",
    "block_shape",
    "check_unmodified",
    "dtensor_placements",
    "full_spec",
    "is_global",
    "mesh_key",
    "placements_spec",
    "spec_placements",
]


@dataclasses.dataclass(frozen=True)
class MeshKey:
    """A device mesh by value: axis names, sizes, the global ranks in mesh order (row-major)
    and the device type."""

    names: tuple[str, ...]
    sizes: tuple[int, ...]
    ranks: tuple[int, ...]
    device_type: str

    def size(self, name: str) -> int:
        return self.sizes[self.names.index(name)]

    def text(self) -> str:
        body = ", ".join(f"{n!r}: {s}" for n, s in zip(self.names, self.sizes, strict=True))
        return "{" + body + "}"


_MESH_KEYS: WeakCache[Any, MeshKey] = WeakCache("mesh keys of global tensors")


def mesh_key(mesh: Any) -> MeshKey:
    """The :class:`MeshKey` of a ``DeviceMesh`` with named axes (cached per mesh object)."""
    key = _MESH_KEYS.get(mesh)
    if key is None:
        names = tuple(mesh.mesh_dim_names or ())
        key = MeshKey(
            names=names,
            sizes=tuple(int(s) for s in mesh.mesh.shape),
            ranks=tuple(int(r) for r in mesh.mesh.flatten().tolist()),
            device_type=str(mesh.device_type),
        )
        _MESH_KEYS.put(mesh, key)
    return key


@dataclasses.dataclass(frozen=True)
class GlobalMeta:
    """The static part of a :class:`GlobalTensor`: its spec (one entry per tensor dim), its
    mesh (compared by :class:`MeshKey`) and its global shape."""

    spec: P
    key: MeshKey
    shape: tuple[int, ...]
    mesh: Any = dataclasses.field(compare=False, hash=False, repr=False)


class GlobalTensor:
    """This rank's block of a global value and the layout of the whole (JAX's ``jax.Array``
    for ``torch.func``).

    Build one with :func:`pshard.shard` (from a whole value), :func:`pshard.from_local` (from
    blocks), :func:`pshard.from_callback` or :func:`pshard.from_dtensor`; ``shard_map`` with
    ``gather_outputs=False`` returns them. It is a pytree node with one child, :attr:`local`:
    ``torch.func.grad`` of a function of ``GlobalTensor`` s returns ``GlobalTensor`` s of the same
    layout, and ``optree.tree_map(lambda p, g: p - lr * g, params, grads)`` updates the blocks.

    Attributes:
        local: this rank's block (a plain tensor; its shape is
            ``ps.local_shape_and_offset(shape, mesh_shape, coordinate, placements)[0]``).
        spec: the :class:`~pshard.P` over the mesh's axes, one entry per tensor dim.
        mesh: the ``DeviceMesh`` whose axes ``spec`` names.
        shape: the global shape (``torch.Size``).
        dtype, device: the block's.
        placements: DTensor's placement list (one pshard placement per mesh dim).

    Example:
        >>> import torch, pshard as ps
        >>> mesh = ps.init_mesh({"dp": 1})
        >>> x = ps.shard(torch.arange(6.0).reshape(3, 2), ps.P("dp"))
        >>> x
        GlobalTensor(shape=(3, 2), spec=P('dp', None), mesh={'dp': 1}, local shape=(3, 2))
        >>> x.local.sum().item(), x.placements
        (15.0, (Shard(0),))
    """

    __slots__ = ("local", "meta", "version", "__weakref__")

    local: Any
    meta: GlobalMeta
    version: int | None

    def __init__(self, local: Any, meta: GlobalMeta) -> None:
        object.__setattr__(self, "local", local)
        object.__setattr__(self, "meta", meta)
        # the block's version counter when this node was made (``torch.func`` makes new nodes
        # around the tensors it wraps): a change under a transform means an in-place write
        tracked = isinstance(local, torch.Tensor) and not torch.compiler.is_compiling()
        object.__setattr__(self, "version", innermost(local)._version if tracked else None)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(
            f"GlobalTensor is immutable: cannot set .{name} (under torch.func, rebinding the "
            f"block would change what is differentiated); build a new one, "
            f"ps.GlobalTensor(new_block, x.meta) or optree.tree_map(f, x), or update the "
            f"block in place outside transforms (x.local.copy_(...), as torch.optim does)"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (GlobalTensor, (self.local, self.meta))

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        # torch calls this for any torch function given a GlobalTensor (instead of failing
        # with "argument 'input' must be Tensor"): say what to call instead
        name = getattr(func, "__name__", None) or str(func)
        raise TypeError(
            f"{name}: a GlobalTensor is a pytree node (this rank's block and the layout of the "
            f"whole), not a tensor: inside a map (ps.shard_map) use its block, x.local; for "
            f"the whole value, ps.gather(x)"
        )

    def __copy__(self) -> GlobalTensor:
        return GlobalTensor(self.local, self.meta)

    def __deepcopy__(self, memo: dict[int, Any]) -> GlobalTensor:
        return GlobalTensor(copy.deepcopy(self.local, memo), self.meta)  # the layout is shared

    @property
    def spec(self) -> P:
        return self.meta.spec

    @property
    def mesh(self) -> Any:
        return self.meta.mesh

    @property
    def shape(self) -> torch.Size:
        return torch.Size(self.meta.shape)

    @property
    def ndim(self) -> int:
        return len(self.meta.shape)

    def dim(self) -> int:
        return len(self.meta.shape)

    def numel(self) -> int:
        """Elements of the global value."""
        return math.prod(self.meta.shape)

    @property
    def dtype(self) -> torch.dtype:
        dtype: torch.dtype = self.local.dtype
        return dtype

    @property
    def device(self) -> torch.device:
        device: torch.device = self.local.device
        return device

    @property
    def placements(self) -> tuple[Placement, ...]:
        return spec_placements(self.meta.spec, self.meta.key)

    def __repr__(self) -> str:
        local = self.local
        held = (
            f"local shape={tuple(local.shape)}"
            if isinstance(local, torch.Tensor)
            else f"local={local!r}"
        )
        return (
            f"GlobalTensor(shape={self.meta.shape}, spec={self.meta.spec!r}, "
            f"mesh={self.meta.key.text()}, {held})"
        )


def is_global(x: Any) -> bool:
    """Whether ``x`` is a :class:`GlobalTensor` (a leaf of pshard's own tree walks)."""
    return type(x) is GlobalTensor


# --------------------------------------------------------------------------- pytree registration


def _flatten(x: GlobalTensor) -> tuple[list[Any], GlobalMeta]:
    return [x.local], x.meta


def _unflatten(children: Sequence[Any], meta: GlobalMeta) -> GlobalTensor:
    (local,) = children
    return GlobalTensor(local, meta)


def _flatten_with_keys(x: GlobalTensor) -> tuple[list[tuple[Any, Any]], GlobalMeta]:
    return [(get_attr_key("local"), x.local)], x.meta


def _optree_flatten(x: GlobalTensor) -> tuple[tuple[Any], GlobalMeta, tuple[str]]:
    return (x.local,), x.meta, ("local",)


def _optree_unflatten(meta: GlobalMeta, children: Sequence[Any]) -> GlobalTensor:
    (local,) = children
    return GlobalTensor(local, meta)


register_torch_pytree(
    GlobalTensor,
    _flatten,
    _unflatten,
    _flatten_with_keys,
    serialized_type_name="pshard.GlobalTensor",
)
for _namespace in (getattr(optree.registry, "__GLOBAL_NAMESPACE"), "pshard"):  # noqa: B009
    optree.register_pytree_node(
        GlobalTensor,  # type: ignore[arg-type]
        _optree_flatten,  # type: ignore[arg-type]
        _optree_unflatten,  # type: ignore[arg-type]
        path_entry_type=optree.GetAttrEntry,
        namespace=_namespace,
    )


# --------------------------------------------------------------------------- layout math (pure)


def full_spec(spec: P, ndim: int) -> P:
    """``spec`` with one entry per tensor dim (trailing ``None`` s added).

    Raises:
        ValueError: ``spec`` has more entries than the tensor has dims.
    """
    if len(spec) > ndim:
        raise ValueError(f"{spec!r} has {len(spec)} entries but the tensor has {ndim} dims")
    if len(spec) == ndim:
        return spec
    return P(*spec, *([None] * (ndim - len(spec))))


def applied_shards(spec: P) -> list[tuple[str, Shard | StridedShard]]:
    """``(axis, Shard(dim))`` for every axis ``spec`` names, in the order the splits apply
    (within a dim, the first axis first; dims are independent); ``StridedShard(dim, k)`` for
    an axis after a number of parts ``k``."""
    out: list[tuple[str, Shard | StridedShard]] = []
    for d, entry in enumerate(spec):
        for name, parts in entry_splits(entry):
            out.append((name, Shard(d) if parts == 1 else StridedShard(d, parts)))
    return out


def spec_placements(spec: P, key: MeshKey) -> tuple[Placement, ...]:
    """DTensor's placement list (one per mesh dim, in mesh order) for ``spec`` on ``key``'s
    mesh: ``Shard(d)`` where the mesh dims splitting ``d`` apply in mesh order,
    ``StridedShard(d, k)`` where ``k`` pieces were cut by later mesh dims first (FSDP2 + TP).

    Raises:
        ValueError: ``spec`` names an axis the mesh lacks, or splits a dim by three or more axes
            in an order DTensor's strided shards cannot write.

    Example:
        >>> from pshard._core.global_tensor import MeshKey, spec_placements
        >>> from pshard import P
        >>> key = MeshKey(("dp", "tp"), (2, 4), tuple(range(8)), "cpu")
        >>> spec_placements(P(("tp", "dp")), key)
        (StridedShard(0, split_factor=4), Shard(0))
    """
    position = {name: i for i, name in enumerate(key.names)}
    out: list[Placement] = [Replicate()] * len(key.names)
    if any(parts > 1 for e in spec for _, parts in entry_splits(e)):
        return _strided_placements(spec, key)
    for d, entry in enumerate(spec):
        axes = tuple(name for name, _ in entry_splits(entry))
        for name in axes:
            if name not in position:
                raise ValueError(
                    f"{spec!r} names mesh axis {name!r}, which is not in the mesh "
                    f"(axes {key.text()})"
                )
        # axes of size 1 split nothing: the order is that of the others; they are Shard(d) as
        # well, unless the dim is strided, whose split factors count only the others
        splitting = [a for a in axes if key.size(a) > 1]
        strided = False
        for j, name in enumerate(splitting):
            before = [a for a in splitting[:j] if position[a] > position[name]]
            factor = math.prod(key.size(a) for a in before)
            out[position[name]] = Shard(d) if factor == 1 else StridedShard(d, factor)
            strided = strided or factor > 1
        for name in axes:
            if key.size(name) == 1:
                out[position[name]] = Replicate() if strided else Shard(d)
    placements = tuple(out)
    try:
        written = placements_spec(placements, key, len(spec), check=False)
    except ValueError:
        written = None
    # where a size-1 axis stands in an entry changes no block (DTensor writes mesh order)
    if written is None or _splitting(written, key) != _splitting(spec, key):
        raise ValueError(
            f"{spec!r} splits a dim by mesh axes in an order that DTensor's placements cannot "
            f"write (mesh {key.text()}); list the axes of each dim in mesh order, or with the "
            f"later mesh axes first"
        )
    return placements


def _splitting(spec: P, key: MeshKey) -> tuple[tuple[str, ...], ...]:
    """``spec``'s entries without the mesh axes of size 1 (which split nothing)."""
    sizes = dict(zip(key.names, key.sizes, strict=True))
    return tuple(tuple(a for a, _ in entry_splits(e) if sizes.get(a, 2) > 1) for e in spec)


def _strided_placements(spec: P, key: MeshKey) -> tuple[Placement, ...]:
    """DTensor's placements for a spec with numbers of parts (strided splits): each axis
    ``StridedShard(d, k)`` after ``k`` parts, checked to cut every block as the spec does."""
    sizes = dict(zip(key.names, key.sizes, strict=True))
    out: list[Placement] = [Replicate()] * len(key.names)
    shape = []
    for d, entry in enumerate(spec):
        splits = entry_splits(entry)
        for name, parts in splits:
            if name not in sizes:
                raise ValueError(
                    f"{spec!r} names mesh axis {name!r}, which is not in the mesh "
                    f"(axes {key.text()})"
                )
            if sizes[name] > 1:
                out[key.names.index(name)] = Shard(d) if parts == 1 else StridedShard(d, parts)
        shape.append(2 * math.prod(sizes[n] * k for n, k in splits))
    placements = tuple(out)
    pairs = applied_shards(spec)
    for coord in itertools.product(*map(range, key.sizes)):
        at = dict(zip(key.names, coord, strict=True))
        mine = index_runs(
            tuple(shape),
            tuple(sizes[n] for n, _ in pairs),
            tuple(at[n] for n, _ in pairs),
            tuple(p for _, p in pairs),
        )
        if mine != index_runs(tuple(shape), key.sizes, coord, placements):
            raise ValueError(
                f"{spec!r} splits a dim in parts and by several mesh axes in an order that "
                f"DTensor's placements cannot write (mesh {key.text()}); list the axes of a "
                f"strided dim in mesh order"
            )
    return placements


def placements_spec(
    placements: Sequence[Placement], key: MeshKey, ndim: int, *, check: bool = True
) -> P:
    """The spec of DTensor's ``placements`` on ``key``'s mesh (the inverse of
    :func:`spec_placements`), one entry per tensor dim.

    Raises:
        ValueError: a ``Partial`` placement (a pending reduction is not a layout), a dim out of
            range, or strided shards that do not describe a layout.
    """
    for i, p in enumerate(placements):
        if not isinstance(p, (Shard, StridedShard, Replicate)):
            raise ValueError(
                f"placements[{i}] = {p!r} (mesh axis {key.names[i]!r}) is not a layout: a "
                f"GlobalTensor holds blocks of one value; reduce the pending value first "
                f"(DTensor.redistribute to Replicate() or Shard(d))"
            )
    normal = [
        dataclasses.replace(p, dim=p.dim % ndim) if isinstance(p, (Shard, StridedShard)) else p
        for p in placements
    ]
    if check:
        for i, p in enumerate(placements):
            if isinstance(p, (Shard, StridedShard)) and not -ndim <= p.dim < ndim:
                raise ValueError(f"placements[{i}] = {p!r} but the tensor has {ndim} dims")
    # a strided shard that is the last split of its dim cuts it in parts (P's (k, axis)); the
    # others are FSDP2's, completed by a later Shard of the dim (explicit_order)
    parts = {
        m: p.split_factor
        for m, p in enumerate(normal)
        if isinstance(p, StridedShard)
        and not any(isinstance(q, Shard | StridedShard) and q.dim == p.dim for q in normal[m + 1 :])
    }
    plain = [Shard(p.dim) if m in parts and isinstance(p, StridedShard) else p
             for m, p in enumerate(normal)]  # fmt: skip
    splits: list[list[tuple[str, int]]] = [[] for _ in range(ndim)]
    for mesh_dim, p in explicit_order(key.sizes, plain):
        if isinstance(p, Shard):
            splits[p.dim].append((key.names[mesh_dim], parts.get(mesh_dim, 1)))
    return P(*(entry_of(e) for e in splits))


def block_runs(meta: GlobalMeta, coordinate: dict[str, int]) -> tuple[tuple[range, ...], ...]:
    """The global indices of the block at ``coordinate`` (axis name -> index), per dim."""
    pairs = applied_shards(meta.spec)
    return index_runs(
        meta.shape,
        tuple(meta.key.size(a) for a, _ in pairs),
        tuple(coordinate[a] for a, _ in pairs),
        tuple(s for _, s in pairs),
    )


def block_shape(meta: GlobalMeta, coordinate: dict[str, int]) -> tuple[int, ...]:
    """The shape of the block at ``coordinate`` (axis name -> index)."""
    return tuple(sum(map(len, runs)) for runs in block_runs(meta, coordinate))


def dtensor_placements(meta: GlobalMeta) -> tuple[Placement, ...]:
    """DTensor's placements for ``meta``, checked to give every rank the same block as the
    spec does. They differ only where a dim is split by mesh axes out of mesh order and its
    size does not divide: DTensor's ``StridedShard`` cuts such a dim left to right by mesh dim,
    the spec in its own order.

    Raises:
        ValueError: the layouts differ for this shape.
    """
    placements = spec_placements(meta.spec, meta.key)
    if not any(isinstance(p, StridedShard) for p in placements):
        return placements
    names, sizes = meta.key.names, meta.key.sizes
    for coord in itertools.product(*map(range, sizes)):
        mine = block_runs(meta, dict(zip(names, coord, strict=True)))
        if mine != index_runs(meta.shape, sizes, coord, placements):
            raise ValueError(
                f"{meta.spec!r} on mesh {meta.key.text()} gives a tensor of shape {meta.shape} "
                f"other blocks than DTensor's placements {placements} do (the split sizes do "
                f"not divide, and DTensor cuts strided shards in another order); pad the dim to "
                f"a multiple of {math.prod(sizes)}, or list its axes in mesh order"
            )
    return placements


def check_unmodified(x: GlobalTensor, fn: str, where: str) -> None:
    """Raise ``ValueError`` if the block of ``x``, a value a ``torch.func`` transform is
    differentiating, batching or pushing forward, was written in place since the transform
    made it (its layout and cotangent would belong to another value)."""
    local = x.local
    if (
        isinstance(local, torch.Tensor)
        and x.version is not None
        and not torch.compiler.is_compiling()
        and is_wrapped(local)
        and innermost(local)._version != x.version
    ):
        raise ValueError(
            f"{fn} {where}: the block of this GlobalTensor was modified in place under a "
            f"torch.func transform; compute a new block out of place (x.local * 2, not "
            f"x.local.mul_(2)) and build a new GlobalTensor around it"
        )
