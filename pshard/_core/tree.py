"""pshard's pytrees: optree in the ``"pshard"`` namespace, with Mappings and dataclasses as nodes.

Every pytree walk in pshard goes through the functions here (or through optree with
``namespace=NAMESPACE`` on a tree that one of them has flattened before).

What is a node:

- everything optree knows: tuples, lists, dicts (leaves in sorted key order), ``OrderedDict`` and
  ``defaultdict``, namedtuples (by field), ``deque``, ``None`` (an empty node by default);
- any ``collections.abc.Mapping`` (HF ``BatchEncoding`` and ``ModelOutput``, ``UserDict``, your
  own): flattened like a dict (sorted keys; an ``OrderedDict`` subclass keeps its insertion
  order, as optree does for ``OrderedDict``) and rebuilt as its own type with its keys in their
  original order. How a type is rebuilt is chosen once, on the first instance seen, by trying in
  turn ``cls(**items)`` (dataclass mappings such as ``ModelOutput``), ``cls(factory, items)``
  (``defaultdict`` subclasses), ``cls(items)``, ``cls(**items)`` and, for ``dict`` subclasses,
  filling an instance made without ``__init__``; the first that gives back the same type with
  the same items wins. A Mapping that is also a dataclass (``ModelOutput``) is a Mapping: its
  children are the keys it holds (``ModelOutput`` omits fields that are ``None``).
- any dataclass (not only registered ones): children are its ``init=True`` fields, in
  declaration order; it is rebuilt with ``cls(**fields)``, so fields with ``init=False`` are not
  children and are recomputed by ``__init__``/``__post_init__`` (a derived ``batch_size`` is
  right for each microbatch). Placements (``Shard(0)``, ...) are dataclasses but stay leaves.

Types are registered in the ``"pshard"`` namespace lazily, once per type, the first time one of
them is flattened here; optree's registry is the only state. To flatten a type your own way,
register it with ``optree.register_pytree_node(cls, ..., namespace="pshard")`` before pshard sees
it.

A flex-attention ``BlockMask`` is a leaf (:func:`is_block_mask`): code that splits values knows
how to cut one along its batch dim (its block tensors, and ``mask_mod`` re-indexed by the batch
offset), which a generic node could not express.

A :class:`~pshard.GlobalTensor` is a leaf of every walk here (whatever ``is_leaf`` says besides):
it is registered as a node with optree and torch so that ``torch.func`` and user code see its
block, but pshard's transforms must see the whole ``GlobalTensor`` (its layout) at its place.

Internal interface (used by the transforms):

- ``NAMESPACE``: ``"pshard"``.
- ``tree_flatten(tree, *, is_leaf=None, none_is_leaf=False) -> (leaves, treedef)``.
- ``tree_flatten_with_path(tree, ...) -> (paths, leaves, treedef)``: paths are optree
  ``PyTreeAccessor`` objects (``keystr`` turns one into ``in_specs[1]['labels']``).
- ``tree_leaves(tree, ...)``, ``tree_unflatten(treedef, leaves)``,
  ``tree_map(fn, tree, *rest, ...)``.
- ``leaf_path(treedef, index) -> PyTreeAccessor``: the path of one leaf (O(leaves); for errors).
- ``keystr(path, prefix="")``: a path in the user's terms: ``prefix[1]['labels'].field``.
- ``is_block_mask(x)``: whether ``x`` is a flex-attention ``BlockMask``.
- ``describe(x)``: a short description of a value for error messages
  (``"a tensor of shape (4, 1000)"``, ``"an int (5)"``, ``"a Foo"``).
- ``article(word)``: ``"an int"``, ``"a UserDict"`` (for messages).
- ``is_opaque(x)``: a leaf pshard cannot look into (not a tensor, BlockMask, scalar or string).
"""

from __future__ import annotations

import dataclasses
import operator
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import optree
import torch
from optree import PyTreeAccessor, PyTreeEntry, PyTreeSpec
from torch.nn.attention.flex_attention import BlockMask

