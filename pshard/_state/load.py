"""``ps.load`` and ``ps.load_metadata``: a checkpoint read into the layout a tree asks for.

A checkpoint is DCP's files plus, when pshard wrote it, the manifest (``pshard.json``: the
tree's structure, layouts and plain values). ``load_metadata`` rebuilds the saved tree with a
:class:`~pshard._state.manifest.SavedTensor` (global shape, dtype, spec) per tensor and the
plain values themselves. ``load(path, like)`` matches ``like``'s leaves to the checkpoint by
key (key paths joined by ``"."``, DCP's names), checks every key, global shape and dtype first
(one ``ValueError`` listing all that differ), then reads each tensor into the layout its
``like`` leaf asks for, through DCP's load planner with DTensor targets: each rank plans read
items only for the saved chunks that overlap its own blocks and reads only those, each chunk
checked (:mod:`pshard._state.read`: one whole checkpoint while saves switch ``path``, the
checksums). Each rank reads on its own; the ranks that read parts of one ``GlobalTensor``
exchange which save they opened and whether they read it (two all-gathers of a few integers),
and a layout DTensor cannot express, an uneven ``StridedShard``, is read in its nearest
expressible layout and moved with ``ps.reshard``, which communicates.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.distributed as dist

from .._core.global_tensor import (
    GlobalMeta,
    GlobalTensor,
    MeshKey,
    block_shape,
    is_global,
    mesh_key,
)
from .._core.placements import P, Replicate
from .._core.specs import broadcast_prefix_flat
from .._core.tree import article, describe, keystr, tree_flatten_with_path, tree_unflatten
from .._runtime.mesh import current_mesh
from .._runtime.wire import Comm
from .._shard_map.global_ops import from_dtensor, global_spec, reshard, to_dtensor
from .._shard_map.mesh_view import MeshView
from .manifest import (
    KeyPath,
    LeafRecord,
    SavedObject,
    SavedTensor,
    build_tree,
    dtype_name,
    fqn,
    key_path,
)
from .read import Checkpoint, open_checkpoint, read_checkpoint, reopened
from .records import is_state_leaf, nearest_spec, target_path
from .rng import RngState

__all__ = ["like_from_specs", "load", "load_metadata"]


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


# --------------------------------------------------------------------------- load_metadata


def load_metadata(path: str | os.PathLike[str]) -> Any:
    """The body of :func:`pshard.load_metadata` (its contract: :mod:`pshard._state.api`)."""
    fn = "load_metadata"
    target = target_path(path, fn)
    ckpt: Checkpoint = reopened(target, fn, lambda opened: open_checkpoint(opened, target, fn))
    rank, world = _world()
    if ckpt.manifest is not None:
        entries = [r.entry(rank, world, fn) for r in ckpt.manifest.leaves]
        return build_tree(ckpt.manifest.structure, entries)
    tree: dict[Any, Any] = {}
    mapping = ckpt.dcp.planner_data if isinstance(ckpt.dcp.planner_data, dict) else {}
    for key, r in ckpt.records.items():
        where: tuple[Any, ...] = tuple(mapping.get(key, (key,)))
        node = tree
        for part in where[:-1]:
            node = node.setdefault(part, {})
        node[where[-1]] = r.entry(rank, world, fn)
    return tree


# --------------------------------------------------------------------------- load


_Prepared = tuple[Any, Callable[[], Any]]


@dataclasses.dataclass(frozen=True)
class _Want:
    """What a leaf of ``like`` asks for: its kind, and for tensors the global shape and dtype
    and ``prepare``, which allocates the DTensor or tensor DCP reads into and returns it with
    the function that builds the output from it."""

    kind: Literal["tensor", "value", "none", "rng"]
    shape: tuple[int, ...] = ()
    dtype: torch.dtype | None = None
    value_type: type | None = None
    prepare: Callable[[], _Prepared] | None = None
    meta: GlobalMeta | None = None  # a global value's layout: the ranks that read parts of it


def _device(like: torch.Tensor, meta: GlobalMeta | None) -> torch.device:
    if like.device.type != "meta":
        return like.device
    return torch.device(meta.key.device_type if meta is not None else "cpu")


def _global_want(meta: GlobalMeta, dtype: torch.dtype, device: torch.device, out: str) -> _Want:
    """Read into ``meta``'s layout (through its nearest expressible one if needed)."""

    def prepare() -> _Prepared:
        read = meta
        spec = nearest_spec(meta)
        if spec != meta.spec:
            read = dataclasses.replace(meta, spec=spec)
        coord = {n: meta.mesh.get_local_rank(n) for n in meta.key.names}
        held = GlobalTensor(torch.empty(block_shape(read, coord), dtype=dtype, device=device), read)

        def finish() -> Any:
            x = held if read is meta else reshard(held, meta.spec)
            return to_dtensor(x) if out == "dtensor" else x

        return to_dtensor(held), finish

    return _Want("tensor", meta.shape, dtype, prepare=prepare, meta=meta)


