"""Differentiable collectives that compose with ``torch.func``.

Each collective is a ``torch.autograd.Function`` in the new style (``forward`` without ``ctx``,
``setup_context``), so ``torch.func`` can transform it, with three rules beside the forward:

* ``backward`` is the transpose (``psum`` -> ``psum``, ``all_gather`` -> ``psum_scatter``,
  ``all_to_all(split, concat)`` -> ``all_to_all(concat, split)``, ``ppermute`` -> the inverse
  permutation, ``broadcast`` -> a sum to the source); ``pmax``/``pmin`` send the summed
  cotangent to the ranks holding the extreme value, split evenly between ties.
* ``jvp`` pushes the tangent through the same collective (they are linear); ``pmax``/``pmin``
  average the tangents of the ranks holding the extreme value.
* ``vmap`` moves the batch dim to the front and runs the collective once on the whole batch,
  with its dims shifted by one.

The rules call the differentiable collectives again (never a bare ``torch.distributed`` call),
so higher-order derivatives (``grad(grad)``, ``hessian``, ``vmap(grad)``, ``jacfwd(jacrev)``)
work. The SPMD convention: every rank runs the same program; a rank's gradient is the
derivative of the sum over ranks of their scalar losses with respect to its own input, which is
what a single process that sees every rank's values computes.

All ranks of an axis must pass tensors of the same shape and dtype (as in JAX; ``shard_map``
pads uneven shards); debug mode (:func:`pshard.debug`) checks this.
"""

from __future__ import annotations

import operator
import zlib
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

from .._compat import transforms_active, unwrap_dead
from .._core.checks import check_int, normalize_dim
from .._core.global_tensor import is_global
from .._core.tree import describe, keystr, leaf_path, tree_flatten, tree_unflatten
from .._runtime import wire as raw
from .._runtime.debug import check_pytree
from .._runtime.mesh import Axis, resolve_axis
from .._runtime.wire import Comm as _Comm
from .._runtime.wire import Perm
from .._runtime.wire import comm as _comm
from . import compiled

__all__ = [
    "psum",
    "pmean",
    "pmax",
    "pmin",
    "all_gather",
    "psum_scatter",
    "all_to_all",
    "ppermute",
    "broadcast",
    "axis_index",
    "axis_size",
    "call",
    "eager",
    "eager_rules",
]

T = TypeVar("T")

def call(fn: type[torch.autograd.Function], *args: Any) -> Any:
    """``fn.apply(*args)``. With no ``torch.func`` transform active, skip ``Function.apply``'s
    binding of default arguments through ``inspect.signature`` (about 20 us a call; every
    argument here is positional, so there is nothing to bind) and do the rest of what it does.
    While dynamo traces, a plain ``apply`` (the graph breaks inside ``torch.func`` transforms,
    see :func:`_collective`)."""
    if torch.compiler.is_compiling():
        return eager(fn, *args) if transforms_active() else fn.apply(*args)
    if transforms_active():
        return fn.apply(*args)
    return super(torch.autograd.Function, fn).apply(*unwrap_dead(args))


# --- autograd / torch.func rules ------------------------------------------------------------------
#
# Every rule below calls a Function (through `call`), never a raw collective, so that it can
# itself be differentiated, batched or pushed forward by an outer transform.


def eager_rules(cls: type[torch.autograd.Function]) -> type[torch.autograd.Function]:
    """Keep dynamo out of ``cls``'s rules. They run eagerly by design (a compiled region uses
    the ops of ``compiled.py``), yet the autograd engine and ``torch.func`` call them from inside
    a compiled function's eager parts, where dynamo would compile each frame again per shape."""
    for name in ("forward", "backward", "jvp", "vmap"):
        setattr(cls, name, staticmethod(torch.compiler.disable(getattr(cls, name), recursive=True)))
    return cls


def _front(x: torch.Tensor, bdim: int | None) -> torch.Tensor:
    return x if bdim is None or bdim == 0 else x.movedim(bdim, 0)


def _shift(bdim: int | None, *dims: int) -> tuple[int, ...]:
    return dims if bdim is None else tuple(d + 1 for d in dims)


def _out_dim(bdim: int | None) -> int | None:
    return None if bdim is None else 0


