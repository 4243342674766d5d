"""A Hugging Face Llama on four axes at once, data x pipeline x tensor x sequence parallelism,
equal to one process.

    python examples/llama_4d.py                             # 16 thread ranks: dp2 pp2 tp2 sp2
    python examples/llama_4d.py --mesh dp=2,pp=2,tp=2,sp=1  # 8 ranks (what the tests run)

A tiny random Llama (float64, 4 decoder layers) is cut into two pipeline stages, each a Hugging
Face model of its own with the full model's weights for its part::

    stage 0: LlamaModel, layers 0-1 (its final norm an identity)   token ids     -> hidden states
    stage 1: LlamaForCausalLM, layers 2-3 + norm + lm_head         hidden states -> logits

On the mesh ``{"dp": 2, "pp": 2, "tp": 2, "sp": 2}`` (rank = ((dp * 2 + pp) * 2 + tp) * 2 +
sp) the documented pairs compose into one run:

- **pipeline** over ``"pp"``: ``ps.pipeline_value_and_grad`` of the two stages, 2
  microbatches, 1F1B; each ``"pp"`` rank holds only its stage's weights;
- **tensor** over ``"tp"``: each stage is a map over its ``"tp"`` ranks (``ps.shard_map(body,
  mesh=mesh["tp"])``) running ``ps.tensor_parallel(stage)`` (the default plan: vocabulary,
  attention heads and MLP split), its parameters ``GlobalTensor``s on ``mesh["tp"]``;
- **sequence** over ``"sp"``: inside the stage, ``ps.sequence_parallel(stage, axis="sp",
  attention="ulysses")`` splits the stage's input along the tokens and gathers its output (a
  stage takes and gives whole sequences); each ``"sp"`` rank's gradients are its tokens'
  share, summed over ``"sp"`` at the end;
- **data** over ``"dp"``: the pipeline runs inside a map over ``"dp"`` (each data rank its
  rows), which hands the stages' ``GlobalTensor``s on ``"tp"`` in as they are; the gradients
  are summed over ``"dp"`` by ``ps.psum`` (block by block, their layout kept) and clipped by
  the whole model's norm (every stage's, every block once).

The loss (next-token cross-entropy, float64, a mean over the batch's targets), the norm and
every gradient block are checked against the whole model in one process with ``.backward()``;
the script prints the largest differences and exits non-zero above 1e-6 (Llama's RMSNorm
computes in float32 even in a float64 model; the split layers sum in another order: the
gradients agree to float32's rounding, about 1e-8). See docs/pipeline.md.
"""

from __future__ import annotations

import argparse
import math
import warnings

import torch
import torch.nn.functional as F

import pshard as ps

P = ps.P
VOCAB, SEQ, ROWS, LAYERS, CUT = 64, 12, 4, 4, 2
MAX_NORM = 0.5
# Llama's RMSNorm computes in float32 even in a float64 model, and the tensor-parallel layers sum
# their parts in another order: the gradients agree to float32's rounding (measured: 1e-8)
TOLERANCE = 1e-6


def config(layers: int):  # -> LlamaConfig
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        attn_implementation="sdpa",
    )  # fmt: skip


def whole_model() -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(config(LAYERS)).double().train()


def stage_model(stage: int) -> tuple[torch.nn.Module, dict[str, str]]:
    """Stage ``stage`` as a model of its own, and its parameters' names in the whole model."""
    from transformers import LlamaForCausalLM, LlamaModel

    if stage == 0:
        model = LlamaModel(config(CUT)).double().train()
        model.norm = torch.nn.Identity()  # the final norm belongs to the last stage

        def name(n: str) -> str:
            return "model." + n
    else:
        model = LlamaForCausalLM(config(LAYERS - CUT)).double().train()

        def name(n: str) -> str:
            if n.startswith("model.layers."):
                i, rest = n.removeprefix("model.layers.").split(".", 1)
                return f"model.layers.{int(i) + CUT}.{rest}"
            return n

    if stage == 1:  # the stage's embedding is not used (it takes hidden states)
        model.model.embed_tokens = None
    return model, {n: name(n) for n, _ in model.named_parameters()}


def batch() -> torch.Tensor:
    return torch.randint(0, VOCAB, (ROWS, SEQ), generator=torch.Generator().manual_seed(1))


def loss_sum(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="sum")


