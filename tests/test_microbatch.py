"""pmap_microbatch against the untransformed function: outputs, losses and gradients (both
nestings with torch.func.grad, eager backward, vmap outside), token weighting, streaming,
pinned errors."""

from __future__ import annotations

import functools
import re
import weakref

import pytest
import torch
import torch.nn.functional as F
from helpers import Batch, BatchEncodingLike, make_block_mask
from torch.func import grad, grad_and_value, vmap
from torch.nn.attention.flex_attention import flex_attention

import pshard as ps

DT = torch.float64
SPLIT = (None, ps.Shard(0), ps.Shard(0))


def make_params() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "w1": torch.randn(5, 8, dtype=DT, generator=g),
        "b1": torch.randn(8, dtype=DT, generator=g),
        "w2": torch.randn(8, 3, dtype=DT, generator=g),
    }


def make_data(batch: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(batch, 5, dtype=DT, generator=g), torch.randint(0, 3, (batch,), generator=g)


def mlp(params, x):
    return torch.tanh(x @ params["w1"] + params["b1"]) @ params["w2"]


def loss_fn(params, x, y):
    return F.cross_entropy(mlp(params, x), y)


def loss_and_logits(params, x, y):
    logits = mlp(params, x)
    return F.cross_entropy(logits, y), {"logits": logits, "flat": logits.reshape(-1)}


OUT = (ps.Partial("mean"), {"logits": ps.Shard(0), "flat": ps.Shard(0)})


def assert_close_trees(a, b):
    for x, y in zip(
        torch.utils._pytree.tree_leaves(a), torch.utils._pytree.tree_leaves(b), strict=True
    ):
        torch.testing.assert_close(x, y)


# --------------------------------------------------------------------------- against fn


@pytest.mark.parametrize("k", [1, 2, 3, 4, 7])
def test_outputs_match_unsplit(k):
    params, (x, y) = make_params(), make_data()
    f = ps.pmap_microbatch(loss_and_logits, num_microbatches=k, in_specs=SPLIT, out_specs=OUT)
    assert_close_trees(f(params, x, y), loss_and_logits(params, x, y))


@pytest.mark.parametrize("k", [1, 2, 3, 4, 7])
def test_gradient_accumulation_matches_unsplit(k):
    params, (x, y) = make_params(), make_data()
    step = ps.pmap_microbatch(
        grad_and_value(loss_fn), num_microbatches=k, in_specs=SPLIT, out_specs=ps.Partial("mean")
    )
    assert_close_trees(step(params, x, y), grad_and_value(loss_fn)(params, x, y))


@pytest.mark.parametrize("k", [1, 3, 7])
def test_grad_of_pmap_matches_unsplit(k):
    params, (x, y) = make_params(), make_data()
    f = ps.pmap_microbatch(loss_and_logits, num_microbatches=k, in_specs=SPLIT, out_specs=OUT)

    def objective(fn):
        def total(p):
            loss, out = fn(p, x, y)
            return loss + (out["logits"] ** 2).mean() + out["flat"][3]

        return total

    assert_close_trees(grad(objective(f))(params), grad(objective(loss_and_logits))(params))
    # eager autograd keeps every microbatch's graph and gives the same gradients
    leaves = {n: t.clone().requires_grad_() for n, t in params.items()}
    objective(f)(leaves).backward()
    assert_close_trees(
        {n: t.grad for n, t in leaves.items()}, grad(objective(loss_and_logits))(params)
    )


def test_vmap_outside():
    params, (_, y) = make_params(), make_data()
    xs = torch.randn(3, 10, 5, dtype=DT)
    f = ps.pmap_microbatch(loss_and_logits, num_microbatches=3, in_specs=SPLIT, out_specs=OUT)
    ours = vmap(f, in_dims=(None, 0, None))(params, xs, y)
    assert_close_trees(ours, vmap(loss_and_logits, in_dims=(None, 0, None))(params, xs, y))


def test_decorator_form_and_microbatch_size():
    seen = []

    @ps.pmap_microbatch(microbatch_size=4, out_specs=ps.Shard(0))
    def double(x):
        seen.append(x.shape[0])
        return 2 * x

    x = torch.arange(10.0)
    assert torch.equal(double(x), 2 * x)
    assert seen == [4, 3, 3]
    assert double.__name__ == "double"
    seen.clear()
    double(torch.arange(3.0))
    assert seen == [3]


# --------------------------------------------------------------------------- token weighting

VOCAB = 7


def lm_params() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return {
        "emb": torch.randn(VOCAB, 4, dtype=DT, generator=g),
        "head": torch.randn(4, VOCAB, dtype=DT, generator=g),
    }


def lm_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (6, 5), generator=g)
    labels = torch.randint(0, VOCAB, (6, 5), generator=g)
    keep = torch.tensor([5, 5, 0, 0, 1, 4])  # tokens per row: rows 2 and 3 have none
    labels[torch.arange(5)[None, :] >= keep[:, None]] = -100
    return ids, labels


