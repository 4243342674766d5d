"""The leaves of a tree to save, and the ranks' agreement on them.

:func:`record` turns one leaf into its :class:`~pshard._state.manifest.LeafRecord` (a
``GlobalTensor``'s layout, a tensor's shape and dtype, a plain value, an RNG state) or refuses
it with the key path named; a DTensor is read as the ``GlobalTensor`` of ``ps.from_dtensor``.
Before anything is written each rank proposes what it saves (:class:`Proposal`: the path, the
structure, every leaf's record as JSON, and a digest of each value it holds a copy of: whole
tensors, blocks of replicated GlobalTensors) and rank 0 compares them: ranks that pass
different trees (:func:`compare`) would otherwise write a checkpoint of one rank's plain values
and another's shapes, or hang, and copies that differ (:func:`check_copies`) would be written
once, the others lost. Always on: the digests go with the proposals, in the exchange every save
makes anyway.

Also the helpers ``save`` and ``load`` share: :func:`target_path`, :func:`is_state_leaf`,
:func:`nearest_spec` (the layout DTensor can write nearest to a spec) and :func:`expressible`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from optree import PyTreeAccessor

from .._compat import is_wrapped
from .._core.global_tensor import (
    GlobalMeta,
    GlobalTensor,
    applied_shards,
    block_shape,
    dtensor_placements,
    is_global,
)
from .._core.placements import P, entry_of, entry_splits
from .._core.tree import describe, keystr
from .._shard_map.global_ops import from_dtensor
from .._shard_map.replicas import groups_text, tensor_digest
from .manifest import (
    KeyPath,
    LeafRecord,
    SavedObject,
    SavedTensor,
    spec_from_json,
    where,
)
from .rng import RngState

__all__ = [
    "Copy",
    "Proposal",
    "check_copies",
    "check_unique",
    "compare",
    "copy_of",
    "expressible",
    "is_state_leaf",
    "leaf_text",
    "nearest_spec",
    "record",
    "target_path",
]

_PLAIN = (int, float, str, bool)


def is_state_leaf(x: Any) -> bool:
    """Leaves of a checkpoint tree that pshard's walks would otherwise open (dataclasses)."""
    return isinstance(x, (RngState, SavedTensor, SavedObject))


def target_path(path: Any, fn: str) -> Path:
    """``path`` as an absolute :class:`~pathlib.Path` (symlinks not resolved).

    Raises:
        TypeError: not a str or ``os.PathLike``.
        ValueError: a path with no name (``/``).
    """
    try:
        text = os.fspath(path)
    except TypeError:
        raise TypeError(f"{fn}: path must be a str or os.PathLike, got {describe(path)}") from None
    out = Path(os.path.abspath(os.fsdecode(text)))
    if out.name in ("", ".", ".."):
        raise ValueError(f"{fn}: path {str(path)!r} names no directory")
    return out


def nearest_spec(meta: GlobalMeta) -> P:
    """The layout closest to ``meta.spec`` that DTensor can write: each dim's axes in mesh
    order (the same axes split the dim, so the blocks are the same sizes, held elsewhere)."""
    names = meta.key.names
    entries: list[str | tuple[str | int, ...] | None] = []
    for entry in meta.spec:
        if entry is None or isinstance(entry, str):
            entries.append(entry)
        else:
            entries.append(entry_of(sorted(entry_splits(entry), key=lambda s: names.index(s[0]))))
    return P(*entries)


def expressible(meta: GlobalMeta) -> bool:
    """Whether DTensor's placements give every rank the block ``meta``'s spec gives it."""
    try:
        dtensor_placements(meta)
    except ValueError:
        return False
    return True


# --------------------------------------------------------------------------- the leaves


