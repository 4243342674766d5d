"""Named ranges in a profiler's trace: where pshard's time goes (``torch.profiler``).

Every collective of the wire is a range ``pshard.<op>[<axis>]`` (``pshard.all_gather[dp]``,
``pshard.psum[tp]``), a ``sharded_call`` unit ``pshard.unit[<name>]``, a pipeline action
``pshard.stage[<i>].mb[<j>].F`` (``B``, ``I``, ``W``), a checkpoint's recompute
``pshard.recompute[<name>]``: a Chrome trace shows them beside torch's operators.

With no profiler running a range costs one check of a flag (the name is not even made:
:func:`ranged` takes a function that makes it). torch's profiler records the thread that
started it; in-process ranks (``ps.spawn(..., backend="threads")``) are threads of their own,
recorded when the caller profiles the spawn with ``profile_all_threads`` (docs/profiling.md).

Internal interface: :func:`ranged`, :func:`profiling`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from .._compat import profiler_enabled

__all__ = ["profiling", "ranged"]

_NOTHING = contextlib.nullcontext()  # stateless: one for every range while no profiler runs


def profiling() -> bool:
    """Whether a profiler records now."""
    return profiler_enabled()


def ranged(name: Callable[[], str]) -> contextlib.AbstractContextManager[Any]:
    """A range named ``name()`` in the profiler's trace, or nothing when none records."""
    if not profiling():
        return _NOTHING
    return torch.profiler.record_function(name())
