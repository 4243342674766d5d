"""A Hugging Face model's gradient checkpointing pointed at ps.checkpoint, trained under
torch.func.grad(functional_call(...)), against the same model without checkpointing (float64,
a tiny LlamaForCausalLM from a config, random weights, nothing downloaded)."""

from __future__ import annotations

import collections
from typing import Any

import pytest
import torch
from torch.func import functional_call, grad
from torch.utils._python_dispatch import TorchDispatchMode

import pshard as ps
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
    ps.checkpoint_layers(model, policy=policy)
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
    ps.checkpoint_layers(model)
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
    ps.checkpoint_layers(model)
    params = ps.shard(whole, ps.P("dp"))
    got, after = step(lambda p: ps.sharded_call(model, p, (ids,), kwargs).loss, params)
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(ps.gather(got[k]), want[k], rtol=1e-9, atol=1e-12, msg=k)
    assert torch.equal(after, state)


def _mixtral(layers: int = 2) -> torch.nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    config = MixtralConfig(
        vocab_size=V,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
        router_aux_loss_coef=0.5,
        output_router_logits=True,
        attn_implementation="sdpa",
        experts_implementation="eager",  # grouped_mm refuses float64 on the CPU
    )
    return MixtralForCausalLM(config).double().train()


def test_moe_router_gradients_through_checkpointed_layers() -> None:
    """Hugging Face records the router logits with forward hooks inside the decoder layers it
    checkpoints (and inside the units sharded_call checkpoints): the load-balancing loss's
    gradient reaches the routers, as without checkpoints (it was silently dropped)."""
    plain = _mixtral()
    model = _mixtral()
    ps.checkpoint_layers(model)
    params = {k: v.detach() for k, v in plain.named_parameters()}
    ids = torch.randint(0, V, (2, 9))
    kwargs = {"labels": ids, "use_cache": False}

    def aux(m: torch.nn.Module, call: Any = functional_call) -> Any:
        return lambda p: call(m, p, (ids,), kwargs).aux_loss

    def total(m: torch.nn.Module, call: Any = functional_call) -> Any:
        return lambda p: call(m, p, (ids,), kwargs).loss

    for loss in (aux, total):
        want = grad(loss(plain))(params)
        assert want["model.layers.0.mlp.gate.weight"].abs().sum() > 0
        got = grad(loss(model))(params)
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=1e-9, atol=1e-12, msg=k)
    # sharded_call's units are checkpoints too
    ps.init_mesh({"dp": 1})
    plain_units = _mixtral()
    sharded = ps.shard(params, ps.P("dp"))
    got = grad(total(plain_units, ps.sharded_call))(sharded)
    for k in want:
        torch.testing.assert_close(ps.gather(got[k]), want[k], rtol=1e-9, atol=1e-12, msg=k)
    # and under .backward()
    model.zero_grad()
    model(ids, **kwargs).loss.backward()
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[k], rtol=1e-9, atol=1e-12, msg=k)


def test_checkpoint_layers_refuses_what_it_does_not_know() -> None:
    import re

    with pytest.raises(TypeError, match=re.escape("checkpoint_layers: no registered model family")):
        ps.checkpoint_layers(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="ps.checkpoint_layers"):
        ps.checkpoint_layers(_llama(1), policy="dots")
