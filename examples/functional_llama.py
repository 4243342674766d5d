"""A Hugging Face Llama loaded sharded from its checkpoint, trained functionally on a 2 x 2
mesh, saved, resumed on 2 ranks, and exported back to Hugging Face's format.

    python examples/functional_llama.py                        # 4 gloo ranks, then 2 to resume
    python examples/functional_llama.py --backend threads      # the ranks as threads
    python examples/functional_llama.py --resume-mesh dp=2,sp=1 --attention ring
    python examples/functional_llama.py --mesh dp=2,tp=2       # FSDP x tensor parallelism
    python examples/functional_llama.py --mesh dp=2,tp=2,sp=2  # 8 ranks: dp x tp x sp
    python examples/functional_llama.py --dtype bf16           # bfloat16 compute, float32 masters

A tiny random ``LlamaForCausalLM`` (built from a config: nothing is downloaded; float64) is
written with ``save_pretrained``, and trained from there on 4 CPU ranks as the mesh
``{"dp": 2, "sp": 2}``. One step is::

    grads, loss = pmap_microbatch(grad_and_value(shard_map(rows_loss, axis_names="dp")))(...)
    grads = psum(grads, "sp")                   # the blocks: each "sp" rank held its tokens' share
    updates, opt_state = optimizer.update(grads, opt_state, params)
    params = ps.optim.apply_updates(params, updates)

    def rows_loss(blocks, rows, count):         # this "dp" rank's blocks and rows
        with ps.sequence_parallel(model, axis="sp", attention="ulysses"):
            logits = ps.sharded_call(model, blocks, (), rows, specs=P("dp")).logits
        return psum(cross_entropy_sum(logits, labels), "dp") / count

- the weights are read from the ``save_pretrained`` directory by ``ps.load`` into
  ``ps.GlobalTensor``s sharded over ``"dp"`` (``P("dp")``), each rank reading only its blocks'
  bytes of the safetensors files: the model never exists whole on a rank (``sharded_call`` runs
  the model's code on a ``meta`` skeleton), and between steps each rank holds half of every
  tensor;
- the optimizer is ``ps.optim.chain(clip_by_global_norm(1.0), adamw(warmup_cosine_decay))``,
  optax's recipe on the blocks: the global norm sums each block's squares once over the axes
  that split it, and the AdamW moments are GlobalTensors of the parameters' layouts;
- ``ps.shard_map`` over ``"dp"`` gives each ``"dp"`` rank its blocks and its rows of the batch;
  ``ps.sharded_call`` (functional FSDP) gathers each decoder layer's weights right before the
  layer runs and again in the backward, and reduce-scatters their gradients into blocks;
- ``ps.sequence_parallel`` splits every row's tokens over the ``"sp"`` ranks and plugs Ulysses
  (or ring) attention into the model;
- with ``--mesh dp=2,tp=2`` (or ``dp=2,tp=2,sp=2``) the layers are also split over ``"tp"``
  by ``ps.tensor_parallel`` (Megatron tensor parallelism; the parameters split over ``"dp"``
  and ``"tp"``, ``sharded_call`` gathering only over ``"dp"``) and the loss is computed on the
  vocabulary split over ``"tp"`` (``ps.cross_entropy``);
- the model's gradient checkpointing is pointed at ``ps.checkpoint``: every decoder layer is
  recomputed in the backward, under ``torch.func.grad``;
- ``ps.pmap_microbatch`` accumulates the gradients of ``--microbatches`` microbatches;
- after ``--save-at`` steps ``ps.save`` writes the state (parameters and optimizer state, each
  rank its blocks) and the run goes on to ``--steps``. The same ranks then load the checkpoint
  and run the last steps again (the same losses, bit for bit), and fresh ranks on another mesh
  (``--resume-mesh``) load it into their layout with ``ps.load`` and run them (the same losses
  to float64 rounding);
- at the end ``ps.save(..., format="huggingface")`` writes the trained weights as consolidated
  safetensors, which ``AutoModelForCausalLM.from_pretrained`` loads (checked bit for bit);
- with ``--dtype bf16`` the parameters and AdamW moments are float32 masters and
  ``sharded_call`` gathers and computes in bfloat16 and reduces the gradients in float32
  (``param_dtype=torch.bfloat16, reduce_dtype=torch.float32``, FSDP2's usual policy).

The losses are checked against the same model trained in one process with plain PyTorch
(``model(**batch)``, ``loss.backward()``, the global norm from ``clip_grad_norm_``, then
``torch.optim.AdamW`` on the same schedule; with ``--dtype bf16`` a float32 model under
``torch.autocast(dtype=torch.bfloat16)``). The script prints them side by side and the largest
differences, and exits non-zero when one is above its tolerance. See
docs/functional_llama.md.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import tempfile
import warnings
from collections.abc import Callable

import optree
import torch
import torch.nn.functional as F

import pshard as ps

P = ps.P
VOCAB, SEQ, ROWS = 64, 12, 4
LR, BETAS, EPS, WEIGHT_DECAY = 1e-2, (0.9, 0.95), 1e-8, 0.01
MAX_NORM = 1.0  # global-norm clipping
# --dtype: the masters' dtype, and sharded_call's policy
MASTERS = {"float64": torch.float64, "bf16": torch.float32}
POLICIES = {"float64": {}, "bf16": {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}}
BF16_TOLERANCE = 1e-2  # of a loss about 4 (measured: 2.5e-3); see the checks at the end
Step = Callable[[dict, dict], tuple[dict, float]]


# ----------------------------------------------------------------------------- model and data
def config():  # -> LlamaConfig
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attn_implementation="sdpa",
    )


def initial_model(dtype: torch.dtype = torch.float64) -> torch.nn.Module:
    """The model with its initial weights (random, seeded: the same in every process)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(config()).double().to(dtype).train()


