"""Batch-dim analysis: which outputs of a function carry the batch dim.

:func:`infer_out_specs` runs a function once on fake tensors (no real compute) in which the split
dim of every ``Shard`` input has the same *symbolic* size ``B`` (the batch size) and every other
dim keeps its static size. Symbolic shapes make the answer exact: an output dim is the batch dim
exactly when its size is the symbol ``B``, whatever reshapes, permutes or reductions produced it.
A dispatch mode marks every tensor computed from a split input (or from a size involving ``B``),
which separates the outputs that need a reduction over microbatches from those that do not.

What each traced value is (per-example, a reduction over the batch, ...) is its kind
(:mod:`pshard._microbatch.batch_kinds`), which the rules of :mod:`pshard._microbatch.kind_rules`
give every op's outputs while the trace runs (:mod:`pshard._microbatch.batch_trace`: the fake
inputs and the dispatch mode). This module runs the trace and turns the kinds of the outputs into
specs.

One cache: :data:`_CACHE`, the traced out specs per function and input signature (and grad mode
and weighting), registered as ``"inferred out specs"`` with :mod:`pshard._core.caches` (so
:func:`pshard.clear_caches` empties it). It keeps functions only weakly, so a bound method,
closure or module is not kept alive by having been analysed.
"""

from __future__ import annotations

import collections
import enum
import re
import threading
import weakref
from collections.abc import Callable, Sequence
from types import MappingProxyType
from typing import Any

import optree
import torch

from .._compat import outside_transforms
from .._core.caches import register
from .._core.checks import fn_name
from .._core.placements import Partial, Placement, Replicate, Shard
from .._core.specs import default_spec, rebuild_spec_tree
from .._core.tree import (
    NAMESPACE,
    article,
    keystr,
    tree_flatten_with_path,
    tree_unflatten,
)
from .._modules.adapter import prepare_tracing
from .batch_kinds import CONST, Kind, describe_kind
from .batch_trace import Trace, is_fake
from .fn_state import state_key
from .split import Inputs, resolve_inputs

__all__ = ["infer_out_specs", "out_specs_of_inputs"]

# The example value of the batch symbol while tracing: the first prime >= this that no input dim
# has. It is deliberately not the real batch size, so that a batch of 1 is not specialised by
# broadcasting and a batch size equal to another dim's size cannot be mistaken for that dim; and
# small, so that a loop over the batch (``for row in x``, ``unbind``) stays cheap to trace.
_HINT_START = 17

_MAX_SIGNATURES_PER_FN = 32

_SCALAR_TYPES = (
    bool,
    int,
    float,
    complex,
    str,
    bytes,
    type(None),
    type(Ellipsis),
    enum.Enum,
    torch.dtype,
    torch.device,
    torch.layout,
    torch.memory_format,
)


# --------------------------------------------------------------------------------------------
# Pytree access.


def _spec_tree(treedef: optree.PyTreeSpec, specs: Sequence[Any]) -> Any:
    """The spec tree of ``specs`` in the output's structure (each container rebuilt as its own
    type where its constructor takes placements, see :func:`rebuild_spec_tree`)."""
    try:
        return tree_unflatten(treedef, specs)
    except Exception:  # a constructor choked on a placement: rebuild node by node
        return rebuild_spec_tree(treedef, iter(specs), keyed_as_dict=False)


def _flatten(tree: Any, root: str) -> tuple[list[str], list[Any], optree.PyTreeSpec]:
    """Leaves of ``tree`` with their key paths rendered under ``root`` (``output[1]['x']``)."""
    paths, leaves, treedef = tree_flatten_with_path(tree)
    return [keystr(path, root) for path in paths], leaves, treedef


# --------------------------------------------------------------------------------------------
# Input specs.


def _shape_str(shape: Sequence[Any]) -> str:
    return "(" + ", ".join(str(s) for s in shape) + ("," if len(shape) == 1 else "") + ")"


def _check_inputs(where: str, inputs: Inputs) -> list[int | None]:
    """What the analysis needs of resolved inputs beyond the split plan: real values, and
    tensors for every ``Shard``; each leaf's split dim."""
    if inputs.plan.recheck is not None:  # the quick plan leaves sizes to the split: compare now
        inputs.plan = inputs.plan.recheck()
    for i, (leaf, spec) in enumerate(zip(inputs.leaves, inputs.specs, strict=True)):
        if is_fake(leaf):
            raise ValueError(
                f"{where} {inputs.name_of(i)}: the input is already a fake tensor (an enclosing "
                f"trace); batch-dim analysis cannot run inside another trace: pass out_specs "
                f"explicitly"
            )
        if type(spec) is Shard and not isinstance(leaf, torch.Tensor):
            raise ValueError(
                f"{where} {inputs.name_of(i)}: {spec!r} but the value is "
                f"{article(type(leaf).__name__)}, not a tensor; only tensors can be split: use "
                f"Replicate() or None for it"
            )
    return inputs.split_dims()


