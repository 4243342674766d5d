"""``sharded_call``'s policy as data: the dtypes of FSDP2's ``MixedPrecisionPolicy`` and the
overlap and resharding switches of ``fully_shard``, in one frozen dataclass.

FSDP2's rules, kept here:

- ``param_dtype``: the floating-point parameters are cast to it before they are gathered, and
  each unit computes with them in it; ``None``: every parameter in its own dtype.
- ``reduce_dtype``: the dtype the weights' cotangents are reduced in (inside a map) or sliced
  in (a ``GlobalTensor`` outside one); ``None``: ``param_dtype`` (FSDP2's default: the
  reduction runs in the compute dtype unless asked otherwise). Gradients come back in each
  block's own dtype either way.
- The floating-point tensors of the call's inputs, and of each unit's, are cast to
  ``param_dtype`` (FSDP2's ``cast_forward_inputs=True``); integer tensors and everything that is
  not a tensor pass as they are; outputs are not cast back (they come out in ``param_dtype``).
- Buffers are never cast (FSDP2 leaves them to the module).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from .._core.tree import describe, tree_flatten, tree_unflatten

__all__ = ["ShardedCallPolicy"]

_FN = "sharded_call"


def _dtype(name: str, value: Any) -> torch.dtype | None:
    if value is None:
        return None
    if not isinstance(value, torch.dtype):
        raise TypeError(
            f"{_FN}: {name} must be a torch.dtype or None, got {describe(value)}; e.g. "
            f"{name}=torch.bfloat16"
        )
    if not value.is_floating_point:
        raise ValueError(
            f"{_FN}: {name}={value} is not a floating-point dtype; parameters and their "
            f"gradients are cast to it (torch.bfloat16, torch.float16 or torch.float32)"
        )
    return value


def _flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{_FN}: {name} must be True or False, got {describe(value)}")
    return value


@dataclasses.dataclass(frozen=True)
class ShardedCallPolicy:
    """What ``sharded_call`` does besides gathering: dtypes, overlap and resharding.

    Attributes:
        param_dtype: the dtype parameters are gathered and computed in (``None``: their own).
        reduce_dtype: the dtype cotangents are reduced in (``None``: ``param_dtype``).
        prefetch: issue the next unit's gather before the current one computes (in the forward
            and the backward) and let gradient reduce-scatters run while the backward goes on.
        reshard_after_forward: drop each unit's gathered weights after its forward and gather
            them again in the backward (``False``: keep them from the forward to the backward,
            ZeRO-2; no second gather).
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    prefetch: bool = True
    reshard_after_forward: bool = True

    @classmethod
    def of(
        cls,
        param_dtype: Any = None,
        reduce_dtype: Any = None,
        prefetch: Any = True,
        reshard_after_forward: Any = True,
    ) -> ShardedCallPolicy:
        """The policy from ``sharded_call``'s keyword arguments, checked.

        Raises:
            TypeError: a dtype that is not a ``torch.dtype`` or a flag that is not a bool.
            ValueError: a dtype that is not floating-point.
        """
        return cls(
            _dtype("param_dtype", param_dtype),
            _dtype("reduce_dtype", reduce_dtype),
            _flag("prefetch", prefetch),
            _flag("reshard_after_forward", reshard_after_forward),
        )

    @property
    def reduce(self) -> torch.dtype | None:
        """The dtype cotangents are reduced in (``None``: the dtype they come in)."""
        return self.reduce_dtype if self.reduce_dtype is not None else self.param_dtype

    def cast_inputs(self, tree: Any) -> Any:
        """``tree`` with its floating-point tensors cast to ``param_dtype``, differentiably."""
        dtype = self.param_dtype
        if dtype is None:
            return tree

        def cast(x: Any) -> bool:
            return isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype

        leaves, treedef = tree_flatten(tree)
        if not any(map(cast, leaves)):
            return tree  # nothing rebuilt: containers the call made stay its own
        return tree_unflatten(treedef, [x.to(dtype) if cast(x) else x for x in leaves])