def token_mean_loss(params, ids, labels):
    logits = params["emb"][ids] @ params["head"]
    return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100)


def num_tokens(params, ids, labels):
    return (labels != -100).sum()


@pytest.mark.parametrize("k", [2, 3, 6])
def test_token_weighting_is_the_global_token_mean(k):
    params, (ids, labels) = lm_params(), lm_batch()
    # microbatches 1 (k=3) and 2, 3 (k=6) have no tokens: their own loss is 0/0 = NaN
    assert torch.isnan(token_mean_loss(params, ids[2:4], labels[2:4]))
    kwargs = {"num_microbatches": k, "in_specs": SPLIT, "weight_fn": num_tokens}
    expected_grads, expected = grad_and_value(token_mean_loss)(params, ids, labels)

    loss = ps.pmap_microbatch(token_mean_loss, out_specs=ps.Partial("mean"), **kwargs)
    torch.testing.assert_close(loss(params, ids, labels), expected)

    step = ps.pmap_microbatch(
        grad_and_value(token_mean_loss), out_specs=ps.Partial("mean"), **kwargs
    )
    grads, value = step(params, ids, labels)
    torch.testing.assert_close(value, expected)
    assert_close_trees(grads, expected_grads)

    assert_close_trees(grad(lambda p: loss(p, ids, labels))(params), expected_grads)

    # without weight_fn the microbatch means are weighted by rows, which is not the token mean
    by_rows = ps.pmap_microbatch(
        token_mean_loss, num_microbatches=2, in_specs=SPLIT, out_specs=ps.Partial("mean")
    )
    assert not torch.allclose(by_rows(params, ids, labels), expected)


def test_token_weighting_under_vmap():
    params, (ids, labels) = lm_params(), lm_batch()
    labels2 = torch.stack([labels, labels.roll(2, 0)])  # each has a microbatch without tokens
    loss = ps.pmap_microbatch(
        token_mean_loss,
        num_microbatches=3,
        in_specs=SPLIT,
        out_specs=ps.Partial("mean"),
        weight_fn=num_tokens,
    )
    ours = vmap(loss, in_dims=(None, None, 0))(params, ids, labels2)
    expected = vmap(token_mean_loss, in_dims=(None, None, 0))(params, ids, labels2)
    torch.testing.assert_close(ours, expected)


def test_all_weights_zero_gives_zero():
    params, (ids, labels) = lm_params(), lm_batch()
    labels = torch.full_like(labels, -100)
    loss = ps.pmap_microbatch(
        token_mean_loss,
        num_microbatches=2,
        in_specs=SPLIT,
        out_specs=ps.Partial("mean"),
        weight_fn=num_tokens,
    )
    assert torch.equal(loss(params, ids, labels), torch.zeros((), dtype=DT))


# --------------------------------------------------------------------------- outputs


def test_reductions_scalars_and_replicate():
    def f(x):
        return {
            "sum": x.sum(0),
            "max": x.max(),
            "min": x.min(),
            "count": x.shape[0],
            "mean_n": float(x.shape[0]),
            "const": torch.ones(2),
        }

    x = torch.randn(9, 2, dtype=DT)
    specs = {
        "sum": ps.Partial("sum"),
        "max": ps.Partial("max"),
        "min": ps.Partial("min"),
        "count": ps.Partial("sum"),
        "mean_n": ps.Partial("mean"),
        "const": None,
    }
    out = ps.pmap_microbatch(f, num_microbatches=4, out_specs=specs)(x)
    torch.testing.assert_close(out["sum"], x.sum(0))
    assert out["max"] == x.max() and out["min"] == x.min()
    assert out["count"] == 9 and isinstance(out["count"], int)
    assert out["mean_n"] == pytest.approx((3 * 3 + 3 * 2 + 2 * 2 + 2 * 2 - 1 * 2) / 9)
    assert torch.equal(out["const"], torch.ones(2))


