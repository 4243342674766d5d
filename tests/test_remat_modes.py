"""ps.checkpoint under the global modes of torch: autocast and the default dtype.

Oracles: ``torch.utils.checkpoint`` on the same program under ``.backward()`` (it restores the
forward's autocast state for its recompute), and the function without a checkpoint under the
same ``torch.func`` transform; both compared bit for bit (float32 under bfloat16 autocast).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as tuc
from torch.func import functional_call, grad, jvp, vjp

from pshard._remat.checkpoint import checkpoint

pytestmark = pytest.mark.filterwarnings(
    "ignore:`torch.jit.script` is deprecated:DeprecationWarning"
)


class Layer(torch.nn.Module):
    """A pre-norm residual feed-forward layer: ``F.linear`` is a composite that autocast casts
    whole outside ``torch.func`` and after its decomposition inside."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.up = torch.nn.Linear(width, 2 * width)
        self.down = torch.nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


def _model(depth: int = 3) -> torch.nn.ModuleList:
    torch.manual_seed(0)
    return torch.nn.ModuleList(Layer() for _ in range(depth))


def _forward(model: torch.nn.ModuleList, wrap: Callable[[Any], Any], x: torch.Tensor) -> Any:
    for layer in model:
        x = wrap(layer)(x)
    return x.float().square().mean()


def _torch_checkpoint(layer: Any) -> Any:
    return functools.partial(tuc.checkpoint, layer, use_reentrant=False)


def _amp_step(wrap: Callable[[Any], Any], dtype: torch.dtype, backward_dtype: Any = None) -> list:
    """The usual mixed-precision step: the forward in autocast, ``.backward()`` outside it (or
    inside another autocast, ``backward_dtype``)."""
    model = _model()
    x = torch.randn(4, 8)
    with torch.autocast("cpu", dtype=dtype):
        loss = _forward(model, wrap, x)
    if backward_dtype is None:
        loss.backward()
    else:
        with torch.autocast("cpu", dtype=backward_dtype, cache_enabled=False):
            loss.backward()
    return [loss.detach(), *(p.grad for p in model.parameters())]


def _equal(a: list, b: list) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.dtype == y.dtype and torch.equal(x, y), (x - y).abs().max()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_amp_loop_matches_torch_utils_checkpoint(dtype: torch.dtype) -> None:
    """Forward in autocast, backward outside: the recompute runs in the forward's autocast."""
    want = _amp_step(_torch_checkpoint, dtype)
    _equal(_amp_step(checkpoint, dtype), want)
    _equal(_amp_step(lambda layer: layer, dtype), want)
    assert not torch.is_autocast_enabled("cpu")  # the backward's state is put back


def test_the_recompute_takes_the_forwards_autocast_not_the_backwards() -> None:
    want = _amp_step(_torch_checkpoint, torch.bfloat16, backward_dtype=torch.float16)
    _equal(_amp_step(checkpoint, torch.bfloat16, backward_dtype=torch.float16), want)


def _transform_step(transform: str, wrap: Callable[[Any], Any]) -> list:
    model = _model()
    params = {k: v.detach() for k, v in model.named_parameters()}
    x = torch.randn(4, 8)

    def loss(p: dict, x: torch.Tensor) -> torch.Tensor:
        return functional_call(model, p, (x,), {}, strict=False)

    model.forward = lambda x: _forward(model, wrap, x)  # type: ignore[method-assign]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        if transform == "grad":
            return list(grad(loss, (0, 1))(params, x)[0].values())
        if transform == "vjp":  # the pull-back called after autocast exited, as .backward() is
            value, pull = vjp(loss, params, x)
        if transform == "jvp":
            tangents = {k: torch.ones_like(v) for k, v in params.items()}
            return list(jvp(lambda p: loss(p, x), (params,), (tangents,)))
    ps, gx = pull(torch.ones_like(value))
    return [value, gx, *ps.values()]


@pytest.mark.parametrize("transform", ["grad", "vjp", "jvp"])
def test_autocast_under_torch_func_matches_the_function(transform: str) -> None:
    _equal(_transform_step(transform, checkpoint), _transform_step(transform, lambda m: m))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_amp_loop_matches_torch_utils_checkpoint() -> None:
    def step(wrap: Callable[[Any], Any]) -> list:
        model = _model().cuda()
        x = torch.randn(4, 8, device="cuda")
        with torch.autocast("cuda", dtype=torch.float16):
            loss = _forward(model, wrap, x)
        loss.backward()
        return [loss.detach(), *(p.grad for p in model.parameters())]

    _equal(step(checkpoint), step(_torch_checkpoint))


def test_a_default_dtype_changed_before_the_backward_is_named() -> None:
    """The default dtype is not set back for the recompute (a program sets it once): changed
    between the forward and the backward it is an error naming it, under .backward() and
    torch.func.grad, whether or not the recompute would take another path (it said 'took
    another path than its forward ... aten.mul.Tensor' first)."""

    @checkpoint
    def scaled(w: torch.Tensor) -> torch.Tensor:
        return w * torch.tensor(1.5)  # a new tensor in the default dtype

    @checkpoint
    def same(w: torch.Tensor) -> torch.Tensor:
        return torch.sin(w) * 2

    named = (
        "cannot be recomputed as its forward ran: the default dtype was float32 in the "
        "forward and is float64 in the recompute (torch.set_default_dtype between the forward "
        "and the backward; keep it as the forward had it until the backward is done)"
    )
    dtype = torch.get_default_dtype()

    def under_grad(f: Any, w: torch.Tensor) -> None:
        def loss(w: torch.Tensor) -> torch.Tensor:
            y = f(w).sum()
            torch.set_default_dtype(torch.float64)
            return y

        torch.func.grad(loss)(w)

    def under_backward(f: Any, w: torch.Tensor) -> None:
        loss = f(w.requires_grad_()).sum()
        torch.set_default_dtype(torch.float64)
        loss.backward()

    for f in (scaled, same):
        for run in (under_grad, under_backward):
            try:
                with pytest.raises(ValueError, match=re.escape(f"{f.__name__} {named}")):
                    run(f, torch.randn(3))
            finally:
                torch.set_default_dtype(dtype)


def test_saved_tensor_hooks_are_refused_in_the_forward() -> None:
    """torch.func refuses saved-tensor hooks; the forward, which runs in a torch.func level as
    the recompute does, says so where they are (it raised in the backward, with torch's text)."""
    w, x = torch.randn(3, 3, requires_grad=True), torch.randn(2, 3)
    text = (
        "<lambda> runs its forward and its recompute inside a torch.func level, which does not "
        "support saved tensor hooks (torch.autograd.graph.saved_tensors_hooks, save_on_cpu)"
    )
    with torch.autograd.graph.save_on_cpu(), pytest.raises(RuntimeError, match=re.escape(text)):
        checkpoint(lambda w, x: torch.tanh(x @ w))(w, x)
