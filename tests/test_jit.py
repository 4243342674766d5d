"""ps.jit against eager: every collective a node of one program (counted, in order, with its
axis), torch.func transforms of shard_map, a whole FSDP training step (sharded_call, clipping,
AdamW with a schedule, apply_updates) over several steps with one program, GlobalTensors in and
out, donation, the cache and its signature, dropout's numbers, the errors (a value read while
tracing naming its line, calls that cannot be traced), threads and gloo processes; the
aot_eager backend (the same trace, no code generation) except one inductor step."""

from __future__ import annotations

import re

import pytest
import torch
import torch._dynamo

import pshard as ps
from pshard import P

f64 = torch.float64
EXACT = {"rtol": 1e-10, "atol": 1e-12}
AOT = "aot_eager"


def _x(r: int, *shape: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 10 * r)
    return torch.randn(*shape, dtype=f64, generator=g)


# ---------------------------------------------------------------- collectives


def _all_collectives(x: torch.Tensor) -> torch.Tensor:
    a = ps.psum(torch.sin(x), "x")
    b = ps.pmax(x * 2, "x")
    c = ps.all_gather(a + b, "x", dim=0)
    d = ps.psum_scatter(c * 3, "x", dim=0)
    e = ps.all_to_all(d.reshape(2, -1), "x", split_dim=1, concat_dim=0)
    f = ps.ppermute(e, "x", [(0, 1), (1, 0)])
    return ps.broadcast(f, "x", src=1).sum() + ps.pmin(x, "x").sum()


def rank_collectives() -> tuple:
    ps.init_mesh({"x": 2})
    x = _x(ps.axis_index("x"), 4, 3)
    jitted = ps.jit(_all_collectives, backend=AOT)
    lowered = jitted.lower(x)
    got = jitted(x)
    assert torch.equal(lowered.compile(AOT)(x), got)  # the lowered program, compiled by hand
    with pytest.raises(TypeError, match="do not have the signature the program was traced for"):
        lowered.compile(AOT)(torch.ones(5, 3, dtype=f64))
    grad = ps.jit(torch.func.grad(_all_collectives), backend=AOT)(x)
    return (got, _all_collectives(x)), (grad, torch.func.grad(_all_collectives)(x)), lowered


def test_collectives_are_nodes_of_one_program(pool) -> None:
    for r, ((got, want), (grad, grad_want), lowered) in enumerate(pool.run(2, rank_collectives)):
        torch.testing.assert_close(got, want, **EXACT, msg=f"rank {r}")
        torch.testing.assert_close(grad, grad_want, **EXACT, msg=f"rank {r}")
        names = [name for name, _ in lowered.collectives]
        assert names == ["psum", "pextreme", "all_gather", "psum_scatter", "all_to_all",
                         "ppermute", "broadcast", "pextreme"], names  # fmt: skip
        assert {axis for _, axis in lowered.collectives} == {"x"}
        targets = [str(n.target) for n in lowered.graph.graph.nodes if n.op == "call_function"]
        pshard_ops = [t for t in targets if t.startswith("pshard.")]
        assert len(pshard_ops) == len(names)
        assert not [t for t in targets if "c10d" in t], "raw c10d calls in the program"
        assert "pshard.psum" in lowered.as_text()


# ---------------------------------------------------------------- transforms of shard_map


