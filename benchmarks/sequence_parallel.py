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

Then a packed batch (several documents per row, ``segment_ids``): the chunk pairs each rank
computes with the segments against plain causal attention, from the kernel's own schedule and
run-time decisions (``block_counts(..., segment_ids=...)``), the time per layer with and
without segments, and the two ways of giving every rank the keys' segment ids, timed on their
own: one all-gather of the ids (what the kernel does) against ``N - 1`` ``ppermute``s of them
beside the K/V blocks.

Then ``usp_attention`` on 4 ranks (mesh ``{"ring": 2, "uly": 2}``, zigzag, causal) beside
pure Ulysses and pure ring attention over the same 4 ranks: bytes sent per rank forward,
counted (all-to-alls and ring transfers), against the hybrid's formula
``(U - 1) / U * b * (s / N) * (2 h + 2 h_kv) * d`` (Ulysses part) ``+ 2 (R - 1) / R * b * s *
h_kv * d / U`` (ring part), and forward + backward time.

Then ``shard_map_seq``'s boundary alone (whole inputs in, the whole output out, of an
elementwise function, forward + backward) against the same written with raw
``torch.distributed`` calls, and against pshard with every gather buffered and then placed.

Last, efficiency on equal cores: one causal layer (8 heads), forward + backward through
``shard_map_seq``, 2 ranks with one thread each against one process with two threads running
fused SDPA, for S = 2048 and 4096, Ulysses and ring under each layout (medians of rounds that
alternate between the two), and the activation memory autograd saves per rank against the
single process.

    python benchmarks/sequence_parallel.py [--seq 2048] [--batch 1] [--head-size 64]
        [--packed-only | --usp-only | --boundary-only | --efficiency-only] [--rounds 3]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
import torch.distributed as dist

import pshard as ps


@contextlib.contextmanager
def _counting():
    """Count the bytes this rank sends (all-to-alls: the part that leaves the rank; ring
    transfers: every send) while the block runs; yields a dict whose "bytes" grows."""
    sent = {"bytes": 0}
    a2a, p2p = dist.all_to_all_single, dist.batch_isend_irecv

    def counted_a2a(output, input, *a, **kw):
        group = kw.get("group")
        size = dist.get_world_size(group) if group is not None else dist.get_world_size()
        sent["bytes"] += input.numel() * input.element_size() * (size - 1) // size
        return a2a(output, input, *a, **kw)

    def counted_p2p(ops):
        for op in ops:
            if op.op is dist.isend:
                sent["bytes"] += op.tensor.numel() * op.tensor.element_size()
        return p2p(ops)

    dist.all_to_all_single, dist.batch_isend_irecv = counted_a2a, counted_p2p
    try:
        yield sent
    finally:
        dist.all_to_all_single, dist.batch_isend_irecv = a2a, p2p


def _qkv(args: argparse.Namespace, hq: int, hkv: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    b, s, d = args.batch, args.seq, args.head_size
    return [torch.randn(b, s, h, d, generator=g, requires_grad=True) for h in (hq, hkv, hkv)]


def _layer(args: argparse.Namespace, hq: int, hkv: int, n: int) -> dict:
    ps.init_mesh({"sp": n})
    q, k, v = _qkv(args, hq, hkv)
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
    with _counting() as sent:
        out = attention(q, k, v)
        forward = sent["bytes"]
        out.backward(torch.ones_like(out))
        backward = sent["bytes"] - forward
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
    worst = torch.tensor(statistics.median(times))
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)  # over every rank, whatever the mesh
    return worst.item()


def _ring_layer(args: argparse.Namespace, hq: int, hkv: int, n: int) -> dict:
    ps.init_mesh({"sp": n})
    q, k, v = _qkv(args, hq, hkv)
    out = {}
    for layout in ("contiguous", "zigzag", "stripe"):
        layer = ps.shard_map_seq(
            lambda q, k, v: ps.ring_attention(q, k, v, causal=True),
            in_specs=ps.Shard(1),
            out_specs=ps.Shard(1),
            layout=layout,
        )
        with _counting() as sent:
            y = layer(q, k, v)
            forward = sent["bytes"]
            y.backward(torch.ones_like(y))
            backward = sent["bytes"] - forward
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
    from pshard.sequence._ring_schedule import block_counts

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


