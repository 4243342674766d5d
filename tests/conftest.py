"""Shared fixtures. ``pool``: persistent multi-process gloo workers (see ``_pool.py``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from _pool import WorkerPool


@pytest.fixture(scope="session")
def pool() -> Iterator[WorkerPool]:
    """``pool.run(nprocs, fn, *args, timeout=120.0, **kwargs)`` -> per-rank results."""
    workers = WorkerPool()
    try:
        yield workers
    finally:
        workers.close()
