"""Batch-dim analysis: ``infer_out_specs`` against hand-checked cases and against a real
microbatched run (split the inputs, run each chunk, merge by the inferred specs, compare)."""

from __future__ import annotations

import collections
import functools
import gc
import re
import weakref

import optree
import pytest
import torch
import torch.nn.functional as F
from helpers import TREES, Batch, CausalLMOutputLike, Derived

import pshard as ps
from pshard._core.tree import tree_flatten, tree_map
from pshard._microbatch import batch_dim as _batch_dim
from pshard._microbatch.split import resolve_inputs

S0, S1, R, MEAN = ps.Shard(0), ps.Shard(1), ps.Replicate(), ps.Partial("mean")
SUM = ps.Partial("sum")


def infer(fn, *args, **kwargs):
    return ps.infer_out_specs(fn, *args, **kwargs)


# ----------------------------------------------------------------------------- batch dim position


@pytest.mark.parametrize(
    ("fn", "expected"),
    [
        (lambda x: x, S0),
        (lambda x: x * 2 + 1, S0),
        (lambda x: x.transpose(0, 1), S1),
        (lambda x: x.permute(1, 2, 0), ps.Shard(2)),
        (lambda x: x.movedim(0, -1), ps.Shard(2)),
        (lambda x: x.reshape(x.shape[0], -1), S0),
        (lambda x: x.flatten(1), S0),
        (lambda x: x.unsqueeze(0), S1),
        (lambda x: x.reshape(x.shape[0], 2, 3, 4).permute(2, 3, 0, 1), ps.Shard(2)),
        (lambda x: x.flatten(1).reshape(-1, 4, 6).transpose(0, 2), ps.Shard(2)),
        (lambda x: x.sum(-1), S0),
        (lambda x: x.amax(dim=(1, 2)), S0),
        (lambda x: x.softmax(-1).transpose(1, 2), S0),
        (lambda x: torch.zeros(x.shape[0], 3), S0),
    ],
)
def test_batch_dim_position(fn, expected):
    assert infer(fn, torch.randn(5, 4, 6)) == expected


@pytest.mark.parametrize(
    ("fn", "expected"),
    [
        (lambda x: x, S1),
        (lambda x: x.sum(0), S0),
        (lambda x: x.transpose(1, 2), ps.Shard(2)),
        (lambda x: x.mean(1), MEAN),
    ],
)
def test_input_split_on_dim_1(fn, expected):
    assert infer(fn, torch.randn(3, 5, 4), in_specs=(S1,)) == expected


def test_input_split_on_negative_dim():
    out = infer(lambda x: (x, x.sum(0)), torch.randn(3, 5), in_specs=ps.Shard(-1))
    assert out == (S1, S0)


# ----------------------------------------------------------------------------- reductions etc.


@pytest.mark.parametrize(
    ("fn", "expected"),
    [
        (lambda x: x.mean(), MEAN),
        (lambda x: x.sum(), SUM),
        (lambda x: x.mean(0), MEAN),
        (lambda x: x.sum(0, keepdim=True), SUM),
        (lambda x: x.T @ x, SUM),
        (lambda x: x.amax(0), ps.Partial("max")),
        (lambda x: x.min(), ps.Partial("min")),
        (lambda x: torch.full((), x.shape[0]), SUM),
    ],
)
def test_reductions_over_the_batch_are_the_reduction_found(fn, expected):
    assert infer(fn, torch.randn(5, 4)) == expected


def test_outputs_independent_of_split_inputs_are_replicate():
    weight = torch.randn(4, 3)

    def fn(x, w, n):
        return {
            "closure": weight * 2,
            "arg": w.sum(),
            "factory": torch.ones(3),
            "random": torch.randn(2),
            "python": n + 1,
            "string": "ok",
            "none": None,
            "arg_itself": w,
            "constant_size": x.shape[1] * 2,
            "mixed": x.sum(0) @ w,
        }

    out = infer(fn, torch.randn(5, 4), torch.randn(4, 3), 7, in_specs=(S0, R, None))
    assert out == {
        "closure": R,
        "arg": R,
        "factory": R,
        "random": R,
        "python": R,
        "string": R,
        "none": None,
        "arg_itself": R,
        "constant_size": R,
        "mixed": SUM,
    }


