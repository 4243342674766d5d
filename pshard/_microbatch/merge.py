"""Merging per-chunk results into one: :func:`merge`, the inverse of :func:`pshard.split` for
results, and the structure check that :func:`pshard.pmap_microbatch` shares with it.

``Shard(d)`` leaves are concatenated, ``Partial`` leaves reduced (by
:mod:`pshard._microbatch.reducers`), ``Replicate()`` leaves taken from the first chunk.

Internal interface (used by ``pmap_microbatch``):

- ``flatten_like(treedef, tree, *, where, name, what, first_what, ...)``: the leaves of
  ``tree`` at the leaf positions of ``treedef``, or an error naming where the structures differ.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import repeat
from typing import Any

import optree
import torch
from optree import PyTreeSpec

from .._core.placements import Partial, Replicate, Shard
from .._core.specs import check_specs
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
from .split import resolve_quick

__all__ = ["flatten_like", "merge"]

_MERGE_SPECS = (Shard, Replicate, Partial)


# --------------------------------------------------------------------------- structure


def _node_text(entries: tuple[Any, ...], depth: int, value: Any, has_value: bool) -> str:
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
    resolved = resolve_quick(
        specs, leaves, treedef, name="specs", fn_name="merge", allowed=_MERGE_SPECS
    )
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
                check_specs(
                    leaves, resolved, treedef, name="specs", fn_name="merge", allowed=_MERGE_SPECS
                )
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


def _default_weights(
    resolved: Sequence[Any], columns: Sequence[Sequence[Any]], k: int
) -> list[float]:
    for spec, column in zip(resolved, columns, strict=True):
        if type(spec) is Shard and all(isinstance(x, torch.Tensor) for x in column):
            d = spec.dim
            return [float(x.shape[d]) for x in column]
    return [1.0] * k
