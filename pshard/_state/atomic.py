"""Writing a checkpoint aside and switching it in, in one step.

A save writes into a sibling of ``path`` (``.<name>.pshard-<token>``, same parent, same
filesystem) and, once every rank has written and DCP's metadata is in place, rank 0 switches
it in with one atomic rename, so ``path`` always holds a whole checkpoint, the previous one
until the switch and the new one after; there is no moment when it does not exist:

- ``path`` is a directory (a previous checkpoint): the two directories trade names in one
  ``renameat2(RENAME_EXCHANGE)`` (Linux), then the previous one, now aside, is deleted;
- ``path`` does not exist: the aside directory is renamed to it;
- the filesystem cannot exchange (not Linux, or NFS and others without ``RENAME_EXCHANGE``):
  ``path`` is a symlink to the aside directory, switched by ``os.replace`` of a new symlink
  over it (atomic on POSIX); DCP's ``FileSystemReader`` opens it like a directory.

Saves into one parent directory take an exclusive ``flock`` on it (rank 0, from the start of a
save to its switch), so they switch in the order they were called, an async save included, and
the aside directories a killed save left behind are removed by the next save of that path.

Nothing pshard did not write is deleted: :func:`check_target` accepts a directory at ``path``
only when each entry is a file pshard or DCP writes (checked again right before the switch),
and removing a previous checkpoint or a stale aside directory deletes only such files (the
directory too once that empties it).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import json
import os
import re
import sys
import uuid
from pathlib import Path

from .hf import HF_INDEX, hf_written_name, stale_sharded
from .manifest import FORMAT, MANIFEST
from .reader import DCP_METADATA, read_dcp_metadata

__all__ = [
    "SaveLock",
    "aside_path",
    "check_target",
    "check_writable",
    "new_token",
    "remove_stale",
    "store_path",
    "switch",
    "writable_error",
]

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
_UNSUPPORTED = frozenset({errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV})
# the files pshard and DCP's writer put in a checkpoint directory (``.metadata.tmp``: DCP's
# metadata while it is written, left by a killed save)
_WRITTEN = frozenset({DCP_METADATA, f"{DCP_METADATA}.tmp", MANIFEST})
_DCP_DATA = re.compile(r"__\d+_\d+\.distcp")
_SHOWN = 10  # foreign entries named in an error


def new_token() -> str:
    """A fresh name part for an aside directory (32 hex digits)."""
    return uuid.uuid4().hex


def aside_path(path: Path, token: str) -> Path:
    """The aside directory of ``path`` for the save ``token``."""
    return path.parent / f".{path.name}.pshard-{token}"


def store_path(aside: Path) -> Path:
    """The file store of an async save's exchanges, beside its aside directory."""
    return aside.with_name(f"{aside.name}-store")


def _aside_pattern(path: Path) -> re.Pattern[str]:
    return re.compile(rf"\.{re.escape(path.name)}\.pshard-[0-9a-f]{{32}}(-link|-probe[01]|-store)?")


def _written_name(name: str) -> bool:
    """Whether pshard or DCP's writer names a file in a checkpoint directory ``name`` (a DCP
    checkpoint's, or a Hugging Face one's that pshard writes)."""
    return name in _WRITTEN or _DCP_DATA.fullmatch(name) is not None or hf_written_name(name)


def _is_dcp_metadata(file: Path) -> bool:
    try:
        read_dcp_metadata(file.parent)
    except Exception:  # not a pickle, or one of something else: either way not DCP's
        return False
    return True


def _is_manifest(file: Path) -> bool:
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return False
    return isinstance(data, dict) and data.get("format") == FORMAT


def _is_hf_index(file: Path) -> bool:
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return False
    return isinstance(data, dict) and isinstance(data.get("weight_map"), dict)


