"""``shard_map_seq``: ``shard_map`` over one axis, specialised for one sequence.

It is built from ``shard_map`` and the layout functions. Each ``Shard(d)`` input enters as this
rank's tokens, copied straight from the whole value, padded (:func:`pshard.sequence.
_seq_boundary.take_tokens`, whose transpose gathers every rank's cotangent block, as
``shard_map``'s own boundary does), and ``shard_map`` passes it in as is; under
``torch.compile`` the input is instead padded and put in the layout's permuted order
(:func:`pshard.sequence._layouts.pad_permute`) and ``shard_map`` takes each rank's even block,
the same values. Each ``Shard`` output leaves ``shard_map`` as this rank's tokens and is gathered
here, every rank's tokens put at their positions and the padding dropped
(:func:`~pshard.sequence._seq_boundary.place_tokens`; pairwise gathers on gloo receive each
rank's runs straight into place where they are contiguous memory); under ``torch.compile``,
``shard_map`` gathers the permuted blocks and
:func:`~pshard.sequence._layouts.unpermute_unpad` puts them back. The gradient convention is
therefore exactly ``shard_map``'s.

While ``fn`` runs, the sequence context (:mod:`pshard.sequence._context`) holds the layout, so
:func:`pshard.seq_positions` and the attention functions know the true position of every token.
"""

from __future__ import annotations

import functools
import numbers
from collections.abc import Callable
from typing import Any, TypeVar, overload

import torch
from torch.distributed.device_mesh import DeviceMesh

from .._core.annotations import check_out_annotation, default_in_specs, default_out_specs
from .._core.checks import axis_names
from .._core.placements import P, Partial, Placement, Replicate, Shard, StridedShard
from .._core.specs import broadcast_prefix_flat, is_split, resolve_specs
from .._core.tree import (
    describe,
    is_block_mask,
    keystr,
    tree_flatten_with_path,
    tree_leaves,
    tree_map,
    tree_unflatten,
)
from .._runtime.debug import debug_enabled
from .._runtime.mesh import mesh_for, resolve_axis
from .._runtime.wire import comm_of
from .._shard_map.shard_map import Local, shard_map
from ._context import SeqContext, normalize_axis, record_for_backward, sequence_context
from ._layouts import SeqLayout, check_layout, pad_permute, unpermute_unpad
from ._seq_boundary import place_tokens, take_tokens

__all__ = ["check_mesh_order", "shard_map_seq"]

F = TypeVar("F", bound=Callable[..., Any])

_FN = "shard_map_seq"


def _check_spec(spec: Any, where: str, outputs: bool) -> None:
    if isinstance(spec, (StridedShard, P)) or (isinstance(spec, Partial) and not outputs):
        allowed = (
            "Shard(d), Replicate(), Partial(...) or None"
            if outputs
            else ("Shard(d), Replicate() or None")
        )
        raise ValueError(
            f"{_FN} {where}: {spec!r} is not a sequence spec; shard_map_seq splits one sequence "
            f"dim over its axis: use {allowed} (use ps.shard_map for other layouts)"
        )


def _local_shards(out_tree: Any) -> Any:
    """``out_tree`` with each ``Shard`` spec as ``Local``: the map passes those outputs out as is
    and ``shard_map_seq`` gathers them itself, in the axis's order."""
    return tree_map(
        lambda s: Local() if isinstance(s, Shard) else s,
        out_tree,
        is_leaf=lambda s: isinstance(s, (Placement, P)),
        none_is_leaf=True,
    )


def check_mesh_order(names: tuple[str, ...], m: DeviceMesh) -> None:
    """Under ``torch.compile`` the blocks are ``shard_map``'s, whose ranks over several mesh
    axes count in the mesh's order: refuse a tuple given in another order."""
    order = tuple(m.mesh_dim_names or ())
    mine = tuple(n for n in order if n in names)
    if mine != tuple(names):
        raise NotImplementedError(
            f"{_FN}: under torch.compile the axes {tuple(names)} must be given in the mesh's "
            f"order {mine}; name them in that order, or run this map eagerly"
        )


