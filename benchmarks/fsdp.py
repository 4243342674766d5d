"""FSDP2 (``fully_shard``) against pshard's functional FSDP and one process, side by side.

The model: ``--layers`` blocks of ``Linear(W, W)`` + GELU (width ``--width``, float32) in an
``nn.ModuleList``, loss the mean squared error against a target, ``--rows`` rows in all, the
same AdamW (lr 1e-3, weight decay 0.01) in every configuration. Three configurations, each in
fresh processes started by ``ps.spawn`` (gloo, CPU; ``ps.spawn``'s threads: one per rank on
this 2-core machine, two for the one process):

- **fsdp2** on ``--nprocs`` ranks: ``torch.distributed.fsdp.fully_shard`` on each block and on
  the root (built on the ``meta`` device, then ``to_empty``), ``.backward()``,
  ``torch.optim.AdamW``; each rank runs its rows (FSDP2 averages the gradients);
- **pshard** on ``--nprocs`` ranks: parameters and AdamW moments as ``GlobalTensor`` s
  ``P("dp")``, the data ``P("dp")``, a ``shard_map`` over ``"dp"`` whose body calls
  ``ps.sharded_call(model_on_meta, blocks, (x,), specs=P("dp"))``, ``torch.func.grad``, and
  AdamW applied to the blocks with ``optree.tree_map``;
- **one process** holding the whole model: ``torch.func.grad`` of ``functional_call`` and the
  same AdamW.

The AdamW of pshard and of the one process is ``torch.optim.AdamW``'s single-tensor update
written out (in place on the blocks, the same ops in the same order), so the three loss curves
agree to the rounding of the matmuls and the collectives' sums: the script prints the largest
difference from the one process's losses.

Measured per rank, as ``benchmarks/global_memory.py`` does (``MALLOC_MMAP_THRESHOLD_=131072``
so freed blocks go back to the system; the data are made before the baseline and each rank
keeps only its rows; the parameters are made one whole tensor at a time and each rank keeps
its block):

- ``peak``: the process's resident high-water mark (``ru_maxrss``) minus its resident size
  before the model was built, the largest over the ranks;
- ``held``: resident size after the steps minus the same baseline (parameters and AdamW state);
- ``step``: the median over the steps after the first (the warm-up) of one rank's step time
  (forward, backward, optimizer), the median over the ranks.

``--rounds`` repeats the configurations, interleaved, and reports medians. Step times taken
in separate runs move with the load of a shared machine (by 2x between runs here), so the time
ratio comes from ``--pairs`` paired steps: FSDP2 and pshard built in the same ``--nprocs``
processes, their steps alternating (the order swapped each pair) after one warm-up step each;
the ratio is the median over the pairs of each pair's pshard / FSDP2 (median over the ranks).

Two more configurations, for the analysis in ``benchmarks/README.md`` (``--modes``):
``pshard-ckloss``, pshard with the loss (after ``sharded_call``) inside ``ps.checkpoint``, and
``one-backward``, one process with ``.backward()`` and ``torch.optim.AdamW``. ``--where``
prints rank 0's Python stack at its memory peak, ``--profile`` a profile of its last step.

Targets (issue 29): pshard's peak at most FSDP2's and at most 0.3x the one process's; pshard's
step at most 1.2x FSDP2's.

    python benchmarks/fsdp.py [--width 2048] [--layers 8] [--rows 8192] [--steps 3]
        [--nprocs 4] [--rounds 1] [--pairs 4] [--modes fsdp2 pshard one pshard-ckloss
        one-backward] [--where] [--profile]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _memory import peak_mib, rss_mib, trim  # noqa: E402

# name -> (label, sharded over the ranks)
MODES = {
    "fsdp2": ("FSDP2", True),
    "pshard": ("pshard", True),
    "one": ("one process", False),
    "pshard-ckloss": ("pshard, loss in ps.checkpoint", True),
    "one-backward": ("one process, .backward()", False),
}
DEFAULT_MODES = ("fsdp2", "pshard", "one")
LR, BETAS, EPS, WEIGHT_DECAY = 1e-3, (0.9, 0.999), 1e-8, 0.01


class _PeakWatch:
    """Samples the resident size every millisecond in a thread and keeps the main thread's
    Python stack at the highest sample (where the peak happens)."""

    def __init__(self, base: float) -> None:
        import threading

        self.base = base
        self.top = 0.0
        self.stack: list[str] = []
        self._main = threading.get_ident()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import traceback

        while not self._stop.is_set():
            rss = rss_mib() - self.base
            if rss > self.top:
                frame = sys._current_frames().get(self._main)
                self.top = rss
                self.stack = traceback.format_stack(frame) if frame is not None else []
            time.sleep(0.001)

    def stop(self) -> str:
        self._stop.set()
        self._thread.join()
        lines = [line for line in self.stack if "/threading.py" not in line]
        return f"{self.top:.1f} MiB above the baseline, at\n" + "".join(lines[-14:])


def _model(width: int, layers: int) -> Any:
    """The MLP on the ``meta`` device (no storage)."""
    import torch

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(width, width)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.gelu(self.linear(x))

    class MLP(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = torch.nn.ModuleList(Block() for _ in range(layers))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = block(x)
            return x

    with torch.device("meta"):
        return MLP()


def _whole(name: str, shape: tuple[int, ...], index: int) -> Any:
    """The initial value of one parameter, the same in every process."""
    import torch

    g = torch.Generator().manual_seed(1000 + index)
    return torch.randn(shape, generator=g) / shape[-1] ** 0.5


def _data(rows: int, width: int) -> tuple[Any, Any]:
    import torch

    g = torch.Generator().manual_seed(0)
    return torch.randn(rows, width, generator=g), torch.randn(rows, width, generator=g)


def _adamw_(p: Any, g: Any, m: Any, v: Any, step: int) -> None:
    """``torch.optim.AdamW``'s single-tensor update of one tensor, in place."""
    import torch

    with torch.no_grad():
        p.mul_(1 - LR * WEIGHT_DECAY)
        m.lerp_(g, 1 - BETAS[0])
        v.mul_(BETAS[1]).addcmul_(g, g, value=1 - BETAS[1])
        step_size = LR / (1 - BETAS[0] ** step)
        denom = (v.sqrt() / (1 - BETAS[1] ** step) ** 0.5).add_(EPS)
        p.addcdiv_(m, denom, value=-step_size)


