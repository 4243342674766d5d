"""Specs carried by types: ``Annotated`` types and dataclass fields, and :func:`specs_of`.

Two sources of specs, both read with ``typing.get_type_hints(..., include_extras=True)`` (so
``from __future__ import annotations`` string annotations are resolved in the defining module):

- dataclass fields: ``x: Annotated[torch.Tensor, ps.Shard(1)]`` (the first placement or ``P``
  among the ``Annotated`` metadata) or ``x: torch.Tensor = dataclasses.field(metadata={"pshard":
  spec})`` (any spec tree). :func:`specs_of` turns a value into its spec tree.
- the types of function parameters and returns (read by :mod:`pshard._core.annotations`):
  ``def step(params, batch: Batch, mask: Annotated[torch.Tensor, ps.Shard(0)]) ->
  Annotated[torch.Tensor, ps.Partial("mean")]``.

A type carries a spec when it is ``Annotated[T, spec, ...]``; ``Optional[X]`` / ``X | None``
carries the spec of ``X``; a fixed-length ``tuple[X1, X2]`` whose members carry specs is the tuple
of their specs (``Replicate()`` for a member without one); ``list[X]``, ``tuple[X, ...]``,
``dict[K, X]`` (any ``Sequence``/``Mapping``) carry ``X``'s spec when it is one placement; in a
return annotation a dataclass type carries the spec tree of its fields.

Internal interface (used by :mod:`pshard._core.annotations`):

- ``NO_SPEC``: the marker of a type or field that carries no spec.
- ``AnnotationError``: an annotation that cannot be read (callers prefix the transform's name).
- ``resolve_annotation(annotation, globalns, localns)``: string references evaluated.
- ``spec_of_type(tp, owner, *, dataclass_types=False)``: the spec tree ``tp`` carries, or
  ``NO_SPEC``.
- ``is_dataclass_value(x)``, ``dataclass_specs(x, fresh) -> (spec tree, annotated)``: the spec
  tree of a dataclass value and whether any field below carries a spec.
- ``failure_text(error)``: ``"NameError: ..."``, for messages.

Caching: a dataclass type's field specs are read once per class and kept in the cache
``"annotations of dataclasses"`` (:class:`pshard._core.caches.WeakCache`: keyed weakly by the
class, so nothing is kept alive by having been read). Per value, what remains is a look-up and
one pass over its fields.
"""

# No ``from __future__ import annotations`` here: doctests compile with this module's future
# flags, and the classes in the examples must carry annotation objects, not strings.
import dataclasses
import re
import sys
import types
import typing
from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import Annotated, Any

import torch

from .caches import WeakCache
from .placements import P, Placement, Replicate, from_torch_placement
from .specs import is_torch_placement, rebuild_spec_tree
from .tree import describe, tree_flatten, tree_leaves

__all__ = [
    "NO_SPEC",
    "AnnotationError",
    "dataclass_specs",
    "failure_text",
    "is_dataclass_value",
    "resolve_annotation",
    "spec_of_type",
    "specs_of",
]

_REPLICATE = Replicate()
NO_SPEC: Any = type("_NoSpec", (), {"__repr__": lambda self: "<no spec>"})()
_SPEC_TYPES = (Placement, P)
# Values that can hold no dataclass: their spec is Replicate() without a walk.
_PLAIN = (torch.Tensor, bool, int, float, complex, str, bytes, type(None), Placement, P)
_UNION_TYPES: tuple[Any, ...] = (typing.Union, types.UnionType)


class AnnotationError(TypeError):
    """An annotation cannot be read (raised with the transform's name prefixed by callers)."""


# --------------------------------------------------------------------------- types -> specs


_SPEC_TEXT = re.compile(r"\s*(ps\.)?(Shard|Replicate|Partial|StridedShard|P)\(")


def resolve_annotation(annotation: Any, globalns: dict, localns: dict | None) -> Any:
    """``annotation`` with string (forward) references evaluated, ``Annotated`` kept."""
    holder = types.SimpleNamespace(__annotations__={"x": annotation})
    return typing.get_type_hints(holder, globalns=globalns, localns=localns, include_extras=True)[
        "x"
    ]


