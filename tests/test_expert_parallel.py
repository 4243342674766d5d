"""ps.expert_parallel against one process running the whole batch: Hugging Face's Mixtral,
Qwen2-MoE (shared expert) and Qwen3-MoE in float64 with 8 experts on 2 and 4 ranks (threads;
gloo processes too), padding and ignored labels, logits and float64 gradients to float64
rounding, the model's own loss and load-balancing loss to the float32 rounding it computes them
in; dp x ep with sharded_call; the experts call alone against transformers' own (every token
sent to one rank's experts, a rank with no tokens); checkpointed layers recomputed after the
block; the global norm; a save resharded to another axis size; the errors."""

from __future__ import annotations

import math
import re
import sys

import pytest
import torch
import torch.nn.functional as F

import pshard as ps
from pshard import P

pytest.importorskip("transformers")

f64 = torch.float64
V, SEQ = 48, 8
EXACT = {"rtol": 1e-10, "atol": 1e-12}
_STACKED = ("experts.gate_up_proj", "experts.down_proj")
FLOAT32 = {"rtol": 2e-5, "atol": 1e-6}  # HF's loss and aux loss: float32 arithmetic


def build(family: str, experts: int = 8, layers: int = 2) -> torch.nn.Module:
    import transformers as tf

    torch.manual_seed(0)
    common = dict(
        vocab_size=V,
        hidden_size=16,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts_per_tok=2,
        max_position_embeddings=64,
        router_aux_loss_coef=0.25,
        output_router_logits=True,
        attn_implementation="sdpa",
        experts_implementation="eager",  # grouped_mm refuses float64 on the CPU
    )
    if family == "mixtral":
        config = tf.MixtralConfig(num_local_experts=experts, intermediate_size=24, **common)
        model = tf.MixtralForCausalLM(config)
    elif family == "qwen2_moe":
        config = tf.Qwen2MoeConfig(
            num_experts=experts, moe_intermediate_size=12, intermediate_size=24,
            shared_expert_intermediate_size=20, decoder_sparse_step=1, **common,
        )  # fmt: skip
        model = tf.Qwen2MoeForCausalLM(config)
    else:
        config = tf.Qwen3MoeConfig(
            num_experts=experts, moe_intermediate_size=12, intermediate_size=24, head_dim=8,
            decoder_sparse_step=1, norm_topk_prob=True, **common,
        )  # fmt: skip
        model = tf.Qwen3MoeForCausalLM(config)
    return model.double().train()


def batch(rows: int) -> dict[str, torch.Tensor]:
    """Rows with right padding of different lengths (attention_mask 0, labels -100)."""
    g = torch.Generator().manual_seed(rows)
    ids = torch.randint(0, V, (rows, SEQ), generator=g)
    mask = torch.ones(rows, SEQ, dtype=torch.long)
    for r in range(rows):
        mask[r, SEQ - r % 3 :] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def ce_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The float64 cross-entropy of next-token targets, summed."""
    return F.cross_entropy(
        logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100, reduction="sum"
    )


def reference(model: torch.nn.Module, b: dict) -> dict:
    """One process on the whole batch: outputs and gradients of the float64 loss and of HF's."""
    names = [n for n, _ in model.named_parameters()]
    out = model(**b, use_cache=False)
    count = (b["labels"][:, 1:] != -100).sum()
    ce = ce_sum(out.logits, b["labels"]) / count
    grads = torch.autograd.grad(ce, list(model.parameters()), retain_graph=True)
    hf_grads = torch.autograd.grad(out.loss, list(model.parameters()))
    return {
        "logits": out.logits.detach(),
        "loss": out.loss.detach(),
        "aux": out.aux_loss.detach(),
        "ce": ce.detach(),
        "grads": dict(zip(names, grads, strict=True)),
        "hf_grads": dict(zip(names, hf_grads, strict=True)),
    }


def _loss(model, specs, b, count, axes, *, call=None):
    """``params -> (float64 loss, HF loss, aux loss, logits)`` of the map over ``axes``."""

    def body(params, rows):
        if call is None:
            out = torch.func.functional_call(model, params, (), {**rows, "use_cache": False})
        else:
            out = call(params, rows)
        ce = ps.psum(ce_sum(out.logits, rows["labels"]), axes) / count
        return ce, out.loss, out.aux_loss, out.logits

    return ps.shard_map(
        body,
        in_specs=(specs, P(axes)),
        out_specs=(P(), P(), P(), P(axes)),
        axis_names=axes,
    )


