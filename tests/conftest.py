"""Shared fixtures (see ``_pool.py``): ``pool`` runs ranks as threads of the test process;
``procs`` on persistent gloo worker processes, for the tests where processes are the point."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from _pool import ThreadPool, WorkerPool


@pytest.fixture(scope="session")
def pool() -> ThreadPool:
    """``pool.run(nprocs, fn, *args, timeout=120.0, **kwargs)`` -> per-rank results."""
    return ThreadPool()


@pytest.fixture(scope="session")
def procs() -> Iterator[WorkerPool]:
    """``pool.run(nprocs, fn, *args, timeout=120.0, **kwargs)`` -> per-rank results."""
    workers = WorkerPool()
    try:
        yield workers
    finally:
        workers.close()
