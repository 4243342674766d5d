"""``pmap_microbatch``: run a function over microbatches of its inputs and merge the results.

The inputs are cut by :func:`pshard.split`'s rules, the function runs on one microbatch at a
time, and each output leaf is reduced as soon as its microbatch finishes (the streaming form of
:func:`pshard.merge`), so at most one microbatch's intermediate values are alive at once.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from optree import PyTreeSpec

from .._core.annotations import default_in_specs, default_out_specs
from .._core.checks import check_int, fn_name
from .._core.placements import Partial, Replicate, Shard
from .._core.specs import default_spec, resolve_specs
from .._core.tree import is_block_mask, keystr, tree_flatten
from .._runtime.debug import debug_enabled
from .batch_dim import out_specs_of_inputs
from .merge import flatten_like
from .reducers import ReduceError, Reducer, make_reducer, weight_value
from .split import Inputs, resolve_inputs, split_columns

__all__ = ["pmap_microbatch"]

F = TypeVar("F", bound=Callable[..., Any])

_IN_SPECS = (Shard, Replicate)
_OUT_SPECS = (Shard, Replicate, Partial)


def _infer_out_specs(fn: Callable[..., Any], inputs: Inputs, weighted: bool) -> Any:
    """The out spec tree of ``fn`` by batch-dim analysis (``out_specs="infer"``), cached there
    per function and input signature."""
    for i, (leaf, spec) in enumerate(zip(inputs.leaves, inputs.specs, strict=True)):
        if type(spec) is Shard and is_block_mask(leaf):
            raise ValueError(
                f"pmap_microbatch({fn_name(fn)}) {inputs.name_of(i)}: out_specs='infer' cannot "
                "trace a function through a BlockMask it splits (flex attention does not run on "
                "fake tensors); pass out_specs explicitly, e.g. out_specs=ps.Shard(0)"
            )
    return out_specs_of_inputs(fn, inputs, api="pmap_microbatch", allow_ratio=weighted)


def pmap_microbatch(
    fn: F | None = None,
    /,
    *,
    num_microbatches: int | None = None,
    microbatch_size: int | None = None,
    in_specs: Any = None,
    kw_specs: Any = None,
    out_specs: Any = "infer",
    weight_fn: Callable[..., Any] | None = None,
    accum_dtype: torch.dtype | None = None,
) -> Any:
    """Run ``fn`` over microbatches of its inputs, one at a time, and merge the results.

    The positional and keyword arguments are split by :func:`pshard.split`'s rules
    (``in_specs``/``kw_specs``), ``fn`` runs on each microbatch in turn, and each output leaf
    is combined by its spec in ``out_specs`` as soon as its microbatch finishes::

        chunks = split((args, kwargs), (in_specs, kw_specs), k)
        for i, (a, kw) in enumerate(chunks):
            out = fn(*a, **kw)
            w_i = weight_fn(*a, **kw) if weight_fn else size of microbatch i
            for each leaf of out and its spec in out_specs:
                Shard(d):         write leaf into its place along d of the merged output
                Partial("sum"):   acc += leaf          ("max"/"min" likewise)
                Partial("mean"):  acc = sum_i(w_i * leaf_i) / sum_i(w_i)  (a running mean)
                Replicate():      the value of microbatch 0
            del out                # nothing of microbatch i is kept but the accumulators
        return the merged outputs

    Peak memory is therefore one microbatch's intermediate values plus the accumulators and
    the ``Shard`` outputs: no list of every microbatch's outputs is kept. ``Shard`` outputs go
    into one preallocated buffer once microbatch 0 shows their shape (the total along the split
    dim is known from the input sizes).

    Composition with gradients (as optax's ``microbatch``):

    - ``pmap_microbatch(torch.func.grad_and_value(loss))`` is gradient accumulation: each
      microbatch's forward and backward run and are freed before the next, and the gradients,
      being ``Partial("mean")`` outputs, are averaged (weighted by ``weight_fn`` if given). This
      is the memory-saving form. Pass parameters that do not require grad (``.detach()``), or
      eager autograd keeps every microbatch's graph to differentiate the result again.
    - ``torch.func.grad(pmap_microbatch(loss))`` (or ``.backward()`` on its result) is also
      exact, but autograd keeps every microbatch's graph until the backward pass, so it saves
      no memory.

    With ``weight_fn`` returning each microbatch's count of tokens (non-ignored labels) and
    ``loss`` returning the mean over its tokens, both the merged loss and the merged gradients
    are exactly the token mean over the whole batch, however unevenly the tokens fall. A
    microbatch of weight 0 contributes nothing to any ``"mean"`` output (no NaN either, even if
    its own mean is ``0/0``); if every weight is 0 the means are zeros. A tensor weight is read
    on the host once per microbatch (a device sync) to know this; under ``vmap``, where it
    cannot be read, a zero weight is applied by selection (NaN-free values, but a gradient
    through a ``0/0`` stays NaN).

    Args:
        fn: the function. Called as ``fn(*args, **kwargs)`` once per microbatch.
        num_microbatches: how many microbatches (sizes differ by at most one, larger first).
        microbatch_size: instead, the largest microbatch: ``ceil(batch / microbatch_size)``
            microbatches, sizes differing by at most one (so none exceeds it). Give exactly one
            of ``num_microbatches`` and ``microbatch_size``.
        in_specs: a prefix tree of the positional arguments (a tuple, one entry per argument,
            or one spec for all) of ``Shard(d)``, ``Replicate()`` or ``None``. Default: the
            specs annotated on ``fn``'s parameters and on the fields of dataclass arguments
            (:func:`pshard.specs_of`; ``Replicate()`` for the rest), or, when nothing is
            annotated, ``Shard(0)`` for every tensor with a dim and every ``BlockMask``,
            ``Replicate()`` for everything else (so give parameters ``None``).
        kw_specs: the same for the keyword arguments (a prefix tree of the kwargs dict).
        out_specs: a prefix tree of ``fn``'s output of ``Shard(d)`` (concatenate),
            ``Partial("sum" | "mean" | "max" | "min")`` (reduce), ``Replicate()`` or ``None``
            (take microbatch 0's). ``"infer"`` (default) takes them from ``fn``'s return
            annotation (``-> Annotated[torch.Tensor, ps.Partial("mean")]``; not read through a
            ``__wrapped__`` wrapper such as ``grad(f)``) or, without one, finds them by
            batch-dim analysis (:func:`pshard.infer_out_specs`, traced once per input signature
            on fake tensors): outputs carrying the batch dim are ``Shard``, the others that
            depend on the batch ``Partial("mean")``, the rest ``Replicate()``. Functions it
            cannot trace (data-dependent control flow, ``.item()``, flex attention over a split
            ``BlockMask``) need explicit ``out_specs``.
        weight_fn: ``weight_fn(*mb_args, **mb_kwargs)`` gives each microbatch's weight (a
            non-negative number or one-element tensor, read once per microbatch) for every
            ``"mean"`` output. Default: the microbatch's size along the split dim.
        accum_dtype: dtype to accumulate floating-point ``Partial`` outputs in (e.g.
            ``torch.float32`` for bfloat16 gradients); results are cast back to the output's
            dtype.

    Returns:
        The function with the same signature, computing the merged output; or, with ``fn``
        omitted, a decorator.

    Raises:
        ValueError: at decoration, when both or neither of ``num_microbatches`` and
            ``microbatch_size`` are given; at call time, naming the key path
            (``pmap_microbatch(loss) in_specs[1]['labels']: ...``), when the ``Shard`` inputs
            disagree on the batch size, there are more microbatches than examples, a spec does
            not fit its value, or the microbatches' outputs differ in structure or in a dim
            other than a ``Shard`` output's split dim.

    Example:
        >>> import torch
        >>> import pshard as ps
        >>> def loss(w, x, y):
        ...     return ((x @ w - y) ** 2).mean()
        >>> w, x, y = torch.ones(3), torch.randn(10, 3), torch.randn(10)
        >>> step = ps.pmap_microbatch(
        ...     torch.func.grad_and_value(loss), num_microbatches=4,
        ...     in_specs=(None, ps.Shard(0), ps.Shard(0)), out_specs=ps.Partial("mean"))
        >>> g, value = step(w, x, y)
        >>> g_full, value_full = torch.func.grad_and_value(loss)(w, x, y)
        >>> torch.allclose(g, g_full) and torch.allclose(value, value_full)
        True

        As a decorator, with the out specs inferred (predictions carry the batch dim: ``Shard(0)``;
        their mean does not: ``Partial("mean")``):

        >>> @ps.pmap_microbatch(microbatch_size=4, in_specs=(None, ps.Shard(0)))
        ... def predict(w, x):
        ...     return x @ w, (x @ w).mean()
        >>> pred, mean = predict(w, x)
        >>> pred.shape, torch.allclose(mean, (x @ w).mean())
        (torch.Size([10]), True)
    """
    for name, value in (
        ("num_microbatches", num_microbatches),
        ("microbatch_size", microbatch_size),
    ):
        if value is not None:
            check_int("pmap_microbatch", name, value, minimum=1)
    if num_microbatches is not None and microbatch_size is None:
        count, by_size = num_microbatches, False
    elif microbatch_size is not None and num_microbatches is None:
        count, by_size = microbatch_size, True
    else:
        given = (
            f"num_microbatches={num_microbatches}, microbatch_size={microbatch_size}"
            if num_microbatches is not None
            else "neither"
        )
        raise ValueError(
            "pmap_microbatch: give exactly one of num_microbatches (how many microbatches) and "
            f"microbatch_size (the most examples in one), got {given}"
        )
    if accum_dtype is not None and not (
        isinstance(accum_dtype, torch.dtype)
        and (accum_dtype.is_floating_point or accum_dtype.is_complex)
    ):
        raise TypeError(
            f"pmap_microbatch: accum_dtype must be a floating-point torch.dtype, got "
            f"{accum_dtype!r}"
        )
    if weight_fn is not None and not callable(weight_fn):
        raise TypeError(f"pmap_microbatch: weight_fn must be callable, got {weight_fn!r}")
    config = _Config(count, by_size, in_specs, kw_specs, out_specs, weight_fn, accum_dtype)
    if fn is None:
        return functools.partial(_wrap, config=config)
    return _wrap(fn, config=config)


@dataclasses.dataclass(frozen=True, slots=True)
class _Config:
    """``pmap_microbatch``'s keyword arguments, checked at decoration."""

    count: int  # num_microbatches, or microbatch_size when by_size
    by_size: bool
    in_specs: Any
    kw_specs: Any
    out_specs: Any
    weight_fn: Callable[..., Any] | None
    accum_dtype: torch.dtype | None


def _wrap(fn: F, *, config: _Config) -> F:
    if not callable(fn):
        raise TypeError(f"pmap_microbatch: fn must be callable, got {fn!r}")

    @functools.wraps(fn)
    def microbatched(*args: Any, **kwargs: Any) -> Any:
        return _run(fn, config, args, kwargs)

    return microbatched  # type: ignore[return-value]


def _run(
    fn: Callable[..., Any], config: _Config, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    where = f"pmap_microbatch({fn_name(fn)})"
    in_specs, kw_specs = config.in_specs, config.kw_specs
    if in_specs is None or (kw_specs is None and kwargs):
        annotated = default_in_specs(fn, args, kwargs, transform="pmap_microbatch")
        if annotated is not None:
            in_specs = annotated[0] if in_specs is None else in_specs
            kw_specs = annotated[1] if kw_specs is None else kw_specs
    inputs = resolve_inputs(
        [(args, in_specs, "in_specs"), (kwargs, kw_specs, "kw_specs")],
        where=where,
        allowed=_IN_SPECS,
        default=default_spec,
    )
    args_def, kwargs_def = inputs.defs
    leaves, specs, plan, name_of = inputs.leaves, inputs.specs, inputs.plan, inputs.name_of
    n_args = inputs.counts[0]
    if not config.by_size:
        k, count_name = config.count, "num_microbatches"
    else:
        if plan.size is None:
            raise ValueError(
                f"{where}: microbatch_size={config.count} but no input is split (every "
                "leaf of in_specs/kw_specs is Replicate()); give the batched inputs Shard(d), "
                "or use num_microbatches"
            )
        k, count_name = math.ceil(plan.size / config.count), "microbatch_size"
    columns, sizes = split_columns(
        leaves, specs, plan, k, name_of, where=where, count_name=count_name
    )
    out_specs = config.out_specs
    if isinstance(out_specs, str) and out_specs == "infer":
        out_specs = default_out_specs(fn, transform="pmap_microbatch", required=False)
        if out_specs is None:
            out_specs = _infer_out_specs(fn, inputs, config.weight_fn is not None)

    weight_fn = config.weight_fn
    reducers: list[Reducer] = []
    out_def: Any = None
    for i in range(k):
        piece = [column[i] for column in columns]
        mb_args: Any = args_def.unflatten(piece[:n_args])
        mb_kwargs: Any = kwargs_def.unflatten(piece[n_args:])
        del piece
        out = fn(*mb_args, **mb_kwargs)
        if weight_fn is not None:
            weight = weight_value(
                _call_weight_fn(weight_fn, mb_args, mb_kwargs, where),
                f"{where}: weight_fn for microbatch {i}",
            )
        else:
            weight = float(sizes[i]) if sizes is not None else 1.0
        del mb_args, mb_kwargs
        if i == 0:
            out_leaves, out_def = tree_flatten(out)
            out_resolved = resolve_specs(
                out_specs,
                out_leaves,
                out_def,
                name="out_specs",
                fn_name=where,
                allowed=_OUT_SPECS,
            )
            debug = debug_enabled()
            reducers = [
                make_reducer(spec, config.accum_dtype, sizes, "microbatch {}", k, debug=debug)
                for spec in out_resolved
            ]
        else:
            out_leaves = flatten_like(
                out_def,
                out,
                where=where,
                name="out_specs",
                what=f"microbatch {i}",
                first_what="microbatch 0",
            )
        del out
        _fold(reducers, out_leaves, weight, i, out_def, where)
        del out_leaves
    return out_def.unflatten([reducer.result() for reducer in reducers])


def _call_weight_fn(
    weight_fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], where: str
) -> Any:
    """``weight_fn(*args, **kwargs)``; a call its signature cannot take is a clear error."""
    try:
        inspect.signature(weight_fn).bind(*args, **kwargs)
    except TypeError as error:
        raise TypeError(
            f"{where}: weight_fn is called like fn, with each microbatch's arguments "
            f"({len(args)} positional{', ' + ', '.join(kwargs) if kwargs else ''}), but "
            f"{fn_name(weight_fn)}{_signature_text(weight_fn)} cannot take them ({error}); "
            f"give weight_fn fn's parameters, e.g. lambda *args, **kwargs: ..."
        ) from None
    except ValueError:  # no signature to check (a builtin): just call it
        pass
    return weight_fn(*args, **kwargs)


def _signature_text(fn: Callable[..., Any]) -> str:
    try:
        return str(inspect.signature(fn))
    except (TypeError, ValueError):
        return "(...)"


def _fold(
    reducers: list[Reducer],
    leaves: list[Any],
    weight: float | torch.Tensor,
    i: int,
    out_def: PyTreeSpec,
    where: str,
) -> None:
    """Add microbatch ``i``'s output leaves to their reductions (a function of its own, so
    that no loop variable keeps a leaf alive into the next microbatch)."""
    for j, (reducer, leaf) in enumerate(zip(reducers, leaves, strict=True)):
        try:
            reducer.add(leaf, weight, i)
        except ReduceError as error:
            path = keystr(out_def.accessors()[j], "out_specs")
            raise ValueError(f"{where} {path}: {error}") from None
