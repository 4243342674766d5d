"""The caches pshard keeps: few, named, and all emptied by :func:`clear_caches`.

A cache here only saves work: every entry is a pure function of its key (layout plans of
integer shapes, spec trees matched against tree structures, annotations read from a function,
a kernel checked once per device), so results never depend on what was cached, and
:func:`clear_caches` may be called at any time. Each cache registers itself under a name when
its module is imported; the registry is written at import time only.

Two kinds:

- :func:`cached` (``functools.lru_cache`` of a pure function of hashable arguments);
- :class:`WeakCache` (a ``weakref.WeakKeyDictionary`` keyed by a function or class, so nothing
  is kept alive by the cache).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from .._compat import fake_mode_active

__all__ = ["WeakCache", "cache_names", "cached", "clear_caches", "register"]

F = TypeVar("F", bound=Callable[..., Any])
K = TypeVar("K")
V = TypeVar("V")

# name -> the function that empties that cache; filled while modules are imported, then read only
_CLEARERS: dict[str, Callable[[], None]] = {}


def register(name: str, clear: Callable[[], None]) -> None:
    """Register the cache ``name``, emptied by ``clear()`` (once per name)."""
    if name in _CLEARERS:
        raise RuntimeError(f"pshard: a cache named {name!r} is already registered")
    _CLEARERS[name] = clear


def cached(name: str, maxsize: int) -> Callable[[F], F]:
    """``functools.lru_cache(maxsize)`` registered as the cache ``name``. While a trace runs
    (fake tensors: ``ps.jit``, ``torch.compile``) the function is called without the cache:
    what it makes there (a tensor of the trace) must not outlive the trace."""

    def wrap(fn: F) -> F:
        memo = functools.lru_cache(maxsize=maxsize)(fn)
        register(name, memo.cache_clear)

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            if fake_mode_active():
                return fn(*args, **kwargs)
            return memo(*args, **kwargs)

        call.cache_clear = memo.cache_clear  # type: ignore[attr-defined]
        call.cache_info = memo.cache_info  # type: ignore[attr-defined]
        return call  # type: ignore[return-value]

    return wrap


class WeakCache(Generic[K, V]):
    """A dict of weakly held keys (functions, classes), registered as the cache ``name``."""

    def __init__(self, name: str) -> None:
        self._entries: weakref.WeakKeyDictionary[K, V] = weakref.WeakKeyDictionary()
        register(name, self._entries.clear)

    def get(self, key: K) -> V | None:
        try:
            return self._entries.get(key)
        except TypeError:  # not weakly referenceable: never cached
            return None

    def put(self, key: K, value: V) -> None:
        try:
            self._entries[key] = value
        except TypeError:
            pass


def cache_names() -> tuple[str, ...]:
    """The names of every cache pshard keeps (in registration order)."""
    return tuple(_CLEARERS)


def clear_caches() -> None:
    """Empty every cache pshard keeps.

    pshard caches only what is a pure function of its key (layout plans, spec trees matched to
    tree structures, annotations read from functions and classes, inferred out specs, kernels
    checked on a device), so results never depend on what was cached; clearing frees memory
    and makes the next calls do that work again.

    Example:
        >>> import pshard as ps
        >>> ps.clear_caches()
    """
    for clear in _CLEARERS.values():
        clear()
