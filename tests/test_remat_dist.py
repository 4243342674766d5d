"""ps.checkpoint with collectives, shard_map and sequence parallelism, on 2 gloo ranks.

Oracles: the single-process function without checkpoint (float64). What communicates in the
recompute is counted with a TorchDispatchMode below autograd (the c10d operators each rank
issues), never assumed.
"""

from __future__ import annotations

import collections
from typing import Any

import pytest
import torch
from helpers import full_attention
from torch.func import grad, jvp
from torch.utils._python_dispatch import TorchDispatchMode

import pshard as ps
from pshard._remat.checkpoint import checkpoint
from pshard._remat.names import checkpoint_name
from pshard._remat.policies import checkpoint_policies as cp

pytestmark = pytest.mark.filterwarnings(
    "ignore:`torch.jit.script` is deprecated:DeprecationWarning"
)

f64 = torch.float64


class Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[f"{func.namespace}.{func._opname}"] += 1
        return func(*args, **(kwargs or {}))


def _close(a: Any, b: Any) -> bool:
    la, lb = torch.utils._pytree.tree_leaves(a), torch.utils._pytree.tree_leaves(b)
    return len(la) == len(lb) and all(
        x.shape == y.shape and torch.allclose(x, y, rtol=1e-9, atol=1e-9)
        for x, y in zip(la, lb, strict=True)
    )


# --- FSDP, the shard_map tutorial's example -------------------------------------------------------


def _predict(params: list, inputs: torch.Tensor) -> torch.Tensor:
    for w, b in params:
        outputs = inputs @ w + b
        inputs = torch.relu(outputs)
    return outputs


def _loss(params: list, batch: tuple) -> torch.Tensor:
    inputs, targets = batch
    return ((_predict(params, inputs) - targets) ** 2).sum(-1).mean()


def _predict_fsdp(local_params: list, inputs: torch.Tensor) -> torch.Tensor:
    for w_frag, b_frag in local_params:
        w = checkpoint_name(ps.all_gather(w_frag, "dp", tiled=True), "gather")
        b = checkpoint_name(ps.all_gather(b_frag, "dp", tiled=True), "gather")
        outputs = inputs @ w + b
        inputs = torch.relu(outputs)
    return outputs


def _fsdp_worker(params: list, batch: tuple) -> dict:
    ps.init_mesh({"dp": 2})
    out = {}
    for name, predict in {
        "plain": _predict_fsdp,
        "all_but_gather": checkpoint(
            _predict_fsdp, policy=cp.save_anything_except_these_names("gather")
        ),
        "recompute_collectives": checkpoint(_predict_fsdp, policy=cp.recompute_collectives),
        "save_collectives": checkpoint(_predict_fsdp, policy=cp.save_collectives),
        "save_gather": checkpoint(_predict_fsdp, policy=cp.save_only_these_names("gather")),
        "nothing": checkpoint(_predict_fsdp),
    }.items():

        def loss_fsdp(local_params: list, local_batch: tuple, predict: Any = predict) -> Any:
            inputs, targets = local_batch
            local = ((predict(local_params, inputs) - targets) ** 2).sum(-1).mean()
            return ps.pmean(local, "dp")

        mapped = ps.shard_map(loss_fsdp, in_specs=(ps.P("dp"), ps.P("dp")), out_specs=ps.P())
        with Count() as c:
            g = grad(mapped)(params, batch)
        out[name] = (g, c.ops)
    return out


