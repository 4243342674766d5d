"""One ``sharded_call``'s schedule of gathers and scatters: what overlaps what.

FSDP2's order, kept per call (no state outlives it but what its backward needs):

- **Forward**: when a unit is called, its own gather (unless prefetched) and the gather of the
  unit after it (in the model's order of units) are issued, then the unit computes while the
  next one's weights travel. The order the units actually ran in is recorded.
- **Backward**: the backward runs the units in the reverse of that order. Before a unit's
  backward (a Function on its outputs, :class:`PreBackward`, whose backward runs first), its
  own gather and the previous unit's are issued; the unit then recomputes with its weights
  and pulls the cotangents back while the previous unit's weights travel.
- **Reduce-scatters** (on an accelerator, issued on a stream beside the compute): a unit's
  gradient reduce-scatter is left in flight and waited for when the next unit issues its own
  (one unit's in flight at a time), and the rest at the end of the backward: every block
  passes through :class:`Gate` before any unit uses it, a Function whose backward runs after
  every unit's (it needs all their gradients), waits for what is in flight and only then hands
  the gradients on. Nothing reads them before. On the CPU they are waited for at once (see
  :meth:`UnitSchedule.defers`).

A prefetched gather is taken only by the primal call of its unit with the blocks it was issued
for, unchanged since (their versions): the tangents of ``jvp``, ``vmap``'s batches and the
rules of higher derivatives gather for themselves. A gather issued but never taken (a unit the
model did not call, a backward that stopped early) is waited for and dropped. Results are the
same bits as without any of it (``prefetch=False``): the same gathers and reduce-scatters, run
at other times.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from .. import _compat as compat
from .._collectives.apply import call, eager_rules
from .._collectives.cast_gather import PendingGather, PendingScatter, UnitPlan, gather_start
from .._runtime.streams import SideStream

__all__ = ["Gate", "PreBackward", "UnitSchedule", "UnitSlot", "gate"]


@dataclasses.dataclass(eq=False)
class _Unit:
    plan: UnitPlan
    blocks: list[torch.Tensor]  # as the call got them (maybe wrappers of transforms)
    calls: int = 0


class UnitSchedule:
    """The gathers and scatters of one call's units (see the module docs).

    ``units``: each unit's plan and blocks, in the model's order; ``prefetch``: overlap at all."""

    def __init__(
        self, units: Sequence[tuple[UnitPlan, list[torch.Tensor]]], *, prefetch: bool
    ) -> None:
        self.units = [_Unit(plan, blocks) for plan, blocks in units]
        self.prefetch = prefetch
        self.order: list[int] = []  # the units in the order the forward called them
        self.gathers: dict[int, PendingGather] = {}
        self.scatters: list[tuple[int, PendingScatter]] = []
        self.gated = False
        self.streams: dict[tuple[str, torch.device], SideStream] = {}

    # --- gathers ----------------------------------------------------------------------------

    def issue(self, u: int | None) -> None:
        """Issue unit ``u``'s gathers now unless they are in flight already (or cannot be:
        a trace, batched blocks)."""
        if u is None or not self.prefetch or u in self.gathers:
            return
        unit = self.units[u]
        raw = [compat.innermost(b) for b in unit.blocks]
        if not raw or compat.tracing(raw) or any(compat.is_batched(b) for b in unit.blocks):
            return
        if any(
            tuple(r.shape) != bp.block_shape for r, bp in zip(raw, unit.plan.blocks, strict=True)
        ):
            return
        with _quiet():
            self.gathers[u] = gather_start(unit.plan, raw, self.side("gather", raw[0].device))

    def take(self, u: int, blocks: Sequence[torch.Tensor]) -> list[torch.Tensor] | None:
        pending = self.gathers.pop(u, None)
        if pending is None:
            return None
        wholes = pending.wait()
        return wholes if pending.matches(blocks) else None

    def drain(self, keep: Sequence[int] = ()) -> None:
        """Wait for and drop the gathers in flight, but those of the units ``keep``."""
        with _quiet():
            for u in [u for u in self.gathers if u not in keep]:
                self.gathers.pop(u).wait()

    # --- the forward and the backward ---------------------------------------------------------

    def forward_call(self, u: int) -> int:
        """Unit ``u`` is called by the model: its position in the order, with its gathers and
        the next unit's issued."""
        position = len(self.order)
        self.order.append(u)
        self.units[u].calls += 1
        self.issue(u)
        self.issue(u + 1 if u + 1 < len(self.units) else None)
        return position

    def before_backward(self, position: int) -> None:
        """The backward reaches the unit at ``position``: its gathers and the previous unit's."""
        u = self.order[position]
        before = self.order[position - 1] if position > 0 else None
        self.drain(keep=[u] if before is None else [u, before])
        self.issue(u)
        self.issue(before)

    def side(self, kind: str, device: torch.device) -> SideStream:
        """The stream the gathers (``kind="gather"``) or the scatters are issued on."""
        key = (kind, device)
        if key not in self.streams:
            self.streams[key] = SideStream(device)
        return self.streams[key]

    # --- scatters -----------------------------------------------------------------------------

    def can_defer(self, device: torch.device) -> bool:
        """Whether scatters on ``device`` may be left in flight at all (an accelerator)."""
        return self.prefetch and self.side("scatter", device).active

    def defers(self, u: int, device: torch.device) -> SideStream | None:
        """The stream to issue unit ``u``'s scatter on if it may be left in flight: on an
        accelerator (a stream beside the compute), when nothing reads its outputs before the
        :class:`Gate` (the unit ran once, its blocks passed the gate, whose backward has not
        run yet). On the CPU a scatter is waited for at once: the gloo threads that would run
        it meanwhile share the cores with the backward (no faster, measured), and its input
        would stay alive through the next unit's backward (a whole unit's gradient more)."""
        if not (self.prefetch and self.gated and self.units[u].calls == 1):
            return None
        stream = self.side("scatter", device)
        return stream if stream.active else None

    def defer(self, u: int, pending: PendingScatter) -> None:
        """Keep unit ``u``'s scatter in flight; wait for the other units' first (one unit's
        in flight at a time)."""
        with _quiet():
            for v, other in self.scatters:
                if v != u:
                    other.wait()
        self.scatters = [(v, s) for v, s in self.scatters if v == u]
        self.scatters.append((u, pending))

    def finish(self) -> None:
        """The end of the backward: every scatter waited for, every stale gather dropped. No
        scatter is deferred after it: a later backward pass through the same graph (a second
        ``.backward()``, the outer pass of a second derivative) does not run the gate again."""
        self.gated = False
        with _quiet():
            for _, pending in self.scatters:
                pending.wait()
        self.scatters = []
        self.drain()


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Communicate on plain tensors, below every ``torch.func`` transform, unseen by autograd
    and by dispatch modes (a checkpoint's tape)."""
    with compat.outside_transforms(), compat.unseen_writes([]):
        yield


class UnitSlot:
    """Unit ``u``'s place in ``schedule``, as its gather sees it (:class:`~pshard._collectives.
    cast_gather.Slot`)."""

    def __init__(self, schedule: UnitSchedule, u: int, device: torch.device) -> None:
        self.schedule = schedule
        self.u = u
        self.device = device

    def take(self, blocks: Sequence[torch.Tensor]) -> list[torch.Tensor] | None:
        return self.schedule.take(self.u, blocks)

    def defers(self) -> SideStream | None:
        return self.schedule.defers(self.u, self.device)

    def defer(self, pending: PendingScatter) -> None:
        self.schedule.defer(self.u, pending)


def _views(xs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    return tuple(x.view_as(x) for x in xs)


@eager_rules
class Gate(torch.autograd.Function):
    """``(schedule, *blocks) -> blocks``; its backward, after every unit's, waits for the
    scatters in flight before handing the gradients on."""

    @staticmethod
    def forward(schedule: UnitSchedule, *blocks: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return _views(blocks)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.schedule = inputs[0]

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        ctx.schedule.finish()
        return (None, *grads)

    @staticmethod
    def jvp(ctx: Any, _schedule: Any, *tangents: torch.Tensor) -> tuple[Any, ...]:
        return tangents

    @staticmethod
    def vmap(info: Any, in_dims: tuple[Any, ...], schedule: Any, *blocks: Any) -> Any:
        return _views(blocks), tuple(in_dims[1:])


@eager_rules
class PreBackward(torch.autograd.Function):
    """``(schedule, position, *outputs) -> outputs``; its backward, just before the unit's,
    issues the unit's gathers and the previous unit's."""

    @staticmethod
    def forward(schedule: UnitSchedule, position: int, *xs: torch.Tensor) -> tuple[Any, ...]:
        return _views(xs)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.schedule, ctx.position = inputs[0], inputs[1]

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        ctx.schedule.before_backward(ctx.position)
        return (None, None, *grads)

    @staticmethod
    def jvp(ctx: Any, _schedule: Any, _position: Any, *tangents: torch.Tensor) -> tuple[Any, ...]:
        return tangents

    @staticmethod
    def vmap(info: Any, in_dims: tuple[Any, ...], schedule: Any, position: int, *xs: Any) -> Any:
        return _views(xs), tuple(in_dims[2:])


def gate(schedule: UnitSchedule, blocks: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``blocks`` through :class:`Gate` (marks the schedule gated)."""
    schedule.gated = True
    return list(call(Gate, schedule, *blocks))
