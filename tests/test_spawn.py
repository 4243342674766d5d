"""ps.spawn: fresh processes with a process group, results, failures and teardown."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import re
import time

import pytest
import torch
import torch.distributed as dist

import pshard as ps
from pshard._runtime.spawn import RemoteTraceback
from pshard._runtime.stalls import STUCK_S


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _assert_all_gone(pids):
    assert pids and all(_gone(pid) for pid in pids), pids
    assert not set(pids) & {p.pid for p in multiprocessing.active_children()}


def _pids(directory, nprocs):
    return [int((directory / f"{r}.pid").read_text()) for r in range(nprocs)]


def _write_pid(directory):
    (directory / f"{dist.get_rank()}.pid").write_text(str(os.getpid()))


# ---------------------------------------------------------------- functions run in the ranks


def _describe(offset, scale):
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    gathered = [torch.zeros(1) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, torch.tensor([offset + scale * dist.get_rank()]))
    return {
        "rank": dist.get_rank(),
        "world": dist.get_world_size(),
        "backend": str(dist.get_backend()),
        "sum": t.item(),
        "gathered": [g.item() for g in gathered],
        "pid": os.getpid(),
        "ppid": os.getppid(),
    }


def _raise_on_rank1(directory):
    _write_pid(directory)
    if dist.get_rank() == 1:
        raise ValueError("rank 1 could not go on")
    dist.all_reduce(torch.ones(1))  # rank 0 blocks here


def _exit_on_rank1(directory):
    _write_pid(directory)
    if dist.get_rank() == 1:
        os._exit(3)
    dist.all_reduce(torch.ones(1))


def _hang(directory):
    _write_pid(directory)
    time.sleep(600)


# ---------------------------------------------------------------- tests


def test_results_args_and_process_group():
    results = ps.spawn(_describe, 10.0, 2.0, nprocs=3, backend="gloo")
    assert [(r["rank"], r["world"], r["backend"], r["sum"]) for r in results] == [
        (r, 3, "gloo", 3.0) for r in range(3)
    ]
    assert all(r["gathered"] == [10.0, 12.0, 14.0] for r in results)
    assert all(r["ppid"] == os.getpid() for r in results)
    _assert_all_gone([r["pid"] for r in results])


def test_exception_reraised_with_rank_and_remote_traceback(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(ValueError) as info:
        ps.spawn(_raise_on_rank1, tmp_path, nprocs=2, timeout=60)
    assert str(info.value) == "rank 1 could not go on"  # the original exception, as it was
    assert time.monotonic() - t0 < 30
    pids = _pids(tmp_path, 2)
    assert info.value.__notes__ == [
        f"spawn: raised in rank 1 of 2 (pid {pids[1]}); rank 0 was still running 1 s after the "
        "failure (probably blocked in a collective) and was terminated"
    ]
    cause = info.value.__cause__
    assert isinstance(cause, RemoteTraceback)
    assert str(cause).startswith(f"\n\n--- rank 1 of 2 (pid {pids[1]}) ---\nTraceback")
    assert 'test_spawn.py", line' in str(cause) and "in _raise_on_rank1" in str(cause)
    assert str(cause).endswith("ValueError: rank 1 could not go on\n")
    _assert_all_gone(pids)


def test_rank_exit_tears_everything_down(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(ps.SpawnError) as info:
        ps.spawn(_exit_on_rank1, tmp_path, nprocs=2, timeout=60)
    assert time.monotonic() - t0 < 30
    pids = _pids(tmp_path, 2)
    # rank 0 then fails in its all_reduce, or is still blocked and torn down
    assert str(info.value).startswith(
        f"spawn: rank 1 of 2 (pid {pids[1]}) exited with code 3 without returning; rank 0 "
    )
    _assert_all_gone(pids)


def test_hang_times_out_and_tears_everything_down(tmp_path):
    timeout = 8.0  # start-up (2 imports of torch on a loaded machine) fits well inside
    t0 = time.monotonic()
    with pytest.raises(
        TimeoutError,
        match=re.escape(
            "spawn: ranks 0, 1 of 2 still running after the timeout of 8 s; all ranks were "
            "terminated"
        ),
    ):
        ps.spawn(_hang, tmp_path, nprocs=2, timeout=timeout)
    elapsed = time.monotonic() - t0
    assert timeout <= elapsed < timeout + 4
    _assert_all_gone(_pids(tmp_path, 2))


def _local_function_factory():
    def inner():
        return 0

    return inner


@pytest.mark.parametrize(
    ("kwargs", "error", "text"),
    [
        ({"nprocs": 0}, ValueError, "spawn: nprocs must be an int >= 1, got 0"),
        ({"nprocs": 2.0}, ValueError, "spawn: nprocs must be an int >= 1, got 2.0"),
        ({"nprocs": 2, "timeout": 0}, ValueError, "spawn: timeout must be a number of seconds > 0"),
        (
            {"nprocs": 2, "backend": "mpi"},
            ValueError,
            "spawn: backend must be 'gloo', 'nccl' or 'threads'",
        ),
    ],
)
def test_argument_errors(kwargs, error, text):
    with pytest.raises(error, match=re.escape(text)):
        ps.spawn(dist.get_rank, **kwargs)


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="needs fewer than 2 GPUs")
def test_nccl_needs_a_gpu_per_rank():
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"spawn: backend 'nccl' needs one GPU per rank, but nprocs=2 and "
            f"{torch.cuda.device_count()} GPUs are visible; use backend='gloo' or fewer ranks"
        ),
    ):
        ps.spawn(dist.get_rank, nprocs=2, backend="nccl")


def test_unpicklable_fn_or_args_rejected_early():
    children = multiprocessing.active_children()
    with pytest.raises(TypeError, match=re.escape("spawn: fn '<lambda>' is a lambda or a")):
        ps.spawn(eval("lambda: 0"), nprocs=2)
    with pytest.raises(
        TypeError,
        match=re.escape(
            "spawn: fn '_local_function_factory.<locals>.inner' is a lambda or a function defined "
            "inside another function, which cannot be pickled into the worker processes; define "
            "it at the top level of a module"
        ),
    ):
        ps.spawn(_local_function_factory(), nprocs=2)
    with pytest.raises(TypeError, match=re.escape("spawn: fn must be callable, got int")):
        ps.spawn(3, nprocs=2)
    with pytest.raises(
        TypeError, match=re.escape("spawn: the arguments of fn cannot be pickled into the worker")
    ) as info:
        ps.spawn(_describe, (x for x in ()), 1.0, nprocs=2)
    assert isinstance(info.value.__cause__, (TypeError, pickle.PicklingError))
    assert multiprocessing.active_children() == children  # nothing was started


def _sys_exit_on_rank1():
    if dist.get_rank() == 1:
        import sys

        sys.exit(0)
    return "done"


def test_sys_exit_in_a_rank_is_an_error_not_a_silent_success():
    """sys.exit(0) in one rank used to be re-raised in the caller as SystemExit(0): the caller
    exited 0 with no output."""
    t0 = time.monotonic()
    with pytest.raises(
        ps.SpawnError, match=re.escape("fn called sys.exit(0) in rank 1 of 2; return from fn")
    ):
        ps.spawn(_sys_exit_on_rank1, nprocs=2, timeout=60)
    assert time.monotonic() - t0 < 30


_ORPHAN_CALLER = r"""
import os, sys, time
import torch.distributed as dist
import pshard as ps

