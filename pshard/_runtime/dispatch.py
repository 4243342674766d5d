"""What dispatch modes see of the in-process transport: one operator per operation.

A gloo process group's operations pass through the dispatcher as ``torch.ops.c10d`` operators
(``allreduce_`` writing its first argument, ...), which is what ``ps.checkpoint`` records of a
collective (and what its policies keep or run again). A process group written in Python is
called around the dispatcher, so each of the in-process transport's operations runs as the
kernel of an operator of its own, of the same name and convention, in the namespace
:data:`OPS_NAMESPACE`: :func:`dispatched` calls the operator, whose kernel posts the operation;
when a dispatch mode replays the operator instead of running it, nothing is posted.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["OPS_NAMESPACE", "dispatched"]

#: The namespace of the transport's operators (``torch.ops.pshard_threads.allreduce_``, ...).
OPS_NAMESPACE = "pshard_threads"

_SCHEMAS = {
    "allreduce_": "(Tensor(a!)[] tensors, int call) -> ()",
    "_allgather_base_": "(Tensor(a!) output, Tensor input, int call) -> ()",
    "allgather_": "(Tensor(a!)[] outputs, Tensor[] inputs, int call) -> ()",
    "_reduce_scatter_base_": "(Tensor(a!) output, Tensor input, int call) -> ()",
    "reduce_scatter_": "(Tensor(a!)[] outputs, Tensor[] inputs, int call) -> ()",
    "alltoall_base_": "(Tensor(a!) output, Tensor input, int call) -> ()",
    "alltoall_": "(Tensor(a!)[] outputs, Tensor[] inputs, int call) -> ()",
    "broadcast_": "(Tensor(a!)[] tensors, int call) -> ()",
    "reduce_": "(Tensor(a!)[] tensors, int call) -> ()",
    "gather_": "(Tensor(a!)[] outputs, Tensor[] inputs, int call) -> ()",
    "scatter_": "(Tensor(a!)[] outputs, Tensor[] inputs, int call) -> ()",
    "barrier": "(int call) -> ()",
    "send": "(Tensor[] tensors, int call) -> ()",
    "recv_": "(Tensor(a!)[] tensors, int call) -> ()",
}

# the operation the operator's kernel is about to post, and what it posted (this context's)
_POSTING: contextvars.ContextVar[Callable[[], Any] | None] = contextvars.ContextVar(
    "pshard_threads_posting", default=None
)
_POSTED: contextvars.ContextVar[Any] = contextvars.ContextVar("pshard_threads_posted", default=None)


def _post(*args: Any) -> None:
    post = _POSTING.get()
    if post is not None:
        _POSTED.set(post())


_LIBRARY = torch.library.Library(OPS_NAMESPACE, "DEF")
for _name, _schema in _SCHEMAS.items():
    _LIBRARY.define(_name + _schema)
    _LIBRARY.impl(_name, _post, "CompositeExplicitAutograd")
    torch.library.register_fake(f"{OPS_NAMESPACE}::{_name}", lambda *args: None, lib=_LIBRARY)


def dispatched(name: str, args: tuple[Any, ...], post: Callable[[], Any]) -> Any:
    """``post()`` run as the kernel of the operator ``name`` on ``args``; what it returned, or
    ``None`` when a dispatch mode replayed the operator instead (fake tensors included)."""
    posting, posted = _POSTING.set(post), _POSTED.set(None)
    try:
        getattr(getattr(torch.ops, OPS_NAMESPACE), name)(*args, 0)
        return _POSTED.get()
    finally:
        _POSTING.reset(posting)
        _POSTED.reset(posted)
