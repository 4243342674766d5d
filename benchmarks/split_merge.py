"""Split + merge of a wide pytree: pshard against torch pipelining's microbatch helpers.

Runs ``ps.merge(ps.split(tree, Shard(0), k), Shard(0))`` and torch's
``split_args_kwargs_into_chunks`` + ``merge_chunks`` (``torch.distributed.pipelining
.microbatch``) on the same dict of tensors, interleaved round by round, and prints the median
time of each and their ratio. A naive optree version (flatten, ``tensor_split`` per leaf,
unflatten; flatten every chunk, ``cat`` per leaf) is shown for reference.

Usage: ``python benchmarks/split_merge.py [--rounds 40]``. Target: pshard <= 0.5x torch for
1000 leaves of shape (64, 16) into 8 chunks.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import optree
import torch
from torch.distributed.pipelining.microbatch import merge_chunks, split_args_kwargs_into_chunks

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
import pshard as ps  # noqa: E402


def pshard_split_merge(tree, k):
    return ps.merge(ps.split(tree, ps.Shard(0), k), ps.Shard(0))


def torch_split_merge(tree, k):
    args_chunks, _ = split_args_kwargs_into_chunks((tree,), {}, k)
    return merge_chunks([args[0] for args in args_chunks], None)


def naive_split_merge(tree, k):
    leaves, treedef = optree.tree_flatten(tree, namespace="pshard")
    pieces = [torch.tensor_split(x, k, 0) for x in leaves]
    chunks = [treedef.unflatten([p[c] for p in pieces]) for c in range(k)]
    flat = [optree.tree_leaves(c, namespace="pshard") for c in chunks]
    return treedef.unflatten([torch.cat(col, 0) for col in zip(*flat, strict=True)])


IMPLS = {
    "torch": torch_split_merge,
    "pshard": pshard_split_merge,
    "naive optree": naive_split_merge,
}


def time_once(fn, tree, k):
    start = time.perf_counter()
    fn(tree, k)
    return time.perf_counter() - start


def run_case(n_leaves, shape, k, rounds):
    tree = {f"layer{i:04d}": torch.randn(*shape) for i in range(n_leaves)}
    expected = torch_split_merge(tree, k)
    for name, fn in IMPLS.items():  # warm up and check they agree
        out = fn(tree, k)
        assert all(torch.equal(out[key], expected[key]) for key in tree), name
    times = {name: [] for name in IMPLS}
    for _ in range(rounds):
        for name, fn in IMPLS.items():
            times[name].append(time_once(fn, tree, k))
    med = {name: statistics.median(ts) * 1e3 for name, ts in times.items()}
    ratios = [p / t for p, t in zip(times["pshard"], times["torch"], strict=True)]
    return med, statistics.median(ratios)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40)
    args = parser.parse_args()
    torch.set_num_threads(1)
    cases = [(1000, (64, 16), 8), (1000, (64, 16), 2), (100, (64, 16), 8), (10, (64, 16), 8)]
    print(f"torch {torch.__version__}, medians of {args.rounds} interleaved rounds (ms)")
    header = "| leaves | shape | k | torch | pshard | naive optree | pshard/torch | naive/torch |"
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for n_leaves, shape, k in cases:
        med, ratio = run_case(n_leaves, shape, k, args.rounds)
        print(
            f"| {n_leaves} | {shape} | {k} | {med['torch']:.2f} | {med['pshard']:.2f} | "
            f"{med['naive optree']:.2f} | {med['pshard'] / med['torch']:.2f} "
            f"(per-round median {ratio:.2f}) | {med['naive optree'] / med['torch']:.2f} |"
        )


if __name__ == "__main__":
    main()
