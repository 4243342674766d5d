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
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import re
import shutil
import sys
import uuid
from pathlib import Path

from .reader import DCP_METADATA

__all__ = ["SaveLock", "aside_path", "check_target", "new_token", "remove_stale", "switch"]

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
_UNSUPPORTED = frozenset({errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV})


def new_token() -> str:
    """A fresh name part for an aside directory (32 hex digits)."""
    return uuid.uuid4().hex


def aside_path(path: Path, token: str) -> Path:
    """The aside directory of ``path`` for the save ``token``."""
    return path.parent / f".{path.name}.pshard-{token}"


def _aside_pattern(path: Path) -> re.Pattern[str]:
    return re.compile(rf"\.{re.escape(path.name)}\.pshard-[0-9a-f]{{32}}(-link|-probe[01])?")


def check_target(path: Path, fn: str) -> None:
    """Raise unless ``path`` may be replaced by a checkpoint: it does not exist, or is a
    directory that is empty or holds a DCP checkpoint (never another directory's contents).

    Raises:
        ValueError: ``path`` is a file, or a directory holding something else.
    """
    if not os.path.lexists(path):
        return
    if not path.is_dir():
        raise ValueError(f"{fn}: {str(path)!r} exists and is not a directory")
    if not (path / DCP_METADATA).exists() and any(path.iterdir()):
        raise ValueError(
            f"{fn}: {str(path)!r} is a directory that holds no checkpoint (no {DCP_METADATA}); "
            f"a save replaces the whole directory, so pshard writes only over an empty one or "
            f"a checkpoint: choose another path or empty it"
        )


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
    if entry.is_symlink() or not entry.is_dir():
        entry.unlink(missing_ok=True)
    else:
        shutil.rmtree(entry, ignore_errors=True)


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


def switch(aside: Path, path: Path, fn: str) -> None:
    """Make the complete checkpoint in ``aside`` the one at ``path`` in one atomic step, then
    delete the previous one (see the module docstring).

    Raises:
        OSError: ``path`` is a directory and the filesystem can neither exchange two
            directories nor was the checkpoint there written as a symlink (the new checkpoint
            stays at ``aside``; nothing at ``path`` changed).
    """
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
