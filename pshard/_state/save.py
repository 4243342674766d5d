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
from .._modules.adapter import config_file
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
from .checksums import CRC32, CRC32C, preferred
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
    config: Any = None,
) -> Future[None] | None:
    """The body of :func:`pshard.save` (see :mod:`pshard._state.api` for the whole contract)."""
    fn = "save"
    target = target_path(path, fn)
    if not isinstance(async_save, bool):
        raise TypeError(f"{fn}: async_save must be a bool, got {describe(async_save)}")
    if format not in ("dcp", "huggingface"):
        raise ValueError(
            f"{fn}: format must be 'dcp' (pshard's checkpoints) or 'huggingface' (a model's "
            f"weights as safetensors that from_pretrained loads), got {format!r}"
        )
    extra = _config_file(config, format, fn)
    comm = default_comm()
    locks: list[SaveLock] = []  # rank 0's, from the first step to the switch
    try:
        job, aside = _prepare(target, tree, comm, fn, async_save, format, locks, extra)
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


def _config_file(config: Any, format: str, fn: str) -> tuple[str, str] | None:
    """The file ``config`` is written as beside a Hugging Face checkpoint's weights."""
    if config is None:
        return None
    if format != "huggingface":
        raise TypeError(
            f"{fn}: config= is written beside a model's weights in format='huggingface' (what "
            f"from_pretrained reads); a DCP checkpoint keeps values in its tree: put them there"
        )
    found = config_file(config)
    if found is None:
        raise TypeError(
            f"{fn}: config is {describe(config)}, which no registered model family writes; "
            f"pass the model's config (model.config of a Hugging Face model)"
        )
    return found


def _prepare(
    target: Path,
    tree: Any,
    comm: Comm,
    fn: str,
    async_save: bool,
    format: str,
    locks: list[SaveLock],
    extra: tuple[str, str] | None = None,
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
        return Proposal(str(target), structure, texts, rng, copies, checksum=preferred())

    def decide(proposals: list[Proposal]) -> list[tuple[str, str]]:
        compare(proposals, fn)
        check_copies(proposals, records, fn)
        check_target(target, fn, ours=() if extra is None else (extra[0],))
        remove_stale(target)
        states = [iter(p.rng) for p in proposals]
        leaves_out = tuple(
            dataclasses.replace(r, rng=tuple(next(s) for s in states)) if r.kind == "rng" else r
            for r in records
        )
        structure = json.loads(proposals[0].structure)
        token = new_token()
        # the fastest checksum every rank computes
        checksum = CRC32C if all(p.checksum == CRC32C for p in proposals) else CRC32
        manifest.append(Manifest(comm.size, structure, leaves_out, save_id(token)))
        return [(token, checksum)] * comm.size

    token, checksum = agree(comm, fn, propose, decide)
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
            if extra is not None:  # the model's config beside its weights
                name, text = extra
                with open(aside / name, "w", encoding="utf-8") as f:
                    f.write(text)
                    f.flush()
                    os.fsync(f.fileno())
        else:
            text = dataclasses.replace(manifest[0], sums=tuple(sums), checksum=checksum).to_json()
            with open(aside / MANIFEST, "w", encoding="utf-8") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
        switch(aside, target, fn, () if extra is None else (extra[0],))

    def job(job_comm: Comm) -> None:
        if format == "huggingface":
            files = file_indices([r for r in records if r.kind in ("global", "tensor")])
            writer: FileSystemWriter = HFWriter(aside, target, save_id(token), files)
        else:
            writer = DCPWriter(aside, target, save_id(token))
        write_checkpoint(
            plan, data, writer, target, job_comm, commit, checksum if format == "dcp" else None
        )

    return job, aside
