"""The checksum of a saved chunk: CRC-32C where the ``crc32c`` package (hardware CRC-32C,
about 11 GB/s on one core here) is installed, else the standard library's CRC-32 (``zlib``,
about 2 GB/s). A save uses CRC-32C when every rank has the package; the manifest names the
checksum it holds, and a load computes that one (checkpoints saved with CRC-32 stay readable
everywhere; one saved with CRC-32C needs the package to be verified).

Internal interface: :data:`CRC32`, :data:`CRC32C`, :func:`preferred`, :func:`file_checksum`.
"""

from __future__ import annotations

import importlib
import mmap
import os
import zlib
from collections.abc import Callable
from typing import Any

__all__ = ["ALGORITHMS", "CRC32", "CRC32C", "file_checksum", "preferred"]

CRC32 = "crc32"
CRC32C = "crc32c"
ALGORITHMS = (CRC32, CRC32C)

_BUFFER = 1 << 24  # bytes read at a time where a chunk is read in pieces
_MAPPED = 1 << 20  # chunks of this many bytes or more are checked where they lie, mapped


def _mapped(fd: int, start: int, length: int, update: Callable[[Any, int], int]) -> int | None:
    """The checksum of the bytes mapped from the file (no copy out of the page cache), or
    ``None`` where the file cannot be mapped."""
    offset = start - start % mmap.ALLOCATIONGRANULARITY
    try:
        with mmap.mmap(fd, start + length - offset, access=mmap.ACCESS_READ, offset=offset) as m:
            view = memoryview(m)
            try:
                crc, at = 0, start - offset
                while at < start - offset + length:  # in pieces: the GIL is let go between them
                    end = min(at + _BUFFER, start - offset + length)
                    crc = update(view[at:end], crc)
                    at = end
                return crc
            finally:
                view.release()
    except (OSError, ValueError):
        return None


def _crc32c() -> Any:
    """The ``crc32c`` module when it is installed and computes in hardware, else ``None``."""
    try:
        module = importlib.import_module("crc32c")
    except ImportError:
        return None
    return module if getattr(module, "hardware_based", False) else None


def preferred() -> str:
    """The checksum this process computes fastest."""
    return CRC32C if _crc32c() is not None else CRC32


def _update(algorithm: str, fn: str) -> Callable[[Any, int], int]:
    if algorithm == CRC32:
        return zlib.crc32
    module = _crc32c() if algorithm == CRC32C else None
    if module is None:
        raise ValueError(
            f"{fn}: the checkpoint's checksums are {algorithm!r}, which this process cannot "
            f"compute in hardware; install the 'crc32c' package (pip install crc32c, or "
            f"pshard[fast]), or load without checking them (verify=False)"
        )
    crc32c: Callable[[Any, int], int] = module.crc32c
    return crc32c


def file_checksum(fd: int, start: int, length: int, algorithm: str, fn: str) -> int | None:
    """The checksum ``algorithm`` of the ``length`` bytes of the file ``fd`` from ``start``
    (mapped where they lie when they are 1 MiB or more, else read; in pieces of 16 MiB);
    ``None`` where the file ends first.

    Raises:
        ValueError: ``algorithm`` cannot be computed here (naming the fix).
    """
    update = _update(algorithm, fn)
    if length and os.fstat(fd).st_size < start + length:
        return None
    if length >= _MAPPED:
        mapped = _mapped(fd, start, length, update)
        if mapped is not None:
            return mapped
    buffer = bytearray(min(_BUFFER, max(length, 1)))
    view = memoryview(buffer)
    crc, done = 0, 0
    while done < length:
        n = os.preadv(fd, [view[: min(len(buffer), length - done)]], start + done)
        if n == 0:
            return None
        crc = update(view[:n], crc)
        done += n
    return crc
