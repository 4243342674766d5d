"""Checks across ranks, on 2 and 4 gloo ranks: ranks that load parts of one value read the
same save (one rank's path switched between the two ranks' opens), a damaged chunk read by one
rank fails every rank, copies that differ where a value is replicated (whole tensors and
replicated GlobalTensors at ps.save, whole values at ps.shard, global shapes at ps.from_local)
are errors naming the key path and the ranks, always (debug mode off).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import pshard as ps
import pshard._state.atomic as atomic
import pshard._state.read as read_mod
from pshard._state.load import load
from pshard._state.save import save

P = ps.P


def _value(i: int) -> dict[str, Any]:
    return {"w": ps.shard(torch.arange(8.0) + 100 * i, P("dp")), "step": i}


def _different_saves_worker(path: str, other: str) -> list[Any]:
    """Rank 1 opens ``path`` after it was switched to another save than the one rank 0
    opened; both must end up reading one save."""
    ps.init_mesh({"dp": 2})
    save(path, _value(1))
    save(other, _value(2))
    rank = dist.get_rank()
    original = read_mod.OpenedCheckpoint
    first: list[bool] = []

    def opening(*args: Any, **kwargs: Any) -> Any:
        if first:
            return original(*args, **kwargs)
        first.append(True)
        if rank == 0:
            out = original(*args, **kwargs)
            dist.barrier()
            dist.barrier()
            return out
        dist.barrier()
        assert atomic._exchange(Path(path), Path(other))
        dist.barrier()
        return original(*args, **kwargs)

    read_mod.OpenedCheckpoint = opening  # type: ignore[misc]
    try:
        back = load(path, _value(0))
    finally:
        read_mod.OpenedCheckpoint = original  # type: ignore[misc]
    return [back["step"], ps.gather(back["w"]).tolist()]


def test_ranks_reading_parts_of_one_value_read_one_save(pool: Any, tmp_path: Path) -> None:
    got = pool.run(2, _different_saves_worker, str(tmp_path / "a"), str(tmp_path / "b"))
    assert got[0] == got[1] == [2, (torch.arange(8.0) + 200).tolist()]


def _damaged_worker(path: str) -> str:
    ps.init_mesh({"dp": 2})
    save(path, _value(1))
    if dist.get_rank() == 0:  # rank 1's block is in rank 1's file
        with open(Path(path) / "__1_0.distcp", "r+b") as f:
            f.seek(-40, 2)
            byte = f.read(1)
            f.seek(-40, 2)
            f.write(bytes([byte[0] ^ 0xFF]))
    dist.barrier()
    try:
        load(path, _value(0))
    except (ValueError, RuntimeError) as e:
        return f"{type(e).__name__}: {e}"
    return "loaded"


def test_a_damaged_chunk_on_one_rank_fails_every_rank(pool: Any, tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    got = pool.run(2, _damaged_worker, path)
    assert got[1].startswith("ValueError: load: the checkpoint at ") and "'__1_0.distcp'" in got[1]
    assert got[0] == (
        f"RuntimeError: load: rank 1 could not read the checkpoint at {path!r} (its error says "
        f"why); every rank that reads it fails with it"
    )
