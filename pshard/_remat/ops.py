"""How ``ps.checkpoint``'s tape sees an operator: what kind it is, what it writes, and how it
runs (a collective finished when its operator returns: :func:`run`).

Read off the operator's schema and tags (``torch._ops.OpOverload``): views, in-place writes,
random draws, new tensors from shapes alone, collectives and point-to-point communication
(:mod:`pshard._remat.policies`), plus the few operators that write arguments their schema does
not mark (BatchNorm's running statistics) and attention kernels whose dropout is off.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import optree
import torch

from pshard._core.caches import cached
from pshard._core.tree import NAMESPACE

from .. import _compat as compat
from .policies import is_collective, is_p2p

__all__ = [
    "BOOKKEEPING",
    "INPUT_FREE",
    "KEEPABLE",
    "OUTPUT_FREE",
    "call_kind",
    "describe",
    "describe_call",
    "draw_arguments",
    "factory_value",
    "is_work",
    "op_kind",
    "run",
    "storage",
    "written",
]

# Operators autograd and functorch may add or leave out between two runs of the same program.
BOOKKEEPING = frozenset(
    {"detach", "alias", "lift_fresh", "is_same_size", "_has_same_storage_numel"}
)
# Operators whose output depends on no tensor's values (only shapes, dtypes, constants).
_FACTORIES = frozenset(
    {
        "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "zeros",
        "zeros_like", "new_zeros", "ones", "ones_like", "new_ones", "full", "full_like",
        "new_full", "scalar_tensor", "arange", "linspace", "logspace", "eye",
    }
)  # fmt: skip
# What a factory fills its tensor with: a constant, or the argument that gives it.
_FILLS = {"zeros": 0, "zeros_like": 0, "new_zeros": 0, "ones": 1, "ones_like": 1, "new_ones": 1}
_FILL_ARGS = {
    "full": "fill_value", "full_like": "fill_value", "new_full": "fill_value", "scalar_tensor": "s",
}  # fmt: skip
_UNFILLED = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"})
KEEPABLE = ("compute", "write", "collective")
# Operators whose derivative reads none of their inputs' values (sums, differences, reshapes),
# and operators whose derivative does not read their own output: a value only such consumers
# read, computed by such an operator, is not needed by a recompute that replays its consumers.
INPUT_FREE = frozenset({"add", "sub", "neg", "clone", "_unsafe_view"})
OUTPUT_FREE = frozenset(
    {
        "mm", "addmm", "bmm", "baddbmm", "addbmm", "mv", "addmv", "dot", "convolution",
        "add", "sub", "neg", "mul", "div", "gelu", "silu", "clone", "_unsafe_view",
    }
)  # fmt: skip
# Operators that write arguments their schema does not mark (running statistics in training).
_UNMARKED_WRITES = {
    "native_batch_norm": (3, 4),
    "cudnn_batch_norm": (3, 4),
    "miopen_batch_norm": (3, 4),
}


@cached("pshard.remat.op_kind", maxsize=4096)
def op_kind(op: Any) -> str:
    """How the tape treats ``op``: ``"compute"`` (fresh outputs), ``"view"`` (outputs alias an
    input), ``"write"`` (writes an argument in place), ``"random"``, ``"factory"`` (a new tensor
    from shapes and constants), ``"collective"`` (a c10d collective, writes its first
    argument), ``"p2p"`` (other communication)."""
    if is_collective(op):
        return "collective"
    if is_p2p(op):
        return "p2p"
    if torch.Tag.nondeterministic_seeded in op.tags:
        return "random"
    if op._opname in _FACTORIES:
        return "factory"
    if op._opname in _UNMARKED_WRITES and op._overloadname == "default":
        return "write"
    schema = op._schema
    if any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments):
        return "write"
    if any(r.alias_info is not None for r in schema.returns):
        return "view"
    return "compute"


def factory_value(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Hashable:
    """What the values of a factory's new tensor depend on besides its shape and dtype: the
    fill (``zeros_like`` and ``full_like(x, 0)`` alike give ``("fill", 0)``), the numbers of a
    range (``arange``, ``linspace``, ``logspace``, ``eye``), ``None`` for ``empty``."""
    name = op._opname
    if name in _UNFILLED:
        return None
    if name in _FILLS:
        return ("fill", _FILLS[name])
    if name in _FILL_ARGS:
        arg = _FILL_ARGS[name]
        names = [a.name for a in op._schema.arguments]
        i = names.index(arg)
        value = args[i] if i < len(args) else kwargs.get(arg)
        return ("fill", value if isinstance(value, (int, float, bool, complex)) else repr(value))
    numbers = [x for x in args if isinstance(x, (int, float, bool, complex))]
    return ("range", tuple(numbers))


def draw_arguments(
    op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[str, Any], ...]:
    """The arguments of a random draw that are numbers (a rate, a mean, a standard deviation,
    a size), by name, defaults filled in (the dispatcher leaves out those equal to their
    default)."""
    out: list[tuple[str, Any]] = []
    for i, a in enumerate(op._schema.arguments):
        if i < len(args) and not a.kwarg_only:
            value = args[i]
        elif a.name in kwargs:
            value = kwargs[a.name]
        elif a.has_default_value():
            value = a.default_value
        else:
            continue
        if isinstance(value, (list, tuple)) and all(isinstance(v, int) for v in value):
            out.append((a.name, tuple(value)))
        elif isinstance(value, (int, float, bool, complex)):
            out.append((a.name, value))
    return tuple(out)


@cached("pshard.remat.dropout_arg", maxsize=4096)
def _dropout_position(op: Any) -> int | None:
    names = [a.name for a in op._schema.arguments]
    return names.index("dropout_p") if "dropout_p" in names else None


def call_kind(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """:func:`op_kind`, except that an attention kernel without dropout draws nothing."""
    kind = op_kind(op)
    if kind == "random":
        i = _dropout_position(op)
        if i is not None:
            p = args[i] if i < len(args) else kwargs.get("dropout_p", 0.0)
            if not p:
                return "compute"
    return kind


@cached("pshard.remat.written_args", maxsize=4096)
def _write_positions(op: Any) -> tuple[tuple[int, str], ...]:
    """``(position, name)`` of the arguments ``op`` writes in place."""
    if is_collective(op) or op._opname.startswith("recv"):
        return ((0, op._schema.arguments[0].name),)
    if is_p2p(op):
        return ()
    if op._opname in _UNMARKED_WRITES and op._overloadname == "default":
        return tuple((i, op._schema.arguments[i].name) for i in _UNMARKED_WRITES[op._opname])
    return tuple(
        (i, a.name)
        for i, a in enumerate(op._schema.arguments)
        if a.alias_info is not None and a.alias_info.is_write
    )


def written(op: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors ``op`` writes in place, in order."""
    out: list[torch.Tensor] = []
    for i, name in _write_positions(op):
        value = args[i] if i < len(args) else kwargs.get(name)
        if value is not None:
            leaves: list[Any] = optree.tree_leaves(value, namespace=NAMESPACE)
            out.extend(x for x in leaves if isinstance(x, torch.Tensor))
    return out