def test_in_place_writes_carry_dependence():
    def fn(x):
        buf = torch.zeros(4)
        acc = torch.zeros(4)
        acc.add_(x.mean(0))
        view = buf[:2]
        view.copy_(x.sum(0)[:2])
        return buf, acc, torch.zeros(4).add_(1.0)

    assert infer(fn, torch.randn(5, 4)) == (SUM, MEAN, R)

    def first_row(x):
        buf = torch.zeros(4)
        buf[:2].copy_(x[0, :2])  # the first example: which one depends on the microbatch
        return buf

    with pytest.raises(ValueError, match=re.escape("infer_out_specs(first_row) output: the")):
        infer(first_row, torch.randn(5, 4))


def test_in_place_write_into_a_replicated_argument():
    def fn(x, state):
        state["count"].add_(1)
        state["sum"].add_(x.sum(0))
        return state

    state = {"count": torch.zeros(()), "sum": torch.zeros(3)}
    # state + a batch sum: summing microbatches would add the state once per microbatch
    with pytest.raises(
        ValueError, match=re.escape("infer_out_specs(fn) output['sum']: the output (shape (3,))")
    ):
        infer(fn, torch.randn(4, 3), state, in_specs=(S0, R))
    assert torch.equal(state["sum"], torch.zeros(3)) and state["count"].item() == 0

    def mean_into(x, state):
        state["mean"].add_(x.mean(0))  # a constant plus a mean is still a mean
        return state

    assert infer(mean_into, torch.randn(4, 3), {"mean": torch.zeros(3)}, in_specs=(S0, R)) == {
        "mean": MEAN
    }


def test_higher_order_operator():
    # which branch runs depends on the microbatch's size: no merge reproduces it
    def fn(x):
        return torch.cond(x.shape[0] > 2, lambda x: x.sin(), lambda x: x.cos(), (x,))

    with pytest.raises(ValueError, match=re.escape("infer_out_specs(fn) output: dim 0 has")):
        infer(fn, torch.randn(4, 3))


def test_kwargs_and_kw_specs():
    def fn(x, *, mask, scale):
        return x * mask * scale, (x * mask).sum(0)

    x, mask = torch.randn(5, 4), torch.ones(5, 4)
    assert infer(fn, x, mask=mask, scale=2.0) == (S0, SUM)
    out = infer(fn, x, mask=torch.ones(4), scale=2.0, kw_specs={"mask": R, "scale": None})
    assert out == (S0, SUM)
    assert infer(
        fn, x.T, mask=mask.T, scale=2.0, in_specs=S1, kw_specs={"mask": S1, "scale": None}
    ) == (S1, S0)


def _default_specs(tree):
    def spec(x):
        return S0 if isinstance(x, torch.Tensor) and x.dim() >= 1 else R

    return tree_map(spec, tree)


@pytest.mark.parametrize(
    ("name", "tree"), [(n, t) for n, t in TREES if n not in ("block_mask", "dataclass_init_false")]
)
def test_identity_over_the_pytree_corpus(name, tree):
    specs = infer(lambda t: t, tree)
    expected = _default_specs(tree)
    assert type(specs) is type(expected)
    assert tree_flatten(specs, is_leaf=_is_placement) == tree_flatten(
        expected, is_leaf=_is_placement
    )


def _is_placement(x):
    return isinstance(x, ps.Placement)


def test_dataclass_and_model_output_outputs():
    def fn(batch):
        logits = batch.input_ids.float().unsqueeze(-1).expand(-1, -1, 5)
        loss = logits.mean()
        return CausalLMOutputLike(loss=loss, logits=logits), Batch(logits, loss, batch.num_tokens)

    batch = Batch(torch.ones(4, 8, dtype=torch.int64), torch.ones(4, 8, dtype=torch.int64), 32)
    out = infer(fn, batch, in_specs=(Batch(S0, S0, None),))
    assert out == (CausalLMOutputLike(loss=MEAN, logits=S0), Batch(S0, MEAN, R))
    assert type(out[0]) is CausalLMOutputLike and type(out[1]) is Batch


def test_container_that_cannot_hold_specs_becomes_a_dict():
    out = infer(lambda x: (Derived(x), Derived(x.sum(0))), torch.randn(4, 3))
    assert out == ({"x": S0}, {"x": SUM})


def test_namedtuple_and_ordered_dict_outputs():
    Out = collections.namedtuple("Out", ["loss", "logits"])

    def fn(x):
        return collections.OrderedDict(b=Out(x.mean(), x), a=[x.sum(1), 3])

    out = infer(fn, torch.randn(5, 4))
    assert out == collections.OrderedDict(b=Out(MEAN, S0), a=[S0, R])
    assert type(out["b"]) is Out


