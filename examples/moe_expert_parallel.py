"""A Hugging Face Qwen3-MoE loaded sharded from ``save_pretrained``, trained functionally on
dp x ep (experts over "ep", every weight also FSDP over "dp"), and exported back to
``from_pretrained``.

    python examples/moe_expert_parallel.py                      # 4 gloo ranks: dp=2 x ep=2
    python examples/moe_expert_parallel.py --backend threads    # the ranks as threads
    python examples/moe_expert_parallel.py --mesh dp=1,ep=4     # 4 experts' ranks of 2 each

A tiny random ``Qwen3MoeForCausalLM`` (8 experts, top-2, built from a config: nothing is
downloaded; float64) is written with ``save_pretrained``, which stores each expert apart
(``experts.<e>.gate_proj.weight``, ...). One step is::

    grads, loss = grad_and_value(shard_map(rows_loss, in_specs=(specs, P(("dp", "ep")))))(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    params = ps.optim.apply_updates(params, updates)

    def rows_loss(blocks, rows):                # this rank's blocks and its rows of the batch
        with ps.expert_parallel(model, "ep"):
            return ps.sharded_call(model, blocks, (), rows, specs=specs).loss

- ``ps.load`` reads the checkpoint into ``ps.GlobalTensor``s: the experts' stacked weights
  (``experts.gate_up_proj``, ``experts.down_proj``) made of the per-expert tensors, split over
  "ep" on the expert dim (``ps.expert_parallel_specs``) and over "dp" on their rows; everything
  else split over "dp". Each rank reads only its blocks' bytes;
- ``ps.expert_parallel`` routes each rank's tokens with the model's router, sends every token to
  the ranks holding its top-2 experts (``ps.ragged_all_to_all``, dropless), runs this rank's 4
  (or 2) experts, and sends the results back; ``ps.sharded_call`` gathers each decoder layer's
  weights over "dp" only (the experts stay split over "ep");
- the loss is the model's own ``out.loss``: the cross-entropy of the whole batch's tokens plus
  ``router_aux_loss_coef`` times the load-balancing loss, whose statistics (tokens per expert,
  router probabilities) are summed over all four ranks' tokens: one process's loss;
- the optimizer is ``ps.optim.chain(clip_by_global_norm(1.0), adamw(1e-2))`` on the blocks;
- at the end ``ps.save(..., format="huggingface", config=...)`` writes the trained weights
  (stacked), which ``AutoModelForCausalLM.from_pretrained`` loads (checked bit for bit).

The losses are checked against the same model trained in one process with plain PyTorch
(``model(**batch).loss.backward()``, the global norm clipped, ``torch.optim.AdamW``). The
model's loss is computed in float32 (transformers casts the logits, and the router's
probabilities are float32): the two runs agree to float32's rounding. See
docs/expert_parallel.md.
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
import warnings

import torch

import pshard as ps

P = ps.P
VOCAB, SEQ, ROWS, EXPERTS = 64, 12, 8, 8
LR, MAX_NORM = 1e-2, 1.0
TOLERANCE = 1e-5  # float32 losses (measured: 5e-7)


def config():  # -> Qwen3MoeConfig
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_experts=EXPERTS,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
        output_router_logits=True,
        router_aux_loss_coef=0.1,
        attn_implementation="sdpa",
        experts_implementation="eager",  # grouped_mm refuses float64 on the CPU
    )


def initial_model() -> torch.nn.Module:
    """The model with its initial weights (random, seeded: the same in every process)."""
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(config()).double().train()


def skeleton() -> torch.nn.Module:
    """The model without its weights (``meta``: ``sharded_call`` runs its code with the
    gathered blocks); the rotary embedding's buffer is computed, so built on the CPU."""
    from transformers import Qwen3MoeForCausalLM

    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(config())
    model.model.rotary_emb = type(model.model.rotary_emb)(config())
    return model.double().train()


def batch(step: int) -> dict[str, torch.Tensor]:
    """``ROWS`` rows of random tokens (two batches, seen in turn), with right padding."""
    g = torch.Generator().manual_seed(step % 2)
    ids = torch.randint(1, VOCAB, (ROWS, SEQ), generator=g)
    mask = torch.ones(ROWS, SEQ, dtype=torch.long)
    for row in range(ROWS):
        mask[row, SEQ - row % 4 :] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def specs_of(model: torch.nn.Module) -> dict[str, P]:
    """Experts over "ep" on the expert dim (``expert_parallel_specs``), and every parameter
    over "dp" on its next dim (the experts' rows, the others' dim 0)."""
    return {k: P(*s, "dp") if s else P("dp") for k, s in ps.expert_parallel_specs(model).items()}


