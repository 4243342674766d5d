"""Ring attention's block kernels on one device: each rank's compute against full SDPA's share.

One causal attention layer (batch 1, S tokens, 8 heads of 64), forward + backward. For each rank
``r`` of ``N`` under ``"zigzag"``, the ring's whole compute for that rank runs on this one
device with the transfers taken out (each step's block is the rank's own, which changes no
mask and no kernel call: the schedule decides those from positions), with the block kernel
``block_kernel`` picks for the device (the CPU flash kernel; on CUDA the efficient-attention
kernel, once its check has passed) and with explicit matmuls. The anchor is full
``scaled_dot_product_attention`` over the whole sequence, forward + backward, divided by ``N``:
what a rank would take if the work split perfectly at no cost. The ratio is the slowest rank's
time over that share (medians of interleaved rounds). With ``--window W`` the layer is causal
with a sliding window of ``W`` keys (Hugging Face's ``sliding_window``): the blocks the window
cuts are masked blocks, and the anchor is SDPA with the same boolean mask.

    python benchmarks/ring_blocks.py [--device cpu|cuda] [--dtype float32] [--seq 2048 4096]
        [--ranks 2 4 8] [--window W] [--threads 1] [--rounds 5]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
import types

import torch

from pshard.sequence import _ring_pass as ring
from pshard.sequence._layouts import SeqLayout
from pshard.sequence._masks import check_window
from pshard.sequence._ring_blocks import acc_dtype
from pshard.sequence._ring_schedule import RingSpec

HEADS, SIZE = 8, 64


@contextlib.contextmanager
def _alone(explicit: bool):
    """The ring without transfers (a block stays where it is), with explicit matmuls if asked."""
    raw, pick = ring.raw, ring.block_kernel
    ring.raw = types.SimpleNamespace(
        ppermute_start=lambda x, c, perm: (x, []), wait=lambda pending: None
    )
    if explicit:
        ring.block_kernel = lambda device, dtype, width: None
    try:
        yield
    finally:
        ring.raw, ring.block_kernel = raw, pick


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(run, device: torch.device) -> float:
    _sync(device)
    t0 = time.perf_counter()
    run()
    _sync(device)
    return time.perf_counter() - t0


def _rank(s: int, n: int, r: int, dtype, device, explicit: bool, window: int | None):
    """One rank's ring compute, forward + backward, as a function to time."""
    lay = SeqLayout("zigzag", s, n)
    spec = RingSpec(lay, True, SIZE**-0.5, 1, check_window("ring_blocks", window))
    c = types.SimpleNamespace(size=n, rank=r)
    g = torch.Generator(device=device).manual_seed(r)
    local = lay.local_length

    def rand(*shape):
        return torch.randn(*shape, generator=g, device=device, dtype=dtype)

    q, do = rand(1, HEADS, 1, local, SIZE), rand(1, HEADS, 1, local, SIZE)
    k, v = rand(1, HEADS, local, SIZE), rand(1, HEADS, local, SIZE)

    def run() -> None:
        with _alone(explicit):
            out, lse = ring.ring_forward(q, k, v, None, c, spec)
            ring.ring_backward(q, k, v, out, lse, do, None, c, spec)

    return run


def _full(s: int, dtype, device, window: int | None):
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v, do = (
        torch.randn(1, HEADS, s, SIZE, generator=g, device=device, dtype=dtype) for _ in range(4)
    )
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    mask = None
    if window is not None:  # query i sees key j when i - window < j <= i
        i, j = torch.arange(s, device=device).view(-1, 1), torch.arange(s, device=device)
        mask = (j <= i) & (i - window < j)

    def run() -> None:
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None
        )
        torch.autograd.grad(out, (q, k, v), do)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    parser.add_argument("--seq", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--window", type=int, default=None, help="a causal sliding window")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    torch.set_num_threads(args.threads)
    kern = ring.block_kernel(device, acc_dtype(dtype), SIZE)
    name = kern.name if kern is not None else "explicit matmuls (no fused kernel here)"
    mask = "causal" if args.window is None else f"causal, window {args.window}"
    print(
        f"ring blocks on {device} ({args.dtype}, {args.threads} thread(s) on CPU), {mask}, "
        f"zigzag, b=1, {HEADS} heads of {SIZE}, fwd + bwd; kernel: {name}"
    )
    print(
        f"{'S':>5} {'N':>2} | {'SDPA/N ms':>9} | {'fused ms':>8} {'ratio':>6} | "
        f"{'explicit ms':>11} {'ratio':>6} | {'ranks fused ms':>15}"
    )
    for s in args.seq:
        full = _full(s, dtype, device, args.window)
        for n in args.ranks:
            runs = {"full": full}
            for r in range(n):
                runs[("fused", r)] = _rank(s, n, r, dtype, device, False, args.window)
                runs[("explicit", r)] = _rank(s, n, r, dtype, device, True, args.window)
            for run in runs.values():  # warm-up (and the kernel's check, once)
                run()
            times: dict = {key: [] for key in runs}
            keys = list(runs)
            for i in range(args.rounds):
                for key in keys[i % len(keys) :] + keys[: i % len(keys)]:  # rotating order
                    times[key].append(_timed(runs[key], device))
            med = {key: statistics.median(t) * 1e3 for key, t in times.items()}
            share = med["full"] / n
            fused = [med[("fused", r)] for r in range(n)]
            explicit = max(med[("explicit", r)] for r in range(n))
            print(
                f"{s:>5} {n:>2} | {share:9.2f} | {max(fused):8.2f} {max(fused) / share:6.2f} | "
                f"{explicit:11.2f} {explicit / share:6.2f} | "
                f"{min(fused):6.2f}-{max(fused):.2f}"
            )


if __name__ == "__main__":
    main()