def _usp_layer(args: argparse.Namespace, hq: int, hkv: int) -> dict:
    ps.init_mesh({"ring": 2, "uly": 2})
    q, k, v = _qkv(args, hq, hkv)
    axis = ("ring", "uly")
    bodies = {
        "usp": lambda q, k, v: ps.usp_attention(
            q, k, v, ulysses_axis="uly", ring_axis="ring", causal=True
        ),
        "ulysses": lambda q, k, v: ps.ulysses_attention(q, k, v, axis=axis, causal=True),
        "ring": lambda q, k, v: ps.ring_attention(q, k, v, axis=axis, causal=True),
    }
    out = {}
    for name, body in bodies.items():
        layer = ps.shard_map_seq(
            body, axis=axis, in_specs=ps.Shard(1), out_specs=ps.Shard(1), layout="zigzag"
        )
        with _counting() as sent:
            layer(q, k, v)
            forward = sent["bytes"]
        seconds = _timed(lambda: layer(q, k, v).sum().backward())  # noqa: B023
        out[name] = {"forward": forward, "seconds": seconds}
    return out


def _usp_table(args: argparse.Namespace) -> None:
    b, s, d = args.batch, args.seq, args.head_size
    r, u = 2, 2
    n = r * u
    print()
    print(f"usp_attention on 4 ranks (ring 2 x ulysses 2, zigzag, causal), b={b}, s={s}, d={d}")
    print(
        f"{'h':>3} {'h_kv':>4} {'attention':>9} | {'fwd sent/rank':>14} {'formula':>10} "
        f"{'ratio':>6} | {'fwd+bwd':>9}"
    )
    for hq, hkv in ((8, 8), (8, 2)):
        res = ps.spawn(_usp_layer, args, hq, hkv, nprocs=n)[0]
        kv_u = max(hkv, u)  # KV heads repeated up to the Ulysses axis
        formulas = {
            "usp": (u - 1) / u * b * (s / n) * (2 * hq + 2 * kv_u) * d * 4
            + 2 * (r - 1) / r * b * s * kv_u * d / u * 4,
            "ulysses": (n - 1) / n * b * (s / n) * (2 * hq + 2 * max(hkv, n)) * d * 4,
            "ring": 2 * (n - 1) / n * b * s * hkv * d * 4,
        }
        for name, formula in formulas.items():
            got = res[name]
            print(
                f"{hq:>3} {hkv:>4} {name:>9} | {got['forward'] / 2**20:11.2f} MB "
                f"{formula / 2**20:7.2f} MB {got['forward'] / formula:6.2f} | "
                f"{got['seconds'] * 1e3:6.1f} ms"
            )


def _sdpa_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    heads = (t.transpose(1, 2) for t in (q, k, v))
    return torch.nn.functional.scaled_dot_product_attention(*heads, is_causal=True)