def _loss(w: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    def body(w, d):
        return ps.psum((torch.tanh(d @ w.T) ** 2).sum(), "x")

    return ps.shard_map(body, in_specs=(P(), P("x")), out_specs=P())(w, d)


def rank_transforms() -> list:
    ps.init_mesh({"x": 2})
    w, d = _x(0, 4, 3), _x(0, 8, 3, seed=1)
    t = _x(0, 4, 3, seed=2)
    cases = {
        "grad": lambda w, d: torch.func.grad(_loss)(w, d),
        "vjp": lambda w, d: torch.func.vjp(lambda w: _loss(w, d), w)[1](torch.ones((), dtype=f64)),
        "jvp": lambda w, d: torch.func.jvp(lambda w: _loss(w, d), (w,), (t,)),
        "hessian-vector": lambda w, d: torch.func.jvp(
            lambda w: torch.func.grad(_loss)(w, d), (w,), (t,)
        )[1],
        "per-example grads": lambda w, d: torch.func.vmap(
            torch.func.grad(lambda w, row: (torch.tanh(row @ w.T) ** 2).sum()), (None, 0)
        )(w, d),
    }  # fmt: skip
    return [(k, ps.jit(f, backend=AOT)(w, d), f(w, d)) for k, f in cases.items()]


def test_torch_func_transforms_of_shard_map(pool) -> None:
    for r, results in enumerate(pool.run(2, rank_transforms)):
        for name, got, want in results:
            torch.testing.assert_close(got, want, **EXACT, msg=f"rank {r}: {name}")


# ---------------------------------------------------------------- a training step


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(),
        torch.nn.Linear(16, 4),
    ).double()  # fmt: skip


def _training(model: torch.nn.Module, mesh: str) -> tuple:
    """``step(params, state, x, y) -> (params, state, loss)``: FSDP over ``mesh`` with
    sharded_call, clipping and AdamW on a schedule."""
    specs = P(mesh)
    tx = ps.optim.chain(
        ps.optim.clip_by_global_norm(0.05),
        ps.optim.adamw(ps.optim.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 6), weight_decay=0.1),
    )

    def loss(params, x, y):
        def body(blocks, x, y):
            out = ps.sharded_call(model, blocks, (x,), specs=specs, units=[torch.nn.Linear])
            return ps.psum(((out - y) ** 2).sum(), mesh) / 16

        return ps.shard_map(body, in_specs=(specs, P(mesh), P(mesh)), out_specs=P())(params, x, y)

    def step(params, state, x, y):
        grads, value = torch.func.grad_and_value(loss)(params, x, y)
        updates, state = tx.update(grads, state, params)
        return ps.optim.apply_updates(params, updates), state, value

    return tx, step


def rank_training(backend: str, steps: int) -> dict:
    ps.init_mesh({"dp": torch.distributed.get_world_size()})
    model = _model()
    tx, step = _training(model, "dp")
    params = ps.shard({k: v.detach() for k, v in model.named_parameters()}, P("dp"))
    state = tx.init(params)
    jitted = ps.jit(step, donate_argnums=(0, 1), backend=backend)
    eager, compiled = (
        (params, state),
        (
            {k: ps.GlobalTensor(v.local.clone(), v.meta) for k, v in params.items()},
            tx.init(params),
        ),
    )
    losses = []
    donated_kept = []
    for i in range(steps):
        x, y = _x(i, 16, 8, seed=5), _x(i, 16, 4, seed=6)
        *eager, want = step(*eager, x, y)
        before = {k: v.local.untyped_storage().data_ptr() for k, v in compiled[0].items()}
        # after the first call: no recompiling, not even the compiler's
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            *compiled, got = jitted(*compiled, x, y)
        donated_kept.append(
            all(compiled[0][k].local.untyped_storage().data_ptr() == p for k, p in before.items())
        )
        losses.append((got, want))
    return {
        "losses": losses,
        "params": [(compiled[0][k].local, eager[0][k].local) for k in eager[0]],
        "moments": [(compiled[1][1].mu[k].local, eager[1][1].mu[k].local) for k in eager[0]],
        "count": (compiled[1][1].count, eager[1][1].count),
        "programs": jitted.cache_size(),
        "global": all(isinstance(v, ps.GlobalTensor) for v in compiled[0].values()),
        "donated": donated_kept,
    }


def _check_training(results: list[dict], tol: dict) -> None:
    for r, res in enumerate(results):
        for got, want in res["losses"]:
            torch.testing.assert_close(got, want, **tol, msg=f"rank {r}")
        for got, want in res["params"] + res["moments"]:
            torch.testing.assert_close(got, want, **tol, msg=f"rank {r}")
        assert int(res["count"][0]) == int(res["count"][1])
        assert res["programs"] == 1, "one program serves every step"
        assert res["global"] and all(res["donated"]), res["donated"]


