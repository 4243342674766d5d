"""What one program of ``ps.jit`` is specialised to: the signature of a call.

A call's arguments are flattened with pshard's pytrees (a ``GlobalTensor`` is its block, its
layout part of the structure). The signature holds the structure, each tensor leaf's shape,
dtype, device, strides' contiguity and ``requires_grad``, the values of the other leaves and of
the static arguments, and the current mesh (axis names, sizes, this rank's coordinates): two
calls with one signature run one program.

Internal interface: :class:`Flat`, :func:`flatten_call`, :func:`tensor_leaves`,
:func:`with_tensors`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from .._core.global_tensor import GlobalTensor, is_global
from .._core.tree import describe, keystr, leaf_path, tree_flatten, tree_unflatten
from .._runtime.mesh import current_mesh

__all__ = ["Flat", "flatten_call", "tensor_leaves", "with_tensors"]

TENSOR = "tensor"  # a leaf that is a tensor (its place, in a list of leaves' kinds)


def tensor_leaves(leaves: Sequence[Any]) -> tuple[list[torch.Tensor], list[Any]]:
    """The tensors of ``leaves`` (a ``GlobalTensor``'s block) and each leaf's kind:
    :data:`TENSOR`, ``("global", meta)``, or the leaf itself (a value)."""
    tensors: list[torch.Tensor] = []
    kinds: list[Any] = []
    for leaf in leaves:
        if is_global(leaf):
            tensors.append(leaf.local)
            kinds.append(("global", leaf.meta))
        elif isinstance(leaf, torch.Tensor):
            tensors.append(leaf)
            kinds.append(TENSOR)
        else:
            kinds.append(leaf)
    return tensors, kinds


def with_tensors(kinds: Sequence[Any], tensors: Sequence[Any]) -> list[Any]:
    """The leaves of :func:`tensor_leaves` again, ``tensors`` in the tensors' places."""
    it = iter(tensors)
    out = []
    for kind in kinds:
        if kind is TENSOR:
            out.append(next(it))
        elif isinstance(kind, tuple) and len(kind) == 2 and kind[0] == "global":
            out.append(GlobalTensor(next(it), kind[1]))
        else:
            out.append(kind)
    return out


@dataclasses.dataclass(frozen=True)
class Flat:
    """A call flattened: its tensor leaves (``tensors``, in leaf order), everything else as
    the signature (``key``), and how to rebuild the arguments from tensors (``rebuild``)."""

    tensors: tuple[torch.Tensor, ...]
    key: Any
    treedef: Any
    kinds: tuple[Any, ...]  # each leaf's kind (:func:`tensor_leaves`)
    static: dict[int, Any]
    donated: tuple[int, ...]  # indices into ``tensors`` of donated leaves

    def rebuild(self, tensors: Sequence[Any]) -> tuple[Any, ...]:
        """The positional arguments with ``tensors`` in the tensor leaves' places."""
        dynamic = list(tree_unflatten(self.treedef, with_tensors(self.kinds, tensors)))
        for i in sorted(self.static):
            dynamic.insert(i, self.static[i])
        return tuple(dynamic)


def _tensor_key(t: torch.Tensor) -> tuple[Any, ...]:
    return (tuple(t.shape), t.dtype, t.device, t.is_contiguous(), t.requires_grad)


def _mesh_key() -> Any:
    mesh = current_mesh()
    if mesh is None:
        return None
    names = tuple(mesh.mesh_dim_names or ())
    coords = tuple(mesh.get_coordinate() or ())
    return names, tuple(mesh.mesh.shape), coords


def flatten_call(
    args: tuple[Any, ...], static_argnums: tuple[int, ...], donate_argnums: tuple[int, ...], fn: str
) -> Flat:
    """``args`` as a :class:`Flat` (see the module docs).

    Raises:
        TypeError: a static argument that is not hashable, or a leaf that is neither a tensor
            nor a hashable value (naming its path).
    """
    static = {i: args[i] for i in static_argnums if i < len(args)}
    for i, value in static.items():
        try:
            hash(value)
        except TypeError:
            raise TypeError(
                f"{fn}: static argument {i} is {describe(value)}, which is not hashable; "
                f"static arguments are part of the signature (pass hashable values, or make it "
                f"a traced argument)"
            ) from None
    dynamic = tuple(a for i, a in enumerate(args) if i not in static)
    positions = [i for i in range(len(args)) if i not in static]
    leaves, treedef = tree_flatten(dynamic)
    arg_of = [
        positions[i] for i, child in enumerate(treedef.children()) for _ in range(child.num_leaves)
    ]
    tensors, kinds = tensor_leaves(leaves)
    keys: list[Any] = []
    donated: list[int] = []
    for n, (leaf, kind) in enumerate(zip(leaves, kinds, strict=True)):
        if kind is TENSOR or is_global(leaf):
            t = leaf.local if is_global(leaf) else leaf
            if arg_of[n] in donate_argnums:
                donated.append(sum(1 for k in keys if k[0] == "tensor"))
            keys.append(("tensor", *_tensor_key(t), None if kind is TENSOR else kind[1]))
            continue
        try:
            hash(leaf)
        except TypeError:
            raise TypeError(
                f"{fn}: {keystr(leaf_path(treedef, n), 'args')} is {describe(leaf)}, neither a "
                f"tensor nor a hashable value; ps.jit traces tensors and specialises the "
                f"program to every other value"
            ) from None
        keys.append(("value", type(leaf), leaf))
    key = (treedef, tuple(keys), tuple(sorted(static.items(), key=lambda kv: kv[0])), _mesh_key())
    return Flat(tuple(tensors), key, treedef, tuple(kinds), static, tuple(donated))