def hang(directory):
    with open(os.path.join(directory, f"{dist.get_rank()}.pid"), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(600)

if __name__ == "__main__":
    ps.spawn(hang, sys.argv[1], nprocs=2, timeout=600)
"""


def test_no_rank_outlives_a_killed_caller(tmp_path):
    """SIGKILL the process that called spawn: every rank ends within seconds (no orphans)."""
    import signal
    import subprocess
    import sys

    script = tmp_path / "caller.py"
    script.write_text(_ORPHAN_CALLER)
    caller = subprocess.Popen([sys.executable, str(script), str(tmp_path)])
    try:
        deadline = time.monotonic() + 120
        while not all((tmp_path / f"{r}.pid").exists() for r in range(2)):
            assert time.monotonic() < deadline, "the ranks did not start"
            time.sleep(0.2)
        time.sleep(0.5)  # the pid files are written: let the writes finish
        pids = _pids(tmp_path, 2)
        caller.send_signal(signal.SIGKILL)
        caller.wait()
        t0 = time.monotonic()
        while not all(_gone(pid) for pid in pids) and time.monotonic() - t0 < 10:
            time.sleep(0.1)
        assert all(_gone(pid) for pid in pids), "ranks outlived their caller"
        assert time.monotonic() - t0 < 10
    finally:
        caller.kill()


def test_scripts_without_a_main_guard_and_functions_from_python_c(tmp_path):
    """The two usual first mistakes say what is wrong and how to fix it (they were raw
    multiprocessing errors, or every rank dying with exit code 1)."""
    import subprocess
    import sys

    script = tmp_path / "no_guard.py"
    script.write_text("import pshard as ps\ndef f():\n    return 1\nps.spawn(f, nprocs=2)\n")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert proc.returncode != 0
    assert (
        f"RuntimeError: spawn is called at the top level of {script} (line 4) without "
        '`if __name__ == "__main__":`'
    ) in proc.stderr
    code = "import pshard as ps\ndef f():\n    return 1\nps.spawn(f, nprocs=2)\n"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert proc.returncode != 0
    assert (
        "TypeError: spawn: fn 'f' is defined in `python -c`, an interactive session or a notebook"
    ) in proc.stderr
    guarded = tmp_path / "guarded.py"
    guarded.write_text(
        "import pshard as ps\ndef f():\n    return 1\n"
        "if __name__ == '__main__':\n    print(ps.spawn(f, nprocs=2))\n"
    )
    proc = subprocess.run([sys.executable, str(guarded)], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert proc.returncode == 0 and proc.stdout.strip() == "[1, 1]", proc.stderr


def _abort_on_rank1():
    if dist.get_rank() == 1:
        os.abort()
    return 0


def test_an_abort_suggests_debug_mode():
    with pytest.raises(ps.SpawnError) as info:
        ps.spawn(_abort_on_rank1, nprocs=2, timeout=60)
    assert "killed by signal 6 (SIGABRT) (an abort in the communication library" in str(info.value)
    assert "rerun with PSHARD_DEBUG=1" in str(info.value)


def _return_early_on_rank1():
    if dist.get_rank() == 1:
        return "left"
    dist.all_reduce(torch.ones(1))  # rank 0 waits here for a rank that already returned
    return "done"


def _uneven_work():
    if dist.get_rank() == 1:
        time.sleep(
            STUCK_S + 0.5
        )  # computing for longer than the stall threshold, not waiting: fine
    return dist.get_rank()


def test_a_rank_returning_while_a_peer_waits_is_an_error_within_seconds(procs):
    t0 = time.monotonic()
    with pytest.raises(ps.SpawnError) as info:
        ps.spawn(_return_early_on_rank1, nprocs=2, timeout=120)
    assert time.monotonic() - t0 < 30
    text = str(info.value)
    assert text.startswith(
        "spawn: rank 1 of 2 returned while rank 0 is still waiting in a collective"
    ), text
    assert "all_reduce" in text and "_return_early_on_rank1" in text
    # uneven work without a collective waiting is fine (the same watch, on the pool's warm
    # processes)
    assert procs.run(2, _uneven_work) == [0, 1]