def failure_text(error: Exception) -> str:
    return f"{type(error).__name__}: {error}"


def spec_of_type(tp: Any, owner: str, *, dataclass_types: bool = False) -> Any:
    """The spec tree ``tp`` carries (see the module docstring), or ``NO_SPEC``."""
    origin = typing.get_origin(tp)
    if origin is Annotated:
        found = []
        for item in tp.__metadata__:
            if is_torch_placement(item):
                item = from_torch_placement(item)
            if isinstance(item, _SPEC_TYPES):
                found.append(item)
            elif isinstance(item, str) and _SPEC_TEXT.match(item):
                raise AnnotationError(
                    f"{owner}: {tp} carries the string {item!r}, not a spec; write the spec "
                    f"itself, Annotated[..., ps.{item}]"
                )
        if len(found) > 1:
            raise AnnotationError(
                f"{owner}: {tp} carries {len(found)} specs ({', '.join(map(repr, found))}); give "
                f"it one"
            )
        if found:
            return found[0]
        return spec_of_type(tp.__origin__, owner, dataclass_types=dataclass_types)
    args = typing.get_args(tp)
    if origin in _UNION_TYPES:
        found = [
            s
            for s in (
                spec_of_type(a, owner, dataclass_types=dataclass_types)
                for a in args
                if a is not type(None)
            )
            if s is not NO_SPEC
        ]
        if any(s != found[0] for s in found[1:]):
            raise AnnotationError(
                f"{owner}: the members of {tp} carry different specs "
                f"({', '.join(map(repr, found))}); give the whole annotation one spec, "
                f"Annotated[..., spec]"
            )
        return found[0] if found else NO_SPEC
    if origin is tuple and args and not (len(args) == 2 and args[1] is Ellipsis):
        specs = [spec_of_type(a, owner, dataclass_types=dataclass_types) for a in args]
        if all(s is NO_SPEC for s in specs):
            return NO_SPEC
        return tuple(_REPLICATE if s is NO_SPEC else s for s in specs)
    if isinstance(origin, type) and args and issubclass(origin, (Sequence, Mapping, AbstractSet)):
        element = args[-1] if issubclass(origin, Mapping) else args[0]
        spec = spec_of_type(element, owner, dataclass_types=dataclass_types)
        if spec is NO_SPEC or isinstance(spec, _SPEC_TYPES):
            return spec
        raise AnnotationError(
            f"{owner}: the elements of {tp} carry the spec tree {spec!r}, but a container of "
            f"any length takes one placement for all its elements; annotate the container "
            f"itself (Annotated[{origin.__name__}[...], spec]) or give the spec explicitly"
        )
    if dataclass_types and _is_dataclass_type(tp):
        return _class_info(tp).type_spec()
    return NO_SPEC


def _is_dataclass_type(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp) and not issubclass(tp, Placement)


def is_dataclass_value(x: Any) -> bool:
    return hasattr(type(x), "__dataclass_fields__") and not isinstance(x, Placement)


def _check_spec_tree(spec: Any, owner: str) -> None:
    for leaf in tree_leaves(spec, none_is_leaf=True):
        if leaf is not None and not isinstance(leaf, _SPEC_TYPES):
            raise AnnotationError(
                f"{owner}: dataclasses.field(metadata={{'pshard': ...}}) must hold a spec tree "
                f"of placements, P(...) or None, got {describe(leaf)} in {spec!r}"
            )


# --------------------------------------------------------------------------- dataclasses