# ----------------------------------------------------------------------------- models and losses


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def test_functional_call_mlp_with_cross_entropy():
    model = _mlp()
    params = {k: v.detach().clone() for k, v in model.named_parameters()}

    def loss_fn(params, x, y):
        logits = torch.func.functional_call(model, params, (x,))
        return F.cross_entropy(logits, y), {"logits": logits, "probs": logits.softmax(-1)}

    x, y = torch.randn(6, 4), torch.randint(0, 3, (6,))
    # cross_entropy's mean is over the non-ignored targets: a ratio, weighted by target counts
    with pytest.raises(
        ValueError, match=re.escape("infer_out_specs(loss_fn) output[0]: the output (shape ())")
    ) as e:
        infer(loss_fn, params, x, y, in_specs=(R, S0, S0))
    assert "weight_fn" in str(e.value)
    inputs = _resolved((R, S0, S0), (params, x, y))
    ratio = functools.partial(_batch_dim.out_specs_of_inputs, allow_ratio=True)
    assert ratio(loss_fn, inputs) == (MEAN, {"logits": S0, "probs": S0})
    # gradients of such a mean with respect to the parameters are the same kind of mean
    grads = ratio(torch.func.grad(lambda p, x, y: loss_fn(p, x, y)[0]), inputs)
    assert grads == dict.fromkeys(params, MEAN)


def test_module_in_closure_is_never_modified():
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8)).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    old_grad = torch.ones(8)
    model[0].bias.grad = old_grad

    def fn(x):
        out = model(x)
        loss = out.pow(2).mean()
        loss.backward()
        return loss, out

    # batch norm in training mode normalises over the batch: refused (and nothing modified)
    with pytest.raises(ValueError, match=re.escape("infer_out_specs(fn) output[0]: the")):
        infer(fn, torch.randn(6, 4))
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert model[0].bias.grad is old_grad
    assert torch.equal(old_grad, torch.ones(8))
    assert all(p.grad is None for name, p in model.named_parameters() if name != "0.bias")


def test_analysis_inside_another_trace_is_an_error():
    def outer(x):
        return ps.infer_out_specs(lambda y: y, x)

    with pytest.raises(
        ValueError, match=re.escape("failed with ValueError: infer_out_specs(")
    ) as e:
        infer(outer, torch.randn(4, 3))
    assert str(e.value.__cause__) == (
        "infer_out_specs(<lambda>) in_specs[0]: the input is already a fake tensor (an enclosing "
        "trace); batch-dim analysis cannot run inside another trace: pass out_specs explicitly"
    )


def test_language_model_style_loss():
    vocab, hidden = 11, 6
    emb = torch.nn.Embedding(vocab, hidden)
    head = torch.nn.Linear(hidden, vocab)

    def fn(batch):
        logits = head(emb(batch["input_ids"]))
        loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)
        return {"loss": loss, "logits": logits, "last": logits[:, -1].argmax(-1)}

    batch = {
        "input_ids": torch.randint(0, vocab, (4, 7)),
        "labels": torch.randint(0, vocab, (4, 7)),
    }
    with pytest.raises(ValueError, match="weight_fn"):  # a mean over non-ignored targets
        infer(fn, batch)
    out = _batch_dim.out_specs_of_inputs(fn, _resolved((S0,), (batch,)), allow_ratio=True)
    assert out == {"loss": MEAN, "logits": S0, "last": S0}
    out = infer(lambda b: fn(b)["logits"], batch, in_specs=S1)
    assert out == S1


# ----------------------------------------------------------------------------- batch sizes


@pytest.mark.parametrize("batch", [1, 2, 4])
def test_small_and_colliding_batch_sizes(batch):
    # The feature dim is 4 and 1 here: a batch size equal to either must not be confused with it.
    w = torch.randn(4, 4)

    def fn(x, bias, w):
        h = x @ w + bias
        return h, h.sum(1), h.sum(0), h.T, x.shape[1] * h.mean()

    out = infer(fn, torch.randn(batch, 4), torch.randn(1, 4), w, in_specs=(S0, R, R))
    assert out == (S0, S0, SUM, S1, MEAN)


def test_batch_size_is_not_specialised_by_python_branches():
    def fn(x):
        if x.shape[0] == x.shape[1]:
            return x.sum(0)
        return x

    assert infer(fn, torch.randn(4, 4)) == S0


