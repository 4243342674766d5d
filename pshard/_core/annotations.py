"""Spec annotations: specs written on types instead of in ``in_specs`` / ``out_specs``.

Two sources of specs, both read with ``typing.get_type_hints(..., include_extras=True)`` (so
``from __future__ import annotations`` string annotations are resolved in the defining module):

- dataclass fields: ``x: Annotated[torch.Tensor, ps.Shard(1)]`` (the first placement or ``P``
  among the ``Annotated`` metadata) or ``x: torch.Tensor = dataclasses.field(metadata={"pshard":
  spec})`` (any spec tree). :func:`specs_of` turns a value into its spec tree.
- function signatures: ``def step(params, batch: Batch, mask: Annotated[torch.Tensor,
  ps.Shard(0)]) -> Annotated[torch.Tensor, ps.Partial("mean")]``.

A type carries a spec when it is ``Annotated[T, spec, ...]``; ``Optional[X]`` / ``X | None``
carries the spec of ``X``; a fixed-length ``tuple[X1, X2]`` whose members carry specs is the tuple
of their specs (``Replicate()`` for a member without one); ``list[X]``, ``tuple[X, ...]``,
``dict[K, X]`` (any ``Sequence``/``Mapping``) carry ``X``'s spec when it is one placement; in a
return annotation a dataclass type carries the spec tree of its fields.

Internal interface (what every transform calls):

- ``default_in_specs(fn, args, kwargs, *, transform) -> (in_specs, kw_specs) | None``: the spec
  trees of the positional args (a tuple, one entry per argument) and keyword args (a dict) read
  from ``fn``'s parameter annotations and from :func:`specs_of` of dataclass arguments
  (``kw_specs`` is ``None`` for a call without keyword arguments); ``None`` when nothing is
  annotated (the transform then applies its own default). Call it only for the
  specs the caller omitted: explicit specs always win.
- ``default_out_specs(fn, *, transform, required=True) -> spec tree | None``: the spec tree of
  ``fn``'s return annotation; when there is none, ``None`` if not ``required``, else a
  ``TypeError`` naming the transform and the function.
- ``check_out_annotation(fn, *, transform)``: the same error at decoration time, for transforms
  whose ``out_specs`` are required (names not defined yet are left to the first call).

What is read of ``fn``: its signature as :func:`inspect.signature` gives it, so
``functools.partial`` objects lose their bound arguments, bound methods their ``self``, callable
objects are read through ``__call__``, and wrappers made with ``functools.wraps`` (they have
``__wrapped__``: ``torch.func.grad(f)``, ``grad_and_value``, ``torch.compile``, pshard's own
transforms) are read as the function they wrap, for their *parameters*. The *return* annotation is
not read through ``__wrapped__``, because a wrapper may return something else (``grad(f)`` returns
gradients, not ``f``'s value): there ``out_specs`` must be given (``pmap_microbatch`` infers them).
Classes are not read. ``vmap(f)`` is read as ``f``, whose annotations describe unbatched values:
give explicit specs to vmapped functions.

Caching: a function's annotations are read once, at its first call through a transform, and kept
in :data:`_FN_CACHE` (a ``weakref.WeakKeyDictionary`` keyed by the function, so nothing is kept
alive by having been read); a dataclass type's field specs once per class in
:data:`_CLASS_CACHE` likewise. Per call, what remains is a look-up and one pass over the
arguments (dataclass arguments: one pass over their fields). A callable that cannot be weakly
referenced or hashed is read on every call.
"""

# No ``from __future__ import annotations`` here: doctests compile with this module's future
# flags, and the classes in the examples must carry annotation objects, not strings.
import dataclasses
import functools
import inspect
import re
import sys
import types
import typing
import weakref
from collections.abc import Callable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import Annotated, Any

import torch

from .checks import fn_name
from .placements import P, Placement, Replicate, from_torch_placement
from .specs import is_torch_placement, rebuild_spec_tree
from .tree import describe, tree_flatten, tree_leaves

__all__ = ["check_out_annotation", "default_in_specs", "default_out_specs", "specs_of"]