def test_fsdp_per_layer_remat(procs) -> None:
    torch.manual_seed(0)
    sizes = [6, 8, 8, 4]
    params = [
        (torch.randn(i, o, dtype=f64) / i**0.5, torch.randn(o, dtype=f64))
        for i, o in zip(sizes[:-1], sizes[1:], strict=True)
    ]
    batch = (torch.randn(10, sizes[0], dtype=f64), torch.randn(10, sizes[-1], dtype=f64))
    want = grad(_loss)(params, batch)
    forward = 2 * len(params)  # gathers in the forward: each weight and each bias, once
    for rank in procs.run(2, _fsdp_worker, params, batch):
        for name, (g, _) in rank.items():
            assert _close(g, want), name
        gathers = {k: ops["c10d._allgather_base_"] for k, (_, ops) in rank.items()}
        counts = str({k: {n: c for n, c in o.items() if "c10d" in n} for k, (_, o) in rank.items()})
        # the gathered weights are not kept: gathered again in the backward (same order on
        # every rank, as the test ran at all); shard_map's boundary gathers the gradients
        plain = gathers["plain"]
        for name in ("all_but_gather", "recompute_collectives", "nothing"):
            assert gathers[name] == plain + forward, counts
        # kept: the recompute does not communicate
        assert gathers["save_collectives"] == gathers["save_gather"] == plain, counts
        for name, (_, ops) in rank.items():  # the transposes of the gathers, once each
            assert ops["c10d._reduce_scatter_base_"] == forward, (name, counts)


# --- shard_map both ways ------------------------------------------------------------------------


