"""The rules of :mod:`pshard._microbatch.kind_rules` for single ops by name: embeddings,
losses and their backward ops, layer norm, indexing, gathering and scattering, attention
kernels, joining and padding, and the backward ops of activations. :class:`OpRules` holds them;
:class:`pshard._microbatch.kind_rules.Rules` (the families and the dispatch by op) inherits
them and gives them what they read of a trace (a value's kind, a tensor's batch dims).

Pure: no process group, no tensors made.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from .._compat import OpOverload
from .batch_kinds import (
    CONST,
    MIXED,
    POS,
    Kind,
    add_kinds,
    join,
    pointwise_kind,
)

__all__ = ["PER_EXAMPLE", "OpCall", "OpRules", "flat", "is_max", "same_size"]

_aten = torch.ops.aten

# attention kernels (and their backwards): each index of dim 0 (the batch) computed on its own
PER_EXAMPLE = frozenset(
    getattr(_aten, name)
    for name in (
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_flash_attention_for_cpu_backward",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_backward",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_efficient_attention_backward",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_cudnn_attention_backward",
        "_scaled_dot_product_fused_attention_overrideable",
        "_scaled_dot_product_fused_attention_overrideable_backward",
    )
    if hasattr(_aten, name)
)


@dataclasses.dataclass(frozen=True)
class OpCall:
    """One call of an aten op in a trace, as the dispatch mode sees it."""

    func: OpOverload
    args: tuple[Any, ...]
    kwargs: dict[str, Any]

    def arg(self, name: str, default: Any = None) -> Any:
        """The argument ``name``, given by keyword or by position (``default`` if absent)."""
        if name in self.kwargs:
            return self.kwargs[name]
        schema = getattr(self.func, "_schema", None)
        for i, a in enumerate(schema.arguments if schema is not None else ()):
            if a.name == name:
                return self.args[i] if i < len(self.args) else default
        return default


class OpRules:
    """The rules for single ops (see the module docs); ``packet`` is the op being applied."""

    packet: Any = None

    def value_kind(self, x: Any) -> Kind:
        """The kind of a tensor or symbolic number (given by :class:`Rules`)."""
        raise NotImplementedError

    def batch_dims(self, t: Any) -> list[int]:
        """The dims of ``t`` whose size involves the batch size (given by :class:`Rules`)."""
        raise NotImplementedError

    def _acts_on_batch(self, op: OpCall, t: Any) -> bool:
        """Whether ``op`` acts along a batch dim of ``t`` (given by :class:`Rules`)."""
        raise NotImplementedError

    def _per_example(self, inputs: Sequence[Any], kinds: list[Kind], backward: bool) -> Kind:
        """A kernel computing each index of dim 0 on its own: per-example values where every
        input is one (with the batch dim first) or the same for the whole batch. A backward is
        linear in its first input, the cotangent: its outputs take the cotangent's kind (a
        token mean's per-token terms stay so)."""
        out = Kind("row", 0)
        for i, (x, k) in enumerate(zip(inputs, kinds, strict=True)):
            if k == CONST:
                continue
            if self.batch_dims(x) != [0]:
                return MIXED
            if i == 0 and backward and k.kind == "rowratio":
                out = k
            elif k != Kind("row", 0):
                return MIXED
        return out

    def _embedding(self, op: OpCall, kinds: list[Kind]) -> Kind:
        weight, indices = kinds[0], kinds[1] if len(kinds) > 1 else CONST
        if weight == CONST and indices.kind == "row" and indices.p == 0:
            return Kind("row", 0)
        return pointwise_kind(kinds) if weight == CONST else MIXED

    def _embedding_dense_backward(self, op: OpCall, kinds: list[Kind]) -> Kind:
        grad = kinds[0]
        if grad.kind == "row":
            return Kind("sum", grad.p)
        if grad.kind == "rowratio":
            return Kind("ratio", 0)
        if grad.kind in ("sum", "ratio") and all(k == CONST for k in kinds[1:]):
            return grad  # summed over the batch already (a position table): linear in it
        return MIXED

    def _nll_loss_forward(self, op: OpCall, kinds: list[Kind]) -> Kind:
        x = kinds[0]
        reduction = op.arg("reduction", 1)
        if x.kind != "row" or x.p != 0:
            return MIXED
        # outputs: (loss, total_weight); one kind for both: the loss's (the count is read as a
        # sum by the ops that use it, see div_kinds)
        return {0: Kind("row", 0), 1: Kind("ratio", 0), 2: Kind("sum", 0)}.get(reduction, MIXED)

    _nll_loss2d_forward = _nll_loss_forward

    def _nll_loss_backward(self, op: OpCall, kinds: list[Kind]) -> Kind:
        grad = kinds[0]
        reduction = op.arg("reduction", 1)
        if reduction == 1:
            return Kind("rowratio", 0) if grad == CONST else MIXED
        if reduction == 2:
            return Kind("row", grad.p) if grad.kind == "const" else MIXED
        return grad if grad.kind == "row" else MIXED

    _nll_loss2d_backward = _nll_loss_backward

    def _mse_loss(self, op: OpCall, kinds: list[Kind]) -> Kind:
        base = pointwise_kind(kinds)
        reduction = op.arg("reduction", 1)
        if base != Kind("row", 0):
            return MIXED if base != CONST else CONST
        return {0: base, 1: Kind("sum", -1), 2: Kind("sum", 0)}.get(reduction, MIXED)

    def _mse_loss_backward(self, op: OpCall, kinds: list[Kind]) -> Kind:
        grad, rest = kinds[0], pointwise_kind(kinds[1:])
        reduction = op.arg("reduction", 1)
        if rest.kind != "row" or rest.p != 0:
            return MIXED
        if reduction == 0:
            return grad if grad.kind == "row" else MIXED
        if grad.kind != "const" or grad.p is None:
            return MIXED
        return Kind("row", grad.p - (1 if reduction == 1 else 0))

    def _native_layer_norm(self, op: OpCall, kinds: list[Kind]) -> Kind:
        x = op.args[0]
        shape = op.arg("normalized_shape", ())
        normalized = range(x.dim() - len(shape), x.dim())
        if any(d in normalized for d in self.batch_dims(x)):
            return MIXED
        return pointwise_kind(kinds)

    def _native_layer_norm_backward(self, op: OpCall, kinds: list[Kind]) -> Kind:
        grad, x = kinds[0], op.args[1]
        shape = op.arg("normalized_shape", ())
        normalized = range(x.dim() - len(shape), x.dim())
        if any(d in normalized for d in self.batch_dims(x)):
            return MIXED
        if pointwise_kind(kinds[1:]) not in (CONST, Kind("row", 0)):
            return MIXED
        # grad_input keeps grad's kind; grad_weight and grad_bias sum it over the batch (see
        # output_kinds)
        return grad if grad.kind in ("row", "rowratio") else MIXED

    def _lookup(self, table: Kind, index: Kind) -> Kind:
        """Values of a table picked by an index (embedding-like)."""
        if index == CONST:
            return table
        if table == CONST and index == Kind("row", 0):
            return index
        return MIXED

    def _index(self, op: OpCall, kinds: list[Kind]) -> Kind:
        x, indices = op.args[0], op.args[1]
        kx = self.value_kind(x)
        indexed = [d for d, i in enumerate(indices) if i is not None]
        kinds_i = [self.value_kind(i) for i in indices if i is not None]
        batch = self.batch_dims(x)
        if kx.kind == "row" and len(batch) == 1 and indexed[:1] == batch and kinds_i[0] == POS:
            # x[arange(B)[:, None], j]: each example's own row (a padding mask read by
            # example index); the other indices must not depend on the batch otherwise
            rest = kinds_i[1:]
            if all(k == CONST or k == Kind("row", 0) for k in rest) and kx.p == 0:
                return kx
            return MIXED
        ki = CONST if all(k == CONST for k in kinds_i) else pointwise_kind(kinds_i)
        if kx.kind in ("row", "rowratio") and any(d in indexed for d in batch):
            return MIXED  # picks rows of the batch
        if kx.kind == "row" and ki in (CONST, Kind("row", 0)):
            return kx if ki == CONST or kx.p == 0 else MIXED
        return self._lookup(kx, ki)

    def _index_select(self, op: OpCall, kinds: list[Kind]) -> Kind:
        x, dim, index = op.args[0], op.args[1], op.args[2]
        kx, ki = self.value_kind(x), self.value_kind(index)
        if kx.kind in ("row", "rowratio") and int(dim) % max(x.dim(), 1) in self.batch_dims(x):
            return MIXED
        return self._lookup(kx, ki)

    def _gather(self, op: OpCall, kinds: list[Kind]) -> Kind:
        x, dim, index = op.args[0], op.args[1], op.args[2]
        kx, ki = self.value_kind(x), self.value_kind(index)
        if int(dim) % max(x.dim(), 1) in self.batch_dims(x):
            return MIXED
        if kx.kind == "row" and ki in (CONST, Kind("row", 0)):
            return kx
        return self._lookup(kx, ki)

    def _scattered(self, base: Kind, values: Kind, summed: bool) -> Kind:
        """``base`` with ``values`` added (``summed``) or written at batch-dependent places."""
        if base == CONST and summed:
            return {"row": Kind("sum", values.p), "rowratio": Kind("ratio", 0)}.get(
                values.kind, MIXED
            )
        return MIXED

    def _index_put(self, op: OpCall, kinds: list[Kind]) -> Kind:
        x, indices, values = op.args[0], op.args[1], op.args[2]
        accumulate = bool(op.arg("accumulate", False))
        kx, kv = self.value_kind(x), self.value_kind(values)
        kinds_i = [self.value_kind(i) for i in indices if i is not None]
        if all(k == CONST for k in kinds_i):
            if kx.kind == "row" and not self.batch_dims(values) and kv == CONST:
                return kx
            return join(kx, kv) or CONST if not accumulate else add_kinds(kx, kv)
        if not self.batch_dims(x):  # rows of the batch land in a table without the batch dim
            return self._scattered(kx, kv, accumulate)
        return MIXED

    _unsafe_index_put = _index_put
    _index_put_impl = _index_put

    def _index_add(self, op: OpCall, kinds: list[Kind]) -> Kind:
        x, dim, index, source = op.args[0], op.args[1], op.args[2], op.args[3]
        kx, ks = self.value_kind(x), self.value_kind(source)
        if self.value_kind(index) != CONST and not self.batch_dims(x):
            return self._scattered(kx, ks, True)
        if int(dim) % max(source.dim(), 1) in self.batch_dims(source):
            return self._scattered(kx, ks, True) if not self.batch_dims(x) else MIXED
        return pointwise_kind([kx, ks])

    def _scatter_add(self, op: OpCall, kinds: list[Kind]) -> Kind:
        x, dim, src = op.args[0], op.args[1], op.args[3]
        kx, ks = self.value_kind(x), self.value_kind(src)
        if int(dim) % max(src.dim(), 1) in self.batch_dims(src) and not self.batch_dims(x):
            return self._scattered(kx, ks, True)
        if int(dim) % max(x.dim(), 1) in self.batch_dims(x):
            return MIXED
        return pointwise_kind(kinds)

    def _cat(self, op: OpCall, kinds: list[Kind]) -> Kind:
        """Joining values along a dim that is not the batch dim keeps them per example (the
        halves of rotary embeddings); along the batch dim it mixes microbatches."""
        tensors = [t for t in flat(op.args[:1]) if isinstance(t, torch.Tensor)]
        for t in tensors:
            dim = int(op.arg("dim", 0)) % max(t.dim(), 1)
            if dim in self.batch_dims(t):
                return MIXED
        if kinds and all(k == kinds[0] for k in kinds) and kinds[0].kind in ("row", "rowratio"):
            return kinds[0]  # (a gradient's per-token terms, joined)
        return pointwise_kind(kinds)

    def _slice_backward(self, op: OpCall, kinds: list[Kind]) -> Kind:
        """The gradient of a slice: the cotangent placed in zeros of the input's size; the same
        per-example values unless the slice picked rows of the batch."""
        grad = op.args[0] if op.args else None
        k0 = self.value_kind(grad)
        if k0.kind not in ("row", "rowratio") or not isinstance(grad, torch.Tensor):
            return k0 if k0 == CONST else MIXED
        sizes = list(op.arg("input_sizes", ()))
        dim = int(op.arg("dim", 0)) % max(len(sizes), 1)
        if dim not in self.batch_dims(grad):
            return k0
        start, end, step = op.arg("start", 0), op.arg("end", None), op.arg("step", 1)
        whole = start == 0 and step == 1 and (end is None or is_max(end) or
                                               same_size(end, sizes[dim]))  # fmt: skip
        return k0 if whole else MIXED

    def _constant_pad_nd(self, op: OpCall, kinds: list[Kind]) -> Kind:
        """Padding dims other than the batch dim with a constant (Hugging Face's shift of the
        labels) keeps a per-example value per example."""
        first = op.args[0] if op.args else None
        pad = list(op.arg("pad", ()))
        if not isinstance(first, torch.Tensor):
            return MIXED
        batch = self.batch_dims(first)
        for i in range(len(pad) // 2):
            if (pad[2 * i], pad[2 * i + 1]) != (0, 0) and first.dim() - 1 - i in batch:
                return MIXED
        return pointwise_kind(kinds)

    def _native_dropout(self, op: OpCall, kinds: list[Kind]) -> Kind:
        return pointwise_kind(kinds)

    def _where(self, op: OpCall, kinds: list[Kind]) -> Kind:
        return pointwise_kind(kinds)

    def _threshold_backward(self, op: OpCall, kinds: list[Kind]) -> Kind:
        grad, x = kinds[0], kinds[1] if len(kinds) > 1 else CONST
        # grad * (x > threshold): linear in grad with a per-example 0/1 factor
        if grad.kind in ("row", "rowratio") and x in (CONST, Kind("row", 0)):
            return grad
        return pointwise_kind(kinds)

    def _softmax_backward_data(self, op: OpCall, kinds: list[Kind]) -> Kind:
        if self._acts_on_batch(op, op.args[0]):
            return MIXED
        return self._linear_in_grad(kinds)

    _log_softmax_backward_data = _softmax_backward_data

    def _tanh_backward(self, op: OpCall, kinds: list[Kind]) -> Kind:
        return self._linear_in_grad(kinds)

    _sigmoid_backward = _tanh_backward
    _gelu_backward = _tanh_backward
    _silu_backward = _tanh_backward
    _elu_backward = _tanh_backward
    _leaky_relu_backward = _tanh_backward
    _softplus_backward = _tanh_backward
    _hardtanh_backward = _tanh_backward

    def _linear_in_grad(self, kinds: list[Kind]) -> Kind:
        grad, rest = kinds[0], pointwise_kind(kinds[1:])
        if grad.kind in ("row", "rowratio") and rest in (CONST, Kind("row", 0)):
            return grad
        return pointwise_kind(kinds)


def flat(x: Any) -> list[Any]:
    if isinstance(x, (list, tuple)):
        return [y for item in x for y in flat(item)]
    return [x]


def is_max(x: Any) -> bool:
    return isinstance(x, int) and x >= 2**62


def same_size(x: Any, size: Any) -> bool:
    try:
        return bool(x == size)
    except Exception:  # symbolic comparison that cannot be decided
        return False
