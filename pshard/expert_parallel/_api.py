"""``ps.expert_parallel`` and ``ps.expert_parallel_specs``: mixture-of-experts layers with their
experts split over a mesh axis, for functional code."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from .._core.placements import P
from .._core.tree import describe
from .._modules.adapter import ExpertsPart, experts_part
from .._runtime.mesh import named_axis
from .._shard_map.sharded_call import KEEP_SPLIT
from ._install import Run, running
from ._plan import Resolved, resolve

__all__ = ["expert_parallel", "expert_parallel_specs"]


def _resolve(
    model: nn.Module, axis: str, mesh: DeviceMesh | None, fn: str
) -> tuple[Resolved, DeviceMesh, int, ExpertsPart]:
    if not isinstance(model, nn.Module):
        raise TypeError(f"{fn}: model must be an nn.Module, got {describe(model)}")
    mesh, size = named_axis(axis, mesh, fn)
    part = experts_part(model)
    resolved = resolve(model, axis, size, part, fn)
    assert part is not None  # resolve refuses a model without known experts
    return resolved, mesh, size, part


def expert_parallel_specs(
    model: nn.Module, axis: str = "ep", *, mesh: DeviceMesh | None = None
) -> dict[str, P]:
    """The spec of every parameter of ``model`` with its experts split over ``axis``: the
    in_specs of the parameters for a map over ``axis`` (and what ``ps.shard`` takes to split
    them).

    The stacked experts' weights (``experts.gate_up_proj``, ``experts.down_proj``: dim 0 the
    expert) are ``P(axis)``, each rank holding ``E / n`` consecutive experts; everything else
    (attention, router, shared experts, norms, embeddings) ``P()``. Combine with other axes as
    for any specs (e.g. FSDP of every parameter over ``"dp"`` on another dim).

    Args:
        model: the model (its own parameters have the whole shapes; the ``meta`` device will do).
        axis: the mesh axis the experts are split over.
        mesh: the mesh; default the current mesh (the check of ``E % n`` needs the axis size).

    Returns:
        A dict parameter name (``model.named_parameters()``) -> :class:`~pshard.P`.

    Raises:
        TypeError: ``model`` is not a module, ``axis`` not a name.
        ValueError: ``axis`` is not an axis of the mesh, the model has no known experts
            module, or the axis size does not divide a module's number of experts.

    Example:
        >>> import torch, pshard as ps
        >>> mesh = ps.init_mesh({"ep": 1})
        >>> ps.expert_parallel_specs(torch.nn.Linear(2, 2))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: expert_parallel_specs(Linear): no known experts module in the model ...
    """
    return dict(_resolve(model, axis, mesh, "expert_parallel_specs")[0].specs)


@contextlib.contextmanager
def expert_parallel(
    model: nn.Module, axis: str = "ep", *, mesh: DeviceMesh | None = None
) -> Iterator[dict[str, P]]:
    """Run ``model``'s mixture-of-experts layers with their experts split over ``axis`` while
    the block is active: inside a map over ``axis`` (each rank its block of the experts and its
    own tokens, the batch split over ``axis`` as over a data axis),
    ``torch.func.functional_call(model, blocks, ...)`` computes what one process computes on
    the map's whole batch.

    Each rank routes its tokens with the (replicated) router, sends every token to the ranks
    holding its top-k experts (:func:`pshard.ragged_all_to_all`), runs its experts on the
    tokens it received (each expert's rows in one matmul) and sends the results back, where
    they are combined with the routing weights. Dropless: no token is dropped, however
    unbalanced the routing. Shared experts (Qwen2-MoE's ``shared_expert``) are replicated and
    run on every rank's own tokens. Inside the block the experts' ``forward`` is pshard's,
    whatever the model's experts implementation setting.

    The model's losses are those of the map's whole batch: ``num_items_in_batch`` (unless
    given: then the count of the whole batch) is the count of every rank's targets, so each
    rank's loss is its share; the router's load-balancing loss (``output_router_logits``, its
    ``router_aux_loss_coef``) sums its token statistics (per-expert counts, router
    probability sums, token count) over every axis the enclosing map maps, never a mean of
    per-rank means; ``out.loss`` and ``out.aux_loss`` are then summed over those axes: the
    single-process values, on every rank. Exactness holds where no token's k-th and
    (k+1)-th router probabilities tie (each rank routes with the model's own ``torch.topk``).

    Gradients: call the map from outside (``torch.func.grad(ps.shard_map(loss, in_specs=
    (ps.expert_parallel_specs(model), P("ep"))))``) or ``.backward()`` through it: the
    experts' gradients are their blocks, the rest whole, equal to one process's. A backward
    or a recompute of a call made inside the block runs as inside it, even after the block
    exits. Inside the block ``ps.sharded_call`` gathers blocks over every axis but ``axis``
    (the experts stay split: FSDP x EP).

    Args:
        model: the model (Hugging Face's Mixtral, Qwen2-MoE, Qwen3-MoE causal LMs and their
            base models); its own parameters have the whole shapes (the ``meta`` device will
            do), ``functional_call`` gives it the blocks.
        axis: the mesh axis the experts are split over.
        mesh: the mesh; default the current mesh.

    Yields:
        The parameters' specs (:func:`expert_parallel_specs`).

    Raises:
        TypeError, ValueError: as :func:`expert_parallel_specs`; when the model runs, blocks
            of the wrong size (naming the parameter), or a call outside a map over ``axis``
            (``RuntimeError``).

    Example:
        >>> import torch, pshard as ps
        >>> mesh = ps.init_mesh({"ep": 1})
        >>> with ps.expert_parallel(torch.nn.Linear(2, 2)):  # doctest: +ELLIPSIS
        ...     pass
        Traceback (most recent call last):
        ...
        ValueError: expert_parallel(Linear): no known experts module in the model ...
    """
    fn = "expert_parallel"
    resolved, mesh, size, part = _resolve(model, axis, mesh, fn)
    token = KEEP_SPLIT.set(KEEP_SPLIT.get() | {axis})
    try:
        with running(Run(model, axis, mesh, size, resolved, part)):
            yield dict(resolved.specs)
    finally:
        KEEP_SPLIT.reset(token)
