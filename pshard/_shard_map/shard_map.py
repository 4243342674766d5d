"""``shard_map``: run a per-block function on every rank, with values outside the map whole.

The map's boundary ops live in :mod:`pshard._shard_map.boundary`; this module turns specs into
layouts, checks them, and wires the boundary around the user's function.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable
from typing import Any, TypeVar, overload

import torch
from torch.distributed.device_mesh import DeviceMesh

from .._core.annotations import check_out_annotation, default_in_specs, default_out_specs
from .._core.checks import axis_names as checked_axis_names
from .._core.global_tensor import is_global
from .._core.placements import P, Partial, Placement, Replicate
from .._core.specs import resolve_specs
from .._core.tree import describe, keystr, tree_flatten_with_path, tree_unflatten
from .._runtime.mesh import mapping, mesh_for, use_mesh
from .boundary import BlockLayout, FromBlocks, PartialExtreme, ToBlock
from .global_boundary import as_spec, enter_global, exit_global, sharded_outputs
from .mesh_view import MeshView, block_layout

__all__ = ["Local", "shard_map"]

F = TypeVar("F", bound=Callable[..., Any])
_FN = "shard_map"


@dataclasses.dataclass(frozen=True)
class Local(Placement):
    """Internal spec: the leaf already is this rank's value, and the map passes it in or out as
    is (no block taken or gathered, no gradient rule of its own). For callers that build a
    leaf's boundary themselves (``shard_map_seq`` takes each rank's sequence tokens straight
    from the whole value and puts the gathered tokens in sequence order)."""


def _enter(x: Any, spec: Placement | P, where: str, m: MeshView, check: bool) -> Any:
    """This rank's block of the input leaf ``x``."""
    if isinstance(spec, Partial):
        raise ValueError(
            f"{_FN} {where}: {spec!r} cannot be an input spec: values outside shard_map are "
            f"whole (the same on every rank of the mapped axes), so there is no pending "
            f"reduction; use Replicate() (or None) to give every rank the whole value, or "
            f"Shard(d) / P(...) to split it"
        )
    if is_global(x):
        return enter_global(x, spec, where, m, check)
    if not isinstance(x, torch.Tensor) or isinstance(spec, Local):
        return x
    lay = block_layout(spec, x.ndim, where, m)
    if m.all is None:
        return x
    guard = None
    if check:
        guard = (
            m.all,
            f"{_FN} {lay.label}: check_rep: inputs must be the same on every rank of the "
            f"mapped axes {m.axes_text(m.mapped)} (shard_map takes each rank's block itself), "
            f"but this one differs; pass the same value on every rank",
        )
    return ToBlock.apply(x, lay, 1.0, guard)


def _exit(y: Any, spec: Placement | P, where: str, m: MeshView, check: bool) -> Any:
    """The whole output leaf from every rank's block ``y``."""
    if isinstance(spec, Local):
        return y
    if is_global(y):
        return exit_global(y, spec, where, m)
    if not isinstance(y, torch.Tensor):
        if isinstance(spec, Partial):
            raise ValueError(
                f"{_FN} {where}: {spec!r} but the value is {describe(y)}, not a tensor; only "
                f"tensors can be reduced over the mapped axes: return a tensor, or give it "
                f"Replicate() or None"
            )
        return y
    if isinstance(spec, Partial):
        if m.all is None:
            return y
        lay = BlockLayout(rep=m.all, label=f"{where} ({spec!r})")
        if spec.reduce in ("max", "min"):
            return PartialExtreme.apply(y, lay, "p" + spec.reduce)
        scale = 1.0 if spec.reduce == "sum" else 1.0 / m.all.size
        return FromBlocks.apply(y, lay, True, scale, None, None)
    lay = block_layout(spec, y.ndim, where, m)
    if lay.gather is None and lay.rep is None:
        return y
    return FromBlocks.apply(y, lay, False, 1.0, None, _rep_guard(lay, spec, m, check))


