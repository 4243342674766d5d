"""Reading a DCP checkpoint directory without running an arbitrary pickle.

DCP's ``.metadata`` file is a pickle of its ``Metadata`` dataclasses, and its
``FileSystemReader`` opens it with ``pickle.load``, which runs whatever the file names.
:class:`CheckpointReader` is that reader with the metadata read by an unpickler that builds only
DCP's metadata classes, torch's sizes, dtypes, layouts and memory formats, and paths; anything
else in the file is refused (``pickle.UnpicklingError``). Tensor data is read as DCP reads it,
with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from .._compat import dcp_metadata_classes

__all__ = ["DCP_METADATA", "CheckpointReader", "read_dcp_metadata"]

#: The name of DCP's metadata file in a checkpoint directory.
DCP_METADATA = ".metadata"

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
    with open(Path(directory) / DCP_METADATA, "rb") as f:
        metadata = _MetadataUnpickler(f).load()
    if not isinstance(metadata, Metadata):
        raise pickle.UnpicklingError(
            f"{Path(directory) / DCP_METADATA} holds {type(metadata).__name__}, not DCP Metadata"
        )
    return metadata


class CheckpointReader(FileSystemReader):
    """DCP's ``FileSystemReader`` whose metadata is read by :func:`read_dcp_metadata`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            raise FileNotFoundError(
                f"{self.path}: pshard reads checkpoints with one global {DCP_METADATA}"
            )
        metadata = read_dcp_metadata(self.path)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        assert metadata.storage_meta is not None
        metadata.storage_meta.load_id = self.load_id
        return metadata
