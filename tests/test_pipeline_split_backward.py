"""Zero bubble's backward cut in two (input cotangent, then weight cotangent), and the
autograd backward that adds into the parameters' leaves, against the whole backward of
torch.func.vjp, on one process, float64: every op run once, weights tied
across layers, outputs that do not depend on the input, integer outputs, ps.checkpoint and an
embedding inside the stage."""

from __future__ import annotations

import pytest
import torch
from torch.autograd.graph import GradientEdge
from torch.utils._python_dispatch import TorchDispatchMode

import pshard as ps
from pshard._pipeline.stage_call import StageParams, run_stage

f64 = torch.float64


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "w1": torch.randn(4, 4, generator=g, dtype=f64),
        "b1": torch.randn(4, generator=g, dtype=f64),
        "w2": torch.randn(4, 4, generator=g, dtype=f64),
        "emb": torch.randn(7, 4, generator=g, dtype=f64),
        "steps": torch.tensor(3),  # not differentiated
    }


def mlp(p, x):
    return torch.tanh(torch.tanh(x @ p["w1"] + p["b1"]) @ p["w2"])


def tied(p, x):  # w1 at two places along the input's path, and once off it
    h = torch.tanh(x @ p["w1"])
    return torch.tanh(h @ p["w2"] @ p["w1"]) * p["w1"].sum()


def two_outputs(p, x):  # one output does not depend on x, one is an integer tensor
    return mlp(p, x), p["w2"].sin().sum(0), torch.arange(3) * p["steps"]


def embedded(p, x):
    return mlp(p, x + p["emb"][torch.tensor([1, 2, 2, 5, 0])].sum(-1, keepdim=True))


def checkpointed(p, x):
    return ps.checkpoint(mlp)(p, x)


def _check(fn):
    params = StageParams(_params())
    x = torch.randn(5, 4, dtype=f64)
    full_out, full = run_stage(fn, params, x, wrt_x=True, mode="vjp")
    out, split = run_stage(fn, params, x, wrt_x=True, mode="split")
    cts = tuple(torch.randn_like(t) for t in full_out.floats)
    gp, gx = full.both(cts)
    sx = split.inputs(cts)
    sp = split.weights(cts)
    for a, b in zip(full_out.floats, out.floats, strict=True):
        torch.testing.assert_close(a, b)
    for a, b in zip(gx + gp, sx + sp, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    return out


@pytest.mark.parametrize("fn", [mlp, tied, two_outputs, embedded, checkpointed])
def test_split_backward_equals_the_whole(fn):
    out = _check(fn)
    if fn is two_outputs:
        assert out.value[2].tolist() == [0, 3, 6]


def test_autograd_backward_adds_into_the_leaves_and_keeps_no_output():
    params = StageParams(_params())
    x = torch.randn(5, 4, dtype=f64)
    total = None
    for scale in (1.0, 2.0):  # two microbatches: their gradients add up in the leaves
        ref_out, ref = run_stage(mlp, StageParams(_params()), x * scale, wrt_x=True, mode="vjp")
        out, pull = run_stage(mlp, params, x * scale, wrt_x=True, mode="full")
        assert isinstance(pull._graph[0][0], GradientEdge)  # not the output: it may go
        ct = (torch.ones(5, 4, dtype=f64),)
        gp, gx = pull.both(ct)
        ref_gp, ref_gx = ref.both(ct)
        assert gp is None  # added into the leaves
        torch.testing.assert_close(gx, ref_gx)
        pairs = zip(total or ref_gp, ref_gp, strict=True)
        total = ref_gp if total is None else tuple(a + b for a, b in pairs)
        assert pull._graph is None  # dropped with its backward
    for got, want in zip(params.accumulated(), total, strict=True):
        torch.testing.assert_close(torch.zeros_like(want) if got is None else got, want)
    assert sum(g is None for g in params.accumulated()) == 1  # "emb": no gradient reached it


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.mm = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.mm += func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm)
        return func(*args, **(kwargs or {}))


def test_each_matmul_of_the_backward_runs_once():
    params = StageParams(_params())
    x = torch.randn(5, 4, dtype=f64)
    _, split = run_stage(mlp, params, x, wrt_x=True, mode="split")
    ct = (torch.ones(5, 4, dtype=f64),)
    with _Count() as inputs:
        split.inputs(ct)
    with _Count() as weights:
        split.weights(ct)
    # two layers: dx and dh in the input pass, dW1 and dW2 in the weight pass
    assert (inputs.mm, weights.mm) == (2, 2)