def test_input_dim_equal_to_the_example_value_is_avoided():
    # Were the symbol's example value equal to x.shape[1], the branch would pin B to it.
    start = _batch_dim._HINT_START

    def fn(x):
        if x.shape[0] == x.shape[1]:
            return x.sum(0)
        return x

    assert infer(fn, torch.randn(4, start)) == S0


def test_loop_over_the_batch_is_an_error():
    def rows(x):
        return torch.stack([row.sum() for row in x])

    with pytest.raises(ValueError, match=re.escape("infer_out_specs(rows): the function only")):
        infer(rows, torch.randn(4, 3))


# ----------------------------------------------------------------------------- errors (pinned)


def loss_fn(x):
    return x.mean(), {"logits": x @ x.T}


def test_ambiguous_output_error():
    with pytest.raises(ValueError) as info:
        infer(loss_fn, torch.randn(4, 3))
    assert str(info.value) == (
        "infer_out_specs(loss_fn) output[1]['logits']: the batch size B is the size of dims "
        "0 and 1 (shape (B, B)), so the batch dim is ambiguous; pass out_specs explicitly"
    )


def test_expression_dim_error():
    def flat(x):
        return x.reshape(-1), x

    with pytest.raises(ValueError) as info:
        infer(flat, torch.randn(4, 3))
    assert str(info.value) == (
        "infer_out_specs(flat) output[0]: dim 0 has size 3*B (shape (3*B,)), an expression of "
        "the batch size B rather than B itself (e.g. a reshape merged the batch dim with "
        "another dim), so it cannot be split as Shard(0); keep the batch dim separate or pass "
        "out_specs explicitly"
    )
    with pytest.raises(ValueError, match=re.escape("dim 1 has size B + 1 (shape (3, B + 1))")):
        infer(lambda x: torch.cat([x, x[:1]]).T, torch.randn(4, 3))


def test_python_number_from_batch_size_error():
    def count(x):
        return x.sum(), x.shape[0] * 2

    with pytest.raises(ValueError) as info:
        infer(count, torch.randn(4, 3))
    assert str(info.value) == (
        "infer_out_specs(count) output[1]: a Python int computed from the batch size (2*B); "
        "each microbatch would give a different value and Python numbers cannot be merged: "
        "compute it outside the function or pass out_specs explicitly"
    )


def test_unknown_output_object_error():
    class Box:
        def __init__(self, t):
            self.t = t

    with pytest.raises(ValueError, match=re.escape("output['box']: a ")):
        infer(lambda x: {"box": Box(x)}, torch.randn(4, 3))
    with pytest.raises(ValueError, match=re.escape("register it as a pytree node")):
        infer(lambda x: Box(x), torch.randn(4, 3))


@pytest.mark.parametrize(
    ("body", "exc"),
    [
        (lambda x: x.sum().item(), "DataDependentOutputException"),
        (lambda x: x * 2 if x.sum() > 0 else x, "DataDependentOutputException"),
        (lambda x: x.tolist(), "DataDependentOutputException"),
        (lambda x: x[x > 0], "DynamicOutputShapeException"),
        (lambda x: torch.nonzero(x), "DynamicOutputShapeException"),
    ],
)
def test_tracing_failure_error(body, exc):
    def step(x):
        return body(x)

    with pytest.raises(ValueError) as info:
        infer(step, torch.randn(4, 3))
    message = str(info.value)
    assert message.startswith(
        "infer_out_specs(step): tracing the function on fake tensors (batch size as a symbol B, "
        f"example value {_batch_dim._HINT_START}) failed with {exc}: "
    )
    assert message.endswith(
        "Batch-dim analysis cannot follow data-dependent Python control flow (`if tensor:`), "
        "`.item()`, `.tolist()` or ops whose output shape depends on values (nonzero, boolean "
        "masks); pass out_specs explicitly: out_specs=ps.Partial('mean') for a mean loss and "
        "its gradients (token-weighted with weight_fn), ps.Partial('sum') for sums, "
        "ps.Shard(0) for outputs that keep the batch dim, or a tree of them"
    )
    assert type(info.value.__cause__).__name__ == exc


def test_user_error_inside_fn_is_wrapped_with_its_cause():
    def bad(x):
        raise KeyError("missing")

    with pytest.raises(ValueError, match=re.escape("failed with KeyError: 'missing'")) as info:
        infer(bad, torch.randn(4, 3))
    assert isinstance(info.value.__cause__, KeyError)


