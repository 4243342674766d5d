"""How pshard calls its ``torch.autograd.Function`` s: :func:`call` (``Function.apply`` without
its per-call signature binding), :func:`eager` (outside a graph that dynamo traces) and
:func:`eager_rules` (a Function's rules kept out of dynamo). Used by the collectives and by the
sequence-parallel exchanges built like them.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from .._compat import compile_disabled, transforms_active, unwrap_dead

__all__ = ["call", "eager", "eager_rules"]


def call(fn: type[torch.autograd.Function], *args: Any) -> Any:
    """``fn.apply(*args)``. With no ``torch.func`` transform active, skip ``Function.apply``'s
    binding of default arguments through ``inspect.signature`` (about 20 us a call; every
    argument here is positional, so there is nothing to bind) and do the rest of what it does.
    While dynamo traces, a plain ``apply`` (inside a ``torch.func`` transform, the Function
    runs eagerly outside the graph: :func:`eager`)."""
    if torch.compiler.is_compiling():
        return _self.eager(fn, *args) if transforms_active() else fn.apply(*args)
    if transforms_active():
        return fn.apply(*args)
    return super(torch.autograd.Function, fn).apply(*unwrap_dead(args))  # type: ignore[misc]


def eager(fn: type[torch.autograd.Function], *args: Any) -> Any:
    """``fn.apply(*args)`` outside the graph (a graph break), rules and all. Kept out of
    dynamo (``torch.compiler.disable``, recursive) from the moment dynamo is imported: call it
    as ``apply.eager`` (the module's attribute), so that callers get the disabled function."""
    return fn.apply(*args)


_self = sys.modules[__name__]
compile_disabled(_self, "eager")


F = Any


def eager_rules(cls: F) -> F:
    """Keep dynamo out of ``cls``'s rules. They run eagerly by design (a compiled region uses
    the ops of :mod:`pshard._collectives.compiled`), yet the autograd engine and ``torch.func``
    call them from inside a compiled function's eager parts, where dynamo would compile each
    frame again per shape. Applied when dynamo is imported: nothing compiles before."""
    for name in ("forward", "backward", "jvp", "vmap"):
        compile_disabled(cls, name)
    return cls
