"""pshard quickstart: a tiny causal LM trained with sequence parallelism and microbatching.

Runs on a laptop CPU (2 gloo ranks by default, float64, well under a minute):

    python examples/quickstart.py
    python examples/quickstart.py --nprocs 4 --sp 2 --microbatches 4 --attention ring
    python examples/quickstart.py --backend threads     # the ranks as threads of one process

On GPUs, the same file under torchrun uses NCCL with no code change (one process per GPU;
``ps.init_mesh`` reads torchrun's environment, so nothing is spawned):

    torchrun --nproc-per-node 8 examples/quickstart.py --sp 4 --dtype float32

The model is plain torch: a dict of parameters and a function. One training step is

    step = pmap_microbatch(grad_and_value(shard_map_seq(loss)))     # then AdamW on the dict

- ``ps.prepare_lm_batch`` shifts the labels over the whole sequence before anything is split;
- ``ps.shard_map_seq`` splits every sequence over the ``"sp"`` ranks (zigzag layout by default)
  and the attention (``ps.ulysses_attention`` or ``ps.ring_attention``) sees the whole sequence;
- ``ps.pmap_microbatch`` accumulates gradients over microbatches, weighted by their number of
  target tokens, so the result is the exact token mean of the whole batch;
- ranks that are not on the ``"sp"`` axis form a ``"dp"`` axis and combine their gradients with a
  token-weighted ``ps.psum``.

It prints a table per step (loss, tokens/s, peak memory per rank) and finally runs the same model
in one process without any parallelism and prints the max difference of the two loss curves
(exit status 1 if it is above the tolerance).
"""

from __future__ import annotations

import argparse
import math
import os
import resource
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import pshard as ps

VOCAB, DIM, HEADS, HEAD_DIM, LAYERS = 32, 32, 4, 8, 2
PAD = {"input_ids": 0, "shift_labels": -100}
SPECS = {"input_ids": ps.Shard(1), "shift_labels": ps.Shard(1)}


# ----------------------------------------------------------------------------- the model
def init_params(dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)

    def w(*shape: int, scale: float = 1.0) -> torch.Tensor:
        t = torch.randn(*shape, generator=g, dtype=torch.float64) * scale / math.sqrt(shape[0])
        return t.to(dtype=dtype, device=device)

    params = {"embed": w(VOCAB, DIM, scale=math.sqrt(VOCAB)), "head": w(DIM, VOCAB)}
    for i in range(LAYERS):
        for name, shape in {
            "wq": (DIM, HEADS * HEAD_DIM),
            "wk": (DIM, HEADS * HEAD_DIM),
            "wv": (DIM, HEADS * HEAD_DIM),
            "wo": (HEADS * HEAD_DIM, DIM),
            "w1": (DIM, 4 * DIM),
            "w2": (4 * DIM, DIM),
        }.items():
            params[f"{i}.{name}"] = w(*shape)
    return params


def rms_norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def rope(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of (batch, seq, heads, head_dim) from the tokens' global positions."""
    freq = 1.0 / 100.0 ** (torch.arange(0, HEAD_DIM, 2, device=x.device, dtype=x.dtype) / HEAD_DIM)
    angle = pos.to(device=x.device, dtype=x.dtype)[:, None, None] * freq  # (seq, 1, head_dim / 2)
    x0, x1 = x[..., 0::2], x[..., 1::2]
    cos, sin = angle.cos(), angle.sin()
    return torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], -1).flatten(-2)


def forward(params: dict, ids: torch.Tensor, pos: torch.Tensor, attention) -> torch.Tensor:
    """Logits (batch, seq, vocab). ``pos``: global position of each token; ``attention`` maps
    (batch, seq, heads, head_dim) q, k, v to the causal attention output."""
    h = params["embed"][ids]
    for i in range(LAYERS):
        x = rms_norm(h)
        q, k, v = ((x @ params[f"{i}.w{n}"]).unflatten(-1, (HEADS, HEAD_DIM)) for n in "qkv")
        h = h + attention(rope(q, pos), rope(k, pos), v).flatten(-2) @ params[f"{i}.wo"]
        h = h + F.gelu(rms_norm(h) @ params[f"{i}.w1"]) @ params[f"{i}.w2"]
    return rms_norm(h) @ params["head"]


