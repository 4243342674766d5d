"""The rules that give each aten op's output its :class:`~pshard._microbatch.batch_kinds.Kind`.

The rules cover torch's aten ops by family (pointwise, views, reductions, contractions,
factories), and a few ops by name (embedding, losses and their backward ops, layer norm, index
and scatter ops, attention kernels, activations' backward ops: :mod:`pshard._microbatch.kind_ops`,
which :class:`Rules` inherits). An op with no rule
makes any batch-dependent output ``mixed``, so the analysis refuses rather than guesses. An
in-place op (``add_``) follows the rule of its functional form. The ``torch.ops.aten`` overload
packets named here are public op names.

Internal interface (used by :mod:`pshard._microbatch.batch_dim`, whose dispatch mode applies a
:class:`Rules` to every op of a trace):

- ``Rules(kind_of, is_batch, power, sign)``: ``apply(func, args, kwargs, inputs) -> Kind``, the
  kind of an op's outputs; ``value_kind(x) -> Kind`` of a tensor or symbolic number.
- ``output_kinds(func, kind, n) -> list[Kind]``: the kind of each of an op's ``n`` outputs.

Pure: no process group, no tensors made.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import MappingProxyType
from typing import Any

import torch

from .._compat import OpOverload
from .batch_kinds import (
    CONST,
    MIXED,
    POS,
    Kind,
    add_kinds,
    add_powers,
    div_kinds,
    mul_kinds,
    pointwise_kind,
)
from .kind_ops import PER_EXAMPLE, OpCall, OpRules, flat, is_max, same_size

__all__ = ["Rules", "output_kinds"]

_aten = torch.ops.aten

# families, by overload packet
_LINEAR_BINARY = frozenset({_aten.add, _aten.sub, _aten.rsub})
_MUL = frozenset({_aten.mul})
_DIV = frozenset({_aten.div, _aten.true_divide})
_NEG = frozenset({_aten.neg})
_SUM = frozenset({_aten.sum, _aten.mean, _aten.nansum})
_EXTREME = MappingProxyType(
    {_aten.amax: "max", _aten.amin: "min", _aten.max: "max", _aten.min: "min"}
)
_MATMUL = frozenset({
    _aten.mm, _aten.bmm, _aten.addmm, _aten.baddbmm, _aten.addbmm, _aten.dot, _aten.vdot,
    _aten.mv, _aten.addmv,
})  # fmt: skip
_SAME = frozenset({
    _aten.clone, _aten._to_copy, _aten.contiguous, _aten.detach, _aten.alias, _aten.lift_fresh,
    _aten.lift_fresh_copy, _aten.view, _aten._unsafe_view, _aten.reshape, _aten.permute,
    _aten.transpose, _aten.t, _aten.squeeze, _aten.unsqueeze, _aten.flatten, _aten.unflatten,
    _aten.movedim, _aten.view_as_real, _aten.view_as_complex, _aten._reshape_alias,
    _aten.unsafe_split, _aten.split, _aten.split_with_sizes, _aten.chunk, _aten.unbind,
    _aten.as_strided, _aten.copy, _aten.fill, _aten.zero, _aten.masked_fill, _aten.to,
    _aten._conj, _aten.conj, _aten.resolve_conj, _aten.resolve_neg, _aten.real, _aten.imag,
    _aten.type_as, _aten.view_copy, _aten.t_copy, _aten.transpose_copy, _aten.permute_copy,
    _aten.unsqueeze_copy, _aten.squeeze_copy, _aten.expand_copy, _aten.slice_copy,
    _aten.select_copy, _aten.alias_copy,
})  # fmt: skip
_EXPAND = frozenset({_aten.expand, _aten.expand_as, _aten.broadcast_to})
_FACTORY = frozenset({
    _aten.empty, _aten.zeros, _aten.ones, _aten.full, _aten.empty_strided, _aten.new_empty,
    _aten.new_zeros, _aten.new_ones, _aten.new_full, _aten.new_empty_strided, _aten.zeros_like,
    _aten.ones_like, _aten.empty_like, _aten.full_like, _aten.rand, _aten.randn, _aten.randint,
    _aten.rand_like, _aten.randn_like, _aten.randint_like, _aten.scalar_tensor, _aten.bernoulli,
    _aten.normal,
})  # fmt: skip
_LIKE = frozenset({
    _aten.zeros_like, _aten.ones_like, _aten.empty_like, _aten.full_like, _aten.rand_like,
    _aten.randn_like, _aten.randint_like,
})  # fmt: skip
_NEW = frozenset(
    {_aten.new_empty, _aten.new_zeros, _aten.new_ones, _aten.new_full, _aten.new_empty_strided}
)
_POSITIONAL = frozenset({_aten.arange, _aten.linspace, _aten.logspace})
_DIM_MIXING = frozenset({  # per-example unless they act along the batch dim
    _aten._softmax, _aten._log_softmax, _aten.softmax, _aten.log_softmax, _aten.cumsum,
    _aten.cumprod, _aten.logcumsumexp, _aten.cummax, _aten.cummin, _aten.sort, _aten.argsort,
    _aten.topk, _aten.flip, _aten.roll, _aten.kthvalue, _aten.median, _aten.mode,
    _aten.argmax, _aten.argmin, _aten.logsumexp, _aten.prod, _aten.var, _aten.std,
    _aten.var_mean, _aten.std_mean, _aten.linalg_vector_norm, _aten.norm, _aten.any,
    _aten.all, _aten.count_nonzero, _aten.nanmedian, _aten.glu, _aten.diff,
})  # fmt: skip


class Rules(OpRules):
    """Applies the rules to one op of a trace.

    ``kind_of(tensor)`` gives a tensor's kind (``None`` when independent), ``is_batch(size)``
    whether a size involves ``B``, ``power(sym)`` the power of ``B`` of a symbolic number
    (``None`` when it is not a monomial), and ``sign(x)`` a number's sign (``None`` when
    unknown).
    """

    def __init__(
        self,
        kind_of: Callable[[Any], Kind | None],
        is_batch: Callable[[Any], bool],
        power: Callable[[Any], int | None],
        sign: Callable[[Any], int | None],
    ) -> None:
        self.kind_of, self.is_batch, self.power, self.sign = kind_of, is_batch, power, sign
        self.packet: Any = None  # the overload packet of the op being applied

    # --- helpers ---------------------------------------------------------------------------

    def value_kind(self, x: Any) -> Kind:
        if isinstance(x, torch.Tensor):
            return self.kind_of(x) or CONST
        if isinstance(x, (torch.SymInt, torch.SymFloat)):
            p = self.power(x)
            return CONST if p == 0 else Kind("const", p)
        return CONST

    def batch_dims(self, t: Any) -> list[int]:
        if not isinstance(t, torch.Tensor):
            return []
        return [d for d, s in enumerate(t.shape) if self.is_batch(s)]

    def _dims(self, op: OpCall, ndim: int) -> list[int] | None:
        """The dims an op with a ``dim`` argument acts on (``None``: all of them)."""
        dim = op.arg("dim")
        if dim is None or (isinstance(dim, (list, tuple)) and not dim):
            return None
        dims = list(dim) if isinstance(dim, (list, tuple)) else [dim]
        return [int(d) % max(ndim, 1) for d in dims]

    def _acts_on_batch(self, op: OpCall, t: Any) -> bool:
        if not isinstance(t, torch.Tensor):
            return False
        bd = self.batch_dims(t)
        dims = self._dims(op, t.dim())
        return bool(bd) and (dims is None or any(d in bd for d in dims))

    # --- the op ----------------------------------------------------------------------------

    def apply(
        self,
        func: OpOverload,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        inputs: Sequence[Any],
    ) -> Kind:
        """The kind of ``func``'s outputs (one kind for all of them)."""
        kinds = [self.value_kind(x) for x in inputs]
        op = OpCall(func, args, kwargs)
        packet = self.packet = _functional(func.overloadpacket)
        if all(k == CONST for k in kinds) and packet not in _FACTORY:
            return CONST
        first = args[0] if args else None
        k0 = self.value_kind(first)
        if packet in _FACTORY:
            return self._factory(op)
        if packet in _POSITIONAL:
            if packet is _aten.arange and self._batch_positions(op):
                return POS
            return MIXED if any(k != CONST for k in kinds) or self._sized(args) else CONST
        if packet in _SAME:
            return self._same(op, first, k0)
        if packet in (_aten.slice, _aten.select, _aten.narrow):
            return self._slice(op, first, k0)
        if packet in _EXPAND:
            return self._expand(k0, first)
        if packet in _NEG:
            return {"max": Kind("min", k0.p), "min": Kind("max", k0.p)}.get(k0.kind, k0)
        if packet in _LINEAR_BINARY:
            b = self.value_kind(args[1]) if len(args) > 1 else CONST
            alpha = op.arg("alpha", 1)
            if self.value_kind(alpha) != CONST:
                b = mul_kinds(b, self.value_kind(alpha), self.sign(alpha))
            if packet is _aten.rsub or (packet is _aten.sub and b.kind in ("max", "min")):
                b = {"max": Kind("min", b.p), "min": Kind("max", b.p)}.get(b.kind, b)
            return add_kinds(k0, b)
        if packet in _MUL:
            other = args[1] if len(args) > 1 else None
            return mul_kinds(k0, self.value_kind(other), self.sign(other))
        if packet in _DIV:
            other = args[1] if len(args) > 1 else None
            mode = op.arg("rounding_mode")
            kind = div_kinds(k0, self.value_kind(other), self.sign(other))
            return kind if mode is None else pointwise_kind(kinds)
        if packet in _SUM:
            return self._sum(op, first, k0)
        if packet in _EXTREME:
            return self._extreme(op, first, k0, _EXTREME[packet])
        if packet in _MATMUL:
            return self._matmul(op)
        if packet in PER_EXAMPLE:
            return self._per_example(inputs, kinds, packet.__name__.endswith("_backward"))
        if packet in _DIM_MIXING:
            return MIXED if self._acts_on_batch(op, first) else pointwise_kind(kinds)
        special = getattr(self, "_" + packet.__name__.lstrip("_"), None)
        if special is not None:
            return special(op, kinds)
        if torch.Tag.pointwise in getattr(func, "tags", ()):
            return pointwise_kind(kinds)
        return MIXED  # no rule: refuse rather than guess

    # --- families ----------------------------------------------------------------------------

    def _sized(self, args: tuple[Any, ...]) -> bool:
        return any(self.is_batch(a) for a in flat(args))

    def _batch_positions(self, op: OpCall) -> bool:
        """``arange(B)``: each example's position in the batch."""
        numbers = [a for a in op.args if not isinstance(a, torch.Tensor)]
        if len(numbers) == 1:
            end = numbers[0]
        elif len(numbers) in (2, 3) and numbers[0] == 0 and (len(numbers) == 2 or numbers[2] == 1):
            end = numbers[1]
        else:
            return False
        return isinstance(end, torch.SymInt) and self.power(end) == 1 and self.is_batch(end)

    def _factory(self, op: OpCall) -> Kind:
        packet = self.packet
        fill = op.arg("fill_value", None)
        if packet is _aten.scalar_tensor:
            fill = op.args[0] if op.args else None
        value = self.value_kind(fill)
        source = op.args[0] if op.args else None
        if packet in (_aten.bernoulli, _aten.normal):  # random values around the source's
            return pointwise_kind([self.value_kind(source)])
        if packet in _LIKE:  # only the shape comes from the source
            shaped = bool(self.batch_dims(source))
        elif packet in _NEW:
            shaped = self._sized(op.args[1:2])
        else:
            shaped = self._sized(op.args[:1]) or self._sized(tuple(op.kwargs.get("size", ())))
        if shaped:
            return Kind("row", value.p) if value.kind == "const" else MIXED
        return value

    def _same(self, op: OpCall, first: Any, k0: Kind) -> Kind:
        packet = self.packet
        if packet in (_aten.copy, _aten.fill, _aten.masked_fill):
            src = op.args[1] if len(op.args) > 1 else None
            if packet is _aten.masked_fill:
                src = op.args[2] if len(op.args) > 2 else None
                mask = self.value_kind(op.args[1] if len(op.args) > 1 else None)
                return pointwise_kind([k0, mask, self.value_kind(src)])
            return self.value_kind(src)
        if packet in (_aten.view, _aten._unsafe_view, _aten.reshape, _aten._reshape_alias,
                      _aten.view_copy, _aten.as_strided) and k0.kind not in ("const", "row",
                      "rowratio"):  # fmt: skip
            return k0  # a reshape of a value without the batch dim keeps its kind
        return k0

    def _slice(self, op: OpCall, first: Any, k0: Kind) -> Kind:
        if k0.kind not in ("row", "rowratio", "pos"):
            return k0
        dim = int(op.arg("dim", 0)) % max(first.dim(), 1)
        if dim not in self.batch_dims(first):
            return k0
        if self.packet is _aten.slice:
            start = op.arg("start", None)
            end = op.arg("end", None)
            step = op.arg("step", 1)
            whole = start in (None, 0) and step == 1
            if whole and (end is None or is_max(end) or same_size(end, first.shape[dim])):
                return k0
        return MIXED  # some rows of the batch: depends on where the microbatch starts

    def _expand(self, k0: Kind, first: Any) -> Kind:
        # broadcasting a value to a new batch dim: a constant becomes the same for every row
        if k0.kind == "const":
            return Kind("row", k0.p) if not self.batch_dims(first) else k0
        if k0.kind == "inv":
            return Kind("rowratio", 0) if k0.p == 0 else MIXED
        if k0.kind in ("row", "rowratio", "pos"):
            return k0
        return MIXED  # a batch statistic broadcast to every row

    def _sum(self, op: OpCall, first: Any, k0: Kind) -> Kind:
        mean = self.packet is _aten.mean
        if self._acts_on_batch(op, first):
            if k0.kind == "row":
                return Kind("sum", add_powers(k0.p, -1 if mean else 0))
            if k0.kind == "rowratio" and not mean:
                return Kind("ratio", 0)
            return MIXED
        if k0.kind in ("row", "rowratio", "sum", "ratio", "const", "inv"):
            return k0
        return MIXED

    def _extreme(self, op: OpCall, first: Any, k0: Kind, reduce: str) -> Kind:
        if self._acts_on_batch(op, first):
            return Kind(reduce, k0.p) if k0.kind == "row" else MIXED
        if len(op.args) > 1 and isinstance(op.args[1], torch.Tensor):  # elementwise max(a, b)
            return pointwise_kind([k0, self.value_kind(op.args[1])])
        if k0.kind in ("row", "const") or k0.kind == reduce:
            return k0
        return MIXED

    def _matmul(self, op: OpCall) -> Kind:
        packet = self.packet
        bias = None
        a, b = op.args[0], op.args[1]
        if packet in (_aten.addmm, _aten.baddbmm, _aten.addbmm, _aten.addmv):
            bias, a, b = op.args[0], op.args[1], op.args[2]
        ka, kb = self.value_kind(a), self.value_kind(b)
        contracted = a.shape[-1] if a.dim() else None
        product = mul_kinds(ka, kb, None)
        if (
            contracted is not None
            and self.is_batch(contracted)
            or (packet is _aten.addbmm and self.batch_dims(a)[:1] == [0])
        ):
            if product.kind == "row":
                product = Kind("sum", product.p)
            elif product.kind == "rowratio":
                product = Kind("ratio", 0)
            else:
                product = MIXED
        if bias is None:
            return product
        for name in ("beta", "alpha"):
            if self.value_kind(op.arg(name, 1)) != CONST:
                return MIXED
        return add_kinds(self.value_kind(bias), product)

    # --- special ops (by name) ---------------------------------------------------------------