from .global_tensor import GlobalTensor, is_global
from .placements import P, Placement

__all__ = [
    "NAMESPACE",
    "article",
    "describe",
    "is_block_mask",
    "is_opaque",
    "keystr",
    "leaf_path",
    "tree_flatten",
    "tree_flatten_with_path",
    "tree_leaves",
    "tree_map",
    "tree_unflatten",
]

NAMESPACE = "pshard"

# Leaves that are plain values, never containers.
_SCALAR_TYPES = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device)


def is_block_mask(x: Any) -> bool:
    """Whether ``x`` is a flex-attention ``BlockMask`` (a leaf split along its batch dim)."""
    return isinstance(x, BlockMask)


def is_opaque(x: Any) -> bool:
    """Whether ``x`` is a leaf pshard cannot look into: not a tensor, ``BlockMask``, Python
    scalar, string, ``None``, placement or ``P``. Such a leaf may hold tensors, so it must never
    be split by treating it as replicated."""
    return not isinstance(x, (torch.Tensor, *_SCALAR_TYPES, Placement, P)) and not is_block_mask(x)


# --------------------------------------------------------------------------- registration


def _wants_registration(cls: type) -> bool:
    if issubclass(cls, (torch.Tensor, Placement, BlockMask)):
        return False
    if not (issubclass(cls, Mapping) or dataclasses.is_dataclass(cls)):
        return False
    return optree.register_pytree_node.get(cls, namespace=NAMESPACE) is None


def _register(cls: type, example: Any) -> None:
    if issubclass(cls, Mapping):
        flatten, unflatten, entry = _mapping_node(cls, example)
    else:
        flatten, unflatten, entry = _dataclass_node(cls)
    try:
        optree.register_pytree_node(
            cls, flatten, unflatten, path_entry_type=entry, namespace=NAMESPACE
        )
    except ValueError:
        # Registered meanwhile (another thread, or the user): theirs stands.
        if optree.register_pytree_node.get(cls, namespace=NAMESPACE) is None:  # pragma: no cover
            raise


def _register_leaf_types(leaves: list[Any]) -> bool:
    """Register every unregistered Mapping / dataclass type among ``leaves``; True if any was."""
    new = [cls for cls in set(map(type, leaves)) if _wants_registration(cls)]
    if not new:
        return False
    examples: dict[type, Any] = {}
    for leaf in leaves:
        examples.setdefault(type(leaf), leaf)
    for cls in new:
        _register(cls, examples[cls])
    return True


def _dataclass_node(cls: type) -> tuple[Callable, Callable, type[PyTreeEntry]]:
    names = tuple(f.name for f in dataclasses.fields(cls) if f.init)
    getter: Callable[[Any], tuple]
    if len(names) == 0:
        getter = lambda obj: ()  # noqa: E731
    elif len(names) == 1:
        one = operator.attrgetter(names[0])
        getter = lambda obj: (one(obj),)  # noqa: E731
    else:
        getter = operator.attrgetter(*names)

    def flatten(obj: Any) -> tuple[tuple, None, tuple[str, ...]]:
        return getter(obj), None, names

    def unflatten(_: None, children: Iterable[Any]) -> Any:
        return cls(**dict(zip(names, children, strict=True)))

    return flatten, unflatten, optree.DataclassEntry


def _mapping_builders(cls: type) -> list[Callable[[dict, Any], Any]]:
    builders: list[Callable[[dict, Any], Any]] = []
    if dataclasses.is_dataclass(cls):
        builders.append(lambda items, _: cls(**items))
    if issubclass(cls, defaultdict):
        builders.append(lambda items, factory: cls(factory, items))
    builders.append(lambda items, _: cls(items))
    builders.append(lambda items, _: cls(**items))
    if issubclass(cls, dict):

        def fill(items: dict, _: Any) -> Any:
            obj = cls.__new__(cls)
            dict.update(obj, items)
            return obj

        builders.append(fill)
    return builders


