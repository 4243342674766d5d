"""Trees of tensors as the kernels see them: flat lists of blocks, checked and grouped.

An optimizer's trees (gradients, moments, parameters, updates) are flattened once per update
into :class:`Flat`: this rank's blocks (a :class:`~pshard.GlobalTensor`'s ``local``, a plain
tensor itself), each leaf's layout (its ``GlobalMeta``, ``None`` for a plain tensor) and the
structure (key paths are computed only for error messages). :func:`check_like` refuses a tree
whose structure or layouts differ from the one it must match, naming the key path;
:func:`groups` cuts the leaves into lists of one device and dtype, what torch's multi-tensor
kernels take; :meth:`Flat.rebuild` puts results back into the tree, each block in a
``GlobalTensor`` of its leaf's layout.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Hashable, Sequence
from typing import Any

import optree
import torch
from optree import PyTreeSpec

from .._core.global_tensor import GlobalMeta, is_global
from .._core.specs import broadcast_prefix_flat
from .._core.tree import (
    NAMESPACE,
    article,
    describe,
    keystr,
    tree_flatten,
    tree_flatten_with_path,
)
from .._runtime import stage_parts

__all__ = [
    "Flat",
    "cast",
    "check_like",
    "flatten",
    "groups",
    "layout_text",
    "prefix_flat",
]


@dataclasses.dataclass(frozen=True)
class Flat:
    """A tree of tensors flattened for the kernels: this rank's blocks in flatten order, the
    structure (``GlobalTensor`` s are nodes whose static data is their layout, so two trees of
    one structure have the same layouts), the argument's name and the tree itself (for error
    messages, which alone need the key paths)."""

    blocks: list[torch.Tensor]
    treedef: PyTreeSpec
    arg: str
    tree: Any

    @functools.cached_property
    def leafy(self) -> tuple[list[Any], PyTreeSpec]:
        """Leaves and structure with each ``GlobalTensor`` a leaf (pshard's walks: spec and
        mask trees are prefixes of this structure); the leaves in the blocks' order."""
        return tree_flatten(self.tree)

    @property
    def leaves(self) -> list[Any]:
        """The leaves with each ``GlobalTensor`` a leaf."""
        return self.leafy[0]

    @property
    def metas(self) -> list[GlobalMeta | None]:
        """Each leaf's layout (``None`` for a plain tensor)."""
        return [x.meta if is_global(x) else None for x in self.leaves]

    def where(self, i: int) -> str:
        """The key path of leaf ``i`` in the user's terms (``grads['w']``)."""
        return keystr(tree_flatten_with_path(self.tree)[0][i], self.arg)

    def check_floating(self, fn: str) -> None:
        """Raise unless every block is floating-point (what an optimizer updates).

        Raises:
            TypeError: naming the first leaf that is not, and its dtype.
        """
        for i, b in enumerate(self.blocks):
            if not (b.is_floating_point() or b.is_complex()):
                kind = str(b.dtype).removeprefix("torch.")
                raise TypeError(
                    f"{fn}: {self.where(self._leaf_of(i))} is {article(kind)} tensor; "
                    f"optimizers update floating-point tensors: keep integer and boolean values "
                    f"(step counters, index tables, masks) out of the tree they update"
                )

    def check_distinct(self, fn: str) -> None:
        """Raise if two blocks share memory (two keys holding one tensor, or views that
        overlap): written in place, one would take both updates.

        Raises:
            ValueError: naming both key paths.
        """
        spans: dict[int, list[tuple[int, int, int]]] = {}
        for i, b in enumerate(self.blocks):
            if b.numel() == 0:
                continue
            start = b.data_ptr()
            extent = sum((n - 1) * abs(st) for n, st in zip(b.shape, b.stride(), strict=True))
            end = start + (extent + 1) * b.element_size()
            owner = b.untyped_storage().data_ptr()
            for other_start, other_end, j in spans.setdefault(owner, []):
                if start < other_end and other_start < end:
                    raise ValueError(
                        f"{fn}: {self.where(self._leaf_of(j))} and "
                        f"{self.where(self._leaf_of(i))} share memory (one tensor under two "
                        f"keys, or overlapping views); written in place (donate=True) it would "
                        f"take both updates. Keep one key per tensor (tie weights after the "
                        f"update), or update without donate"
                    )
            spans[owner].append((start, end, i))

    def _leaf_of(self, block: int) -> int:
        """The index among :attr:`leaves` (a GlobalTensor one leaf) of block ``block``."""
        if len(self.leaves) == len(self.blocks):
            return block
        target = self.blocks[block]
        for k, leaf in enumerate(self.leaves):
            if getattr(leaf, "local", leaf) is target:
                return k
        return block

    def rebuild(self, blocks: Sequence[torch.Tensor]) -> Any:
        """A tree of this structure holding ``blocks``, each in a ``GlobalTensor`` of its
        leaf's layout where the leaf was one (the tree itself when they are its own blocks,
        written in place)."""
        if all(a is b for a, b in zip(blocks, self.blocks, strict=True)):
            return self.tree
        stage_parts.carry(self.blocks, blocks)  # a pipeline stage's part stays one
        return self.treedef.unflatten(blocks)


