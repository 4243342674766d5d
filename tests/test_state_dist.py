"""ps.save / ps.load on 2 and 4 gloo ranks, float64, against the whole values.

A tree of GlobalTensors on two meshes (uneven blocks, an empty block, a replicated value, a
strided FSDP2 x TP layout and an uneven strided one DTensor cannot write), whole tensors, plain
values and RNG states, saved on 4 ranks and read back: on the same ranks, on 2 ranks in other
layouts and another mesh (each rank plans reads of only the saved chunks its blocks overlap,
and of exactly its elements), on one process as whole tensors. An async save keeps the values
at the call. A resumed AdamW run (optree.tree_map over GlobalTensors) takes the next steps of
the uninterrupted run bit for bit on the same mesh, and to float64 rounding on 2 ranks as
P(None, "tp"). FSDP2 checkpoints written by dcp.save load into GlobalTensors and pshard's load
into an FSDP2 model with dcp.load. A rank killed half-way through a save leaves the previous
checkpoint in place.
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path
from typing import Any

import optree
import pytest
import torch
import torch.distributed as dist
from helpers import spied, spy
from torch.func import grad

import pshard as ps
import pshard._state.reader as reader
import pshard._state.write as write
from pshard._core.global_tensor import block_runs
from pshard._state.load import load, load_metadata
from pshard._state.manifest import SavedTensor
from pshard._state.rng import RngState
from pshard._state.save import save

pytestmark = pytest.mark.filterwarnings(
    "ignore:`torch.jit.script` is deprecated:DeprecationWarning"
)

f64 = torch.float64
P = ps.P


def _whole(*shape: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, dtype=f64, generator=g)


def _block(x: torch.Tensor, g: ps.GlobalTensor) -> torch.Tensor:
    """This rank's block of the whole ``x`` under ``g``'s layout (the oracle's slicing)."""
    coord = {n: g.mesh.get_local_rank(n) for n in g.mesh.mesh_dim_names}
    out = x
    for d, runs in enumerate(block_runs(g.meta, coord)):
        index = torch.tensor([i for r in runs for i in r], dtype=torch.long)
        out = out.index_select(d, index)
    return out


def _wholes() -> dict[str, torch.Tensor]:
    return {
        "w": _whole(10, 6, seed=1),  # 3, 3, 3, 1 rows on 4 ranks
        "e": _whole(3, 2, seed=2),  # an empty block on rank 3
        "b": _whole(5, seed=3),  # replicated
        "whole": _whole(2, 2, seed=4),  # a plain tensor
        "s": _whole(8, 3, seed=5),  # P(("tp", "dp")): StridedShard, as FSDP2 over TP
        "u": _whole(7, 2, seed=6),  # P(("tp", "dp")) uneven: DTensor cannot write it
        "m": _whole(6, 4, seed=7),  # P("dp", "tp")
    }


SPECS4 = {"w": P("dp"), "e": P("dp"), "b": P(), "s": P(("tp", "dp")), "u": P(("tp", "dp"))}
SPECS4["m"] = P("dp", "tp")
ON_GRID = {"s", "u", "m"}
VALUES = {"step": 3, "lr": 0.1, "name": "run", "flag": True, "none": None}


def _state4() -> dict[str, Any]:
    flat = ps.init_mesh({"dp": 4})
    grid = ps.init_mesh({"dp": 2, "tp": 2})
    state: dict[str, Any] = dict(VALUES)
    for k, x in _wholes().items():
        if k == "whole":
            state[k] = x
        else:
            state[k] = ps.shard(x, SPECS4[k], mesh=grid if k in ON_GRID else flat)
    state["rng"] = RngState.capture()  # the same on every rank (the pool seeds each call)
    torch.manual_seed(100 + dist.get_rank())
    state["rng_rank"] = RngState.capture()  # each rank's own
    return state


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, ps.GlobalTensor):
        return isinstance(b, ps.GlobalTensor) and a.meta == b.meta and torch.equal(a.local, b.local)
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return type(a) is type(b) and a == b


