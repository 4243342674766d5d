"""DCP's save protocol, run by pshard so it controls where the ranks meet and what is read.

The steps are DCP's own, through its public planner and storage-writer interfaces
(``DefaultSavePlanner``, ``FileSystemWriter``): each rank plans its writes, rank 0 makes the
global plan (replicated chunks written once) and DCP's metadata, each rank writes its files,
rank 0 writes ``.metadata`` and then commits. Three things differ from ``dcp.save``:

- the planner reads each entry's data from a dict of tensors given beside the state dict (the
  blocks themselves for a blocking save, copies taken at the call for an async one), while it
  plans from the state dict (DTensors and tensors, possibly on the meta device);
- each rank reads its files back once written and takes every chunk's checksum, which rank 0
  puts in the manifest; the metadata names the save's id, which the manifest names too;
- the exchanges go through a :class:`~pshard._state.comm.Comm` (the default group, a group of
  the save's own in a background thread, or none), each step through
  :func:`~pshard._state.comm.agree`, and rank 0's ``commit`` (the manifest and the atomic
  switch) runs inside the last step, so every rank learns whether the checkpoint is in place.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.checkpoint.storage import WriteResult

from .atomic import writable_error
from .checksums import file_checksum
from .comm import Comm, agree
from .manifest import ChunkSum

__all__ = ["DCPWriter", "chunk_sums", "write_checkpoint"]


class DCPWriter(FileSystemWriter):
    """DCP's writer into the aside directory, naming the final path as the checkpoint id and
    ``save_id`` as the save's id."""

    def __init__(self, aside: Path, final: Path, save_id: str) -> None:
        super().__init__(aside, single_file_per_rank=True, sync_files=True, overwrite=False)
        self._final = final
        self.save_id = save_id

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=os.fspath(self._final), save_id=self.save_id)


class _Planner(DefaultSavePlanner):
    """DCP's default planner reading each entry's data from ``data`` (fqn -> tensor)."""

    def __init__(self, data: Mapping[str, torch.Tensor]) -> None:
        super().__init__()
        self._data = data

    def lookup_object(self, index: MetadataIndex) -> Any:
        return self._data[index.fqn]


def chunk_sums(directory: Path, results: list[WriteResult], checksum: str) -> list[ChunkSum]:
    """The checksum of each chunk in ``results``, read back from the files in ``directory``
    (what is on disk, not what was meant to be)."""
    out: list[ChunkSum] = []
    by_file: dict[str, list[WriteResult]] = {}
    for r in results:
        by_file.setdefault(r.storage_data.relative_path, []).append(r)
    for name, items in sorted(by_file.items()):
        fd = os.open(directory / name, os.O_RDONLY)
        try:
            for r in items:
                info = r.storage_data
                crc = file_checksum(fd, int(info.offset), int(info.length), checksum, "save")
                if crc is None:
                    raise OSError(f"save: {str(directory / name)!r} is shorter than DCP wrote it")
                offsets = tuple(int(i) for i in r.index.offset or ())
                out.append((r.index.fqn, offsets, crc))
        finally:
            os.close(fd)
    return out


def write_checkpoint(
    state_dict: dict[str, Any],
    data: Mapping[str, torch.Tensor],
    writer: FileSystemWriter,
    final: Path,
    comm: Comm,
    commit: Callable[[list[ChunkSum]], None],
    checksum: str | None = "crc32",
) -> None:
    """Write ``state_dict`` (fqn -> DTensor or tensor, for planning) with the data of ``data``
    (fqn -> this rank's block or whole tensor) through ``writer`` (a :class:`DCPWriter`, or
    the Hugging Face one, into the save's aside directory); then rank 0 runs ``commit`` with
    every chunk's checksum of the kind ``checksum`` names (none when it is ``None``). Every
    rank returns, or every rank raises.

    Raises:
        BaseException: this rank's own failure.
        RuntimeError: another rank failed.
    """
    aside = Path(writer.path)
    planner = _Planner(data)
    coordinator = comm.rank == 0
    metadata: list[Metadata] = []

    def local_plan() -> SavePlan:
        planner.set_up_planner(
            state_dict, storage_meta=writer.storage_meta(), is_coordinator=coordinator
        )
        try:  # DCP's writer makes the aside directory
            writer.set_up_storage_writer(coordinator, rank=comm.rank, use_collectives=True)
            return writer.prepare_local_plan(planner.create_local_plan())
        except PermissionError as e:  # one the process could not tell beforehand (ACLs, NFS)
            raise writable_error(final, "save") from e

    def global_plan(plans: list[SavePlan]) -> list[SavePlan]:
        plans, md = planner.create_global_plan(plans)
        metadata.append(md)
        return writer.prepare_global_plan(plans)

    plan: SavePlan = agree(comm, "save", local_plan, global_plan)

    def write_data() -> tuple[list[WriteResult], list[ChunkSum]]:
        results: list[WriteResult] = writer.write_data(planner.finish_plan(plan), planner).wait()
        return results, chunk_sums(aside, results, checksum) if checksum is not None else []

    def finish(written: list[tuple[list[WriteResult], list[ChunkSum]]]) -> list[None]:
        writer.finish(metadata[0], [results for results, _ in written])
        commit([s for _, sums in written for s in sums])
        return [None] * comm.size

    agree(comm, "save", write_data, finish)