def test_accum_dtype():
    values = torch.rand(32, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)

    def running_sum(dtype):
        total = values[0].to(dtype)
        for v in values[1:]:
            total = total + v.to(dtype)
        return total.to(torch.bfloat16)

    narrow, wide = running_sum(torch.bfloat16), running_sum(torch.float32)
    assert narrow != wide  # bfloat16 accumulation loses precision on this input

    def f(x):
        return x.sum()

    specs = {"num_microbatches": 32, "out_specs": ps.Partial("sum")}
    out = ps.pmap_microbatch(f, accum_dtype=torch.float32, **specs)(values)
    assert out.dtype == torch.bfloat16 and out == wide
    assert ps.pmap_microbatch(f, **specs)(values) == wide  # float32 is the default for bf16
    assert ps.pmap_microbatch(f, accum_dtype=torch.bfloat16, **specs)(values) == narrow


def test_shard_output_sizes_that_do_not_scale():
    def f(x):
        return {"head": x[:2], "rows": x, "twice": torch.cat([x, x])}

    x = torch.arange(10.0).reshape(5, 2)
    out = ps.pmap_microbatch(f, num_microbatches=2, out_specs=ps.Shard(0))(x)
    assert torch.equal(out["head"], torch.cat([x[:2], x[3:5]]))
    assert torch.equal(out["rows"], x)
    assert torch.equal(out["twice"], torch.cat([x[:3], x[:3], x[3:], x[3:]]))


def test_streaming_keeps_no_earlier_outputs():
    refs: list[dict[str, weakref.ref]] = []

    def f(x):
        for old in refs:  # every earlier output has been folded in and freed
            assert all(ref() is None for ref in old.values())
        out = {"rows": 2 * x, "mean": x.mean(0), "sum": x.sum(0), "max": x.amax(0)}
        refs.append({n: weakref.ref(t) for n, t in out.items()})
        return out

    specs = {
        "rows": ps.Shard(0),
        "mean": ps.Partial("mean"),
        "sum": ps.Partial(),
        "max": ps.Partial("max"),
    }
    x = torch.randn(12, 3)
    out = ps.pmap_microbatch(f, num_microbatches=6, out_specs=specs)(x)
    assert torch.equal(out["rows"], 2 * x)
    torch.testing.assert_close(out["mean"], x.mean(0))
    torch.testing.assert_close(out["sum"], x.sum(0))
    assert torch.equal(out["max"], x.amax(0))


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_block_mask_inputs():
    torch.manual_seed(0)
    q, key, v = (torch.randn(4, 1, 128, 8) for _ in range(3))
    mask = make_block_mask(seq=128, block=64)

    def attend(q, k, v, mask):
        return flex_attention(q, k, v, block_mask=mask)

    expected = attend(q, key, v, mask)
    out = ps.pmap_microbatch(attend, num_microbatches=2, out_specs=ps.Shard(0))(q, key, v, mask)
    torch.testing.assert_close(out, expected)
    with pytest.raises(
        ValueError,
        match=re.escape(
            "pmap_microbatch(attend) in_specs[3]: out_specs='infer' cannot trace a function "
            "through a BlockMask it splits"
        ),
    ):
        ps.pmap_microbatch(attend, num_microbatches=2)(q, key, v, mask)


def test_mapping_and_dataclass_batches():
    params = make_params()
    x, y = make_data()

    def loss_on(params, batch, *, scale):
        return scale * F.cross_entropy(mlp(params, batch["x"]), batch["y"])

    enc = BatchEncodingLike({"x": x, "y": y})
    f = ps.pmap_microbatch(
        loss_on, num_microbatches=3, in_specs=(None, ps.Shard(0)), out_specs=ps.Partial("mean")
    )
    torch.testing.assert_close(f(params, enc, scale=2.0), loss_on(params, enc, scale=2.0))

    def loss_dc(params, batch):
        return F.cross_entropy(mlp(params, batch.input_ids), batch.labels) + batch.num_tokens

    dc = Batch(x, y, 3)
    f = ps.pmap_microbatch(
        loss_dc,
        num_microbatches=4,
        in_specs=(None, Batch(ps.Shard(0), ps.Shard(0), None)),
        out_specs=ps.Partial("mean"),
    )
    torch.testing.assert_close(f(params, dc), loss_dc(params, dc))