def _save4_worker(path: str, async_path: str) -> int:
    state = _state4()
    save(path, state)
    back = load(path, state)
    assert back.keys() == state.keys()
    for k in state:
        assert _same(back[k], state[k]), k
    meta = load_metadata(path)
    assert meta["w"] == SavedTensor((10, 6), f64, P("dp", None), (("dp", 4),))
    assert meta["s"] == SavedTensor((8, 3), f64, P(("tp", "dp"), None), (("dp", 2), ("tp", 2)))
    assert meta["whole"] == SavedTensor((2, 2), f64) and meta["step"] == 3
    assert meta["rng_rank"] == state["rng_rank"]  # this rank's own
    # into whole tensors on every rank, and into the layouts load_metadata names
    wholes = _wholes()
    got = load(path, {k: torch.empty(x.shape, dtype=f64) for k, x in wholes.items()}, partial=True)
    assert all(torch.equal(got[k], wholes[k]) for k in wholes)
    with ps.use_mesh(state["m"].mesh):
        grid = load(path, {k: meta[k] for k in ON_GRID}, partial=True)
    assert all(_same(grid[k], state[k]) for k in ON_GRID)
    # a like of meta blocks: the blocks are read onto the mesh's device
    lazy = {k: ps.GlobalTensor(state[k].local.to("meta"), state[k].meta) for k in SPECS4}
    got = load(path, lazy, partial=True)
    assert all(_same(got[k], state[k]) for k in SPECS4)
    # async: the values at the call, not the in-place update that follows it
    future = save(async_path, state, async_save=True)
    for k in SPECS4:
        state[k].local.add_(1.0)
    state["whole"].add_(1.0)
    for _ in range(3):  # the caller's collectives go on while the save's thread exchanges
        assert torch.equal(ps.gather(state["w"]), wholes["w"] + 1)
    assert future is not None and future.result(timeout=60) is None
    later = load(
        async_path, {k: torch.empty(x.shape, dtype=f64) for k, x in wholes.items()}, partial=True
    )
    assert all(torch.equal(later[k], wholes[k]) for k in wholes)
    return 1


class _Reads:
    """Records the read items DCP plans on this rank (CheckpointReader.read_data), under
    :func:`_reads_spied` around the run."""

    def __enter__(self) -> list[Any]:
        return spied([])

    def __exit__(self, *exc: object) -> None:
        spied(None)


def _planned(items: list[Any], this: Any, plan: Any, planner: Any) -> None:
    items.extend(plan.items)


def _reads_spied() -> Any:
    return spy(reader.CheckpointReader, "read_data", _planned)


def _rows(chunks: Any) -> set[tuple[int, int]]:
    return {(int(c.offsets[0]), int(c.offsets[0]) + int(c.sizes[0])) for c in chunks}


def _load2_worker(path: str) -> int:
    mesh = ps.init_mesh({"tp": 2})
    rank = dist.get_rank()
    wholes = _wholes()
    meta = load_metadata(path)
    tp = {k: P(None, "tp") if x.ndim == 2 else P("tp") for k, x in wholes.items()}
    like = {k: dataclasses.replace(meta[k], spec=tp[k]) for k in wholes}
    like["whole"] = meta["whole"]  # spec None: whole
    like.update({k: meta[k] for k in (*VALUES, "rng")})
    with _Reads() as items:
        got = load(path, like, partial=True)
    for k, x in wholes.items():
        g = got[k]
        if k == "whole":
            assert isinstance(g, torch.Tensor) and torch.equal(g, x)
            continue
        assert isinstance(g, ps.GlobalTensor) and g.spec == P(
            *tp[k], *[None] * (x.ndim - len(tp[k]))
        )
        assert g.mesh is mesh and torch.equal(g.local, _block(x, g)), k
    assert {k: got[k] for k in VALUES} == VALUES and got["rng"] == meta["rng"]
    # each rank plans reads of exactly its elements: P(None, "tp") crosses every saved row block
    w_items = [i for i in items if i.dest_index.fqn == "w"]
    assert sum(torch.Size(i.lengths).numel() for i in w_items) == 10 * 3
    # rows: only the saved chunks the block overlaps are read
    md = reader.read_dcp_metadata(path)
    saved = md.state_dict_metadata["w"].chunks
    with _Reads() as items:
        rows = load(path, {"w": ps.shard(torch.zeros(10, 6, dtype=f64), P("tp"))}, partial=True)
    assert torch.equal(rows["w"].local, _block(wholes["w"], rows["w"]))
    mine = (0, 5) if rank == 0 else (5, 10)
    overlapping = {c for c in _rows(saved) if c[0] < mine[1] and mine[0] < c[1]}
    assert {(int(i.storage_index.offset[0])) for i in items} == {a for a, _ in overlapping}
    assert sum(torch.Size(i.lengths).numel() for i in items) == 5 * 6
    read = {i.storage_index for i in items}
    total = sum(md.storage_data[s].length for s in md.storage_data if s.fqn == "w")
    assert sum(md.storage_data[s].length for s in read) < total
    # each rank saved its own RNG state: a world of 2 cannot take them over
    with pytest.raises(
        ValueError,
        match=re.escape(
            "load like['rng_rank']: the 4 saving ranks held different RNG states and this world "
            "has 2 ranks"
        ),
    ):
        load(path, {"rng_rank": RngState(b"")}, partial=True)
    return 1