def skeleton(dtype: torch.dtype = torch.float64) -> torch.nn.Module:
    """The model without its weights: ``sharded_call`` runs its code with the gathered weights
    and reads their global shapes from its parameters, which live on the ``meta`` device (no
    memory). The rotary embedding's buffer is computed, not learned: built on the CPU."""
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(config())
    model.model.rotary_emb = type(model.model.rotary_emb)(config())
    model = model.to(dtype).train()
    # every decoder layer's checkpoint function is ps.checkpoint (torch.utils.checkpoint cannot
    # run under torch.func): the layer keeps its input and is recomputed in the backward
    ps.checkpoint_layers(model)
    return model


def batch(step: int) -> dict[str, torch.Tensor]:
    """``ROWS`` rows of ``SEQ`` random tokens (two batches, seen in turn, so the loss goes
    down). Even steps: rows with left padding (``attention_mask``); odd steps: packed documents
    (``position_ids`` restarting at 0). Labels are the tokens (shifted by the loss), -100 on
    padding and at each document's first token."""
    g = torch.Generator().manual_seed(step % 2)
    ids = torch.randint(1, VOCAB, (ROWS, SEQ), generator=g)
    if step % 2 == 0:
        mask = torch.ones(ROWS, SEQ, dtype=torch.long)
        for row, pad in enumerate((0, 3, 0, 5)):
            mask[row, :pad] = 0
        labels = ids.masked_fill(mask == 0, -100)
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}
    pos = torch.arange(SEQ).repeat(ROWS, 1)
    for row, start in enumerate((4, 7, 2, 9)):
        pos[row, start:] = torch.arange(SEQ - start)
    return {"input_ids": ids, "position_ids": pos, "labels": ids.masked_fill(pos == 0, -100)}


def targets(b: dict[str, torch.Tensor]) -> torch.Tensor:
    return (b["labels"][:, 1:] != -100).sum()


def loss_sum(logits: torch.Tensor, labels: torch.Tensor, axis: str | None = None) -> torch.Tensor:
    """The next-token cross-entropy summed over the targets, in float64 (the model's own
    ``loss`` is computed in float32); with ``axis``, on logits whose vocabulary is split over
    it."""
    shifted = F.pad(labels, (0, 1), value=-100)[:, 1:]
    return ps.cross_entropy(logits, shifted, axis=axis, reduction="sum")


def param_specs(model: torch.nn.Module, tp: bool) -> P | dict[str, P]:
    """How the parameters are held: split over "dp" (FSDP), and with ``tp`` split over "tp" as
    ``ps.tensor_parallel_specs`` says, "dp" then splitting dim 0 further (after "tp" where "tp"
    splits it: ``sharded_call`` inside ``tensor_parallel`` gathers over "dp" only)."""
    if not tp:
        return P("dp")
    out = {}
    for name, spec in ps.tensor_parallel_specs(model, axis="tp").items():
        entries = list(spec) or [None]
        first = entries[0]
        entries[0] = "dp" if first is None else (first, "dp")
        out[name] = P(*entries)
    return out


