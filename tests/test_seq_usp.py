"""usp_attention (Ulysses over "uly", ring over "ring") on 4 ranks, mesh {"ring": 2, "uly": 2},
against attention over the whole sequence on one process with the same explicit mask (float64,
outputs and gradients of q, k, v): contiguous, zigzag and stripe layouts, lengths not divisible
by 4, with and without segment ids and windows, GQA with fewer KV heads than the Ulysses axis;
the tiny LM of the test suite under usp_attention against the single-process model; the gathered
layout the ring part runs on; errors."""

from __future__ import annotations

import functools
import re

import pytest
import torch
from helpers import masked_attention, reference_mask
from test_seq_masks import LM_PADS, LM_SPECS, lm_forward, packed_batch, ref_lm_loss, segment_pattern
from test_seq_model import _sums, init_params

import pshard as ps
from pshard.sequence._layouts import LAYOUTS, SeqLayout, pad_permute
from pshard.sequence._ring_schedule import GatheredLayout, plan

B, D = 2, 3
TOL = {"rtol": 1e-9, "atol": 1e-11}
AXIS = ("ring", "uly")

# (layout, seq_len, query heads, kv heads, causal, window, with segment ids)
CONFIGS = [
    (kind, s, hq, hkv, causal, window, seg)
    for kind in LAYOUTS
    for s, hq, hkv in ((11, 4, 4), (9, 4, 1))
    for causal, window, seg in ((True, None, False), (True, 3, True), (False, (1, 2), True))
]


def _data() -> list:
    torch.manual_seed(0)
    out = []
    for _, s, hq, hkv, *_ in CONFIGS:
        q = torch.randn(B, s, hq, D, dtype=torch.float64)
        k = torch.randn(B, s, hkv, D, dtype=torch.float64)
        v = torch.randn(B, s, hkv, D + 1, dtype=torch.float64)
        cot = torch.randn(B, s, hq, D + 1, dtype=torch.float64)
        out.append((q, k, v, cot, segment_pattern(B, s)))
    return out


def _usp(q, k, v, seg, causal, window):
    return ps.usp_attention(
        q, k, v, ulysses_axis="uly", ring_axis="ring", causal=causal, segment_ids=seg,
        window=window,
    )  # fmt: skip


def _mapped(kind: str, causal: bool, window, with_seg: bool):
    def attend(q, k, v, seg):
        return _usp(q, k, v, seg if with_seg else None, causal, window)

    return ps.shard_map_seq(
        attend, axis=AXIS, in_specs=ps.Shard(1), out_specs=ps.Shard(1), layout=kind,
        pad_values=(0.0, 0.0, 0.0, -1),
    )  # fmt: skip


def _worker(data: list) -> list:
    ps.init_mesh({"ring": 2, "uly": 2})
    out = []
    for (kind, _, _, _, causal, window, with_seg), (q, k, v, cot, seg) in zip(
        CONFIGS, data, strict=True
    ):
        mapped = _mapped(kind, causal, window, with_seg)
        xs = [t.clone().requires_grad_(True) for t in (q, k, v)]
        y = mapped(*xs, seg)
        grads = torch.autograd.grad((y * cot).sum(), xs)
        weighted = functools.partial(_weighted, mapped, seg=seg, cot=cot)
        fgrads = torch.func.grad(weighted, argnums=(0, 1, 2))(q, k, v)
        out.append((y.detach(), grads, fgrads))
    return out


def _weighted(mapped, q, k, v, *, seg, cot):
    return (mapped(q, k, v, seg) * cot).sum()


