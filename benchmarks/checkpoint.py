"""ps.save / ps.load against dcp.save / dcp.load: time, bytes written and read per rank.

Training state of a decoder-sized MLP (``--layers`` x (``Linear(W, 4W)``, ``Linear(4W, W)``),
float32) as ``GlobalTensor`` s sharded over ``"dp"``: parameters and two AdamW moments, plus a
step count and the RNG state. On 4 gloo ranks (one ``ps.spawn``), median of ``--reps``:

- ``ps.save``: a blocking save into a new directory (aside, then the atomic switch), and the
  bytes of this rank's data file; ``dcp.save``: the same blocks as DTensors
  (``ps.to_dtensor``) into a new directory, the anchor; ``ps.save over``: a save over the
  previous checkpoint (the switch deletes it);
- ``async``: the time ``ps.save(..., async_save=True)`` takes to return (the copy of the blocks
  to CPU memory) and to finish;
- ``ps.load`` / ``dcp.load``: the same layout back (into new blocks / into DTensors in place);
  ``unverified``: ``ps.load(..., verify=False)``, without the chunks' checksums; their cost is
  the difference (the files are in the page cache: every load reads them again), beside the
  time the checksum the save chose (CRC-32C with the ``crc32c`` package, else zlib's CRC-32)
  and zlib's CRC-32 take over one rank's file.

Then on 2 ranks, the checkpoint read as ``P("dp")`` (each rank's rows) and as ``P(None, "dp")``
(each rank's columns cross every saved row block): the bytes of the saved chunks each rank's
plan reads (DCP reads a saved chunk whole), against the checkpoint's data.

Usage: ``python benchmarks/checkpoint.py [--width 1024] [--layers 4] [--reps 3] [--dir /tmp]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _state(width: int, layers: int) -> dict[str, Any]:
    import optree
    import torch

    import pshard as ps
    from pshard._state.rng import RngState

    g = torch.Generator().manual_seed(0)
    whole = {}
    for i in range(layers):
        whole[f"{i}.up"] = torch.randn(width, 4 * width, generator=g)
        whole[f"{i}.down"] = torch.randn(4 * width, width, generator=g)
    params = ps.shard(whole, ps.P("dp"))
    m = optree.tree_map(lambda p: p * 0.1, params)
    v = optree.tree_map(lambda p: p * p, params)
    return {"params": params, "m": m, "v": v, "step": 100, "rng": RngState.capture()}


def _timed(fn: Any, reps: int) -> float:
    """Median seconds of ``fn(rep)`` over ``reps`` (between barriers, slowest rank's view)."""
    import torch.distributed as dist

    times = []
    for rep in range(reps):
        dist.barrier()
        start = time.perf_counter()
        fn(rep)
        dist.barrier()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def save_load(root: str, width: int, layers: int, reps: int) -> dict[str, float]:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import pshard as ps
    from pshard._core.tree import tree_map
    from pshard._state.load import load
    from pshard._state.save import save

    torch.set_num_threads(1)
    ps.init_mesh({"dp": dist.get_world_size()})
    rank = dist.get_rank()
    state = _state(width, layers)
    tensors = {k: state[k] for k in ("params", "m", "v")}
    dtensors = tree_map(ps.to_dtensor, tensors)  # pshard's walk: GlobalTensors are leaves
    out: dict[str, float] = {}
    # each save into a new directory, as a run saves step after step
    out["ps.save"] = _timed(lambda rep: save(f"{root}/ps{rep}", state), reps)
    out["bytes"] = float(Path(f"{root}/ps0/__{rank}_0.distcp").stat().st_size)
    out["dcp.save"] = _timed(lambda rep: dcp.save(dtensors, checkpoint_id=f"{root}/dcp{rep}"), reps)
    out["ps.save over"] = _timed(lambda rep: save(f"{root}/ps0", state), reps)
    calls, totals = [], []
    for rep in range(reps):
        dist.barrier()
        start = time.perf_counter()
        future = save(f"{root}/async{rep}", state, async_save=True)
        calls.append(time.perf_counter() - start)
        assert future is not None
        future.result()
        dist.barrier()
        totals.append(time.perf_counter() - start)
    out["async call"], out["async done"] = statistics.median(calls), statistics.median(totals)
    # verified and unverified loads taken in turns, so that a busy machine slows both alike
    verified, unverified = [], []
    for _ in range(reps):
        verified.append(_timed(lambda rep: load(f"{root}/ps0", state), 1))
        unverified.append(_timed(lambda rep: load(f"{root}/ps0", state, verify=False), 1))
    out["ps.load"], out["unverified"] = statistics.median(verified), statistics.median(unverified)
    data = Path(f"{root}/ps0/__{rank}_0.distcp").read_bytes()
    out["crc32"] = _timed(lambda rep: zlib.crc32(data), reps)
    out["checksum"] = _timed(lambda rep: file_checksum_of(data), reps)
    out["dcp.load"] = _timed(lambda rep: dcp.load(dtensors, checkpoint_id=f"{root}/dcp0"), reps)
    out.update(_always_checked(root, state["params"], reps))
    return out


def _always_checked(root: str, params: dict[str, Any], reps: int) -> dict[str, float]:
    """The checks that are always on, each beside the call it is part of: ps.shard (a digest
    of each whole value, one all-gather), ps.from_local (global shapes, one all-gather) and a
    save of replicated parameters (a digest of each copy)."""
    import pshard as ps
    from pshard._core.tree import tree_flatten_with_path
    from pshard._shard_map.mesh_view import MeshView
    from pshard._shard_map.replicas import check_whole_values, tensor_digest
    from pshard._state.save import save

    whole = ps.gather(params)  # every rank: the whole parameters
    paths, leaves, _ = tree_flatten_with_path(whole)
    view = MeshView(ps.current_mesh(), None, "shard")
    blocks = {k: p.local for k, p in params.items()}
    shapes = {k: tuple(p.shape) for k, p in params.items()}
    replicated = ps.shard(whole, ps.P())
    out: dict[str, float] = {}
    out["ps.shard"] = _timed(lambda rep: ps.shard(whole, ps.P("dp")), reps)
    out["shard check"] = _timed(lambda rep: check_whole_values(paths, leaves, view), reps)
    out["from_local"] = _timed(
        lambda rep: ps.from_local(blocks, ps.P("dp"), global_shapes=shapes), reps
    )
    out["save replicated"] = _timed(lambda rep: save(f"{root}/rep{rep}", replicated), reps)
    out["copies"] = _timed(lambda rep: [tensor_digest(x) for x in leaves], reps)
    return out


def read_plan(root: str, width: int, layers: int) -> dict[str, float]:
    import torch
    import torch.distributed as dist

    import pshard as ps
    import pshard._state.reader as reader
    from pshard._state.load import load, load_metadata

    torch.set_num_threads(1)
    ps.init_mesh({"dp": dist.get_world_size()})
    md = reader.read_dcp_metadata(f"{root}/ps0")
    meta = load_metadata(f"{root}/ps0")
    out: dict[str, float] = {"data": float(sum(s.length for s in md.storage_data.values()))}
    original = reader.CheckpointReader.read_data
    for name, spec in (("rows", ps.P("dp")), ("columns", ps.P(None, "dp"))):
        read: set[Any] = set()

        def spy(self: Any, plan: Any, planner: Any, read: set[Any] = read) -> Any:
            read.update(item.storage_index for item in plan.items)
            return original(self, plan, planner)

        like = {
            part: {k: _with_spec(e, spec) for k, e in meta[part].items()}
            for part in ("params", "m", "v")
        }
        reader.CheckpointReader.read_data = spy  # type: ignore[method-assign]
        try:
            load(f"{root}/ps0", like, partial=True)
        finally:
            reader.CheckpointReader.read_data = original  # type: ignore[method-assign]
        out[name] = float(sum(md.storage_data[s].length for s in read))
    return out


def _with_spec(entry: Any, spec: Any) -> Any:
    import dataclasses

    return dataclasses.replace(entry, spec=spec)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    import pshard as ps

    whole = 3 * args.layers * 2 * args.width * 4 * args.width * 4
    print(
        f"state: params + 2 moments of {args.layers} x (Linear({args.width}, {4 * args.width}), "
        f"Linear({4 * args.width}, {args.width})), float32: {whole / 2**20:.0f} MiB whole"
    )
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        rows = ps.spawn(save_load, root, args.width, args.layers, args.reps, nprocs=4)
        print(f"4 ranks, P('dp'); seconds (median of {args.reps}), slowest rank:")
        keys = ("ps.save", "dcp.save", "ps.save over", "async call", "async done")
        for key in (*keys, "ps.load", "unverified", "dcp.load"):
            print(f"  {key:<12} {max(r[key] for r in rows):8.3f}")
        verified = max(r["ps.load"] for r in rows)
        checks = verified - max(r["unverified"] for r in rows)
        crc = max(r["crc32"] for r in rows)
        ours = max(r["checksum"] for r in rows)
        print(
            f"  checksums ({preferred()}): {checks:.3f} s of a {verified:.3f} s load "
            f"({checks / verified:.0%}); the checksum of a rank's file alone {ours:.3f} s "
            f"({ours / verified:.0%}); zlib's CRC-32 of it {crc:.3f} s ({crc / verified:.0%})"
        )
        slowest = {k: max(r[k] for r in rows) for k in rows[0]}
        print("always-on checks (slowest rank), the parameters only:")
        print(
            f"  ps.shard          {slowest['ps.shard']:8.3f}  (its check of the whole values "
            f"{slowest['shard check']:.3f})"
        )
        print(f"  ps.from_local     {slowest['from_local']:8.3f}  (global shapes exchanged)")
        print(
            f"  ps.save, P()      {slowest['save replicated']:8.3f}  (the digests of the copies "
            f"{slowest['copies']:.3f})"
        )
        written = [r["bytes"] / 2**20 for r in rows]
        print(f"  written per rank: {', '.join(f'{b:.1f}' for b in written)} MiB")
        plans = ps.spawn(read_plan, root, args.width, args.layers, nprocs=2)
        data = plans[0]["data"] / 2**20
        print(f"2 ranks read the {data:.1f} MiB of saved chunks:")
        for name in ("rows", "columns"):
            per_rank = ", ".join(f"{p[name] / 2**20:.1f}" for p in plans)
            print(f"  as {name:<8} {per_rank} MiB per rank")


def preferred() -> str:
    """The checksum a save chooses on this machine."""
    from pshard._state.checksums import preferred as chosen

    return chosen()


def file_checksum_of(data: bytes) -> int:
    """The checksum a save chooses on this machine, of ``data``."""
    if preferred() == "crc32c":
        import crc32c

        return int(crc32c.crc32c(data))
    return zlib.crc32(data)


if __name__ == "__main__":
    main()