def skew(model: torch.nn.Module) -> None:
    """Heavily unbalanced routing: every token's first choice is expert 0 or 1 (rank 0's):
    their router rows are +c u and -c u, one of which is large and positive for any token."""
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for layer in model.model.layers:
            u = torch.randn(layer.mlp.gate.weight.shape[1], dtype=f64, generator=g)
            layer.mlp.gate.weight[0] = 40 * u
            layer.mlp.gate.weight[1] = -40 * u


def rank_matches(family: str, mesh: dict, mode: str, fsdp: bool = False) -> dict:
    ps.init_mesh(mesh)
    axes = tuple(mesh)
    model = build(family)
    if mode == "skewed":
        skew(model)
    if mode == "checkpoint":
        ps.checkpoint_layers(model)
    b = batch(2 * ps.axis_size(axes))
    count = (b["labels"][:, 1:] != -100).sum()
    whole = {k: v.detach() for k, v in model.named_parameters()}
    specs = ps.expert_parallel_specs(model, "ep")
    call = None
    if fsdp:  # every parameter also split over "dp" (the experts on their hidden dim)
        specs = {k: P(*s, "dp") if s else P("dp") for k, s in specs.items()}
        specs = {k: s if whole[k].dim() >= len(s) else P() for k, s in specs.items()}

        def call(params, rows):
            return ps.sharded_call(model, params, (), {**rows, "use_cache": False}, specs=specs)

    params = ps.shard(whole, specs)
    with ps.expert_parallel(model, "ep"):
        fn = _loss(model, specs, b, count, axes, call=call)
        if mode == "backward":  # the backward pass runs after the block exits
            leaves = {k: ps.GlobalTensor(v.local.clone().requires_grad_(), v.meta)
                      for k, v in params.items()}  # fmt: skip
            ce, loss, aux, logits = fn(leaves, b)
    if mode == "backward":
        ce.backward()
        grads = {k: v.local.grad for k, v in leaves.items()}
        hf_grads = None
    else:
        with ps.expert_parallel(model, "ep"):
            grads, (ce, loss, aux, logits) = torch.func.grad(
                lambda p: (lambda o: (o[0], o))(fn(p, b)), has_aux=True
            )(params)
            hf_grads = torch.func.grad(lambda p: fn(p, b)[1])(params)
            grads = {k: g.local for k, g in grads.items()}
            hf_grads = {k: g.local for k, g in hf_grads.items()}
    want = reference(model, b)

    def block(k: str, t: torch.Tensor) -> torch.Tensor:
        return ps.shard(t, specs[k]).local

    return {
        "out": [
            (ce, want["ce"], EXACT),
            (logits, want["logits"], EXACT),
            (loss, want["loss"], FLOAT32),
            (aux, want["aux"], FLOAT32),
        ],  # fmt: skip
        "grads": {k: (g, block(k, want["grads"][k])) for k, g in grads.items()},
        "hf_grads": {k: (g, block(k, want["hf_grads"][k])) for k, g in (hf_grads or {}).items()},
        "split": {k: params[k].local.shape[0] for k in params if k.endswith(_STACKED)},
        "first choices": _first_choices(model, b),
    }


def _first_choices(model: torch.nn.Module, b: dict) -> list[int]:
    """How many of the batch's tokens choose each expert first, in layer 0."""
    with torch.no_grad():
        hidden = model.model.layers[0].input_layernorm(model.model.embed_tokens(b["input_ids"]))
        logits = model.model.layers[0].mlp.gate(hidden.flatten(0, 1))[0]
    return torch.bincount(logits.argmax(-1), minlength=8).tolist()


def _check(results: list[dict], local: int, skewed: bool = False) -> None:
    if skewed:  # every token's first choice on rank 0
        choices = results[0]["first choices"]
        assert sum(choices[:2]) == sum(choices), choices
    for r, res in enumerate(results):
        for got, want, tol in res["out"]:
            torch.testing.assert_close(got.detach(), want, **tol, msg=f"rank {r}")
        for name, (got, want) in res["grads"].items():
            torch.testing.assert_close(got, want, **EXACT, msg=f"rank {r}: {name}")
        for name, (got, want) in res["hf_grads"].items():
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6, msg=f"rank {r}: {name}")
        assert res["split"] and set(res["split"].values()) == {local}, res["split"]


