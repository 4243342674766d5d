"""sequence_parallel module hooks: the tiny LM as an nn.Module, run sequence-parallel through the
hooks, equals the plain module (logits, loss, parameter gradients after reduce_gradients) with
gathered outputs, with local outputs and a loss share per rank, and with logits_to_keep; hooks
and contexts are gone after the block, also when the forward raises."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from helpers import CausalLMOutputLike
from test_seq_model import forward, full_attention, init_params, make_batch, sp_attention
from torch import nn

import pshard as ps
from pshard.sequence._context import find_context

TOL = {"rtol": 1e-9, "atol": 1e-11}


class TinyLM(nn.Module):
    """The functional test model as a module with an HF-like forward."""

    def __init__(self, hq: int, hkv: int, seed: int) -> None:
        super().__init__()
        params = init_params(hq, hkv, seed)
        self.embed = nn.Parameter(params["embed"])
        self.head = nn.Parameter(params["head"])
        self.blocks = nn.ModuleList()
        for i in range(2):
            block = nn.Module()
            for name, value in params[f"block{i}"].items():
                setattr(block, name, nn.Parameter(value))
            self.blocks.append(block)
        self.attention = full_attention

    def params(self) -> dict:
        out = {"embed": self.embed, "head": self.head}
        for i, block in enumerate(self.blocks):
            out[f"block{i}"] = dict(block.named_parameters())
        return out

    def forward(
        self,
        input_ids,
        position_ids=None,
        shift_labels=None,
        num_items_in_batch=None,
        logits_to_keep=None,
    ):
        pos = torch.arange(input_ids.shape[1]) if position_ids is None else position_ids[0]
        logits = forward(self.params(), input_ids, pos, self.attention)
        if isinstance(logits_to_keep, int) and logits_to_keep:
            keep = slice(-logits_to_keep, None)
        elif isinstance(logits_to_keep, torch.Tensor):
            keep = logits_to_keep
        else:
            keep = slice(None)
        logits = logits[:, keep]
        loss = None
        if shift_labels is not None:
            targets = shift_labels[:, keep]
            total = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
            count = (targets != -100).sum() if num_items_in_batch is None else num_items_in_batch
            loss = total / count
        return CausalLMOutputLike(loss=loss, logits=logits)


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


def _hooks_worker(n: int, layout: str) -> dict:
    ps.init_mesh({"sp": n})
    out = {}
    s = 2 * n + 3
    batch = make_batch(2, s, seed=7)
    ids, labels = batch["input_ids"], batch["shift_labels"]
    items = (labels != -100).sum()
    plain, model = TinyLM(4, 2, seed=1), TinyLM(4, 2, seed=1)
    model.attention = sp_attention
    ref = plain(ids, shift_labels=labels)
    ref.loss.backward()
    out["ref"] = (ref.logits.detach(), ref.loss.detach(), _grads(plain))

    # gathered outputs: the same loss on every rank from the whole logits, positional input_ids
    with ps.sequence_parallel(model, axis="sp", layout=layout) as sp:
        got = model(ids)
        loss = F.cross_entropy(got.logits.flatten(0, 1), labels.flatten())
    loss.backward()
    sp.reduce_gradients()
    out["gathered"] = (got.logits.detach(), loss.detach(), _grads(model))

    # local outputs: each rank backpropagates its share of the loss (global token count)
    model.zero_grad(set_to_none=True)
    with ps.sequence_parallel(model, layout=layout, gather_outputs=False):
        local = model(input_ids=ids, shift_labels=labels, num_items_in_batch=items)
    local.loss.backward()
    ps.reduce_gradients(model, "sp")
    out["local"] = (
        local.logits.shape[1],
        ps.psum(local.loss.detach(), "sp"),
        _grads(model),
    )

    # logits_to_keep (an int turned into a mask over the whole sequence)
    with torch.no_grad(), ps.sequence_parallel(model, layout=layout):
        kept = model(ids, logits_to_keep=3).logits
    out["kept"] = (kept, plain(ids, logits_to_keep=3).logits.detach())

    # hooks and contexts are gone after the block, also when the forward raises
    try:
        with ps.sequence_parallel(model, layout=layout):
            model(ids, bogus=1)
    except TypeError as e:
        out["raised"] = "bogus" in str(e)
    try:
        with ps.sequence_parallel(model):
            model(shift_labels=labels)
    except ValueError as e:
        out["no_ids"] = str(e)
    out["clean"] = (
        find_context() is None
        and not model._forward_pre_hooks
        and not model._forward_hooks
        and ps.current_mesh() is not None
    )
    return out


@pytest.mark.parametrize(
    ("n", "layout"), [(2, "zigzag"), (2, "stripe"), (4, "contiguous"), (4, "zigzag")]
)
def test_hooks_match_plain_module(pool, n: int, layout: str) -> None:
    for r, out in enumerate(pool.run(n, _hooks_worker, n, layout)):
        logits, loss, grads = out["ref"]
        msg = f"rank {r}"
        g_logits, g_loss, g_grads = out["gathered"]
        torch.testing.assert_close(g_logits, logits, msg=msg, **TOL)
        torch.testing.assert_close(g_loss, loss, msg=msg, **TOL)
        for a, b in zip(g_grads, grads, strict=True):
            torch.testing.assert_close(a, b, msg=msg, **TOL)
        width, l_loss, l_grads = out["local"]
        assert width == -(-(2 * n + 3) // (2 * n if layout == "zigzag" else n)) * (
            2 if layout == "zigzag" else 1
        )
        torch.testing.assert_close(l_loss, loss, msg=msg, **TOL)
        for a, b in zip(l_grads, grads, strict=True):
            torch.testing.assert_close(a, b, msg=msg, **TOL)
        torch.testing.assert_close(*out["kept"], msg=msg, **TOL)
        assert out["raised"] and out["clean"]
        assert out["no_ids"] == (
            "sequence_parallel(TinyLM): the call has no 'input_ids' or 'inputs_embeds' tensor of "
            "shape (batch, seq, ...) to read the sequence length from (arguments: "
            "['shift_labels']); pass the sequence as input_ids= or inputs_embeds="
        )


def test_arguments() -> None:
    with pytest.raises(TypeError, match=re.escape("sequence_parallel: model must be an nn.Module")):
        ps.sequence_parallel(lambda x: x)
    with pytest.raises(ValueError, match=re.escape("sequence_parallel: layout must be one of")):
        ps.sequence_parallel(nn.Linear(1, 1), layout="ring")


# --------------------------------------------------------------------------- debug mode


def _same_model_worker(where: str, debug: bool) -> dict:
    """A rank whose model differs (``where``: a parameter, a buffer, or nowhere) under
    ``sequence_parallel`` with debug mode on or off."""
    ps.init_mesh({"sp": 2})
    model = TinyLM(4, 2, seed=1)
    model.attention = sp_attention
    model.register_buffer("scale", torch.ones(3, dtype=torch.float64))
    rank = ps.axis_index("sp")
    with torch.no_grad():
        if where == "parameter" and rank == 1:
            model.blocks[1].wk.add_(1e-3)
        if where == "buffer" and rank == 0:
            model.scale[2] = 2.0
    ids = make_batch(2, 7, seed=3)["input_ids"]
    try:
        with ps.debug(debug), ps.sequence_parallel(model, layout="zigzag"):
            logits = model(ids).logits
    except ValueError as e:
        return {"error": str(e), "clean": not model._forward_pre_hooks}
    return {"logits": logits.detach()}


def test_debug_mode_checks_the_model_is_the_same_on_every_rank(pool) -> None:
    """In debug mode, entering sequence_parallel checks that every rank of the axis holds the
    same parameters and buffers (issue 30): a rank with other weights raises on every rank,
    naming the first tensor that differs and the ranks, instead of each rank's tokens silently
    going through its own weights."""
    fix = (
        "every rank of the sequence-parallel axis must hold the same model (load, or broadcast, "
        "the same weights on every rank)"
    )
    for where, name in (("parameter", "blocks.1.wk"), ("buffer", "scale")):
        for out in pool.run(2, _same_model_worker, where, True):
            assert out["error"] == (
                f"sequence_parallel(TinyLM): debug mode: {where} {name!r} differs between the "
                f"ranks of axis 'sp'; {fix}; global ranks holding equal values: [0] vs [1]"
            )
            assert out["clean"]
    # debug mode off: no check, no error (each rank's tokens use its own weights)
    assert all("logits" in out for out in pool.run(2, _same_model_worker, "parameter", False))
    # the same model on every rank passes the check
    same = pool.run(2, _same_model_worker, "nowhere", True)
    torch.testing.assert_close(same[0]["logits"], same[1]["logits"], **TOL)