def test_default_in_specs_and_kwargs():
    def f(x, n, *, mask, scale=1.0):
        return {"y": x * mask * scale + n}

    x, mask = torch.randn(7, 2), torch.rand(7, 2) > 0.5
    f_mb = ps.pmap_microbatch(f, num_microbatches=3, out_specs=ps.Shard(0))
    assert torch.equal(
        f_mb(x, 3, mask=mask, scale=torch.tensor(2.0))["y"], f(x, 3, mask=mask, scale=2.0)["y"]
    )


def test_infer_out_specs():
    params, (x, y) = make_params(), make_data()

    def loss_logits_norm(params, x, y):
        logits = mlp(params, x)
        return F.cross_entropy(logits, y), logits, params["w1"].norm()

    # cross_entropy's mean is over the non-ignored targets: weighted by their count
    targets = functools.partial(lambda params, x, y: (y != -100).sum())
    f = ps.pmap_microbatch(loss_logits_norm, num_microbatches=3, in_specs=SPLIT, weight_fn=targets)
    assert_close_trees(f(params, x, y), loss_logits_norm(params, x, y))
    step = ps.pmap_microbatch(
        grad_and_value(loss_fn), num_microbatches=4, in_specs=SPLIT, weight_fn=targets
    )
    assert_close_trees(step(params, x, y), grad_and_value(loss_fn)(params, x, y))
    with pytest.raises(ValueError, match=re.escape("give pmap_microbatch a weight_fn")):
        ps.pmap_microbatch(loss_fn, num_microbatches=3, in_specs=SPLIT)(params, x, y)
    with pytest.raises(
        ValueError,
        match=re.escape(
            "pmap_microbatch(loss_and_logits) output[1]['flat']: dim 0 has size 3*B (shape "
            "(3*B,)), an expression of the batch size B"
        ),
    ):
        ps.pmap_microbatch(loss_and_logits, num_microbatches=3, in_specs=SPLIT, weight_fn=targets)(
            params, x, y
        )


# --------------------------------------------------------------------------- errors


def test_errors_at_decoration():
    with pytest.raises(
        ValueError,
        match=re.escape(
            "pmap_microbatch: give exactly one of num_microbatches (how many microbatches) and "
            "microbatch_size (the most examples in one), got num_microbatches=2, microbatch_size=4"
        ),
    ):
        ps.pmap_microbatch(loss_fn, num_microbatches=2, microbatch_size=4)
    with pytest.raises(
        ValueError, match=re.escape("pmap_microbatch: give exactly one of num_microbatches")
    ):
        ps.pmap_microbatch(loss_fn)
    with pytest.raises(
        ValueError, match=re.escape("pmap_microbatch: num_microbatches must be >= 1, got 0")
    ):
        ps.pmap_microbatch(num_microbatches=0)
    with pytest.raises(
        TypeError, match=re.escape("pmap_microbatch: microbatch_size must be an int")
    ):
        ps.pmap_microbatch(microbatch_size=2.5)
    with pytest.raises(
        TypeError, match=re.escape("pmap_microbatch: accum_dtype must be a floating-point")
    ):
        ps.pmap_microbatch(num_microbatches=2, accum_dtype=torch.int32)
    with pytest.raises(TypeError, match=re.escape("pmap_microbatch: fn must be callable")):
        ps.pmap_microbatch(num_microbatches=2)(3)