@pytest.mark.parametrize(
    ("family", "n", "mode"),
    [
        ("mixtral", 2, "grad"),
        ("qwen2_moe", 2, "grad"),
        ("qwen3_moe", 4, "grad"),
        ("mixtral", 4, "backward"),
        ("qwen2_moe", 2, "checkpoint"),
        ("qwen2_moe", 4, "grad"),
        ("mixtral", 4, "skewed"),
        ("qwen3_moe", 2, "skewed"),
    ],
)
def test_matches_one_process(pool, family: str, n: int, mode: str) -> None:
    _check(pool.run(n, rank_matches, family, {"ep": n}, mode), 8 // n, mode == "skewed")


def test_dp_by_ep_with_sharded_call(pool) -> None:
    """FSDP over "dp" x experts over "ep" on 4 ranks: the statistics and the count of the loss
    summed over both axes (all four ranks' tokens)."""
    _check(pool.run(4, rank_matches, "mixtral", {"dp": 2, "ep": 2}, "grad", True), 4)


def test_on_gloo_processes(procs) -> None:
    _check(procs.run(2, rank_matches, "qwen3_moe", {"ep": 2}, "grad"), 4)


_ATTENTION = {f"model.layers.*.self_attn.{n}_proj": "colwise" for n in "qkv"} | {
    "model.layers.*.self_attn.o_proj": "rowwise"
}
# the router's weights are float32 (Hugging Face's softmax of logits.float()): the attention's
# split sums change the float64 cotangents reaching them by their rounding, which their float32
# rounding turns into ~1e-8 relative differences upstream
ROUTER32 = {"rtol": 1e-6, "atol": 1e-9}


def rank_with_tensor_parallel() -> dict:
    ps.init_mesh({"ep": 2, "tp": 2})
    model = build("mixtral")
    b = batch(4)
    count = (b["labels"][:, 1:] != -100).sum()
    whole = {k: v.detach() for k, v in model.named_parameters()}
    ep, tp = ps.expert_parallel_specs(model), ps.tensor_parallel_specs(model, _ATTENTION)
    specs = {k: tp[k] if tp[k] != P() else ep[k] for k in whole}

    def body(p, rows):
        out = torch.func.functional_call(model, p, (), {**rows, "use_cache": False})
        ce = ps.psum(ce_sum(out.logits, rows["labels"]), "ep") / count
        return ce, out.loss, out.aux_loss

    with ps.tensor_parallel(model, _ATTENTION), ps.expert_parallel(model):
        fn = ps.shard_map(body, in_specs=(specs, P("ep")), out_specs=(P(), P(), P()))
        grads, (ce, loss, aux) = torch.func.grad(
            lambda p: (lambda o: (o[0], o))(fn(p, b)), has_aux=True
        )(ps.shard(whole, specs))
    want = reference(model, b)
    return {
        "out": [
            (ce, want["ce"], EXACT),
            (loss, want["loss"], FLOAT32),
            (aux, want["aux"], FLOAT32),
        ],  # fmt: skip
        "grads": {
            k: (g.local, ps.shard(want["grads"][k], specs[k]).local) for k, g in grads.items()
        },  # fmt: skip
        "split": {k: (tuple(g.local.shape), tuple(g.shape)) for k, g in grads.items()},
    }


def test_ep_with_tensor_parallel_attention(pool) -> None:
    """Experts over "ep", the attention's heads over "tp" (its tokens replicated there): the
    losses of the whole batch and the gradients of one process."""
    for r, res in enumerate(pool.run(4, rank_with_tensor_parallel)):
        for got, want, tol in res["out"]:
            torch.testing.assert_close(got.detach(), want, **tol, msg=f"rank {r}")
        for name, (got, want) in res["grads"].items():
            torch.testing.assert_close(got, want, **ROUTER32, msg=f"rank {r}: {name}")
        q = res["split"]["model.layers.0.self_attn.q_proj.weight"]
        e = res["split"]["model.layers.0.mlp.experts.down_proj"]
        assert q[0][0] * 2 == q[1][0] and e[0][0] * 2 == e[1][0], res["split"]


# ---------------------------------------------------------------- the experts call alone


class _Holder(torch.nn.Module):
    """A model of one experts module (with its config, as a Hugging Face model), called as
    its mixture-of-experts block calls it."""

    def __init__(self, experts: torch.nn.Module) -> None:
        super().__init__()
        self.experts = experts
        self.config = experts.config

    def forward(self, hidden, index, weights):
        return self.experts(hidden, index, weights)


def _experts() -> torch.nn.Module:
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    config = build("mixtral", layers=1).config
    experts = MixtralExperts(config).double()
    torch.nn.init.normal_(experts.gate_up_proj, std=0.3, generator=torch.Generator().manual_seed(1))
    torch.nn.init.normal_(experts.down_proj, std=0.3, generator=torch.Generator().manual_seed(2))
    return experts


def _routing(case: str, rank: int, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s tokens (rows, 16), top-2 experts and weights."""
    g = torch.Generator().manual_seed(10 + rank)
    rows = 0 if case == "empty" and rank == 1 else 3 + 2 * rank
    hidden = torch.randn(rows, 16, dtype=f64, generator=g)
    index = torch.tensor(
        [torch.randperm(8, generator=g)[:2].tolist() for _ in range(rows)], dtype=torch.long
    )
    index = index.reshape(rows, 2)
    if case == "one rank":  # every token of every rank to rank 0's experts (0 and 1, or 1 and 0)
        index = torch.tensor([[i % 2, 1 - i % 2] for i in range(rows)]).reshape(rows, 2)
    if case == "none":  # expert 8 of 8: no expert (transformers' experts skip it)
        index[::2, 1] = 8
    if case == "bad" and rank == 1:
        index[0, 0] = 9
    weights = torch.rand(rows, 2, generator=g).float()
    return hidden, index, weights


def rank_experts_call(case: str, n: int) -> tuple:
    ps.init_mesh({"ep": n})
    r = ps.axis_index("ep")
    holder = _Holder(_experts())
    whole = {k: v.detach() for k, v in holder.named_parameters()}
    mine = _routing(case, r, n)
    hidden_r, index_r, weights_r = (t.requires_grad_() if t.is_floating_point() else t
                                    for t in mine)  # fmt: skip
    with ps.expert_parallel(holder, "ep") as specs:
        leaves = {k: ps.GlobalTensor(v.local.clone().requires_grad_(), v.meta)
                  for k, v in ps.shard(whole, specs).items()}  # fmt: skip

        def body(p):  # each rank its own tokens (closed over): the sum of every rank's
            out = torch.func.functional_call(holder, p, (hidden_r, index_r, weights_r))
            return ps.psum((out * torch.arange(1.0, 17.0, dtype=f64)).sum(), "ep")

        ps.shard_map(body, in_specs=(specs,), out_specs=P())(leaves).backward()
    # the oracle: transformers' experts on every rank's tokens at once
    everyone = [_routing(case, s, n) for s in range(n)]
    hidden = torch.cat([e[0] for e in everyone]).requires_grad_()
    weights = torch.cat([e[2] for e in everyone]).requires_grad_()
    index = torch.cat([e[1] for e in everyone])
    out = holder(hidden, index, weights)
    want = torch.autograd.grad(
        (out * torch.arange(1.0, 17.0, dtype=f64)).sum(), [hidden, weights, *holder.parameters()]
    )
    start = sum(e[0].shape[0] for e in everyone[:r])
    rows = slice(start, start + mine[0].shape[0])
    return (
        (hidden_r.grad, want[0][rows]),
        (weights_r.grad, want[1][rows]),
        *(
            (leaves[k].local.grad, ps.shard(w, specs[k]).local)
            for k, w in zip(whole, want[2:], strict=True)
        ),  # fmt: skip
    )


@pytest.mark.parametrize(("case", "n"), [("random", 2), ("one rank", 4), ("empty", 2), ("none", 2)])
def test_experts_call_matches_transformers(pool, case: str, n: int) -> None:
    """Each rank's tokens through the experts of every rank: the gradients of its tokens, its
    routing weights and its experts' blocks equal transformers' eager experts on all tokens."""
    for r, pairs in enumerate(pool.run(n, rank_experts_call, case, n)):
        for i, (got, want) in enumerate(pairs):
            torch.testing.assert_close(got, want, **EXACT, msg=f"rank {r}, value {i}")


def test_a_router_choosing_no_expert_is_an_error_on_every_rank(pool) -> None:
    texts = pool.run(2, _raises, rank_experts_call, "bad", 2)
    for text in texts:
        assert "the router of rank(s) [1] of 'ep' chose experts outside 0..7 (or 8 for none)" in (
            text
        ), text


def _raises(fn, *args) -> str:
    try:
        fn(*args)
    except ValueError as e:
        return str(e)
    return "no error"


# ---------------------------------------------------------------- composition


def rank_norm_and_save(path: str) -> tuple:
    ps.init_mesh({"ep": 4})
    model = build("mixtral")
    b = batch(4)
    count = (b["labels"][:, 1:] != -100).sum()
    specs = ps.expert_parallel_specs(model)
    params = ps.shard({k: v.detach() for k, v in model.named_parameters()}, specs)
    with ps.expert_parallel(model):
        grads = torch.func.grad(lambda p: _loss(model, specs, b, count, ("ep",))(p, b)[0])(params)
    norm = ps.optim.global_norm(grads)
    clip = ps.optim.clip_by_global_norm(norm.item() / 3)
    clipped = clip.update(grads, clip.init(params))[0]
    ps.save(path, params)
    want = reference(model, b)["grads"]
    whole_norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in want.values()]))
    return (norm, whole_norm), {
        k: (g.local, ps.shard(want[k] * (norm.item() / 3 / whole_norm), specs[k]).local)
        for k, g in clipped.items()
    }


def rank_load(path: str) -> dict:
    ps.init_mesh({"ep": 2})
    model = build("mixtral")
    specs = ps.expert_parallel_specs(model)
    loaded = ps.load(path, specs=specs)
    whole = {k: v.detach() for k, v in model.named_parameters()}
    return {k: (v.local, ps.shard(whole[k], specs[k]).local) for k, v in loaded.items()}


def test_global_norm_and_a_save_resharded(pool, tmp_path) -> None:
    """The global norm of the experts' blocks and the rest, the clipping by it (to a third),
    and the experts saved from 4 ranks loaded on 2."""
    for (norm, want), clipped in pool.run(4, rank_norm_and_save, str(tmp_path / "ckpt")):
        torch.testing.assert_close(norm, want, **EXACT)
        for k, (got, expected) in clipped.items():
            torch.testing.assert_close(got, expected, **EXACT, msg=k)
    names = [n for n, _ in build("mixtral").named_parameters()]
    for pairs in pool.run(2, rank_load, str(tmp_path / "ckpt")):
        assert sorted(pairs) == sorted(names)
        for k, (got, expected) in pairs.items():
            assert torch.equal(got, expected), k


# ---------------------------------------------------------------- errors


def rank_errors() -> list[str]:
    ps.init_mesh({"ep": 4})
    texts = []
    for bad in (lambda: ps.expert_parallel_specs(build("mixtral", experts=6)),
                lambda: ps.expert_parallel_specs(torch.nn.Linear(2, 2)),
                lambda: ps.expert_parallel_specs(build("mixtral"), "tp")):  # fmt: skip
        try:
            bad()
        except ValueError as e:
            texts.append(str(e))
    model = build("mixtral")
    b = batch(4)
    with ps.expert_parallel(model):
        try:  # outside a map over the axis
            model(**b)
        except RuntimeError as e:
            texts.append(str(e))
        try:  # whole experts where the map gives blocks
            whole = {k: v.detach() for k, v in model.named_parameters()}
            ps.shard_map(lambda p, x: torch.func.functional_call(model, p, (), x).logits,
                         in_specs=(P(), P("ep")), out_specs=P("ep"))(whole, b)  # fmt: skip
        except ValueError as e:
            texts.append(str(e))
    return texts


def test_errors_on_every_rank(pool) -> None:
    for texts in pool.run(4, rank_errors):
        assert len(texts) == 5, texts
        assert re.search(r"model\.layers\.0\.mlp\.experts holds 6 experts, which axis 'ep' of 4 "
                         r"ranks does not divide", texts[0]), texts[0]  # fmt: skip
        assert "expert_parallel_specs(Linear): no known experts module" in texts[1]
        assert "axis 'tp' is not an axis of the mesh" in texts[2]
        assert "runs outside a map over 'ep'" in texts[3]
        assert (
            "model.layers.0.mlp.experts.gate_up_proj has 8 experts on this rank, but 8 experts "
            "over 4 ranks of 'ep' are 2 each" in texts[4]
        ), texts[4]


def test_the_model_is_restored() -> None:
    ps.init_mesh({"ep": 1})
    model = build("qwen2_moe")
    module = type(model).__module__
    own = sys.modules[module].load_balancing_loss_func
    with ps.expert_parallel(model):
        assert "forward" in model.model.layers[0].mlp.experts.__dict__
        assert sys.modules[module].load_balancing_loss_func is not own
    assert "forward" not in model.__dict__
    assert "forward" not in model.model.layers[0].mlp.experts.__dict__
    assert sys.modules[module].load_balancing_loss_func is own


# ---------------------------------------------------------------- Hugging Face checkpoints


def rank_load_pretrained(path: str, mesh: dict) -> dict:
    ps.init_mesh(mesh)
    model = build("qwen3_moe")
    specs = ps.expert_parallel_specs(model)
    if "dp" in mesh:  # and FSDP over "dp": the experts' blocks split further, on their rows
        specs = {k: P(*s, "dp") if s else P("dp") for k, s in specs.items()}
    loaded = ps.load(path, specs=specs)
    whole = {k: v.detach() for k, v in model.named_parameters()}
    return {k: (v.local, ps.shard(whole[k], specs[k]).local) for k, v in loaded.items()}


@pytest.mark.parametrize("mesh", [{"ep": 2}, {"dp": 2, "ep": 2}])
def test_load_what_save_pretrained_wrote(pool, tmp_path, mesh) -> None:
    """save_pretrained stores each expert apart (experts.0.gate_proj.weight, ...): ps.load
    gives the model's stacked tensors, each rank its block of them."""
    model = build("qwen3_moe")
    model.save_pretrained(tmp_path)
    meta = ps.load_metadata(str(tmp_path))
    names = [n for n, _ in model.named_parameters()]
    assert sorted(meta) == sorted(names), sorted(set(meta) ^ set(names))
    results = pool.run(math.prod(mesh.values()), rank_load_pretrained, str(tmp_path), mesh)
    for r, pairs in enumerate(results):
        assert sorted(pairs) == sorted(names)
        for k, (got, want) in pairs.items():
            assert torch.equal(got, want), (r, k)


# ---------------------------------------------------------------- ps.jit


def rank_under_jit() -> tuple:
    ps.init_mesh({"ep": 2})
    model = build("qwen3_moe").train()
    b = batch(4)
    count = (b["labels"][:, 1:] != -100).sum()
    specs = ps.expert_parallel_specs(model)
    params = ps.shard({k: v.detach() for k, v in model.named_parameters()}, specs)

    def grads(p, b):
        with ps.expert_parallel(model):
            return torch.func.grad(lambda p: _loss(model, specs, b, count, ("ep",))(p, b)[0])(p)

    want = grads(params, b)  # eager, without checkpoints (the same numbers)
    ps.checkpoint_layers(model)
    lowered = ps.jit(grads).lower(params, b)
    got = lowered.compile("eager")(params, b)  # the program as it is (dynamo, no AOT pass)
    collectives = [name for name, _ in lowered.collectives]
    return [(got[k].local, want[k].local) for k in want], collectives


def test_under_jit(pool) -> None:
    """The whole gradient of a Qwen3-MoE under expert parallelism, its layers checkpointed, as
    one program: the counts of the exchanges are data of the program (run as traced; inductor
    cannot yet compile the programs whose sizes depend on data, and says so), and the backward
    exchanges the tokens again: dispatch and combine of 2 layers, their transposes, and the
    recompute's (12; 8 without checkpoints)."""
    for r, (pairs, collectives) in enumerate(pool.run(2, rank_under_jit)):
        for got, want in pairs:
            torch.testing.assert_close(got, want, **EXACT, msg=f"rank {r}")
        assert {"ragged_all_to_all", "all_to_all"} <= set(collectives)
        assert collectives.count("ragged_all_to_all") == 12, collectives
