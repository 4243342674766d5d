"""ps.pipeline_value_and_grad against torch.distributed.pipelining on the same stages.

The model: ``--nprocs`` ranks, each holding ``--virtual`` stages (one, but for
``interleaved_1f1b``) of ``--layers`` blocks ``Linear(W, W)`` + GELU (width ``--width``,
float32); the loss is the squared error against a target summed over ``--rows`` rows, cut into
``--microbatches`` microbatches. The two sides run the same modules:

- **torch**: ``torch.distributed.pipelining.PipelineStage`` around each stage's module and
  ``ScheduleGPipe`` / ``Schedule1F1B`` / ``ScheduleInterleaved1F1B`` (``scale_grads=False``:
  the gradient of the summed loss), ``schedule.step(x, target=t, losses=...)``, which runs
  ``.backward()``; gradients in the modules' ``.grad``;
- **pshard**: ``ps.pipeline_value_and_grad(stage, loss, schedule=...)`` with ``stage(params,
  x) = torch.func.functional_call(module, params, x)``; gradients returned. Also
  ``"zero_bubble"`` (torch's zero-bubble schedules need a different stage split).

Measured, per schedule:

- ``step``: one step's time on every rank (the slowest rank's), median over ``--steps``
  paired steps after one warm-up step each: torch and pshard built in the same processes,
  their steps alternating (the order swapped each pair), so that both see the same load; the
  ratio is the median over the pairs of pshard / torch (for ``"zero_bubble"``: against
  pshard's own ``"1f1b"``, paired the same way, row ``1f1b``);
- ``idle``: the measured bubble, the share of the step the busiest rank spends with nothing
  to compute, ``1 - compute / step``, where ``compute`` is the time a rank spent in its
  stages' forwards and backwards during that step (pshard: its trace,
  ``pshard._pipeline.executor.record``; torch: its ``PipelineStage``'s ``forward_one_chunk``,
  ``backward_one_chunk`` and ``backward_weight_one_chunk`` timed), the largest over the
  ranks, against the slowest rank's step; median over the steps;
- ``theory``: the schedule's bubble by the same measure on its timeline (a backward costing
  two forwards; ``ps.pipeline_schedule(...).bubble_fraction()``): ``(N - 1) / (M + N - 1)``
  for GPipe and 1F1B, ``(N - 1) / (v M + N - 1)`` interleaved, ``(N - 1) / (3 M + N - 1)``
  zero bubble;
- ``peak``: per-rank resident high-water mark (``ru_maxrss``) over a few steps, minus the
  resident size before the stages were built, the largest over the ranks, each side in fresh
  processes of its own (``MALLOC_MMAP_THRESHOLD_=131072``: freed blocks go back to the
  system).

Targets (issue 38): pshard's step at most 1.0x torch's for the same schedule; zero bubble's
idle time measurably below 1F1B's; pshard's 1F1B peak at most torch's.

    python benchmarks/pipeline.py [--width 1024] [--layers 2] [--rows 2048] [--microbatches 4]
        [--nprocs 2] [--steps 5] [--schedules gpipe 1f1b interleaved_1f1b zero_bubble]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _memory import peak_mib, rss_mib, trim  # noqa: E402

TORCH_SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B",
                   "interleaved_1f1b": "ScheduleInterleaved1F1B"}  # fmt: skip


def _modules(args, rank, v):
    import torch

    class Stage(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList(
                torch.nn.Linear(args.width, args.width) for _ in range(args.layers)
            )

        def forward(self, x):
            for lay in self.layers:
                x = torch.nn.functional.gelu(lay(x))
            return x

    out = []
    for k in range(v):
        torch.manual_seed(k * args.nprocs + rank)  # the same weights on both sides
        out.append(Stage())
    return out


def _data(args):
    import torch

    g = torch.Generator().manual_seed(123)
    return (torch.randn(args.rows, args.width, generator=g),
            torch.randn(args.rows, args.width, generator=g))  # fmt: skip


def _loss(y, t):
    return ((y - t) ** 2).sum()


def _torch_step(args, schedule, mods):
    import torch
    import torch.distributed as dist
    import torch.distributed.pipelining as pp

    n, rank = args.nprocs, dist.get_rank()
    v = len(mods)
    stages = [
        pp.PipelineStage(m, k * n + rank, v * n, torch.device("cpu")) for k, m in enumerate(mods)
    ]
    spent = [0.0]  # compute time inside the stages, read by the caller

    def timed(method):
        def run(*a, **k):
            start = time.perf_counter()
            try:
                return method(*a, **k)
            finally:
                spent[0] += time.perf_counter() - start

        return run

    for st in stages:
        for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
            setattr(st, name, timed(getattr(st, name)))
    cls = getattr(pp, TORCH_SCHEDULES[schedule])
    if v > 1:
        sched = cls(stages, args.microbatches, loss_fn=_loss, scale_grads=False)
    else:
        sched = cls(stages[0], args.microbatches, loss_fn=_loss, scale_grads=False)
    x, t = _data(args)

    def step():
        for m in mods:
            m.zero_grad(set_to_none=True)
        spent[0] = 0.0
        losses = []
        if rank == 0:
            sched.step(x, target=t if n == 1 else None, losses=losses)
        elif rank == n - 1:
            sched.step(target=t, losses=losses)
        else:
            sched.step()
        return spent[0]

    return step


def _pshard_step(args, schedule, mods):
    import torch

    import pshard as ps
    from pshard._pipeline.executor import record

    v = len(mods)
    base = mods[0]

    def stage(params, x):
        return torch.func.functional_call(base, params, (x,))

    params = [{k: p.detach() for k, p in m.named_parameters()} for m in mods]
    stages = [stage] * (v * args.nprocs) if schedule == "interleaved_1f1b" else stage
    fn = ps.pipeline_value_and_grad(
        stages, _loss, num_microbatches=args.microbatches, schedule=schedule
    )
    x, t = _data(args)
    p = tuple(params) if schedule == "interleaved_1f1b" else params[0]

    def step():
        with record() as events:
            fn(p, x, t)
        return sum(e.end - e.start for e in events if e.what == "compute")

    return step


def _timed(args, schedule):
    """One rank: paired steps of torch and pshard, each step's time and compute time."""
    import torch
    import torch.distributed as dist

    import pshard as ps

    torch.set_num_threads(1)
    ps.init_mesh({"pp": args.nprocs})
    v = args.virtual if schedule == "interleaved_1f1b" else 1
    mods = _modules(args, dist.get_rank(), v)
    sides = {"pshard": _pshard_step(args, schedule, mods)}
    if schedule in TORCH_SCHEDULES:
        sides["torch"] = _torch_step(args, schedule, mods)
    else:  # zero bubble: against pshard's own 1F1B, in the same processes
        sides["1f1b"] = _pshard_step(args, "1f1b", mods)
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in sides}
    for step in sides.values():  # warm-up
        step()
    for i in range(args.steps):
        order = list(sides) if i % 2 == 0 else list(reversed(sides))
        for name in order:
            dist.barrier()
            start = time.perf_counter()
            compute = sides[name]()
            times[name].append((time.perf_counter() - start, compute))
    return times