# --------------------------------------------------------------------------------------------
# Cache.


# What one trace gives: the output's structure and the spec of each of its leaves.
_Traced = tuple[optree.PyTreeSpec, list[Placement]]
_Table = collections.OrderedDict[Any, _Traced]  # input signature -> traced, least recent first


class _TraceCache:
    """Out specs per function and input signature, holding functions weakly.

    A bound method is keyed on its instance (weakly) and its function, so ``obj.method`` (a new
    object at every attribute access) still hits. Functions that cannot be weakly referenced or
    hashed, and signatures with unhashable non-tensor leaves, are not cached. At most
    ``_MAX_SIGNATURES_PER_FN`` signatures are kept per function (least recently used dropped).
    """

    def __init__(self) -> None:
        self._entries: weakref.WeakKeyDictionary[Any, dict[Any, _Table]] = (
            weakref.WeakKeyDictionary()
        )
        self._lock = threading.Lock()

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    @staticmethod
    def _owner(fn: Any) -> tuple[Any, Any]:
        self_obj = getattr(fn, "__self__", None)
        func = getattr(fn, "__func__", None)
        if self_obj is not None and func is not None:
            return self_obj, func
        return fn, None

    def _table(self, fn: Any, create: bool) -> _Table | None:
        owner, func = self._owner(fn)
        try:
            per_owner = self._entries.get(owner)
            if per_owner is None:
                if not create:
                    return None
                per_owner = self._entries[owner] = {}
        except TypeError:  # not weakly referenceable or not hashable
            return None
        table = per_owner.get(func)
        if table is None and create:
            table = per_owner[func] = collections.OrderedDict()
        return table

    def get(self, fn: Any, signature: Any) -> _Traced | None:
        with self._lock:
            table = self._table(fn, create=False)
            if table is None or signature not in table:
                return None
            table.move_to_end(signature)
            return table[signature]

    def put(self, fn: Any, signature: Any, value: _Traced) -> None:
        with self._lock:
            table = self._table(fn, create=True)
            if table is None:
                return
            table[signature] = value
            while len(table) > _MAX_SIGNATURES_PER_FN:
                table.popitem(last=False)


_CACHE = _TraceCache()
register("inferred out specs", _CACHE.clear)


def _signature(
    treedef: optree.PyTreeSpec,
    leaves: Sequence[Any],
    specs: Sequence[Any],
    split_dims: Sequence[int | None],
) -> Any:
    """Hashable description of the inputs, or None when it cannot be hashed. The batch size is
    left out: the analysis does not depend on it, so a smaller last batch hits the cache."""
    parts: list[Any] = [treedef]
    for leaf, spec, dim in zip(leaves, specs, split_dims, strict=True):
        if isinstance(leaf, torch.Tensor):
            shape = tuple(None if d == dim else int(s) for d, s in enumerate(leaf.shape))
            parts.append(
                ("tensor", shape, dim, leaf.dtype, leaf.device, leaf.requires_grad, leaf.layout)
            )
        else:
            parts.append(("value", type(leaf), leaf, spec is not None))
    key = tuple(parts)
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _next_prime(n: int, exclude: set[int]) -> int:
    while n in exclude or any(n % p == 0 for p in range(2, int(n**0.5) + 1)):
        n += 1
    return n


_MERGES = MappingProxyType(
    {
        Kind("const", 0): Replicate(),
        Kind("const", 1): Partial("sum"),
        Kind("sum", 0): Partial("sum"),
        Kind("sum", -1): Partial("mean"),
        Kind("max", 0): Partial("max"),
        Kind("min", 0): Partial("min"),
    }
)