def _written(entry: Path) -> bool:
    """Whether ``entry`` of a directory is a file pshard or DCP writes (``.metadata`` that
    parses as DCP's metadata, ``pshard.json`` that is a manifest)."""
    if entry.is_symlink() or not entry.is_file() or not _written_name(entry.name):
        return False
    if entry.name == DCP_METADATA:
        return _is_dcp_metadata(entry)
    if entry.name == MANIFEST:
        return _is_manifest(entry)
    if entry.name == HF_INDEX:
        return _is_hf_index(entry)
    return True


def _listing(entries: list[Path]) -> str:
    names = [repr(e.name + ("/" if e.is_dir() and not e.is_symlink() else "")) for e in entries]
    shown = ", ".join(names[:_SHOWN])
    return shown if len(names) <= _SHOWN else f"{shown} and {len(names) - _SHOWN} more"


def check_target(path: Path, fn: str, ours: tuple[str, ...] = ()) -> None:
    """Raise unless ``path`` may be replaced by a checkpoint: it does not exist, or is a
    directory each of whose entries is a file pshard or DCP writes (``.metadata`` that parses
    as DCP's metadata, ``__<rank>_<n>.distcp``, ``pshard.json`` that is a manifest,
    ``.metadata.tmp``): an empty directory or a checkpoint, never one holding anything else.

    ``ours``: names of files this save writes too (a model's ``config.json``), which it may
    replace.

    Raises:
        ValueError: ``path`` is a file, or a directory holding something else (each such
            entry named).
    """
    if not os.path.lexists(path):
        return
    if not path.is_dir():
        raise ValueError(f"{fn}: {str(path)!r} exists and is not a directory")
    foreign = sorted(
        (e for e in path.iterdir() if not _written(e) and not (e.name in ours and e.is_file())),
        key=lambda e: e.name,
    )
    if not foreign:
        return
    metadata, index = path / DCP_METADATA, path / HF_INDEX
    if metadata not in foreign and metadata.exists():
        head = "holds a checkpoint and"
    elif index not in foreign and index.exists():
        head = "holds a Hugging Face checkpoint and"
    else:
        head = f"is a directory that holds no checkpoint (no {DCP_METADATA} DCP wrote) and"
    raise ValueError(
        f"{fn}: {str(path)!r} {head} entries pshard did not write: {_listing(foreign)}; a save "
        f"replaces the whole directory and would delete them, so pshard writes only over an "
        f"empty directory or a checkpoint it or DCP wrote: save into a fresh directory or a "
        f"subdirectory, or move them away"
    )


def writable_error(path: Path, fn: str) -> PermissionError:
    """The error of a save that may not create files beside ``path``."""
    return PermissionError(
        errno.EACCES,
        f"{fn}: cannot write a checkpoint at {str(path)!r}: this process may not create files in "
        f"its directory {str(path.parent)!r} (a save writes the checkpoint beside the path, as "
        f"'.{path.name}.pshard-<id>', then renames it to the path); make that directory "
        f"writable, or save elsewhere",
    )


def check_writable(path: Path, fn: str) -> None:
    """Raise unless this process may create ``path``'s parent (if missing) and files in it.

    Raises:
        PermissionError: it may not (``path`` and the directory named).
    """
    directory = path.parent
    while not directory.exists() and directory != directory.parent:
        directory = directory.parent
    if not os.access(directory, os.W_OK | os.X_OK):
        if directory != path.parent:
            raise PermissionError(
                errno.EACCES,
                f"{fn}: cannot write a checkpoint at {str(path)!r}: its directory "
                f"{str(path.parent)!r} does not exist and this process may not create it in "
                f"{str(directory)!r}; make that directory writable, or save elsewhere",
            )
        raise writable_error(path, fn)


class SaveLock:
    """An exclusive ``flock`` on a save's parent directory (see the module docstring)."""

    def __init__(self, parent: Path) -> None:
        parent.mkdir(parents=True, exist_ok=True)
        self._fd: int | None = os.open(parent, os.O_RDONLY)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
        except BaseException:
            os.close(self._fd)
            raise

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)