def _pad_value(value: Any, where: str) -> Any:
    if value is None:
        return 0
    if isinstance(value, (bool, numbers.Number)) and not isinstance(value, complex):
        return value
    raise TypeError(
        f"{_FN} {where}: a pad value must be a number (or None for 0), got {describe(value)}"
    )


def _check_kw_specs(kw_specs: dict[str, Any] | None, fn_name: str) -> None:
    """Keyword arguments are passed whole (as in shard_map): an annotation asking to split one
    is an error rather than a silent replicate."""
    for name, spec in (kw_specs or {}).items():
        split = [leaf for leaf in tree_leaves(spec, none_is_leaf=True) if is_split(leaf)]
        if split:
            raise ValueError(
                f"{_FN}({fn_name}): keyword argument {name!r} is annotated {split[0]!r}, but "
                f"keyword arguments are passed whole to every rank; pass it positionally to "
                f"split it along the sequence"
            )


@overload
def shard_map_seq(
    fn: None = None,
    /,
    *,
    axis: str | tuple[str, ...] = "sp",
    mesh: DeviceMesh | None = None,
    in_specs: Any = None,
    out_specs: Any = None,
    layout: str = "contiguous",
    pad_values: Any = 0,
) -> Callable[[F], F]: ...


@overload
def shard_map_seq(
    fn: F,
    /,
    *,
    axis: str | tuple[str, ...] = "sp",
    mesh: DeviceMesh | None = None,
    in_specs: Any = None,
    out_specs: Any = None,
    layout: str = "contiguous",
    pad_values: Any = 0,
) -> F: ...


