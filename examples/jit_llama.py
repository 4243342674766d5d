"""A Hugging Face Llama's whole FSDP training step (forward, backward, collectives, clipping,
AdamW) as one compiled program with ``ps.jit``, checked against the same step run eagerly.

    python examples/jit_llama.py                          # 2 gloo ranks, inductor
    python examples/jit_llama.py --compiler aot_eager     # the same program, no code generated
    python examples/jit_llama.py --backend threads        # the ranks as threads

One step::

    @ps.jit(donate_argnums=(0, 1))
    def step(params, state, ids):
        grads, loss = torch.func.grad_and_value(loss_of)(params, ids)
        updates, state = optimizer.update(grads, state, params)
        return ps.optim.apply_updates(params, updates), state, loss

    def loss_of(params, ids):                    # FSDP over "dp": sharded_call in a map
        def body(blocks, rows):
            out = ps.sharded_call(model, blocks, (), {"input_ids": rows, "labels": rows},
                                  specs=P("dp"))
            return ps.pmean(out.loss, "dp")
        return ps.shard_map(body, in_specs=(P("dp"), P("dp")), out_specs=P())(params, ids)

The first call traces the step on fake tensors into one graph (the all-gathers and
reduce-scatters of ``sharded_call`` and the optimizer's global norm are nodes of it) and
compiles it; every later call runs that program: one program for every step (the optimizer's
step count, learning rate and clipping factor are tensors in it), the parameters and moments
updated in place (donated). The script prints the losses of both runs, their largest
difference, the step times and the number of programs traced, and exits non-zero when the
losses differ or a second program was traced. See docs/jit.md.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch

import pshard as ps

P = ps.P
VOCAB, SEQ, ROWS = 256, 64, 4
TOLERANCE = 1e-4  # float32 losses of two orders of the same operations (measured: ~1e-6)


def model_and_batch() -> tuple[torch.nn.Module, torch.Tensor]:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
        attn_implementation="sdpa",
    )  # fmt: skip
    ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=torch.Generator().manual_seed(1))
    return LlamaForCausalLM(config).train(), ids


def run(args: argparse.Namespace) -> dict:
    ps.init_mesh({"dp": args.nprocs})
    warnings.simplefilter("ignore")
    model, ids = model_and_batch()
    specs = P("dp")
    optimizer = ps.optim.chain(ps.optim.clip_by_global_norm(1.0), ps.optim.adamw(1e-3))

    def loss_of(params: dict, ids: torch.Tensor) -> torch.Tensor:
        def body(blocks: dict, rows: torch.Tensor) -> torch.Tensor:
            kwargs = {"input_ids": rows, "labels": rows, "use_cache": False}
            return ps.pmean(ps.sharded_call(model, blocks, (), kwargs, specs=specs).loss, "dp")

        return ps.shard_map(body, in_specs=(specs, specs), out_specs=P())(params, ids)

    def step(params: dict, state: object, ids: torch.Tensor) -> tuple:
        grads, loss = torch.func.grad_and_value(loss_of)(params, ids)
        updates, state = optimizer.update(grads, state, params)
        return ps.optim.apply_updates(params, updates), state, loss

    jitted = ps.jit(step, donate_argnums=(0, 1), backend=args.compiler)
    whole = {k: v.detach() for k, v in model.named_parameters()}
    start_params = ps.shard(whole, specs)
    eager = (start_params, optimizer.init(start_params))
    copy = {k: ps.GlobalTensor(v.local.clone(), v.meta) for k, v in start_params.items()}
    compiled = (copy, optimizer.init(copy))  # its own: donated to the program
    losses, times = [], {"eager": [], "ps.jit": []}
    for _ in range(args.steps):
        start = time.perf_counter()
        *eager, want = step(*eager, ids)
        times["eager"].append(time.perf_counter() - start)
        start = time.perf_counter()
        *compiled, got = jitted(*compiled, ids)
        times["ps.jit"].append(time.perf_counter() - start)
        losses.append((float(want), float(got)))
    return {
        "losses": losses,
        "first": times["ps.jit"][0],
        "eager": statistics.median(times["eager"][1:]),
        "jit": statistics.median(times["ps.jit"][1:]),
        "programs": jitted.cache_size(),
        "collectives": len(jitted.lower(*compiled, ids).collectives),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--nprocs", type=int, default=2)
    parser.add_argument(
        "--backend", choices=("gloo", "threads"), default="gloo", help="processes or threads"
    )
    parser.add_argument("--compiler", default="inductor", help="inductor, aot_eager, ...")
    args = parser.parse_args()
    result = ps.spawn(run, args, nprocs=args.nprocs, backend=args.backend)[0]
    print(f"{'step':>4} {'eager':>14} {'ps.jit':>14}")
    for i, (want, got) in enumerate(result["losses"]):
        print(f"{i + 1:>4} {want:>14.8f} {got:>14.8f}")
    diff = max(abs(a - b) for a, b in result["losses"])
    print(f"first call (trace + compile with {args.compiler}): {result['first']:.1f} s; "
          f"then a step: eager {result['eager'] * 1e3:.0f} ms, ps.jit "
          f"{result['jit'] * 1e3:.0f} ms ({result['jit'] / result['eager']:.2f}x)")  # fmt: skip
    print(f"programs traced: {result['programs']}; collectives in the program: "
          f"{result['collectives']}; max difference of the losses: {diff:.1e} (tolerance "
          f"{TOLERANCE:g})")  # fmt: skip
    if result["programs"] != 1 or not diff <= TOLERANCE:
        raise SystemExit("the program differs from eager, or was traced again")


if __name__ == "__main__":
    main()
