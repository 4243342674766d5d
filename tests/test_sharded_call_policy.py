"""ps.sharded_call's policy: mixed precision (param_dtype, reduce_dtype), prefetch and
reshard_after_forward, against the same casts done by hand on one process.

Float32 masters, bfloat16 compute: outside any map (GlobalTensors, whole data) the output and
the gradients equal the one-process bfloat16 run bit for bit; inside a shard_map over "dp" with
the batch split, the gradient blocks equal the sum over the ranks' rows of the one-process
bfloat16 gradients of those rows, summed in float32 (``reduce_dtype``) or in bfloat16 (the
default, FSDP2's). What the transport is handed is counted: bfloat16 gathers move half the bytes
of float32 ones, and ``reshard_after_forward=False`` gathers once. ``prefetch`` changes no bit
under ``torch.func.grad`` and ``.backward()``.
"""

from __future__ import annotations

import contextlib
import contextvars
import re
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from test_sharded_call import block
from torch.func import functional_call, grad

import pshard as ps
from pshard._runtime.transport import ThreadGroup

f32, bf16 = torch.float32, torch.bfloat16
P = ps.P


class Block(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = torch.nn.Linear(width, 2 * width)
        self.down = torch.nn.Linear(2 * width, width, bias=False)
        self.seen: list[torch.dtype] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(self.up.weight.dtype)
        return x + self.down(torch.tanh(self.up(x)))


class Model(torch.nn.Module):
    def __init__(self, width: int = 6, depth: int = 3) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(4, width)
        self.blocks = torch.nn.ModuleList(Block(width) for _ in range(depth))
        self.head = torch.nn.Linear(width, 3)
        self.order = list(range(depth))  # the blocks in the order the forward calls them

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for i in self.order:
            h = self.blocks[i](h)
        return self.head(h)


def _model() -> tuple[Model, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = Model()
    return model, {k: v.detach().clone() for k, v in model.named_parameters()}


def _by_hand(model: Model, whole: dict, x: torch.Tensor) -> torch.Tensor:
    """The casts done by hand on one process: bfloat16 weights and input."""
    return functional_call(model, {k: v.to(bf16) for k, v in whole.items()}, (x.to(bf16),))


def _loss(out: torch.Tensor) -> torch.Tensor:
    return (out.float() ** 2).sum()


# set by a rank around what it counts (ps.shard's own exchanges are not)
_COUNTING: contextvars.ContextVar[bool] = contextvars.ContextVar("test_counting", default=False)


@contextlib.contextmanager
def _wire() -> Iterator[dict[str, list[int]]]:
    """Bytes handed to the in-process transport per all-gather and reduce-scatter (every
    rank's, in the order they were issued, while the rank counts)."""
    seen: dict[str, list[int]] = {"all_gather": [], "reduce_scatter": []}
    gather, scatter = ThreadGroup.all_gather_single, ThreadGroup.reduce_scatter_single

    def counted_gather(self: Any, output: Any, input: Any, opts: Any = None) -> Any:
        if _COUNTING.get():
            seen["all_gather"].append(input.numel() * input.element_size())
        return gather(self, output, input, opts)

    def counted_scatter(self: Any, output: Any, input: Any, opts: Any = None) -> Any:
        if _COUNTING.get():
            seen["reduce_scatter"].append(input.numel() * input.element_size())
        return scatter(self, output, input, opts)

    ThreadGroup.all_gather_single = counted_gather  # type: ignore[method-assign]
    ThreadGroup.reduce_scatter_single = counted_scatter  # type: ignore[method-assign]
    try:
        yield seen
    finally:
        ThreadGroup.all_gather_single = gather  # type: ignore[method-assign]
        ThreadGroup.reduce_scatter_single = scatter  # type: ignore[method-assign]


def _outside_worker(nprocs: int) -> None:
    """GlobalTensors outside any map: bit for bit the one-process bfloat16 run."""
    ps.init_mesh({"dp": nprocs})
    model, whole = _model()
    x = torch.randn(5, 4)
    params = ps.shard(whole, P("dp"))  # float32 masters, uneven blocks
    policy = {"param_dtype": bf16, "reduce_dtype": f32}
    out = ps.sharded_call(model, params, (x,), **policy)
    assert out.dtype == bf16 and set(model.blocks[0].seen) == {bf16}
    assert torch.equal(out, _by_hand(model, whole, x))
    plain = functional_call(model, whole, (x,))
    assert (out.float() - plain).abs().max() > 1e-4  # bfloat16, not the float32 result
    got = grad(lambda p: _loss(ps.sharded_call(model, p, (x,), **policy)))(params)
    want = grad(lambda w: _loss(_by_hand(model, w, x)))(whole)
    for k, g in got.items():
        assert g.local.dtype == f32 and g.meta == params[k].meta, k
        assert torch.equal(g.local, block(want[k], g)), k


@pytest.mark.parametrize("nprocs", [1, 2])
def test_bfloat16_outside_a_map_equals_the_casts_by_hand(pool: Any, nprocs: int) -> None:
    pool.run(nprocs, _outside_worker, nprocs)


def _inside_worker(nprocs: int, reduce_dtype: torch.dtype | None) -> None:
    """Blocks inside a shard_map over "dp", the batch split: each rank's bfloat16 cotangents
    reduced in ``reduce_dtype`` (``None``: bfloat16, FSDP2's default)."""
    ps.init_mesh({"dp": nprocs})
    model, whole = _model()
    meta = Model().to("meta")
    x = torch.randn(4 * nprocs, 4)
    params = ps.shard(whole, P("dp"))

    def body(p: dict, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = ps.sharded_call(meta, p, (x,), specs=P("dp"), param_dtype=bf16,
                              reduce_dtype=reduce_dtype)  # fmt: skip
        return ps.psum(_loss(out), "dp"), out

    loss = ps.shard_map(body, in_specs=(P("dp"), P("dp")), out_specs=(P(), P("dp")))
    value, out = loss(params, x)
    ref = _by_hand(model, whole, x)
    assert out.dtype == bf16 and torch.allclose(out.float(), ref.float(), rtol=1e-2, atol=1e-2)
    got = grad(lambda p: loss(p, x)[0])(params)
    # one process: each rank's rows in bfloat16, the gradients summed in reduce_dtype
    parts = [grad(lambda w, r=r: _loss(_by_hand(model, w, r)))(whole) for r in x.chunk(nprocs)]
    for k, g in got.items():
        total = parts[0][k].to(bf16)
        for part in parts[1:]:  # in rank order, as the in-process ranks reduce
            total = (total.float() + part[k].to(bf16).float()).to(reduce_dtype or bf16)
        assert g.local.dtype == f32, k
        torch.testing.assert_close(g.local, block(total.float(), g), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(("nprocs", "reduce_dtype"), [(2, f32), (4, None)])
def test_bfloat16_inside_a_map_reduces_in_reduce_dtype(
    pool: Any, nprocs: int, reduce_dtype: torch.dtype | None
) -> None:
    pool.run(nprocs, _inside_worker, nprocs, reduce_dtype)


_POLICIES = {
    "float32": {},
    "bfloat16": {"param_dtype": bf16, "reduce_dtype": f32},
    "zero2": {"param_dtype": bf16, "reduce_dtype": f32, "reshard_after_forward": False},
}


def _step_worker(policy: str) -> None:
    """One gradient of a map over "dp" under ``policy``."""
    ps.init_mesh({"dp": 2})
    _, whole = _model()
    meta = Model().to("meta")
    x = torch.randn(8, 4)
    params = ps.shard(whole, P("dp"))

    def body(p: dict, x: torch.Tensor) -> torch.Tensor:
        out = ps.sharded_call(meta, p, (x,), specs=P("dp"), **_POLICIES[policy])
        return ps.psum(_loss(out), "dp")

    token = _COUNTING.set(True)
    try:
        grad(ps.shard_map(body, in_specs=(P("dp"), P("dp")), out_specs=P()))(params, x)
    finally:
        _COUNTING.reset(token)


def test_bfloat16_gathers_move_half_the_bytes(pool: Any) -> None:
    seen = {}
    for policy in _POLICIES:
        with _wire() as seen[policy]:  # the ranks are threads of this process
            pool.run(2, _step_worker, policy)
    f, b, z = seen["float32"], seen["bfloat16"], seen["zero2"]
    # two ranks; each of 3 units gathers its 3 tensors twice (forward, backward), the rest 4
    assert len(f["all_gather"]) == len(b["all_gather"]) == 2 * (2 * 3 * 3 + 4)
    assert 2 * sum(b["all_gather"]) == sum(f["all_gather"]) > 0
    assert b["reduce_scatter"] == f["reduce_scatter"]  # reduced in float32 either way
    # reshard_after_forward=False: the units gather once (the forward's gathers)
    assert len(z["all_gather"]) == 2 * (3 * 3 + 4)


def _overlap_worker(nprocs: int, inside: bool) -> None:
    """The gradients with and without prefetch under torch.func.grad and .backward(); outside
    a map, the model calls its blocks out of order and one of them twice (the prefetch of the
    next block in the model's order misses, the twice-used block reduces at once)."""
    ps.init_mesh({"dp": nprocs})
    model, whole = _model()
    if not inside:
        model.order = [2, 0, 0, 1]
    x = torch.randn(4 * nprocs, 4)
    params = ps.shard(whole, P("dp"))
    out = []
    for prefetch in (True, False):
        kw = {"param_dtype": bf16, "reduce_dtype": f32, "prefetch": prefetch}
        if inside:

            def body(p: dict, x: torch.Tensor, kw: dict = kw) -> torch.Tensor:
                return ps.psum(_loss(ps.sharded_call(model, p, (x,), specs=P("dp"), **kw)), "dp")

            loss = ps.shard_map(body, in_specs=(P("dp"), P("dp")), out_specs=P())
        else:

            def loss(p: dict, x: torch.Tensor, kw: dict = kw) -> torch.Tensor:
                return _loss(ps.sharded_call(model, p, (x,), **kw))

        g = grad(loss)(params, x)
        out += [g[k].local for k in sorted(g)]
        leaves = {
            k: ps.GlobalTensor(v.local.clone().requires_grad_(), v.meta) for k, v in params.items()
        }
        loss(leaves, x).backward()
        out += [leaves[k].local.grad for k in sorted(leaves)]
    half = len(out) // 2
    for a, b in zip(out[:half], out[half:], strict=True):
        assert torch.equal(a, b)
    if not inside:  # and they are the gradients of the casts by hand
        want = grad(lambda w: _loss(_by_hand(model, w, x)))(whole)
        for k, g in zip(sorted(params), out[:half], strict=False):
            # block 0's two calls' gradients add up in float32 here, in bfloat16 by hand
            tol = 1e-2 if k.startswith("blocks.0.") else 0.0
            torch.testing.assert_close(g, block(want[k], params[k]), rtol=tol, atol=tol)


@contextlib.contextmanager
def _accelerator_streams() -> Iterator[None]:
    """The CPU given a recording stream API, so that the paths of an accelerator run (the side
    streams, reduce-scatters left in flight until the gate); the ranks are threads of this
    process."""
    from pshard._runtime import streams

    api = streams.stream_api
    streams.stream_api = lambda device: _Streams()  # type: ignore[assignment]
    try:
        yield
    finally:
        streams.stream_api = api  # type: ignore[assignment]


@pytest.mark.parametrize(
    ("nprocs", "inside", "accelerator"), [(2, False, False), (4, True, False), (2, True, True)]
)
def test_prefetch_changes_no_bit(pool: Any, nprocs: int, inside: bool, accelerator: bool) -> None:
    with _accelerator_streams() if accelerator else contextlib.nullcontext():
        pool.run(nprocs, _overlap_worker, nprocs, inside)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("inside", [False, True])
def test_prefetch_on_cuda_streams_changes_no_bit(inside: bool) -> None:
    """On a GPU the gathers are issued on a side stream and the reduce-scatters left in flight
    on another (a world of one in this process: the streams, not the ranks, are the point)."""
    with torch.device("cuda"):
        _overlap_worker(1, inside)


def test_policy_errors() -> None:
    ps.init_mesh({"dp": 1})
    model, whole = _model()
    x = torch.randn(2, 4)
    with pytest.raises(TypeError, match=re.escape("sharded_call: param_dtype must be a torch")):
        ps.sharded_call(model, whole, (x,), param_dtype="bfloat16")
    with pytest.raises(ValueError, match=re.escape("reduce_dtype=torch.int32 is not a floating")):
        ps.sharded_call(model, whole, (x,), reduce_dtype=torch.int32)
    with pytest.raises(TypeError, match=re.escape("sharded_call: prefetch must be True or False")):
        ps.sharded_call(model, whole, (x,), prefetch=1)


def _transforms_worker(inside: bool) -> None:
    """jvp, grad of grad and vmap (over the data, and of per-example gradients) through the
    units' gathers, in float64 against one process; prefetch on, debug mode on."""
    ps.init_mesh({"dp": 2})
    torch.manual_seed(0)
    model = Model().double()
    whole = {k: v.detach().clone() for k, v in model.named_parameters()}
    x = torch.randn(4, 4, dtype=torch.float64)
    params = ps.shard(whole, P("dp"))
    tangent = {k: torch.randn_like(v) for k, v in whole.items()}
    tangents = ps.shard(tangent, P("dp"))

    def one(w: dict, x: torch.Tensor) -> torch.Tensor:
        return (functional_call(model, w, (x,)) ** 2).sum()

    if inside:

        def body(p: dict, x: torch.Tensor) -> torch.Tensor:
            return ps.psum((ps.sharded_call(model, p, (x,), specs=P("dp")) ** 2).sum(), "dp")

        loss = ps.shard_map(body, in_specs=(P("dp"), P("dp")), out_specs=P())
    else:

        def loss(p: dict, x: torch.Tensor) -> torch.Tensor:
            return (ps.sharded_call(model, p, (x,)) ** 2).sum()

    def close(a: torch.Tensor, b: torch.Tensor) -> None:
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)

    with ps.debug(True):
        _, got = torch.func.jvp(lambda p: loss(p, x), (params,), (tangents,))
        _, want = torch.func.jvp(lambda w: one(w, x), (whole,), (tangent,))
        close(got, want)

        def hvp(p: dict, v: dict, f: Any) -> dict:  # grad of <grad f, v> (whole values)
            def inner(q: dict) -> torch.Tensor:
                g, w = ps.gather(grad(f)(q)), ps.gather(v)
                return sum((g[k] * w[k]).sum() for k in q)

            return grad(inner)(p)

        got_h = hvp(params, tangents, lambda p: loss(p, x))
        want_h = hvp(whole, tangent, lambda w: one(w, x))
        for k, g in got_h.items():
            close(g.local, block(want_h[k], g))
        xs = torch.randn(3, 2, 4, dtype=torch.float64)
        if not inside:  # vmap over the data with the parameters held by every example
            close(torch.func.vmap(loss, in_dims=(None, 0))(params, xs),
                  torch.func.vmap(one, in_dims=(None, 0))(whole, xs))  # fmt: skip
        per_example = torch.func.vmap(grad(loss), in_dims=(None, 0))(params, xs)
        want_e = torch.func.vmap(grad(one), in_dims=(None, 0))(whole, xs)
        for k, g in per_example.items():
            close(g.local, block(want_e[k].movedim(0, -1), g).movedim(-1, 0))


@pytest.mark.parametrize("inside", [False, True])
def test_composes_with_every_transform(pool: Any, inside: bool) -> None:
    # inside a map, with the accelerator's paths: scatters in flight until the gate
    with _accelerator_streams() if inside else contextlib.nullcontext():
        pool.run(2, _transforms_worker, inside)


class _Streams:
    """A device stream API that records what is asked of it (the CUDA path, on the CPU)."""

    def __init__(self) -> None:
        self.log: list[tuple[str, ...]] = []
        self.current = "compute"

    def Stream(self, device: torch.device) -> Any:  # noqa: N802 - torch's name
        api = self

        class Stream:
            name = "side"

            def wait_stream(self, other: Any) -> None:
                api.log.append(("wait", self.name, getattr(other, "name", other)))

        return Stream()

    def current_stream(self, device: torch.device) -> Any:
        api = self

        class Current:
            name = self.current

            def wait_stream(self, other: Any) -> None:
                api.log.append(("wait", self.name, other.name))

        return Current()

    @contextlib.contextmanager
    def stream(self, s: Any) -> Iterator[None]:
        before, self.current = self.current, s.name
        self.log.append(("enter", s.name))
        try:
            yield
        finally:
            self.current = before
            self.log.append(("exit", s.name))

    def record_stream(self, t: torch.Tensor, s: Any) -> None:
        self.log.append(("record", tuple(t.shape), s.name))


def _streams_worker() -> list[tuple[str, ...]]:
    """A gather and a scatter issued on a side stream: the stream waits for the compute
    stream first, the cast and the collectives run on it, and the compute stream waits for it
    and records what it made before anything reads them."""
    from pshard._collectives.cast_gather import (
        BlockPlan,
        PendingGather,
        PendingScatter,
        UnitPlan,
        block_levels,
    )
    from pshard._runtime import wire
    from pshard._runtime.streams import SideStream

    ps.init_mesh({"dp": 2})
    api = _Streams()
    _API.set(api)  # what the spies on the wire (installed by the test) log into
    side = SideStream(torch.device("cpu"), api)
    comm = wire.comm("dp", "test")
    shape, levels = block_levels((5, 3), [(comm, ps.Shard(0))])
    plan = UnitPlan((BlockPlan(shape, (5, 3), levels),), bf16, f32)
    (whole,) = PendingGather(plan, [torch.randn(shape)], side).wait()
    scatter = PendingScatter(plan, (f32,), [torch.ones(5, 3, dtype=bf16)], side)
    scatter.wait()
    assert whole.dtype == bf16 and scatter.outputs[0].dtype == f32
    return api.log


_API: contextvars.ContextVar[_Streams] = contextvars.ContextVar("test_streams_api")


def test_side_streams_order_the_work(pool: Any) -> None:
    from pshard._runtime import wire

    issued = wire.all_gather_start, wire.reduce_scatter_start

    def spied(i: int) -> Any:
        def call(*args: Any) -> Any:
            api = _API.get()
            api.log.append(("collective", api.current))
            return issued[i](*args)

        return call

    wire.all_gather_start, wire.reduce_scatter_start = spied(0), spied(1)
    try:  # the ranks are threads of this process
        log = pool.run(2, _streams_worker)[0]
    finally:
        wire.all_gather_start, wire.reduce_scatter_start = issued
    piece = (3, 3)  # rank 0's block of 5 rows over 2 ranks
    assert log == [
        ("wait", "side", "compute"), ("enter", "side"), ("collective", "side"), ("exit", "side"),
        ("wait", "compute", "side"), ("record", (2, *piece), "compute"),
        ("wait", "side", "compute"), ("enter", "side"), ("collective", "side"), ("exit", "side"),
        ("wait", "compute", "side"), ("record", piece, "compute"),
    ]  # fmt: skip