def _live_target(path: Path) -> str | None:
    return os.readlink(path) if path.is_symlink() else None


def remove_stale(path: Path) -> list[Path]:
    """Delete the aside directories of ``path`` that no save holds (killed saves'); call it
    holding the :class:`SaveLock`. Returns what was deleted."""
    pattern, live = _aside_pattern(path), _live_target(path)
    removed: list[Path] = []
    if not path.parent.is_dir():
        return removed
    for entry in path.parent.iterdir():
        if entry.name == live or not pattern.fullmatch(entry.name):
            continue
        _remove(entry)
        removed.append(entry)
    return removed


def _remove(entry: Path) -> None:
    """Delete ``entry``, an aside-named entry a save made: a symlink or file, or a directory's
    files that pshard or DCP write and then the directory if that empties it. Anything else
    in it (put there meanwhile by someone else) stays, and so does the directory."""
    if entry.is_symlink() or not entry.is_dir():
        entry.unlink(missing_ok=True)
        return
    stale_sharded(entry)  # a killed Hugging Face save's
    with contextlib.suppress(FileNotFoundError):
        for child in entry.iterdir():
            if _written_name(child.name) and child.is_file() and not child.is_symlink():
                child.unlink(missing_ok=True)
    with contextlib.suppress(OSError):  # not empty: what stays is not pshard's to delete
        entry.rmdir()


def _exchange(a: Path, b: Path) -> bool:
    """Swap the names ``a`` and ``b`` in one step; False where the OS or filesystem cannot."""
    if sys.platform != "linux":
        return False
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p]
    renameat2.argtypes += [ctypes.c_uint]
    rc = renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if rc == 0:
        return True
    code = ctypes.get_errno()
    if code in _UNSUPPORTED:
        return False
    raise OSError(code, os.strerror(code), str(a), None, str(b))


def _exchange_supported(aside: Path) -> bool:
    probes = [aside.with_name(f"{aside.name}-probe{i}") for i in range(2)]
    try:
        for probe in probes:
            probe.mkdir()
        return _exchange(*probes)
    finally:
        for probe in probes:
            with contextlib.suppress(OSError):
                probe.rmdir()


def _link(aside: Path, path: Path) -> None:
    """Point the symlink ``path`` at ``aside`` with one ``os.replace``; delete the previous
    target if it is an aside directory."""
    previous = _live_target(path)
    link = aside.with_name(f"{aside.name}-link")
    os.symlink(aside.name, link, target_is_directory=True)
    os.replace(link, path)
    if previous is not None and _aside_pattern(path).fullmatch(previous):
        _remove(path.parent / previous)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def switch(aside: Path, path: Path, fn: str, ours: tuple[str, ...] = ()) -> None:
    """Make the complete checkpoint in ``aside`` the one at ``path`` in one atomic step, then
    delete the previous one (see the module docstring).

    Raises:
        ValueError: ``path`` now holds something pshard did not write (:func:`check_target`,
            again: a file put there while the ranks wrote); nothing at ``path`` changed.
        OSError: ``path`` is a directory and the filesystem can neither exchange two
            directories nor was the checkpoint there written as a symlink (the new checkpoint
            stays at ``aside``; nothing at ``path`` changed).
    """
    check_target(path, fn, ours)
    _fsync_dir(aside)
    if path.is_symlink():
        _link(aside, path)
    elif path.exists():
        if not _exchange(aside, path):
            raise OSError(
                errno.ENOTSUP,
                f"{fn}: {str(path)!r} is a directory and this filesystem cannot swap two "
                f"directories in one step (renameat2 RENAME_EXCHANGE), so the new checkpoint "
                f"stays at {str(aside)!r} and {str(path)!r} is unchanged; move it away once, "
                f"then pshard keeps it a symlink it can switch atomically",
            )
        _remove(aside)  # the previous checkpoint, now aside
    elif _exchange_supported(aside):
        os.rename(aside, path)
    else:
        _link(aside, path)
    _fsync_dir(path.parent)
