"""ps.pipeline_value_and_grad and ps.pipeline against one process running the stages in
sequence, float64, on 4 ranks: every schedule (uneven microbatches, fewer than the stages),
heterogeneous stages (an embedding, a tuple with an integer tensor between stages, a feature
size that changes, a cross-entropy head; once in debug mode), interleaved stages, and the
differentiable forward under torch.func.grad, vjp and .backward()."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import pshard as ps

f64 = torch.float64
D = 6


def layer(p, x):
    return torch.tanh(x @ p["w"] + p["b"])


def mlp(ps_, x):
    for p in ps_:
        x = layer(p, x)
    return x


def sq_loss(y, t):
    return ((y - t) ** 2).sum()


def _layers(n=8, d=D, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        {"w": torch.randn(d, d, generator=g, dtype=f64) / d**0.5,
         "b": torch.randn(d, generator=g, dtype=f64) * 0.1}
        for _ in range(n)
    ]  # fmt: skip


def _data(b, seed=1, d=D):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, d, generator=g, dtype=f64), torch.randn(b, d, generator=g, dtype=f64)


def _reference(layers, x, t, m, loss_fn=sq_loss, model=mlp):
    """The loss summed over torch.chunk's microbatches and the gradient of every layer."""
    leaves = [{k: v.clone().requires_grad_() for k, v in p.items()} for p in layers]
    pairs = zip(x.chunk(m), t.chunk(m), strict=True)
    loss = sum(loss_fn(model(leaves, xc), tc) for xc, tc in pairs)
    loss.backward()
    return loss.detach(), [{k: v.grad for k, v in p.items()} for p in leaves]


def _max_diff(got, want):
    return max((got[k] - want[k]).abs().max().item() for k in want)


def rank_every_schedule(schedule):
    torch.set_default_dtype(f64)
    ps.init_mesh({"pp": 4})
    r = ps.axis_index("pp")
    layers = _layers()
    v = 2 if schedule == "interleaved_1f1b" else 1
    per = 8 // (4 * v)  # layers per stage
    mine = [[(k * 4 + r) * per + j for j in range(per)] for k in range(v)]  # this rank's layers
    if v == 1:
        stages, params = mlp, [layers[i] for i in mine[0]]
    else:
        stages, params = [mlp] * 8, tuple([layers[i] for i in ids] for ids in mine)
    out = []
    for m, b in [(4, 8), (3, 7), (2, 5)]:  # even, uneven (3, 3, 1), fewer than the 4 stages
        x, t = _data(b)
        step = ps.pipeline_value_and_grad(stages, sq_loss, num_microbatches=m, schedule=schedule)
        loss, grads = step(params, x, t)
        ref_loss, ref_grads = _reference(layers, x, t, m)
        trees = grads if v > 1 else (grads,)
        assert isinstance(grads, tuple if v > 1 else list)
        diff = max(
            _max_diff(g, ref_grads[i]) for tree, ids in zip(trees, mine, strict=True)
            for g, i in zip(tree, ids, strict=True)
        )  # fmt: skip
        out.append((abs(loss.item() - ref_loss.item()), diff, loss.dtype))
    return out


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"])
def test_every_schedule_equals_one_process(pool, schedule):
    for rank in pool.run(4, rank_every_schedule, schedule):
        for loss_diff, grad_diff, dtype in rank:
            assert dtype == f64
            assert loss_diff < 1e-12 and grad_diff < 1e-12


VOCAB, T, E, H = 11, 5, 4, 8


def _lm_params(seed=0):
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=f64) * 0.5

    return [
        {"emb": rnd(VOCAB, E), "w": rnd(E, H)},  # tokens -> (B, T, H)
        {"w": rnd(H, H), "b": rnd(H)},
        {"w": rnd(H, 2 * H)},  # the feature size changes between stages
        {"w": rnd(2 * H, VOCAB)},  # the head: logits
    ]


def embed(p, tokens):
    return torch.tanh(p["emb"][tokens] @ p["w"])


def middle(p, h):  # hands on a tuple: a float and an integer tensor
    h = torch.tanh(h @ p["w"] + p["b"])
    return h, (h > 0).sum(-1)


def widen(p, hc):
    h, count = hc
    return torch.tanh(h @ p["w"]) * (1 + count.unsqueeze(-1))


def head(p, h):
    return h @ p["w"]


def ce(logits, labels):
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")


def lm(params, tokens):
    h = tokens
    for fn, p in zip((embed, middle, widen, head), params, strict=True):
        h = fn(p, h)
    return h


