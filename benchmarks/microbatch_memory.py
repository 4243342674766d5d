"""Peak memory of gradient accumulation with ``pmap_microbatch`` against one full batch.

Each configuration runs in a fresh subprocess, which reports its peak resident set size
(``resource.getrusage(RUSAGE_SELF).ru_maxrss``) after one training step minus the peak before
it (model, data and a tiny warm-up step already in memory). The step is
``pmap_microbatch(torch.func.grad_and_value(loss), num_microbatches=k)`` on an activation-heavy
MLP (6 x Linear(1024, 1024) + ReLU, batch 8192, MSE), and, for comparison, a hand-written
accumulation loop over ``tensor_split`` microbatches.

Resident memory depends on the allocator as well as on what is alive: glibc's malloc raises its
mmap threshold after large blocks are freed, after which freed activations may stay in the
heap and count as resident. The main table therefore runs the children with
``MALLOC_MMAP_THRESHOLD_=131072`` (large blocks always mapped, and returned when freed), so the
peak is the memory actually alive; a second table shows glibc's default behaviour.

Usage: ``python benchmarks/microbatch_memory.py``. Target: k=8 at most 0.45x the peak of k=1.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BATCH, WIDTH, DEPTH = 8192, 1024, 6


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def child(mode: str, k: int) -> None:
    sys.path.insert(0, str(ROOT))
    import torch
    from _anchors import hand_accumulation, microbatched
    from torch.func import functional_call, grad_and_value

    torch.set_num_threads(2)
    torch.manual_seed(0)
    layers = []
    for _ in range(DEPTH):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers)
    params = {name: p.detach() for name, p in model.named_parameters()}
    x, y = torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH)

    def loss(params, x, y):
        return torch.nn.functional.mse_loss(functional_call(model, params, (x,)), y)

    step_fn = grad_and_value(loss)
    step = microbatched(step_fn, k) if mode == "pmap_microbatch" else hand_accumulation(step_fn, k)

    step(params, x[:16], y[:16])  # warm-up: load every code path on a tiny batch
    before = peak_mib()
    grads, value = step(params, x, y)
    after = peak_mib()
    print(json.dumps({"peak_mib": after - before, "loss": float(value)}))


def run_child(mode: str, k: int, fixed_threshold: bool) -> dict:
    env = dict(os.environ)
    env.pop("MALLOC_MMAP_THRESHOLD_", None)
    if fixed_threshold:
        env["MALLOC_MMAP_THRESHOLD_"] = "131072"
    out = subprocess.run(
        [sys.executable, __file__, "--child", mode, str(k)],
        check=True,
        capture_output=True,
        text=True,
        env=env,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def table(fixed_threshold: bool) -> None:
    ks = [1, 2, 4, 8]
    modes = ("pmap_microbatch", "hand-written loop")
    rows = {(mode, k): run_child(mode, k, fixed_threshold) for mode in modes for k in ks}
    base = rows[("pmap_microbatch", 1)]["peak_mib"]
    malloc = "MALLOC_MMAP_THRESHOLD_=131072" if fixed_threshold else "glibc default malloc"
    print(
        f"\npeak RSS of one step above the pre-step peak (MiB); MLP {DEPTH} x Linear({WIDTH}) + "
        f"ReLU, batch {BATCH}, float32, {malloc}"
    )
    print("| k | pmap_microbatch | ratio to k=1 | hand-written loop | ratio to k=1 | loss |")
    print("|---|---|---|---|---|---|")
    for k in ks:
        p, h = rows[("pmap_microbatch", k)], rows[("hand-written loop", k)]
        print(
            f"| {k} | {p['peak_mib']:.0f} | {p['peak_mib'] / base:.2f} | {h['peak_mib']:.0f} | "
            f"{h['peak_mib'] / base:.2f} | {p['loss']:.6f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", nargs=2, metavar=("MODE", "K"))
    args = parser.parse_args()
    if args.child:
        child(args.child[0], int(args.child[1]))
        return
    table(fixed_threshold=True)
    table(fixed_threshold=False)


if __name__ == "__main__":
    main()
