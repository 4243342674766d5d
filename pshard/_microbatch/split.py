"""Splitting a pytree into chunks along its batch dim: :func:`split` and the input resolution
that :func:`pshard.pmap_microbatch` and :func:`pshard.infer_out_specs` share with it.

:func:`split` cuts every ``Shard(d)`` leaf of a tree along ``d`` like ``torch.tensor_split``
(views, sizes differing by at most one, larger chunks first) and hands ``Replicate()`` leaves
whole to every chunk; a flex-attention ``BlockMask`` is cut along its batch dim with its
``mask_mod`` re-indexed (:mod:`pshard._microbatch.block_masks`).

Internal interface (used by ``pmap_microbatch``, batch-dim analysis and :func:`pshard.merge`):

- ``resolve_inputs(parts, *, where, allowed, default=None) -> Inputs``: the one input-resolution
  step of ``split``, ``pmap_microbatch`` and ``infer_out_specs``: each part ``(value, spec tree,
  root name)`` (``(args, in_specs, "in_specs")``, ...) flattened once, every leaf's spec resolved
  once (``default(leaf)`` where the spec tree is omitted), and the ``Shard`` leaves checked to fit
  and to agree on the size of their split dim once (the :class:`SplitPlan`); key paths are
  written only for errors (``Inputs.name_of(i)``).
- ``resolve_quick(specs, leaves, treedef, *, name, fn_name, allowed) -> list``: each leaf's
  spec with the types checked (leaves are checked where they are used).
- ``split_columns(leaves, specs, plan, num_chunks, name_of, *, where, count_name)
  -> (columns, sizes)``: each leaf's ``num_chunks`` pieces and the chunk sizes along the split
  (None when nothing is split).
- ``chunk_sizes(total, num_chunks)``: ``torch.tensor_split``'s chunk sizes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from itertools import repeat
from typing import Any

import torch
from optree import PyTreeSpec

from .._core.checks import check_int
from .._core.placements import Replicate, Shard
from .._core.specs import broadcast_prefix_flat, check_specs
from .._core.tree import describe, is_block_mask, keystr, leaf_path, tree_flatten
from .block_masks import share_block_mask, split_block_mask

__all__ = [
    "Inputs",
    "NameOf",
    "SplitPlan",
    "chunk_sizes",
    "plan_split",
    "resolve_inputs",
    "resolve_quick",
    "split",
    "split_columns",
]

NameOf = Callable[[int], str]

_REPLICATE = Replicate()
_SPLIT_WITH_SIZES = torch.Tensor.split_with_sizes
_SPLIT_SPECS = (Shard, Replicate)


def chunk_sizes(total: int, num_chunks: int) -> list[int]:
    """``torch.tensor_split``'s chunk sizes: differing by at most one, larger chunks first."""
    base, extra = divmod(total, num_chunks)
    return [base + 1] * extra + [base] * (num_chunks - extra)


@dataclasses.dataclass
class SplitPlan:
    """Which leaves a split cuts, and the size of their split dim."""

    size: int | None  # the common size of the split dims; None when no leaf is split
    first: int  # the leaf that set ``size`` (for errors)
    tensors: list[tuple[int, int]]  # (leaf index, split dim) of each tensor to split
    masks: list[int]  # leaf indices of BlockMasks to split (batch > 1)
    shared_masks: list[int]  # leaf indices of batch-1 BlockMasks (re-indexed, not cut)
    uniform_dim: int | None = None  # set when every leaf is a tensor split along this dim
    recheck: Callable[[], SplitPlan] | None = None  # with uniform_dim: the general plan (it raises)


def _split_dim_text(leaf: Any, dim: int) -> str:
    return f"dim {dim} of {describe(leaf)}"