def test_specialised_batch_size_error():
    start = _batch_dim._HINT_START
    fixed = torch.ones(start, 3)  # a closure of the example size: x + fixed forces B == start

    def pinned(x):
        return x + fixed

    with pytest.raises(ValueError) as info:
        infer(pinned, torch.randn(4, 3))
    assert str(info.value) == (
        f"infer_out_specs(pinned): the function only works for one batch size: tracing it with "
        f"a symbolic batch size B forced B == {start} (by a Python loop over the batch dim, "
        f"`unbind`, or combining the batch dim with a dim of that fixed size, as Hugging Face "
        f"models do); batch-dim analysis cannot follow it: pass out_specs explicitly: "
        f"out_specs=ps.Partial('mean') for a mean loss and its gradients (token-weighted with "
        f"weight_fn), ps.Partial('sum') for sums, ps.Shard(0) for outputs that keep the batch "
        f"dim, or a tree of them"
    )


def test_batch_size_mismatch_error_names_paths():
    model = _mlp()
    params = dict(model.named_parameters())
    with pytest.raises(ValueError) as info:
        infer(lambda p, x: x, params, torch.randn(6, 4))
    assert str(info.value) == (
        "infer_out_specs(<lambda>) in_specs[0]['2.bias']: Shard(0) splits a dim of size 3 (dim 0 "
        "of a tensor of shape (3,)) but in_specs[0]['0.bias'] splits one of size 8 (dim 0 of a "
        "tensor of shape (8,)); every Shard leaf must have the same size along its split dim: "
        "give leaves that are not batched Replicate() or None"
    )
    with pytest.raises(ValueError) as info:
        infer(lambda x, y: x, torch.randn(6, 4), y=torch.randn(3, 5), kw_specs={"y": S1})
    assert str(info.value) == (
        "infer_out_specs(<lambda>) kw_specs['y']: Shard(1) splits a dim of size 5 (dim 1 of a "
        "tensor of shape (3, 5)) but in_specs[0] splits one of size 6 (dim 0 of a tensor of "
        "shape (6, 4)); every Shard leaf must have the same size along its split dim: give "
        "leaves that are not batched Replicate() or None"
    )


def test_input_spec_errors():
    x = torch.randn(4, 3)
    with pytest.raises(ValueError) as info:
        infer(lambda x: x, x, in_specs=(ps.Shard(2),))
    assert str(info.value) == (
        "infer_out_specs(<lambda>) in_specs[0]: Shard(2) but the tensor has 2 dims "
        "(shape (4, 3)); did you mean Shard(1)?"
    )
    with pytest.raises(ValueError) as info:
        infer(lambda x, n: x, x, 3, in_specs=(S0, S0))
    assert str(info.value) == (
        "infer_out_specs(<lambda>) in_specs[1]: Shard(0) but the value is an int (3), not a "
        "tensor; only tensors can be split: give it Replicate() or None"
    )
    with pytest.raises(TypeError) as info:
        infer(lambda x: x, x, in_specs=(ps.Partial(),))
    assert str(info.value) == (
        "infer_out_specs(<lambda>) in_specs[0]: expected a Shard, a Replicate or None as the "
        "spec, got a Partial (Partial('sum'))"
    )
    with pytest.raises(TypeError, match=re.escape("got a StridedShard")):
        infer(lambda x: x, x, in_specs=ps.StridedShard(0, split_factor=2))
    with pytest.raises(ValueError) as info:
        infer(lambda d: d, {"a": x}, in_specs=([S0],))
    assert str(info.value) == (
        "infer_out_specs(<lambda>) in_specs[0]: the spec is a list of length 1 but the value is "
        "a dict with keys ['a']"
    )
    with pytest.raises(ValueError, match=re.escape("infer_out_specs(<lambda>) kw_specs['y']")):
        infer(lambda x, y: x, x, y=3, kw_specs={"y": S0})


def _resolved(specs, value=None):
    value = (torch.randn(4, 3), 2) if value is None else value
    return resolve_inputs(
        [(value, tuple(specs), "in_specs"), ({}, None, "kw_specs")],
        where="infer_out_specs(<lambda>)",
        allowed=(ps.Shard, ps.Replicate),
    )


