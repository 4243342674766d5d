"""pipeline_value_and_grad composed with the rest of pshard, each against one process at
float64: inside a map over a data axis (dp x pp), ps.checkpoint in a stage, ps.sharded_call in
a stage (FSDP within a stage), and parameters stacked along P("pp") inside a map over pp."""

from __future__ import annotations

import pytest
import torch
from test_pipeline import _data as _pipeline_data
from test_pipeline import _layers as _pipeline_layers
from test_pipeline import _max_diff as _diff
from test_pipeline import _reference, layer, mlp, sq_loss

import pshard as ps

f64 = torch.float64
P = ps.P
D = 5


def _layers(n, seed=0):
    return _pipeline_layers(n, d=D, seed=seed)


def _data(b):
    return _pipeline_data(b, d=D)


def _reference_grads(layers, x, t):
    """The one-process loss (a float) and the gradient of every layer."""
    loss, grads = _reference(layers, x, t, 1)
    return loss.item(), grads


def rank_dp_pp(dp, pp, schedule):
    """Each "dp" rank runs its own pipeline over "pp" on its rows; losses and gradients are
    summed over "dp"."""
    torch.set_default_dtype(f64)
    ps.init_mesh({"dp": dp, "pp": pp})
    r = ps.axis_index("pp")
    v = 2 if schedule == "interleaved_1f1b" else 1
    layers = _layers(2 * pp * v)
    mine = [list(range(2 * (k * pp + r), 2 * (k * pp + r) + 2)) for k in range(v)]
    x, t = _data(4 * dp + 1)  # uneven over "dp" too
    stages = [mlp] * (v * pp) if v > 1 else mlp
    step = ps.pipeline_value_and_grad(stages, sq_loss, num_microbatches=2, schedule=schedule)

    def body(params, x, t):
        loss, grads = step(params, x, t)
        return ps.psum(loss, "dp"), ps.psum(grads, "dp")

    mapped = ps.shard_map(
        body, in_specs=(None, P("dp"), P("dp")), out_specs=(P(), P()), axis_names="dp"
    )
    params = [[layers[i] for i in ids] for ids in mine]
    loss, grads = mapped(tuple(params) if v > 1 else params[0], x, t)
    ref_loss, ref = _reference_grads(layers, x, t)
    trees = grads if v > 1 else (grads,)
    diff = max(
        _diff(g, ref[i]) for tree, ids in zip(trees, mine, strict=True)
        for g, i in zip(tree, ids, strict=True)
    )  # fmt: skip
    return abs(loss.item() - ref_loss), diff


@pytest.mark.parametrize("schedule", ["1f1b", "zero_bubble"])
def test_inside_a_map_over_a_data_axis(pool, schedule):
    for loss_diff, grad_diff in pool.run(4, rank_dp_pp, 2, 2, schedule):
        assert loss_diff < 1e-12 and grad_diff < 1e-12


def test_dp_x_pp_on_8_ranks(pool):  # 8 thread ranks
    for loss_diff, grad_diff in pool.run(8, rank_dp_pp, 2, 4, "interleaved_1f1b"):
        assert loss_diff < 1e-12 and grad_diff < 1e-12


def rank_checkpoint(schedule):
    torch.set_default_dtype(f64)
    ps.init_mesh({"pp": 4})
    r = ps.axis_index("pp")
    layers = _layers(8)
    x, t = _data(6)
    counted = []

    def stage(params, h):
        counted.append(1)
        return mlp(params, h)

    step = ps.pipeline_value_and_grad(
        ps.checkpoint(stage), sq_loss, num_microbatches=3, schedule=schedule
    )
    loss, grads = step(layers[2 * r : 2 * r + 2], x, t)
    ref_loss, ref = _reference_grads(layers, x, t)
    diff = max(_diff(g, ref[2 * r + i]) for i, g in enumerate(grads))
    return abs(loss.item() - ref_loss), diff, len(counted)


@pytest.mark.parametrize("schedule", ["1f1b", "zero_bubble"])
def test_checkpoint_in_a_stage(pool, schedule):
    for loss_diff, grad_diff, calls in pool.run(4, rank_checkpoint, schedule):
        assert loss_diff < 1e-12 and grad_diff < 1e-12
        assert calls > 3  # the stage ran again in the backward: its activations were recomputed


class Layer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(D, D)

    def forward(self, x):
        return torch.tanh(self.lin(x))


