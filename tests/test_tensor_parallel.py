"""ps.tensor_parallel on Hugging Face causal LMs built from configs (nothing downloads), float64,
on 2 gloo ranks, against the same model on one process.

Llama (2 KV heads), Llama with 1 KV head (fewer than ranks: k/v projections whole, each rank
keeps its head; left padding exposes a wrong num_key_value_groups), Qwen2 (q/k/v biases) and
GPT-2 (Conv1D stores (in, out); the fused c_attn split part by part; its head tied to wte):
specs and ps.shard blocks against hand-sliced oracles; logits, the model's own loss (labels=)
and the parameters' gradient blocks for plain, left-padded and packed batches, under
torch.func.grad of the map and .backward(); loss parallel (logits split over the vocabulary,
the model's loss replaced, and ps.cross_entropy on them); Megatron sequence parallelism with
the decoder layers recomputed by ps.checkpoint after the block exits. Tolerances: GPT-2 to
float64 rounding; Llama and Qwen2 compute RMSNorm (and transformers its loss) in float32, so
they get float32's rounding, no more. Bad input is named (pinned texts)."""

from __future__ import annotations

import re
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import pshard as ps
from pshard._core.global_tensor import block_runs

transformers = pytest.importorskip("transformers")

P = ps.P
V = 61  # odd: the vocabulary splits unevenly (31 + 30)
EXACT = {"rtol": 1e-10, "atol": 1e-12}
FLOAT32 = {"rtol": 2e-6, "atol": 2e-7}  # the model's own float32 rounding (RMSNorm, HF's loss)
KINDS = ("llama", "llama1", "qwen2", "gpt2")


def build(kind: str) -> torch.nn.Module:
    """A tiny random model of ``kind`` in float64 (no dropout), the same in every process."""
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    warnings.simplefilter("ignore")  # transformers' notes about configs
    torch.manual_seed(0)
    common = {"vocab_size": V, "hidden_size": 32, "intermediate_size": 40, "num_hidden_layers": 2}
    common.update(num_attention_heads=4, max_position_embeddings=32, attn_implementation="sdpa")
    if kind == "gpt2":
        config = GPT2Config(
            vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=32, resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager",
        )  # fmt: skip
        model = GPT2LMHeadModel(config)
    elif kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common, num_key_value_heads=2))
    else:
        kv = 1 if kind == "llama1" else 2
        model = LlamaForCausalLM(LlamaConfig(**common, num_key_value_heads=kv))
    return model.double().train()


def batch(kind: str) -> dict[str, torch.Tensor]:
    """4 rows of 8 tokens: ``plain``, ``padded`` (left padding) or ``packed`` (documents whose
    position_ids restart at 0); labels -100 where nothing is predicted."""
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, V, (4, 8), generator=g)
    if kind == "padded":
        mask = torch.ones(4, 8, dtype=torch.long)
        mask[1, :3] = mask[3, :5] = 0
        return {
            "input_ids": ids,
            "attention_mask": mask,
            "labels": ids.masked_fill(mask == 0, -100),
        }
    if kind == "packed":
        pos = torch.arange(8).repeat(4, 1)
        pos[0, 5:] = torch.arange(3)
        pos[2, 2:] = torch.arange(6)
        return {"input_ids": ids, "position_ids": pos, "labels": ids.masked_fill(pos == 0, -100)}
    return {"input_ids": ids, "labels": ids.clone()}


def block_of(whole: torch.Tensor, g: ps.GlobalTensor) -> torch.Tensor:
    """This rank's block of ``whole`` under ``g``'s layout."""
    mesh = g.mesh
    runs = block_runs(g.meta, {n: mesh.get_local_rank(n) for n in mesh.mesh_dim_names})
    for d, r in enumerate(runs):
        whole = whole.index_select(d, torch.tensor([i for run in r for i in run], dtype=torch.long))
    return whole


def reference(model: torch.nn.Module, b: dict, loss: str = "model") -> tuple[Any, dict]:
    """The one-process logits, loss (the model's own, or float64 ``"f64"``) and gradients."""
    out = model(**b, use_cache=False)
    value = out.loss if loss == "model" else _f64_loss(out.logits, b["labels"])
    names = [n for n, _ in model.named_parameters()]
    grads = torch.autograd.grad(value, list(model.parameters()))
    return (out.logits.detach(), value.detach()), dict(zip(names, grads, strict=True))


