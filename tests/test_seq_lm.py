"""prepare_lm_batch and token_mean_loss: labels shifted over the whole sequence (no target lost
at shard boundaries, unlike shifting each shard), logits_to_keep masks, and the global token
mean against single-process cross-entropy, on 2 and 4 ranks."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

import pshard as ps
from pshard.sequence._layouts import LAYOUTS, SeqLayout, pad_permute


def _shard(x: torch.Tensor, lay: SeqLayout, r: int, value: int) -> torch.Tensor:
    return pad_permute(x, 1, lay, value).chunk(lay.size, 1)[r] if lay.padded_length else x


def test_shift_and_defaults() -> None:
    ids = torch.tensor([[5, 6, 7, 8, 9], [1, 2, 3, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    batch = {"input_ids": ids, "attention_mask": mask, "extra": "kept"}
    out = ps.prepare_lm_batch(batch)
    assert set(batch) == {"input_ids", "attention_mask", "extra"}  # not modified
    assert out["extra"] == "kept" and out["input_ids"] is ids
    assert out["labels"].tolist() == [[5, 6, 7, 8, 9], [1, 2, 3, -100, -100]]
    assert out["shift_labels"].tolist() == [[6, 7, 8, 9, -100], [2, 3, -100, -100, -100]]
    assert out["position_ids"].tolist() == [list(range(5))] * 2
    assert out["num_items_in_batch"].item() == 4 + 2
    assert "logits_to_keep" not in out
    # given labels are kept as they are; given position ids too
    labels = torch.tensor([[-100, 6, 7, -100, 9]])
    pos = torch.tensor([[3, 4, 5, 6, 7]])
    out = ps.prepare_lm_batch({"labels": labels, "position_ids": pos}, ignore_index=-1)
    assert out["labels"] is labels and out["position_ids"] is pos
    assert out["shift_labels"].tolist() == [[6, 7, -100, 9, -1]]
    assert out["num_items_in_batch"].item() == 4  # -100 is a target when ignore_index=-1
    # an empty sequence
    out = ps.prepare_lm_batch({"input_ids": torch.zeros(2, 0, dtype=torch.long)})
    assert out["shift_labels"].shape == (2, 0) and out["num_items_in_batch"].item() == 0


def test_logits_to_keep() -> None:
    ids = torch.arange(6).view(1, 6)
    for k, want in [(2, [0, 0, 0, 0, 1, 1]), (0, [1] * 6), (9, [1] * 6), (1, [0] * 5 + [1])]:
        out = ps.prepare_lm_batch({"input_ids": ids}, logits_to_keep=k)
        assert out["logits_to_keep"].tolist() == [bool(w) for w in want]
        # only targets at kept positions count; the last position never has a target
        assert out["num_items_in_batch"].item() == sum(want[:5])
    out = ps.prepare_lm_batch({"input_ids": ids, "logits_to_keep": 3})
    assert out["logits_to_keep"].tolist() == [False] * 3 + [True] * 3
    given = torch.tensor([True, False, True, False, True, False])
    out = ps.prepare_lm_batch({"input_ids": ids, "logits_to_keep": given})
    assert out["logits_to_keep"] is given and out["num_items_in_batch"].item() == 3
    # split contiguously, the whole-sequence mask gives each rank the mask of its own chunk,
    # which is what a per-rank computation of "the last k tokens" gives
    s, n, k = 12, 4, 5
    mask = ps.prepare_lm_batch({"input_ids": torch.zeros(1, s, dtype=torch.long)}, logits_to_keep=k)
    for r, chunk in enumerate(mask["logits_to_keep"].chunk(n)):
        first = r * (s // n)
        assert chunk.tolist() == [first + i >= s - k for i in range(s // n)]


def test_no_target_lost_at_shard_boundaries() -> None:
    """pshard shifts before sharding: every position keeps its target under every layout. The
    common bug (each rank shifting its own shard) loses one target per shard boundary."""
    for kind in LAYOUTS:
        for n in (2, 3, 4):
            for s in (5, 8, 13):
                labels = torch.arange(100, 100 + s).view(1, s)
                batch = ps.prepare_lm_batch({"input_ids": labels})
                lay = SeqLayout(kind, s, n)
                pairs = set()
                for r in range(n):
                    pos = _shard(batch["position_ids"], lay, r, 0)[0].tolist()
                    tgt = _shard(batch["shift_labels"], lay, r, -100)[0].tolist()
                    pairs |= {
                        (p, t)
                        for p, t, pad in zip(pos, tgt, lay.is_pad(r), strict=True)
                        if t != -100
                    }
                    assert all(t == -100 for t, pad in zip(tgt, lay.is_pad(r), strict=True) if pad)
                assert pairs == {(p, 100 + p + 1) for p in range(s - 1)}
                if kind == "contiguous":
                    # shifting each shard on its own: the last token of every shard loses its
                    # target (the first token of the next shard)
                    buggy = 0
                    for r in range(n):
                        shard = _shard(labels, lay, r, -100)
                        buggy += (shard[:, 1:] != -100).sum().item()
                    nonempty = sum(1 for r in range(n) if not all(lay.is_pad(r)))
                    assert buggy == s - nonempty < s - 1


def test_prepare_errors() -> None:
    with pytest.raises(TypeError, match=re.escape("prepare_lm_batch: batch must be a Mapping")):
        ps.prepare_lm_batch([torch.zeros(1, 2)])
    with pytest.raises(ValueError, match=re.escape("has neither 'labels' nor an 'input_ids'")):
        ps.prepare_lm_batch({"attention_mask": torch.ones(1, 2)})
    with pytest.raises(
        ValueError,
        match=re.escape(
            "prepare_lm_batch: batch['attention_mask'] must be a (batch, seq) = (1, 2) tensor "
            "like the labels, got "
        ),
    ):
        ps.prepare_lm_batch({"labels": torch.ones(1, 2), "attention_mask": torch.ones(1, 3)})
    with pytest.raises(ValueError, match=re.escape("logits_to_keep must be >= 0, got -1")):
        ps.prepare_lm_batch({"input_ids": torch.ones(1, 2, dtype=torch.long)}, logits_to_keep=-1)


# --------------------------------------------------------------------------- token_mean_loss


def _loss_worker(n: int, logits: torch.Tensor, targets: torch.Tensor) -> dict:
    ps.init_mesh({"sp": n})
    r = ps.axis_index("sp")
    out = {}
    x = logits[r].clone().requires_grad_(True)
    t = targets[r]
    total = F.cross_entropy(x, t, reduction="sum", ignore_index=-100)
    loss = ps.token_mean_loss(total, (t != -100).sum(), "sp")
    (g,) = torch.autograd.grad(loss, x)
    out["loss"], out["grad"] = loss.detach(), g
    out["func_grad"] = torch.func.grad(
        lambda x: ps.token_mean_loss(
            F.cross_entropy(x, t, reduction="sum"), (t != -100).sum().item(), "sp"
        )
    )(logits[r])
    # no target on any rank: 0, finite gradients
    none = torch.full_like(t, -100)
    x = logits[r].clone().requires_grad_(True)
    empty = ps.token_mean_loss(F.cross_entropy(x, none, reduction="sum"), 0, "sp")
    empty.backward()
    out["empty"], out["empty_grad"] = empty.detach(), x.grad
    # per-row sums and counts broadcast (a vector of means)
    out["rows"] = ps.token_mean_loss(torch.tensor([1.0, 2.0]) * (r + 1), torch.tensor(2), "sp")
    return out


@pytest.mark.parametrize("n", [2, 4])
def test_token_mean_loss(pool, n: int) -> None:
    torch.manual_seed(n)
    logits = torch.randn(n, 5, 7, dtype=torch.float64)
    targets = torch.randint(0, 7, (n, 5))
    targets[1] = -100  # a rank without targets
    targets[0, :3] = -100  # and one with fewer
    got = pool.run(n, _loss_worker, n, logits, targets)
    X = logits.clone().requires_grad_(True)
    ref = F.cross_entropy(X.reshape(-1, 7), targets.reshape(-1))  # the mean over all targets
    (G,) = torch.autograd.grad(ref, X)
    for r, out in enumerate(got):
        torch.testing.assert_close(out["loss"], ref.detach(), rtol=1e-12, atol=0)
        # every rank backpropagates the same loss; psum's transpose sums the n copies (the
        # collectives' convention), so each rank's gradient is n times its part of the mean's
        torch.testing.assert_close(out["grad"], n * G[r], rtol=1e-12, atol=0)
        torch.testing.assert_close(out["func_grad"], n * G[r], rtol=1e-12, atol=0)
        assert out["empty"].item() == 0.0 and torch.equal(
            out["empty_grad"], torch.zeros(5, 7, dtype=torch.float64)
        )
        s = sum(range(1, n + 1))
        assert out["rows"].tolist() == [s / (2 * n), 2 * s / (2 * n)]


def test_token_mean_loss_errors() -> None:
    ps.init_mesh({"sp": 1})
    with pytest.raises(
        TypeError, match=re.escape("token_mean_loss: losses_sum must be a floating")
    ):
        ps.token_mean_loss(torch.tensor(3), 1, "sp")
    with pytest.raises(ValueError, match=re.escape("num_tokens (shape (3,)) does not broadcast")):
        ps.token_mean_loss(torch.zeros(2), torch.ones(3, dtype=torch.int64), "sp")


def test_token_mean_loss_edge_cases() -> None:
    ps.init_mesh({"sp": 1})
    # no token anywhere: 0 with a zero gradient, whatever the sum holds
    total = torch.tensor(3.0, requires_grad=True)
    out = ps.token_mean_loss(total, 0, "sp")
    assert out.item() == 0.0
    out.backward()
    assert total.grad.item() == 0.0
    # float16 losses with more tokens than float16 can count
    half = ps.token_mean_loss(torch.tensor(7000.0, dtype=torch.float16), 70000, "sp")
    assert half.dtype == torch.float16 and half.item() == pytest.approx(0.1, rel=1e-3)
    with pytest.raises(ValueError, match=re.escape("token_mean_loss: num_tokens must be >= 0")):
        ps.token_mean_loss(torch.tensor(3.0), -2, "sp")
    with pytest.raises(TypeError, match=re.escape("token_mean_loss: num_tokens must be an int")):
        ps.token_mean_loss(torch.tensor(3.0), 2.5, "sp")
