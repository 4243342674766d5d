"""One unit of ``ps.sharded_call``: its gather, its checkpointed call, and its place in the
call's schedule.

:class:`Gathered` turns some parameters' blocks into the values the model computes with (a
gather, a cast, or nothing) through one :func:`~pshard._collectives.cast_gather.cast_gather`;
:class:`UnitCall` is what a unit's checkpoint runs (the gather, named :data:`GATHER_NAME` so
that the policy recomputes it, then the unit's own forward); :class:`UnitEntry` is what the
model's call of the unit runs (its place in the schedule, its inputs cast, the checkpoint, and
the Function on its outputs that starts the backward's gathers); :func:`installed` puts the
entries in place of the units' forwards while the model runs.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from .. import _compat as compat
from .._collectives.apply import call
from .._collectives.cast_gather import BlockPlan, UnitPlan, cast_gather
from .._core.tree import tree_flatten, tree_unflatten
from .._remat.checkpoint import checkpoint
from .._remat.names import checkpoint_name
from .._remat.policies import save_anything_except_these_names
from .._runtime.ranges import ranged
from .fsdp_policy import ShardedCallPolicy
from .unit_schedule import PreBackward, UnitSchedule, UnitSlot

__all__ = ["GATHER_NAME", "Gathered", "UnitCall", "UnitEntry", "installed"]

#: The :func:`pshard.checkpoint_name` of the weights a unit gathers (recomputed, not saved).
GATHER_NAME = "pshard.sharded_call.gather"

# the units whose own forward is running (their override calls through to it)
_INSIDE: contextvars.ContextVar[frozenset[int]] = contextvars.ContextVar(
    "pshard_sharded_call_inside", default=frozenset()
)


class Gathered:
    """Some parameters gathered together (a unit's, or the rest's): their plans, and which of
    them need work (a gather or a cast; the others are used as they are). ``cast[i]``: the
    value is a parameter (a buffer keeps its dtype)."""

    def __init__(
        self, plans: list[BlockPlan], dtypes: list[torch.dtype], policy: ShardedCallPolicy,
        cast: list[bool],
    ) -> None:  # fmt: skip
        pd = policy.param_dtype
        self.work = [
            i
            for i, (bp, c, d) in enumerate(zip(plans, cast, dtypes, strict=True))
            if bp.levels or (c and pd is not None and d.is_floating_point and d != pd)
        ]
        # only floating-point parameters are cast (a buffer that is gathered keeps its dtype)
        blocks = tuple(dataclasses.replace(plans[i], cast=cast[i]) for i in self.work)
        self.plan = UnitPlan(blocks, pd, policy.reduce)

    def __call__(self, blocks: list[torch.Tensor], slot: UnitSlot | None) -> list[torch.Tensor]:
        if not self.work:
            return list(blocks)
        wholes = iter(cast_gather(self.plan, [blocks[i] for i in self.work], slot))
        work = set(self.work)
        return [next(wholes) if i in work else b for i, b in enumerate(blocks)]


class UnitCall:
    """One unit's call, checkpointed: gathers the unit's parameters from the blocks it is given
    (named :data:`GATHER_NAME`, so the policy recomputes them) and runs the unit's own forward
    with them. Not a closure over the unit, so the checkpoint does not take the unit's own
    parameters for arguments."""

    def __init__(
        self,
        unit: torch.nn.Module,
        prefix: str,
        name: str,
        local_names: list[str],
        gathered: Gathered,
        slot: UnitSlot | None,
    ) -> None:
        self.unit = unit
        self.prefix = prefix
        self.__qualname__ = name  # how ps.checkpoint's errors name this call
        self.local_names = local_names
        self.gathered = gathered
        self.slot = slot

    def __call__(
        self,
        blocks: list[torch.Tensor],
        extras: dict[str, torch.Tensor],
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        with ranged(lambda: f"pshard.unit[{self.prefix}].gather"):
            gathered = self.gathered(blocks, self.slot)
        whole = dict(extras)
        for local_name, value in zip(self.local_names, gathered, strict=True):
            whole[local_name] = checkpoint_name(value, GATHER_NAME)
        token = _INSIDE.set(_INSIDE.get() | {id(self.unit)})
        try:
            return torch.func.functional_call(self.unit, whole, args, kwargs, strict=False)
        finally:
            _INSIDE.reset(token)


class UnitEntry:
    """What the model's call of a unit runs: its place in the schedule, its inputs cast, the
    checkpointed call, and (when the backward gathers again and overlaps) the Function on its
    outputs that starts the backward's gathers."""

    def __init__(
        self, run: UnitCall, u: int, blocks: list[torch.Tensor], extras: dict[str, torch.Tensor],
        schedule: UnitSchedule, policy: ShardedCallPolicy,
    ) -> None:  # fmt: skip
        self.run = run
        self.u = u
        self.blocks = blocks
        self.extras = extras
        self.schedule = schedule
        self.policy = policy
        # reshard after forward: every value kept but the gathered weights (gathered again)
        dropped = (GATHER_NAME,) if policy.reshard_after_forward else ()
        self.checkpoint_policy = save_anything_except_these_names(*dropped)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        position = self.schedule.forward_call(self.u)
        args, kwargs = self.policy.cast_inputs((args, kwargs))
        with ranged(lambda: f"pshard.unit[{self.run.prefix}]"):
            out = checkpoint(self.run, self.blocks, self.extras, *args,
                             policy=self.checkpoint_policy, **kwargs)  # fmt: skip
        if not (self.policy.prefetch and self.policy.reshard_after_forward):
            return out
        if not (torch.is_grad_enabled() or compat.transforms_active()):
            return out
        leaves, treedef = tree_flatten(out)
        at = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and _float(x)]
        if not at:
            return out
        passed = call(PreBackward, self.schedule, position, *[leaves[i] for i in at])
        for i, x in zip(at, passed, strict=True):
            leaves[i] = x
        return tree_unflatten(treedef, leaves)


def _float(x: torch.Tensor) -> bool:
    return x.is_floating_point() or x.is_complex()


@contextlib.contextmanager
def installed(calls: Mapping[int, tuple[torch.nn.Module, Callable[..., Any]]]) -> Iterator[None]:
    """Each unit's forward replaced by its checkpointed call while the block runs; inside that
    call, the unit's own forward."""
    saved = []
    try:
        for unit, entry in calls.values():
            own = unit.__dict__.get("forward")
            original = type(unit).forward if own is None else own

            def forward(*args: Any, __unit: Any = unit, __call: Any = entry, __orig: Any = original,
                        **kwargs: Any) -> Any:  # fmt: skip
                if id(__unit) in _INSIDE.get():
                    return (
                        __orig(__unit, *args, **kwargs)
                        if __orig is type(__unit).forward
                        else __orig(*args, **kwargs)
                    )
                return __call(*args, **kwargs)

            saved.append((unit, own))
            unit.forward = forward
        yield
    finally:
        for unit, own in saved:
            if own is None:
                del unit.forward
            else:
                unit.forward = own
