"""Objects shared by in-process ranks stay safe to share: what a rank writes into them for a
while (functional_call's tensors, sequence_parallel's hooks and attention setting, a
tensor_parallel block) is that rank's, and the other ranks see the objects as they were, even
when the writing rank gives the turn away in the middle (a collective). Each against one
process or per-rank copies."""

from __future__ import annotations

import pytest
import torch
from torch.func import functional_call

import pshard as ps

f64 = torch.float64
P = ps.P


class _Scale(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(3, dtype=f64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = ps.psum(x * self.w, "x")  # the rank waits here: the other one runs
        return y * self.w


def test_functional_call_on_a_shared_module_sees_this_ranks_tensors():
    module = _Scale()
    x = torch.arange(3, dtype=f64)

    def rank():
        ps.init_mesh({"x": 2})
        r = ps.axis_index("x")
        w = torch.full((3,), r + 1.0, dtype=f64)
        return functional_call(module, {"w": w}, (x,)), module.w

    (a, wa), (b, wb) = ps.spawn(rank, nprocs=2, backend="threads")
    torch.testing.assert_close(a, x * 3 * 1)  # (1 + 2) * x, then times this rank's w
    torch.testing.assert_close(b, x * 3 * 2)
    assert wa is module.w and wb is module.w  # the module's own after the call


transformers = pytest.importorskip("transformers")


def _config():
    return transformers.LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        attn_implementation="sdpa",
    )


def _model(config):
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).double()


IDS = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("share", ["config", "model"])
def test_sequence_parallel_on_shared_objects(share):
    """Models built in each rank from one config object, or one model object in every rank,
    under sequence_parallel: the single-process loss and gradients; the config as it was."""
    config = _config()
    shared = _model(config)
    want = shared(IDS, labels=IDS).loss
    want_grads = torch.autograd.grad(want, list(shared.parameters()))

    def rank():
        ps.init_mesh({"sp": 2})
        model = shared if share == "model" else _model(config)
        params = dict(model.named_parameters())
        with ps.sequence_parallel(model, axis="sp", attention="ulysses"):
            loss = model(IDS, labels=IDS).loss
            grads = torch.autograd.grad(loss, list(params.values()))
        return loss.detach(), ps.psum([g for g in grads], "sp")

    for loss, grads in ps.spawn(rank, nprocs=2, backend="threads"):
        torch.testing.assert_close(loss, want.detach())
        for g, w in zip(grads, want_grads, strict=True):
            torch.testing.assert_close(g, w)
    assert config._attn_implementation == "sdpa"
    assert not shared._forward_pre_hooks and not shared._forward_hooks


def test_tensor_parallel_on_one_shared_model():
    """One model object under tensor_parallel from two rank threads: the single-process loss
    and gradients (it was refused as 'already split by another tensor_parallel block')."""
    model = _model(_config())
    whole = {k: v.detach() for k, v in model.named_parameters()}

    def loss_fn(p):
        return functional_call(model, p, (IDS,), {"labels": IDS}).loss

    want, want_grads = torch.func.grad_and_value(loss_fn)(whole)[::-1]

    def rank():
        ps.init_mesh({"tp": 2})
        specs = ps.tensor_parallel_specs(model)

        def body(blocks):
            with ps.tensor_parallel(model):
                return functional_call(model, blocks, (IDS,), {"labels": IDS}).loss

        mapped = ps.shard_map(body, in_specs=(specs,), out_specs=P())
        grads, loss = torch.func.grad_and_value(mapped)(ps.shard(whole, specs))
        return loss, ps.gather(grads)

    for loss, grads in ps.spawn(rank, nprocs=2, backend="threads"):
        torch.testing.assert_close(loss, want)
        for k in want_grads:
            torch.testing.assert_close(grads[k], want_grads[k], msg=k)