class Stage(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([Layer(), Layer()])

    def forward(self, x):
        for lay in self.layers:
            x = lay(x)
        return x


def rank_sharded_call():
    """FSDP within each stage: a map over "dp" hands each stage its parameters' blocks (and
    its rows), ps.sharded_call gathers each layer's weights as it runs."""
    torch.set_default_dtype(f64)
    ps.init_mesh({"dp": 2, "pp": 2})
    r = ps.axis_index("pp")
    layers = _layers(4)
    x, t = _data(8)
    whole = {f"layers.{i}.lin.{k}": layers[2 * r + i][k].T.contiguous() if k == "w" else
             layers[2 * r + i][k] for i in range(2) for k in ("w", "b")}  # fmt: skip
    whole = {k.replace(".w", ".weight").replace(".b", ".bias"): v for k, v in whole.items()}
    meta = Stage().to(f64).to("meta")

    def stage(blocks, h):
        return ps.sharded_call(meta, blocks, (h,), specs=P("dp"))

    step = ps.pipeline_value_and_grad(stage, sq_loss, num_microbatches=2)

    def body(blocks, x, t):
        loss, grads = step(blocks, x, t)
        return ps.psum(loss, "dp"), grads

    mapped = ps.shard_map(
        body, in_specs=(P("dp"), P("dp"), P("dp")), out_specs=(P(), P("dp")), axis_names="dp"
    )
    loss, grads = mapped(whole, x, t)
    ref_loss, ref = _reference_grads(layers, x, t)
    diff = 0.0
    for i in range(2):
        want = ref[2 * r + i]
        diff = max(
            diff,
            (grads[f"layers.{i}.lin.weight"] - want["w"].T).abs().max().item(),
            (grads[f"layers.{i}.lin.bias"] - want["b"]).abs().max().item(),
        )
    return abs(loss.item() - ref_loss), diff


def test_sharded_call_in_a_stage(pool):
    for loss_diff, grad_diff in pool.run(4, rank_sharded_call):
        assert loss_diff < 1e-12 and grad_diff < 1e-12


def rank_stacked():
    """Blocks of parameters stacked along P("pp") inside a map over "pp": each stage gets
    its block of layers, its gradient is a block; the map gathers them."""
    torch.set_default_dtype(f64)
    ps.init_mesh({"pp": 4})
    layers = _layers(8)
    stacked = {k: torch.stack([p[k] for p in layers]) for k in ("w", "b")}  # (8, ...)
    x, t = _data(7)

    def stage(block, h):  # this rank's 2 layers
        for i in range(block["w"].shape[0]):
            h = layer({"w": block["w"][i], "b": block["b"][i]}, h)
        return h

    step = ps.pipeline_value_and_grad(stage, sq_loss, num_microbatches=3)
    mapped = ps.shard_map(step, in_specs=(P("pp"), P(), P()), out_specs=(P(), P("pp")))
    loss, grads = mapped(stacked, x, t)
    ref_loss, ref = _reference_grads(layers, x, t)
    want = {k: torch.stack([g[k] for g in ref]) for k in ("w", "b")}
    return abs(loss.item() - ref_loss), _diff(grads, want)


def test_stacked_blocks_inside_a_map_over_pp(pool):
    for loss_diff, grad_diff in pool.run(4, rank_stacked):
        assert loss_diff < 1e-12 and grad_diff < 1e-12


class _Mlp(torch.nn.Module):
    """A stage with a Megatron pair: up (colwise over "tp"), down (rowwise)."""

    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(D, 6)
        self.down = torch.nn.Linear(6, D)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(x)))


_PLAN = {"up": "colwise", "down": "rowwise"}


def _one_process(models, x, t):
    """The loss of the stages' models run one after another in one process, backpropagated
    into fresh leaves of their parameters (one dict per model)."""
    leaves = [{k: v.detach().clone().requires_grad_() for k, v in m.named_parameters()}
              for m in models]  # fmt: skip
    h = x
    for m, p in zip(models, leaves, strict=True):
        h = torch.func.functional_call(m, p, (h,))
    ref = sq_loss(h, t)
    ref.backward()
    return ref, leaves