class _ClassInfo:
    """The field specs of one dataclass type, read once."""

    __slots__ = (
        "cls",
        "names",
        "specs",
        "open",
        "hints",
        "annotated",
        "mapping",
        "_static",
        "_type",
    )

    def __init__(self, cls: type) -> None:
        self.cls = cls
        self.mapping = issubclass(cls, Mapping)
        fields = [f for f in dataclasses.fields(cls) if f.init or self.mapping]
        self.names = tuple(f.name for f in fields)
        self.hints = _class_hints(cls, fields)
        specs = []
        for f in fields:
            owner = f"{cls.__qualname__}.{f.name}"
            typed = spec_of_type(self.hints[f.name], owner) if f.name in self.hints else NO_SPEC
            if "pshard" in f.metadata:
                spec = f.metadata["pshard"]
                _check_spec_tree(spec, owner)
                if typed is not NO_SPEC and typed != spec:
                    raise AnnotationError(
                        f"{owner} has two specs: {typed!r} in its type and {spec!r} in "
                        f"dataclasses.field(metadata={{'pshard': ...}}); keep one"
                    )
                typed = spec
            specs.append(typed)
        self.specs = tuple(specs)
        self.open = tuple(n for n, s in zip(self.names, specs, strict=True) if s is NO_SPEC)
        self.annotated = any(s is not NO_SPEC for s in specs)
        self._static: Any = None
        self._type: Any = None

    def build(self, specs: dict[str, Any]) -> Any:
        """The spec tree from one spec per field: an instance of the class when its
        ``__init__`` takes the specs and keeps them, else a dict keyed by field name."""
        if not self.mapping:
            try:
                obj = self.cls(**specs)
                if all(getattr(obj, k) is v for k, v in specs.items()):
                    return obj
            except Exception:  # noqa: BLE001 - validators that reject placements: use a dict
                pass
        return specs

    def static(self) -> Any:
        """The spec tree of an instance whose fields without a spec hold no dataclass."""
        if self._static is None:
            self._static = self.build(
                {
                    n: _REPLICATE if s is NO_SPEC else s
                    for n, s in zip(self.names, self.specs, strict=True)
                }
            )
        return self._static

    def type_spec(self) -> Any:
        """The spec tree the type carries (fields typed as dataclasses included), for return
        annotations; ``NO_SPEC`` when no field carries one."""
        if self._type is None:
            specs = {}
            for name, spec in zip(self.names, self.specs, strict=True):
                if spec is NO_SPEC and name in self.hints:
                    owner = f"{self.cls.__qualname__}.{name}"
                    spec = spec_of_type(self.hints[name], owner, dataclass_types=True)
                specs[name] = spec
            if all(s is NO_SPEC for s in specs.values()):
                self._type = NO_SPEC
            else:
                self._type = self.build(
                    {n: _REPLICATE if s is NO_SPEC else s for n, s in specs.items()}
                )
        return self._type


def _class_hints(cls: type, fields: list[dataclasses.Field]) -> dict[str, Any]:
    """The resolved annotations of ``cls``'s fields (fields given a spec by metadata need not
    resolve)."""
    try:
        return typing.get_type_hints(cls, include_extras=True)
    except Exception:  # noqa: BLE001 - find the field that fails, below
        pass
    owners: dict[str, type] = {}
    for base in reversed(cls.__mro__):
        for name in base.__dict__.get("__annotations__", {}):
            owners[name] = base
    hints = {}
    for f in fields:
        if "pshard" in f.metadata:
            continue
        base = owners.get(f.name, cls)
        module = sys.modules.get(base.__module__)
        try:
            hints[f.name] = resolve_annotation(
                f.type, dict(vars(module)) if module else {}, dict(vars(base))
            )
        except Exception as error:  # noqa: BLE001 - reported with the field's name
            raise AnnotationError(
                f"cannot resolve the annotation of {cls.__qualname__}.{f.name} ({f.type!r}): "
                f"{failure_text(error)}; make the name importable in module {base.__module__} at "
                f"run time (not only under TYPE_CHECKING; a class defined inside a function "
                f"cannot be found from a string annotation), or give the field its spec with "
                f"dataclasses.field(metadata={{'pshard': spec}})"
            ) from None
    return hints


# dataclass type -> _ClassInfo (see the module docstring)
_CLASS_CACHE: "WeakCache[type, _ClassInfo]" = WeakCache("annotations of dataclasses")


def _class_info(cls: type) -> _ClassInfo:
    info = _CLASS_CACHE.get(cls)
    if info is None:
        info = _ClassInfo(cls)
        _CLASS_CACHE.put(cls, info)
    return info


