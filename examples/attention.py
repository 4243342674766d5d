"""Ulysses and ring attention on the same sequence-parallel model, both against full attention.

    python examples/attention.py            # 2 gloo ranks
    python examples/attention.py --nprocs 4

One attention layer (projections, rotary positions, causal attention, output projection) runs
under ``ps.shard_map_seq``: every rank holds a slice of the sequence (zigzag layout, a length that
does not divide by the number of ranks). ``ps.ulysses_attention`` exchanges sequence for heads
with two all-to-alls; ``ps.ring_attention`` keeps the heads and passes K/V blocks around the ring.
Both must give the single-process output and gradients (float64).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import pshard as ps

B, S, HEADS, HEAD_DIM = 2, 29, 4, 8
DIM = HEADS * HEAD_DIM


def layer(params: dict, x: torch.Tensor, pos: torch.Tensor, attention) -> torch.Tensor:
    q, k, v = ((x @ params[n]).unflatten(-1, (HEADS, HEAD_DIM)) for n in ("wq", "wk", "wv"))
    angle = pos.to(x.dtype)[:, None, None] * 0.1  # (seq, 1, 1): a simple rotary embedding
    q, k = (torch.cat([t * angle.cos(), t.roll(1, -1) * angle.sin()], -1) for t in (q, k))
    return attention(q, k, v).flatten(-2) @ params["wo"]


def full_attention(q, k, v):
    out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True)
    return out.transpose(1, 2)


def rank_main(params: dict, x: torch.Tensor, cotangent: torch.Tensor) -> dict:
    ps.init_mesh({"sp": torch.distributed.get_world_size()})
    attentions = {
        "ulysses": lambda q, k, v: ps.ulysses_attention(q, k, v, axis="sp", causal=True),
        "ring": lambda q, k, v: ps.ring_attention(q, k, v, axis="sp", causal=True),
    }
    out = {}
    for name, attention in attentions.items():
        mapped = ps.shard_map_seq(
            lambda p, x, attention=attention: layer(p, x, ps.seq_positions(), attention),
            in_specs=(None, ps.Shard(1)),
            out_specs=ps.Shard(1),
            layout="zigzag",
        )
        y, vjp = torch.func.vjp(mapped, params, x)
        out[name] = (y, *vjp(cotangent))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nprocs", type=int, default=2)
    parser.add_argument(
        "--backend",
        choices=("gloo", "threads"),
        default="gloo",
        help="ranks as processes or threads",
    )
    args = parser.parse_args()

    g = torch.Generator().manual_seed(0)
    params = {
        n: torch.randn(DIM, DIM, generator=g, dtype=torch.float64) / DIM**0.5
        for n in ("wq", "wk", "wv", "wo")
    }
    x = torch.randn(B, S, DIM, generator=g, dtype=torch.float64)
    cotangent = torch.randn(B, S, DIM, generator=g, dtype=torch.float64)

    def reference(p, x):
        return layer(p, x, torch.arange(S), full_attention)

    y, vjp = torch.func.vjp(reference, params, x)
    ref = (y, *vjp(cotangent))

    results = ps.spawn(rank_main, params, x, cotangent, nprocs=args.nprocs, backend=args.backend)
    print(f"{args.nprocs} ranks, {S} tokens (zigzag layout), {HEADS} heads, causal, float64")
    print(f"  {'attention':<10}{'rank':<6}{'output':<12}{'d params':<12}d input")
    worst = 0.0
    for rank, per_rank in enumerate(results):
        for name, (out, d_params, d_x) in per_rank.items():
            diffs = [
                (out - ref[0]).abs().max().item(),
                max((d_params[k] - ref[1][k]).abs().max().item() for k in params),
                (d_x - ref[2]).abs().max().item(),
            ]
            worst = max(worst, *diffs)
            print(f"  {name:<10}{rank:<6}" + "".join(f"{d:<12.1e}" for d in diffs))
    print(f"max difference against full attention: {worst:.1e}")
    if worst > 1e-10:
        raise SystemExit("sequence-parallel attention differs from full attention")


if __name__ == "__main__":
    main()
