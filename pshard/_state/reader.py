"""Reading a DCP checkpoint directory without running an arbitrary pickle.

DCP's ``.metadata`` file is a pickle of its ``Metadata`` dataclasses, and its
``FileSystemReader`` opens it with ``pickle.load``, which runs whatever the file names.
:class:`CheckpointReader` is that reader with the metadata read by an unpickler that builds only
DCP's metadata classes, torch's sizes, dtypes, layouts and memory formats, and paths; anything
else in the file is refused (``pickle.UnpicklingError``). Tensor data is read as DCP reads it,
with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import concurrent.futures
import errno
import io
import os
import pickle
import zlib
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import MappingProxyType
from typing import IO, Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from .._compat import dcp_metadata_classes
from .._core.tree import describe
from .opened import OpenedCheckpoint

__all__ = [
    "DCP_METADATA",
    "CheckpointReader",
    "checksum",
    "parse_dcp_metadata",
    "read_dcp_metadata",
]

#: The name of DCP's metadata file in a checkpoint directory.
DCP_METADATA = ".metadata"
_SHOWN = 10  # keys named in an error

_ALLOWED: Mapping[str, frozenset[str]] = MappingProxyType(
    {
        **dcp_metadata_classes(),
        "torch": frozenset({"Size"}),
        "pathlib": frozenset(
            {"Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"}
        ),
        "collections": frozenset({"OrderedDict"}),
    }
)


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(
            f"DCP metadata names {module}.{name}, which is not a class of DCP's metadata; "
            f"pshard does not run it"
        )


def read_dcp_metadata(directory: str | os.PathLike[str]) -> Metadata:
    """DCP's ``Metadata`` of the checkpoint in ``directory`` (read with the restricted
    unpickler).

    Raises:
        FileNotFoundError: ``directory`` holds no ``.metadata``.
        pickle.UnpicklingError: the file names a class that is not DCP metadata.
    """
    file = Path(directory) / DCP_METADATA
    return parse_dcp_metadata(file.read_bytes(), str(file))


def parse_dcp_metadata(data: bytes, source: str) -> Metadata:
    """DCP's ``Metadata`` from the bytes of a ``.metadata`` file (the restricted unpickler);
    ``source`` names the file in errors.

    Raises:
        pickle.UnpicklingError: not DCP's metadata (or a class that is not DCP metadata).
    """
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except pickle.UnpicklingError:
        raise
    except Exception as e:  # a damaged pickle: EOFError, ValueError, ...
        raise pickle.UnpicklingError(
            f"{source}: not DCP metadata ({type(e).__name__}: {e})"
        ) from None
    if not isinstance(metadata, Metadata):
        raise pickle.UnpicklingError(f"{source} holds {type(metadata).__name__}, not DCP Metadata")
    return metadata


def checksum(data: bytes | memoryview) -> int:
    """The CRC-32 of ``data`` (``zlib.crc32``), the checksum of a saved chunk."""
    return zlib.crc32(data)


class CheckpointReader(FileSystemReader):
    """DCP's ``FileSystemReader`` reading through an :class:`OpenedCheckpoint` and checking
    every chunk it reads: its bytes are all there (a truncated file is an error naming the
    file, the key and the checkpoint) and, with ``sums`` (from the manifest: ``(key, chunk
    offsets) -> CRC-32``), their checksum is the one recorded at the save. ``where`` names the
    checkpoint (the user's path) and ``fn`` the caller in errors.
    """

    def __init__(
        self,
        opened: OpenedCheckpoint,
        sums: Mapping[tuple[str, tuple[int, ...]], int] | None,
        where: str,
        fn: str,
    ) -> None:
        super().__init__(opened.path)
        self._opened = opened
        self._sums = sums
        self._where = where
        self._fn = fn

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            raise FileNotFoundError(
                f"{self.path}: pshard reads checkpoints with one global {DCP_METADATA}"
            )
        metadata = parse_dcp_metadata(self._opened.read_bytes(DCP_METADATA), self._where)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        assert metadata.storage_meta is not None
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def open_files(self, plan: LoadPlan) -> None:
        """Open every data file ``plan`` reads (each stays readable if a save replaces the
        checkpoint meanwhile).

        Raises:
            Replaced: a file is gone because the checkpoint was replaced.
            FileNotFoundError: a file is missing (named, with the keys stored in it).
        """
        for name in sorted({self.storage_data[r.storage_index].relative_path for r in plan.items}):
            try:
                self._opened.open_file(name)
            except FileNotFoundError:
                keys = sorted(
                    {k.fqn for k, v in self.storage_data.items() if v.relative_path == name}
                )
                raise FileNotFoundError(
                    errno.ENOENT,
                    f"{self._fn}: the checkpoint at {self._where!r} is damaged: its file "
                    f"{name!r}, which holds {_keys_text(keys)}, is missing; restore it or load "
                    f"another checkpoint",
                ) from None

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read ``plan``'s items, checked (see the class docstring), in file order. The
        checksums are taken in a second thread while this one deserialises (``zlib.crc32``
        releases the GIL), and compared before this returns."""
        self.open_files(plan)
        items = sorted(
            plan.items,
            key=lambda r: (
                self.storage_data[r.storage_index].relative_path,
                self.storage_data[r.storage_index].offset,
            ),
        )
        if self._sums is None or len(items) < 2:
            self._read_items(items, planner, None)
        else:
            with ThreadPoolExecutor(1, thread_name_prefix="pshard-checksum") as pool:
                self._read_items(items, planner, pool)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _read_items(
        self, items: list[ReadItem], planner: LoadPlanner, pool: ThreadPoolExecutor | None
    ) -> None:
        checks: list[concurrent.futures.Future[None]] = []
        for req in items:
            index, info = req.storage_index, self.storage_data[req.storage_index]
            data = self._chunk(index, info)
            if pool is not None:
                checks.append(pool.submit(self._verify, index, info, data))
            elif self._sums is not None:
                self._verify(index, info, data)
            self._read_item(req, info, data, planner)
        for check in checks:
            check.result()

    def _read_item(self, req: ReadItem, info: Any, data: bytes, planner: LoadPlanner) -> None:
        index = req.storage_index
        stream: IO[bytes] = io.BytesIO(data)
        if info.transform_descriptors:
            stream = self.transforms.transform_load_stream(req, info.transform_descriptors, stream)
            if not stream.seekable():
                stream = io.BytesIO(stream.read())
        if req.type == LoadItemType.BYTE_IO:
            planner.load_bytes(req, io.BytesIO(stream.read()))
            return
        try:
            saved = torch.load(stream, map_location="cpu", weights_only=True)
        except Exception as e:
            if self._sums is not None:
                self._verify(index, info, data)  # a changed byte says so first
            raise ValueError(self._damaged(index, info, f"{type(e).__name__}: {e}")) from None
        if not isinstance(saved, torch.Tensor) or saved.dim() != len(req.lengths):
            raise ValueError(self._damaged(index, info, f"it holds {describe(saved)}"))
        for dim, (start, length) in enumerate(zip(req.storage_offsets, req.lengths, strict=True)):
            if length < saved.size(dim):
                saved = saved.narrow(dim, start, length)
        target = planner.resolve_tensor(req).detach()
        if target.size() != saved.size():
            raise ValueError(
                self._damaged(
                    index,
                    info,
                    f"it holds a block of shape {tuple(saved.shape)} where DCP's metadata plans "
                    f"{tuple(target.shape)}",
                )
            )
        target.copy_(saved)
        planner.commit_tensor(req, target)

    def _chunk(self, index: MetadataIndex, info: Any) -> bytes:
        """The bytes DCP stored for ``index``, all of them."""
        name, start, length = info.relative_path, int(info.offset), int(info.length)
        data = self._opened.pread(name, start, length)
        if len(data) < length:
            size = self._opened.size(name)
            raise ValueError(
                self._damaged(index, info, f"the file has {size} bytes, so it is truncated")
            )
        return data

    def _verify(self, index: MetadataIndex, info: Any, data: bytes) -> None:
        """Raise unless ``data`` has the checksum the manifest records for ``index``."""
        assert self._sums is not None
        want = self._sums.get((index.fqn, tuple(int(i) for i in index.offset or ())))
        if want is None:
            raise ValueError(self._damaged(index, info, "the manifest records no checksum for it"))
        got = checksum(data)
        if got != want:
            raise ValueError(
                self._damaged(
                    index,
                    info,
                    f"its checksum is {got:08x} where the manifest records {want:08x}, so the "
                    f"bytes changed after the save",
                )
            )

    def _damaged(self, index: MetadataIndex, info: Any, why: str) -> str:
        start, length = int(info.offset), int(info.length)
        return (
            f"{self._fn}: the checkpoint at {self._where!r} is damaged: key {index.fqn!r} "
            f"(its chunk at offsets {tuple(int(i) for i in index.offset or ())}) is stored in file "
            f"{info.relative_path!r} at bytes {start}..{start + length}, but {why}; restore the "
            f"file or load another checkpoint"
        )


def _keys_text(keys: list[str]) -> str:
    shown = ", ".join(map(repr, keys[:_SHOWN]))
    more = f" and {len(keys) - _SHOWN} more" if len(keys) > _SHOWN else ""
    return f"key {shown}" if len(keys) == 1 else f"keys {shown}{more}"
