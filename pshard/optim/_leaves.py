"""Trees of tensors as the kernels see them: flat lists of blocks, checked and grouped.

An optimizer's trees (gradients, moments, parameters, updates) are flattened once per update
into :class:`Flat`: the key paths, this rank's blocks (a :class:`~pshard.GlobalTensor`'s
``local``, a plain tensor itself) and each leaf's layout (its ``GlobalMeta``, ``None`` for a
plain tensor). :func:`check_like` refuses a tree whose structure or layouts differ from the one
it must match, naming the key path; :func:`groups` cuts the leaves into lists of one device and
dtype, what torch's multi-tensor kernels take; :meth:`Flat.rebuild` puts results back into the
tree, each block in a ``GlobalTensor`` of its leaf's layout.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence
from typing import Any

import torch
from optree import PyTreeAccessor, PyTreeSpec

from .._compat import foreach
from .._core.global_tensor import GlobalMeta, GlobalTensor, is_global
from .._core.tree import describe, keystr, leaf_path, tree_flatten

__all__ = ["Flat", "check_like", "flatten", "groups", "layout_text", "scaled"]

_mul = foreach("mul")


@dataclasses.dataclass(frozen=True)
class Flat:
    """A tree of tensors flattened for the kernels: blocks, layouts, structure, and the
    argument's name (key paths are computed only for error messages)."""

    blocks: list[torch.Tensor]
    metas: list[GlobalMeta | None]
    treedef: PyTreeSpec
    arg: str

    @property
    def paths(self) -> list[PyTreeAccessor]:
        """Every leaf's key path (costs a walk: for errors)."""
        return list(self.treedef.accessors())

    def where(self, i: int) -> str:
        """The key path of leaf ``i`` in the user's terms (``grads['w']``)."""
        return keystr(leaf_path(self.treedef, i), self.arg)

    def rebuild(self, blocks: Sequence[torch.Tensor]) -> Any:
        """A tree of this structure holding ``blocks``, each in a ``GlobalTensor`` of its
        leaf's layout where the leaf was one."""
        leaves = [
            b if m is None else GlobalTensor(b, m) for b, m in zip(blocks, self.metas, strict=True)
        ]
        return self.treedef.unflatten(leaves)


def flatten(tree: Any, fn: str, arg: str) -> Flat:
    """Flatten ``tree`` (tensors and GlobalTensors; a GlobalTensor is a leaf).

    Raises:
        TypeError: a leaf that is neither, naming its key path.
    """
    leaves, treedef = tree_flatten(tree)
    blocks: list[torch.Tensor] = []
    metas: list[GlobalMeta | None] = []
    for i, leaf in enumerate(leaves):
        if type(leaf) is torch.Tensor or (isinstance(leaf, torch.Tensor) and not is_global(leaf)):
            blocks.append(leaf)
            metas.append(None)
        elif is_global(leaf) and isinstance(leaf.local, torch.Tensor):
            blocks.append(leaf.local)
            metas.append(leaf.meta)
        else:
            raise TypeError(
                f"{fn}: {keystr(leaf_path(treedef, i), arg)} is {describe(leaf)}; ps.optim "
                f"works on trees whose leaves are tensors or GlobalTensors (keep other values "
                f"out of the tree, or make them tensors)"
            )
    return Flat(blocks, metas, treedef, arg)


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
    global shape, spec and mesh for GlobalTensors; the same shape for plain tensors).

    Raises:
        ValueError: naming the key paths that are missing, extra or laid out differently;
            ``fix`` ends the message.
    """
    if flat.treedef != ref.treedef:
        mine = [keystr(p, "") for p in flat.paths]
        theirs = [keystr(p, "") for p in ref.paths]
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
    for i, (meta, want) in enumerate(zip(flat.metas, ref.metas, strict=True)):
        block, other = flat.blocks[i], ref.blocks[i]
        if meta != want or block.shape != other.shape:
            raise ValueError(
                f"{fn}: {flat.where(i)} is {layout_text(meta, block)} but {ref.where(i)} is "
                f"{layout_text(want, other)}; {fix}"
            )


def groups(keys: Sequence[Hashable]) -> list[list[int]]:
    """The indices of equal keys, groups in order of first appearance (one foreach call each)."""
    out: dict[Hashable, list[int]] = {}
    for i, key in enumerate(keys):
        out.setdefault(key, []).append(i)
    return list(out.values())


def scaled(
    xs: list[torch.Tensor], factor: float, into: list[torch.Tensor] | None = None
) -> list[torch.Tensor]:
    """``xs * factor``, written into ``into`` (donated tensors of the same shapes and dtypes)
    when given and on the CPU, where torch's multi-tensor kernels are loops over the tensors
    anyway; new tensors otherwise (one multi-tensor kernel; a CUDA allocation is cheap)."""
    if into is not None and xs and xs[0].device.type == "cpu":
        for x, out in zip(xs, into, strict=True):
            torch.mul(x, factor, out=out)
        return into
    out_: list[torch.Tensor] = _mul(xs, factor)
    return out_