@eager_rules
class _PSum(torch.autograd.Function):
    @staticmethod
    def forward(x: torch.Tensor, c: _Comm) -> torch.Tensor:
        return raw.all_reduce(x, c, "psum")

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        ctx.c = inputs[1]

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return call(_PSum, g, ctx.c), None

    @staticmethod
    def jvp(ctx: Any, t: torch.Tensor, *_: Any) -> torch.Tensor:
        return call(_PSum, t, ctx.c)

    @staticmethod
    def vmap(info: Any, in_dims: tuple[Any, ...], x: torch.Tensor, c: _Comm) -> Any:
        return call(_PSum, _front(x, in_dims[0]), c), _out_dim(in_dims[0])


@eager_rules
class _PExtreme(torch.autograd.Function):
    """pmax (op="pmax") or pmin (op="pmin")."""

    @staticmethod
    def forward(x: torch.Tensor, c: _Comm, op: str) -> torch.Tensor:
        return raw.all_reduce(x, c, op)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        ctx.c = inputs[1]
        ctx.save_for_backward(inputs[0], output)
        ctx.save_for_forward(inputs[0], output)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        # d/dx_r sum_s <g_s, out> = (sum_s g_s) * holds_r / (number of holders)
        x, out = ctx.saved_tensors
        holds = (x == out).to(g.dtype)
        both = call(_PSum, torch.stack([g, holds]), ctx.c)
        return both[0] * holds / both[1], None, None

    @staticmethod
    def jvp(ctx: Any, t: torch.Tensor, *_: Any) -> torch.Tensor:
        # the mean of the holders' tangents
        x, out = ctx.saved_tensors
        holds = (x == out).to(t.dtype)
        both = call(_PSum, torch.stack([t * holds, holds]), ctx.c)
        return both[0] / both[1]

    @staticmethod
    def vmap(info: Any, in_dims: tuple[Any, ...], x: torch.Tensor, c: _Comm, op: str) -> Any:
        return call(_PExtreme, _front(x, in_dims[0]), c, op), _out_dim(in_dims[0])


@eager_rules
class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(x: torch.Tensor, c: _Comm, dim: int, tiled: bool) -> torch.Tensor:
        return raw.all_gather(x, c, dim, tiled)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        _, ctx.c, ctx.dim, ctx.tiled = inputs

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        return call(_PSumScatter, g, ctx.c, ctx.dim, ctx.tiled), None, None, None

    @staticmethod
    def jvp(ctx: Any, t: torch.Tensor, *_: Any) -> torch.Tensor:
        return call(_AllGather, t, ctx.c, ctx.dim, ctx.tiled)

    @staticmethod
    def vmap(
        info: Any, in_dims: tuple[Any, ...], x: torch.Tensor, c: _Comm, dim: int, tiled: bool
    ) -> Any:
        (dim,) = _shift(in_dims[0], dim)
        return call(_AllGather, _front(x, in_dims[0]), c, dim, tiled), _out_dim(in_dims[0])


@eager_rules
class _PSumScatter(torch.autograd.Function):
    @staticmethod
    def forward(x: torch.Tensor, c: _Comm, dim: int, tiled: bool) -> torch.Tensor:
        return raw.reduce_scatter(x, c, dim, tiled)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        _, ctx.c, ctx.dim, ctx.tiled = inputs

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        return call(_AllGather, g, ctx.c, ctx.dim, ctx.tiled), None, None, None

    @staticmethod
    def jvp(ctx: Any, t: torch.Tensor, *_: Any) -> torch.Tensor:
        return call(_PSumScatter, t, ctx.c, ctx.dim, ctx.tiled)

    @staticmethod
    def vmap(
        info: Any, in_dims: tuple[Any, ...], x: torch.Tensor, c: _Comm, dim: int, tiled: bool
    ) -> Any:
        (dim,) = _shift(in_dims[0], dim)
        return call(_PSumScatter, _front(x, in_dims[0]), c, dim, tiled), _out_dim(in_dims[0])


@eager_rules
class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(x: torch.Tensor, c: _Comm, split_dim: int, concat_dim: int) -> torch.Tensor:
        return raw.all_to_all(x, c, split_dim, concat_dim)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        _, ctx.c, ctx.split_dim, ctx.concat_dim = inputs

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        return call(_AllToAll, g, ctx.c, ctx.concat_dim, ctx.split_dim), None, None, None

    @staticmethod
    def jvp(ctx: Any, t: torch.Tensor, *_: Any) -> torch.Tensor:
        return call(_AllToAll, t, ctx.c, ctx.split_dim, ctx.concat_dim)

    @staticmethod
    def vmap(
        info: Any,
        in_dims: tuple[Any, ...],
        x: torch.Tensor,
        c: _Comm,
        split_dim: int,
        concat_dim: int,
    ) -> Any:
        split_dim, concat_dim = _shift(in_dims[0], split_dim, concat_dim)
        out = call(_AllToAll, _front(x, in_dims[0]), c, split_dim, concat_dim)
        return out, _out_dim(in_dims[0])


