"""ps.checkpoint inside ps.jit: what the policy does not keep is computed again in the
program's backward (operations counted against the program without a checkpoint), collectives
issued again (counted per policy), the forward's random draws kept, every transform exact
against eager, and the program's peak memory (the live tensors of the graph in the order
aot_eager runs it) below that of the program that keeps everything."""

from __future__ import annotations

import operator

import pytest
import torch

import pshard as ps
from pshard import P

f64 = torch.float64
EXACT = {"rtol": 1e-10, "atol": 1e-12}
AOT = "aot_eager"
policies = ps.checkpoint_policies


def _x(r: int, *shape: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 10 * r)
    return torch.randn(*shape, dtype=f64, generator=g)


def _count(graph: torch.fx.GraphModule, name: str) -> int:
    return sum(1 for n in graph.graph.nodes if n.op == "call_function" and name in str(n.target))


def _peak(graph: torch.fx.GraphModule) -> int:
    """The most bytes of tensors alive at once when the graph runs in its order (a tensor
    lives from its node to its last reader; views and getitems share their base's bytes)."""
    nodes = list(graph.graph.nodes)
    base: dict[torch.fx.Node, torch.fx.Node] = {}
    for n in nodes:
        a = n.args[0] if n.args and isinstance(n.args[0], torch.fx.Node) else None
        view = n.op == "call_function" and (
            n.target is operator.getitem or getattr(n.target, "is_view", False)
        )
        base[n] = base[a] if view and a is not None else n
    last: dict[torch.fx.Node, int] = {}
    for i, n in enumerate(nodes):
        for a in n.all_input_nodes:
            last[base[a]] = i
    alive, peak, now = set(), 0, 0
    for i, n in enumerate(nodes):
        b = base[n]
        val = n.meta.get("val")
        if b is n and isinstance(val, torch.Tensor) and n.op != "placeholder":
            alive.add(n)
            now += val.numel() * val.element_size()
        peak = max(peak, now)
        for d in [d for d in alive if last.get(d, -1) <= i]:
            alive.discard(d)
            now -= d.meta["val"].numel() * d.meta["val"].element_size()
    return peak


# ---------------------------------------------------------------- compute recomputed


def _deep(policy):
    def layer(w, h):
        a = ps.checkpoint_name(torch.tanh(h @ w), "a")
        return torch.sin(a) * a + h

    def loss(ws, x):
        h = x
        for w in ws:
            h = layer(w, h) if policy is None else ps.checkpoint(layer, policy=policy)(w, h)
        return (h**2).sum()

    return torch.func.grad(loss)


@pytest.mark.parametrize(
    "policy, extra_mm, extra_tanh, extra_sin",
    [
        (policies.nothing_saveable, 6, 6, 6),
        (policies.dots_saveable, 0, 6, 6),
        (policies.save_only_these_names("a"), 0, 0, 6),
        (policies.save_anything_except_these_names("a"), 0, 6, 0),
        (policies.everything_saveable, 0, 0, 0),
    ],
)
def test_the_policy_decides_what_the_program_computes_again(
    policy, extra_mm, extra_tanh, extra_sin
) -> None:
    ps.init_mesh({"x": 1})
    ws = [_x(i, 32, 32) / 6 for i in range(6)]
    x = _x(9, 64, 32)
    plain = ps.jit(_deep(None), backend=AOT)
    remat = ps.jit(_deep(policy), backend=AOT)
    torch.testing.assert_close(remat(ws, x), _deep(policy)(ws, x), **EXACT)
    torch.testing.assert_close(remat(ws, x), plain(ws, x), **EXACT)
    g0, g1 = plain.lower(ws, x).graph, remat.lower(ws, x).graph
    assert _count(g1, "aten.mm") - _count(g0, "aten.mm") == extra_mm
    assert _count(g1, "aten.tanh.") - _count(g0, "aten.tanh.") == extra_tanh
    assert _count(g1, "aten.sin.") - _count(g0, "aten.sin.") == extra_sin
    assert (_count(g1, "remat_barrier") > 0) == (extra_mm + extra_tanh + extra_sin > 0)
    if policy is policies.nothing_saveable:  # every layer keeps its input alone
        assert _peak(g1) < 0.6 * _peak(g0), (_peak(g1), _peak(g0))


