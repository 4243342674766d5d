"""Point-to-point messages between the ranks of a pipeline axis: layouts, headers, streams.

Each directed pair of ranks is a *channel* whose messages the schedule orders
(:class:`pshard._pipeline.schedule.Message`); the sender sends them in that order and the
receiver posts its receives in that order (:class:`Inbox`), so sends and receives pair up
without tags. A message is, in order on the wire:

1. in debug mode, an *envelope* (kind, stage, microbatch, index) that the receiver checks
   against the message it expects before it posts anything else;
2. when the receiver cannot know the shapes, a *header* (:data:`HEADER_LEN` int64s): whether
   data follows and its :class:`Layout` (a tensor or a tuple of tensors, each leaf's dtype
   and shape). An activation carries one when its microbatch is the first of its size
   (every rank knows the sizes); the other activations of that size have the same layout (the
   sender checks it), and a cotangent has the layout of the activation its receiver sent;
3. the tensors themselves, one send each.

Sends are asynchronous (:class:`Outbox` keeps them until they complete); receives are posted
ahead of need where the layout is known (:meth:`Inbox.post` with ``block=False``).

Internal interface: :class:`Link` (the axis: group, peers, device), :class:`Layout`,
:class:`Inbox`, :class:`Outbox`, :data:`NO_DATA`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist

from .._core.checks import WIRE_DTYPES
from .._runtime.wire import Comm
from .schedule import Message

__all__ = ["HEADER_LEN", "NO_DATA", "Inbox", "Layout", "Link", "Outbox"]

#: int64s in a header: room for 2 + 2 * leaves + total dims (a tuple of 10 4-d tensors).
HEADER_LEN = 64
_MAGIC = 0x5050
_ENVELOPE = 5


class _NoData:
    """The payload of a message whose sender had failed before it could compute it."""

    def __repr__(self) -> str:
        return "NO_DATA"


#: See :class:`_NoData`.
NO_DATA: Any = _NoData()


@dataclasses.dataclass(frozen=True)
class Layout:
    """What a message carries: a tensor (``is_tuple=False``, one leaf) or a tuple of tensors,
    each leaf ``(dtype, shape)``."""

    is_tuple: bool
    leaves: tuple[tuple[torch.dtype, tuple[int, ...]], ...]

    @staticmethod
    def of(value: Any) -> Layout:
        """The layout of a tensor or a tuple of tensors (checked by the caller)."""
        if isinstance(value, torch.Tensor):
            return Layout(False, ((value.dtype, tuple(value.shape)),))
        return Layout(True, tuple((t.dtype, tuple(t.shape)) for t in value))

    def tensors(self, value: Any) -> tuple[torch.Tensor, ...]:
        return tuple(value) if self.is_tuple else (value,)

    def build(self, tensors: Sequence[torch.Tensor]) -> Any:
        return tuple(tensors) if self.is_tuple else tensors[0]

    def floats(self) -> tuple[tuple[torch.dtype, tuple[int, ...]], ...]:
        """The leaves a cotangent has (the differentiable ones)."""
        return tuple((d, s) for d, s in self.leaves if d.is_floating_point or d.is_complex)

    def encode(self) -> list[int] | None:
        """The header's ints after the status (None: they do not fit in a header)."""
        out = [int(self.is_tuple), len(self.leaves)]
        for dtype, shape in self.leaves:
            if dtype not in WIRE_DTYPES:
                return None
            out += [WIRE_DTYPES.index(dtype), len(shape), *shape]
        return out if len(out) + 2 <= HEADER_LEN else None

    @staticmethod
    def decode(ints: Sequence[int]) -> Layout:
        is_tuple, count = bool(ints[0]), ints[1]
        leaves, k = [], 2
        for _ in range(count):
            dtype, ndim = WIRE_DTYPES[ints[k]], ints[k + 1]
            leaves.append((dtype, tuple(ints[k + 2 : k + 2 + ndim])))
            k += 2 + ndim
        return Layout(is_tuple, tuple(leaves))

    def describe(self) -> str:
        parts = [f"{tuple(s)} {str(d).removeprefix('torch.')}" for d, s in self.leaves]
        return parts[0] if not self.is_tuple else "(" + ", ".join(parts) + ")"