@eager_rules
class _PPermute(torch.autograd.Function):
    @staticmethod
    def forward(x: torch.Tensor, c: _Comm, perm: Perm) -> torch.Tensor:
        return raw.ppermute(x, c, perm)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        _, ctx.c, ctx.perm = inputs

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        inverse = tuple((dst, src) for src, dst in ctx.perm)
        return call(_PPermute, g, ctx.c, inverse), None, None

    @staticmethod
    def jvp(ctx: Any, t: torch.Tensor, *_: Any) -> torch.Tensor:
        return call(_PPermute, t, ctx.c, ctx.perm)

    @staticmethod
    def vmap(info: Any, in_dims: tuple[Any, ...], x: torch.Tensor, c: _Comm, perm: Perm) -> Any:
        return call(_PPermute, _front(x, in_dims[0]), c, perm), _out_dim(in_dims[0])


@eager_rules
class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(x: torch.Tensor, c: _Comm, src: int) -> torch.Tensor:
        return raw.broadcast(x, c, src)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        _, ctx.c, ctx.src = inputs

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        return call(_Reduce, g, ctx.c, ctx.src), None, None

    @staticmethod
    def jvp(ctx: Any, t: torch.Tensor, *_: Any) -> torch.Tensor:
        return call(_Broadcast, t, ctx.c, ctx.src)

    @staticmethod
    def vmap(info: Any, in_dims: tuple[Any, ...], x: torch.Tensor, c: _Comm, src: int) -> Any:
        return call(_Broadcast, _front(x, in_dims[0]), c, src), _out_dim(in_dims[0])


@eager_rules
class _Reduce(torch.autograd.Function):
    """Sum to rank ``dst`` (zeros elsewhere): the transpose of broadcast."""

    @staticmethod
    def forward(x: torch.Tensor, c: _Comm, dst: int) -> torch.Tensor:
        return raw.reduce(x, c, dst)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        _, ctx.c, ctx.dst = inputs

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        return call(_Broadcast, g, ctx.c, ctx.dst), None, None

    @staticmethod
    def jvp(ctx: Any, t: torch.Tensor, *_: Any) -> torch.Tensor:
        return call(_Reduce, t, ctx.c, ctx.dst)

    @staticmethod
    def vmap(info: Any, in_dims: tuple[Any, ...], x: torch.Tensor, c: _Comm, dst: int) -> Any:
        return call(_Reduce, _front(x, in_dims[0]), c, dst), _out_dim(in_dims[0])


# --- under torch.compile -------------------------------------------------------------------------
#
# A collective becomes one custom op of the graph (pshard._collectives.compiled), with the Comm
# traced as a constant whose key the op resolves again when it runs. torch.func transforms traced by
# dynamo would get wrong tangents from a Function's custom jvp and have no rules for a custom op, so
# inside one the graph breaks and the transform runs eagerly, with the rules above.

_COLLECTIVES: dict[str, tuple[Any, Callable[..., torch.Tensor], Callable[..., tuple]]] = {
    "psum": (_PSum, compiled.psum, lambda: ()),
    "pextreme": (_PExtreme, compiled.pextreme, lambda op: (op,)),
    "all_gather": (_AllGather, compiled.all_gather, lambda dim, tiled: (dim, tiled)),
    "psum_scatter": (_PSumScatter, compiled.psum_scatter, lambda dim, tiled: (dim, tiled)),
    "all_to_all": (_AllToAll, compiled.all_to_all, lambda split, concat: (split, concat)),
    "ppermute": (_PPermute, compiled.ppermute, lambda perm: ([i for pair in perm for i in pair],)),
    "broadcast": (_Broadcast, compiled.broadcast, lambda src: (src,)),
}


def _collective(name: str, x: torch.Tensor, c: _Comm, *rest: Any) -> torch.Tensor:
    """Collective ``name`` of ``x`` over ``c``: its Function in eager code, its op (one node of
    the graph) while dynamo traces."""
    fn, op, extra = _COLLECTIVES[name]
    if not torch.compiler.is_compiling():
        return call(fn, x, c, *rest)
    if transforms_active():
        return eager(fn, x, c, *rest)
    return op(x, c.key, c.size, c.rank, *extra(*rest))


