"""``ps.pipeline_value_and_grad``: a training step's loss and gradients through a pipeline.

The model is cut into stages along a mesh axis, rank ``r`` running stage ``r`` (and ``r +
N``, ... under ``"interleaved_1f1b"``). The batch is cut into microbatches that flow through
the stages as the schedule says (:mod:`pshard._pipeline.schedule`), each stage differentiated
as ``torch.func.vjp`` would (:mod:`pshard._pipeline.stage_call`; under zero bubble the
backward cut in two: :mod:`pshard._pipeline.split_backward`), each backward run as soon as
the schedule says (:mod:`pshard._pipeline.executor`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import optree
import torch
import torch.distributed as dist

from .._core.checks import WIRE_DTYPES, check_int
from .._core.tree import NAMESPACE, describe
from .._runtime import stage_parts
from .._runtime.mesh import Axis, current_mesh
from .._runtime.tracing import refuse
from .executor import loss_code
from .schedule import SCHEDULES
from .setup import Prepared, check_stages, prepare

__all__ = ["pipeline_value_and_grad"]

_FN = "pipeline_value_and_grad"

Stages = Callable[[Any, Any], Any] | Sequence[Callable[[Any, Any], Any]]


def pipeline_value_and_grad(
    stages: Stages,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    *,
    axis: Axis = "pp",
    num_microbatches: int,
    schedule: str = "1f1b",
    in_specs: Any = None,
) -> Callable[[Any, Any, Any], tuple[torch.Tensor, Any]]:
    """The loss and this rank's stage's gradients of a model cut into stages along ``axis``.

    Rank ``r`` of ``axis`` (``N`` ranks) runs stage ``r``: ``stages`` is one function
    ``stage(params, x) -> y`` for every stage, or a list of ``N`` functions (the first may
    embed tokens, the last end in the head). ``inputs`` and ``targets`` are cut into
    ``num_microbatches`` microbatches along dim 0 (``torch.chunk``'s sizes; ``in_specs``, a
    prefix tree of ``(inputs, targets)`` in :func:`pshard.pmap_microbatch`'s spec language,
    says otherwise); the microbatches flow through the stages as ``schedule`` orders, each
    activation sent to the next rank with its shapes (so a stage may change the feature
    shape). In pseudo-code, on every rank::

        def fn(params, inputs, targets):        # params: this rank's stage's
            loss = 0
            for x, t in zip(chunk(inputs), chunk(targets)):
                y = x
                for stage in stages:             # stage i runs on rank i, all at once
                    y = stage(params_i, y)
                loss += loss_fn(y, t)
            return loss, grad(loss, params_r)    # the same loss on every rank

    Schedules (``M`` microbatches):

    - ``"1f1b"`` (default): one forward and one backward in turn after a short warm-up; at
      most ``N`` microbatches' activations alive on a rank; bubble ``(N - 1) / (M + N - 1)``.
    - ``"gpipe"``: every forward, then every backward (all ``M`` alive); the same bubble.
    - ``"interleaved_1f1b"``: ``stages`` is a list of ``v * N`` functions, rank ``r`` holding
      stages ``r, r + N, ...``; ``params`` and the gradients are tuples of its ``v`` trees.
      Bubble ``(N - 1) / (v * M + N - 1)`` when ``M`` is a multiple of ``N``.
    - ``"zero_bubble"`` (ZB-H1): each backward cut into the input cotangent, sent upstream at
      once, and the weight cotangent, computed where the rank would wait (the stage's
      autograd graph cut at the nodes the weights hang off: each product of the backward
      runs once); about a third of 1F1B's bubble, at most ``N`` microbatches alive.

    ``pshard.pipeline_schedule`` shows any of them as a timeline. Every schedule gives the
    same loss and gradients as one process running the stages in sequence, to rounding;
    fewer microbatches than stages is allowed (a larger bubble).

    Composes with a map over another axis (``ps.shard_map(..., axis_names="dp")`` around it:
    2-D data x pipeline parallelism, each data rank running its own pipeline), with
    :func:`pshard.checkpoint` and :func:`pshard.sharded_call` inside a stage, and inside a map
    over ``axis`` itself, where ``params`` may be the blocks of parameters stacked along it
    (``P(axis)``): each stage gets its block and its gradient is a block.

    Args:
        stages: one function ``stage(params, x) -> y`` shared by every stage, or a list of
            them, one per stage (``v * N`` for ``"interleaved_1f1b"``). The first stage's ``x``
            is the microbatch of ``inputs``; the others' the previous stage's ``y``, a tensor
            or a tuple of tensors whose dtype and shape beyond the split dim are the same for
            every microbatch.
        loss_fn: ``loss_fn(y, targets) -> scalar``, the microbatch's loss from the last
            stage's output; the loss returned is their sum (a mean is the user's division by
            a global count).
        axis: the mesh axis along which the stages lie (a name, a tuple of names, or a
            ``ProcessGroup``).
        num_microbatches: how many microbatches (``>= 1``).
        schedule: ``"1f1b"``, ``"gpipe"``, ``"interleaved_1f1b"`` or ``"zero_bubble"``.
        in_specs: how to cut ``(inputs, targets)`` (a prefix tree: ``Shard(d)``,
            ``Replicate()`` or ``None``); default ``Shard(0)`` for tensors with a dim.

    Returns:
        ``fn(params, inputs, targets) -> (loss, grads)``: ``params`` this rank's stage's
        pytree (plain tensors, blocks or ``GlobalTensor`` s; a tuple of ``v`` trees for
        ``"interleaved_1f1b"``), ``inputs`` and ``targets`` the same on every rank of the
        axis; ``loss`` (the sum over microbatches, in the loss's dtype) on every rank,
        ``grads`` with ``params``' structure (``None`` for leaves that are not floating-point
        tensors). Every rank of the axis must call it.

    Raises:
        TypeError: ``stages`` or ``loss_fn`` is not callable.
        ValueError: on every rank of the axis, never a hang: an unknown ``schedule``, a count
            of stage functions that does not fit the axis (naming both counts), ``params`` that
            are not ``v`` trees, inputs that cannot be cut into ``num_microbatches`` pieces, a
            stage whose output dtype or shape beyond the split dim changes between
            microbatches (naming the stage), a ``loss_fn`` that does not return a scalar. A
            stage that raises is raised again on its rank; the other ranks raise a
            ``RuntimeError`` naming it.

    Example:
        >>> import torch, pshard as ps
        >>> mesh = ps.init_mesh({"pp": 1})
        >>> def stage(w, x):
        ...     return torch.tanh(x @ w)
        >>> step = ps.pipeline_value_and_grad(
        ...     stage, lambda y, t: ((y - t) ** 2).sum(), num_microbatches=2)
        >>> w, x, t = torch.eye(3), torch.ones(4, 3), torch.zeros(4, 3)
        >>> loss, grads = step(w, x, t)
        >>> round(loss.item(), 4), grads.shape
        (6.9603, torch.Size([3, 3]))
    """
    refuse(_FN, "its schedule sends between stages as it goes (jit each stage's function)")
    check_stages(stages, _FN)
    if not callable(loss_fn):
        raise TypeError(f"{_FN}: loss_fn must be a function loss_fn(y, targets), got "
                        f"{describe(loss_fn)}")  # fmt: skip
    if schedule not in SCHEDULES:
        raise ValueError(
            f"{_FN}: schedule={schedule!r} is not a schedule; use one of "
            f"{', '.join(map(repr, SCHEDULES))}"
        )
    count = check_int(_FN, "num_microbatches", num_microbatches, minimum=1)

    def fn(params: Any, inputs: Any, targets: Any) -> tuple[torch.Tensor, Any]:
        prep = prepare(
            fn_name=_FN,
            stages=stages,
            params=params,
            axis=axis,
            schedule=schedule,
            num_microbatches=count,
            parts=[((inputs, targets), in_specs, "in_specs")],
        )
        (pairs,) = prep.microbatches.parts
        last = prep.schedule.num_stages - 1
        fns = dict(prep.fns)
        if last in fns:
            head = fns[last]
            fns[last] = lambda p, x, m: loss_fn(head(p, x), pairs[m][1])
        mode = "split" if schedule == "zero_bubble" else "full"
        ex = prep.executor(_FN, fns, [pair[0] for pair in pairs], mode=mode, loss=True)
        ex.run()
        total = ex.loss.item() if ex.loss is not None else 0.0
        code = loss_code(ex.loss_dtype) if ex.loss_dtype is not None else 0
        loss_sum, dtype_code = ex.status([total, code])
        dtype = WIRE_DTYPES[int(dtype_code) - 1] if dtype_code else torch.get_default_dtype()
        loss = torch.tensor(loss_sum, dtype=torch.float64, device=prep.link.device).to(dtype)
        trees = ex.gradient_trees()
        grads = [trees[s] for s in prep.stages]
        _mark_stage_parts(grads, prep, axis)
        return loss, (tuple(grads) if schedule == "interleaved_1f1b" else grads[0])

    return fn


def _mark_stage_parts(grads: list[Any], prep: Prepared, axis: Axis) -> None:
    """Mark the gradients as this rank's stages' part of the model's, so that a global norm
    of them sums the squares over the pipeline axis (:mod:`pshard._runtime.stage_parts`)."""
    if prep.link.group is None:
        return  # one stage: the gradients are the whole model's
    mesh = None if isinstance(axis, dist.ProcessGroup) else current_mesh()
    part = stage_parts.StagePart(prep.link.group, prep.axis_name, mesh)
    stage_parts.mark(optree.tree_leaves(tuple(grads), namespace=NAMESPACE), part)  # type: ignore[arg-type]
