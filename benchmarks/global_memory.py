"""Per-rank memory of training state held as GlobalTensors against the whole-value loop.

A decoder-sized MLP (``--layers`` blocks of ``Linear(W, 4W)``, GELU, ``Linear(4W, W)``, float32)
trained with AdamW written with ``optree.tree_map``, on N = 1, 2, 4 gloo ranks, two ways:

- **whole**: every rank holds the whole parameters, gradients and moments (what an FSDP loop
  through ``shard_map`` with plain tensors does: exact, saves nothing);
- **global**: parameters, gradients and moments are ``GlobalTensor`` s sharded over ``"dp"``
  (``P("dp")`` on each weight's first dim); the step is ``torch.func.grad`` of a ``shard_map``
  whose body all-gathers each layer's weights right before using it.

Measured per rank (one fresh group of processes per configuration, through ``ps.spawn``):

- ``state``: bytes of the distinct storages behind the parameters, gradients and moments held
  between steps (read from the tensors' storages, not computed from shapes);
- ``RSS held``: resident memory after two steps minus before the model was built, with
  ``MALLOC_MMAP_THRESHOLD_=131072`` so that freed blocks go back to the system;
- ``peak``: peak resident memory during the steps minus before the model was built. Without
  rematerialisation the backward keeps every layer's gathered weights until it reaches that
  layer, so the peak holds the whole parameters once (``ps.checkpoint`` / ``sharded_call`` bring
  it down to one gathered layer);
- ``step``: median time of a step (gloo on loopback, 2 cores shared by the ranks).

Usage: ``python benchmarks/global_memory.py [--width 512] [--layers 8]``. Target: ``state`` at
most ceil(1/N) of the whole.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _memory import peak_mib, rss_mib, trim  # noqa: E402


def _storage_bytes(tree: object) -> int:
    import optree
    import torch

    seen: dict[int, int] = {}
    for t in optree.tree_leaves(tree):
        if isinstance(t, torch.Tensor):
            s = t.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def _adam(p: object, m: object, v: object, step: int) -> object:
    c1, c2 = 1 - 0.9**step, 1 - 0.999**step
    return p - 1e-3 * (m / c1) / ((v / c2).sqrt() + 1e-8)  # type: ignore[operator]


def run(mode: str, width: int, layers: int, steps: int) -> dict:
    import optree
    import torch

    import pshard as ps

    torch.set_num_threads(1)
    n = torch.distributed.get_world_size()
    ps.init_mesh({"dp": n})
    trim()
    base = rss_mib()
    g = torch.Generator().manual_seed(0)
    whole = {}
    for i in range(layers):
        whole[f"{i}.up"] = torch.randn(width, 4 * width, generator=g) / width**0.5
        whole[f"{i}.down"] = torch.randn(4 * width, width, generator=g) / (4 * width) ** 0.5
    x = torch.randn(8 * n, width, generator=g)

    def body(params: dict, x: torch.Tensor) -> torch.Tensor:
        h = x
        for i in range(layers):
            up, down = params[f"{i}.up"], params[f"{i}.down"]
            if mode == "global":
                up, down = ps.all_gather(up, "dp", dim=0), ps.all_gather(down, "dp", dim=0)
            h = h + torch.nn.functional.gelu(h @ up) @ down
        return ps.psum((h**2).mean(), "dp")

    spec = ps.P("dp") if mode == "global" else None
    params = ps.shard(whole, ps.P("dp")) if mode == "global" else whole
    del whole
    loss = ps.shard_map(body, in_specs=(spec, ps.P("dp")), out_specs=ps.P())
    step_grad = torch.func.grad(loss)
    m = optree.tree_map(torch.zeros_like, params)
    v = optree.tree_map(torch.zeros_like, params)
    times = []
    grads = None
    for step in range(1, steps + 1):
        start = time.perf_counter()
        grads = step_grad(params, x)
        m = optree.tree_map(lambda m, g: 0.9 * m + 0.1 * g, m, grads)
        v = optree.tree_map(lambda v, g: 0.999 * v + 0.001 * g * g, v, grads)
        params = optree.tree_map(partial(_adam, step=step), params, m, v)
        times.append(time.perf_counter() - start)
    trim()
    return {
        "state": _storage_bytes((params, grads, m, v)),
        "rss": rss_mib() - base,
        "peak": peak_mib() - base,
        "step": statistics.median(times[1:] or times),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")
    import pshard as ps

    whole_state = 4 * args.layers * 2 * args.width * 4 * args.width * 4  # p, g, m, v; float32
    print(
        f"decoder MLP: {args.layers} x (Linear({args.width}, {4 * args.width}), GELU, "
        f"Linear({4 * args.width}, {args.width})), float32; whole state (p+g+m+v) "
        f"{whole_state / 2**20:.1f} MiB"
    )
    print(
        f"{'N':>2} {'mode':>7} {'state MiB':>10} {'x whole':>8} {'RSS held':>9} "
        f"{'peak':>8} {'step ms':>8}"
    )
    for n in (1, 2, 4):
        for mode in ("whole", "global"):
            rows = ps.spawn(run, mode, args.width, args.layers, args.steps, nprocs=n)
            worst = max(rows, key=lambda r: r["state"])
            print(
                f"{n:2d} {mode:>7} {worst['state'] / 2**20:10.1f} "
                f"{worst['state'] / whole_state:8.3f} "
                f"{max(r['rss'] for r in rows):9.1f} {max(r['peak'] for r in rows):8.1f} "
                f"{1e3 * statistics.median(r['step'] for r in rows):8.1f}"
            )


if __name__ == "__main__":
    main()