def test_save_on_4_ranks_load_on_4_2_and_1(pool: Any, tmp_path: Path) -> None:
    path, async_path = str(tmp_path / "ckpt"), str(tmp_path / "async")
    assert pool.run(4, _save4_worker, path, async_path) == [1] * 4
    with _reads_spied():
        assert pool.run(2, _load2_worker, path) == [1] * 2
    # one process, no mesh: whole tensors
    wholes = _wholes()
    got = load(
        path,
        {**{k: torch.empty(x.shape, dtype=f64) for k, x in wholes.items()}, **VALUES},
        partial=True,
    )
    assert all(torch.equal(got[k], x) for k, x in wholes.items())
    meta = load_metadata(path)
    assert meta["u"] == SavedTensor((7, 2), f64, P(("tp", "dp"), None), (("dp", 2), ("tp", 2)))
    names = sorted(os.listdir(path))
    assert names == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
        "__2_0.distcp",
        "__3_0.distcp",
        "pshard.json",
    ]


def _mismatch_worker(path: str) -> str:
    ps.init_mesh({"dp": 2})
    rank = dist.get_rank()
    with pytest.raises(ValueError) as info:
        save(path, {"w": torch.ones(2 + rank), "step": rank})
    return str(info.value)


def test_ranks_passing_different_trees(pool: Any, tmp_path: Path) -> None:
    """(Whole tensors' values that differ: tests/test_state_checks.py.)"""
    messages = pool.run(2, _mismatch_worker, str(tmp_path / "ckpt"))
    assert (
        messages[0]
        == messages[1]
        == (
            "save: the ranks pass different trees; every rank saves the same tree (its own blocks; "
            "whole tensors and plain values, written once, equal on every rank):\n  "
            "tree['step']: rank 0 has the int 0, rank 1 has the int 1\n  "
            "tree['w']: rank 0 has a tensor (2,) float32, rank 1 has a tensor (3,) float32"
        )
    )


def _one_rank_worker(path: str) -> list[str]:
    ps.init_mesh({"dp": 2})
    rank = dist.get_rank()
    w = ps.shard(_whole(5, 3, seed=8), P("dp"))
    out = []
    for tree in (
        {"w": w, "x": object() if rank == 1 else 1},  # a bad leaf on rank 1 only
        {"w": optree.tree_map(lambda t: t[:1], w) if rank == 1 else w},  # a bad block there
        {"x": object()},  # on every rank: no rank named
        {"w": optree.tree_map(lambda t: t[:1], w)},  # each rank its own (its coordinate named)
    ):
        with pytest.raises((TypeError, ValueError)) as info:
            save(path, tree)
        out.append(f"{type(info.value).__name__}: {info.value}")
    assert not os.path.exists(path)
    return out


