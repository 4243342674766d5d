"""``ps.jit``: a function traced once per signature into one program, compiled and cached
(JAX's ``jax.jit``)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from .._compat import compile_backends, transforms_active
from .._core.tree import describe
from .._runtime.tracing import active_trace
from .program import Compiled, Lowered, lower
from .signature import flatten_call

__all__ = ["Jitted", "jit"]

_BACKENDS = ("inductor", "aot_eager", "eager")


class Jitted:
    """A function under ``ps.jit``: call it, :meth:`lower` it, ask its :meth:`cache_size`."""

    def __init__(
        self,
        fn: Callable[..., Any],
        static_argnums: tuple[int, ...],
        donate_argnums: tuple[int, ...],
        backend: str | Callable[..., Any],
    ) -> None:
        self.fn = fn
        self.static_argnums = static_argnums
        self.donate_argnums = donate_argnums
        self.backend = backend
        self._name = f"ps.jit({getattr(fn, '__qualname__', type(fn).__name__)})"
        self._cache: dict[Any, Compiled] = {}
        functools.update_wrapper(self, fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs:
            raise TypeError(
                f"{self._name}: keyword arguments are not traced; pass them positionally (or "
                f"bind them with functools.partial before ps.jit)"
            )
        if active_trace() is not None:  # inside another program: part of it
            return self.fn(*args)
        if transforms_active():
            raise RuntimeError(
                f"{self._name} was called inside a torch.func transform; a program is traced "
                f"from outside every transform: put the transform inside "
                f"(ps.jit(torch.func.grad(f)))"
            )
        flat = flatten_call(args, self.static_argnums, self.donate_argnums, self._name)
        program = self._cache.get(flat.key)
        if program is None:
            program = lower(self.fn, flat, self._name).compile(self.backend)
            self._cache[flat.key] = program
        return program.run(flat.tensors)

    def lower(self, *args: Any) -> Lowered:
        """Trace only: the program of these arguments' signature (not cached, not compiled)."""
        return lower(self.fn, flatten_call(args, self.static_argnums, self.donate_argnums,
                                           self._name), self._name)  # fmt: skip

    def cache_size(self) -> int:
        """How many programs (signatures) were traced and compiled so far."""
        return len(self._cache)


def _argnums(value: int | tuple[int, ...] | list[int], what: str) -> tuple[int, ...]:
    nums = (value,) if isinstance(value, int) else tuple(value)
    if not all(isinstance(i, int) and i >= 0 for i in nums):
        raise TypeError(f"ps.jit: {what} must be non-negative ints, got {describe(value)}")
    return nums


def jit(
    fn: Callable[..., Any] | None = None,
    /,
    *,
    static_argnums: int | tuple[int, ...] = (),
    donate_argnums: int | tuple[int, ...] = (),
    backend: str | Callable[..., Any] = "inductor",
) -> Any:
    """Trace ``fn`` once per signature into one program, compile it, and run that program on
    later calls with the same signature (JAX's ``jax.jit``).

    ``fn`` runs on fake tensors of the arguments' shapes, through every ``torch.func``
    transform and pshard transform inside it (``shard_map``, collectives, ``GlobalTensor``
    arguments and results, ``ps.optim`` updates, ...), into one ``torch.fx`` graph in which each
    collective is a ``pshard::`` op node; the graph is compiled by ``backend`` and cached.
    Metadata the ranks exchange (block shapes, layouts) is exchanged once, at trace time; only
    tensor data moves in the program. Python side effects in ``fn`` happen when it is traced,
    not when the program runs.

    The signature of a call: the pytree structure of the arguments, each tensor's shape, dtype,
    device, contiguity and ``requires_grad``, each ``GlobalTensor``'s layout, the values of
    non-tensor leaves and of ``static_argnums`` arguments, and the current mesh (axis names,
    sizes, this rank's coordinates). A new signature traces again.

    Args:
        fn: the function (positional arguments, pytrees of tensors and hashable values).
        static_argnums: arguments passed as Python values (hashable; part of the signature).
        donate_argnums: arguments whose tensors' buffers the outputs may take (an optimizer
            step's parameters and moments): each donated tensor takes the first output of its
            shape, dtype and device (the output shares its storage); do not use a donated
            argument after the call.
        backend: ``"inductor"`` (default), ``"aot_eager"`` (the same program, not code
            generated: fast to compile), or any ``torch.compile`` backend.

    Returns:
        The jitted function (a :class:`Jitted`: also ``.lower(*args)`` and ``.cache_size()``).

    Raises:
        ConcretizationError: (when called) Python read a traced value (``bool(t)``,
            ``t.item()``, a branch on a tensor), naming the line.
        NotTraceable: (when called) ``fn`` calls what cannot be part of a program
            (``ps.save``, ``ps.load``, ``ps.spawn``, a pipeline's schedule).

    Example:
        >>> import torch, pshard as ps
        >>> mesh = ps.init_mesh({"x": 1})
        >>> f = ps.jit(lambda x: ps.psum(torch.sin(x) * 2, "x"), backend="aot_eager")
        >>> x = torch.ones(3, dtype=torch.float64)
        >>> torch.equal(f(x), ps.psum(torch.sin(x) * 2, "x"))
        True
        >>> f.cache_size()
        1
    """
    if isinstance(backend, str) and backend not in _BACKENDS:
        if backend not in compile_backends():
            raise ValueError(
                f"ps.jit: unknown backend {backend!r} (pshard's tests use {_BACKENDS}; any "
                f"torch.compile backend name or callable will do)"
            )
    statics = _argnums(static_argnums, "static_argnums")
    donated = _argnums(donate_argnums, "donate_argnums")
    if set(statics) & set(donated):
        raise ValueError(f"ps.jit: arguments {sorted(set(statics) & set(donated))} are both "
                         f"static and donated")  # fmt: skip

    def wrap(f: Callable[..., Any]) -> Jitted:
        if not callable(f):
            raise TypeError(f"ps.jit: fn must be callable, got {describe(f)}")
        return Jitted(f, statics, donated, backend)

    return wrap if fn is None else wrap(fn)
