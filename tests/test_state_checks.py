"""Checks across ranks, on 2 and 4 gloo ranks: ranks that load parts of one value read the
same save (one rank's path switched between the two ranks' opens), a damaged chunk read by one
rank fails every rank, copies that differ where a value is replicated (whole tensors and
replicated GlobalTensors at ps.save, whole values at ps.shard, global shapes at ps.from_local)
are errors naming the key path and the ranks, always (debug mode off).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
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


# --------------------------------------------------------------------------- copies at save


def _copies_worker(path: str) -> list[str]:
    grid = ps.init_mesh({"dp": 2, "tp": 2})
    rank, dp = dist.get_rank(), grid.get_local_rank("dp")
    ok = ps.from_local(torch.full((1, 2), float(dp)), P("dp"), global_shapes=(2, 2))
    # P("dp") replicates the block over "tp": ranks 2 and 3 hold dp=1's block, but differ
    bad = ps.from_local(ok.local + (rank == 3), P("dp"), global_shapes=(2, 2))
    out = []
    for tree in (
        # per-rank moments as plain tensors (an optimizer library's), even shapes
        {"opt": {"m": torch.full((4,), float(rank // 2))}, "step": 1},
        {"b": ps.shard(torch.ones(2), P()), "model": {"w": bad}},
    ):
        with pytest.raises(ValueError) as info:
            save(path, tree)
        out.append(str(info.value))
    assert not Path(path).exists()
    save(path, {"model": {"w": ok}})  # its blocks differ only over "dp", which splits it
    back = load(path, {"model": {"w": ps.shard(torch.zeros(2, 2), P())}})
    assert torch.equal(back["model"]["w"].local, torch.tensor([[0.0, 0.0], [1.0, 1.0]]))
    return out


def test_copies_that_differ_are_refused_at_save(pool: Any, tmp_path: Path) -> None:
    """Debug mode off: a whole tensor, or a replicated GlobalTensor's block, that the ranks
    holding copies of it hold with different values is an error on every rank naming the key
    path and the ranks (DCP would keep one copy and lose the others)."""
    messages = pool.run(4, _copies_worker, str(tmp_path / "ckpt"))
    assert messages[0] == messages[1] == messages[2] == messages[3]
    assert messages[0] == [
        "save tree['opt']['m']: a whole tensor (every rank holds a copy) differs between the "
        "ranks (global ranks holding equal values: [0, 1] vs [2, 3]); a checkpoint keeps one "
        "copy, so the others would be lost. Per-rank state (an optimizer's moments of a rank's "
        "block) is a GlobalTensor: ps.from_local(block, spec) with the spec of the value it is "
        "a block of",
        "save tree['model']['w']: the GlobalTensor's spec P('dp', None) replicates its block "
        "over mesh axes ('tp',) of mesh {'dp': 2, 'tp': 2}, but the ranks holding copies of a "
        "block hold different values (global ranks holding equal values: [2] vs [3]); a "
        "checkpoint keeps one copy, so the others would be lost. Pass the same block on each "
        "of them, or make per-rank state a GlobalTensor whose spec splits it over those axes "
        "too (ps.from_local)",
    ]


# --------------------------------------------------------------------------- shard, from_local


def _set_up_worker() -> list[str]:
    grid = ps.init_mesh({"dp": 2, "tp": 2})
    rank, dp = dist.get_rank(), grid.get_local_rank("dp")
    out = []
    # an initialisation drawn per rank: ranks 0, 1 from seed 0, ranks 2, 3 from seed 1
    g = torch.Generator().manual_seed(dp)
    with pytest.raises(ValueError) as info:
        ps.shard({"b": torch.zeros(2), "w": torch.randn(4, 2, generator=g)}, P("dp"))
    out.append(str(info.value))
    # global shapes the ranks disagree on, each rank's block fitting its own: (3, 2) gives dp=0
    # a block of 2 rows, (4, 2) gives dp=1 one of 2 rows too
    shape = (3, 2) if dp == 0 else (4, 2)
    with pytest.raises(ValueError) as info:
        ps.from_local({"w": torch.ones(2, 2)}, P("dp"), global_shapes={"w": shape})
    out.append(str(info.value))
    # the same whole values and shapes everywhere pass
    w = ps.shard(torch.arange(8.0).reshape(4, 2), P("dp"))
    same = ps.from_local(w.local, P("dp"), global_shapes=(4, 2))
    assert same.shape == (4, 2) and torch.equal(ps.gather(same), torch.arange(8.0).reshape(4, 2))
    return out + [str(rank)]


def test_shard_and_from_local_compare_what_every_rank_passes(pool: Any) -> None:
    """Debug mode off: whole values that differ between the ranks (ps.shard) and global
    shapes they disagree on (ps.from_local) are errors on every rank naming the key path and
    the ranks."""
    got = pool.run(4, _set_up_worker)
    assert [m[:2] for m in got] == [got[0][:2]] * 4
    assert got[0][:2] == [
        "shard tree['w']: the whole value differs between the ranks (global ranks holding equal "
        "values: [0, 1] vs [2, 3]); each rank takes its block of the value it passes, so blocks "
        "of different values would make one GlobalTensor: pass the same value on every rank "
        "(drawn from the same seed), or make per-rank values a GlobalTensor with "
        "ps.from_local(block, spec)",
        "from_local tree['w']: the ranks disagree on the global shape: (3, 2) on global ranks "
        "[0, 1], (4, 2) on global ranks [2, 3]; every rank passes the same global_shapes",
    ]


# --------------------------------------------------------------------------- async, not waited


def _no_wait_worker(path: str) -> int:
    """An async save that the rank does not wait for: it returns, and ps.spawn tears the
    process group down while the save still writes (its checksums are slowed down)."""
    import pshard._state.write as write

    chunk_sums = write.chunk_sums

    def slow(*args: Any) -> Any:
        time.sleep(1.0)
        return chunk_sums(*args)

    write.chunk_sums = slow
    ps.init_mesh({"dp": 2})
    save(path, {"w": ps.shard(torch.arange(6.0), P("dp")), "step": 3}, async_save=True)
    return dist.get_rank()


def test_an_async_save_nobody_waits_for_still_finishes(tmp_path: Path, capfd: Any) -> None:
    """The save finishes without the process group (torn down once fn returned) and the
    process waits for it; nothing is printed."""
    path = str(tmp_path / "ckpt")
    assert ps.spawn(_no_wait_worker, path, nprocs=2) == [0, 1]
    err = capfd.readouterr().err
    assert "Exception" not in err and "Traceback" not in err, err
    back = load(path, {"w": torch.zeros(6), "step": 0})
    assert back["step"] == 3 and torch.equal(back["w"], torch.arange(6.0))
    assert os.listdir(tmp_path) == ["ckpt"]
