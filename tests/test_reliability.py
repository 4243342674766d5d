"""Issue 30: mismatched collectives named in seconds, and the last unclear errors.

A rank that skips a collective (it returns, or goes on to another one) and debug mode on in
only some ranks are errors naming the ranks and the collectives within seconds, not the debug
check's 60 s timeout; ``ps.spawn`` of a function read from standard input says what is wrong
before any rank starts; a collective after ``destroy_process_group`` says the group is gone.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist

import pshard as ps
from pshard._runtime.stalls import STUCK_S, Position, Watch

_HERE = os.path.abspath(__file__)


def _noop() -> None:
    pass


def _at(fn: str) -> str:
    """How the errors name a line of this file in ``fn``."""
    return f"called from {fn} ({_HERE}:"


def _default_debug_timeout() -> None:
    os.environ.pop("PSHARD_DEBUG_TIMEOUT", None)  # the default: 60 s


# ---------------------------------------------------------------- functions run in the workers


def _returns_early() -> str:
    _default_debug_timeout()
    ps.init_mesh({"x": 2})
    with ps.debug(True):
        if dist.get_rank() == 0:
            ps.psum(torch.ones(2), "x")  # rank 1 never calls it
    return "left"


def _skips_ahead() -> None:
    _default_debug_timeout()
    ps.init_mesh({"x": 2})
    other = dist.new_group([0, 1])  # another group over the same ranks
    with ps.debug(True):
        if dist.get_rank() == 0:
            ps.psum(torch.ones(2), "x")
            ps.psum(torch.ones(2), other)
        else:  # skips the psum on "x": waits in the next one, for rank 0
            ps.psum(torch.ones(2), other)
            ps.psum(torch.ones(2), "x")


def _debug_in_rank0_only() -> None:
    _default_debug_timeout()
    ps.init_mesh({"x": 2})
    with ps.debug(dist.get_rank() == 0):
        ps.psum(torch.ones(2), "x")


def _after_destroy() -> dict[str, str]:
    ps.init_mesh({"x": 1, "y": 1})
    ps.psum(torch.ones(2), "x")
    dist.destroy_process_group()
    out = {}
    for name, call in (
        ("psum", lambda: ps.psum(torch.ones(2), "x")),
        ("all_gather", lambda: ps.all_gather(torch.ones(2), ("x", "y"))),
    ):
        try:
            call()
        except Exception as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
        else:
            out[name] = "no error"
    return out


# ---------------------------------------------------------------- tests


def _fails_within(pool, seconds: float, fn) -> str:
    pool.run(2, _noop)  # a started gang: only the failing call is timed
    start = time.monotonic()
    with pytest.raises(ps.SpawnError) as info:
        pool.run(2, fn, timeout=90.0)
    assert time.monotonic() - start < seconds
    return str(info.value)


def test_a_rank_that_returns_instead_of_calling_a_collective_is_named(procs) -> None:
    """Rank 0 waits in debug mode's check of a psum that rank 1 never calls: named in seconds
    (it was the check's own timeout, 60 s)."""
    text = _fails_within(procs, 10.0, _returns_early)
    assert text.startswith(
        "pool.run: rank 1 of 2 returned while rank 0 is still waiting in a collective (psum on "
        "axis 'x', in debug mode's check, " + _at("_returns_early")
    ), text
    assert text.endswith(
        ") for more than 3 s: every rank must call the same collectives, and the returning rank "
        "never called this one; all ranks were terminated"
    ), text


def test_a_rank_that_skips_ahead_to_another_collective_is_named(procs) -> None:
    """Rank 1 skips a psum and waits in the next one, on another group, for rank 0, which waits
    for it in the psum it skipped: both named, with where they wait."""
    text = _fails_within(procs, 10.0, _skips_ahead)
    assert text.startswith(
        "pool.run: ranks 0, 1 of 2 wait for each other in different collectives for more than "
        "3 s (rank 0 waits in psum on axis 'x', in debug mode's check, " + _at("_skips_ahead")
    ), text
    assert re.search(
        r"\), for rank 1; rank 1 waits in psum on axis 'group2', in debug mode's check, "
        + re.escape(_at("_skips_ahead"))
        + r"\d+\), for rank 0\): every rank must call the same collectives in the same order, "
        r"and a rank that skips one waits in the next while the others wait for it in the one "
        r"it skipped; all ranks were terminated$",
        text,
    ), text


def test_debug_mode_on_in_some_ranks_only_is_named(procs) -> None:
    """Debug mode on in rank 0 only: rank 0 waits in the check, rank 1 in the collective itself
    (both hung until the check's timeout)."""
    text = _fails_within(procs, 10.0, _debug_in_rank0_only)
    assert text.startswith(
        "pool.run: debug mode is on in rank 0 and off in rank 1 of 2, which wait for each other "
        "for more than 3 s (rank 0 waits in psum on axis 'x', in debug mode's check, "
        + _at("_debug_in_rank0_only")
    ), text
    assert (
        "; rank 1 waits in psum on axis 'x' (all_reduce in distributed_c10d.py), "
        + _at("_debug_in_rank0_only")
        in text
    )
    assert text.endswith(
        "Turn it on in every rank or in none (PSHARD_DEBUG=1 in every rank's environment, or "
        "the same ps.debug(...) in every rank); all ranks were terminated"
    ), text


def test_a_collective_after_destroy_process_group_says_so(pool) -> None:
    """It was torch's "Could not resolve the process group registered under the name 0"."""
    (got,) = pool.run(1, _after_destroy)
    for name, axis in (("psum", "'x'"), ("all_gather", "('x', 'y')")):
        assert got[name] == (
            f"RuntimeError: {name}: the default process group was destroyed "
            f"(torch.distributed.destroy_process_group) or never initialised, so axis {axis} "
            f"has no process group to run on; start one with ps.spawn (local processes), "
            f"torchrun (a job), or ps.init_mesh (a world of one process, or torchrun's "
            f"environment), then make the mesh again"
        ), got[name]


_FROM_STDIN = """
import pshard as ps

def f():
    return 1

if __name__ == "__main__":
    print(ps.spawn(f, nprocs=2, timeout=60))
"""


def test_spawn_of_a_function_read_from_standard_input_says_so() -> None:
    """``python - <<EOF``: the workers cannot import ``fn`` from there; the error said that a
    rank "had not joined the process group", with no word of the cause."""
    proc = subprocess.run(
        [sys.executable, "-"],
        input=textwrap.dedent(_FROM_STDIN),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert (
        "TypeError: spawn: fn 'f' is defined in `python -c`, an interactive session or a "
        "notebook, where the worker processes cannot import it from (they start fresh and import "
        "fn by module and name); run the ranks as threads of this process instead "
        "(backend='threads'), or put fn in a .py file (a module, or the script you run) and "
        "import it"
    ) in proc.stderr, proc.stderr
    assert "joined the process group" not in proc.stderr  # raised before any rank started


# ---------------------------------------------------------------- the rules, single process


def _check(group: str, step: int, members: tuple[int, ...], left_s: float = 60.0) -> Position:
    return Position("check", "psum on axis 'x'", "f (a.py:1)", group, members, step, True, left_s)


def _in(group: str, members: tuple[int, ...], debug: bool | None = None) -> Position:
    what = "all_reduce in distributed_c10d.py"
    return Position("collective", what, "f (a.py:2)", group, members, debug=debug)


def _stall(seen: dict[int, Position], returned: tuple[int, ...] = (), for_s: float = STUCK_S):
    """What a Watch says of ranks seen at the same place for ``for_s`` seconds."""
    watch = Watch(4, "spawn")
    for now in (0.0, for_s):
        for rank, where in seen.items():
            watch.see(rank, where, now)
    return watch.stall(set(seen), set(returned), for_s)


def test_stall_rules() -> None:
    computing = Position("computing")
    # waits for a rank that returned
    text = _stall({0: _check("g", 5, (0, 1))}, returned=(1,))
    assert text is not None and text.startswith(
        "spawn: rank 1 of 4 returned while rank 0 is still waiting in a collective (psum on axis "
        "'x', in debug mode's check, called from f (a.py:1)) for more than 3 s"
    )
    # a rank that returned outside the group waited on, while the rank waited for computes
    assert _stall({0: _in("g", (0, 1)), 1: computing}, returned=(3,)) is None
    # not at the same place for long enough; a check about to report itself
    assert _stall({0: _check("g", 5, (0, 1))}, returned=(1,), for_s=STUCK_S - 0.1) is None
    assert _stall({0: _check("g", 5, (0, 1), left_s=1.0)}, returned=(1,)) is None
    # each waits in a check on a different group for the other
    text = _stall({0: _check("g1", 5, (0, 1)), 1: _check("g2", 0, (0, 1))})
    assert text is not None and text.startswith(
        "spawn: ranks 0, 1 of 4 wait for each other in different collectives for more than 3 s "
        "(rank 0 waits in psum on axis 'x', in debug mode's check, called from f (a.py:1), for "
        "rank 1; rank 1 waits in "
    )
    # a chain that ends in a computing rank may still move
    assert _stall({0: _check("g1", 5, (0, 1)), 1: _check("g2", 0, (1, 2)), 2: computing}) is None
    # waiting for ranks in a collective that is under way (all its ranks are in it)
    assert _stall({0: _check("g1", 5, (0, 2)), 1: _in("g2", (1, 2)), 2: _in("g2", (1, 2))}) is None
    # debug mode off in the rank waited for, which waits in the collective itself
    text = _stall({0: _check("g", 5, (0, 1)), 1: _in("g", (0, 1), debug=False)})
    assert text is not None and text.startswith(
        "spawn: debug mode is on in rank 0 and off in rank 1 of 4, which wait for each other"
    )
    # the same without debug mode's checks: not known from outside
    assert _stall({0: _in("g1", (0, 1)), 1: _in("g2", (0, 1))}) is None
