"""torch.compile: every collective, shard_map, shard_map_seq with Ulysses and ring attention, and
pmap_microbatch, compiled with aot_eager and inductor on 2 gloo ranks, against eager (float64,
outputs and gradients through .backward() and torch.func.grad); collectives captured in the graph
(torch._dynamo.explain: no graph break); no state written into the mesh; a compiled function run
in a mesh where its axes have another size refuses. Compiled cases are few and small: inductor
compiles C++ for every graph."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import pshard as ps

BACKENDS = ("aot_eager", "inductor")
TOL = {"rtol": 1e-10, "atol": 1e-12}


def _fresh() -> None:
    """A clean dynamo cache (the pool's workers outlive each test); inductor compiles in-process."""
    torch._dynamo.reset()
    torch._inductor.config.compile_threads = 1


def _close(a, b) -> None:
    for x, y in zip(
        torch.utils._pytree.tree_leaves(a), torch.utils._pytree.tree_leaves(b), strict=True
    ):
        torch.testing.assert_close(x, y, **TOL)


def _every_collective(x: torch.Tensor) -> torch.Tensor:
    y = ps.psum(torch.sin(x) * 2, "x")
    y = ps.all_gather(y, "x", dim=0)
    y = ps.psum_scatter(y * y, "x", dim=0)
    y = ps.all_to_all(y.reshape(3, 2), "x", split_dim=1, concat_dim=0)
    y = ps.ppermute(y.reshape(-1), "x", [(0, 1), (1, 0)])
    y = ps.all_gather(y, "x", dim=0, tiled=False) + 1
    y = ps.psum_scatter(y, "x", dim=0, tiled=False)
    y = ps.pmax(y, "x") * ps.pmin(y, "x") + ps.broadcast(y, "x", src=1) + ps.pmean(y, "x")
    return (y**2).sum()


def _collectives_body(backend: str) -> None:
    _fresh()
    ps.init_mesh({"x": 2})
    x = torch.linspace(-1, 2, 6, dtype=torch.float64) * (dist.get_rank() + 1)
    compiled = torch.compile(_every_collective, backend=backend)
    _close(compiled(x), _every_collective(x))
    # .backward() through the compiled graph (the ops' autograd rules)
    xc, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
    compiled(xc).backward()
    _every_collective(xe).backward()
    _close(xc.grad, xe.grad)
    # torch.func.grad inside the compiled region: it runs eagerly with the exact rules
    grad = torch.compile(torch.func.grad(_every_collective), backend=backend)
    _close(grad(x), torch.func.grad(_every_collective)(x))
    # and jvp: the same tangent as eager (never zeros)
    tangent = torch.ones_like(x)

    def jvp(x):
        return torch.func.jvp(_every_collective, (x,), (tangent,))

    _close(torch.compile(jvp, backend=backend)(x), jvp(x))


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_collective_compiles_equal_to_eager(procs, backend):
    procs.run(2, _collectives_body, backend)


def _three(x: torch.Tensor) -> torch.Tensor:
    y = ps.psum(x * 2, "x")
    y = ps.all_gather(y.sin(), "x", dim=0)
    return ps.psum_scatter(y.cos(), "x", dim=0)


def _explain_body() -> tuple[int, int, list[str]]:
    _fresh()
    mesh = ps.init_mesh({"x": 2})
    with ps.use_mesh(mesh):
        report = torch._dynamo.explain(_three)(torch.ones(4))
    ops = [
        str(node.target)
        for graph in report.graphs
        for node in graph.graph.nodes
        if node.op == "call_function" and "pshard" in str(node.target)
    ]
    return report.graph_count, report.graph_break_count, ops


def test_three_collectives_make_one_graph(procs):
    for graphs, breaks, ops in procs.run(2, _explain_body):
        assert (graphs, breaks) == (1, 0)
        assert ops == [f"pshard.{op}.default" for op in ("psum", "all_gather", "psum_scatter")]


def _state_body() -> list:
    ps.init_mesh({"x": 2})
    mesh = ps.current_mesh()
    before = dict(vars(mesh))
    ps.psum(torch.ones(2), "x")
    ps.axis_index(("x",))
    return sorted(set(vars(mesh)) - set(before))


def test_no_state_written_into_the_mesh(procs):
    assert procs.run(2, _state_body) == [[], []]


def _other_mesh_body() -> str:
    _fresh()
    ps.init_mesh({"x": 2})
    f = torch.compile(lambda t: ps.psum(t, "x") * 2, backend="aot_eager")
    assert torch.equal(f(torch.ones(3)), torch.full((3,), 4.0))
    other = init_device_mesh("cpu", (2, 1), mesh_dim_names=("y", "x"))  # "x" has size 1 here
    with ps.use_mesh(other), pytest.raises(RuntimeError, match="traced with axis 'x' of size 2"):
        f(torch.ones(3))
    return "ok"


def test_compiled_function_refuses_a_mesh_with_other_sizes(procs):
    assert procs.run(2, _other_mesh_body) == ["ok", "ok"]


# --- transforms -----------------------------------------------------------------------------------


def _shard_map_body(backend: str) -> None:
    _fresh()
    ps.init_mesh({"x": 2})
    torch.manual_seed(0)
    w = torch.randn(3, 3, dtype=torch.float64)
    x = torch.randn(5, 3, dtype=torch.float64)  # 5 rows on 2 ranks: uneven, padded

    def loss(w, x):
        return ps.psum(((x @ w).tanh() ** 2).sum(), "x")

    mapped = ps.shard_map(loss, in_specs=(ps.P(), ps.P("x")), out_specs=ps.P())
    grad = torch.func.grad(mapped)
    _close(torch.compile(grad, backend=backend)(w, x), grad(w, x))
    _close(torch.func.grad(lambda w: ((x @ w).tanh() ** 2).sum())(w), grad(w, x))
    _close(torch.compile(mapped, backend=backend)(w, x), mapped(w, x))


@pytest.mark.parametrize("backend", BACKENDS)
def test_grad_of_shard_map_compiles(procs, backend):
    procs.run(2, _shard_map_body, backend)


def _attention_body(kind: str, backend: str) -> None:
    _fresh()
    ps.init_mesh({"sp": 2})
    torch.manual_seed(0)
    attend = ps.ulysses_attention if kind == "ulysses" else ps.ring_attention
    q, k, v = (torch.randn(1, 11, 2, 4, dtype=torch.float64) for _ in range(3))
    layer = ps.shard_map_seq(
        lambda q, k, v: attend(q, k, v, causal=True),
        in_specs=ps.Shard(1), out_specs=ps.Shard(1), layout="zigzag", axis="sp",
    )  # fmt: skip

    def step(q, k, v):
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        out = layer(q, k, v)
        (out**2).sum().backward()
        return out.detach(), q.grad, k.grad, v.grad

    compiled = step(q, k, v), torch.compile(step, backend=backend)(q, k, v)
    _close(*compiled)
    full = torch.nn.functional.scaled_dot_product_attention(
        *(t.transpose(1, 2) for t in (q, k, v)), is_causal=True
    ).transpose(1, 2)
    _close(compiled[1][0], full)


# each attention once, each backend once (the collectives run under both just above)
@pytest.mark.parametrize(("kind", "backend"), [("ulysses", "inductor"), ("ring", "aot_eager")])
def test_sequence_parallel_attention_compiles(procs, kind, backend):
    procs.run(2, _attention_body, kind, backend)


def _microbatch_body(backend: str) -> None:
    _fresh()
    ps.init_mesh({"x": 2})
    torch.manual_seed(dist.get_rank())
    w = torch.randn(3, 3, dtype=torch.float64)
    x = torch.randn(7, 3, dtype=torch.float64)

    def loss(w, x):
        return ps.pmean(((x @ w).tanh() ** 2).mean(), "x")

    step = ps.pmap_microbatch(
        torch.func.grad_and_value(loss), num_microbatches=3,
        in_specs=(ps.Replicate(), ps.Shard(0)),
        out_specs=(ps.Partial("mean"), ps.Partial("mean")),
    )  # fmt: skip
    _close(torch.compile(step, backend=backend)(w, x), step(w, x))


@pytest.mark.parametrize("backend", BACKENDS)
def test_microbatched_grad_and_value_compiles(procs, backend):
    procs.run(2, _microbatch_body, backend)


@pytest.mark.parametrize("spec", ["mean", "sum", "max", "concat"])
def test_microbatch_merges_compile_equal_to_eager(spec):
    # the streaming reducers once gave a wrong mean under aot_eager (in-place accumulators
    # across graph breaks)
    _fresh()
    x = torch.linspace(-2, 3, 10, dtype=torch.float64).reshape(5, 2)
    out_spec = ps.Shard(0) if spec == "concat" else ps.Partial(spec)
    step = ps.pmap_microbatch(
        lambda x: x.sin() if spec == "concat" else (x.sin() ** 2).sum(),
        num_microbatches=3, out_specs=out_spec,
    )  # fmt: skip
    _close(torch.compile(step, backend="aot_eager")(x), step(x))
