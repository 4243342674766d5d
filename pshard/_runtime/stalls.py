"""Where a rank waits, and which ranks wait for each other for good.

Worker side, :func:`position`: what a worker's main thread is doing, read from its frames (by
the worker's watch thread, when the caller asks): computing, waiting in debug mode's check
before a collective (:func:`pshard._runtime.debug.waiting`), or inside a collective (a frame of
torch.distributed's c10d module or of pshard's wire), with the group it runs on.

Caller side, :class:`Watch`: the caller of a gang asks every running rank where it is every
:data:`PROBE_S` seconds and keeps, for each, since when it has been at the same place. A rank
at the same collective (or the same check) for :data:`STUCK_S` seconds is *stuck*, and the run
cannot finish when

- a rank is stuck waiting for a rank that has returned (when its group is not known: any
  rank has returned): it waits for a rank that has left; or
- a rank is stuck in a check, and every rank it waits for is stuck too (or has returned), and
  every rank those wait for, and so on: they wait for each other. A rank waits in a check for
  the ranks of its group that are not in the same check, and in a collective for the ranks of
  its group that are not in a collective on that group (none: the collective is under way).
  Ranks computing, or in collectives that are under way, may still come, so nothing is said.

A check whose own timeout (``PSHARD_DEBUG_TIMEOUT``) ends within ``_OWN_S`` seconds is left to
report itself. Without debug mode only the first rule applies: ranks that wait in different
collectives with nobody returned look like slow collectives from outside.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from types import FrameType, MappingProxyType
from typing import Literal

import torch.distributed as dist

from .debug import group_key, waiting
from .messages import ranks_text
from .wire import Comm

__all__ = ["PROBE_S", "STUCK_S", "Position", "Watch", "position"]

#: Once a call runs, how often the caller asks every running rank where it is.
PROBE_S = 1.0
#: How long a rank may wait at the same collective, with its peers stuck or gone, before that
#: is an error.
STUCK_S = 3.0
# A check whose own timeout ends within this many seconds reports itself.
_OWN_S = 2.0

# frames of these files mean "inside a collective" (a torch.distributed call, or pshard's raw
# communication)
_COLLECTIVE_FILES = (
    os.path.join("torch", "distributed", "distributed_c10d.py"),
    os.path.join("pshard", "_runtime", "wire.py"),
)
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


@dataclass(frozen=True)
class Position:
    """Where a worker's main thread is.

    ``kind``: ``"computing"`` (in no collective), ``"check"`` (debug mode's check before a
    collective, waiting for the other ranks' calls) or ``"collective"``. ``what`` names the
    collective, ``caller`` the innermost frame of the program around it; ``group`` and
    ``members`` (global ranks) are its group's, empty when unknown; ``step`` is a check's
    sequence number on its group; ``debug`` whether debug mode was on in a pshard collective
    (``None``: not known); ``left_s`` the seconds left before a check's own timeout (not part of
    the comparison: a rank is at the same place while only that changes).
    """

    kind: Literal["computing", "check", "collective"]
    what: str = ""
    caller: str = ""
    group: str = ""
    members: tuple[int, ...] = ()
    step: int = -1
    debug: bool | None = None
    left_s: float = field(default=math.inf, compare=False)

    @property
    def inside(self) -> bool:
        return self.kind != "computing"

    def describe(self) -> str:
        """``"psum on axis 'x', in debug mode's check, called from f (a.py:3)"``."""
        check = ", in debug mode's check" if self.kind == "check" else ""
        return f"{self.what}{check}, called from {self.caller}"


# ----------------------------------------------------------------------------- worker side


def position(thread: int | None) -> Position:
    """Where ``thread`` (a thread id; a worker's main thread) is now."""
    frame = sys._current_frames().get(thread) if thread is not None else None
    frames: list[FrameType] = []
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    frames.reverse()  # outermost first
    for i, f in enumerate(frames):
        wait = waiting(f)
        if wait is not None:
            return Position(
                "check",
                f"{wait.op} on axis {wait.label!r}",
                _caller(frames, i),
                wait.name,
                _members(wait.group),
                wait.seq,
                True,
                wait.deadline - time.monotonic(),
            )
    inside = [i for i, f in enumerate(frames) if f.f_code.co_filename.endswith(_COLLECTIVE_FILES)]
    if not inside:
        return Position("computing")
    last = frames[inside[-1]].f_code
    what = f"{last.co_name} in {os.path.basename(last.co_filename)}"
    caller = _caller(frames, inside[0])
    known, group, pshard = _group([frames[i] for i in reversed(inside)])
    debug = None
    if pshard is not None:  # "psum on axis 'x' (all_reduce in distributed_c10d.py)"
        op, c = pshard
        what, debug = f"{op} on axis {c.name!r} ({what})", c.debug
    if not known:
        return Position("collective", what, caller, debug=debug)
    if group is None:
        group = dist.group.WORLD
    name = "" if group is None else group_key(group)
    return Position("collective", what, caller, name, _members(group), debug=debug)


def _library(frame: FrameType) -> bool:
    path = frame.f_code.co_filename
    return "torch" in path.split(os.sep) or path.startswith(_PACKAGE_DIR)


def _caller(frames: list[FrameType], inner: int) -> str:
    """The innermost frame of the program (not torch's, not pshard's) outside ``inner``."""
    f = next((f for f in reversed(frames[:inner]) if not _library(f)), frames[inner])
    return f"{f.f_code.co_name} ({f.f_code.co_filename}:{f.f_lineno})"


# pshard's names of the wire's functions that differ from them (all_reduce's is its ``op``)
_PSHARD_NAMES = MappingProxyType(
    {
        "reduce_scatter": "psum_scatter",
        "gather_parts": "all_gather",
        "ppermute_start": "ppermute",
    }
)


def _group(
    inner_first: list[FrameType],
) -> tuple[bool, dist.ProcessGroup | None, tuple[str, Comm] | None]:
    """From a collective's frames (innermost first): whether its group is known, the group
    (``None``: the default group), and for a pshard collective its name and
    :class:`~pshard._runtime.wire.Comm` (``None`` for a torch.distributed call)."""
    known, group = False, None
    pshard: tuple[str, Comm] | None = None
    for f in inner_first:
        local = f.f_locals
        c = local.get("c")
        if isinstance(c, Comm):
            name = f.f_code.co_name
            op = local.get("op") if name == "all_reduce" else None
            pshard = (op if isinstance(op, str) else _PSHARD_NAMES.get(name, name), c)
            if not known:
                known, group = True, c.group
        elif not known and "group" in local:
            value = local["group"]
            if value is None or isinstance(value, dist.ProcessGroup):
                known, group = True, value
    return known, group, pshard


def _members(group: dist.ProcessGroup | None) -> tuple[int, ...]:
    try:
        return tuple(dist.get_process_group_ranks(group)) if group is not None else ()
    except Exception:  # a group torch no longer knows
        return ()


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
        """The error text when the ranks ``running`` cannot finish (``returned`` have), or
        ``None`` while they may."""
        here = {r: self._seen[r][0] for r in running if r in self._seen}
        stuck = {r for r in here if self._stuck(r, now)}
        for rank in sorted(stuck) if returned else ():
            # the ranks it waits for that have returned (all returned: its group is not known)
            waits_for = _waits_for(rank, here)
            left = set(returned) if waits_for is None else waits_for & set(returned)
            if left:
                return (
                    f"{self._caller}: {ranks_text(left)} of {self._nprocs} returned while rank "
                    f"{rank} is still waiting in a collective ({here[rank].describe()}) for "
                    f"more than {STUCK_S:g} s: every rank must call the same collectives, and "
                    f"the returning rank never called this one; all ranks were terminated"
                )
        waits = {r: w for r in stuck if (w := _waits_for(r, here)) is not None and w}
        for r in sorted(waits):
            if here[r].kind == "check":
                ring = _closure(r, waits, running)
                if ring is not None:
                    return self._deadlock(ring, here, waits)
        return None

    def _stuck(self, rank: int, now: float) -> bool:
        where, since = self._seen[rank]
        if not where.inside or now - since < STUCK_S:
            return False
        return where.kind != "check" or where.left_s > _OWN_S

    def _deadlock(
        self, ring: set[int], here: dict[int, Position], waits: dict[int, set[int]]
    ) -> str:
        details = "; ".join(
            f"rank {r} waits in {here[r].describe()}, for {ranks_text(waits[r])}"
            for r in sorted(ring)
        )
        on = [r for r in ring if here[r].kind == "check"]
        off = [r for r in ring if here[r].kind == "collective" and here[r].debug is False]
        n, stuck = self._nprocs, f"{STUCK_S:g} s"
        if off:
            return (
                f"{self._caller}: debug mode is on in {ranks_text(on)} and off in "
                f"{ranks_text(off)} of {n}, which wait for each other for more than {stuck} "
                f"({details}): with debug mode on a rank checks each collective with the other "
                f"ranks before it runs, with it off a rank goes straight into the collective. "
                f"Turn it on in every rank or in none (PSHARD_DEBUG=1 in every rank's "
                f"environment, or the same ps.debug(...) in every rank); all ranks were "
                f"terminated"
            )
        return (
            f"{self._caller}: {ranks_text(ring)} of {n} wait for each other in different "
            f"collectives for more than {stuck} ({details}): every rank must call the same "
            f"collectives in the same order, and a rank that skips one waits in the next while "
            f"the others wait for it in the one it skipped; all ranks were terminated"
        )


def _waits_for(rank: int, here: dict[int, Position]) -> set[int] | None:
    """The ranks ``rank`` waits for (``None``: not known)."""
    at = here[rank]
    if not at.members:
        return None
    # in a check: the ranks in the same check; in a collective: those in one on its group
    same = (at.kind, at.group, at.step if at.kind == "check" else -1)
    with_it = {q for q, p in here.items() if (p.kind, p.group, p.step) == same}
    return set(at.members) - with_it - {rank}


def _closure(start: int, waits: dict[int, set[int]], running: Collection[int]) -> set[int] | None:
    """The running ranks ``start`` waits for, directly or through others, with ``start``, when
    every one of them waits (nobody among them can move first); else ``None``."""
    ring, todo = {start}, [start]
    while todo:
        for q in waits[todo.pop()]:
            if q in ring or q not in running:  # a rank not running has returned (or failed)
                continue
            if q not in waits:
                return None
            ring.add(q)
            todo.append(q)
    return ring
