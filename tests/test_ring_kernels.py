"""The ring's block kernels (pshard/sequence/_kernels.py).

The CUDA adapter (``aten._scaled_dot_product_efficient_attention`` and its backward) is checked
here without a GPU: against the real ops' schemas on meta tensors, and numerically against
stand-ins that read and write memory the way the CUDA kernel does (its log-sum-exp padded to 32
rows, ``out`` read as ``(B, M, H, W)`` rows whatever its strides, the log-sum-exp with a unit
row stride, a unit stride along the head size required, the bias's strides aligned, NaN for a
query that sees no key); ring attention on those stand-ins equals full attention under every
layout, padding, packed documents, windows and grouped heads. The check run before the CUDA
kernel is first used passes on the faithful stand-ins and fails, with a warning, on adapters
that get one of those conventions wrong."""

from __future__ import annotations

import math
import warnings

import pytest
import test_seq_masks
import torch
from helpers import full_attention, masked_attention, reference_mask
from test_ring_attention import _check, _data, _worker

import pshard as ps
from pshard.sequence import _kernels as kernels
from pshard.sequence import _ring_pass as ring_pass

F64 = torch.float64


def _needs(cond: bool, what: str) -> None:
    if not cond:
        raise RuntimeError(what)  # the CUDA kernel's TORCH_CHECKs raise RuntimeError too


def _reads(*ts: torch.Tensor) -> None:
    """What the kernel checks of q, k, v: a unit stride along the head size, and the head size,
    the other strides and the offset multiples of its alignment (8 elements here)."""
    for t in ts:
        _needs(t.stride(-1) == 1, "expected a unit stride along the head size")
        aligned = [t.shape[-1], t.storage_offset(), *t.stride()[:-1]]
        _needs(all(x % 8 == 0 for x in aligned), "misaligned head size, strides or offset")


def _math(q, k, v, bias, causal: bool, scale: float):
    """Scaled scores (float64) plus the bias, masked by the top-left causal mask."""
    s = (q.to(F64) @ k.to(F64).transpose(-1, -2)) * scale
    if bias is not None:
        b, h, m, n = s.shape
        _needs(bias.dtype == q.dtype and tuple(bias.shape) == (b, h, m, n), "bias: BMHK, q's dtype")
        _needs(bias.stride(-1) == 1, "bias: a unit stride along the keys")
        # the kernel's alignment for float32 (4 elements): offset, batch, head and row strides
        steps = [(bias.storage_offset(), 2), (bias.stride(0), b), (bias.stride(1), h)]
        _needs(all(x % 4 == 0 for x, size in [*steps, (bias.stride(2), m)] if size > 1), "align")
        s = s + bias.to(F64)
    if causal:
        seen = torch.ones(s.shape[-2:], dtype=torch.bool).tril()
        s = s.masked_fill(~seen, -math.inf)
    return s