def full_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Single-process reference: SDPA over the whole sequence."""
    out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True)
    return out.transpose(1, 2)


def sums(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    total = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
    return total, (targets != -100).sum()


# ----------------------------------------------------------------------------- the data
def make_batch(step: int, rows: int, seq: int, device: torch.device) -> dict:
    """Arithmetic sequences mod VOCAB (learnable from two tokens); a prompt of random length at
    the start of each row has no targets, so microbatches hold different numbers of tokens."""
    g = torch.Generator().manual_seed(1000 + step)
    start = torch.randint(0, VOCAB, (rows, 1), generator=g)
    stride = torch.randint(1, 4, (rows, 1), generator=g)
    ids = (start + stride * torch.arange(seq)) % VOCAB
    labels = ids.clone()
    prompt = torch.randint(1, seq // 2, (rows, 1), generator=g)
    labels[torch.arange(seq) < prompt] = -100
    batch = ps.prepare_lm_batch({"input_ids": ids, "labels": labels})  # shifts over the whole row
    return {k: batch[k].to(device) for k in ("input_ids", "shift_labels")}


# ----------------------------------------------------------------------------- AdamW on a dict
def adamw(params: dict, grads: dict, state: dict, lr: float = 1e-2, wd: float = 0.01) -> dict:
    b1, b2, eps = 0.9, 0.95, 1e-8
    state["t"] = t = state.get("t", 0) + 1
    m = state.setdefault("m", {k: torch.zeros_like(p) for k, p in params.items()})
    v = state.setdefault("v", {k: torch.zeros_like(p) for k, p in params.items()})
    out = {}
    for k, p in params.items():
        m[k] = b1 * m[k] + (1 - b1) * grads[k]
        v[k] = b2 * v[k] + (1 - b2) * grads[k] ** 2
        update = (m[k] / (1 - b1**t)) / ((v[k] / (1 - b2**t)).sqrt() + eps)
        out[k] = p * (1 - lr * wd) - lr * update
    return out


# ----------------------------------------------------------------------------- one rank
def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10  # KiB on Linux


def rank_main(args: argparse.Namespace) -> list[float]:
    """Train; every rank returns its loss curve (the same on every rank)."""
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        # ranks share the CPU cores: oversubscribed threads make gloo's collectives crawl
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    sp = args.sp or world
    if world % sp:
        raise SystemExit(f"--sp {sp} must divide the number of ranks ({world})")
    ps.init_mesh({"dp": world // sp, "sp": sp})  # NCCL on GPUs, gloo on CPU
    rank = dist.get_rank()
    attend = ps.ring_attention if args.attention == "ring" else ps.ulysses_attention

    def local_loss(params: dict, batch: dict) -> torch.Tensor:
        """This rank's tokens of every row; attention and the loss see the whole sequence."""
        logits = forward(
            params,
            batch["input_ids"],
            ps.seq_positions(),  # global positions (zigzag-permuted, padding at >= seq)
            lambda q, k, v: attend(q, k, v, axis="sp", causal=True),
        )
        return ps.token_mean_loss(*sums(logits, batch["shift_labels"]), "sp")

    loss = ps.shard_map_seq(
        local_loss,
        in_specs=(None, SPECS),
        out_specs=ps.Replicate(),
        layout=args.layout,
        pad_values=(0, PAD),
    )
    step = ps.pmap_microbatch(
        torch.func.grad_and_value(loss),
        num_microbatches=args.microbatches,
        in_specs=(None, ps.Shard(0)),
        out_specs=ps.Partial("mean"),  # weighted by weight_fn: the exact token mean
        weight_fn=lambda params, mb: (mb["shift_labels"] != -100).sum(),
    )

    dtype = getattr(torch, args.dtype)
    params, state, curve = init_params(dtype, device), {}, []
    dp, dp_rank = ps.axis_size("dp"), ps.axis_index("dp")
    if rank == 0:
        print(
            f"{world} ranks (dp={dp}, sp={sp}) on {device.type}, {args.attention} attention, "
            f"{args.layout} layout, {args.microbatches} microbatches, {args.dtype}"
        )
        print(f"{'step':>4} {'loss':>12} {'tokens/s':>10}  peak memory per rank (MiB)")
    for i in range(args.steps):
        batch = make_batch(i, args.batch, args.seq, device)
        tokens = int((batch["shift_labels"] != -100).sum())
        mine = ps.split(batch, ps.Shard(0), dp)[dp_rank]  # this dp group's rows
        t0 = time.perf_counter()
        grads, value = step(params, mine)
        # token-weighted mean over the data-parallel groups (identity when dp == 1)
        n = (mine["shift_labels"] != -100).sum().to(dtype)
        grads, value = ps.psum(({k: g * n for k, g in grads.items()}, value * n), "dp")
        total = ps.psum(n, "dp")
        grads, value = {k: g / total for k, g in grads.items()}, value / total
        params = adamw(params, grads, state)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - t0
        curve.append(value.item())
        mem = torch.tensor([peak_memory_mb(device)], device=device)
        mems = [torch.zeros_like(mem) for _ in range(world)]
        dist.all_gather(mems, mem)
        if rank == 0:
            per_rank = " ".join(f"{m.item():7.1f}" for m in mems)
            print(f"{i:>4} {curve[-1]:>12.6f} {tokens / elapsed:>10.0f}  {per_rank}", flush=True)
    return curve