@torch.compiler.disable(recursive=True)
def eager(fn: type[torch.autograd.Function], *args: Any) -> Any:
    """``fn.apply(*args)`` outside the graph (a graph break), rules and all."""
    return fn.apply(*args)


# --- the public functions -------------------------------------------------------------------------


def _map_leaves(
    fn: str, c: _Comm, x: Any, f: Callable[[torch.Tensor, Callable[[], str]], torch.Tensor]
) -> Any:
    """Apply ``f(leaf, path)`` to every tensor leaf of ``x``; ``path()`` names the leaf (``x``,
    ``x['a'][0]``) for error messages. A leaf that is not a tensor is a ``TypeError``. In debug
    mode the ranks first compare the structure of ``x`` (a single tensor is a tree of one)."""
    if isinstance(x, torch.Tensor):
        if c.debug and c.group is not None:
            check_pytree(fn, c.group, c.name, 1, 0)
        return f(x, lambda: "x")
    leaves, treedef = tree_flatten(x)
    if c.debug and c.group is not None:
        check_pytree(fn, c.group, c.name, len(leaves), zlib.crc32(repr(treedef).encode()))

    def path(i: int) -> Callable[[], str]:
        return lambda: keystr(leaf_path(treedef, i), "x")

    out = []
    for i, leaf in enumerate(leaves):
        if is_global(leaf):
            raise TypeError(
                f"{fn}: {path(i)()} is {describe(leaf)}; collectives work on this rank's "
                f"blocks inside a map: pass it through ps.shard_map (fn receives its block), "
                f"or get the whole value with ps.gather"
            )
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(
                f"{fn}: {path(i)()} is {describe(leaf)}, not a tensor; collectives take a "
                f"tensor or a pytree of tensors (convert it with torch.as_tensor)"
            )
        out.append(f(leaf, path(i)))
    return tree_unflatten(treedef, out)


def _divisible(
    fn: str, arg: str, d: int, x: torch.Tensor, path: Callable[[], str], size: int, name: str
) -> None:
    if x.shape[d] % size:
        raise ValueError(
            f"{fn}: {path()}.shape[{d}] == {x.shape[d]} ({arg}={d}, shape {tuple(x.shape)}) is "
            f"not divisible by the size {size} of axis {name!r}; pad dim {d} to a multiple of "
            f"{size}"
        )


def psum(x: T, axis: Axis) -> T:
    """Sum ``x`` over the ranks of ``axis``; every rank gets the sum.

    Args:
        x: a tensor or a pytree of tensors, the same shapes and dtypes on every rank.
        axis: a mesh-axis name of the current mesh, a tuple of names (their product, major to
            minor) or a ``ProcessGroup``.

    Returns:
        The sum, with the structure of ``x``. Its transpose (gradient) is ``psum`` again: the
        cotangents of every rank are summed.

    Example:
        >>> import torch, pshard as ps
        >>> mesh = ps.init_mesh({"sp": 1})
        >>> ps.psum({"a": torch.ones(2)}, "sp")
        {'a': tensor([1., 1.])}
    """
    c = _comm(axis, "psum")
    return _map_leaves(
        "psum", c, x, lambda t, _: t if c.group is None else _collective("psum", t, c)
    )


def pmean(x: T, axis: Axis) -> T:
    """Average ``x`` over the ranks of ``axis`` (``psum(x, axis) / axis_size(axis)``).

    Integer tensors give a floating-point mean (true division), as ``torch.mean`` would.

    Example:
        >>> import torch, pshard as ps
        >>> mesh = ps.init_mesh({"sp": 1})
        >>> ps.pmean(torch.tensor([2.0, 4.0]), "sp")
        tensor([2., 4.])
    """
    c = _comm(axis, "pmean")

    def one(t: torch.Tensor, _: Any) -> torch.Tensor:
        if c.group is not None:
            return _collective("psum", t, c) / c.size
        # one rank: the identity, but integer inputs still give a float mean
        return t if t.is_floating_point() or t.is_complex() else t / 1

    return _map_leaves("pmean", c, x, one)


def pmax(x: T, axis: Axis) -> T:
    """Elementwise maximum of ``x`` over the ranks of ``axis``; every rank gets it.

    The gradient (and tangent) goes to the ranks holding the maximum of each element, split
    evenly between ties, as ``torch.amax`` does over a dim.

    Example:
        >>> import torch, pshard as ps
        >>> mesh = ps.init_mesh({"sp": 1})
        >>> ps.pmax(torch.tensor([1.0, -3.0]), "sp")
        tensor([ 1., -3.])
    """
    c = _comm(axis, "pmax")
    return _map_leaves(
        "pmax", c, x, lambda t, _: t if c.group is None else _collective("pextreme", t, c, "pmax")
    )


