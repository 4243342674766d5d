"""FSDP2 (``fully_shard``) against pshard's functional FSDP and one process, side by side.

The model: ``--layers`` blocks of ``Linear(W, W)`` + GELU (width ``--width``, float32 masters)
in an ``nn.ModuleList``, loss the mean squared error against a target, ``--rows`` rows in all,
the same AdamW (lr 1e-3, weight decay 0.01) in every configuration. The configurations, each in
fresh processes started by ``ps.spawn`` (gloo, CPU; ``ps.spawn``'s threads: one per rank on
this 2-core machine, two for the one process):

- **fsdp2** on ``--nprocs`` ranks: ``torch.distributed.fsdp.fully_shard`` on each block and on
  the root (built on the ``meta`` device, then ``to_empty``), ``.backward()``,
  ``torch.optim.AdamW``; each rank runs its rows (FSDP2 averages the gradients);
- **pshard** on ``--nprocs`` ranks: parameters and AdamW moments as ``GlobalTensor`` s
  ``P("dp")``, the data ``P("dp")``, a ``shard_map`` over ``"dp"`` whose body calls
  ``ps.sharded_call(model_on_meta, blocks, (x,), specs=P("dp"))``, ``torch.func.grad``, and
  AdamW applied to the blocks with ``optree.tree_map``;
- **one process** holding the whole model (float32): ``torch.func.grad`` of
  ``functional_call`` and the same AdamW.

Each sharded configuration runs under every ``--policies``: ``float32``, and ``bfloat16``
(FSDP2's ``MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)``,
``sharded_call``'s ``param_dtype=torch.bfloat16, reduce_dtype=torch.float32``: float32 masters
and moments, bfloat16 gathers and compute, float32 reduction).

The AdamW of pshard and of the one process is ``torch.optim.AdamW``'s single-tensor update
written out (in place on the blocks, the same ops in the same order), so the loss curves agree
to the rounding of the matmuls and the collectives' sums: the script prints the largest
difference from the one process's losses.

Measured per rank, as ``benchmarks/global_memory.py`` does (``MALLOC_MMAP_THRESHOLD_=131072``
so freed blocks go back to the system; the data are made before the baseline and each rank
keeps only its rows; the parameters are made one whole tensor at a time and each rank keeps
its block):

- ``peak``: the process's resident high-water mark (``ru_maxrss``) minus its resident size
  before the model was built, the largest over the ranks;
- ``held``: resident size after the steps minus the same baseline (parameters and AdamW state);
- ``step``: the median over the steps after the first (the warm-up) of one rank's step time
  (forward, backward, optimizer), the median over the ranks;
- all-gathers: what rank 0 hands to all-gathers in the last step (the input of each
  ``all_gather_single``, or the block each pairwise gather sends): their number and bytes.

``--rounds`` repeats the configurations, interleaved, and reports medians. Step times taken
in separate runs move with the load of a shared machine (by 2x between runs here), so the time
ratios come from ``--pairs`` rounds of paired steps per policy: FSDP2, pshard and pshard with
``prefetch=False`` built in the same ``--nprocs`` processes, their steps taking turns (the
order rotated each round) after one warm-up step each; each ratio (pshard / FSDP2, pshard with /
without prefetch) is the median over the rounds of that round's ratio (median over the ranks).

More configurations for the analysis in ``benchmarks/README.md`` (``--modes``):
``pshard-ckloss``, pshard with the loss (after ``sharded_call``) inside ``ps.checkpoint``;
``pshard-noprefetch``; ``pshard-zero2`` (``reshard_after_forward=False``); ``one-backward``,
one process with ``.backward()`` and ``torch.optim.AdamW``. ``--where`` prints rank 0's Python
stack at its memory peak, ``--profile`` a profile of its last step.

Targets (issue 36): pshard's peak at most FSDP2's under both policies and at most 0.3x the one
process's; pshard's step at most 0.9x FSDP2's with prefetch; bfloat16 gathers half the bytes.

    python benchmarks/fsdp.py [--width 2048] [--layers 8] [--rows 8192] [--steps 3]
        [--nprocs 4] [--rounds 1] [--pairs 4] [--modes fsdp2 pshard one pshard-ckloss
        pshard-noprefetch pshard-zero2 one-backward] [--policies float32 bfloat16]
        [--where] [--profile]
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
    "pshard-noprefetch": ("pshard, prefetch=False", True),
    "pshard-zero2": ("pshard, reshard_after_forward=False", True),
    "one-backward": ("one process, .backward()", False),
}
DEFAULT_MODES = ("fsdp2", "pshard", "one")
# policy -> (param_dtype, reduce_dtype) names: FSDP2's MixedPrecisionPolicy and sharded_call's
POLICIES = {"float32": (None, None), "bfloat16": ("bfloat16", "float32")}
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


def _dtypes(policy: str) -> tuple[Any, Any]:
    import torch

    return tuple(None if d is None else getattr(torch, d) for d in POLICIES[policy])


def _setup(
    mode: str, policy: str, data: tuple[Any, Any], width: int, layers: int, rows: int
) -> tuple[Any, Any]:
    """Builds ``mode``'s model and optimizer state on this rank under the dtype ``policy``;
    returns ``step(i) -> loss`` (the ``i``-th AdamW step, from 1) and ``state() -> tensors``
    (parameters and moments)."""
    import optree
    import torch
    import torch.distributed as dist

    import pshard as ps

    n, rank = dist.get_world_size(), dist.get_rank()
    x, y = data
    model = _model(width, layers)
    shapes = {k: tuple(p.shape) for k, p in model.named_parameters()}
    param_dtype, reduce_dtype = _dtypes(policy)
    if mode in ("fsdp2", "one-backward"):
        if mode == "fsdp2":
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
            for block in model.blocks:
                fully_shard(block, mesh=ps.current_mesh(), mp_policy=mp)
            fully_shard(model, mesh=ps.current_mesh(), mp_policy=mp)
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
        return ps.psum(((out - y) ** 2).sum(), "dp") / total  # bfloat16 out: float32 loss

    if mode.startswith("pshard"):
        policy_kw = {
            "param_dtype": param_dtype,
            "reduce_dtype": reduce_dtype,
            "prefetch": mode != "pshard-noprefetch",
            "reshard_after_forward": mode != "pshard-zero2",
        }

        def body(params: dict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            out = ps.sharded_call(model, params, (x,), specs=ps.P("dp"), **policy_kw)
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


class _Wire:
    """Counts the bytes this rank hands to all-gathers (gloo's own all-gather, or the pairwise
    sends pshard's wire makes of large CPU blocks), the collectives' inputs as FSDP2 and pshard
    call them: what goes out on the wire from this rank, per gather."""

    def __init__(self) -> None:
        import torch.distributed as dist

        from pshard._runtime import wire

        self.bytes: list[int] = []
        names = [(dist, "all_gather_into_tensor"), (dist, "all_gather_single")]
        names += [(wire, "_all_gather_flat"), (dist, "batch_isend_irecv")]
        self._saved = [(owner, name, getattr(owner, name)) for owner, name in names
                       if hasattr(owner, name)]  # fmt: skip

        def gather(fn: Any) -> Any:
            def counted(output: Any, input: Any, *args: Any, **kwargs: Any) -> Any:
                self.bytes.append(input.numel() * input.element_size())
                return fn(output, input, *args, **kwargs)

            return counted

        def sends(fn: Any) -> Any:
            def counted(ops: Any) -> Any:
                sent = [op.tensor for op in ops if op.op is dist.isend]
                if sent:  # one pairwise gather: this rank's block to every other rank
                    self.bytes.append(sent[0].numel() * sent[0].element_size())
                return fn(ops)

            return counted

        for owner, name, fn in self._saved:  # each caller counted once, by its own entry
            setattr(owner, name, sends(fn) if name == "batch_isend_irecv" else gather(fn))

    def close(self) -> None:
        for owner, name, fn in self._saved:
            setattr(owner, name, fn)


def run(
    mode: str,
    policy: str,
    width: int,
    layers: int,
    rows: int,
    steps: int,
    profile: bool,
    where: bool,
) -> dict:
    """One configuration in fresh processes: ``steps`` AdamW steps, their losses, times, this
    rank's memory and the bytes it handed to all-gathers in the last step."""
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
    step, state = _setup(mode, policy, data, width, layers, rows)
    times: list[float] = []
    losses: list[float] = []
    prof = None
    wire = None
    for i in range(1, steps + 1):
        if profile and rank == 0 and i == steps:
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            prof.__enter__()
        if i == steps and MODES[mode][1]:
            wire = _Wire()
        start = time.perf_counter()
        losses.append(float(step(i)))
        times.append(time.perf_counter() - start)
    if wire is not None:
        wire.close()
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
        "gathers": [] if wire is None else wire.bytes,
    }
    if watch is not None:
        out["where"] = watch.stop()
    if prof is not None:
        out["profile"] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20)
    return out