_REPLICATE = Replicate()
_NO_SPEC: Any = type("_NoSpec", (), {"__repr__": lambda self: "<no spec>"})()
_SPEC_TYPES = (Placement, P)
# Values that can hold no dataclass: their spec is Replicate() without a walk.
_PLAIN = (torch.Tensor, bool, int, float, complex, str, bytes, type(None), Placement, P)
_UNION_TYPES: tuple[Any, ...] = (typing.Union, types.UnionType)

# Caches (see the module docstring): function -> _FnInfo, dataclass type -> _ClassInfo.
_FN_CACHE: "weakref.WeakKeyDictionary[Any, _FnInfo]" = weakref.WeakKeyDictionary()
_CLASS_CACHE: "weakref.WeakKeyDictionary[type, _ClassInfo]" = weakref.WeakKeyDictionary()


class AnnotationError(TypeError):
    """An annotation cannot be read (raised with the transform's name prefixed by callers)."""


# --------------------------------------------------------------------------- types -> specs


_SPEC_TEXT = re.compile(r"\s*(ps\.)?(Shard|Replicate|Partial|StridedShard|P)\(")


def _resolve(annotation: Any, globalns: dict, localns: dict | None) -> Any:
    """``annotation`` with string (forward) references evaluated, ``Annotated`` kept."""
    holder = types.SimpleNamespace(__annotations__={"x": annotation})
    return typing.get_type_hints(holder, globalns=globalns, localns=localns, include_extras=True)[
        "x"
    ]


def _failure(error: Exception) -> str:
    return f"{type(error).__name__}: {error}"


def _spec_of_type(tp: Any, owner: str, *, dataclass_types: bool = False) -> Any:
    """The spec tree ``tp`` carries (see the module docstring), or ``_NO_SPEC``."""
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
        return _spec_of_type(tp.__origin__, owner, dataclass_types=dataclass_types)
    args = typing.get_args(tp)
    if origin in _UNION_TYPES:
        found = [
            s
            for s in (
                _spec_of_type(a, owner, dataclass_types=dataclass_types)
                for a in args
                if a is not type(None)
            )
            if s is not _NO_SPEC
        ]
        if any(s != found[0] for s in found[1:]):
            raise AnnotationError(
                f"{owner}: the members of {tp} carry different specs "
                f"({', '.join(map(repr, found))}); give the whole annotation one spec, "
                f"Annotated[..., spec]"
            )
        return found[0] if found else _NO_SPEC
    if origin is tuple and args and not (len(args) == 2 and args[1] is Ellipsis):
        specs = [_spec_of_type(a, owner, dataclass_types=dataclass_types) for a in args]
        if all(s is _NO_SPEC for s in specs):
            return _NO_SPEC
        return tuple(_REPLICATE if s is _NO_SPEC else s for s in specs)
    if isinstance(origin, type) and args and issubclass(origin, (Sequence, Mapping, AbstractSet)):
        element = args[-1] if issubclass(origin, Mapping) else args[0]
        spec = _spec_of_type(element, owner, dataclass_types=dataclass_types)
        if spec is _NO_SPEC or isinstance(spec, _SPEC_TYPES):
            return spec
        raise AnnotationError(
            f"{owner}: the elements of {tp} carry the spec tree {spec!r}, but a container of "
            f"any length takes one placement for all its elements; annotate the container "
            f"itself (Annotated[{origin.__name__}[...], spec]) or give the spec explicitly"
        )
    if dataclass_types and _is_dataclass_type(tp):
        return _class_info(tp).type_spec()
    return _NO_SPEC


def _is_dataclass_type(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp) and not issubclass(tp, Placement)