def pmin(x: T, axis: Axis) -> T:
    """Elementwise minimum of ``x`` over the ranks of ``axis``; see :func:`pmax`.

    Example:
        >>> import torch, pshard as ps
        >>> mesh = ps.init_mesh({"sp": 1})
        >>> ps.pmin(torch.tensor([1.0, -3.0]), "sp")
        tensor([ 1., -3.])
    """
    c = _comm(axis, "pmin")
    return _map_leaves(
        "pmin", c, x, lambda t, _: t if c.group is None else _collective("pextreme", t, c, "pmin")
    )


def all_gather(x: T, axis: Axis, *, dim: int = 0, tiled: bool = True) -> T:
    """Gather ``x`` from every rank of ``axis``, in rank order.

    ``tiled=True`` concatenates along ``dim`` (size ``n * x.shape[dim]``); ``tiled=False``
    stacks along a new dim inserted at ``dim`` (size ``n``). Every rank must pass the same
    shape (uneven gathers are not supported: pad first, as ``shard_map`` does). The transpose
    is :func:`psum_scatter` with the same ``dim`` and ``tiled``.

    Example:
        >>> import torch, pshard as ps
        >>> mesh = ps.init_mesh({"sp": 1})
        >>> ps.all_gather(torch.ones(2, 3), "sp", dim=1, tiled=False).shape
        torch.Size([2, 1, 3])
    """
    c = _comm(axis, "all_gather")

    def one(t: torch.Tensor, path: Callable[[], str]) -> torch.Tensor:
        d = normalize_dim("all_gather", "dim", dim, t, what=path, extra=0 if tiled else 1)
        if c.group is None:
            return t if tiled else t.unsqueeze(d)
        return _collective("all_gather", t, c, d, bool(tiled))

    return _map_leaves("all_gather", c, x, one)


def psum_scatter(x: T, axis: Axis, *, dim: int = 0, tiled: bool = True) -> T:
    """Sum ``x`` over the ranks of ``axis`` and give rank ``r`` the ``r``-th block of the sum.

    ``tiled=True``: ``x.shape[dim]`` must divide by the axis size ``n``; rank ``r`` gets the
    ``r``-th of ``n`` equal slices along ``dim``. ``tiled=False``: ``x.shape[dim]`` must equal
    ``n``; rank ``r`` gets index ``r`` along ``dim``, which is removed. The transpose is
    :func:`all_gather` with the same ``dim`` and ``tiled``.

    Example:
        >>> import torch, pshard as ps
        >>> mesh = ps.init_mesh({"sp": 1})
        >>> ps.psum_scatter(torch.arange(4.0), "sp")
        tensor([0., 1., 2., 3.])
    """
    c = _comm(axis, "psum_scatter")

    def one(t: torch.Tensor, path: Callable[[], str]) -> torch.Tensor:
        d = normalize_dim("psum_scatter", "dim", dim, t, what=path)
        if tiled:
            _divisible("psum_scatter", "dim", d, t, path, c.size, c.name)
        elif t.shape[d] != c.size:
            raise ValueError(
                f"psum_scatter: with tiled=False, {path()}.shape[{d}] must equal the size "
                f"{c.size} of axis {c.name!r}, got {t.shape[d]} (shape {tuple(t.shape)}); use "
                f"tiled=True to scatter blocks of a longer dim"
            )
        if c.group is None:
            return t if tiled else t.select(d, 0)
        return _collective("psum_scatter", t, c, d, bool(tiled))

    return _map_leaves("psum_scatter", c, x, one)


