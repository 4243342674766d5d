"""Spec annotations of functions: the specs a transform reads from ``fn``'s signature when
``in_specs`` / ``out_specs`` are omitted.

``def step(params, batch: Batch, mask: Annotated[torch.Tensor, ps.Shard(0)]) ->
Annotated[torch.Tensor, ps.Partial("mean")]``: each parameter's type and the return type carry
a spec as :mod:`pshard._core.type_specs` reads it (``Annotated``, ``Optional``, tuples,
containers, dataclass types), and dataclass arguments carry the specs of their fields
(:func:`pshard.specs_of`, re-exported here).

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
in the cache ``"annotations of functions"`` (:class:`pshard._core.caches.WeakCache`: keyed weakly
by the function, so nothing is kept alive by having been read); dataclass types likewise in
:mod:`pshard._core.type_specs`. Per call, what remains is a look-up and one pass over the
arguments (dataclass arguments: one pass over their fields). A callable that cannot be weakly
referenced or hashed is read on every call.
"""

from __future__ import annotations

import functools
import inspect
import sys
import types
from collections.abc import Callable
from typing import Any

from .caches import WeakCache
from .checks import fn_name
from .placements import Replicate
from .type_specs import (
    NO_SPEC,
    AnnotationError,
    dataclass_specs,
    failure_text,
    is_dataclass_value,
    resolve_annotation,
    spec_of_type,
)
from .type_specs import specs_of as specs_of  # moved to type_specs; re-exported for pshard

__all__ = ["check_out_annotation", "default_in_specs", "default_out_specs", "specs_of"]

_REPLICATE = Replicate()


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
        self.var_positional: Any = NO_SPEC
        self.keyword: dict[str, Any] = {}
        self.var_keyword: Any = NO_SPEC
        self.annotated = False
        self.in_error: str | None = None
        self.out_spec: Any = NO_SPEC
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
                tp = resolve_annotation(signature.return_annotation, globalns, None)
                self.out_spec = spec_of_type(tp, where, dataclass_types=True)
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
            spec = NO_SPEC
            if param.annotation is not inspect.Parameter.empty:
                where = f"parameter {param.name!r}"
                try:
                    tp = resolve_annotation(param.annotation, globalns, None)
                    spec = spec_of_type(tp, where)
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
            self.annotated = self.annotated or spec is not NO_SPEC
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
        f"cannot resolve {what} ({annotation!r}): {failure_text(error)}; make "
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


# function -> _FnInfo (see the module docstring)
_FN_CACHE: WeakCache[Callable[..., Any], _FnInfo] = WeakCache("annotations of functions")


def _fn_info(fn: Callable[..., Any]) -> _FnInfo:
    info = _FN_CACHE.get(fn)  # None also for a callable that cannot be cached: read every time
    if info is None:
        info = _FnInfo(fn)
        _FN_CACHE.put(fn, info)
    return info


def default_in_specs(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    transform: str,
) -> tuple[tuple[Any, ...], dict[str, Any] | None] | None:
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
            if spec is NO_SPEC:
                spec = _REPLICATE
                if is_dataclass_value(arg):
                    spec, sub = dataclass_specs(arg, False)
                    annotated = annotated or sub
            in_specs.append(spec)
        kw_specs = {}
        for i, arg in kwargs.items():
            spec = info.keyword.get(i, info.var_keyword)
            if spec is NO_SPEC:
                spec = _REPLICATE
                if is_dataclass_value(arg):
                    spec, sub = dataclass_specs(arg, False)
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
    if info.out_spec is NO_SPEC and info.out_error is None:
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
    if info.out_spec is not NO_SPEC:
        return info.out_spec
    if info.out_error is not None:
        raise TypeError(f"{transform}({info.name}): {info.out_error}")
    if not required:
        return None
    raise TypeError(f"{transform}({info.name}): out_specs omitted and {info.out_missing}")
