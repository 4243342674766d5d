"""``ps.tensor_parallel``, ``ps.tensor_parallel_specs`` and ``ps.tensor_parallel_plan``: torch's
``parallelize_module`` for functional code."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from .._core.placements import P
from .._core.tree import describe
from .._modules.adapter import TensorParallelParts, tensor_parallel_part
from .._runtime.mesh import named_axis
from .._shard_map.sharded_call import KEEP_SPLIT
from ._install import Run, running
from ._plan import Resolved, resolve

__all__ = ["tensor_parallel", "tensor_parallel_plan", "tensor_parallel_specs"]


def tensor_parallel_plan(model: nn.Module, *, sequence_parallel: bool = False) -> dict[str, str]:
    """The default plan of a model a model adapter knows (Hugging Face's Llama, Qwen2, Mistral
    and GPT-2 causal LMs): embeddings ``"vocab"``, attention and MLP projections ``"colwise"``
    / ``"rowwise"``, the head ``"colwise"``; with ``sequence_parallel=True`` also the decoder
    layers and the final norm ``"sequence"`` (Megatron sequence parallelism: the activations
    between the parallel regions split over the tokens).

    Args:
        model: the model.
        sequence_parallel: add Megatron sequence parallelism.

    Returns:
        The plan, a dict of module-name pattern -> style, to pass to :func:`tensor_parallel`
        (``plan=None`` is this plan without sequence parallelism).

    Raises:
        ValueError: no adapter has a plan for this model.

    Example:
        >>> import torch, pshard as ps
        >>> ps.tensor_parallel_plan(torch.nn.Linear(2, 2))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: tensor_parallel_plan: no default plan for Linear ...
    """
    return _default_plan(
        model, sequence_parallel, tensor_parallel_part(model), "tensor_parallel_plan"
    )


def _default_plan(
    model: nn.Module, sequence: bool, adapter: TensorParallelParts | None, fn: str
) -> dict[str, str]:
    plan = adapter.tensor_parallel_plan(model, sequence) if adapter is not None else None
    if plan is None:
        raise ValueError(
            f"{fn}: no default plan for {type(model).__name__} (default plans: Hugging Face's "
            f"Llama, Qwen2, Mistral and GPT-2 causal LMs); pass a plan, e.g. "
            f"{{'up': 'colwise', 'down': 'rowwise'}}"
        )
    return plan


def _resolve(
    model: nn.Module,
    plan: Mapping[str, str] | None,
    axis: str,
    mesh: DeviceMesh | None,
    fn: str,
) -> tuple[Resolved, DeviceMesh, int, TensorParallelParts | None]:
    if not isinstance(model, nn.Module):
        raise TypeError(f"{fn}: model must be an nn.Module, got {describe(model)}")
    mesh, size = named_axis(axis, mesh, fn)
    adapter = tensor_parallel_part(model)
    if plan is None:
        plan = _default_plan(model, False, adapter, fn)
    return resolve(model, plan, axis, size, adapter, fn), mesh, size, adapter


def tensor_parallel_specs(
    model: nn.Module,
    plan: Mapping[str, str] | None = None,
    *,
    axis: str = "tp",
    mesh: DeviceMesh | None = None,
) -> dict[str, P]:
    """The spec of every parameter of ``model`` under ``plan`` over ``axis``: the in_specs of
    the parameters for a map over ``axis`` (and what ``ps.shard`` takes to split them).

    A ``"colwise"`` ``nn.Linear`` splits its output features (``weight`` ``P(axis, None)``,
    ``bias`` ``P(axis)``), a ``"rowwise"`` one its input features (``weight``
    ``P(None, axis)``, ``bias`` ``P()``), a ``"vocab"`` embedding its rows (``P(axis, None)``);
    layers storing ``(in, out)`` (GPT-2's ``Conv1D``) get the transposed specs; a fused q|k|v
    projection is split part by part (``P(None, (3, axis))``: each rank its share of q, of k
    and of v); key/value projections with fewer heads than ranks, and everything else,
    ``P()`` (whole). The output depends on the axis size: ``mesh`` defaults to the current
    mesh.

    Args:
        model: the model (its own parameters have the whole shapes; the ``meta`` device will do).
        plan: module-name pattern -> style (see :func:`tensor_parallel`); ``None``: the
            model's default plan (:func:`tensor_parallel_plan`).
        axis: the mesh axis the layers are split over.
        mesh: the mesh; default the current mesh.

    Returns:
        A dict parameter name (``model.named_parameters()``) -> :class:`~pshard.P`.

    Raises:
        TypeError, ValueError: as :func:`tensor_parallel` (a pattern that matches no module, a
            module a style cannot split, heads the axis size does not divide, ...).

    Example:
        >>> import torch, pshard as ps
        >>> mesh = ps.init_mesh({"tp": 1})
        >>> mlp = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
        >>> ps.tensor_parallel_specs(mlp, {"0": "colwise", "2": "rowwise"})
        {'0.weight': P('tp', None), '0.bias': P('tp'), '2.weight': P(None, 'tp'), '2.bias': P()}
    """
    resolved = _resolve(model, plan, axis, mesh, "tensor_parallel_specs")[0]
    return dict(resolved.specs)


@contextlib.contextmanager
def tensor_parallel(
    model: nn.Module,
    plan: Mapping[str, str] | None = None,
    *,
    axis: str = "tp",
    mesh: DeviceMesh | None = None,
    loss_parallel: bool = False,
) -> Iterator[dict[str, P]]:
    """Run ``model``'s layers split over ``axis`` (Megatron tensor parallelism) while the block
    is active: inside a map over ``axis`` (or ``sharded_call`` within one),
    ``torch.func.functional_call(model, blocks, ...)`` on this rank's blocks computes the whole
    model's result.

    In pseudo-code, for the styles of ``plan`` (module-name pattern -> style; patterns are
    matched name by name, ``*`` standing for one name)::

        colwise:  y = x @ W_r.T + b_r              # this rank's output features (an output
                                                   # head's gathered, unless loss_parallel)
        rowwise:  y = psum(x_r @ W_r.T) + b        # x_r: this rank's input features
        vocab:    y = psum(rows_r[ids] where ids are this rank's rows, else 0)
        sequence: the module runs on this rank's share of the tokens (dim 1): the first such
                  module splits its input, the last gathers its output; inside them colwise
                  layers all-gather the tokens and rowwise ones psum_scatter them
        replicate (and every module no pattern matches): as it is

    Attention modules a model adapter describes run on this rank's heads: their q, k and v
    projections ``"colwise"`` and output projection ``"rowwise"`` split the heads (which the
    axis size must divide; with fewer key/value heads than ranks, the key/value projections
    stay whole and each rank keeps the head its queries use), and the module's own head counts
    (e.g. ``num_key_value_groups``, GPT-2's ``split_size``) are this rank's for the block.

    With ``loss_parallel=True`` the head's logits stay split over the vocabulary (the last dim,
    ``torch.chunk``'s split) and the model's own loss (``labels=``) is computed on them with
    :func:`pshard.cross_entropy` over ``axis`` (never gathered; Hugging Face's loss function
    is replaced for the block); ``ps.cross_entropy(logits, labels, axis=axis)`` does the same
    for a loss of your own.

    Gradients: call the map from outside (``torch.func.grad(ps.shard_map(loss, in_specs=
    (ps.tensor_parallel_specs(model), ...)))``) or ``.backward()`` through it, as for any map:
    the parameters' gradients are their blocks, equal to one process's (up to the model's own
    float32 rounding, e.g. Hugging Face's RMSNorm). A backward or a recompute of a call made
    inside the block runs as inside it, even after the block exits (``ps.checkpoint`` and
    ``torch.utils.checkpoint`` recompute split layers split). Inside the block
    ``ps.sharded_call`` gathers blocks over every axis but ``axis`` (FSDP x TP: parameters
    split over both).

    The block changes the model while it is active (each split layer's ``forward`` and the
    attention modules' head counts), and restores it on exit; a call of the model outside a
    run of the block is the model's own.

    Args:
        model: the model; its own parameters have the whole shapes (the ``meta`` device will
            do), ``functional_call`` gives it the blocks.
        plan: module-name pattern -> ``"colwise"`` | ``"rowwise"`` | ``"vocab"`` |
            ``"sequence"`` | ``"replicate"``; ``None``: the model's default plan
            (:func:`tensor_parallel_plan`).
        axis: the mesh axis to split over.
        mesh: the mesh; default the current mesh.
        loss_parallel: keep the head's logits split over the vocabulary.

    Yields:
        The parameters' specs (:func:`tensor_parallel_specs`).

    Raises:
        TypeError, ValueError: a plan pattern that matches no module, an unknown style, a
            module a style cannot split, heads the axis size does not divide, tied parameters
            split two ways, ``loss_parallel`` without an output head; when the model runs,
            blocks whose shapes are not the plan's (naming the parameter).

    Example:
        >>> import torch, pshard as ps
        >>> mesh = ps.init_mesh({"tp": 1})
        >>> mlp = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
        >>> params = {k: v.detach() for k, v in mlp.named_parameters()}
        >>> x = torch.randn(3, 4)
        >>> with ps.tensor_parallel(mlp, {"0": "colwise", "2": "rowwise"}) as specs:
        ...     f = ps.shard_map(lambda p, x: torch.func.functional_call(mlp, p, (x,)),
        ...                      in_specs=(specs, None), out_specs=ps.P())
        ...     y = f(params, x)
        >>> torch.allclose(y, mlp(x))
        True
    """
    fn = "tensor_parallel"
    resolved, mesh, size, adapter = _resolve(model, plan, axis, mesh, fn)
    if loss_parallel and not any(layer.head for layer in resolved.layers.values()):
        raise ValueError(
            f"{fn}(loss_parallel=True): the plan has no output head (a 'colwise' layer without a "
            f"'rowwise' sibling) whose logits could stay split over the vocabulary"
        )
    run = Run(model, axis, mesh, size, resolved, bool(loss_parallel), adapter)
    token = KEEP_SPLIT.set(KEEP_SPLIT.get() | {axis})
    try:
        with running(run):
            yield dict(resolved.specs)
    finally:
        KEEP_SPLIT.reset(token)