def test_private_interface_checks_leaf_specs():
    def check(specs):
        return _batch_dim.out_specs_of_inputs(lambda x, n: x, _resolved(specs))

    assert check([S1, None]) == S1
    with pytest.raises(ValueError) as info:
        check([ps.Shard(-3), None])
    assert str(info.value) == (
        "infer_out_specs(<lambda>) in_specs[0]: Shard(-3) but the tensor has 2 dims "
        "(shape (4, 3)); did you mean Shard(-2)?"
    )
    with pytest.raises(ValueError, match=re.escape("in_specs[1]: Shard(0) but the value is an")):
        check([S0, S0])
    with pytest.raises(TypeError, match=re.escape("in_specs[0]: expected a Shard, a Replicate")):
        check([ps.Partial(), None])
    with pytest.raises(TypeError, match=re.escape("in_specs[0]: expected a Shard, a Replicate")):
        check([0, None])


def test_none_arguments_and_none_specs():
    def fn(x, mask, extra):
        return x if mask is None else x * mask, extra

    x = torch.randn(4, 3)
    assert infer(fn, x, None, (None, 2), in_specs=(S0, None, None)) == (S0, (None, R))
    assert infer(fn, x, None, (None, 2), in_specs=(S0, R, (None, R))) == (S0, (None, R))
    assert infer(fn, x, None, (None, 2)) == (S0, (None, R))


def test_scalar_tensor_defaults_to_replicate():
    assert infer(lambda x, t: (x * t, t * 2), torch.randn(4, 3), torch.tensor(2.0)) == (S0, R)


def test_no_split_inputs_gives_replicate():
    assert infer(lambda n: (torch.ones(2) * n, n), 3) == (R, R)


# ----------------------------------------------------------------------------- cache


@pytest.fixture
def traces(monkeypatch):
    """The traces batch-dim inference runs (each trace's non-tensor inputs), counted outside
    the traced function (state the function reads is part of the cache key)."""
    from pshard._microbatch import batch_dim

    seen = []
    original = batch_dim._trace_out_specs

    def counting(where, fn, treedef, leaves, *rest):
        seen.append([x for x in leaves if not isinstance(x, torch.Tensor)])
        return original(where, fn, treedef, leaves, *rest)

    monkeypatch.setattr(batch_dim, "_trace_out_specs", counting)
    return seen


def test_traced_once_per_signature(traces):
    calls = traces

    def fn(x, w):
        return x @ w, (x @ w).mean()

    w = torch.randn(3, 2)
    for batch in (8, 8, 5, 1):  # a different batch size is the same signature
        assert infer(fn, torch.randn(batch, 3), w, in_specs=(S0, R)) == (S0, MEAN)
    assert len(calls) == 1
    infer(fn, torch.randn(8, 3), torch.randn(3, 4), in_specs=(S0, R))  # new weight shape
    infer(fn, torch.randn(8, 3, dtype=torch.float64), w.double(), in_specs=(S0, R))
    assert len(calls) == 3
    infer(fn, torch.randn(8, 3), torch.randn(3, 4), in_specs=(S0, R))
    assert len(calls) == 3
    # The cached result is a fresh tree each time: mutating it does not touch the cache.
    out = infer(fn, torch.randn(8, 3), w, in_specs=(S0, R))
    assert isinstance(out, tuple)
    assert len(calls) == 3


def test_state_the_function_reads_is_part_of_the_cache_key():
    """Results never depend on what was cached: a module's flag or a closure's dict that
    changes how the output reduces over the batch is seen at the next call."""
    import pshard as ps

    class Loss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.reduction = "sum"

        def forward(self, x):
            return x.sum() if self.reduction == "sum" else x.mean()

    loss, x = Loss(), torch.arange(8.0)
    f = ps.pmap_microbatch(loss, num_microbatches=2)
    assert f(x).item() == 28.0
    loss.reduction = "mean"
    assert f(x).item() == 3.5
    mode = {"m": "sum"}

    def g(x):
        return x.sum() if mode["m"] == "sum" else x.amax()

    h = ps.pmap_microbatch(g, num_microbatches=2)
    assert h(x).item() == 28.0
    mode["m"] = "max"
    assert h(x).item() == 7.0