def rank(mesh_sizes: dict[str, int]) -> dict:
    mesh = ps.init_mesh(mesh_sizes)
    warnings.simplefilter("ignore")
    whole = whole_model()
    weights = {k: v.detach() for k, v in whole.named_parameters()}
    stage = ps.axis_index("pp")
    model, names = stage_model(stage)
    # the default plan, but the last stage's embedding (it has none: it takes hidden states)
    plan = {k: v for k, v in ps.tensor_parallel_plan(model).items()
            if stage == 0 or "embed_tokens" not in k}  # fmt: skip
    specs = ps.tensor_parallel_specs(model, plan, mesh=mesh["tp"])
    params = ps.shard({n: weights[names[n]] for n in names}, specs, mesh=mesh["tp"])
    count = ROWS * (SEQ - 1)  # the batch's targets

    def body(blocks: dict, x: torch.Tensor) -> torch.Tensor:
        key = "input_ids" if stage == 0 else "inputs_embeds"
        with (
            ps.tensor_parallel(model, plan),
            ps.sequence_parallel(model, axis="sp", mesh=mesh["sp"], attention="ulysses"),
        ):
            out = torch.func.functional_call(model, blocks, (), {key: x, "use_cache": False})
        return out.last_hidden_state if stage == 0 else out.logits

    run_stage = ps.shard_map(body, mesh=mesh["tp"], in_specs=(specs, P()), out_specs=P())
    step = ps.pipeline_value_and_grad(
        run_stage, lambda logits, ids: loss_sum(logits, ids) / count, num_microbatches=2
    )
    clip = ps.optim.clip_by_global_norm(MAX_NORM)

    def train(p: dict, ids: torch.Tensor, labels: torch.Tensor) -> tuple:
        loss, grads = step(p, ids, labels)
        grads = ps.psum(grads, ("dp", "sp"))  # the data ranks' rows, the sequence ranks' tokens
        return ps.psum(loss, "dp"), grads, ps.optim.global_norm(grads), clip.update(grads, ())[0]

    ids = batch()
    loss, grads, norm, clipped = ps.shard_map(
        train, in_specs=(None, P("dp"), P("dp")), out_specs=(P(), P(), P(), P()),
        axis_names="dp",
    )(params, ids, ids)  # fmt: skip

    # one process: the whole model, the whole batch
    ref = loss_sum(whole(input_ids=ids, use_cache=False).logits, ids) / count
    ref.backward()
    want = {n: dict(whole.named_parameters())[names[n]].grad for n in names}
    total = math.sqrt(sum(float((p.grad**2).sum()) for p in whole.parameters()))
    scale = min(1.0, MAX_NORM / total)
    got, got_clipped = ps.gather(grads), ps.gather(clipped)
    return {
        "loss": abs(loss.item() - ref.item()),
        "grads": max(float((got[n] - want[n]).abs().max()) for n in names),
        "norm": abs(norm.item() - total),
        "clipped": max(float((got_clipped[n] - want[n] * scale).abs().max()) for n in names),
        "value": loss.item(),
        "split": all(
            tuple(g.local.shape) != tuple(g.shape) for n, g in grads.items() if specs[n] != P()
        ),  # fmt: skip
    }


def mesh_arg(text: str) -> dict[str, int]:
    sizes = {k: int(v) for k, v in (item.split("=") for item in text.split(","))}
    if list(sizes) != ["dp", "pp", "tp", "sp"] or sizes["pp"] != 2:
        raise argparse.ArgumentTypeError(f"give dp=,pp=2,tp=,sp= in that order, got {text!r}")
    return sizes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mesh", type=mesh_arg, default="dp=2,pp=2,tp=2,sp=2")
    parser.add_argument("--backend", choices=("threads", "gloo"), default="threads")
    args = parser.parse_args()
    n = math.prod(args.mesh.values())
    results = ps.spawn(rank, args.mesh, nprocs=n, backend=args.backend, timeout=600)
    mesh = " x ".join(f"{k}={v}" for k, v in args.mesh.items())
    print(f"{mesh} ({n} ranks): loss {results[0]['value']:.12f}")
    worst = {k: max(r[k] for r in results) for k in ("loss", "grads", "norm", "clipped")}
    for k, v in worst.items():
        print(f"max difference against one process, {k}: {v:.2e} (tolerance {TOLERANCE:g})")
    split = all(r["split"] for r in results)
    print(f"every tensor-parallel gradient a block on its rank: {split}")
    if max(worst.values()) > TOLERANCE or not split:
        raise SystemExit("the four-axis run differs from one process")


if __name__ == "__main__":
    main()
