"""The private torch APIs of ``ps.checkpoint``, in one place (to move into pshard's compatibility
module).

Each is a small function with the meaning ``ps.checkpoint`` relies on; a torch release that
moves one breaks this module's tests, not the remat machinery far away. Tested on torch 2.13.

- functorch's interpreter stack and wrappers (``torch._C._functorch``,
  ``torch._functorch.pyfunctorch``): which transforms run (:func:`transforms`), a tensor's
  level (:func:`level_of`), unwrapping one level or all of them (:func:`unwrap_level`,
  :func:`wrap_level`, :func:`base_of`), and running code with the innermost transform taken off
  the stack (:func:`lowered`). The backward of a checkpoint recomputes its function with the
  ``grad`` level that runs that backward taken off, so the recompute is recorded only by the
  transforms outside it: recorded there too, it would stay alive until the whole gradient is
  done and nothing would be saved.
- forward-mode AD outside functorch (:func:`forward_ad_active`).
- ``torch.nn.utils.stateless._reparametrize_module`` (what ``torch.func.functional_call`` runs):
  :func:`reparametrized`.
- ``torch._C._distributed_c10d._create_work_from_future``: :func:`completed_work`, the result of
  a collective that the recompute does not issue again.
- ``torch.utils._python_dispatch.TorchDispatchMode``: :data:`TorchDispatchMode`.
- tracing (``torch.compile``, fake tensors, ``make_fx``): :func:`tracing`, when a checkpoint
  runs its function as it is (nothing is recomputed in a trace).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch._C import _functorch as _ft
from torch._functorch.pyfunctorch import coerce_cinterpreter as _coerce
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "TorchDispatchMode",
    "base_of",
    "completed_work",
    "forward_ad_active",
    "is_batched",
    "fake_mode_active",
    "is_fake",
    "level_of",
    "live_wrapper",
    "lowered",
    "reparametrized",
    "top_transform",
    "transforms",
    "tracing",
    "transforms_active",
    "unwrap_dead",
    "unwrap_level",
    "wrap_level",
]

_KINDS = {
    _ft.TransformType.Grad: "grad",
    _ft.TransformType.Jvp: "jvp",
    _ft.TransformType.Vmap: "vmap",
    _ft.TransformType.Functionalize: "functionalize",
}


def tracing(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether this runs in a trace rather than for real: dynamo compiling, a fake-tensor,
    proxy or functionalization mode active, or fake tensors given."""
    if torch.compiler.is_compiling():
        return True
    keys = torch._C._TorchDispatchModeKey
    for key in (keys.FAKE, keys.PROXY, keys.FUNCTIONAL):
        if torch._C._get_dispatch_mode(key) is not None:
            return True
    return any(is_fake(t) for t in tensors)


def fake_mode_active() -> bool:
    """Whether a fake-tensor or proxy (``make_fx``) mode is active."""
    keys = torch._C._TorchDispatchModeKey
    return any(torch._C._get_dispatch_mode(k) is not None for k in (keys.FAKE, keys.PROXY))


def is_fake(t: torch.Tensor) -> bool:
    """Whether ``t`` is a fake tensor (shapes without data, as tracers make)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def transforms_active() -> bool:
    """Whether a ``torch.func`` transform (grad, vjp, jvp, vmap, ...) is running."""
    return bool(torch._C._are_functorch_transforms_active())


def transforms() -> list[tuple[str, int]]:
    """The running ``torch.func`` transforms, outermost first: ``("grad" | "jvp" | "vmap" |
    "functionalize", level)``."""
    stack = _ft.get_interpreter_stack() or []
    return [(_KINDS.get(ci.key(), "other"), ci.level()) for ci in stack]


def top_transform() -> tuple[str, int] | None:
    """The innermost running transform as ``(kind, level)``, or ``None``."""
    ci = _ft.peek_interpreter_stack()
    return None if ci is None else (_KINDS.get(ci.key(), "other"), ci.level())


def forward_ad_active() -> bool:
    """Whether a ``torch.autograd.forward_ad.dual_level`` is open (forward mode outside
    ``torch.func``)."""
    from torch.autograd import forward_ad

    return bool(getattr(forward_ad, "_current_level", -1) >= 0)


def level_of(t: torch.Tensor) -> int:
    """The level of the outermost functorch wrapper of ``t`` (-1 for a plain tensor)."""
    level = _ft.maybe_get_level(t)
    return -1 if level is None else int(level)


def live_wrapper(t: torch.Tensor) -> bool:
    """Whether ``t`` is a functorch wrapper of a transform that is still running."""
    dead = _ft.is_dead_tensor_wrapper(t)  # type: ignore[attr-defined]
    return bool(_ft.is_functorch_wrapped_tensor(t)) and not bool(dead)


def is_batched(t: torch.Tensor) -> bool:
    """Whether ``t`` is a ``vmap`` BatchedTensor."""
    return bool(_ft.is_batchedtensor(t))


def unwrap_dead(t: torch.Tensor) -> torch.Tensor:
    """``t`` without the wrappers of transforms that have returned (a ``vjp``'s saved values
    when its ``vjp_fn`` runs)."""
    return _ft.unwrap_if_dead(t)


def base_of(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor under every functorch wrapper of ``t`` (what a dispatch mode sees)."""
    while _ft.is_functorch_wrapped_tensor(t):
        t = _ft.get_unwrapped(t)
    return t


def unwrap_level(t: torch.Tensor, level: int) -> torch.Tensor:
    """``t`` seen from below the ``grad``/``jvp`` transform ``level`` (``t`` itself when it is not
    wrapped at that level)."""
    return _ft._unwrap_for_grad(t, level)


def wrap_level(t: torch.Tensor, level: int) -> torch.Tensor:
    """``t`` as a value of the ``grad``/``jvp`` transform ``level``, with no history there."""
    return _ft._wrap_for_grad(t, level)


@contextlib.contextmanager
def lowered() -> Iterator[None]:
    """Run the body with the innermost transform taken off the stack, as functorch itself does
    when it hands an operation to the next transform (the grad mode outside a ``grad`` that was
    entered under ``torch.no_grad`` is restored with it)."""
    ci = _ft.peek_interpreter_stack()
    if ci is None:
        yield
        return
    with _coerce(ci).lower():
        yield


@contextlib.contextmanager
def reparametrized(module: torch.nn.Module, tensors: Mapping[str, torch.Tensor]) -> Iterator[None]:
    """Within the block, ``module``'s parameters and buffers named in ``tensors`` are those
    tensors (as in ``torch.func.functional_call``)."""
    from torch.nn.utils.stateless import _reparametrize_module

    with _reparametrize_module(module, dict(tensors), tie_weights=False, strict=False):
        yield


def completed_work(tensors: Sequence[torch.Tensor]) -> Any:
    """A finished ``torch.distributed`` Work whose result is ``tensors``, as a c10d operator
    returns it (the TorchScript object)."""
    from torch._C._distributed_c10d import (  # type: ignore[attr-defined]
        _create_work_from_future,
    )

    fut: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future()
    fut.set_result(list(tensors))
    return _create_work_from_future(fut).boxed()
