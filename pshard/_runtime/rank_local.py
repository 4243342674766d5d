"""What a rank writes into objects the ranks of one process share, kept per rank.

In-process ranks (``ps.spawn(..., backend="threads")``) may share Python objects: one model, or
models built from one config object. Some calls write into them for a while: a model's
``torch.func.functional_call`` puts the rank's tensors in place of its parameters,
``sequence_parallel`` registers hooks and plugs its attention into the config. A rank that gives
the turn away inside such a call (it waits in a collective) would leave its values for the next
rank to run with. So the writes are held per rank: the rank that wrote them sees its values
while it runs; at each hand-over they are put aside (the values from before put back) and those
of the rank that takes the turn put in (:class:`Held`, from
:mod:`pshard._runtime.turns`). Outside in-process ranks nothing is held and nothing changes.

Internal interface: :class:`Slot`, :data:`MISSING`, :func:`hold`, :func:`module_slots`,
:func:`hold_reparametrization`, :func:`handle_slots`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from .turns import current_task

__all__ = [
    "MISSING",
    "Held",
    "Slot",
    "handle_slots",
    "hold",
    "hold_reparametrization",
    "module_slots",
]

MISSING: Any = object()
"""The value of a slot that holds nothing (a dict without the key, an object without the
attribute)."""


@dataclasses.dataclass(frozen=True, eq=False)
class Slot:
    """A place a value is written: ``container[key]`` (``item``) or ``container.key``."""

    container: Any
    key: Any
    item: bool

    def get(self) -> Any:
        if self.item:
            return self.container.get(self.key, MISSING)
        return getattr(self.container, self.key, MISSING)

    def put(self, value: Any) -> None:
        if self.item:
            if value is MISSING:
                self.container.pop(self.key, None)
            else:
                self.container[self.key] = value
        elif value is MISSING:
            if hasattr(self.container, self.key):
                delattr(self.container, self.key)
        else:
            setattr(self.container, self.key, value)


@dataclasses.dataclass(eq=False)
class Held:
    """One rank's values in ``slots``, and what the other ranks see there."""

    slots: list[Slot]
    originals: list[Any]
    values: list[Any] = dataclasses.field(default_factory=list)

    def aside(self) -> None:
        """The rank gives the turn away: keep its values, put the originals back."""
        self.values = [s.get() for s in self.slots]
        for s, o in zip(reversed(self.slots), reversed(self.originals), strict=True):
            s.put(o)

    def back(self) -> None:
        """The rank takes the turn: its values in place again."""
        self.originals = [s.get() for s in self.slots]
        for s, v in zip(self.slots, self.values, strict=True):
            s.put(v)


def hold(slots: Sequence[Slot], originals: Sequence[Any]) -> Callable[[], None]:
    """The values now in ``slots`` are this rank's, written over ``originals``: in an
    in-process rank, the other ranks see ``originals`` there while they run. Returns the
    release, to call (while this rank runs) before the rank puts the originals back itself."""
    task = current_task()
    if task is None:
        return _nothing
    held = Held(list(slots), list(originals))
    mine = task.rank.local

    def release() -> None:
        for i, h in enumerate(mine):
            if h is held:
                del mine[i]
                return

    mine.append(held)
    return release


def _nothing() -> None:
    return None


def module_slots(module: torch.nn.Module, names: Sequence[str]) -> list[Slot]:
    """Where ``functional_call`` puts each of ``names`` (dotted names of parameters, buffers
    or tensor attributes) in ``module``."""
    slots = []
    for name in names:
        prefix, _, leaf = name.rpartition(".")
        try:
            sub = module.get_submodule(prefix) if prefix else module
        except AttributeError:
            continue  # a missing module: nothing is written there
        if leaf in sub._parameters:
            slots.append(Slot(sub._parameters, leaf, True))
        elif leaf in sub._buffers:
            slots.append(Slot(sub._buffers, leaf, True))
        else:
            slots.append(Slot(sub, leaf, False))
    return slots


def handle_slots(handles: Sequence[Any]) -> list[Slot]:
    """Where the hooks of ``handles`` (``RemovableHandle`` s of a module's hooks) are
    registered: each hook table (and its flag tables) of the handle's id."""
    slots = []
    for h in handles:
        tables = [h.hooks_dict_ref(), *(ref() for ref in h.extra_dict_ref)]
        slots += [Slot(t, h.id, True) for t in tables if t is not None and h.id in t]
    return slots


@contextlib.contextmanager
def hold_reparametrization(
    enter: Callable[[], contextlib.AbstractContextManager[Any]],
    module: torch.nn.Module,
    names: Sequence[str],
) -> Iterator[Any]:
    """``functional_call``'s reparametrization of ``module`` (``enter()``), its tensors held per
    rank while it is in place."""
    if current_task() is None:
        with enter() as value:
            yield value
        return
    slots = module_slots(module, names)
    originals = [s.get() for s in slots]
    with enter() as value:
        release = hold(slots, originals)
        try:
            yield value
        finally:
            release()