def _choose_builder(cls: type, example: Any) -> Callable[[dict, Any], Any] | None:
    items: dict[Any, Any] = dict(example.items())
    factory = getattr(example, "default_factory", None)
    for build in _mapping_builders(cls):
        try:
            rebuilt: Any = build(dict(items), factory)
            same_type = type(rebuilt) is cls
            if (
                same_type
                and list(rebuilt.keys()) == list(items)
                and all(rebuilt[k] is v for k, v in items.items())
            ):
                return build
        except Exception:  # noqa: BLE001 - any failure just rules this way out
            continue
    return None


def _mapping_node(cls: type, example: Any) -> tuple[Callable, Callable, type[PyTreeEntry]]:
    keep_order = issubclass(cls, OrderedDict)
    has_factory = issubclass(cls, defaultdict)
    build = _choose_builder(cls, example)

    def flatten(obj: Any) -> tuple[tuple, tuple, tuple]:
        original = tuple(obj.keys())
        keys = original if keep_order else tuple(optree.utils.total_order_sorted(original))
        values = tuple(obj[k] for k in keys)
        factory = obj.default_factory if has_factory else None
        # metadata: keys in leaf order, the original order when it differs, the default factory
        return values, (keys, None if keys == original else original, factory), keys

    def unflatten(metadata: tuple, children: Iterable[Any]) -> Any:
        keys, original, factory = metadata
        items = dict(zip(keys, children, strict=True))
        if original is not None:
            items = {k: items[k] for k in original}
        if build is None:
            raise TypeError(
                f"pshard cannot rebuild a {cls.__name__} from its items (none of "
                f"{cls.__name__}(items), {cls.__name__}(**items) gave one back); register "
                f"it with optree.register_pytree_node({cls.__name__}, flatten, unflatten, "
                f'namespace="pshard") before pshard sees it'
            )
        return build(items, factory)

    return flatten, unflatten, optree.MappingEntry


# --------------------------------------------------------------------------- flatten API


def _leaf_test(is_leaf: Callable[[Any], bool] | None) -> Callable[[Any], bool]:
    """``is_leaf`` with :class:`~pshard.GlobalTensor` s as leaves too."""
    if is_leaf is None:
        return is_global
    return lambda x: is_global(x) or bool(is_leaf(x))


def tree_flatten(
    tree: Any,
    *,
    is_leaf: Callable[[Any], bool] | None = None,
    none_is_leaf: bool = False,
) -> tuple[list[Any], PyTreeSpec]:
    """Flatten ``tree`` into its leaves and structure in the ``"pshard"`` namespace.

    Mappings and dataclasses of types not seen before are registered on the way.

    Example:
        >>> from pshard._core.tree import tree_flatten, tree_unflatten
        >>> leaves, treedef = tree_flatten({"b": 1, "a": (2, None)})
        >>> leaves
        [2, 1]
        >>> tree_unflatten(treedef, [20, 10])
        {'b': 10, 'a': (20, None)}
    """
    while True:
        leaves, treedef = optree.tree_flatten(
            tree, _leaf_test(is_leaf), none_is_leaf=none_is_leaf, namespace=NAMESPACE
        )
        if not _register_leaf_types(leaves):
            return leaves, treedef


def tree_flatten_with_path(
    tree: Any,
    *,
    is_leaf: Callable[[Any], bool] | None = None,
    none_is_leaf: bool = False,
) -> tuple[list[PyTreeAccessor], list[Any], PyTreeSpec]:
    """Like :func:`tree_flatten`, with each leaf's path (an optree ``PyTreeAccessor``).

    Example:
        >>> from pshard._core.tree import keystr, tree_flatten_with_path
        >>> paths, leaves, _ = tree_flatten_with_path((1, {"labels": 2}))
        >>> [keystr(p, "in_specs") for p in paths]
        ['in_specs[0]', "in_specs[1]['labels']"]
    """
    while True:
        paths, leaves, treedef = optree.tree_flatten_with_accessor(
            tree, _leaf_test(is_leaf), none_is_leaf=none_is_leaf, namespace=NAMESPACE
        )
        if not _register_leaf_types(leaves):
            return paths, leaves, treedef