def test_clear_caches_traces_again_with_the_same_answer(traces):
    calls = traces

    def fn(x, w):
        return x @ w, (x @ w).mean()

    x, w = torch.randn(8, 3), torch.randn(3, 2)
    assert infer(fn, x, w, in_specs=(S0, R)) == (S0, MEAN)
    assert infer(fn, x, w, in_specs=(S0, R)) == (S0, MEAN)
    assert len(calls) == 1
    ps.clear_caches()
    assert infer(fn, x, w, in_specs=(S0, R)) == (S0, MEAN)
    assert len(calls) == 2


def test_cache_distinguishes_python_values_and_specs(traces):
    def fn(x, dim):
        return x.sum(dim)

    x = torch.randn(4, 3)
    assert infer(fn, x, 0) == SUM
    assert infer(fn, x, 1) == S0
    assert infer(fn, x, 1) == S0
    assert infer(fn, x.T, 0, in_specs=(S1, None)) == S0
    assert traces == [[0], [1], [0]]


def test_bound_methods_hit_and_do_not_keep_the_instance_alive(traces):
    class Model:
        def __init__(self):
            self.scale = 2.0

        def forward(self, x):
            return x.mean() * self.scale, x

    model = Model()
    for _ in range(3):
        assert infer(model.forward, torch.randn(4, 3)) == (MEAN, S0)
    assert len(traces) == 1
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None


def test_closures_are_not_kept_alive():
    def make():
        scale = torch.randn(3)
        return lambda x: x * scale

    fn = make()
    assert infer(fn, torch.randn(4, 3)) == S0
    ref = weakref.ref(fn)
    del fn
    gc.collect()
    assert ref() is None


def test_errors_are_not_cached():
    calls = []

    def fn(x):
        calls.append(1)
        return x.sum().item()

    for _ in range(2):
        with pytest.raises(ValueError):
            infer(fn, torch.randn(4, 3))
    assert len(calls) == 2


# ----------------------------------------------------------------------------- private interface


def test_private_interface_with_resolved_inputs():
    args, kwargs = (torch.randn(3, 6), 2), {"y": torch.randn(6)}

    def resolved(specs):
        return resolve_inputs(
            [(args, specs, "in_specs"), (kwargs, {"y": S0}, "kw_specs")],
            where="pmap_microbatch(<lambda>)",
            allowed=(ps.Shard, ps.Replicate),
        )

    out = _batch_dim.out_specs_of_inputs(
        lambda x, n, y: (x * y * n, x.sum(1)), resolved((ps.Shard(-1), None)), api="pmap_microbatch"
    )
    assert out == (S1, SUM)
    with pytest.raises(
        ValueError, match=re.escape("pmap_microbatch(<lambda>) output: dim 0 has size 3*B")
    ):
        _batch_dim.out_specs_of_inputs(
            lambda x, n, y: x.flatten(), resolved((S1, None)), api="pmap_microbatch"
        )


# ----------------------------------------------------------------------------- oracle: real runs


def _merge(chunk_outputs, specs, weights):
    """Merge per-chunk outputs by out specs: cat for Shard(d), weighted mean for
    Partial('mean'), the first chunk's value for Replicate (checked equal)."""
    spec_leaves = optree.tree_flatten(
        specs, is_leaf=lambda s: isinstance(s, ps.Placement), namespace="pshard"
    )[0]
    flat = [optree.tree_leaves(out, namespace="pshard") for out in chunk_outputs]
    merged = []
    for i, spec in enumerate(spec_leaves):
        values = [chunk[i] for chunk in flat]
        if isinstance(spec, ps.Shard):
            merged.append(torch.cat(values, dim=spec.dim))
        elif spec == MEAN:
            total = sum(weights)
            merged.append(sum(w * v for w, v in zip(weights, values, strict=True)) / total)
        elif spec == SUM:
            merged.append(sum(values))
        else:
            for v in values[1:]:
                assert torch.equal(torch.as_tensor(v), torch.as_tensor(values[0]))
            merged.append(values[0])
    treedef = optree.tree_structure(chunk_outputs[0], namespace="pshard")
    return optree.tree_unflatten(treedef, merged)


