"""The public collectives: ``psum``, ``pmean``, ``pmax``, ``pmin``, ``all_gather``,
``psum_scatter``, ``all_to_all``, ``ppermute``, ``broadcast``, ``axis_index``, ``axis_size``.

Each checks its arguments, resolves the axis, and runs its collective on every tensor leaf of a
pytree: the ``autograd.Function`` of :mod:`pshard._collectives.rules` in eager code (with
``backward`` = the transpose, ``jvp`` and ``vmap`` rules, so every ``torch.func`` transform and
their compositions work), the custom op of :mod:`pshard._collectives.compiled` while
``torch.compile`` traces.

The SPMD convention: every rank runs the same program; a rank's gradient is the derivative of
the sum over ranks of their scalar losses with respect to its own input, which is what a single
process that sees every rank's values computes.

All ranks of an axis must pass tensors of the same shape and dtype (as in JAX; ``shard_map``
pads uneven shards); debug mode (:func:`pshard.debug`) checks this.
"""

from __future__ import annotations

import operator
import zlib
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

from .._compat import transforms_active
from .._core.checks import check_int, normalize_dim
from .._core.global_tensor import GlobalTensor, is_global
from .._core.tree import describe, keystr, leaf_path, tree_flatten, tree_unflatten
from .._runtime import stage_parts
from .._runtime.debug import check_pytree
from .._runtime.mesh import Axis, resolve_axis
from .._runtime.wire import Comm as _Comm
from .._runtime.wire import Perm
from .._runtime.wire import comm as _comm
from . import apply
from .apply import call
from .compiled import OPS
from .rules import FUNCTIONS
from .transposes import encode

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
]

T = TypeVar("T")


def _collective(name: str, x: torch.Tensor, c: _Comm, *params: Any) -> torch.Tensor:
    """Collective ``name`` of ``x`` over ``c``: its Function in eager code; while dynamo traces,
    its op (one node of the graph: the Comm is a constant of the trace whose key the op resolves
    again when it runs), or the Function run eagerly inside a ``torch.func`` transform (dynamo
    would get the Function's custom jvp wrong, and a custom op has no ``torch.func`` rules)."""
    fn = FUNCTIONS[name]
    if not torch.compiler.is_compiling():
        return call(fn, x, c, *params)
    if transforms_active():
        return apply.eager(fn, x, c, *params)
    return OPS[name](x, c.key, c.size, c.rank, *encode(name, params))


# --- the public functions -------------------------------------------------------------------------


def _map_leaves(
    fn: str,
    c: _Comm,
    x: Any,
    f: Callable[[torch.Tensor, Callable[[], str]], torch.Tensor],
    axis: Axis | None = None,
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

    out: list[Any] = []
    over = _axis_names(axis)
    for i, leaf in enumerate(leaves):
        if is_global(leaf) and over and not set(over) & set(leaf.meta.key.names):
            # laid out on other axes than this collective's (a stage's "tp" blocks summed
            # over "dp"): the blocks are combined elementwise, the layout stays
            out.append(GlobalTensor(f(leaf.local, path(i)), leaf.meta))
            continue
        if is_global(leaf):
            split = [e for e in leaf.spec if e is not None]
            axes = ", ".join(repr(a) for e in split for a in ((e,) if isinstance(e, str) else e))
            where = path(i)()
            raise TypeError(
                f"{fn}: {where} is a GlobalTensor of shape {tuple(leaf.shape)} split over "
                f"{axes}; collectives take this "
                f"rank's block: pass it to ps.shard_map(f, in_specs=ps.{leaf.spec!r}, ...) (f "
                f"gets the block and can call {fn} on it; a map over other axes hands a "
                f"GlobalTensor on as it is), or get the whole value with ps.gather({where})"
            )
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(
                f"{fn}: {path(i)()} is {describe(leaf)}, not a tensor; collectives take a "
                f"tensor or a pytree of tensors (convert it with torch.as_tensor)"
            )
        out.append(f(leaf, path(i)))
    return tree_unflatten(treedef, out)


def _axis_names(axis: Axis | None) -> tuple[str, ...]:
    """The mesh-axis names of ``axis`` (none for a process group)."""
    if isinstance(axis, str):
        return (axis,)
    if isinstance(axis, tuple) and all(isinstance(a, str) for a in axis):
        return axis
    return ()


def _marked(source: torch.Tensor, result: torch.Tensor) -> torch.Tensor:
    """``result``, with ``source``'s mark of a pipeline stage's gradient (a sum of a stage's
    gradients over a data axis is still that stage's part)."""
    stage_parts.carry((source,), (result,))
    return result


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
        "psum",
        c,
        x,
        lambda t, _: t if c.group is None else _marked(t, _collective("psum", t, c)),
        axis,
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
            return _marked(t, _collective("psum", t, c) / c.size)
        # one rank: the identity, but integer inputs still give a float mean
        return t if t.is_floating_point() or t.is_complex() else t / 1

    return _map_leaves("pmean", c, x, one, axis)


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
        "pmax",
        c,
        x,
        lambda t, _: t if c.group is None else _collective("pextreme", t, c, "pmax"),
        axis,
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
        "pmin",
        c,
        x,
        lambda t, _: t if c.group is None else _collective("pextreme", t, c, "pmin"),
        axis,
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