def rank_tensor_parallel(schedule):
    """Tensor parallelism within each stage (pp x tp on 4 ranks): each stage's parameters are
    GlobalTensors split over "tp" by the plan, and the stage is a map over "tp" computing
    inside ps.tensor_parallel; the gradients come back as blocks of the same layout."""
    torch.set_default_dtype(f64)
    mesh = ps.init_mesh({"pp": 2, "tp": 2})
    torch.manual_seed(0)
    models = [_Mlp() for _ in range(2)]  # the same on every rank
    mine = models[ps.axis_index("pp")]
    specs = ps.tensor_parallel_specs(mine, _PLAN)
    # each stage's own parameters: GlobalTensors of the stage's "tp" ranks (a mesh of that axis)
    whole = {k: v.detach() for k, v in mine.named_parameters()}
    params = ps.shard(whole, specs, mesh=mesh["tp"])
    x, t = _data(5)

    def body(blocks, h):
        with ps.tensor_parallel(mine, _PLAN):
            return torch.func.functional_call(mine, blocks, (h,))

    stage = ps.shard_map(body, mesh=mesh["tp"], in_specs=(specs, P()), out_specs=P())
    step = ps.pipeline_value_and_grad(stage, sq_loss, num_microbatches=3, schedule=schedule)
    loss, grads = step(params, x, t)
    ref, leaves = _one_process(models, x, t)
    want = {k: v.grad for k, v in leaves[ps.axis_index("pp")].items()}
    assert all(isinstance(g, ps.GlobalTensor) and g.spec == params[k].spec
               for k, g in grads.items())  # fmt: skip
    # the global norm of the stage's blocks is the whole model's (every stage, every block)
    whole = sum(float((v.grad**2).sum()) for p in leaves for v in p.values()) ** 0.5
    norm_diff = abs(ps.optim.global_norm(grads).item() - whole)
    return abs(loss.item() - ref.item()), max(_diff(ps.gather(grads), want), norm_diff)


@pytest.mark.parametrize("schedule", ["1f1b", "zero_bubble"])
def test_tensor_parallel_in_a_stage(pool, schedule):
    for loss_diff, grad_diff in pool.run(4, rank_tensor_parallel, schedule):
        assert loss_diff < 1e-12 and grad_diff < 1e-12


def rank_dp_pp_tp():
    """dp x pp x tp on 8 ranks, the documented pairs composed: the pipeline inside a map over
    "dp" (each data rank its rows), each stage's parameters GlobalTensors on its "tp" ranks
    (handed on by the map over "dp" as they are), the gradients summed over "dp" with ps.psum
    (GlobalTensors on "tp" summed block by block) and clipped by the whole model's norm.
    Both were refused: the map said the GlobalTensor was on another mesh, the psum that a map
    hands a GlobalTensor on as it is."""
    torch.set_default_dtype(f64)
    mesh = ps.init_mesh({"dp": 2, "pp": 2, "tp": 2})
    torch.manual_seed(0)
    models = [_Mlp() for _ in range(2)]
    mine = models[ps.axis_index("pp")]
    specs = ps.tensor_parallel_specs(mine, _PLAN)
    params = ps.shard({k: v.detach() for k, v in mine.named_parameters()}, specs,
                      mesh=mesh["tp"])  # fmt: skip
    x, t = _data(9)  # uneven over "dp"

    def body(blocks, h):
        with ps.tensor_parallel(mine, _PLAN):
            return torch.func.functional_call(mine, blocks, (h,))

    stage = ps.shard_map(body, mesh=mesh["tp"], in_specs=(specs, P()), out_specs=P())
    step = ps.pipeline_value_and_grad(stage, sq_loss, num_microbatches=2)
    clip = ps.optim.clip_by_global_norm(0.5)

    def train(p, x, t):
        loss, grads = step(p, x, t)
        grads = ps.psum(grads, "dp")
        return ps.psum(loss, "dp"), grads, ps.optim.global_norm(grads), clip.update(grads, ())[0]

    mapped = ps.shard_map(
        train, in_specs=(None, P("dp"), P("dp")), out_specs=(P(), P(), P(), P()),
        axis_names="dp",
    )  # fmt: skip
    loss, grads, norm, clipped = mapped(params, x, t)
    ref, leaves = _one_process(models, x, t)
    want = {k: v.grad for k, v in leaves[ps.axis_index("pp")].items()}
    assert all(isinstance(g, ps.GlobalTensor) and g.meta == params[k].meta
               for k, g in grads.items())  # fmt: skip
    whole = sum(float((v.grad**2).sum()) for p in leaves for v in p.values()) ** 0.5
    scaled = {k: w * min(1.0, 0.5 / whole) for k, w in want.items()}
    return (
        abs(loss.item() - ref.item()),
        _diff(ps.gather(grads), want),
        abs(norm.item() - whole),
        _diff(ps.gather(clipped), scaled),
    )


def test_dp_pp_tp_on_8_ranks(pool):  # 8 thread ranks
    for diffs in pool.run(8, rank_dp_pp_tp):
        assert max(diffs) < 1e-12, diffs