def test_a_training_step_is_one_program(pool) -> None:
    _check_training(pool.run(2, rank_training, AOT, 4), EXACT)


def test_a_training_step_on_gloo_processes(procs) -> None:
    _check_training(procs.run(2, rank_training, AOT, 2), EXACT)


def test_a_training_step_with_inductor(pool) -> None:
    """Generated code: the same numbers to float64 rounding (its own order of operations)."""
    _check_training(pool.run(2, rank_training, "inductor", 2), {"rtol": 1e-9, "atol": 1e-12})


def rank_ragged(backend: str) -> list:
    """ragged_all_to_all in a program: the counts are data (one program for every count)."""
    ps.init_mesh({"ep": 2})
    r = ps.axis_index("ep")
    w = torch.arange(1.0, 3.0, dtype=f64)

    def loss(x, send):
        y, recv = ps.ragged_all_to_all(x, send, "ep")
        return ((y * w) ** 2).sum() + recv.sum()

    grad = torch.func.grad(loss)
    jitted = ps.jit(grad, backend=backend)
    out = []
    for counts in ([[1, 2], [3, 0]], [[3, 0], [0, 3]], [[0, 3], [2, 1]]):
        x, send = _x(r, 3, 2), torch.tensor(counts[r])
        out.append((jitted(x, send), grad(x, send)))
    return [out, jitted.cache_size(), jitted.lower(x, send).collectives]


@pytest.mark.parametrize("backend", [AOT, "inductor"])
def test_ragged_all_to_all_in_a_program(pool, backend: str) -> None:
    for r, (pairs, programs, collectives) in enumerate(pool.run(2, rank_ragged, backend)):
        for got, want in pairs:
            torch.testing.assert_close(got, want, **EXACT, msg=f"rank {r}")
        assert programs == 1
        assert [name for name, _ in collectives] == ["ragged_all_to_all"] * 2  # and its transpose


# ---------------------------------------------------------------- signatures and the cache


def test_the_cache_and_the_signature() -> None:
    ps.init_mesh({"x": 1})
    traced = []

    def f(x, scale, n):
        traced.append(n)  # a side effect: at trace time only
        return x * scale + n

    jitted = ps.jit(f, static_argnums=(2,), backend=AOT)
    x = torch.ones(3, dtype=f64)
    assert torch.equal(jitted(x, 2.0, 1), f(x, 2.0, 1))
    jitted(x + 1, 2.0, 1)  # new values, the same signature
    assert jitted.cache_size() == 1 and traced == [1, 1]  # (one trace; one eager call above)
    jitted(x, 3.0, 1)  # a non-tensor leaf is part of the signature
    jitted(x, 2.0, 2)  # so is a static argument
    jitted(torch.ones(4, dtype=f64), 2.0, 1)  # and a shape
    jitted(torch.ones(3), 2.0, 1)  # and a dtype
    assert jitted.cache_size() == 5
    with pytest.raises(TypeError, match="static argument 0 is a list"):
        ps.jit(f, static_argnums=0, backend=AOT)([1], 2.0, 1)


def test_nested_jit_is_part_of_the_outer_program() -> None:
    ps.init_mesh({"x": 1})
    inner = ps.jit(lambda x: x * 2, backend=AOT)
    outer = ps.jit(lambda x: inner(x) + 1, backend=AOT)
    x = torch.ones(2, dtype=f64)
    assert torch.equal(outer(x), x * 2 + 1) and inner.cache_size() == 0


def test_dropout_draws_the_eager_numbers() -> None:
    ps.init_mesh({"x": 1})

    def f(x):
        return torch.nn.functional.dropout(x, 0.5, training=True) * 3

    jitted = ps.jit(f, backend=AOT)
    x = torch.ones(64, dtype=f64)
    jitted(x)  # traced (and a first draw)
    torch.manual_seed(7)
    got = jitted(x)
    after = torch.rand(3)
    torch.manual_seed(7)
    want = f(x)
    assert torch.equal(got, want)
    assert torch.equal(after, torch.rand(3)), "the generator is left where eager leaves it"