def reference_curve(args: argparse.Namespace, device: torch.device) -> list[float]:
    """The same training in one process: no split, no microbatches, full attention."""
    dtype = getattr(torch, args.dtype)
    params, state, curve = init_params(dtype, device), {}, []

    def loss(params: dict, batch: dict) -> torch.Tensor:
        pos = torch.arange(batch["input_ids"].shape[1], device=device)
        total, count = sums(
            forward(params, batch["input_ids"], pos, full_attention), batch["shift_labels"]
        )
        return total / count

    for i in range(args.steps):
        grads, value = torch.func.grad_and_value(loss)(
            params, make_batch(i, args.batch, args.seq, device)
        )
        params = adamw(params, grads, state)
        curve.append(value.item())
    return curve


def check(curves: list[list[float]], args: argparse.Namespace, device: torch.device) -> None:
    ref = reference_curve(args, device)
    worst = max(abs(a - b) for curve in curves for a, b in zip(curve, ref, strict=True))
    tol = 1e-9 if args.dtype == "float64" else 1e-3
    print(f"single process: first loss {ref[0]:.6f}, last loss {ref[-1]:.6f}")
    print(
        f"max difference of the loss curves ({len(curves)} ranks): {worst:.2e} (tolerance {tol:g})"
    )
    if not worst <= tol:
        raise SystemExit("the parallel loss curve does not match the single-process one")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--nprocs", type=int, default=2, help="local ranks (ignored under torchrun)"
    )
    parser.add_argument(
        "--backend",
        choices=("gloo", "threads"),
        default="gloo",
        help="local ranks as gloo processes, or as threads of this process",
    )
    parser.add_argument("--sp", type=int, default=0, help="sequence-parallel ranks (default: all)")
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--attention", choices=("ulysses", "ring"), default="ulysses")
    parser.add_argument("--layout", choices=("contiguous", "zigzag", "stripe"), default="zigzag")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=8, help="rows per step")
    parser.add_argument("--seq", type=int, default=61, help="tokens per row (need not divide)")
    parser.add_argument("--dtype", choices=("float64", "float32"), default="float64")
    args = parser.parse_args()

    if "LOCAL_RANK" in os.environ:  # under torchrun: this process is one rank
        curve = rank_main(args)
        curves = [None] * dist.get_world_size()
        dist.all_gather_object(curves, curve)
        if dist.get_rank() == 0:
            check(
                curves,
                args,
                torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"),
            )
        dist.destroy_process_group()
    else:
        curves = ps.spawn(rank_main, args, nprocs=args.nprocs, backend=args.backend)
        check(curves, args, torch.device("cpu"))


if __name__ == "__main__":
    main()