def _whole_want(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> _Want:
    def prepare() -> _Prepared:
        block = torch.empty(shape, dtype=dtype, device=device)
        return block, lambda: block

    return _Want("tensor", shape, dtype, prepare=prepare)


def _want(x: Any, here: str, fn: str) -> _Want:
    if isinstance(x, torch.Tensor) and type(x) is not torch.Tensor:
        from torch.distributed.tensor import DTensor

        if isinstance(x, DTensor):
            try:
                g = from_dtensor(x)
            except ValueError as e:
                raise ValueError(f"{fn} {here}: {e}") from None
            return _global_want(g.meta, g.dtype, _device(g.local, g.meta), "dtensor")
    if is_global(x):
        return _global_want(x.meta, x.dtype, _device(x.local, x.meta), "global")
    if isinstance(x, torch.Tensor):
        return _whole_want(tuple(x.shape), x.dtype, _device(x, None))
    if isinstance(x, SavedTensor):
        if x.spec is None:
            return _whole_want(x.shape, x.dtype, torch.device("cpu"))
        try:
            mesh = current_mesh()
        except RuntimeError:
            raise ValueError(
                f"{fn} {here}: a SavedTensor with spec {x.spec!r} asks for a GlobalTensor on "
                f"the current mesh, but there is none; ps.init_mesh(...) first, or ask for the "
                f"whole tensor: dataclasses.replace(entry, spec=None)"
            ) from None
        spec = global_spec(x.spec, len(x.shape), mesh, fn, here)
        meta = GlobalMeta(spec, mesh_key(mesh), x.shape, mesh)
        return _global_want(meta, x.dtype, torch.device(meta.key.device_type), "global")
    if isinstance(x, SavedObject):
        raise ValueError(
            f"{fn} {here}: {x.fqn!r} is a pickled Python object DCP wrote; pshard never "
            f"unpickles (it runs arbitrary code); leave it out of like and pass partial=True"
        )
    if x is None:
        return _Want("none")
    if type(x) in (int, float, str, bool):
        return _Want("value", value_type=type(x))
    if isinstance(x, RngState):
        return _Want("rng")
    raise TypeError(
        f"{fn} {here}: {describe(x)}; like holds GlobalTensors, tensors, DTensors, "
        f"SavedTensors, int, float, str, bool, None and RngStates"
    )


def _say(r: LeafRecord) -> str:
    if r.kind in ("global", "tensor"):
        assert r.dtype is not None
        return f"a {dtype_name(r.dtype)} tensor of shape {r.shape}"
    if r.kind == "value":
        return f"{type(r.value).__name__} {r.value!r}"
    return {"none": "None", "rng": "an RngState", "object": "a pickled object"}[r.kind]


def _say_want(w: _Want) -> str:
    if w.kind == "tensor":
        assert w.dtype is not None
        return f"a {dtype_name(w.dtype)} tensor of shape {w.shape}"
    if w.kind == "value":
        assert w.value_type is not None
        return article(w.value_type.__name__)
    return {"none": "None", "rng": "an RngState"}[w.kind]


def _differs(r: LeafRecord, w: _Want) -> bool:
    if w.kind == "tensor":
        return r.kind not in ("global", "tensor") or r.shape != w.shape or r.dtype != w.dtype
    if w.kind == "value":
        return r.kind != "value" or type(r.value) is not w.value_type
    return r.kind != w.kind


def _check(
    ckpt: Checkpoint,
    keys: list[tuple[str, KeyPath, str]],
    wants: list[_Want],
    partial: bool,
    target: str,
    fn: str,
) -> None:
    missing, different = [], []
    for (key, _, here), w in zip(keys, wants, strict=True):
        r = ckpt.records.get(key)
        if r is None:
            missing.append(f"{here} ({key!r})")
        elif _differs(r, w):
            different.append(
                f"{here} ({key!r}): the checkpoint holds {_say(r)}, like {_say_want(w)}"
            )
    asked = {key for key, _, _ in keys}
    extra = [] if partial else [repr(k) for k in ckpt.records if k not in asked]
    if not (missing or extra or different):
        return
    lines = [
        f"{fn}: like does not match the checkpoint at {target!r} (keys: key paths joined by '.')"
    ]
    if missing:
        lines.append("missing from the checkpoint: " + ", ".join(missing))
    if extra:
        lines.append(
            "in the checkpoint but not in like: "
            + ", ".join(extra)
            + " (pass partial=True to leave them unread)"
        )
    if different:
        lines.append("different:\n    " + "\n    ".join(different))
    raise ValueError("\n  ".join(lines))


def _comms(wants: list[_Want], fn: str) -> list[Comm]:
    """The groups of ranks that read parts of one value: all ranks of each mesh in ``like``
    (none without a process group)."""
    if not (dist.is_available() and dist.is_initialized()):
        return []
    out: dict[MeshKey, Comm] = {}
    for w in wants:
        if w.meta is not None and w.meta.key not in out:
            c = MeshView(w.meta.mesh, None, fn).all
            if c is not None:
                out[w.meta.key] = c
    return list(out.values())


def load(
    path: str | os.PathLike[str], like: Any, *, partial: bool = False, verify: bool = True
) -> Any:
    """The body of :func:`pshard.load` (see :mod:`pshard._state.api` for the whole contract)."""
    fn = "load"
    if not isinstance(partial, bool):
        raise TypeError(f"{fn}: partial must be a bool, got {describe(partial)}")
    if not isinstance(verify, bool):
        raise TypeError(f"{fn}: verify must be a bool, got {describe(verify)}")
    target = target_path(path, fn)
    accessors, leaves, treedef = tree_flatten_with_path(
        like, is_leaf=is_state_leaf, none_is_leaf=True
    )
    keys: list[tuple[str, KeyPath, str]] = []
    seen: dict[str, str] = {}
    for accessor in accessors:
        kp = key_path(accessor, fn)
        here = keystr(accessor, "like")
        key = fqn(kp)
        if key in seen:
            raise ValueError(
                f"{fn}: {seen[key]} and {here} have the same key {key!r} (DCP joins keys "
                f"with '.'); rename one"
            )
        seen[key] = here
        keys.append((key, kp, here))
    wants = [_want(x, here, fn) for x, (_, _, here) in zip(leaves, keys, strict=True)]
    prepared: dict[str, _Prepared] = {}

    def check(ckpt: Checkpoint) -> dict[str, Any]:
        _check(ckpt, keys, wants, partial, str(target), fn)
        if not prepared:  # allocated once, also when a save makes the load open path again
            for (key, _, _), w in zip(keys, wants, strict=True):
                if w.prepare is not None:
                    prepared[key] = w.prepare()
        return {key: p[0] for key, p in prepared.items()}

    ckpt = read_checkpoint(target, fn, check, _comms(wants, fn), verify)
    rank, world = _world()
    out = []
    for (key, _, here), w in zip(keys, wants, strict=True):
        r = ckpt.records[key]
        if key in prepared:
            out.append(prepared[key][1]())
        elif w.kind == "value":
            out.append(r.value)
        elif w.kind == "rng":
            out.append(r.rng_for(rank, world, f"{fn} {here}"))
        else:
            out.append(None)
    return tree_unflatten(treedef, out)


def like_from_specs(path: str | os.PathLike[str], specs: Any, fn: str) -> Any:
    """The tree saved at ``path`` (:func:`load_metadata`) with each tensor asked for in the
    layout ``specs`` gives it (a prefix tree of the saved tree: a ``P`` over the current
    mesh's axes, ``Replicate()`` for ``P()``, ``None`` for the whole tensor). A 0-d tensor
    (an optimizer's step count) has no dim to split: it is read whole whatever the spec that
    covers it.

    Raises:
        ValueError: ``specs`` is not a prefix of the saved tree (naming the key path).
        TypeError: a spec leaf of another kind (naming the key path).
    """
    meta = load_metadata(path)
    accessors, leaves, treedef = tree_flatten_with_path(
        meta, is_leaf=is_state_leaf, none_is_leaf=True
    )
    wanted = broadcast_prefix_flat(specs, treedef, leaves, name="specs", fn_name=fn)
    out = []
    for accessor, x, spec in zip(accessors, leaves, wanted, strict=True):
        if not isinstance(x, SavedTensor):
            out.append(x)
            continue
        if isinstance(spec, Replicate) or (isinstance(spec, P) and not x.shape):
            spec = P()
        if spec is not None and not isinstance(spec, P):
            raise TypeError(
                f"{fn} {keystr(accessor, 'specs')}: {describe(spec)} is not a layout to load "
                f"into; give a P over the mesh axes (P('dp'), P(None, 'tp')), Replicate() or "
                f"None (the whole tensor)"
            )
        out.append(dataclasses.replace(x, spec=spec))
    return tree_unflatten(treedef, out)
