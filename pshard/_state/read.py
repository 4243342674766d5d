"""Reading one whole checkpoint, while saves of the same path may switch it.

:func:`open_checkpoint` reads what a checkpoint directory describes (DCP's metadata, the
manifest if pshard wrote it) through an :class:`~pshard._state.opened.OpenedCheckpoint`, so
both come from one save; :func:`read_checkpoint` then plans DCP's reads into the targets a
``check`` gives, opens the data files those reads need and reads them, each chunk checked
(:class:`~pshard._state.reader.CheckpointReader`). A checkpoint replaced by a save before its
data files were open (they are gone) is opened again, from ``path``.

Where several ranks read parts of one global value (``like`` holds ``GlobalTensor`` s), they
must read the same save: before reading, the ranks of each mesh involved exchange which save
they opened (a digest of its metadata) and whether they could open it; if they differ, or one
found it replaced, every one of them opens ``path`` again. After reading they exchange whether
each succeeded, so a rank that found a damaged chunk fails every rank (no rank goes on into the
next collective alone). Each exchange is one all-gather of three integers per rank.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from .._runtime.wire import Comm, all_gather
from .checksums import CRC32
from .hf import HF_INDEX, HF_SINGLE, HFReader, is_hf, open_hf
from .manifest import MANIFEST, SAVE_ID_PREFIX, LeafRecord, Manifest
from .opened import OpenedCheckpoint, Replaced
from .reader import DCP_METADATA, CheckpointReader, parse_dcp_metadata

__all__ = ["ATTEMPTS", "Checkpoint", "open_checkpoint", "read_checkpoint", "reopened"]

#: How many times a load opens a checkpoint that saves keep replacing before it gives up.
ATTEMPTS = 5

_OK, _AGAIN, _FAILED = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """A checkpoint as opened: where (the user's path, for messages), DCP's metadata (for a
    Hugging Face model directory, pshard's reading of its safetensors headers), the manifest
    if pshard wrote it, a record per key, and a digest of the save it came from."""

    where: str
    dcp: Metadata
    manifest: Manifest | None
    records: dict[str, LeafRecord]
    generation: str
    format: Literal["dcp", "huggingface"] = "dcp"


def _dcp_records(md: Metadata) -> dict[str, LeafRecord]:
    out: dict[str, LeafRecord] = {}
    for key, entry in md.state_dict_metadata.items():
        if isinstance(entry, TensorStorageMetadata):
            shape = tuple(int(n) for n in entry.size)
            out[key] = LeafRecord((key,), "tensor", shape, entry.properties.dtype)
        else:
            out[key] = LeafRecord((key,), "object")
    return out


def open_checkpoint(opened: OpenedCheckpoint, target: Path, fn: str) -> Checkpoint:
    """Read DCP's metadata and the manifest of the checkpoint ``opened`` (at ``target``).

    Raises:
        Replaced: the checkpoint was replaced before its files could be read.
        FileNotFoundError: no checkpoint there, or pshard's manifest is missing from one
            pshard wrote.
        ValueError: the manifest and DCP's metadata disagree.
    """
    where = str(target)
    has_manifest = opened.exists(MANIFEST)
    if not opened.exists(DCP_METADATA) and not has_manifest and is_hf(opened):
        md, records, generation = open_hf(opened, where, fn)
        return Checkpoint(where, md, None, records, generation, "huggingface")
    if not opened.exists(DCP_METADATA):
        if opened.replaced():
            raise Replaced(DCP_METADATA)
        if has_manifest:
            raise FileNotFoundError(
                errno.ENOENT,
                f"{fn}: the checkpoint at {where!r} is damaged: it has pshard's {MANIFEST} but "
                f"not DCP's {DCP_METADATA}, which lists where every tensor is stored; restore "
                f"it or load another checkpoint",
            )
        raise FileNotFoundError(
            errno.ENOENT,
            f"{fn}: no checkpoint at {where!r} (no DCP {DCP_METADATA} file there, nor a Hugging "
            f"Face model's {HF_INDEX} or {HF_SINGLE})",
        )
    raw = opened.read_bytes(DCP_METADATA)
    md = parse_dcp_metadata(raw, f"{fn}: {str(target / DCP_METADATA)!r}")
    save_id = getattr(md.storage_meta, "save_id", None)
    digest = hashlib.sha256(raw)
    manifest = None
    if has_manifest:
        text = opened.read_bytes(MANIFEST)
        digest.update(text)
        manifest = Manifest.from_json(text.decode("utf-8"), f"{fn}: {str(target / MANIFEST)!r}")
        if manifest.save_id is not None and manifest.save_id != save_id:
            raise ValueError(
                f"{fn}: the checkpoint at {where!r} is inconsistent: its {MANIFEST} comes from "
                f"save {manifest.save_id!r} and DCP's {DCP_METADATA} from save {save_id!r}; a "
                f"checkpoint's files were mixed by hand: restore them or load another checkpoint"
            )
    elif isinstance(save_id, str) and save_id.startswith(SAVE_ID_PREFIX):
        if opened.replaced():  # a save switched the path and is deleting these files
            raise Replaced(MANIFEST)
        raise FileNotFoundError(
            errno.ENOENT,
            f"{fn}: the checkpoint at {where!r} is damaged: pshard wrote it (DCP's "
            f"{DCP_METADATA} names save {save_id!r}) but its manifest {MANIFEST}, which holds "
            f"the tree's structure, layouts, plain values and checksums, is missing; restore it "
            f"or load another checkpoint (torch.distributed.checkpoint.load still reads its "
            f"tensors)",
        )
    if manifest is None:
        records = _dcp_records(md)
    else:
        records = {r.fqn: r for r in manifest.leaves}
        _check_manifest(records, md, where, fn)
    return Checkpoint(where, md, manifest, records, digest.hexdigest())


def _check_manifest(records: dict[str, LeafRecord], md: Metadata, where: str, fn: str) -> None:
    for key, r in records.items():
        if r.kind not in ("global", "tensor"):
            continue
        entry = md.state_dict_metadata.get(key)
        if (
            not isinstance(entry, TensorStorageMetadata)
            or tuple(entry.size) != r.shape
            or entry.properties.dtype != r.dtype
        ):
            raise ValueError(
                f"{fn}: the checkpoint at {where!r} is inconsistent: its manifest has a "
                f"tensor {key!r} that DCP's metadata does not hold as described"
            )


def reopened(target: Path, fn: str, attempt: Callable[[OpenedCheckpoint], Any]) -> Any:
    """``attempt(opened)`` on the checkpoint at ``target``, opened again while it raises
    :class:`Replaced` (at most :data:`ATTEMPTS` times).

    Raises:
        RuntimeError: saves replaced the checkpoint every time.
    """
    for _ in range(ATTEMPTS):
        with OpenedCheckpoint(target, fn) as opened:
            try:
                return attempt(opened)
            except Replaced:
                continue
    raise _replaced_error(target, fn)


def _replaced_error(target: Path, fn: str) -> RuntimeError:
    return RuntimeError(
        f"{fn}: saves replaced the checkpoint at {str(target)!r} {ATTEMPTS} times while this "
        f"load read it, each time before it had its files open; load again"
    )


def _digest(generation: str) -> int:
    return int.from_bytes(hashlib.sha256(generation.encode()).digest()[:8], "little", signed=True)


def _exchange(comms: Sequence[Comm], generation: str, status: int) -> list[tuple[int, int, int]]:
    """Every participating rank's ``(save digest, status, global rank)``."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    rows: list[tuple[int, int, int]] = []
    for c in comms:
        row = torch.tensor([_digest(generation), status, rank], dtype=torch.int64)
        device = _comm_device(c)
        got = all_gather(row.to(device), c, 0, False).cpu().tolist()
        rows.extend((int(a), int(b), int(r)) for a, b, r in got)
    return rows


def _comm_device(c: Comm) -> torch.device:
    backend = str(dist.get_backend(c.group)) if c.group is not None else "gloo"
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def read_checkpoint(
    target: Path,
    fn: str,
    check: Callable[[Checkpoint], dict[str, Any]],
    comms: Sequence[Comm],
    verify: bool,
) -> Checkpoint:
    """Open the checkpoint at ``target``, have ``check`` compare it with what is asked and
    give the targets to read into (fqn -> DTensor or tensor, allocated once), and read them:
    one whole checkpoint, each chunk checked (checksums too when ``verify``). ``comms``: the
    groups of ranks that must read the same save (see the module docstring; empty when each
    rank reads on its own). Returns the checkpoint read.

    Raises:
        What ``check`` raises, or a damaged checkpoint's error (on the rank that found it;
        RuntimeError on the others of ``comms``).
        RuntimeError: saves kept replacing the checkpoint.
    """
    for _ in range(ATTEMPTS):
        with OpenedCheckpoint(target, fn) as opened:
            status, error, generation = _OK, None, ""
            try:
                ckpt = open_checkpoint(opened, target, fn)
                generation = ckpt.generation
                state_dict = check(ckpt)
                reader, planner, plan = _plan(state_dict, ckpt, opened, verify, fn)
                reader.open_files(plan)
            except Replaced:
                status = _AGAIN
            except Exception as e:
                status, error = _FAILED, e
            rows = _exchange(comms, generation, status) if comms else []
            if status == _AGAIN or any(s == _AGAIN for _, s, _ in rows):
                continue
            if len({g for g, _, _ in rows}) > 1:  # ranks opened different saves
                continue
            _raise_failure(error, rows, ckpt.where if error is None else str(target), fn)
            try:
                reader.read_data(plan, planner).wait()
            except Exception as e:
                status, error = _FAILED, e
            if comms:
                rows = _exchange(comms, generation, status)
            _raise_failure(error, rows, ckpt.where, fn)
            return ckpt
    raise _replaced_error(target, fn)


def _raise_failure(
    error: BaseException | None, rows: list[tuple[int, int, int]], where: str, fn: str
) -> None:
    if error is not None:
        raise error
    failed = sorted({r for _, s, r in rows if s == _FAILED})
    if failed:
        ranks = ", ".join(map(str, failed))
        raise RuntimeError(
            f"{fn}: rank{'s' if len(failed) > 1 else ''} {ranks} could not read the checkpoint "
            f"at {where!r} (its error says why); every rank that reads it fails with it"
        )


def _plan(
    state_dict: dict[str, Any], ckpt: Checkpoint, opened: OpenedCheckpoint, verify: bool, fn: str
) -> tuple[CheckpointReader | HFReader, DefaultLoadPlanner, Any]:
    """DCP's load plan on this rank alone: read items for the chunks of each target (DTensor
    or tensor, fqn -> target) that the checkpoint's saved chunks overlap."""
    sums = ckpt.manifest.checksums() if verify and ckpt.manifest and ckpt.manifest.sums else None
    reader: CheckpointReader | HFReader
    if ckpt.format == "huggingface":
        reader = HFReader(opened, ckpt.where, fn)
    else:
        checksum = ckpt.manifest.checksum if ckpt.manifest is not None else CRC32
        reader = CheckpointReader(opened, sums, ckpt.where, fn, checksum)
    planner = DefaultLoadPlanner()
    planner.set_up_planner(state_dict, ckpt.dcp, is_coordinator=True)
    reader.set_up_storage_reader(ckpt.dcp, True, rank=0, use_collectives=True)
    plan = reader.prepare_local_plan(planner.create_local_plan())
    plan = reader.prepare_global_plan(planner.create_global_plan([plan]))[0]
    return reader, planner, planner.finish_plan(plan)