def _value_specs(x: Any, fresh: bool) -> tuple[Any, bool]:
    """``(spec tree of x, whether any field below carries a spec)``."""
    if isinstance(x, _PLAIN):
        return _REPLICATE, False
    if is_dataclass_value(x):
        return dataclass_specs(x, fresh)
    leaves, treedef = tree_flatten(x, is_leaf=is_dataclass_value)
    found = [i for i, leaf in enumerate(leaves) if is_dataclass_value(leaf)]
    if not found:
        return _REPLICATE, False
    specs = [_REPLICATE] * len(leaves)
    annotated = False
    for i in found:
        specs[i], sub = dataclass_specs(leaves[i], fresh)
        annotated = annotated or sub
    return rebuild_spec_tree(treedef, iter(specs), keyed_as_dict=True), annotated


def dataclass_specs(x: Any, fresh: bool) -> tuple[Any, bool]:
    info = _class_info(type(x))
    if info.mapping:
        table = dict(zip(info.names, info.specs, strict=True))
        items = [(k, x[k], table.get(k, NO_SPEC)) for k in x.keys()]  # noqa: SIM118
    else:
        if not fresh and all(isinstance(getattr(x, name), _PLAIN) for name in info.open):
            return info.static(), info.annotated  # the common case: one pass over the fields
        items = [(n, getattr(x, n), s) for n, s in zip(info.names, info.specs, strict=True)]
    annotated = info.annotated
    specs = {}
    for name, value, spec in items:
        if spec is NO_SPEC:
            spec, sub = _value_specs(value, fresh)
            annotated = annotated or sub
        specs[name] = spec
    return (specs if info.mapping else info.build(specs)), annotated


def specs_of(tree: Any) -> Any:
    """The spec tree of ``tree`` from the spec annotations of its dataclasses.

    Each dataclass field gets the first placement or ``P`` among the metadata of its
    ``Annotated`` type, or the spec tree in ``dataclasses.field(metadata={"pshard": spec})``;
    a field without one gets :func:`specs_of` of its value (so dataclasses nested in fields, and
    in lists, tuples and dicts there, get their own specs), which is ``Replicate()`` for a value
    with no dataclass inside. String annotations (``from __future__ import annotations``) are
    resolved in the module that defines the class.

    The result is a prefix tree of ``tree`` (the spec matcher pairs it with the value by field
    name): a dataclass's specs are an instance of the class holding a spec per field, or a dict
    keyed by field name when the class cannot hold placements (a ``__post_init__`` that checks
    its fields, ``init=False`` fields computed from them, a dataclass that is a ``Mapping``).
    Containers holding dataclasses keep their structure; a value with no dataclass inside is
    ``Replicate()``.

    Args:
        tree: any value: a dataclass, a pytree of them, or anything else.

    Returns:
        The spec tree.

    Raises:
        TypeError: an annotation that cannot be resolved (naming the class and field), a field
            with two different specs, or ``metadata={"pshard": ...}`` that is not a spec tree.

    Example:
        >>> import dataclasses
        >>> from typing import Annotated
        >>> import torch
        >>> import pshard as ps
        >>> @dataclasses.dataclass
        ... class Batch:
        ...     input_ids: Annotated[torch.Tensor, ps.Shard(1)]
        ...     labels: torch.Tensor = dataclasses.field(metadata={"pshard": ps.Shard(1)})
        ...     num_tokens: int = 0
        >>> batch = Batch(torch.zeros(2, 8), torch.zeros(2, 8), 16)
        >>> ps.specs_of(batch)
        Batch(input_ids=Shard(1), labels=Shard(1), num_tokens=Replicate())
        >>> ps.specs_of({"lr": 0.1, "batches": [batch]})  # doctest: +NORMALIZE_WHITESPACE
        {'lr': Replicate(),
         'batches': [Batch(input_ids=Shard(1), labels=Shard(1), num_tokens=Replicate())]}
    """
    try:
        return _value_specs(tree, True)[0]
    except AnnotationError as error:
        raise TypeError(f"specs_of: {error}") from None
