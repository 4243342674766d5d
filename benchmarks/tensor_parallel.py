"""Tensor parallelism: pshard under ``torch.func.grad`` against torch's ``parallelize_module``
(DTensor) with ``.backward()``, on the same Llama-shaped decoder, 2 and 4 gloo ranks.

The model: a Hugging Face ``LlamaForCausalLM`` built from a config (nothing downloads; float32,
SDPA attention): ``--layers`` decoder layers of width ``--hidden`` (``--heads`` query heads,
``--kv-heads`` key/value heads, MLP ``--ffn``), vocabulary ``--vocab``; a batch of ``--rows``
rows of ``--seq`` tokens, the mean next-token cross-entropy. One step is a forward and a
backward (the gradients of every parameter; no optimizer). Configurations (``--modes``), each
run in fresh processes started by ``ps.spawn`` (one thread per rank):

- **dtensor**: torch's ``parallelize_module`` with the plan torchtitan uses (q/k/v, gate, up
  ``ColwiseParallel``; o, down ``RowwiseParallel``; the embedding ``RowwiseParallel`` with
  replicated input; the head ``ColwiseParallel`` with replicated output), the model built on
  the ``meta`` device then filled with this rank's blocks; ``loss.backward()``;
- **pshard**: ``ps.tensor_parallel(model)`` (the default plan: the same splits) on the model
  left on ``meta``, the parameters ``GlobalTensor`` s of ``ps.tensor_parallel_specs``, a
  ``shard_map`` over ``"tp"`` around ``functional_call``, ``torch.func.grad_and_value``;
- **pshard-remat**: the same with every decoder layer in ``ps.checkpoint`` keeping the
  matmuls' outputs (``dots_saveable``: only the elementwise operations run again).
  ``torch.func.grad`` differentiates with ``create_graph=True``, so what the forward saved
  outside a checkpoint lives until the gradient returns (``.backward()`` frees each node's as
  it goes); a checkpoint lets go of its values after its own backward;
- **pshard-sp**: **pshard** with Megatron sequence parallelism
  (``ps.tensor_parallel_plan(model, sequence_parallel=True)``), for its activation memory;
- **pshard-backward**: **pshard** differentiated with ``.backward()`` (the blocks as leaf
  tensors) instead of ``torch.func.grad``: what the split model holds apart from
  ``create_graph`` (not in the default modes).

Measured per rank: ``peak``, the resident high-water mark above the resident size before the
model was built (the largest over the ranks); ``step``, the median step time after a warm-up
step (the median over the ranks). Step times of separate runs move with the load of a shared
machine, so the time ratio comes from ``--pairs`` paired steps: both configurations built in
the same processes, their steps alternating (order swapped each pair), the ratio the median of
each pair's pshard / dtensor. The script checks that pshard's loss equals DTensor's.

Target (issue 37): pshard's step time and peak at most 1.0x DTensor TP's.

    python benchmarks/tensor_parallel.py [--nprocs 2 4] [--hidden 1024] [--ffn 2816]
        [--layers 4] [--heads 16] [--kv-heads 8] [--vocab 8192] [--seq 256] [--rows 2]
        [--steps 3] [--pairs 4] [--modes dtensor pshard pshard-remat pshard-sp]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _memory import peak_mib, rss_mib, trim  # noqa: E402

MODES = {
    "dtensor": "DTensor TP",
    "pshard": "pshard",
    "pshard-remat": "pshard, layers ps.checkpoint",
    "pshard-sp": "pshard + sequence parallel",
    "pshard-backward": "pshard, .backward()",
}


def _config(a: argparse.Namespace) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.ffn,
        num_hidden_layers=a.layers, num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
        max_position_embeddings=a.seq, attn_implementation="sdpa", tie_word_embeddings=False,
    )  # fmt: skip


def _meta_model(a: argparse.Namespace) -> Any:
    import torch
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(_config(a))
    model.model.rotary_emb = type(model.model.rotary_emb)(_config(a))  # a computed buffer
    return model.train()


def _whole(shape: tuple[int, ...], index: int) -> Any:
    """The initial value of parameter ``index``, the same in every process."""
    import torch

    g = torch.Generator().manual_seed(1000 + index)
    return torch.randn(shape, generator=g) / shape[-1] ** 0.5


def _batch(a: argparse.Namespace) -> tuple[Any, Any]:
    import torch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, a.vocab, (a.rows, a.seq), generator=g)
    return ids, ids.clone()


def _loss(logits: Any, labels: Any, axis: str | None = None) -> Any:
    import torch.nn.functional as F

    shifted = F.pad(labels, (0, 1), value=-100)[:, 1:]
    if axis is None:
        return F.cross_entropy(logits.flatten(0, 1), shifted.flatten())
    import pshard as ps

    return ps.cross_entropy(logits, shifted, axis=axis)


def _dtensor(a: argparse.Namespace, ids: Any, labels: Any) -> Any:
    """DTensor TP: ``step() -> loss``."""
    import torch
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    import pshard as ps

    model = _meta_model(a)
    shapes = {k: tuple(p.shape) for k, p in model.named_parameters()}
    plan: dict[str, Any] = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Replicate()),
    }
    for i in range(a.layers):
        layer = f"model.layers.{i}."
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                     "mlp.gate_proj", "mlp.up_proj"):  # fmt: skip
            plan[layer + name] = ColwiseParallel()
        plan[layer + "self_attn.o_proj"] = RowwiseParallel()
        plan[layer + "mlp.down_proj"] = RowwiseParallel()
    parallelize_module(model, ps.current_mesh(), plan)
    model.to_empty(device="cpu")
    model.model.rotary_emb = type(model.model.rotary_emb)(_config(a))
    with torch.no_grad():
        for i, (k, p) in enumerate(model.named_parameters()):
            whole = _whole(shapes[k], i)
            if hasattr(p, "to_local"):
                from torch.distributed.tensor import distribute_tensor

                p.to_local().copy_(distribute_tensor(whole, p.device_mesh, p.placements).to_local())
            else:
                p.copy_(whole)

    def step() -> Any:
        loss = _loss(model(input_ids=ids, use_cache=False).logits, labels)
        loss.backward()
        for p in model.parameters():
            p.grad = None
        return loss.detach()

    return step


def _pshard(a: argparse.Namespace, ids: Any, labels: Any, mode: str) -> Any:
    """pshard: ``step() -> loss``."""
    import torch

    import pshard as ps

    model = _meta_model(a)
    sequence = mode == "pshard-sp"
    if mode == "pshard-remat":
        dots = ps.checkpoint_policies.dots_saveable

        def remat(fn: Any, *args: Any, **kwargs: Any) -> Any:
            return ps.checkpoint(fn, policy=dots)(*args, **kwargs)

        model._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=remat)
    plan = ps.tensor_parallel_plan(model, sequence_parallel=sequence)
    specs = ps.tensor_parallel_specs(model, plan)
    params = {
        k: ps.shard(_whole(tuple(p.shape), i), specs[k])
        for i, (k, p) in enumerate(model.named_parameters())
    }

    def body(params: dict, ids: Any, labels: Any) -> Any:
        out = torch.func.functional_call(model, params, (), {"input_ids": ids, "use_cache": False})
        return _loss(out.logits, labels, "tp")

    def loss(params: dict) -> Any:
        with ps.tensor_parallel(model, plan, loss_parallel=True):
            mapped = ps.shard_map(body, in_specs=(specs, None, None), out_specs=ps.P())
            return mapped(params, ids, labels)

    if mode == "pshard-backward":
        leaves = {k: ps.GlobalTensor(v.local.requires_grad_(), v.meta) for k, v in params.items()}

        def backward_step() -> Any:
            value = loss(leaves)
            value.backward()
            for x in leaves.values():
                x.local.grad = None
            return value.detach()

        return backward_step
    grad_and_value = torch.func.grad_and_value(loss)

    def step() -> Any:
        grads, value = grad_and_value(params)
        del grads
        return value.detach()

    return step


def _build(mode: str, a: argparse.Namespace, data: tuple[Any, Any]) -> Any:
    if mode == "dtensor":
        return _dtensor(a, *data)
    return _pshard(a, *data, mode)


def run(mode: str, a: argparse.Namespace) -> dict:
    """One configuration in fresh processes: its losses, step time and peak above baseline."""
    import torch.distributed as dist

    import pshard as ps

    ps.init_mesh({"tp": dist.get_world_size()})
    import torch.distributed.tensor.parallel  # noqa: F401  (imported before the baseline)
    import transformers.models.llama.modeling_llama  # noqa: F401

    data = _batch(a)
    trim()
    base = rss_mib()
    step = _build(mode, a, data)
    times, losses = [], []
    for _ in range(a.steps):
        start = time.perf_counter()
        losses.append(float(step()))
        times.append(time.perf_counter() - start)
    return {"losses": losses, "step": statistics.median(times[1:] or times),
            "peak": peak_mib() - base}  # fmt: skip


def paired(mode: str, a: argparse.Namespace) -> float:
    """DTensor and ``mode`` in the same processes, steps alternating: the time ratio."""
    import torch.distributed as dist

    import pshard as ps

    ps.init_mesh({"tp": dist.get_world_size()})
    data = _batch(a)
    steps = {m: _build(m, a, data) for m in ("dtensor", mode)}
    for s in steps.values():
        s()  # warm-up
    ratios = []
    for i in range(a.pairs):
        order = ("dtensor", mode) if i % 2 == 0 else (mode, "dtensor")
        took = {}
        for m in order:
            start = time.perf_counter()
            steps[m]()
            took[m] = time.perf_counter() - start
        ratios.append(took[mode] / took["dtensor"])
    return statistics.median(ratios)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nprocs", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--ffn", type=int, default=2816)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument(
        "--modes", nargs="+", choices=tuple(MODES), default=list(MODES)[:4], help="see above"
    )
    a = parser.parse_args()
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")  # freed blocks go back

    import warnings

    import pshard as ps

    warnings.simplefilter("ignore")
    print(f"Llama-shaped decoder: hidden {a.hidden}, ffn {a.ffn}, {a.layers} layers, "
          f"{a.heads}/{a.kv_heads} heads, vocabulary {a.vocab}; {a.rows} x {a.seq} tokens; "
          f"float32, forward + backward")  # fmt: skip
    print(f"{'ranks':>5} {'configuration':<28} {'step (s)':>9} {'peak (MiB)':>11} {'loss':>12}")
    for n in a.nprocs:
        results = {}
        for mode in a.modes:
            per_rank = ps.spawn(run, mode, a, nprocs=n)
            results[mode] = {
                "step": statistics.median(r["step"] for r in per_rank),
                "peak": max(r["peak"] for r in per_rank),
                "loss": per_rank[0]["losses"][-1],
            }
            r = results[mode]
            print(f"{n:>5} {MODES[mode]:<28} {r['step']:>9.3f} {r['peak']:>11.1f} "
                  f"{r['loss']:>12.6f}")  # fmt: skip
        for mode in ("pshard", "pshard-remat"):
            if {"dtensor", mode} <= set(results):
                ratio = statistics.median(ps.spawn(paired, mode, a, nprocs=n))
                peak = results[mode]["peak"] / results["dtensor"]["peak"]
                diff = abs(results[mode]["loss"] - results["dtensor"]["loss"])
                print(f"{n:>5} {MODES[mode]} / DTensor: step {ratio:.2f}x (paired), peak "
                      f"{peak:.2f}x, loss difference {diff:.1e}")  # fmt: skip
        if {"pshard", "pshard-sp"} <= set(results):
            sp = results["pshard-sp"]["peak"] / results["pshard"]["peak"]
            print(f"{n:>5} sequence parallel / pshard: peak {sp:.2f}x")


if __name__ == "__main__":
    main()
