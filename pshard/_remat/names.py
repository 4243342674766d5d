"""``ps.checkpoint_name``: name an intermediate so that a checkpoint policy can save it.

The name is heard by the checkpoint whose forward is running (through :data:`NAMER`, a context
variable that :mod:`pshard._remat.tape` sets while it records a forward); anywhere else
``checkpoint_name`` is the identity and costs nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar
from typing import Any, TypeVar

import torch

from pshard._core.tree import describe, keystr, leaf_path, tree_flatten

__all__ = ["NAMER", "checkpoint_name"]

T = TypeVar("T")

#: ``namer(x, name)`` of the checkpoint whose forward is running, else ``None``.
NAMER: ContextVar[Callable[[torch.Tensor, str], None] | None] = ContextVar(
    "pshard_checkpoint_namer", default=None
)


def checkpoint_name(x: T, name: str) -> T:
    """Name ``x`` (a tensor or a pytree of tensors) for the policy of the enclosing
    :func:`pshard.checkpoint`; returns ``x`` itself.

    A policy sees the name as a call ``policy(checkpoint_name, x, name=name)`` for each tensor
    of ``x``; :func:`~pshard.checkpoint_policies.save_only_these_names` saves the named values
    and :func:`~pshard.checkpoint_policies.save_anything_except_these_names` recomputes them.
    What is saved is the output of the operation that wrote the tensor's data (for
    ``checkpoint_name(ps.all_gather(w, "dp"), "gather")``, the gather itself), so a saved name
    is not computed again in the recompute, communication included. One name may label many
    values, in one call or in several (every layer's gathered weights, say); the policy applies
    to each. Outside a checkpoint, and in the recompute, it does nothing.

    Args:
        x: a tensor or a pytree of tensors.
        name: the name, a string.

    Returns:
        ``x``, unchanged (the same objects).

    Raises:
        TypeError: ``name`` is not a string, or a leaf of ``x`` is not a tensor.

    Example:
        >>> import torch, pshard as ps
        >>> policy = ps.checkpoint_policies.save_only_these_names("h")
        >>> @ps.checkpoint(policy=policy)
        ... def f(x):
        ...     h = ps.checkpoint_name(torch.sin(x), "h")  # kept for the backward
        ...     return (h * x).sum()
        >>> x = torch.tensor([0.0, 1.0])
        >>> torch.func.grad(f)(x)
        tensor([0.0000, 1.3818])
    """
    if not isinstance(name, str):
        raise TypeError(
            f"ps.checkpoint_name: name must be a string, got {describe(name)}; pass the name "
            f"that the checkpoint's policy lists, e.g. ps.checkpoint_name(x, 'gather')"
        )
    namer = NAMER.get()
    if namer is None:
        if not isinstance(x, torch.Tensor):
            _leaves(x, name)
        return x
    for leaf in _leaves(x, name):
        namer(leaf, name)
    return x


def _leaves(x: Any, name: str) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    leaves, treedef = tree_flatten(x)
    for i, leaf in enumerate(leaves):
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(
                f"ps.checkpoint_name({name!r}): {keystr(leaf_path(treedef, i), 'x')} is "
                f"{describe(leaf)}, not a tensor; name tensors (or pytrees of tensors) only"
            )
    return leaves