def resolve_quick(
    specs: Any,
    leaves: list[Any],
    treedef: PyTreeSpec,
    *,
    name: str,
    fn_name: str,
    allowed: tuple[type, ...],
) -> list[Any]:
    """The spec of every leaf (``None`` made ``Replicate()``), with the types checked but not
    the leaves: callers check the leaves they split as they touch them (``plan_split``), or
    call ``check_specs`` when an operation on one fails, for its message."""
    flat = broadcast_prefix_flat(specs, treedef, leaves, name=name, fn_name=fn_name)
    unique = {id(spec): spec for spec in flat}
    for spec in unique.values():
        if spec is not None and type(spec) not in allowed:
            check_specs(leaves, flat, treedef, name=name, fn_name=fn_name, allowed=allowed)
            raise TypeError(f"{fn_name} {name}: {spec!r} is not allowed here")  # pragma: no cover
    if any(spec is None for spec in unique.values()):
        flat = [_REPLICATE if spec is None else spec for spec in flat]
    return flat


@dataclasses.dataclass
class Inputs:
    """Inputs resolved once (see :func:`resolve_inputs`)."""

    defs: list[PyTreeSpec]  # each part's structure
    roots: list[str]  # each part's name in messages (``in_specs``, ``kw_specs``)
    leaves: list[Any]  # every part's leaves, in order
    specs: list[Any]  # their specs (``Shard`` / ``Replicate`` ...)
    plan: SplitPlan
    counts: list[int]  # leaves per part

    def name_of(self, i: int) -> str:
        """Leaf ``i``'s key path (``in_specs[1]['labels']``), written on demand."""
        for treedef, root, count in zip(self.defs, self.roots, self.counts, strict=True):
            if i < count:
                return keystr(leaf_path(treedef, i), root)
            i -= count
        raise IndexError(i)  # pragma: no cover

    def split_dims(self) -> list[int | None]:
        """Each leaf's non-negative split dim (None when it is not split)."""
        dims: list[int | None] = [None] * len(self.leaves)
        plan = self.plan
        if plan.uniform_dim is not None:
            return [plan.uniform_dim % max(x.ndim, 1) for x in self.leaves]
        for i, d in plan.tensors:
            dims[i] = d % self.leaves[i].ndim
        for i in plan.masks + plan.shared_masks:
            dims[i] = 0
        return dims


def resolve_inputs(
    parts: Sequence[tuple[Any, Any, str]],
    *,
    where: str,
    allowed: tuple[type, ...],
    default: Callable[[Any], Any] | None = None,
) -> Inputs:
    """Flatten each ``(value, spec tree, root name)`` part once, resolve every leaf's spec once
    (``default(leaf)`` where the part's spec tree is ``None`` and ``default`` is given), and
    check once that the ``Shard`` leaves fit and agree on the size of their split dim."""
    defs, roots, leaves, specs, counts = [], [], [], [], []
    for value, spec_tree, root in parts:
        part_leaves, treedef = tree_flatten(value)
        if spec_tree is None and default is not None:
            part_specs = [default(leaf) for leaf in part_leaves]
        else:
            if root == "in_specs" and isinstance(spec_tree, list):
                spec_tree = tuple(spec_tree)  # a list of specs for the args tuple
            part_specs = resolve_quick(
                spec_tree, part_leaves, treedef, name=root, fn_name=where, allowed=allowed
            )
        defs.append(treedef)
        roots.append(root)
        counts.append(len(part_leaves))
        leaves += part_leaves
        specs += part_specs

    def misfit(i: int) -> None:  # check_specs words the error of the part holding leaf i
        start = 0
        for treedef, root, count in zip(defs, roots, counts, strict=True):
            if i < start + count:
                check_specs(
                    leaves[start : start + count], specs[start : start + count], treedef,
                    name=root, fn_name=where, allowed=allowed,
                )  # fmt: skip
                return
            start += count

    inputs = Inputs(defs, roots, leaves, specs, SplitPlan(None, -1, [], [], []), counts)
    inputs.plan = plan_split(leaves, specs, inputs.name_of, where=where, misfit=misfit)
    return inputs


def plan_split(
    leaves: list[Any],
    specs: list[Any],
    name_of: NameOf,
    *,
    where: str,
    misfit: Callable[[int], None],
) -> SplitPlan:
    """Check that the ``Shard`` leaves fit their spec and agree on the size of their split dim.

    ``specs`` hold ``Shard`` and ``Replicate`` only; ``misfit(i)`` raises the error for a leaf
    its ``Shard`` spec does not fit.
    """
    if specs and type(specs[0]) is Shard and specs.count(specs[0]) == len(specs):

        def recheck() -> SplitPlan:
            return _plan_general(leaves, specs, name_of, where=where, misfit=misfit)

        plan = _plan_uniform(leaves, specs[0].dim, recheck)
        if plan is not None:
            return plan
    return _plan_general(leaves, specs, name_of, where=where, misfit=misfit)