def _rows_major(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` ``(B, H, M, W)`` stored as ``(B, M, H, W)`` dense: how the kernel writes tensors."""
    b, h, m, w = x.shape
    return torch.empty(b, m, h, w, dtype=dtype).transpose(1, 2).copy_(x)


def fake_efficient(q, k, v, bias, compute_log_sumexp, dropout_p=0.0, is_causal=False, *, scale):
    _needs(compute_log_sumexp and dropout_p == 0.0, "unsupported arguments")
    _reads(q, k, v)
    s = _math(q, k, v, bias, is_causal, scale)
    lse = torch.logsumexp(s, -1)
    out = torch.softmax(s, -1) @ v.to(F64)  # NaN where a row sees no key: no contract there
    b, h, m = lse.shape
    padded = torch.full((b, h, -(-m // 32) * 32), math.nan, dtype=torch.float64)
    padded[..., :m] = lse  # rows past m hold nothing meaningful
    seed = torch.zeros((), dtype=torch.long)
    return _rows_major(out, q.dtype), padded, seed, seed


def fake_efficient_backward(
    grad_out, q, k, v, bias, out, lse, seed, offset, dropout_p, grad_input_mask, is_causal=False,
    *, scale,
):  # fmt: skip
    _needs(dropout_p == 0.0 and list(grad_input_mask) == [1, 1, 1, 0], "unsupported arguments")
    _reads(q, k, v)
    b, h, m, w = q.shape[0], q.shape[1], q.shape[2], v.shape[-1]
    # the kernel's row stride of `out` is h * w (not passed); heads, batches by their strides
    o = torch.as_strided(
        out, (b, m, h, w), (out.stride(0), h * w, out.stride(1), 1), out.storage_offset()
    ).transpose(1, 2)
    ls = torch.as_strided(lse, (b, h, m), (lse.stride(0), lse.stride(1), 1), lse.storage_offset())
    p = torch.exp(_math(q, k, v, bias, is_causal, scale) - ls.to(F64).unsqueeze(-1))
    do = grad_out.to(F64)
    dv = p.transpose(-1, -2) @ do
    ds = p * (do @ v.to(F64).transpose(-1, -2) - (do * o.to(F64)).sum(-1, keepdim=True))
    dq, dk = ds @ k.to(F64) * scale, ds.transpose(-1, -2) @ q.to(F64) * scale
    return tuple(_rows_major(g, q.dtype) for g in (dq, dk, dv)) + (None,)


FAKE = kernels.efficient_kernel(fake_efficient, fake_efficient_backward)


def _explicit_block(q, k, v, do, scale: float, **kw):
    return kernels._explicit(*(t.to(F64) for t in (q, k, v, do)), scale, **kw)


def _seen(shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    """A boolean mask with rows that see every key, some, and none."""
    seen = torch.rand(shape, generator=g) < 0.4
    seen[..., 0, :] = True
    seen[..., 3, :] = False
    if shape[0] > 1:
        seen[1:, :, 4:6, :] = False
    return seen


@pytest.mark.parametrize("kind", ["full", "causal", "mask per row", "shared mask"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_adapter_on_the_stand_ins_equals_explicit_attention(kind: str, dtype) -> None:
    """Output, log-sum-exp (the padding rows cut off) and the three gradients, from a merged
    output handed back ``(B, H, M, W)``-contiguous as the ring does (which the kernel would
    misread as rows of heads without the adapter's relayout) and strided query rows. Masks of
    45 keys (a bias the kernel would refuse unless laid out with an aligned row stride) with
    rows that see no key: the stand-ins give NaN there, which the ring replaces (zeros, a
    log-sum-exp of 0 handed back), and those rows give no gradient."""
    g = torch.Generator().manual_seed(len(kind))
    causal, m = kind == "causal", 37
    n = 37 if causal else 45
    q = torch.randn(2, 3, m + 4, 16, generator=g, dtype=dtype)[..., 4:, :]
    k, v = (torch.randn(2, 3, n, 16, generator=g, dtype=dtype) for _ in range(2))
    do = torch.randn(2, 3, m, 16, generator=g, dtype=dtype)
    seen = None
    if "mask" in kind:
        seen = _seen((1 if kind == "shared mask" else 2, 1, m, n), g)
    mask = None if seen is None else kernels.additive(seen, dtype)
    out, lse = FAKE.forward(q, k, v, mask, causal, 0.3)
    assert lse.shape == (2, 3, m)
    want = list(_explicit_block(q, k, v, do, 0.3, causal=causal, seen=seen))
    live = torch.isfinite(want[1])
    assert (kind in ("full", "causal")) == bool(live.all())
    # as the ring hands them back: 0 where a row sees nothing
    out, lse = torch.where(live.unsqueeze(-1), out, 0.0), torch.where(live, lse, 0.0)
    grads = FAKE.backward(do, q, k, v, out.contiguous(), lse, mask, causal, 0.3)
    want[1] = torch.where(live, want[1], 0.0)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-10, "atol": 1e-12}
    for got, ref in zip((out, lse, *grads), want, strict=True):
        torch.testing.assert_close(got.to(F64), ref, **tol)


def test_adapter_calls_the_real_ops_with_their_schemas() -> None:
    """The CUDA kernel's adapter on meta tensors runs the real ops' meta functions: arguments
    in the schemas' order and types, shapes as the ring expects (the log-sum-exp cut to M)."""
    assert kernels.CUDA is not None  # the ops exist in every build, CPU-only ones included
    meta = {"device": "meta", "dtype": torch.float32}
    q, do = torch.empty(2, 3, 37, 16, **meta), torch.empty(2, 3, 37, 16, **meta)
    k, v = torch.empty(2, 3, 45, 16, **meta), torch.empty(2, 3, 45, 16, **meta)
    for causal in (False, True):
        kk, vv = (k, v) if not causal else (k[..., :37, :], v[..., :37, :])
        out, lse = kernels.CUDA.forward(q, kk, vv, None, causal, 0.25)
        assert out.shape == (2, 3, 37, 16) and lse.shape == (2, 3, 37)
        assert lse.dtype == torch.float32
        dq, dk, dv = kernels.CUDA.backward(do, q, kk, vv, out, lse, None, causal, 0.25)
        assert (dq.shape, dk.shape, dv.shape) == (q.shape, kk.shape, vv.shape)
    for rows in (1, 2):  # a mask shared by the batch, one per batch row
        mask = torch.empty(rows, 1, 37, 45, **meta)
        out, lse = kernels.CUDA.forward(q, k, v, mask, False, 0.25)
        assert out.shape == (2, 3, 37, 16) and lse.shape == (2, 3, 37)
        dq, dk, dv = kernels.CUDA.backward(do, q, k, v, out, lse, mask, False, 0.25)
        assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)


def _broken(kind: str) -> kernels.BlockKernel:
    """Adapters each getting one of the kernel's conventions wrong."""

    def forward(q, k, v, mask, causal, scale):
        bias = None if mask is None else kernels._bias(mask, q.shape[0], q.shape[1])
        out, lse, _, _ = fake_efficient(q, k, v, bias, True, 0.0, causal, scale=scale)
        if kind == "lse kept padded":
            return out, lse
        if kind == "lse in base 2":
            return out, lse[..., : q.shape[-2]] / math.log(2)
        return out, lse[..., : q.shape[-2]]

    def backward(do, q, k, v, out, lse, mask, causal, scale):
        seed = torch.zeros((), dtype=torch.long)
        rows = out if kind == "out as given" else out.transpose(1, 2).contiguous().transpose(1, 2)
        bias = None if mask is None else kernels._bias(mask, q.shape[0], q.shape[1])
        grads = fake_efficient_backward(
            do, q, k, v, bias, rows, lse, seed, seed, 0.0, [1, 1, 1, 0], causal, scale=scale
        )
        return grads[:3]

    return kernels.BlockKernel(kind, forward, backward, masks=True, cut=False, align=8)


@pytest.mark.parametrize("kind", ["out as given", "lse kept padded", "lse in base 2"])
def test_check_refuses_adapters_that_misread_the_kernel(kind: str) -> None:
    """Before first use the CUDA kernel is checked against explicit matmuls; an adapter that
    hands the backward ``out`` as the ring holds it (the kernel reads it as rows of heads: wrong
    gradients, or an out-of-bounds read), keeps the padded log-sum-exp rows, or reads it in
    another base fails, warns once, and the ring keeps explicit matmuls."""
    kern = _broken(kind)
    with pytest.warns(RuntimeWarning, match="disagrees with explicit matmuls"):
        assert not kernels.verified(kern, torch.device("cpu"), torch.float32, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a memo: no second warning, no second run
        assert not kernels.verified(kern, torch.device("cpu"), torch.float32, 16)


@pytest.mark.parametrize("width", [4, 16, 64])
def test_check_passes_the_faithful_stand_ins(width: int) -> None:
    """Widths that are no multiple of the alignment are padded as the ring pads them."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert kernels.verified(FAKE, torch.device("cpu"), torch.float32, width)


def test_check_runs_under_inference_mode_and_no_grad() -> None:
    """The check's reference needs no autograd: it runs where the ring's forward may run."""
    with torch.inference_mode():
        assert kernels.verified(FAKE, torch.device("cpu"), torch.float32, 24)
    with torch.no_grad():
        assert kernels.verified(FAKE, torch.device("cpu"), torch.float32, 40)


def test_cpu_blocks_use_the_cpu_kernel() -> None:
    """CPU blocks of float32 and float64 take the flash kernel, which is never checked (the
    suite checks it against full attention); meta tensors have no kernel."""
    for dtype in (torch.float32, torch.float64):
        assert kernels.block_kernel(torch.device("cpu"), dtype, 8) is kernels.CPU
    assert kernels.block_kernel(torch.device("meta"), torch.float32, 8) is None


# --------------------------------------------------------------------------- the ring on it


def _efficient_worker(n: int, data: list, worker=_worker) -> tuple[list, dict]:
    """``worker`` with every block that the CUDA kernel would take run on the stand-ins."""
    calls = {"causal": 0, "full": 0, "masked": 0}

    def counted(op):
        def run(*args, **kwargs):
            causal = args[6] if op is fake_efficient else args[11]
            calls["masked" if args[3] is not None else "causal" if causal else "full"] += 1
            return op(*args, **kwargs)

        return run

    kern = kernels.efficient_kernel(counted(fake_efficient), counted(fake_efficient_backward))
    real = ring_pass.block_kernel
    ring_pass.block_kernel = lambda device, dtype, width: kern
    try:
        return worker(n, data), calls
    finally:
        ring_pass.block_kernel = real


@pytest.mark.parametrize("n", [2, 4])
def test_ring_on_the_cuda_kernel_equals_full_attention(procs, n: int) -> None:
    """Ring attention with the CUDA kernel's adapter (on the stand-ins): full blocks and causal
    triangles on the kernel (never cut), padded blocks through its bias; forward, gradients
    and torch.func.grad equal full attention under every layout, grouped heads, another head
    size for v (both padded to the alignment)."""
    data = _data(n)
    got = procs.run(n, _efficient_worker, n, data)
    _check(n, data, [g for g, _ in got], {"rtol": 1e-9, "atol": 1e-11})
    for _, calls in got:
        assert calls["causal"] > 0 and calls["full"] > 0 and calls["masked"] > 0, calls


@pytest.mark.parametrize("n", [2, 4])
def test_masked_ring_on_the_cuda_kernel_equals_full_attention(procs, n: int) -> None:
    """Masked blocks through the kernel's bias (on the stand-ins, which give NaN for a query
    that sees no key): packed documents with padding and queries that see nothing, sliding
    windows, both, causal or not, every layout, grouped heads; forward, gradients and
    torch.func.grad equal attention over the whole sequence with the same mask."""
    data = test_seq_masks._data(n)
    got = procs.run(n, _efficient_worker, n, data, test_seq_masks._worker, timeout=300)
    test_seq_masks.check_against_full_attention(n, data, [g for g, _ in got])
    for _, calls in got:
        assert calls["masked"] > 0 and calls["full"] > 0, calls


@pytest.mark.parametrize("dv", [8, 4, 12])
@pytest.mark.parametrize("causal", [False, True])
def test_views_the_kernel_cannot_read_are_copied(causal: bool, dv: int) -> None:
    """The backward splits one buffer of keys and values: with head sizes 8 for k and 4 for v,
    k's rows are views the CUDA kernel cannot read (a row stride of 12, no multiple of its
    alignment) and go in as aligned copies (the stand-ins refuse misaligned views as the kernel
    does); with 8 for v both are aligned views, with 12 both are padded to 16. Ring attention
    on one rank equals full attention in each case."""
    ps.init_mesh({"sp": 1})
    g = torch.Generator().manual_seed(dv)
    q, k = (torch.randn(2, 11, 2, 8, generator=g, dtype=F64) for _ in range(2))
    v, c = torch.randn(2, 11, 2, dv, generator=g, dtype=F64), torch.randn(2, 11, 2, dv, dtype=F64)
    inputs = [t.requires_grad_() for t in (q, k, v)]
    real = ring_pass.block_kernel
    ring_pass.block_kernel = lambda device, dtype, width: FAKE
    try:
        got = ps.ring_attention(*inputs, causal=causal)
        got_grads = torch.autograd.grad((got * c).sum(), inputs)
    finally:
        ring_pass.block_kernel = real
    want = full_attention(*inputs, causal)
    want_grads = torch.autograd.grad((want * c).sum(), inputs)
    for a, b in zip((got, *got_grads), (want, *want_grads), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


def _on_a_device(dev: torch.device, causal: bool, packed: bool) -> None:
    """Ring attention on one rank in float32 against the float64 oracle on ``dev``: every block
    on the device's kernel (with ``packed``, masked blocks too: three documents and padding in
    one row, whose padding queries see nothing, and two documents in the other)."""
    ps.init_mesh({"sp": 1})
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v, c = (torch.randn(2, 300, 4, 64, generator=g, device=dev) for _ in range(4))
    seg = None
    if packed:
        seg = torch.tensor([[0] * 100 + [1] * 120 + [2] * 50 + [-1] * 30, [3] * 170 + [4] * 130])
        seg = seg.to(dev)
    inputs = [t.requires_grad_() for t in (q, k, v)]
    got = ps.ring_attention(*inputs, causal=causal, segment_ids=seg)
    got_grads = torch.autograd.grad((got * c).sum(), inputs)
    wide = [t.double() for t in inputs]
    if packed:
        want = masked_attention(*wide, reference_mask(300, seg.cpu(), causal).to(dev))
    else:
        want = full_attention(*wide, causal)
    want_grads = torch.autograd.grad((want * c.double()).sum(), inputs)
    for a, b in zip((got, *got_grads), (want, *want_grads), strict=True):
        torch.testing.assert_close(a.double(), b.double(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("packed", [False, True])
def test_on_one_device_against_the_oracle(packed: bool) -> None:
    """The CUDA test's body on the CPU kernel (so it is known to run): float32 blocks against
    the float64 oracle."""
    assert kernels.block_kernel(torch.device("cpu"), torch.float32, 64) is kernels.CPU
    _on_a_device(torch.device("cpu"), True, packed)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_on_a_cuda_device(causal: bool, packed: bool) -> None:
    """On a GPU: the real kernel passes its check, and ring attention on one rank (full blocks,
    causal triangles and masked blocks on the kernel) equals the float64 oracle, forward and
    gradients, in float32."""
    dev = torch.device("cuda")
    assert kernels.block_kernel(dev, torch.float32, 64) is kernels.CUDA
    _on_a_device(dev, causal, packed)