def is_work(x: Any) -> bool:
    """Whether ``x`` is a ``torch.distributed`` Work as an operator returns it (a TorchScript
    object)."""
    return "Work" in type(x).__name__ or "ScriptObject" in type(x).__name__


def run(op: Any, kind: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``op(*args, **kwargs)``, a collective finished when it returns: its Work is waited for
    here, below the modes of the checkpoint that runs it, and returned finished. A backend may
    finish a collective in its Work's wait, with operators of its own (gloo copies a
    reduce-scatter's result into the output there): waited for later, those operators would
    pass through the checkpoint's modes as the function's own, writing the collective's output
    after it, from a buffer of the backend's."""
    out = op(*args, **kwargs)
    if kind != "collective" or type(out) is not tuple:
        return out
    works = [x for x in out if is_work(x)]
    if not works:  # the in-process ranks' operators return nothing
        return out
    for work in works:
        work.wait()
    done = compat.completed_work(written(op, args, kwargs))
    return tuple(done if is_work(x) else x for x in out)


def storage(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage().data_ptr() if t.numel() else None
    except (RuntimeError, NotImplementedError):  # no storage (sparse, nested, ...)
        return None


def describe_call(op: Any, tensors: Sequence[torch.Tensor]) -> str:
    """``aten.mm.default on ((2, 3) float64, (3, 3) float64)``, for errors."""
    return describe(op, [(t.shape, t.dtype) for t in tensors])


def describe(op: Any, metas: Sequence[tuple[torch.Size, torch.dtype]]) -> str:
    """:func:`describe_call` from the shapes and dtypes of the tensors."""
    shapes = ", ".join(f"{tuple(s)} {str(d).removeprefix('torch.')}" for s, d in metas)
    return f"{op} on ({shapes})" if metas else f"{op}"
