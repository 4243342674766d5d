"""Hugging Face model directories: safetensors files, read and written sharded.

A model directory holds its weights as ``model.safetensors``, or as several
``model-00001-of-0000N.safetensors`` files and ``model.safetensors.index.json`` naming the file
of each tensor. Each safetensors file is an 8-byte little-endian header length, a JSON header
(per tensor its dtype, shape and byte range) and the tensors' bytes, row-major.

Reading (:func:`open_hf`, :class:`HFReader`): pshard reads the headers itself, of the files the
index names (or of ``model.safetensors`` alone; other ``*.safetensors`` files in the directory
are not the model's and are left alone, where torch's ``HuggingFaceStorageReader`` would merge
every one of them), checks that each file is as long as its header says, and gives DCP's load
planner one whole-tensor chunk per key; torch's reader then reads each rank's blocks with
``safetensors.safe_open`` (only the bytes of the slices asked for). Dtypes are compared before
reading (torch's reader would cast with ``copy_``).

**Stacked experts.** Mixture-of-experts models hold every expert's weights in one tensor
(``experts.gate_up_proj``, experts first) where their checkpoints store each expert apart
(``experts.0.gate_proj.weight``, ...). The model adapters name such stacks
(:func:`pshard._modules.adapter.stacked_names`); the reader then shows the stacked tensor in
place of its parts (:class:`_Stack`), and reads each block of it from the parts' slices it
covers: a rank holding some of the experts reads only their bytes.

Writing (:class:`HFWriter`): torch's ``HuggingFaceStorageWriter`` with ``save_distributed``
(each rank writes its own blocks, into ``sharded/`` files of its own; without it every rank
writes the same file name) and consolidation (rank 0 assembles the whole tensors into
``model-0000i-of-0000N.safetensors`` and writes the index), in the aside directory of the
save; pshard then deletes the ``sharded/`` copy it wrote and switches the directory in
(:mod:`pshard._state.atomic`). Safetensors carries no checksums.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import json
import math
import os
import re
import struct
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from .._modules.adapter import stacked_names
from .manifest import LeafRecord, dtype_name, where
from .opened import OpenedCheckpoint

__all__ = [
    "HF_INDEX",
    "HF_SINGLE",
    "HFReader",
    "HFWriter",
    "check_hf_leaf",
    "file_indices",
    "hf_written_name",
    "is_hf",
    "open_hf",
    "remove_sharded",
    "stale_sharded",
]

HF_INDEX = "model.safetensors.index.json"
HF_SINGLE = "model.safetensors"
_SHARDED = "sharded"  # where torch's writer puts each rank's files before consolidating
_NUMBERED = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
_SHARD_FILE = re.compile(r"shard-\d{5}-model-\d{5}-of-\d{5}\.safetensors")
_MAX_FILE_BYTES = 5 * 10**9  # per consolidated file, as save_pretrained's default

# safetensors' dtype names; the writer's consolidation knows the first nine only
_WRITABLE = {
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "I8": torch.int8,
    "U8": torch.uint8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "BF16": torch.bfloat16,
}
_READABLE = {
    **_WRITABLE,
    "BOOL": torch.bool,
    "U16": torch.uint16,
    "U32": torch.uint32,
    "U64": torch.uint64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


def is_hf(opened: OpenedCheckpoint) -> bool:
    """Whether the directory is a Hugging Face model directory (an index or
    ``model.safetensors``)."""
    return opened.exists(HF_INDEX) or opened.exists(HF_SINGLE)


def hf_written_name(name: str) -> bool:
    """Whether pshard's Hugging Face save writes a file named ``name`` in a checkpoint."""
    return name == HF_INDEX or _NUMBERED.fullmatch(name) is not None


# --------------------------------------------------------------------------- reading


@dataclasses.dataclass(frozen=True)
class _Stored:
    """Where a tensor is in a safetensors file (what torch's reader needs: ``relative_path``,
    the file it opens)."""

    relative_path: str
    shape: torch.Size
    dtype: torch.dtype


@dataclasses.dataclass(frozen=True)
class _Stack:
    """A stacked tensor made of per-expert parts: ``parts[e]`` are expert ``e``'s (file, key,
    rows), concatenated on dim 0."""

    parts: tuple[tuple[tuple[str, str, int], ...], ...]
    shape: torch.Size
    dtype: torch.dtype


