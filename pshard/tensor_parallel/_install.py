"""A model while ``tensor_parallel`` runs it: the blocks it is in (a context variable), its
split layers' ``forward`` replaced, and what stays after the block for backward passes.

**The run.** Each ``with ps.tensor_parallel(model, ...)`` is a :class:`Run` (the model, the
axis and its mesh, the resolved plan), pushed on a context variable for the block. ``ps.checkpoint``
runs its recompute in a copy of the forward's context, so a layer recomputed after the block
still finds its run.

**The patches.** While at least one run of a model is installed, each split layer's
``forward`` is a :class:`_Forward` (an instance attribute, as ``sharded_call`` installs its
units) and the model's own is a :class:`_Root`; the attention modules compute with this rank's
head counts and the model's loss, with ``loss_parallel``, works on the split vocabulary (both
through the model adapter). A patch asks for the model's active run on every call: with none it
is the module's own ``forward``; with one it computes the split layer (:mod:`._layers`).
Installs are counted per model (threads that are ranks share one model) and the model is
restored when the last one ends.

**Backward passes.** The root records the run with the model's outputs
(:func:`pshard._modules.passes.record_for_backward`): a backward pass through a call made in
the block installs the patches again for the rest of that pass (recomputed layers, with
``ps.checkpoint`` or ``torch.utils.checkpoint``, run split as in the forward) and finds the run
where the context variable has none.

Internal interface: ``Run`` (``backward_scope``), ``running(run)`` (the block's context
manager: the run pushed and installed), ``active_run(model)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from .._collectives.functions import axis_index
from .._modules.adapter import TensorParallelParts
from .._modules.passes import record_for_backward
from .._modules.patches import (
    Part,
    Root,
    Runs,
    patch_parts,
    set_forward,
)
from .._runtime.mesh import use_mesh
from ._layers import Split, run_layer
from ._plan import Resolved

__all__ = ["Run", "active_run", "running"]

_FN = "tensor_parallel"


class Run:
    """One ``tensor_parallel`` block of one model."""

    def __init__(
        self,
        model: nn.Module,
        axis: str,
        mesh: DeviceMesh,
        size: int,
        resolved: Resolved,
        loss_parallel: bool,
        adapter: TensorParallelParts | None,
    ) -> None:
        self.model = model
        self.axis = axis
        self.mesh = mesh
        self.size = size
        self.resolved = resolved
        self.loss_parallel = loss_parallel
        self.adapter = adapter
        self.key = (axis, size, loss_parallel, tuple(resolved.layers.values()))
        self.split: Split | None = None

    def split_now(self) -> Split:
        """This rank's view of the axis (made once, in the run's mesh)."""
        if self.split is None:
            with use_mesh(self.mesh):
                rank = axis_index(self.axis)
            self.split = Split(self.axis, self.size, rank, self.loss_parallel)
        return self.split

    def backward_scope(self) -> Callable[[], None]:
        """A backward pass through a call of the block: the model split again until it ends."""
        return _BLOCKS.install(self)


class _Forward(Part):
    """A split layer's ``forward`` while its model is installed."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        own = self.own()
        run = active_run(self.model)
        if run is None:
            return own(*args, **kwargs)
        layer = run.resolved.layers[self.name]
        with use_mesh(run.mesh):
            return run_layer(layer, self.module, own, args, kwargs, run.split_now())


class _Root(Root):
    """The model's ``forward`` while it is installed: records the run with the outputs (for
    the backward passes through them)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        own = self.own()
        run = active_run(self.model)
        if run is None:
            return own(*args, **kwargs)
        return record_for_backward(own(*args, **kwargs), run)


def _clash(run: Run) -> str:
    return (
        f"{_FN}({type(run.model).__name__}): the model is already split by another "
        f"tensor_parallel block (another plan, axis size or loss_parallel); one model runs "
        f"under one layout at a time"
    )


def _patch(run: Run, root: Root) -> None:
    model, adapter = run.model, run.adapter
    patch_parts(root, run.resolved.layers, _Forward)
    for name, heads, kv_heads in run.resolved.attention:
        assert adapter is not None  # only an adapter describes attention modules
        root.undo.append(adapter.localize_attention(model.get_submodule(name), heads, kv_heads))
    if run.loss_parallel and adapter is not None:
        undo = adapter.parallel_loss(model, run.axis)
        if undo is not None:
            root.undo.append(undo)
    root.undo.append(set_forward(model, root))


# the runs of this kind of block in this context, and how they are installed
_BLOCKS = Runs("pshard_tensor_parallel", Run, _Root, _patch, _clash)
active_run = _BLOCKS.active  # (model) -> the innermost run of it, or the recorded one, or None
running = _BLOCKS.running  # (run): the block, the run pushed on the context and installed