def _rep_guard(
    lay: BlockLayout, spec: Placement | P, m: MeshView, check: bool
) -> tuple[Any, str] | None:
    """The ``check_rep`` test of an output replicated over ``lay.rep`` (None when off)."""
    if not check or lay.rep is None:
        return None
    return (
        lay.rep,
        f"{_FN} {lay.label}: check_rep: {spec!r} says this output is the same on every "
        f"rank of axes {m.axes_text(lay.rep.name.split(','))} but fn returned different "
        f"values; reduce it inside fn (ps.psum, ps.pmean), or give it Partial(...) or a "
        f"spec that splits it",
    )


def _tensor(x: Any, spec: Placement | P) -> bool:
    """Whether a leaf needs :func:`_enter` / :func:`_exit` (the rest passes through)."""
    return isinstance(x, torch.Tensor) or isinstance(spec, Partial) or is_global(x)


def _stays_sharded(y: Any, spec: Placement | P, where: str, m: MeshView) -> bool:
    """Whether an output leaves the map as a ``GlobalTensor`` (``gather_outputs=False``): a
    tensor whose spec splits it over a mapped axis."""
    if not isinstance(y, torch.Tensor) or isinstance(spec, (Partial, Local)):
        return False
    return bool(as_spec(spec, y.ndim, where, m, trivial=True).axes)


def _outputs(out: Any, out_tree: Any, m: MeshView, check: bool, gather_outputs: bool) -> Any:
    """The outputs of ``fn`` as the map returns them."""
    out_paths, out_leaves, out_def = tree_flatten_with_path(out)
    specs = resolve_specs(out_tree, out_leaves, out_def, name="out_specs", fn_name=_FN)
    outer: list[Any] = []
    sharded: list[tuple[int, tuple[torch.Tensor, Placement | P, str, Any]]] = []
    for i, (path, y, s) in enumerate(zip(out_paths, out_leaves, specs, strict=True)):
        where = keystr(path, "out_specs")
        if not gather_outputs and _stays_sharded(y, s, where, m):
            guard = _rep_guard(block_layout(s, y.ndim, where, m), s, m, check)
            sharded.append((i, (y, s, where, guard)))
            outer.append(None)
        else:
            outer.append(_exit(y, s, where, m, check) if _tensor(y, s) else y)
    if sharded:
        made = sharded_outputs([item for _, item in sharded], m)
        for (i, _), value in zip(sharded, made, strict=True):
            outer[i] = value
    return tree_unflatten(out_def, outer)


@overload
def shard_map(
    fn: None = None,
    /,
    *,
    mesh: DeviceMesh | None = None,
    in_specs: Any = None,
    out_specs: Any = None,
    axis_names: str | Iterable[str] | None = None,
    check_rep: bool = False,
    gather_outputs: bool = True,
) -> Callable[[F], F]: ...


@overload
def shard_map(
    fn: F,
    /,
    *,
    mesh: DeviceMesh | None = None,
    in_specs: Any = None,
    out_specs: Any = None,
    axis_names: str | Iterable[str] | None = None,
    check_rep: bool = False,
    gather_outputs: bool = True,
) -> F: ...


