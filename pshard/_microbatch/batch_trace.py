"""The trace of batch-dim analysis: fake inputs whose split dims share one symbolic size ``B``,
and a dispatch mode that gives every traced tensor its kind.

:class:`Trace` holds one trace's state: a ``ShapeEnv`` with the batch symbol ``B``, the fake
tensor mode, and the :class:`KindMode` that runs under it. :class:`KindMode` marks every tensor
computed from a split input (or from a size involving ``B``) with a
:class:`~pshard._microbatch.batch_kinds.Kind`, by the rules of
:mod:`pshard._microbatch.kind_rules`: a tensor's kind is that of its view joined with the writes
made into its storage, so in-place writes reach every alias.

Internal interface (used by :mod:`pshard._microbatch.batch_dim`):

- ``Trace(hint)``: ``fake_input(leaf, split_dim)``, ``fake_mode``, ``deps`` (the
  :class:`KindMode`), ``symbol``, ``env``, ``render(expr)``, ``size_expr(size)``,
  ``specialised_to()``.
- ``KindMode``: ``kind_of(tensor)``, ``restore()`` (the ``.grad`` of real tensors touched).
- ``is_fake(x)``: whether ``x`` is a fake tensor.

The private torch APIs it needs (fake tensors, dynamo's ``ConstantSource``, dispatch modes,
functorch's wrapped tensors) come from :mod:`pshard._compat`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import optree
import torch

from .._compat import (
    OpOverload,
    TorchDispatchMode,
    constant_source,
    fake_tensor_types,
    is_wrapped,
    symbolic_reference,
)
from .._core.tree import NAMESPACE
from .batch_kinds import CONST, MIXED, Kind, join
from .kind_rules import Rules, output_kinds

__all__ = ["KindMode", "Trace", "is_fake"]


def _storage_key(t: torch.Tensor) -> tuple[int, Any]:
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):
        return id(t), t
    return storage._cdata, storage


class KindMode(TorchDispatchMode):
    """Runs under the fake mode of a trace and gives every tensor its :class:`Kind` (how it
    depends on the batch), by the rules of :mod:`pshard._microbatch.batch_kinds`.

    A tensor's kind is that of its view (tensors made by an op) joined with the writes made
    into its storage (so an in-place write of batch values into a buffer, or into a view of
    one, reaches every alias). Real tensors reaching an op (parameters and buffers of modules
    captured by ``fn``) are swapped for fake copies first, so no op computes on or writes to
    real data; :meth:`restore` puts back the ``.grad`` of any real leaf that autograd touched.
    """

    # Higher-order operators (flex_attention, cond, ...) come through __torch_dispatch__ too.
    supports_higher_order_operators = True

    def __init__(self, symbol: Any, fake_mode: Any) -> None:
        super().__init__()
        self._symbol = symbol
        self._fake_mode = fake_mode
        self._views: dict[int, tuple[Any, Kind]] = {}  # id -> (tensor kept alive, kind)
        self._writes: dict[int, tuple[Any, Kind | None]] = {}  # storage -> (storage, kind)
        self._real_leaves: dict[int, tuple[torch.Tensor, Any]] = {}  # id -> (tensor, .grad)
        self.rules = Rules(self.kind_of, self.is_batch, self.power, self.sign)

    # --- kinds ------------------------------------------------------------------------------

    def set_kind(self, t: torch.Tensor, kind: Kind | None) -> None:
        self._views[id(t)] = (t, kind or CONST)

    def write(self, t: torch.Tensor, kind: Kind | None) -> None:
        key, keep = _storage_key(t)
        old = self._writes.get(key, (keep, None))[1]
        whole = t.numel() == _storage_numel(t)
        self._writes[key] = (keep, kind if whole else join(old, kind))
        self.set_kind(t, kind if whole else join(self.kind_of(t), kind))

    def kind_of(self, t: torch.Tensor) -> Kind | None:
        view = self._views.get(id(t))
        kind = view[1] if view is not None and view[0] is t else None
        written = self._writes.get(_storage_key(t)[0])
        if written is not None:
            kind = join(kind, written[1])
        return None if kind == CONST else kind

    def is_batch(self, size: Any) -> bool:
        return isinstance(size, torch.SymInt) and self._symbol in size.node.expr.free_symbols

    def power(self, x: Any) -> int | None:
        expr = x.node.expr
        if self._symbol not in expr.free_symbols:
            return 0
        for p in range(-4, 5):
            if self._symbol not in (expr / self._symbol**p).free_symbols:
                return p
        return None

    @staticmethod
    def sign(x: Any) -> int | None:
        if isinstance(x, bool) or x is None:
            return None
        if isinstance(x, (int, float)):
            return (x > 0) - (x < 0)
        if isinstance(x, (torch.SymInt, torch.SymFloat)):
            hint = x.node.hint
            return None if hint is None else (hint > 0) - (hint < 0)
        return None

    # --- real tensors -------------------------------------------------------------------------

    def _fake(self, x: Any) -> Any:
        if not isinstance(x, torch.Tensor) or is_fake(x):
            return x
        if x.is_leaf and id(x) not in self._real_leaves:
            self._real_leaves[id(x)] = (x, x.grad)
        return _fake_like(self._fake_mode, x)

    def restore(self) -> None:
        for tensor, grad in self._real_leaves.values():
            if tensor.grad is not grad:
                tensor.grad = grad

    def __torch_dispatch__(
        self,
        func: Callable[..., Any],
        types: Sequence[type],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        call: Any = (args, kwargs or {})
        leaves: list[Any] = optree.tree_leaves(call, namespace=NAMESPACE)
        if any(isinstance(x, torch.Tensor) and not is_fake(x) for x in leaves):
            call = optree.tree_map(self._fake, call, namespace=NAMESPACE)
            leaves = optree.tree_leaves(call, namespace=NAMESPACE)
        args, kwargs = call
        reference = symbolic_reference(func)  # (a kernel that would fix the batch size)
        out = (func if reference is None else reference)(*args, **kwargs)
        inputs = [x for x in leaves if isinstance(x, (torch.Tensor, torch.SymInt, torch.SymFloat))]
        if not isinstance(func, OpOverload):  # a higher-order op: no rule
            kind = MIXED if any(self.rules.value_kind(x) != CONST for x in inputs) else CONST
        else:
            kind = self.rules.apply(func, args, kwargs, inputs)
        written: set[int] = set()
        schema = getattr(func, "_schema", None)
        for i, argument in enumerate(schema.arguments if schema is not None else ()):
            alias = argument.alias_info
            if alias is not None and alias.is_write:
                target: Any = args[i] if i < len(args) else kwargs.get(argument.name)
                for t in optree.tree_leaves(target, namespace=NAMESPACE):
                    if isinstance(t, torch.Tensor):
                        self.write(t, kind)
                        written.add(_storage_key(t)[0])
        positions = list(out) if isinstance(out, (tuple, list)) else [out]
        for part, k in zip(positions, output_kinds(func, kind, len(positions)), strict=True):
            for t in optree.tree_leaves(part, namespace=NAMESPACE):
                if isinstance(t, torch.Tensor) and _storage_key(t)[0] not in written:
                    self.set_kind(t, k)
        return out


def _storage_numel(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().nbytes() // max(t.element_size(), 1)
    except (RuntimeError, NotImplementedError, TypeError):
        return t.numel()


def _fake_like(fake_mode: Any, x: torch.Tensor) -> torch.Tensor:
    """A fake tensor with ``x``'s metadata; a tensor wrapped by a ``torch.func`` transform is
    described by its logical shape (the transform does not change the answer)."""
    if not is_wrapped(x):
        return fake_mode.from_tensor(x, static_shapes=True)
    with fake_mode:
        return torch.empty(tuple(x.shape), dtype=x.dtype, device=x.device)


def is_fake(x: Any) -> bool:
    """Whether ``x`` is a fake tensor (of this trace or of an enclosing one)."""
    return isinstance(x, fake_tensor_types()[0])


class Trace:
    """The state of one trace: shape env, batch symbol and dependence marks."""

    def __init__(self, hint: int) -> None:
        from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

        fake_tensor_mode = fake_tensor_types()[1]

        self.hint = hint
        self.env = ShapeEnv(
            allow_scalar_outputs=False,
            allow_dynamic_output_shape_ops=False,
            specialize_zero_one=False,
        )
        source = constant_source("pshard_batch_size")
        self.symbol = self.env.create_symbol(hint, source, dynamic_dim=DimDynamic.DYNAMIC)
        self.batch = self.env.create_symintnode(self.symbol, hint=hint, source=source)
        self.fake_mode = fake_tensor_mode(shape_env=self.env, allow_non_fake_inputs=True)
        self.deps = KindMode(self.symbol, self.fake_mode)

    def fake_input(self, leaf: Any, split_dim: int | None) -> Any:
        if not isinstance(leaf, torch.Tensor):
            return leaf
        if split_dim is None:
            fake = _fake_like(self.fake_mode, leaf)
        else:
            sizes = [self.batch if d == split_dim else int(s) for d, s in enumerate(leaf.shape)]
            # Keep the memory layout (outermost dim first) so layout-sensitive ops behave alike.
            try:
                strides = [leaf.stride(d) for d in range(leaf.dim())]
                order = sorted(range(leaf.dim()), key=lambda d: (-strides[d], d))
            except RuntimeError:  # a tensor of a torch.func transform: no strides
                order = list(range(leaf.dim()))
            with self.fake_mode:
                fake = torch.empty_permuted(sizes, order, dtype=leaf.dtype, device=leaf.device)
            self.deps.set_kind(fake, Kind("row", 0))
        if leaf.requires_grad and not fake.requires_grad:
            fake.requires_grad_(True)
        return fake

    def render(self, expr: Any) -> str:
        """``expr`` written with ``B`` for the batch symbol (a plain sympy ``Symbol("B")``)."""
        return str(expr.subs(self.symbol, type(self.symbol)("B")))

    def size_expr(self, size: Any) -> Any:
        if isinstance(size, torch.SymInt):
            return self.env.simplify(size.node.expr)
        return int(size)

    def specialised_to(self) -> Any:
        """The value the batch symbol was fixed to by a guard, or None if it stayed free."""
        replaced = self.env.replace(self.symbol)
        if replaced != self.symbol:
            return replaced
        bounds = self.env.var_to_range.get(self.symbol)
        if bounds is not None and bounds.lower == bounds.upper:
            return bounds.lower
        return None
