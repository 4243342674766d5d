"""Peak memory and time of one training step with ``ps.checkpoint`` per layer.

Two models, each layer checkpointed on its own:

- ``mlp``: 8 residual feed-forward layers, ``x + W2 gelu(W1 x)`` (width D, hidden 4D);
- ``decoder``: pre-norm transformer decoder layers (causal SDPA attention, GELU MLP).

Variants: no remat under ``torch.func.grad`` (``plain grad``) and under ``.backward()``
(``plain backward``); ``ps.checkpoint`` on every layer under ``torch.func.grad`` with each
policy (``nothing_saveable``, ``dots_saveable``, ``save_only_these_names('hidden')`` on the
feed-forward's hidden activation, ``everything_saveable``, ``offload(dots_saveable)``); and
``torch.utils.checkpoint`` (non-reentrant) on every layer under ``.backward()``, the reference.

Each variant runs in a fresh process: a warm-up step, the memory step, then ``--rounds``
timed rounds. Memory (``peak``): on the CPU, the process's resident set high-water mark
(``VmHWM``, reset through ``/proc/self/clear_refs`` just before the step) minus the resident
size before the step, with ``MALLOC_MMAP_THRESHOLD_=65536`` so that large tensors are mapped
and returned to the system when freed (the resident size then follows what is alive); on
CUDA, ``torch.cuda.max_memory_allocated`` during the step minus what was allocated before it
(the caching allocator's count of live tensor bytes). Both include the gradients the step
creates, not the parameters and data that exist before it.

Time: each variant's step, the step without remat under ``torch.func.grad`` and a forward
without grad are timed round by round, interleaved, in the variant's process: ``step s`` is the
median step time, ``step / plain grad`` the median of the per-round ratios, and ``extra fwd``
the median of (step - plain grad step) / forward time per round, the recompute's cost in
forwards (target: at most 1 for ``nothing_saveable``).

Targets: ``nothing_saveable``'s peak at most ``torch.utils.checkpoint``'s, and on the MLP at
most half of no remat's.

    python benchmarks/remat.py [--model mlp|decoder|all] [--device cpu|cuda] [--rounds 5]

The CPU runs use 2 threads (``REMAT_THREADS``). On a machine shared with other work, time the
CPU time of the process rather than wall time (``REMAT_CLOCK=process``, best with
``REMAT_THREADS=1``: idle threads waiting for work count as busy).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

VARIANTS = (
    "plain grad",
    "plain backward",
    "torch.utils.checkpoint backward",
    "nothing_saveable grad",
    "dots_saveable grad",
    "names('hidden') grad",
    "everything_saveable grad",
    "offload(dots_saveable) grad",
)

SIZES = {
    # model: (layers, batch, seq, width, heads) on the CPU / on CUDA
    "mlp": {"cpu": (8, 4096, 1, 256, 0), "cuda": (8, 16384, 1, 2048, 0)},
    "decoder": {"cpu": (4, 4, 256, 256, 4), "cuda": (8, 8, 2048, 1024, 16)},
}


# --- the child: one variant in a fresh process ----------------------------------------------------


def _models(name: str, sizes: tuple[int, ...]) -> tuple[Any, Any]:
    import torch
    import torch.nn.functional as F

    from pshard._remat.names import checkpoint_name

    layers, batch, seq, width, heads = sizes

    class FeedForward(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up = torch.nn.Linear(width, 4 * width)
            self.down = torch.nn.Linear(4 * width, width)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.down(F.gelu(checkpoint_name(self.up(x), "hidden")))

    class MLPLayer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ff = FeedForward()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.ff(x)

    class DecoderLayer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm1 = torch.nn.LayerNorm(width)
            self.qkv = torch.nn.Linear(width, 3 * width)
            self.proj = torch.nn.Linear(width, width)
            self.norm2 = torch.nn.LayerNorm(width)
            self.ff = FeedForward()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, s, _ = x.shape
            qkv = self.qkv(self.norm1(x)).view(b, s, 3, heads, width // heads)
            q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(a.transpose(1, 2).reshape(b, s, width))
            return x + self.ff(self.norm2(x))

    layer = MLPLayer if name == "mlp" else DecoderLayer
    shape = (batch, width) if name == "mlp" else (batch, seq, width)
    return [layer() for _ in range(layers)], shape


def _rss_kib() -> tuple[int, int]:
    """(current resident KiB, high-water mark KiB) of this process."""
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            fields[key] = value
    return int(fields["VmRSS"].split()[0]), int(fields["VmHWM"].split()[0])


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def child(model_name: str, variant: str, device: str, rounds: int) -> dict:
    sys.path.insert(0, str(ROOT))
    import torch
    import torch.utils.checkpoint as tuc
    from torch.func import grad

    import pshard as ps
    from pshard._remat.checkpoint import checkpoint
    from pshard._remat.policies import checkpoint_policies as cp

    checkpoint = getattr(ps, "checkpoint", checkpoint)  # the public name once it is exported
    if device == "cpu":
        torch.set_num_threads(int(os.environ.get("REMAT_THREADS", "2")))
    torch.manual_seed(0)
    layers, shape = _models(model_name, SIZES[model_name][device])
    policy = {
        "nothing_saveable grad": cp.nothing_saveable,
        "dots_saveable grad": cp.dots_saveable,
        "names('hidden') grad": cp.save_only_these_names("hidden"),
        "everything_saveable grad": cp.everything_saveable,
        "offload(dots_saveable) grad": cp.offload(cp.dots_saveable),
    }.get(variant)
    if policy is not None:
        wrapped = [checkpoint(layer, policy=policy) for layer in layers]
    elif variant.startswith("torch.utils.checkpoint"):
        wrapped = [
            (lambda x, m=layer: tuc.checkpoint(m, x, use_reentrant=False)) for layer in layers
        ]
    else:
        wrapped = layers
    model = torch.nn.ModuleList(layers).to(device)
    params = {k: v.detach() for k, v in model.named_parameters()}
    x = torch.randn(shape, device=device)

    def forward(params: dict, x: torch.Tensor, layers: list = layers) -> torch.Tensor:
        with torch.nn.utils.stateless._reparametrize_module(model, params):
            for layer in layers:
                x = layer(x)
        return x.square().mean()

    def plain_step() -> Any:
        return grad(forward)(params, x)

    leaves = {k: v.clone().requires_grad_() for k, v in params.items()}

    def step() -> Any:
        if variant.endswith("backward"):
            return forward(leaves, x, wrapped).backward()
        return grad(forward)(params, x, wrapped)

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    # wall time by default; CPU time of the process (REMAT_CLOCK=process) on a shared machine,
    # where other programs' load moves wall times by more than the differences measured
    clock = time.process_time if os.environ.get("REMAT_CLOCK") == "process" else time.perf_counter

    def timed(fn: Callable[[], Any]) -> float:
        sync()
        start = clock()
        fn()
        sync()
        return clock() - start

    def reset() -> None:  # no gradients left from an earlier step
        for p in leaves.values():
            p.grad = None

    step()  # warm-up
    reset()
    sync()
    out: dict[str, Any] = {}
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step()
        sync()
        out["peak_mib"] = (torch.cuda.max_memory_allocated() - base) / 2**20
    else:
        rss, _ = _rss_kib()
        if _reset_hwm():
            step()
            out["peak_mib"] = (_rss_kib()[1] - rss) / 1024
        else:
            out["peak_mib"] = float("nan")
    reset()
    # time: this variant's step, no remat's step under torch.func.grad and a forward without
    # grad, interleaved round by round (a loaded machine slows all three alike)
    with torch.no_grad():
        timed(lambda: forward(params, x))
    timed(plain_step)
    ratios, forwards, steps = [], [], []
    for _ in range(rounds):
        t_step = timed(step)
        reset()
        t_plain = timed(plain_step)
        with torch.no_grad():
            t_fwd = timed(lambda: forward(params, x))
        steps.append(t_step)
        ratios.append(t_step / t_plain)
        forwards.append(t_fwd / t_plain)
    out["step_s"] = statistics.median(steps)
    out["ratio"] = statistics.median(ratios)
    out["extra_fwd"] = statistics.median((r - 1) / f for r, f in zip(ratios, forwards, strict=True))
    return out


# --- the driver ---------------------------------------------------------------------------------


def run(model: str, variant: str, device: str, rounds: int) -> dict:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    args = [sys.executable, __file__, "--child", model, variant, device, str(rounds)]
    out = subprocess.run(args, capture_output=True, text=True, env=env)
    if out.returncode:
        raise RuntimeError(f"{model} / {variant} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def table(model: str, device: str, rounds: int) -> None:
    sizes = SIZES[model][device]
    print(f"\n## {model} on {device}: layers, batch, seq, width, heads = {sizes}\n")
    results = {v: run(model, v, device, rounds) for v in VARIANTS}
    base = results["plain grad"]["peak_mib"]
    backward = results["plain backward"]["peak_mib"]
    ref = results["torch.utils.checkpoint backward"]["peak_mib"]
    print(
        "| variant | peak MiB | peak / plain grad | peak / plain backward | "
        "peak / torch ckpt | step s | step / plain grad | extra fwd |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for v, r in results.items():
        print(
            f"| {v} | {r['peak_mib']:.1f} | "
            f"{r['peak_mib'] / base:.2f} | {r['peak_mib'] / backward:.2f} | "
            f"{r['peak_mib'] / ref:.2f} | {r['step_s']:.3f} | {r['ratio']:.2f} | "
            f"{r['extra_fwd']:+.2f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="all", choices=["mlp", "decoder", "all"])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        model, variant, device, rounds = args.child
        print(json.dumps(child(model, variant, device, int(rounds))))
        return
    for model in ("mlp", "decoder") if args.model == "all" else (args.model,):
        table(model, args.device, args.rounds)


if __name__ == "__main__":
    main()