def test_against_full_attention(pool) -> None:
    data = _data()
    got = pool.run(4, _worker, data, timeout=300)
    for c, ((_, s, _, _, causal, window, with_seg), (q, k, v, cot, seg)) in enumerate(
        zip(CONFIGS, data, strict=True)
    ):
        mask = reference_mask(s, seg if with_seg else None, causal, window)
        inputs = [t.clone().requires_grad_(True) for t in (q, k, v)]
        ref = masked_attention(*inputs, mask)
        ref_grads = torch.autograd.grad((ref * cot).sum(), inputs)
        for r in range(4):
            y, grads, fgrads = got[r][c]
            msg = f"rank {r} {CONFIGS[c]}"
            torch.testing.assert_close(y, ref.detach(), msg=msg, **TOL)
            for g, fg, rg in zip(grads, fgrads, ref_grads, strict=True):
                torch.testing.assert_close(g, rg, msg=msg, **TOL)
                torch.testing.assert_close(fg, rg, msg=msg, **TOL)


def _local_lm_loss(params: dict, batch: dict) -> torch.Tensor:
    att = functools.partial(_usp, seg=batch["segment_ids"], causal=True, window=None)
    logits = lm_forward(params, batch["input_ids"], batch["position_ids"], att)
    return ps.token_mean_loss(*_sums(logits, batch["shift_labels"]), AXIS)


def _lm_worker() -> list:
    ps.init_mesh({"ring": 2, "uly": 2})
    out = []
    for kind in ("contiguous", "zigzag"):
        params, batch = init_params(4, 1, seed=4), packed_batch(11, seed=4)
        loss = ps.shard_map_seq(
            _local_lm_loss, axis=AXIS, in_specs=(None, LM_SPECS), out_specs=ps.Replicate(),
            layout=kind, pad_values=(0, LM_PADS),
        )  # fmt: skip
        grad, value = torch.func.grad_and_value(loss)(params, batch)
        ref_grad, ref_value = torch.func.grad_and_value(ref_lm_loss)(params, batch)
        out.append((kind, (value, ref_value), (grad, ref_grad)))
    return out


def test_tiny_lm_with_packed_rows_matches_single_process(pool) -> None:
    for r, per_rank in enumerate(pool.run(4, _lm_worker, timeout=300)):
        for kind, value, grads in per_rank:
            torch.testing.assert_close(*value, msg=f"rank {r} {kind}", **TOL)
            for a, b in zip(*(torch.utils._pytree.tree_leaves(g) for g in grads), strict=True):
                torch.testing.assert_close(a, b, msg=f"rank {r} {kind}", **TOL)


def test_gathered_layout() -> None:
    """Ring rank r holds the tokens of ranks r * U .. r * U + U - 1, in that order: under zigzag
    that is the zigzag of the ring axis (chunks r and 2R - 1 - r, each U chunks wide)."""
    base = SeqLayout("zigzag", 16, 4)
    gathered = GatheredLayout(base, 2, 2)
    assert gathered.local_length == 8
    assert gathered.positions(0) == base.positions(0) + base.positions(1)
    assert sorted(gathered.positions(0)) == sorted(SeqLayout("zigzag", 16, 2).positions(0))
    x = torch.arange(16)
    blocks = pad_permute(x, 0, base, -1).chunk(4)
    assert torch.equal(gathered.position_tensor(1, "cpu"), torch.cat(blocks[2:]))
    # the load-balancing layouts balance the ring part: equal causal work on both ring ranks
    for kind, balanced in (("zigzag", True), ("stripe", True), ("contiguous", False)):
        layout = GatheredLayout(SeqLayout(kind, 64, 4), 2, 2)
        work = [plan(layout, r, True)[1].work for r in range(2)]
        assert (work[0] == work[1]) is balanced, (kind, work)
        assert sum(work) == 32.0  # half of the 2 x 2 steps x 4 x 4 chunk pairs: causal


def test_errors() -> None:
    ps.init_mesh({"ring": 1, "uly": 1})
    q = torch.randn(1, 4, 3, 2)
    with pytest.raises(TypeError, match=re.escape("usp_attention: q, k, v must have one floating")):
        ps.usp_attention(q.long(), q.long(), q.long(), ulysses_axis="uly", ring_axis="ring")
    with pytest.raises(ValueError, match=re.escape("usp_attention: window=0 must be >= 1")):
        ps.usp_attention(q, q, q, ulysses_axis="uly", ring_axis="ring", window=0)
