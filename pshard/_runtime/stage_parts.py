"""Gradients that are one pipeline stage's part of a model's gradients.

``pipeline_value_and_grad`` returns, on each rank of the pipeline axis, the gradients of its own
stages only: the model's gradients are all the stages' together. A global norm of them must add
the squares of every stage (a sum over the pipeline axis), or clipping would scale each stage by
its own norm. So the tensors it returns carry a :class:`StagePart` mark naming the axis, which
:func:`pshard.optim.global_norm` reads; pshard's collectives over other axes (a ``psum`` of the
gradients over a data axis) and ``ps.optim``'s transforms hand the mark on to what they compute
from a marked tensor, leaf by leaf. Tensors computed by other code carry no mark.

Internal interface: :class:`StagePart`, :func:`mark`, :func:`part_of`, :func:`carry`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["StagePart", "carry", "mark", "part_of"]

_ATTR = "_pshard_stage_part"


@dataclasses.dataclass(frozen=True, eq=False)
class StagePart:
    """The mark: the process group of the pipeline axis (``None`` with one rank), its name and
    the mesh it is an axis of (``None`` for a group given as a ``ProcessGroup``)."""

    group: Any
    axis: str
    mesh: Any


def mark(tensors: Sequence[Any], part: StagePart) -> None:
    """Mark the floating-point ``tensors`` (blocks of GlobalTensors included) as one stage's."""
    for t in tensors:
        if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()):
            setattr(t, _ATTR, part)


def part_of(t: Any) -> StagePart | None:
    """The mark of ``t``, if it has one."""
    return getattr(t, _ATTR, None) if isinstance(t, torch.Tensor) else None


def carry(sources: Sequence[Any], results: Sequence[Any]) -> None:
    """Hand each source's mark to the result computed from it, position by position."""
    for s, r in zip(sources, results, strict=False):
        part = part_of(s)
        if part is not None and isinstance(r, torch.Tensor) and r is not s:
            setattr(r, _ATTR, part)