# ---------------------------------------------------------------- errors


def test_python_reading_a_traced_value_names_the_line() -> None:
    ps.init_mesh({"x": 1})

    def f(x):
        if x.sum() > 0:  # the line the error names
            return x
        return -x

    with pytest.raises(ps.ConcretizationError) as info:
        ps.jit(f, backend=AOT)(torch.ones(2))
    text = str(info.value)
    assert re.search(r"test_jit\.py:\d+ \(if x\.sum\(\) > 0:", text), text
    assert "static_argnums" in text
    with pytest.raises(ps.ConcretizationError, match=r"the result result\[0\] is a Python number"):
        ps.jit(lambda x: x.tolist(), backend=AOT)(torch.ones(2))


def test_an_output_shape_that_depends_on_values() -> None:
    """Not Python reading a value: the program's sizes are symbols, right for every call."""
    ps.init_mesh({"x": 1})
    jitted = ps.jit(lambda x: x[x > 0] * 2, backend=AOT)
    for x in (torch.tensor([1.0, -1.0, 2.0]), torch.tensor([1.0, 1.0, 2.0])):
        assert torch.equal(jitted(x), x[x > 0] * 2)
    assert jitted.cache_size() == 1


def rank_untraceable(tmp: str) -> list[str]:
    ps.init_mesh({"ep": 2})
    x = torch.ones(4, 2)
    calls = {
        "save": lambda x: ps.save(tmp, {"x": x}),
        "spawn": lambda x: ps.spawn(lambda: None, nprocs=1, backend="threads"),
        "pipeline": lambda x: ps.pipeline_value_and_grad(
            lambda p, h: h, lambda y, t: y.sum(), num_microbatches=1
        )({}, x, x),
    }
    out = []
    for fn in calls.values():
        try:
            ps.jit(fn, backend=AOT)(x)
        except ps.NotTraceable as e:
            out.append(str(e))
    return out


def test_what_cannot_be_traced_is_an_error(pool, tmp_path) -> None:
    for texts in pool.run(2, rank_untraceable, str(tmp_path / "ckpt")):
        assert len(texts) == 3, texts
        assert texts[0].startswith("ps.save cannot be part of a ps.jit program: it writes files")
        assert texts[1].startswith("ps.spawn cannot be part of a ps.jit program")
        assert texts[2].startswith("pipeline_value_and_grad cannot be part of a ps.jit program")
    assert not (tmp_path / "ckpt").exists()


def rank_replication_checks() -> tuple:
    ps.init_mesh({"x": 2})
    r = ps.axis_index("x")

    def f(w, d):
        return ps.psum((d * w).sum(), "x")

    checked = ps.jit(ps.shard_map(f, in_specs=(P(), P("x")), out_specs=P(), check_rep=True),
                     backend=AOT)  # fmt: skip
    w, d = torch.ones(3, dtype=f64), _x(0, 4, 3)
    same = checked(w, d)
    try:
        checked(w + r, d)  # the same program; the values differ on rank 1
        error = ""
    except RuntimeError as e:
        error = str(e)
    with ps.debug():  # debug mode's checks: in the program too
        debugged = ps.jit(lambda w, d: ps.shard_map(f, in_specs=(P(), P("x")), out_specs=P())(w, d),
                          backend=AOT)(w, d)  # fmt: skip
    return same, debugged, error, checked.cache_size()


def test_replication_checks_run_in_the_program(pool) -> None:
    """check_rep=True and debug mode: shapes and dtypes checked when the program is made, the
    values when it runs (an error on every rank)."""
    for same, debugged, error, programs in pool.run(2, rank_replication_checks):
        assert torch.equal(same, debugged) and programs == 1
        assert "check_rep: inputs must be the same on every rank" in error, error
        assert error.endswith("the ranks hold different values"), error