def _plan_general(
    leaves: list[Any],
    specs: list[Any],
    name_of: NameOf,
    *,
    where: str,
    misfit: Callable[[int], None],
) -> SplitPlan:
    size: int | None = None
    first = -1
    tensors: list[tuple[int, int]] = []
    masks: list[int] = []
    shared: list[int] = []
    for i, spec in enumerate(specs):
        if type(spec) is not Shard:
            continue
        leaf = leaves[i]
        dim = spec.dim
        if isinstance(leaf, torch.Tensor):
            ndim = leaf.ndim
            if not -ndim <= dim < ndim:
                misfit(i)
                raise ValueError(f"{where} {name_of(i)}: {spec!r} but {describe(leaf)}")
            n = leaf.shape[dim]
            tensors.append((i, dim))
        elif is_block_mask(leaf) and dim in (0, -4):
            n = leaf.kv_num_blocks.shape[0]
            if n == 1:  # broadcast over the batch: every chunk shares its blocks
                shared.append(i)
                continue
            masks.append(i)
        else:
            misfit(i)
            raise ValueError(f"{where} {name_of(i)}: {spec!r} cannot split {describe(leaf)}")
        if n != size:
            if size is None:
                size, first = n, i
                continue
            raise ValueError(
                f"{where} {name_of(i)}: {spec!r} splits a dim of size {n} "
                f"({_split_dim_text(leaf, dim % leaf.ndim if leaf.ndim else 0)}) but "
                f"{name_of(first)} splits one of size {size} "
                f"({_first_text(leaves, specs, first)}); every Shard leaf must have the same "
                "size along its split dim: give leaves that are not batched Replicate() or None"
            )
    return SplitPlan(size, first, tensors, masks, shared)


_PLAIN_TENSORS = frozenset((torch.Tensor, torch.nn.Parameter))


def _plan_uniform(
    leaves: list[Any], dim: int, recheck: Callable[[], SplitPlan]
) -> SplitPlan | None:
    """The common case quickly: every leaf a plain tensor, split along ``dim``. Only the first
    leaf's size is read: ``split_columns`` checks the others as it cuts them, and calls
    ``recheck`` (the general plan, which words the error) if one does not fit."""
    if not set(map(type, leaves)) <= _PLAIN_TENSORS:
        return None
    first = leaves[0]
    if not -first.ndim <= dim < first.ndim:
        return None
    return SplitPlan(first.shape[dim], 0, [], [], [], uniform_dim=dim, recheck=recheck)


def _first_text(leaves: list[Any], specs: list[Any], first: int) -> str:
    leaf = leaves[first]
    dim = specs[first].dim % leaf.ndim if isinstance(leaf, torch.Tensor) else 0
    return _split_dim_text(leaf, dim)


