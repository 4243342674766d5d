"""Random generator states: the recompute draws the numbers its forward drew.

The forward records the states when it first draws (:func:`before_draw`): the global
generators (CPU and every initialised CUDA device, as ``torch.utils.checkpoint`` does) at its
first draw, and each generator passed explicitly (``torch.randn(..., generator=g)``) at its
first draw from it. The recompute sets them before it runs anything and puts the states of the
backward back when it is done (:class:`Rewind`), so every generator ends where a step without a
checkpoint leaves it. Setting them at the start matters for nesting: the outer recompute runs
an inner checkpoint's forward again, which records the states it sees at its own first draw,
before that draw reaches the outer recompute.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import optree
import torch

from pshard._core.tree import NAMESPACE

__all__ = ["RngStates", "Rewind", "before_draw", "capture"]


@dataclasses.dataclass(frozen=True)
class RngStates:
    """The CPU generator state, when CUDA is initialised every device's state, and the states of
    the explicit ``generators`` (each with its state)."""

    cpu: torch.Tensor
    cuda: tuple[torch.Tensor, ...]
    generators: tuple[tuple[torch.Generator, torch.Tensor], ...] = ()

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda:
            torch.cuda.set_rng_state_all(list(self.cuda))
        for generator, state in self.generators:
            generator.set_state(state)


def capture(generators: tuple[torch.Generator, ...] = ()) -> RngStates:
    """The global generators' states now, and those of ``generators``."""
    cuda: tuple[torch.Tensor, ...] = ()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        cuda = tuple(torch.cuda.get_rng_state_all())
    return RngStates(torch.get_rng_state(), cuda, tuple((g, g.get_state()) for g in generators))


def before_draw(
    states: RngStates | None, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> RngStates:
    """``states`` (``None`` before the first draw) with, added, the states of the generators a
    random operator called with ``args``/``kwargs`` is about to draw from and that were not drawn
    from before."""
    if states is None:
        states = capture()
    leaves: list[Any] = optree.tree_leaves((args, kwargs), namespace=NAMESPACE)  # type: ignore[arg-type]
    new = [
        g
        for g in leaves
        if isinstance(g, torch.Generator) and not any(g is h for h, _ in states.generators)
    ]
    if not new:
        return states
    added = tuple((g, g.get_state()) for g in new)
    return dataclasses.replace(states, generators=states.generators + added)


class Rewind:
    """Set the forward's states (:meth:`start`, once) and put the current ones back
    (:meth:`finish`)."""

    def __init__(self, forward: RngStates) -> None:
        self._forward = forward
        self._outside: RngStates | None = None

    def start(self) -> None:
        if self._outside is None:
            self._outside = capture(tuple(g for g, _ in self._forward.generators))
            self._forward.restore()

    def finish(self) -> None:
        if self._outside is not None:
            self._outside.restore()
            self._outside = None
