"""Values that leave a checkpointed function by another route than its return value.

A function may hand a value out without returning it: it appends it to a list, writes it into
a dict or an attribute, or a forward hook of a module it calls records it (Hugging Face records
router logits, attentions and hidden states so). The checkpoint runs its forward below autograd
and ``torch.func``, so such a value would reach the caller with no history: its gradient would
be silently lost. :class:`Made` finds them: it holds every floating-point tensor the function's
torch calls return (the Python objects the function sees, through a ``TorchFunctionMode``) and,
when the function has returned, those still referenced from anywhere else are the ones that
left. The checkpoint makes each an output of its ``autograd.Function`` as well, recomputes it
like the others, and swaps the object that left with that output
(:func:`pshard._compat.swap_contents`), so the list, dict or attribute holding it holds a value
with its gradient, as under ``torch.utils.checkpoint``.

The trackers of nested checkpoints form a chain (a context variable): a result belongs to the
innermost one, which hands the values that left it to the one outside when it ends (they may
leave that one too). In the recompute the same class indexes the function's results by the
tensor under their ``torch.func`` wrappers, so the replay's tensor of a value that left finds
the object that carries its derivative.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import sys
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import torch
from torch.overrides import TorchFunctionMode

from .. import _compat as compat

__all__ = ["Holder", "Made", "hand_over", "untracked"]

_CURRENT: contextvars.ContextVar[Made | None] = contextvars.ContextVar(
    "pshard_remat_made", default=None
)
_SEQUENCES = (tuple, list)


@contextlib.contextmanager
def untracked() -> Iterator[None]:
    """What runs inside is no call of the enclosing function (a checkpoint's own machinery):
    nothing it returns is held for that function."""
    token = _CURRENT.set(None)
    try:
        yield
    finally:
        _CURRENT.reset(token)


class Holder(Protocol):
    """What holds tensors for pshard's own use: its ``tensors`` (``None`` once let go)."""

    tensors: list[torch.Tensor | None] | None


def hand_over(tensors: Sequence[Any], holders: Sequence[Holder] = ()) -> None:
    """Hold ``tensors`` for the function running now, as results of its calls (a checkpoint's
    outputs, returned by its ``autograd.Function``); the ``holders`` (what a checkpoint's
    levels keep of its inputs) are no route out of that function."""
    made = _CURRENT.get()
    if made is not None:
        made.adopt([t for t in tensors if _floating(t)])
        made.holders += holders


def _floating(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())


class Made(TorchFunctionMode):
    """The floating-point tensors a function's torch calls returned, held until :meth:`left`
    (or :meth:`close`). Tensors a call returns that it was given (an in-place operation
    returns its argument) are not the function's: only new objects are held."""

    def __init__(self) -> None:
        super().__init__()
        self._made: list[torch.Tensor] = []
        self._ids: set[int] = set()
        # a tensor held by one list alone, and one whose tensor C++ also holds (a view's base):
        # their reference counts are the baselines (torch may count C++'s hold as a reference)
        base = torch.empty(0)
        self._probes = [torch.empty(0), base]
        self._probe_view = base.view(0)
        self._token: contextvars.Token[Made | None] | None = None
        self._parent: Made | None = None
        self._closed = False
        self.holders: list[Holder] = []

    def __enter__(self) -> Made:
        self._parent = _CURRENT.get()
        self._token = _CURRENT.set(self)
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        if self._token is not None:
            _CURRENT.reset(self._token)
            self._token = None

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if _CURRENT.get() is not self:  # a nested checkpoint's tracker holds it
            return out
        if type(out) in _SEQUENCES or isinstance(out, tuple):  # tuples, named tuples (topk)
            for t in out:
                if _floating(t):
                    self._hold(t, args, kwargs)
        elif _floating(out):
            self._hold(out, args, kwargs)
        return out

    def _hold(self, t: torch.Tensor, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if id(t) in self._ids:
            return
        if any(t is a for a in args) or any(t is v for v in kwargs.values()):
            return  # an argument returned (an in-place operation)
        self._made.append(t)
        self._ids.add(id(t))

    def adopt(self, tensors: Sequence[torch.Tensor]) -> None:
        """Hold ``tensors`` as if this function's calls had returned them (values that left a
        nested checkpoint, and may leave this one too)."""
        if self._closed:  # (a recompute runs in a copy of its forward's context)
            return
        for t in tensors:
            if id(t) not in self._ids:
                self._made.append(t)
                self._ids.add(id(t))

    def left(self, outputs: Sequence[torch.Tensor], ours: Sequence[int] = ()) -> list[torch.Tensor]:
        """The held tensors referenced from anywhere but here, ``outputs`` (the tensors the
        function returned, which the caller holds while asking) and pshard's own machinery
        (``ours``: the ``id`` of the tensor of each reference it holds), in the order they
        were made; lets go of the others."""
        made, self._made, self._ids = self._made, [], set()
        # references known not to be routes out: the outputs, what pshard's holders hold (by
        # id: a loop variable would be one more reference)
        known = collections.Counter(
            [id(t) for t in outputs]
            + list(ours)
            + [id(t) for h in self.holders for t in h.tensors or ()]
        )
        self.holders = []
        made += self._probes
        self._probes = []
        counts = [sys.getrefcount(t) for t in made]
        shared, alone = counts.pop(), counts.pop()
        del made[-2:]
        return [
            t
            for t, n in zip(made, counts, strict=True)
            if n > (shared if compat.use_count(t) > 1 else alone) + known.get(id(t), 0)
        ]

    def close(self, left: Sequence[torch.Tensor] = ()) -> None:
        """Let go of what is held; hand ``left`` (what left this function) to the enclosing
        function's tracker."""
        self._made, self._ids, self._closed, self.holders = [], set(), True, []
        if self._parent is not None and left:
            self._parent.adopt(left)
        self._parent = None

    def index(self) -> dict[int, torch.Tensor]:
        """The held tensors by the ``id`` of the tensor under their ``torch.func`` wrappers."""
        return {id(compat.innermost(t)): t for t in self._made}
