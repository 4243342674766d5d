"""Pipelines on 4 ranks: the activations each schedule keeps alive, zero bubble's order, and
bad input as an error on every rank within seconds (never a hang), after which the ranks
run the next pipeline as if nothing happened."""

from __future__ import annotations

import re
import time
import weakref

import pytest
import torch

import pshard as ps
from pshard._pipeline.executor import record

f64 = torch.float64
D = 6
FN = "pipeline_value_and_grad"


def layer(p, x):
    return torch.tanh(x @ p["w"] + p["b"])


def sq_loss(y, t):
    return ((y - t) ** 2).sum()


def _setup(b=8):
    torch.set_default_dtype(f64)
    ps.init_mesh({"pp": 4})
    g = torch.Generator().manual_seed(0)
    params = [
        {"w": torch.randn(D, D, generator=g) / D**0.5, "b": torch.randn(D, generator=g)}
        for _ in range(4)
    ]
    x, t = torch.randn(b, D, generator=g), torch.randn(b, D, generator=g)
    return ps.axis_index("pp"), params, x, t


class _Token:
    pass


def rank_alive(schedule):
    """The most microbatches whose saved activations a rank holds at once: each stage call
    makes a token that its autograd nodes keep (one node per level of differentiation under
    zero bubble), which lives as long as the microbatch's pullback."""
    r, params, x, t = _setup(16)
    live = weakref.WeakSet()
    peak = [0]
    current = []

    class Mark(torch.autograd.Function):
        @staticmethod
        def forward(h):
            return h.clone()

        @staticmethod
        def setup_context(ctx, inputs, output):
            ctx.token = current[-1]

        @staticmethod
        def backward(ctx, g):
            return g

    def stage(p, h):
        token = _Token()
        live.add(token)
        current.append(token)
        out = Mark.apply(layer(p, h))
        current.clear()
        del token
        peak[0] = max(peak[0], len(live))
        return out

    step = ps.pipeline_value_and_grad(stage, sq_loss, num_microbatches=8, schedule=schedule)
    step(params[r], x, t)
    return peak[0], len(live)


@pytest.mark.parametrize(
    "schedule,expected",
    [("1f1b", [4, 3, 2, 1]), ("gpipe", [8] * 4), ("zero_bubble", [4, 4, 4, 4])],
)
def test_microbatches_alive_per_rank(pool, schedule, expected):
    got = pool.run(4, rank_alive, schedule)
    assert all(left == 0 for _, left in got)  # nothing outlives the step
    assert [p for p, _ in got] == expected  # at most N = 4 but for GPipe: M = 8
    data = ps.pipeline_schedule(schedule, num_ranks=4, num_microbatches=8)
    assert [data.peak_alive(r) for r in range(4)] == expected  # as the schedule says


def rank_zero_bubble_order():
    r, params, x, t = _setup()
    with record() as events:
        ps.pipeline_value_and_grad(
            lambda p, h: layer(p, h), sq_loss, num_microbatches=4, schedule="zero_bubble"
        )(params[r], x, t)
    order = [(e.what, e.message.producer if e.message else e.action) for e in events]
    checks = 0
    for i, (what, a) in enumerate(order):
        if what == "compute" and a.kind == "W" and a.stage > 0:
            sent = order.index(("send", type(a)("I", a.stage, a.microbatch)))
            assert sent < i  # the input cotangent left before the weight cotangent was made
            checks += 1
    computed = [a for what, a in order if what == "compute"]
    # some weight cotangent waits for a later microbatch's input cotangent: the split is real
    deferred = any(
        a.kind == "W" and any(b.kind == "I" and b.microbatch > a.microbatch for b in computed[:j])
        for j, a in enumerate(computed)
    )
    return checks, deferred


def test_zero_bubble_sends_the_input_cotangent_before_the_weight_gradient(pool):
    got = pool.run(4, rank_zero_bubble_order)
    assert [c for c, _ in got] == [0, 4, 4, 4]
    assert any(d for _, d in got)


def _outcome(fn):
    start = time.monotonic()
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test looks at it
        return type(e).__name__, str(e), time.monotonic() - start
    return None, "", time.monotonic() - start


def _still_exact(r, params, x, t):
    """The ranks run the next pipeline correctly (every message of the failed one was
    received: nothing stray is left on the channels)."""
    step = ps.pipeline_value_and_grad(layer, sq_loss, num_microbatches=3)
    loss, grads = step(params[r], x, t)
    leaves = [{k: v.clone().requires_grad_() for k, v in p.items()} for p in params]
    h = x
    for p in leaves:
        h = layer(p, h)
    ref = sq_loss(h, t)
    ref.backward()
    diff = max((grads[k] - leaves[r][k].grad).abs().max().item() for k in ("w", "b"))
    return abs(loss.item() - ref.item()) < 1e-12 and diff < 1e-12