def test_a_mistake_on_one_rank_names_it(pool: Any, tmp_path: Path) -> None:
    messages = pool.run(2, _one_rank_worker, str(tmp_path / "ckpt"))
    assert messages[0][:3] == messages[1][:3]
    leaf = (
        "save tree['x']: an object; a checkpoint holds GlobalTensors, tensors, int, float, str, "
        "bool, None and ps.RngState (plain data, never a pickle): convert it to those (a dict of "
        "them for an object's state)"
    )
    assert messages[0] == [
        f"TypeError: {leaf} (on rank 1 of 2)",
        "ValueError: save tree['w']: the GlobalTensor's block has shape (1, 3), but its spec "
        "P('dp', None) and global shape (5, 3) give this rank (dp=1) of mesh {'dp': 2} a block "
        "of shape (2, 3), so the checkpoint would not load; save GlobalTensors whose blocks fit "
        "their layout (ps.from_local(block, spec, global_shapes=...) checks it) (on rank 1 of 2)",
        f"TypeError: {leaf}",
        "ValueError: save tree['w']: the GlobalTensor's block has shape (1, 3), but its spec "
        "P('dp', None) and global shape (5, 3) give this rank (dp=0) of mesh {'dp': 2} a block "
        "of shape (3, 3), so the checkpoint would not load; save GlobalTensors whose blocks fit "
        "their layout (ps.from_local(block, spec, global_shapes=...) checks it) (on rank 0 of 2; "
        "rank 1 raised another)",
    ]
    assert messages[1][3].startswith("ValueError: save tree['w']: the GlobalTensor's block has")
    assert "this rank (dp=1)" in messages[1][3] and messages[1][3].endswith("checks it)")


# --------------------------------------------------------------------------- resume


def _mlp(params: dict, x: torch.Tensor) -> torch.Tensor:
    h = (x @ params["w1"] + params["b1"]).tanh()
    return ((h @ params["w2"]) ** 2).sum()