def test_bad_calls() -> None:
    ps.init_mesh({"x": 1})
    jitted = ps.jit(lambda x: x + 1, backend=AOT)
    with pytest.raises(TypeError, match="keyword arguments are not traced"):
        jitted(x=torch.ones(1))
    with pytest.raises(RuntimeError, match="called inside a torch.func transform"):
        torch.func.grad(lambda x: jitted(x).sum())(torch.ones(2))
    with pytest.raises(ValueError, match="unknown backend 'no such backend'"):
        ps.jit(lambda x: x, backend="no such backend")
    with pytest.raises(ValueError, match=r"arguments \[0\] are both static and donated"):
        ps.jit(lambda x: x, static_argnums=0, donate_argnums=0)


# ---------------------------------------------------------------- the model-level transforms


def _llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        attn_implementation="sdpa",
    )  # fmt: skip
    return LlamaForCausalLM(config).double().train()


def rank_model_transforms(kind: str) -> tuple:
    ps.init_mesh({"tp": 2} if kind == "tp" else {"sp": 2})
    model = _llama()
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    whole = {k: v.detach() for k, v in model.named_parameters()}
    kwargs = {"input_ids": ids, "labels": ids, "use_cache": False}
    if kind.endswith("padded"):  # padding (a mask) and packed rows (positions restarting)
        mask = torch.ones(2, 16, dtype=torch.long)
        mask[1, :5] = 0
        positions = torch.arange(16).repeat(2, 1)
        positions[0, 9:] = torch.arange(7)
        kwargs |= {"attention_mask": mask, "position_ids": positions,
                   "labels": ids.masked_fill(mask == 0, -100)}  # fmt: skip
        kind = kind.removesuffix("-padded")
    if kind == "tp":
        specs = ps.tensor_parallel_specs(model)
        params: dict = ps.shard(whole, specs)

        def loss(p):
            with ps.tensor_parallel(model):
                body = lambda p: torch.func.functional_call(model, p, (), kwargs).loss  # noqa: E731
                return ps.shard_map(body, in_specs=(specs,), out_specs=P())(p)
    else:
        params = whole

        def loss(p):
            with ps.sequence_parallel(model, axis="sp", attention=kind):
                return torch.func.functional_call(model, p, (), kwargs).loss

    step = torch.func.grad_and_value(loss)
    lowered = ps.jit(step).lower(params)  # traced once: the program run and its collectives
    (got, value), (want, value_want) = lowered.compile(AOT)(params), step(params)

    def local(t):
        return t.local if isinstance(t, ps.GlobalTensor) else t

    return ((value, value_want), [(local(got[k]), local(want[k])) for k in want],
            lowered.collectives)  # fmt: skip


@pytest.mark.parametrize("kind", ["tp", "ulysses", "ring", "ring-padded"])
def test_model_transforms_under_jit(pool, kind: str) -> None:
    """tensor_parallel and sequence_parallel (Ulysses, ring; padding and packed rows: segment
    ids as data, no block skipped on values) of a Hugging Face Llama: one program, eager's
    loss and gradients (eager run after the trace: nothing the trace made is cached)."""
    pytest.importorskip("transformers")
    for r, (value, grads, collectives) in enumerate(pool.run(2, rank_model_transforms, kind)):
        torch.testing.assert_close(*value, **EXACT, msg=f"rank {r}")
        for got, want in grads:
            torch.testing.assert_close(got, want, **EXACT, msg=f"rank {r}")
        ops = {name for name, _ in collectives}
        want = {"tp": "psum", "ulysses": "all_to_all", "ring": "ppermute"}[kind.split("-")[0]]
        assert want in ops, ops


