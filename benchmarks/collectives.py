"""pshard's collectives against the raw torch.distributed calls they wrap.

Runs on 2 gloo ranks on this machine (started with ``ps.spawn``) and prints, per operation and
message size (bytes of the local input), the median time of the raw call (with the reshapes it
needs), of pshard's call, their ratio, and the median of the per-round ratios of samples taken
back to back (``paired``; less sensitive to a loaded machine). Samples of the two alternate,
each after a barrier, so load on
the machine hits both alike; small messages are timed over several back-to-back calls per sample.

    python benchmarks/collectives.py [--sizes 64K,1M,16M,64M] [--repeats 15] [--nprocs 2]

The raw baselines:

- ``psum``: ``y = x.clone(); dist.all_reduce(y)`` (pshard's result is a new tensor, so the raw
  call that leaves ``x`` alone needs the copy too); the in-place ``all_reduce(x)`` is shown as
  a second row (``psum (raw in place)``) to show the cost of that copy.
- ``all_gather``: ``all_gather_into_tensor`` into an ``(n * s0, ...)`` buffer (dim 0).
- ``all_to_all``: the Ulysses exchange of a ``(batch, seq, heads, head_dim)`` block, heads
  split and sequence concatenated: ``unflatten`` + ``movedim`` + ``contiguous``,
  ``all_to_all_single``, ``movedim`` + ``flatten``.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
import unittest.mock
from collections.abc import Callable

import torch
import torch.distributed as dist

import pshard as ps

_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().removesuffix("B")
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


def _label(nbytes: int) -> str:
    for unit, scale in (("MB", 1 << 20), ("KB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes} B"


def _time(fn: Callable[[], object], calls: int) -> float:
    """Seconds per call of ``calls`` back-to-back calls, on the slowest rank."""
    dist.barrier()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = torch.tensor([(time.perf_counter() - start) / calls])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed)


def _cases(nbytes: int, n: int) -> dict[str, tuple[Callable[[], object], Callable[[], object]]]:
    numel = nbytes // 4
    x = torch.randn(numel)

    def raw_psum() -> torch.Tensor:
        y = x.clone()
        dist.all_reduce(y)
        return y

    def raw_psum_inplace() -> torch.Tensor:
        dist.all_reduce(x)
        return x

    def raw_gather() -> torch.Tensor:
        out = x.new_empty(n * numel)
        _gather(out, x)
        return out

    # (batch 1, seq, heads 8 * n, head_dim 64), this rank's sequence block
    heads, head_dim = 8 * n, 64
    seq = max(1, numel // (heads * head_dim))
    q = torch.randn(1, seq, heads, head_dim)

    def raw_all_to_all() -> torch.Tensor:
        inp = q.unflatten(2, (n, heads // n)).movedim(2, 0).contiguous()
        out = torch.empty_like(inp)
        dist.all_to_all_single(out, inp)
        return out.movedim(0, 1).flatten(1, 2)

    return {
        "psum": (raw_psum, lambda: ps.psum(x, "x")),
        "psum (raw in place)": (raw_psum_inplace, lambda: ps.psum(x, "x")),
        "all_gather": (raw_gather, lambda: ps.all_gather(x, "x")),
        "all_to_all": (
            raw_all_to_all,
            lambda: ps.all_to_all(q, "x", split_dim=2, concat_dim=1),
        ),
        # the raw call against itself: how far apart two identical calls time on this machine
        "all_to_all (raw A/A)": (raw_all_to_all, raw_all_to_all),
    }


def _bench(sizes: list[int], repeats: int) -> list[tuple[str, int, float, float, float]]:
    torch.set_num_threads(1)
    n = dist.get_world_size()
    ps.init_mesh({"x": n})
    rows = []
    for nbytes in sizes:
        for name, (raw, mine) in _cases(nbytes, n).items():
            for _ in range(2):  # warm up
                raw(), mine()
            calls = max(1, (4 << 20) // nbytes)  # >= 4 MB per sample: less barrier noise
            t_raw, t_mine = [], []
            for i in range(repeats):
                pair = ((raw, t_raw), (mine, t_mine))
                for fn, times in pair if i % 2 == 0 else pair[::-1]:
                    times.append(_time(fn, calls))
            # paired: the median over rounds of the ratio of the two samples taken back to back,
            # which cancels the machine's slow drifts (other load, frequency changes)
            paired = statistics.median(m / r for m, r in zip(t_mine, t_raw, strict=True))
            rows.append((name, nbytes, statistics.median(t_raw), statistics.median(t_mine), paired))
    return rows


def _local_transport() -> contextlib.AbstractContextManager:
    """Replace the transport of the calls timed here with a local copy (no other rank)."""
    stack = contextlib.ExitStack()

    def reduce(t: torch.Tensor, *a: object, **k: object) -> None:
        t.add_(0)

    def gather(out: torch.Tensor, inp: torch.Tensor, *a: object, **k: object) -> None:
        out.view(-1, inp.numel()).copy_(inp.view(1, -1))

    def to_all(out: torch.Tensor, inp: torch.Tensor, *a: object, **k: object) -> None:
        out.copy_(inp)

    def pairwise(ops: list) -> list:  # gloo's large gathers (sends and receives, paired in order)
        sends = [op.tensor for op in ops if op.op is dist.isend]
        for op, sent in zip((op for op in ops if op.op is dist.irecv), sends, strict=True):
            op.tensor.copy_(sent)
        return []

    for owner, name, fake in (
        (dist, "all_reduce", reduce),
        (dist, "all_to_all_single", to_all),
        (dist, "batch_isend_irecv", pairwise),
        (globals(), "_gather", gather),
        (ps._comm, "_all_gather_flat", gather),
    ):
        if isinstance(owner, dict):
            old = owner[name]
            owner[name] = fake
            stack.callback(owner.__setitem__, name, old)
        else:
            stack.enter_context(unittest.mock.patch.object(owner, name, fake))
    return stack


def _overhead(sizes: list[int], calls: int = 400) -> list[tuple[str, int, float, float]]:
    """Per-call CPU time of each raw call and pshard's with the transport replaced by a local
    copy: what the wrapper adds, free of the other rank's timing (medians of 9 samples)."""
    n = dist.get_world_size()
    rows = []
    with _local_transport():
        for nbytes in sizes:
            for name, (raw, mine) in _cases(nbytes, n).items():
                if "raw" in name:
                    continue
                samples: dict = {raw: [], mine: []}
                for _ in range(9):
                    for fn in (raw, mine):
                        fn()
                        start = time.perf_counter()
                        for _ in range(calls):
                            fn()
                        samples[fn].append((time.perf_counter() - start) / calls)
                raw_s, mine_s = statistics.median(samples[raw]), statistics.median(samples[mine])
                rows.append((name, nbytes, raw_s, mine_s))
    dist.barrier()  # return together: a rank still timing is not one stuck in a collective
    return rows