def shard_map(
    fn: Callable[..., Any] | None = None,
    /,
    *,
    mesh: DeviceMesh | None = None,
    in_specs: Any = None,
    out_specs: Any = None,
    axis_names: str | Iterable[str] | None = None,
    check_rep: bool = False,
    gather_outputs: bool = True,
) -> Any:
    """Map ``fn`` over blocks of its inputs, one block per rank, and assemble its outputs.

    Outside the map every value is whole, the same on every rank of the mapped axes. Inside,
    ``fn`` sees this rank's block of each input and may talk to the other ranks with pshard's
    collectives (``ps.psum(x, "sp")``: axis names resolve in ``mesh``). Its outputs are put back
    together on every rank. In pseudo-code, for mapped axes of total size ``N``::

        def shard_map(fn)(*args):
            for rank in range(N):                          # all at once, one per process
                blocks[rank] = fn(*(block(a, spec, rank) for a, spec in zip(args, in_specs)))
            return assemble(blocks, out_specs)             # the same on every rank

    Specs (``in_specs`` a prefix tree of the positional args, ``out_specs`` of the output):

    - ``P(...)``: one entry per tensor dim, each ``None``, a mapped axis name, or a tuple of
      them (that dim is split over their product, the first the slowest); mapped axes not
      named hold the whole dim (replicated).
    - ``Shard(d)``: dim ``d`` split over every mapped axis, in mesh order (``P`` with all mapped
      axes on dim ``d``); ``StridedShard(d, k)`` is DTensor's strided split on every mapped axis.
    - ``Replicate()`` or ``None``: the whole value on every rank.
    - ``Partial(reduce)`` (outputs only): the output is ``reduce`` (``"sum"``, ``"mean"``,
      ``"max"``, ``"min"``) over the mapped axes of the ranks' values. As an input spec it is an
      error: outside values are whole, so nothing is pending.

    Uneven splits follow ``torch.chunk`` (DTensor's layout: the blocks are
    ``ps.shard_tensor(x, sizes, coordinate, placements)``); split outputs may be uneven too, their
    blocks' sizes are exchanged before the gather. Non-tensor leaves pass through unchanged
    (only ``Replicate``/``None`` specs). Keyword arguments are passed whole (replicated), unless
    ``in_specs`` is omitted and their parameters carry spec annotations.

    Gradients (JAX's convention, ``check_vma=False``): outside the map values *and cotangents*
    are replicated over the mapped axes. Splitting an input transposes to an all-gather of the
    blocks' cotangents (summed over the mapped axes its spec does not name); a replicated
    input's cotangent is summed over the mapped axes; a split output's cotangent is sliced; a
    ``Partial("sum")`` output passes its cotangent on as is (``"mean"`` divides it by ``N``,
    ``"max"``/``"min"`` give it to the ranks holding the extreme); a replicated output's
    cotangent is divided by the size of the axes it is replicated over before ``fn``'s own
    transposes run (so ``ps.psum`` inside, transposed to ``psum``, restores it). Hence
    ``torch.func.grad(shard_map(f))`` equals the single-process gradient, identical on every
    rank, and ``vjp``, ``jvp``, ``vmap`` (over the whole map) and ``.backward()`` work through it.

    Global tensors (:class:`pshard.GlobalTensor`, values that stay sharded between calls): an
    input laid out over the mapped axes as its spec asks reaches ``fn`` as its block with no
    communication, and its cotangent stays a block (the gradient with respect to the block's
    elements: no all-gather, and a sum only over the mapped axes it is replicated on); laid out
    otherwise, it is resharded first (exact, differentiable). One sharded only over axes the
    map does not map passes into ``fn`` unchanged, as a ``GlobalTensor`` over those axes, so
    maps over different axes nest (FSDP over ``"dp"`` around ``shard_map_seq`` over ``"sp"``).
    With ``gather_outputs=False`` every output whose spec splits it leaves as a
    ``GlobalTensor`` (no gather; the blocks' shapes are exchanged once per call, so uneven
    outputs get their true global shape); replicated and ``Partial`` outputs stay whole.

    With one rank on the mapped axes the map is free: ``fn`` runs on the inputs themselves.

    Args:
        fn: the per-block function (positional-only). Omit it to use ``shard_map`` as a
            decorator.
        mesh: the device mesh; default :func:`pshard.current_mesh` at call time. It is the
            current mesh while ``fn`` runs.
        in_specs: a prefix tree of the positional arguments (a single spec applies to all).
            Omitted: the specs annotated on ``fn``'s parameters and on the fields of dataclass
            arguments (:func:`pshard.specs_of`), ``Replicate()`` for the rest; with no
            annotations every input is replicated.
        out_specs: a prefix tree of ``fn``'s output. Omitted: the spec annotated on ``fn``'s
            return (``-> Annotated[torch.Tensor, ps.P()]``; not read through a ``__wrapped__``
            wrapper such as ``torch.func.grad(f)``), which must then exist.
        axis_names: the mesh axes to map (a name or a collection); default all. Other axes are
            left to the caller: values may differ along them and ``fn`` may use them itself
            (e.g. a data-parallel ``"dp"`` axis around a sequence-parallel map over ``"sp"``).
        check_rep: check at run time (also on in debug mode, :func:`pshard.debug`) that inputs
            and replicated outputs really are equal on every rank of the mapped axes they are
            replicated over; a mismatch raises ``ValueError`` on every rank naming the key path
            and the ranks. Costs a small all-gather and an all-reduce per checked tensor.
        gather_outputs: ``False`` returns the outputs whose specs split them as
            :class:`pshard.GlobalTensor` s of their blocks instead of gathering them.

    Returns:
        The mapped function (or a decorator making one).

    Raises:
        TypeError: ``out_specs`` is omitted and ``fn``'s return annotation carries no spec, an
            annotation cannot be resolved, or a spec is not a placement, ``P`` or ``None``.
        ValueError: a spec tree is not a prefix of the value, a ``P`` names an axis that is not
            mapped, a spec does not fit its tensor, a ``Partial`` input spec, or a ``check_rep``
            mismatch; messages name the key path (``in_specs[0]['x']``).

    Example:
        >>> import torch, pshard as ps
        >>> mesh = ps.init_mesh({"sp": 1})
        >>> @ps.shard_map(in_specs=ps.P("sp"), out_specs=ps.P())
        ... def column_sums(x):
        ...     return ps.psum(x.sum(0), "sp")
        >>> column_sums(torch.arange(6.0).reshape(3, 2))
        tensor([6., 9.])
        >>> ps.shard_map(lambda x: 2 * x, in_specs=ps.Shard(0), out_specs=ps.Shard(0))(
        ...     torch.ones(3))
        tensor([2., 2., 2.])
        >>> double = ps.shard_map(lambda w: 2 * w, in_specs=ps.P("sp"), out_specs=ps.P("sp"),
        ...                       gather_outputs=False)
        >>> double(ps.shard(torch.ones(3), ps.P("sp")))  # blocks in, blocks out
        GlobalTensor(shape=(3,), spec=P('sp'), mesh={'sp': 1}, local shape=(3,))
    """
    names = (
        None
        if axis_names is None
        else checked_axis_names(axis_names, _FN, arg="axis_names", collection=True)
    )
    if fn is None:
        return functools.partial(
            shard_map,
            mesh=mesh,
            in_specs=in_specs,
            out_specs=out_specs,
            axis_names=names,
            check_rep=check_rep,
            gather_outputs=gather_outputs,
        )
    if not callable(fn):
        raise TypeError(f"{_FN}: fn must be callable, got {describe(fn)}")
    if out_specs is None:
        check_out_annotation(fn, transform=_FN)
    if mesh is not None and not isinstance(mesh, DeviceMesh):
        raise TypeError(f"{_FN}: mesh must be a DeviceMesh, got {describe(mesh)}")

    @functools.wraps(fn)
    def mapped(*args: Any, **kwargs: Any) -> Any:
        m = MeshView(mesh_for(_FN) if mesh is None else mesh, names, _FN)
        check = bool(check_rep) or m.debug
        arg_specs, kw_specs = in_specs, None
        if in_specs is None:
            annotated = default_in_specs(fn, args, kwargs, transform=_FN)
            if annotated is not None:
                arg_specs, kw_specs = annotated
        paths, leaves, treedef = tree_flatten_with_path(args)
        specs = resolve_specs(arg_specs, leaves, treedef, name="in_specs", fn_name=_FN)
        inner = [
            _enter(x, s, keystr(path, "in_specs"), m, check) if _tensor(x, s) else x
            for path, x, s in zip(paths, leaves, specs, strict=True)
        ]
        kw_paths, kw_leaves, kw_def = tree_flatten_with_path(kwargs)
        kw_leaf_specs = (
            [Replicate()] * len(kw_leaves)
            if kw_specs is None
            else resolve_specs(kw_specs, kw_leaves, kw_def, name="kwargs", fn_name=_FN)
        )
        kw_inner = [
            _enter(x, s, keystr(path, "kwargs"), m, check) if _tensor(x, s) else x
            for path, x, s in zip(kw_paths, kw_leaves, kw_leaf_specs, strict=True)
        ]
        with use_mesh(m.mesh), mapping(m.mapped):
            out = fn(*tree_unflatten(treedef, inner), **tree_unflatten(kw_def, kw_inner))
        out_tree = default_out_specs(fn, transform=_FN) if out_specs is None else out_specs
        return _outputs(out, out_tree, m, check, gather_outputs)

    return mapped
