"""Random generator states: the recompute draws the numbers its forward drew.

The forward records the states when it first draws (:func:`capture`); the recompute sets them
before it runs anything and puts the states of the backward back when it is done
(:class:`Rewind`), so the global generators end where a step without a checkpoint leaves them.
Setting them at the start matters for nesting: the outer recompute runs an inner checkpoint's
forward again, which records the states it sees at its own first draw, before that draw
reaches the outer recompute. CPU and every initialised CUDA device, as
``torch.utils.checkpoint`` does.
"""

from __future__ import annotations

import dataclasses

import torch

__all__ = ["RngStates", "Rewind", "capture"]


@dataclasses.dataclass(frozen=True)
class RngStates:
    """The CPU generator state and, when CUDA is initialised, every device's state."""

    cpu: torch.Tensor
    cuda: tuple[torch.Tensor, ...]

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda:
            torch.cuda.set_rng_state_all(list(self.cuda))


def capture() -> RngStates:
    """The generators' states now."""
    cuda: tuple[torch.Tensor, ...] = ()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        cuda = tuple(torch.cuda.get_rng_state_all())
    return RngStates(torch.get_rng_state(), cuda)


class Rewind:
    """Set the forward's states (:meth:`start`, once) and put the current ones back
    (:meth:`finish`)."""

    def __init__(self, forward: RngStates) -> None:
        self._forward = forward
        self._outside: RngStates | None = None

    def start(self) -> None:
        if self._outside is None:
            self._outside = capture()
            self._forward.restore()

    def finish(self) -> None:
        if self._outside is not None:
            self._outside.restore()
            self._outside = None