def flatten(tree: Any, fn: str, arg: str) -> Flat:
    """Flatten ``tree`` (tensors and GlobalTensors) into its blocks.

    Raises:
        TypeError: a leaf that is neither, naming its key path.
    """
    blocks, treedef = optree.tree_flatten(tree, namespace=NAMESPACE)
    if all(isinstance(b, torch.Tensor) for b in blocks):
        return Flat(blocks, treedef, arg, tree)
    # types pshard registers on first sight (Mappings, dataclasses), or leaves of other kinds
    paths, leaves, _ = tree_flatten_with_path(tree)
    for path, leaf in zip(paths, leaves, strict=True):
        if not (isinstance(leaf, torch.Tensor) or is_global(leaf)) or not isinstance(
            getattr(leaf, "local", leaf), torch.Tensor
        ):
            raise TypeError(
                f"{fn}: {keystr(path, arg)} is {describe(leaf)}; ps.optim works on trees whose "
                f"leaves are tensors or GlobalTensors (keep other values out of the tree, or "
                f"make them tensors)"
            )
    blocks, treedef = optree.tree_flatten(tree, namespace=NAMESPACE)
    return Flat(blocks, treedef, arg, tree)


def prefix_flat(prefix: Any, flat: Flat, name: str, fn: str) -> list[Any]:
    """The leaf of the prefix tree ``prefix`` (a spec tree, a mask) over each block of
    ``flat`` (prefix semantics of pshard's spec trees; errors name the key path).

    Raises:
        ValueError: ``prefix`` is not a prefix of the tree.
    """
    try:  # the blocks' structure: a GlobalTensor is a node with one child
        return broadcast_prefix_flat(prefix, flat.treedef, flat.blocks, name=name, fn_name=fn)
    except ValueError:  # the message in the user's terms: GlobalTensors as leaves
        leaves, treedef = flat.leafy
        return broadcast_prefix_flat(prefix, treedef, leaves, name=name, fn_name=fn)


def layout_text(meta: GlobalMeta | None, block: torch.Tensor) -> str:
    """A leaf's layout for error messages."""
    if meta is None:
        return f"a tensor of shape {tuple(block.shape)}"
    return (
        f"a GlobalTensor of shape {meta.shape} ({meta.spec!r} on mesh {meta.key.text()}, block "
        f"shape {tuple(block.shape)})"
    )


def check_like(flat: Flat, ref: Flat, fn: str, fix: str) -> None:
    """Raise unless ``flat`` has ``ref``'s structure and, leaf by leaf, its layout (the same
    global shape, spec and mesh for GlobalTensors; the same block shape).

    Raises:
        ValueError: naming the key paths that are missing, extra or laid out differently;
            ``fix`` ends the message.
    """
    if flat.treedef == ref.treedef and all(
        a.shape == b.shape for a, b in zip(flat.blocks, ref.blocks, strict=True)
    ):
        return
    mine = [keystr(p, "") for p in tree_flatten_with_path(flat.tree)[0]]
    theirs = [keystr(p, "") for p in tree_flatten_with_path(ref.tree)[0]]
    if mine != theirs:
        missing = [ref.arg + k for k in theirs if k not in set(mine)]
        extra = [flat.arg + k for k in mine if k not in set(theirs)]
        details = []
        if missing:
            details.append(f"missing from {flat.arg}: {', '.join(missing)}")
        if extra:
            details.append(f"not in {ref.arg}: {', '.join(extra)}")
        if not details:
            details.append(f"{flat.arg} is {flat.treedef} but {ref.arg} is {ref.treedef}")
        raise ValueError(
            f"{fn}: {flat.arg} does not have the structure of {ref.arg} ({'; '.join(details)}); "
            f"{fix}"
        )
    for i, (x, y) in enumerate(zip(flat.leaves, ref.leaves, strict=True)):
        meta, want = getattr(x, "meta", None), getattr(y, "meta", None)
        block, other = getattr(x, "local", x), getattr(y, "local", y)
        if meta != want or block.shape != other.shape:
            raise ValueError(
                f"{fn}: {flat.where(i)} is {layout_text(meta, block)} but {ref.where(i)} is "
                f"{layout_text(want, other)}; {fix}"
            )
    raise ValueError(  # node types differ where the keys agree (a list for a tuple)
        f"{fn}: {flat.arg} does not have the structure of {ref.arg} ({flat.arg} is "
        f"{flat.treedef} but {ref.arg} is {ref.treedef}); {fix}"
    )


def groups(keys: Sequence[Hashable]) -> list[list[int]]:
    """The indices of equal keys, groups in order of first appearance (one foreach call each)."""
    out: dict[Hashable, list[int]] = {}
    for i, key in enumerate(keys):
        out.setdefault(key, []).append(i)
    return list(out.values())


def cast(xs: list[torch.Tensor], idx: list[int], dtype: torch.dtype) -> list[torch.Tensor]:
    """``xs[i]`` for ``i`` in ``idx``, in ``dtype`` (the tensors themselves where they are)."""
    return [xs[i] if xs[i].dtype == dtype else xs[i].to(dtype) for i in idx]