def test_errors_batch_sizes():
    params, (x, y) = make_params(), make_data()
    with pytest.raises(
        ValueError,
        match=re.escape(
            "pmap_microbatch(loss_fn) in_specs[0]['w1']: Shard(0) splits a dim of size 5 (dim 0 of "
            "a tensor of shape (5, 8)) but in_specs[0]['b1'] splits one of size 8 (dim 0 of a "
            "tensor of shape (8,)); every Shard leaf must have the same size along its split dim: "
            "give leaves that are not batched Replicate() or None"
        ),
    ):
        ps.pmap_microbatch(loss_fn, num_microbatches=2, out_specs=ps.Partial("mean"))(params, x, y)
    with pytest.raises(
        ValueError,
        match=re.escape(
            "pmap_microbatch(loss_fn) in_specs[1]: num_microbatches=11 but Shard(0) splits a dim "
            "of size 10 (dim 0 of a tensor of shape (10, 5)); there cannot be more chunks than "
            "entries along the split dim: use num_microbatches <= 10"
        ),
    ):
        ps.pmap_microbatch(
            loss_fn, num_microbatches=11, in_specs=SPLIT, out_specs=ps.Partial("mean")
        )(params, x, y)

    def g(x, *, mask):
        return x

    with pytest.raises(
        ValueError,
        match=re.escape("pmap_microbatch(g) kw_specs['mask']: Shard(0) splits a dim of size 9"),
    ):
        ps.pmap_microbatch(g, num_microbatches=2, out_specs=ps.Shard(0))(x, mask=torch.ones(9))
    with pytest.raises(
        ValueError,
        match=re.escape(
            "pmap_microbatch(g) kw_specs['mask']: Shard(1) but the tensor has 1 dim (shape (10,))"
        ),
    ):
        ps.pmap_microbatch(
            g, num_microbatches=2, kw_specs={"mask": ps.Shard(1)}, out_specs=ps.Shard(0)
        )(x, mask=torch.ones(10))
    with pytest.raises(
        ValueError, match=re.escape("pmap_microbatch(g): microbatch_size=2 but no input is split")
    ):
        ps.pmap_microbatch(g, microbatch_size=2, in_specs=None, kw_specs=None, out_specs=None)(
            3, mask=1
        )


def test_errors_outputs():
    x = torch.randn(6, 3)

    def pair(x):
        return x, x.sum()

    with pytest.raises(
        ValueError,
        match=re.escape(
            "pmap_microbatch(pair) out_specs: the spec is a tuple of length 3 but the value is a "
            "tuple of length 2"
        ),
    ):
        ps.pmap_microbatch(pair, num_microbatches=2, out_specs=(None, None, None))(x)

    def ragged(x):
        return x[:, : x.shape[0]]

    with pytest.raises(
        ValueError,
        match=re.escape(
            "pmap_microbatch(ragged) out_specs: Shard(0) but microbatch 1 gave a tensor of shape "
            "(2, 2) and microbatch 0 a tensor of shape (*, 3); the outputs must agree on every dim "
            "but the split dim 0"
        ),
    ):
        ps.pmap_microbatch(ragged, num_microbatches=2, out_specs=ps.Shard(0))(torch.randn(5, 3))

    def changing(x):
        return {"a": x} if x.shape[0] == 3 else {"b": x}

    with pytest.raises(
        ValueError, match=re.escape("pmap_microbatch(changing) out_specs: microbatch 1 has a dict")
    ):
        ps.pmap_microbatch(changing, num_microbatches=2, out_specs=ps.Shard(0))(torch.randn(5, 3))

    with pytest.raises(
        ValueError,
        match=re.escape("pmap_microbatch(pair) out_specs[1]: Shard(0) but the tensor has 0 dims"),
    ):
        ps.pmap_microbatch(pair, num_microbatches=2, out_specs=ps.Shard(0))(x)


def test_errors_weights_and_replicate(monkeypatch):
    x = torch.randn(6, 3)

    def mean(x):
        return x.mean()

    with pytest.raises(
        ValueError,
        match=re.escape(
            "pmap_microbatch(mean): weight_fn for microbatch 0 must be finite and >= 0, got -1.0"
        ),
    ):
        ps.pmap_microbatch(
            mean, num_microbatches=2, out_specs=ps.Partial("mean"), weight_fn=lambda x: -1
        )(x)
    with pytest.raises(
        ValueError,
        match=re.escape(
            "pmap_microbatch(mean): weight_fn for microbatch 0 must be a number or a one-element "
            "tensor, got a tensor of shape (3,)"
        ),
    ):
        ps.pmap_microbatch(
            mean, num_microbatches=2, out_specs=ps.Partial("mean"), weight_fn=lambda x: x[:, 0]
        )(x)
    monkeypatch.setenv("PSHARD_DEBUG", "1")
    with pytest.raises(
        ValueError,
        match=re.escape(
            "pmap_microbatch(mean) out_specs: Replicate() but microbatch 1 (a tensor of shape ()) "
            "differs from microbatch 0"
        ),
    ):
        ps.pmap_microbatch(mean, num_microbatches=2, out_specs=None)(x)


