"""pmap_microbatch and shard_map nested both ways, against the single-process token-mean loss.

The model is a linear classifier with a token-mean cross-entropy over labels with ignored
positions (very uneven token counts, some rows with none), float64. Every nesting must give the
loss and gradients of the unsplit, unsharded function on every rank.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.func import grad_and_value

import pshard as ps

ROWS, FEATURES, CLASSES = 11, 5, 4


def _data():
    g = torch.Generator().manual_seed(0)
    params = {
        "w": torch.randn(FEATURES, CLASSES, dtype=torch.float64, generator=g),
        "b": torch.randn(CLASSES, dtype=torch.float64, generator=g),
    }
    x = torch.randn(ROWS, 3, FEATURES, dtype=torch.float64, generator=g)  # rows x tokens
    y = torch.randint(0, CLASSES, (ROWS, 3), generator=g)
    y[torch.rand(ROWS, 3, generator=g) < 0.6] = -100  # uneven counts, rows with no target
    y[0] = -100
    y[1] = torch.tensor([1, 2, 3])
    return params, x, y


def _token_sum_and_count(params, x, y):
    logits = x @ params["w"] + params["b"]
    losses = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none")
    mask = y.flatten() != -100
    return torch.where(mask, losses, 0.0).sum(), mask.sum()


def full_loss(params, x, y):
    """The reference: token mean over the whole batch."""
    total, count = _token_sum_and_count(params, x, y)
    return total / count


def _tokens(params, x, y):
    return (y != -100).sum()


def _microbatch_mean(params, x, y):
    """Token mean of one microbatch (NaN when it has no token: its weight is 0 then)."""
    total, count = _token_sum_and_count(params, x, y)
    return total / count


def _global_mean(params, x, y):
    """Token mean over the global batch inside shard_map: psum of sums over psum of counts."""
    total, count = _token_sum_and_count(params, x, y)
    return ps.psum(total, "dp") / ps.psum(count, "dp").clamp_min(1)


def _micro_in_shard(params, x, y):
    # Gradient accumulation over microbatches of this rank's rows, token weighted...
    step = ps.pmap_microbatch(
        grad_and_value(_microbatch_mean),
        num_microbatches=2,
        in_specs=(None, ps.Shard(0), ps.Shard(0)),
        out_specs=(ps.Partial("mean"), ps.Partial("mean")),
        weight_fn=_tokens,
    )
    grads, loss = step(params, x, y)
    # ...then the token-weighted mean over the ranks.
    count = _tokens(params, x, y).to(torch.float64)
    total = ps.psum(count, "dp")
    avg = lambda t: ps.psum(t * count, "dp") / total  # noqa: E731
    return {k: avg(g) for k, g in grads.items()}, avg(loss)


def _check(nprocs: int):
    params, x, y = _data()
    ref_grads, ref_loss = grad_and_value(full_loss)(params, x, y)
    ps.init_mesh({"dp": nprocs})
    results = {}

    # shard_map(pmap_microbatch(grad_and_value(f))): data parallel over ranks, accumulation inside.
    inner = ps.shard_map(
        _micro_in_shard,
        in_specs=(None, ps.Shard(0), ps.Shard(0)),
        out_specs=ps.Replicate(),
    )
    results["shard_map(pmap_microbatch(grad))"] = inner(params, x, y)

    # pmap_microbatch over the global batch around a shard_map'd global token mean.
    sharded = ps.shard_map(
        _global_mean, in_specs=(None, ps.Shard(0), ps.Shard(0)), out_specs=ps.Replicate()
    )
    outer = ps.pmap_microbatch(
        sharded,
        num_microbatches=4,
        in_specs=(None, ps.Shard(0), ps.Shard(0)),
        out_specs=ps.Partial("mean"),
        weight_fn=_tokens,
    )
    results["grad(pmap_microbatch(shard_map))"] = grad_and_value(outer)(params, x, y)
    outer_grad = ps.pmap_microbatch(
        grad_and_value(sharded),
        num_microbatches=4,
        in_specs=(None, ps.Shard(0), ps.Shard(0)),
        out_specs=(ps.Partial("mean"), ps.Partial("mean")),
        weight_fn=_tokens,
    )
    results["pmap_microbatch(grad(shard_map))"] = outer_grad(params, x, y)

    # grad of shard_map(pmap_microbatch(f)) with the token sum and count merged as sums.
    def body(params, x, y):
        total, count = ps.pmap_microbatch(
            _token_sum_and_count,
            num_microbatches=2,
            in_specs=(None, ps.Shard(0), ps.Shard(0)),
            out_specs=(ps.Partial("sum"), ps.Partial("sum")),
        )(params, x, y)
        return total, count

    mapped = ps.shard_map(
        body, in_specs=(None, ps.Shard(0), ps.Shard(0)), out_specs=ps.Partial("sum")
    )

    def loss(params, x, y):
        total, count = mapped(params, x, y)
        return total / count

    results["grad(shard_map(pmap_microbatch))"] = grad_and_value(loss)(params, x, y)
    # Plain eager backward through the whole nesting.
    leaf = {k: v.clone().requires_grad_() for k, v in params.items()}
    value = loss(leaf, x, y)
    value.backward()
    results["backward"] = ({k: v.grad for k, v in leaf.items()}, value.detach())

    errors = {}
    for name, (grads, value) in results.items():
        err = (value - ref_loss).abs().item()
        for k in params:
            err = max(err, (grads[k] - ref_grads[k]).abs().max().item())
        errors[name] = err
    # Identical on every rank.
    return errors, {name: r[1].item() for name, r in results.items()}


@pytest.mark.parametrize("nprocs", [1, 2, 4])
def test_nesting_matches_single_process(pool, nprocs):
    per_rank = pool.run(nprocs, _check, nprocs)
    for errors, values in per_rank:
        for name, err in errors.items():
            assert err < 1e-12, (name, err)
        assert values == per_rank[0][1]


def test_reference_is_token_weighted():
    # Guard against a test that cannot fail: the per-microbatch unweighted mean differs.
    params, x, y = _data()
    chunks = [c for c in zip(x.tensor_split(4), y.tensor_split(4), strict=True)]
    means = [_microbatch_mean(params, cx, cy) for cx, cy in chunks if (cy != -100).any()]
    assert abs(torch.stack(means).mean() - full_loss(params, x, y)) > 1e-3
