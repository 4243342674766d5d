"""Baselines shared by the microbatching benchmarks."""

from __future__ import annotations

from collections.abc import Callable

import pshard as ps


def hand_accumulation(step_fn: Callable, k: int) -> Callable:
    """The hand-written gradient-accumulation loop pmap_microbatch is measured against:
    ``step_fn(params, x, y) -> (grads, value)`` on ``k`` tensor_split microbatches, averaged by
    microbatch size, one microbatch's results alive at a time."""

    def loop(params, x, y):
        grads, value, total = None, None, 0
        for xb, yb in zip(x.tensor_split(k), y.tensor_split(k), strict=True):
            g, v = step_fn(params, xb, yb)
            n = xb.shape[0]
            if grads is None:
                grads, value = {name: t * n for name, t in g.items()}, v * n
            else:
                for name, t in g.items():
                    grads[name].add_(t, alpha=n)
                value = value + v * n
            total += n
            del g, v
        return {name: t / total for name, t in grads.items()}, value / total

    return loop


def microbatched(step_fn: Callable, k: int) -> Callable:
    """The same with pshard: ``pmap_microbatch`` over (params, x, y), means weighted by size."""
    return ps.pmap_microbatch(
        step_fn,
        num_microbatches=k,
        in_specs=(None, ps.Shard(0), ps.Shard(0)),
        out_specs=ps.Partial("mean"),
    )
