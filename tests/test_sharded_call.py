"""ps.sharded_call (functional FSDP) against the one-process model, float64, on 1, 2 and 4 ranks.

Both forms: GlobalTensors outside any map, and the blocks a ``shard_map`` over ``"dp"`` hands
its body with their specs; uneven and empty blocks; ``torch.func.grad``, ``vjp`` and
``.backward()``; the gathers counted (each unit gathers its weights once in the forward and once
more in the backward, the rest once); nested in ``shard_map_seq`` (FSDP over "dp" x sequence
parallel over "sp") and under ``pmap_microbatch``.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from torch.func import functional_call, grad, vjp
from torch.utils._python_dispatch import TorchDispatchMode

import pshard as ps
from pshard._core.global_tensor import block_runs

pytestmark = pytest.mark.filterwarnings(
    "ignore:`torch.jit.script` is deprecated:DeprecationWarning"
)

f64 = torch.float64
P = ps.P


class Block(torch.nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.up = torch.nn.Linear(width, hidden)
        self.down = torch.nn.Linear(hidden, width, bias=False)

    def forward(self, x: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
        return x + scale * self.down(torch.tanh(self.up(x)))


class Model(torch.nn.Module):
    def __init__(self, width: int = 5, hidden: int = 7, depth: int = 3) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(3, width)
        self.blocks = torch.nn.ModuleList(Block(width, hidden) for _ in range(depth))
        self.head = torch.nn.Linear(width, 2)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h, scale=scale)
        return self.head(h)


def _model() -> tuple[Model, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = Model().to(f64)
    return model, {k: v.detach().clone() for k, v in model.named_parameters()}


def _loss(model: Model, params: dict, x: torch.Tensor) -> torch.Tensor:
    return (functional_call(model, params, (x,), {"scale": 0.5}) ** 2).sum()


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape and torch.allclose(a, b, rtol=1e-9, atol=1e-10), (a, b)


def block(x: torch.Tensor, g: ps.GlobalTensor) -> torch.Tensor:
    """``x``'s elements that ``g``'s block holds on this rank."""
    mesh = g.mesh
    runs = block_runs(g.meta, {n: mesh.get_local_rank(n) for n in mesh.mesh_dim_names})
    for d, r in enumerate(runs):
        x = x.index_select(d, torch.tensor([i for run in r for i in run], dtype=torch.long))
    return x


def _check(grads: dict, ref: dict, params: dict) -> None:
    for k, g in grads.items():
        assert isinstance(g, ps.GlobalTensor) and g.meta == params[k].meta, k
        _close(g.local, block(ref[k], g))


class _Counter(TorchDispatchMode):
    """Counts the parameters gathered (the outputs of ``pshard::cast_gather``, the operator a
    unit's gather is, whether its collectives ran ahead or inside it)."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if "cast_gather" in str(func):
            self.n += len(out)
        return out


def _outside_worker(nprocs: int) -> int:
    """GlobalTensors outside any map: whole inputs, every rank computes the same loss."""
    ps.init_mesh({"dp": nprocs})
    model, whole = _model()
    x = torch.randn(4, 3, dtype=f64)
    params = ps.shard(whole, P("dp"))  # 5, 7, 3 rows over 4 ranks: uneven and empty blocks
    ref_loss, ref = _loss(model, whole, x), grad(lambda p: _loss(model, p, x))(whole)

    def loss(p: dict) -> torch.Tensor:
        return (ps.sharded_call(model, p, (x,), {"scale": 0.5}) ** 2).sum()

    _close(loss(params), ref_loss)
    _check(grad(loss)(params), ref, params)
    value, pull = vjp(loss, params)
    _close(value, ref_loss)
    _check(pull(torch.tensor(2.0, dtype=f64))[0], {k: 2 * v for k, v in ref.items()}, params)
    leaves = {
        k: ps.GlobalTensor(v.local.clone().requires_grad_(), v.meta) for k, v in params.items()
    }
    loss(leaves).backward()
    for k, v in leaves.items():
        _close(v.local.grad, block(ref[k], v))
    if nprocs == 1:
        return 0
    # gathers: embed and head (the rest) once; each of 3 blocks' 3 tensors in the forward and
    # again in the backward
    with _Counter() as forward:
        loss(params)
    with _Counter() as both:
        grad(loss)(params)
    assert forward.n == 4 + 3 * 3, forward.n
    assert both.n == 4 + 2 * 3 * 3, both.n
    return both.n


@pytest.mark.parametrize("nprocs", [1, 2, 4])
def test_global_tensors_outside_a_map(procs: Any, nprocs: int) -> None:
    # on gloo processes: what the tests on in-process ranks do not see
    counts = procs.run(nprocs, _outside_worker, nprocs)
    assert counts == [counts[0]] * nprocs


def _inside_worker(nprocs: int) -> int:
    """Blocks inside a shard_map over "dp", data sharded too."""
    ps.init_mesh({"dp": nprocs})
    model, whole = _model()
    meta_model = Model().to(f64).to("meta")  # the module's own parameters hold no weights
    x = torch.randn(6, 3, dtype=f64)
    params = ps.shard(whole, P("dp"))
    ref = grad(lambda p: _loss(model, p, x))(whole)

    def body(p: dict, x: torch.Tensor) -> torch.Tensor:
        out = ps.sharded_call(meta_model, p, (x,), {"scale": 0.5}, specs=P("dp"))
        return ps.psum((out**2).sum(), "dp")

    loss = ps.shard_map(body, in_specs=(P("dp"), P("dp")), out_specs=P())
    _close(loss(params, x), _loss(model, whole, x))
    _check(grad(loss)(params, x), ref, params)
    return 1


@pytest.mark.parametrize("nprocs", [2, 4])
def test_blocks_inside_a_map(pool: Any, nprocs: int) -> None:
    assert pool.run(nprocs, _inside_worker, nprocs) == [1] * nprocs


def _composed_worker() -> int:
    """FSDP over "dp" around sequence parallelism over "sp", and under pmap_microbatch."""
    ps.init_mesh({"dp": 2, "sp": 2})
    model, whole = _model()
    x = torch.randn(2, 6, 3, dtype=f64)  # (batch, seq, features); the model acts per token
    params = ps.shard(whole, P("dp"))
    ref = grad(lambda p: _loss(model, p, x))(whole)

    def body(p: dict, x: torch.Tensor) -> torch.Tensor:
        assert isinstance(p["embed.weight"], ps.GlobalTensor)  # over "dp", unmapped here
        out = ps.sharded_call(model, p, (x,), {"scale": 0.5})
        return ps.psum((out**2).sum(), "sp")

    seq = ps.shard_map_seq(body, axis="sp", in_specs=(None, ps.Shard(1)), out_specs=ps.Replicate())
    _close(seq(params, x), _loss(model, whole, x))
    _check(grad(seq)(params, x), ref, params)
    # gradient accumulation: two microbatches of the batch, their gradients summed
    step = ps.pmap_microbatch(
        grad(lambda p, x: (ps.sharded_call(model, p, (x,), {"scale": 0.5}) ** 2).sum()),
        num_microbatches=2,
        in_specs=(None, ps.Shard(0)),
        out_specs=ps.Partial("sum"),
    )
    _check(step(params, x), ref, params)
    return 1


def test_composes_with_shard_map_seq_and_pmap_microbatch(pool: Any) -> None:
    assert pool.run(4, _composed_worker) == [1] * 4


def test_units_and_errors() -> None:
    ps.init_mesh({"dp": 1})
    model, whole = _model()
    x = torch.randn(4, 3, dtype=f64)
    params = ps.shard(whole, P("dp"))
    for units in (Block, (Block,), lambda m: isinstance(m, Block), [torch.nn.Linear]):
        out = ps.sharded_call(model, params, (x,), {"scale": 0.5}, units=units)
        _close(out, functional_call(model, whole, (x,), {"scale": 0.5}))
    with pytest.raises(ValueError, match=re.escape("sharded_call: params names ['nope']")):
        ps.sharded_call(model, {"nope": torch.zeros(1)}, (x,))
    with pytest.raises(TypeError, match=re.escape("sharded_call: units must be module classes")):
        ps.sharded_call(model, params, (x,), units=3)
    with pytest.raises(ValueError, match=re.escape("sharded_call params['head.weight']: the")):
        ps.sharded_call(model, {"head.weight": torch.zeros(3, 5, dtype=f64)}, (x,), specs=P("dp"))
    concat = ps.pmap_microbatch(
        lambda p, x: p["head.weight"],
        num_microbatches=2,
        in_specs=(None, ps.Shard(0)),
        out_specs=ps.Shard(0),
    )
    with pytest.raises(ValueError, match=re.escape("a GlobalTensor is one global value, not rows")):
        concat(params, x)


class _Tied(torch.nn.Module):
    """A weight tied across two units (layers 0 and 2), and one inside the rest and a unit."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(4, 4)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3))
        self.layers[2].weight = self.layers[0].weight
        self.layers[1].bias = self.embed.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def test_weights_tied_across_units() -> None:
    ps.init_mesh({"dp": 1})
    torch.manual_seed(0)
    model = _Tied().to(f64)
    whole = {k: v.detach() + 0.1 for k, v in model.named_parameters()}  # one name per tie
    assert "layers.2.weight" not in whole and "layers.1.bias" not in whole
    x = torch.randn(3, 4, dtype=f64)

    def ref(p: dict) -> torch.Tensor:
        return (functional_call(model, p, (x,)) ** 2).sum()

    def loss(p: dict) -> torch.Tensor:
        return (ps.sharded_call(model, p, (x,)) ** 2).sum()

    params = ps.shard(whole, P("dp"))
    _close(loss(params), ref(whole))
    _check(grad(loss)(params), grad(ref)(whole), params)


def test_unit_errors_name_the_unit_and_the_value() -> None:
    ps.init_mesh({"dp": 1})
    model, whole = _model()
    x = torch.randn(4, 3, dtype=f64)
    with pytest.raises(TypeError, match=re.escape("sharded_call params['head.bias']: expected a")):
        ps.sharded_call(model, {"head.bias": None}, (x,))
    block = {"head.weight": whole["head.weight"][:1]}
    with pytest.raises(ValueError, match=re.escape("pass the map's in_spec for it in specs=")):
        ps.sharded_call(model, block, (x,))
    with pytest.raises(TypeError, match=re.escape("specs['head.weight']: Shard(0) does not say")):
        ps.sharded_call(model, block, (x,), specs=ps.Shard(0))
    wrong = ps.shard({"head.weight": torch.zeros(3, 5, dtype=f64)}, P("dp"))
    with pytest.raises(ValueError, match=re.escape("a GlobalTensor of shape (3, 5), but the")):
        ps.sharded_call(model, wrong, (x,))


def test_a_unit_that_runs_differently_again_is_named() -> None:
    """A Hugging Face model called with its default use_cache=True fills a cache in the forward,
    so a unit's second run differs: the error names the unit."""
    transformers = pytest.importorskip("transformers")
    ps.init_mesh({"dp": 1})
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2,
        n_embd=16,
        n_head=2,
        vocab_size=50,
        n_positions=16,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    model = transformers.GPT2LMHeadModel(config).double()
    ids = torch.randint(0, 50, (2, 8))
    params = ps.shard({k: v.detach() for k, v in model.named_parameters()}, P("dp"))
    with pytest.raises(ValueError, match=re.escape("sharded_call unit 'transformer.h.1' (GPT2")):
        grad(lambda p: ps.sharded_call(model, p, (ids,), {"labels": ids}).loss)(params)
    loss = grad(
        lambda p: ps.sharded_call(model, p, (ids,), {"labels": ids, "use_cache": False}).loss
    )
    ref = grad(
        lambda p: functional_call(model, p, (ids,), {"labels": ids, "use_cache": False}).loss
    )
    whole = {k: v.detach() for k, v in model.named_parameters()}
    _check(loss(params), ref(whole), params)


def _per_rank_data_worker() -> list[str]:
    """Data that differs per rank outside any map: each rank gets only its own gradient (the
    convention outside a map); debug mode says so instead of returning it."""
    ps.init_mesh({"dp": 2})
    model, whole = _model()
    x = torch.randn(4, 3, dtype=f64) + ps.axis_index("dp")  # another batch on each rank
    params = ps.shard(whole, P("dp"))

    def loss(p: dict) -> torch.Tensor:
        return (ps.sharded_call(model, p, (x,)) ** 2).sum()

    grad(loss)(params)  # no check without debug mode
    with ps.debug(True):
        try:
            grad(loss)(params)
        except ValueError as e:
            return [str(e)]
    return ["no error"]


def test_per_rank_data_outside_a_map_is_an_error_in_debug_mode(pool: Any) -> None:
    for (message,) in pool.run(2, _per_rank_data_worker):
        assert "debug mode: the cotangent of the whole value differs between the ranks" in message


def test_a_meta_parameter_missing_from_params_is_named() -> None:
    """A module built on the meta device, a parameter missing from params: sharded_call names
    it (torch said 'Tensor on device meta is not on the expected device cpu!')."""
    ps.init_mesh({"dp": 1})
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    params = {k: torch.randn(v.shape) for k, v in model.named_parameters() if k != "1.bias"}
    text = "sharded_call: the module's parameter '1.bias' is on the meta device"
    with pytest.raises(ValueError, match=re.escape(text)):
        ps.sharded_call(model, ps.shard(params, ps.P("dp")), (torch.randn(2, 3),))