def tree_leaves(
    tree: Any,
    *,
    is_leaf: Callable[[Any], bool] | None = None,
    none_is_leaf: bool = False,
) -> list[Any]:
    """The leaves of ``tree`` in flatten order."""
    return tree_flatten(tree, is_leaf=is_leaf, none_is_leaf=none_is_leaf)[0]


def tree_unflatten(treedef: PyTreeSpec, leaves: Iterable[Any]) -> Any:
    """Rebuild a tree of ``treedef``'s structure from ``leaves`` (each node its own type)."""
    return treedef.unflatten(leaves)


def tree_map(
    fn: Callable[..., Any],
    tree: Any,
    *rest: Any,
    is_leaf: Callable[[Any], bool] | None = None,
    none_is_leaf: bool = False,
) -> Any:
    """Apply ``fn`` to the leaves of ``tree`` (and the matching leaves or subtrees of ``rest``).

    Example:
        >>> from pshard._core.tree import tree_map
        >>> tree_map(lambda x, y: x + y, {"a": 1, "b": [2]}, {"a": 10, "b": [20]})
        {'a': 11, 'b': [22]}
    """
    leaves, treedef = tree_flatten(tree, is_leaf=is_leaf, none_is_leaf=none_is_leaf)
    others = [treedef.flatten_up_to(r) for r in rest]
    return treedef.unflatten(map(fn, leaves, *others))


def leaf_path(treedef: PyTreeSpec, index: int) -> PyTreeAccessor:
    """The path of leaf ``index`` of ``treedef`` (computes every path: use it for errors)."""
    return treedef.accessors()[index]


def keystr(path: PyTreeAccessor | Sequence[Any], prefix: str = "") -> str:
    """Write a pytree path as Python code on ``prefix``: ``in_specs[1]['labels'].mask``.

    ``path`` is a ``PyTreeAccessor`` (from :func:`tree_flatten_with_path`), a sequence of
    optree ``PyTreeEntry`` objects, or a sequence of plain keys and indices (written ``[k]``).

    Example:
        >>> from pshard._core.tree import keystr
        >>> keystr((1, "labels"), "in_specs")
        "in_specs[1]['labels']"
    """
    if isinstance(path, PyTreeAccessor):
        return path.codify(prefix)
    entries = tuple(path)
    if all(isinstance(e, PyTreeEntry) for e in entries):
        return PyTreeAccessor(entries).codify(prefix)
    return prefix + "".join(
        e.codify("") if isinstance(e, PyTreeEntry) else f"[{e!r}]" for e in entries
    )


def article(word: str) -> str:
    """``word`` with its indefinite article: ``an int``, ``a tensor``, ``a UserDict``."""
    return f"an {word}" if word[:1] in "aeioAEIO" else f"a {word}"


def _short_repr(x: Any, limit: int = 40) -> str:
    text = repr(x)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def describe(x: Any) -> str:
    """A short description of a value for error messages.

    Example:
        >>> import torch
        >>> from pshard._core.tree import describe
        >>> describe(torch.zeros(4, 1000)), describe(5), describe(None)
        ('a tensor of shape (4, 1000)', 'an int (5)', 'None')
    """
    if x is None:
        return "None"
    if isinstance(x, torch.Tensor):
        return f"a tensor of shape {tuple(x.shape)}"
    if isinstance(x, GlobalTensor):
        return f"a GlobalTensor of shape {tuple(x.meta.shape)} ({x.meta.spec!r})"
    if is_block_mask(x):
        return f"a BlockMask of shape {tuple(x.shape)}"
    name = type(x).__name__
    if isinstance(x, (*_SCALAR_TYPES, Placement, P)):
        return f"{article(name)} ({_short_repr(x)})"
    if isinstance(x, Mapping):
        return f"{article(name)} with keys {_short_repr(list(x.keys()), 80)}"
    if isinstance(x, (tuple, list)) and not hasattr(x, "_fields"):
        return f"{article(name)} of length {len(x)}"
    return article(name)
