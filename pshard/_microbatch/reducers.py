"""Streaming reductions of one pytree leaf over chunks: what :func:`pshard.merge` and
:func:`pshard.pmap_microbatch` do with each output leaf.

A reducer takes each chunk's value in turn (``add(x, weight, i)``) and gives the merged value
(``result()``), keeping only its accumulator between chunks:

- ``Partial("sum" | "max" | "min")``: elementwise, in ``accum_dtype`` for floating tensors when
  given (float32 for ``bfloat16`` / ``float16`` when not: one rounding at the end, not one per
  chunk); Python numbers reduce as numbers;
- ``Partial("mean")``: the weighted sum divided by the total weight at the end (IEEE semantics:
  an ``inf`` stays ``inf``), accumulated like a sum; a single contributing chunk comes back
  exactly and a zero-weight chunk (known on the host) is skipped, NaN or not; a weight that
  cannot be read (under ``vmap``) is applied with ``where`` instead of a branch;
- ``Replicate()``: the first chunk's value (compared with the others in debug mode);
- ``Shard(d)`` (:class:`Concat`): written into one buffer preallocated from chunk 0's shape, or
  concatenated once at the end when autograd keeps the pieces anyway.

With more than one chunk and no autograd involved, accumulators are tensors of their own,
updated in place; when a value takes part in autograd or a ``torch.func`` transform every update
is out of place, so gradients flow through the merge.

Internal interface:

- ``Reducer``: what a reducer provides (``add(x, weight, i)``, ``result()``).
- ``make_reducer(spec, accum_dtype, sizes, label, chunks, *, debug=None) -> Reducer``: the
  reducer of one leaf with (checked) spec ``spec`` over ``chunks`` chunks; ``sizes`` are the
  chunks' input sizes along the split (for ``Concat``; None when unknown); ``label.format(i)``
  names chunk ``i`` in messages; ``debug`` turns on the ``Replicate()`` equality check.
- ``ReduceError``: raised by ``add``; the message lacks the key path, which the caller adds.
- ``weight_value(w, what) -> float | Tensor``: a chunk's weight as a float (a one-element
  tensor when it cannot be read, e.g. under ``vmap``).
"""

from __future__ import annotations

import numbers
from typing import Any, Protocol

import optree
import torch

from .._compat import is_wrapped
from .._core.global_tensor import GlobalTensor, is_global
from .._core.placements import Partial, Shard
from .._core.tree import NAMESPACE, describe
from .._runtime.debug import debug_enabled

__all__ = ["Concat", "ReduceError", "Reducer", "make_reducer", "weight_value"]


_LOW_PRECISION = (torch.bfloat16, torch.float16)


class ReduceError(Exception):
    """A reduction failed; the message lacks the leaf's key path, which the caller adds."""


class Reducer(Protocol):
    """The streaming reduction of one leaf over chunks."""

    def add(self, x: Any, w: float | torch.Tensor, i: int) -> None:
        """Add chunk ``i``'s value ``x`` of weight ``w``; raises :class:`ReduceError`."""
        ...

    def result(self) -> Any:
        """The merged value of the chunks added so far."""
        ...


def _shape(x: Any) -> tuple[int, ...]:
    return tuple(x.shape)


def _is_tracked(t: torch.Tensor) -> bool:
    """Whether ``t`` takes part in autograd or a ``torch.func`` transform (so it must not be
    written in place). While ``torch.compile`` traces, every tensor counts as tracked: the
    accumulators are then updated out of place (the compiler reuses the memory), since
    in-place updates of an accumulator carried across graph breaks came back lost (a wrong
    mean, no error) under torch 2.13's AOT backends."""
    return torch.compiler.is_compiling() or t.requires_grad or is_wrapped(t)


def _is_leaf(x: Any) -> bool:
    return optree.tree_is_leaf(x, namespace=NAMESPACE)


def weight_value(w: Any, what: str) -> float | torch.Tensor:
    """A chunk's weight as a Python float, read once; a one-element tensor whose value cannot
    be read here (under ``vmap``) is returned as it is."""
    if isinstance(w, torch.Tensor):
        if w.numel() != 1:
            raise ValueError(
                f"{what} must be a number or a one-element tensor, got a tensor of shape "
                f"{_shape(w)}"
            )
        try:
            value = float(w)
        except RuntimeError:  # a batched tensor (vmap): decide per element, masked
            return w.reshape(())
    elif isinstance(w, numbers.Real) and not isinstance(w, bool):
        value = float(w)
    else:
        raise TypeError(f"{what} must be a number or a one-element tensor, got {describe(w)}")
    if not value >= 0 or value == float("inf"):
        raise ValueError(f"{what} must be finite and >= 0, got {value}")
    return value


# --------------------------------------------------------------------------- reducers


