"""Fused attention kernels for one ring block, returning the log-sum-exp the online merge needs.

A :class:`BlockKernel` computes softmax attention of ``(B, H, M, W)`` queries against
``(B, H, N, W)`` keys and values (one width ``W`` for all three: the ring zero-pads the narrower
head size) and returns the output with its log-sum-exp ``(B, H, M)``; its backward takes the
*whole* softmax's output rows and log-sum-exp (merged over the ring), so each block's gradient
is exact. :func:`block_kernel` picks one for a device and dtype, or ``None`` (explicit matmuls):

- CPU: ``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward. Additive masks,
  float32 and float64, any strides but the head size's.
- CUDA: ``aten._scaled_dot_product_efficient_attention`` and its backward, float32 here (the
  ring computes its blocks in fp32): full blocks, causal triangles (square, so top-left and
  bottom-right alignment agree) and masked blocks (padding, packed documents, windows) through
  the kernel's additive bias. What the adapter relies on, from the kernel's sources: the
  log-sum-exp comes back padded to a multiple of 32 rows on CUDA builds, unpadded on ROCm ones
  (only the first ``M`` mean anything); the backward reads ``out`` as rows of heads,
  ``(B, M, H, W)`` dense (its row stride is not passed: it is ``H * W``), and the log-sum-exp
  with a unit stride along rows; without dropout the seed tensors are not read; the head size,
  strides and offset must be multiples of the kernel's alignment (the ring pads the width to 8
  and copies other views); the bias is ``(B, H, M, N)`` in q's dtype, any strides whose
  batch, head and row ones are multiples of the alignment (zero ones broadcast).

What either kernel gives for a row whose mask is ``-inf`` throughout (a query that sees no key
in the block) is not part of its contract, so the ring sets such rows' output to 0 and their
log-sum-exp to ``-inf`` itself; the backward gets the merged log-sum-exp, finite (0 for a row
that sees nothing at all), so those rows' probabilities are 0 and they give no gradient.

Conventions a kernel does not document can change between releases, and a wrong one gives a
wrong number without an error. So the CUDA kernel is first run once per device, dtype and width
(:func:`verified`) on a small problem of the shapes and strides the ring passes, against
explicit matmuls in float64; if it disagrees, a warning says so and that device keeps explicit
matmuls. While compiling or capturing a CUDA graph the check cannot run: explicit matmuls
there.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable
from typing import Any

import torch

from .._compat import aten_op
from .._core.caches import cached

__all__ = [
    "CPU",
    "CUDA",
    "BlockKernel",
    "additive",
    "block_kernel",
    "efficient_kernel",
    "finite",
    "flash_kernel",
    "verified",
]

Forward = Callable[..., tuple[torch.Tensor, torch.Tensor]]
Backward = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


@dataclasses.dataclass(frozen=True)
class BlockKernel:
    """``forward(q, k, v, mask, causal, scale) -> (out, lse)`` and ``backward(do, q, k, v, out,
    lse, mask, causal, scale) -> (dq, dk, dv)`` on 4-d tensors (``mask``: additive ``(B | 1, 1,
    M, N)`` or ``None``; ``causal``: row ``a`` sees keys ``<= a``, square blocks only). The
    forward's rows that see no key may hold anything (see the module's notes)."""

    name: str
    forward: Forward
    backward: Backward
    masks: bool  # takes an additive mask (else masked blocks use explicit matmuls)
    cut: bool  # causal blocks are cut in halves first (the kernel skips only tiles of its size)
    align: int  # the width is padded to a multiple of this


def additive(seen: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask (True: the key is seen) as an additive one: 0 and ``-inf``."""
    return torch.zeros(seen.shape, dtype=dtype, device=seen.device).masked_fill_(~seen, -math.inf)


