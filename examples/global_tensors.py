"""Parameters, gradients and AdamW moments that stay sharded between steps (FSDP x tensor parallel).

    python examples/global_tensors.py [--nprocs 4] [--steps 5]

A two-layer MLP trained on a 2 x 2 mesh (``"dp"`` x ``"tp"``; ``--nprocs 2`` uses 2 x 1) with
every parameter a ``ps.GlobalTensor``: the first layer's weight as ``P("dp", "tp")`` (rows over
"dp", columns over "tp": FSDP of a column-parallel layer), the second's as ``P("tp", "dp")``.
One step is ``torch.func.grad`` of a ``shard_map`` whose body all-gathers each block over "dp"
(FSDP), runs the Megatron layer pair over "tp", and sums the loss; the gradients come back as
blocks of the same layout and AdamW, written with ``optree.tree_map``, updates the blocks. The
losses are checked against the same model trained in one process, and each rank prints what it
holds: a quarter of the parameters, gradients and moments on 4 ranks.
"""

from __future__ import annotations

import argparse

import optree
import torch

import pshard as ps

P = ps.P
LAYOUT = {"w1": P("dp", "tp"), "b1": P("tp"), "w2": P("tp", "dp")}


def init(d_in: int, hidden: int, d_out: int) -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "w1": torch.randn(d_in, hidden, generator=g, dtype=torch.float64) / d_in**0.5,
        "b1": torch.zeros(hidden, dtype=torch.float64),
        "w2": torch.randn(hidden, d_out, generator=g, dtype=torch.float64) / hidden**0.5,
    }


def data(rows: int, d_in: int, d_out: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(rows, d_in, generator=g, dtype=torch.float64)
    return x, torch.sin(x[:, :d_out])


def mlp(params: dict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    h = torch.relu(x @ params["w1"] + params["b1"])
    return ((h @ params["w2"] - y) ** 2).mean()


def local_loss(params: dict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """One rank's part: its rows of the batch, its columns of the hidden layer."""
    w1 = ps.all_gather(params["w1"], "dp", dim=0)  # FSDP: the dp-blocks of this tp-block
    w2 = ps.all_gather(params["w2"], "dp", dim=1)
    h = torch.relu(x @ w1 + params["b1"])
    out = ps.psum(h @ w2, "tp")  # Megatron: the row-parallel layer's partial sums
    rows = ps.psum(torch.tensor(float(x.shape[0]), dtype=x.dtype), "dp")
    return ps.psum(((out - y) ** 2).sum(), "dp") / (rows * y.shape[1])


def adamw(params: dict, grads: dict, m: dict, v: dict, step: int, lr: float = 0.05) -> tuple:
    b1, b2, eps, wd = 0.9, 0.999, 1e-8, 0.01
    m = optree.tree_map(lambda m, g: b1 * m + (1 - b1) * g, m, grads)
    v = optree.tree_map(lambda v, g: b2 * v + (1 - b2) * g * g, v, grads)

    def update(p: torch.Tensor, m: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return p * (1 - lr * wd) - lr * (m / (1 - b1**step)) / ((v / (1 - b2**step)).sqrt() + eps)

    return optree.tree_map(update, params, m, v), m, v


def train(steps: int, sharded: bool) -> tuple[list[float], dict]:
    whole = init(16, 32, 8)
    x, y = data(24, 16, 8)
    if sharded:
        params = ps.shard(whole, LAYOUT)
        step_grad = torch.func.grad_and_value(
            ps.shard_map(local_loss, in_specs=(LAYOUT, P("dp"), P("dp")), out_specs=P())
        )
    else:
        params, step_grad = whole, torch.func.grad_and_value(mlp)
    m = optree.tree_map(torch.zeros_like, params)
    v = optree.tree_map(torch.zeros_like, params)
    losses = []
    for step in range(1, steps + 1):
        grads, loss = step_grad(params, x, y)
        params, m, v = adamw(params, grads, m, v, step)
        losses.append(loss.item())
    held = {
        "parameters": params,
        "gradients": grads,
        "moments": (m, v),
    }
    return losses, held


def _bytes(tree: object) -> int:
    return sum(t.numel() * t.element_size() for t in optree.tree_leaves(tree))


def main(nprocs: int, steps: int) -> tuple[list[float], dict[str, int]]:
    ps.init_mesh({"dp": 2, "tp": nprocs // 2})
    losses, held = train(steps, sharded=True)
    return losses, {k: _bytes(v) for k, v in held.items()}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nprocs", type=int, default=4, choices=(2, 4))
    parser.add_argument(
        "--backend",
        choices=("gloo", "threads"),
        default="gloo",
        help="ranks as processes or threads",
    )
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    results = ps.spawn(main, args.nprocs, args.steps, nprocs=args.nprocs, backend=args.backend)
    reference, whole = train(args.steps, sharded=False)
    whole_bytes = {k: _bytes(v) for k, v in whole.items()}
    print(f"{'step':>4} {'loss (sharded)':>16} {'loss (one process)':>19}")
    for i, (a, b) in enumerate(zip(results[0][0], reference, strict=True), 1):
        print(f"{i:4d} {a:16.10f} {b:19.10f}")
    print("bytes held per rank / by one process:")
    for name, n in whole_bytes.items():
        per_rank = [r[1][name] for r in results]
        print(f"  {name:10s} {per_rank} / {n} ({max(per_rank) / n:.2f}x)")
    diff = max(abs(a - b) for r in results for a, b in zip(r[0], reference, strict=True))
    print(f"max difference: {diff:.2e}")
    assert diff < 1e-9, diff