# ----------------------------------------------------------------------------- the optimizer
def schedule(steps: int) -> ps.optim.Schedule:
    """Warm-up from LR / 10 to LR over the first third of the steps, then a cosine decay to
    LR / 10."""
    warmup = max(1, steps // 3)
    return ps.optim.warmup_cosine_decay_schedule(LR / 10, LR, warmup, steps, end_value=LR / 10)


def optimizer(steps: int) -> ps.optim.GradientTransformation:
    """optax's recipe: clip the gradients' global norm, then AdamW on the schedule."""
    return ps.optim.chain(
        ps.optim.clip_by_global_norm(MAX_NORM),
        ps.optim.adamw(schedule(steps), b1=BETAS[0], b2=BETAS[1], eps=EPS,
                       weight_decay=WEIGHT_DECAY),
    )  # fmt: skip


# ----------------------------------------------------------------------------- one rank
def make_step(model: torch.nn.Module, args: argparse.Namespace) -> Step:
    """One training step, ``(state, batch) -> (next state, loss)``, on the current mesh."""
    axes = ps.current_mesh().mesh_dim_names or ()
    tp, sp = "tp" in axes, "sp" in axes
    specs = param_specs(model, tp)

    def rows_loss(params: dict, rows: dict, count: torch.Tensor) -> torch.Tensor:
        """Inside the map over "dp" (and "tp"): this rank's blocks of the parameters and its
        rows of the microbatch; ``count``: the targets of the whole batch (every microbatch
        and row)."""
        inputs = {k: v for k, v in rows.items() if k != "labels"}
        with contextlib.ExitStack() as stack:
            if tp:  # the layers split over "tp", the logits split over the vocabulary
                stack.enter_context(ps.tensor_parallel(model, axis="tp", loss_parallel=True))
            if sp:
                stack.enter_context(ps.sequence_parallel(
                    model, axis="sp", attention=args.attention, layout=args.layout
                ))  # fmt: skip
            # each decoder layer gathers its weights over "dp" right before it runs; the
            # logits come back whole (each "sp" rank's backward takes its tokens' part)
            out = ps.sharded_call(
                model, params, (), {**inputs, "use_cache": False}, specs=specs,
                **POLICIES[args.dtype],
            )  # fmt: skip
        logits = out.logits.to(MASTERS[args.dtype])  # bfloat16 logits: the loss in float32
        part = loss_sum(logits, rows["labels"], "tp" if tp else None)
        return ps.psum(part, "dp") / count

    loss = ps.shard_map(
        rows_loss,
        in_specs=(specs, P("dp"), None),
        out_specs=P(),
        axis_names=("dp", "tp") if tp else "dp",
    )
    accumulate = ps.pmap_microbatch(
        torch.func.grad_and_value(loss),
        num_microbatches=args.microbatches,
        in_specs=(None, ps.Shard(0), None),
        out_specs=ps.Partial("sum"),  # each microbatch's part of the batch's token mean
    )

    opt = optimizer(args.steps)

    def step(state: dict, b: dict) -> tuple[dict, float]:
        grads, value = accumulate(state["params"], b, targets(b))
        if sp:  # each "sp" rank holds its tokens' share of every gradient block: sum them
            grads = optree.tree_map(lambda g: ps.psum(g, "sp"), grads)
        # the global norm of GlobalTensors sums each block's squares over the axes that split
        # it; the moments are GlobalTensors of the parameters' layouts
        updates, opt_state = opt.update(grads, state["opt"], state["params"])
        params = ps.optim.apply_updates(state["params"], updates)
        return {"params": params, "opt": opt_state, "step": state["step"] + 1}, value.item()

    return step


def train(
    step: Step, state: dict, steps: int, save: tuple[str, int] | None = None
) -> tuple[dict, list[float]]:
    """Run the steps from ``state["step"]`` to ``steps``; ``save``: (path, after which step)."""
    losses = []
    while state["step"] < steps:
        state, loss = step(state, batch(state["step"]))
        losses.append(loss)
        if save is not None and state["step"] == save[1]:
            ps.save(save[0], state)  # every rank writes its blocks
    return state, losses


def first_run(args: argparse.Namespace) -> tuple[list[float], list[float], tuple[int, int]]:
    """``--mesh`` (4 ranks as 2 x 2 by default): train, saving after ``--save-at`` steps; then
    load that checkpoint and run the last steps again."""
    ps.init_mesh(args.mesh)
    warnings.simplefilter("ignore")  # transformers' notes about configs
    model = skeleton(MASTERS[args.dtype])
    # the pretrained weights, each rank reading only its blocks of the safetensors files (over
    # "dp", and "tp" with --mesh ...,tp=2): the model never exists whole on a rank
    specs = param_specs(model, "tp" in args.mesh)
    params = ps.load(args.pretrained, specs=specs)  # state-dict name -> GlobalTensor
    state = {"params": params, "opt": optimizer(args.steps).init(params), "step": 0}
    step = make_step(model, args)
    state, losses = train(step, state, args.steps, save=(args.path, args.save_at))
    held = (
        sum(p.local.numel() for p in state["params"].values()),
        sum(p.shape.numel() for p in state["params"].values()),
    )
    # the trained weights as a Hugging Face checkpoint, the config beside them (from_pretrained
    # loads the directory): each rank writes its blocks, then rank 0 consolidates
    ps.save(args.export, state["params"], format="huggingface", config=model.config)
    # resume on the same mesh: the state itself is the target (its layout, its mesh)
    _, again = train(step, ps.load(args.path, state), args.steps)
    return losses, again, held, ps.gather(state["params"])


def resumed_run(args: argparse.Namespace) -> list[float]:
    """Fresh ranks on another mesh: load the checkpoint into this mesh's layout, go on."""
    ps.init_mesh(args.resume_mesh)
    warnings.simplefilter("ignore")
    # every tensor of the checkpoint as a GlobalTensor P("dp") on this mesh, "step" an int
    state = ps.load(args.path, specs=P("dp"))
    _, losses = train(make_step(skeleton(MASTERS[args.dtype]), args), state, args.steps)
    return losses


# ----------------------------------------------------------------------------- one process
def reference(steps: int, dtype: str = "float64") -> list[float]:
    """The same training in one process with plain PyTorch: the whole batch at once (with
    ``dtype="bf16"``, float32 weights under ``torch.autocast`` in bfloat16)."""
    model = initial_model(MASTERS[dtype])
    adam = torch.optim.AdamW(
        model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY
    )
    lr = schedule(steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(adam, lambda i: lr(i) / LR)
    losses = []
    for i in range(steps):
        b = batch(i)
        inputs = {k: v for k, v in b.items() if k != "labels"}
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
            logits = model(**inputs, use_cache=False).logits
        loss = loss_sum(logits.to(MASTERS[dtype]), b["labels"]) / targets(b)
        adam.zero_grad()
        loss.backward()
        # the global norm as clip_grad_norm_ computes it; clipped by optax's rule (torch's
        # own clipping divides by norm + 1e-6, which would move the losses by about 1e-9)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
        if norm > MAX_NORM:
            for p in model.parameters():
                p.grad.mul_(MAX_NORM / norm)
        adam.step()
        scheduler.step()
        losses.append(loss.item())
    return losses


def exported_weights(path: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The weights ``from_pretrained`` loads from what ``ps.save(..., format="huggingface",
    config=...)`` wrote."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return {k: v.detach() for k, v in model.named_parameters()}


def mesh_arg(text: str) -> dict[str, int]:
    """``dp=2,sp=1`` -> ``{"dp": 2, "sp": 1}`` (the resumed run's mesh: dp and sp)."""
    sizes = {k: int(v) for k, v in (item.split("=") for item in text.split(","))}
    if not set(sizes) <= {"dp", "sp"}:
        raise argparse.ArgumentTypeError(f"axes are dp and sp, got {text!r}")
    return {"dp": sizes.get("dp", 1), "sp": sizes.get("sp", 1)}


def first_mesh_arg(text: str) -> dict[str, int]:
    """``dp=2,tp=2`` -> ``{"dp": 2, "tp": 2}``: dp, and sp and/or tp, in the order given."""
    sizes = {k: int(v) for k, v in (item.split("=") for item in text.split(","))}
    if "dp" not in sizes or not set(sizes) <= {"dp", "sp", "tp"} or len(sizes) < 2:
        raise argparse.ArgumentTypeError(f"axes are dp and sp and/or tp, got {text!r}")
    return sizes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument(
        "--backend",
        choices=("gloo", "threads"),
        default="gloo",
        help="ranks as processes or threads",
    )
    parser.add_argument("--save-at", type=int, default=3, help="save after this many steps")
    parser.add_argument("--microbatches", type=int, choices=(1, 2), default=2)
    parser.add_argument("--attention", choices=("ulysses", "ring"), default="ulysses")
    parser.add_argument("--layout", choices=("contiguous", "zigzag", "stripe"), default="zigzag")
    parser.add_argument(
        "--mesh", type=first_mesh_arg, default="dp=2,sp=2", help="e.g. dp=2,tp=2 or dp=2,tp=2,sp=2"
    )
    parser.add_argument(
        "--resume-mesh", type=mesh_arg, default="dp=1,sp=2", help="e.g. dp=1,sp=2 or dp=2,sp=1"
    )
    parser.add_argument(
        "--dtype", choices=tuple(MASTERS), default="float64",
        help="bf16: float32 masters, bfloat16 compute, float32 gradient reduction",
    )  # fmt: skip
    args = parser.parse_args()
    if not 0 < args.save_at < args.steps:
        parser.error("--save-at must be between 0 and --steps")
    resume = args.resume_mesh
    warnings.simplefilter("ignore")
    with tempfile.TemporaryDirectory() as tmp:
        args.path = os.path.join(tmp, f"step-{args.save_at}")
        args.pretrained = os.path.join(tmp, "pretrained")
        args.export = os.path.join(tmp, "trained")
        initial_model(MASTERS[args.dtype]).save_pretrained(args.pretrained)  # the start
        nprocs = math.prod(args.mesh.values())
        (losses, again, (held, whole), trained), *_ = ps.spawn(
            first_run, args, nprocs=nprocs, backend=args.backend
        )
        resumed = ps.spawn(
            resumed_run, args, nprocs=resume["dp"] * resume["sp"], backend=args.backend
        )[0]
        exported = exported_weights(args.export, MASTERS[args.dtype])
    plain = reference(args.steps, args.dtype)

    where = ",".join(f"{k}={v}" for k, v in resume.items())
    mesh = " x ".join(f"{k}={v}" for k, v in args.mesh.items())
    columns = (mesh, "one process", f"resumed on {mesh}", f"resumed on {where}")
    width = max(21, *(len(c) + 2 for c in columns))
    print(f"{'step':>4}" + "".join(f"{c:>{width}}" for c in columns))
    for i in range(args.steps):
        j = i - args.save_at
        row = [losses[i], plain[i], *((again[j], resumed[j]) if j >= 0 else ())]
        print(f"{i + 1:>4}" + "".join(f"{x:{width}.12f}" for x in row))
    print(f"parameters held per rank between steps: {held} of {whole} (each AdamW moment too)")
    after = losses[args.save_at :]
    # split layers sum their partial outputs in another order than one process, and Llama's
    # RMSNorm rounds to float32: with "tp" the losses agree to float32's rounding
    tol = 1e-6 if "tp" in args.mesh else 1e-10
    # bfloat16: every unit computes in bfloat16 (its norms and residual sum too, FSDP2's way)
    # where autocast keeps those in float32: the losses agree to bfloat16's rounding
    plain_tol = BF16_TOLERANCE if args.dtype == "bf16" else tol
    checks = [  # what, max difference, tolerance
        (f"{mesh} against one process", plain, losses, plain_tol),
        ("resumed on the same mesh against the run", after, again, 0.0),
        (f"resumed on {where} against the run", after, resumed, plain_tol),
    ]
    same = exported.keys() == trained.keys() and all(
        torch.equal(exported[k], trained[k]) for k in trained
    )
    print(f"exported in Hugging Face's format, loaded by from_pretrained: "
          f"{'the trained weights, bit for bit' if same else 'OTHER WEIGHTS'}")  # fmt: skip
    failed = [] if same else ["the exported weights"]
    for what, want, got, tol in checks:
        diff = max(abs(a - b) for a, b in zip(want, got, strict=True))
        print(f"max difference, {what}: {diff:.2e} (tolerance {tol:g})")
        if not diff <= tol:
            failed.append(what)
    if failed:
        raise SystemExit(f"the losses differ: {'; '.join(failed)}")


if __name__ == "__main__":
    main()
