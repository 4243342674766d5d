"""``ps.sequence_parallel`` on an ``nn.Module``: an existing model, sequence-parallel by hooks.

    python examples/module_hooks.py            # 2 gloo ranks
    python examples/module_hooks.py --nprocs 4

A small causal LM written as an ordinary ``nn.Module`` with a Hugging Face-like forward
(``input_ids``, ``position_ids``; returns a dict with ``logits``) whose attention function is
a constructor argument: SDPA for the plain model, ``ps.ulysses_attention`` (or
``ps.ring_attention``) for the sequence-parallel one; the weights are the same.
Inside ``with ps.sequence_parallel(model)`` the forward pre-hook splits every sequence argument
over the ``"sp"`` ranks (zigzag layout, padding a length that does not divide), the forward sees
this rank's tokens, and the post-hook gathers the logits back to the whole sequence, with their
gradient. After ``loss.backward()`` each rank holds its own tokens' share of the parameter
gradients; ``reduce_gradients`` sums them. Logits, loss and gradients are checked against the
same module run in one process.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn

import pshard as ps

VOCAB, DIM, HEADS = 23, 16, 4


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention on (batch, seq, heads, head_dim), the whole sequence in one process."""
    out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True)
    return out.transpose(1, 2)


def sp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The same, with the sequence split over the "sp" ranks (inside the hooks)."""
    return ps.ulysses_attention(q, k, v, axis="sp", causal=True)


class Block(nn.Module):
    def __init__(self, attention) -> None:
        super().__init__()
        self.attention = attention
        self.qkv = nn.Linear(DIM, 3 * DIM, bias=False)
        self.out = nn.Linear(DIM, DIM, bias=False)
        self.mlp = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm1(h)).unflatten(-1, (3, HEADS, -1)).unbind(2)
        a = self.attention(q, k, v)
        h = h + self.out(a.flatten(-2))
        return h + self.mlp(self.norm2(h))


class TinyLM(nn.Module):
    def __init__(self, attention=sdpa) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Embedding(64, DIM)
        self.blocks = nn.ModuleList(Block(attention) for _ in range(2))
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> dict:
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1]).expand_as(input_ids)
        h = self.embed(input_ids) + self.pos(position_ids)  # global positions, also when split
        for block in self.blocks:
            h = block(h)
        return {"logits": self.head(h)}


def lm_loss(logits: torch.Tensor, shift_labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), shift_labels.flatten())  # ignores -100


def rank_main(state: dict, batch: dict) -> dict:
    ps.init_mesh({"sp": torch.distributed.get_world_size()})
    model = TinyLM(sp_attention).double()
    model.load_state_dict(state)
    with ps.sequence_parallel(model, axis="sp", layout="zigzag"):
        logits = model(batch["input_ids"])["logits"]  # whole sequence again
    loss = lm_loss(logits, batch["shift_labels"])
    loss.backward()
    ps.reduce_gradients(model, "sp")  # each rank held its own tokens' share
    grads = {n: p.grad for n, p in model.named_parameters()}
    return {"logits": logits.detach(), "loss": loss.detach(), "grads": grads}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nprocs", type=int, default=2)
    parser.add_argument(
        "--backend",
        choices=("gloo", "threads"),
        default="gloo",
        help="ranks as processes or threads",
    )
    args = parser.parse_args()

    torch.manual_seed(0)
    model = TinyLM().double()
    ids = torch.randint(0, VOCAB, (3, 37))
    batch = ps.prepare_lm_batch({"input_ids": ids})  # shift over the whole sequence first
    batch = {"input_ids": batch["input_ids"], "shift_labels": batch["shift_labels"]}

    logits = model(batch["input_ids"])["logits"]
    loss = lm_loss(logits, batch["shift_labels"])
    loss.backward()
    ref = {n: p.grad for n, p in model.named_parameters()}

    results = ps.spawn(
        rank_main, model.state_dict(), batch, nprocs=args.nprocs, backend=args.backend
    )
    worst = 0.0
    for rank, res in enumerate(results):
        diffs = {
            "logits": (res["logits"] - logits).abs().max().item(),
            "loss": (res["loss"] - loss).abs().item(),
            "grads": max((res["grads"][n] - ref[n]).abs().max().item() for n in ref),
        }
        worst = max(worst, *diffs.values())
        print(f"rank {rank}: " + ", ".join(f"{k} {v:.1e}" for k, v in diffs.items()))
    print(f"loss {loss.item():.6f}; max difference against the plain module: {worst:.1e}")
    if worst > 1e-10:
        raise SystemExit("the sequence-parallel module differs from the plain one")


if __name__ == "__main__":
    main()