def test_the_recompute_waits_for_the_backward_under_inductor() -> None:
    """Inductor keeps the recompute (the barrier's copies are new values it cannot merge
    with the forward's: the generated code computes tanh twice per layer, once without
    checkpoints) and computes the same numbers."""
    from torch._inductor.utils import run_and_get_code

    ps.init_mesh({"x": 1})
    ws = [_x(i, 8, 8) / 3 for i in range(2)]
    x = _x(9, 4, 8)
    for policy, tanhs in ((policies.nothing_saveable, 4), (policies.everything_saveable, 2)):
        f = _deep(policy)
        jitted = ps.jit(f, backend="inductor")
        got, code = run_and_get_code(lambda: jitted(ws, x))  # noqa: B023
        torch.testing.assert_close(got, f(ws, x), rtol=1e-9, atol=1e-12)
        assert "\n".join(code).count("tanh(") == tanhs


# ---------------------------------------------------------------- collectives issued again


def rank_gathers(policy) -> tuple:
    ps.init_mesh({"x": 2})
    layers = 3
    ws = [_x(i, 8, 8) / 3 for i in range(layers)]  # split over "x" by rows
    d = _x(0, 10, 8, seed=1)

    def layer(w, h):
        whole = ps.checkpoint_name(ps.all_gather(w, "x", dim=0, tiled=True), "gather")
        return torch.tanh(h @ whole) * 2 + h

    def loss(ws, d):
        def body(ws, d):
            h = d
            for w in ws:
                h = ps.checkpoint(layer, policy=policy)(w, h)
            return ps.psum((h**2).sum(), "x")

        return ps.shard_map(body, in_specs=(P("x"), P("x")), out_specs=P())(ws, d)

    f = torch.func.grad(loss)
    jitted = ps.jit(f, backend=AOT)
    names = [n for n, _ in jitted.lower(ws, d).collectives]
    return jitted(ws, d), f(ws, d), names


@pytest.mark.parametrize(
    "policy, gathers",
    [
        (policies.nothing_saveable, 3),  # each layer's forward again, gather included
        (policies.save_collectives, 0),  # the gathers kept
        (policies.recompute_collectives, 2),  # gathered again where the backward needs them
        (policies.save_anything_except_these_names("gather"), 2),  # FSDP's reshard
        (policies.everything_saveable, 0),
    ],
)
def test_collectives_are_issued_again_as_the_policy_says(pool, policy, gathers) -> None:
    """Three gathers in the forward, three of the gradients' blocks at the map's boundary,
    and those the backward issues again: the backward of the first layer needs its weight only
    when its tanh is computed again (its input is data)."""
    for r, (got, want, names) in enumerate(pool.run(2, rank_gathers, policy)):
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, **EXACT, msg=f"rank {r}")
        assert names.count("all_gather") == 3 + 3 + gathers, names
        assert names.count("psum_scatter") == 3, names  # the gathers' transposes, once each


def rank_sharded_call() -> tuple:
    ps.init_mesh({"dp": 2})
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(3)]).double()
    params = ps.shard({k: v.detach() for k, v in model.named_parameters()}, P("dp"))
    x = _x(0, 8, 8, seed=2)

    def loss(params, x):
        def body(blocks, x):
            out = ps.sharded_call(model, blocks, (x,), specs=P("dp"), units=[torch.nn.Linear])
            return ps.psum((torch.tanh(out) ** 2).sum(), "dp")

        return ps.shard_map(body, in_specs=(P("dp"), P("dp")), out_specs=P())(params, x)

    f = torch.func.grad(loss)
    jitted = ps.jit(f, backend=AOT)
    names = [n for n, _ in jitted.lower(params, x).collectives]
    got, want = jitted(params, x), f(params, x)
    return [(got[k].local, want[k].local) for k in want], names


def test_sharded_call_gathers_again_in_the_program(pool) -> None:
    """FSDP's reshard-after-forward holds in a program: the weights the backward needs (every
    unit's but the first's, whose input is data) are gathered again, not kept; a unit's
    parameters are gathered (and their gradients reduce-scattered) in one exchange."""
    for r, (pairs, names) in enumerate(pool.run(2, rank_sharded_call)):
        for got, want in pairs:
            torch.testing.assert_close(got, want, **EXACT, msg=f"rank {r}")
        assert names.count("all_gather") == 3 + 2, names  # each unit, then units 2 and 3
        assert names.count("psum_scatter") == 3, names


