"""ps.checkpoint against the function it checkpoints (float64, one process).

Every derivative is compared with the same derivative of the function without a checkpoint,
under every torch.func transform and their compositions, .backward() and double backward,
for each kind of policy. What is recomputed is counted with a TorchDispatchMode below autograd
(never assumed); what is kept alive is measured the same way (bytes of live storages).
Multi-process cases (collectives, shard_map, sequence parallelism, microbatching) are in
test_remat_dist.py, Hugging Face in test_remat_hf.py.
"""

from __future__ import annotations

import collections
import contextvars
import functools
import itertools
import re
from collections.abc import Callable
from typing import Any

import optree
import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call, grad, hessian, jacfwd, jacrev, jvp, vjp, vmap
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from pshard._compat import reparametrized
from pshard._remat.checkpoint import CheckpointModule, checkpoint, remat
from pshard._remat.names import checkpoint_name
from pshard._remat.policies import checkpoint_policies as cp

# torch scripts its jvp decompositions the first time jacfwd/jvp needs them (a torch warning)
pytestmark = pytest.mark.filterwarnings(
    "ignore:`torch.jit.script` is deprecated:DeprecationWarning"
)

f64 = torch.float64


# --- helpers --------------------------------------------------------------------------------------


def close(a: Any, b: Any, tol: float = 1e-10) -> None:
    la, ta = optree.tree_flatten(a)
    lb, tb = optree.tree_flatten(b)
    assert ta == tb, (ta, tb)
    assert len(la) == len(lb) > 0
    for x, y in zip(la, lb, strict=True):
        assert x.shape == y.shape and x.dtype == y.dtype, (x.shape, y.shape, x.dtype, y.dtype)
        assert torch.allclose(x, y, rtol=tol, atol=tol), (x - y).abs().max()


class Count(TorchDispatchMode):
    """How many times each aten operator runs (below autograd and torch.func)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func._opname] += 1
        return func(*args, **(kwargs or {}))


def count(fn: Callable[[], Any]) -> collections.Counter[str]:
    with Count() as c:
        fn()
    return c.ops


class LiveBytes(TorchDispatchMode):
    """The peak of the bytes held by the live storages that operators took or created."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in optree.tree_leaves((args, kwargs, out), none_is_leaf=True):
            if isinstance(t, torch.Tensor) and t.numel():
                st = t.untyped_storage()
                self.live.setdefault(st.data_ptr(), (StorageWeakRef(st), st.nbytes()))
        self.live = {k: v for k, v in self.live.items() if not v[0].expired()}
        self.peak = max(self.peak, sum(n for _, n in self.live.values()))
        return out


def peak_bytes(fn: Callable[[], Any]) -> int:
    with LiveBytes() as m:
        fn()
    return m.peak


def randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=f64)


# --- every transform, every kind of policy ------------------------------------------------------