def _adamw(params: dict, grads: dict, m: dict, v: dict, step: int) -> tuple:
    """AdamW written with optree.tree_map over GlobalTensors (as in test_global_map.py)."""
    lr, b1, b2, eps, wd = 0.05, 0.9, 0.99, 1e-8, 0.01
    m = optree.tree_map(lambda m, g: b1 * m + (1 - b1) * g, m, grads)
    v = optree.tree_map(lambda v, g: b2 * v + (1 - b2) * g * g, v, grads)
    c1, c2 = 1 - b1**step, 1 - b2**step

    def update(p: torch.Tensor, m: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return p * (1 - lr * wd) - lr * (m / c1) / ((v / c2).sqrt() + eps)

    return optree.tree_map(update, params, m, v), m, v


def _steps(state: dict, loss: Any, count: int) -> tuple[dict, list[dict]]:
    """``count`` AdamW steps on batches drawn from the global generator; the whole parameters
    after each."""
    params, m, v, step = state["params"], state["m"], state["v"], state["step"]
    seen = []
    for _ in range(count):
        step += 1
        x = torch.randn(8, 5, dtype=f64)
        params, m, v = _adamw(params, grad(loss)(params, x), m, v, step)
        seen.append(ps.gather(params))
    return {"params": params, "m": m, "v": v, "step": step}, seen


def _train4_worker(path: str, before: int, after: int) -> list[dict]:
    ps.init_mesh({"dp": 4})
    whole = {"w1": _whole(5, 7, seed=11), "b1": _whole(7, seed=12), "w2": _whole(7, 3, seed=13)}
    params = ps.shard(whole, P("dp"))  # 7 rows on 4 ranks: uneven
    zeros = optree.tree_map(torch.zeros_like, params)
    state = {"params": params, "m": zeros, "v": zeros, "step": 0}
    loss = ps.shard_map(
        lambda p, x: ps.psum(_mlp(p, x), "dp"), in_specs=(None, P("dp")), out_specs=P()
    )
    state, _ = _steps(state, loss, before)
    save(path, {**state, "rng": RngState.capture()})
    _, uninterrupted = _steps(state, loss, after)
    back = load(path, {**state, "rng": RngState(b"")})
    back.pop("rng").restore()
    assert back["step"] == before
    _, resumed = _steps(back, loss, after)
    for a, b in zip(uninterrupted, resumed, strict=True):
        assert all(torch.equal(a[k], b[k]) for k in a)  # bit for bit
    return uninterrupted


def _resume2_worker(path: str, after: int) -> list[dict]:
    ps.init_mesh({"tp": 2})
    meta = load_metadata(path)
    specs = {"w1": P(None, "tp"), "b1": P("tp"), "w2": P(None, "tp")}
    like = {k: meta[k] for k in ("step", "rng")}
    for part in ("params", "m", "v"):
        like[part] = {k: dataclasses.replace(e, spec=specs[k]) for k, e in meta[part].items()}
    state = load(path, like)
    assert state["params"]["w1"].spec == P(None, "tp")
    state.pop("rng").restore()
    loss = ps.shard_map(_mlp, in_specs=(None, None), out_specs=P())
    _, resumed = _steps(state, loss, after)
    return resumed


def test_resume_takes_the_next_steps(pool: Any, tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    uninterrupted = pool.run(4, _train4_worker, path, 3, 3)[0]
    resumed = pool.run(2, _resume2_worker, path, 3)
    for a, b in zip(uninterrupted, resumed[0], strict=True):
        for k in a:
            assert torch.allclose(a[k], b[k], rtol=1e-12, atol=1e-14), (
                k,
                (a[k] - b[k]).abs().max(),
            )
    assert all(
        torch.equal(x[k], y[k]) for x, y in zip(resumed[0], resumed[1], strict=True) for k in x
    )


# --------------------------------------------------------------------------- FSDP2


def _fsdp_model(mesh: Any) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    model = model.double()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _fsdp_worker(path: str) -> int:
    import torch.distributed.checkpoint as dcp

    mesh = ps.init_mesh({"dp": 2})
    model = _fsdp_model(mesh)
    sd = model.state_dict()
    dcp.save(sd, checkpoint_id=path + "-fsdp")
    full = {k: v.full_tensor() for k, v in sd.items()}
    # FSDP2's files into GlobalTensors: its own layout, another one, and DTensors
    for like in (
        {k: ps.from_dtensor(v) for k, v in sd.items()},
        {
            k: ps.shard(torch.zeros_like(x), P(None, "dp") if x.ndim == 2 else P())
            for k, x in full.items()
        },
    ):
        got = load(path + "-fsdp", like)
        for k, g in got.items():
            assert isinstance(g, ps.GlobalTensor) and g.meta == like[k].meta
            assert torch.equal(ps.gather(g), full[k]), k
    dtensors = load(path + "-fsdp", sd)
    assert all(torch.equal(dtensors[k].full_tensor(), full[k]) for k in full)
    # pshard's files into the FSDP2 model with dcp.load
    new = {k: ps.shard(torch.randn_like(x), P("dp")) for k, x in full.items()}
    save(path + "-pshard", {"model": new, "step": 5})
    target = {"model": model.state_dict()}
    dcp.load(target, checkpoint_id=path + "-pshard")
    model.load_state_dict(target["model"])
    for k, p in model.named_parameters():
        assert torch.equal(p.full_tensor(), ps.gather(new[k])), k
    return 1


def test_fsdp2_checkpoints_both_ways(pool: Any, tmp_path: Path) -> None:
    assert pool.run(2, _fsdp_worker, str(tmp_path / "ckpt")) == [1] * 2


# --------------------------------------------------------------------------- a killed save


def _killed_worker(path: str) -> int:
    mesh = ps.init_mesh({"dp": 2})
    save(path, {"w": ps.shard(_whole(6, 3, seed=21), P("dp"), mesh=mesh), "step": 1})
    rank = dist.get_rank()
    original = write.DCPWriter.write_data

    def dying(self: Any, plan: Any, planner: Any) -> Any:
        out = original(self, plan, planner)
        if rank == 1:  # half of its file on disk, then gone
            for f in Path(self.path).glob("__1_*.distcp"):
                os.truncate(f, f.stat().st_size // 2)
            os._exit(17)
        return out

    write.DCPWriter.write_data = dying  # type: ignore[method-assign]
    try:
        save(path, {"w": ps.shard(_whole(6, 3, seed=22), P("dp"), mesh=mesh), "step": 2})
    finally:
        write.DCPWriter.write_data = original  # type: ignore[method-assign]
    return 1


def test_a_killed_save_leaves_the_previous_checkpoint(procs: Any, tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    with pytest.raises(ps.SpawnError, match=r"rank 1 of 2 \(pid \d+\) exited with code 17"):
        procs.run(2, _killed_worker, str(path), timeout=60)
    got = load(path, {"w": torch.empty(6, 3, dtype=f64), "step": 0})
    assert got["step"] == 1 and torch.equal(got["w"], _whole(6, 3, seed=21))
    stale = [p for p in tmp_path.iterdir() if p.name.startswith(".ckpt.pshard-")]
    assert len(stale) == 1 and not (stale[0] / ".metadata").exists()
    save(path, {"w": torch.zeros(1), "step": 3})  # the next save removes what the dead one left
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
