"""``ps.sharded_call``: ``torch.func.functional_call`` for FSDP-sharded parameters.

A model is cut into units (by default its repeated blocks, e.g. the decoder layers, and one
unit for the rest). The rest's parameters are gathered when the call starts; each unit gathers
its own right before it runs and lets them go after; the backward gathers them again and returns
their cotangents as blocks. The regathering is :func:`pshard.checkpoint` around each unit with a
policy that keeps everything but the gathered weights (FSDP's reshard-after-forward), so the
activations are not recomputed, only the gathers.

Two forms, told apart per parameter:

- a :class:`~pshard.GlobalTensor` (outside any map, or passed into a map over other axes): its
  blocks are gathered over its own mesh, :func:`pshard.gather`'s way (the transpose takes this
  rank's block of the whole cotangent);
- a plain tensor, with its spec in ``specs`` (inside a map: the block ``fn`` received and the
  map's in_spec for it): gathered over the spec's axes, padded where the blocks are uneven
  (``torch.chunk``'s rule); the transpose reduce-scatters, the cotangent of the block summed
  over the ranks that used the whole. Global shapes are read from the module's own parameters
  (which may live on the ``meta`` device).

Either way a unit's gather is one differentiable operation that casts too
(:mod:`pshard._collectives.cast_gather`: FSDP2's mixed precision, the policy of
:mod:`pshard._shard_map.fsdp_policy`), issued ahead by the call's schedule
(:mod:`pshard._shard_map.unit_schedule`); a unit's call is :mod:`pshard._shard_map.units`'.
"""

from __future__ import annotations

import contextvars
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch

from .. import _compat as compat
from .._collectives.cast_gather import BlockPlan, block_levels
from .._core.global_tensor import applied_shards, is_global
from .._core.placements import P, Replicate, Shard, StridedShard
from .._core.specs import broadcast_prefix_flat
from .._core.tree import describe, tree_flatten
from .._runtime.mesh import mesh_for
from .._runtime.tracing import active_trace
from .._runtime.wire import comm
from .fsdp_policy import ShardedCallPolicy
from .global_ops import block_plan
from .unit_schedule import UnitSchedule, UnitSlot, gate
from .units import GATHER_NAME, Gathered, UnitCall, UnitEntry, installed

__all__ = ["GATHER_NAME", "KEEP_SPLIT", "default_units", "sharded_call"]

_FN = "sharded_call"

#: The mesh axes whose splits ``sharded_call`` keeps: inside ``ps.tensor_parallel(axis=a)``
#: the blocks are gathered over every axis but ``a`` (and the layers compute on ``a``'s block).
KEEP_SPLIT: contextvars.ContextVar[frozenset[str]] = contextvars.ContextVar(
    "pshard_sharded_call_keep", default=frozenset()
)

Units = type | tuple[type, ...] | list[type] | Callable[[torch.nn.Module], bool] | None