def _block(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = torch.tanh(x @ w)
    return ps.psum(h, "x") * h


def _shard_map_worker(x: torch.Tensor, w: torch.Tensor) -> dict:
    ps.init_mesh({"x": 2})
    specs = dict(in_specs=(ps.P("x"), ps.P()), out_specs=ps.P("x"))
    plain = ps.shard_map(_block, **specs)
    variants = {
        "inside": ps.shard_map(checkpoint(_block), **specs),
        "around": checkpoint(ps.shard_map(_block, **specs)),
        "inside_dots": ps.shard_map(checkpoint(_block, policy=cp.dots_saveable), **specs),
    }

    def loss(f: Any) -> Any:
        return lambda x, w: (f(x, w) ** 2).sum()

    want = grad(loss(plain), (0, 1))(x, w)
    want_jvp = jvp(plain, (x, w), (torch.ones_like(x), w))[1]
    out = {}
    for name, f in variants.items():
        with Count() as c:
            g = grad(loss(f), (0, 1))(x, w)
        out[name] = (
            _close(g, want),
            _close(jvp(f, (x, w), (torch.ones_like(x), w))[1], want_jvp),
            c.ops["c10d.allreduce_"],
        )
    with Count() as c:
        grad(loss(plain), (0, 1))(x, w)
    out["plain"] = c.ops["c10d.allreduce_"]
    return out


def test_nests_both_ways_with_shard_map(procs) -> None:
    torch.manual_seed(1)
    x, w = torch.randn(6, 3, dtype=f64), torch.randn(3, 3, dtype=f64)
    for rank in procs.run(2, _shard_map_worker, x, w):
        plain = rank.pop("plain")
        for name, (grad_ok, jvp_ok, psums) in rank.items():
            assert grad_ok and jvp_ok, name
            assert psums >= plain + 1, name  # the psum is issued again in the recompute


# --- psum_scatter on gloo -----------------------------------------------------------------------


def _scatter_block(x: torch.Tensor) -> torch.Tensor:
    return ps.psum_scatter(x.sin(), "tp", dim=1).cos()


def _scatter_worker(x: torch.Tensor) -> dict:
    ps.init_mesh({"tp": 2})
    out = {}
    for name, f in {
        "plain": _scatter_block,
        "nothing": checkpoint(_scatter_block),
        "save_collectives": checkpoint(_scatter_block, policy=cp.save_collectives),
    }.items():
        mapped = ps.shard_map(f, in_specs=ps.P(None, "tp"), out_specs=ps.P(None, "tp"))
        with Count() as c:
            g = grad(lambda x, mapped=mapped: (mapped(x) ** 2).sum())(x)
        out[name] = (g, {k: n for k, n in c.ops.items() if k.startswith("c10d.")})
    return out


def test_checkpointed_psum_scatter_on_gloo(procs) -> None:
    """gloo copies a reduce-scatter's result into its output in the Work's wait, after the
    operator returned: the recompute took that copy for part of the function (a copy of a
    tensor from outside, another one each run: refused as another path) and, where the policy
    keeps collectives, issued the reduce-scatter again."""
    torch.manual_seed(3)
    x = torch.randn(4, 64, dtype=f64)  # each rank's 4 x 32 block: 128 elements reduced
    # one process: the ranks' blocks summed, each rank's half of the sum its output block
    want = grad(lambda x: (sum(x.sin().chunk(2, dim=1)).cos() ** 2).sum())(x)
    for rank in procs.run(2, _scatter_worker, x):
        plain = rank["plain"][1]
        assert plain["c10d._reduce_scatter_base_"] == 1, plain
        for name, (g, _) in rank.items():
            assert _close(g, want), name
        assert rank["nothing"][1] == {**plain, "c10d._reduce_scatter_base_": 2}
        assert rank["save_collectives"][1] == plain  # kept: the recompute does not communicate


# --- sequence parallelism -------------------------------------------------------------------------


def _attention_worker(q, k, v, c) -> dict:
    ps.init_mesh({"sp": 2})
    spec = ps.Shard(1)
    out = {}
    for name, attn in {"ulysses": ps.ulysses_attention, "ring": ps.ring_attention}.items():
        body = checkpoint(lambda q, k, v, attn=attn: attn(q, k, v, causal=True))
        f = ps.shard_map_seq(body, in_specs=(spec, spec, spec), out_specs=spec)
        # the backward runs after shard_map_seq's sequence context has exited: the recompute
        # runs in the context its forward saw
        g = grad(lambda q, k, v, f=f: (f(q, k, v) * c).sum(), (0, 1, 2))(q, k, v)
        out[name] = (f(q, k, v), g)
    return out


def test_checkpointed_sequence_parallel_attention_is_exact(pool) -> None:
    torch.manual_seed(2)
    b, s, h, d = 2, 7, 2, 3  # a length that does not divide by 2: padding too
    q, k, v = (torch.randn(b, s, h, d, dtype=f64) for _ in range(3))
    c = torch.randn(b, s, h, d, dtype=f64)
    want = full_attention(q, k, v, True)
    want_grads = grad(lambda q, k, v: (full_attention(q, k, v, True) * c).sum(), (0, 1, 2))(q, k, v)
    for rank in pool.run(2, _attention_worker, q, k, v, c):
        for name, (y, g) in rank.items():
            assert _close(y, want), name
            assert _close(g, want_grads), name


# --- autocast: sharded_call's units are checkpoints ---------------------------------------------


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(8, 16)
        self.down = torch.nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(3, 8)
        self.blocks = torch.nn.ModuleList(_Block() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return h


def _autocast_worker() -> dict:
    """The usual mixed-precision loop (bfloat16 autocast around the forward) with
    sharded_call, against the same program on the whole parameters in one process."""
    ps.init_mesh({"dp": 2})
    torch.manual_seed(0)
    model = _Model()  # float32: autocast computes the products in bfloat16
    whole = {k: v.detach() for k, v in model.named_parameters()}
    x = torch.randn(4, 3)

    def loss(call: Any, p: dict) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return call(model, p, (x,)).float().square().sum()

    def ok(grads: dict, want: dict) -> bool:  # bit for bit
        return all(torch.equal(ps.gather(grads[k]), want[k]) for k in want)

    params = ps.shard(whole, ps.P("dp"))
    want = grad(lambda p: loss(torch.func.functional_call, p))(whole)
    out = {}
    out["grad"] = ok(grad(lambda p: loss(ps.sharded_call, p))(params), want)
    # .backward() after autocast exited: the recompute runs in the forward's autocast
    leaves = {
        k: ps.GlobalTensor(v.local.clone().requires_grad_(), v.meta) for k, v in params.items()
    }
    loss(ps.sharded_call, leaves).backward()
    wholes = {k: v.clone().requires_grad_() for k, v in whole.items()}
    loss(torch.func.functional_call, wholes).backward()
    got = {k: ps.GlobalTensor(v.local.grad, v.meta) for k, v in leaves.items()}
    out["backward"] = ok(got, {k: v.grad for k, v in wholes.items()})
    return out


def test_sharded_call_inside_autocast(pool) -> None:
    for rank in pool.run(2, _autocast_worker):
        assert rank == {"grad": True, "backward": True}