def _is_dataclass_value(x: Any) -> bool:
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
            typed = _spec_of_type(self.hints[f.name], owner) if f.name in self.hints else _NO_SPEC
            if "pshard" in f.metadata:
                spec = f.metadata["pshard"]
                _check_spec_tree(spec, owner)
                if typed is not _NO_SPEC and typed != spec:
                    raise AnnotationError(
                        f"{owner} has two specs: {typed!r} in its type and {spec!r} in "
                        f"dataclasses.field(metadata={{'pshard': ...}}); keep one"
                    )
                typed = spec
            specs.append(typed)
        self.specs = tuple(specs)
        self.open = tuple(n for n, s in zip(self.names, specs, strict=True) if s is _NO_SPEC)
        self.annotated = any(s is not _NO_SPEC for s in specs)
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
                    n: _REPLICATE if s is _NO_SPEC else s
                    for n, s in zip(self.names, self.specs, strict=True)
                }
            )
        return self._static

    def type_spec(self) -> Any:
        """The spec tree the type carries (fields typed as dataclasses included), for return
        annotations; ``_NO_SPEC`` when no field carries one."""
        if self._type is None:
            specs = {}
            for name, spec in zip(self.names, self.specs, strict=True):
                if spec is _NO_SPEC and name in self.hints:
                    owner = f"{self.cls.__qualname__}.{name}"
                    spec = _spec_of_type(self.hints[name], owner, dataclass_types=True)
                specs[name] = spec
            if all(s is _NO_SPEC for s in specs.values()):
                self._type = _NO_SPEC
            else:
                self._type = self.build(
                    {n: _REPLICATE if s is _NO_SPEC else s for n, s in specs.items()}
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
            hints[f.name] = _resolve(f.type, dict(vars(module)) if module else {}, dict(vars(base)))
        except Exception as error:  # noqa: BLE001 - reported with the field's name
            raise AnnotationError(
                f"cannot resolve the annotation of {cls.__qualname__}.{f.name} ({f.type!r}): "
                f"{_failure(error)}; make the name importable in module {base.__module__} at "
                f"run time (not only under TYPE_CHECKING; a class defined inside a function "
                f"cannot be found from a string annotation), or give the field its spec with "
                f"dataclasses.field(metadata={{'pshard': spec}})"
            ) from None
    return hints


def _class_info(cls: type) -> _ClassInfo:
    info = _CLASS_CACHE.get(cls)
    if info is None:
        info = _CLASS_CACHE[cls] = _ClassInfo(cls)
    return info


def _value_specs(x: Any, fresh: bool) -> tuple[Any, bool]:
    """``(spec tree of x, whether any field below carries a spec)``."""
    if isinstance(x, _PLAIN):
        return _REPLICATE, False
    if _is_dataclass_value(x):
        return _dataclass_specs(x, fresh)
    leaves, treedef = tree_flatten(x, is_leaf=_is_dataclass_value)
    found = [i for i, leaf in enumerate(leaves) if _is_dataclass_value(leaf)]
    if not found:
        return _REPLICATE, False
    specs = [_REPLICATE] * len(leaves)
    annotated = False
    for i in found:
        specs[i], sub = _dataclass_specs(leaves[i], fresh)
        annotated = annotated or sub
    return rebuild_spec_tree(treedef, iter(specs), keyed_as_dict=True), annotated


def _dataclass_specs(x: Any, fresh: bool) -> tuple[Any, bool]:
    info = _class_info(type(x))
    if info.mapping:
        table = dict(zip(info.names, info.specs, strict=True))
        items = [(k, x[k], table.get(k, _NO_SPEC)) for k in x.keys()]  # noqa: SIM118
    else:
        if not fresh and all(isinstance(getattr(x, name), _PLAIN) for name in info.open):
            return info.static(), info.annotated  # the common case: one pass over the fields
        items = [(n, getattr(x, n), s) for n, s in zip(info.names, info.specs, strict=True)]
    annotated = info.annotated
    specs = {}
    for name, value, spec in items:
        if spec is _NO_SPEC:
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


# --------------------------------------------------------------------------- functions


_FIX_OUT = (
    "; pass out_specs=... (a prefix tree of the output) or annotate the return, e.g. "
    "-> Annotated[torch.Tensor, ps.Replicate()]"
)


class _FnInfo:
    """The spec annotations of one function's signature, read once."""

    __slots__ = (
        "name",
        "positional",
        "positional_names",
        "var_positional",
        "keyword",
        "var_keyword",
        "annotated",
        "in_error",
        "out_spec",
        "out_error",
        "out_missing",
    )

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.name = fn_name(fn)
        self.positional: tuple[Any, ...] = ()
        self.positional_names: tuple[str, ...] = ()
        self.var_positional: Any = _NO_SPEC
        self.keyword: dict[str, Any] = {}
        self.var_keyword: Any = _NO_SPEC
        self.annotated = False
        self.in_error: str | None = None
        self.out_spec: Any = _NO_SPEC
        self.out_error: str | None = None  # the return annotation cannot be read
        self.out_missing = f"the return annotation of {self.name} carries no spec{_FIX_OUT}"
        target, wrapped = _target(fn)
        if target is None:
            self.out_missing = f"{self.name} is a class, whose annotations are not read{_FIX_OUT}"
            return
        try:
            signature = inspect.signature(fn)
        except (TypeError, ValueError):  # builtins and the like: nothing to read
            self.out_missing = f"{self.name} has no signature to read{_FIX_OUT}"
            return
        module = getattr(target, "__module__", None)
        globalns = getattr(target, "__globals__", None)
        if globalns is None:
            globalns = dict(vars(sys.modules[module])) if module in sys.modules else {}
        self._read_parameters(signature, globalns, module)
        if wrapped:
            self.out_missing = (
                f"{self.name} is a wrapper (it has __wrapped__: torch.func.grad(f), a "
                "functools.wraps decorator), whose return annotation is not read because a "
                "wrapper may return something else; pass out_specs=..."
            )
        elif signature.return_annotation is inspect.Signature.empty:
            self.out_missing = f"{self.name} has no return annotation{_FIX_OUT}"
        else:
            where = f"the return annotation of {self.name}"
            try:
                tp = _resolve(signature.return_annotation, globalns, None)
                self.out_spec = _spec_of_type(tp, where, dataclass_types=True)
            except AnnotationError as error:
                self.out_error = str(error)
            except Exception as error:  # noqa: BLE001 - reported when out specs are read
                self.out_error = _unresolved(
                    "the return annotation", signature.return_annotation, error, module, "out_specs"
                )

    def _read_parameters(
        self, signature: inspect.Signature, globalns: dict, module: str | None
    ) -> None:
        positional, names = [], []
        for param in signature.parameters.values():
            spec = _NO_SPEC
            if param.annotation is not inspect.Parameter.empty:
                where = f"parameter {param.name!r}"
                try:
                    tp = _resolve(param.annotation, globalns, None)
                    spec = _spec_of_type(tp, where)
                except AnnotationError as error:
                    self.in_error = self.in_error or str(error)
                except Exception as error:  # noqa: BLE001 - reported when in specs are read
                    self.in_error = self.in_error or _unresolved(
                        f"the annotation of {where}",
                        param.annotation,
                        error,
                        module,
                        "in_specs and kw_specs",
                    )
            self.annotated = self.annotated or spec is not _NO_SPEC
            kind = param.kind
            if kind in (param.POSITIONAL_ONLY, param.POSITIONAL_OR_KEYWORD):
                positional.append(spec)
                names.append(param.name)
            if kind in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY):
                self.keyword[param.name] = spec
            elif kind == param.VAR_POSITIONAL:
                self.var_positional = spec
            elif kind == param.VAR_KEYWORD:
                self.var_keyword = spec
        self.positional = tuple(positional)
        self.positional_names = tuple(names)


