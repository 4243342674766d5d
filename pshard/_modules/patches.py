"""A module's ``forward`` (or a name in a namespace) replaced while a block runs it, and put
back: the patches ``tensor_parallel`` and ``expert_parallel`` install (an instance attribute
``forward``, as ``sharded_call`` installs its units).

Internal interface: ``own_forward(module, saved)``, ``set_forward(module, forward) -> undo``,
``set_name(namespace, name, value) -> undo``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

__all__ = ["own_forward", "set_forward", "set_name"]


def own_forward(module: nn.Module, saved: Any) -> Callable[..., Any]:
    """The ``forward`` ``module`` had before a patch (``saved``: its instance attribute then,
    ``None`` for the class's)."""
    return saved if saved is not None else type(module).forward.__get__(module)


def set_forward(module: nn.Module, forward: Any) -> Callable[[], None]:
    """``module.forward = forward``; the undo puts back what was there (if the patch is still
    in place)."""
    saved = module.__dict__.get("forward")
    module.forward = forward

    def undo() -> None:
        if module.__dict__.get("forward") is forward:
            if saved is None:
                del module.forward
            else:
                module.forward = saved

    return undo


def set_name(namespace: dict[str, Any], name: str, value: Any) -> Callable[[], None]:
    """``namespace[name] = value`` (a module's globals); the undo puts back what was there (if
    the patch is still in place)."""
    saved = namespace[name]
    namespace[name] = value

    def undo() -> None:
        if namespace.get(name) is value:
            namespace[name] = saved

    return undo