def record(path: KeyPath, x: Any, accessor: PyTreeAccessor, fn: str) -> tuple[LeafRecord, Any]:
    """This leaf's record and the value to save (a GlobalTensor, tensor, value or state)."""
    here = keystr(accessor, "tree")
    if isinstance(x, torch.Tensor) and type(x) is not torch.Tensor:
        from torch.distributed.tensor import DTensor

        if isinstance(x, DTensor):
            try:
                x = from_dtensor(x)
            except ValueError as e:
                raise ValueError(f"{fn} {here}: {e}") from None
    if is_global(x):
        local = x.local
        if not isinstance(local, torch.Tensor) or is_wrapped(local):
            raise TypeError(
                f"{fn} {here}: the GlobalTensor's block is {describe(local)}; save outside "
                f"torch.func transforms, with tensor blocks"
            )
        meta: GlobalMeta = x.meta
        if dist.is_initialized() and dist.get_rank() not in meta.key.ranks:
            raise ValueError(
                f"{fn} {here}: this rank ({dist.get_rank()}) is not in the GlobalTensor's mesh "
                f"{meta.key.text()}; every rank that saves must hold a block of it"
            )
        _check_block(local, meta, here, fn)
        mesh = tuple(zip(meta.key.names, meta.key.sizes, strict=True))
        return LeafRecord(path, "global", meta.shape, local.dtype, meta.spec, mesh), x
    if isinstance(x, torch.Tensor):
        if is_wrapped(x):
            raise TypeError(f"{fn} {here}: a tensor of a torch.func transform; save outside it")
        return LeafRecord(path, "tensor", tuple(x.shape), x.dtype), x
    if x is None:
        return LeafRecord(path, "none"), None
    if type(x) in _PLAIN:
        return LeafRecord(path, "value", value=x), x
    if isinstance(x, RngState):
        return LeafRecord(path, "rng", rng=(x,)), x
    base = next((t for t in (bool, int, float, str) if isinstance(x, t)), None)
    hint = (
        f"convert it with {base.__name__}(x)"
        if base is not None
        else "convert it to those (a dict of them for an object's state)"
    )
    raise TypeError(
        f"{fn} {here}: {describe(x)}; a checkpoint holds GlobalTensors, tensors, int, float, "
        f"str, bool, None and ps.RngState (plain data, never a pickle): {hint}"
    )


def _check_block(local: torch.Tensor, meta: GlobalMeta, here: str, fn: str) -> None:
    """Raise unless ``local`` has the shape ``meta`` gives this rank's block (else DCP would
    write chunks that disagree with the global shape, and the load fail)."""
    coord = {n: meta.mesh.get_local_rank(n) for n in meta.key.names}
    want = block_shape(meta, coord)
    if tuple(local.shape) != want:
        at = ", ".join(f"{n}={coord[n]}" for n in meta.key.names)
        raise ValueError(
            f"{fn} {here}: the GlobalTensor's block has shape {tuple(local.shape)}, but its spec "
            f"{meta.spec!r} and global shape {meta.shape} give this rank ({at}) of mesh "
            f"{meta.key.text()} a block of shape {want}, so the checkpoint would not load; save "
            f"GlobalTensors whose blocks fit their layout (ps.from_local(block, spec, "
            f"global_shapes=...) checks it)"
        )


def check_unique(records: list[LeafRecord], fn: str) -> None:
    seen: dict[str, KeyPath] = {}
    for r in records:
        other = seen.setdefault(r.fqn, r.path)
        if other != r.path:
            raise ValueError(
                f"{fn}: {where(other)} and {where(r.path)} have the same DCP key {r.fqn!r} "
                f"(DCP joins keys with '.'); rename one"
            )


@dataclasses.dataclass(frozen=True)
class Proposal:
    """What a rank proposes to save: rank 0 compares every rank's with its own."""

    path: str
    structure: str
    leaves: tuple[str, ...]  # each leaf's record as JSON, without RNG states
    rng: tuple[RngState, ...]  # this rank's, one per RNG leaf
    copies: tuple[Copy | None, ...] = ()  # per leaf: the block this rank holds a copy of
    checksum: str = "crc32"  # the checksum this rank computes fastest (pshard._state.checksums)


#: A rank's copy of a value several ranks hold (written once): which block (its coordinates on
#: the mesh axes that split it; ``()`` for a whole tensor) and the digest of its contents.
Copy = tuple[tuple[int, ...], int]


def leaf_text(record: LeafRecord) -> str:
    data = dataclasses.replace(record, rng=()).to_json()
    return json.dumps(data, sort_keys=True, allow_nan=False)