def _unresolved(what: str, annotation: Any, error: Exception, module: Any, specs: str) -> str:
    return (
        f"cannot resolve {what} ({annotation!r}): {_failure(error)}; make "
        f"the name importable in module {module} at run time (not only under TYPE_CHECKING; a "
        f"name defined inside a function cannot be found from a string annotation), or pass "
        f"{specs} explicitly (annotations are then not read)"
    )


def _target(fn: Any) -> tuple[Any, bool]:
    """The function whose annotations and globals describe ``fn`` (None for a class), and
    whether a ``__wrapped__`` link was followed to reach it."""
    wrapped = False
    while True:
        if isinstance(fn, functools.partial):
            fn = fn.func
        elif isinstance(fn, types.MethodType):
            fn = fn.__func__
        elif isinstance(fn, type):
            return None, wrapped
        elif getattr(fn, "__wrapped__", None) is not None:
            fn, wrapped = fn.__wrapped__, True
        elif not isinstance(fn, (types.FunctionType, types.BuiltinFunctionType)):
            call = getattr(type(fn), "__call__", None)  # noqa: B004 - the method, not callable()
            return (call if isinstance(call, types.FunctionType) else fn), wrapped
        else:
            return fn, wrapped


def _fn_info(fn: Callable[..., Any]) -> _FnInfo:
    try:
        info = _FN_CACHE.get(fn)
    except TypeError:  # unhashable or not weakly referable: read every time
        return _FnInfo(fn)
    if info is None:
        info = _FnInfo(fn)
        try:
            _FN_CACHE[fn] = info
        except TypeError:
            pass
    return info