def _merge_spec(
    where: str, kind: Kind | None, dim: int | None, shape: str, allow_ratio: bool
) -> Placement:
    """The out spec of an output of ``kind`` (``dim``: its dim of size ``B``, if any), or an
    error saying why no merge of microbatches reproduces it."""
    kind = kind or CONST
    if dim is not None and kind == Kind("row", 0):
        return Shard(dim)
    if dim is None and kind in _MERGES:
        return _MERGES[kind]
    if dim is None and kind == Kind("ratio", 0):
        if allow_ratio:
            return Partial("mean")
        raise ValueError(
            f"{where}: the output (shape {shape}) is {describe_kind(kind)}, such as a mean over "
            f"the non-ignored targets (cross_entropy's default) or a token-mean loss; its "
            f"microbatches must be weighted by their denominators: give pmap_microbatch a "
            f"weight_fn returning each microbatch's count (e.g. lambda *mb: (labels != -100)"
            f".sum()), or pass out_specs explicitly"
        )
    if dim is not None:
        what = "per-example values" if kind.kind == "row" else describe_kind(kind)
        detail = (
            f" scaled by B**{kind.p} (for instance the gradient of a mean with respect to a "
            f"split input), so each microbatch scales them by its own size"
            if kind.kind == "row"
            else ", so its rows depend on the rest of the batch"
        )
        raise ValueError(
            f"{where}: dim {dim} has the batch size (shape {shape}) but the values are "
            f"{what}{detail}; concatenating microbatches would not give the whole batch's: "
            f"pass out_specs explicitly"
        )
    raise ValueError(
        f"{where}: the output (shape {shape}) is {describe_kind(kind)}; no merge of "
        f"microbatches (concatenation, sum, mean, max, min) gives the whole batch's value: "
        f"pass out_specs explicitly"
    )


