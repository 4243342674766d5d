"""Masks by global position in ulysses_attention and ring_attention: segment ids (packed
documents, padding, negative ids) and sliding windows, against attention over the whole
sequence on one process with the same explicit mask (float64, outputs and gradients of q, k, v)
on 1, 2 and 4 ranks, every layout, lengths not divisible by the axis size, GQA, causal or not.
Also: the mask rules themselves (pure), the ring's skipped blocks with segments, the tiny LM on
packed and padded rows with checkpointed layers (reentrant or not) against one process, and the
errors."""

from __future__ import annotations

import contextlib
import contextvars
import functools
import io
import pathlib
import re
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import masked_attention, reference_mask, seq_block
from test_ring_attention import count_worker, counting_rows
from test_seq_model import _norm, _rope, _sums, init_params

import pshard as ps
from pshard._core.tree import tree_leaves, tree_map
from pshard.sequence._context import SeqContext, sequence_context
from pshard.sequence._layouts import LAYOUTS, SeqLayout, pad_permute
from pshard.sequence._masks import check_window, position_mask, visible_counts
from pshard.sequence._ring_schedule import BlockCounts, block_counts

B, D = 2, 3
TOL = {"rtol": 1e-9, "atol": 1e-11}
ATTENTION = {"ulysses": ps.ulysses_attention, "ring": ps.ring_attention}

# (name, causal, window, with segment ids)
MASKS = [
    ("segments causal", True, None, True),
    ("segments", False, None, True),
    ("window causal", True, 3, False),
    ("window (2, 1)", False, (2, 1), False),
    ("window + segments causal", True, 2, True),
    ("window (1, None) + segments", False, (1, None), True),
]