def output_kinds(func: Any, kind: Kind, n: int) -> list[Kind]:
    """The kind of each of an op's ``n`` outputs, from the op's kind (the first output's)."""
    kinds = [kind] * n
    packet = _functional(func.overloadpacket) if hasattr(func, "overloadpacket") else None
    if packet is _aten.native_layer_norm_backward and n == 3:
        summed = {"row": Kind("sum", kind.p), "rowratio": Kind("ratio", 0)}.get(kind.kind, MIXED)
        kinds[1:] = [summed, summed]
    elif packet in (_aten.nll_loss_forward, _aten.nll_loss2d_forward) and n == 2:
        kinds[1] = Kind("sum", 0) if kind != MIXED else MIXED  # total_weight: a count
    elif packet in (_aten.max, _aten.min, _aten.sort, _aten.topk, _aten.kthvalue) and n == 2:
        if kind.kind in ("max", "min", "mixed"):
            kinds[1] = MIXED  # the index of the extreme over the batch
    elif packet is _aten.native_layer_norm and kind == CONST:
        kinds = [CONST] * n
    return kinds


def _functional(packet: Any) -> Any:
    """``aten.add_`` -> ``aten.add``: an in-place op follows its functional form's rule."""
    name = packet.__name__
    if name.endswith("_") and not name.startswith("_"):
        return getattr(_aten, name[:-1], packet)
    return packet
