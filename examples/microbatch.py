"""Microbatching a forward that returns logits and a loss, with inferred out specs.

    python examples/microbatch.py

``ps.pmap_microbatch`` splits the batch (dim 0, ``torch.tensor_split``'s rule: sizes differ by at
most one), runs the forward on each microbatch in turn and merges the outputs. With
``out_specs="infer"`` (the default) pshard traces the forward once with a symbolic batch size:
``logits`` carries the batch dim, so it is concatenated; ``loss`` is cross-entropy's mean over
the non-ignored targets, a ratio of two sums over the batch, which no size-weighted mean
reproduces: the analysis refuses it unless ``weight_fn`` gives each microbatch's number of
target tokens, and with it the merged loss is the exact token mean of the whole batch. The
same wrapper around ``torch.func.grad_and_value`` is gradient accumulation. Everything is
checked against the whole batch in one call (no process group needed).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import pshard as ps

VOCAB, DIM = 17, 8


def forward(params: dict, batch: dict) -> dict:
    logits = torch.tanh(params["embed"][batch["input_ids"]]) @ params["head"]
    targets = batch["labels"]
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
    return {"logits": logits, "loss": loss}


def loss_only(params: dict, batch: dict) -> torch.Tensor:
    return forward(params, batch)["loss"]


def tokens(params: dict, batch: dict) -> torch.Tensor:
    return (batch["labels"] != -100).sum()


def main() -> None:
    g = torch.Generator().manual_seed(0)
    params = {
        "embed": torch.randn(VOCAB, DIM, generator=g, dtype=torch.float64),
        "head": torch.randn(DIM, VOCAB, generator=g, dtype=torch.float64),
    }
    ids = torch.randint(0, VOCAB, (7, 12), generator=g)
    labels = ids.roll(-1, 1)
    labels[:, -1] = -100
    labels[torch.arange(12) < torch.randint(0, 11, (7, 1), generator=g)] = -100  # ragged prompts
    batch = {"input_ids": ids, "labels": labels}

    try:
        ps.infer_out_specs(forward, params, batch, in_specs=(None, ps.Shard(0)))
    except ValueError as error:  # the loss is a mean over targets: it needs their counts
        print(f"without weight_fn: {str(error).split(': ', 1)[1][:80]}...")
    logits_spec = ps.infer_out_specs(
        lambda params, batch: forward(params, batch)["logits"], params, batch,
        in_specs=(None, ps.Shard(0)),
    )  # fmt: skip
    print(f"inferred out spec of the logits: {logits_spec}; of the loss with weight_fn: mean")

    mb_forward = ps.pmap_microbatch(
        forward, num_microbatches=3, in_specs=(None, ps.Shard(0)), weight_fn=tokens
    )
    out, ref = mb_forward(params, batch), forward(params, batch)
    print(
        f"3 microbatches of rows {[len(c) for c in torch.arange(7).tensor_split(3)]}, "
        f"target tokens {[int(tokens(None, b)) for b in ps.split(batch, ps.Shard(0), 3)]}"
    )
    print(
        f"logits {tuple(out['logits'].shape)}, loss {out['loss'].item():.12f} "
        f"(whole batch {ref['loss'].item():.12f})"
    )

    accumulate = ps.pmap_microbatch(
        torch.func.grad_and_value(loss_only),
        num_microbatches=3,
        in_specs=(None, ps.Shard(0)),
        weight_fn=tokens,
    )
    grads, value = accumulate(params, batch)
    ref_grads, _ = torch.func.grad_and_value(loss_only)(params, batch)

    worst = max(
        (out["logits"] - ref["logits"]).abs().max().item(),
        (out["loss"] - ref["loss"]).abs().item(),
        (value - ref["loss"]).abs().item(),
        *((grads[k] - ref_grads[k]).abs().max().item() for k in params),
    )
    print(f"max difference against the whole batch (logits, loss, gradients): {worst:.1e}")
    if worst > 1e-12:
        raise SystemExit("microbatched results differ from the whole batch")


if __name__ == "__main__":
    main()
