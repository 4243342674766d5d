"""ps.tensor_parallel composed on one mesh, against the same Hugging Face model on one process
(float64; Llama's RMSNorm and transformers' loss give float32 rounding):

- FSDP x TP on 4 ranks: ps.sharded_call over "dp" inside tensor_parallel over "tp", parameters
  split over both axes, in two layouts (mesh dp x tp with "dp" splitting the dim "tp" splits,
  after it; mesh tp x dp with "dp" on the other dim), decoder layers recomputed by
  ps.checkpoint, the loss on the vocabulary split over "tp"; torch.func.grad and .backward();
- dp x tp x sp on 8 ranks: the same with ps.sequence_parallel over "sp" (Ulysses), gradients
  summed over "sp" by the caller (8 thread ranks).
"""

from __future__ import annotations

from typing import Any

import optree
import pytest
import torch
from test_tensor_parallel import FLOAT32, batch, block_of, build

import pshard as ps

transformers = pytest.importorskip("transformers")

P = ps.P


def fsdp_specs(model: torch.nn.Module, tp: dict[str, P], how: str) -> dict[str, P]:
    """``tp`` with "dp" added: ``"after"`` splits dim 0 over "dp" (after "tp" where "tp" splits
    it too), ``"apart"`` puts "dp" on a dim "tp" does not split (after "tp" for 1-D
    parameters)."""
    shapes = {k: v.shape for k, v in model.named_parameters()}
    out = {}
    for name, spec in tp.items():
        entries: list[Any] = list(spec) + [None] * (len(shapes[name]) - len(spec))
        d = 0
        if how == "apart" and len(entries) > 1:
            d = next(i for i, e in enumerate(entries) if e is None)
        e = entries[d]
        entries[d] = "dp" if e is None else (e, "dp") if isinstance(e, str) else (*e, "dp")
        out[name] = P(*entries)
    return out


def _loss_fn(model: torch.nn.Module, specs: dict, b: dict, count: torch.Tensor, sp: bool):
    """``params -> loss``: a map over ("dp", "tp") whose body runs sharded_call inside
    tensor_parallel (and sequence_parallel over "sp")."""

    def body(params: dict, rows: dict) -> torch.Tensor:
        inputs = {k: v for k, v in rows.items() if k != "labels"} | {"use_cache": False}
        out = ps.sharded_call(model, params, (), inputs, specs=specs)
        labels = torch.nn.functional.pad(rows["labels"], (0, 1), value=-100)[:, 1:]
        part = ps.cross_entropy(out.logits, labels, axis="tp", reduction="sum")
        return ps.psum(part, "dp") / count

    def loss(params: dict) -> torch.Tensor:
        with ps.tensor_parallel(model, loss_parallel=True):
            mapped = ps.shard_map(
                body, in_specs=(specs, P("dp")), out_specs=P(), axis_names=("dp", "tp")
            )
            if not sp:
                return mapped(params, b)
            with ps.sequence_parallel(model, axis="sp", attention="ulysses"):
                return mapped(params, b)

    return loss


def _compose_worker(mesh: dict[str, int], how: str, mode: str) -> dict:
    ps.init_mesh(mesh)
    model = build("llama")
    ps.checkpoint_layers(model)
    b = batch("packed")
    count = (b["labels"][:, 1:] != -100).sum()
    specs = fsdp_specs(model, ps.tensor_parallel_specs(model), how)
    params = ps.shard({k: v.detach() for k, v in model.named_parameters()}, specs)
    loss = _loss_fn(model, specs, b, count, "sp" in mesh)
    if mode == "grad":
        grads, value = torch.func.grad_and_value(loss)(params)
        blocks = {k: g.local for k, g in grads.items()}
    else:
        leaves = {
            k: ps.GlobalTensor(v.local.clone().requires_grad_(), v.meta) for k, v in params.items()
        }
        value = loss(leaves)
        value.backward()
        blocks = {k: v.local.grad for k, v in leaves.items()}
    if "sp" in mesh:  # each "sp" rank holds its tokens' share of every gradient block
        blocks = optree.tree_map(lambda g: ps.psum(g, "sp"), blocks)
    out = model(**b, use_cache=False).logits
    ref = torch.nn.functional.cross_entropy(out[:, :-1].flatten(0, 1), b["labels"][:, 1:].flatten())
    names = [n for n, _ in model.named_parameters()]
    ref_grads = dict(zip(names, torch.autograd.grad(ref, list(model.parameters())), strict=True))
    return {
        "loss": (value.detach(), ref.detach()),
        "grads": {k: (blocks[k], block_of(ref_grads[k], params[k])) for k in blocks},
        "split": {k: tuple(params[k].local.shape) != tuple(params[k].shape) for k in params},
    }


def _check(results: list[dict]) -> None:
    for r, out in enumerate(results):
        torch.testing.assert_close(*out["loss"], **FLOAT32)
        for name, (got, want) in out["grads"].items():
            torch.testing.assert_close(got, want, **FLOAT32, msg=f"rank {r}: {name}")


@pytest.mark.parametrize(
    ("mesh", "how", "mode"),
    [({"dp": 2, "tp": 2}, "after", "grad"), ({"tp": 2, "dp": 2}, "apart", "backward")],
)
def test_fsdp_over_dp_and_tensor_parallel_over_tp(pool, mesh: dict, how: str, mode: str) -> None:
    """Every parameter split over "dp" (and the parallel ones over "tp" too): the loss and
    every gradient block equal one process's, both layouts, both ways to differentiate."""
    results = pool.run(4, _compose_worker, mesh, how, mode)
    _check(results)
    assert all(results[0]["split"].values())  # every parameter is split over some axis


def test_dp_tp_sp_on_eight_ranks(pool) -> None:
    """dp x tp x sp: FSDP over "dp", tensor parallelism over "tp", Ulysses sequence
    parallelism over "sp"; the gradients summed over "sp" equal one process's."""
    _check(pool.run(8, _compose_worker, {"dp": 2, "tp": 2, "sp": 2}, "after", "grad"))


def _kept_order_worker() -> str:
    ps.init_mesh({"dp": 1, "tp": 2})
    model = build("llama")
    specs = fsdp_specs(model, ps.tensor_parallel_specs(model), "after")
    name = "model.layers.0.self_attn.q_proj.weight"
    specs[name] = P(("dp", "tp"), None)  # "dp" first: the "tp" block is not what "dp" gathers
    params = ps.shard({k: v.detach() for k, v in model.named_parameters()}, specs)
    ids = batch("plain")["input_ids"]

    def body(p: dict) -> torch.Tensor:
        return ps.sharded_call(model, p, (ids,), {"use_cache": False}, specs=specs).logits

    try:
        with ps.tensor_parallel(model):
            ps.shard_map(body, in_specs=(specs,), out_specs=P(), axis_names=("dp", "tp"))(params)
    except ValueError as e:
        return str(e)
    return "no error"


def test_inside_tensor_parallel_its_axis_splits_first(pool) -> None:
    """sharded_call keeps the "tp" split: a block split over "dp" before "tp" on one dim is an
    error naming the parameter and the fix."""
    message = pool.run(2, _kept_order_worker)[0]
    assert message.startswith(
        "sharded_call specs['model.layers.0.self_attn.q_proj.weight']: P(('dp', 'tp'), None) "
        "splits dim 0 over 'dp' before 'tp', but inside ps.tensor_parallel(axis='tp')"
    ), message