PAIRED = ("fsdp2", "pshard", "pshard-noprefetch")


def run_paired(policy: str, width: int, layers: int, rows: int, pairs: int) -> dict:
    """FSDP2, pshard and pshard without prefetch in the same processes, their steps taking
    turns (the order rotated from one round to the next), so that all see the same load: each
    one's step times after one warm-up step each, and per round the ratios pshard / FSDP2 and
    pshard / pshard without prefetch."""
    import torch.distributed as dist

    import pshard as ps

    ps.init_mesh({"dp": dist.get_world_size()})
    steps = {
        mode: _setup(mode, policy, _place(mode, rows, width), width, layers, rows)[0]
        for mode in PAIRED
    }
    times: dict[str, list[float]] = {mode: [] for mode in PAIRED}
    for i in range(1, pairs + 2):
        k = i % len(PAIRED)
        for mode in PAIRED[k:] + PAIRED[:k]:
            start = time.perf_counter()
            float(steps[mode](i))
            times[mode].append(time.perf_counter() - start)
    t = {mode: ts[1:] for mode, ts in times.items()}
    return {
        **t,
        "vs_fsdp2": [p / f for p, f in zip(t["pshard"], t["fsdp2"], strict=True)],
        "prefetch": [p / q for p, q in zip(t["pshard"], t["pshard-noprefetch"], strict=True)],
    }


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
        "--pairs", type=int, default=4, help="paired rounds of steps timed (0: none)"
    )
    parser.add_argument("--modes", nargs="+", default=list(DEFAULT_MODES), choices=list(MODES))
    parser.add_argument(
        "--policies", nargs="+", default=list(POLICIES), choices=list(POLICIES),
        help="dtype policies of the sharded configurations (FSDP2's MixedPrecisionPolicy and "
        "sharded_call's param_dtype / reduce_dtype); one process runs in float32",
    )  # fmt: skip
    parser.add_argument("--profile", action="store_true", help="profile rank 0's last step")
    parser.add_argument(
        "--where", action="store_true", help="rank 0's Python stack at its memory peak"
    )
    args = parser.parse_args()
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")
    import pshard as ps

    n_params = args.layers * (args.width * args.width + args.width)
    print(
        f"MLP: {args.layers} x (Linear({args.width}, {args.width}) + GELU), float32 masters, "
        f"{n_params * 4 / 2**20:.1f} MiB of parameters; {args.rows} rows, MSE; AdamW; "
        f"{args.steps} steps (the first a warm-up); {args.nprocs} gloo ranks"
    )
    configs = [
        (mode, policy)
        for policy in args.policies
        for mode in args.modes
        if MODES[mode][1] or policy == args.policies[0]
    ]
    results: dict[tuple[str, str], list[dict]] = {c: [] for c in configs}
    for r in range(args.rounds):
        for mode, policy in configs:
            nprocs = args.nprocs if MODES[mode][1] else 1
            pol = policy if MODES[mode][1] else "float32"
            ranks = ps.spawn(
                run, mode, pol, args.width, args.layers, args.rows, args.steps, args.profile,
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
                "gathers": ranks[0]["gathers"],
            }
            results[mode, policy].append(summary)
            sent = sum(summary["gathers"]) / 2**20
            print(
                f"  round {r + 1}, {MODES[mode][0]} ({pol}): peak {summary['peak']:.1f} MiB, "
                f"step {summary['step']:.2f} s, all-gathers {len(summary['gathers'])} sending "
                f"{sent:.1f} MiB, losses " + " ".join(f"{v:.7f}" for v in summary["losses"]),
                flush=True,
            )
            for key in ("where", "profile"):
                for x in ranks:
                    if key in x:
                        print(f"{MODES[mode][0]}, rank 0, {key}: {x[key]}")

    paired = {}
    for policy in args.policies if args.pairs and args.nprocs > 0 else ():
        ranks = ps.spawn(
            run_paired, policy, args.width, args.layers, args.rows, args.pairs,
            nprocs=args.nprocs, timeout=3600,
        )  # fmt: skip
        # a round's ratio on each rank, the median over the ranks, then over the rounds
        per = {
            key: [statistics.median(r) for r in zip(*(x[key] for x in ranks), strict=True)]
            for key in ("vs_fsdp2", "prefetch")
        }
        paired[policy] = {
            **{m: statistics.median(t for x in ranks for t in x[m]) for m in PAIRED},
            **{key: statistics.median(v) for key, v in per.items()},
            "rounds": per,
        }
        p = paired[policy]
        print(
            f"  paired steps ({policy}) in the same processes: FSDP2 {p['fsdp2']:.2f} s, "
            f"pshard {p['pshard']:.2f} s, without prefetch {p['pshard-noprefetch']:.2f} s; "
            "pshard / FSDP2 per round " + " ".join(f"{r:.2f}" for r in per["vs_fsdp2"])
            + "; with / without prefetch " + " ".join(f"{r:.2f}" for r in per["prefetch"]),
            flush=True,
        )  # fmt: skip

    def med(mode: str, policy: str, key: str) -> float:
        runs = results.get((mode, policy))
        return statistics.median(s[key] for s in runs) if runs else 0.0

    first = args.policies[0]
    ref = ("one", first) if ("one", first) in results else None
    print(
        "\n| configuration | policy | peak MiB / rank | held MiB | state MiB | step s "
        "| all-gathers a step, MiB sent / rank | max abs loss diff from one process |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for mode, policy in configs:
        if not results[mode, policy]:
            continue
        diff = "-"
        if ref is not None:
            diff = "{:.1e}".format(
                max(
                    abs(a - b)
                    for s, rs in zip(results[mode, policy], results[ref], strict=True)
                    for a, b in zip(s["losses"], rs["losses"], strict=True)
                )
            )
        g = results[mode, policy][-1]["gathers"]
        sent = f"{len(g)}, {sum(g) / 2**20:.1f}" if g else "-"
        print(
            f"| {MODES[mode][0]} | {policy if MODES[mode][1] else 'float32'} | "
            f"{med(mode, policy, 'peak'):.1f} | {med(mode, policy, 'held'):.1f} | "
            f"{med(mode, policy, 'state'):.1f} | {med(mode, policy, 'step'):.2f} | {sent} | "
            f"{diff} |"
        )
    print("\n| ratio | policy | figure | target |\n|---|---|---|---|")
    rows = []
    for policy in args.policies:
        p = paired.get(policy)
        if p is not None:
            rows.append(("pshard / FSDP2, step (paired)", policy, f"{p['vs_fsdp2']:.2f}", "<= 0.9"))
            rows.append(("pshard with / without prefetch, step (paired)", policy,
                         f"{p['prefetch']:.2f}", ""))  # fmt: skip
        for mode in ("pshard", "pshard-ckloss", "pshard-zero2", "pshard-noprefetch"):
            if (mode, policy) in results and ("fsdp2", policy) in results:
                rows.append((
                    f"{MODES[mode][0]} / FSDP2, peak", policy,
                    _ratio(med(mode, policy, "peak"), med("fsdp2", policy, "peak")),
                    "<= 1" if mode in ("pshard", "pshard-ckloss") else "",
                ))  # fmt: skip
        if ("pshard", policy) in results and ref is not None:
            one = _ratio(med("pshard", policy, "peak"), med(*ref, "peak"))
            rows.append(("pshard / one process (float32), peak", policy, one, "<= 0.3"))
    if len(args.policies) > 1 and all(("pshard", p) in results for p in args.policies[:2]):
        a, b = (results["pshard", p][-1]["gathers"] for p in args.policies[:2])
        rows.append((f"pshard all-gather bytes, {args.policies[1]} / {args.policies[0]}", "",
                     _ratio(sum(b), sum(a)), "0.5 for bfloat16"))  # fmt: skip
    for name, policy, figure, target in rows:
        print(f"| {name} | {policy} | {figure} | {target} |")


if __name__ == "__main__":
    main()
