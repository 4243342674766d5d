"""Reading a DCP checkpoint directory without running an arbitrary pickle.

DCP's ``.metadata`` file is a pickle of its ``Metadata`` dataclasses, and its
``FileSystemReader`` opens it with ``pickle.load``, which runs whatever the file names.
:class:`CheckpointReader` is that reader with the metadata read by an unpickler that builds only
DCP's metadata classes, torch's sizes, dtypes, layouts and memory formats, and paths; anything
else in the file is refused (``pickle.UnpicklingError``). Tensor data is read as DCP reads it,
with ``torch.load(weights_only=True)``, through an
:class:`~pshard._state.opened.OpenedCheckpoint` (files opened once, relative to one open
directory), and checked: every chunk's bytes all there (a truncated file is named) and, with
the manifest's checksums, their checksum (:func:`pshard._state.checksums.file_checksum`) the one
recorded at the save.
"""

from __future__ import annotations

import errno
import io
import os
import pickle
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
from .checksums import CRC32, file_checksum
from .opened import OpenedCheckpoint

__all__ = [
    "DCP_METADATA",
    "CheckpointReader",
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


class _FileView(io.RawIOBase):
    """The bytes ``[start, start + length)`` of the file ``fd`` as a file of their own, read
    with ``os.preadv`` straight into the caller's buffer (torch reads a tensor's bytes into its
    storage through ``readinto``)."""

    def __init__(self, fd: int, start: int, length: int) -> None:
        super().__init__()
        self._fd, self._start, self._length, self._pos = fd, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        n = max(0, min(len(view), self._length - self._pos))
        if n == 0:
            return 0
        got = os.preadv(self._fd, [view[:n]], self._start + self._pos)
        self._pos += got
        return got


_BUFFER = 1 << 24  # bytes read at a time where a chunk is read in pieces


class CheckpointReader(FileSystemReader):
    """DCP's ``FileSystemReader`` reading through an :class:`OpenedCheckpoint` and checking
    every chunk it reads: its bytes are all there (a truncated file is an error naming the
    file, the key and the checkpoint) and, with ``sums`` (from the manifest: ``(key, chunk
    offsets) -> checksum``, of the kind ``checksum`` names), their checksum is the one recorded
    at the save. ``where`` names the checkpoint (the user's path) and ``fn`` the caller in
    errors.
    """

    def __init__(
        self,
        opened: OpenedCheckpoint,
        sums: Mapping[tuple[str, tuple[int, ...]], int] | None,
        where: str,
        fn: str,
        checksum: str = CRC32,
    ) -> None:
        super().__init__(opened.path)
        self._opened = opened
        self._sums = sums
        self._checksum = checksum
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
        """Read ``plan``'s items, checked (see the class docstring), in file order: torch reads
        each chunk from the file into its tensor's memory while a second thread reads the same
        bytes for their checksum (``os.pread`` and the checksums release the GIL); the
        checksums are compared before this returns."""
        self.open_files(plan)
        items = sorted(
            plan.items,
            key=lambda r: (
                self.storage_data[r.storage_index].relative_path,
                self.storage_data[r.storage_index].offset,
            ),
        )
        for req in items:  # a truncated file is named before anything is read
            self._check_length(req.storage_index, self.storage_data[req.storage_index])
        if self._sums is None:
            for req in items:
                self._read_item(req, self.storage_data[req.storage_index], planner)
        else:
            with ThreadPoolExecutor(1, thread_name_prefix="pshard-checksum") as pool:
                checks = [
                    pool.submit(self._verify, r.storage_index, self.storage_data[r.storage_index])
                    for r in items
                ]
                for req in items:
                    self._read_item(req, self.storage_data[req.storage_index], planner)
                for check in checks:
                    check.result()
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _read_item(self, req: ReadItem, info: Any, planner: LoadPlanner) -> None:
        index = req.storage_index
        name, start, length = info.relative_path, int(info.offset), int(info.length)
        stream: IO[bytes] = io.BufferedReader(
            _FileView(self._opened.fd(name), start, length), _BUFFER
        )
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
                self._verify(index, info)  # a changed byte says so first
            raise ValueError(self._damaged(index, info, f"{type(e).__name__}: {e}")) from None
        if not isinstance(saved, torch.Tensor) or saved.dim() != len(req.lengths):
            raise ValueError(self._damaged(index, info, f"it holds {describe(saved)}"))
        for dim, (first, size) in enumerate(zip(req.storage_offsets, req.lengths, strict=True)):
            if size < saved.size(dim):
                saved = saved.narrow(dim, first, size)
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

    def _check_length(self, index: MetadataIndex, info: Any) -> None:
        """Raise unless the file holds all the bytes DCP stored for ``index``."""
        size = self._opened.size(info.relative_path)
        if size < int(info.offset) + int(info.length):
            raise ValueError(
                self._damaged(index, info, f"the file has {size} bytes, so it is truncated")
            )

    def _verify(self, index: MetadataIndex, info: Any) -> None:
        """Raise unless the bytes stored for ``index`` have the checksum the manifest records."""
        assert self._sums is not None
        want = self._sums.get((index.fqn, tuple(int(i) for i in index.offset or ())))
        if want is None:
            raise ValueError(self._damaged(index, info, "the manifest records no checksum for it"))
        fd, start, length = self._opened.fd(info.relative_path), int(info.offset), int(info.length)
        got = file_checksum(fd, start, length, self._checksum, self._fn)
        if got is None:
            raise ValueError(self._damaged(index, info, "the file ends before it"))
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
