"""A checkpoint directory opened once, so that everything one load reads comes from one save.

A save switches a new directory in at ``path`` and then deletes the previous one's files
(:mod:`pshard._state.atomic`). :class:`OpenedCheckpoint` opens the directory ``path`` names
once (a descriptor of that directory, through ``path``'s symlink if it is one) and every file
after that relative to the descriptor: DCP's ``.metadata``, the manifest and the data files all
come from the directory that was at ``path`` at that moment, never some from the next save's.
A data file, once open, stays readable after the save that replaces the checkpoint deletes it;
a file that is already gone when the load opens it, because the checkpoint was replaced
meanwhile, raises :class:`Replaced` (the load opens ``path`` again).
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from types import TracebackType

__all__ = ["OpenedCheckpoint", "Replaced"]


class Replaced(Exception):
    """The checkpoint at the path was replaced while it was open: a file it names is gone."""


class OpenedCheckpoint:
    """The checkpoint directory at ``path``, opened once (see the module docstring); ``fn``
    names the caller in errors. A context manager: leaving it closes every file it opened.

    Raises:
        FileNotFoundError: nothing at ``path``, or not a directory.
    """

    def __init__(self, path: Path, fn: str) -> None:
        self.path = path
        try:
            self._dir = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        except (FileNotFoundError, NotADirectoryError) as e:
            what = "no such directory" if isinstance(e, FileNotFoundError) else "not a directory"
            raise FileNotFoundError(
                errno.ENOENT, f"{fn}: no checkpoint at {str(path)!r} ({what})"
            ) from None
        self._files: dict[str, int] = {}

    def __enter__(self) -> OpenedCheckpoint:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Close the directory and every data file opened."""
        files, self._files = self._files, {}
        for fd in files.values():
            os.close(fd)
        if self._dir >= 0:
            os.close(self._dir)
            self._dir = -1

    def replaced(self) -> bool:
        """Whether ``path`` now names another directory than the one opened (or nothing)."""
        try:
            now = os.stat(self.path)
        except FileNotFoundError:
            return True
        mine = os.fstat(self._dir)
        return (now.st_dev, now.st_ino) != (mine.st_dev, mine.st_ino)

    def exists(self, name: str) -> bool:
        """Whether the directory holds a regular file ``name``."""
        try:
            st = os.stat(name, dir_fd=self._dir)
        except FileNotFoundError:
            return False
        return stat.S_ISREG(st.st_mode)

    def read_bytes(self, name: str) -> bytes:
        """The whole file ``name`` of the directory.

        Raises:
            Replaced: it is gone and ``path`` names another directory now.
            FileNotFoundError: it is not there.
        """
        fd = self._open(name)
        try:
            with os.fdopen(fd, "rb", closefd=False) as f:
                return f.read()
        finally:
            os.close(fd)

    def open_file(self, name: str) -> None:
        """Open the data file ``name`` now (kept open until :meth:`close`).

        Raises:
            Replaced: it is gone and ``path`` names another directory now.
            FileNotFoundError: it is not there.
        """
        if name not in self._files:
            self._files[name] = self._open(name)

    def fd(self, name: str) -> int:
        """The descriptor of the data file ``name`` (opened first)."""
        self.open_file(name)
        return self._files[name]

    def size(self, name: str) -> int:
        """The size in bytes of the data file ``name`` (opened first)."""
        return os.fstat(self.fd(name)).st_size

    def _open(self, name: str) -> int:
        if os.sep in name or name in ("", ".", ".."):
            raise FileNotFoundError(
                errno.ENOENT, f"{name!r} is not a file name in the checkpoint directory"
            )
        try:
            return os.open(name, os.O_RDONLY, dir_fd=self._dir)
        except FileNotFoundError:
            if self.replaced():
                raise Replaced(name) from None
            raise
