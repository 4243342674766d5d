"""A Hugging Face Llama cut into pipeline stages and trained with ps.pipeline_value_and_grad.

    python examples/pipeline_llama.py                                  # 3 gloo ranks, 1F1B
    python examples/pipeline_llama.py --schedule zero_bubble --microbatches 6

A tiny random ``LlamaForCausalLM`` (built from a config: nothing is downloaded; float64) with
six decoder layers is cut into three stages, one per rank of the mesh axis ``"pp"``::

    stage 0: embed_tokens + layers 0, 1           token ids   -> hidden states
    stage 1: layers 2, 3                           hidden      -> hidden
    stage 2: layers 4, 5 + norm + lm_head          hidden      -> logits

Each rank holds only its stage's parameters (a dict of the model's own names) and runs its
part of the model functionally (``torch.func.functional_call`` on the model's own modules).
One step is::

    loss, grads = step(params, tokens, labels)    # ps.pipeline_value_and_grad(stages, ...)
    for name, p in params.items(): p.grad = grads[name]
    optimizer.step()                               # torch.optim.AdamW on this stage's tensors

The batch is cut into ``--microbatches`` microbatches of rows that flow through the stages as
the schedule says; the loss (the next-token cross-entropy, a mean over the batch's tokens:
each microbatch's sum divided by the batch's count) arrives on every rank. The losses are
checked against the same model trained in one process with plain PyTorch (``model(ids)``,
``loss.backward()``, ``torch.optim.AdamW``); the script prints them side by side and exits
non-zero when they differ by more than 1e-9. See docs/pipeline.md.
"""

from __future__ import annotations

import argparse
import warnings

import torch
import torch.nn.functional as F

import pshard as ps

VOCAB, SEQ, ROWS, LAYERS = 48, 10, 6, 6
CUTS = ((0, 2), (2, 4), (4, 6))  # each stage's decoder layers
LR = 1e-2


def make_model() -> torch.nn.Module:
    """The model with its initial weights (random, seeded: the same in every process)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attn_implementation="sdpa",  # causal without a mask: no padding in this batch
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).double().train()


def batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step % 2)  # two batches, seen in turn
    return torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)


def loss_sum(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The next-token cross-entropy summed over the tokens."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="sum")


# ----------------------------------------------------------------------------- the stages
def stage_names(model: torch.nn.Module, stage: int) -> list[str]:
    """The parameters of a stage: its decoder layers, plus the embedding or the head."""
    first, last = CUTS[stage]
    prefixes = [f"model.layers.{i}." for i in range(first, last)]
    if stage == 0:
        prefixes.append("model.embed_tokens.")
    if stage == len(CUTS) - 1:
        prefixes += ["model.norm.", "lm_head."]
    return [n for n, _ in model.named_parameters() if n.startswith(tuple(prefixes))]


def make_stages(model: torch.nn.Module) -> list:
    """The three stage functions ``stage(params, x) -> y``, ``params`` a dict of the model's
    own parameter names (only the stage's)."""
    inner = model.model

    def sub(params: dict, prefix: str) -> dict:
        return {k.removeprefix(prefix): v for k, v in params.items() if k.startswith(prefix)}

    def layers(params: dict, h: torch.Tensor, first: int, last: int) -> torch.Tensor:
        pos = torch.arange(h.shape[1]).unsqueeze(0)
        rope = inner.rotary_emb(h, pos)  # cos and sin: computed, not learned
        for i in range(first, last):
            h = torch.func.functional_call(
                inner.layers[i], sub(params, f"model.layers.{i}."), (h,),
                {"position_embeddings": rope, "position_ids": pos},
            )  # fmt: skip
        return h

    def embed(params: dict, ids: torch.Tensor) -> torch.Tensor:
        h = torch.func.functional_call(inner.embed_tokens, sub(params, "model.embed_tokens."), ids)
        return layers(params, h, *CUTS[0])

    def middle(params: dict, h: torch.Tensor) -> torch.Tensor:
        return layers(params, h, *CUTS[1])

    def head(params: dict, h: torch.Tensor) -> torch.Tensor:
        h = layers(params, h, *CUTS[2])
        h = torch.func.functional_call(inner.norm, sub(params, "model.norm."), h)
        return torch.func.functional_call(model.lm_head, sub(params, "lm_head."), h)

    return [embed, middle, head]


# ----------------------------------------------------------------------------- the runs
def rank(steps: int, microbatches: int, schedule: str) -> list[float]:
    """One rank of the pipeline: its stage's parameters, trained for ``steps`` steps."""
    ps.init_mesh({"pp": len(CUTS)})
    warnings.simplefilter("ignore")  # transformers' notes about configs
    r = ps.axis_index("pp")
    model = make_model()
    whole = dict(model.named_parameters())
    params = {n: whole[n].detach().clone().requires_grad_() for n in stage_names(model, r)}
    optimizer = torch.optim.AdamW(params.values(), lr=LR)
    count = ROWS * (SEQ - 1)  # the batch's targets: each microbatch's sum / count = the mean
    step = ps.pipeline_value_and_grad(
        make_stages(model),
        lambda logits, ids: loss_sum(logits, ids) / count,
        num_microbatches=microbatches,
        schedule=schedule,
    )
    losses = []
    for i in range(steps):
        ids = batch(i)
        loss, grads = step({n: p.detach() for n, p in params.items()}, ids, ids)
        for name, p in params.items():
            p.grad = grads[name]
        optimizer.step()
        losses.append(loss.item())
    return losses


def reference(steps: int) -> list[float]:
    """The same training in one process, with plain PyTorch."""
    warnings.simplefilter("ignore")
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for i in range(steps):
        ids = batch(i)
        loss = loss_sum(model(input_ids=ids).logits, ids) / (ROWS * (SEQ - 1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=3)
    parser.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b", "zero_bubble"])
    parser.add_argument(
        "--backend", choices=("gloo", "threads"), default="gloo", help="ranks: processes, threads"
    )
    args = parser.parse_args()
    got = ps.spawn(
        rank, args.steps, args.microbatches, args.schedule, nprocs=len(CUTS), backend=args.backend
    )
    want = reference(args.steps)
    print(f"{'step':>4}  {'pipeline':>14}  {'one process':>14}")
    for i, (a, b) in enumerate(zip(got[0], want, strict=True)):
        print(f"{i:>4}  {a:14.10f}  {b:14.10f}")
    worst = max(abs(a - b) for losses in got for a, b in zip(losses, want, strict=True))
    print(f"max difference over {len(CUTS)} ranks and {args.steps} steps: {worst:.2e}")
    if worst > 1e-9 or want[-1] >= want[0]:
        raise SystemExit("the pipeline's losses differ from one process's")


if __name__ == "__main__":
    main()
