"""What a function reads besides its arguments, summed up for the cache of inferred out specs.

Batch-dim inference traces a function once per input signature and caches the answer. The
answer may also depend on state the function reads (a loss module's ``reduction``, a config
flag in a closure or a global): :func:`state_key` sums that state up so that it is part of the
cache key, and results never depend on what was cached.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch

__all__ = ["state_key"]

_PLAIN = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device)
_STATE_ITEMS = 256  # a container larger than this is not looked into: such a call is not cached


class _Opaque(Exception):
    """State that cannot be summed up: the call is traced again each time."""


def _state_of(obj: Any, budget: list[int], seen: set[int]) -> Any:
    """A hashable summary of what a traced call can read from ``obj``: plain values, the
    shapes and dtypes of tensors, the plain attributes of modules (their submodules' too),
    small containers of those. Functions, classes and modules of code are named by identity."""
    budget[0] -= 1
    if budget[0] < 0:
        raise _Opaque
    if isinstance(obj, _PLAIN):
        return obj
    if isinstance(obj, torch.Tensor):
        return ("tensor", tuple(obj.shape), obj.dtype, obj.device, obj.requires_grad)
    if id(obj) in seen:
        return ("seen", id(obj))
    seen.add(id(obj))
    if isinstance(obj, (tuple, list, set, frozenset)):
        items = sorted(obj, key=repr) if isinstance(obj, (set, frozenset)) else obj
        return (type(obj), tuple(_state_of(x, budget, seen) for x in items))
    if isinstance(obj, dict):
        return (dict, tuple((_state_of(k, budget, seen), _state_of(v, budget, seen))
                            for k, v in obj.items()))  # fmt: skip
    if isinstance(obj, torch.nn.Module):
        plain = tuple(
            (k, _state_of(v, budget, seen))
            for k, v in vars(obj).items()
            if k not in ("_parameters", "_buffers", "_modules")
            and not k.startswith("_")
            or k == "training"
        )
        tensors = tuple(
            (k, _state_of(v, budget, seen))
            for reg in ("_parameters", "_buffers")
            for k, v in getattr(obj, reg).items()
        )
        children = tuple((k, _state_of(m, budget, seen)) for k, m in obj._modules.items())
        return (type(obj), plain, tensors, children)
    if callable(obj) or isinstance(obj, type) or inspect.ismodule(obj):
        return ("object", id(obj))
    attrs = getattr(obj, "__dict__", None)
    if attrs is None:
        raise _Opaque
    return (type(obj), tuple((k, _state_of(v, budget, seen)) for k, v in attrs.items()))


def state_key(fn: Any) -> Any:
    """What ``fn`` can read besides its arguments, summed up for the cache key: the function
    (or module) itself, a bound method's object, a ``functools.partial``'s arguments, the
    contents of its closure cells and the globals its code names; ``None`` when some of it
    cannot be summed up (then the call is traced again each time, so results never depend on
    what was cached). State reached only through other functions it calls is not seen."""
    roots: list[Any] = []
    while isinstance(fn, functools.partial):
        roots += [fn.args, fn.keywords]
        fn = fn.func
    if isinstance(fn, torch.nn.Module):
        roots.append(fn)
    owner = getattr(fn, "__self__", None)
    if owner is not None:
        roots.append(owner)
    code = getattr(fn, "__func__", fn)
    for cell in getattr(code, "__closure__", None) or ():
        try:
            roots.append(cell.cell_contents)
        except ValueError:  # an empty cell
            roots.append(None)
    names = getattr(getattr(code, "__code__", None), "co_names", ())
    module_globals = getattr(code, "__globals__", {})
    roots += [module_globals[n] for n in names if n in module_globals]
    try:
        return tuple(_state_of(r, [_STATE_ITEMS], set()) for r in roots)
    except _Opaque:
        return None
