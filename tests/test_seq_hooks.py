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
from pshard._modules.adapter import PreparedCall, register_adapter, registered_adapters
from pshard.sequence._context import find_context
from pshard.sequence._lm import NUM_ITEMS_IN_BATCH, SHIFT_LABELS
from pshard.sequence.plug import plugged_attention, run_attention

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


# --------------------------------------------------------------------------- model adapters


def _toy_attention(q, k, v):
    """A model family's attention layer: the attention plugged for the running call, else its
    own."""
    plugged = plugged_attention(q.shape[1])
    if plugged is None:
        return full_attention(q, k, v)
    return run_attention(
        plugged, q, k, v, causal=True, window=None, scale=None, seq_dim=1, head_dim=2
    )


class ToyLM(TinyLM):
    """A model family an adapter knows: attention swapped by the adapter, loss computed inside
    from ``shift_labels``."""


class _ToyAdapter:
    """A model adapter written against the protocol alone (as an integration would be)."""

    name = "toy (tests)"
    interface = "a ToyLM's attention"

    def matches(self, model) -> bool:
        return isinstance(model, ToyLM)

    def attention_name(self, model) -> str:
        return "plugged" if model.attention is _toy_attention else "own"

    def plug(self, model):
        model.attention = _toy_attention
        return lambda: setattr(model, "attention", full_attention)

    def use_attention(self, model, name: str):
        if self.attention_name(model) == name:
            return None
        model.attention = _toy_attention if name == "plugged" else full_attention
        return lambda: setattr(model, "attention", full_attention)

    def prepare(self, model, kwargs, accepts, length) -> PreparedCall:
        kwargs = dict(kwargs)
        labels = kwargs.get(SHIFT_LABELS)
        if labels is None:
            return PreparedCall(kwargs)
        if kwargs.get(NUM_ITEMS_IN_BATCH) is None:  # the whole batch's count
            kwargs[NUM_ITEMS_IN_BATCH] = (labels != -100).sum()
        return PreparedCall(kwargs, None, loss_share=True)

    def sum_loss(self, output, reduce):
        output["loss"] = reduce(output["loss"], "output['loss']")
        return output


register_adapter(_ToyAdapter())


def _adapter_worker(n: int, attention: str) -> dict:
    ps.init_mesh({"sp": n})
    batch = make_batch(2, 2 * n + 3, seed=5)
    ids, labels = batch["input_ids"], batch["shift_labels"]
    plain, model = TinyLM(4, 2, seed=2), ToyLM(4, 2, seed=2)
    ref = plain(ids, shift_labels=labels)
    ref.loss.backward()
    with ps.sequence_parallel(model, layout="zigzag", attention=attention):
        got = model(ids, shift_labels=labels)
        inside = model.attention is _toy_attention
    got.loss.backward()
    ps.reduce_gradients(model, "sp")
    return {
        "logits": (got.logits.detach(), ref.logits.detach()),
        "loss": (got.loss.detach(), ref.loss.detach()),
        "grads": (_grads(model), _grads(plain)),
        "plugged": inside,
        "restored": model.attention is full_attention and not model._forward_pre_hooks,
    }


@pytest.mark.parametrize("attention", ["ulysses", "ring"])
def test_a_model_adapter_plugs_into_sequence_parallel(pool, attention: str) -> None:
    """A model family described by an adapter written against pshard._modules.adapter alone:
    its attention is swapped for the block, its loss shares are summed, and the model equals
    the plain one (logits, loss, gradients after reduce_gradients); restored on exit."""
    assert any(a.name == "toy (tests)" for a in registered_adapters())
    for r, out in enumerate(pool.run(2, _adapter_worker, 2, attention)):
        msg = f"rank {r}"
        torch.testing.assert_close(*out["logits"], msg=msg, **TOL)
        torch.testing.assert_close(*out["loss"], msg=msg, **TOL)
        for a, b in zip(*out["grads"], strict=True):
            torch.testing.assert_close(a, b, msg=msg, **TOL)
        assert out["plugged"] and out["restored"], msg


def test_the_sequence_package_imports_no_integration() -> None:
    """The core defines the adapter protocol; integrations implement it: nothing under
    pshard/sequence or pshard/_modules imports pshard.integrations (not even lazily), and the
    transformers integration registers its adapter without importing transformers (optional)."""
    import ast
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(ps.__file__).parent
    for path in sorted([*(root / "sequence").glob("*.py"), *(root / "_modules").glob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                target = "." * node.level + (node.module or "")
            elif isinstance(node, ast.Import):
                target = ",".join(a.name for a in node.names)
            else:
                continue
            assert "integrations" not in target, (path.name, node.lineno, target)
    code = (
        "import sys; sys.modules['transformers'] = None\n"
        "import pshard.integrations.transformers\n"
        "from pshard._modules.adapter import registered_adapters\n"
        "assert 'transformers' in [a.name for a in registered_adapters()]\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)