def _oracle_cases():
    torch.manual_seed(0)
    model = _mlp().double()
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    w = torch.randn(5, 4, dtype=torch.float64)

    def mlp_loss(params, x, y):  # a mean over rows: cross_entropy's sum over the batch size
        logits = torch.func.functional_call(model, params, (x,))
        return F.cross_entropy(logits, y, reduction="sum") / x.shape[0], logits

    def mlp_grad(params, x, y):
        return torch.func.grad_and_value(lambda p: mlp_loss(p, x, y)[0])(params)

    x4 = torch.randn(7, 4, dtype=torch.float64)
    y = torch.randint(0, 3, (7,))
    x3 = torch.randn(3, 7, 5, dtype=torch.float64)
    return [
        ("mlp_loss", mlp_loss, (params, x4, y), (R, S0, S0)),
        ("mlp_grad", mlp_grad, (params, x4, y), (R, S0, S0)),
        ("batch_dim_1", lambda x, w: ((x @ w).transpose(0, 1), (x @ w).mean()), (x3, w), (S1, R)),
        (
            "batch_last",
            lambda x, w: {"h": (x @ w).permute(0, 2, 1), "m": x.mean((0, 1)), "w": w * 2},
            (x3, w),
            (S1, R),
        ),
        (
            "sum_non_batch",
            lambda x: (x.sum(-1), x.pow(2).mean(0), x.transpose(0, 1).flatten(1)),
            (x3,),
            (S1,),
        ),
        (
            "reshape_keep",
            lambda x: x.reshape(3, x.shape[1], 5, 1).squeeze(-1).movedim(1, -1),
            (x3,),
            (S1,),
        ),
    ]


@pytest.mark.parametrize("case", _oracle_cases(), ids=lambda c: c[0])
def test_merged_microbatches_match_the_full_run(case):
    _, fn, args, in_specs = case
    specs = ps.infer_out_specs(fn, *args, in_specs=in_specs)
    full = fn(*args)
    chunked_args = []
    for arg, spec in zip(args, in_specs, strict=True):
        if isinstance(spec, ps.Shard):
            chunked_args.append(torch.tensor_split(arg, 3, dim=spec.dim))
        else:
            chunked_args.append([arg] * 3)
    first_split = next(i for i, s in enumerate(in_specs) if isinstance(s, ps.Shard))
    weights = [c.shape[in_specs[first_split].dim] for c in chunked_args[first_split]]
    outputs = [fn(*chunk) for chunk in zip(*chunked_args, strict=True)]
    merged = _merge(outputs, specs, weights)
    assert optree.tree_structure(merged, namespace="pshard") == optree.tree_structure(
        full, namespace="pshard"
    )
    for got, want in zip(
        optree.tree_leaves(merged, namespace="pshard"),
        optree.tree_leaves(full, namespace="pshard"),
        strict=True,
    ):
        torch.testing.assert_close(got, want)


# ----------------------------------------------------------------------- what language models do


def _padded_mask(mask: torch.Tensor, q: int) -> torch.Tensor:
    """A padding mask read by example index, as Hugging Face's mask functions read it."""
    b = torch.arange(mask.shape[0])[:, None, None]
    kv = torch.arange(mask.shape[1])[None, None, :]
    return mask[b, kv].expand(-1, q, -1)


@pytest.mark.parametrize(
    ("fn", "expected"),
    [
        # the shift of the labels (torch's fake pad kernel fixed the batch size)
        (lambda x, m: F.pad(x, (0, 1), value=-1.0), S0),
        # a padding mask read with arange over the batch
        (lambda x, m: _padded_mask(m, 3), S0),
        (lambda x, m: x[torch.arange(x.shape[0]), 0], S0),
        # rotary halves joined along the features
        (lambda x, m: torch.cat([-x[..., 2:], x[..., :2]], dim=-1), S0),
        # an attention kernel and its gradient
        (lambda x, m: F.scaled_dot_product_attention(x[:, None], x[:, None], x[:, None]), S0),
        (
            lambda x, m: torch.func.grad(
                lambda y: F.scaled_dot_product_attention(y[:, None], y[:, None], y[:, None]).sum()
            )(x),
            S0,
        ),
    ],
)
def test_language_model_ops(fn, expected):
    x, mask = torch.randn(5, 3, 4), torch.ones(5, 3, dtype=torch.bool)
    assert infer(fn, x, mask) == expected


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: x * torch.arange(x.shape[0])[:, None, None],  # positions as values
        lambda x: F.pad(x, (0, 0, 0, 0, 1, 0)),  # padding the batch dim
        lambda x: torch.cat([x, x], dim=0),  # joining along the batch dim
        lambda x: x[torch.arange(x.shape[0]).flip(0)],  # rows in another order
    ],
)
def test_batch_positions_as_values_are_refused(fn):
    with pytest.raises(ValueError, match="pass out_specs explicitly"):
        infer(fn, torch.randn(5, 3, 4))
