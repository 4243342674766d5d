"""Hugging Face causal LMs under ``sequence_parallel(model, attention=...)``: tiny random Llama
(GQA), Qwen2, Mistral (sliding window) and GPT2 models in float64, on 2 and 4 gloo ranks, every
layout, Ulysses and ring, called the usual ways (``labels=``, left and right padding, packed
rows, ``logits_to_keep`` 0 and k, ``inputs_embeds``, gradient checkpointing reentrant or not),
against the same model on one process: logits to 1e-9 (at real tokens: a padding token sees
nothing under pshard, while transformers' kernels disagree among themselves on what it sees),
the loss to float32 precision (transformers computes its loss in float32), gradients after
``reduce_gradients`` to 1e-7.
Every refusal is pinned by its message, and the model is unchanged after the block."""

from __future__ import annotations

import copy
import re
import warnings

import pytest
import torch

import pshard as ps

transformers = pytest.importorskip("transformers")

TOL = {"rtol": 1e-9, "atol": 1e-9}
GRAD_TOL = {"rtol": 1e-7, "atol": 1e-9}
LOSS_TOL = {"rtol": 2e-6, "atol": 1e-7}  # transformers' loss is computed in float32
V = 40


def build(family: str, **overrides) -> torch.nn.Module:
    """A tiny random model of ``family`` in float64 (sdpa attention, no dropout)."""
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    common = {"vocab_size": V, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2}
    common.update(num_attention_heads=4, max_position_embeddings=64)
    if family == "llama":
        config = LlamaConfig(**common, num_key_value_heads=2)
        cls = LlamaForCausalLM
    elif family == "qwen2":
        config = Qwen2Config(**common, num_key_value_heads=2)
        cls = Qwen2ForCausalLM
    elif family == "mistral":
        config = MistralConfig(**common, num_key_value_heads=1, sliding_window=3)
        cls = MistralForCausalLM
    else:
        config = GPT2Config(
            vocab_size=V, n_embd=16, n_layer=2, n_head=4, n_positions=64,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        )  # fmt: skip
        cls = GPT2LMHeadModel
    for key, value in overrides.items():
        setattr(config, key, value)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cls(config).double()


