"""GlobalTensors on 2 and 4 gloo ranks against the one-process model, float64.

The FSDP, tensor-parallel (Megatron) and FSDP x TP examples of JAX's shard_map tutorial with
parameters that stay sharded: the loss equals the one-process loss, and the gradient of each
block equals the matching block of the one-process gradient under ``grad``, ``vjp`` and
``.backward()``; AdamW steps written with ``optree.tree_map`` over GlobalTensors equal
``torch.optim.AdamW`` on the whole model, with the moments held as blocks; jvp and vmap through
the boundary; reshard round trips; DTensor round trips against DTensor's own layouts;
``gather_outputs=False``; maps over different axes nested.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import optree
import pytest
import torch
from torch.func import grad, jvp, vjp, vmap

import pshard as ps
from pshard._core.global_tensor import block_runs
from pshard._core.tree import tree_flatten as ps_tree_flatten

pytestmark = pytest.mark.filterwarnings(
    "ignore:`torch.jit.script` is deprecated:DeprecationWarning"
)

f64 = torch.float64
P = ps.P


def _close(a: Any, b: Any) -> None:
    la, ta = ps_tree_flatten(a)
    lb, tb = ps_tree_flatten(b)
    assert ta == tb, (ta, tb)
    for x, y in zip(la, lb, strict=True):
        assert x.shape == y.shape and x.dtype == y.dtype, (x.shape, y.shape, x.dtype, y.dtype)
        assert torch.allclose(x, y, rtol=1e-9, atol=1e-10), (x, y)


def _whole(*shape: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, dtype=f64, generator=g)


def _block(x: torch.Tensor, g: ps.GlobalTensor) -> torch.Tensor:
    """This rank's block of the whole ``x`` under ``g``'s layout (the oracle's slicing)."""
    mesh = g.mesh
    coord = {n: mesh.get_local_rank(n) for n in mesh.mesh_dim_names}
    runs = block_runs(g.meta, coord)
    out = x
    for d, r in enumerate(runs):
        index = torch.tensor([i for run in r for i in run], dtype=torch.long)
        out = out.index_select(d, index)
    return out


def _check_blocks(grads: dict, ref: dict, layout: dict) -> None:
    """Each gradient is a GlobalTensor of its parameter's layout holding the block of the
    one-process gradient, in a storage of its own size."""
    for k, g in grads.items():
        assert isinstance(g, ps.GlobalTensor) and g.meta == layout[k].meta, k
        _close(g.local, _block(ref[k], g))
        assert g.local.untyped_storage().nbytes() == g.local.numel() * g.local.element_size(), k
        _close(ps.gather(g), ref[k])


# --------------------------------------------------------------------------- the models


def _mlp(params: dict, x: torch.Tensor) -> torch.Tensor:
    """The one-process model: two layers, a sum of squares."""
    h = (x @ params["w1"] + params["b1"]).tanh()
    return ((h @ params["w2"]) ** 2).sum()


def _model(d_in: int, hidden: int, d_out: int) -> dict:
    return {
        "w1": _whole(d_in, hidden, seed=1),
        "b1": _whole(hidden, seed=2),
        "w2": _whole(hidden, d_out, seed=3),
    }


def _fsdp_gathered(params: dict, x: torch.Tensor) -> torch.Tensor:
    """FSDP as the map's reshard: the parameters enter whole (in_specs None), so the map
    gathers each GlobalTensor's blocks and returns its cotangent as a block (uneven too)."""
    return ps.psum(_mlp(params, x), "dp")


def _fsdp_explicit(params: dict, x: torch.Tensor) -> torch.Tensor:
    """FSDP as in JAX's tutorial: the blocks enter as they are, fn gathers them itself."""
    whole = {k: ps.all_gather(v, "dp", dim=0, tiled=True) for k, v in params.items()}
    return ps.psum(_mlp(whole, x), "dp")


def _fsdp_worker(nprocs: int) -> int:
    ps.init_mesh({"dp": nprocs})
    _fsdp_case((5, 7, 6), _fsdp_gathered, None)  # uneven, an empty block on 4 ranks
    _fsdp_case((4 * nprocs, 2 * nprocs, 2 * nprocs), _fsdp_explicit, P("dp"))
    return 2


def _fsdp_case(dims: tuple[int, int, int], body: Callable, pspec: Any) -> None:
    d_in, hidden, rows = dims
    whole = _model(d_in, hidden, 3)
    x = _whole(rows, d_in, seed=4)
    params = ps.shard(whole, P("dp"))
    loss = ps.shard_map(body, in_specs=(pspec, P("dp")), out_specs=P())
    ref_loss, ref = _mlp(whole, x), grad(_mlp)(whole, x)
    _close(loss(params, x), ref_loss)
    _check_blocks(grad(loss)(params, x), ref, params)
    # vjp with a cotangent of 2
    value, pull = vjp(lambda p: loss(p, x), params)
    _close(value, ref_loss)
    (ct,) = pull(torch.tensor(2.0, dtype=f64))
    _check_blocks(ct, {k: 2 * v for k, v in ref.items()}, params)
    # .backward() with the blocks as leaf tensors
    leaves = {
        k: ps.GlobalTensor(v.local.clone().requires_grad_(), v.meta) for k, v in params.items()
    }
    loss(leaves, x).backward()
    for k, v in leaves.items():
        _close(v.local.grad, _block(ref[k], v))
    # jvp through the boundary: tangents as GlobalTensors of the same layout
    cos = {k: v.cos() for k, v in whole.items()}
    _, dot = jvp(lambda p: loss(p, x), (params,), (ps.shard(cos, P("dp")),))
    _close(dot, jvp(lambda p: _mlp(p, x), (whole,), (cos,))[1])
    # vmap over a batch of inputs, and over stacked parameters
    xs = torch.stack([x, 2 * x])
    _close(vmap(lambda x: loss(params, x))(xs), vmap(lambda x: _mlp(whole, x))(xs))
    stacked = optree.tree_map(lambda t: torch.stack([t, -t]), params)
    stacked_whole = {k: torch.stack([v, -v]) for k, v in whole.items()}
    _close(vmap(lambda p: loss(p, x))(stacked), vmap(lambda p: _mlp(p, x))(stacked_whole))


@pytest.mark.parametrize("nprocs", [2, 4])
def test_fsdp_matches_one_process(pool: Any, nprocs: int) -> None:
    assert pool.run(nprocs, _fsdp_worker, nprocs) == [2] * nprocs


def _megatron(x: torch.Tensor, params: dict) -> torch.Tensor:
    """Column-parallel then row-parallel: hidden units split over "tp"."""
    h = (x @ params["w1"] + params["b1"]).tanh()
    return (ps.psum(h @ params["w2"], "tp") ** 2).sum()


def _tp_worker(nprocs: int) -> int:
    ps.init_mesh({"tp": nprocs})
    whole = _model(3, 3 * nprocs, 2)
    x = _whole(5, 3, seed=5)
    layout = {"w1": P(None, "tp"), "b1": P("tp"), "w2": P("tp", None)}
    params = ps.shard(whole, layout)
    loss = ps.shard_map(_megatron, in_specs=(None, layout), out_specs=P())
    _close(loss(x, params), _mlp(whole, x))
    _check_blocks(grad(loss, argnums=1)(x, params), grad(_mlp)(whole, x), params)
    # x's gradient is whole (replicated input), the one-process one
    _close(grad(loss)(x, params), grad(_mlp, argnums=1)(whole, x))
    return 1


@pytest.mark.parametrize("nprocs", [2])
def test_tensor_parallel_matches_one_process(pool: Any, nprocs: int) -> None:
    assert pool.run(nprocs, _tp_worker, nprocs) == [1] * nprocs


def _fsdp_tp(params: dict, x: torch.Tensor) -> torch.Tensor:
    """FSDP over "dp" (each rank holds a dp-block of its tp-block) x Megatron over "tp"."""
    w1 = ps.all_gather(params["w1"], "dp", dim=0)
    b1 = ps.all_gather(params["b1"], "dp", dim=0)
    w2 = ps.all_gather(params["w2"], "dp", dim=1)
    h = (x @ w1 + b1).tanh()
    y = ps.psum(h @ w2, "tp")
    return ps.psum((y**2).sum(), "dp")


def _adamw(params: dict, grads: dict, m: dict, v: dict, step: int) -> tuple:
    """AdamW written with optree.tree_map: works on GlobalTensors and on whole tensors."""
    lr, b1, b2, eps, wd = 0.05, 0.9, 0.99, 1e-8, 0.01
    m = optree.tree_map(lambda m, g: b1 * m + (1 - b1) * g, m, grads)
    v = optree.tree_map(lambda v, g: b2 * v + (1 - b2) * g * g, v, grads)
    c1, c2 = 1 - b1**step, 1 - b2**step

    def update(p: torch.Tensor, m: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return p * (1 - lr * wd) - lr * (m / c1) / ((v / c2).sqrt() + eps)

    return optree.tree_map(update, params, m, v), m, v


def _fsdp_tp_worker() -> int:
    ps.init_mesh({"dp": 2, "tp": 2})
    whole = _model(4, 8, 6)
    x = _whole(6, 4, seed=6)
    layout = {"w1": P("dp", "tp"), "b1": P(("tp", "dp")), "w2": P("tp", "dp")}
    inner = {"w1": P("dp", "tp"), "b1": P(("tp", "dp")), "w2": P("tp", "dp")}
    params = ps.shard(whole, layout)
    assert params["b1"].placements == (ps.StridedShard(0, 2), ps.Shard(0))
    loss = ps.shard_map(_fsdp_tp, in_specs=(inner, P("dp")), out_specs=P())
    _close(loss(params, x), _mlp(whole, x))
    _check_blocks(grad(loss)(params, x), grad(_mlp)(whole, x), params)
    # the same with the tensor-parallel layout only: the map gathers over "dp" itself
    tp_only = {"w1": P(None, "tp"), "b1": P("tp"), "w2": P("tp", None)}
    loss2 = ps.shard_map(
        lambda p, x: ps.psum(_megatron(x, p), "dp"), in_specs=(tp_only, P("dp")), out_specs=P()
    )
    _close(loss2(params, x), _mlp(whole, x))
    _check_blocks(grad(loss2)(params, x), grad(_mlp)(whole, x), params)
    # AdamW over GlobalTensors equals torch.optim.AdamW on the whole model
    m = optree.tree_map(torch.zeros_like, params)
    v = optree.tree_map(torch.zeros_like, params)
    ref = {k: t.clone().requires_grad_() for k, t in whole.items()}
    opt = torch.optim.AdamW(ref.values(), lr=0.05, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01)
    for step in range(1, 4):
        g = grad(loss)(params, x)
        params, m, v = _adamw(params, g, m, v, step)
        opt.zero_grad()
        _mlp(ref, x).backward()
        opt.step()
    _close(ps.gather(params), {k: t.detach() for k, t in ref.items()})
    for k, t in m.items():  # the moments are blocks: a quarter of each whole tensor per rank
        assert t.local.numel() * 4 == whole[k].numel(), k
    return 1


def test_fsdp_x_tensor_parallel_and_adamw(pool: Any) -> None:
    assert pool.run(4, _fsdp_tp_worker) == [1] * 4


# --------------------------------------------------------------------------- layouts


def _specs_2d(names: tuple[str, ...]) -> list[ps.P]:
    out = {P()}
    for a in names:
        out |= {P(a), P(None, a)}
    a, b = names
    out |= {P(a, b), P(b, a), P((a, b)), P((b, a)), P(None, (a, b)), P(None, (b, a))}
    return sorted(out, key=repr)


def _reshard_worker() -> int:
    mesh = ps.init_mesh({"dp": 2, "tp": 2})
    flat = ps.init_mesh({"world": 4})
    x = _whole(7, 5, seed=7)
    pairs = 0
    specs = _specs_2d(("dp", "tp"))
    for s1, s2 in itertools.product(specs, repeat=2):
        a = ps.shard(x, s1, mesh=mesh)
        assert torch.equal(a.local, _block(x, a))
        b = ps.reshard(a, s2)
        assert b.spec == ps.P(*s2, *([None] * (2 - len(s2)))) and torch.equal(b.local, _block(x, b))
        pairs += 1
    # another mesh over the same ranks, and back
    a = ps.shard(x, P(("dp", "tp")), mesh=mesh)
    b = ps.reshard(a, P(None, "world"), mesh=flat)
    assert b.mesh is flat and torch.equal(b.local, _block(x, b))
    assert torch.equal(ps.gather(ps.reshard(b, P("tp"), mesh=mesh)), x)
    # differentiable: the transpose of a reshard is the inverse reshard
    c = _whole(7, 5, seed=8)

    def f(w: torch.Tensor) -> torch.Tensor:
        g = ps.reshard(ps.shard(w, P("dp", "tp"), mesh=mesh), P(None, "world"), mesh=flat)
        return (ps.gather(g) * c).sum()

    _close(grad(f)(x), c)
    # gather_outputs=False: uneven outputs get their true global shape, in one exchange
    with ps.use_mesh(mesh):
        g = ps.shard_map(
            lambda x: (
                2 * x,
                ps.psum(x.sum(0, keepdim=True), "dp"),
                ps.psum(x.sum(), ("dp", "tp")),
            ),
            in_specs=P("dp", "tp"),
            out_specs=(P("dp", "tp"), P(None, "tp"), P()),
            gather_outputs=False,
        )
        y, colsum, total = g(x)
        assert isinstance(y, ps.GlobalTensor) and y.shape == (7, 5) and y.spec == P("dp", "tp")
        assert isinstance(colsum, ps.GlobalTensor) and colsum.shape == (1, 5)
        assert isinstance(total, torch.Tensor) and not isinstance(total, ps.GlobalTensor)
        _close(ps.gather(y), 2 * x)
        _close(total, x.sum())

        def h(x: torch.Tensor) -> torch.Tensor:
            y, colsum, _ = g(x)
            return (ps.gather(y) ** 2).sum() + (ps.gather(colsum) * c[:1]).sum()

        _close(grad(h)(x), 8 * x + c[:1].expand_as(x))
    return pairs


def test_reshard_round_trips_and_sharded_outputs(pool: Any) -> None:
    assert pool.run(4, _reshard_worker) == [len(_specs_2d(("dp", "tp"))) ** 2] * 4


def _dtensor_worker() -> int:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh = ps.init_mesh({"dp": 2, "tp": 2})
    checks = 0
    for shape, placements, spec in (
        ((7, 5), [Shard(0), Shard(1)], P("dp", "tp")),
        ((7, 5), [Shard(0), Shard(0)], P(("dp", "tp"))),
        ((7, 5), [Replicate(), Shard(1)], P(None, "tp")),
        ((8, 4), [_StridedShard(0, split_factor=2), Shard(0)], P(("tp", "dp"))),  # FSDP2 + TP
        ((5,), [Replicate(), Replicate()], P()),
    ):
        x = _whole(*shape, seed=9)
        d = distribute_tensor(x, mesh, placements)
        g = ps.from_dtensor(d)
        assert g.spec == ps.P(*spec, *([None] * (len(shape) - len(spec)))), (g.spec, spec)
        assert g.local.untyped_storage().data_ptr() == d.to_local().untyped_storage().data_ptr()
        assert torch.equal(g.local, _block(x, g)) and torch.equal(ps.gather(g), x)
        back = ps.to_dtensor(ps.shard(x, spec))
        assert tuple(back.placements) == tuple(d.placements)
        assert torch.equal(back.to_local(), d.to_local())
        assert torch.equal(back.full_tensor(), x)
        checks += 1
    return checks


def test_dtensor_round_trips(pool: Any) -> None:
    assert pool.run(4, _dtensor_worker) == [5] * 4


# --------------------------------------------------------------------------- nesting


def _nested_worker() -> int:
    """Parameters sharded over "dp" pass through a map over "sp" as GlobalTensors over "dp";
    inside, the body gathers them itself. The gradient of each block is the block of the
    one-process gradient."""
    ps.init_mesh({"dp": 2, "sp": 2})
    whole = _model(3, 5, 2)
    x = _whole(6, 3, seed=10)
    params = ps.shard(whole, P("dp"))

    def body(params: dict, x: torch.Tensor) -> torch.Tensor:
        assert isinstance(params["w1"], ps.GlobalTensor) and params["w1"].spec == P("dp", None)
        return ps.psum(_mlp(ps.gather(params), x), "sp")

    loss = ps.shard_map(body, axis_names={"sp"}, in_specs=(None, P("sp")), out_specs=P())
    _close(loss(params, x), _mlp(whole, x))
    _check_blocks(grad(loss)(params, x), grad(_mlp)(whole, x), params)
    # the same inside shard_map_seq: FSDP over "dp" x sequence parallel over "sp"
    seq = ps.shard_map_seq(body, axis="sp", in_specs=(None, ps.Shard(0)), out_specs=ps.Replicate())
    _close(seq(params, x), _mlp(whole, x))
    _check_blocks(grad(seq)(params, x), grad(_mlp)(whole, x), params)
    return 1


def test_maps_over_different_axes_nest(pool: Any) -> None:
    assert pool.run(4, _nested_worker) == [1] * 4


# --------------------------------------------------------------------------- torch.compile


def _compile_worker() -> int:
    """A GlobalTensor input through a compiled shard_map: the same loss, gradient and
    .backward() as eager."""
    torch._dynamo.reset()
    ps.init_mesh({"dp": 2})
    w, x = _whole(6, 4, seed=11), _whole(5, 6, seed=12)
    g = ps.shard(w, P("dp"))

    def body(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return ps.psum((x @ ps.all_gather(w, "dp")).tanh().sum(), "dp")

    f = ps.shard_map(body, in_specs=(P("dp"), P("dp")), out_specs=P())
    compiled = torch.compile(f, backend="aot_eager")
    _close(compiled(g, x), f(g, x))
    ref = grad(f)(g, x)
    local = g.local.clone().requires_grad_()
    compiled(ps.GlobalTensor(local, g.meta), x).backward()
    _close(local.grad, ref.local)
    out = torch.compile(
        ps.shard_map(lambda w: 2 * w, in_specs=P("dp"), out_specs=P("dp"), gather_outputs=False),
        backend="aot_eager",
    )(g)
    assert isinstance(out, ps.GlobalTensor) and out.meta == g.meta
    _close(out.local, 2 * g.local)
    return 1


def test_global_tensors_compile(procs: Any) -> None:
    assert procs.run(2, _compile_worker) == [1, 1]


# --------------------------------------------------------------------------- errors


def _message(f: Callable[[], Any]) -> str:
    try:
        f()
    except (ValueError, TypeError) as e:
        return str(e)
    return "no error"


def _errors_worker() -> dict:
    mesh = ps.init_mesh({"dp": 2})
    rank = mesh.get_local_rank("dp")
    out = {}
    # a block that does not fit the global shape the ranks agree on
    out["shape"] = _message(lambda: ps.from_local({"w": torch.zeros(3 + rank, 2)}, P("dp")))
    # ranks that disagree on a global shape (debug mode)
    with ps.debug(True):
        out["disagree"] = _message(
            lambda: ps.from_local(torch.zeros(2), P("dp"), global_shapes=(4,) if rank else (3,))
        )
    # check_rep: a replicated GlobalTensor whose blocks differ between ranks
    bad = ps.GlobalTensor(torch.full((2,), float(rank)), ps.shard(torch.zeros(2), P()).meta)
    out["rep"] = _message(
        lambda: ps.shard_map(lambda w: w, in_specs=P(), out_specs=P(), check_rep=True)(bad)
    )
    return out


def test_errors(pool: Any) -> None:
    r0, r1 = pool.run(2, _errors_worker)
    assert (
        "from_local tree['w'] (P('dp', None)): the blocks returned on the ranks of axes"
        in (r0["shape"])
    )
    assert r0["shape"] == r1["shape"]
    assert "from_local tree: the ranks disagree on the global shape" in r0["disagree"]
    assert (
        "check_rep: this GlobalTensor's blocks must be the same on the ranks of axes" in r0["rep"]
    )
