"""``ps.optim.adamw`` against ``torch.optim.AdamW(foreach=True).step()`` on the same blocks.

The blocks are one rank's share of a decoder's parameters (``--layers`` blocks of width
``--width``: four attention projections, a 4x MLP, two norms; an embedding and a head of
``--vocab`` rows) held as ``GlobalTensor`` s sharded ``P("dp")`` over ``--ranks`` ranks (a
1-rank mesh with the blocks' shapes: the math is per block, no communication), float32. Four
ways to take an AdamW step, timed in interleaved rounds (medians; the ratio is the median of
the per-round ratios):

- **torch**: ``torch.optim.AdamW(foreach=True).step()`` on the blocks (in place, one temporary);
- **pure**: ``updates, state = tx.update(grads, state, params)`` then
  ``params = ps.optim.apply_updates(params, updates)`` (new moments, updates and parameters);
- **donate**: the same with ``donate=True`` in both (moments, updates and parameters written
  into the donated tensors);
- **tree_map**: AdamW written with ``optree.tree_map`` over the GlobalTensors (as
  ``examples/functional_llama.py`` did): one kernel per operation and leaf.

Each round times every way three times and keeps the best (on a shared machine, the time with
the core to itself); the table gives the median over rounds and the median per-round ratio.
A pure step allocates what torch writes in place: on a CPU, tensors larger than the
allocator's heap threshold (128 KiB by default in glibc) are fresh pages on each allocation,
whose first touch costs more than a pass over them, so the pure ratio grows with the blocks'
size (``--width 128 --vocab 2000`` stays in the heap); with a caching allocator (CUDA) it does
not.

Usage: ``python benchmarks/optim.py [--width 1024] [--layers 4] [--vocab 32000] [--ranks 4]
[--rounds 15] [--device cpu|cuda]``. Target: donate about 1.0x torch, pure at most 1.3x where
allocating is cheap (the test suite asserts 1.75x pure on heap-sized blocks and 1.5x donating on
larger ones).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import optree  # noqa: E402
import torch  # noqa: E402

import pshard as ps  # noqa: E402

LR, B1, B2, EPS, WD = 1e-3, 0.9, 0.999, 1e-8, 0.01


def _shapes(width: int, layers: int, vocab: int) -> dict[str, tuple[int, ...]]:
    out: dict[str, tuple[int, ...]] = {"embed": (vocab, width), "head": (vocab, width)}
    for i in range(layers):
        for name in ("q", "k", "v", "o"):
            out[f"layers.{i}.attn.{name}"] = (width, width)
        out[f"layers.{i}.mlp.up"] = (4 * width, width)
        out[f"layers.{i}.mlp.down"] = (width, 4 * width)
        out[f"layers.{i}.norm1"] = (width,)
        out[f"layers.{i}.norm2"] = (width,)
    out["norm"] = (width,)
    return out


def _blocks(shapes: dict[str, tuple[int, ...]], ranks: int, seed: int) -> dict[str, torch.Tensor]:
    """Rank 0's block of each parameter under P("dp") on ``ranks`` ranks."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in shapes.items():
        rows = -(-shape[0] // ranks)
        out[name] = torch.randn((rows, *shape[1:]), generator=g) * 0.02
    return out


def _tree_map_adamw(params: Any, grads: Any, m: Any, v: Any, step: int) -> tuple[Any, Any, Any]:
    m = optree.tree_map(lambda m, g: B1 * m + (1 - B1) * g, m, grads)
    v = optree.tree_map(lambda v, g: B2 * v + (1 - B2) * g * g, v, grads)
    c1, c2 = 1 - B1**step, 1 - B2**step

    def update(p: torch.Tensor, m: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return p * (1 - LR * WD) - LR / c1 * m / ((v / c2).sqrt() + EPS)

    return optree.tree_map(update, params, m, v), m, v


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    ps.init_mesh({"dp": 1})

    shapes = _shapes(args.width, args.layers, args.vocab)
    blocks = {k: v.to(device) for k, v in _blocks(shapes, args.ranks, seed=0).items()}
    grad_blocks = {k: v.to(device) for k, v in _blocks(shapes, args.ranks, seed=1).items()}
    count = sum(b.numel() for b in blocks.values())

    leaves = [b.clone().requires_grad_() for b in blocks.values()]
    for p, g in zip(leaves, grad_blocks.values(), strict=True):
        p.grad = g.clone()
    opt = torch.optim.AdamW(leaves, lr=LR, betas=(B1, B2), eps=EPS, weight_decay=WD, foreach=True)

    tx = ps.optim.adamw(LR, b1=B1, b2=B2, eps=EPS, weight_decay=WD)
    grads = ps.shard(grad_blocks, ps.P("dp"))
    pure = {"params": ps.shard(blocks, ps.P("dp"))}
    pure["state"] = tx.init(pure["params"])
    donated = {"params": ps.shard(blocks, ps.P("dp"))}
    donated["state"] = tx.init(donated["params"])
    spare = optree.tree_map(torch.clone, grads)  # gradients to donate, refreshed each step
    mapped: dict[str, Any] = {"params": ps.shard(blocks, ps.P("dp")), "step": 0}
    mapped["m"] = optree.tree_map(torch.zeros_like, mapped["params"])
    mapped["v"] = optree.tree_map(torch.zeros_like, mapped["params"])

    def pure_step() -> None:
        updates, pure["state"] = tx.update(grads, pure["state"], pure["params"])
        pure["params"] = ps.optim.apply_updates(pure["params"], updates)

    def donate_step() -> None:
        updates, donated["state"] = tx.update(
            spare, donated["state"], donated["params"], donate=True
        )
        donated["params"] = ps.optim.apply_updates(donated["params"], updates, donate=True)

    def refresh() -> None:  # not timed: the next step's gradients, as a backward would give
        for s, g in zip(optree.tree_leaves(spare), optree.tree_leaves(grads), strict=True):
            s.copy_(g)

    def tree_map_step() -> None:
        mapped["step"] += 1
        mapped["params"], mapped["m"], mapped["v"] = _tree_map_adamw(
            mapped["params"], grads, mapped["m"], mapped["v"], mapped["step"]
        )

    fns = {"torch": opt.step, "pure": pure_step, "donate": donate_step, "tree_map": tree_map_step}
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    medians, ratios = _time(fns, refresh, args.rounds, sync)

    where = (
        torch.cuda.get_device_name(device) if device.type == "cuda" else f"{args.threads} thread(s)"
    )
    print(
        f"AdamW step on {len(blocks)} blocks, {count / 1e6:.1f} M float32 elements per rank "
        f"(width {args.width}, {args.layers} layers, vocab {args.vocab}, {args.ranks} ranks), "
        f"{where}, {args.rounds} rounds"
    )
    print("| step | median (ms) | ratio to torch (per-round median) |")
    print("|---|---|---|")
    for name in fns:
        print(f"| {name} | {medians[name]:.2f} | {ratios[name]:.2f} |")


def _time(
    fns: dict[str, Callable[[], None]],
    refresh: Callable[[], None],
    rounds: int,
    sync: Callable[[], None],
) -> tuple[dict[str, float], dict[str, float]]:
    """Per step: the median over interleaved rounds of each round's best of three calls (ms),
    and the median of the per-round ratios to ``fns["torch"]``; ``refresh`` runs after each
    donating call, untimed; ``sync`` waits for the device before and after each timed call."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for r in range(rounds + 2):  # 2 warm-up rounds, the allocator included
        for name, f in fns.items():
            best = float("inf")
            for _ in range(3):
                sync()
                t0 = time.perf_counter()
                f()
                sync()
                best = min(best, time.perf_counter() - t0)
                if name == "donate":
                    refresh()
            if r >= 2:
                times[name].append(best)
    medians = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    ratios = {
        k: statistics.median(a / b for a, b in zip(v, times["torch"], strict=True))
        for k, v in times.items()
    }
    return medians, ratios


if __name__ == "__main__":
    main()