class Link:
    """The pipeline axis as the executor sees it: this rank's index, the peers' group ranks,
    the device messages travel on (CUDA for NCCL, else the CPU)."""

    def __init__(self, comm: Comm) -> None:
        self.comm = comm
        self.size = comm.size
        self.rank = comm.rank
        self.group = comm.group
        self.debug = comm.debug
        backend = str(dist.get_backend(comm.group)).lower() if comm.group is not None else ""
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if "nccl" in backend
            else (torch.device("cpu"))
        )

    def _peer(self, index: int) -> int:
        return index if self.comm.order is None else self.comm.order[index]

    def isend(self, t: torch.Tensor, dst: int) -> Any:
        return dist.isend(t, group=self.group, group_dst=self._peer(dst))

    def irecv(self, t: torch.Tensor, src: int) -> Any:
        return dist.irecv(t, group=self.group, group_src=self._peer(src))

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """The sum over the axis (in place; ``t`` on :attr:`device`)."""
        if self.group is not None:
            dist.all_reduce(t, group=self.group)
        return t

    def broadcast(self, t: torch.Tensor, src: int) -> torch.Tensor:
        """Index ``src``'s ``t`` on every rank (in place)."""
        if self.group is not None:
            dist.broadcast(t, group=self.group, group_src=self._peer(src))
        return t


def _envelope(msg: Message, device: torch.device) -> torch.Tensor:
    kind = 0 if msg.kind == "activation" else 1
    return torch.tensor([_MAGIC, kind, msg.stage, msg.microbatch, msg.index], device=device)


class Outbox:
    """This rank's sends, in the schedule's order; each kept (and its tensor alive) until
    :meth:`settle` waits for it."""

    def __init__(self, link: Link) -> None:
        self.link = link
        self._pending: list[tuple[Any, torch.Tensor, int]] = []  # work, tensor, due tick

    def send(
        self,
        msg: Message,
        tensors: Sequence[torch.Tensor] | None,
        header: Layout | None | Literal[False] = False,
    ) -> None:
        """Send ``msg``: its envelope in debug mode, a header when ``header`` is not
        ``False`` (a layout, or ``None``: no data follows), then ``tensors`` (``None``: none)."""
        link = self.link
        out: list[torch.Tensor] = []
        if link.debug:
            out.append(_envelope(msg, link.device))
        if header is not False:
            ints = [_MAGIC, 0 if header is None else 1]
            if header is not None:
                ints += header.encode() or []
            ints += [0] * (HEADER_LEN - len(ints))
            out.append(torch.tensor(ints, dtype=torch.int64, device=link.device))
        for t in tensors or ():
            out.append(t.to(link.device).contiguous())
        for t in out:
            self._pending.append((link.isend(t, msg.dst), t, msg.due))

    def settle(self, tick: int) -> None:
        """Wait for the sends whose receiver's action starts before ``tick`` (it gets there
        without anything this rank sends later, so the wait ends) and let their tensors go:
        a rank holds its sent activations only as long as the schedule needs them (gloo's
        send work does not say when it completed before it is waited for)."""
        if any(due < tick for _, _, due in self._pending):
            keep = []
            for work, t, due in self._pending:
                if due < tick:
                    work.wait()
                else:
                    keep.append((work, t, due))
            self._pending = keep

    def wait(self) -> None:
        for work, _, _ in self._pending:
            work.wait()
        self._pending = []


@dataclasses.dataclass
class _Slot:
    """One incoming message as its receives are posted."""

    msg: Message
    envelope: tuple[Any, torch.Tensor] | None = None
    checked: bool = False
    header: tuple[Any, torch.Tensor] | None = None
    layout: Any = None  # Layout, NO_DATA, or None while unknown
    data: list[tuple[Any, torch.Tensor]] | None = None


