"""torch.compile's front end, loaded only when something compiles (see :mod:`pshard._compat`)."""

from __future__ import annotations

import importlib.abc
import inspect
import sys
from collections.abc import Callable
from typing import Any

import torch

__all__ = [
    "compile_disabled",
    "constant_result",
    "when_compiling",
]


# --- torch.compile's front end, loaded only when something compiles -------------------------------
#
# ``torch.compiler.disable`` imports dynamo (and, with it, DTensor, FSDP and most of torch's
# compile stack: seconds at import). Nothing can compile before dynamo is imported, so pshard's
# functions that must stay out of compiled graphs are disabled when it is: ``when_compiling``
# runs its callbacks right after ``torch._dynamo`` has been imported (now, if it already is).


class _AfterDynamo(importlib.abc.MetaPathFinder):
    """A finder that lets the others find ``torch._dynamo`` and runs callbacks once it has
    been executed; it removes itself then."""

    def __init__(self) -> None:
        self.callbacks: list[Callable[[], None]] = []

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != "torch._dynamo":
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _ThenRun(spec.loader, self)
                return spec
        return None


class _ThenRun(importlib.abc.Loader):
    def __init__(self, loader: Any, hook: _AfterDynamo) -> None:
        self.loader, self.hook = loader, hook

    def create_module(self, spec: Any) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.loader.exec_module(module)
        if self.hook in sys.meta_path:
            sys.meta_path.remove(self.hook)
        callbacks, self.hook.callbacks = self.hook.callbacks, []
        for callback in callbacks:
            callback()

    def __getattr__(self, name: str) -> Any:  # the wrapped loader's other methods
        return getattr(self.loader, name)


def when_compiling(callback: Callable[[], None]) -> None:
    """Run ``callback`` once ``torch._dynamo`` is imported (now, if it already is)."""
    if "torch._dynamo" in sys.modules:
        callback()
        return
    hook = next((f for f in sys.meta_path if isinstance(f, _AfterDynamo)), None)
    if hook is None:
        hook = _AfterDynamo()
        sys.meta_path.insert(0, hook)
    hook.callbacks.append(callback)


def compile_disabled(owner: Any, name: str) -> None:
    """Replace ``owner.name`` (a module's function or a class's static method) by
    ``torch.compiler.disable(it, recursive=True)`` once dynamo is imported."""

    def disable() -> None:
        value = inspect.getattr_static(owner, name)
        fn = value.__func__ if isinstance(value, staticmethod) else value
        disabled = torch.compiler.disable(fn, recursive=True)
        setattr(
            owner, name, staticmethod(disabled) if isinstance(value, staticmethod) else disabled
        )

    when_compiling(disable)


def constant_result(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.compiler.assume_constant_result(fn)`` without importing dynamo: the mark it
    sets (dynamo reads it when it traces a call to ``fn``)."""
    fn._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return fn
