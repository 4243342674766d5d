"""A Hugging Face Llama under ``sequence_parallel``: forward + backward time on 2 ranks against
one process on the same cores.

A random 4-layer ``LlamaForCausalLM`` (hidden 256, 8 heads of 32, 4 KV heads, vocab 1024,
float32) on one row of ``--seq`` tokens with labels. One process with every core
(``torch.set_num_threads(2)`` on this machine) runs ``model(...).loss.backward()``; two gloo
ranks with one thread each run the same step under ``ps.sequence_parallel(model,
attention=...)`` plus ``ps.reduce_gradients``. Each round times both (interleaved, so machine
noise hits both alike); the table gives medians over rounds and the ratio.

    python benchmarks/hf_llama.py [--seq 1024] [--rounds 7]
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch
import torch.distributed as dist

import pshard as ps


def build() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=8192,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def _batch(seq: int) -> dict:
    ids = torch.randint(0, 1024, (1, seq), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids}


def _parallel(args: argparse.Namespace, attention: str, layout: str) -> float:
    ps.init_mesh({"sp": 2})
    warnings.simplefilter("ignore")
    model, batch = build(), _batch(args.seq)

    def step() -> None:
        with ps.sequence_parallel(model, attention=attention, layout=layout):
            loss = model(**batch).loss
        loss.backward()
        ps.reduce_gradients(model, "sp")
        model.zero_grad(set_to_none=True)

    step()  # warm-up
    times = []
    for _ in range(args.repeats):
        dist.barrier()
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return ps.pmax(torch.tensor(statistics.median(times)), "sp").item()


def _single(args: argparse.Namespace) -> float:
    warnings.simplefilter("ignore")
    torch.set_num_threads(2)
    model, batch = build(), _batch(args.seq)

    def step() -> None:
        model(**batch, use_cache=False).loss.backward()
        model.zero_grad(set_to_none=True)

    step()
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    configs = [("ulysses", "zigzag"), ("ring", "zigzag"), ("ring", "contiguous")]
    times: dict = {c: [] for c in [None, *configs]}
    for _ in range(args.rounds):
        times[None].append(ps.spawn(_single, args, nprocs=1)[0])
        for c in configs:
            times[c].append(ps.spawn(_parallel, args, *c, nprocs=2)[0])
    one = statistics.median(times[None])
    print(f"4-layer Llama, seq {args.seq}, float32, forward + backward, medians of {args.rounds}")
    print(f"{'':>22} | {'time':>9} | {'vs one process':>14}")
    print(f"{'one process, 2 threads':>22} | {one * 1e3:6.1f} ms | {1.0:14.2f}")
    for c in configs:
        t = statistics.median(times[c])
        ratios = [p / s for p, s in zip(times[c], times[None], strict=True)]
        print(
            f"{c[0] + ' ' + c[1]:>22} | {t * 1e3:6.1f} ms | {t / one:6.2f} "
            f"(per-round {statistics.median(ratios):.2f})"
        )


if __name__ == "__main__":
    main()
