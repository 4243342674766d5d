"""Debug mode: the switch, and mismatched collectives raising instead of hanging."""

from __future__ import annotations

import contextvars
import os
import re
import time

import pytest
import torch
import torch.distributed as dist
from torch import func

import pshard as ps


def test_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PSHARD_DEBUG", raising=False)
    assert not ps.debug_enabled()
    for value, on in (("1", True), ("true", True), ("0", False), ("", False), ("off", False)):
        monkeypatch.setenv("PSHARD_DEBUG", value)
        assert ps.debug_enabled() is on, value
    monkeypatch.setenv("PSHARD_DEBUG", "1")
    with ps.debug(False):
        assert not ps.debug_enabled()  # the explicit switch wins over the environment
        with ps.debug(True):
            assert ps.debug_enabled()
        assert not ps.debug_enabled()
    assert ps.debug_enabled()
    monkeypatch.delenv("PSHARD_DEBUG")

    def as_function() -> tuple[bool, bool]:
        before = ps.debug_enabled()
        ps.debug(True)  # stays on for the rest of this context
        return before, ps.debug_enabled()

    assert contextvars.copy_context().run(as_function) == (False, True)
    assert not ps.debug_enabled()  # the copied context did not leak
    with pytest.raises(TypeError, match=re.escape("debug: enabled must be a bool, got 'yes'")):
        ps.debug("yes")  # type: ignore[arg-type]


def _mismatch_worker() -> dict:
    ps.init_mesh({"x": 2})
    r = dist.get_rank()
    x = torch.ones(3, dtype=torch.float64)
    calls = {
        "shape": lambda: ps.psum(torch.ones(3 + r), "x"),
        "op": lambda: ps.psum(x, "x") if r == 0 else ps.all_gather(x, "x"),
        "dtype": lambda: ps.pmax(x.to(torch.float32 if r else torch.float64), "x"),
        "uneven_gather": lambda: ps.all_gather(torch.ones(2 + r, 3), "x", dim=0),
        "perm": lambda: ps.ppermute(x, "x", [(0, 1)] if r == 0 else [(1, 0)]),
        "args": lambda: ps.all_to_all(torch.ones(2, 2), "x", split_dim=r, concat_dim=0),
    }
    out: dict = {}
    with ps.debug(True):
        for key, call in calls.items():
            start = time.monotonic()
            try:
                call()
            except ValueError as e:
                out[key] = str(e)
            else:
                out[key] = "no error"
            out[key + "_s"] = time.monotonic() - start
        # the axis is still in step, and transforms run with the checks on
        out["after"] = ps.psum(torch.ones(1), "x")
        out["vmap_grad"] = func.vmap(func.grad(lambda v: ps.pmax(v, "x").sum()))(
            torch.arange(4.0).reshape(2, 2) * (r + 1)
        )
    return out


def test_mismatches_raise_on_every_rank(pool) -> None:
    got = pool.run(2, _mismatch_worker)
    for r, res in enumerate(got):
        for key in ("shape", "op", "dtype", "uneven_gather", "perm", "args"):
            assert "(pshard debug mode)" in res[key], (r, key, res[key])
            assert res[key + "_s"] < 5.0, (key, res[key + "_s"])
        torch.testing.assert_close(res["after"], torch.tensor([2.0]))
    # pmax ties (element 0 of row 0) share the summed cotangent 2 evenly
    torch.testing.assert_close(got[0]["vmap_grad"], torch.tensor([[1.0, 0.0], [0.0, 0.0]]))
    torch.testing.assert_close(got[1]["vmap_grad"], torch.tensor([[1.0, 2.0], [2.0, 2.0]]))
    tail = (
        "\nEvery rank of an axis must call the same collectives in the same order, with the "
        "same shapes, dtypes and arguments; without debug mode this would hang or combine "
        "unrelated tensors."
    )
    assert got[1]["shape"] == (
        "psum (pshard debug mode): the 2 ranks of axis 'x' issued different collectives "
        "(this is axis rank 1):\n"
        "  axis rank 0 (global rank 0): psum(shape=(3,), dtype=torch.float32) on axis 'x'\n"
        "  axis rank 1 (global rank 1): psum(shape=(4,), dtype=torch.float32) on axis 'x'" + tail
    )
    assert got[0]["op"] == (
        "psum (pshard debug mode): the 2 ranks of axis 'x' issued different collectives "
        "(this is axis rank 0):\n"
        "  axis rank 0 (global rank 0): psum(shape=(3,), dtype=torch.float64) on axis 'x'\n"
        "  axis rank 1 (global rank 1): all_gather(shape=(3,), dtype=torch.float64, dim=0, "
        "tiled=True) on axis 'x'" + tail
    )
    assert "pmax(shape=(3,), dtype=torch.float32)" in got[0]["dtype"]
    assert (
        "all_gather(shape=(3, 3), dtype=torch.float32, dim=0, tiled=True)"
        in (got[0]["uneven_gather"])
    )
    assert "ppermute(shape=(3,), dtype=torch.float64, perm_code=" in got[0]["perm"]
    assert "split_dim=1, concat_dim=0" in got[0]["args"]


def _env_mismatch_worker() -> None:
    os.environ["PSHARD_DEBUG"] = "1"
    try:
        ps.init_mesh({"x": 2})
        ps.all_gather(torch.ones(2 + dist.get_rank()), "x")
    finally:
        del os.environ["PSHARD_DEBUG"]


def _noop() -> None:
    pass


def test_env_switch_mismatch_errors_within_seconds(pool) -> None:
    pool.run(2, _noop)  # start the pool first: only the failing call is timed
    start = time.monotonic()
    text = "all_gather (pshard debug mode): the 2 ranks of axis 'x' issued different collectives"
    with pytest.raises(ValueError, match=re.escape(text)):
        pool.run(2, _env_mismatch_worker, timeout=60.0)
    assert time.monotonic() - start < 10.0


def _robustness_worker(case: str) -> str:
    os.environ["PSHARD_DEBUG_TIMEOUT"] = "3"
    try:
        ps.init_mesh({"x": 2})
        r = dist.get_rank()
        x = torch.ones(2)
        if case == "structure":
            with ps.debug(True):
                ps.psum([x, x] if r == 0 else [x, x, x], "x")
        elif case == "skipped":
            with ps.debug(True):
                if r == 0:
                    ps.psum(x, "x")
        elif case == "partial":
            with ps.debug(r == 0):
                ps.psum(x, "x")
        return "no error"
    finally:
        del os.environ["PSHARD_DEBUG_TIMEOUT"]


@pytest.mark.parametrize("case", ["structure", "skipped", "partial"])
def test_debug_mode_catches_what_would_hang(procs, case: str) -> None:
    """Pytrees of different structure, a rank that skips a collective, and debug mode on in
    only some ranks are errors naming the ranks within seconds, not hangs."""
    procs.run(2, _noop)
    start = time.monotonic()
    with pytest.raises(ValueError) as info:
        procs.run(2, _robustness_worker, case, timeout=60.0)
    assert time.monotonic() - start < 15.0
    text = str(info.value)
    if case == "structure":
        assert text.startswith(
            "psum (pshard debug mode): the 2 ranks of axis 'x' issued different collectives"
        )
        assert "): a pytree of 2 leaves (structure " in text
        assert "): a pytree of 3 leaves (structure " in text
    else:
        assert text.startswith(
            "psum (pshard debug mode): axis rank 1 (global rank 1) of axis 'x' did not reach "
            "this collective within 3 s (this is axis rank 0)"
        ), text
        assert "debug mode is off on that rank" in text