def default_units(module: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The repeated blocks: children of a ``ModuleList`` whose class occurs twice or more."""
    out = []
    for name, sub in module.named_modules():
        if isinstance(sub, torch.nn.ModuleList):
            classes = [type(m) for m in sub]
            for i, child in enumerate(sub):
                if classes.count(type(child)) > 1:
                    out.append((f"{name}.{i}" if name else str(i), child))
    return out


def _find_units(module: torch.nn.Module, units: Units) -> list[tuple[str, torch.nn.Module]]:
    if units is None:
        found = default_units(module)
    else:
        if isinstance(units, type):
            units = (units,)
        if isinstance(units, (tuple, list)):
            if not all(isinstance(c, type) for c in units):
                raise TypeError(
                    f"{_FN}: units must be module classes or a predicate module -> bool, got "
                    f"{units!r}"
                )
            classes = tuple(units)
            test: Callable[[torch.nn.Module], bool] = lambda m: isinstance(m, classes)  # noqa: E731
        elif callable(units):
            test = units
        else:
            raise TypeError(
                f"{_FN}: units must be module classes or a predicate module -> bool, got "
                f"{describe(units)}"
            )
        found = [(n, m) for n, m in module.named_modules() if n and test(m)]
    # outermost units only: a unit inside another is part of it
    names = [n for n, _ in found]
    return [(n, m) for n, m in found if not any(n != o and n.startswith(o + ".") for o in names)]


def _owner(name: str, prefixes: list[str]) -> str | None:
    for p in prefixes:
        if name.startswith(p + "."):
            return p
    return None


def _axes_of(spec: Any, name: str) -> list[tuple[str, Shard | StridedShard]]:
    """``(axis, placement)`` pairs of a block's spec, in the order the splits apply."""
    if spec is None or isinstance(spec, Replicate):
        return []
    if isinstance(spec, P):
        return applied_shards(spec)
    raise TypeError(
        f"{_FN} specs[{name!r}]: expected a P over the mesh axes, Replicate() or None as the "
        f"spec of a block, got {describe(spec)}"
    )


def _block_plan(
    name: str, value: Any, spec: Any, whole: tuple[int, ...], views: dict[Any, Any]
) -> BlockPlan:
    """How the value of ``params[name]`` becomes the whole parameter: a GlobalTensor over its
    own mesh (the transpose slices), a block inside a map over its spec's axes (the transpose
    reduce-scatters; uneven blocks padded; inside ``tensor_parallel`` the kept axes' splits
    stay), a whole tensor as it is."""
    if is_global(value):
        return block_plan(value, f"params[{name!r}]", _FN, views)
    pairs = _axes_of(spec, name)
    if not pairs:
        return BlockPlan(whole, whole, ())
    mesh_for(_FN)  # the error names sharded_call when there is no mesh
    keep = KEEP_SPLIT.get()
    splits = [(comm(axis, _FN), p) for axis, p in pairs]
    expected, levels = block_levels(whole, splits, [axis not in keep for axis, _ in pairs])
    if tuple(value.shape) != expected:
        raise ValueError(
            f"{_FN} params[{name!r}]: the block has shape {tuple(value.shape)}, but {spec!r} "
            f"splits the module's parameter of shape {whole} so that this rank holds "
            f"{expected}; pass the block the map gave (its in_spec as specs[{name!r}])"
        )
    _check_kept(pairs, keep, spec, name)
    shape = list(expected)
    for lv in levels:  # what the gathers leave: the whole, or the kept axes' block of it
        shape[lv.dim] = lv.length
    return BlockPlan(expected, tuple(shape), levels)


def _check_kept(
    pairs: list[tuple[str, Shard | StridedShard]], keep: frozenset[str], spec: Any, name: str
) -> None:
    """Inside ``tensor_parallel``: an axis whose split is kept must split its dim before
    every axis that is gathered (the block is then the kept axis's block of the whole)."""
    gathered: dict[int, str] = {}
    for axis, p in pairs:
        if axis not in keep:
            gathered.setdefault(p.dim, axis)
        elif p.dim in gathered:
            raise ValueError(
                f"{_FN} specs[{name!r}]: {spec!r} splits dim {p.dim} over {gathered[p.dim]!r} "
                f"before {axis!r}, but inside ps.tensor_parallel(axis={axis!r}) the blocks are "
                f"gathered over every axis but {axis!r}, which must split first; list "
                f"{axis!r} first in that entry, or split the other axis on another dim"
            )


def sharded_call(
    module: torch.nn.Module,
    params: Mapping[str, Any],
    args: Any,
    kwargs: Mapping[str, Any] | None = None,
    *,
    specs: Any = None,
    units: Units = None,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    prefetch: bool = True,
    reshard_after_forward: bool = True,
) -> Any:
    """``torch.func.functional_call(module, params, args, kwargs)`` with FSDP-sharded
    parameters: each unit of the model gathers its parameters right before it runs, lets them
    go after, gathers them again in the backward, and returns their cotangents as blocks.

    In pseudo-code::

        rest = gather(params of no unit)                 # kept for the whole call
        for each unit, when the model calls it:
            out = checkpoint(lambda blocks, *a: unit(gather(blocks), *a),
                             policy=save_anything_except_these_names(gathered weights))

    Two forms, told apart per parameter (they may be mixed):

    - **GlobalTensors** (outside any map, or passed through a map over other axes): the blocks
      are gathered with :func:`pshard.gather` over the tensor's own mesh; ``args`` are whole
      and the same on every rank (outside a map a block's gradient is this rank's block of
      the gradient of its own result, never summed over ranks: for data that differs per
      rank, call it inside a ``shard_map`` over the data axis; debug mode checks this).
    - **Blocks inside a map** (the usual case, data sharded over ``"dp"`` too): ``params`` are
      the blocks ``fn`` received and ``specs`` their spec tree (the map's in_specs for them, a
      prefix tree of ``params``); each is gathered with :func:`pshard.all_gather` over its spec's
      axes (uneven blocks padded), whose transpose reduce-scatters the cotangent. The global
      shapes are the module's own parameters' (build the module on the ``meta`` device to hold
      no weights).

    Each unit runs again in the backward (to gather its weights again), so what it computes
    must depend on its arguments only: a cache the forward fills (a Hugging Face model's
    default ``use_cache=True``) is an error naming the unit; pass ``use_cache=False``. Weights
    tied across units (or a unit and the rest) are gathered once, with the rest.

    **Mixed precision** (FSDP2's ``MixedPrecisionPolicy``): with ``param_dtype`` the
    floating-point parameters are cast to it before they are gathered (half the bytes on the
    wire for bfloat16) and every unit computes in it; the floating-point tensors of the inputs
    (the call's and each unit's) are cast to it, and the outputs come back in it. The weights'
    cotangents are cast to ``reduce_dtype`` before they are reduce-scattered (inside a map) or
    sliced (a GlobalTensor outside one); ``None``: ``param_dtype``, FSDP2's default. Gradients
    come back in each block's own dtype: float32 masters stay float32. Buffers are not cast.

    **Overlap**: with ``prefetch`` (default) the next unit's gather is issued before the
    current unit computes, in the forward (the model's order of units) and in the backward
    (the reverse of the order the forward ran them in); on an accelerator the reduce-scatters
    of gradients run while the backward goes on. The numbers are those of ``prefetch=False``,
    bit for bit. In a ``ps.jit`` program the gathers are the program's nodes, each in its
    unit (issued again in the backward), and the compiler orders them.
    ``reshard_after_forward=False`` keeps each unit's gathered weights from its
    forward to its backward (ZeRO-2: no second gather, one gathered unit more per unit).

    Gradients: exact under ``torch.func.grad`` / ``vjp`` / ``jvp`` / ``vmap`` and
    ``.backward()`` (blocks as leaf tensors), uneven and empty blocks included; they come back
    as blocks (GlobalTensors of the same layout, or blocks of the map's input). Per-rank peak:
    the blocks, the rest's gathered parameters, two gathered units (the one computing and the
    next) and the activations. Under ``torch.func.grad`` what runs outside the units (the loss)
    keeps its graph until the whole gradient is done: put it in :func:`pshard.checkpoint` too to
    free those activations, as ``.backward()`` would.

    Args:
        module: the model. Its own parameters are not used where ``params`` has a value (they
            may be on the ``meta`` device); parameters and buffers ``params`` lacks are the
            module's own.
        params: parameter (and buffer) name -> GlobalTensor, block, or whole tensor (a spec of
            ``None`` / ``Replicate()``).
        args: the positional arguments of the call (a tuple, or a single value).
        kwargs: its keyword arguments.
        specs: for blocks: a prefix tree of ``params`` of ``P`` specs naming the mesh axes
            that split each block (the map's in_specs for them; ``None`` or ``Replicate()``
            for whole tensors); ignored for GlobalTensors, which carry their own.
        units: module classes or a predicate ``module -> bool`` choosing the units; default the
            repeated blocks (children of a ``ModuleList`` whose class occurs twice or more).
        param_dtype: the dtype parameters are gathered and computed in; ``None``: their own.
        reduce_dtype: the dtype the weights' cotangents are reduced (or sliced) in; ``None``:
            ``param_dtype``.
        prefetch: issue the next unit's gather ahead (see above).
        reshard_after_forward: gather each unit again in the backward (``False``: keep it).

    Returns:
        What ``module`` returns.

    Raises:
        TypeError: ``units``, a spec (``Shard(d)`` does not name the axes), a value of
            ``params``, a dtype or a flag of the wrong kind.
        ValueError: a name of ``params`` that is not a parameter or buffer of ``module``, a
            block whose shape is not this rank's block of the parameter under its spec, a
            GlobalTensor or whole tensor of another shape than the module's parameter, a dtype
            that is not floating-point.

    Example:
        >>> import torch, pshard as ps
        >>> mesh = ps.init_mesh({"dp": 1})
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
        >>> params = ps.shard(dict(model.named_parameters()), ps.P("dp"))
        >>> out = ps.sharded_call(model, params, (torch.ones(3, 4),))
        >>> torch.allclose(out, model(torch.ones(3, 4)))
        True
        >>> out = ps.sharded_call(model, params, (torch.ones(3, 4),), param_dtype=torch.bfloat16)
        >>> out.dtype, params["0.weight"].dtype
        (torch.bfloat16, torch.float32)
    """
    policy = ShardedCallPolicy.of(param_dtype, reduce_dtype, prefetch, reshard_after_forward)
    if active_trace() is not None:  # a program (ps.jit): each gather inside its unit's region,
        policy = dataclasses.replace(policy, prefetch=False)  # recomputed there in the backward
    kwargs = dict(kwargs or {})
    args = args if isinstance(args, tuple) else (args,)
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"{_FN}: module must be an nn.Module, got {describe(module)}")
    if not isinstance(params, Mapping):
        raise TypeError(
            f"{_FN}: params must be a dict of name -> tensor, as torch.func.functional_call "
            f"takes, got {describe(params)}"
        )
    own: dict[str, torch.Tensor] = dict(module.named_parameters(remove_duplicate=False))
    own.update(module.named_buffers(remove_duplicate=False))
    unknown = [n for n in params if n not in own]
    if unknown:
        raise ValueError(
            f"{_FN}: params names {unknown[:5]} that module ({type(module).__name__}) has no "
            f"parameter or buffer of; use the names of module.named_parameters()"
        )
    for n, v in params.items():
        if not (is_global(v) or isinstance(v, torch.Tensor)):
            raise TypeError(
                f"{_FN} params[{n!r}]: expected a tensor or a GlobalTensor, got {describe(v)}"
            )
    by_name = _specs_by_name(params, specs)
    for n, v in params.items():
        _check_value(n, v, by_name[n], tuple(own[n].shape))
    unit_list = _find_units(module, units)
    prefixes = sorted((n for n, _ in unit_list), key=len, reverse=True)
    shared = _shared_names(own, params, prefixes)
    # every parameter or buffer given, under its name and its tied aliases
    given = {alias: n for n in params for alias in shared.get(n, (n,))}
    _check_not_meta(module, own, given)
    members: dict[str, list[str]] = {p: [] for p, _ in unit_list}
    views: dict[Any, Any] = {}  # GlobalTensors' meshes, resolved once a call
    plans = {
        n: _block_plan(n, v, by_name[n], tuple(own[n].shape), views) for n, v in params.items()
    }
    is_param = {n for n, _ in module.named_parameters(remove_duplicate=False)}

    def gathered(names: list[str]) -> Gathered:
        dtypes = [_local(params[n]).dtype for n in names]
        return Gathered([plans[n] for n in names], dtypes, policy, [n in is_param for n in names])

    def own_value(name: str) -> torch.Tensor:  # a parameter params does not give: cast
        value = own[name]
        if name in is_param and value.is_floating_point() and policy.param_dtype is not None:
            return value.to(policy.param_dtype)
        return value

    rest_names = []
    for n in params:
        owner = None if n in shared else _owner(n, prefixes)
        if owner is not None:
            members[owner].append(n)
        else:
            rest_names.append(n)
    rest_blocks = [_local(params[n]) for n in rest_names]
    rest = dict(zip(rest_names, gathered(rest_names)(rest_blocks, None), strict=True))
    if policy.param_dtype is not None:  # the module's own parameters, cast as FSDP2 casts
        unit_of = {n: _owner(n, prefixes) for n in own if n not in given}
        rest.update({n: own_value(n) for n, o in unit_of.items() if o is None and n in is_param})
    entries = []  # (prefix, unit, names, blocks, extras) of the units with parameters given
    for prefix, unit in unit_list:
        mine = members[prefix]
        # what else the unit reads: weights tied to the rest's (gathered there) and its own
        # parameters and buffers that params does not give, passed in as arguments
        extras: dict[str, torch.Tensor] = {}
        tied_to_mine = {id(own[n]) for n in mine}  # functional_call ties those itself
        for alias in own:
            if _owner(alias, [prefix]) is None or id(own[alias]) in tied_to_mine:
                continue
            local_name = alias[len(prefix) + 1 :]
            source = given.get(alias)
            extras[local_name] = rest[source] if source is not None else own_value(alias)
        if mine:
            entries.append((prefix, unit, mine, [_local(params[n]) for n in mine], extras))
    groups = [gathered(mine) for _, _, mine, _, _ in entries]
    schedule = UnitSchedule(
        [(g.plan, [blocks[i] for i in g.work]) for g, (*_, blocks, _) in zip(groups, entries,
                                                                           strict=True)],
        prefetch=policy.prefetch,
    )  # fmt: skip
    differentiated = torch.is_grad_enabled() or compat.transforms_active()
    work = [e[3][i] for g, e in zip(groups, entries, strict=True) for i in g.work]
    if policy.prefetch and differentiated and work and schedule.can_defer(work[0].device):
        # every unit's blocks pass the gate, whose backward comes after all of theirs
        it = iter(gate(schedule, work))
        for g, e in zip(groups, entries, strict=True):
            for i in g.work:
                e[3][i] = next(it)
        for unit_s, g, e in zip(schedule.units, groups, entries, strict=True):
            unit_s.blocks = [e[3][i] for i in g.work]
    calls: dict[int, tuple[torch.nn.Module, Callable[..., Any]]] = {}
    for u, (g, (prefix, unit, mine, blocks, extras)) in enumerate(
        zip(groups, entries, strict=True)
    ):
        run = UnitCall(
            unit,
            prefix,
            f"{_FN} unit {prefix!r} ({type(unit).__name__})",
            [n[len(prefix) + 1 :] for n in mine],
            g,
            UnitSlot(schedule, u, blocks[0].device) if policy.prefetch else None,
        )
        calls[id(unit)] = (unit, UnitEntry(run, u, blocks, extras, schedule, policy))
    args, kwargs = policy.cast_inputs((args, kwargs))
    kwargs = dict(kwargs)
    try:
        with installed(calls):
            schedule.issue(0 if entries else None)
            out = torch.func.functional_call(module, rest, args, kwargs, strict=False)
    except BaseException:
        schedule.gathers.clear()  # not waited for: another rank may never issue its part
        raise
    schedule.drain()  # what the forward issued and did not take
    return out