def all_to_all(x: T, axis: Axis, *, split_dim: int, concat_dim: int) -> T:
    """Split ``x`` into ``n`` blocks along ``split_dim``, send block ``j`` to rank ``j``, and
    concatenate the blocks received along ``concat_dim`` in rank order.

    ``x.shape[split_dim]`` must divide by the axis size ``n``; the result has
    ``shape[split_dim] / n`` and ``shape[concat_dim] * n`` (the sequence <-> heads exchange of
    Ulysses attention). The transpose swaps ``split_dim`` and ``concat_dim``.

    Example:
        >>> import torch, pshard as ps
        >>> mesh = ps.init_mesh({"sp": 1})
        >>> ps.all_to_all(torch.ones(2, 4, 8), "sp", split_dim=2, concat_dim=1).shape
        torch.Size([2, 4, 8])
    """
    c = _comm(axis, "all_to_all")

    def one(t: torch.Tensor, path: Callable[[], str]) -> torch.Tensor:
        s = normalize_dim("all_to_all", "split_dim", split_dim, t, what=path)
        k = normalize_dim("all_to_all", "concat_dim", concat_dim, t, what=path)
        if c.group is None:
            return t
        _divisible("all_to_all", "split_dim", s, t, path, c.size, c.name)
        return _collective("all_to_all", t, c, s, k)

    return _map_leaves("all_to_all", c, x, one)


def _check_perm(perm: Sequence[tuple[int, int]], size: int, name: str) -> Perm:
    try:
        pairs = tuple((operator.index(s), operator.index(d)) for s, d in perm)
    except (TypeError, ValueError):
        raise TypeError(
            f"ppermute: perm must be a list of (src, dst) pairs of ints, got {perm!r}"
        ) from None
    for s, d in pairs:
        if not (0 <= s < size and 0 <= d < size):
            raise ValueError(
                f"ppermute: perm pair ({s}, {d}) names a rank outside axis {name!r} of size "
                f"{size}; ranks are 0..{size - 1}"
            )
    for i, role in ((1, "receives from"), (0, "sends to")):
        seen: dict[int, tuple[int, int]] = {}
        for p in pairs:
            if p[i] in seen:
                raise ValueError(
                    f"ppermute: perm has rank {p[i]} as {'dst' if i else 'src'} twice "
                    f"({seen[p[i]]} and {p}); each rank {role} at most one rank"
                )
            seen[p[i]] = p
    return pairs


def ppermute(x: T, axis: Axis, perm: Sequence[tuple[int, int]]) -> T:
    """Send ``x`` from rank ``src`` to rank ``dst`` for each ``(src, dst)`` pair of ``perm``.

    Ranks of ``axis`` that are no pair's ``dst`` get zeros. Every rank may appear at most once
    as a source and at most once as a destination (a partial permutation); all ranks must pass
    the same ``perm``. The transpose is the inverse permutation.

    Example:
        >>> import torch, pshard as ps
        >>> mesh = ps.init_mesh({"sp": 1})
        >>> ps.ppermute(torch.ones(2), "sp", [(0, 0)])
        tensor([1., 1.])
        >>> ps.ppermute(torch.ones(2), "sp", [])
        tensor([0., 0.])
    """
    c = _comm(axis, "ppermute")
    pairs = _check_perm(perm, c.size, c.name)
    if c.group is None and pairs:
        return x
    return _map_leaves("ppermute", c, x, lambda t, _: _collective("ppermute", t, c, pairs))


def broadcast(x: T, axis: Axis, *, src: int = 0) -> T:
    """Give every rank of ``axis`` rank ``src``'s ``x``.

    The transpose sums the cotangents of every rank into rank ``src`` (zeros elsewhere): only
    ``src``'s input affects the result.

    Example:
        >>> import torch, pshard as ps
        >>> mesh = ps.init_mesh({"sp": 1})
        >>> ps.broadcast(torch.arange(3), "sp")
        tensor([0, 1, 2])
    """
    c = _comm(axis, "broadcast")
    s = check_int("broadcast", "src", src)
    if not 0 <= s < c.size:
        raise ValueError(
            f"broadcast: src={src} is not a rank of axis {c.name!r} of size {c.size}; use "
            f"0..{c.size - 1}"
        )
    return _map_leaves(
        "broadcast", c, x, lambda t, _: t if c.group is None else _collective("broadcast", t, c, s)
    )


def axis_index(axis: Axis) -> int:
    """This rank's index along ``axis`` (for a tuple of names: major to minor).

    Example:
        >>> import pshard as ps
        >>> mesh = ps.init_mesh({"dp": 1, "sp": 1})
        >>> ps.axis_index(("dp", "sp"))
        0
    """
    return resolve_axis(axis, fn="axis_index").rank


def axis_size(axis: Axis) -> int:
    """The number of ranks along ``axis`` (for a tuple of names: the product).

    Example:
        >>> import pshard as ps
        >>> mesh = ps.init_mesh({"sp": 1})
        >>> ps.axis_size("sp")
        1
    """
    return resolve_axis(axis, fn="axis_size").size
