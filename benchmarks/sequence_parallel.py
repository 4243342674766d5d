"""Ulysses attention: bytes moved per rank per attention layer, counted, against the lower bound,
and activation memory per rank against one rank.

Runs one attention layer (``ps.ulysses_attention`` inside ``ps.shard_map_seq``) on ``N`` gloo
ranks started with ``ps.spawn``, for ``N`` in 1, 2, 4 and a few head configurations, and counts:

- **bytes sent per rank**, forward and backward, by wrapping ``torch.distributed``'s
  ``all_to_all_single`` (the only call a Ulysses layer makes): a rank sends ``(N - 1) / N`` of
  each all-to-all's input to the other ranks. The lower bound for the forward is what every
  rank must send of q, k, v and the output: ``(N - 1) / N * b * (s / N) * (2 h + 2 h_kv) * d``
  elements (each rank holds ``s / N`` tokens of q, k, v, out; it keeps ``1 / N`` of them). The
  backward moves the same amount again (the transposed all-to-alls). With fewer KV heads than
  ranks, the KV heads are repeated before the exchange, which the ratio column shows.
- **activation memory per rank**: bytes of the tensors autograd saves for the backward during
  the layer's forward (``torch.autograd.graph.saved_tensors_hooks``, storages counted once),
  which is what stays alive between forward and backward. The attention itself here is
  PyTorch's CPU SDPA (the math kernel, which saves the ``s x s`` attention weights per head), so
  the per-rank memory falls with ``N`` as each rank holds ``h / N`` heads of the whole sequence.

    python benchmarks/sequence_parallel.py [--seq 2048] [--batch 1] [--head-size 64]
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

import pshard as ps


def _layer(args: argparse.Namespace, hq: int, hkv: int, n: int) -> dict:
    ps.init_mesh({"sp": n})
    sent = {"bytes": 0}
    original = dist.all_to_all_single

    def counted(output, input, *a, **kw):
        sent["bytes"] += input.numel() * input.element_size() * (n - 1) // n
        return original(output, input, *a, **kw)

    g = torch.Generator().manual_seed(0)
    b, s, d = args.batch, args.seq, args.head_size
    q = torch.randn(b, s, hq, d, generator=g, requires_grad=True)
    k = torch.randn(b, s, hkv, d, generator=g, requires_grad=True)
    v = torch.randn(b, s, hkv, d, generator=g, requires_grad=True)
    attention = ps.shard_map_seq(
        lambda q, k, v: ps.ulysses_attention(q, k, v, causal=True),
        in_specs=ps.Shard(1),
        out_specs=ps.Shard(1),
    )
    inside = ps.shard_map_seq(
        lambda q, k, v: _saved(lambda: ps.ulysses_attention(q, k, v, causal=True)),
        in_specs=ps.Shard(1),
        out_specs=ps.Replicate(),
    )
    dist.all_to_all_single = counted
    try:
        out = attention(q, k, v)
        forward = sent["bytes"]
        out.backward(torch.ones_like(out))
        backward = sent["bytes"] - forward
    finally:
        dist.all_to_all_single = original
    saved = inside(q.detach().requires_grad_(True), k, v)
    return {"forward": forward, "backward": backward, "saved": int(saved)}


def _saved(run) -> torch.Tensor:
    """Run the layer; return the bytes autograd saved for its backward on this rank."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return torch.tensor(float(sum(storages.values())))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--head-size", type=int, default=64)
    args = parser.parse_args()
    b, s, d = args.batch, args.seq, args.head_size
    print(f"one causal attention layer, b={b}, s={s}, head size {d}, float32, gloo on CPU")
    print(
        f"{'N':>2} {'h':>3} {'h_kv':>4} | {'fwd sent/rank':>14} {'bound':>12} {'ratio':>6} | "
        f"{'bwd sent/rank':>14} | {'saved/rank':>12} {'vs N=1':>7}"
    )
    for hq, hkv in ((8, 8), (8, 2), (8, 1)):
        base = None
        for n in (1, 2, 4):
            res = ps.spawn(_layer, args, hq, hkv, n, nprocs=n)[0]
            bound = (n - 1) / n * b * (s / n) * (2 * hq + 2 * hkv) * d * 4
            base = res["saved"] if base is None else base
            ratio = f"{res['forward'] / bound:6.2f}" if bound else f"{'-':>6}"
            print(
                f"{n:>2} {hq:>3} {hkv:>4} | {res['forward'] / 2**20:11.2f} MB "
                f"{bound / 2**20:9.2f} MB {ratio} | {res['backward'] / 2**20:11.2f} MB | "
                f"{res['saved'] / 2**20:9.2f} MB {res['saved'] / base:7.2f}"
            )


if __name__ == "__main__":
    main()