def _stack(
    name: str, grid: list[list[str]], stored: dict[str, _Stored], where_: str, fn: str
) -> _Stack:
    """The stack ``name`` of the parts ``grid`` names (their shapes and dtypes checked)."""
    first = stored[grid[0][0]]
    rows = [stored[k].shape[0] for k in grid[0]]
    for e, keys in enumerate(grid):
        for k, n in zip(keys, rows, strict=True):
            s = stored[k]
            if s.dtype != first.dtype or len(s.shape) != 2 or s.shape != (n, first.shape[1]):
                raise ValueError(
                    f"{fn}: the Hugging Face checkpoint at {where_!r} stores {name!r} per expert, "
                    f"but {k!r} ({dtype_name(s.dtype)}, shape {tuple(s.shape)}) does not stack "
                    f"with {grid[0][0]!r} ({dtype_name(first.dtype)}, shape "
                    f"{tuple(first.shape)}) as expert {e}"
                )
    parts = tuple(
        tuple((stored[k].relative_path, k, n) for k, n in zip(keys, rows, strict=True))
        for keys in grid
    )
    return _Stack(parts, torch.Size([len(grid), sum(rows), first.shape[1]]), first.dtype)


def _header(opened: OpenedCheckpoint, name: str, where_: str, fn: str) -> tuple[dict, int]:
    """The JSON header of the file ``name`` and where its data begins.

    Raises:
        ValueError: not a safetensors file, or shorter than its header says.
    """
    fd, size = opened.fd(name), opened.size(name)

    def damaged(why: str) -> ValueError:
        return ValueError(
            f"{fn}: the Hugging Face checkpoint at {where_!r} is damaged: its file {name!r} "
            f"{why}; restore it or load another checkpoint"
        )

    head = os.pread(fd, 8, 0)
    if len(head) < 8:
        raise damaged(f"has {size} bytes, fewer than a safetensors header")
    (length,) = struct.unpack("<Q", head)
    if 8 + length > size:
        raise damaged(f"has {size} bytes but its header says it alone takes {8 + length}")
    try:
        header = json.loads(os.pread(fd, length, 8))
    except ValueError as e:
        raise damaged(f"has no safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise damaged("has no safetensors header")
    data_start = 8 + length
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        try:
            begin, end = (int(i) for i in entry["data_offsets"])
            shape = tuple(int(n) for n in entry["shape"])
            dtype = _READABLE[entry["dtype"]]
        except (KeyError, TypeError, ValueError):
            raise damaged(
                f"describes {key!r} as {entry!r}, which pshard does not read (a dtype of "
                f"{sorted(_READABLE)}, a shape and data_offsets)"
            ) from None
        want = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if end - begin != want:
            raise damaged(
                f"gives {key!r} ({dtype_name(dtype)}, shape {shape}) {end - begin} bytes where "
                f"it takes {want}"
            )
        if data_start + end > size:
            raise damaged(
                f"has {size} bytes but its header puts {key!r} at bytes {data_start + begin}.."
                f"{data_start + end}, so it is truncated"
            )
    return header, data_start


def open_hf(
    opened: OpenedCheckpoint, where_: str, fn: str
) -> tuple[Metadata, dict[str, LeafRecord], str]:
    """DCP's metadata of the model directory ``opened`` (one whole chunk per tensor), a
    record per key, and a digest of its index and headers.

    Raises:
        FileNotFoundError: a file the index names is missing.
        ValueError: a damaged file or index (named), or a key the index puts in a file that
            does not hold it.
    """
    digest = hashlib.sha256()
    if opened.exists(HF_INDEX):
        text = opened.read_bytes(HF_INDEX)
        digest.update(text)
        try:
            weight_map = json.loads(text)["weight_map"]
            files: dict[str, list[str]] = {}
            for key, file in weight_map.items():
                files.setdefault(str(file), []).append(str(key))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(
                f"{fn}: the Hugging Face checkpoint at {where_!r} has an index {HF_INDEX!r} "
                f"without a weight_map of key -> file ({type(e).__name__}: {e})"
            ) from None
    else:
        files = {HF_SINGLE: []}  # every key of the file
    stored: dict[str, _Stored] = {}
    for name, keys in sorted(files.items()):
        try:
            header, _ = _header(opened, name, where_, fn)
        except FileNotFoundError:
            raise FileNotFoundError(
                errno.ENOENT,
                f"{fn}: the Hugging Face checkpoint at {where_!r} is damaged: its file {name!r}, "
                f"which the index names for {len(keys)} keys ({keys[0]!r}, ...), is missing",
            ) from None
        digest.update(name.encode() + json.dumps(header, sort_keys=True).encode())
        for key in keys or [k for k in header if k != "__metadata__"]:
            entry = header.get(key)
            if entry is None or key == "__metadata__":
                raise ValueError(
                    f"{fn}: the Hugging Face checkpoint at {where_!r} is inconsistent: its "
                    f"index puts {key!r} in {name!r}, which does not hold it"
                )
            shape = torch.Size(int(n) for n in entry["shape"])
            stored[key] = _Stored(name, shape, _READABLE[entry["dtype"]])
    tensors: dict[str, _Stored | _Stack] = dict(stored)
    for name, grid in stacked_names(set(stored)).items():
        for keys in grid:
            for k in keys:
                tensors.pop(k, None)
        tensors[name] = _stack(name, grid, stored, where_, fn)
    state: dict[str, TensorStorageMetadata] = {}
    storage: dict[MetadataIndex, _Stored | _Stack] = {}
    records: dict[str, LeafRecord] = {}
    for key, t in tensors.items():
        origin = torch.Size([0] * len(t.shape))
        state[key] = TensorStorageMetadata(
            TensorProperties(dtype=t.dtype), t.shape, [ChunkStorageMetadata(origin, t.shape)]
        )
        storage[MetadataIndex(key, origin)] = t
        records[key] = LeafRecord((key,), "tensor", tuple(t.shape), t.dtype)
    md = Metadata(state_dict_metadata=dict(state), storage_data=storage)
    md.storage_meta = StorageMeta()
    return md, records, digest.hexdigest()


class HFReader(HuggingFaceStorageReader):
    """torch's ``HuggingFaceStorageReader`` over the metadata :func:`open_hf` read, reading
    the files through an :class:`OpenedCheckpoint` (each opened once; kept readable if a save
    replaces the directory meanwhile)."""

    def __init__(self, opened: OpenedCheckpoint, where_: str, fn: str) -> None:
        super().__init__(path=os.fspath(opened.path))
        self._opened = opened
        self._where = where_
        self._fn = fn
        self._through: set[MetadataIndex] = set()  # storage entries read through a descriptor

    def open_files(self, plan: LoadPlan) -> None:
        """Open every file ``plan`` reads, and read them through those descriptors.

        Raises:
            Replaced: a file is gone because the directory was replaced.
        """
        for item in plan.items:
            if item.storage_index in self._through:
                continue
            stored: _Stored | _Stack = self.storage_data[item.storage_index]
            if isinstance(stored, _Stack):
                parts = tuple(
                    tuple((self._path(file), key, n) for file, key, n in expert)
                    for expert in stored.parts
                )
                self.storage_data[item.storage_index] = dataclasses.replace(stored, parts=parts)
            else:
                self.storage_data[item.storage_index] = dataclasses.replace(
                    stored, relative_path=self._path(stored.relative_path)
                )
            self._through.add(item.storage_index)

    def _path(self, file: str) -> str:
        """Where to open ``file``: through the descriptor the checkpoint holds open."""
        proc = Path("/proc/self/fd")
        fd = self._opened.fd(file)
        return os.fspath(proc / str(fd) if proc.is_dir() else self._opened.path / file)

    def _read_stacks(self, items: list[ReadItem], planner: LoadPlanner) -> None:
        """Each block of a stacked tensor from the slices of its parts it covers."""
        from safetensors import safe_open

        with contextlib.ExitStack() as files:
            opened: dict[str, Any] = {}
            for req in items:
                stack: _Stack = self.storage_data[req.storage_index]
                (e0, r0, c0), (ne, nr, nc) = req.storage_offsets, req.lengths
                block = torch.empty((ne, nr, nc), dtype=stack.dtype)
                for i in range(ne):
                    start = 0
                    for file, key, n in stack.parts[e0 + i]:
                        lo, hi = max(r0, start), min(r0 + nr, start + n)
                        if lo < hi:
                            if file not in opened:
                                opened[file] = files.enter_context(safe_open(file, "pt"))
                            part = opened[file].get_slice(key)
                            block[i, lo - r0 : hi - r0] = part[
                                lo - start : hi - start, c0 : c0 + nc
                            ]
                        start += n
                target = planner.resolve_tensor(req).detach()
                target.copy_(block.view(target.shape))
                planner.commit_tensor(req, target)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        self.open_files(plan)
        stacks = [i for i in plan.items if isinstance(self.storage_data[i.storage_index], _Stack)]
        if stacks:
            rest = [
                i for i in plan.items if not isinstance(self.storage_data[i.storage_index], _Stack)
            ]
            plan = dataclasses.replace(plan, items=rest)
        try:
            self._read_stacks(stacks, planner)
            return super().read_data(plan, planner)
        except Exception as e:
            raise ValueError(
                f"{self._fn}: could not read the Hugging Face checkpoint at {self._where!r} "
                f"({type(e).__name__}: {e}); restore it or load another checkpoint"
            ) from e


# --------------------------------------------------------------------------- writing


def check_hf_leaf(record: LeafRecord, fn: str) -> None:
    """Raise unless ``record`` is a leaf a Hugging Face checkpoint holds: a tensor of a dtype
    safetensors and torch's consolidation write.

    Raises:
        TypeError: a plain value, an RNG state, ``None``; a dtype it cannot write.
    """
    here = f"{fn} {where(record.path)}"
    if record.kind not in ("global", "tensor"):
        raise TypeError(
            f"{here}: format='huggingface' writes a model's weights only (tensors, "
            f"GlobalTensors, DTensors), not {record.kind} leaves; leave the step, RNG states "
            f"and other values out, or save them with format='dcp'"
        )
    if record.dtype not in _WRITABLE.values():
        names = ", ".join(dtype_name(d) for d in _WRITABLE.values())
        raise TypeError(
            f"{here}: format='huggingface' writes {names}, not "
            f"{dtype_name(record.dtype) if record.dtype else record.dtype}; cast it first"
        )


def file_indices(records: list[LeafRecord]) -> dict[str, int]:
    """Each key's consolidated file (1, 2, ...), in order, each file up to 5 GB."""
    out: dict[str, int] = {}
    index, size = 1, 0
    for r in records:
        assert r.dtype is not None
        n = math.prod(r.shape) * torch.empty((), dtype=r.dtype).element_size()
        if size and size + n > _MAX_FILE_BYTES:
            index, size = index + 1, 0
        out[r.fqn] = index
        size += n
    return out


class HFWriter(HuggingFaceStorageWriter):
    """torch's ``HuggingFaceStorageWriter`` into the aside directory, every rank writing its
    own blocks and rank 0 consolidating them (``save_distributed``, ``enable_consolidation``),
    naming the final path and the save's id."""

    def __init__(self, aside: Path, final: Path, save_id: str, files: dict[str, int]) -> None:
        super().__init__(
            os.fspath(aside),
            fqn_to_index_mapping=files,
            save_distributed=True,
            enable_consolidation=True,
        )
        self._final = final
        self.save_id = save_id

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=os.fspath(self._final), save_id=self.save_id)


def remove_sharded(aside: Path) -> None:
    """Delete the ``sharded/`` copy torch's writer leaves in ``aside`` (the files it wrote
    there, then the directory), and make the consolidated files durable."""
    sharded = aside / _SHARDED
    if sharded.is_dir():
        for entry in sharded.iterdir():
            if _SHARD_FILE.fullmatch(entry.name) and entry.is_file():
                entry.unlink()
        sharded.rmdir()
    for entry in aside.iterdir():
        if hf_written_name(entry.name):
            fd = os.open(entry, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def stale_sharded(directory: Path) -> None:
    """Delete a ``sharded/`` directory of shard files that a killed save left in
    ``directory`` (an aside directory), keeping anything else."""
    sharded = directory / _SHARDED
    if not sharded.is_dir() or sharded.is_symlink():
        return
    for entry in sharded.iterdir():
        if _SHARD_FILE.fullmatch(entry.name) and entry.is_file() and not entry.is_symlink():
            entry.unlink(missing_ok=True)
    try:
        sharded.rmdir()
    except OSError:  # not empty: what stays is not pshard's to delete
        pass
