"""``ps.jit`` of a whole training step against the same step eager, against ``torch.compile`` of
FSDP2's ``.backward()`` step, and its trace + compile time against ``torch.compile`` of the
one-process step.

``--parallel tp`` and ``--parallel ulysses`` time the same against tensor parallelism
(``tensor_parallel`` in a map over "tp") and Ulysses (``sequence_parallel`` over "sp", the
gradients summed over it) instead of FSDP.

The model: a Hugging Face ``LlamaForCausalLM`` built from a config (nothing downloads; float32,
SDPA): ``--layers`` decoder layers of width ``--hidden``, a batch of ``--rows`` rows of
``--seq`` tokens, the model's own loss. The step (on ``--nprocs`` gloo ranks, one thread each):

- **eager**: ``grad_and_value(shard_map(sharded_call(model)))`` over ``"dp"`` (FSDP: every
  parameter a ``GlobalTensor`` ``P("dp")``), ``ps.optim.chain(clip_by_global_norm(1.0),
  adamw(1e-3))``, ``apply_updates``;
- **ps.jit**: the same function under ``ps.jit(step, donate_argnums=(0, 1))`` (inductor);
- **FSDP2 compiled** (``--parallel fsdp``): ``fully_shard`` on each decoder layer and the
  root, the model under ``torch.compile``, ``loss.backward()``, ``clip_grad_norm_``,
  ``torch.optim.AdamW`` (foreach).

Measured: the median step time of ``--rounds`` interleaved rounds (eager and ps.jit in the same
processes, alternating), their ratio per round (median); ps.jit's programs after all rounds (1:
no recompilation); the first call's time (trace + compile) against ``torch.compile`` of the
one-process step (the model whole on one rank; the step function with ``.backward()``, clipping
and AdamW under ``torch.compile``: its first call less a later step; inductor's caches off for
both); the peak resident memory above the baseline of eager and ps.jit steps, each in
fresh processes (the largest over ranks); the losses.

    python benchmarks/jit.py [--hidden 256] [--layers 4] [--seq 128] [--rows 4] [--rounds 6]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _memory import hwm_mib, reset_peak, rss_mib, trim  # noqa: E402


def _model(a: argparse.Namespace) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=2 * a.hidden,
        num_hidden_layers=a.layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=a.seq, attn_implementation="sdpa",
    )  # fmt: skip
    return LlamaForCausalLM(config).train()


def _ids(a: argparse.Namespace) -> Any:
    import torch

    return torch.randint(0, a.vocab, (a.rows, a.seq), generator=torch.Generator().manual_seed(1))


_AXIS = {"fsdp": "dp", "tp": "tp", "ulysses": "sp"}


def _mesh(a: argparse.Namespace) -> Any:
    import torch.distributed as dist

    import pshard as ps

    return ps.init_mesh({_AXIS[a.parallel]: dist.get_world_size()})


def _pshard_step(a: argparse.Namespace) -> tuple[Any, Any, Any]:
    """``(step, params, state)`` of the functional step: FSDP (``sharded_call`` in a map over
    "dp", the batch split), tensor parallelism (``tensor_parallel`` in a map over "tp") or
    Ulysses (``sequence_parallel`` over "sp": each rank's gradients its tokens' share, summed)."""
    import torch

    import pshard as ps

    model = _model(a)
    whole = {k: v.detach() for k, v in model.named_parameters()}
    tx = ps.optim.chain(ps.optim.clip_by_global_norm(1.0), ps.optim.adamw(1e-3))
    specs: Any = ps.P("dp")

    def kwargs(rows: Any) -> dict:
        return {"input_ids": rows, "labels": rows, "use_cache": False}

    if a.parallel == "fsdp":

        def loss(p: dict, ids: Any) -> Any:
            def body(blocks: dict, rows: Any) -> Any:
                out = ps.sharded_call(model, blocks, (), kwargs(rows), specs=specs)
                return ps.pmean(out.loss, "dp")

            return ps.shard_map(body, in_specs=(specs, specs), out_specs=ps.P())(p, ids)

        params: Any = ps.shard(whole, specs)
    elif a.parallel == "tp":
        specs = ps.tensor_parallel_specs(model)

        def loss(p: dict, ids: Any) -> Any:
            with ps.tensor_parallel(model):
                body = lambda b, r: torch.func.functional_call(model, b, (), kwargs(r)).loss  # noqa: E731
                return ps.shard_map(body, in_specs=(specs, None), out_specs=ps.P())(p, ids)

        params = ps.shard(whole, specs)
    else:

        def loss(p: dict, ids: Any) -> Any:
            with ps.sequence_parallel(model, axis="sp", attention="ulysses"):
                return torch.func.functional_call(model, p, (), kwargs(ids)).loss

        params = whole

    def step(p: dict, s: Any, ids: Any) -> tuple[dict, Any, Any]:
        grads, value = torch.func.grad_and_value(loss)(p, ids)
        if a.parallel == "ulysses":  # each rank's tokens' share of the gradients
            grads = ps.psum(grads, "sp")
        updates, s = tx.update(grads, s, p)
        return ps.optim.apply_updates(p, updates), s, value

    return step, params, tx.init(params)


def _copy(params: dict) -> dict:
    import pshard as ps

    return {
        k: ps.GlobalTensor(v.local.clone(), v.meta) if isinstance(v, ps.GlobalTensor) else v.clone()
        for k, v in params.items()
    }


def paired(a: argparse.Namespace) -> dict:
    """Eager and ps.jit in the same processes, their steps alternating."""

    import pshard as ps

    warnings.simplefilter("ignore")
    _mesh(a)
    ids = _ids(a)
    step, params, state = _pshard_step(a)
    jitted = ps.jit(step, donate_argnums=(0, 1), backend=a.backend)
    eager = (params, state)
    compiled = (_copy(params), _pshard_step(a)[2])  # its own state: donated
    start = time.perf_counter()
    *compiled, first = jitted(*compiled, ids)
    first_call = time.perf_counter() - start
    *eager, _ = step(*eager, ids)  # warm-up
    times: dict[str, list[float]] = {"eager": [], "jit": []}
    losses = []
    for i in range(a.rounds):
        for mode in ("eager", "jit") if i % 2 == 0 else ("jit", "eager"):
            start = time.perf_counter()
            if mode == "eager":
                *eager, e = step(*eager, ids)
            else:
                *compiled, j = jitted(*compiled, ids)
            times[mode].append(time.perf_counter() - start)
        losses.append((float(e), float(j)))
    ratios = [j / e for e, j in zip(times["eager"], times["jit"], strict=True)]
    return {
        "eager": statistics.median(times["eager"]),
        "jit": statistics.median(times["jit"]),
        "ratio": statistics.median(ratios),
        "first": first_call,
        "programs": jitted.cache_size(),
        "losses": losses,
    }


def peak(a: argparse.Namespace, mode: str) -> float:
    """The peak above the baseline of ``--rounds`` steps of one mode, in fresh processes."""

    import pshard as ps

    warnings.simplefilter("ignore")
    _mesh(a)
    ids = _ids(a)
    import transformers.models.llama.modeling_llama  # noqa: F401  (before the baseline)

    step, params, state = _pshard_step(a)
    if mode == "jit":
        step = ps.jit(step, donate_argnums=(0, 1), backend=a.backend)
    params, state, _ = step(params, state, ids)  # (compiled: not the step's memory)
    trim()
    base = rss_mib()  # the model's state and the program, resident
    reset_peak()
    for _ in range(3):
        params, state, _ = step(params, state, ids)
    return hwm_mib() - base


def fsdp2(a: argparse.Namespace) -> dict:
    """torch.compile of FSDP2's step."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    import pshard as ps

    warnings.simplefilter("ignore")
    mesh = ps.init_mesh({"dp": dist.get_world_size()})
    model = _model(a)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=1e-4, foreach=True)
    compiled = torch.compile(model)
    ids = _ids(a)

    def step() -> float:
        loss = compiled(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        return float(loss)

    start = time.perf_counter()
    step()
    first = time.perf_counter() - start
    times = []
    for _ in range(a.rounds):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return {"step": statistics.median(times), "first": first}


def one_process(a: argparse.Namespace) -> dict:
    """torch.compile of the one-process step (forward, ``.backward()``, clipping, AdamW): its
    first call (trace and compile) less a later step."""
    import torch

    warnings.simplefilter("ignore")
    model = _model(a)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=1e-4, foreach=True)
    ids = _ids(a)

    @torch.compile
    def step() -> None:
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()

    start = time.perf_counter()
    step()
    first = time.perf_counter() - start
    start = time.perf_counter()
    step()
    return {"compile": first - (time.perf_counter() - start)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nprocs", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--backend", default="inductor")
    parser.add_argument(
        "--parallel", choices=tuple(_AXIS), default="fsdp", help="the step's parallelism"
    )
    a = parser.parse_args()
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")  # freed blocks go back
    # compile times from scratch, for both (inductor's caches would serve a second run)
    os.environ.setdefault("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1")
    import pshard as ps

    print(f"Llama: hidden {a.hidden}, {a.layers} layers, vocabulary {a.vocab}; {a.rows} x "
          f"{a.seq} tokens; float32; {a.nprocs} gloo ranks, {a.parallel} over all")  # fmt: skip
    n = a.nprocs
    pair = ps.spawn(paired, a, nprocs=n)
    fs = ps.spawn(fsdp2, a, nprocs=n) if a.parallel == "fsdp" else None
    one = ps.spawn(one_process, a, nprocs=1)[0]
    peaks = {m: max(ps.spawn(peak, a, m, nprocs=n)) for m in ("eager", "jit")}
    eager = statistics.median(r["eager"] for r in pair)
    jit = statistics.median(r["jit"] for r in pair)
    ratio = statistics.median(r["ratio"] for r in pair)
    first = max(r["first"] for r in pair)
    fsdp_step = statistics.median(r["step"] for r in fs) if fs else None
    diff = max(abs(e - j) for r in pair for e, j in r["losses"])
    print(f"{'configuration':<34} {'step (s)':>9} {'vs eager':>9}")
    label = f"eager ({a.parallel} step)"
    print(f"{label:<34} {eager:>9.3f} {1.0:>8.2f}x")
    print(f"{'ps.jit (' + a.backend + ')':<34} {jit:>9.3f} {ratio:>8.2f}x (paired)")
    if fsdp_step is not None:
        print(f"{'FSDP2 + torch.compile':<34} {fsdp_step:>9.3f} {fsdp_step / eager:>8.2f}x")
    print(f"ps.jit programs after {a.rounds + 1} calls: {[r['programs'] for r in pair]}")
    print(f"first call (trace + compile): ps.jit {first:.1f} s; torch.compile of the one-process "
          f"step {one['compile']:.1f} s ({first / one['compile']:.2f}x)")  # fmt: skip
    print(f"peak above baseline (MiB, largest rank): eager {peaks['eager']:.1f}, ps.jit "
          f"{peaks['jit']:.1f} ({peaks['jit'] / peaks['eager']:.2f}x)")  # fmt: skip
    print(f"largest loss difference, ps.jit against eager: {diff:.1e}")


if __name__ == "__main__":
    main()
