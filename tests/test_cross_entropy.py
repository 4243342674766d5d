"""ps.cross_entropy against torch.nn.functional.cross_entropy on the whole logits, float64:
plain (axis=None) and with the vocabulary split over 4 ranks (uneven, one rank holding nothing),
every reduction, ignore_index, values and gradients under torch.func.grad of a shard_map and
.backward(), bfloat16 logits; bad input named."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

import pshard as ps

P = ps.P
f64 = torch.float64
REDUCTIONS = ("mean", "sum", "none")


def _data(vocab: int, dtype: torch.dtype = f64) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(vocab)
    logits = (3 * torch.randn(2, 5, vocab, generator=g, dtype=f64)).to(dtype)
    labels = torch.randint(0, vocab, (2, 5), generator=g)
    labels[0, 1] = labels[1, 4] = -100
    return logits, labels


def _reference(logits: torch.Tensor, labels: torch.Tensor, reduction: str) -> torch.Tensor:
    out = F.cross_entropy(logits.movedim(-1, 1), labels, reduction=reduction)
    return out


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_without_an_axis_it_is_torchs(reduction: str) -> None:
    logits, labels = _data(7)
    got = ps.cross_entropy(logits, labels, reduction=reduction)
    torch.testing.assert_close(got, _reference(logits, labels, reduction), rtol=1e-14, atol=0)


def _split_worker(vocab: int) -> dict:
    ps.init_mesh({"tp": 4})
    logits, labels = _data(vocab)
    weights = torch.linspace(0.5, 2.0, labels.numel(), dtype=f64).reshape(labels.shape)
    out: dict = {}
    for reduction in REDUCTIONS:

        def loss(lg: torch.Tensor, reduction: str = reduction) -> torch.Tensor:
            def body(block: torch.Tensor) -> torch.Tensor:
                got = ps.cross_entropy(block, labels, axis="tp", reduction=reduction)
                return got * weights if reduction == "none" else got

            value = ps.shard_map(body, in_specs=P(None, None, "tp"), out_specs=P())(lg)
            return value.sum()

        grad, value = torch.func.grad_and_value(loss)(logits)
        leaf = logits.clone().requires_grad_()
        loss(leaf).backward()
        out[reduction] = (value, grad, leaf.grad)
    low, low_labels = _data(vocab, torch.bfloat16)
    out["bfloat16"] = ps.shard_map(
        lambda b: ps.cross_entropy(b, low_labels, axis="tp"),
        in_specs=P(None, None, "tp"),
        out_specs=P(),
    )(low)
    return out


@pytest.mark.parametrize("vocab", [11, 5])  # blocks of 3, 3, 3, 2 and of 2, 2, 1, 0
def test_a_vocabulary_split_over_four_ranks(pool, vocab: int) -> None:
    """Every reduction's value and gradient (torch.func.grad and .backward()) equal torch's on
    the whole logits; ignored targets add nothing; uneven blocks, an empty one included."""
    logits, labels = _data(vocab)
    weights = torch.linspace(0.5, 2.0, labels.numel(), dtype=f64).reshape(labels.shape)
    for rank, out in enumerate(pool.run(4, _split_worker, vocab)):
        for reduction in REDUCTIONS:
            leaf = logits.clone().requires_grad_()
            ref = _reference(leaf, labels, reduction)
            ref = (ref * weights if reduction == "none" else ref).sum()
            ref.backward()
            value, grad, backward_grad = out[reduction]
            msg = f"rank {rank}, {reduction}"
            torch.testing.assert_close(value, ref.detach(), rtol=1e-12, atol=1e-12, msg=msg)
            torch.testing.assert_close(grad, leaf.grad, rtol=1e-12, atol=1e-12, msg=msg)
            torch.testing.assert_close(backward_grad, leaf.grad, rtol=1e-12, atol=1e-12, msg=msg)
            assert grad[0, 1].abs().max() == 0 and grad[1, 4].abs().max() == 0  # ignored
        low, low_labels = _data(vocab, torch.bfloat16)
        want = F.cross_entropy(low.float().movedim(-1, 1), low_labels).to(torch.bfloat16)
        assert out["bfloat16"].dtype == torch.bfloat16
        torch.testing.assert_close(out["bfloat16"], want, rtol=0, atol=0)


def test_bad_input_is_named() -> None:
    ps.init_mesh({"tp": 1})
    logits, labels = _data(7)
    with pytest.raises(ValueError, match=re.escape("labels must have shape logits.shape[:-1]")):
        ps.cross_entropy(logits, labels[:, :3], axis="tp")
    with pytest.raises(TypeError, match="labels must be an integer tensor"):
        ps.cross_entropy(logits, labels.double())
    with pytest.raises(ValueError, match="reduction must be one of"):
        ps.cross_entropy(logits, labels, reduction="avg")  # type: ignore[arg-type]
    bad = labels.clone()
    bad[0, 0] = 7
    with pytest.raises(ValueError, match=re.escape("labels [7] are outside the vocabulary [0, 7)")):
        ps.cross_entropy(logits, bad, axis="tp")