def _is_number(x: Any) -> bool:
    return isinstance(x, numbers.Number) and not isinstance(x, bool)


def _check_reducible(x: Any, spec: Any) -> None:
    if isinstance(x, torch.Tensor) or _is_number(x) or isinstance(x, bool):
        return
    raise ReduceError(f"{spec!r} reduces tensors and numbers, got {describe(x)}")


class _Reducer:
    """Streaming reduction of one leaf over chunks (``add`` each chunk's value, ``result``)."""

    __slots__ = ("spec", "accum", "label", "several", "value", "owned", "dtype")

    def __init__(
        self, spec: Any, accum_dtype: torch.dtype | None, label: str, several: bool
    ) -> None:
        self.spec = spec
        self.label = label  # names chunk i in messages: label.format(i)
        self.several = several  # more than one chunk will come
        self.accum = accum_dtype
        self.value: Any = None
        self.owned = False  # whether ``value`` is a tensor made here (safe to write in place)
        self.dtype: torch.dtype | None = None

    def _start(self, x: Any, given: Any) -> None:
        """The first contribution ``x`` (``given`` before casting). With more to come and no
        autograd involved, the accumulator is a tensor of its own, updated in place from then
        on; a single chunk's value is passed through untouched."""
        if isinstance(x, torch.Tensor) and self.several and not _is_tracked(x):
            self.value = x if x is not given else x.clone()
            self.owned = True
        else:
            self.value = x

    def _cast(self, x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            if self.dtype is None:
                self.dtype = x.dtype
            accum = self.accum
            if accum is None and x.dtype in _LOW_PRECISION and self.several:
                accum = torch.float32  # one rounding at the end, not one per chunk
            if accum is not None and x.is_floating_point() and x.dtype != accum:
                return x.to(accum)
        return x

    def _inplace(self, x: Any) -> bool:
        value = self.value
        return (
            self.owned
            and isinstance(x, torch.Tensor)
            and not _is_tracked(x)
            and not _is_tracked(value)
            and x.shape == value.shape
        )

    def result(self) -> Any:
        value = self.value
        if isinstance(value, torch.Tensor) and self.dtype is not None and value.dtype != self.dtype:
            return value.to(self.dtype)
        return value


class _Sum(_Reducer):
    __slots__ = ()

    def add(self, x: Any, w: Any, i: int) -> None:
        _check_reducible(x, self.spec)
        given, x = x, self._cast(x)
        if self.value is None:
            self._start(x, given)
        elif self._inplace(x):
            self.value.add_(x)
        else:
            self.value = self.value + x
            self.owned = isinstance(self.value, torch.Tensor)


class _Extreme(_Reducer):
    __slots__ = ()

    def add(self, x: Any, w: Any, i: int) -> None:
        _check_reducible(x, self.spec)
        given, x = x, self._cast(x)
        value = self.value
        if value is None:
            self._start(x, given)
            return
        pick = torch.maximum if self.spec.reduce == "max" else torch.minimum
        if self._inplace(x):
            pick(value, x, out=value)
        elif isinstance(value, torch.Tensor) or isinstance(x, torch.Tensor):
            a, b = _as_tensors(value, x)
            self.value = pick(a, b)
            self.owned = True
        else:
            self.value = max(value, x) if self.spec.reduce == "max" else min(value, x)


def _as_tensors(a: Any, b: Any) -> tuple[torch.Tensor, torch.Tensor]:
    like = a if isinstance(a, torch.Tensor) else b

    def tensor(x: Any) -> torch.Tensor:
        if isinstance(x, torch.Tensor):
            return x
        return torch.as_tensor(x, dtype=like.dtype, device=like.device)

    return tensor(a), tensor(b)


class _Mean(_Reducer):
    """Weighted mean: ``sum(w * x) / sum(w)``, divided once at the end (so an ``inf`` stays
    ``inf``, where a running ``lerp`` gives ``inf - inf``); a single contributing chunk is
    given back as it came, and a zero-weight chunk is never touched."""

    __slots__ = ("total", "zero", "pending", "count")

    def __init__(
        self, spec: Any, accum_dtype: torch.dtype | None, label: str, several: bool
    ) -> None:
        super().__init__(spec, accum_dtype, label, several)
        self.total: Any = 0.0
        self.zero: Any = None  # a zero of the right kind while every weight so far was zero
        self.pending: Any = None  # the weight the first contribution is not yet scaled by
        self.count = 0  # chunks with a non-zero weight

    def add(self, x: Any, w: Any, i: int) -> None:
        _check_reducible(x, self.spec)
        if isinstance(x, torch.Tensor) and not (x.is_floating_point() or x.is_complex()):
            raise ReduceError(
                f"Partial('mean') of a {x.dtype} tensor: a mean needs a floating dtype; return "
                "a floating-point tensor or give this output Partial('sum')"
            )
        given, x = x, self._cast(x)
        if isinstance(w, torch.Tensor):
            self._add_masked(x, w)
            return
        if w == 0:  # contributes nothing, even when x is NaN
            if self.value is None and self.zero is None:
                self.zero = torch.zeros_like(given) if isinstance(x, torch.Tensor) else 0.0
            return
        self.total += w
        self.count += 1
        if self.value is None:  # kept unscaled: a single contribution comes back as it came
            self._start(x if isinstance(x, torch.Tensor) else float(x), given)
            self.pending = w
            return
        if self.pending is not None:  # now scale the first by its weight
            first, self.pending = self.pending, None
            if self._inplace(self.value):
                self.value.mul_(first)
            else:
                self.value = self.value * first
                self.owned = isinstance(self.value, torch.Tensor)
        if self._inplace(x):
            self.value.add_(x, alpha=w)
        elif isinstance(self.value, torch.Tensor) or isinstance(x, torch.Tensor):
            a, b = _as_tensors(self.value, x)
            self.value = a + b.to(a.dtype) * w
            self.owned = True
        else:
            self.value = self.value + x * w

    def _add_masked(self, x: Any, w: torch.Tensor) -> None:
        # The weight cannot be read (vmap): select instead of branching, so that a zero-weight
        # chunk still contributes nothing (and no NaN) in value.
        if not isinstance(x, torch.Tensor):
            x = torch.as_tensor(x, dtype=torch.get_default_dtype(), device=w.device)
        scaled = torch.where(w != 0, x * w.to(x.dtype), torch.zeros_like(x))
        if self.pending is not None:  # a readable weight came first: scale it now
            self.value, self.pending = self.value * self.pending, None
        self.count = 2  # never given back as it came
        if self.value is None:
            self.value, self.total, self.owned = scaled, w, True
            return
        a, b = _as_tensors(self.value, scaled)
        self.value = a + b.to(a.dtype)
        self.total = self.total + w
        self.owned = True

    def result(self) -> Any:
        if self.value is None:
            return self.zero
        if self.count == 1:
            return super().result()
        total = self.total
        if isinstance(total, torch.Tensor):
            total = torch.where(total == 0, torch.ones_like(total), total).to(self.value.dtype)
        value = self.value / total
        if isinstance(value, torch.Tensor) and self.dtype is not None and value.dtype != self.dtype:
            return value.to(self.dtype)
        return value


class _First(_Reducer):
    """``Replicate()``: the first chunk's value; later chunks must hold a leaf there (and, in
    debug mode, an equal one)."""

    __slots__ = ("check",)

    def __init__(
        self, spec: Any, accum_dtype: torch.dtype | None, label: str, several: bool, check: bool
    ) -> None:
        super().__init__(spec, accum_dtype, label, several)
        self.check = check  # debug mode: compare every chunk's value with the first

    def add(self, x: Any, w: Any, i: int) -> None:
        if i == 0:
            self.value = x
            return
        first = self.value
        label = self.label
        if type(x) is not type(first) and not _is_leaf(x):
            raise ReduceError(
                f"{label.format(i)} has {describe(x)} but {label.format(0)} has {describe(first)}"
            )
        if self.check and not _equal(first, x):
            raise ReduceError(
                f"Replicate() but {label.format(i)} ({describe(x)}) differs from "
                f"{label.format(0)} ({describe(first)}); give this leaf a Partial or Shard spec "
                "if it varies"
            )

    def result(self) -> Any:
        return self.value


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        try:
            return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
        except RuntimeError:  # a traced / batched tensor: cannot be read here
            return True
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - values that do not compare are not known to differ
        return True


class Concat:
    """``Shard(d)`` output of a streamed loop: written into one preallocated buffer as chunks
    arrive (when the first chunk's size along ``d`` is a multiple ``r`` of its input chunk size,
    the total is ``r`` times the batch), else kept and concatenated once at the end (outputs
    that take part in autograd, which keeps them anyway, and sizes that do not scale)."""

    __slots__ = ("spec", "sizes", "label", "dim", "buffer", "pieces", "offset", "ratio", "shape0")

    def __init__(self, spec: Shard, sizes: list[int] | None, label: str) -> None:
        self.spec = spec
        self.sizes = sizes
        self.label = label
        self.dim = 0
        self.buffer: torch.Tensor | None = None
        self.pieces: list[torch.Tensor] = []
        self.offset = 0
        self.ratio = 0
        self.shape0: list[int] = []  # chunk 0's shape with the split dim set to -1

    def _first(self, x: torch.Tensor) -> None:
        shape = list(x.shape)
        if not -len(shape) <= self.spec.dim < len(shape):
            raise ReduceError(f"{self.spec!r} but {self.label.format(0)} gave {describe(x)}")
        self.dim = d = self.spec.dim % len(shape)
        n, shape[d] = shape[d], -1
        self.shape0 = shape
        sizes = self.sizes
        if sizes is None or len(sizes) == 1 or _is_tracked(x) or n == 0 or n % sizes[0]:
            self.pieces.append(x)
            return
        self.ratio = n // sizes[0]
        total = list(x.shape)
        total[d] = self.ratio * sum(sizes)
        self.buffer = x.new_empty(total)
        self.buffer.narrow(d, 0, n).copy_(x)
        self.offset = n

    def add(self, x: Any, w: Any, i: int) -> None:
        if not isinstance(x, torch.Tensor):
            raise ReduceError(f"{self.spec!r} concatenates tensors, got {describe(x)}")
        if i == 0:
            self._first(x)
            return
        d = self.dim
        shape = list(x.shape)
        n = shape[d] if len(shape) == len(self.shape0) else -1
        if n >= 0:
            shape[d] = -1
        if shape != self.shape0:
            first = ", ".join("*" if s == -1 else str(s) for s in self.shape0)
            raise ReduceError(
                f"{self.spec!r} but {self.label.format(i)} gave {describe(x)} and "
                f"{self.label.format(0)} a tensor of shape ({first}); the outputs must agree "
                f"on every dim but the split dim {d}"
            )
        buffer = self.buffer
        if buffer is not None:
            sizes = self.sizes or ()
            if n == self.ratio * sizes[i] and x.dtype == buffer.dtype and not _is_tracked(x):
                buffer.narrow(d, self.offset, n).copy_(x)
                self.offset += n
                return
            self.pieces.append(buffer.narrow(d, 0, self.offset))
            self.buffer = None
        self.pieces.append(x)

    def result(self) -> Any:
        if self.buffer is not None:
            return self.buffer
        if len(self.pieces) == 1:
            return self.pieces[0]
        return torch.cat(self.pieces, self.dim)


class _Blocks:
    """A reduction that also takes :class:`~pshard.GlobalTensor` s: it reduces their blocks
    (``Partial`` sums, means and extremes, ``Replicate()``'s first), every chunk's of the same
    layout, and rebuilds a ``GlobalTensor`` of that layout. A ``GlobalTensor`` is one global
    value, not rows of a batch: ``Shard(d)`` cannot concatenate it."""

    __slots__ = ("inner", "meta", "spec")

    def __init__(self, inner: Reducer, spec: Any) -> None:
        self.inner = inner
        self.spec = spec
        self.meta: Any = None

    def add(self, x: Any, w: float | torch.Tensor, i: int) -> None:
        if is_global(x):
            if isinstance(self.spec, Shard):
                raise ReduceError(
                    f"{self.spec!r} but the value is {describe(x)}: a GlobalTensor is one "
                    f"global value, not rows of the batch; give it Partial(...) (gradients) or "
                    f"Replicate()"
                )
            if i == 0:
                self.meta = x.meta
            elif self.meta != x.meta:
                raise ReduceError(
                    f"chunk {i} gave {describe(x)} laid out as {x.meta.spec!r} on mesh "
                    f"{x.meta.key.text()}, another layout than chunk 0's; every chunk must give "
                    f"the same layout"
                )
            self.inner.add(x.local, w, i)
            return
        if self.meta is not None:
            raise ReduceError(f"chunk {i} gave {describe(x)} where chunk 0 gave a GlobalTensor")
        self.inner.add(x, w, i)

    def result(self) -> Any:
        out = self.inner.result()
        return out if self.meta is None else GlobalTensor(out, self.meta)


def make_reducer(
    spec: Any,
    accum_dtype: torch.dtype | None,
    sizes: list[int] | None,
    label: str,
    chunks: int,
    *,
    debug: bool | None = None,
) -> Reducer:
    """The streaming reduction of one output leaf with (checked) spec ``spec`` over ``chunks``
    chunks; ``label`` names chunk ``i`` in messages as ``label.format(i)``
    (``"microbatch {}"``); ``debug`` (default: :func:`pshard.debug_enabled`) turns on the
    equality check of ``Replicate()`` leaves."""
    kind = type(spec)
    inner: Reducer
    several = chunks > 1
    if kind is Shard:
        inner = Concat(spec, sizes, label)
    elif kind is Partial:
        reduce = spec.reduce
        if reduce == "sum":
            inner = _Sum(spec, accum_dtype, label, several)
        elif reduce == "mean":
            inner = _Mean(spec, accum_dtype, label, several)
        else:
            inner = _Extreme(spec, accum_dtype, label, several)
    else:
        on = debug_enabled() if debug is None else debug
        inner = _First(spec, accum_dtype, label, several, on)
    return _Blocks(inner, spec)