def _leaf_spec(where: str, leaf: Any, trace: Trace, allow_ratio: bool = False) -> Placement:
    """The out spec of one output leaf."""
    symbol = trace.symbol
    if isinstance(leaf, torch.Tensor):
        exprs = [trace.size_expr(s) for s in leaf.shape]
        shape = _shape_str([trace.render(e) if not isinstance(e, int) else e for e in exprs])
        exact = [d for d, e in enumerate(exprs) if not isinstance(e, int) and e == symbol]
        derived = [
            d
            for d, e in enumerate(exprs)
            if not isinstance(e, int) and e != symbol and symbol in e.free_symbols
        ]
        if derived:
            d = derived[0]
            raise ValueError(
                f"{where}: dim {d} has size {trace.render(exprs[d])} (shape {shape}), an "
                f"expression of the batch size B rather than B itself (e.g. a reshape merged "
                f"the batch dim with another dim), so it cannot be split as Shard({d}); keep "
                f"the batch dim separate or pass out_specs explicitly"
            )
        if len(exact) > 1:
            dims = ", ".join(map(str, exact[:-1])) + f" and {exact[-1]}"
            raise ValueError(
                f"{where}: the batch size B is the size of dims {dims} (shape {shape}), so "
                f"the batch dim is ambiguous; pass out_specs explicitly"
            )
        kind = trace.deps.kind_of(leaf) if is_fake(leaf) else None
        return _merge_spec(where, kind, exact[0] if exact else None, shape, allow_ratio)
    if isinstance(leaf, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        expr = trace.env.simplify(leaf.node.expr)
        if symbol in getattr(expr, "free_symbols", ()):
            number = type(leaf).__name__.replace("Sym", "").lower()
            raise ValueError(
                f"{where}: a Python {number} computed from the batch size ({trace.render(expr)}); "
                f"each microbatch would give a different value and Python numbers cannot be "
                f"merged: compute it outside the function or pass out_specs explicitly"
            )
        return Replicate()
    if isinstance(leaf, torch.Size):
        for size in leaf:
            _leaf_spec(where, size, trace)
        return Replicate()
    if isinstance(leaf, _SCALAR_TYPES):
        return Replicate()
    raise ValueError(
        f"{where}: {article(type(leaf).__qualname__)} is neither a tensor, a Python scalar nor a "
        f"pytree container pshard can see into; register it as a pytree node (optree namespace "
        f"'pshard') or pass out_specs explicitly"
    )


# how to do without inference (the end of the errors above)
_PASS_OUT_SPECS = (
    "pass out_specs explicitly: out_specs=ps.Partial('mean') for a mean loss and its gradients "
    "(token-weighted with weight_fn), ps.Partial('sum') for sums, ps.Shard(0) for outputs "
    "that keep the batch dim, or a tree of them"
)


def _trace_out_specs(
    where: str,
    fn: Callable[..., Any],
    treedef: optree.PyTreeSpec,
    leaves: Sequence[Any],
    split_dims: Sequence[int | None],
    allow_ratio: bool = False,
) -> _Traced:
    static = {
        int(s)
        for leaf, dim in zip(leaves, split_dims, strict=True)
        if isinstance(leaf, torch.Tensor)
        for d, s in enumerate(leaf.shape)
        if d != dim
    }
    trace = Trace(_next_prime(_HINT_START, static))
    prepare_tracing()  # model families skip their checks on values
    # The answer depends on fn and the inputs' metadata only: the trace runs outside any
    # torch.func transform that is calling us (grad, vmap, ...).
    with outside_transforms():
        fake_leaves = [
            trace.fake_input(leaf, dim) for leaf, dim in zip(leaves, split_dims, strict=True)
        ]
    args, kwargs = tree_unflatten(treedef, fake_leaves)
    try:
        with outside_transforms(), trace.fake_mode, trace.deps:
            out = fn(*args, **kwargs)
    except Exception as error:
        detail = re.sub(rf"\b{trace.symbol}\b", "B", str(error))
        raise ValueError(
            f"{where}: tracing the function on fake tensors (batch size as a symbol B, example "
            f"value {trace.hint}) failed with {type(error).__name__}: {detail}. Batch-dim "
            f"analysis cannot follow data-dependent Python control flow (`if tensor:`), "
            f"`.item()`, `.tolist()` or ops whose output shape depends on values (nonzero, "
            f"boolean masks); {_PASS_OUT_SPECS}"
        ) from error
    finally:
        trace.deps.restore()
    value = trace.specialised_to()
    if value is not None:
        raise ValueError(
            f"{where}: the function only works for one batch size: tracing it with a symbolic "
            f"batch size B forced B == {value} (by a Python loop over the batch dim, `unbind`, "
            f"or combining the batch dim with a dim of that fixed size, as Hugging Face models "
            f"do); batch-dim analysis cannot follow it: {_PASS_OUT_SPECS}"
        )
    out_names, out_leaves, out_treedef = _flatten(out, "output")
    specs = [
        _leaf_spec(f"{where} {n}", leaf, trace, allow_ratio)
        for n, leaf in zip(out_names, out_leaves, strict=True)
    ]
    return out_treedef, specs


def out_specs_of_inputs(
    fn: Callable[..., Any],
    inputs: Inputs,
    *,
    api: str = "infer_out_specs",
    allow_ratio: bool = False,
) -> Any:
    """Out spec tree of ``fn`` for inputs resolved by
    :func:`pshard._microbatch.split.resolve_inputs` (the positional and keyword parts), cached
    per ``fn`` and input signature (treedef, shapes without the batch size, dtypes, devices,
    requires_grad, split dims, non-tensor values, grad mode, weighting); errors are not cached.
    ``api`` starts every error (``"api(fn_name) ..."``); ``allow_ratio`` (``pmap_microbatch`` with a
    ``weight_fn``) merges ratios of batch sums as ``Partial("mean")``."""
    where = f"{api}({fn_name(fn)})"
    split_dims = _check_inputs(where, inputs)
    treedef = optree.treespec_tuple(inputs.defs, namespace=NAMESPACE)
    leaves, specs = inputs.leaves, inputs.specs
    signature = _signature(treedef, leaves, specs, split_dims)
    state = state_key(fn)
    if signature is not None and state is not None:  # and everything else the answer depends on
        signature = (
            signature, state, allow_ratio, torch.is_grad_enabled(),
            torch.is_inference_mode_enabled(),
        )  # fmt: skip
    else:
        signature = None
    cached = None if signature is None else _CACHE.get(fn, signature)
    if cached is None:
        cached = _trace_out_specs(where, fn, treedef, leaves, split_dims, allow_ratio)
        if signature is not None:
            _CACHE.put(fn, signature, cached)
    out_treedef, out_specs = cached
    return _spec_tree(out_treedef, out_specs)


def infer_out_specs(
    fn: Callable[..., Any],
    /,
    *args: Any,
    in_specs: Any = None,
    kw_specs: Any = None,
    **kwargs: Any,
) -> Any:
    """Infer the out specs of ``fn(*args, **kwargs)`` when its inputs are split into microbatches.

    ``fn`` is traced once on fake tensors (no real compute): the split dim of every ``Shard(d)``
    input gets one shared symbolic size ``B`` (the batch size), every other dim keeps its size,
    and every traced value gets a kind saying how it depends on the batch
    (:mod:`pshard._microbatch.batch_kinds`: per-example rows, a sum / max / min over the batch
    times a power of ``B``, a ratio of batch sums, or a mix). Each output leaf then gets:

    - ``Shard(d)`` when its dim ``d`` has size exactly ``B`` and its rows are per-example values;
    - ``Partial(r)`` when it is a reduction over the batch, ``r`` the reduction the trace
      applies: ``"sum"``, ``"mean"`` (a sum divided by ``B``), ``"max"``, ``"min"``;
    - ``Replicate()`` when it does not depend on the split inputs at all (e.g. a function of the
      parameters only), and for Python scalars and ``None``.

    Anything else is an error naming the output and asking for ``out_specs``: inference is
    exact or refuses. That includes a mean over tokens (a ratio of two sums over the batch,
    such as ``cross_entropy``'s mean over non-ignored targets: ``pmap_microbatch`` accepts it
    as ``Partial("mean")`` when given a ``weight_fn``), the square of a mean, a value minus the
    batch mean, one row of the batch, batch norm in training mode, and the gradient of a mean
    with respect to a split input (per-example values scaled by ``1 / B``). Pseudo-code::

        B = Symbol()                        # shared by every Shard input's split dim
        out = fn(*fake(args, B), **fake(kwargs, B))
        spec(leaf) = Shard(d)          if leaf.shape[d] == B and its rows are per-example
                     Partial(r)        if leaf is the reduction r over the batch
                     Replicate()       if leaf does not depend on a Shard input
                     error             otherwise

    The trace runs outside any ``torch.func`` transform that is calling it and builds its fake
    inputs from the arguments' metadata, so the answer is the same under ``grad``, ``vmap`` or
    ``requires_grad`` inputs as in a plain call. It is cached per ``fn`` (held weakly) and
    input signature (tree structure, shapes apart from the batch size, dtypes, specs, non-tensor
    argument values, ``requires_grad``, grad mode); the cache assumes ``fn``'s behaviour depends
    only on that (not on, say, a closure whose shapes change).

    The batch symbol's example value while tracing is a small prime that no input dim has
    (``17`` unless taken), never the real batch size: a batch of 1 is not specialised away by
    broadcasting, and a batch size equal to another dim's size is never mistaken for it.
    Python side effects of ``fn`` happen during the trace (on fake values). Not supported (an
    error that asks for explicit out specs): a Python loop over the batch dim, ``.item()`` and
    other data-dependent values, higher-order operators (``torch.cond``) fed by the batch, flex
    attention (its eager path compiles, which refuses the tracing mode), and analysis nested
    inside another trace.

    Args:
        fn: the function; it may call ``nn.Module``\\ s (their parameters and buffers stay
            real and are never modified; ``.grad`` is restored), ``torch.func`` transforms,
            autograd and higher-order ops such as ``torch.cond``.
        *args: positional arguments for ``fn``.
        in_specs: a prefix tree of ``args`` of ``Shard(d)``, ``Replicate()`` or ``None``
            (= ``Replicate()``). Default: ``Shard(0)`` for tensors with at least one dim,
            ``Replicate()`` for everything else (``pmap_microbatch``'s default).
        kw_specs: the same for ``kwargs`` (a prefix tree of the kwargs dict).
        **kwargs: keyword arguments for ``fn``.

    Returns:
        A spec tree with the structure of ``fn``'s output (``None`` outputs stay ``None``, which
        as a spec means ``Replicate()``).

    Raises:
        ValueError: naming the function and the output path (``infer_out_specs(loss_fn)
            output[1]['logits']: ...``) when an output is not one of the kinds above (saying
            which kind it is), has the batch size in two dims, or has a dim that is an
            expression of it (``2*B`` after a reshape), or is a Python number computed from it;
            when tracing fails (data-dependent control flow, ``.item()``);
            when the Shard inputs disagree on the batch size; for specs that are not a prefix of
            the arguments or do not fit their leaf (``TypeError`` for a spec that is not
            ``Shard``/``Replicate``/``None``).

    Example:
        >>> import torch
        >>> import pshard as ps
        >>> def loss_fn(w, x):
        ...     logits = x @ w
        ...     return logits.logsumexp(-1).mean(), {"logits": logits, "w_norm": w.norm(),
        ...                                          "top": logits.amax(0), "n": x.sum(0)}
        >>> loss, rest = ps.infer_out_specs(loss_fn, torch.ones(3, 5), torch.ones(8, 3),
        ...                                 in_specs=(ps.Replicate(), ps.Shard(0)))
        >>> loss, rest["logits"], rest["w_norm"], rest["top"], rest["n"]
        (Partial('mean'), Shard(0), Replicate(), Partial('max'), Partial('sum'))
    """
    api = "infer_out_specs"
    if not callable(fn):
        raise TypeError(f"{api}: fn must be callable, got {fn!r} ({type(fn).__name__})")
    inputs = resolve_inputs(
        [(args, in_specs, "in_specs"), (kwargs, kw_specs, "kw_specs")],
        where=f"{api}({fn_name(fn)})",
        allowed=(Shard, Replicate),
        default=default_spec,
    )
    return out_specs_of_inputs(fn, inputs, api=api)