def optimizer() -> ps.optim.GradientTransformation:
    return ps.optim.chain(ps.optim.clip_by_global_norm(MAX_NORM), ps.optim.adamw(LR))


def run(args: argparse.Namespace) -> tuple[list[float], tuple[int, int], dict]:
    ps.init_mesh(args.mesh)
    warnings.simplefilter("ignore")  # transformers' notes about configs
    model = skeleton()
    specs = specs_of(model)
    # the per-expert tensors stacked, each rank reading its block
    params = ps.load(args.pretrained, specs=specs)
    axes = ("dp", "ep")

    def rows_loss(blocks: dict, rows: dict) -> torch.Tensor:
        with ps.expert_parallel(model, "ep"):
            out = ps.sharded_call(model, blocks, (), {**rows, "use_cache": False}, specs=specs)
        return out.loss  # the whole batch's, on every rank

    loss = ps.shard_map(rows_loss, in_specs=(specs, P(axes)), out_specs=P(), axis_names=axes)
    opt = optimizer()
    state = opt.init(params)
    losses = []
    for step in range(args.steps):
        grads, value = torch.func.grad_and_value(loss)(params, batch(step))
        updates, state = opt.update(grads, state, params)
        params = ps.optim.apply_updates(params, updates)
        losses.append(value.item())
    held = (sum(p.local.numel() for p in params.values()), sum(p.numel() for p in params.values()))
    ps.save(args.export, params, format="huggingface", config=model.config)
    return losses, held, ps.gather(params)


def reference(steps: int) -> list[float]:
    """The same training in one process with plain PyTorch."""
    model = initial_model()
    adam = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=1e-4)
    losses = []
    for step in range(steps):
        loss = model(**batch(step), use_cache=False).loss
        adam.zero_grad()
        loss.backward()
        # clipped by optax's rule (torch's own clipping divides by norm + 1e-6)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
        if norm > MAX_NORM:
            for p in model.parameters():
                p.grad.mul_(MAX_NORM / norm)
        adam.step()
        losses.append(loss.item())
    return losses


def mesh_arg(text: str) -> dict[str, int]:
    sizes = {k: int(v) for k, v in (item.split("=") for item in text.split(","))}
    if set(sizes) != {"dp", "ep"} or EXPERTS % sizes["ep"]:
        raise argparse.ArgumentTypeError(f"axes dp and ep (ep dividing {EXPERTS}), got {text!r}")
    return {"dp": sizes["dp"], "ep": sizes["ep"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--backend", choices=("gloo", "threads"), default="gloo")
    parser.add_argument("--mesh", type=mesh_arg, default="dp=2,ep=2")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        args.pretrained = os.path.join(tmp, "pretrained")
        args.export = os.path.join(tmp, "trained")
        initial_model().save_pretrained(args.pretrained)  # each expert apart
        nprocs = math.prod(args.mesh.values())
        (losses, (held, whole), trained), *_ = ps.spawn(
            run, args, nprocs=nprocs, backend=args.backend
        )
        exported = AutoModelForCausalLM.from_pretrained(args.export, dtype=torch.float64)
        exported = {k: v.detach() for k, v in exported.named_parameters()}
    plain = reference(args.steps)
    mesh = " x ".join(f"{k}={v}" for k, v in args.mesh.items())
    print(f"{'step':>4}{mesh:>22}{'one process':>22}")
    for i, (a, b) in enumerate(zip(losses, plain, strict=True)):
        print(f"{i + 1:>4}{a:22.12f}{b:22.12f}")
    print(f"parameters held per rank between steps: {held} of {whole}")
    same = exported.keys() == trained.keys() and all(
        torch.equal(exported[k], trained[k]) for k in trained
    )
    print(f"exported in Hugging Face's format, loaded by from_pretrained: "
          f"{'the trained weights, bit for bit' if same else 'OTHER WEIGHTS'}")  # fmt: skip
    diff = max(abs(a - b) for a, b in zip(losses, plain, strict=True))
    print(f"max difference against one process: {diff:.2e} (tolerance {TOLERANCE:g})")
    if not same or not diff <= TOLERANCE:
        raise SystemExit("the run differs from one process")


if __name__ == "__main__":
    main()