def segment_pattern(b: int, s: int) -> torch.Tensor:
    """Row 0: three packed documents, the last two tokens padding (-1); row 1: left padding,
    then two documents with other ids; further rows: one document."""
    seg = torch.zeros(b, s, dtype=torch.int64)
    seg[0, s // 3 :] = 1
    seg[0, 2 * s // 3 :] = 2
    if s > 4:
        seg[0, -2:] = -1
    if b > 1:
        seg[1, :2] = -1
        seg[1, 2 : max(s // 2, 2)] = 5
        seg[1, max(s // 2, 2) :] = 7
    return seg


# --------------------------------------------------------------------------- pure rules


def test_window_forms() -> None:
    assert check_window("f", None) is None
    assert check_window("f", 1) == (0, None)
    assert check_window("f", 5) == (4, None)
    assert check_window("f", (3, 0)) == (3, 0)
    assert check_window("f", [None, 2]) == (None, 2)
    assert check_window("f", (-1, -1)) is None
    for bad, kind, msg in [
        (0, ValueError, "f: window=0 must be >= 1 (Hugging Face's sliding_window"),
        ((2, -3), ValueError, "f: window=(2, -3): each side of a (left, right) window"),
        ((1.5, 2), ValueError, "f: window=(1.5, 2): each side"),
        ("8", TypeError, "f: window must be an int (Hugging Face's sliding_window) or a"),
        ((1, 2, 3), TypeError, "f: window must be an int"),
        (True, TypeError, "f: window must be an int"),
    ]:
        with pytest.raises(kind, match=re.escape(msg)):
            check_window("f", bad)


@pytest.mark.parametrize("window", [None, 1, 3, (0, 0), (2, 1), (None, 2), (1, None)])
@pytest.mark.parametrize("causal", [False, True])
def test_position_rules_against_definition(window, causal) -> None:
    """position_mask and visible_counts (the ring's schedule) equal the definition, on the
    scattered, padded position sets of every layout."""
    length = 13
    ref = reference_mask(length, causal=causal, window=window)[0]
    win = check_window("t", window)
    for kind in LAYOUTS:
        lay = SeqLayout(kind, length, 3)
        for r in range(3):
            for src in range(3):
                qp, kp = lay.positions(r), lay.positions(src)
                got = position_mask(torch.tensor(qp), torch.tensor(kp), length, causal, win)
                want = torch.zeros(len(qp), len(kp), dtype=torch.bool)
                for a, i in enumerate(qp):
                    for c, j in enumerate(kp):
                        want[a, c] = i < length and j < length and bool(ref[i, j])
                assert torch.equal(got, want), (kind, r, src)
                counts = visible_counts(qp, kp, length, causal, win)
                np.testing.assert_array_equal(counts, want.sum(1).numpy())


def test_block_counts_with_masks() -> None:
    """A window skips the blocks outside it; segments skip blocks no document spans; counts
    add up to every pair."""
    n, s = 4, 64
    causal = block_counts("contiguous", s, n, True)
    windowed = block_counts("contiguous", s, n, True, window=8)
    assert sum(c.work for c in windowed) < sum(c.work for c in causal) / 2
    # with a window of one chunk, each rank sees its own block and the one before: at most 3
    # of its 8 chunk pairs per ring step... and nothing from two blocks back
    assert all(c.skipped >= 2 * 2 * (n - 2) for c in windowed[2:])
    docs = torch.arange(s).div(s // 8, rounding_mode="floor").unsqueeze(0)  # 8 documents
    for kind in LAYOUTS:
        total = 4 * n  # chunk pairs per rank: 2 x 2 per step, n steps
        packed = block_counts(kind, s, n, True, segment_ids=docs)
        plain = block_counts(kind, s, n, True)
        for c, p in zip(packed, plain, strict=True):
            assert c.full + c.partial + c.skipped == total
            assert c.skipped >= p.skipped
        assert sum(c.skipped for c in packed) > sum(c.skipped for c in plain)
    # one document per row: the same schedule as without segments
    assert block_counts("zigzag", s, n, True, segment_ids=torch.zeros(2, s)) == block_counts(
        "zigzag", s, n, True
    )


# --------------------------------------------------------------------------- against full attention


def _configs(n: int) -> list[tuple[str, int, int, int, int]]:
    """(layout, seq_len, query heads, kv heads, mask index)."""
    out = []
    for kind in LAYOUTS:
        for s in (2 * n + 3, 4 * n + 1):
            for i in range(len(MASKS)):
                hq, hkv = ((4, 4), (4, 1))[(s + i) % 2]
                out.append((kind, s, hq, hkv, i))
    return out


def _data(n: int) -> list:
    torch.manual_seed(10 + n)
    data = []
    for _, s, hq, hkv, _ in _configs(n):
        q = torch.randn(B, s, hq, D, dtype=torch.float64)
        k = torch.randn(B, s, hkv, D, dtype=torch.float64)
        v = torch.randn(B, s, hkv, D + 1, dtype=torch.float64)
        cot = torch.randn(B, s, hq, D + 1, dtype=torch.float64)
        data.append((q, k, v, cot, segment_pattern(B, s)))
    return data


def _worker(n: int, data: list) -> list:
    ps.init_mesh({"sp": n})
    r = ps.axis_index("sp")
    out = []
    for (kind, s, _, _, i), (q, k, v, cot, seg) in zip(_configs(n), data, strict=True):
        _, causal, window, with_seg = MASKS[i]
        lay = SeqLayout(kind, s, n)
        local = [seq_block(t, lay, r) for t in (q, k, v)]
        mine_cot = seq_block(cot, lay, r)
        mine_seg = pad_permute(seg, 1, lay, 0).chunk(n, 1)[r] if with_seg else None
        per_fn = {}
        with sequence_context(SeqContext(("sp",), lay, r, torch.device("cpu"))):
            for name, attention in ATTENTION.items():
                fn = functools.partial(
                    attention, causal=causal, window=window, segment_ids=mine_seg
                )
                xs = [t.clone().requires_grad_(True) for t in local]
                y = fn(*xs)
                grads = torch.autograd.grad((y * mine_cot).sum(), xs)
                fgrads = torch.func.grad(
                    lambda q, k, v, fn=fn, c=mine_cot: (fn(q, k, v) * c).sum(), argnums=(0, 1, 2)
                )(*local)
                per_fn[name] = (y.detach(), grads, fgrads)
        out.append(per_fn)
    return out


@pytest.mark.parametrize("n", [1, 2, 4])
def test_against_full_attention_with_masks(pool, n: int) -> None:
    data = _data(n)
    check_against_full_attention(n, data, pool.run(n, _worker, n, data, timeout=300))


def check_against_full_attention(n: int, data: list, got: list) -> None:
    """What ``_worker`` gave on every rank against attention over the whole sequence."""
    for c, ((kind, s, hq, hkv, i), (q, k, v, cot, seg)) in enumerate(
        zip(_configs(n), data, strict=True)
    ):
        name, causal, window, with_seg = MASKS[i]
        lay = SeqLayout(kind, s, n)
        mask = reference_mask(s, seg if with_seg else None, causal, window)
        inputs = [t.clone().requires_grad_(True) for t in (q, k, v)]
        ref = masked_attention(*inputs, mask)
        ref_grads = torch.autograd.grad((ref * cot).sum(), inputs)
        if with_seg:  # the pattern has queries that see nothing: they must give exact zeros
            assert not mask.any(-1).all()
        for r in range(n):
            real = torch.tensor(lay.is_pad(r)).logical_not().view(1, -1, 1, 1)
            for fn in ATTENTION:
                y, grads, fgrads = got[r][c][fn]
                msg = f"{fn} rank {r} {kind} s={s} heads {hq}/{hkv} {name}"
                torch.testing.assert_close(
                    y, seq_block(ref.detach(), lay, r) * real, msg=msg, **TOL
                )
                for g, fg, rg in zip(grads, fgrads, ref_grads, strict=True):
                    torch.testing.assert_close(g, seq_block(rg, lay, r), msg=msg, **TOL)
                    torch.testing.assert_close(fg, g, msg=msg, **TOL)


def test_ring_skips_blocks_the_segments_empty(pool) -> None:
    n, s = 4, 32
    seg = torch.arange(s).div(s // 8, rounding_mode="floor").unsqueeze(0)
    chunk = s // n // 2
    for kind in LAYOUTS:
        with counting_rows():
            rows = pool.run(n, count_worker, n, s, kind, seg)
        counts = block_counts(kind, s, n, True, segment_ids=seg)
        assert rows == [(c.full + c.partial) * chunk * chunk for c in counts], kind
        assert rows < [(c.full + c.partial) * chunk * chunk for c in block_counts(kind, s, n, True)]


# --------------------------------------------------------------------------- the tiny LM


def _block(p: dict, h: torch.Tensor, pos: torch.Tensor, attention) -> torch.Tensor:
    x = _norm(h)
    hd = 2
    q = _rope((x @ p["wq"]).unflatten(-1, (-1, hd)), pos)
    k = _rope((x @ p["wk"]).unflatten(-1, (-1, hd)), pos)
    v = (x @ p["wv"]).unflatten(-1, (-1, hd))
    h = h + attention(q, k, v).flatten(-2) @ p["wo"]
    return h + torch.tanh(_norm(h) @ p["w1"]) @ p["w2"]


def lm_forward(params, ids, pos, attention, reentrant=None) -> torch.Tensor:
    """The tiny LM of test_seq_model with per-document positions; each block checkpointed
    (``torch.utils.checkpoint``) unless ``reentrant`` is None."""
    h = params["embed"][ids]
    for i in range(2):
        p = params[f"block{i}"]
        if reentrant is None:
            h = _block(p, h, pos, attention)
        else:
            h = torch.utils.checkpoint.checkpoint(
                _block, p, h, pos, attention, use_reentrant=reentrant
            )
    return _norm(h) @ params["head"]


def packed_batch(s: int, seed: int) -> dict:
    """Row 0: packed documents of lengths 3, 2 and the rest (position_ids restarting, labels
    -100 at each document start, as DataCollatorWithFlattening makes them); row 1: two tokens
    of left padding."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 13, (2, s), generator=g)
    pos = torch.stack([torch.arange(s), (torch.arange(s) - 2).clamp_min(0)])
    mask = torch.ones(2, s, dtype=torch.int64)
    mask[1, :2] = 0
    for start in (3, 5):
        if start < s:
            pos[0, start:] = torch.arange(s - start)
    labels = ids.masked_fill(mask == 0, -100).masked_fill(pos == 0, -100)
    batch = ps.prepare_lm_batch(
        {"input_ids": ids, "attention_mask": mask, "position_ids": pos, "labels": labels}
    )
    return {k: batch[k] for k in ("input_ids", "shift_labels", "position_ids", "segment_ids")}


LM_SPECS = {k: ps.Shard(1) for k in ("input_ids", "shift_labels", "position_ids", "segment_ids")}
LM_PADS = {"input_ids": 0, "shift_labels": -100, "position_ids": 0, "segment_ids": -1}


def ref_lm_loss(params: dict, batch: dict) -> torch.Tensor:
    s = batch["input_ids"].shape[1]
    mask = reference_mask(s, batch["segment_ids"], causal=True)
    logits = lm_forward(
        params,
        batch["input_ids"],
        batch["position_ids"],
        lambda q, k, v: masked_attention(q, k, v, mask),
    )
    total, count = _sums(logits, batch["shift_labels"])
    return total / count


def local_lm_loss(params: dict, batch: dict, attention: str, reentrant) -> torch.Tensor:
    att = functools.partial(
        ATTENTION[attention], axis="sp", causal=True, segment_ids=batch["segment_ids"]
    )
    logits = lm_forward(params, batch["input_ids"], batch["position_ids"], att, reentrant)
    return ps.token_mean_loss(*_sums(logits, batch["shift_labels"]), "sp")


def _lm_worker(n: int) -> list:
    ps.init_mesh({"sp": n})
    out = []
    for i, kind in enumerate(LAYOUTS):
        s = 2 * n + 3 + i
        params = init_params(4, 2, seed=i)
        batch = packed_batch(s, seed=i)
        ref_grad, ref_value = torch.func.grad_and_value(ref_lm_loss)(params, batch)
        for attention in ATTENTION:
            for reentrant in (None, False, True):
                loss = ps.shard_map_seq(
                    functools.partial(local_lm_loss, attention=attention, reentrant=reentrant),
                    in_specs=(None, LM_SPECS),
                    out_specs=ps.Replicate(),
                    layout=kind,
                    pad_values=(0, LM_PADS),
                )
                leaves = tree_map(lambda t: t.detach().requires_grad_(True), params)
                value = loss(leaves, batch)
                value.backward()
                res = {
                    "config": (kind, s, attention, reentrant),
                    "value": (value.detach(), ref_value),
                    "backward": (tree_map(lambda t: t.grad, leaves), ref_grad),
                }
                if reentrant is None:  # torch.func.grad refuses checkpointing (saved-tensor hooks)
                    res["grad"] = (torch.func.grad(loss)(params, batch), ref_grad)
                elif reentrant is False:  # reentrant checkpointing refuses autograd.grad
                    xs = tree_map(lambda t: t.detach().requires_grad_(True), params)
                    grads = torch.autograd.grad(loss(xs, batch), tree_leaves(xs))
                    res["grad"] = (grads, ref_grad)
                out.append(res)
    return out


@pytest.mark.parametrize("n", [2, 4])
def test_packed_checkpointed_lm_matches_single_process(pool, n: int) -> None:
    for r, per_rank in enumerate(pool.run(n, _lm_worker, n, timeout=300)):
        for res in per_rank:
            msg = f"rank {r} {res['config']}"
            torch.testing.assert_close(*res["value"], msg=msg, **TOL)
            for key in ("backward", "grad"):
                if key in res:
                    got, want = res[key]
                    for x, y in zip(tree_leaves(got), tree_leaves(want), strict=True):
                        torch.testing.assert_close(x, y, msg=f"{msg} {key}", **TOL)


def _train(loss_fn, params: dict, batch: dict, steps: int = 3, lr: float = 0.5) -> list:
    """Plain SGD on ``loss_fn``; the loss of every step."""
    params = tree_map(lambda t: t.detach().clone(), params)
    curve = []
    for _ in range(steps):
        leaves = tree_map(lambda t: t.requires_grad_(True), params)
        value = loss_fn(leaves, batch)
        value.backward()
        curve.append(value.detach())
        params = tree_map(lambda t: (t - lr * t.grad).detach(), leaves)
    return curve


def _training_worker(n: int) -> dict:
    """Three SGD steps of the packed, checkpointed LM under each attention against one process."""
    ps.init_mesh({"sp": n})
    params, batch = init_params(4, 2, seed=9), packed_batch(2 * n + 1, seed=9)
    out = {"reference": _train(ref_lm_loss, params, batch)}
    for attention in ATTENTION:
        loss = ps.shard_map_seq(
            functools.partial(local_lm_loss, attention=attention, reentrant=False),
            in_specs=(None, LM_SPECS),
            out_specs=ps.Replicate(),
            layout="zigzag",
            pad_values=(0, LM_PADS),
        )
        out[attention] = _train(loss, params, batch)
    return out


def test_packed_checkpointed_lm_trains_like_single_process(pool) -> None:
    for res in pool.run(2, _training_worker, 2):
        want = torch.stack(res.pop("reference"))
        assert want[-1] < want[0]  # it trains
        for attention, curve in res.items():
            torch.testing.assert_close(torch.stack(curve), want, msg=attention, **TOL)


def _positions_worker(n: int) -> list:
    """seq_positions() inside a checkpointed function is recomputed with the forward's layout."""
    ps.init_mesh({"sp": n})
    out = []
    for reentrant in (False, True):

        def body(x, reentrant=reentrant):
            inner = lambda x: x * ps.seq_positions().to(x.dtype).view(1, -1)  # noqa: E731
            y = torch.utils.checkpoint.checkpoint(inner, x, use_reentrant=reentrant)
            return (y**2).sum().view(1)

        mapped = ps.shard_map_seq(
            body, in_specs=ps.Shard(1), out_specs=ps.Partial("sum"), layout="zigzag"
        )
        x = torch.linspace(-1, 1, 2 * 7, dtype=torch.float64).view(2, 7).requires_grad_(True)
        mapped(x).sum().backward()
        out.append(x.grad)
    return out


def test_seq_positions_under_checkpointing(pool) -> None:
    x = torch.linspace(-1, 1, 2 * 7, dtype=torch.float64).view(2, 7)
    want = 2 * x * torch.arange(7.0, dtype=torch.float64) ** 2
    for grads in pool.run(2, _positions_worker, 2):
        for g in grads:
            torch.testing.assert_close(g, want, **TOL)


class CheckpointedLM(torch.nn.Module):
    """``lm_forward`` as a module (HF-like keyword forward) with checkpointed blocks; with
    ``attention=None`` it is the single-process reference (the explicit segment mask)."""

    def __init__(self, attention: str | None, reentrant: bool) -> None:
        super().__init__()
        params = init_params(4, 2, seed=5)
        flat = {k: v for k, v in params.items() if isinstance(v, torch.Tensor)}
        for i in range(2):
            flat.update({f"block{i}_{k}": v for k, v in params[f"block{i}"].items()})
        self.p = torch.nn.ParameterDict({k: torch.nn.Parameter(v) for k, v in flat.items()})
        self.attention, self.reentrant = attention, reentrant

    def forward(self, input_ids, position_ids, segment_ids):
        params = {"embed": self.p["embed"], "head": self.p["head"]}
        for i in range(2):
            params[f"block{i}"] = {
                k.split("_", 1)[1]: v for k, v in self.p.items() if k.startswith(f"block{i}_")
            }
        if self.attention is None:
            mask = reference_mask(input_ids.shape[1], segment_ids, causal=True)
            att = lambda q, k, v: masked_attention(q, k, v, mask)  # noqa: E731
        else:
            att = functools.partial(ATTENTION[self.attention], causal=True, segment_ids=segment_ids)
        return {"logits": lm_forward(params, input_ids, position_ids, att, self.reentrant)}


def _hooks_worker(n: int) -> list:
    ps.init_mesh({"sp": n})
    batch = packed_batch(2 * n + 3, seed=11)
    inputs = {k: batch[k] for k in ("input_ids", "position_ids", "segment_ids")}
    targets = batch["shift_labels"]

    def loss_of(model):
        total, count = _sums(model(**inputs)["logits"], targets)
        return total / count

    ref = CheckpointedLM(None, False)
    ref_loss = loss_of(ref)
    ref_loss.backward()
    out = []
    for layout in ("zigzag", "stripe"):
        for attention in ATTENTION:
            for reentrant in (False, True):
                model = CheckpointedLM(attention, reentrant)
                with ps.sequence_parallel(model, axis="sp", layout=layout):
                    loss = loss_of(model)
                loss.backward()  # outside the block: recomputation finds the recorded layout
                ps.reduce_gradients(model, "sp")
                out.append(
                    {
                        "config": (layout, attention, reentrant),
                        "loss": (loss.detach(), ref_loss.detach()),
                        "grads": [
                            (p.grad, q.grad)
                            for p, q in zip(model.parameters(), ref.parameters(), strict=True)
                        ],
                    }
                )
    return out


def test_sequence_parallel_hooks_checkpointed(pool) -> None:
    for r, per_rank in enumerate(pool.run(2, _hooks_worker, 2)):
        for res in per_rank:
            msg = f"rank {r} {res['config']}"
            torch.testing.assert_close(*res["loss"], msg=msg, **TOL)
            for got, want in res["grads"]:
                torch.testing.assert_close(got, want, msg=msg, **TOL)


def _checkpointed_ring(x: torch.Tensor) -> torch.Tensor:
    attend = functools.partial(ps.ring_attention, causal=True)
    return torch.utils.checkpoint.checkpoint(attend, x, x, x, use_reentrant=False)


def _two_maps_worker(n: int, lengths: tuple[int, int]) -> Any:
    """Two checkpointed maps of different lengths differentiated in one backward pass."""
    ps.init_mesh({"sp": n})
    attend = ps.shard_map_seq(_checkpointed_ring, in_specs=ps.Shard(1), out_specs=ps.Shard(1))
    xs = [
        torch.linspace(-1, 1, s * 4, dtype=torch.float64).view(1, s, 2, 2).requires_grad_(True)
        for s in lengths
    ]
    try:
        sum((attend(x) ** 2).sum() for x in xs).backward()
    except RuntimeError as e:
        return str(e)
    return [x.grad for x in xs]


def test_two_maps_in_one_backward_pass(pool) -> None:
    """Told apart by their local lengths; refused, never guessed, when those are equal too."""
    for grads in pool.run(2, _two_maps_worker, 2, (5, 9)):
        for s, g in zip((5, 9), grads, strict=True):
            x = torch.linspace(-1, 1, s * 4, dtype=torch.float64).view(1, s, 2, 2)
            x.requires_grad_(True)
            (full_causal(x) ** 2).sum().backward()
            torch.testing.assert_close(g, x.grad, **TOL)
    for message in pool.run(2, _two_maps_worker, 2, (7, 8)):
        assert message.startswith(
            "pshard: a function is being recomputed in the backward pass (activation "
            "checkpointing) while 2 different sequence layouts of axis ('sp',) are being "
            "differentiated in it (contiguous layout of 8 tokens, contiguous layout of 7 tokens)"
        ), message


def full_causal(x: torch.Tensor) -> torch.Tensor:
    return masked_attention(x, x, x, reference_mask(x.shape[1], causal=True))


# --------------------------------------------------------------------------- errors


def test_errors() -> None:
    ps.init_mesh({"sp": 1})
    q = torch.randn(2, 5, 4, 3)
    for fn in ATTENTION.values():
        name = fn.__name__
        with pytest.raises(
            ValueError,
            match=re.escape(
                f"{name}: segment_ids has shape (2, 4) but q has shape (2, 5, 4, 3) (seq_dim=1, "
                f"head_dim=2), so segment_ids must be (2, 5): this rank's tokens"
            ),
        ):
            fn(q, q, q, segment_ids=torch.zeros(2, 4, dtype=torch.int64))
        with pytest.raises(TypeError, match=re.escape(f"{name}: segment_ids must be an integer")):
            fn(q, q, q, segment_ids=torch.zeros(2, 5))
        with pytest.raises(ValueError, match=re.escape(f"{name}: window=0 must be >= 1")):
            fn(q, q, q, window=0)
        ints = q.long()
        with pytest.raises(TypeError, match=re.escape(f"{name}: q, k, v must have one floating")):
            fn(ints, ints, ints)

    def no_mask(q, k, v, is_causal=False, scale=None, enable_gqa=False):
        return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale)

    for kwargs, given in (
        ({"window": 2}, "window"),
        ({"segment_ids": torch.zeros(2, 5, dtype=torch.int64)}, "segment_ids"),
        (
            {"window": 2, "segment_ids": torch.zeros(2, 5, dtype=torch.int64)},
            "segment_ids and window",
        ),
    ):
        with pytest.raises(
            ValueError,
            match=re.escape(
                f"ulysses_attention: {given} needs a mask, but attn_fn 'no_mask' takes no "
                f"attn_mask argument"
            ),
        ):
            ps.ulysses_attention(q, q, q, attn_fn=no_mask, **kwargs)
    # an attn_fn that takes the mask gets it (here: it equals the default)
    with_mask = functools.partial(F.scaled_dot_product_attention)
    seg = torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, -1, -1]])
    torch.testing.assert_close(
        ps.ulysses_attention(q, q, q, segment_ids=seg, attn_fn=with_mask, causal=True),
        ps.ring_attention(q, q, q, segment_ids=seg, causal=True),
    )


def test_prepare_lm_batch_segments() -> None:
    batch = ps.prepare_lm_batch(
        {
            "input_ids": torch.tensor([[5, 6, 7, 8, 9, 4], [0, 0, 3, 4, 5, 6]]),
            "attention_mask": torch.tensor([[1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1]]),
            "position_ids": torch.tensor([[0, 1, 2, 0, 1, 0], [1, 1, 0, 1, 2, 3]]),
        }
    )
    assert batch["segment_ids"].tolist() == [[0, 0, 0, 1, 1, 2], [-1, -1, 1, 1, 1, 1]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0], [1, 1, 0, 1, 2, 3]]
    right = ps.prepare_lm_batch(
        {"input_ids": torch.tensor([[5, 6, 0]]), "attention_mask": torch.tensor([[1, 1, 0]])}
    )
    assert right["segment_ids"].tolist() == [[0, 0, -1]]
    plain = ps.prepare_lm_batch({"input_ids": torch.tensor([[5, 6, 7]])})
    assert "segment_ids" not in plain  # nothing to mask: plain causal attention
    given = torch.tensor([[3, 3, 4]])
    kept = ps.prepare_lm_batch(
        {"input_ids": torch.tensor([[5, 6, 7]]), "segment_ids": given, "shift_labels": given}
    )
    assert kept["segment_ids"] is given and kept["shift_labels"] is given
    for bad, msg in [
        (
            {"input_ids": torch.ones(2, 3, dtype=torch.int64), "attention_mask": torch.ones(3)},
            "prepare_lm_batch: batch['attention_mask'] must be a (batch, seq) = (2, 3) tensor",
        ),
        (
            {"input_ids": torch.ones(1, 3, dtype=torch.int64), "logits_to_keep": torch.ones(4)},
            "prepare_lm_batch: logits_to_keep must be an int or a boolean mask of shape (3,)",
        ),
    ]:
        with pytest.raises(ValueError, match=re.escape(msg)):
            ps.prepare_lm_batch(bad)


def test_schedule_counts_every_pair() -> None:
    for kind in LAYOUTS:
        for window in (None, 2, (1, 1)):
            for causal in (False, True):
                for c in block_counts(kind, 11, 3, causal, window=window):
                    assert isinstance(c, BlockCounts)
                    assert c.full + c.partial + c.skipped in (3, 12)


def test_docs_masks_example_runs() -> None:
    """The python block of docs/sequence.md's masks section runs and prints what it says."""
    text = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "sequence.md").read_text()
    section = text.split("## Masks", 1)[1].split("\n## ", 1)[0]
    code, printed = re.findall(r"```(?:python)?\n(.*?)```", section, re.S)[:2]
    out = io.StringIO()

    def run():
        with contextlib.redirect_stdout(out):
            exec(compile(code, "docs/sequence.md", "exec"), {"__name__": "docs_sequence"})

    contextvars.copy_context().run(run)  # the example's mesh does not outlive it
    assert out.getvalue() == printed
