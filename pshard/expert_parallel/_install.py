"""A model while ``expert_parallel`` runs it: the blocks it is in (a context variable), its
experts' and its own ``forward`` and its load-balancing loss replaced, and what stays after the
block for backward passes.

**The run.** Each ``with ps.expert_parallel(model, ...)`` is a :class:`Run` (the model, the
axis and its mesh, the resolved experts), pushed on a context variable for the block.

**The patches.** While at least one run of a model is installed, each experts module's
``forward`` is an :class:`_Experts` (:func:`~pshard.expert_parallel._dispatch.dispatch` on this
rank's tokens), the model's own is a :class:`_Root`, and the load-balancing loss function the
model's forward reads (a name in its modeling module) is a :class:`_Balance`. Each asks for the
active run on every call: with none it is what it replaced. Installs are counted per model
(threads that are ranks share one model, each with its own context) and the model is restored
when the last one ends; the loss function, shared by the family's models, is counted apart.

**One call of the model** (:class:`_Root`): the axes the enclosing map maps are the ranks whose
tokens make the batch. The count of the targets of the whole batch (``num_items_in_batch``,
unless given) goes to the model, so its loss is this rank's share; the load-balancing loss sums
its token statistics over those ranks and each rank returns its share of it; ``loss`` and
``aux_loss`` are then summed over the axes: the single-process values on every rank.

**Backward passes.** The root records the run with the model's outputs
(:func:`pshard._modules.passes.record_for_backward`): a backward pass through a call made in
the block installs the patches again for the rest of that pass (recomputed experts, with
``ps.checkpoint`` or ``torch.utils.checkpoint``, exchange as in the forward).

Internal interface: ``Run`` (``backward_scope``), ``running(run)``.
"""

from __future__ import annotations

import contextvars
import inspect
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from .._collectives.functions import psum
from .._modules.adapter import ExpertsPart
from .._modules.passes import record_for_backward
from .._modules.patches import (
    Part,
    Root,
    Runs,
    patch_parts,
    set_forward,
    set_name,
)
from .._runtime.mesh import mapped_axes, use_mesh
from ._dispatch import dispatch
from ._plan import Resolved

__all__ = ["Run", "running"]

_FN = "expert_parallel"
_NUM_ITEMS = "num_items_in_batch"
_SUMMED = ("loss", "aux_loss")

# the load-balancing loss of the model call running now (read by the family's loss function)
_CALL: contextvars.ContextVar[Callable[..., Any] | None] = contextvars.ContextVar(
    "pshard_expert_parallel_call", default=None
)


class Run:
    """One ``expert_parallel`` block of one model."""

    def __init__(
        self,
        model: nn.Module,
        axis: str,
        mesh: DeviceMesh,
        size: int,
        resolved: Resolved,
        part: ExpertsPart,
    ) -> None:
        self.model, self.axis, self.mesh, self.size = model, axis, mesh, size
        self.resolved, self.part = resolved, part
        self.key = (axis, size)

    def backward_scope(self) -> Callable[[], None]:
        """A backward pass through a call of the block: the model patched again until it ends."""
        return _BLOCKS.install(self)

    def batch_axes(self) -> tuple[str, ...]:
        """The axes of the enclosing map (the ranks whose tokens make the batch), which must
        include the experts' axis."""
        names = tuple(self.mesh.mesh_dim_names or ())
        axes = tuple(a for a in mapped_axes() if a in names)
        if self.axis not in axes:
            raise RuntimeError(
                f"{_FN}({type(self.model).__name__}): the model runs outside a map over "
                f"{self.axis!r} (maps running: {mapped_axes() or 'none'}); call it inside "
                f"ps.shard_map(..., in_specs=(ps.expert_parallel_specs(model), ...)) mapping "
                f"{self.axis!r}, each rank its block of the experts and its own tokens"
            )
        return axes


