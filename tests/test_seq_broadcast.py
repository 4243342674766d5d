"""broadcast_batches: every rank's batch reaches every rank in rank order (nested trees,
different shapes per rank), the next broadcast is in flight before the current batch is
yielded, structure mismatches are errors, and one rank is the identity."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
import torch.distributed as dist
from helpers import assert_trees_equal

import pshard as ps


@dataclasses.dataclass
class Extra:
    weights: torch.Tensor
    tag: str = "same"


def _batch(r: int) -> dict:
    g = torch.Generator().manual_seed(r)
    return {
        "input_ids": torch.arange(10 * r, 10 * r + r + 2),
        "nested": {
            "x": torch.randn(r + 1, 3, dtype=torch.float64, generator=g),
            "mask": torch.arange(r) % 2 == 0,
            "half": torch.randn(2, r + 1, generator=g).to(torch.bfloat16).t(),  # not contiguous
        },
        "list": [torch.tensor(float(r)), torch.zeros(0, 4, dtype=torch.int32)],
        "extra": Extra(torch.full((r + 1,), r, dtype=torch.int8)),
        "steps": 3,
        "none": None,
    }


def _worker(n: int) -> dict:
    ps.init_mesh({"sp": n})
    r = ps.axis_index("sp")
    log = []
    original = dist.broadcast

    def logged(tensor, src, group=None, async_op=False):
        log.append(("broadcast", src, async_op))
        return original(tensor, src=src, group=group, async_op=async_op)

    mine = _batch(r)
    got = []
    dist.broadcast = logged
    try:
        for batch in ps.broadcast_batches(mine, "sp"):
            log.append(("yield", len(got)))
            got.append(batch)
    finally:
        dist.broadcast = original
    return {"got": got, "log": log, "own": got[r] is mine}


@pytest.mark.parametrize("n", [2, 4])
def test_every_batch_in_turn(procs, n: int) -> None:
    results = procs.run(n, _worker, n)
    for out in results:
        assert out["own"]  # the source gets its own object back
        assert len(out["got"]) == n
        for i, batch in enumerate(out["got"]):
            assert_trees_equal(batch, _batch(i))
        # double buffer: the broadcast for step i + 1 is issued (async) before step i is yielded
        log = out["log"]
        for i in range(n):
            y = log.index(("yield", i))
            sent = [k for k, e in enumerate(log) if e[0] == "broadcast" and e[1] == i]
            assert len(sent) == 1 and log[sent[0]][2] is True
            assert sent[0] < y and (i == 0 or sent[0] < log.index(("yield", i - 1)))


def _mismatch_worker(kind: str) -> str:
    ps.init_mesh({"sp": 2})
    r = ps.axis_index("sp")
    batch = {"a": torch.zeros(2)}
    if kind == "keys" and r == 1:
        batch = {"a": torch.zeros(2), "b": torch.zeros(1)}
    if kind == "value":
        batch["name"] = f"rank{r}"
    if kind == "kind":
        batch["a"] = torch.zeros(2) if r == 0 else 0.5
    try:
        list(ps.broadcast_batches(batch, "sp"))
    except ValueError as e:
        return str(e)
    return "no error"


def test_mismatches_are_errors(pool) -> None:
    keys = pool.run(2, _mismatch_worker, "keys")
    assert all(
        "the ranks' batches have different pytree structures (rank 0: 1 leaves, rank 1: 2 leaves"
        in m
        for m in keys
    )
    value = pool.run(2, _mismatch_worker, "value")
    assert value[0] == (
        "broadcast_batches: batch['name'] is a str ('rank0'), not a tensor, and differs "
        "between ranks; only tensors are sent (never pickled): make it a tensor, or the same on "
        "every rank"
    )
    kind = pool.run(2, _mismatch_worker, "kind")
    assert all(
        re.search(
            r"batch\['a'\] is .*differs between ranks|batch\['a'\] is a tensor on some ranks", m
        )
        for m in kind
    )


def _one_rank_worker() -> list:
    ps.init_mesh({"dp": 2, "sp": 1})
    b = {"x": torch.arange(3)}
    out = list(ps.broadcast_batches(b, "sp"))
    return [len(out), out[0] is b]


def test_one_rank(pool) -> None:
    assert pool.run(2, _one_rank_worker) == [[1, True], [1, True]]
    ps.init_mesh({"sp": 1})
    with pytest.raises(TypeError, match=re.escape("batch['x'] has dtype torch.float8_e4m3fnuz")):
        list(ps.broadcast_batches({"x": torch.zeros(2, dtype=torch.float8_e4m3fnuz)}, "sp"))
