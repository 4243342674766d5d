"""The multi-process test harness (``pool`` fixture, tests/_pool.py)."""

from __future__ import annotations

import contextvars
import os
import re
import signal
import time

import pytest
import torch
import torch.distributed as dist

import pshard as ps
from pshard._runtime.spawn import RemoteTraceback

_VAR: contextvars.ContextVar[str] = contextvars.ContextVar("test_pool_var", default="unset")


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


# ---------------------------------------------------------------- functions run in the workers


def _rank_info(offset, *, scale=1):
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return (
        dist.get_rank(),
        dist.get_world_size(),
        offset + scale * dist.get_rank(),
        t.item(),
        str(dist.get_backend()),
        torch.get_num_threads(),
        os.getpid(),
    )


def _dirty_state():
    _VAR.set("set")
    ps.init_mesh()
    torch.set_default_dtype(torch.float64)
    torch.set_grad_enabled(False)
    torch.rand(3)  # advance the generator
    return torch.rand(2)


def _read_state():
    try:
        ps.current_mesh()
        mesh = "leaked"
    except RuntimeError:
        mesh = "none"
    return _VAR.get(), mesh, torch.get_default_dtype(), torch.is_grad_enabled(), torch.rand(5)


def _seeded():
    return torch.rand(5)


def _raise_on_rank1():
    if dist.get_rank() == 1:
        raise ValueError(f"bad value on rank {dist.get_rank()}")
    return dist.get_rank()


def _raise_everywhere():
    raise KeyError(f"missing on rank {dist.get_rank()}")


class _Unpicklable(Exception):
    def __init__(self, a, b):  # pickling re-creates it with one argument: fails
        super().__init__(f"{a}/{b}")


def _raise_unpicklable():
    raise _Unpicklable(1, 2)


def _return_unpicklable():
    return lambda: None


def _raise_while_others_wait():
    if dist.get_rank() == 1:
        raise ValueError("rank 1 gives up")
    dist.all_reduce(torch.ones(1))  # blocks: rank 1 never joins
    return "unreachable"


def _exit_on_rank1():
    if dist.get_rank() == 1:
        os._exit(3)
    dist.all_reduce(torch.ones(1))


def _kill_self():
    os.kill(os.getpid(), signal.SIGKILL)


def _sleep(seconds):
    time.sleep(seconds)


def _destroy_group():
    dist.destroy_process_group()


def _is_initialized():
    return dist.is_initialized(), dist.get_world_size()


# ---------------------------------------------------------------- tests


@pytest.mark.parametrize("nprocs", [1, 2, 4])
def test_results_in_rank_order(procs, nprocs):
    results = procs.run(nprocs, _rank_info, 10, scale=3)
    total = float(sum(range(nprocs)))
    assert [r[:6] for r in results] == [
        (r, nprocs, 10 + 3 * r, total, "gloo", 1) for r in range(nprocs)
    ]
    pids = [r[6] for r in results]
    assert len(set(pids)) == nprocs and os.getpid() not in pids
    assert procs.pids(nprocs) == pids
    # the gang is reused by the next call
    assert [r[6] for r in procs.run(nprocs, _rank_info, 0)] == pids


def test_state_isolated_between_calls(procs):
    expected = _seeded_reference()
    first = procs.run(2, _dirty_state)
    assert all(x.dtype == torch.float64 for x in first)
    for var, mesh, dtype, grad, rand in procs.run(2, _read_state):
        assert (var, mesh, dtype, grad) == ("unset", "none", torch.float32, True)
        torch.testing.assert_close(rand, expected)


def _seeded_reference():
    torch.manual_seed(0)
    out = torch.rand(5)
    torch.manual_seed(torch.seed())
    return out


def test_exception_in_one_rank_keeps_the_pool(procs):
    pids = [r[6] for r in procs.run(2, _rank_info, 0)]
    with pytest.raises(ValueError, match=re.escape("bad value on rank 1")) as info:
        procs.run(2, _raise_on_rank1)
    exc = info.value
    assert exc.__notes__ == [f"pool.run: raised in rank 1 of 2 (pid {pids[1]})"]
    assert isinstance(exc.__cause__, RemoteTraceback)
    text = str(exc.__cause__)
    assert f"--- rank 1 of 2 (pid {pids[1]}) ---" in text
    assert "in _raise_on_rank1" in text and "ValueError: bad value on rank 1" in text
    # every rank finished: the same workers serve the next call
    assert [r[6] for r in procs.run(2, _rank_info, 0)] == pids


