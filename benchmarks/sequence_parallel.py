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

Then the same layer with ``ps.ring_attention`` under each layout, side by side with Ulysses:

- **bytes sent per rank**, counted by wrapping ``torch.distributed.batch_isend_irecv`` (every
  ring step is one ``ppermute``): against ``2 (N - 1) / N * b * s * h_kv * d`` elements forward
  (each rank passes its K and V blocks on ``N - 1`` times); the backward sends K/V ``N - 1``
  times and the fp32 dK/dV ``N`` times (back to their owner).
- **work balance per layout**: the (query chunk, key chunk) pairs each rank computes (a masked
  diagonal pair counts one half), from the schedule the kernel runs; zigzag is balanced,
  contiguous leaves the last rank ``2N - 1`` times the first.
- **time per layer** (forward + backward, median of a few runs, slowest rank) on gloo.

    python benchmarks/sequence_parallel.py [--seq 2048] [--batch 1] [--head-size 64]
"""

from __future__ import annotations

import argparse
import statistics
import time

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


def _timed(run, repeats: int = 3) -> float:
    """Median seconds of ``run()`` (forward and backward), the slowest rank's."""
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return ps.pmax(torch.tensor(statistics.median(times)), "sp").item()


def _ring_layer(args: argparse.Namespace, hq: int, hkv: int, n: int) -> dict:
    ps.init_mesh({"sp": n})
    sent = {"bytes": 0}
    original = dist.batch_isend_irecv

    def counted(ops):
        for op in ops:
            if op.op is dist.isend:
                sent["bytes"] += op.tensor.numel() * op.tensor.element_size()
        return original(ops)

    g = torch.Generator().manual_seed(0)
    b, s, d = args.batch, args.seq, args.head_size
    q = torch.randn(b, s, hq, d, generator=g, requires_grad=True)
    k = torch.randn(b, s, hkv, d, generator=g, requires_grad=True)
    v = torch.randn(b, s, hkv, d, generator=g, requires_grad=True)
    out = {}
    for layout in ("contiguous", "zigzag", "stripe"):
        layer = ps.shard_map_seq(
            lambda q, k, v: ps.ring_attention(q, k, v, causal=True),
            in_specs=ps.Shard(1),
            out_specs=ps.Shard(1),
            layout=layout,
        )
        dist.batch_isend_irecv = counted
        try:
            sent["bytes"] = 0
            y = layer(q, k, v)
            forward = sent["bytes"]
            y.backward(torch.ones_like(y))
            backward = sent["bytes"] - forward
        finally:
            dist.batch_isend_irecv = original
        seconds = _timed(lambda: layer(q, k, v).sum().backward())  # noqa: B023
        out[layout] = {"forward": forward, "backward": backward, "seconds": seconds}
    ulysses = ps.shard_map_seq(
        lambda q, k, v: ps.ulysses_attention(q, k, v, causal=True),
        in_specs=ps.Shard(1),
        out_specs=ps.Shard(1),
        layout="zigzag",
    )
    out["ulysses"] = {"seconds": _timed(lambda: ulysses(q, k, v).sum().backward())}
    return out


def _ring_table(args: argparse.Namespace) -> None:
    from pshard.sequence._ring import block_counts

    b, s, d = args.batch, args.seq, args.head_size
    print()
    print("ring_attention, the same layer (causal), bytes sent per rank and time per layer")
    print(
        f"{'N':>2} {'h':>3} {'h_kv':>4} {'layout':>10} | {'fwd sent/rank':>14} {'bound':>12} "
        f"{'ratio':>6} | {'bwd sent/rank':>14} | {'work min/max':>13} | {'fwd+bwd':>9} "
        f"{'ulysses':>9}"
    )
    for hq, hkv in ((8, 8), (8, 2)):
        for n in (2, 4):
            res = ps.spawn(_ring_layer, args, hq, hkv, n, nprocs=n)[0]
            bound = 2 * (n - 1) / n * b * s * hkv * d * 4
            for layout in ("contiguous", "zigzag", "stripe"):
                r = res[layout]
                work = [c.work for c in block_counts(layout, s, n, causal=True)]
                print(
                    f"{n:>2} {hq:>3} {hkv:>4} {layout:>10} | {r['forward'] / 2**20:11.2f} MB "
                    f"{bound / 2**20:9.2f} MB {r['forward'] / bound:6.2f} | "
                    f"{r['backward'] / 2**20:11.2f} MB | {min(work):5.1f}/{max(work):5.1f} "
                    f"{max(work) / min(work):4.1f}x | {r['seconds'] * 1e3:6.1f} ms "
                    f"{res['ulysses']['seconds'] * 1e3:6.1f} ms"
                )


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
    _ring_table(args)


if __name__ == "__main__":
    main()