def _storage_mib(tensors: list[Any]) -> float:
    seen: dict[int, int] = {}
    for t in tensors:
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values()) / 2**20


def _init_module(model: Any, shapes: dict[str, tuple[int, ...]], n: int, rank: int) -> None:
    """Fills a module's parameters (moved off ``meta``) with this rank's blocks of the values
    every configuration starts from (plain tensors for one process, FSDP2's DTensors)."""
    import torch

    model.to_empty(device="cpu")
    with torch.no_grad():
        for i, (k, p) in enumerate(model.named_parameters()):
            local = p.to_local() if hasattr(p, "to_local") else p
            local.copy_(_whole(k, shapes[k], i).chunk(n)[rank])


def _place(mode: str, rows: int, width: int) -> tuple[Any, Any]:
    """The data as ``mode`` takes them: GlobalTensors ``P("dp")`` for pshard, this rank's rows
    otherwise (the whole for one process)."""
    import torch.distributed as dist

    import pshard as ps

    n, rank = dist.get_world_size(), dist.get_rank()
    x_whole, y_whole = _data(rows, width)
    if mode.startswith("pshard"):
        return ps.shard((x_whole, y_whole), ps.P("dp"))
    return x_whole.chunk(n)[rank].clone(), y_whole.chunk(n)[rank].clone()


