"""Expert parallelism: ``ps.expert_parallel`` on n gloo ranks against one process running the
whole batch, and against a dense model of the same active parameters.

The model: a Hugging Face ``Qwen3MoeForCausalLM`` built from a config (nothing downloads;
float32, SDPA attention, the eager experts): ``--layers`` decoder layers of width ``--hidden``,
``--experts`` experts of width ``--expert-ffn``, top-``--k`` routing, the load-balancing loss
on; a batch of ``--rows`` rows of ``--seq`` tokens, the model's own loss. One step is a forward
and a backward (every parameter's gradient, ``torch.func.grad_and_value``; no optimizer).
Configurations, each in fresh processes (one thread per rank):

- **one process**: the whole batch, the model's own experts; its torch threads set to the
  ranks' count (the same cores as the n ranks);
- **dense**: the same in one process with each MoE layer replaced by a dense MLP of width
  ``k x expert-ffn`` (the same active parameters per token);
- **ep, balanced** and **ep, skewed**: ``ps.expert_parallel`` over ``"ep"`` of n ranks, each
  rank its ``rows / n`` rows and ``E / n`` experts, inside a ``shard_map``; the router as
  initialised (balanced), or with half the tokens' first choice pushed to rank 0's experts
  (skewed: its router rows for experts 0 and 1 scaled).

Measured per rank: the bytes of token rows sent to other ranks in a step (forward and
backward), against the bound (every (token, choice) row to another rank and back, forward and
backward: ``4 x layers x tokens x k x hidden x 4 bytes``); the experts' work balance (the
largest count of rows a rank's experts compute in a layer over the mean); the median step
time after a warm-up; the experts' parameter bytes held (1/n of the model's); ``peak``, the
resident high-water mark above the resident size before the model was built (the largest over
the ranks).

    python benchmarks/expert_parallel.py [--nprocs 2] [--hidden 256] [--expert-ffn 512]
        [--experts 8] [--k 2] [--layers 2] [--rows 4] [--seq 256] [--steps 4]
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

MODES = ("one process", "dense", "ep, balanced", "ep, skewed")


def _config(a: argparse.Namespace, dense: bool = False) -> Any:
    from transformers import Qwen3Config, Qwen3MoeConfig

    common = dict(
        vocab_size=a.vocab, hidden_size=a.hidden, num_hidden_layers=a.layers,
        num_attention_heads=8, num_key_value_heads=4, head_dim=a.hidden // 8,
        max_position_embeddings=a.seq, attn_implementation="sdpa", tie_word_embeddings=False,
    )  # fmt: skip
    if dense:
        return Qwen3Config(intermediate_size=a.k * a.expert_ffn, **common)
    return Qwen3MoeConfig(
        intermediate_size=a.expert_ffn, moe_intermediate_size=a.expert_ffn,
        num_experts=a.experts, num_experts_per_tok=a.k, norm_topk_prob=True,
        decoder_sparse_step=1, output_router_logits=True, router_aux_loss_coef=0.01,
        experts_implementation="eager", **common,
    )  # fmt: skip


def _model(a: argparse.Namespace, dense: bool = False, skewed: bool = False) -> Any:
    import torch
    from transformers import Qwen3ForCausalLM, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    cls = Qwen3ForCausalLM if dense else Qwen3MoeForCausalLM
    model = cls(_config(a, dense)).train()
    if skewed:
        with torch.no_grad():
            for layer in model.model.layers:
                layer.mlp.gate.weight[:2] *= 6  # experts 0 and 1: rank 0's
    return model


def _batch(a: argparse.Namespace) -> dict:
    import torch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, a.vocab, (a.rows, a.seq), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def _counting() -> tuple[list[int], list[list[int]]]:
    """Count the bytes each exchange sends to other ranks and the rows each rank receives."""
    from pshard._runtime import wire

    sent, received = [0], []
    own = wire.ragged_exchange

    def counted(x: Any, c: Any, send: tuple, recv: tuple) -> Any:
        row = x[:1].numel() * x.element_size() if x.shape[0] else 0
        sent[0] += sum(n for j, n in enumerate(send) if j != c.rank) * row
        received.append(list(recv))
        return own(x, c, send, recv)

    wire.ragged_exchange = counted
    return sent, received


def run(mode: str, a: argparse.Namespace) -> dict:
    import torch
    import torch.distributed as dist

    import pshard as ps

    n = dist.get_world_size()
    if mode in ("one process", "dense"):
        torch.set_num_threads(a.nprocs_now)
    b = _batch(a)
    trim()
    base = rss_mib()
    model = _model(a, dense=mode == "dense", skewed=mode == "ep, skewed")
    params = {k: v.detach() for k, v in model.named_parameters()}
    sent, received = [0], []
    if mode.startswith("ep"):
        ps.init_mesh({"ep": n})
        sent, received = _counting()
        specs = ps.expert_parallel_specs(model)
        params = ps.shard(params, specs)

        def body(p: dict, rows: dict) -> Any:
            return torch.func.functional_call(model, p, (), {**rows, "use_cache": False}).loss

        def loss(p: dict) -> Any:
            with ps.expert_parallel(model):
                return ps.shard_map(body, in_specs=(specs, ps.P("ep")), out_specs=ps.P())(p, b)
    else:

        def loss(p: dict) -> Any:
            return torch.func.functional_call(model, p, (), {**b, "use_cache": False}).loss

    step = torch.func.grad_and_value(loss)
    times, losses = [], []
    for _ in range(a.steps):
        sent[0], received[:] = 0, []
        start = time.perf_counter()
        grads, value = step(params)
        times.append(time.perf_counter() - start)
        losses.append(float(value))
        del grads
    experts = sum(
        (v.local if hasattr(v, "local") else v).numel() * 4
        for k, v in params.items() if "experts" in k
    )  # fmt: skip
    # the rows each rank's experts compute, per layer (the forward's first exchanges)
    forward = received[: 2 * a.layers : 2] if received else []
    return {
        "step": statistics.median(times[1:]),
        "peak": peak_mib() - base,
        "loss": losses[-1],
        "sent": sent[0],
        "rows": [sum(r) for r in forward],
        "experts": experts,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nprocs", type=int, nargs="+", default=[2])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--expert-ffn", type=int, default=512)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--k", type=int, default=2)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=4)
    a = parser.parse_args()
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")  # freed blocks go back

    import warnings

    import pshard as ps

    warnings.simplefilter("ignore")
    tokens = a.rows * a.seq
    print(f"Qwen3-MoE-shaped decoder: hidden {a.hidden}, {a.experts} experts of {a.expert_ffn}, "
          f"top-{a.k}, {a.layers} layers; {a.rows} x {a.seq} tokens; float32, forward + "
          f"backward")  # fmt: skip
    head = (f"{'ranks':>5} {'configuration':<14} {'step (s)':>9} {'vs 1 proc':>9} "
            f"{'peak MiB':>9} {'experts MiB':>11} {'sent/bound':>10} {'balance':>8} "
            f"{'loss':>10}")  # fmt: skip
    print(head)
    for n in a.nprocs:
        a.nprocs_now = n
        results = {}
        for mode in MODES:
            ranks = 1 if mode in ("one process", "dense") else n
            per_rank = ps.spawn(run, mode, a, nprocs=ranks)
            bound = 4 * a.layers * (tokens // ranks) * a.k * a.hidden * 4
            rows = [r["rows"] for r in per_rank]
            balance = (
                max(max(layer) / (sum(layer) / len(layer)) for layer in zip(*rows, strict=True))
                if rows[0] else 1.0
            )  # fmt: skip
            results[mode] = r = {
                "step": statistics.median(x["step"] for x in per_rank),
                "peak": max(x["peak"] for x in per_rank),
                "experts": max(x["experts"] for x in per_rank) / 2**20,
                "sent": max(x["sent"] for x in per_rank) / bound if ranks > 1 else 0.0,
                "balance": balance,
                "loss": per_rank[0]["loss"],
            }
            ratio = r["step"] / results["one process"]["step"]
            print(f"{n:>5} {mode:<14} {r['step']:>9.3f} {ratio:>8.2f}x {r['peak']:>9.1f} "
                  f"{r['experts']:>11.2f} {r['sent']:>10.2f} {r['balance']:>8.2f} "
                  f"{r['loss']:>10.6f}")  # fmt: skip
        diff = abs(results["ep, balanced"]["loss"] - results["one process"]["loss"])
        print(f"{n:>5} loss difference, ep against one process: {diff:.1e}")


if __name__ == "__main__":
    main()