def test_exception_in_every_rank(procs):
    with pytest.raises(KeyError, match="missing on rank 0") as info:
        procs.run(4, _raise_everywhere)
    note = info.value.__notes__[0]
    assert note.startswith("pool.run: raised in rank 0 of 4 (pid ")
    assert note.endswith("; rank 1 also raised KeyError; rank 2 also raised KeyError; "
                         "rank 3 also raised KeyError")  # fmt: skip
    text = str(info.value.__cause__)
    assert all(f"--- rank {r} of 4 " in text for r in range(4))
    assert procs.run(4, _is_initialized) == [(True, 4)] * 4


def test_unpicklable_exception_and_result(procs):
    with pytest.raises(ps.SpawnError) as info:
        procs.run(2, _raise_unpicklable)
    assert re.match(
        r"pool\.run: raised in rank 0 of 2 \(pid \d+\): test_pool\._Unpicklable: 1/2 \(the "
        r"exception could not be re-created here; its traceback is attached\); rank 1 also "
        r"raised _Unpicklable$",
        str(info.value),
    )
    assert "in _raise_unpicklable" in str(info.value.__cause__)
    with pytest.raises(Exception, match="pickle") as info:
        procs.run(2, _return_unpicklable)
    assert "while pickling the return value to send it back" in info.value.__notes__
    assert procs.run(2, _is_initialized) == [(True, 2)] * 2


def test_failure_while_others_block_restarts_the_pool(procs):
    pids = [r[6] for r in procs.run(2, _rank_info, 0)]
    starts = procs.starts[2]
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="rank 1 gives up") as info:
        procs.run(2, _raise_while_others_wait)
    assert time.monotonic() - t0 < 5
    assert info.value.__notes__ == [
        f"pool.run: raised in rank 1 of 2 (pid {pids[1]}); rank 0 was still running 1 s after "
        "the failure (probably blocked in a collective) and was terminated"
    ]
    assert all(_gone(pid) for pid in pids)
    results = procs.run(2, _rank_info, 0)  # a fresh gang, working
    assert [r[3] for r in results] == [1.0, 1.0]
    assert procs.starts[2] == starts + 1 and not set(pids) & {r[6] for r in results}


def test_rank_death_restarts_the_pool(procs):
    pids = [r[6] for r in procs.run(2, _rank_info, 0)]
    with pytest.raises(ps.SpawnError) as info:
        procs.run(2, _exit_on_rank1)
    # rank 0 either fails in its collective or is torn down; the death is reported first
    assert str(info.value).startswith(
        f"pool.run: rank 1 of 2 (pid {pids[1]}) exited with code 3 without returning"
    )
    assert all(_gone(pid) for pid in pids)
    assert [r[3] for r in procs.run(2, _rank_info, 0)] == [1.0, 1.0]


def test_signal_death_and_timeout_restart_the_pool(procs):
    (pid,) = [r[6] for r in procs.run(1, _rank_info, 0)]
    with pytest.raises(
        ps.SpawnError,
        match=re.escape(
            f"pool.run: rank 0 of 1 (pid {pid}) was killed by signal 9 (SIGKILL) without returning"
        ),
    ):
        procs.run(1, _kill_self)
    assert _gone(pid)
    (pid,) = [r[6] for r in procs.run(1, _rank_info, 0)]
    t0 = time.monotonic()
    with pytest.raises(
        TimeoutError,
        match=re.escape(
            "pool.run: rank 0 of 1 still running after the timeout of 1.5 s; all ranks were "
            "terminated"
        ),
    ):
        procs.run(1, _sleep, 60, timeout=1.5)
    assert 1.5 <= time.monotonic() - t0 < 5
    assert _gone(pid)
    assert procs.run(1, _is_initialized) == [(True, 1)]


def test_destroyed_group_restarts_the_pool(procs):
    procs.run(1, _is_initialized)
    starts = procs.starts[1]
    procs.run(1, _destroy_group)
    assert procs.run(1, _is_initialized) == [(True, 1)]
    assert procs.starts[1] == starts + 1


def test_rejects_local_functions_before_running(procs):
    def local():
        return 1

    with pytest.raises(TypeError, match=re.escape("pool.run: fn 'test_rejects_local_functions")):
        procs.run(2, local)
    with pytest.raises(TypeError, match="is a lambda or a function defined inside another"):
        procs.run(2, lambda: 1)
    with pytest.raises(ValueError, match=re.escape("pool.run: nprocs must be an int >= 1, got 0")):
        procs.run(0, _rank_info, 0)
