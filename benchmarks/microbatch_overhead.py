"""Per-microbatch overhead of ``pmap_microbatch`` against a hand-written accumulation loop.

Both run ``torch.func.grad_and_value`` of an MLP loss over ``k`` microbatches of about 10 ms of
work each and average the gradients weighted by microbatch size; the loop splits with
``tensor_split`` and accumulates in place by hand. Rounds alternate between the two; the table
gives the median step time of each, the median of the per-round ratios, and the overhead per
microbatch (median per-round difference / k).

Usage: ``python benchmarks/microbatch_overhead.py [--rounds 40]``. Target: within 5%.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.func import functional_call, grad_and_value

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
from _anchors import hand_accumulation, microbatched  # noqa: E402


def make_case(width: int, depth: int, rows: int, k: int):
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.Tanh()]
    model = torch.nn.Sequential(*layers)
    params = {name: p.detach() for name, p in model.named_parameters()}
    x, y = torch.randn(rows * k, width), torch.randn(rows * k, width)

    def loss(params, x, y):
        return torch.nn.functional.mse_loss(functional_call(model, params, (x,)), y)

    step_fn = grad_and_value(loss)
    pmapped, loop = microbatched(step_fn, k), hand_accumulation(step_fn, k)

    return (params, x, y), {"pmap_microbatch": pmapped, "hand-written loop": loop}, step_fn


def timed(fn, args) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 thread, medians of {args.rounds} alternating rounds")
    print(
        "| k | microbatch step (ms) | pmap_microbatch (ms) | hand-written loop (ms) | "
        "ratio (per-round median) | overhead per microbatch (us) |"
    )
    print("|---|---|---|---|---|---|")
    for k in (4, 8, 16):
        inputs, impls, step_fn = make_case(width=256, depth=3, rows=768, k=k)
        params, x, y = inputs
        mb = (params, x[: x.shape[0] // k], y[: y.shape[0] // k])
        for fn in impls.values():  # warm up
            fn(*inputs)
        step_ms = statistics.median(timed(step_fn, mb) for _ in range(20)) * 1e3
        times = {name: [] for name in impls}
        for r in range(args.rounds):
            order = list(impls.items()) if r % 2 == 0 else list(reversed(impls.items()))
            for name, fn in order:
                times[name].append(timed(fn, inputs))
        ours, loop = times["pmap_microbatch"], times["hand-written loop"]
        ratio = statistics.median(a / b for a, b in zip(ours, loop, strict=True))
        per_mb = statistics.median(a - b for a, b in zip(ours, loop, strict=True)) / k * 1e6
        print(
            f"| {k} | {step_ms:.1f} | {statistics.median(ours) * 1e3:.1f} | "
            f"{statistics.median(loop) * 1e3:.1f} | {ratio:.3f} | {per_mb:.0f} |"
        )


if __name__ == "__main__":
    main()
