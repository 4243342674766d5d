"""Calls made inside a block, found again by the backward passes through them.

A context manager that changes how a model runs (``sequence_parallel`` plugs an attention,
``tensor_parallel`` splits layers) is usually gone by the time the backward pass runs, and
activation checkpointing (``ps.checkpoint``, ``torch.utils.checkpoint``) runs parts of the model
again in that pass. The call therefore records itself with its outputs: every floating output
passes through an identity (:func:`record_for_backward`) whose backward, which runs before
anything inside the call is differentiated, files the call's entry under the running backward
pass (its graph task, :func:`pshard._compat.graph_task_id`) and enters the entry's
``backward_scope()`` (e.g. the model's layers patched again) for the rest of the pass.
:func:`recorded` lists what the running pass filed; the backward pass may run on another thread
(the autograd engine's device threads), where context variables do not reach.

That registry (graph task -> what its pass recorded) is the only state kept outside a context
variable, and no entry outlives its backward pass: the first filing of a pass hands the autograd
engine an end-of-pass callback, which the engine calls when the pass succeeds and drops, with the
graph task, when it fails; a finalizer on the callback ends the pass either way, so the entry
goes (and what ``backward_scope`` changed is undone) also after a backward pass that raised.

Internal interface:

- ``Recorded``: what an entry provides (``backward_scope() -> undo | None``).
- ``record_for_backward(tree, entry)``: the identity on ``tree`` that files ``entry`` for the
  backward pass through it.
- ``recorded()``: the entries the running backward pass filed, in filing order.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, Protocol

import torch

from .._collectives.apply import call
from .._compat import graph_task_id, queue_backward_callback
from .._core.tree import tree_map

__all__ = ["Recorded", "record_for_backward", "recorded"]


class Recorded(Protocol):
    """An entry a call files for the backward pass through it."""

    def backward_scope(self) -> Callable[[], None] | None:
        """Runs when a backward pass through the call begins (its first recorded output is
        differentiated); returns what to undo when that pass ends, or ``None``."""
        ...


class _Pass:
    """What one running backward pass recorded: its entries, and what to undo when it ends."""

    def __init__(self) -> None:
        self.entries: list[Recorded] = []
        self.undo: list[Callable[[], None]] = []


# graph task id of a running backward pass -> what it recorded (see the module docs); written and
# read from the threads the backward passes run on (each dict operation holds the GIL)
_PASSES: dict[int, _Pass] = {}


def _end(task: int) -> None:
    """Backward pass ``task`` ended: forget what it recorded and undo what it changed."""
    done = _PASSES.pop(task, None)
    if done is not None:
        for undo in reversed(done.undo):
            undo()


class _OnEnd:
    """The end-of-pass callback of one graph task. The engine calls it when the pass succeeds
    and drops it with the graph task when the pass fails; its finalizer ends the pass in both
    cases (a second :func:`_end` finds nothing)."""

    def __init__(self, task: int) -> None:
        self.task = task
        weakref.finalize(self, _end, task)

    def __call__(self) -> None:
        _end(self.task)


def _file(entry: Recorded) -> None:
    task = graph_task_id()
    if task < 0:  # pragma: no cover - a backward runs inside a graph task
        return
    live = _PASSES.get(task)
    if live is None:
        live = _PASSES[task] = _Pass()
        queue_backward_callback(_OnEnd(task))
    if entry not in live.entries:
        live.entries.append(entry)
        undo = entry.backward_scope()
        if undo is not None:  # e.g. a model's attention plugged again for the recomputation
            live.undo.append(undo)


class _Record(torch.autograd.Function):
    """The identity; its backward files the entry for the rest of the backward pass."""

    @staticmethod
    def forward(x: torch.Tensor, entry: Recorded) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def setup_context(c: Any, inputs: tuple[Any, ...], output: Any) -> None:
        c.entry = inputs[1]

    @staticmethod
    def backward(c: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        _file(c.entry)
        return g, None

    @staticmethod
    def jvp(c: Any, t: torch.Tensor, _: Any) -> torch.Tensor:
        return t

    @staticmethod
    def vmap(info: Any, in_dims: tuple[Any, ...], x: torch.Tensor, entry: Recorded) -> Any:
        return call(_Record, x, entry), in_dims[0]


def record_for_backward(tree: Any, entry: Recorded) -> Any:
    """``tree`` with every floating tensor passed through an identity whose backward files
    ``entry`` (found by :func:`recorded`) for the rest of that backward pass."""
    return tree_map(
        lambda x: (
            call(_Record, x, entry)
            if isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex())
            else x
        ),
        tree,
    )


def recorded() -> tuple[Recorded, ...]:
    """What the backward pass running in this thread filed (empty outside one)."""
    running = _PASSES.get(graph_task_id())
    return () if running is None else tuple(running.entries)
