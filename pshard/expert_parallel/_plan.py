"""A model's experts resolved against the size of an expert-parallel axis: which modules hold
the stacked experts, how many each rank holds, and every parameter's spec. Pure: reads the
model, changes nothing.

Internal interface: ``Resolved``, ``resolve(model, axis, size, part, fn)``.
"""

from __future__ import annotations

import dataclasses

from torch import nn

from .._core.placements import P
from .._modules.adapter import ExpertsPart

__all__ = ["Resolved", "resolve"]


@dataclasses.dataclass(frozen=True)
class Resolved:
    """``experts``: name -> (experts in the whole model, this rank's count); ``specs``: every
    parameter's spec over the axis."""

    experts: dict[str, tuple[int, int]]
    specs: dict[str, P]


def resolve(model: nn.Module, axis: str, size: int, part: ExpertsPart | None, fn: str) -> Resolved:
    """``model``'s experts split over ``axis`` of ``size`` ranks (see :class:`Resolved`)."""
    found = part.experts_modules(model) if part is not None else []
    if not found:
        raise ValueError(
            f"{fn}({type(model).__name__}): no known experts module in the model (known: "
            f"Hugging Face's stacked experts, modules holding every expert's weights in "
            f"'gate_up_proj' (experts, 2 x intermediate, hidden) and 'down_proj' (experts, "
            f"hidden, intermediate), as in Mixtral, Qwen2-MoE and Qwen3-MoE)"
        )
    assert part is not None
    experts: dict[str, tuple[int, int]] = {}
    stacked: set[str] = set()
    for name, module in found:
        count = part.experts_count(module)
        if count % size:
            raise ValueError(
                f"{fn}({type(model).__name__}): {name} holds {count} experts, which axis "
                f"{axis!r} of {size} ranks does not divide (each rank holds experts / ranks of "
                f"them); use an axis size that divides {count}"
            )
        experts[name] = (count, count // size)
        stacked |= {f"{name}.{p}" for p in part.experts_parameters(module)}
    specs = {n: P(axis) if n in stacked else P() for n, _ in model.named_parameters()}
    return Resolved(experts, specs)
