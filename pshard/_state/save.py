"""``ps.save``: a tree of GlobalTensors, tensors and plain values as a DCP checkpoint.

Every rank calls ``save`` with the same tree (its own blocks). The ranks first agree on the
tree (its structure, each leaf's kind, global shape, dtype, layout and plain value: a mismatch
is a ``ValueError`` on every rank, naming the key paths, before anything is written); then
each rank writes its blocks of every ``GlobalTensor`` through DCP (as the DTensor of
``ps.to_dtensor``; DCP writes a block that several ranks hold, and a whole tensor, once), into
a directory beside ``path``; rank 0 writes the manifest (``pshard.json``: structure, layouts,
plain values, every rank's RNG states) and switches the new checkpoint in atomically
(:mod:`pshard._state.atomic`).

``async_save=True`` copies the blocks and tensors to CPU memory before it returns (later
in-place updates do not reach the checkpoint) and writes in a background thread, whose
exchanges go through a gloo process group made for that save.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .._compat import is_wrapped
from .._core.global_tensor import (
    GlobalMeta,
    GlobalTensor,
    dtensor_placements,
    is_global,
)
from .._core.placements import P
from .._core.tree import describe, keystr, tree_flatten_with_path
from .._runtime.debug import debug_enabled
from .._shard_map.global_ops import from_dtensor, reshard, to_dtensor
from .atomic import SaveLock, aside_path, check_target, new_token, remove_stale, switch
from .comm import Comm, GroupComm, LocalComm, agree, default_comm
from .manifest import (
    MANIFEST,
    KeyPath,
    LeafRecord,
    Manifest,
    SavedObject,
    SavedTensor,
    encode_structure,
    key_path,
    spec_from_json,
    where,
)
from .rng import RngState
from .write import write_checkpoint

__all__ = ["is_state_leaf", "nearest_spec", "save", "target_path"]

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
    entries: list[str | tuple[str, ...] | None] = []
    for entry in meta.spec:
        if entry is None or isinstance(entry, str):
            entries.append(entry)
        else:
            entries.append(tuple(sorted(entry, key=names.index)))
    return P(*entries)


def _expressible(meta: GlobalMeta) -> bool:
    try:
        dtensor_placements(meta)
    except ValueError:
        return False
    return True


# --------------------------------------------------------------------------- the leaves


def _record(path: KeyPath, x: Any, accessor: Any, fn: str) -> tuple[LeafRecord, Any]:
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


def _duplicates(records: list[LeafRecord], fn: str) -> None:
    seen: dict[str, KeyPath] = {}
    for r in records:
        other = seen.setdefault(r.fqn, r.path)
        if other != r.path:
            raise ValueError(
                f"{fn}: {where(other)} and {where(r.path)} have the same DCP key {r.fqn!r} "
                f"(DCP joins keys with '.'); rename one"
            )


def _digest(t: torch.Tensor) -> str:
    flat = t.detach().cpu().contiguous().reshape(-1)
    return hashlib.sha256(flat.view(torch.uint8).numpy().tobytes()).hexdigest()


@dataclasses.dataclass(frozen=True)
class _Proposal:
    """What a rank proposes to save: rank 0 compares every rank's with its own."""

    path: str
    structure: str
    leaves: tuple[str, ...]  # each leaf's record as JSON, without RNG states
    rng: tuple[RngState, ...]  # this rank's, one per RNG leaf


def _leaf_text(record: LeafRecord, x: Any, debug: bool) -> str:
    data = dataclasses.replace(record, rng=()).to_json()
    if debug and record.kind == "tensor":
        data["sha256"] = _digest(x)
    return json.dumps(data, sort_keys=True, allow_nan=False)


def _say(text: str) -> str:
    data = json.loads(text)
    kind = data["kind"]
    if kind == "global":
        spec = spec_from_json(data["spec"])
        return f"a GlobalTensor {tuple(data['shape'])} {data['dtype']} {spec!r}"
    if kind == "tensor":
        digest = f" (sha256 {data['sha256'][:12]})" if "sha256" in data else ""
        return f"a tensor {tuple(data['shape'])} {data['dtype']}{digest}"
    if kind == "value":
        ((name, value),) = data["value"].items()
        return f"the {name} {value!r}"
    return "an RngState" if kind == "rng" else "None"


def _compare(proposals: list[_Proposal], fn: str) -> None:
    mine = proposals[0]
    for rank, other in enumerate(proposals):
        if other == dataclasses.replace(mine, rng=other.rng):
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


# --------------------------------------------------------------------------- save