def _table(rows: list[tuple[str, int, float, float, float]]) -> str:
    lines = [
        f"{'op':<22}{'size':>10}{'raw ms':>11}{'pshard ms':>11}{'ratio':>8}{'paired':>8}",
        "-" * 70,
    ]
    for name, nbytes, raw, mine, paired in rows:
        lines.append(
            f"{name:<22}{_label(nbytes):>10}{raw * 1e3:>11.3f}{mine * 1e3:>11.3f}"
            f"{mine / raw:>8.3f}{paired:>8.3f}"
        )
    return "\n".join(lines)


def _run(nprocs: int, sizes: list[int], repeats: int) -> tuple[list[tuple], list[tuple]]:
    return ps.spawn(_both, sizes, repeats, nprocs=nprocs, timeout=3600.0)[0]


def _both(sizes: list[int], repeats: int) -> tuple[list[tuple], list[tuple]]:
    return _bench(sizes, repeats), _overhead(sizes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="64K,256K,1M,4M,16M,64M")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--nprocs", type=int, default=2)
    args = parser.parse_args()
    sizes = [_size(s) for s in args.sizes.split(",")]
    rows, overhead = _run(args.nprocs, sizes, args.repeats)
    print(f"{args.nprocs} gloo ranks, torch {torch.__version__}, medians of {args.repeats}")
    print(_table(rows))
    timed = {(name, nbytes): raw for name, nbytes, raw, _, _ in rows}
    print()
    print("the wrapper's own cost: CPU time per call with the transport replaced by a local copy")
    print(
        f"{'op':<22}{'size':>10}{'raw us':>10}{'pshard us':>11}{'added us':>10}{'of timed raw':>14}"
    )
    print("-" * 77)
    for name, nbytes, raw, mine in overhead:
        added = mine - raw
        print(
            f"{name:<22}{_label(nbytes):>10}{raw * 1e6:>10.1f}{mine * 1e6:>11.1f}"
            f"{added * 1e6:>10.1f}{1 + added / timed[name, nbytes]:>14.3f}"
        )


if __name__ == "__main__":
    main()
