"""A tiny causal transformer LM in float64 (embeddings, rotary positions, 2 attention + MLP
blocks, GQA variants): loss, logits and gradients under shard_map_seq + ulysses_attention equal
the single-process model on 2 and 4 ranks, under every layout, for lengths not divisible by the
axis size (and shorter than it); pmap_microbatch around it with token weights equals the whole
batch."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

import pshard as ps
from pshard._core.tree import tree_leaves, tree_map

V, DM, HD, FF = 13, 8, 2, 12
TOL = {"rtol": 1e-9, "atol": 1e-11}


def init_params(hq: int, hkv: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)

    def w(*shape: int) -> torch.Tensor:
        return 0.4 * torch.randn(*shape, generator=g, dtype=torch.float64)

    params = {"embed": w(V, DM), "head": w(DM, V)}
    for i in range(2):
        params[f"block{i}"] = {
            "wq": w(DM, hq * HD),
            "wk": w(DM, hkv * HD),
            "wv": w(DM, hkv * HD),
            "wo": w(hq * HD, DM),
            "w1": w(DM, FF),
            "w2": w(FF, DM),
        }
    return params


def _norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _rope(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    angle = (pos.to(x.dtype) * 0.37).unsqueeze(-1)  # (..., seq, 1) against (b, seq, heads)
    cos, sin = angle.cos(), angle.sin()
    x0, x1 = x[..., 0], x[..., 1]
    return torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], -1)


def forward(params: dict, ids: torch.Tensor, pos: torch.Tensor, attention) -> torch.Tensor:
    h = params["embed"][ids]
    for i in range(2):
        p = params[f"block{i}"]
        x = _norm(h)
        q = _rope((x @ p["wq"]).unflatten(-1, (-1, HD)), pos)
        k = _rope((x @ p["wk"]).unflatten(-1, (-1, HD)), pos)
        v = (x @ p["wv"]).unflatten(-1, (-1, HD))
        h = h + attention(q, k, v).flatten(-2) @ p["wo"]
        h = h + torch.tanh(_norm(h) @ p["w1"]) @ p["w2"]
    return _norm(h) @ params["head"]


def full_attention(q, k, v):
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        is_causal=True,
        enable_gqa=q.shape[2] != k.shape[2],
    )
    return out.transpose(1, 2)


def sp_attention(q, k, v):
    return ps.ulysses_attention(q, k, v, axis="sp", causal=True)


def _sums(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    total = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
    return total, (targets != -100).sum()


def ref_loss(params: dict, batch: dict) -> torch.Tensor:
    s = batch["input_ids"].shape[1]
    logits = forward(params, batch["input_ids"], torch.arange(s), full_attention)
    total, count = _sums(logits, batch["shift_labels"])
    return total / count.clamp_min(1)


def local_loss(params: dict, batch: dict, attention=sp_attention) -> torch.Tensor:
    """The per-shard loss: positions from the sequence context (padding at >= s)."""
    logits = forward(params, batch["input_ids"], ps.seq_positions(), attention)
    return ps.token_mean_loss(*_sums(logits, batch["shift_labels"]), "sp")


def local_logits(params: dict, batch: dict) -> torch.Tensor:
    """Positions from the sharded position_ids this time (they equal seq_positions)."""
    return forward(params, batch["input_ids"], batch["position_ids"][0], sp_attention)


BATCH_SPECS = {"input_ids": ps.Shard(1), "shift_labels": ps.Shard(1), "position_ids": ps.Shard(1)}
PADS = {"input_ids": 0, "shift_labels": -100, "position_ids": 0}


def microbatched_against_reference(attention, params: dict, batch: dict) -> dict:
    """``pmap_microbatch(grad_and_value(shard_map_seq(loss)))`` with token weights on ``batch``
    (whose row 1 has no target: a microbatch of weight 0) next to the whole-batch reference, and
    the mapped loss on an empty sequence (all padding on every rank): pairs to compare."""
    loss = ps.shard_map_seq(
        functools.partial(local_loss, attention=attention),
        in_specs=(None, BATCH_SPECS),
        out_specs=ps.Replicate(),
        layout="zigzag",
        pad_values=(0, PADS),
    )
    step = ps.pmap_microbatch(
        torch.func.grad_and_value(loss),
        num_microbatches=4,
        in_specs=(None, ps.Shard(0)),
        out_specs=ps.Partial("mean"),
        weight_fn=lambda params, mb: (mb["shift_labels"] != -100).sum(),
    )
    batch["shift_labels"][1] = -100
    grad, value = step(params, batch)
    ref_grad, ref_value = torch.func.grad_and_value(ref_loss)(params, batch)
    empty_grad, empty_value = torch.func.grad_and_value(loss)(params, make_batch(1, 0, seed=0))
    return {
        "grad": (grad, ref_grad),
        "value": (value, ref_value),
        "empty": (empty_value, empty_grad),
    }


def make_batch(b: int, s: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, V, (b, s), generator=g)
    labels[0, : s // 2] = -100  # a prompt without targets
    batch = ps.prepare_lm_batch({"input_ids": labels.clamp_min(0), "labels": labels})
    return {k: batch[k] for k in ("input_ids", "shift_labels", "position_ids")}


def _configs(n: int) -> list[tuple[str, int, int, int]]:
    """(layout, seq_len, query heads, kv heads)."""
    heads = [(4, 4), (4, 1)] if n == 2 else [(4, 4), (4, 2), (4, 1)]
    lengths = [2 * n + 3, 1] if n == 2 else [2 * n + 3, 3]
    return [
        (kind, s, hq, hkv)
        for kind in ("contiguous", "zigzag", "stripe")
        for s in lengths
        for hq, hkv in heads
    ]


def _model_worker(n: int) -> list:
    ps.init_mesh({"sp": n})
    out = []
    for i, (kind, s, hq, hkv) in enumerate(_configs(n)):
        params = init_params(hq, hkv, seed=i)
        batch = make_batch(2, s, seed=100 + i)
        specs = {"in_specs": (None, BATCH_SPECS), "layout": kind, "pad_values": (0, PADS)}
        loss = ps.shard_map_seq(local_loss, out_specs=ps.Replicate(), **specs)
        logits = ps.shard_map_seq(local_logits, out_specs=ps.Shard(1), **specs)
        ref_grad, ref_value = torch.func.grad_and_value(ref_loss)(params, batch)
        grad, value = torch.func.grad_and_value(loss)(params, batch)
        # plain autograd through the same map
        leaves = tree_map(lambda t: t.detach().requires_grad_(True), params)
        loss(leaves, batch).backward()
        full = forward(params, batch["input_ids"], torch.arange(s), full_attention)
        out.append(
            {
                "value": (value, ref_value),
                "grad": (grad, ref_grad),
                "backward": tree_map(lambda t: t.grad, leaves),
                "logits": (logits(params, batch), full),
            }
        )
    return out


def _assert_tree_close(a, b, msg: str) -> None:
    la, lb = tree_leaves(a), tree_leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb, strict=True):
        torch.testing.assert_close(x, y, msg=msg, **TOL)


@pytest.mark.parametrize("n", [2, 4])
def test_model_matches_single_process(pool, n: int) -> None:
    results = pool.run(n, _model_worker, n, timeout=300)
    for r, per_rank in enumerate(results):
        for config, res in zip(_configs(n), per_rank, strict=True):
            msg = f"rank {r} {config}"
            torch.testing.assert_close(*res["value"], msg=msg, **TOL)
            _assert_tree_close(*res["grad"], msg=msg)
            _assert_tree_close(res["backward"], res["grad"][1], msg=msg)
            torch.testing.assert_close(*res["logits"], msg=msg, **TOL)