def save(
    path: str | os.PathLike[str], tree: Any, *, async_save: bool = False
) -> Future[None] | None:
    """Save ``tree`` as a checkpoint at ``path`` (a directory), in
    ``torch.distributed.checkpoint``'s format. Every rank calls it, with the same tree.

    Each rank writes only its blocks of each :class:`~pshard.GlobalTensor` (a block several
    ranks hold, once); whole tensors are written once; ints, floats, strings, bools, ``None``
    and :class:`RngState` s (each rank's) are stored as JSON beside DCP's files, with the
    tree's structure and every tensor's global shape, dtype and spec (:func:`load_metadata`).
    DTensors are saved as the GlobalTensors of :func:`pshard.from_dtensor`.

    The checkpoint is written aside and switched in atomically once every rank has written:
    ``path`` holds the previous checkpoint until then (also if a rank dies half-way) and never
    stops existing. DCP's own tools read it: ``dcp.load(state_dict, checkpoint_id=path)``, keys
    being the key paths joined by ``"."`` (``{"model": {"w": x}}`` -> ``"model.w"``).

    Args:
        path: the checkpoint directory: it must not exist, be empty, or hold a checkpoint
            (which it replaces).
        tree: a pytree of GlobalTensors, tensors, DTensors, int, float, str, bool, ``None``
            and :class:`RngState`, with str (or int) keys.
        async_save: return at once with a ``concurrent.futures.Future`` while a background
            thread writes; what is saved is the tree at the call (its tensors are copied to
            CPU memory first). Saves into one parent directory switch in call order.

    Returns:
        ``None``, or with ``async_save`` a ``Future`` whose ``result()`` is ``None`` once the
        checkpoint is in place and raises what the save raised.

    Raises:
        TypeError: a leaf a checkpoint cannot hold (the message names its key path).
        ValueError: two leaves with one DCP key, ranks passing different trees (each
            difference named), or ``path`` a file or a directory holding something else.
        RuntimeError: another rank failed (nothing was switched).

    Example:
        >>> import tempfile, torch, pshard as ps
        >>> from pshard._state.save import save
        >>> from pshard._state.load import load
        >>> mesh = ps.init_mesh({"dp": 1})
        >>> state = {"w": ps.shard(torch.arange(6.0).reshape(3, 2), ps.P("dp")), "step": 3}
        >>> path = tempfile.mkdtemp() + "/ckpt"
        >>> save(path, state)
        >>> back = load(path, state)
        >>> torch.equal(back["w"].local, state["w"].local), back["step"]
        (True, 3)
    """
    fn = "save"
    target = target_path(path, fn)
    if not isinstance(async_save, bool):
        raise TypeError(f"{fn}: async_save must be a bool, got {describe(async_save)}")
    comm = default_comm()
    lock = SaveLock(target.parent) if comm.rank == 0 else None
    handed = False
    try:
        job = _prepare(target, tree, comm, fn, async_save)
        if async_save:
            group = dist.new_group(backend="gloo") if isinstance(comm, GroupComm) else None
            future = _in_background(job, group, lock)
            handed = True
            return future
        job(comm)
        return None
    finally:
        if lock is not None and not handed:
            lock.release()


def _in_background(
    job: Callable[[Comm], None], group: dist.ProcessGroup | None, lock: SaveLock | None
) -> Future[None]:
    future: Future[None] = Future()
    future.set_running_or_notify_cancel()

    def run() -> None:
        try:
            job(GroupComm(group) if group is not None else LocalComm())
        except BaseException as e:
            future.set_exception(e)
        else:
            future.set_result(None)
        finally:
            if lock is not None:
                lock.release()
            if group is not None:
                dist.destroy_process_group(group)

    threading.Thread(target=run, name="pshard-save", daemon=False).start()
    return future


def _prepare(
    target: Path, tree: Any, comm: Comm, fn: str, async_save: bool
) -> Callable[[Comm], None]:
    """Agree on the tree with the other ranks, then lay out what each rank writes; returns
    the write (run now, or in the background with a comm of its own)."""
    accessors, leaves, treedef = tree_flatten_with_path(
        tree, is_leaf=is_state_leaf, none_is_leaf=True
    )
    debug = debug_enabled()
    records: list[LeafRecord] = []
    values: list[Any] = []
    manifest: list[Manifest] = []

    def propose() -> _Proposal:
        for accessor, x in zip(accessors, leaves, strict=True):
            record, value = _record(key_path(accessor, fn), x, accessor, fn)
            records.append(record)
            values.append(value)
        _duplicates(records, fn)
        structure = json.dumps(encode_structure(treedef, fn))
        texts = tuple(_leaf_text(r, v, debug) for r, v in zip(records, values, strict=True))
        rng = tuple(v for r, v in zip(records, values, strict=True) if r.kind == "rng")
        return _Proposal(str(target), structure, texts, rng)

    def decide(proposals: list[_Proposal]) -> list[str]:
        _compare(proposals, fn)
        check_target(target, fn)
        remove_stale(target)
        states = [iter(p.rng) for p in proposals]
        leaves_out = tuple(
            dataclasses.replace(r, rng=tuple(next(s) for s in states)) if r.kind == "rng" else r
            for r in records
        )
        structure = json.loads(proposals[0].structure)
        manifest.append(Manifest(comm.size, structure, leaves_out))
        return [new_token()] * comm.size

    token: str = agree(comm, fn, propose, decide)
    aside = aside_path(target, token)
    plan: dict[str, Any] = {}
    data: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for record, value in zip(records, values, strict=True):
            if record.kind == "global":
                x: GlobalTensor = value
                if not _expressible(x.meta):
                    x = reshard(x, nearest_spec(x.meta))
                block = x.local.detach()
                plan[record.fqn] = to_dtensor(GlobalTensor(block.to("meta"), x.meta))
            elif record.kind == "tensor":
                block = value.detach()
                plan[record.fqn] = block.to("meta")
            else:
                continue
            if async_save:
                block = block.to("cpu", memory_format=torch.contiguous_format, copy=True)
            data[record.fqn] = block

    def commit() -> None:
        text = manifest[0].to_json()
        with open(aside / MANIFEST, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        switch(aside, target, fn)

    def job(job_comm: Comm) -> None:
        write_checkpoint(plan, data, aside, target, job_comm, commit)

    return job