def shard_map_seq(
    fn: Callable[..., Any] | None = None,
    /,
    *,
    axis: str | tuple[str, ...] = "sp",
    mesh: DeviceMesh | None = None,
    in_specs: Any = None,
    out_specs: Any = None,
    layout: str = "contiguous",
    pad_values: Any = 0,
) -> Any:
    """Map ``fn`` over the shards of one sequence split along ``axis``.

    ``shard_map`` over the single axis ``axis`` (other mesh axes are left to the caller, e.g.
    data parallelism), specialised for sequences of any length: every ``Shard(d)`` input is
    padded along ``d`` to a multiple of the axis size ``N`` (of ``2N`` for ``"zigzag"``) with
    its pad value, permuted by ``layout`` and split evenly; every ``Shard(d)`` output is
    gathered, un-permuted and unpadded. In pseudo-code::

        def shard_map_seq(fn)(*args):
            s = the length of dim d of the Shard(d) inputs (the same for all)
            args = [permute(pad(a, d, pad_value), layout) for Shard(d) inputs]
            out = shard_map(fn_in_sequence_context, in_specs=..., out_specs=...)(*args)
            return [unpad(unpermute(o, layout), s) for Shard(d) outputs]

    Layouts (rank ``r`` of ``N``): ``"contiguous"`` (rank ``r`` holds the ``r``-th block),
    ``"zigzag"`` (blocks ``r`` and ``2N - 1 - r`` of ``2N``, which balances causal attention),
    ``"stripe"`` (token ``t`` on rank ``t % N``). Inside ``fn``, :func:`pshard.seq_positions`
    gives the global position of each local token (padding at ``>= s``), and
    :func:`pshard.ulysses_attention` masks by true positions and never attends to padding.
    Element-wise and per-token work needs no care; anything mixing tokens must use those
    (or collectives) rather than local ``arange``.

    Gradients follow ``shard_map``'s convention (outside, values and cotangents are replicated
    over ``axis``): ``torch.func.grad(shard_map_seq(f))`` is the single-process gradient on
    every rank, and ``pmap_microbatch`` composes around it in either order.

    Args:
        fn: the per-shard function (positional-only); omit it to use a decorator.
        axis: the sequence-parallel mesh axis (a name, or a tuple of names split as one).
        mesh: the device mesh (default: the current mesh at call time).
        in_specs: a prefix tree of the positional args: ``Shard(d)`` (a sequence dim),
            ``Replicate()`` or ``None``. All ``Shard`` inputs must have the same length along
            their dim. Keyword arguments are replicated. When omitted, read from ``fn``'s
            parameter annotations and the ``specs_of`` of dataclass arguments.
        out_specs: a prefix tree of ``fn``'s output: ``Shard(d)`` (each rank returns its
            tokens along ``d``), ``Replicate()``/``None``, or ``Partial(reduce)``. When
            omitted, read from ``fn``'s return annotation (an error if it has none).
        layout: ``"contiguous"``, ``"zigzag"`` or ``"stripe"``.
        pad_values: what padding tokens hold, a number or a prefix tree of the positional
            args, e.g. ``(0, {"input_ids": 0, "labels": -100})``.

    Returns:
        The mapped function (or a decorator).

    Raises:
        TypeError: a spec or pad value of the wrong type, or ``out_specs`` missing.
        ValueError: no ``Shard`` input, ``Shard`` inputs of different lengths, a spec that is
            not a sequence spec or does not fit its tensor, or an output shard of the wrong
            length; messages name the key path (``in_specs[1]['labels']``).

    Example:
        >>> import torch, pshard as ps
        >>> mesh = ps.init_mesh({"sp": 1})
        >>> @ps.shard_map_seq(in_specs=(ps.Shard(1),), out_specs=ps.Shard(1), layout="zigzag")
        ... def double(x):
        ...     return 2 * x
        >>> double(torch.arange(5.0).view(1, 5))
        tensor([[0., 2., 4., 6., 8.]])
    """
    names = axis_names(axis, _FN)
    check_layout(layout, _FN)
    if fn is None:
        return functools.partial(
            shard_map_seq,
            axis=axis,
            mesh=mesh,
            in_specs=in_specs,
            out_specs=out_specs,
            layout=layout,
            pad_values=pad_values,
        )
    if not callable(fn):
        raise TypeError(f"{_FN}: fn must be callable, got {describe(fn)}")
    fn_name = getattr(fn, "__name__", type(fn).__name__)
    if out_specs is None:
        check_out_annotation(fn, transform=_FN)
    if mesh is not None and not isinstance(mesh, DeviceMesh):
        raise TypeError(f"{_FN}: mesh must be a DeviceMesh, got {describe(mesh)}")
    key = normalize_axis(axis)

    @functools.wraps(fn)
    def mapped(*args: Any, **kwargs: Any) -> Any:
        m = mesh_for(_FN) if mesh is None else mesh
        info = resolve_axis(names, mesh=m, fn=_FN)
        arg_specs = in_specs
        if in_specs is None:
            annotated = default_in_specs(fn, args, kwargs, transform=_FN)
            if annotated is not None:
                arg_specs, kw_specs = annotated
                _check_kw_specs(kw_specs, fn_name)
        out_tree = default_out_specs(fn, transform=_FN) if out_specs is None else out_specs
        paths, leaves, treedef = tree_flatten_with_path(args)
        specs = resolve_specs(arg_specs, leaves, treedef, name="in_specs", fn_name=_FN)
        pads = broadcast_prefix_flat(pad_values, treedef, leaves, name="pad_values", fn_name=_FN)
        length: int | None = None
        first: tuple[str, Shard, tuple[int, ...]] = ("", Shard(0), ())  # the first Shard input
        device = torch.device("cpu")
        dims: list[int | None] = []
        for path, x, spec in zip(paths, leaves, specs, strict=True):
            where = keystr(path, "in_specs")
            _check_spec(spec, where, outputs=False)
            if not isinstance(spec, Shard):
                dims.append(None)
                continue
            if is_block_mask(x):
                raise ValueError(
                    f"{_FN} {where}: {spec!r} but the value is {describe(x)}; a BlockMask "
                    f"cannot be split along the sequence: build it inside fn from "
                    f"ps.seq_positions(), or give it Replicate()"
                )
            d = spec.dim % x.dim()
            dims.append(d)
            if length is None:
                length, first, device = x.shape[d], (where, spec, tuple(x.shape)), x.device
            elif x.shape[d] != length:
                raise ValueError(
                    f"{_FN} {where}: {spec!r} splits a sequence of {x.shape[d]} tokens (shape "
                    f"{tuple(x.shape)}) but {first[0]}: {first[1]!r} splits one of {length} "
                    f"(shape {first[2]}); every Shard input must be the same sequence: pad them "
                    f"to one length, or give the other inputs Replicate()"
                )
        if length is None:
            raise ValueError(
                f"{_FN}({fn_name}): no input has a Shard(d) spec, so there is no sequence to "
                f"split; give the sequence inputs Shard(d) in in_specs (e.g. ps.Shard(1) for "
                f"(batch, seq) tensors)"
            )
        lay = SeqLayout(layout, length, info.size)
        ctx = SeqContext(key, lay, info.rank, device, m)
        values = [
            None if d is None else _pad_value(pad, keystr(path, "pad_values"))
            for path, d, pad in zip(paths, dims, pads, strict=True)
        ]
        compiling = torch.compiler.is_compiling()
        c = None  # the axis, in the order given (None for one rank)
        if info.group is not None:
            c = comm_of(names, info, debug_enabled())
        if compiling:  # traceable: the permuted whole, shard_map's blocks
            check_mesh_order(names, m)
            flat = [
                x if d is None else pad_permute(x, d, lay, value)
                for x, d, value in zip(leaves, dims, values, strict=True)
            ]
            inner_specs: list[Placement] = [Replicate() if d is None else Shard(d) for d in dims]
        else:  # this rank's tokens straight from the whole value (no permuted whole)
            flat = [
                x if d is None else take_tokens(x, d, lay, c, value)
                for x, d, value in zip(leaves, dims, values, strict=True)
            ]
            inner_specs = [Replicate() if d is None else Local() for d in dims]

        def body(flat_inner: list[Any], **kw: Any) -> Any:
            with sequence_context(ctx):
                out = fn(*tree_unflatten(treedef, flat_inner), **kw)
            out = record_for_backward(out, ctx)  # for recomputation (checkpointing) in backward
            out_paths, out_leaves, out_def = tree_flatten_with_path(out)
            out_flat = resolve_specs(out_tree, out_leaves, out_def, name="out_specs", fn_name=_FN)
            for path, y, spec in zip(out_paths, out_leaves, out_flat, strict=True):
                where = keystr(path, "out_specs")
                _check_spec(spec, where, outputs=True)
                if isinstance(spec, Shard) and y.shape[spec.dim % y.dim()] != lay.local_length:
                    d = spec.dim % y.dim()
                    raise ValueError(
                        f"{_FN} {where}: {spec!r} but fn returned {y.shape[d]} tokens along dim "
                        f"{d} (shape {tuple(y.shape)}) on a rank that holds {lay.local_length} "
                        f"(a sequence of {length} on {info.size} ranks, {layout} layout, "
                        f"padding included); a Shard output has one entry per local token"
                    )
            return out

        out = shard_map(
            body,
            mesh=m,
            in_specs=(inner_specs,),
            out_specs=out_tree if compiling else _local_shards(out_tree),
            axis_names=names,
        )(flat, **kwargs)
        out_paths, out_leaves, out_def = tree_flatten_with_path(out)
        out_flat = resolve_specs(out_tree, out_leaves, out_def, name="out_specs", fn_name=_FN)
        return tree_unflatten(
            out_def,
            [
                y
                if not isinstance(spec, Shard)
                else unpermute_unpad(y, spec.dim % y.dim(), lay)
                if compiling
                else place_tokens(
                    y, spec.dim % y.dim(), lay, c, f"{keystr(path, 'out_specs')} ({spec!r})"
                )
                for path, y, spec in zip(out_paths, out_leaves, out_flat, strict=True)
            ],
        )

    return mapped
