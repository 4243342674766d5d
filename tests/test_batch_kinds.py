"""Batch-dim analysis is exact or refuses: a corpus of functions, each run by
``pmap_microbatch`` with the inferred out specs on 3 uneven microbatches (float64) and compared
with the function on the whole batch. A function is either refused (a ``ValueError`` asking for
``out_specs``) or merged to the whole batch's value; the common ones (losses, their gradients,
per-example outputs, sums, maxima, token means with ``weight_fn``) must not be refused. The same
holds when the call sits under ``torch.func.grad``, ``vmap`` or a ``requires_grad`` input, in any
order (no answer is carried from one calling context to another)."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

import pshard as ps

S0, R = ps.Shard(0), ps.Replicate()
DT = torch.float64
N, D, C = 7, 4, 3


def _data(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, C, (N,), generator=g)
    y[2] = -100  # an ignored target
    return {
        "w": torch.randn(D, C, dtype=DT, generator=g),
        "x": torch.randn(N, D, dtype=DT, generator=g),
        "y": y,
        "ids": torch.randint(0, 5, (N, 2), generator=g),
        "table": torch.randn(5, D, dtype=DT, generator=g),
        "ln": torch.randn(D, dtype=DT, generator=g),
    }


def _targets(w, x, y, *rest):
    return (y != -100).sum()


def _ce(w, x, y):
    return F.cross_entropy(x @ w, y)


def _token_mean(w, x, y):
    losses = ((x @ w) ** 2).sum(-1)
    mask = (y != -100).to(DT)
    return (losses * mask).sum() / mask.sum()


def _mse(w, x, y):
    return ((x @ w) ** 2).mean()


def _lm(table, ids, ln):
    h = F.layer_norm(table[ids], (D,), weight=ln)
    return h.tanh().pow(2).mean()


# name -> (fn, argument names, in_specs, weight_fn or None, must be accepted)
CASES = {
    "per_example": (lambda w, x: torch.tanh(x @ w), ("w", "x"), (R, S0), None, True),
    "mean": (lambda w, x: (x @ w).mean(), ("w", "x"), (R, S0), None, True),
    "sum": (lambda w, x: (x @ w).sum(0), ("w", "x"), (R, S0), None, True),
    "max": (lambda x: x.amax(0), ("x",), (S0,), None, True),
    "min": (lambda x: x.min(), ("x",), (S0,), None, True),
    "neg_max": (lambda x: -(x.amax(0)) * 2.0, ("x",), (S0,), None, True),
    "count": (lambda x: torch.full((), x.shape[0], dtype=DT), ("x",), (S0,), None, True),
    "mean_plus_const": (lambda w, x: x.mean(0) @ w + 1.0, ("w", "x"), (R, S0), None, True),
    "gram": (lambda x: x.T @ x, ("x",), (S0,), None, True),
    "mse_grad": (torch.func.grad(_mse), ("w", "x", "y"), (R, S0, S0), None, True),
    "mse_value_and_grad": (
        torch.func.grad_and_value(_mse),
        ("w", "x", "y"),
        (R, S0, S0),
        None,
        True,
    ),
    "grad_wrt_split_sum": (
        torch.func.grad(lambda x, w: (x @ w).pow(2).sum()),
        ("x", "w"),
        (S0, R),
        None,
        True,
    ),
    "ce_weighted": (_ce, ("w", "x", "y"), (R, S0, S0), _targets, True),
    "ce_grad_weighted": (
        torch.func.grad_and_value(_ce),
        ("w", "x", "y"),
        (R, S0, S0),
        _targets,
        True,
    ),
    "token_mean_weighted": (_token_mean, ("w", "x", "y"), (R, S0, S0), _targets, True),
    "token_mean_grad_weighted": (
        torch.func.grad(_token_mean),
        ("w", "x", "y"),
        (R, S0, S0),
        _targets,
        True,
    ),
    "lm_grad": (
        torch.func.grad(_lm, argnums=(0, 2)),
        ("table", "ids", "ln"),
        (R, S0, R),
        None,
        True,
    ),  # fmt: skip
    "softmax_features": (lambda x: x.softmax(-1), ("x",), (S0,), None, True),
    "independent": (lambda w, x: (w * 2, x.shape[1]), ("w", "x"), (R, S0), None, True),
    # refused: no merge of microbatches reproduces these
    "ce_unweighted": (_ce, ("w", "x", "y"), (R, S0, S0), None, False),
    "mean_squared": (lambda x: x.mean() ** 2, ("x",), (S0,), None, False),
    "norm": (lambda x: x.norm(), ("x",), (S0,), None, False),
    "centered": (lambda x: x - x.mean(0), ("x",), (S0,), None, False),
    "softmax_batch": (lambda x: x.softmax(0), ("x",), (S0,), None, False),
    "cumsum_batch": (lambda x: x.cumsum(0), ("x",), (S0,), None, False),
    "first_row": (lambda x: x[0], ("x",), (S0,), None, False),
    "head_rows": (lambda x: x[:2], ("x",), (S0,), None, False),
    "scaled_by_batch": (lambda x: x * x.shape[0], ("x",), (S0,), None, False),
    "mean_grad_wrt_split": (
        torch.func.grad(lambda x, w: (x @ w).mean()),
        ("x", "w"),
        (S0, R),
        None,
        False,
    ),
    "sum_plus_const": (lambda x: x.sum(0) + 1.0, ("x",), (S0,), None, False),
    "max_times_tensor": (lambda x, w: x.amax(0) * w[:, 0], ("x", "w"), (S0, R), None, False),
    "var": (lambda x: x.var(0), ("x",), (S0,), None, False),
    "logsumexp_batch": (lambda x: x.logsumexp(0), ("x",), (S0,), None, False),
    "arange_rows": (
        lambda x: x * torch.arange(x.shape[0], dtype=DT)[:, None],
        ("x",),
        (S0,),
        None,
        False,
    ),  # fmt: skip
    "batch_norm": (
        lambda x: F.batch_norm(x, None, None, training=True),
        ("x",),
        (S0,),
        None,
        False,
    ),
}


def _leaves(tree):
    return [t for t in torch.utils._pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _run(name: str):
    fn, names, in_specs, weight_fn, _ = CASES[name]
    data = _data()
    args = tuple(data[n] for n in names)
    mapped = ps.pmap_microbatch(fn, num_microbatches=3, in_specs=in_specs, weight_fn=weight_fn)
    return mapped, fn, args


@pytest.mark.parametrize("name", list(CASES))
def test_exact_or_refused(name: str) -> None:
    ps.init_mesh({"x": 1})
    accepted = CASES[name][4]
    mapped, fn, args = _run(name)
    try:
        got = mapped(*args)
    except ValueError as e:
        assert not accepted, f"{name} was refused: {e}"
        assert "pass out_specs explicitly" in str(e) or "weight_fn" in str(e), str(e)
        return
    assert accepted, f"{name} was accepted; it cannot be merged exactly"
    want = fn(*args)
    got_leaves, want_leaves = _leaves(got), _leaves(want)
    assert len(got_leaves) == len(want_leaves)
    for g, w in zip(got_leaves, want_leaves, strict=True):
        torch.testing.assert_close(g, w.to(g.dtype), rtol=1e-12, atol=1e-12, msg=name)


def _outer_loss(w, x, y):
    return ps.pmap_microbatch(_mse, num_microbatches=3, in_specs=(None, S0, S0))(w, x, y)


def _outer_token(w, x, y):
    step = ps.pmap_microbatch(
        _token_mean, num_microbatches=3, in_specs=(None, S0, S0), weight_fn=_targets
    )
    return step(w, x, y)


@pytest.mark.parametrize("order", ["grad_first", "plain_first"])
def test_outer_transforms_and_calling_order(order: str) -> None:
    """grad / vmap / requires_grad around pmap_microbatch with inferred specs, called in either
    order: the same numbers as the unsplit function every time."""
    ps.init_mesh({"x": 1})
    d = _data(1)
    w, x, y = d["w"], d["x"], d["y"]

    def check_all():
        for outer, plain in ((_outer_loss, _mse), (_outer_token, _token_mean)):
            torch.testing.assert_close(outer(w, x, y), plain(w, x, y))
            torch.testing.assert_close(
                torch.func.grad(outer)(w, x, y), torch.func.grad(plain)(w, x, y)
            )
            torch.testing.assert_close(  # the gradient with respect to the split input
                torch.func.grad(outer, argnums=1)(w, x, y),
                torch.func.grad(plain, argnums=1)(w, x, y),
            )
            wr = w.clone().requires_grad_(True)
            outer(wr, x, y).backward()
            torch.testing.assert_close(wr.grad, torch.func.grad(plain)(w, x, y))
            ws = torch.stack([w, 2 * w])
            torch.testing.assert_close(
                torch.func.vmap(functools.partial(outer, x=x, y=y))(ws),
                torch.func.vmap(functools.partial(plain, x=x, y=y))(ws),
            )

    if order == "grad_first":
        check_all()
    else:
        _outer_loss(w, x, y)
        _outer_token(w, x, y)
        check_all()