def default_in_specs(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    transform: str,
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """The input spec trees of a call ``fn(*args, **kwargs)`` from annotations.

    Each argument gets its parameter's annotated spec, else :func:`specs_of` of its value when
    it is a dataclass (whose fields may carry specs); once anything carries a spec, every other
    argument is ``Replicate()``. Nothing annotated: ``None``, and the transform applies its own
    default.

    Args:
        fn: the user's function (as given to the transform).
        args: the positional arguments of this call.
        kwargs: the keyword arguments of this call.
        transform: the transform's name, for errors (``"pmap_microbatch"``).

    Returns:
        ``(in_specs, kw_specs)``: a tuple with one spec tree per positional argument and a dict
        with one per keyword argument (``None`` when there are no keyword arguments, so that
        callers can skip matching an empty tree); or ``None`` when nothing is annotated.

    Raises:
        TypeError: an annotation cannot be resolved or carries conflicting specs; the message
            names the transform, the function and the parameter (or class and field).
    """
    info = _fn_info(fn)
    if info.in_error is not None:
        raise TypeError(f"{transform}({info.name}): {info.in_error}")
    annotated = info.annotated
    positional = info.positional
    n = len(positional)
    in_specs = []
    i: int | str = 0
    try:
        for i, arg in enumerate(args):
            spec = positional[i] if i < n else info.var_positional
            if spec is _NO_SPEC:
                spec = _REPLICATE
                if _is_dataclass_value(arg):
                    spec, sub = _dataclass_specs(arg, False)
                    annotated = annotated or sub
            in_specs.append(spec)
        kw_specs = {}
        for i, arg in kwargs.items():
            spec = info.keyword.get(i, info.var_keyword)
            if spec is _NO_SPEC:
                spec = _REPLICATE
                if _is_dataclass_value(arg):
                    spec, sub = _dataclass_specs(arg, False)
                    annotated = annotated or sub
            kw_specs[i] = spec
    except AnnotationError as error:
        if isinstance(i, str):
            what = f"keyword argument {i!r}"
        else:
            what = f"argument {i}"
            if i < n:
                what += f" ({info.positional_names[i]!r})"
        raise TypeError(
            f"{transform}({info.name}) {what}: {error}; or pass in_specs and kw_specs "
            "explicitly (annotations are then not read)"
        ) from None
    return (tuple(in_specs), kw_specs or None) if annotated else None


def check_out_annotation(fn: Callable[..., Any], *, transform: str) -> None:
    """At decoration, raise :func:`default_out_specs`'s error if ``fn``'s return annotation
    carries no spec. Names that do not resolve yet (a class defined further down the module)
    are not an error here, and nothing is cached: the first call reads the annotations."""
    info = _FnInfo(fn)
    if info.out_spec is _NO_SPEC and info.out_error is None:
        raise TypeError(f"{transform}({info.name}): out_specs omitted and {info.out_missing}")


def default_out_specs(fn: Callable[..., Any], *, transform: str, required: bool = True) -> Any:
    """The output spec tree of ``fn`` from its return annotation.

    Args:
        fn: the user's function (as given to the transform).
        transform: the transform's name, for errors.
        required: whether a return annotation without a spec is an error (``pmap_microbatch``
            infers its out specs instead: ``required=False`` returns ``None``).

    Raises:
        TypeError: the return annotation carries no spec (when ``required``), or cannot be
            resolved; the message names the transform and the function.
    """
    info = _fn_info(fn)
    if info.out_spec is not _NO_SPEC:
        return info.out_spec
    if info.out_error is not None:
        raise TypeError(f"{transform}({info.name}): {info.out_error}")
    if not required:
        return None
    raise TypeError(f"{transform}({info.name}): out_specs omitted and {info.out_missing}")