def rank_bad_counts():
    r, params, x, t = _setup()
    out = []
    for stages, schedule, p in [
        ([layer] * 3, "1f1b", params[r]),
        ([layer] * 8, "1f1b", params[r]),
        ([layer] * 6, "interleaved_1f1b", (params[r],)),
        (layer, "interleaved_1f1b", params[r]),
        ([layer] * 8, "interleaved_1f1b", params[r]),
        ([layer] * 8, "interleaved_1f1b", [params[r], params[r]]),  # a list, not a tuple
    ]:
        step = ps.pipeline_value_and_grad(stages, sq_loss, num_microbatches=2, schedule=schedule)
        out.append(_outcome(lambda s=step, p=p: s(p, x, t)))
    out.append(_outcome(lambda: ps.pipeline([layer] * 2, num_microbatches=2)(params[r], x)))
    return out, _still_exact(r, params, x, t)


def test_bad_stage_counts_are_errors_on_every_rank(pool):
    got = pool.run(4, rank_bad_counts)
    for outcomes, exact in got:
        assert exact
        assert [o[:2] for o in outcomes] == [o[:2] for o in got[0][0]]  # the same everywhere
        kinds = [kind for kind, _, _ in outcomes]
        assert kinds == ["ValueError"] * 7
        assert all(seconds < 30 for _, _, seconds in outcomes)
    texts = [text for _, text, _ in got[0][0]]
    assert texts[0] == (
        f"{FN}: stages has 3 functions but axis 'pp' has 4 ranks; give one function per rank "
        f"(or one shared function)"
    )
    assert "or use schedule='interleaved_1f1b' for 2 stages per rank" in texts[1]
    assert texts[2].startswith(f"{FN}: stages has 6 functions but axis 'pp' has 4 ranks")
    assert "not one shared function" in texts[3]
    assert texts[4].startswith(f"{FN}: with 2 stages per rank (schedule='interleaved_1f1b') "
                               "params must be a tuple of 2 trees")  # fmt: skip
    assert texts[5] == (
        f"{FN}: with 2 stages per rank (schedule='interleaved_1f1b') params must be a tuple of 2 "
        f"trees, this rank's stages' parameters in order; got a list of 2, which is one tree (a "
        f"stage's list of layers, say): pass tuple(params) if each item is a stage's tree"
    )
    assert texts[6].startswith("pipeline: stages has 2 functions but axis 'pp' has 4 ranks")


def rank_changing_stage(case):
    r, params, x, t = _setup(7)  # microbatches of 3, 3, 1
    calls = []

    def stage(p, h):
        y = layer(p, h)
        calls.append(1)
        if r == 1 and case == "shape" and h.shape[0] == 1:
            return y[:, :3]  # a new size class: the header path
        if r == 1 and case == "dtype" and len(calls) == 2:
            return y.float()  # the same size as microbatch 0: no header
        if r == 2 and case == "raise" and len(calls) == 2:
            raise KeyError("boom")
        return y

    step = ps.pipeline_value_and_grad(stage, sq_loss, num_microbatches=3)
    outcome = _outcome(lambda: step(params[r], x, t))
    return outcome, _still_exact(r, params, x, t)


def test_a_stage_whose_output_changes_shape_is_an_error_on_every_rank(pool):
    got = pool.run(4, rank_changing_stage, "shape")
    want = (
        f"{FN}: stage 1 (rank 1 of axis 'pp') returned (1, 3) float64 for microbatch 2 but "
        f"(3, 6) float64 for microbatch 0: a stage's output must keep its dtype and its shape "
        f"beyond the split dim 0 for every microbatch"
    )
    for (kind, text, seconds), exact in got:
        assert kind == "ValueError" and text.startswith(want) and seconds < 30
        assert exact
    got = pool.run(4, rank_changing_stage, "dtype")
    for (kind, text, _), exact in got:
        assert kind == "ValueError" and exact
        assert text.startswith(f"{FN}: stage 1 (rank 1 of axis 'pp') returned (3, 6) float32 "
                               f"for microbatch 1 but (3, 6) float64 for microbatch 0")  # fmt: skip


