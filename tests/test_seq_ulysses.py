"""ulysses_attention against single-process attention over the whole sequence, under every
layout, lengths not divisible by the axis size, GQA (KV heads replicated when fewer than the
ranks), causal or not, gradients of q, k and v included.

The sequence context is entered directly here (as shard_map_seq does), so these tests pin the
attention alone; the LM tests check it inside shard_map_seq."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from helpers import full_attention, seq_block

import pshard as ps
from pshard.sequence._context import SeqContext, sequence_context
from pshard.sequence._layouts import LAYOUTS, SeqLayout, unpermute_unpad

B, D = 2, 3


def _configs(n: int) -> list[tuple[str, int, int, int, bool]]:
    """(layout, seq_len, query heads, kv heads, causal)."""
    out = []
    for kind in LAYOUTS:
        for s in (2 * n + 1, n - 1):
            for hq, hkv in ((n, n), (2 * n, n // 2 or 1), (n, 1)):
                for causal in (False, True):
                    out.append((kind, s, hq, hkv, causal))
    return out


def _worker(n: int, data: list) -> list:
    ps.init_mesh({"sp": n})
    r = ps.axis_index("sp")
    out = []
    for (kind, s, _, _, causal), (q, k, v, c) in zip(_configs(n), data, strict=True):
        lay = SeqLayout(kind, s, n)
        local = [seq_block(t, lay, r).requires_grad_(True) for t in (q, k, v)]
        with sequence_context(SeqContext(("sp",), lay, r, torch.device("cpu"))):
            y = ps.ulysses_attention(*local, axis="sp", causal=causal)
        grads = torch.autograd.grad((y * seq_block(c, lay, r)).sum(), local)
        out.append((y.detach(), grads))
    return out


@pytest.mark.parametrize("n", [2, 4])
def test_against_full_attention(pool, n: int) -> None:
    torch.manual_seed(n)
    data = []
    for _, s, hq, hkv, _ in _configs(n):
        q = torch.randn(B, s, hq, D, dtype=torch.float64)
        k = torch.randn(B, s, hkv, D, dtype=torch.float64)
        v = torch.randn(B, s, hkv, D + 1, dtype=torch.float64)  # another head size for v
        c = torch.randn(B, s, hq, D + 1, dtype=torch.float64)
        data.append((q, k, v, c))
    got = pool.run(n, _worker, n, data)
    for i, ((kind, s, hq, hkv, causal), (q, k, v, c)) in enumerate(
        zip(_configs(n), data, strict=True)
    ):
        lay = SeqLayout(kind, s, n)
        inputs = [t.clone().requires_grad_(True) for t in (q, k, v)]
        ref = full_attention(*inputs, causal)
        grads = torch.autograd.grad((ref * c).sum(), inputs)
        outs = torch.cat([got[r][i][0] for r in range(n)], 1)
        case = (kind, s, hq, hkv, causal)
        torch.testing.assert_close(unpermute_unpad(outs, 1, lay), ref.detach(), msg=str(case))
        pads = torch.tensor([p for r in range(n) for p in lay.is_pad(r)])
        assert torch.all(outs[:, pads] == 0), case  # padding tokens get zeros
        for j, name in enumerate("qkv"):
            local = torch.cat([got[r][i][1][j] for r in range(n)], 1)
            torch.testing.assert_close(
                unpermute_unpad(local, 1, lay), grads[j], msg=f"{case} d{name}"
            )
            assert torch.all(local[:, pads] == 0), (case, name)


def _layouts_worker() -> dict:
    """Other dims (batch, heads, seq, size), no context (contiguous), flex_attention."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    ps.init_mesh({"sp": 2})
    r = ps.axis_index("sp")
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(3, 2, 4, 6, 5, generator=g).unbind(0)  # (B, H, S, D), S = 6
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3)
    mine = slice(3 * r, 3 * r + 3)
    y = ps.ulysses_attention(
        q[:, :, mine], k[:, :, mine], v[:, :, mine], causal=True, seq_dim=2, head_dim=1, scale=0.3
    )

    def flex(q, k, v, *, is_causal, scale, enable_gqa):
        s = q.shape[-2]
        mask = create_block_mask(lambda b, h, i, j: j <= i, None, None, s, s, device="cpu")
        return flex_attention(q, k, v, block_mask=mask, scale=scale, enable_gqa=enable_gqa)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # flex_attention without torch.compile warns
        z = ps.ulysses_attention(
            q[:, :, mine],
            k[:, :, mine],
            v[:, :, mine],
            causal=True,
            attn_fn=flex,
            seq_dim=-2,
            head_dim=-3,
            scale=0.3,
        )
    return {
        "ulysses": torch.allclose(y, ref[:, :, mine], atol=1e-6),
        "flex": torch.allclose(z, ref[:, :, mine], atol=1e-6),
    }


def test_dims_no_context_and_flex(pool) -> None:
    assert pool.run(2, _layouts_worker) == [{"ulysses": True, "flex": True}] * 2


def _errors_worker() -> dict:
    ps.init_mesh({"sp": 4})
    out = {}
    x = torch.zeros(1, 3, 4, 2)
    calls = {
        "heads": lambda: ps.ulysses_attention(torch.zeros(1, 3, 6, 2), x[:, :, :2], x[:, :, :2]),
        "gqa": lambda: ps.ulysses_attention(
            torch.zeros(1, 3, 8, 2), torch.zeros(1, 3, 3, 2), torch.zeros(1, 3, 3, 2)
        ),
        "feature": lambda: ps.ulysses_attention(x, x, x, head_dim=-1),
        "size": lambda: ps.ulysses_attention(x, torch.zeros(1, 3, 4, 3), torch.zeros(1, 3, 4, 3)),
        "length": lambda: ps.ulysses_attention(x, torch.zeros(1, 2, 4, 2), torch.zeros(1, 2, 4, 2)),
    }
    lay = SeqLayout("zigzag", 10, 4)
    with sequence_context(SeqContext(("sp",), lay, 0, torch.device("cpu"))):
        calls["context"] = lambda: ps.ulysses_attention(x, x, x)
        for name, call in calls.items():
            try:
                call()
            except ValueError as e:
                out[name] = str(e)
    return out


def test_errors(pool) -> None:
    got = pool.run(4, _errors_worker)[0]
    assert got["heads"] == (
        "ulysses_attention: q has 6 heads (head_dim=2, shape (1, 3, 6, 2)), which do not divide "
        "by the size 4 of axis 'sp'; Ulysses attention gives every rank heads / 4 query heads: "
        "use a head count divisible by 4, or a smaller axis"
    )
    assert (
        "q has 8 heads and k, v have 3 (head_dim=2); the query heads must be a multiple"
        in got["gqa"]
    )
    assert (
        "head_dim=3 names the last dim of q (shape (1, 3, 4, 2)), which is the feature"
        in got["feature"]
    )
    assert "q and k must have the same head size" in got["size"]
    assert "q and k must agree on every dim but the head dim (2) and the last" in got["length"]
    assert got["context"] == (
        "ulysses_attention: q has 3 tokens along seq_dim=1 (shape (1, 3, 4, 2)) but "
        "shard_map_seq gave this rank 4 (a sequence of 10 on 4 ranks, zigzag layout); pass this "
        "rank's tokens, with seq_dim naming their dim"
    )
    with pytest.raises(TypeError, match=re.escape("ulysses_attention: q must be a tensor")):
        ps.ulysses_attention(None, None, None)