def body(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    h = checkpoint_name(x @ w, "h")
    g = checkpoint_name(torch.tanh(h), "g")
    return torch.sin(g) @ w.t() + x * h.sum()


def custom_policy(op, *args, **kwargs) -> bool:
    return op is checkpoint_name or op is torch.ops.aten.tanh.default


POLICIES = {
    "nothing": None,
    "dots": cp.dots_saveable,
    "names": cp.save_only_these_names("g"),
    "all_but_h": cp.save_anything_except_these_names("h"),
    "offload_dots": cp.offload(cp.dots_saveable),
    "callable": custom_policy,
}

W, X = randn(3, 3), randn(2, 3)


def _loss(f: Callable) -> Callable:
    return lambda w, x: (f(w, x) ** 2).sum()


def _backward(f: Callable) -> Any:
    w, x = W.clone().requires_grad_(), X.clone().requires_grad_()
    _loss(f)(w, x).backward()
    return w.grad, x.grad


def _double_backward(f: Callable) -> Any:
    w, x = W.clone().requires_grad_(), X.clone().requires_grad_()
    gw, gx = torch.autograd.grad(_loss(f)(w, x), (w, x), create_graph=True)
    ((gw**2).sum() + (gw * gx.sum()).sum()).backward()
    return w.grad, x.grad


TRANSFORMS: dict[str, Callable[[Callable], Any]] = {
    "grad": lambda f: grad(_loss(f), (0, 1))(W, X),
    "vjp": lambda f: vjp(f, W, X)[1](torch.ones(2, 3, dtype=f64)),
    "jacrev": lambda f: jacrev(f, (0, 1))(W, X),
    "jacfwd": lambda f: jacfwd(f, (0, 1))(W, X),
    "hessian": lambda f: hessian(_loss(f))(W, X),
    "jvp": lambda f: jvp(f, (W, X), (torch.ones_like(W), X))[1],
    "vmap": lambda f: vmap(f, (None, 0))(W, X * torch.arange(1.0, 5.0, dtype=f64)[:, None, None]),
    "vmap_grad": lambda f: vmap(grad(_loss(f)), (None, 0))(W, torch.stack([X, X * 2])),
    "grad_vmap": lambda f: grad(lambda w: vmap(_loss(f), (None, 0))(w, torch.stack([X, -X])).sum())(
        W
    ),
    "grad_grad": lambda f: grad(lambda w: grad(_loss(f))(w, X).sin().sum())(W),
    "jvp_grad": lambda f: jvp(grad(_loss(f)), (W, X), (X.t() @ X, X))[1],
    "backward": _backward,
    "double_backward": _double_backward,
}


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("transform", list(TRANSFORMS))
def test_transforms_match_the_function(transform: str, policy: str) -> None:
    torch.manual_seed(0)
    got = TRANSFORMS[transform](checkpoint(body, policy=POLICIES[policy]))
    want = TRANSFORMS[transform](body)
    close(got, want)


def test_nested_checkpoints() -> None:
    inner = checkpoint(lambda w, x: torch.tanh(x @ w) * 2, policy=cp.dots_saveable)

    def f(w, x):
        return torch.sin(inner(w, inner(w, x).sin()))

    g = checkpoint(f)

    def plain(w, x):
        return torch.sin(torch.tanh(torch.sin(torch.tanh(x @ w) * 2) @ w) * 2)

    for name in ("grad", "hessian", "jvp_grad", "vmap_grad", "grad_grad", "double_backward"):
        close(TRANSFORMS[name](g), TRANSFORMS[name](plain))


# Nesting with different policies: each level's recompute runs the level below again and must
# replay what that level kept rather than take it for another path. The layer has no residual
# (its output is not only summed) and names its product; the policies are the four ways a level
# can treat it (``save_only_these_names("h")`` and ``offload(dots_saveable)`` keep what
# ``dots_saveable`` keeps here).
NESTED_POLICIES = {
    "nothing": None,
    "dots": cp.dots_saveable,
    "all_but_h": cp.save_anything_except_these_names("h"),
    "everything": cp.everything_saveable,
}


def _nested_layer(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(checkpoint_name(x @ w, "h"))


def _two_levels(outer: Any, inner: Any) -> Callable:
    """A checkpoint of each layer inside a checkpoint of the whole."""
    layer = checkpoint(_nested_layer, policy=inner)
    return checkpoint(lambda w, x: layer(w, layer(w, x)), policy=outer)


def _three_levels(middle: Any, inner: Any) -> Callable:
    """A checkpoint (default policy) around ``checkpoint(block, policy=middle)``, where ``block``
    runs the layer checkpointed with ``inner``, checkpointed with the default, and as it is."""

    def block(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        x = checkpoint(_nested_layer, policy=inner)(w, x)
        x = checkpoint(_nested_layer)(w, x)
        return _nested_layer(w, x)

    return checkpoint(checkpoint(block, policy=middle))


@pytest.mark.parametrize("levels", [2, 3])
@pytest.mark.parametrize("transform", list(TRANSFORMS))
def test_nested_checkpoints_with_every_pair_of_policies(transform: str, levels: int) -> None:
    def plain(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        for _ in range(levels):
            x = _nested_layer(w, x)
        return x

    build = _two_levels if levels == 2 else _three_levels
    want = TRANSFORMS[transform](plain)
    for outer, inner in itertools.product(NESTED_POLICIES.values(), repeat=2):
        close(TRANSFORMS[transform](build(outer, inner)), want)


# --- what is recomputed -------------------------------------------------------------------------


def _counts(policy: Any) -> collections.Counter[str]:
    f = body if policy == "plain" else checkpoint(body, policy=policy)
    return count(lambda: grad(_loss(f), (0, 1))(W, X))


def test_nothing_saveable_recomputes_the_forward_once() -> None:
    plain, ckpt = _counts("plain"), _counts(None)
    forward = count(lambda: body(W, X))
    assert ckpt["tanh"] == plain["tanh"] + forward["tanh"] == 2
    assert ckpt["sin"] == plain["sin"] + forward["sin"]
    # the last product, only summed into the output (which torch.func.grad still holds), is
    # not needed by the backward: it is not computed again
    assert ckpt["mm"] == plain["mm"] + forward["mm"] - 1


def test_dots_saveable_replays_matrix_products() -> None:
    plain, ckpt = _counts("plain"), _counts(cp.dots_saveable)
    assert ckpt["mm"] == plain["mm"]  # not one matmul more than without the checkpoint
    assert ckpt["tanh"] == plain["tanh"] + 1 and ckpt["sin"] == plain["sin"] + 1


def test_names_choose_what_is_recomputed() -> None:
    plain = _counts("plain")
    only_g = _counts(cp.save_only_these_names("g"))
    assert only_g["tanh"] == plain["tanh"] and only_g["mm"] == plain["mm"] + 1
    all_but_h = _counts(cp.save_anything_except_these_names("h"))
    assert all_but_h["tanh"] == plain["tanh"] and all_but_h["sin"] == plain["sin"]
    assert all_but_h["mm"] == plain["mm"] + 1  # x @ w, named "h", and only it


def test_everything_saveable_recomputes_nothing() -> None:
    assert _counts(cp.everything_saveable) == _counts("plain")


def test_callable_policy_is_asked_about_each_operator_and_name() -> None:
    asked: list[str] = []

    def policy(op, *args, **kwargs) -> bool:
        asked.append(f"name {kwargs['name']}" if op is checkpoint_name else op._opname)
        return op is torch.ops.aten.sin.default

    plain, got = _counts("plain"), _counts(policy)
    assert {"mm", "tanh", "sin", "name h", "name g"} <= set(asked)
    assert got["sin"] == plain["sin"] and got["tanh"] == plain["tanh"] + 1


def test_one_name_labels_several_values() -> None:
    def f(w, x):
        for _ in range(3):
            x = torch.tanh(checkpoint_name(x @ w, "pre"))
        return x

    plain = count(lambda: grad(_loss(f))(W, X))
    got = count(lambda: grad(_loss(checkpoint(f, policy=cp.save_only_these_names("pre"))))(W, X))
    # every "pre" is kept; the tanh of the first two layers are recomputed, the last one is the
    # checkpoint's output, still alive in the backward of torch.func.grad, so it is taken as is
    assert got["mm"] == plain["mm"] and got["tanh"] == plain["tanh"] + 2


def test_a_value_overwritten_after_it_was_named_is_recomputed() -> None:
    def f(w, x):
        h = checkpoint_name(x @ w, "h")
        h.mul_(2)  # the kept value would be stale: the recompute computes it again
        return torch.sin(h)

    g = checkpoint(f, policy=cp.save_only_these_names("h"))
    close(grad(_loss(g), (0, 1))(W, X), grad(_loss(f), (0, 1))(W, X))
    ops = count(lambda: grad(_loss(g))(W, X))
    assert ops["mm"] == count(lambda: grad(_loss(f))(W, X))["mm"] + 1


# --- memory ---------------------------------------------------------------------------------------


def _mlp_layer(w1: torch.Tensor, w2: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return x + torch.tanh(torch.tanh(x @ w1) * 1.5) @ w2


def _mlp_loss(layer: Callable) -> Callable:
    def loss(ws: list, x: torch.Tensor) -> torch.Tensor:
        for w1, w2 in ws:
            x = layer(w1, w2, x)
        return x.square().sum()

    return loss


def _mlp(depth: int = 12) -> tuple[list, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ws = [(torch.randn(32, 128, generator=g) / 6, torch.randn(128, 32, generator=g) / 12)]
    return ws * depth, torch.randn(256, 32, generator=g)


def _step(layer: Callable, mode: str, ws: list, x: torch.Tensor) -> Callable[[], Any]:
    if mode == "grad":
        return lambda: grad(_mlp_loss(layer))(ws, x)
    leaves = [[w.clone().requires_grad_() for w in pair] for pair in ws]
    return lambda: _mlp_loss(layer)(leaves, x).backward()


def test_peak_memory_matches_torch_utils_checkpoint() -> None:
    ws, x = _mlp()
    act = x.numel() * x.element_size()  # one layer's input; its hidden activations are 4x
    plain = {m: peak_bytes(_step(_mlp_layer, m, ws, x)) for m in ("grad", "backward")}
    ckpt = {m: peak_bytes(_step(checkpoint(_mlp_layer), m, ws, x)) for m in ("grad", "backward")}

    def torch_layer(*args: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(_mlp_layer, *args, use_reentrant=False)

    reference = peak_bytes(_step(torch_layer, "backward", ws, x))
    assert ckpt["grad"] < 0.2 * plain["grad"] and ckpt["backward"] < 0.4 * plain["backward"]
    assert ckpt["grad"] <= reference, (ckpt, reference)  # the functional step, as low as torch's
    # under .backward() the consumer of a layer's output frees it before the layer's backward,
    # so the recompute computes it again (torch's stops before the last operation)
    assert ckpt["backward"] <= reference + act, (ckpt, reference)


def test_what_only_feeds_a_live_output_is_not_recomputed() -> None:
    ws, x = _mlp(4)
    leaves = [[w.clone().requires_grad_() for w in pair] for pair in ws]
    plain = count(lambda: grad(_mlp_loss(_mlp_layer))(ws, x))["mm"]
    # under torch.func.grad each layer's output is still alive when its backward runs: of
    # x + tanh(tanh(x @ w1) * 1.5) @ w2, only x @ w1 is computed again (the backward of the
    # last product needs its inputs, not its output, and the sum needs neither)
    assert count(lambda: grad(_mlp_loss(checkpoint(_mlp_layer)))(ws, x))["mm"] == plain + 4
    close(grad(_mlp_loss(checkpoint(_mlp_layer)))(ws, x), grad(_mlp_loss(_mlp_layer))(ws, x))
    # under .backward() the next layer has freed it: both products are computed again
    backward = count(lambda: _mlp_loss(checkpoint(_mlp_layer))(leaves, x).backward())["mm"]
    assert backward == count(lambda: _mlp_loss(_mlp_layer)(leaves, x).backward())["mm"] + 8


def test_dots_saveable_keeps_only_the_products() -> None:
    ws, x = _mlp()
    act = x.numel() * x.element_size()
    nothing = peak_bytes(_step(checkpoint(_mlp_layer), "grad", ws, x))
    dots = peak_bytes(_step(checkpoint(_mlp_layer, policy=cp.dots_saveable), "grad", ws, x))
    plain = peak_bytes(_step(_mlp_layer, "grad", ws, x))
    assert nothing < dots < plain
    assert 4 * len(ws) * act <= dots - nothing <= 5 * len(ws) * act  # x @ w1 (4x), h @ w2 (1x)


def test_offload_keeps_what_the_policy_keeps_in_cpu_memory() -> None:
    from pshard._remat import replay as replay_module

    seen: list[list[torch.Tensor]] = []
    original = replay_module.Replayer.__init__

    def spy(self, tape, inputs, kept):  # what the recompute is handed
        seen.append(list(kept))
        original(self, tape, inputs, kept)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    w, x = W.to(device), X.to(device)
    f = checkpoint(body, policy=cp.offload(cp.dots_saveable))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(replay_module.Replayer, "__init__", spy)
        got = grad(_loss(f), (0, 1))(w, x)
    close([g.cpu() for g in got], [g.cpu() for g in grad(_loss(body), (0, 1))(w, x)])
    assert len(seen) == 1 and len(seen[0]) == 2  # x @ w and sin(g) @ w.t()
    assert all(t.device.type == "cpu" for t in seen[0])


# --- the contexts of the forward ----------------------------------------------------------------

SCALE: contextvars.ContextVar[float] = contextvars.ContextVar("SCALE", default=1.0)


def test_recompute_sees_the_context_of_the_forward() -> None:
    def f(x):
        return torch.sin(x) * SCALE.get()

    x = randn(3)
    token = SCALE.set(3.0)
    try:
        _, pull = vjp(checkpoint(f), x)
    finally:
        SCALE.reset(token)
    (got,) = pull(torch.ones(3, dtype=f64))  # the backward runs after the context exited
    torch.testing.assert_close(got, 3.0 * torch.cos(x))


def test_recompute_sees_the_mesh_and_debug_mode_of_the_forward() -> None:
    import pshard as ps

    def f(x):
        scale = ps.axis_size("x") * (3.0 if ps.debug_enabled() else 1.0)
        return ps.psum(torch.sin(x), "x") * scale

    def run() -> None:
        mesh = ps.init_mesh({"x": 1})
        ps.init_mesh({"y": 1})  # current after the forward: it has no axis "x"
        x = randn(3)
        with ps.use_mesh(mesh), ps.debug():
            _, pull = vjp(checkpoint(f), x)
        assert not ps.debug_enabled()
        with pytest.raises(ValueError):
            ps.axis_size("x")  # outside, the axis is not there
        (got,) = pull(torch.ones(3, dtype=f64))
        torch.testing.assert_close(got, 3.0 * torch.cos(x))

    contextvars.copy_context().run(run)  # the meshes stay in this test


def test_nests_both_ways_with_pmap_microbatch() -> None:
    import pshard as ps

    def f(w, x):
        return torch.tanh(x @ w).square().mean()

    w, x = randn(3, 3), randn(8, 3)
    mb = functools.partial(ps.pmap_microbatch, num_microbatches=4, in_specs=(None, ps.Shard(0)))
    want = grad(f)(w, x)
    close(grad(mb(checkpoint(f)))(w, x), want)  # checkpoint inside the microbatch loop
    close(grad(checkpoint(mb(f)))(w, x), want)  # the whole loop recomputed
    close(mb(grad(checkpoint(f)), out_specs=ps.Partial("mean"))(w, x), want)  # accumulation
    mean = ps.Partial("mean")  # no batch-dim analysis in what is counted
    ops = count(lambda: grad(mb(checkpoint(f), out_specs=mean))(w, x))
    assert ops["tanh"] == 2 * count(lambda: grad(mb(f, out_specs=mean))(w, x))["tanh"] == 8


def _dropout_step(f: Callable, x: torch.Tensor, w: torch.Tensor) -> Any:
    torch.manual_seed(1)
    g = grad(lambda w: f(w, x).square().sum())(w)
    return g, torch.get_rng_state()


def test_random_ops_draw_the_same_numbers_in_the_recompute() -> None:
    def f(w, x):
        h = F.dropout(torch.tanh(x @ w), p=0.5, training=True)
        return F.dropout(h @ w, p=0.3, training=True) + torch.rand_like(h)

    x, w = randn(8, 6), randn(6, 6)
    want, state = _dropout_step(f, x, w)
    for policy in (None, cp.dots_saveable, cp.save_anything_except_these_names()):
        got, after = _dropout_step(checkpoint(f, policy=policy), x, w)
        close(got, want)
        assert torch.equal(after, state)  # the global generator ends where it would


def _random_step(f: Callable, w: torch.Tensor, how: str) -> Any:
    """The gradient of ``f(w).square().sum()`` under ``how`` from seed 4, and the generator's
    state after the step and one more draw."""
    torch.manual_seed(4)
    if how == "grad":
        g = grad(lambda w: f(w).square().sum())(w)
    else:
        w = w.clone().requires_grad_()
        f(w).square().sum().backward()
        g = w.grad
    return g, torch.get_rng_state(), torch.rand(3)


@pytest.mark.parametrize("how", ["grad", "backward"])
def test_random_ops_in_nested_checkpoints(how: str) -> None:
    """The outer recompute runs the inner checkpoint's forward again: that forward draws the
    numbers of the first one, and the inner backward draws them once more."""
    x, w = randn(3, 4), randn(4, 4)

    def inner(a):
        return F.dropout(torch.tanh(x @ a), p=0.3, training=True)

    def middle(inner: Callable) -> Callable:
        def f(a):
            before = torch.rand(4, dtype=f64)  # a draw of the outer checkpoint before the inner
            return (inner(a) * before) @ a * (1 + torch.rand((), dtype=f64))

        return f

    plain = middle(inner)
    nested = {
        "inner only": middle(checkpoint(inner)),
        "outer only": checkpoint(middle(inner)),
        "both": checkpoint(middle(checkpoint(inner))),
        "both, dots": checkpoint(middle(checkpoint(inner, policy=cp.dots_saveable))),
        "three": checkpoint(lambda a: checkpoint(middle(checkpoint(inner)))(a).sin()),
    }
    for name, f in nested.items():
        want = _random_step((lambda a: plain(a).sin()) if name == "three" else plain, w, how)
        got = _random_step(f, w, how)
        close(got[0], want[0])
        assert torch.equal(got[1], want[1]), name  # the generator ends where it would
        close(got[2], want[2])


@pytest.mark.parametrize("how", ["grad", "backward"])
def test_random_ops_with_an_explicit_generator(how: str) -> None:
    """Draws from a generator given as ``generator=`` are the forward's in the recompute too,
    and that generator ends where the step without a checkpoint leaves it."""
    x, w = randn(3, 4), randn(4, 4)
    gen, other = torch.Generator(), torch.Generator()

    def f(a):
        h = torch.tanh(x @ a) * torch.randn(3, 4, dtype=f64, generator=gen)
        h = h * torch.empty(3, 4, dtype=f64).bernoulli_(0.7, generator=other)
        return (h + torch.rand(3, 4, dtype=f64)) @ a * torch.rand((), dtype=f64, generator=gen)

    def step(g: Callable) -> Any:
        gen.manual_seed(5)
        other.manual_seed(6)
        grads, state, draws = _random_step(g, w, how)
        return grads, state, draws, gen.get_state(), other.get_state()

    want = step(f)
    for name, g in {"one": checkpoint(f), "nested": checkpoint(lambda a: checkpoint(f)(a))}.items():
        got = step(g)
        close(got[0], want[0])
        for a, b in zip(got[1:], want[1:], strict=True):
            assert torch.equal(a, b), name  # every generator ends where it would

    # reseeded between the forward and the backward: the recompute draws the forward's numbers
    # and leaves the generator where the reseed put it
    def pullback(g: Callable, reseed: bool) -> torch.Tensor:
        torch.manual_seed(4)
        gen.manual_seed(5)
        other.manual_seed(6)
        _, pull = vjp(g, w)
        if reseed:
            gen.manual_seed(7)
        return pull(torch.ones(3, 4, dtype=f64))[0]

    got = pullback(checkpoint(f), True)
    assert torch.equal(gen.get_state(), torch.Generator().manual_seed(7).get_state())
    close(got, pullback(f, False))


def _attention_layer(device: str) -> tuple[Callable, dict, torch.Tensor]:
    """A decoder's attention block whose reshape of the attention's output is a view only
    because of the strides SDPA gives that output."""
    torch.manual_seed(0)
    width, heads, b, s = 32, 4, 2, 16
    qkv, proj = torch.nn.Linear(width, 3 * width), torch.nn.Linear(width, width)
    params = {
        "qkv": qkv.weight.detach().to(device),
        "proj": proj.weight.detach().to(device),
    }

    def layer(p: dict, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (x @ p["qkv"].t()).view(b, s, 3, heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + a.transpose(1, 2).reshape(b, s, width) @ p["proj"].t()

    return layer, params, torch.randn(b, s, width, device=device)


def _offload_attention(device: str) -> None:
    layer, params, x = _attention_layer(device)
    f = checkpoint(layer, policy=cp.offload(cp.dots_saveable))
    got = grad(lambda p: f(p, x).square().sum())(params)
    want = grad(lambda p: layer(p, x).square().sum())(params)
    close([got[k].cpu() for k in sorted(got)], [want[k].cpu() for k in sorted(want)])


def test_offloaded_values_keep_their_strides(monkeypatch: pytest.MonkeyPatch) -> None:
    """What offload keeps comes back with its strides: the attention's output restored
    contiguous made the reshape after it a copy, and the recompute "took another path" (on a
    GPU, where offloading copies; the copy forced here on the CPU)."""
    from pshard._remat import record

    monkeypatch.setattr(record, "_offload", lambda t: record.host_copy(t, pin=False))
    _offload_attention("cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_offload_on_cuda() -> None:
    _offload_attention("cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_random_ops_on_cuda() -> None:
    def f(w, x):
        return F.dropout(torch.tanh(x @ w), p=0.5, training=True) @ w

    x, w = randn(8, 6).cuda(), randn(6, 6).cuda()

    def step(g: Callable) -> Any:
        torch.manual_seed(1)
        out = grad(lambda w: g(w, x).square().sum())(w)
        return out, torch.cuda.get_rng_state()

    (want, state), (got, after) = step(f), step(checkpoint(f))
    close(got, want)
    assert torch.equal(after, state)


# --- modules --------------------------------------------------------------------------------------


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(4, 8)
        self.down = torch.nn.Linear(8, 4)
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x))) * self.scale


class Net(torch.nn.Module):
    def __init__(self, wrap: Callable[[torch.nn.Module], torch.nn.Module]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList([wrap(Block()) for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x.square().sum()


def test_checkpointed_module_has_the_layers_parameters() -> None:
    layer = Block().double()
    wrapped = checkpoint(layer)
    assert isinstance(wrapped, CheckpointModule)
    assert [n for n, _ in wrapped.named_parameters()] == [n for n, _ in layer.named_parameters()]
    assert all(a is b for a, b in zip(wrapped.parameters(), layer.parameters(), strict=True))
    assert wrapped.state_dict().keys() == layer.state_dict().keys()
    assert wrapped.up is layer.up and wrapped.scale is layer.scale
    wrapped.eval()
    assert not layer.training
    wrapped.train()
    assert layer.training


def test_functional_call_grad_through_checkpointed_modules() -> None:
    plain = Net(lambda b: b).double()
    ckpt = Net(checkpoint).double()
    ckpt.load_state_dict(plain.state_dict())
    params = {k: v.detach() + 0.1 for k, v in plain.named_parameters()}  # not the module's own
    x = randn(5, 4)

    def loss(model: torch.nn.Module) -> Callable:
        return lambda p: functional_call(model, p, (x,))

    close(grad(loss(ckpt))(params), grad(loss(plain))(params))
    close(
        hessian(loss(ckpt))(params)["blocks.0.up.bias"],
        hessian(loss(plain))(params)["blocks.0.up.bias"],
    )
    ops = count(lambda: grad(loss(ckpt))(params))
    assert ops["tanh"] == 2 * count(lambda: grad(loss(plain))(params))["tanh"]


@pytest.mark.parametrize("how", ["module", "bound_method", "closure", "partial"])
def test_modules_a_function_reaches_are_differentiated(how: str) -> None:
    layer = Block().double()
    x = randn(5, 4)
    calls: dict[str, Callable[[], torch.Tensor]] = {
        "module": lambda: checkpoint(layer)(x),
        "bound_method": lambda: checkpoint(layer.forward)(x),
        "closure": lambda: checkpoint(lambda x: layer(x))(x),
        "partial": lambda: checkpoint(functools.partial(Block.forward, layer), x),  # HF's way
    }
    params = {k: v.detach() + 0.1 for k, v in layer.named_parameters()}

    def loss(p: dict, call: Callable[[], torch.Tensor]) -> torch.Tensor:
        with reparametrized(layer, p):  # what an outer functional_call does
            return call().square().sum()

    close(grad(loss)(params, calls[how]), grad(loss)(params, lambda: layer(x)))
    ops = count(lambda: grad(loss)(params, calls[how]))
    assert ops["tanh"] == 2 * count(lambda: grad(loss)(params, lambda: layer(x)))["tanh"]


def test_batchnorm_running_statistics_are_updated_once() -> None:
    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)).double()
    ckpt = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)).double()
    ckpt.load_state_dict(plain.state_dict())
    wrapped = checkpoint(ckpt)
    x = randn(6, 4)
    plain(x).square().sum().backward()
    wrapped(x).square().sum().backward()
    close(dict(ckpt.named_buffers()), dict(plain.named_buffers()))
    close([p.grad for p in ckpt.parameters()], [p.grad for p in plain.parameters()])


# --- calling conventions, pytrees ---------------------------------------------------------------


def test_calling_conventions() -> None:
    def f(w, x):
        return torch.tanh(x @ w)

    want = grad(lambda w: f(w, X).sum())(W)
    assert remat is checkpoint
    close(grad(lambda w: checkpoint(f)(w, X).sum())(W), want)
    close(grad(lambda w: checkpoint(f, w, X).sum())(W), want)  # torch.utils.checkpoint's
    close(grad(lambda w: checkpoint(f, w, x=X).sum())(W), want)
    close(grad(lambda w: checkpoint(policy=cp.dots_saveable)(f)(w, X).sum())(W), want)

    @checkpoint
    def g(w, x):
        return f(w, x)

    close(grad(lambda w: g(w, X).sum())(W), want)
    assert g.__name__ == "g"


def test_pytree_arguments_and_outputs() -> None:
    def f(tree, n, flag=None):
        a = tree["a"] @ tree["b"][0]
        return {"y": (a * n).sin(), "n": n, "idx": a.argmax(-1), "none": flag}

    b = randn(3, 3)

    def loss(f: Callable) -> Callable:
        return lambda a: f({"a": a, "b": [b, "label"]}, 3)["y"].square().sum()

    got = checkpoint(f)({"a": X, "b": [b, "label"]}, 3)
    assert got["n"] == 3 and got["none"] is None and got["idx"].dtype == torch.int64
    close(got["y"], f({"a": X, "b": [b, "label"]}, 3)["y"])
    close(grad(loss(checkpoint(f)))(X), grad(loss(f))(X))
    a = X.clone().requires_grad_()
    loss(checkpoint(f))(a).backward()
    close(a.grad, grad(loss(f))(X))


def test_global_tensors_as_arguments_and_outputs() -> None:
    """A GlobalTensor reaches the checkpoint as its block: the block's gradient under
    torch.func and under .backward(), in a dict too; one returned is rebuilt with its layout."""
    import pshard as ps

    def run() -> None:
        ps.init_mesh({"dp": 1})
        x = randn(2, 3)

        def layer(p, x):
            return torch.tanh(x @ ps.gather(p["w"])) * ps.gather(p["s"])

        def loss(f: Callable) -> Callable:
            return lambda p: (f(p, x) ** 2).sum()

        whole = {"w": W, "s": randn(3)}
        want = grad(loss(layer))(whole)
        params = ps.shard(whole, ps.P("dp"))
        for policy in (None, cp.dots_saveable):
            got = grad(loss(checkpoint(layer, policy=policy)))(params)
            assert all(
                isinstance(g, ps.GlobalTensor) and g.meta == params[k].meta for k, g in got.items()
            )
            close({k: ps.gather(g) for k, g in got.items()}, want)
        blocks = {k: v.clone().requires_grad_() for k, v in whole.items()}
        given = {k: ps.from_local(b, ps.P("dp"), global_shapes=b.shape) for k, b in blocks.items()}
        loss(checkpoint(layer))(given).backward()
        close({k: b.grad for k, b in blocks.items()}, want)

        def make(w):
            return ps.shard(torch.tanh(ps.gather(w)), ps.P("dp"))

        w = ps.shard(W, ps.P("dp"))
        out = checkpoint(make)(w)
        assert isinstance(out, ps.GlobalTensor) and out.meta == w.meta
        close(out.local, make(w).local)
        want = grad(lambda w: (ps.gather(make(w)) ** 2).sum())(w)
        close(grad(lambda w: (ps.gather(checkpoint(make)(w)) ** 2).sum())(w).local, want.local)
        block = W.clone().requires_grad_()
        made = checkpoint(make)(ps.from_local(block, ps.P("dp"), global_shapes=(3, 3)))
        (ps.gather(made) ** 2).sum().backward()
        close(block.grad, want.local)

    contextvars.copy_context().run(run)  # the mesh stays in this test


def test_no_grad_runs_the_function_as_is() -> None:
    calls = []

    def f(x):
        calls.append(1)
        return x * 2

    with torch.no_grad():
        assert torch.equal(checkpoint(f)(torch.ones(2)), torch.full((2,), 2.0))
    assert calls == [1]


# --- errors ---------------------------------------------------------------------------------------


def test_unknown_policies_are_refused() -> None:
    with pytest.raises(TypeError, match=re.escape("ps.checkpoint: policy='dots' is a string")):
        checkpoint(body, policy="dots")
    with pytest.raises(TypeError, match="did you mean policy=ps.checkpoint_policies.dots_saveable"):
        checkpoint(body, policy="dots")
    with pytest.raises(
        TypeError, match=re.escape("is a function that makes a policy, not a policy; call it")
    ):
        checkpoint(body, policy=cp.save_only_these_names)
    with pytest.raises(
        TypeError, match=re.escape("ps.checkpoint: policy is an int (3), not a policy")
    ):
        checkpoint(body, policy=3)
    with pytest.raises(
        TypeError, match=re.escape("cannot be called as policy(op, *args, **kwargs)")
    ):
        checkpoint(body, policy=lambda: True)
    with pytest.raises(TypeError, match="names must be strings"):
        cp.save_only_these_names("a", 3)
    with pytest.raises(TypeError, match=re.escape("fn must be a function or an nn.Module")):
        checkpoint(3)

    def maybe(op, *args, **kwargs):
        return None

    with pytest.raises(TypeError, match=re.escape("returned None for aten.mm.default")):
        grad(_loss(checkpoint(body, policy=maybe)), (0, 1))(W, X)


def test_policies_are_checked_against_both_call_forms() -> None:
    """A callable policy is called with an operator and its arguments and, for names, as
    policy(checkpoint_name, x, name=name): one that cannot take the second is refused at once;
    a policy that raises is named in the error; the hint for a misspelt name is a close one."""
    with pytest.raises(
        TypeError,
        match=re.escape(
            "ps.checkpoint: policy test_policies_are_checked_against_both_call_forms.<locals>."
            "<lambda> cannot be called as policy(checkpoint_name, x, name=name)"
        ),
    ):
        checkpoint(body, policy=lambda op, *args: False)

    def broken(op, *args, **kwargs):
        return {"mm": True, None: False}[getattr(op, "_opname", None)]  # KeyError: tanh

    for error, policy in ((KeyError, broken), (TypeError, lambda op, *a, **k: a[0].shape + 1)):
        name = getattr(policy, "__qualname__", "")
        with pytest.raises(
            TypeError if error is TypeError else RuntimeError,
            match=re.escape(f"ps.checkpoint: policy {name} raised {error.__name__}"),
        ) as info:
            grad(_loss(checkpoint(body, policy=policy)), (0, 1))(W, X)
        assert isinstance(info.value.__cause__, error)

    hints = {
        "dots_savable": "dots_saveable",
        "nothing": "nothing_saveable",
        "save_collective": "save_collectives",
        "offload": "offload(ps.checkpoint_policies.dots_saveable)",
        "save_only": "save_only_these_names('name', ...)",
    }
    for text, name in hints.items():
        with pytest.raises(TypeError, match=re.escape(f"policy=ps.checkpoint_policies.{name}?")):
            checkpoint(body, policy=text)
    for text in ("e", "x", "sum", "save"):  # nothing close, or several: no hint
        with pytest.raises(TypeError) as info:
            checkpoint(body, policy=text)
        assert "did you mean" not in str(info.value)
    with pytest.raises(TypeError) as info:
        cp.offload("x")
    assert "did you mean" not in str(info.value)


def test_closure_over_a_differentiated_tensor_is_refused() -> None:
    w = W.clone().requires_grad_()
    f = checkpoint(lambda x: torch.tanh(x @ w))
    with pytest.raises(
        ValueError, match=re.escape("reads a tensor that requires grad (shape (3, 3)")
    ):
        f(X.clone().requires_grad_())
    with pytest.raises(ValueError, match="reads a tensor of an enclosing torch.func transform"):
        grad(lambda w: checkpoint(lambda x: torch.tanh(x @ w))(X).sum())(W)
    with pytest.raises(ValueError, match="reads a tensor of an enclosing torch.func transform"):
        jvp(lambda w: checkpoint(lambda x: torch.tanh(x @ w))(X), (W,), (W,))


def test_closure_over_constants_is_exact() -> None:
    mask = (randn(2, 3) > 0).double()
    f = checkpoint(lambda w, x: torch.tanh(x @ w) * mask)
    g = lambda w, x: torch.tanh(x @ w) * mask  # noqa: E731
    for name in ("grad", "hessian", "backward", "vmap_grad"):
        close(TRANSFORMS[name](f), TRANSFORMS[name](g))


def test_integer_tensors_made_inside_a_transform_may_be_read() -> None:
    """Integer tensors have no derivative to lose: a checkpointed function may read one made
    inside the transform (segment ids built by sequence_parallel's hooks, say)."""

    def f(w: torch.Tensor, checkpointed: bool) -> torch.Tensor:
        seg = torch.arange(3)  # made under grad / jvp, read without being an argument
        body = lambda w, x: torch.tanh(x @ w) * (seg + 1)  # noqa: E731
        return (checkpoint(body) if checkpointed else body)(w, X).sum()

    close(grad(f)(W, True), grad(f)(W, False))
    close(jvp(lambda w: f(w, True), (W,), (W,)), jvp(lambda w: f(w, False), (W,), (W,)))


def test_a_recompute_that_differs_in_a_scalar_is_an_error() -> None:
    """A Python number that changed between the forward and the recompute (a counter) is
    another path, whether the operation takes it as it is or in a new tensor; the error shows
    the argument that differs."""
    calls = [0]

    def scaled(w, x):
        calls[0] += 1
        return torch.tanh(x @ w) * calls[0]

    def filled(w, x):
        calls[0] += 1
        h = torch.tanh(x @ w)
        return h * torch.full_like(h, calls[0])

    texts = {
        scaled: "the forward ran aten.mul.Tensor on ((2, 3) float64) (operation 3 of 3), which "
        "the recompute did not; it ran it with other=2 where the forward had other=1",
        filled: "the forward ran aten.mul.Tensor on ((2, 3) float64, (2, 3) float64) (operation "
        "3 of 3), which the recompute did not; it ran it with other a new tensor filled with 2 "
        "where the forward had other a new tensor filled with 1",
    }
    for f, text in texts.items():
        for run in (lambda f: grad(_loss(checkpoint(f)))(W, X), lambda f: _backward(checkpoint(f))):
            calls[0] = 0
            with pytest.raises(ValueError, match=re.escape(text)):
                run(f)

    rate = [0.5]

    def dropped(w, x):
        h = torch.tanh(x @ w)
        return h * torch.empty_like(h).bernoulli_(rate[0])

    _, pull = vjp(checkpoint(dropped), W, X)
    rate[0] = 0.9  # a random draw is known by its place: its arguments are compared
    with pytest.raises(ValueError, match=re.escape("drew with p=0.9 where the forward had p=0.5")):
        pull(torch.ones(2, 3, dtype=f64))

    def drawn(w, x):  # the rate in a tensor the draw reads
        h = torch.tanh(x @ w)
        return h * torch.bernoulli(torch.full_like(h, rate[0]))

    rate[0] = 0.5
    _, pull = vjp(checkpoint(drawn), W, X)
    rate[0] = 0.9
    text = (
        "drew with self a new tensor filled with 0.9 where the forward had self a new tensor "
        "filled with 0.5"
    )
    with pytest.raises(ValueError, match=re.escape(text)):
        pull(torch.ones(2, 3, dtype=f64))

    scale, table = randn(3), randn(3, 30)  # known by value, by identity and version
    _, pull = vjp(checkpoint(lambda w, x: torch.tanh(x @ w) * scale), W, X)
    scale.mul_(-1)
    text = (
        f"it ran it with other a float64 tensor of values [{', '.join(map(repr, scale.tolist()))}]"
    )
    with pytest.raises(ValueError, match=re.escape(text)):
        pull(torch.ones(2, 3, dtype=f64))
    _, pull = vjp(checkpoint(lambda w, x: torch.tanh(x @ w) @ table), W, X)
    table.mul_(2)
    text = (
        "it ran it with mat2 a tensor from outside (version 1) where the forward had mat2 a "
        "tensor from outside (version 0): it was modified in place between the forward and the "
        "backward"
    )
    with pytest.raises(ValueError, match=re.escape(text)):
        pull(torch.ones(2, 30, dtype=f64))


def test_another_path_in_the_recompute_is_an_error() -> None:
    calls = [0]

    def flaky(w, x):
        calls[0] += 1
        h = x @ w
        return torch.sin(h) if calls[0] == 1 else torch.cos(h)

    msg = (
        "ps.checkpoint: the recompute of test_another_path_in_the_recompute_is_an_error."
        "<locals>.flaky took another path than its forward: the forward ran aten.sin.default "
        "on ((2, 3) float64)"
    )
    with pytest.raises(ValueError, match=re.escape(msg)):
        grad(_loss(checkpoint(flaky)))(W, X)
    calls[0] = 0
    with pytest.raises(ValueError, match="it ran aten.cos.default on"):
        _backward(checkpoint(flaky))

    def shapes(w, x):
        calls[0] += 1
        return x[: 3 - calls[0]] @ w

    calls[0] = 0
    with pytest.raises(ValueError, match="took another path than its forward|returned"):
        grad(_loss(checkpoint(shapes)))(W, randn(3, 3))


@pytest.mark.parametrize(
    "policy",
    [
        cp.save_only_these_names("out"),
        cp.save_anything_except_these_names("h"),
        lambda op, *args, **kwargs: op is torch.ops.aten.tanh.default,
    ],
)
def test_the_checkpoints_own_output_is_not_kept_twice(policy: Any) -> None:
    """A policy that saves the checkpoint's output does not make the checkpoint hold it: the
    caller holds it (the next layer's input), the backward takes it back while it lives and
    computes it again once it is gone; the gradients are exact either way."""
    x = randn(256, 64)

    def layer(w, x):
        return checkpoint_name(torch.tanh(checkpoint_name(x @ w, "h")), "out")

    f = checkpoint(layer, policy=policy)
    w = randn(64, 64).requires_grad_()
    (expected,) = torch.autograd.grad(layer(w, x).sum(), w)
    out = f(w, x)
    loss = out.sum()
    held = StorageWeakRef(out.untyped_storage())
    del out
    assert held.expired()  # only the caller held it
    close(torch.autograd.grad(loss, w)[0], expected)
    out = f(w, x)
    ops = count(lambda: close(torch.autograd.grad(out.sum(), w)[0], expected))
    assert ops["tanh"] == 0  # taken back while alive


def test_state_carried_from_the_forward_into_the_recompute_is_named() -> None:
    """A function that keeps a value it computed outside itself (a key/value cache that grows on
    each call) reads it back in the recompute: the error says so, naming the forward's
    operation, not only that a tensor from outside differs."""
    for run in (lambda f: grad(_loss(checkpoint(f)))(W, X), lambda f: _backward(checkpoint(f))):
        cache = {"k": torch.zeros(0, 3, dtype=f64)}

        def attend(w, x, cache=cache):
            k = torch.cat([cache["k"], torch.tanh(x @ w)])  # the cache grows, as in decoding
            cache["k"] = k
            return k.sum(0)

        text = (
            "The tensor from outside that the recompute read is the output of operation 3 of "
            "its forward (aten.cat.default), kept outside the function (in a cache, a list or "
            "an attribute it writes)"
        )
        with pytest.raises(ValueError, match=re.escape(text)):
            run(attend)


def test_a_tensor_modified_in_place_before_the_backward_is_an_error() -> None:
    scale = randn(3)

    def f(w, x):
        return torch.tanh(x @ w) * scale

    _, pull = vjp(checkpoint(f), W, X)
    scale.mul_(2)
    with pytest.raises(ValueError, match="took another path than its forward"):
        pull(torch.ones(2, 3, dtype=f64))


@pytest.mark.parametrize("size", [3, 100])  # known by value (small) or by identity (large)
@pytest.mark.parametrize("how", ["backward", "vjp"])
def test_an_outside_integer_tensor_changed_before_the_backward_is_an_error(
    how: str, size: int
) -> None:
    """Index tables and masks read from outside have no gradient of their own, but the
    gradient goes where they say: one modified in place or replaced by other values between
    the forward and the backward is an error (without a checkpoint, autograd raises too)."""
    x = randn(size, 3)
    weights = randn(size, 3)
    outside = {"index": torch.arange(size), "mask": torch.arange(size) % 2 == 0}

    def f(w, x):
        h = torch.tanh(x @ w)[outside["index"]]
        return torch.where(outside["mask"][:, None], h, h * 2)

    def run(change: Callable[[], None] | None) -> torch.Tensor:
        outside["index"], outside["mask"] = torch.arange(size), torch.arange(size) % 2 == 0
        if how == "vjp":
            out, pull = vjp(lambda w: (checkpoint(f)(w, x) * weights).sum(), W)
            if change is not None:
                change()
            return pull(torch.ones((), dtype=f64))[0]
        w = W.clone().requires_grad_()
        out = (checkpoint(f)(w, x) * weights).sum()
        if change is not None:
            change()
        out.backward()
        return w.grad

    want = grad(lambda w: (f(w, x) * weights).sum())(W)
    close(run(None), want)
    # replaced by equal values (a cache rebuilt, a constant made again): the same gradient
    close(run(lambda: outside.update(index=outside["index"].clone())), want)
    name = re.escape(f"ps.checkpoint: {f.__qualname__} read")
    changes = {
        "was modified in place": lambda: outside["index"].copy_(outside["index"].flip(0)),
        "was replaced by a tensor of other values": lambda: outside.update(
            index=outside["index"].flip(0)
        ),
        "mask": lambda: outside["mask"].logical_not_(),
    }
    for what, change in changes.items():
        text = "was modified in place" if what == "mask" else what
        with pytest.raises(ValueError, match=f"{name} .* {text} between the forward and"):
            run(change)


def test_an_argument_modified_in_place_before_the_backward_is_an_error() -> None:
    x = randn(2, 3)
    _, pull = vjp(checkpoint(lambda w, x: torch.tanh(x @ w)), W, x)
    x.add_(1)
    with pytest.raises(ValueError, match=re.escape("argument 1 of")):
        pull(torch.ones(2, 3, dtype=f64))
    z = x.clone().requires_grad_() * 1
    out = checkpoint(lambda z: torch.tanh(z * 2))(z)
    with torch.no_grad():
        z.mul_(2)  # under .backward(), autograd's own check of what it saved
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_writing_a_differentiated_argument_in_place_is_an_error() -> None:
    def f(x):
        x.mul_(2)
        return x.sin()

    x = randn(3).requires_grad_()
    msg = (
        "ps.checkpoint: test_writing_a_differentiated_argument_in_place_is_an_error.<locals>.f "
        "writes in place to one of its arguments that needs a gradient"
    )
    for arg in (x, x * 1):
        with pytest.raises(ValueError, match=re.escape(msg)):
            checkpoint(f)(arg)


# --- values that leave the function by another route ---------------------------------------------


def _with_side(side: list[torch.Tensor]) -> Callable:
    def f(w, x):
        h = x @ w
        side.append(torch.sin(h))  # leaves by a list, not by the return value
        return torch.cos(h)

    return f


def _side_loss(f: Callable, side: list[torch.Tensor]) -> Callable:
    def loss(w, x):
        side.clear()
        out = f(w, x)
        return out.sum() + 3 * side[0].sum()

    return loss


SIDE_RUNS: dict[str, Callable[[Callable], Any]] = {
    "grad": lambda loss: grad(loss, (0, 1))(W, X),
    "backward": lambda loss: (lambda w, x: (loss(w, x).backward(), (w.grad, x.grad))[1])(
        W.clone().requires_grad_(), X.clone().requires_grad_()
    ),
    "vjp": lambda loss: vjp(loss, W, X)[1](torch.tensor(1.0, dtype=f64)),
    "jvp": lambda loss: jvp(loss, (W, X), (torch.ones_like(W), X))[1],
    "vmap_grad": lambda loss: vmap(grad(loss), (None, 0))(W, torch.stack([X, X * 2])),
    "grad_vmap": lambda loss: grad(lambda w: vmap(loss, (None, 0))(w, torch.stack([X, -X])).sum())(
        W
    ),
    "hessian": lambda loss: hessian(loss)(W, X),
}


@pytest.mark.parametrize("policy", ["nothing", "dots", "names"])
@pytest.mark.parametrize("run", list(SIDE_RUNS))
def test_values_that_leave_by_a_list_carry_their_gradient(run: str, policy: str) -> None:
    """f appends sin(x @ w) to a list and returns cos(x @ w); the loss reads both: the
    gradient has the side route's term (it was silently dropped)."""
    side: list[torch.Tensor] = []
    f = _with_side(side)
    want = SIDE_RUNS[run](_side_loss(f, side))
    got = SIDE_RUNS[run](_side_loss(checkpoint(f, policy=POLICIES[policy]), side))
    close(got, want)


def test_values_recorded_by_forward_hooks_carry_their_gradient() -> None:
    """A forward hook inside a checkpointed module records an inner layer's output (as Hugging
    Face records router logits), and the hook of the checkpointed layer records its own output
    (as it records hidden states): both get their gradients."""
    torch.manual_seed(0)
    layer = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Tanh(), torch.nn.Linear(5, 4))
    layer = layer.to(f64)
    seen: dict[str, torch.Tensor] = {}
    hooks = [
        layer[0].register_forward_hook(lambda m, a, out: seen.__setitem__("inner", out)),
        layer.register_forward_hook(lambda m, a, out: seen.__setitem__("outer", out)),
    ]
    params = dict(layer.named_parameters())
    x = randn(3, 4)

    def loss(p, module):
        seen.clear()
        y = functional_call(module, p, (x,))
        return (y**2).sum() + 3 * seen["inner"].sin().sum() + (seen["outer"] * 2).sum()

    try:
        want = grad(loss)(params, layer)
        got = grad(loss)(params, checkpoint(layer))
        close(got, want)
        # .backward() too
        p = {k: v.detach().clone().requires_grad_() for k, v in params.items()}
        loss(p, checkpoint(layer)).backward()
        close({k: v.grad for k, v in p.items()}, want)
    finally:
        for h in hooks:
            h.remove()


def test_values_that_leave_nested_checkpoints_carry_their_gradient() -> None:
    """A value that leaves an inner checkpoint leaves the outer one too; one that the outer
    function only reads does not."""
    side: list[torch.Tensor] = []

    def inner(w, x):
        h = x @ w
        side.append(torch.sin(h))
        return torch.cos(h)

    def outer(w, x, ck):
        local: list[torch.Tensor] = []
        y = (checkpoint(inner) if ck else inner)(w, x)
        local.append(y * 2)  # leaves nothing: the list dies with the call
        side.append(local[0].exp())
        return y.tanh()

    def loss(ck):
        def fn(w, x):
            side.clear()
            out = (checkpoint(outer) if ck else outer)(w, x, ck)
            return out.sum() + 3 * side[0].sum() + side[1].sum()

        return fn

    close(grad(loss(True), (0, 1))(W, X), grad(loss(False), (0, 1))(W, X))


def test_values_that_leave_and_depend_on_each_other() -> None:
    """Two values that leave, one computed from the other (saved by its derivative)."""
    side: list[torch.Tensor] = []

    def f(w, x):
        a = x @ w
        side.extend([a, a * a])
        return a.sum(0)

    def loss(fn):
        def run(w, x):
            side.clear()
            return fn(w, x).sum() + side[0].sin().sum() + side[1].cos().sum()

        return run

    close(grad(loss(checkpoint(f)), (0, 1))(W, X), grad(loss(f), (0, 1))(W, X))
    close(SIDE_RUNS["backward"](loss(checkpoint(f))), SIDE_RUNS["backward"](loss(f)))
