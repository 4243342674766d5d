"""A lost rank under torchrun --max-restarts: the restarted attempt joins fresh process groups
(the store's keys of the lost attempt under another prefix: gloo no longer tries to connect to
the ranks that are gone), resumes from the last checkpoint the ranks switched in (the old or
the new one, whole) and ends with the weights of a run that was never interrupted, bit for bit.
A rank that never comes is an error after PSHARD_INIT_TIMEOUT, not a wait of 30 minutes."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import elastic_train

import pshard as ps

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "elastic_train.py"


def _torchrun(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> Any:
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
        cwd=HERE,
    )


def _finals(out: str) -> list[list[float]]:
    """Each rank's final weights (the ranks' lines may run into each other)."""
    return sorted(json.loads(m) for m in re.findall(r"FINAL (\[[^\]]*\])", out))


def test_a_rank_lost_after_an_async_save_restarts_and_continues(tmp_path: Path) -> None:
    start = time.monotonic()
    lost = _torchrun(
        "--nproc-per-node", "2", "--max-restarts", "1", "--monitor-interval", "0.2",
        str(SCRIPT), str(tmp_path / "ckpt"), "3",
    )  # fmt: skip
    assert lost.returncode == 0, lost.stdout[-3000:] + lost.stderr[-3000:]
    assert time.monotonic() - start < 90
    # the run never interrupted, on thread ranks (no reduction in the math: bit for bit)
    want = sorted(ps.spawn(elastic_train.run, str(tmp_path / "whole"), 0, nprocs=2,
                           backend="threads"))  # fmt: skip
    got = _finals(lost.stdout)
    assert len(got) == 2
    assert got == want  # the same floats: bit for bit


def test_a_rank_that_never_joins_is_an_error_in_seconds(tmp_path: Path) -> None:
    """Two ranks promised, one started: init_mesh gives up after PSHARD_INIT_TIMEOUT with an
    error that says why."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = "import pshard as ps; ps.init_mesh({'dp': 2})"
    env = {
        **os.environ,
        "RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        "LOCAL_RANK": "0", "PSHARD_INIT_TIMEOUT": "3",
    }  # fmt: skip
    start = time.monotonic()
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, timeout=60)  # fmt: skip
    assert run.returncode != 0
    assert time.monotonic() - start < 30
    assert "did not all join the process groups within 3 s" in run.stderr, run.stderr[-2000:]
