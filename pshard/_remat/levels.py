"""What the rules of a checkpoint's ``autograd.Function`` do with ``torch.func``'s levels.

A backward (or jvp) that runs under a ``grad`` (or ``jvp``) transform finds that level
(:func:`running_level`) and computes with it taken off the stack (:func:`stripped`, which
:mod:`pshard._remat.checkpoint` explains); under such a level the inputs are held by
:class:`Held` rather than by autograd, so each checkpoint lets go of them once its backward has
run. :func:`differentiated` tells whether what a rule computes will itself be differentiated.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from .. import _compat as compat

__all__ = [
    "Held",
    "detached",
    "differentiated",
    "differentiating",
    "running_level",
    "stripped",
    "version",
]


def detached(t: Any) -> Any:
    return None if t is None else t.detach()


def differentiating() -> bool:
    return any(kind in ("grad", "jvp") for kind, _ in compat.transforms())


def differentiated(tensors: Sequence[Any]) -> bool:
    """Whether what is computed from ``tensors`` here will be differentiated: a ``grad`` or
    ``jvp`` transform still running, forward-mode AD, or autograd tracking one of them."""
    if not torch.is_grad_enabled() and not compat.forward_ad_active():
        return differentiating()
    if differentiating() or compat.forward_ad_active():
        return True
    return any(t is not None and t.requires_grad for t in tensors)


def running_level(kind: str, tensors: Sequence[Any]) -> int | None:
    """The level of the ``kind`` transform running this backward (or jvp) when it is the
    innermost one: the inputs saved at that level are its live wrappers. ``None`` otherwise
    (no transform, a ``vjp`` whose ``vjp_fn`` runs after it returned, a ``vmap`` on top). The
    cotangents cannot tell: a ``vjp_fn`` called by an outer ``grad`` hands over that ``grad``'s
    values, and taking that level off would cut the outer derivative."""
    top = compat.top_transform()
    if top is None or top[0] != kind:
        return None
    for t in tensors:
        if t is not None and compat.live_wrapper(t) and compat.level_of(t) == top[1]:
            return top[1]
    return None


def stripped(
    level: int | None,
    compute: Callable[[Callable[[Any], Any] | None], list[torch.Tensor | None]],
) -> list[torch.Tensor | None]:
    """``compute(unwrap)`` with the transform ``level`` (the innermost) taken off the stack
    (:mod:`pshard._compat` explains why), its results wrapped back at that level with no
    history there; ``compute(None)`` as is when ``level`` is ``None``."""
    if level is None:
        return compute(None)

    def unwrap(t: Any) -> Any:
        return None if t is None else compat.unwrap_level(t, level)

    with compat.lowered():
        results = compute(unwrap)
    return [None if r is None else compat.wrap_level(r, level) for r in results]


class Held:
    """What a ``torch.func`` level's node keeps for its backward, held here rather than by
    autograd: ``torch.func.grad`` retains its whole graph until it returns (it differentiates
    with ``create_graph=True``), so what autograd saved would stay alive through the backward;
    held here, each checkpoint lets go of its inputs once its backward has run, as
    ``.backward()`` does. In-place changes after the forward are checked by version.

    It also holds the outputs the forward returned (plain tensors under the transform's
    wrappers, so no reference cycle through the graph): the next checkpoint lets go of them as
    its inputs, and this one's recompute takes them instead of computing them again
    (:attr:`pshard._remat.tape.Tape.returned`), then lets go of them too."""

    def __init__(
        self, tensors: Sequence[torch.Tensor | None], returned: Sequence[torch.Tensor]
    ) -> None:
        self.tensors: list[torch.Tensor | None] | None = list(tensors)
        self.versions = [None if t is None else version(t) for t in tensors]
        self.returned = list(returned)

    def get(self, name: str) -> list[torch.Tensor | None]:
        if self.tensors is None:
            raise RuntimeError(
                f"ps.checkpoint: the backward of {name} ran a second time under the torch.func "
                f"transform that ran it once already; its inputs were released after the first"
            )
        for i, (t, v) in enumerate(zip(self.tensors, self.versions, strict=True)):
            if t is not None and v is not None and version(t) != v:
                raise ValueError(
                    f"ps.checkpoint: argument {i} of {name} (shape {tuple(t.shape)}) was "
                    f"modified in place after the forward; the recompute needs it as the "
                    f"forward saw it: modify a copy instead"
                )
        return self.tensors

    def release(self) -> None:
        self.tensors, self.returned = None, []


def version(t: torch.Tensor) -> int | None:
    """The version of the tensor under every functorch wrapper (what an in-place change of
    the caller's tensor bumps)."""
    try:
        return int(compat.innermost(t)._version)
    except (RuntimeError, AttributeError):
        return None