class _Experts(Part):
    """An experts module's ``forward`` while its model is installed."""

    def __call__(
        self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        run = active_run(self.model)
        if run is None:
            return self.own()(hidden, top_k_index, top_k_weights)
        count, local = run.resolved.experts[self.name]
        for p in run.part.experts_parameters(self.module):
            held = getattr(self.module, p)
            if held.shape[0] != local:
                raise ValueError(
                    f"{_FN}({type(self.model).__name__}): {self.name}.{p} has {held.shape[0]} "
                    f"experts on this rank, but {count} experts over {run.size} ranks of "
                    f"{run.axis!r} are {local} each; pass this rank's block "
                    f"(in_specs: ps.expert_parallel_specs(model), P({run.axis!r}) on the "
                    f"expert dim)"
                )
        with use_mesh(run.mesh):
            return dispatch(
                run.part, self.module, run.axis, run.size, local, hidden, top_k_index,
                top_k_weights,
            )  # fmt: skip


class _Root(Root):
    """The model's ``forward`` while it is installed (see the module docs)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        own = self.own()
        run = active_run(self.model)
        if run is None:
            return own(*args, **kwargs)
        with use_mesh(run.mesh):
            axes = run.batch_axes()
            kwargs = _by_name(own, args, kwargs)
            items = run.part.loss_items(kwargs)
            if items is not None:
                kwargs[_NUM_ITEMS] = psum(items, axes)
            names = list(run.mesh.mesh_dim_names or ())
            share = math.prod(int(run.mesh.size(names.index(a))) for a in axes)
            token = _CALL.set(run.part.balance_loss(lambda t: psum(t, axes), share))
            try:
                out = own(**kwargs)
            finally:
                _CALL.reset(token)
            out = _sum_losses(out, axes)
        return record_for_backward(out, run)


class _Balance:
    """The family's load-balancing loss function while a model of it is installed: inside a
    call of the block, the block's (statistics of the whole batch); else the family's own."""

    def __init__(self, own: Callable[..., Any]) -> None:
        self.own = own
        self.count = 0
        self.restore: Callable[[], None] = _nothing

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        inside = _CALL.get()
        return (self.own if inside is None else inside)(*args, **kwargs)


def _nothing() -> None:
    return None


def _by_name(own: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict:
    """The call's arguments by name (positional ones bound by ``forward``'s signature)."""
    if not args:
        return dict(kwargs)
    names = [
        p.name
        for p in inspect.signature(own).parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    if len(args) > len(names):
        raise TypeError(f"{_FN}: {len(args)} positional arguments, forward takes {len(names)}")
    return dict(zip(names, args, strict=False)) | kwargs


def _sum_losses(out: Any, axes: tuple[str, ...]) -> Any:
    """``loss`` and ``aux_loss`` of the model's output (a ``ModelOutput``) summed over
    ``axes``: each rank computed its share."""
    for key in _SUMMED:
        try:
            value = out[key]
        except (KeyError, TypeError, IndexError):
            continue
        if isinstance(value, torch.Tensor):
            out[key] = psum(value, axes)
    return out


def _clash(run: Run) -> str:
    return (
        f"{_FN}({type(run.model).__name__}): the model is already split by another "
        f"expert_parallel block (another axis or size); one model runs under one layout at a "
        f"time"
    )


def _patch(run: Run, root: Root) -> None:
    model = run.model
    patch_parts(root, run.resolved.experts, _Experts)
    slot = run.part.balance_loss_slot(model)
    if slot is not None:
        root.undo.append(_patch_balance(*slot))
    root.undo.append(set_forward(model, root))


def _patch_balance(namespace: dict[str, Any], name: str) -> Callable[[], None]:
    """The family's loss function a :class:`_Balance` (one per family, counted)."""
    current = namespace[name]
    if isinstance(current, _Balance):
        balance = current
    else:
        balance = _Balance(current)
        balance.restore = set_name(namespace, name, balance)
    balance.count += 1

    def undo() -> None:
        balance.count -= 1
        if balance.count == 0:
            balance.restore()

    return undo


# the runs of this kind of block in this context, and how they are installed
_BLOCKS = Runs("pshard_expert_parallel", Run, _Root, _patch, _clash)
active_run = _BLOCKS.active  # (model) -> the innermost run of it, or the recorded one, or None
running = _BLOCKS.running  # (run): the block, the run pushed on the context and installed