# ---------------------------------------------------------------- random draws, transforms


def test_random_draws_are_kept_and_equal_eager() -> None:
    ps.init_mesh({"x": 1})
    w, x = _x(0, 16, 16) / 4, _x(1, 8, 16)

    def layer(w, h):
        return torch.nn.functional.dropout(torch.tanh(h @ w), 0.4, training=True) + h

    def loss(w, x):
        return (ps.checkpoint(layer)(w, ps.checkpoint(layer)(w, x)) ** 2).sum()

    f = torch.func.grad(loss)
    jitted = ps.jit(f, backend=AOT)
    jitted(w, x)
    torch.manual_seed(5)
    got = jitted(w, x)
    after_program = torch.get_rng_state()
    torch.manual_seed(5)
    want = f(w, x)
    torch.testing.assert_close(got, want, **EXACT)
    assert torch.equal(after_program, torch.get_rng_state())
    graph = jitted.lower(w, x).graph
    draws = [
        n
        for n in graph.graph.nodes
        if isinstance(n.target, torch._ops.OpOverload)
        and torch.Tag.nondeterministic_seeded in n.target.tags
    ]
    assert len(draws) == 2, draws  # one per layer: the recompute draws nothing
    assert _count(graph, "aten.tanh.") == 4  # but computes the layers again


def test_transforms_of_checkpointed_code_in_a_program() -> None:
    """Per-example gradients (vmap of grad), a Hessian-vector product (jvp of grad) and a
    checkpoint inside a checkpoint: eager's numbers."""
    ps.init_mesh({"x": 1})
    w, xs, v = _x(0, 6, 6) / 3, _x(1, 5, 3, 6), _x(2, 6, 6)

    def layer(w, h):
        return torch.sin(torch.tanh(h @ w)) + h

    def loss(w, x):
        inner = ps.checkpoint(lambda w, h: layer(w, ps.checkpoint(layer)(w, h)))
        return (inner(w, x) ** 2).sum()

    per_example = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))

    def hvp(w, x, v):
        return torch.func.jvp(lambda w: torch.func.grad(loss)(w, x), (w,), (v,))[1]

    for f, args in ((per_example, (w, xs)), (hvp, (w, xs[0], v))):
        jitted = ps.jit(f, backend=AOT)
        torch.testing.assert_close(jitted(*args), f(*args), **EXACT)
        assert _count(jitted.lower(*args).graph, "remat_barrier") > 0, f


def test_a_donated_step_with_checkpoints_keeps_its_buffers() -> None:
    """The program is made functional before it computes again; donated outputs still take
    their inputs' storage."""
    ps.init_mesh({"x": 1})
    tx = ps.optim.adamw(1e-2)
    params = {"w": _x(0, 8, 8) / 3}
    state = tx.init(params)
    x = _x(1, 4, 8)

    def loss(params, x):
        return (ps.checkpoint(lambda w, h: torch.tanh(h @ w))(params["w"], x) ** 2).sum()

    def step(params, state, x):
        grads = torch.func.grad(loss)(params, x)
        updates, state = tx.update(grads, state, params)
        return ps.optim.apply_updates(params, updates), state

    eager = step(params, state, x)
    jitted = ps.jit(step, donate_argnums=(0, 1), backend=AOT)
    donated = {"w": params["w"].clone()}
    ptr = donated["w"].untyped_storage().data_ptr()
    got = jitted(donated, tx.init(donated), x)
    torch.testing.assert_close(got[0]["w"], eager[0]["w"], **EXACT)
    assert got[0]["w"].untyped_storage().data_ptr() == ptr


def test_hugging_face_checkpointed_layers_in_a_program() -> None:
    """ps.checkpoint_layers of a Llama: each decoder layer a region of the program (its
    attention and MLP computed again in the backward), the gradients eager's."""
    transformers = pytest.importorskip("transformers")
    ps.init_mesh({"x": 1})
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).double().train()
    params = {k: v.detach() for k, v in model.named_parameters()}
    ids = torch.randint(0, 64, (2, 16))

    def loss(p, ids):
        return torch.func.functional_call(model, p, (ids,), {"labels": ids, "use_cache": False})

    f = torch.func.grad(lambda p, ids: loss(p, ids).loss)
    plain = ps.jit(f, backend=AOT).lower(params, ids).graph
    ps.checkpoint_layers(model)
    jitted = ps.jit(f, backend=AOT)
    got, want = jitted(params, ids), f(params, ids)
    for k in want:
        torch.testing.assert_close(got[k], want[k], **EXACT, msg=k)
    graph = jitted.lower(params, ids).graph
    assert _count(graph, "remat_barrier") == 3
    assert _count(graph, "aten.mm") > _count(plain, "aten.mm")
    assert _peak(graph) < _peak(plain)