def inputs(kind: str, s: int, seed: int) -> dict:
    """The usual ways of calling a causal LM, on a batch of 2 rows of ``s`` tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, V, (2, s), generator=g)
    if kind == "labels":
        return {"input_ids": ids, "labels": ids}
    if kind in ("left", "right"):
        mask = torch.ones(2, s, dtype=torch.long)
        if kind == "left":
            mask[1, :2] = 0
        else:
            mask[1, -2:] = 0
        return {
            "input_ids": ids,
            "attention_mask": mask,
            "labels": ids.masked_fill(mask == 0, -100),
        }
    if kind == "packed":  # DataCollatorWithFlattening: positions restart, -100 at doc starts
        pos = torch.stack([torch.arange(s), torch.arange(s)])
        pos[0, 3:] = torch.arange(s - 3)
        pos[1, s // 2 :] = torch.arange(s - s // 2)
        return {"input_ids": ids, "position_ids": pos, "labels": ids.masked_fill(pos == 0, -100)}
    if kind == "keep":
        return {"input_ids": ids, "logits_to_keep": 2}
    if kind == "keep0":
        return {"input_ids": ids, "labels": ids, "logits_to_keep": 0}
    raise AssertionError(kind)


def _grads(model) -> list:
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def _forward(model, kw: dict, embeds: bool):
    kw = dict(kw)
    if embeds:
        kw["inputs_embeds"] = model.get_input_embeddings()(kw.pop("input_ids"))
    out = model(**kw)
    return out.logits, out.loss if out.loss is not None else (out.logits**2).mean()


def _run(model, kw: dict, embeds: bool):
    logits, loss = _forward(model, kw, embeds)
    loss.backward()
    return logits.detach(), loss.detach()


def _case(family, kind, layout, attention, s, embeds=False, checkpoint=None, seed=0) -> dict:
    model = build(family)
    if checkpoint is not None:
        model.train()
        model.gradient_checkpointing_enable({"use_reentrant": checkpoint})
    ref = copy.deepcopy(model)
    kw = inputs(kind, s, seed)
    # the reference is called as training calls it: without a cache (with one, transformers
    # skips its packed-document mask and attends across documents)
    want_logits, want_loss = _run(ref, {**kw, "use_cache": False}, embeds)
    with ps.sequence_parallel(model, layout=layout, attention=attention):
        logits, loss = _forward(model, kw, embeds)
    loss.backward()  # outside the block: checkpointed layers are recomputed with pshard's attention
    logits, loss = logits.detach(), loss.detach()
    ps.reduce_gradients(model, "sp")
    real = kw.get("attention_mask")
    if real is not None and kind != "keep":  # padding positions' logits are not compared
        logits, want_logits = (x[real.bool()] for x in (logits, want_logits))
    return {
        "logits": (logits, want_logits),
        "loss": (loss, want_loss),
        "grads": (_grads(model), _grads(ref)),
        "restored": model.config._attn_implementation == "sdpa"
        and not model._forward_pre_hooks
        and not model._forward_hooks,
    }


def _cases(n: int) -> list[tuple]:
    """(family, kind, layout, attention, seq_len, inputs_embeds, checkpoint)."""
    s = 2 * n + 3  # not divisible by n (nor 2n)
    out = []
    for i, family in enumerate(("llama", "qwen2", "mistral", "gpt2")):
        for j, layout in enumerate(("contiguous", "zigzag", "stripe")):
            attention = ("ulysses", "ring")[(i + j) % 2]
            kinds = ("labels", "left", "right", "packed") if n == 2 else ("left", "packed")
            for kind in kinds:
                out.append((family, kind, layout, attention, s, False, None))
    for attention in ("ulysses", "ring"):
        out.append(("llama", "keep", "zigzag", attention, s, False, None))
        out.append(("llama", "keep0", "zigzag", attention, s, False, None))
        out.append(("mistral", "labels", "zigzag", attention, s, True, None))  # inputs_embeds
        for reentrant in (False, True):
            out.append(("qwen2", "left", "zigzag", attention, s, False, reentrant))
            out.append(("mistral", "packed", "stripe", attention, s, False, reentrant))
    return out


def _worker(n: int) -> list:
    ps.init_mesh({"sp": n})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' own deprecation notes
        return [_case(*case, seed=i) for i, case in enumerate(_cases(n))]


@pytest.mark.parametrize("n", [2, 4])
def test_models_match_single_process(pool, n: int) -> None:
    results = pool.run(n, _worker, n, timeout=300)
    for r, per_rank in enumerate(results):
        for case, res in zip(_cases(n), per_rank, strict=True):
            msg = f"rank {r} {case}"
            torch.testing.assert_close(*res["logits"], msg=msg, **TOL)
            torch.testing.assert_close(*res["loss"], msg=msg, **LOSS_TOL)
            got, want = res["grads"]
            assert len(got) == len(want) > 0, msg
            for a, b in zip(got, want, strict=True):
                torch.testing.assert_close(a, b, msg=msg, **GRAD_TOL)
            assert res["restored"], msg


# --------------------------------------------------------------------------- refusals


def _refusals_worker(n: int) -> dict:
    ps.init_mesh({"sp": n})
    ids = torch.randint(1, V, (1, 5))
    out = {}

    def attempt(name, fn):
        try:
            fn()
        except (ValueError, RuntimeError, TypeError) as e:
            out[name] = (type(e).__name__, str(e))
        else:
            out[name] = None

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build("llama")

        def plain_sdpa():  # no attention plugged: the model's own sdpa on local tokens
            with ps.sequence_parallel(model):
                model(input_ids=ids)

        def cache():
            with ps.sequence_parallel(model, attention="ulysses"):
                model(input_ids=ids, use_cache=True)

        def generate():
            with ps.sequence_parallel(model, attention="ring"):
                model.generate(ids, max_new_tokens=2, do_sample=False)

        def attentions():
            with ps.sequence_parallel(model, attention="ulysses"):
                model(input_ids=ids, output_attentions=True)

        def nested():
            with ps.sequence_parallel(model, attention="ulysses"):
                with ps.sequence_parallel(model, attention="ring"):
                    pass

        def dropout():
            dropping = build("llama", attention_dropout=0.5)
            dropping.train()
            with ps.sequence_parallel(dropping, attention="ulysses"):
                dropping(input_ids=ids)

        def not_hf():
            ps.sequence_parallel(torch.nn.Linear(2, 2), attention="ulysses")

        for name, fn in [
            ("plain_sdpa", plain_sdpa),
            ("cache", cache),
            ("generate", generate),
            ("attentions", attentions),
            ("nested", nested),
            ("dropout", dropout),
            ("not_hf", not_hf),
        ]:
            attempt(name, fn)
        out["restored"] = (
            model.config._attn_implementation == "sdpa" and not model._forward_pre_hooks
        )
    return out


def test_refusals(pool) -> None:
    for res in pool.run(2, _refusals_worker, 2):
        assert res.pop("restored")
        want = {
            "plain_sdpa": (
                "RuntimeError",
                "sequence_parallel(LlamaForCausalLM): no sequence-parallel attention ran during "
                "this forward: the model used its own attention ('sdpa')",
            ),
            "cache": (
                "ValueError",
                "sequence_parallel(LlamaForCausalLM): use_cache=True (a KV cache, as generate() "
                "asks for) cannot be used inside the block",
            ),
            "generate": ("ValueError", "sequence_parallel(LlamaForCausalLM): "),
            "attentions": (
                "ValueError",
                "sequence_parallel(LlamaForCausalLM): output_attentions=True cannot be honoured",
            ),
            "nested": (
                "RuntimeError",
                "sequence_parallel(LlamaForCausalLM): the model is already under "
                "sequence_parallel; it cannot be nested on one model",
            ),
            "dropout": (
                "ValueError",
                "sequence_parallel: LlamaAttention asks for attention dropout (p=0.5) in "
                "training mode",
            ),
            "not_hf": (
                "TypeError",
                "sequence_parallel(Linear): attention='ulysses' plugs into a Hugging Face "
                "model's attention interface",
            ),
        }
        for name, (kind, start) in want.items():
            assert res[name] is not None, f"{name} was not refused"
            assert res[name][0] == kind, (name, res[name])
            assert res[name][1].startswith(start), (name, res[name][1])
        assert re.search(r"KV cache|use_cache", res["generate"][1]), res["generate"]


def test_outside_the_block_is_the_model_itself() -> None:
    ps.init_mesh({"sp": 1})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build("llama")
        ids = torch.randint(1, V, (1, 6))
        before = model(input_ids=ids).logits
        with ps.sequence_parallel(model, attention="ring"):
            inside = model(input_ids=ids).logits
            # a submodule called on its own, outside any sequence-parallel call: its own sdpa
            hidden = model.model(input_ids=ids).last_hidden_state
        after = model(input_ids=ids).logits
    torch.testing.assert_close(inside, before, **TOL)
    torch.testing.assert_close(model.lm_head(hidden), before, **TOL)
    assert torch.equal(after, before)
    assert model.config._attn_implementation == "sdpa"


# --------------------------------------------------------------------------- FSDP2


def _fsdp_worker() -> dict:
    """A 2 x 2 mesh: FSDP2 (fully_shard) over "dp", sequence_parallel over "sp"."""
    from torch.distributed.fsdp import fully_shard

    mesh = ps.init_mesh({"dp": 2, "sp": 2})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build("llama")
        ref = copy.deepcopy(model)
        batches = [inputs("left", 7, seed=s) for s in (1, 2)]
        # one process: the mean over the data-parallel batches (what FSDP's gradient averages)
        losses = [ref(**b, use_cache=False).loss for b in batches]
        (sum(losses) / 2).backward()
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        mine = batches[mesh.get_local_rank("dp")]
        with ps.sequence_parallel(model, axis="sp", mesh=mesh, attention="ring", layout="zigzag"):
            loss = model(**mine).loss
        loss.backward()
        ps.reduce_gradients(model, "sp")
        got = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    return {
        "loss": (loss.detach(), losses[mesh.get_local_rank("dp")].detach()),
        "grads": [(got[n], p.grad) for n, p in ref.named_parameters()],
    }


def test_fsdp2_over_dp_and_sequence_parallel_over_sp(pool) -> None:
    for res in pool.run(4, _fsdp_worker, timeout=300):
        torch.testing.assert_close(*res["loss"], **LOSS_TOL)
        for got, want in res["grads"]:
            torch.testing.assert_close(got, want, **GRAD_TOL)


# --------------------------------------------------------------------------- usp on a 2-D mesh


def _usp_worker() -> list:
    ps.init_mesh({"ring": 2, "uly": 2})
    out = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for family, kind, layout in (
            ("llama", "left", "zigzag"),
            ("mistral", "packed", "contiguous"),
        ):
            model = build(family)
            ref = copy.deepcopy(model)
            kw = inputs(kind, 11, seed=5)
            want_logits, want_loss = _run(ref, {**kw, "use_cache": False}, False)
            with ps.sequence_parallel(model, axis=("ring", "uly"), layout=layout, attention="usp"):
                logits, loss = _forward(model, kw, False)
            loss.backward()
            ps.reduce_gradients(model, ("ring", "uly"))
            real = kw.get("attention_mask")
            if real is not None:
                logits, want_logits = logits[real.bool()], want_logits[real.bool()]
            out.append(
                {
                    "case": (family, kind, layout),
                    "logits": (logits.detach(), want_logits),
                    "loss": (loss.detach(), want_loss),
                    "grads": (_grads(model), _grads(ref)),
                }
            )
    return out


def test_usp_on_a_2d_mesh(pool) -> None:
    for r, per_rank in enumerate(pool.run(4, _usp_worker, timeout=300)):
        for res in per_rank:
            msg = f"rank {r} {res['case']}"
            torch.testing.assert_close(*res["logits"], msg=msg, **TOL)
            torch.testing.assert_close(*res["loss"], msg=msg, **LOSS_TOL)
            for a, b in zip(*res["grads"], strict=True):
                torch.testing.assert_close(a, b, msg=msg, **GRAD_TOL)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_readme_token_weighted_accumulation_on_a_model(family: str) -> None:
    """The README's pmap_microbatch call on a Hugging Face model, with out_specs inferred (it
    could not trace: the padding of the labels fixed the batch size, transformers' checks on
    values stopped the trace, the mask's arange over the batch and the attention kernels had no
    rule) and given: the loss and gradients are the whole batch's token mean (the model shifts
    its labels inside, so the weight counts the targets after the shift); the whole output too
    (logits concatenated, loss token-weighted)."""
    model = build(family)
    params = {k: v.detach() for k, v in model.named_parameters()}
    g = torch.Generator().manual_seed(0)
    batch = {"input_ids": torch.randint(0, V, (4, 9), generator=g)}
    batch["labels"] = torch.randint(0, V, (4, 9), generator=g)
    batch["labels"][0, :5] = -100  # uneven target counts

    def loss_fn(params, batch):
        return torch.func.functional_call(model, params, (), batch).loss

    def weight(batch):
        return (batch["labels"][:, 1:] != -100).sum()

    def step(**out):
        return ps.pmap_microbatch(
            torch.func.grad_and_value(loss_fn),
            num_microbatches=2,
            in_specs=(None, ps.Shard(0)),
            weight_fn=lambda params, batch: weight(batch),
            **out,
        )

    want_grads, want_loss = torch.func.grad_and_value(loss_fn)(params, batch)
    for out in ({}, {"out_specs": ps.Partial("mean")}):
        grads, loss = step(**out)(params, batch)
        torch.testing.assert_close(loss, want_loss, **LOSS_TOL)
        # the model's loss is float32 (its rounding, not the weighting: wrong weights move
        # them 1e-3)
        torch.testing.assert_close(grads, want_grads, rtol=1e-5, atol=1e-7)

    def forward(b):
        return model(**b, use_cache=False)

    whole = ps.pmap_microbatch(forward, num_microbatches=2, weight_fn=weight)(batch)
    want = forward(batch)
    torch.testing.assert_close(whole.logits, want.logits)
    torch.testing.assert_close(whole.loss, want.loss, **LOSS_TOL)
