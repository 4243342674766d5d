"""Spec trees: matching a prefix tree of specs against a value, and checking each leaf's spec.

A spec tree is a *prefix* of the value it describes (JAX's ``in_axes``/``in_specs``, optree's
prefix semantics): each leaf of the spec tree (a placement, a ``P(...)``, or ``None`` meaning
``Replicate()``) applies to the whole subtree of the value below it. ``None`` is always a leaf of
a spec tree; in a value it is an empty node (no leaf, passed through unchanged).

Containers of the spec and the value match when they are of the same type with the same keys
(or length), and, more leniently, when the spec's container is a plain ``tuple``/``list`` and
the value's any sequence (tuple, list, namedtuple, deque) of the same length, or the spec's is a
plain ``dict`` (or ``OrderedDict``/``defaultdict``) and the value's is keyed (any Mapping,
dataclass or namedtuple) with the same keys. Keyed children pair up by key, never by order.

Internal interface (used by the transforms):

- ``broadcast_prefix(prefix, tree, *, name="in_specs", fn_name=None) -> list``: the prefix
  tree's leaf over each leaf of ``tree``, in flatten order (generic: any leaf values, ``None``
  stays ``None``; also used for ``pad_values``).
- ``broadcast_prefix_flat(prefix, treedef, leaves=None, *, name, fn_name) -> list``: the same
  when the value is already flattened (``leaves`` only improve error messages).
- ``resolve_specs(specs, leaves, treedef, *, name="in_specs", fn_name=None,
  allowed=(Placement, P)) -> list[Placement | P]``: ``broadcast_prefix_flat`` then
  ``check_specs``: the spec of every leaf, ``None`` turned into ``Replicate()``, checked.
- ``check_specs(leaves, specs, treedef, *, ...) -> list[Placement | P]``: the per-leaf part on
  already broadcast specs: each spec is an allowed type; a ``Shard``/``StridedShard`` (or a
  ``P`` naming a mesh axis) lands on a tensor with enough dims or a ``BlockMask`` split on its
  batch dim; never on a scalar or on an object pshard cannot look into. Negative dims are kept
  as given (normalise with ``dim % ndim``).
- ``is_split(spec) -> bool``: whether a (resolved) spec splits its value.
- ``is_torch_placement(x) -> bool``: whether ``x`` is a ``torch.distributed.tensor`` placement.
- ``default_spec(leaf) -> Placement``: ``pmap_microbatch``'s default spec of one leaf.
- ``rebuild_spec_tree(treedef, specs, *, keyed_as_dict) -> spec tree``: a spec tree of the
  structure ``treedef`` from an iterator of specs (what annotations and batch-dim analysis build).

The structure matching is cached per pair of tree structures (the cache ``"spec matching"`` of
:mod:`pshard._core.caches`, a pure function of two ``PyTreeSpec``), so repeated calls on
same-shaped trees cost one flatten of the spec tree and one list comprehension.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Iterator, Mapping
from typing import Any

import optree
import torch
from optree import PyTreeKind, PyTreeSpec

from .caches import cached
from .global_tensor import GlobalTensor
from .placements import P, Placement, Replicate, Shard, StridedShard, from_torch_placement
from .tree import (
    NAMESPACE,
    article,
    describe,
    is_block_mask,
    is_opaque,
    keystr,
    leaf_path,
    tree_flatten,
)

__all__ = [
    "broadcast_prefix",
    "broadcast_prefix_flat",
    "check_specs",
    "default_spec",
    "is_split",
    "is_torch_placement",
    "rebuild_spec_tree",
    "resolve_specs",
]

_PLAIN_SEQUENCES = (PyTreeKind.TUPLE, PyTreeKind.LIST)
_SEQUENCES = (*_PLAIN_SEQUENCES, PyTreeKind.NAMEDTUPLE, PyTreeKind.DEQUE, PyTreeKind.STRUCTSEQUENCE)
_DICTS = tuple(
    getattr(PyTreeKind, k)
    for k in ("DICT", "ORDEREDDICT", "DEFAULTDICT", "FROZENDICT")
    if hasattr(PyTreeKind, k)
)
_LEAVES = (PyTreeKind.LEAF, PyTreeKind.NONE)


class _Mismatch(Exception):
    """Raised by :func:`_match` with the child-index path to the first mismatching node pair."""

    def __init__(self, path: list[tuple[int, int]]) -> None:
        super().__init__(path)
        self.path = path


# --------------------------------------------------------------------------- structure matching


def _keys(td: PyTreeSpec) -> tuple[Any, ...] | None:
    """The keys of a keyed node (dict-like, Mapping, dataclass, namedtuple); None otherwise."""
    kind, cls = td.kind, td.type
    if cls is None:  # a leaf
        return None
    if kind in _DICTS:
        return tuple(td.entries())
    if kind == PyTreeKind.NAMEDTUPLE:
        return tuple(getattr(cls, "_fields", ()))
    if kind == PyTreeKind.CUSTOM:
        entry = optree.register_pytree_node.get(cls, namespace=NAMESPACE)
        if entry is not None and issubclass(
            entry.path_entry_type, (optree.MappingEntry, optree.GetAttrEntry)
        ):
            return tuple(td.entries())
    return None


def _pairing(spec: PyTreeSpec, value: PyTreeSpec) -> list[int] | None:
    """For each child of ``value``, the index of the matching child of ``spec``; None if the
    two nodes do not match."""
    skind, vkind = spec.kind, value.kind
    if vkind in _LEAVES:
        return None
    n = spec.num_children
    if skind in _PLAIN_SEQUENCES and vkind in _SEQUENCES:
        return list(range(n)) if value.num_children == n else None
    vkeys = _keys(value)
    if skind in _DICTS and vkeys is not None or spec.type is value.type:
        skeys = _keys(spec)
        if skeys is not None and vkeys is not None:
            if len(skeys) != len(vkeys) or set(skeys) != set(vkeys):
                return None
            where = {k: i for i, k in enumerate(skeys)}
            return [where[k] for k in vkeys]
        if (
            spec.type is value.type
            and value.num_children == n
            and spec.entries() == value.entries()
        ):
            return list(range(n))
    return None


def _node(td: PyTreeSpec) -> PyTreeSpec:
    """The top node of ``td`` alone (``one_level``); ``td`` is not a leaf."""
    node = td.one_level()
    if node is None:  # pragma: no cover - callers never pass a leaf
        raise TypeError(f"pshard: {td} is a leaf, not a node")
    return node


def _walk(
    spec: PyTreeSpec,
    value: PyTreeSpec,
    offset: int,
    out: list[int],
    path: list[tuple[int, int]],
) -> None:
    if spec.kind == PyTreeKind.LEAF:
        out.extend([offset] * value.num_leaves)
        return
    pairing = _pairing(spec, value)
    if pairing is None:
        raise _Mismatch(list(path))
    schildren = spec.children()
    starts = [0]
    for child in schildren:
        starts.append(starts[-1] + child.num_leaves)
    for vi, (si, vchild) in enumerate(zip(pairing, value.children(), strict=True)):
        path.append((si, vi))
        _walk(schildren[si], vchild, offset + starts[si], out, path)
        path.pop()


def _match_uncached(spec: PyTreeSpec, value: PyTreeSpec) -> tuple[int, ...]:
    out: list[int] = []
    _walk(spec, value, 0, out, [])
    return tuple(out)


@cached("spec matching", maxsize=256)
def _match_cached(spec: PyTreeSpec, value: PyTreeSpec) -> tuple[int, ...]:
    return _match_uncached(spec, value)


def _match(spec: PyTreeSpec, value: PyTreeSpec) -> tuple[int, ...]:
    """For each leaf of ``value``, the index of the spec leaf that covers it."""
    try:
        return _match_cached(spec, value)
    except TypeError:  # unhashable node metadata (e.g. a default_factory): no caching
        return _match_uncached(spec, value)


# --------------------------------------------------------------------------- prefix errors


def _describe_node(td: PyTreeSpec) -> str:
    kind, cls = td.kind, td.type
    name = cls.__name__ if cls is not None else ""
    if kind == PyTreeKind.NONE:
        return "None"
    if kind in _SEQUENCES and kind != PyTreeKind.NAMEDTUPLE:
        return f"{article(name)} of length {td.num_children}"
    keys = _keys(td)
    if keys is not None:
        if (
            kind == PyTreeKind.NAMEDTUPLE
            or dataclasses.is_dataclass(cls)
            and not issubclass(cls, Mapping)
        ):
            what = "namedtuple" if kind == PyTreeKind.NAMEDTUPLE else "dataclass"
            return f"{article(name)} ({what}) with fields {list(keys)}"
        return f"{article(name)} with keys {list(keys)}"
    return f"{article(name)} with {td.num_children} children"


def _prefix_error(
    spec: PyTreeSpec,
    value: PyTreeSpec,
    leaves: list[Any] | None,
    path: list[tuple[int, int]],
    name: str,
    fn_name: str | None,
) -> ValueError:
    entries = []
    offset = 0
    for si, vi in path:
        entries.append(_node(spec).accessors()[si][0])
        offset += sum(child.num_leaves for child in value.children()[:vi])
        spec, value = spec.child(si), value.child(vi)
    where = f"{fn_name} " if fn_name else ""
    if value.kind == PyTreeKind.LEAF:
        got = describe(leaves[offset]) if leaves is not None else "a leaf"
    else:
        got = _describe_node(value)
    message = (
        f"{where}{keystr(entries, name)}: the spec is {_describe_node(spec)} but the value is {got}"
    )
    skeys, vkeys = _keys(spec), (_keys(value) if value.kind not in _LEAVES else None)
    comparable = spec.kind in _DICTS or spec.type is value.type
    if comparable and skeys is not None and vkeys is not None and set(skeys) != set(vkeys):
        missing = [k for k in vkeys if k not in set(skeys)]
        extra = [k for k in skeys if k not in set(vkeys)]
        details = []
        if missing:
            details.append(f"missing from the spec: {missing}")
        if extra:
            details.append(f"not in the value: {extra}")
        message += f" ({'; '.join(details)})"
    elif value.kind in _LEAVES:
        message += (
            f"; {name} must be a prefix of the value's tree: put one spec over this whole value "
            "instead of a container"
        )
    return ValueError(message)


# --------------------------------------------------------------------------- broadcasting


def broadcast_prefix_flat(
    prefix: Any,
    treedef: PyTreeSpec,
    leaves: list[Any] | None = None,
    *,
    name: str = "in_specs",
    fn_name: str | None = None,
) -> list[Any]:
    """The leaf of the prefix tree ``prefix`` that covers each leaf of ``treedef``.

    Args:
        prefix: a prefix tree of ``treedef`` (``None`` is a leaf).
        treedef: the structure of the value, from :func:`pshard._core.tree.tree_flatten`.
        leaves: the value's leaves, only to describe them in errors.
        name: the argument's name, for errors (``in_specs``, ``out_specs``, ``pad_values``).
        fn_name: the function's name, for errors (``shard_map_seq``).

    Raises:
        ValueError: ``prefix`` is not a prefix of the value, naming the key path.

    ``torch.distributed.tensor`` placements among the leaves of ``prefix`` are converted to
    pshard's (:func:`pshard.from_torch_placement`).

    Example:
        >>> from pshard._core.specs import broadcast_prefix_flat
        >>> from pshard._core.tree import tree_flatten
        >>> leaves, treedef = tree_flatten({"ids": 1, "pair": (2, 3)})
        >>> broadcast_prefix_flat({"ids": "a", "pair": None}, treedef)
        ['a', None, None]
    """
    spec_leaves, spec_td = tree_flatten(prefix, none_is_leaf=True)
    if any(is_torch_placement(leaf) for leaf in spec_leaves):  # DTensor's: converted
        spec_leaves = [
            from_torch_placement(leaf) if is_torch_placement(leaf) else leaf for leaf in spec_leaves
        ]
    if spec_td.kind == PyTreeKind.LEAF:
        return spec_leaves * treedef.num_leaves
    try:
        index = _match(spec_td, treedef)
    except _Mismatch as e:
        raise _prefix_error(spec_td, treedef, leaves, e.path, name, fn_name) from None
    if not index:
        return []
    if len(index) == 1:
        return [spec_leaves[index[0]]]
    return list(operator.itemgetter(*index)(spec_leaves))


def default_spec(leaf: Any) -> Placement:
    """``pmap_microbatch``'s default spec of a leaf: ``Shard(0)`` for a tensor with a dim and
    for a flex-attention ``BlockMask`` (split on its batch dim), ``Replicate()`` otherwise."""
    if isinstance(leaf, torch.Tensor):
        return _SHARD0 if leaf.dim() >= 1 else _REPLICATE
    return _SHARD0 if is_block_mask(leaf) else _REPLICATE


def rebuild_spec_tree(treedef: PyTreeSpec, specs: Iterator[Any], *, keyed_as_dict: bool) -> Any:
    """A spec tree with the structure ``treedef`` and the leaves of the iterator ``specs``.

    Containers are rebuilt as their own types, except keyed nodes pshard registers (Mappings,
    dataclasses): as plain dicts of their keys with ``keyed_as_dict``, else only when their
    own constructor refuses placements in place of their values (a ``__post_init__`` that
    reads a tensor's shape). Either way the result matches the value as a spec-tree prefix."""
    kind = treedef.kind
    if kind == PyTreeKind.LEAF:
        return next(specs)
    children = [
        rebuild_spec_tree(c, specs, keyed_as_dict=keyed_as_dict) for c in treedef.children()
    ]
    keys = _keys(treedef) if kind == PyTreeKind.CUSTOM else None
    if keys is not None and keyed_as_dict:
        return dict(zip(keys, children, strict=True))
    try:
        return _node(treedef).unflatten(children)
    except Exception:  # a constructor choked on a placement
        return dict(zip(keys, children, strict=True)) if keys is not None else tuple(children)


_SHARD0 = Shard(0)
_REPLICATE = Replicate()


def is_torch_placement(x: Any) -> bool:
    """A ``torch.distributed.tensor`` placement (``Shard(0)`` from DTensor)."""
    module = type(x).__module__
    return module.startswith("torch.distributed.tensor") and hasattr(x, "is_shard")


def broadcast_prefix(
    prefix: Any,
    tree: Any,
    *,
    name: str = "in_specs",
    fn_name: str | None = None,
) -> list[Any]:
    """The leaf of the prefix tree ``prefix`` that covers each leaf of ``tree``, in flatten order.

    Example:
        >>> import torch
        >>> import pshard as ps
        >>> from pshard._core.specs import broadcast_prefix
        >>> batch = {"ids": torch.zeros(4, 8), "extra": {"a": torch.zeros(4), "b": 1}}
        >>> broadcast_prefix({"ids": ps.Shard(1), "extra": None}, batch)
        [None, None, Shard(1)]
        >>> broadcast_prefix({"ids": ps.Shard(1)}, batch, name="in_specs[0]")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: in_specs[0]: the spec is a dict with keys ['ids'] but the value is a dict ...
    """
    leaves, treedef = tree_flatten(tree)
    return broadcast_prefix_flat(prefix, treedef, leaves, name=name, fn_name=fn_name)


# --------------------------------------------------------------------------- per-leaf checks


def is_split(spec: Placement | P) -> bool:
    """Whether a resolved spec splits its value (a ``Shard``, ``StridedShard``, or a ``P`` that
    names a mesh axis)."""
    if isinstance(spec, P):
        return bool(spec.axes)
    return isinstance(spec, (Shard, StridedShard))


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _with_dim(spec: Shard | StridedShard, dim: int) -> Shard | StridedShard:
    return dataclasses.replace(spec, dim=dim)


def _fits(leaf: Any, spec: Placement | P) -> bool:
    """The common case of :func:`_leaf_error`, fast: a tensor with the dims the spec names."""
    if isinstance(leaf, (torch.Tensor, GlobalTensor)):
        ndim = leaf.ndim
        if isinstance(spec, P):
            return len(spec) <= ndim
        return isinstance(spec, (Shard, StridedShard)) and -ndim <= spec.dim < ndim
    return isinstance(spec, P) and not spec.axes  # a P that splits nothing fits any leaf


def _leaf_error(leaf: Any, spec: Placement | P) -> str | None:
    """Why ``spec`` cannot split ``leaf`` (None if it can)."""
    if isinstance(leaf, (torch.Tensor, GlobalTensor)):
        ndim, shape = leaf.ndim, tuple(leaf.shape)
        has = f"the tensor has {_plural(ndim, 'dim')} (shape {shape})"
        if isinstance(spec, P):
            if len(spec) > ndim:
                return (
                    f"{spec!r} has {len(spec)} {'entry' if len(spec) == 1 else 'entries'} but "
                    f"{has}; give at most one entry per tensor dim"
                )
            return None
        if not isinstance(spec, (Shard, StridedShard)):
            return None  # splits nothing
        if ndim == 0:
            return (
                f"{spec!r} but {has}; a 0-dim tensor cannot be split: give it Replicate() or None"
            )
        if not -ndim <= spec.dim < ndim:
            fix = _with_dim(spec, ndim - 1 if spec.dim >= 0 else -ndim)
            return f"{spec!r} but {has}; did you mean {fix!r}?"
        return None
    if is_block_mask(leaf):
        if isinstance(spec, P):
            ok = len(spec) <= 4 and all(entry is None for entry in list(spec)[1:])
        else:
            ok = type(spec) is Shard and spec.dim in (0, -4)
        if not ok:
            use = "P(axis)" if isinstance(spec, P) else "Shard(0)"
            return (
                f"{spec!r} but the value is {describe(leaf)}, which can only be split along "
                f"its batch dim 0; use {use}"
            )
        return None
    if is_opaque(leaf):
        cls = type(leaf).__name__
        return (
            f"{spec!r} but the value is {describe(leaf)}, which pshard cannot look into (it may "
            f"hold tensors); make {cls} a dataclass or Mapping, register it with "
            f'optree.register_pytree_node({cls}, flatten, unflatten, namespace="pshard"), '
            "or give it Replicate() or None"
        )
    return (
        f"{spec!r} but the value is {describe(leaf)}, not a tensor; only tensors can be split: "
        "give it Replicate() or None"
    )


def _allowed_text(allowed: tuple[type, ...]) -> str:
    names = []
    for cls in allowed:
        if cls is Placement:
            names.append("a placement (Shard, StridedShard, Replicate, Partial)")
        elif cls is P:
            names.append("a P(...)")
        else:
            names.append(f"a {cls.__name__}")
    return ", ".join(names) + " or None"


def check_specs(
    leaves: list[Any],
    specs: list[Any],
    treedef: PyTreeSpec,
    *,
    name: str = "in_specs",
    fn_name: str | None = None,
    allowed: tuple[type, ...] = (Placement, P),
) -> list[Placement | P]:
    """Check the spec of every leaf (already broadcast) and turn ``None`` into ``Replicate()``.

    Raises:
        TypeError: a spec is not an instance of ``allowed`` (nor ``None``).
        ValueError: a splitting spec lands on a tensor without that dim, on a scalar, or on an
            object pshard cannot look into; the message names the key path, e.g.
            ``shard_map_seq in_specs[1]['labels']: Shard(2) but the tensor has 2 dims
            (shape (4, 1000)); did you mean Shard(1)?``.
    """
    where = f"{fn_name} " if fn_name else ""
    replicate = Replicate()
    out: list[Placement | P] = [replicate if spec is None else spec for spec in specs]
    if len(out) != len(leaves):
        raise ValueError(f"check_specs: {len(leaves)} leaves but {len(out)} specs")
    # id(spec) -> whether leaves under it need a look (splits, or a P to check against ndim)
    splits: dict[int, bool] = {}
    for i, spec in enumerate(out):
        split = splits.get(id(spec))
        if split is None:
            if spec is not replicate and not isinstance(spec, allowed):
                raise TypeError(
                    f"{where}{keystr(leaf_path(treedef, i), name)}: expected "
                    f"{_allowed_text(allowed)} as the spec, got {describe(spec)}"
                )
            split = splits[id(spec)] = is_split(spec) or isinstance(spec, P) and len(spec) > 0
        if split and not _fits(leaves[i], spec):
            problem = _leaf_error(leaves[i], spec)
            if problem is not None:
                raise ValueError(f"{where}{keystr(leaf_path(treedef, i), name)}: {problem}")
    return out


def resolve_specs(
    specs: Any,
    leaves: list[Any],
    treedef: PyTreeSpec,
    *,
    name: str = "in_specs",
    fn_name: str | None = None,
    allowed: tuple[type, ...] = (Placement, P),
) -> list[Placement | P]:
    """The checked spec of every leaf of a flattened value, from a prefix spec tree.

    ``None`` leaves become ``Replicate()``; non-tensor leaves under a non-splitting spec pass
    through; see :func:`check_specs` for what is checked.

    Example:
        >>> import torch
        >>> import pshard as ps
        >>> from pshard._core.specs import resolve_specs
        >>> from pshard._core.tree import tree_flatten
        >>> args = (torch.zeros(4, 8), {"labels": torch.zeros(4, 1000), "n": 3})
        >>> leaves, treedef = tree_flatten(args)
        >>> resolve_specs((ps.Shard(1), {"labels": ps.Shard(1), "n": None}), leaves, treedef)
        [Shard(1), Shard(1), Replicate()]
        >>> resolve_specs((None, ps.Shard(2)), leaves, treedef, fn_name="f")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: f in_specs[1]['labels']: Shard(2) but the tensor has 2 dims ... Shard(1)?
    """
    flat = broadcast_prefix_flat(specs, treedef, leaves, name=name, fn_name=fn_name)
    return check_specs(leaves, flat, treedef, name=name, fn_name=fn_name, allowed=allowed)
