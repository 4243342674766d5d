"""``ps.save``: a tree of GlobalTensors, tensors and plain values as a DCP checkpoint.

Every rank calls ``save`` with the same tree (its own blocks). The ranks first agree on the
tree (its structure, each leaf's kind, global shape, dtype, layout and plain value: a mismatch
is a ``ValueError`` on every rank, naming the key paths, before anything is written) and on
the values several ranks hold copies of (a digest of each whole tensor and replicated block,
compared where the copies are held, always); then each rank writes its blocks of every
``GlobalTensor`` through DCP (as the DTensor of ``ps.to_dtensor``; DCP writes a block that
several ranks hold, and a whole tensor, once), into a directory beside ``path``; rank 0 writes
the manifest (``pshard.json``: structure, layouts, plain values, every rank's RNG states, every
chunk's checksum) and switches the new checkpoint in atomically
(:mod:`pshard._state.atomic`).

``async_save=True`` copies the blocks and tensors to CPU memory before it returns (later
in-place updates do not reach the checkpoint) and writes in a background thread, whose
exchanges go through a file store beside the checkpoint, not a process group: the save
finishes also when a rank returns without waiting on its future and its process groups are
torn down (the thread is not a daemon: the process waits for it at exit).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Literal

import torch
from torch.distributed.checkpoint import FileSystemWriter

from .._core.global_tensor import GlobalTensor
from .._core.tree import describe, tree_flatten_with_path
from .._runtime.threads import exchange_store
from .._runtime.turns import in_background
from .._shard_map.global_ops import reshard, to_dtensor
from .atomic import (
    SaveLock,
    aside_path,
    check_target,
    check_writable,
    new_token,
    remove_stale,
    store_path,
    switch,
)
from .comm import Comm, GroupComm, LocalComm, StoreComm, agree, default_comm
from .hf import HFWriter, check_hf_leaf, file_indices, remove_sharded
from .manifest import MANIFEST, ChunkSum, LeafRecord, Manifest, encode_structure, key_path, save_id
from .records import (
    Proposal,
    check_copies,
    check_unique,
    compare,
    copy_of,
    expressible,
    is_state_leaf,
    leaf_text,
    nearest_spec,
    record,
    target_path,
)
from .write import DCPWriter, write_checkpoint

__all__ = ["save"]


# --------------------------------------------------------------------------- save


def save(
    path: str | os.PathLike[str],
    tree: Any,
    *,
    async_save: bool = False,
    format: Literal["dcp", "huggingface"] = "dcp",
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

    ``format="huggingface"`` writes a model's weights as Hugging Face safetensors instead: a
    tree of tensors only, keyed by state-dict names (a flat ``{"model.embed_tokens.weight":
    ...}``, or nested dicts whose keys join to them), each rank writing its blocks and rank 0
    consolidating them into ``model-0000i-of-0000N.safetensors`` (up to 5 GB each) and
    ``model.safetensors.index.json`` (torch's ``HuggingFaceStorageWriter``), written aside and
    switched in the same way. ``AutoModelForCausalLM.from_pretrained(path)`` loads it once
    ``config.json`` is beside it (``model.config.save_pretrained(path)``); :func:`load` reads
    it back sharded.

    Args:
        path: the checkpoint directory: it must not exist, be empty, or hold a checkpoint
            and nothing else (which it replaces; files pshard and DCP did not write there,
            a ``config.json`` or ``logs/``, are never deleted: the save refuses them).
        tree: a pytree of GlobalTensors, tensors, DTensors, int, float, str, bool, ``None``
            and :class:`RngState`, with str (or int) keys.
        async_save: return at once with a ``concurrent.futures.Future`` while a background
            thread writes; what is saved is the tree at the call (its tensors are copied to
            CPU memory first). Saves into one parent directory switch in call order. The save
            finishes also if the caller returns without waiting (the process waits for it at
            exit; its exchanges need no process group).
        format: ``"dcp"`` (pshard's checkpoint) or ``"huggingface"`` (safetensors of a
            model's weights).

    Returns:
        ``None``, or with ``async_save`` a ``Future`` whose ``result()`` is ``None`` once the
        checkpoint is in place and raises what the save raised.

    Raises:
        TypeError: a leaf a checkpoint cannot hold (the message names its key path; with
            ``format="huggingface"``, anything but a tensor of a dtype safetensors holds).
        ValueError: two leaves with one DCP key, a GlobalTensor whose block does not fit its
            spec and global shape, ranks passing different trees (each difference named),
            copies of a whole tensor or of a replicated GlobalTensor's block that differ
            between the ranks holding them (the key path and the ranks named: per-rank state
            is a GlobalTensor, ``ps.from_local``), or ``path`` a file or a directory holding
            something pshard and DCP do not write (each such entry named).
        PermissionError: this process may not create files in ``path``'s directory.
        RuntimeError: another rank failed (nothing was switched).

    Example:
        >>> import tempfile, torch, pshard as ps
        >>> mesh = ps.init_mesh({"dp": 1})
        >>> state = {"w": ps.shard(torch.arange(6.0).reshape(3, 2), ps.P("dp")), "step": 3}
        >>> path = tempfile.mkdtemp() + "/ckpt"
        >>> ps.save(path, state)
        >>> back = ps.load(path, state)
        >>> torch.equal(back["w"].local, state["w"].local), back["step"]
        (True, 3)
    """
    fn = "save"
    target = target_path(path, fn)
    if not isinstance(async_save, bool):
        raise TypeError(f"{fn}: async_save must be a bool, got {describe(async_save)}")
    if format not in ("dcp", "huggingface"):
        raise ValueError(
            f"{fn}: format must be 'dcp' (pshard's checkpoints) or 'huggingface' (a model's "
            f"weights as safetensors that from_pretrained loads), got {format!r}"
        )
    comm = default_comm()
    locks: list[SaveLock] = []  # rank 0's, from the first step to the switch
    try:
        job, aside = _prepare(target, tree, comm, fn, async_save, format, locks)
        if not async_save:
            job(comm)
            return None
        store = store_path(aside) if isinstance(comm, GroupComm) else None
        future = _in_background(job, store, comm.rank, comm.size, locks[0] if locks else None)
        locks.clear()  # the background thread releases it
        return future
    finally:
        for lock in locks:
            lock.release()