def _setup(mode: str, data: tuple[Any, Any], width: int, layers: int, rows: int) -> tuple[Any, Any]:
    """Builds ``mode``'s model and optimizer state on this rank; returns ``step(i) -> loss``
    (the ``i``-th AdamW step, from 1) and ``state() -> tensors`` (parameters and moments)."""
    import optree
    import torch
    import torch.distributed as dist

    import pshard as ps

    n, rank = dist.get_world_size(), dist.get_rank()
    x, y = data
    model = _model(width, layers)
    shapes = {k: tuple(p.shape) for k, p in model.named_parameters()}
    if mode in ("fsdp2", "one-backward"):
        if mode == "fsdp2":
            from torch.distributed.fsdp import fully_shard

            for block in model.blocks:
                fully_shard(block, mesh=ps.current_mesh())
            fully_shard(model, mesh=ps.current_mesh())
        _init_module(model, shapes, n, rank)
        opt = torch.optim.AdamW(
            model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY
        )

        def module_step(i: int) -> torch.Tensor:
            loss = ((model(x) - y) ** 2).mean()  # FSDP2 averages the ranks' gradients
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.detach()

        def module_state() -> list[torch.Tensor]:
            out = [getattr(p, "to_local", lambda p=p: p)() for p in model.parameters()]
            for s in opt.state.values():
                out += [getattr(t, "to_local", lambda t=t: t)() for t in s.values() if t.dim()]
            return out

        return module_step, module_state

    params: dict[str, Any] = {}
    for i, k in enumerate(shapes):
        whole = _whole(k, shapes[k], i)
        params[k] = ps.shard(whole, ps.P("dp")) if mode.startswith("pshard") else whole
        del whole
    m: Any = optree.tree_map(torch.zeros_like, params)  # type: ignore[arg-type]
    v: Any = optree.tree_map(torch.zeros_like, params)  # type: ignore[arg-type]
    total = rows * width

    def tail(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ps.psum(((out - y) ** 2).sum(), "dp") / total

    if mode.startswith("pshard"):

        def body(params: dict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            out = ps.sharded_call(model, params, (x,), specs=ps.P("dp"))
            return ps.checkpoint(tail)(out, y) if mode == "pshard-ckloss" else tail(out, y)

        loss_fn = ps.shard_map(
            body, in_specs=(ps.P("dp"), ps.P("dp"), ps.P("dp")), out_specs=ps.P()
        )
    else:

        def loss_fn(params: dict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return ((torch.func.functional_call(model, params, (x,)) - y) ** 2).mean()

    grad_and_value = torch.func.grad_and_value(loss_fn)

    def step(i: int) -> torch.Tensor:
        grads, loss = grad_and_value(params, x, y)
        update = lambda p, g, m, v: _adamw_(p, g, m, v, i)  # noqa: E731
        optree.tree_map(update, params, grads, m, v)  # type: ignore[arg-type]
        return loss

    def state() -> list[torch.Tensor]:
        leaves: list[Any] = optree.tree_leaves((params, m, v))  # type: ignore[arg-type]
        return [t for t in leaves if isinstance(t, torch.Tensor)]

    return step, state


def run(
    mode: str, width: int, layers: int, rows: int, steps: int, profile: bool, where: bool
) -> dict:
    """One configuration in fresh processes: ``steps`` AdamW steps, their losses, times and
    this rank's memory."""
    import torch
    import torch.distributed as dist

    import pshard as ps

    rank = dist.get_rank()
    ps.init_mesh({"dp": dist.get_world_size()})
    if mode == "fsdp2":
        import torch.distributed.fsdp  # noqa: F401  (imported before the baseline)
    data = _place(mode, rows, width)
    trim()
    base = rss_mib()  # everything below is counted
    watch = _PeakWatch(base) if where and rank == 0 else None
    step, state = _setup(mode, data, width, layers, rows)
    times: list[float] = []
    losses: list[float] = []
    prof = None
    for i in range(1, steps + 1):
        if profile and rank == 0 and i == steps:
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            prof.__enter__()
        start = time.perf_counter()
        losses.append(float(step(i)))
        times.append(time.perf_counter() - start)
    if prof is not None:
        prof.__exit__(None, None, None)
    peak = peak_mib() - base
    state_mib = _storage_mib(state())
    trim()
    out = {
        "losses": losses,
        "step": statistics.median(times[1:] or times),
        "peak": peak,
        "held": rss_mib() - base,
        "state": state_mib,
    }
    if watch is not None:
        out["where"] = watch.stop()
    if prof is not None:
        out["profile"] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20)
    return out


def run_paired(width: int, layers: int, rows: int, pairs: int) -> dict:
    """FSDP2 and pshard in the same processes, their steps alternating (the order swapped from
    one pair to the next), so that both see the same load: each one's step times after one
    warm-up step each, and the ratio pshard / FSDP2 of each pair."""
    import torch.distributed as dist

    import pshard as ps

    ps.init_mesh({"dp": dist.get_world_size()})
    fsdp2, _ = _setup("fsdp2", _place("fsdp2", rows, width), width, layers, rows)
    pshard, _ = _setup("pshard", _place("pshard", rows, width), width, layers, rows)
    times: dict[str, list[float]] = {"fsdp2": [], "pshard": []}
    for i in range(1, pairs + 2):
        order = [("fsdp2", fsdp2), ("pshard", pshard)]
        for name, step in order if i % 2 else order[::-1]:
            start = time.perf_counter()
            float(step(i))
            times[name].append(time.perf_counter() - start)
    ratios = [p / f for p, f in zip(times["pshard"][1:], times["fsdp2"][1:], strict=True)]
    return {"fsdp2": times["fsdp2"][1:], "pshard": times["pshard"][1:], "ratios": ratios}


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=3, help="AdamW steps, the first a warm-up")
    parser.add_argument("--nprocs", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument(
        "--pairs", type=int, default=4, help="paired FSDP2 / pshard steps timed (0: none)"
    )
    parser.add_argument("--modes", nargs="+", default=list(DEFAULT_MODES), choices=list(MODES))
    parser.add_argument("--profile", action="store_true", help="profile rank 0's last step")
    parser.add_argument(
        "--where", action="store_true", help="rank 0's Python stack at its memory peak"
    )
    args = parser.parse_args()
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")
    import pshard as ps

    n_params = args.layers * (args.width * args.width + args.width)
    print(
        f"MLP: {args.layers} x (Linear({args.width}, {args.width}) + GELU), float32, "
        f"{n_params * 4 / 2**20:.1f} MiB of parameters; {args.rows} rows, MSE; AdamW; "
        f"{args.steps} steps (the first a warm-up); {args.nprocs} gloo ranks"
    )
    results: dict[str, list[dict]] = {mode: [] for mode in args.modes}
    for r in range(args.rounds):
        for mode in args.modes:
            nprocs = args.nprocs if MODES[mode][1] else 1
            ranks = ps.spawn(
                run, mode, args.width, args.layers, args.rows, args.steps, args.profile,
                args.where, nprocs=nprocs, timeout=3600,
            )  # fmt: skip
            summary = {
                "peak": max(x["peak"] for x in ranks),
                "held": max(x["held"] for x in ranks),
                "state": max(x["state"] for x in ranks),
                "step": statistics.median(x["step"] for x in ranks),
                # each rank's loss is over its rows (equal numbers): the mean is the whole's
                "losses": [
                    statistics.fmean(ls) for ls in zip(*(x["losses"] for x in ranks), strict=True)
                ],
            }
            results[mode].append(summary)
            print(
                f"  round {r + 1}, {MODES[mode][0]}: peak {summary['peak']:.1f} MiB, step "
                f"{summary['step']:.2f} s, losses "
                + " ".join(f"{v:.7f}" for v in summary["losses"]),
                flush=True,
            )
            for key in ("where", "profile"):
                for x in ranks:
                    if key in x:
                        print(f"{MODES[mode][0]}, rank 0, {key}: {x[key]}")

    paired = None
    if args.pairs and args.nprocs > 0:
        ranks = ps.spawn(
            run_paired, args.width, args.layers, args.rows, args.pairs,
            nprocs=args.nprocs, timeout=3600,
        )  # fmt: skip
        # the pair's ratio on each rank, the median over the ranks, then over the pairs
        per_pair = [statistics.median(r) for r in zip(*(x["ratios"] for x in ranks), strict=True)]
        paired = {
            "fsdp2": statistics.median(t for x in ranks for t in x["fsdp2"]),
            "pshard": statistics.median(t for x in ranks for t in x["pshard"]),
            "ratio": statistics.median(per_pair),
            "pairs": per_pair,
        }
        print(
            f"  paired steps in the same processes: FSDP2 {paired['fsdp2']:.2f} s, pshard "
            f"{paired['pshard']:.2f} s, pshard / FSDP2 per pair "
            + " ".join(f"{r:.2f}" for r in per_pair),
            flush=True,
        )

    def med(mode: str, key: str) -> float:
        return statistics.median(s[key] for s in results[mode]) if mode in results else 0.0

    ref = "one" if "one" in results else None
    print(
        "\n| configuration | peak MiB / rank | held MiB | state MiB | step s "
        "| max abs loss diff from one process |"
    )
    print("|---|---|---|---|---|---|")
    for mode in args.modes:
        diff = "-"
        if ref is not None:
            diff = "{:.1e}".format(
                max(
                    abs(a - b)
                    for s, rs in zip(results[mode], results[ref], strict=True)
                    for a, b in zip(s["losses"], rs["losses"], strict=True)
                )
            )
        print(
            f"| {MODES[mode][0]} | {med(mode, 'peak'):.1f} | {med(mode, 'held'):.1f} | "
            f"{med(mode, 'state'):.1f} | {med(mode, 'step'):.2f} | {diff} |"
        )
    if "pshard" not in results:
        return
    print("\n| ratio | figure | target |\n|---|---|---|")
    rows = []
    if paired is not None:
        rows.append(("pshard / FSDP2, step (paired)", f"{paired['ratio']:.2f}", "<= 1.2"))
    if "fsdp2" in results:
        per_round = [
            p["step"] / f["step"] for p, f in zip(results["pshard"], results["fsdp2"], strict=True)
        ]
        rows += [
            ("pshard / FSDP2, peak", _ratio(med("pshard", "peak"), med("fsdp2", "peak")), "<= 1"),
            ("pshard / FSDP2, step (separate runs)", f"{statistics.median(per_round):.2f}", ""),
        ]
    if ref is not None:
        rows.append(
            (
                "pshard / one process, peak",
                _ratio(med("pshard", "peak"), med(ref, "peak")),
                "<= 0.3",
            )
        )
        if "fsdp2" in results:
            rows.append(
                ("FSDP2 / one process, peak", _ratio(med("fsdp2", "peak"), med(ref, "peak")), "")
            )
    if "one-backward" in results:
        rows.append(
            (
                "pshard / one process .backward(), peak",
                _ratio(med("pshard", "peak"), med("one-backward", "peak")),
                "",
            )
        )
    if "pshard-ckloss" in results and "fsdp2" in results:
        rows.append(
            (
                "pshard, loss in ps.checkpoint / FSDP2, peak",
                _ratio(med("pshard-ckloss", "peak"), med("fsdp2", "peak")),
                "",
            )
        )
    for name, figure, target in rows:
        print(f"| {name} | {figure} | {target} |")


if __name__ == "__main__":
    main()