def _efficiency_ranks(s: int, d: int, attention: str, layout: str, repeats: int) -> dict:
    """Steps of the layer through ``shard_map_seq`` (whole q, k, v in, whole output out), of the
    layer as a model's layer (this rank's activations in, a loss share out) and of the single
    process (rank 0 alone with both threads, rank 1 blocked in a barrier), interleaved, so
    each ratio compares steps taken moments apart."""
    ps.init_mesh({"sp": 2})
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, s, 8, d, generator=g, requires_grad=True) for _ in range(3))
    fn = {"ring": ps.ring_attention, "ulysses": ps.ulysses_attention}[attention]
    layer = ps.shard_map_seq(
        lambda q, k, v: fn(q, k, v, causal=True),
        in_specs=ps.Shard(1),
        out_specs=ps.Shard(1),
        layout=layout,
    )
    inside = ps.shard_map_seq(
        lambda q, k, v: _saved(lambda: fn(q, k, v, causal=True)),
        in_specs=ps.Shard(1),
        out_specs=ps.Replicate(),
        layout=layout,
    )
    saved = inside(q.detach().requires_grad_(True), k, v)
    # As a layer inside a model sees it: q, k, v are this rank's activations (no gathers at a
    # boundary), the output feeds this rank's share of the loss.
    local = [t.detach()[:, : s // 2].clone().requires_grad_(True) for t in (q, k, v)]
    in_model = ps.shard_map_seq(
        lambda ids: fn(*local, causal=True).sum(),
        in_specs=ps.Shard(1),
        out_specs=ps.Partial("sum"),
        layout=layout,
    )
    ids = torch.zeros(1, s, dtype=torch.int64)
    whole = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]

    def single() -> None:
        if dist.get_rank() == 0:
            torch.set_num_threads(2)
            try:
                _sdpa_step(*whole).sum().backward()
            finally:
                torch.set_num_threads(1)
        dist.barrier()

    steps = {
        "single": single,
        "time": lambda: layer(q, k, v).sum().backward(),
        "in_model": lambda: in_model(ids).backward(),
    }
    for step in steps.values():
        step()
    times: dict = {name: [] for name in steps}
    names = list(steps)
    for i in range(repeats):
        for name in names[i % 3 :] + names[: i % 3]:  # each step first in turn
            dist.barrier()
            start = time.perf_counter()
            steps[name]()
            times[name].append(time.perf_counter() - start)
    worst = torch.tensor([times[n] for n in names], dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)  # the slowest rank's (rank 0's for single)
    return {
        "times": dict(zip(names, worst.tolist(), strict=True)),
        "saved": saved.item(),
        "saved_single": _saved(lambda: _sdpa_step(*whole)).item(),
    }


def _efficiency_table(args: argparse.Namespace) -> None:
    d, rounds, repeats = args.head_size, args.rounds, 3
    configs = [(a, lay) for a in ("ulysses", "ring") for lay in ("contiguous", "zigzag", "stripe")]
    print()
    print(
        "efficiency on equal cores: one causal layer (8 heads), fwd+bwd, 2 ranks x 1 thread "
        "against 1 process x 2 threads (fused SDPA); steps of the three interleaved in each "
        f"round, {rounds} rounds of {repeats}: medians of the times and of the step-by-step ratios"
    )
    print(
        f"{'S':>5} {'attention':>9} {'layout':>10} | {'time':>9} {'1 process':>10} "
        f"{'ratio':>6} | {'in a model':>10} {'ratio':>6} | {'saved/rank':>11} "
        f"{'vs 1 process':>12}"
    )
    for s in (2048, 4096):
        times: dict = {c: {"single": [], "time": [], "in_model": []} for c in configs}
        saved: dict = {}
        for _ in range(rounds):
            for c in configs:
                res = ps.spawn(_efficiency_ranks, s, d, *c, repeats, nprocs=2)[0]
                for name, ts in res["times"].items():
                    times[c][name].extend(ts)
                saved[c] = res["saved"] / res["saved_single"]
                saved[(c, "bytes")] = res["saved"]
        for c in configs:
            t = times[c]
            med = {name: statistics.median(ts) for name, ts in t.items()}
            ratio = {
                name: statistics.median(a / b for a, b in zip(t[name], t["single"], strict=True))
                for name in ("time", "in_model")
            }
            print(
                f"{s:>5} {c[0]:>9} {c[1]:>10} | {med['time'] * 1e3:6.1f} ms "
                f"{med['single'] * 1e3:7.1f} ms {ratio['time']:6.2f} | "
                f"{med['in_model'] * 1e3:7.1f} ms {ratio['in_model']:6.2f} | "
                f"{saved[(c, 'bytes')] / 2**20:8.2f} MB {saved[c]:12.2f}"
            )


def _raw_boundary(layout: str, q, k, v, ct) -> tuple[torch.Tensor, torch.Tensor]:
    """The boundary of ``q + k + v`` written by hand with raw ``torch.distributed``: this rank's
    tokens of each whole input (pad, permute, slice), the output all-gathered and put back in
    sequence order by an index, and the backward the same way (the cotangent's tokens in; the
    three input gradients, here equal, gathered and put back one by one)."""
    from pshard.sequence._layouts import SeqLayout

    n, r = dist.get_world_size(), dist.get_rank()
    s = q.shape[1]
    lay = SeqLayout(layout, s, n)
    perm = lay.position_tensor()  # slot -> position (padding: >= s)
    keep = lay.inverse()[:s]  # position -> slot

    def mine(x):
        padded = torch.nn.functional.pad(x, (0, 0, 0, 0, 0, lay.padded_length - s))
        return padded.index_select(1, perm).chunk(n, 1)[r]

    gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

    def gather(y):
        buf = y.new_empty((n, *y.shape))
        gather_flat(buf.view(-1), y.contiguous().view(-1))
        return buf.movedim(0, 1).flatten(1, 2).index_select(1, torch.tensor(keep))

    local = [mine(x) for x in (q, k, v)]
    out = gather(local[0] + local[1] + local[2])
    g = mine(ct)
    grads = [gather(g) for _ in range(3)]
    return out, grads[0]


def _boundary_ranks(b: int, s: int, layout: str, repeats: int) -> dict:
    ps.init_mesh({"sp": 2})
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, s, 8, 64, generator=g, requires_grad=True) for _ in range(3))
    ct = torch.randn(b, s, 8, 64, generator=g)
    layer = ps.shard_map_seq(
        lambda q, k, v: q + k + v, in_specs=ps.Shard(1), out_specs=ps.Shard(1), layout=layout
    )
    from pshard.sequence import _seq_boundary

    placed = _seq_boundary._place_direct

    def buffered() -> None:  # the same with every gather into a buffer, then placed
        _seq_boundary._place_direct = lambda *a: None
        try:
            layer(q, k, v).backward(ct)
        finally:
            _seq_boundary._place_direct = placed

    steps = {
        "pshard": lambda: layer(q, k, v).backward(ct),
        "buffered": buffered,
        "raw": lambda: _raw_boundary(layout, q.detach(), k.detach(), v.detach(), ct),
    }
    out, grad = _raw_boundary(layout, q.detach(), k.detach(), v.detach(), ct)
    assert torch.equal(out, layer(q, k, v)), "the hand-written boundary differs"
    assert torch.equal(grad, torch.autograd.grad(layer(q, k, v), q, ct)[0])
    times: dict = {name: [] for name in steps}
    for step in steps.values():
        step()
    for i in range(repeats):
        names = list(steps)
        for name in names[i % 3 :] + names[: i % 3]:  # each first in turn
            dist.barrier()
            start = time.perf_counter()
            steps[name]()
            times[name].append(time.perf_counter() - start)
    worst = torch.tensor([times[n] for n in steps], dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return dict(zip(steps, worst.tolist(), strict=True))


def _boundary_table(args: argparse.Namespace) -> None:
    from pshard.sequence._layouts import SeqLayout

    print()
    print(
        "shard_map_seq's boundary alone: whole q, k, v (b, s, 8, 64, float32) in, the whole "
        "q + k + v out, fwd + bwd (4 gathers), 2 ranks x 1 thread, against the same written with "
        "raw torch.distributed (pad, permute, slice; gloo's all-gather + index) and against "
        "pshard with every gather buffered, then placed; medians of step-by-step ratios"
    )
    print(
        f"{'b':>3} {'s':>5} {'layout':>10} | {'run piece':>9} | {'pshard':>9} {'raw':>9} "
        f"{'ratio':>6} | {'buffered':>9} {'ratio':>6}"
    )
    for b, s in ((1, 2048), (2, 4096), (4, 1024), (16, 512)):
        for layout in ("contiguous", "zigzag", "stripe"):
            t = ps.spawn(_boundary_ranks, b, s, layout, 2 * args.rounds + 5, nprocs=2)[0]
            runs = len(SeqLayout(layout, s, 2).runs(0))
            piece = "strided" if layout == "stripe" else f"{s // 2 // runs * 2048 >> 10} KiB"
            med = {name: statistics.median(ts) * 1e3 for name, ts in t.items()}
            ratio = {
                name: statistics.median(a / b for a, b in zip(t["pshard"], t[name], strict=True))
                for name in ("raw", "buffered")
            }
            print(
                f"{b:>3} {s:>5} {layout:>10} | {piece:>9} | {med['pshard']:6.1f} ms "
                f"{med['raw']:6.1f} ms {ratio['raw']:6.2f} | {med['buffered']:6.1f} ms "
                f"{ratio['buffered']:6.2f}"
            )


def _documents(s: int, docs: int) -> torch.Tensor:
    """``(1, s)`` segment ids: ``docs`` documents of uneven lengths (a fixed draw)."""
    g = torch.Generator().manual_seed(1)
    cuts = torch.randperm(s - 1, generator=g)[: docs - 1].add(1).sort().values
    ids = torch.zeros(s, dtype=torch.int64)
    ids[cuts] = 1
    return ids.cumsum(0).unsqueeze(0)


def _packed_layer(args: argparse.Namespace, n: int, seg: torch.Tensor) -> dict:
    from pshard._runtime import wire as raw

    ps.init_mesh({"sp": n})
    g = torch.Generator().manual_seed(0)
    b, s, d = 1, args.seq, args.head_size
    q, k, v = (torch.randn(b, s, 8, d, generator=g, requires_grad=True) for _ in range(3))
    out = {}
    for with_seg in (False, True):
        layer = ps.shard_map_seq(
            lambda q, k, v, ids: ps.ring_attention(
                q,
                k,
                v,
                causal=True,
                segment_ids=ids if with_seg else None,  # noqa: B023
            ),
            in_specs=ps.Shard(1),
            out_specs=ps.Shard(1),
            layout="zigzag",
            pad_values=(0.0, 0.0, 0.0, -1),
        )
        out[with_seg] = _timed(lambda: layer(q, k, v, seg).sum().backward())  # noqa: B023
    c = raw.comm("sp", "benchmark")
    mine = seg.chunk(n, 1)[c.rank].contiguous()
    perm = tuple((i, (i + 1) % n) for i in range(n))

    def travel():
        x = mine
        for _ in range(n - 1):
            x = raw.ppermute(x, c, perm)

    out["gather"] = _timed(lambda: raw.all_gather(mine, c, 1, True), repeats=21)
    out["travel"] = _timed(travel, repeats=21)
    return out


def _packed_table(args: argparse.Namespace) -> None:
    from pshard.sequence._ring_schedule import block_counts

    s = args.seq
    print()
    print(
        f"ring_attention on a packed row (causal, b=1, s={s}, 8/8 heads, head size "
        f"{args.head_size}): chunk pairs computed per rank (of 4N) with segment ids and without"
    )
    print(
        f"{'N':>2} {'docs':>4} {'layout':>10} | {'pairs w/ seg':>12} {'causal only':>12} "
        f"{'skipped by seg':>14} | {'fwd+bwd seg':>11} {'causal':>9} | "
        f"{'ids: gather':>11} {'N-1 ppermute':>12}"
    )
    for docs in (8, 32):
        seg = _documents(s, docs)
        for n in (2, 4):
            res = ps.spawn(_packed_layer, args, n, seg, nprocs=n)[0]
            for layout in ("contiguous", "zigzag", "stripe"):
                with_seg = block_counts(layout, s, n, True, segment_ids=seg)
                plain = block_counts(layout, s, n, True)
                done = [c.full + c.partial for c in with_seg]
                base = [c.full + c.partial for c in plain]
                skipped = 1 - sum(done) / sum(base)
                times = ""
                if layout == "zigzag":
                    times = (
                        f"{res[True] * 1e3:8.1f} ms {res[False] * 1e3:6.1f} ms | "
                        f"{res['gather'] * 1e6:8.0f} us {res['travel'] * 1e6:9.0f} us"
                    )
                print(
                    f"{n:>2} {docs:>4} {layout:>10} | {min(done):>5}-{max(done):<6} "
                    f"{min(base):>5}-{max(base):<6} {skipped:13.0%} | {times}"
                )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--head-size", type=int, default=64)
    parser.add_argument("--packed-only", action="store_true", help="only the packed-row table")
    parser.add_argument("--usp-only", action="store_true", help="only the usp_attention table")
    parser.add_argument(
        "--efficiency-only", action="store_true", help="only the equal-cores efficiency table"
    )
    parser.add_argument(
        "--boundary-only", action="store_true", help="only the shard_map_seq boundary table"
    )
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the efficiency table")
    args = parser.parse_args()
    if args.boundary_only:
        _boundary_table(args)
        return
    if args.efficiency_only:
        _efficiency_table(args)
        return
    if args.packed_only:
        _packed_table(args)
        return
    if args.usp_only:
        _usp_table(args)
        return
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
    _packed_table(args)
    _usp_table(args)
    _boundary_table(args)
    _efficiency_table(args)


if __name__ == "__main__":
    main()