def _in_background(
    job: Callable[[Comm], None], store: Path | None, rank: int, size: int, lock: SaveLock | None
) -> Future[None]:
    """Run ``job`` in a thread that is not a daemon (the process waits for it at exit; an
    in-process rank's world, likewise), its exchanges through a store the ranks share at
    ``store`` (none: a process alone), not a process group: the save finishes also when the
    caller returns without waiting and its process groups are destroyed meanwhile."""

    def run() -> None:
        comm: Comm | None = None
        try:
            if store is None:
                comm = LocalComm()
            else:
                comm = StoreComm(exchange_store(os.fspath(store), store.name), rank, size)
            job(comm)
        finally:
            if isinstance(comm, StoreComm):
                comm.close()
            if lock is not None:
                lock.release()

    return in_background(run, name="pshard-save")


def _prepare(
    target: Path,
    tree: Any,
    comm: Comm,
    fn: str,
    async_save: bool,
    format: str,
    locks: list[SaveLock],
) -> tuple[Callable[[Comm], None], Path]:
    """Agree with the other ranks on the tree (rank 0 takes the save lock), lay out what each
    rank writes (copies of the tensors for an async save) and check that every rank could;
    returns the write (run now, or in the background with a comm of its own)."""
    accessors, leaves, treedef = tree_flatten_with_path(
        tree, is_leaf=is_state_leaf, none_is_leaf=True
    )
    records: list[LeafRecord] = []
    values: list[Any] = []
    manifest: list[Manifest] = []

    def propose() -> Proposal:
        check_writable(target, fn)
        if comm.rank == 0:
            locks.append(SaveLock(target.parent))
        for accessor, x in zip(accessors, leaves, strict=True):
            rec, value = record(key_path(accessor, fn), x, accessor, fn)
            records.append(rec)
            values.append(value)
        check_unique(records, fn)
        if format == "huggingface":
            for r in records:
                check_hf_leaf(r, fn)
        structure = json.dumps(encode_structure(treedef, fn))
        texts = tuple(leaf_text(r) for r in records)
        rng = tuple(v for r, v in zip(records, values, strict=True) if r.kind == "rng")
        copies = tuple(copy_of(r, v, comm.size) for r, v in zip(records, values, strict=True))
        return Proposal(str(target), structure, texts, rng, copies)

    def decide(proposals: list[Proposal]) -> list[str]:
        compare(proposals, fn)
        check_copies(proposals, records, fn)
        check_target(target, fn)
        remove_stale(target)
        states = [iter(p.rng) for p in proposals]
        leaves_out = tuple(
            dataclasses.replace(r, rng=tuple(next(s) for s in states)) if r.kind == "rng" else r
            for r in records
        )
        structure = json.loads(proposals[0].structure)
        token = new_token()
        manifest.append(Manifest(comm.size, structure, leaves_out, save_id(token)))
        return [token] * comm.size

    token: str = agree(comm, fn, propose, decide)
    aside = aside_path(target, token)
    plan: dict[str, Any] = {}  # fqn -> what DCP plans from: DTensors and tensors of meta blocks
    data: dict[str, torch.Tensor] = {}  # fqn -> this rank's block or the whole tensor

    def lay_out() -> None:
        with torch.no_grad():
            for rec, value in zip(records, values, strict=True):
                if rec.kind == "global":
                    x: GlobalTensor = value
                    if not expressible(x.meta):  # a collective over the mesh
                        x = reshard(x, nearest_spec(x.meta))
                    block = x.local.detach()
                    plan[rec.fqn] = to_dtensor(GlobalTensor(block.to("meta"), x.meta))
                elif rec.kind == "tensor":
                    block = value.detach()
                    plan[rec.fqn] = block.to("meta")
                else:
                    continue
                if async_save:
                    block = block.to("cpu", memory_format=torch.contiguous_format, copy=True)
                elif format == "huggingface":  # safetensors writes contiguous tensors only
                    block = block.contiguous()
                data[rec.fqn] = block

    agree(comm, fn, lay_out, lambda done: [None] * comm.size)

    def commit(sums: list[ChunkSum]) -> None:
        if format == "huggingface":
            remove_sharded(aside)
        else:
            text = dataclasses.replace(manifest[0], sums=tuple(sums)).to_json()
            with open(aside / MANIFEST, "w", encoding="utf-8") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
        switch(aside, target, fn)

    def job(job_comm: Comm) -> None:
        if format == "huggingface":
            files = file_indices([r for r in records if r.kind in ("global", "tensor")])
            writer: FileSystemWriter = HFWriter(aside, target, save_id(token), files)
        else:
            writer = DCPWriter(aside, target, save_id(token))
        checksums = format == "dcp"
        write_checkpoint(plan, data, writer, target, job_comm, commit, checksums)

    return job, aside