def _f64_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())


def tp_loss(model: torch.nn.Module, b: dict, *, loss_parallel: bool = False, loss: str = "model",
            plan: dict | None = None):  # fmt: skip
    """``params -> loss`` of the model split over "tp" inside a map over it."""

    def body(params: dict, b: dict) -> torch.Tensor:
        out = torch.func.functional_call(model, params, (), {**b, "use_cache": False})
        if loss == "model":
            return out.loss
        labels = F.pad(b["labels"], (0, 1), value=-100)[:, 1:]
        return ps.cross_entropy(out.logits, labels, axis="tp" if loss_parallel else None)

    def value(params: dict) -> torch.Tensor:
        with ps.tensor_parallel(model, plan, loss_parallel=loss_parallel) as specs:
            return ps.shard_map(body, in_specs=(specs, None), out_specs=P())(params, b)

    return value


def _whole(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def _blocks(grads: dict, ref: dict, params: dict) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    return {k: (g.local, block_of(ref[k], params[k])) for k, g in grads.items()}


# --------------------------------------------------------------------------- specs and blocks


def _expected_specs(kind: str) -> dict[str, P]:
    """The specs of the default plan, written out by hand (the oracle)."""
    col, row, whole = P("tp", None), P(None, "tp"), P()
    if kind == "gpt2":
        out = {"transformer.wte.weight": P("tp", None)}
        for i in range(2):
            h = f"transformer.h.{i}."
            out |= {h + "attn.c_attn.weight": P(None, (3, "tp")),
                    h + "attn.c_attn.bias": P((3, "tp")),
                    h + "attn.c_proj.weight": P("tp", None), h + "attn.c_proj.bias": whole,
                    h + "mlp.c_fc.weight": P(None, "tp"), h + "mlp.c_fc.bias": P("tp"),
                    h + "mlp.c_proj.weight": P("tp", None),
                    h + "mlp.c_proj.bias": whole}  # fmt: skip
        return out
    kv = whole if kind == "llama1" else col
    out = {"model.embed_tokens.weight": P("tp", None), "lm_head.weight": col}
    for i in range(2):
        layer = f"model.layers.{i}."
        out |= {layer + "self_attn.q_proj.weight": col, layer + "self_attn.k_proj.weight": kv,
                layer + "self_attn.v_proj.weight": kv, layer + "self_attn.o_proj.weight": row,
                layer + "mlp.gate_proj.weight": col, layer + "mlp.up_proj.weight": col,
                layer + "mlp.down_proj.weight": row}  # fmt: skip
        if kind == "qwen2":
            out |= {layer + f"self_attn.{p}_proj.bias": P("tp") for p in "qkv"}
    return out


def _model_worker(kind: str) -> dict:
    """Everything one model kind is checked for on one rank (one model build per rank)."""
    ps.init_mesh({"tp": 2})
    model = build(kind)
    params = _whole(model)
    specs = ps.tensor_parallel_specs(model)
    blocks = ps.shard(params, specs)
    out: dict[str, Any] = {"specs": specs, "blocks": {k: v.local for k, v in blocks.items()}}
    out["rank"] = ps.axis_index("tp")
    # logits of a left-padded batch (every model), the model's own loss and its gradient blocks
    # for a packed batch, under torch.func.grad
    padded = {k: v for k, v in batch("padded").items() if k != "labels"}
    with ps.tensor_parallel(model) as s:
        call = lambda p, b: torch.func.functional_call(model, p, (), b).logits  # noqa: E731
        logits = ps.shard_map(call, in_specs=(s, None), out_specs=P())(blocks, padded)
    out["logits"] = (logits, model(**padded).logits.detach())
    packed = batch("packed")
    grads, value = torch.func.grad_and_value(tp_loss(model, packed))(blocks)
    (_, ref_loss), ref_grads = reference(model, packed)
    out["loss"] = (value, ref_loss)
    out["grads"] = _blocks(grads, ref_grads, blocks)
    out["unchanged"] = "forward" not in vars(model) and not any(
        "forward" in vars(m) for m in model.modules()
    )
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_a_model_split_over_two_ranks(pool, kind: str) -> None:
    """Specs and blocks as written out by hand (GPT-2's c_attn: each rank its share of q, k, v);
    logits of a left-padded batch, the labels= loss and the gradient blocks of a packed batch
    under torch.func.grad equal one process's; the model is its own again after the block."""
    tol = EXACT if kind == "gpt2" else FLOAT32
    model = build(kind)
    whole = _whole(model)
    for out in pool.run(2, _model_worker, kind):
        r = out["rank"]
        want = {k: P() for k in whole} | _expected_specs(kind)
        assert out["specs"] == want
        for name, block in out["blocks"].items():
            assert torch.equal(block, _slice(whole[name], want[name], r)), name
        torch.testing.assert_close(*out["logits"], **EXACT)
        torch.testing.assert_close(*out["loss"], **FLOAT32)  # HF's loss is float32 on both sides
        for name, (got, ref) in out["grads"].items():
            torch.testing.assert_close(got, ref, **tol, msg=f"rank {r}: {name}")
        assert out["unchanged"]


def _slice(x: torch.Tensor, spec: P, rank: int) -> torch.Tensor:
    """Rank ``rank``'s block of ``x`` under ``spec`` over 2 ranks, sliced by hand."""
    for d, entry in enumerate(spec):
        if entry is None:
            continue
        n = x.shape[d]
        if entry == "tp":
            x = x.narrow(d, rank * -(-n // 2), min(-(-n // 2), n - rank * -(-n // 2)))
        else:  # (3, "tp"): each third split in two
            third = n // 3
            x = torch.cat(
                [x.narrow(d, k * third + rank * third // 2, third // 2) for k in range(3)], d
            )
    return x


# --------------------------------------------------------------------------- .backward()


def _backward_worker(kind: str) -> dict:
    ps.init_mesh({"tp": 2})
    model = build(kind)
    # every decoder layer checkpointed: recomputed in the backward, after the block exited
    ps.checkpoint_layers(model)
    params = _whole(model)
    blocks = ps.shard(params, ps.tensor_parallel_specs(model))
    leaves = {
        k: ps.GlobalTensor(v.local.clone().requires_grad_(), v.meta) for k, v in blocks.items()
    }
    b = batch("padded")
    value = tp_loss(model, b)(leaves)
    value.backward()
    grads = {k: v.local.grad for k, v in leaves.items()}
    _, ref_grads = reference(model, b)
    return {k: (grads[k], block_of(ref_grads[k], blocks[k])) for k in grads}


def test_backward_through_the_map(pool) -> None:
    """loss.backward() (blocks as leaf tensors) leaves each rank its gradient blocks, with the
    decoder layers recomputed (ps.checkpoint) after the tensor_parallel block exited."""
    for r, out in enumerate(pool.run(2, _backward_worker, "llama1")):
        for name, (got, ref) in out.items():
            torch.testing.assert_close(got, ref, **FLOAT32, msg=f"rank {r}: {name}")


# --------------------------------------------------------------------------- loss parallel


def _loss_parallel_worker(kind: str, batch_kind: str) -> dict:
    ps.init_mesh({"tp": 2})
    model = build(kind)
    blocks = ps.shard(_whole(model), ps.tensor_parallel_specs(model))
    b = batch(batch_kind)
    (ref_logits, ref_value), ref_grads = reference(model, b, loss="f64")
    out: dict[str, Any] = {}
    for how in ("model", "f64"):  # the model's own loss (replaced) and ps.cross_entropy
        grads, value = torch.func.grad_and_value(tp_loss(model, b, loss_parallel=True, loss=how))(
            blocks
        )
        out[how] = ((value, ref_value), _blocks(grads, ref_grads, blocks))
    with ps.tensor_parallel(model, loss_parallel=True) as specs:
        call = lambda p, b: torch.func.functional_call(model, p, (), b).logits  # noqa: E731
        split = ps.shard_map(call, in_specs=(specs, None), out_specs=P(None, None, "tp"))
        inputs = {k: v for k, v in b.items() if k != "labels"} | {"use_cache": False}
        out["logits"] = (split(blocks, inputs), ref_logits)
    out["restored"] = "_loss_function" not in vars(model)
    return out


@pytest.mark.parametrize(("kind", "batch_kind"), [("llama", "padded"), ("gpt2", "packed")])
def test_loss_parallel(pool, kind: str, batch_kind: str) -> None:
    """The head's logits stay split over the vocabulary (61 = 31 + 30; GPT-2's head is tied to
    wte): the model's own labels= loss (replaced for the block) and ps.cross_entropy on them
    equal the float64 loss of the whole logits, gradients too."""
    tol = EXACT if kind == "gpt2" else FLOAT32
    for r, out in enumerate(pool.run(2, _loss_parallel_worker, kind, batch_kind)):
        for how in ("model", "f64"):
            (value, ref), grads = out[how]
            torch.testing.assert_close(value, ref, **tol, msg=f"rank {r}: {how} loss")
            for name, (got, want) in grads.items():
                torch.testing.assert_close(got, want, **tol, msg=f"rank {r}: {how}, {name}")
        torch.testing.assert_close(out["logits"][0], out["logits"][1].detach(), **EXACT)
        assert out["restored"]


# --------------------------------------------------------------------------- sequence parallel


def _sequence_worker(kind: str, checkpoint: bool = False) -> dict:
    ps.init_mesh({"tp": 2})
    model = build(kind)
    if checkpoint:
        ps.checkpoint_layers(model)
    plan = ps.tensor_parallel_plan(model, sequence_parallel=True)
    blocks = ps.shard(_whole(model), ps.tensor_parallel_specs(model, plan))
    b = batch("padded")
    grads, value = torch.func.grad_and_value(tp_loss(model, b, plan=plan, loss="f64"))(blocks)
    (_, ref_value), ref_grads = reference(model, b, loss="f64")
    return {"plan": plan, "loss": (value, ref_value), "grads": _blocks(grads, ref_grads, blocks)}


@pytest.mark.parametrize(
    ("kind", "checkpoint"),
    [
        ("llama", False),
        ("gpt2", False),
        ("gpt2", True),
    ],
)
def test_sequence_parallel_option(pool, kind: str, checkpoint: bool) -> None:
    """The default plan with Megatron sequence parallelism (decoder layers and final norm
    'sequence'): the loss and the gradient blocks equal one process's (with checkpointed
    decoder layers, recomputed by ps.checkpoint after the block exited)."""
    tol = EXACT if kind == "gpt2" else FLOAT32
    for r, out in enumerate(pool.run(2, _sequence_worker, kind, checkpoint)):
        assert "sequence" in out["plan"].values()
        torch.testing.assert_close(*out["loss"], **tol)
        for name, (got, want) in out["grads"].items():
            torch.testing.assert_close(got, want, **tol, msg=f"rank {r}: {name}")


# --------------------------------------------------------------------------- errors


def _errors_worker() -> dict[str, str]:
    from transformers import LlamaConfig, LlamaForCausalLM

    ps.init_mesh({"tp": 2})
    model = build("llama")
    out = {}

    def catch(key: str, f: Any) -> None:
        try:
            f()
        except (TypeError, ValueError) as e:
            out[key] = str(e)

    catch(
        "pattern", lambda: ps.tensor_parallel_specs(model, {"model.layer.*.mlp.up_proj": "colwise"})
    )
    catch("style", lambda: ps.tensor_parallel_specs(model, {"model.norm": "colwise"}))
    catch("unknown", lambda: ps.tensor_parallel_specs(model, {"lm_head": "columnwise"}))
    catch(
        "pair",
        lambda: ps.tensor_parallel_specs(model, {"model.layers.*.self_attn.q_proj": "colwise"}),
    )
    odd = LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=24, intermediate_size=8,
                                       num_hidden_layers=1, num_attention_heads=3,
                                       num_key_value_heads=3))  # fmt: skip
    catch("heads", lambda: ps.tensor_parallel_specs(odd))
    whole = _whole(model)  # called with the whole parameters: not the plan's blocks

    def whole_call() -> None:
        with ps.tensor_parallel(model):
            f = lambda p: torch.func.functional_call(model, p, (batch("plain")["input_ids"],))  # noqa: E731
            ps.shard_map(f, in_specs=(P(),), out_specs=P())(whole)

    catch("blocks", whole_call)
    return out


def test_bad_input_is_named(pool) -> None:
    """A pattern that matches no module, a module a style cannot split, an unknown style, an
    attention module split by halves, heads the axis size does not divide, and whole
    parameters where the plan's blocks belong: each an error naming the pattern, module or
    parameter."""
    out = pool.run(2, _errors_worker)[0]
    assert out["pattern"].startswith(
        "tensor_parallel_specs plan['model.layer.*.mlp.up_proj']: the pattern matches no module "
        "of LlamaForCausalLM"
    )
    style = "module 'model.norm' (LlamaRMSNorm) is matched by 'model.norm' with style 'colwise'"
    assert re.search(re.escape(style + ", which cannot split it"), out["style"])
    assert "unknown style 'columnwise'" in out["unknown"]
    assert "the attention module 'model.layers.0.self_attn'" in out["pair"]
    assert "has 3 query heads, which the axis size 2 does not divide" in out["heads"]
    assert out["blocks"].startswith(
        "tensor_parallel: model.embed_tokens.weight is (61, 32), but the plan ('vocab' from "
        "pattern 'model.embed_tokens') splits it as P('tp', None), so that rank"
    )


# --------------------------------------------------------------------------- a model of one's own


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(6)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(6, 7), torch.nn.GELU(), torch.nn.Linear(7, 6)
        )

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.mlp(self.norm(h))


class TinyLM(torch.nn.Module):
    """An embedding, one MLP block, a norm and a head: styles on a model no adapter knows
    (uneven splits: 61 rows, 7 hidden features)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(V, 6, padding_idx=3)
        self.block = Block()
        self.norm = torch.nn.LayerNorm(6)
        self.head = torch.nn.Linear(6, V, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.block(self.embed(ids))))


PLAN = {"embed": "vocab", "block.mlp.0": "colwise", "block.mlp.2": "rowwise", "head": "colwise"}


def _own_model_worker(sequence: bool) -> dict:
    ps.init_mesh({"tp": 2})
    torch.manual_seed(0)
    model = TinyLM().double()
    plan = dict(PLAN)
    if sequence:  # the block and the final norm on this rank's tokens
        plan |= {"norm": "sequence", "block": "sequence"}  # the first in module order splits
    specs = ps.tensor_parallel_specs(model, plan)
    params = ps.shard({k: v.detach() for k, v in model.named_parameters()}, specs)
    ids = torch.randint(0, V, (3, 8), generator=torch.Generator().manual_seed(2))
    target = torch.randn(3, 8, V, dtype=torch.float64, generator=torch.Generator().manual_seed(3))

    def loss(p: dict) -> torch.Tensor:
        with ps.tensor_parallel(model, plan) as s:
            call = lambda p: torch.func.functional_call(model, p, (ids,))  # noqa: E731
            return (ps.shard_map(call, in_specs=(s,), out_specs=P())(p) * target).sum()

    grads, value = torch.func.grad_and_value(loss)(params)
    ref = (model(ids) * target).sum()
    names = [n for n, _ in model.named_parameters()]
    ref_grads = dict(zip(names, torch.autograd.grad(ref, list(model.parameters())), strict=True))
    return {
        "specs": specs,
        "loss": (value, ref.detach()),
        "grads": _blocks(grads, ref_grads, params),
    }


@pytest.mark.parametrize("sequence", [False, True])
def test_a_model_no_adapter_knows(pool, sequence: bool) -> None:
    """A plan of one's own on a plain nn.Module: a vocabulary-split embedding with a padding
    row, an MLP pair, a gathered head, uneven splits; with 'sequence' modules around the MLP
    (Megatron sequence parallelism) too; float64 exact."""
    for r, out in enumerate(pool.run(2, _own_model_worker, sequence)):
        assert out["specs"]["embed.weight"] == P("tp", None)
        assert out["specs"]["block.mlp.2.bias"] == P()
        torch.testing.assert_close(*out["loss"], **EXACT)
        for name, (got, want) in out["grads"].items():
            torch.testing.assert_close(got, want, **EXACT, msg=f"rank {r}: {name}")


def test_the_sequence_region_follows_module_order() -> None:
    """The first 'sequence' module in module order splits the tokens and the last gathers
    them, whatever order the plan lists them in (pure: no process group)."""
    from pshard.tensor_parallel._plan import resolve

    model = TinyLM()
    for plan in (PLAN | {"norm": "sequence", "block": "sequence"},
                 PLAN | {"block": "sequence", "norm": "sequence"}):  # fmt: skip
        layers = resolve(model, plan, "tp", 2, None, "test").layers
        assert layers["block"].split_tokens and not layers["block"].gather_tokens
        assert layers["norm"].gather_tokens and not layers["norm"].split_tokens
        assert layers["block.mlp"].style == "gather" and layers["block.mlp.2"].scatter_output
