"""A Hugging Face Llama trained sequence-parallel, checked against the same model in one process.

    python examples/hf_llama.py                                  # 2 gloo ranks, Ulysses
    python examples/hf_llama.py --nprocs 4 --attention ring --layout stripe
    python examples/hf_llama.py --checkpointing                  # gradient checkpointing

A tiny random ``LlamaForCausalLM`` (GQA, built from a config: nothing is downloaded) is trained
for a few AdamW steps on batches that alternate between left padding (``attention_mask``) and
packed documents (``position_ids`` restarting at 0, labels -100 at each document start, as
``DataCollatorWithFlattening`` makes them). Every rank calls the model the usual way::

    with ps.sequence_parallel(model, attention="ulysses", layout="zigzag"):
        loss = model(input_ids=..., attention_mask=..., labels=...).loss
    loss.backward()
    ps.reduce_gradients(model, "sp")
    optimizer.step()

and gets the single-process loss; after ``reduce_gradients`` its gradients are the single-process
gradients, so the loss curve equals the one of the model trained in one process (printed side
by side, then the largest difference). Runs on CPU in float64 as it is; on GPUs under
``torchrun`` the same code uses NCCL.
"""

from __future__ import annotations

import argparse
import copy
import warnings

import torch

import pshard as ps

VOCAB, SEQ = 64, 11


def build() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return LlamaForCausalLM(config).double()


def batch(step: int) -> dict:
    """Even steps: two rows, the second left-padded; odd steps: packed documents."""
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(1, VOCAB, (2, SEQ), generator=g)
    if step % 2 == 0:
        mask = torch.ones(2, SEQ, dtype=torch.long)
        mask[1, :3] = 0
        return {
            "input_ids": ids,
            "attention_mask": mask,
            "labels": ids.masked_fill(mask == 0, -100),
        }
    pos = torch.stack([torch.arange(SEQ), torch.arange(SEQ)])
    pos[0, 4:] = torch.arange(SEQ - 4)
    pos[1, 6:] = torch.arange(SEQ - 6)
    return {"input_ids": ids, "position_ids": pos, "labels": ids.masked_fill(pos == 0, -100)}


def train(model, steps: int, step_fn) -> list[float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        optimizer.zero_grad()
        losses.append(step_fn(model, batch(step)))
        optimizer.step()
    return losses


def single_process_step(model, b: dict) -> float:
    loss = model(**b, use_cache=False).loss  # training calls the model without a cache
    loss.backward()
    return loss.item()


def main(args: argparse.Namespace) -> list[tuple[float, float]]:
    ps.init_mesh({"sp": args.nprocs})
    warnings.simplefilter("ignore")  # transformers' notes about configs
    model = build()
    if args.checkpointing:
        model.gradient_checkpointing_enable({"use_reentrant": False})
    reference = copy.deepcopy(model)

    def parallel_step(model, b: dict) -> float:
        with ps.sequence_parallel(model, attention=args.attention, layout=args.layout):
            loss = model(**b).loss  # the single-process loss, on every rank
        loss.backward()
        ps.reduce_gradients(model, "sp")  # each rank held its tokens' share
        return loss.item()

    model.train()
    reference.train()
    return list(
        zip(
            train(model, args.steps, parallel_step),
            train(reference, args.steps, single_process_step),
            strict=True,
        )
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nprocs", type=int, default=2)
    parser.add_argument(
        "--backend",
        choices=("gloo", "threads"),
        default="gloo",
        help="ranks as processes or threads",
    )
    parser.add_argument("--attention", choices=["ulysses", "ring"], default="ulysses")
    parser.add_argument("--layout", choices=["contiguous", "zigzag", "stripe"], default="zigzag")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--checkpointing", action="store_true")
    args = parser.parse_args()
    curves = ps.spawn(main, args, nprocs=args.nprocs, backend=args.backend)
    print(f"{'step':>4} {'sequence-parallel':>18} {'one process':>12}")
    for step, (got, want) in enumerate(curves[0]):
        print(f"{step:>4} {got:18.6f} {want:12.6f}")
    diff = max(abs(a - b) for curve in curves for a, b in curve)
    print(f"max difference over {args.nprocs} ranks: {diff:.2e}")
    if not diff < 1e-6:  # transformers computes its loss in float32
        raise SystemExit("the loss curves differ")
