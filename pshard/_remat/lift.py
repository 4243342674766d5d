"""The tensors a checkpointed function uses without taking them as arguments, made arguments.

A checkpoint's gradient flows only to its arguments. A module's parameters reach a function
in other ways: the function is the module (``ps.checkpoint(layer)``), a bound method of it, a
``functools.partial`` over it (Hugging Face calls its checkpoint function with
``partial(forward, layer, **kwargs)``), or a closure over it (``lambda x: layer(x)``). Those
modules are found here (:func:`find_modules`), their parameters and buffers are passed to the
checkpoint as arguments and put in place while the function runs (:class:`Lifted`, as
``torch.func.functional_call`` does), so the recompute uses the very tensors the forward used,
even after an outer ``functional_call`` has put the module's own back. A ``partial``'s bound
arguments are unpacked into the call (:func:`unpack_partial`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from .. import _compat as compat

__all__ = ["Lifted", "find_modules", "unpack_partial"]


def unpack_partial(
    fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]:
    """``partial(f, *a, **k)(*args, **kwargs)`` as ``f(*a, *args, **{**k, **kwargs})``."""
    while isinstance(fn, functools.partial):
        args = (*fn.args, *args)
        kwargs = {**fn.keywords, **kwargs}
        fn = fn.func
    return fn, args, kwargs


def find_modules(fn: Callable[..., Any], leaves: Sequence[Any]) -> list[torch.nn.Module]:
    """The modules whose tensors ``fn`` called on ``leaves`` may use: ``fn`` itself, the owner
    of a bound method, modules among the leaves, and modules ``fn`` closes over (one level);
    only the outermost of nested modules."""
    found: list[torch.nn.Module] = []

    def add(obj: Any) -> None:
        if isinstance(obj, torch.nn.Module) and not any(obj is m for m in found):
            found.append(obj)

    add(fn)
    add(getattr(fn, "__self__", None))
    for leaf in leaves:
        add(leaf)
    code = inspect.unwrap(fn) if callable(fn) else fn
    for cell in getattr(code, "__closure__", None) or ():
        try:
            add(cell.cell_contents)
        except ValueError:  # an empty cell
            pass
    inner = {id(sub) for m in found for sub in m.modules() if sub is not m}
    return [m for m in found if id(m) not in inner]


class Lifted:
    """The parameters and buffers of ``modules`` as a flat list of tensors (:attr:`tensors`),
    and :meth:`installed`, which puts a list like it in their place while a block runs."""

    def __init__(self, modules: Sequence[torch.nn.Module]) -> None:
        self._modules = list(modules)
        self._names: list[list[str]] = []
        self.tensors: list[torch.Tensor] = []
        for m in self._modules:
            named: list[tuple[str, torch.Tensor]] = [*m.named_parameters(remove_duplicate=False)]
            named += [*m.named_buffers(remove_duplicate=False)]
            self._names.append([n for n, _ in named])
            self.tensors.extend(t for _, t in named)

    def __len__(self) -> int:
        return len(self.tensors)

    @contextlib.contextmanager
    def installed(self, tensors: Sequence[torch.Tensor]) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            i = 0
            for module, names in zip(self._modules, self._names, strict=True):
                values = dict(zip(names, tensors[i : i + len(names)], strict=True))
                i += len(names)
                if values:
                    stack.enter_context(compat.reparametrized(module, values))
            yield