def rank_microbatch_and_checkpoint() -> list:
    ps.init_mesh({"x": 2})
    w, d = _x(0, 4, 4), _x(ps.axis_index("x"), 6, 4, seed=1)

    def layer(w, d):
        return torch.nn.functional.dropout(torch.tanh(d @ w), 0.3, training=True)

    def remat(w, d):
        return ps.psum((ps.checkpoint(layer)(w, d) ** 2).sum(), "x")

    def micro(w, d):
        return ps.pmap_microbatch(
            lambda w, d: ((d @ w) ** 2).mean(), num_microbatches=2,
            in_specs=(None, ps.Shard(0)), out_specs=ps.Partial("mean"),
        )(w, d)  # fmt: skip

    out = []
    for f in (torch.func.grad(remat), torch.func.grad(micro)):
        jitted = ps.jit(f, backend=AOT)
        jitted(w, d)
        torch.manual_seed(3)
        got = jitted(w, d)
        torch.manual_seed(3)
        out.append((got, f(w, d)))
    return out


def test_checkpoint_and_microbatches_under_jit(pool) -> None:
    """ps.checkpoint (with dropout: the program's numbers are eager's) and pmap_microbatch."""
    for r, pairs in enumerate(pool.run(2, rank_microbatch_and_checkpoint)):
        for got, want in pairs:
            torch.testing.assert_close(got, want, **EXACT, msg=f"rank {r}")


def test_torch_compile_of_a_step_does_not_recompile_on_values() -> None:
    """The optimizer computes with tensors when traced: a new norm, learning rate or step
    count is a new value in the same graph, never a recompile."""
    import torch._dynamo

    ps.init_mesh({"x": 1})
    tx = ps.optim.chain(
        ps.optim.clip_by_global_norm(0.5),
        ps.optim.adamw(ps.optim.warmup_cosine_decay_schedule(0.0, 0.1, 2, 8)),
    )

    def step(params, state, g):
        updates, state = tx.update(g, state, params)
        return ps.optim.apply_updates(params, updates), state

    torch._dynamo.reset()
    compiled = torch.compile(step, backend=AOT)
    params = {"w": torch.ones(3, dtype=f64)}
    state = tx.init(params)
    eager = (params, state)
    for i in range(6):
        g = {"w": _x(i, 3) * (i + 1) / 4}  # norms below and above the threshold
        # after the first step (which compiles each transform's frames), no recompile:
        # every step is in warmup or decay, below or above the norm, with its own count
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            params, state = compiled(params, state, g)
        eager = step(*eager, g)
    torch.testing.assert_close(params["w"], eager[0]["w"], **EXACT)


def rank_weighted_microbatches_and_sequences() -> list:
    ps.init_mesh({"x": 2})
    w, d = _x(0, 4, 4), _x(0, 6, 4, seed=1)
    mask = torch.tensor([1, 1, 0, 1, 0, 0], dtype=f64)

    def weighted(w, d, m):  # an exact token-weighted mean over microbatches
        return ps.pmap_microbatch(
            lambda w, d, m: (((d @ w) ** 2).sum(-1) * m).sum() / m.sum().clamp(min=1),
            num_microbatches=3, in_specs=(None, ps.Shard(0), ps.Shard(0)),
            out_specs=ps.Partial("mean"), weight_fn=lambda w, d, m: m.sum(),
        )(w, d, m)  # fmt: skip

    x = _x(0, 2, 9, 4, seed=2)  # 9 tokens over 2 ranks: padded

    def seq(w, x):
        body = lambda w, x: ps.psum((torch.tanh(x @ w) ** 2).sum(), "x")  # noqa: E731
        return ps.shard_map_seq(
            body, axis="x", in_specs=(ps.Replicate(), ps.Shard(1)), out_specs=ps.Replicate()
        )(w, x)

    out = []
    for f, args in ((torch.func.grad(weighted), (w, d, mask)), (torch.func.grad(seq), (w, x))):
        out.append((ps.jit(f, backend=AOT)(*args), f(*args)))
    return out


def test_weighted_microbatches_and_padded_sequences_under_jit(pool) -> None:
    """pmap_microbatch's token-weighted mean (weight_fn) and shard_map_seq with padding."""
    for r, pairs in enumerate(pool.run(2, rank_weighted_microbatches_and_sequences)):
        for got, want in pairs:
            torch.testing.assert_close(got, want, **EXACT, msg=f"rank {r}")
