"""Placements: how one value is laid out over a mesh axis or over microbatches.

A placement says what one mesh dimension (or the microbatch "axis") does to a tensor:

- :class:`Shard` splits it along a tensor dim;
- :class:`Replicate` keeps the same value everywhere;
- :class:`Partial` marks a value whose true value is a pending reduction over the axis;
- :class:`StridedShard` is DTensor's ``_StridedShard`` (the FSDP2 + TP layout);
- :class:`P` is JAX's ``PartitionSpec``: one entry per tensor dim naming the mesh axes that
  split it.

All are frozen, hashable, compare by value and print like their constructor call.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from .._compat import strided_shard_type
from .checks import check_int

if TYPE_CHECKING:
    from torch.distributed.tensor.placement_types import Placement as TorchPlacement

__all__ = [
    "Placement",
    "Shard",
    "Replicate",
    "Partial",
    "StridedShard",
    "P",
    "entry_of",
    "entry_splits",
    "to_torch_placement",
    "from_torch_placement",
]

_REDUCE_OPS = ("sum", "mean", "max", "min")
# pshard reduce name -> torch.distributed.tensor.Partial reduce_op name
_TO_TORCH_REDUCE = MappingProxyType({"sum": "sum", "mean": "avg", "max": "max", "min": "min"})
_FROM_TORCH_REDUCE = MappingProxyType({v: k for k, v in _TO_TORCH_REDUCE.items()})


class Placement:
    """Base class of :class:`Shard`, :class:`Replicate`, :class:`Partial` and
    :class:`StridedShard`. Not instantiated directly."""

    __slots__ = ()

    def is_shard(self) -> bool:
        """True for :class:`Shard` and :class:`StridedShard`."""
        return False


@dataclasses.dataclass(frozen=True, repr=False)
class Shard(Placement):
    """Split along tensor dim ``dim`` (negative dims count from the end).

    Example:
        >>> import pshard as ps
        >>> ps.Shard(1)
        Shard(1)
        >>> ps.Shard(-1) == ps.Shard(-1)
        True
    """

    dim: int

    def __post_init__(self) -> None:
        check_int("Shard", "dim", self.dim)

    def __repr__(self) -> str:
        return f"Shard({self.dim})"

    def is_shard(self) -> bool:
        return True


@dataclasses.dataclass(frozen=True, repr=False)
class StridedShard(Placement):
    """DTensor's ``_StridedShard``: split along ``dim`` as if the tensor had first been split
    into ``split_factor`` pieces by a later mesh dimension (FSDP2 + TP, right-to-left order).

    Example:
        >>> import pshard as ps
        >>> ps.StridedShard(0, split_factor=2)
        StridedShard(0, split_factor=2)
    """

    dim: int
    split_factor: int

    def __post_init__(self) -> None:
        check_int("StridedShard", "dim", self.dim)
        check_int("StridedShard", "split_factor", self.split_factor, minimum=1)

    def __repr__(self) -> str:
        return f"StridedShard({self.dim}, split_factor={self.split_factor})"

    def is_shard(self) -> bool:
        return True


@dataclasses.dataclass(frozen=True, repr=False)
class Replicate(Placement):
    """The same value on every rank (or every microbatch).

    Example:
        >>> import pshard as ps
        >>> ps.Replicate()
        Replicate()
    """

    def __repr__(self) -> str:
        return "Replicate()"


@dataclasses.dataclass(frozen=True, repr=False)
class Partial(Placement):
    """A pending reduction: the true value is ``reduce`` over the axis of the local values.

    Args:
        reduce: one of ``"sum"``, ``"mean"``, ``"max"``, ``"min"``.

    Example:
        >>> import pshard as ps
        >>> ps.Partial()
        Partial('sum')
        >>> ps.Partial("mean")
        Partial('mean')
    """

    reduce: str = "sum"

    def __post_init__(self) -> None:
        if self.reduce not in _REDUCE_OPS:
            raise ValueError(
                f"Partial: reduce must be one of {', '.join(map(repr, _REDUCE_OPS))}, "
                f"got {self.reduce!r}"
            )

    def __repr__(self) -> str:
        return f"Partial({self.reduce!r})"


class P:
    """JAX's ``PartitionSpec``: one entry per tensor dim, each ``None`` (not split), a mesh-axis
    name, or a tuple of mesh-axis names (split over their product, major to minor).

    Trailing tensor dims without an entry are not split. Entries are stored normalised: a
    one-name tuple becomes the name, an empty tuple becomes ``None``.

    **Strided splits.** An int ``k`` right before an axis name in a tuple entry cuts the dim
    (what the axes before it left of it) into ``k`` equal parts first and splits every part over
    that axis: each rank holds its piece of every part, in order. ``P(None, (3, "tp"))`` is the
    layout of a fused q|k|v projection under tensor parallelism (each rank its share of q, of k
    and of v), DTensor's ``_StridedShard(1, split_factor=3)``; ``P(("dp", 3, "tp"))`` splits
    over ``"dp"`` first and that block strided over ``"tp"``.

    Example:
        >>> import pshard as ps
        >>> spec = ps.P("dp", None, ("sp", "tp"))
        >>> spec
        P('dp', None, ('sp', 'tp'))
        >>> len(spec), spec[0], spec.axes
        (3, 'dp', ('dp', 'sp', 'tp'))
        >>> ps.P(None, (3, "tp")).axes
        ('tp',)
    """

    __slots__ = ("_entries",)
    _entries: tuple[str | tuple[str | int, ...] | None, ...]

    def __init__(self, *entries: str | tuple[str | int, ...] | None) -> None:
        normalised: list[str | tuple[str | int, ...] | None] = []
        seen: set[str] = set()
        for i, entry in enumerate(entries):
            if isinstance(entry, list):
                entry = tuple(entry)
            if isinstance(entry, tuple):
                entry = entry_of(entry_splits(_strided_entry(i, entry)))
            elif entry is not None and not isinstance(entry, str):
                raise TypeError(
                    f"P: entry {i} must be None, a mesh-axis name or a tuple of names, "
                    f"got {entry!r} ({type(entry).__name__})"
                )
            for name, _ in entry_splits(entry):
                if name in seen:
                    raise ValueError(f"P{entries!r}: mesh axis {name!r} is used more than once")
                seen.add(name)
            normalised.append(entry)
        object.__setattr__(self, "_entries", tuple(normalised))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("P is immutable")

    @property
    def axes(self) -> tuple[str, ...]:
        """Every mesh-axis name used, in order of appearance."""
        return tuple(name for entry in self._entries for name, _ in entry_splits(entry))

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[str | tuple[str | int, ...] | None]:
        return iter(self._entries)

    def __getitem__(self, index: int) -> str | tuple[str | int, ...] | None:
        return self._entries[index]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, P) and self._entries == other._entries

    def __hash__(self) -> int:
        return hash((P, self._entries))

    def __repr__(self) -> str:
        return f"P({', '.join(map(repr, self._entries))})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (P, self._entries)


def _strided_entry(i: int, entry: tuple[Any, ...]) -> tuple[str | int, ...]:
    """A tuple entry checked (names, each optionally after its number of parts) with parts of 1
    dropped."""
    out: list[str | int] = []
    for j, item in enumerate(entry):
        if isinstance(item, str):
            out.append(item)
            continue
        if isinstance(item, bool) or not isinstance(item, int):
            raise TypeError(
                f"P: entry {i} must hold mesh-axis names (str), each optionally after an int "
                f"number of parts, got {entry!r}"
            )
        if item < 1 or j + 1 == len(entry) or not isinstance(entry[j + 1], str):
            raise ValueError(
                f"P: entry {i} = {entry!r}: a number of parts must be an int >= 1 right before "
                f"the mesh-axis name that splits every part, e.g. (3, 'tp')"
            )
        if item > 1:
            out.append(item)
    return tuple(out)


def entry_splits(entry: str | tuple[str | int, ...] | None) -> tuple[tuple[str, int], ...]:
    """The ``(axis name, parts)`` of one entry of a :class:`P`, in the order they split the dim
    (``parts`` 1 for a plain split, ``k`` for a strided one).

    Example:
        >>> from pshard._core.placements import entry_splits
        >>> entry_splits(("dp", 3, "tp"))
        (('dp', 1), ('tp', 3))
    """
    if entry is None:
        return ()
    if isinstance(entry, str):
        return ((entry, 1),)
    out: list[tuple[str, int]] = []
    parts = 1
    for item in entry:
        if isinstance(item, int):
            parts = item
        else:
            out.append((item, parts))
            parts = 1
    return tuple(out)


def entry_of(splits: Iterable[tuple[str, int]]) -> str | tuple[str | int, ...] | None:
    """The entry of a :class:`P` made of ``(axis name, parts)`` splits (inverse of
    :func:`entry_splits`)."""
    items: list[str | int] = []
    for name, parts in splits:
        items.extend((parts, name) if parts > 1 else (name,))
    if len(items) == 1 and isinstance(items[0], str):
        return items[0]
    return tuple(items) if items else None


def to_torch_placement(p: Placement) -> TorchPlacement:
    """Convert a pshard placement to the ``torch.distributed.tensor`` placement.

    ``Partial("mean")`` becomes torch's ``Partial("avg")``; ``StridedShard`` becomes
    ``_StridedShard``.

    Example:
        >>> import pshard as ps
        >>> ps.to_torch_placement(ps.Shard(1))
        Shard(dim=1)
    """
    from torch.distributed.tensor import placement_types as pt

    if isinstance(p, StridedShard):
        return strided_shard_type()(p.dim, split_factor=p.split_factor)
    if isinstance(p, Shard):
        return pt.Shard(p.dim)
    if isinstance(p, Replicate):
        return pt.Replicate()
    if isinstance(p, Partial):
        return pt.Partial(_TO_TORCH_REDUCE[p.reduce])
    raise TypeError(
        f"to_torch_placement: expected Shard, StridedShard, Replicate or Partial, got {p!r} "
        f"({type(p).__name__}); a P(...) describes tensor dims, not one mesh dim"
    )


def from_torch_placement(p: object) -> Placement:
    """Convert a ``torch.distributed.tensor`` placement to pshard's.

    Example:
        >>> import pshard as ps
        >>> from torch.distributed.tensor import Shard
        >>> ps.from_torch_placement(Shard(0))
        Shard(0)
    """
    from torch.distributed.tensor import placement_types as pt

    # _StridedShard subclasses Shard in some torch versions: test it first.
    if isinstance(p, strided_shard_type()):
        return StridedShard(p.dim, split_factor=int(p.split_factor))
    if isinstance(p, pt.Shard):
        return Shard(p.dim)
    if isinstance(p, pt.Replicate):
        return Replicate()
    if isinstance(p, pt.Partial):
        if p.reduce_op not in _FROM_TORCH_REDUCE:
            raise ValueError(
                f"from_torch_placement: Partial reduce_op {p.reduce_op!r} has no pshard "
                f"equivalent (supported: {', '.join(map(repr, _FROM_TORCH_REDUCE))})"
            )
        return Partial(_FROM_TORCH_REDUCE[p.reduce_op])
    raise TypeError(
        f"from_torch_placement: expected a torch.distributed.tensor placement, got {p!r} "
        f"({type(p).__name__})"
    )
