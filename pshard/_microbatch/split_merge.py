"""Splitting a pytree into chunks along its batch dim, and merging per-chunk results.

:func:`split` cuts every ``Shard(d)`` leaf of a tree along ``d`` like ``torch.tensor_split``
(views, sizes differing by at most one, larger chunks first) and hands ``Replicate()`` leaves
whole to every chunk; a flex-attention ``BlockMask`` is cut along its batch dim with its
``mask_mod`` re-indexed. :func:`merge` is its inverse for results: ``Shard(d)`` leaves are
concatenated, ``Partial`` leaves reduced (by :mod:`pshard._microbatch.reducers`),
``Replicate()`` leaves taken from the first chunk.

Internal interface (used by :func:`pshard.pmap_microbatch`):

- ``resolve_inputs(parts, *, where, allowed) -> Inputs``: the one input-resolution step of
  ``split``, ``pmap_microbatch`` and ``infer_out_specs``: each part ``(value, spec tree, root
  name)`` (``(args, in_specs, "in_specs")``, ...) flattened once, every leaf's spec resolved once
  (``default_spec`` where the spec tree is omitted), and the ``Shard`` leaves checked to fit and
  to agree on the size of their split dim once (the :class:`SplitPlan`); key paths are written
  only for errors (``Inputs.name_of(i)``).
- ``resolve_quick(specs, leaves, treedef, *, name, fn_name, allowed) -> list``: each leaf's
  spec with the types checked (leaves are checked where they are used).
- ``split_columns(leaves, specs, plan, num_chunks, name_of, *, where, count_name)
  -> (columns, sizes)``: each leaf's ``num_chunks`` pieces and the chunk sizes along the split
  (None when nothing is split).
- ``flatten_like(treedef, tree, *, where, name, what, first_what, ...)``: the leaves of
  ``tree`` at the leaf positions of ``treedef``, or an error naming where the structures differ.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Sequence
from itertools import repeat
from typing import Any

import optree
import torch
from optree import PyTreeSpec

from .._core.checks import check_int
from .._core.placements import Partial, Replicate, Shard
from .._core.specs import broadcast_prefix_flat, check_specs
from .._core.tree import (
    NAMESPACE,
    article,
    describe,
    is_block_mask,
    keystr,
    leaf_path,
    tree_flatten,
)
from .._runtime.debug import debug_enabled
from .reducers import ReduceError, make_reducer, weight_value

__all__ = ["merge", "split"]

NameOf = Callable[[int], str]

_REPLICATE = Replicate()
_SPLIT_WITH_SIZES = torch.Tensor.split_with_sizes
_SPLIT_SPECS = (Shard, Replicate)
_MERGE_SPECS = (Shard, Replicate, Partial)


# --------------------------------------------------------------------------- split


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
    recheck: Callable[[], Any] | None = None  # with uniform_dim: the general plan (it raises)


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


def _plan_uniform(leaves: list[Any], dim: int, recheck: Callable[[], Any]) -> SplitPlan | None:
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
    if plan.size is None:
        return [(leaf,) * k for leaf in leaves], None
    if plan.recheck is not None and (k > plan.size or k == 1):
        plan = plan.recheck()  # the sizes have not been compared yet
    if plan.size == 0:
        raise ValueError(
            f"{where} {name_of(plan.first)}: the batch is empty: {specs[plan.first]!r} splits a "
            f"dim of size 0 ({_first_text(leaves, specs, plan.first)}), so there is nothing to "
            f"split into {k} chunk{'s' if k != 1 else ''}; skip empty batches before the call"
        )
    if k > plan.size:
        raise ValueError(
            f"{where} {name_of(plan.first)}: {count_name}={k} but {specs[plan.first]!r} "
            f"splits a dim of size {plan.size} ({_first_text(leaves, specs, plan.first)}); "
            f"there cannot be more chunks than entries along the split dim: use "
            f"{count_name} <= {plan.size}"
        )
    sizes = chunk_sizes(plan.size, k)
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
        columns[i] = _share_block_mask(leaves[i], sizes)
    if len(plan.tensors) + len(plan.masks) + len(plan.shared_masks) < len(leaves):
        for i, column in enumerate(columns):
            if column is None:
                columns[i] = (leaves[i],) * k
    return columns, sizes


def _offsets(sizes: Sequence[int]) -> list[int]:
    out, start = [], 0
    for n in sizes:
        out.append(start)
        start += n
    return out


def offset_mask_mod(mask_mod: Callable, offset: int) -> Callable:
    """``mask_mod`` seen from a chunk that starts at batch index ``offset``."""
    if offset == 0:
        return mask_mod
    inner = getattr(mask_mod, "_pshard_batch_offset", None)
    if inner is not None:  # a chunk of a chunk: one offset on the original mask_mod
        mask_mod, offset = inner[0], inner[1] + offset

    def mask_mod_at_offset(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return mask_mod(b + offset, h, q_idx, kv_idx)

    mask_mod_at_offset._pshard_batch_offset = (mask_mod, offset)  # type: ignore[attr-defined]
    return mask_mod_at_offset


_BLOCK_TENSORS = (
    "kv_num_blocks",
    "kv_indices",
    "full_kv_num_blocks",
    "full_kv_indices",
    "q_num_blocks",
    "q_indices",
    "full_q_num_blocks",
    "full_q_indices",
)


def split_block_mask(mask: Any, sizes: Sequence[int]) -> list[Any]:
    """Cut a ``BlockMask`` along its batch dim into chunks of ``sizes`` (block tensors as
    views, ``mask_mod`` re-indexed by each chunk's batch offset)."""
    offsets = _offsets(sizes)
    if any(getattr(mask, n, None) is not None for n in ("dq_write_order", "dq_kv_order")):
        # torch's own slicing knows how to cut its precomputed dq metadata
        out = []
        for start, n in zip(offsets, sizes, strict=True):
            chunk = mask[start : start + n]
            chunk.mask_mod = offset_mask_mod(mask.mask_mod, start)
            out.append(chunk)
        return out
    pieces = {
        name: (None,) * len(sizes) if t is None else t.split_with_sizes(list(sizes), 0)
        for name in _BLOCK_TENSORS
        for t in (getattr(mask, name),)
    }
    cls = type(mask)
    return [
        cls(
            seq_lengths=mask.seq_lengths,
            **{name: pieces[name][c] for name in _BLOCK_TENSORS},
            BLOCK_SIZE=mask.BLOCK_SIZE,
            mask_mod=offset_mask_mod(mask.mask_mod, start),
        )
        for c, start in enumerate(offsets)
    ]


def _share_block_mask(mask: Any, sizes: Sequence[int]) -> list[Any]:
    """A batch-1 ``BlockMask`` for every chunk: the same blocks, ``mask_mod`` re-indexed."""
    out = []
    for start in _offsets(sizes):
        if start == 0:
            out.append(mask)
            continue
        chunk = copy.copy(mask)
        chunk.mask_mod = offset_mask_mod(mask.mask_mod, start)
        out.append(chunk)
    return out


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


# --------------------------------------------------------------------------- structure


def _node_text(entries: tuple, depth: int, value: Any, has_value: bool) -> str:
    """What a tree holds at ``entries[:depth]``, from the path of a leaf below it (and the
    value there when known)."""
    if has_value:
        return _describe_sub(value)
    if len(entries) > depth:
        return article(entries[depth].type.__name__)
    return "a leaf"


def _difference(
    treedef: PyTreeSpec, other: Any, first: Any, has_first: bool
) -> tuple[str, str, str]:
    """Where ``other``'s structure first differs from ``treedef`` (whose value is ``first``
    when ``has_first``): (the path as a key-string suffix, what each one has there)."""
    paths_a = treedef.accessors()
    paths_b, _, treedef_b = optree.tree_flatten_with_accessor(other, namespace=NAMESPACE)
    for a, b in zip([*paths_a, None], [*paths_b, None], strict=False):
        if a == b and a is not None:
            continue
        entries_a = tuple(a) if a is not None else ()
        entries_b = tuple(b) if b is not None else ()
        depth = 0
        while depth < min(len(entries_a), len(entries_b)) and entries_a[depth] == entries_b[depth]:
            depth += 1
        node = optree.PyTreeAccessor(entries_a[:depth])
        here_first = node(first) if has_first else None
        return (
            node.codify(""),
            _node_text(entries_a, depth, here_first, has_first),
            _describe_sub(node(other)),
        )
    return "", str(treedef), str(treedef_b)


def _describe_sub(x: Any) -> str:
    _, treedef = optree.tree_flatten(x, namespace=NAMESPACE)
    if treedef.is_leaf() or treedef.num_leaves == 0:
        return describe(x)
    return f"{describe(x)} ({treedef.num_leaves} leaves)"


def flatten_like(
    treedef: PyTreeSpec,
    tree: Any,
    *,
    where: str,
    name: str,
    what: str,
    first_what: str,
    first: Any = None,
    has_first: bool = False,
) -> list[Any]:
    """The leaves of ``tree``, which must have the structure ``treedef``.

    ``what`` / ``first_what`` name ``tree`` and the tree ``treedef`` came from in errors
    (``"chunks[2]"``, ``"chunks[0]"``); ``name`` is the spec argument the key paths are written
    on (``"specs"``, ``"out_specs"``); ``first`` is that tree's value when ``has_first``.
    """
    try:
        return treedef.flatten_up_to(tree)
    except ValueError:
        pass
    path, a, b = _difference(treedef, tree, first, has_first)
    raise ValueError(
        f"{where} {name}{path}: {what} has {b} but {first_what} has {a}; every one must have "
        "the same tree structure"
    )


def _is_leaf(x: Any) -> bool:
    return optree.tree_is_leaf(x, namespace=NAMESPACE)


# --------------------------------------------------------------------------- merge


def _concat_problem(column: Sequence[Any], spec: Shard, error: Exception) -> str:
    first = column[0]
    for c, x in enumerate(column):
        if is_block_mask(x):
            return (
                f"{spec!r} cannot concatenate BlockMasks (their mask_mods cannot be merged); "
                "give this leaf Replicate()"
            )
        if not isinstance(x, torch.Tensor) and not _is_leaf(x):
            return (
                f"chunks[{c}] has {_describe_sub(x)} but chunks[0] has {describe(first)}; every "
                "one must have the same tree structure"
            )
        if not isinstance(x, torch.Tensor):
            return f"{spec!r} concatenates tensors but chunks[{c}] has {describe(x)}"
    for c, x in enumerate(column):
        if x.ndim != first.ndim:
            return (
                f"{spec!r} but chunks[0] has {describe(first)} and chunks[{c}] {describe(x)}; "
                "the chunks must have the same number of dims"
            )
        if not -x.ndim <= spec.dim < x.ndim:
            return f"{spec!r} but chunks[{c}] has {describe(x)}"
        d = spec.dim % x.ndim
        for j in range(x.ndim):
            if j != d and x.shape[j] != first.shape[j]:
                return (
                    f"{spec!r} but chunks[0] has {describe(first)} and chunks[{c}] "
                    f"{describe(x)}: they differ in dim {j}; every dim but the split dim "
                    f"{d} must agree"
                )
    return f"{spec!r}: torch.cat failed: {error}"


def merge(
    chunks: Sequence[Any],
    specs: Any,
    *,
    weights: Sequence[Any] | None = None,
    accum_dtype: torch.dtype | None = None,
) -> Any:
    """Merge per-chunk results into one, the inverse of :func:`split` for results.

    Each leaf of ``specs`` (a prefix tree of a chunk) says how the chunks' leaves below it
    combine:

    - ``Shard(d)``: concatenated along ``d`` (``torch.cat``: one new tensor);
    - ``Partial("sum")``, ``Partial("max")``, ``Partial("min")``: reduced elementwise;
    - ``Partial("mean")``: the weighted mean ``sum_c w_c x_c / sum_c w_c``; a chunk of weight 0
      contributes nothing (not even a NaN it holds); if every weight is 0 the result is zeros;
    - ``Replicate()`` or ``None``: the first chunk's leaf (with ``PSHARD_DEBUG=1``, every chunk
      must hold an equal one).

    Python numbers under ``Partial`` reduce as numbers; a mean of integer tensors is an error.
    Reductions keep IEEE semantics (an ``inf`` in a mean stays ``inf``) and accumulate
    ``bfloat16`` / ``float16`` in float32 (one rounding at the end) unless ``accum_dtype`` says
    otherwise; the result has the chunks' dtype.

    Args:
        chunks: the per-chunk trees, all of the same structure.
        specs: a prefix tree of a chunk of ``Shard(d)``, ``Partial(...)``, ``Replicate()`` or
            ``None``.
        weights: one non-negative weight per chunk (numbers or one-element tensors) for
            ``Partial("mean")`` leaves. Default: each chunk's size along the split dim of the
            first ``Shard`` leaf of the tree (the chunk sizes when the chunks come from
            :func:`split`), or equal weights when no leaf is ``Shard``.
        accum_dtype: the dtype floating ``Partial`` leaves accumulate in (default: float32
            for ``bfloat16`` / ``float16``, their own dtype otherwise).

    Returns:
        One tree with the structure of a chunk.

    Raises:
        ValueError: naming the key path (``merge specs['logits']: ...``) when the chunks differ
            in structure, ``Shard`` leaves differ in a dim other than the split dim, a reduced
            leaf is not a tensor or number, or ``weights`` has the wrong length.

    Example:
        >>> import torch
        >>> import pshard as ps
        >>> chunks = [{"y": torch.ones(3, 2), "loss": 1.0}, {"y": torch.zeros(1, 2), "loss": 5.0}]
        >>> out = ps.merge(chunks, {"y": ps.Shard(0), "loss": ps.Partial("mean")})
        >>> out["y"].shape, out["loss"]
        (torch.Size([4, 2]), 2.0)
    """
    chunks = list(chunks)
    k = len(chunks)
    if k == 0:
        raise ValueError("merge: chunks is empty; give at least one chunk")
    leaves, treedef = tree_flatten(chunks[0])
    flat = [leaves]
    for c in range(1, k):
        flat.append(
            flatten_like(
                treedef,
                chunks[c],
                where="merge",
                name="specs",
                what=f"chunks[{c}]",
                first_what="chunks[0]",
                first=chunks[0],
                has_first=True,
            )
        )
    checks = {"name": "specs", "fn_name": "merge", "allowed": _MERGE_SPECS}
    resolved = resolve_quick(specs, leaves, treedef, **checks)
    if (
        k > 1
        and leaves
        and type(resolved[0]) is Shard
        and resolved.count(resolved[0]) == len(resolved)
    ):
        try:  # the common case quickly: one Shard spec over the whole tree
            return treedef.unflatten(
                list(map(torch.cat, zip(*flat, strict=True), repeat(resolved[0].dim, len(leaves))))
            )
        except (RuntimeError, TypeError, IndexError):
            pass  # the per-leaf path below finds the leaf and words the error
    columns = list(zip(*flat, strict=True)) if leaves else []

    def name_of(i: int) -> str:
        return keystr(leaf_path(treedef, i), "specs")

    if weights is not None:
        weights = list(weights)
        if len(weights) != k:
            raise ValueError(
                f"merge: weights has {len(weights)} entries for {k} chunks; give one weight "
                "per chunk"
            )
        mean_weights: list[Any] | None = [
            weight_value(w, f"merge: weights[{c}]") for c, w in enumerate(weights)
        ]
    else:
        mean_weights = None
    out: list[Any] = []
    debug: bool | None = None
    for i, (spec, column) in enumerate(zip(resolved, columns, strict=True)):
        kind = type(spec)
        if kind is Shard:
            if k == 1 and isinstance(column[0], torch.Tensor):
                out.append(column[0])
                continue
            try:
                out.append(torch.cat(column, spec.dim))
            except (RuntimeError, TypeError, IndexError) as error:
                check_specs(leaves, resolved, treedef, **checks)
                problem = _concat_problem(column, spec, error)
                raise ValueError(f"merge {name_of(i)}: {problem}") from None
            continue
        if kind is Partial and spec.reduce == "mean" and mean_weights is None:
            mean_weights = _default_weights(resolved, columns, k)
        if debug is None:
            debug = debug_enabled()
        reducer = make_reducer(spec, accum_dtype, None, "chunks[{}]", k, debug=debug)
        try:
            for c, x in enumerate(column):
                reducer.add(x, mean_weights[c] if mean_weights is not None else 1.0, c)
        except ReduceError as error:
            raise ValueError(f"merge {name_of(i)}: {error}") from None
        out.append(reducer.result())
    return treedef.unflatten(out)


def _default_weights(resolved: list[Any], columns: list[Sequence[Any]], k: int) -> list[float]:
    for spec, column in zip(resolved, columns, strict=True):
        if type(spec) is Shard and all(isinstance(x, torch.Tensor) for x in column):
            d = spec.dim
            return [float(x.shape[d]) for x in column]
    return [1.0] * k
