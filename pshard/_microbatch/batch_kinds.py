"""How a traced value depends on the batch: the lattice batch-dim analysis propagates.

Every tensor of a trace gets a :class:`Kind` (none: it does not depend on the batch). With
``B`` the batch size (a symbol in the trace) and ``p`` an integer power:

- ``const``: the same for every batch, times ``B**p`` (``p = 0``: independent);
  ``p = None``: some other function of ``B`` (``B + 1``);
- ``row``: per-example values along a dim of size ``B`` (rows independent of each other),
  times ``B**p``: concatenating microbatches gives the whole batch's only when ``p == 0``;
- ``sum`` / ``max`` / ``min``: a reduction over the batch of per-example values, times
  ``B**p`` (``sum`` with ``p == -1`` is a mean);
- ``inv``: ``B**p`` divided by a batch sum (``1 / token_count``);
- ``rowratio``: per-example values divided by a batch sum (a token mean's per-token terms);
- ``ratio``: a batch sum divided by another batch sum (a mean over tokens, not rows);
- ``mixed``: anything else (the square of a mean, a row minus the batch mean, the first row).

An output then merges over microbatches exactly when it is ``const`` with ``p`` 0
(``Replicate``) or 1 (``Partial("sum")``), ``row`` with ``p == 0`` (``Shard``), ``sum`` with
``p`` 0 or -1 (``Partial("sum" | "mean")``), ``max``/``min`` with ``p == 0``, or ``ratio``
(``Partial("mean")`` weighted by the denominators: only with ``weight_fn``). Everything else is
refused. The rules below cover torch's aten ops by family (pointwise, views, reductions,
contractions, factories, losses, norms, indexing); an op with no rule makes any batch-dependent
output ``mixed``, so the analysis refuses rather than guesses.

Pure: no process group, no tensors made. Used by :mod:`pshard._microbatch.batch_dim`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

__all__ = ["Kind", "CONST", "MIXED", "Rules", "describe_kind", "join", "output_kinds"]


class Kind(NamedTuple):
    kind: str
    p: int | None = 0


CONST = Kind("const", 0)
MIXED = Kind("mixed", None)

_aten = torch.ops.aten

# families, by overload packet
_LINEAR_BINARY = {_aten.add, _aten.sub, _aten.rsub}
_MUL = {_aten.mul}
_DIV = {_aten.div, _aten.true_divide}
_NEG = {_aten.neg}
_SUM = {_aten.sum, _aten.mean, _aten.nansum}
_EXTREME = {_aten.amax: "max", _aten.amin: "min", _aten.max: "max", _aten.min: "min"}
_MATMUL = {
    _aten.mm, _aten.bmm, _aten.addmm, _aten.baddbmm, _aten.addbmm, _aten.dot, _aten.vdot,
    _aten.mv, _aten.addmv,
}  # fmt: skip
_SAME = {
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
}  # fmt: skip
_EXPAND = {_aten.expand, _aten.expand_as, _aten.broadcast_to}
_FACTORY = {
    _aten.empty, _aten.zeros, _aten.ones, _aten.full, _aten.empty_strided, _aten.new_empty,
    _aten.new_zeros, _aten.new_ones, _aten.new_full, _aten.new_empty_strided, _aten.zeros_like,
    _aten.ones_like, _aten.empty_like, _aten.full_like, _aten.rand, _aten.randn, _aten.randint,
    _aten.rand_like, _aten.randn_like, _aten.randint_like, _aten.scalar_tensor, _aten.bernoulli,
    _aten.normal,
}  # fmt: skip
_LIKE = {
    _aten.zeros_like, _aten.ones_like, _aten.empty_like, _aten.full_like, _aten.rand_like,
    _aten.randn_like, _aten.randint_like,
}  # fmt: skip
_NEW = {_aten.new_empty, _aten.new_zeros, _aten.new_ones, _aten.new_full, _aten.new_empty_strided}
_POSITIONAL = {_aten.arange, _aten.linspace, _aten.logspace}
_DIM_MIXING = {  # per-example unless they act along the batch dim
    _aten._softmax, _aten._log_softmax, _aten.softmax, _aten.log_softmax, _aten.cumsum,
    _aten.cumprod, _aten.logcumsumexp, _aten.cummax, _aten.cummin, _aten.sort, _aten.argsort,
    _aten.topk, _aten.flip, _aten.roll, _aten.kthvalue, _aten.median, _aten.mode,
    _aten.argmax, _aten.argmin, _aten.logsumexp, _aten.prod, _aten.var, _aten.std,
    _aten.var_mean, _aten.std_mean, _aten.linalg_vector_norm, _aten.norm, _aten.any,
    _aten.all, _aten.count_nonzero, _aten.nanmedian, _aten.glu, _aten.diff,
}  # fmt: skip


def describe_kind(k: Kind | None) -> str:
    """A phrase for error messages."""
    if k is None or k == CONST:
        return "independent of the batch"
    p = "" if not k.p else f" times B**{k.p}"
    return {
        "const": f"a function of the batch size B{p}" if k.p is not None else "a function of B",
        "row": f"per-example values{p}",
        "sum": f"a sum over the batch{p}",
        "max": f"a max over the batch{p}",
        "min": f"a min over the batch{p}",
        "inv": "divided by a sum over the batch",
        "rowratio": "per-example values divided by a sum over the batch",
        "ratio": "a ratio of two sums over the batch (a mean over tokens, say)",
        "mixed": "a mix of the batch that no merge of microbatches reproduces",
    }[k.kind]


def _pow(a: int | None, b: int | None, sign: int = 1) -> int | None:
    return None if a is None or b is None else a + sign * b


def join(a: Kind | None, b: Kind | None) -> Kind | None:
    """The kind of a buffer holding values of both kinds (a partial in-place write)."""
    a, b = a or CONST, b or CONST
    if a == CONST:
        return None if b == CONST else b
    if b == CONST or a == b:
        return a
    return MIXED


def _mul(a: Kind, b: Kind, sign_b: int | None) -> Kind:
    """``a * b`` for kinds (``sign_b``: the sign of ``b`` when it is a known number)."""
    if a.kind == "const" and b.kind != "const":
        return _mul(b, a, None)
    if b.kind == "const":
        p = _pow(a.p, b.p)
        if a.kind == "const" or (a.kind in ("row", "sum", "inv") and b.p is not None):
            return Kind(a.kind, p)
        if a.kind in ("max", "min") and b.p is not None and sign_b is not None:
            return Kind(a.kind if sign_b > 0 else {"max": "min", "min": "max"}[a.kind], p)
        if a.kind in ("ratio", "rowratio") and b.p == 0:
            return a
        return MIXED
    pair = {a.kind, b.kind}
    if pair == {"row"}:
        return Kind("row", _pow(a.p, b.p))
    if pair == {"row", "rowratio"} and Kind("row", 0) in (a, b):
        return Kind("rowratio", 0)
    if pair == {"row", "inv"} and _pow(a.p, b.p) == 0:
        return Kind("rowratio", 0)
    if pair == {"sum", "inv"} and _pow(a.p, b.p) == 0:
        return Kind("ratio", 0)
    return MIXED


def _inverse(b: Kind) -> Kind:
    if b.kind == "const":
        return Kind("const", None if b.p is None else -b.p)
    if b.kind == "sum":
        return Kind("inv", None if b.p is None else -b.p)
    if b.kind == "inv":
        return Kind("sum", None if b.p is None else -b.p)
    return MIXED


def _div(a: Kind, b: Kind, sign_b: int | None) -> Kind:
    if a.kind == "row" and b.kind == "row":
        return Kind("row", _pow(a.p, b.p, -1))
    if a.kind == "sum" and b.kind == "sum" and a.p == b.p and a.p is not None:
        return Kind("ratio", 0)
    if a.kind == "row" and b.kind == "sum" and a.p == b.p and a.p is not None:
        return Kind("rowratio", 0)
    return _mul(a, _inverse(b), sign_b)


def _add(a: Kind, b: Kind) -> Kind:
    """``a + b`` (and ``a - b``)."""
    if a == b:
        return a if a.p is not None else MIXED
    if a.kind == "const" and b.kind != "const":
        a, b = b, a
    if b.kind == "const":
        if a.kind == "const":
            return Kind("const", a.p if b.p == a.p else None)
        if b.p != 0:
            return MIXED
        if (a.kind == "row" and a.p == 0) or (a.kind == "sum" and a.p == -1):
            return a  # a per-example shift, or a mean plus a constant
        if a.kind in ("max", "min") and a.p == 0 or a.kind == "ratio":
            return a
        return MIXED
    return MIXED


def _pointwise(kinds: Sequence[Kind]) -> Kind:
    """A pointwise function of several values that is not known to be linear."""
    batch = [k for k in kinds if k != CONST]
    if not batch:
        return CONST
    if all(k.kind == "const" for k in batch):
        return Kind("const", None)
    if all(k.kind == "const" or (k.kind == "row" and k.p == 0) for k in batch):
        if all(k.kind == "row" or k.p == 0 for k in batch):
            return Kind("row", 0)
    return MIXED


class Rules:
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

    @staticmethod
    def _arg(func: Any, args: tuple, kwargs: dict, name: str, default: Any = None) -> Any:
        schema = getattr(func, "_schema", None)
        if name in kwargs:
            return kwargs[name]
        for i, a in enumerate(schema.arguments if schema is not None else ()):
            if a.name == name:
                return args[i] if i < len(args) else default
        return default

    def _dims(self, func: Any, args: tuple, kwargs: dict, ndim: int) -> list[int] | None:
        """The dims an op with a ``dim`` argument acts on (``None``: all of them)."""
        dim = self._arg(func, args, kwargs, "dim")
        if dim is None or (isinstance(dim, (list, tuple)) and not dim):
            return None
        dims = list(dim) if isinstance(dim, (list, tuple)) else [dim]
        return [int(d) % max(ndim, 1) for d in dims]

    def _acts_on_batch(self, func: Any, args: tuple, kwargs: dict, t: Any) -> bool:
        if not isinstance(t, torch.Tensor):
            return False
        bd = self.batch_dims(t)
        dims = self._dims(func, args, kwargs, t.dim())
        return bool(bd) and (dims is None or any(d in bd for d in dims))

    # --- the op ----------------------------------------------------------------------------

    def apply(self, func: Any, args: tuple, kwargs: dict, inputs: Sequence[Any]) -> Kind:
        """The kind of ``func``'s outputs (one kind for all of them)."""
        kinds = [self.value_kind(x) for x in inputs]
        packet = self.packet = _functional(func.overloadpacket)
        if all(k == CONST for k in kinds) and packet not in _FACTORY:
            return CONST
        first = args[0] if args else None
        k0 = self.value_kind(first)
        if packet in _FACTORY:
            return self._factory(func, args, kwargs)
        if packet in _POSITIONAL:
            return MIXED if any(k != CONST for k in kinds) or self._sized(args) else CONST
        if packet in _SAME:
            return self._same(func, args, kwargs, first, k0)
        if packet in (_aten.slice, _aten.select, _aten.narrow):
            return self._slice(func, args, kwargs, first, k0)
        if packet in _EXPAND:
            return self._expand(k0, first)
        if packet in _NEG:
            return {"max": Kind("min", k0.p), "min": Kind("max", k0.p)}.get(k0.kind, k0)
        if packet in _LINEAR_BINARY:
            b = self.value_kind(args[1]) if len(args) > 1 else CONST
            alpha = self._arg(func, args, kwargs, "alpha", 1)
            if self.value_kind(alpha) != CONST:
                b = _mul(b, self.value_kind(alpha), self.sign(alpha))
            if packet is _aten.rsub or (packet is _aten.sub and b.kind in ("max", "min")):
                b = {"max": Kind("min", b.p), "min": Kind("max", b.p)}.get(b.kind, b)
            return _add(k0, b)
        if packet in _MUL:
            b = args[1] if len(args) > 1 else None
            return _mul(k0, self.value_kind(b), self.sign(b))
        if packet in _DIV:
            b = args[1] if len(args) > 1 else None
            mode = self._arg(func, args, kwargs, "rounding_mode")
            kind = _div(k0, self.value_kind(b), self.sign(b))
            return kind if mode is None else _pointwise(kinds)
        if packet in _SUM:
            return self._sum(func, args, kwargs, first, k0)
        if packet in _EXTREME:
            return self._extreme(func, args, kwargs, first, k0, _EXTREME[packet])
        if packet in _MATMUL:
            return self._matmul(func, args, kwargs)
        if packet in _DIM_MIXING:
            return MIXED if self._acts_on_batch(func, args, kwargs, first) else _pointwise(kinds)
        special = getattr(self, "_" + packet.__name__.lstrip("_"), None)
        if special is not None:
            return special(func, args, kwargs, kinds)
        if torch.Tag.pointwise in getattr(func, "tags", ()):
            return _pointwise(kinds)
        return MIXED  # no rule: refuse rather than guess

    # --- families ----------------------------------------------------------------------------

    def _sized(self, args: tuple) -> bool:
        return any(self.is_batch(a) for a in _flat(args))

    def _factory(self, func: Any, args: tuple, kwargs: dict) -> Kind:
        packet = self.packet
        fill = self._arg(func, args, kwargs, "fill_value", None)
        if packet is _aten.scalar_tensor:
            fill = args[0] if args else None
        value = self.value_kind(fill)
        source = args[0] if args else None
        if packet in (_aten.bernoulli, _aten.normal):  # random values around the source's
            return _pointwise([self.value_kind(source)])
        if packet in _LIKE:  # only the shape comes from the source
            shaped = bool(self.batch_dims(source))
        elif packet in _NEW:
            shaped = self._sized(args[1:2])
        else:
            shaped = self._sized(args[:1]) or self._sized(tuple(kwargs.get("size", ())))
        if shaped:
            return Kind("row", value.p) if value.kind == "const" else MIXED
        return value

    def _same(self, func: Any, args: tuple, kwargs: dict, first: Any, k0: Kind) -> Kind:
        packet = self.packet
        if packet in (_aten.copy, _aten.fill, _aten.masked_fill):
            src = args[1] if len(args) > 1 else None
            if packet is _aten.masked_fill:
                src = args[2] if len(args) > 2 else None
                mask = self.value_kind(args[1] if len(args) > 1 else None)
                return _pointwise([k0, mask, self.value_kind(src)])
            return self.value_kind(src)
        if packet in (_aten.view, _aten._unsafe_view, _aten.reshape, _aten._reshape_alias,
                      _aten.view_copy, _aten.as_strided) and k0.kind not in ("const", "row",
                      "rowratio"):  # fmt: skip
            return k0  # a reshape of a value without the batch dim keeps its kind
        return k0

    def _slice(self, func: Any, args: tuple, kwargs: dict, first: Any, k0: Kind) -> Kind:
        if k0.kind not in ("row", "rowratio"):
            return k0
        dim = int(self._arg(func, args, kwargs, "dim", 0)) % max(first.dim(), 1)
        if dim not in self.batch_dims(first):
            return k0
        if self.packet is _aten.slice:
            start = self._arg(func, args, kwargs, "start", None)
            end = self._arg(func, args, kwargs, "end", None)
            step = self._arg(func, args, kwargs, "step", 1)
            whole = start in (None, 0) and step == 1
            if whole and (end is None or _is_max(end) or _same_size(end, first.shape[dim])):
                return k0
        return MIXED  # some rows of the batch: depends on where the microbatch starts

    def _expand(self, k0: Kind, first: Any) -> Kind:
        # broadcasting a value to a new batch dim: a constant becomes the same for every row
        if k0.kind == "const":
            return Kind("row", k0.p) if not self.batch_dims(first) else k0
        if k0.kind == "inv":
            return Kind("rowratio", 0) if k0.p == 0 else MIXED
        if k0.kind in ("row", "rowratio"):
            return k0
        return MIXED  # a batch statistic broadcast to every row

    def _sum(self, func: Any, args: tuple, kwargs: dict, first: Any, k0: Kind) -> Kind:
        mean = self.packet is _aten.mean
        if self._acts_on_batch(func, args, kwargs, first):
            if k0.kind == "row":
                return Kind("sum", _pow(k0.p, -1 if mean else 0))
            if k0.kind == "rowratio" and not mean:
                return Kind("ratio", 0)
            return MIXED
        if k0.kind in ("row", "rowratio", "sum", "ratio", "const", "inv"):
            return k0
        return MIXED

    def _extreme(self, func: Any, args: tuple, kwargs: dict, first: Any, k0: Kind, op: str):
        if self._acts_on_batch(func, args, kwargs, first):
            return Kind(op, k0.p) if k0.kind == "row" else MIXED
        if len(args) > 1 and isinstance(args[1], torch.Tensor):  # elementwise max(a, b)
            return _pointwise([k0, self.value_kind(args[1])])
        if k0.kind in ("row", "const") or k0.kind == op:
            return k0
        return MIXED

    def _matmul(self, func: Any, args: tuple, kwargs: dict) -> Kind:
        packet = self.packet
        bias = None
        a, b = args[0], args[1]
        if packet in (_aten.addmm, _aten.baddbmm, _aten.addbmm, _aten.addmv):
            bias, a, b = args[0], args[1], args[2]
        ka, kb = self.value_kind(a), self.value_kind(b)
        contracted = a.shape[-1] if a.dim() else None
        product = _mul(ka, kb, None)
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
            if self.value_kind(self._arg(func, args, kwargs, name, 1)) != CONST:
                return MIXED
        return _add(self.value_kind(bias), product)

    # --- special ops (by name) ---------------------------------------------------------------

    def _embedding(self, func, args, kwargs, kinds):
        weight, indices = kinds[0], kinds[1] if len(kinds) > 1 else CONST
        if weight == CONST and indices.kind == "row" and indices.p == 0:
            return Kind("row", 0)
        return _pointwise(kinds) if weight == CONST else MIXED

    def _embedding_dense_backward(self, func, args, kwargs, kinds):
        grad = kinds[0]
        if grad.kind == "row":
            return Kind("sum", grad.p)
        if grad.kind == "rowratio":
            return Kind("ratio", 0)
        return MIXED

    def _nll_loss_forward(self, func, args, kwargs, kinds):
        x = kinds[0]
        reduction = self._arg(func, args, kwargs, "reduction", 1)
        if x.kind != "row" or x.p != 0:
            return MIXED
        # outputs: (loss, total_weight); one kind for both: the loss's (the count is read as a
        # sum by the ops that use it, see _div)
        return {0: Kind("row", 0), 1: Kind("ratio", 0), 2: Kind("sum", 0)}.get(reduction, MIXED)

    _nll_loss2d_forward = _nll_loss_forward

    def _nll_loss_backward(self, func, args, kwargs, kinds):
        grad = kinds[0]
        reduction = self._arg(func, args, kwargs, "reduction", 1)
        if reduction == 1:
            return Kind("rowratio", 0) if grad == CONST else MIXED
        if reduction == 2:
            return Kind("row", grad.p) if grad.kind == "const" else MIXED
        return grad if grad.kind == "row" else MIXED

    _nll_loss2d_backward = _nll_loss_backward

    def _mse_loss(self, func, args, kwargs, kinds):
        base = _pointwise(kinds)
        reduction = self._arg(func, args, kwargs, "reduction", 1)
        if base != Kind("row", 0):
            return MIXED if base != CONST else CONST
        return {0: base, 1: Kind("sum", -1), 2: Kind("sum", 0)}.get(reduction, MIXED)

    def _mse_loss_backward(self, func, args, kwargs, kinds):
        grad, rest = kinds[0], _pointwise(kinds[1:])
        reduction = self._arg(func, args, kwargs, "reduction", 1)
        if rest.kind != "row" or rest.p != 0:
            return MIXED
        if reduction == 0:
            return grad if grad.kind == "row" else MIXED
        if grad.kind != "const" or grad.p is None:
            return MIXED
        return Kind("row", grad.p - (1 if reduction == 1 else 0))

    def _native_layer_norm(self, func, args, kwargs, kinds):
        x = args[0]
        shape = self._arg(func, args, kwargs, "normalized_shape", ())
        normalized = range(x.dim() - len(shape), x.dim())
        if any(d in normalized for d in self.batch_dims(x)):
            return MIXED
        return _pointwise(kinds)

    def _native_layer_norm_backward(self, func, args, kwargs, kinds):
        grad, x = kinds[0], args[1]
        shape = self._arg(func, args, kwargs, "normalized_shape", ())
        normalized = range(x.dim() - len(shape), x.dim())
        if any(d in normalized for d in self.batch_dims(x)):
            return MIXED
        if _pointwise(kinds[1:]) not in (CONST, Kind("row", 0)):
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

    def _index(self, func, args, kwargs, kinds):
        x, indices = args[0], args[1]
        kx = self.value_kind(x)
        indexed = [d for d, i in enumerate(indices) if i is not None]
        kinds_i = [self.value_kind(i) for i in indices if i is not None]
        ki = CONST if all(k == CONST for k in kinds_i) else _pointwise(kinds_i)
        if kx.kind in ("row", "rowratio") and any(d in indexed for d in self.batch_dims(x)):
            return MIXED  # picks rows of the batch
        if kx.kind == "row" and ki in (CONST, Kind("row", 0)):
            return kx if ki == CONST or kx.p == 0 else MIXED
        return self._lookup(kx, ki)

    def _index_select(self, func, args, kwargs, kinds):
        x, dim, index = args[0], args[1], args[2]
        kx, ki = self.value_kind(x), self.value_kind(index)
        if kx.kind in ("row", "rowratio") and int(dim) % max(x.dim(), 1) in self.batch_dims(x):
            return MIXED
        return self._lookup(kx, ki)

    def _gather(self, func, args, kwargs, kinds):
        x, dim, index = args[0], args[1], args[2]
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

    def _index_put(self, func, args, kwargs, kinds):
        x, indices, values = args[0], args[1], args[2]
        accumulate = bool(self._arg(func, args, kwargs, "accumulate", False))
        kx, kv = self.value_kind(x), self.value_kind(values)
        kinds_i = [self.value_kind(i) for i in indices if i is not None]
        if all(k == CONST for k in kinds_i):
            if kx.kind == "row" and not self.batch_dims(values) and kv == CONST:
                return kx
            return join(kx, kv) or CONST if not accumulate else _add(kx, kv)
        if not self.batch_dims(x):  # rows of the batch land in a table without the batch dim
            return self._scattered(kx, kv, accumulate)
        return MIXED

    _unsafe_index_put = _index_put
    _index_put_impl = _index_put

    def _index_add(self, func, args, kwargs, kinds):
        x, dim, index, source = args[0], args[1], args[2], args[3]
        kx, ks = self.value_kind(x), self.value_kind(source)
        if self.value_kind(index) != CONST and not self.batch_dims(x):
            return self._scattered(kx, ks, True)
        if int(dim) % max(source.dim(), 1) in self.batch_dims(source):
            return self._scattered(kx, ks, True) if not self.batch_dims(x) else MIXED
        return _pointwise([kx, ks])

    def _scatter_add(self, func, args, kwargs, kinds):
        x, dim, src = args[0], args[1], args[3]
        kx, ks = self.value_kind(x), self.value_kind(src)
        if int(dim) % max(src.dim(), 1) in self.batch_dims(src) and not self.batch_dims(x):
            return self._scattered(kx, ks, True)
        if int(dim) % max(x.dim(), 1) in self.batch_dims(x):
            return MIXED
        return _pointwise(kinds)

    def _native_dropout(self, func, args, kwargs, kinds):
        return _pointwise(kinds)

    def _where(self, func, args, kwargs, kinds):
        return _pointwise(kinds)

    def _threshold_backward(self, func, args, kwargs, kinds):
        grad, x = kinds[0], kinds[1] if len(kinds) > 1 else CONST
        # grad * (x > threshold): linear in grad with a per-example 0/1 factor
        if grad.kind in ("row", "rowratio") and x in (CONST, Kind("row", 0)):
            return grad
        return _pointwise(kinds)

    def _softmax_backward_data(self, func, args, kwargs, kinds):
        if self._acts_on_batch(func, args, kwargs, args[0]):
            return MIXED
        return self._linear_in_grad(kinds)

    _log_softmax_backward_data = _softmax_backward_data

    def _tanh_backward(self, func, args, kwargs, kinds):
        return self._linear_in_grad(kinds)

    _sigmoid_backward = _tanh_backward
    _gelu_backward = _tanh_backward
    _silu_backward = _tanh_backward
    _elu_backward = _tanh_backward
    _leaky_relu_backward = _tanh_backward
    _softplus_backward = _tanh_backward
    _hardtanh_backward = _tanh_backward

    def _linear_in_grad(self, kinds):
        grad, rest = kinds[0], _pointwise(kinds[1:])
        if grad.kind in ("row", "rowratio") and rest in (CONST, Kind("row", 0)):
            return grad
        return _pointwise(kinds)


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


def _flat(x: Any) -> list[Any]:
    if isinstance(x, (list, tuple)):
        return [y for item in x for y in _flat(item)]
    return [x]


def _is_max(x: Any) -> bool:
    return isinstance(x, int) and x >= 2**62


def _same_size(x: Any, size: Any) -> bool:
    try:
        return bool(x == size)
    except Exception:  # symbolic comparison that cannot be decided
        return False