def _check_not_meta(
    module: torch.nn.Module, own: Mapping[str, torch.Tensor], given: Mapping[str, str]
) -> None:
    """A parameter or buffer ``params`` does not give is the module's own: one on the meta
    device has no values to compute with."""
    missing = [n for n, t in own.items() if n not in given and t.is_meta]
    if not missing:
        return
    params = {n for n, _ in module.named_parameters(remove_duplicate=False)}
    kind = "parameter" if missing[0] in params else "buffer"
    more = f" (and {len(missing) - 1} more: {missing[1:4]})" if len(missing) > 1 else ""
    raise ValueError(
        f"{_FN}: the module's {kind} {missing[0]!r}{more} is on the meta device (the module was "
        f"built with torch.device('meta')) and params does not give it, so there are no values "
        f"to compute with; pass it in params (ps.init_sharded(module, specs) gives every "
        f"parameter and buffer), or materialise the module first"
    )


def _local(value: Any) -> torch.Tensor:
    return value.local if is_global(value) else value


def _specs_by_name(params: Mapping[str, Any], specs: Any) -> dict[str, Any]:
    """The spec of each value of ``params`` (``None`` for GlobalTensors and whole tensors)."""
    names = list(params)
    if specs is None:
        return dict.fromkeys(names)
    leaves, treedef = tree_flatten(dict(params))
    flat = broadcast_prefix_flat(specs, treedef, leaves, name="specs", fn_name=_FN)
    out = dict(zip(sorted(names), flat, strict=True))  # pshard's dicts flatten sorted
    for n, s in out.items():
        if isinstance(s, Shard):
            raise TypeError(
                f"{_FN} specs[{n!r}]: {s!r} does not say which mesh axes split the block; give "
                f"the map's in_spec as a P naming them, e.g. P('dp') for dim 0 split over 'dp'"
            )
        if is_global(params[n]):
            out[n] = None  # a GlobalTensor carries its own layout
    return out