def test_a_stage_that_raises_is_an_error_on_every_rank(pool):
    got = pool.run(4, rank_changing_stage, "raise")
    for r, ((kind, text, seconds), exact) in enumerate(got):
        assert exact and seconds < 30
        if r == 2:
            assert (kind, text) == ("KeyError", "'boom'")  # the original, on its rank
        else:
            assert kind == "RuntimeError"
            assert text == (
                f"{FN}: stage 2 (rank 2 of axis 'pp') raised KeyError: 'boom' (in F(stage 2, "
                f"microbatch 1)); every rank of the axis stopped computing then and raises "
                f"this error (rank 2 raises the original)"
            )


def rank_backward_raises():
    r, params, x, t = _setup(6)

    class Fails(torch.autograd.Function):
        @staticmethod
        def forward(h):
            return h.clone()

        @staticmethod
        def setup_context(ctx, inputs, output):
            pass

        @staticmethod
        def backward(ctx, g):
            raise ArithmeticError("no backward here")

    def stage(p, h):
        y = layer(p, h)
        return Fails.apply(y) if r == 3 else y

    outcomes = []
    for schedule in ("1f1b", "zero_bubble"):
        step = ps.pipeline_value_and_grad(stage, sq_loss, num_microbatches=3, schedule=schedule)
        outcomes.append(_outcome(lambda s=step: s(params[r], x, t))[:2])
    return outcomes, _still_exact(r, params, x, t)


def test_a_backward_that_raises_is_an_error_on_every_rank(pool):
    for r, (outcomes, exact) in enumerate(pool.run(4, rank_backward_raises)):
        assert exact
        for kind, text in outcomes:
            if r == 3:
                assert (kind, text) == ("ArithmeticError", "no backward here")
            else:
                assert (
                    kind == "RuntimeError"
                    and "stage 3 (rank 3 of axis 'pp') raised "
                    "ArithmeticError: no backward here (in "
                    in text
                )


def rank_disagree():
    r, params, x, t = _setup()
    step = ps.pipeline_value_and_grad(layer, sq_loss, num_microbatches=2 if r == 3 else 4)
    with ps.debug(True):
        outcome = _outcome(lambda: step(params[r], x, t))
    return outcome, _still_exact(r, params, x, t)


def test_ranks_that_disagree_are_an_error_in_debug_mode(pool):
    for (kind, text, seconds), exact in pool.run(4, rank_disagree):
        assert kind == "ValueError" and seconds < 30 and exact
        assert text.startswith(f"{FN} (pshard debug mode): the ranks of axis 'pp' would run "
                               "different pipelines")  # fmt: skip
        assert "rank 0: num_microbatches=4" in text and "rank 3: num_microbatches=2" in text


def rank_bad_loss():
    r, params, x, t = _setup()
    step = ps.pipeline_value_and_grad(layer, lambda y, t_: (y - t_) ** 2, num_microbatches=2)
    return _outcome(lambda: step(params[r], x, t))[:2]


def test_a_loss_that_is_not_a_scalar(pool):
    for kind, text in pool.run(4, rank_bad_loss):
        assert kind == "ValueError"
        assert text.startswith(f"{FN}: loss_fn returned a tensor of shape (4, 6) for microbatch 0")


def test_errors_on_one_process():
    ps.init_mesh({"pp": 1})
    x = torch.ones(6, 2)
    step = ps.pipeline_value_and_grad(lambda w, h: h @ w, lambda y, t: y.sum(), num_microbatches=4)
    with pytest.raises(ValueError, match=re.escape(
        f"{FN} in_specs[0]: num_microbatches=4 but torch.chunk's rule cuts the 6 entries of "
        f"the split dim into 3 microbatches of 2 (ceil(6 / 4) each), not 4; use "
        f"num_microbatches=3"
    )):  # fmt: skip
        step(torch.eye(2), x, x)
    with pytest.raises(ValueError, match=re.escape("num_microbatches=4 but the batch")):
        step(torch.eye(2), x[:3], x[:3])
    with pytest.raises(ValueError, match=re.escape("schedule='zb' is not a schedule")):
        ps.pipeline_value_and_grad(lambda w, h: h, lambda y, t: y.sum(), num_microbatches=1,
                                   schedule="zb")  # fmt: skip
    with pytest.raises(TypeError, match=re.escape(f"{FN}: stages must be a function")):
        ps.pipeline_value_and_grad([], lambda y, t: y.sum(), num_microbatches=1)
    two = ps.pipeline_value_and_grad(  # two stages on one rank
        [lambda w, h: {"h": h}, lambda w, h: h], lambda y, t: y.sum(), num_microbatches=1,
        schedule="interleaved_1f1b",
    )  # fmt: skip
    with pytest.raises(ValueError, match=re.escape(
        f"{FN}: stage 0 (rank 0 of axis 'pp') returned a dict"
    )):  # fmt: skip
        two((torch.eye(2), torch.eye(2)), x, x)
