"""A Hugging Face model's gradient checkpointing pointed at ps.checkpoint, trained under
torch.func.grad(functional_call(...)), against the same model without checkpointing (float64,
a tiny LlamaForCausalLM from a config, random weights, nothing downloaded)."""

from __future__ import annotations

import collections
import functools
from typing import Any

import pytest
import torch
from torch.func import functional_call, grad
from torch.utils._python_dispatch import TorchDispatchMode

import pshard as ps
from pshard._remat.checkpoint import checkpoint
from pshard._remat.policies import checkpoint_policies as cp

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.filterwarnings(
    "ignore:`torch.jit.script` is deprecated:DeprecationWarning"
)

V = 40


class Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func._opname] += 1
        return func(*args, **(kwargs or {}))


def _llama(layers: int = 3) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=V,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config).double().train()


def _loss(model: torch.nn.Module, ids: torch.Tensor) -> Any:
    def loss(params: dict) -> torch.Tensor:
        return functional_call(model, params, (ids,), {"labels": ids, "use_cache": False}).loss

    return loss


@pytest.mark.parametrize("policy", [None, cp.dots_saveable])
def test_llama_gradient_checkpointing_under_torch_func_grad(policy: Any) -> None:
    plain = _llama()
    model = _llama()
    # the one line: every decoder layer's checkpoint function is ps.checkpoint
    model._set_gradient_checkpointing(
        enable=True, gradient_checkpointing_func=functools.partial(checkpoint, policy=policy)
    )
    params = {k: v.detach() for k, v in plain.named_parameters()}
    ids = torch.randint(0, V, (2, 9))
    want = grad(_loss(plain, ids))(params)
    with Count() as c:
        got = grad(_loss(model, ids))(params)
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-9, atol=1e-12, msg=k)
    with Count() as p:
        grad(_loss(plain, ids))(params)
    # the layers really ran again in the backward (one more attention per layer), unless the
    # policy kept the attention kernels' outputs
    sdpa = "_scaled_dot_product_flash_attention_for_cpu"
    assert c.ops[sdpa] - p.ops[sdpa] == (0 if policy is cp.dots_saveable else 3), (c.ops, p.ops)
    assert c.ops["rsqrt"] > p.ops["rsqrt"]  # RMSNorm recomputed either way


def test_llama_gradient_checkpointing_under_backward() -> None:
    plain = _llama(2)
    model = _llama(2)
    model._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=checkpoint)
    ids = torch.randint(0, V, (2, 7))
    plain(ids, labels=ids, use_cache=False).loss.backward()
    model(ids, labels=ids, use_cache=False).loss.backward()
    for (k, a), (_, b) in zip(model.named_parameters(), plain.named_parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-9, atol=1e-12, msg=k)


def test_gpt2_with_dropout_in_sharded_call_units() -> None:
    """sharded_call's units are checkpoints, and the model's own gradient checkpointing pointed
    at ps.checkpoint nests one inside each: with dropout, every recompute draws the forward's
    masks (the outer recompute runs the inner checkpoint's forward again)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    ps.init_mesh({"dp": 1})
    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=2,
        n_embd=16,
        n_head=2,
        vocab_size=V,
        n_positions=16,
        resid_pdrop=0.1,
        embd_pdrop=0.1,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = GPT2LMHeadModel(config).double().train()
    ids = torch.randint(0, V, (2, 8))
    kwargs = {"labels": ids, "use_cache": False}
    whole = {k: v.detach().clone() for k, v in model.named_parameters()}

    def step(loss: Any, params: Any) -> Any:
        torch.manual_seed(1)
        return grad(loss)(params), torch.get_rng_state()

    want, state = step(lambda p: functional_call(model, p, (ids,), kwargs).loss, whole)
    model._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=checkpoint)
    params = ps.shard(whole, ps.P("dp"))
    got, after = step(lambda p: ps.sharded_call(model, p, (ids,), kwargs).loss, params)
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(ps.gather(got[k]), want[k], rtol=1e-9, atol=1e-12, msg=k)
    assert torch.equal(after, state)