def finite(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` with ``-inf`` (rows that see no key) as 0, so ``exp(-inf - 0) = 0``."""
    return torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)


# --------------------------------------------------------------------------- CPU


_CPU = aten_op("_scaled_dot_product_flash_attention_for_cpu")
_CPU_BACKWARD = aten_op("_scaled_dot_product_flash_attention_for_cpu_backward")


def flash_kernel(forward_op: Callable[..., Any], backward_op: Callable[..., Any]) -> BlockKernel:
    """The block kernel on ``aten._scaled_dot_product_flash_attention_for_cpu``-like ops."""

    def forward(q, k, v, mask, causal: bool, scale: float):
        return forward_op(q, k, v, 0.0, causal, attn_mask=mask, scale=scale)

    def backward(do, q, k, v, out, lse, mask, causal: bool, scale: float):
        return backward_op(do, q, k, v, out, lse, 0.0, causal, attn_mask=mask, scale=scale)

    return BlockKernel("flash (cpu)", forward, backward, masks=True, cut=True, align=1)


CPU = flash_kernel(_CPU, _CPU_BACKWARD) if _CPU is not None and _CPU_BACKWARD is not None else None


# --------------------------------------------------------------------------- CUDA

_LSE_ROWS = 32  # the efficient kernel's log-sum-exp is padded to a multiple of this many rows
_BIAS_ALIGN = 16  # the bias's row stride, a multiple of the kernel's alignment for every dtype


def _bias(mask: torch.Tensor, batch: int, heads: int) -> torch.Tensor:
    """The additive mask ``(B | 1, 1, M, N)`` as the kernel's bias: in a buffer whose row
    stride is a multiple of the alignment, expanded to ``(B, H, M, N)`` (no copy)."""
    bm, _, m, n = mask.shape
    buf = mask.new_empty(bm, 1, m, -(-n // _BIAS_ALIGN) * _BIAS_ALIGN)[..., :n]
    buf.copy_(mask)
    return buf.expand(batch, heads, m, n)


def efficient_kernel(
    forward_op: Callable[..., Any], backward_op: Callable[..., Any]
) -> BlockKernel:
    """The block kernel on ``aten._scaled_dot_product_efficient_attention``-like ops (tests
    pass stand-ins that read memory the way the CUDA kernel does)."""

    def forward(q, k, v, mask, causal: bool, scale: float):
        bias = None if mask is None else _bias(mask, q.shape[0], q.shape[1])
        out, lse, _, _ = forward_op(q, k, v, bias, True, 0.0, causal, scale=scale)
        return out, lse[..., : q.shape[-2]]

    def backward(do, q, k, v, out, lse, mask, causal: bool, scale: float):
        b, h, m, _ = out.shape
        bias = None if mask is None else _bias(mask, b, h)
        rows = out.transpose(1, 2).contiguous().transpose(1, 2)  # (B, M, H, W) dense in memory
        # padded as the forward gives it (ROCm's kernels take it unpadded)
        padded = lse.new_zeros(b, h, m if torch.version.hip else -(-m // _LSE_ROWS) * _LSE_ROWS)
        padded[..., :m] = lse
        seed = torch.zeros((), dtype=torch.long, device=q.device)  # unread without dropout
        dq, dk, dv, _ = backward_op(
            do, q, k, v, bias, rows, padded, seed, seed, 0.0, [True, True, True, False], causal,
            scale=scale,
        )  # fmt: skip
        return dq, dk, dv

    return BlockKernel("efficient (cuda)", forward, backward, masks=True, cut=False, align=8)


_EFFICIENT = aten_op("_scaled_dot_product_efficient_attention")
_EFFICIENT_BACKWARD = aten_op("_scaled_dot_product_efficient_attention_backward")
CUDA = (
    efficient_kernel(_EFFICIENT, _EFFICIENT_BACKWARD)
    if _EFFICIENT is not None and _EFFICIENT_BACKWARD is not None
    else None
)


# --------------------------------------------------------------------------- selection


def block_kernel(device: torch.device, dtype: torch.dtype, width: int) -> BlockKernel | None:
    """The fused kernel for blocks of ``dtype`` (the ring's accumulation dtype) and head size
    ``width`` on ``device``, or ``None`` for explicit matmuls."""
    if device.type == "cpu":
        return CPU
    if device.type == "cuda" and CUDA is not None and dtype == torch.float32:
        return CUDA if _checked(CUDA, device, dtype, width) else None
    return None


def _checked(kernel: BlockKernel, device: torch.device, dtype: torch.dtype, width: int) -> bool:
    """:func:`verified`; ``False`` while compiling or capturing a CUDA graph (the check cannot
    run there: explicit matmuls)."""
    if torch.compiler.is_compiling() or (
        device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    ):
        return False
    return verified(kernel, device, dtype, width)


@cached("fused attention kernel checks", 256)
def verified(kernel: BlockKernel, device: torch.device, dtype: torch.dtype, width: int) -> bool:
    """Whether ``kernel`` gives the explicit matmuls' output, log-sum-exp and gradients (from a
    merged output and log-sum-exp laid out as the ring lays them out) on a small problem on
    ``device`` in ``dtype``: full and causal blocks, row counts that are no multiple of 32,
    strided rows. Run once per arguments (a memo); a failure warns once."""
    ok = _agrees(kernel, device, dtype, width)
    if not ok:
        warnings.warn(
            f"pshard: the fused attention kernel {kernel.name!r} disagrees with explicit "
            f"matmuls on {device} ({dtype}, head size {width}); ring attention computes its "
            "blocks with explicit matmuls there (exact, slower). Please report this with your "
            "torch version.",
            RuntimeWarning,
            stacklevel=2,
        )
    return ok


def _agrees(kernel: BlockKernel, device: torch.device, dtype: torch.dtype, width: int) -> bool:
    width = -(-width // kernel.align) * kernel.align  # as the ring pads it
    gen = torch.Generator(device=device).manual_seed(0)
    scale = 1.0 / math.sqrt(width)
    b, h, m, n = 2, 3, 37, 45
    for causal, keys, seen in _problems(kernel, gen, device, b, m, n):

        def rows(count: int) -> torch.Tensor:  # a row slice of a larger tensor, as the ring's
            x = torch.randn(b, h, count + 3, width, generator=gen, device=device)
            return x.to(torch.float64)[..., 3:, :]

        q, k, v, do = rows(m), rows(keys), rows(keys), rows(m)
        want = list(_explicit(q, k, v, do, scale, causal=causal, seen=seen))
        mask = None if seen is None else additive(seen, dtype)
        try:
            out, lse = kernel.forward(q.to(dtype), k.to(dtype), v.to(dtype), mask, causal, scale)
            # as the ring does: rows that see no key 0 (log-sum-exp -inf, handed back as 0);
            # the merged output and log-sum-exp handed back contiguous (B, H, M, W)
            live = torch.isfinite(want[1])
            out = torch.where(live.unsqueeze(-1), out, 0.0)
            out_c, lse_c = out.contiguous(), torch.where(live, lse, 0.0).contiguous()
            grads = kernel.backward(
                do.to(dtype), q.to(dtype), k.to(dtype), v.to(dtype), out_c, lse_c, mask,
                causal, scale,
            )  # fmt: skip
        except RuntimeError:
            return False
        lse, want[1] = torch.where(live, lse, 0.0), torch.where(live, want[1], 0.0)
        for got, ref in zip((out, lse, *grads), want, strict=True):
            if got.shape != ref.shape:
                return False
            err = (got.to(torch.float64) - ref).abs().max().item()
            if not err <= 1e-2 * max(1.0, ref.abs().max().item()):  # also catches nan
                return False
    return True


def _problems(kernel: BlockKernel, gen: torch.Generator, device, b: int, m: int, n: int):
    """``(causal, keys, seen)`` of the check's blocks: a full one, a causal triangle, and with
    masks a mask per batch row (rows that see every key, some, or none) and one shared by the
    batch."""
    yield False, n, None
    yield True, m, None
    if kernel.masks:
        seen = torch.rand(b, 1, m, n, generator=gen, device=device) < 0.5
        seen[:, :, 0] = True
        seen[0, :, 1] = False
        seen[1, :, 5:7] = False
        yield False, n, seen
        yield False, n, torch.rand(1, 1, m, n, generator=gen, device=device) < 0.3


def _explicit(q, k, v, do, scale: float, *, causal: bool = False, seen=None) -> tuple:
    """Output, log-sum-exp (``-inf`` where a row sees no key, its output and gradients 0) and
    ``(dq, dk, dv)`` by the textbook formulas (no autograd, so it runs under ``inference_mode``
    and inside other functions' backward too); ``seen``: a boolean mask ``(B | 1, 1, M, N)``."""
    s = q @ k.transpose(-1, -2) * scale
    if causal:
        seen = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
    if seen is not None:
        s = s.masked_fill(~seen, -math.inf)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - finite(lse).unsqueeze(-1))
    out = p @ v
    ds = p * (do @ v.transpose(-1, -2) - (do * out).sum(-1, keepdim=True))
    return out, lse, ds @ k * scale, ds.transpose(-1, -2) @ q * scale, p.transpose(-1, -2) @ do