def test_microbatches_of_checkpointed_code_in_a_program() -> None:
    """pmap_microbatch over a checkpointed layer (its batch-dim analysis traces the layer
    too): eager's gradient, every microbatch's layer computed again."""
    ps.init_mesh({"x": 1})
    w, d = _x(0, 8, 8) / 3, _x(1, 12, 8)
    layer = ps.checkpoint(lambda w, h: torch.sin(torch.tanh(h @ w)))

    def loss(w, d):
        return ps.pmap_microbatch(
            lambda w, d: (layer(w, d) ** 2).mean(), num_microbatches=3,
            in_specs=(None, ps.Shard(0)), out_specs=ps.Partial("mean"),
        )(w, d)  # fmt: skip

    f = torch.func.grad(loss)
    jitted = ps.jit(f, backend=AOT)
    torch.testing.assert_close(jitted(w, d), f(w, d), **EXACT)
    assert _count(jitted.lower(w, d).graph, "remat_barrier") == 3


def rank_sharded_call_layouts(world: int, spec: tuple, dtype: torch.dtype | None) -> list:
    mesh = {"dp": world} if len(spec) == 1 else {"dp": 2, "tp": 2}
    ps.init_mesh(mesh)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(7, 10), torch.nn.Tanh(), torch.nn.Linear(10, 5), torch.nn.Tanh(),
        torch.nn.Linear(5, 3),
    ).double()  # fmt: skip
    specs = P(spec if len(spec) > 1 else spec[0])
    params = ps.shard({k: v.detach() for k, v in model.named_parameters()}, specs)
    x = _x(0, 2 * world, 7, seed=2)

    def loss(params, x):
        def body(blocks, x):
            out = ps.sharded_call(
                model, blocks, (x,), specs=specs, units=[torch.nn.Linear], param_dtype=dtype
            )
            return ps.psum((out.double() ** 2).sum(), "dp")

        return ps.shard_map(body, in_specs=(specs, P("dp")), out_specs=P())(params, x)

    f = torch.func.grad(loss)
    got, want = ps.jit(f, backend=AOT)(params, x), f(params, x)
    return [(got[k].local, want[k].local) for k in want]


@pytest.mark.parametrize(
    "world, spec, dtype",
    [(3, ("dp",), None), (4, ("dp", "tp"), None), (2, ("dp",), torch.float32)],
)
def test_sharded_call_programs_with_uneven_and_nested_blocks(pool, world, spec, dtype) -> None:
    """A unit's parameters gathered in one exchange per axis and dtype: blocks of 10, 5 and
    3 rows over 3 ranks (padded), split over two axes (the second level per parameter), and
    mixed precision (float64 masters gathered and computed in float32, their gradients
    reduced in float32): eager's numbers."""
    tol = EXACT if dtype is None else {"rtol": 1e-6, "atol": 1e-6}
    for r, pairs in enumerate(pool.run(world, rank_sharded_call_layouts, world, spec, dtype)):
        for got, want in pairs:
            assert got.dtype == want.dtype == f64
            torch.testing.assert_close(got, want, **tol, msg=f"rank {r}")


def test_a_program_without_a_backward_is_left_as_traced() -> None:
    """A checkpointed call in a program that differentiates nothing: one forward, no barrier,
    the program as traced (not made functional: an in-place write stays one)."""
    ps.init_mesh({"x": 1})

    def f(w, x):
        h = ps.checkpoint(lambda w, x: torch.tanh(x @ w))(w, x)
        return h.mul_(2)

    w, x = _x(0, 4, 4), _x(1, 3, 4)
    jitted = ps.jit(f, backend=AOT)
    torch.testing.assert_close(jitted(w, x), f(w, x), **EXACT)
    graph = jitted.lower(w, x).graph
    assert _count(graph, "remat_barrier") == 0 and _count(graph, "aten.tanh.") == 1
    assert _count(graph, "aten.mul_.") == 1