# --------------------------------------------------------------------------- IEEE and precision


def test_mean_keeps_ieee_semantics():
    """An inf in a mean stays inf (a running lerp turned it into nan), a nan stays nan."""
    x = torch.tensor([[1.0], [float("inf")], [2.0], [3.0], [4.0], [5.0]], dtype=DT)
    for k in (2, 3, 6):
        out = ps.pmap_microbatch(lambda x: x.mean(), num_microbatches=k)(x)
        assert out.item() == float("inf"), k
    chunks = [torch.tensor(float("inf")), torch.tensor(1.0), torch.tensor(2.0)]
    assert ps.merge(chunks, ps.Partial("mean")).item() == float("inf")
    assert ps.merge([torch.tensor(-float("inf")), torch.tensor(1.0)], ps.Partial("mean")) == -float(
        "inf"
    )
    assert ps.merge([torch.tensor(float("nan")), torch.tensor(1.0)], ps.Partial("mean")).isnan()
    # one contributing chunk comes back exactly; a zero-weight chunk contributes nothing
    x = torch.tensor(0.1, dtype=DT)
    assert ps.merge([x], ps.Partial("mean"), weights=[3.0]).item() == 0.1
    nan = torch.tensor(float("nan"), dtype=DT)
    assert ps.merge([x, nan], ps.Partial("mean"), weights=[7.0, 0.0]).item() == 0.1


def test_low_precision_accumulates_in_float32():
    """bf16 / fp16 sums and means accumulate in float32 by default (256 + 255 x 1 = 511)."""
    for dtype in (torch.bfloat16, torch.float16):
        chunks = [torch.tensor(256.0, dtype=dtype)] + [torch.tensor(1.0, dtype=dtype)] * 255
        total = ps.merge(chunks, ps.Partial("sum"))
        assert total.dtype == dtype
        assert total.item() == (512.0 if dtype == torch.bfloat16 else 511.0)  # one rounding
        mean = ps.merge(chunks, ps.Partial("mean"))
        assert mean.dtype == dtype
        torch.testing.assert_close(mean.float(), torch.tensor(511 / 256), atol=1e-2, rtol=0)
        if dtype == torch.bfloat16:  # asked for bf16 accumulation explicitly: a rounding a step
            low = ps.merge(chunks, ps.Partial("sum"), accum_dtype=dtype)
            assert low.item() == 256.0
    x = torch.ones(512, 1, dtype=torch.bfloat16)
    x[0] = 256
    out = ps.pmap_microbatch(lambda x: x.sum(), num_microbatches=256)(x)
    assert out.item() == 768.0  # 256 + 511 ones, rounded once to bf16


def test_clear_errors_for_common_mistakes():
    x = torch.ones(4, dtype=DT)
    with pytest.raises(
        ValueError,
        match=re.escape(
            "split specs: the batch is empty: Shard(0) splits a dim of size 0 (dim 0 of a tensor "
            "of shape (0, 3)), so there is nothing to split into 2 chunks"
        ),
    ):
        ps.split(torch.zeros(0, 3), ps.Shard(0), 2)
    with pytest.raises(ValueError, match=re.escape("pmap_microbatch(<lambda>) in_specs[0]: the")):
        ps.pmap_microbatch(lambda x: x, num_microbatches=2)(torch.zeros(0, 3))
    step = ps.pmap_microbatch(
        lambda x, y: (x * y).sum(), num_microbatches=2, out_specs=ps.Partial("mean"),
        weight_fn=lambda x: 1.0,
    )  # fmt: skip
    with pytest.raises(
        TypeError,
        match=re.escape(
            "pmap_microbatch(<lambda>): weight_fn is called like fn, with each microbatch's "
            "arguments (2 positional), but <lambda>(x) cannot take them"
        ),
    ):
        step(x, x)