def rank_heterogeneous(schedule):
    torch.set_default_dtype(f64)
    ps.init_mesh({"pp": 4})
    r = ps.axis_index("pp")
    params = _lm_params()
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (7, T), generator=g)
    labels = torch.randint(0, VOCAB, (7, T), generator=g)
    step = ps.pipeline_value_and_grad(
        [embed, middle, widen, head], ce, num_microbatches=3, schedule=schedule
    )
    with ps.debug(schedule == "zero_bubble"):  # every message checked on arrival
        loss, grads = step(params[r], tokens, labels)
    ref_loss, ref_grads = _reference(params, tokens, labels, 3, loss_fn=ce, model=lm)
    return abs(loss.item() - ref_loss.item()), _max_diff(grads, ref_grads[r])


@pytest.mark.parametrize("schedule", ["1f1b", "zero_bubble"])
def test_heterogeneous_stages_with_an_embedding_and_a_cross_entropy(pool, schedule):
    for loss_diff, grad_diff in pool.run(4, rank_heterogeneous, schedule):
        assert loss_diff < 1e-12 and grad_diff < 1e-12


def rank_forward(how):
    torch.set_default_dtype(f64)
    ps.init_mesh({"pp": 4})
    r = ps.axis_index("pp")
    layers = _layers()
    x, t = _data(7)
    params = layers[2 * r : 2 * r + 2]
    model = ps.pipeline(mlp, num_microbatches=3)

    def objective(p, x_):
        return (model(p, x_).sin() * t).sum()

    if how == "grad":
        gp, gx = torch.func.grad(objective, argnums=(0, 1))(params, x)
    elif how == "vjp":
        y, pull = torch.func.vjp(model, params, x)
        gp, gx = pull(y.cos() * t)
    else:
        leaves = [{k: v.clone().requires_grad_() for k, v in p.items()} for p in params]
        xl = x.clone().requires_grad_()
        objective(leaves, xl).backward()
        gp, gx = [{k: v.grad for k, v in p.items()} for p in leaves], xl.grad
    with torch.no_grad():
        y = model(params, x)
    ref = [{k: v.clone().requires_grad_() for k, v in p.items()} for p in layers]
    xr = x.clone().requires_grad_()
    (mlp(ref, xr).sin() * t).sum().backward()
    out_diff = (y - mlp(layers, x)).abs().max().item()
    grad_diff = max(_max_diff(g, {k: v.grad for k, v in ref[2 * r + i].items()})
                    for i, g in enumerate(gp))  # fmt: skip
    return out_diff, grad_diff, (gx - xr.grad).abs().max().item()


@pytest.mark.parametrize("how", ["grad", "vjp", "backward"])
def test_pipeline_is_differentiable(pool, how):
    for out_diff, grad_diff, input_diff in pool.run(4, rank_forward, how):
        assert out_diff < 1e-12 and grad_diff < 1e-12 and input_diff < 1e-12


def test_one_rank_and_torch_chunk_sizes():
    torch.set_default_dtype(f64)
    try:
        ps.init_mesh({"pp": 1})
        seen = []

        def mean_loss(y, t):
            seen.append(y.shape[0])
            return ((y - t) ** 2).mean()

        layers = _layers(2)
        x, t = _data(10)
        loss, grads = ps.pipeline_value_and_grad(mlp, mean_loss, num_microbatches=4)(layers, x, t)
        assert seen == [3, 3, 3, 1]  # torch.chunk's sizes, not tensor_split's 3, 3, 2, 2
        ref_loss, ref_grads = _reference(layers, x, t, 4, loss_fn=mean_loss)
        assert abs(loss.item() - ref_loss.item()) < 1e-12
        assert max(_max_diff(g, r) for g, r in zip(grads, ref_grads, strict=True)) < 1e-12
        # in_specs cut another dim, and leave a leaf whole
        xs, ts = x.T.contiguous(), t.T.contiguous()
        step = ps.pipeline_value_and_grad(
            lambda p, x_: mlp(p, x_[0].T) * x_[1],
            lambda y, t_: ((y - t_.T) ** 2).sum(),
            num_microbatches=4,
            in_specs=((ps.Shard(1), None), ps.Shard(1)),
        )
        loss2, _ = step(layers, (xs, torch.tensor(1.0)), ts)
        ref2, _ = _reference(layers, x, t, 4)
        assert abs(loss2.item() - ref2.item()) < 1e-12
    finally:
        torch.set_default_dtype(torch.float32)