def split_columns(
    leaves: list[Any],
    specs: list[Any],
    plan: SplitPlan,
    num_chunks: int,
    name_of: NameOf,
    *,
    where: str,
    count_name: str,
) -> tuple[list[Sequence[Any]], list[int] | None]:
    """Each leaf's ``num_chunks`` pieces (views), and the chunk sizes (None: nothing split)."""
    k = num_chunks
    size = plan.size
    if size is not None and plan.recheck is not None and (k > size or k == 1):
        plan = plan.recheck()  # the sizes have not been compared yet
        size = plan.size
    if size is None:
        return [(leaf,) * k for leaf in leaves], None
    if size == 0:
        raise ValueError(
            f"{where} {name_of(plan.first)}: the batch is empty: {specs[plan.first]!r} splits a "
            f"dim of size 0 ({_first_text(leaves, specs, plan.first)}), so there is nothing to "
            f"split into {k} chunk{'s' if k != 1 else ''}; skip empty batches before the call"
        )
    if k > size:
        raise ValueError(
            f"{where} {name_of(plan.first)}: {count_name}={k} but {specs[plan.first]!r} "
            f"splits a dim of size {size} ({_first_text(leaves, specs, plan.first)}); "
            f"there cannot be more chunks than entries along the split dim: use "
            f"{count_name} <= {size}"
        )
    sizes = chunk_sizes(size, k)
    if k == 1:
        return [(leaf,) for leaf in leaves], sizes
    if plan.uniform_dim is not None:
        n = len(leaves)
        try:
            pieces = map(_SPLIT_WITH_SIZES, leaves, repeat(sizes, n), repeat(plan.uniform_dim, n))
            return list(pieces), sizes
        except (RuntimeError, IndexError):  # a leaf of another size: let the general plan say
            if plan.recheck is not None:
                plan.recheck()
            raise
    columns: list[Any] = [None] * len(leaves)
    for i, dim in plan.tensors:
        columns[i] = leaves[i].split_with_sizes(sizes, dim)
    for i in plan.masks:
        columns[i] = split_block_mask(leaves[i], sizes)
    for i in plan.shared_masks:
        columns[i] = share_block_mask(leaves[i], sizes)
    if len(plan.tensors) + len(plan.masks) + len(plan.shared_masks) < len(leaves):
        for i, column in enumerate(columns):
            if column is None:
                columns[i] = (leaves[i],) * k
    return columns, sizes


def split(tree: Any, specs: Any, num_chunks: int) -> list[Any]:
    """Split a pytree into ``num_chunks`` chunks along the dims its specs name.

    Each leaf of ``specs`` (a prefix tree of ``tree``) says what happens to the leaves below it:

    - ``Shard(d)``: the tensor is cut along dim ``d`` like ``torch.tensor_split(x, num_chunks,
      d)``: chunk sizes differ by at most one, larger chunks first, and every piece is a view
      (no copy). A flex-attention ``BlockMask`` is cut along its batch dim (``Shard(0)``), its
      ``mask_mod`` re-indexed so that chunk ``c`` sees the batch indices of the whole batch; a
      ``BlockMask`` of batch 1 (broadcast over the batch) keeps its blocks in every chunk, with
      ``mask_mod`` re-indexed likewise.
    - ``Replicate()`` or ``None``: the leaf is passed whole to every chunk.

    Every ``Shard`` leaf must have the same size along its split dim, and ``num_chunks`` may not
    exceed it: both are errors, never a quiet change of the number of chunks. With no ``Shard``
    leaf at all, every chunk is the whole tree.

    Args:
        tree: the pytree to split (tuples, lists, dicts, namedtuples, Mappings, dataclasses).
        specs: a prefix tree of ``tree`` of ``Shard(d)``, ``Replicate()`` or ``None``.
        num_chunks: how many chunks (``>= 1``).

    Returns:
        ``num_chunks`` trees with the structure of ``tree``.

    Raises:
        ValueError: naming the key path (``split specs['labels']: ...``) when ``specs`` is not a
            prefix of ``tree``, a ``Shard`` dim is out of range or lands on a value that is not
            a tensor, the ``Shard`` leaves disagree on the size of their split dim, or
            ``num_chunks`` exceeds it.
        TypeError: a spec is not ``Shard``, ``Replicate`` or ``None``.

    Example:
        >>> import torch
        >>> import pshard as ps
        >>> batch = {"x": torch.arange(10).reshape(5, 2), "lr": 0.1}
        >>> chunks = ps.split(batch, {"x": ps.Shard(0), "lr": None}, 2)
        >>> [c["x"].shape[0] for c in chunks], chunks[1]["lr"]
        ([3, 2], 0.1)
    """
    k = check_int("split", "num_chunks", num_chunks, minimum=1)
    inputs = resolve_inputs([(tree, specs, "specs")], where="split", allowed=_SPLIT_SPECS)
    treedef = inputs.defs[0]
    columns, _ = split_columns(
        inputs.leaves, inputs.specs, inputs.plan, k, inputs.name_of, where="split",
        count_name="num_chunks",
    )  # fmt: skip
    if not columns:
        return [treedef.unflatten(()) for _ in range(k)]
    return list(map(treedef.unflatten, zip(*columns, strict=True)))
