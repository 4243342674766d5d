"""torch.compile: eager against compiled time per step, and where the graph still breaks.

The step is the quickstart model's sequence-parallel step (``examples/quickstart.py``: 2 layers,
4 heads of 8, a 61-token sequence per row, 8 rows, zigzag layout, float32) on 2 gloo ranks, in
two forms:

- ``functional``: the quickstart's own step,
  ``pmap_microbatch(grad_and_value(shard_map_seq(loss)))``. ``torch.func`` transforms inside a
  compiled region run eagerly (pshard's exact rules), so compiling it buys little;
- ``backward``: the same loss through ``shard_map_seq``, differentiated with ``.backward()``,
  microbatches accumulated by hand: dynamo captures the model and the collectives.

Times are medians over interleaved rounds (eager, compiled, eager, ...) after warm-up, per rank
0. The graph-break table runs ``torch._dynamo.explain`` on three functions: a ``shard_map`` body
with three collectives, a Ulysses layer and a ring layer under ``shard_map_seq``.

    python benchmarks/compile.py [--rounds 15] [--backend inductor]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import Counter

import torch
import torch.distributed as dist

import pshard as ps

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import quickstart as qs  # noqa: E402

ROWS, SEQ, MICRO = 8, 61, 2


def _loss(attend):
    def local(params: dict, batch: dict) -> torch.Tensor:
        logits = qs.forward(
            params, batch["input_ids"], ps.seq_positions(),
            lambda q, k, v: attend(q, k, v, axis="sp", causal=True),
        )  # fmt: skip
        return ps.token_mean_loss(*qs.sums(logits, batch["shift_labels"]), "sp")

    return ps.shard_map_seq(
        local, in_specs=(None, qs.SPECS), out_specs=ps.Replicate(), layout="zigzag",
        pad_values=(0, qs.PAD),
    )  # fmt: skip


def _functional(loss):
    return ps.pmap_microbatch(
        torch.func.grad_and_value(loss), num_microbatches=MICRO, in_specs=(None, ps.Shard(0)),
        out_specs=ps.Partial("mean"),
        weight_fn=lambda params, mb: (mb["shift_labels"] != -100).sum(),
    )  # fmt: skip


def _backward(loss, compile_fn):
    loss = compile_fn(loss)

    def step(params: dict, batch: dict):
        params = {k: p.detach().requires_grad_() for k, p in params.items()}
        total, value = (batch["shift_labels"] != -100).sum(), 0.0
        for mb in ps.split(batch, ps.Shard(0), MICRO):
            w = (mb["shift_labels"] != -100).sum() / total
            v = loss(params, mb) * w
            v.backward()
            value = value + v.detach()
        return {k: p.grad for k, p in params.items()}, value

    return step


def _time(fns: dict, args, rounds: int) -> dict:
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            dist.barrier()
            t0 = time.perf_counter()
            fn(*args)
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


def _close(a, b) -> float:
    la, lb = torch.utils._pytree.tree_leaves(a), torch.utils._pytree.tree_leaves(b)
    return max(float((x - y).abs().max()) for x, y in zip(la, lb, strict=True))


def _explain(fn, *args) -> tuple[int, int, Counter]:
    torch._dynamo.reset()
    report = torch._dynamo.explain(fn)(*args)
    reasons = Counter(r.reason.splitlines()[0] for r in report.break_reasons)
    return report.graph_count, report.graph_break_count, reasons


def _breaks() -> list:
    torch.manual_seed(0)
    x = torch.randn(8, 4)

    def three(x):
        y = ps.psum(x * 2, "sp")
        y = ps.all_gather(y.sin(), "sp", dim=0)
        return ps.psum_scatter(y.cos(), "sp", dim=0)

    body = ps.shard_map(three, in_specs=ps.P("sp"), out_specs=ps.P("sp"))
    q, k, v = (torch.randn(1, 64, 4, 8) for _ in range(3))
    rows = [("three collectives (no transform)", _explain(three, x))]
    rows.append(("shard_map of the three", _explain(body, x)))
    for name, attend in (("ulysses", ps.ulysses_attention), ("ring", ps.ring_attention)):
        layer = ps.shard_map_seq(
            lambda q, k, v, attend=attend: attend(q, k, v, causal=True),
            in_specs=ps.Shard(1), out_specs=ps.Shard(1), layout="zigzag",
        )  # fmt: skip
        rows.append((f"{name} layer under shard_map_seq", _explain(layer, q, k, v)))
    return rows


def rank_main(args: argparse.Namespace) -> tuple:
    torch.set_num_threads(1)
    torch._inductor.config.compile_threads = 1
    ps.init_mesh({"sp": dist.get_world_size()})
    params = qs.init_params(torch.float32, torch.device("cpu"))
    batch = qs.make_batch(0, ROWS, SEQ, torch.device("cpu"))
    table = []
    for attention in ("ulysses", "ring"):
        attend = ps.ring_attention if attention == "ring" else ps.ulysses_attention
        loss = _loss(attend)
        for form in ("functional", "backward"):
            torch._dynamo.reset()
            if form == "functional":
                eager = _functional(loss)
                compiled = torch.compile(eager, backend=args.backend)
            else:
                eager = _backward(loss, lambda f: f)
                compiled = _backward(loss, lambda f: torch.compile(f, backend=args.backend))
            t0 = time.perf_counter()
            diff = _close(compiled(params, batch), eager(params, batch))
            first = time.perf_counter() - t0
            for _ in range(2):  # warm-up (and recompilations) outside the timed rounds
                compiled(params, batch)
            med = _time({"eager": eager, "compiled": compiled}, (params, batch), args.rounds)
            table.append((attention, form, med["eager"], med["compiled"], first, diff))
    return table, _breaks()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--backend", default="inductor")
    args = parser.parse_args()
    table, breaks = ps.spawn(rank_main, args, nprocs=2, timeout=1800)[0]
    print(f"quickstart step on 2 gloo ranks x 1 thread, float32, backend={args.backend}")
    print(f"{'attention':<9} {'step':<10} {'eager ms':>9} {'compiled ms':>12} {'ratio':>6} "
          f"{'1st call s':>10} {'max |diff|':>10}")  # fmt: skip
    for attention, form, eager, compiled, first, diff in table:
        print(
            f"{attention:<9} {form:<10} {eager * 1e3:>9.1f} {compiled * 1e3:>12.1f} "
            f"{compiled / eager:>6.2f} {first:>10.1f} {diff:>10.1e}"
        )
    print("\ngraph breaks (torch._dynamo.explain, 2 ranks)")
    print(f"{'function':<34} {'graphs':>6} {'breaks':>6}  reasons")
    for name, (graphs, count, reasons) in breaks:
        text = "; ".join(f"{n}x {r}" for r, n in reasons.most_common()) or "-"
        print(f"{name:<34} {graphs:>6} {count:>6}  {text}")


if __name__ == "__main__":
    main()