def copy_of(record: LeafRecord, x: Any, world: int) -> Copy | None:
    """This rank's copy of the leaf if other ranks hold copies of it too: a whole tensor
    (with more than one rank), or the block of a GlobalTensor its spec replicates over mesh
    axes of size above 1."""
    if record.kind == "tensor":
        return ((), tensor_digest(x)) if world > 1 else None
    if record.kind != "global":
        return None
    g: GlobalTensor = x
    meta = g.meta
    split = {axis for axis, _ in applied_shards(meta.spec)}
    if all(n in split or meta.key.size(n) == 1 for n in meta.key.names):
        return None
    block = tuple(meta.mesh.get_local_rank(n) for n in meta.key.names if n in split)
    return block, tensor_digest(g.local)


def check_copies(proposals: list[Proposal], records: list[LeafRecord], fn: str) -> None:
    """Raise unless the ranks holding copies of one value (a whole tensor, a block of a
    replicated GlobalTensor) hold equal ones: DCP writes one of them.

    Raises:
        ValueError: the first value whose copies differ (its key path and the ranks).
    """
    for i, rec in enumerate(records):
        blocks: dict[tuple[int, ...], dict[int, list[int]]] = {}
        for rank, p in enumerate(proposals):
            copy = p.copies[i] if p.copies else None
            if copy is not None:
                blocks.setdefault(copy[0], {}).setdefault(copy[1], []).append(rank)
        differ = [list(by.values()) for by in blocks.values() if len(by) > 1]
        if not differ:
            continue
        held = "; ".join(groups_text(g) for g in differ)
        if rec.kind == "tensor":
            raise ValueError(
                f"{fn} {where(rec.path)}: a whole tensor (every rank holds a copy) differs "
                f"between the ranks (global ranks holding equal values: {held}); a checkpoint "
                f"keeps one copy, so the others would be lost. Per-rank state (an optimizer's "
                f"moments of a rank's block) is a GlobalTensor: ps.from_local(block, spec) "
                f"with the spec of the value it is a block of"
            )
        assert rec.spec is not None and rec.mesh is not None
        split = {axis for axis, _ in applied_shards(rec.spec)}
        axes = tuple(n for n, size in rec.mesh if n not in split and size > 1)
        mesh = "{" + ", ".join(f"{n!r}: {size}" for n, size in rec.mesh) + "}"
        raise ValueError(
            f"{fn} {where(rec.path)}: the GlobalTensor's spec {rec.spec!r} replicates its block "
            f"over mesh axes {axes} of mesh {mesh}, but the ranks holding copies of a block "
            f"hold different values (global ranks holding equal values: {held}); a checkpoint "
            f"keeps one copy, so the others would be lost. Pass the same block on each of "
            f"them, or make per-rank state a GlobalTensor whose spec splits it over those axes "
            f"too (ps.from_local)"
        )


def _say(text: str) -> str:
    data = json.loads(text)
    kind = data["kind"]
    if kind == "global":
        spec = spec_from_json(data["spec"])
        return f"a GlobalTensor {tuple(data['shape'])} {data['dtype']} {spec!r}"
    if kind == "tensor":
        return f"a tensor {tuple(data['shape'])} {data['dtype']}"
    if kind == "value":
        ((name, value),) = data["value"].items()
        return f"the {name} {value!r}"
    return "an RngState" if kind == "rng" else "None"


def compare(proposals: list[Proposal], fn: str) -> None:
    mine = proposals[0]
    for rank, other in enumerate(proposals):
        if other == dataclasses.replace(mine, rng=other.rng, copies=other.copies):
            continue
        if other.path != mine.path:
            raise ValueError(
                f"{fn}: rank 0 saves to {mine.path!r} and rank {rank} to {other.path!r}; every "
                f"rank passes the same path"
            )
        keys0 = {tuple(json.loads(t)["path"]): t for t in mine.leaves}
        keys1 = {tuple(json.loads(t)["path"]): t for t in other.leaves}
        lines = []
        for k in sorted(keys0.keys() | keys1.keys(), key=repr):
            a, b = keys0.get(k), keys1.get(k)
            if a == b:
                continue
            name = where(k)
            lines.append(
                f"{name}: rank 0 has {_say(a) if a else 'nothing'}, rank {rank} has "
                f"{_say(b) if b else 'nothing'}"
            )
        if not lines:
            lines.append("the trees have different structures (containers)")
        raise ValueError(
            f"{fn}: the ranks pass different trees; every rank saves the same tree (its own "
            f"blocks; whole tensors and plain values, written once, equal on every rank):\n  "
            + "\n  ".join(lines)
        )
