"""Microbatches for a pipeline: inputs cut along their split dim by ``torch.chunk``'s rule.

The spec language is :func:`pshard.pmap_microbatch`'s (``Shard(d)`` leaves are cut along
``d``, ``Replicate()`` / ``None`` leaves go whole to every microbatch; by default ``Shard(0)``
for tensors with a dim), resolved by :func:`pshard._microbatch.split.resolve_inputs`. The
sizes follow ``torch.chunk``: ``ceil(n / k)`` per microbatch, the last one smaller
(``torch.chunk(10 rows, 4)``: 3, 3, 3, 1). Where ``torch.chunk`` would return fewer than
``k`` pieces (6 rows into 4: three pieces of 2) it is an error, never a quiet change of the
number of microbatches.

Internal interface: :func:`split_microbatches` -> :class:`Microbatches`, :func:`chunk_sizes`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from .._core.placements import Replicate, Shard
from .._core.specs import default_spec
from .._core.tree import describe
from .._microbatch.block_masks import share_block_mask, split_block_mask
from .._microbatch.split import resolve_inputs

__all__ = ["Microbatches", "chunk_sizes", "split_microbatches"]


def chunk_sizes(total: int, k: int) -> list[int]:
    """``torch.chunk``'s sizes for ``total`` entries in ``k`` pieces (it may give fewer)."""
    size = -(-total // k)
    return [size] * (total // size) + ([total % size] if total % size else [])


@dataclasses.dataclass
class Microbatches:
    """Each part's microbatches (``parts[i][m]``), their sizes, the split dim (of the first
    split leaf, non-negative) and each leaf's (every part's leaves in order; ``None``: passed
    whole)."""

    parts: list[list[Any]]
    sizes: list[int]
    split_dim: int
    dims: list[int | None]


def split_microbatches(
    parts: Sequence[tuple[Any, Any, str]], k: int, *, where: str
) -> Microbatches:
    """Cut each ``(value, spec tree, root name)`` part into ``k`` microbatches (see the
    module docs); the ``Shard`` leaves of every part must agree on the size of their split
    dim.

    Raises:
        ValueError: naming the key path, when a spec does not fit its leaf, the split sizes
            differ, nothing is split, the batch is empty, or ``torch.chunk`` cannot give
            ``k`` pieces.
    """
    inputs = resolve_inputs(parts, where=where, allowed=(Shard, Replicate), default=default_spec)
    plan = inputs.plan
    if plan.recheck is not None:  # the quick plan read one leaf: check them all
        plan = inputs.plan = plan.recheck()
    if plan.size is None:
        raise ValueError(
            f"{where}: no input is split into microbatches (every leaf of in_specs is "
            f"Replicate()); give the batched inputs Shard(d) in in_specs (the default for "
            f"tensors with a dim)"
        )
    first, total = plan.first, plan.size
    name, leaf = inputs.name_of(first), inputs.leaves[first]
    if total == 0 or k > total:
        raise ValueError(
            f"{where} {name}: num_microbatches={k} but the batch ({describe(leaf)}) has {total} "
            f"entries along its split dim; use 1 <= num_microbatches <= {total}"
            if total
            else f"{where} {name}: the batch is empty ({describe(leaf)}); skip empty batches "
            f"before the call"
        )
    sizes = chunk_sizes(total, k)
    if len(sizes) != k:
        fits = [j for j in range(1, total + 1) if len(chunk_sizes(total, j)) == j]
        near = min(fits, key=lambda j: (abs(j - k), j))
        raise ValueError(
            f"{where} {name}: num_microbatches={k} but torch.chunk's rule cuts the {total} "
            f"entries of the split dim into {len(sizes)} microbatches of {sizes[0]} "
            f"(ceil({total} / {k}) each), not {k}; use num_microbatches={near}, or a batch "
            f"that torch.chunk cuts into {k} pieces"
        )
    dims = inputs.split_dims()
    columns: list[Any] = []
    for i, leaf in enumerate(inputs.leaves):
        if dims[i] is None or type(inputs.specs[i]) is not Shard:
            columns.append((leaf,) * k)
        elif i in plan.masks:
            columns.append(split_block_mask(leaf, sizes))
        elif i in plan.shared_masks:
            columns.append(share_block_mask(leaf, sizes))
        else:
            columns.append(leaf.split_with_sizes(sizes, dims[i]))
    out: list[list[Any]] = []
    start = 0
    for treedef, count in zip(inputs.defs, inputs.counts, strict=True):
        cols = columns[start : start + count]
        out.append([treedef.unflatten([c[m] for c in cols]) for m in range(k)])
        start += count
    dims = [d if type(spec) is Shard else None for d, spec in zip(dims, inputs.specs, strict=True)]
    split_dim = next(d for d in dims if d is not None)
    return Microbatches(out, sizes, split_dim, dims)