class Inbox:
    """The receives of one channel (``src`` -> this rank), posted in the channel's order.

    ``expect(msg)`` says what ``msg`` carries when no header does: a :class:`Layout` of the
    tensors, :data:`NO_DATA`, ``"header"`` (a header says), or ``None`` (not known yet: this
    rank has not yet done what decides it). ``on_header(msg, layout)`` is
    told each header's layout (:data:`NO_DATA` for none) as it arrives."""

    def __init__(
        self,
        link: Link,
        src: int,
        messages: Sequence[Message],
        expect: Callable[[Message], Any],
        on_header: Callable[[Message, Any], None],
    ) -> None:
        self.link = link
        self.src = src
        self.messages = messages
        self.expect = expect
        self.on_header = on_header
        self.cursor = 0  # messages before it have every receive posted
        self.slots: dict[int, _Slot] = {}

    def post(self, upto: int, *, block: bool) -> None:
        """Post the receives of messages up to index ``upto``, in order; without ``block``,
        stop at the first one whose layout is not known yet (a header not arrived)."""
        while self.cursor <= min(upto, len(self.messages) - 1):
            slot = self.slots.setdefault(self.cursor, _Slot(self.messages[self.cursor]))
            if not self._advance(slot, block):
                return
            self.cursor += 1

    def _small(
        self, posted: tuple[Any, torch.Tensor] | None, length: int
    ) -> tuple[Any, torch.Tensor]:
        """A receive of ``length`` int64s (an envelope, a header), posted if not yet."""
        if posted is not None:
            return posted
        buf = torch.empty(length, dtype=torch.int64, device=self.link.device)
        return self.link.irecv(buf, self.src), buf

    def _advance(self, slot: _Slot, block: bool) -> bool:
        link, msg = self.link, slot.msg
        if link.debug and not slot.checked:
            slot.envelope = self._small(slot.envelope, _ENVELOPE)
            if not (block or slot.envelope[0].is_completed()):
                return False
            slot.envelope[0].wait()
            _check_envelope(slot.envelope[1], msg, self.src, link.rank)
            slot.checked = True
        if slot.layout is None:
            expected = self.expect(msg)
            if expected is None:  # depends on what this rank has not done yet
                if block:  # pragma: no cover - the schedule orders it before
                    raise RuntimeError(f"pipeline: the layout of {msg} is not known")
                return False
            if not (isinstance(expected, str) and expected == "header"):
                slot.layout = expected
            else:
                slot.header = self._small(slot.header, HEADER_LEN)
                if not (block or slot.header[0].is_completed()):
                    return False
                slot.header[0].wait()
                ints = slot.header[1].tolist()
                slot.layout = Layout.decode(ints[2:]) if ints[1] else NO_DATA
                self.on_header(msg, slot.layout)
        if slot.data is None:
            slot.data = []
            if slot.layout is not NO_DATA:
                for dtype, shape in slot.layout.leaves:
                    buf = torch.empty(shape, dtype=dtype, device=link.device)
                    slot.data.append((link.irecv(buf, self.src), buf))
        return True

    def take(self, msg: Message) -> tuple[Any, tuple[torch.Tensor, ...]]:
        """``msg``'s layout (or :data:`NO_DATA`) and tensors, once they have arrived."""
        self.post(msg.index, block=True)
        slot = self.slots.pop(msg.index)
        for work, _ in slot.data or ():
            work.wait()
        return slot.layout, tuple(buf for _, buf in slot.data or ())


def _check_envelope(buf: torch.Tensor, msg: Message, src: int, me: int) -> None:
    got = buf.tolist()
    want = _envelope(msg, torch.device("cpu")).tolist()
    if got != want:
        kinds = ("activation", "cotangent")
        raise RuntimeError(
            f"pipeline (pshard debug mode): rank {me} of the pipeline axis expected the "
            f"{msg.kind} of stage {msg.stage}, microbatch {msg.microbatch} (message "
            f"{msg.index} from rank {src}) but rank {src} sent "
            + (
                f"the {kinds[got[1]]} of stage {got[2]}, microbatch {got[3]} (message {got[4]})"
                if got[0] == _MAGIC and got[1] in (0, 1)
                else "something else"
            )
            + "; the ranks ran different schedules (different arguments on different ranks?)"
        )