def _peak(args, side, schedule):
    """One rank in fresh processes: the resident high-water mark over a few steps."""
    import torch
    import torch.distributed as dist

    import pshard as ps

    torch.set_num_threads(1)
    ps.init_mesh({"pp": args.nprocs})
    trim()
    before = rss_mib()
    v = args.virtual if schedule == "interleaved_1f1b" else 1
    mods = _modules(args, dist.get_rank(), v)
    step = (_torch_step if side == "torch" else _pshard_step)(args, schedule, mods)
    for _ in range(3):
        step()
    return peak_mib() - before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--rows", type=int, default=2048)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--nprocs", type=int, default=2)
    parser.add_argument("--virtual", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument(
        "--schedules", nargs="+", default=["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"]
    )
    parser.add_argument("--no-memory", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")
    import pshard as ps

    n, m = args.nprocs, args.microbatches
    print(f"{n} ranks, width {args.width}, {args.layers} layers per stage, {args.rows} rows in "
          f"{m} microbatches, float32, gloo on CPU, one thread per rank")  # fmt: skip
    head = (f"{'schedule':<18}{'side':<8}{'step ms':>9}{'ratio':>7}{'idle':>7}{'theory':>8}"
            f"{'peak MiB':>10}")  # fmt: skip
    print(head)
    for schedule in args.schedules:
        v = args.virtual if schedule == "interleaved_1f1b" else 1
        theory = ps.pipeline_schedule(schedule, num_ranks=n, num_microbatches=m,
                                      virtual_stages=v).bubble_fraction()  # fmt: skip
        ranks = ps.spawn(_timed, args, schedule, nprocs=n, timeout=1800)
        peaks = {}
        if not args.no_memory:
            for side in ("pshard", "torch") if schedule in TORCH_SCHEDULES else ("pshard",):
                peaks[side] = max(ps.spawn(_peak, args, side, schedule, nprocs=n, timeout=1800))
        sides = list(ranks[0])
        # per step: the slowest rank's time, and the busiest rank's idle share of it
        step = {s: [max(r[s][i][0] for r in ranks) for i in range(args.steps)] for s in sides}
        idle = {
            s: statistics.median(
                1 - max(r[s][i][1] for r in ranks) / step[s][i] for i in range(args.steps)
            )
            for s in sides
        }
        for side in sides:
            med = statistics.median(step[side])
            ratio = ""
            other = next((o for o in ("torch", "1f1b") if o in step), None)
            if side == "pshard" and other is not None:
                pairs = zip(step["pshard"], step[other], strict=True)
                ratio = f"{statistics.median(a / b for a, b in pairs):.2f}"
            peak = f"{peaks[side]:.0f}" if side in peaks else ""
            print(f"{schedule:<18}{side:<8}{med * 1e3:>9.1f}{ratio:>7}{idle[side]:>7.0%}"
                  f"{theory:>8.0%}{peak:>10}")  # fmt: skip


if __name__ == "__main__":
    main()
