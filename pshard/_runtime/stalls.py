"""Where a rank waits, and whether it waits for a rank that has left.

Worker side, :func:`position`: what a worker's main thread is doing, read from its frames (by
the worker's watch thread, when the caller asks): computing, or inside a collective (a frame of
torch.distributed's c10d module or of pshard's wire). Debug mode's checks wait on the store with
a timeout and an error of their own, so they are not counted.

Caller side, :class:`Watch`: once a rank has returned, the caller of a gang asks every running
rank where it is every :data:`PROBE_S` seconds and keeps, for each, since when it has been at
the same place. A rank inside the same collective for :data:`STUCK_S` seconds while another has
returned waits for a rank that has left: an error.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Collection
from dataclasses import dataclass
from types import FrameType
from typing import Literal

from .messages import ranks_text

__all__ = ["PROBE_S", "STUCK_S", "Position", "Watch", "position"]

#: Once a rank has returned, how often the caller asks the others where they are.
PROBE_S = 1.0
#: How long a rank may wait in the same collective after another has returned before that is
#: an error (its peer has returned).
STUCK_S = 3.0

# frames of these files mean "inside a collective" (a torch.distributed call, or pshard's raw
# communication)
_COLLECTIVE_FILES = (
    os.path.join("torch", "distributed", "distributed_c10d.py"),
    os.path.join("pshard", "_runtime", "wire.py"),
)
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


@dataclass(frozen=True)
class Position:
    """Where a worker's main thread is: ``kind`` ``"computing"`` (in no collective) or
    ``"collective"``; ``what`` names the collective, ``caller`` the innermost frame of the
    program around it."""

    kind: Literal["computing", "collective"]
    what: str = ""
    caller: str = ""

    @property
    def inside(self) -> bool:
        return self.kind != "computing"

    def describe(self) -> str:
        """``"all_reduce in distributed_c10d.py, called from f (a.py:3)"``."""
        return f"{self.what}, called from {self.caller}"


# ----------------------------------------------------------------------------- worker side


def position(thread: int | None) -> Position:
    """Where ``thread`` (a thread id; a worker's main thread) is now."""
    frame = sys._current_frames().get(thread) if thread is not None else None
    frames: list[FrameType] = []
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    frames.reverse()  # outermost first
    inside = [i for i, f in enumerate(frames) if f.f_code.co_filename.endswith(_COLLECTIVE_FILES)]
    if not inside:
        return Position("computing")
    last = frames[inside[-1]].f_code
    what = f"{last.co_name} in {os.path.basename(last.co_filename)}"
    return Position("collective", what, _caller(frames, inside[0]))


def _library(frame: FrameType) -> bool:
    path = frame.f_code.co_filename
    return "torch" in path.split(os.sep) or path.startswith(_PACKAGE_DIR)


def _caller(frames: list[FrameType], inner: int) -> str:
    """The innermost frame of the program (not torch's, not pshard's) outside ``inner``."""
    f = next((f for f in reversed(frames[:inner]) if not _library(f)), frames[inner])
    return f"{f.f_code.co_name} ({f.f_code.co_filename}:{f.f_lineno})"


# ----------------------------------------------------------------------------- caller side


class Watch:
    """Where each running rank of a gang was seen, and since when (see the module docs)."""

    def __init__(self, nprocs: int, caller: str) -> None:
        self._nprocs = nprocs
        self._caller = caller
        self._seen: dict[int, tuple[Position, float]] = {}

    def see(self, rank: int, where: Position | None, now: float) -> None:
        """Record where ``rank`` is (``None``: it did not say)."""
        old = self._seen.get(rank)
        if where is None:
            self._seen.pop(rank, None)
        else:
            same = old is not None and old[0] == where
            self._seen[rank] = (where, old[1] if same and old is not None else now)

    def stall(self, running: Collection[int], returned: Collection[int], now: float) -> str | None:
        """The error text when a rank of ``running`` waits for ranks that have ``returned``, or
        ``None`` while none does."""
        for rank in sorted(running):
            seen = self._seen.get(rank)
            if returned and seen is not None and seen[0].inside and now - seen[1] >= STUCK_S:
                return (
                    f"{self._caller}: {ranks_text(returned)} of {self._nprocs} returned while "
                    f"rank {rank} is still waiting in a collective ({seen[0].describe()}) for "
                    f"more than {STUCK_S:g} s: every rank must call the same collectives, and "
                    f"the returning rank never called this one; all ranks were terminated"
                )
        return None