def _check_value(name: str, v: Any, spec: Any, whole: tuple[int, ...]) -> None:
    """A GlobalTensor of the parameter's shape, or a tensor of it (whole, no spec)."""
    if is_global(v):
        if tuple(v.shape) != whole and not KEEP_SPLIT.get():  # inside tensor_parallel: its block
            raise ValueError(
                f"{_FN} params[{name!r}]: a GlobalTensor of shape {tuple(v.shape)}, but the "
                f"module's parameter has shape {whole}"
            )
    elif spec is None and tuple(v.shape) != whole:
        raise ValueError(
            f"{_FN} params[{name!r}]: a tensor of shape {tuple(v.shape)}, but the module's "
            f"parameter has shape {whole}; if it is the block a map gave, pass the map's "
            f"in_spec for it in specs= (e.g. specs=P('dp'))"
        )


def _shared_names(
    own: Mapping[str, torch.Tensor], params: Mapping[str, Any], prefixes: list[str]
) -> dict[str, tuple[str, ...]]:
    """name of ``params`` -> all its aliases, for the weights tied across units (or a unit and
    the rest): those are gathered once with the rest and handed to every unit that uses them."""
    aliases: dict[int, list[str]] = {}
    for alias, tensor in own.items():
        aliases.setdefault(id(tensor), []).append(alias)
    out = {}
    for n in params:
        group = aliases[id(own[n])]
        if len(group) > 1 and len({_owner(a, prefixes) for a in group}) > 1:
            out[n] = tuple(group)
    return out
