"""The forward of a checkpoint, recorded below autograd and ``torch.func``.

While the checkpointed function runs its forward, the recorder (:mod:`pshard._remat.record`,
a ``TorchDispatchMode``,
so it sees the operators that really run, under every transform) writes one :class:`Entry`
per operator into a :class:`Tape`: the operator, where each tensor argument came from (an
input of the checkpoint, the output of an earlier entry, a new tensor, a tensor from outside),
and the outputs the policy keeps. In the recompute, :mod:`pshard._remat.replay` identifies each
operator by the same description: a kept entry returns its kept outputs instead of running (no
FLOPs; for a collective, no communication), everything else runs. Autograd and ``torch.func``
sit above both modes, so a replayed output gets exactly the derivatives (backward, tangents,
batching) it would get if it had been computed again.

Identification is by content, not position: the key of a call (:func:`key_of`) is
``(operator, arguments)`` with tensors replaced by their source, so operations that only the
recompute runs (the tangent computations of an outer ``jvp``, autograd's bookkeeping) never
take a kept value, and a kept value is returned only where the recompute computes the same
thing from the same sources. Calls with the same key are matched in order; non-tensor
arguments (a Python number) are part of the key. New tensors (``empty``, ``zeros_like``, ...)
are known by their shape, dtype and what fills them (``zeros_like(x)`` and ``full_like(x, 0)``
alike: :func:`pshard._remat.ops.factory_value`), not by the factory, since ``torch.func`` may
make them with another factory than the forward did; small constants
(``torch.tensor([...])``) by their value; integer and boolean tensors (positions, indices,
masks) by their shape and dtype alone, since the recompute may take them from a cache where
the forward computed them (``shard_map_seq``'s positions), so calls that differ only in them
are told apart by their order; those the forward read from outside the function are held, and
the recompute checks that each is unchanged (the same values, not modified in place). Random
draws are known by their place among the draws, and never kept: the recompute draws the same
numbers again from the generator states the forward had at its first draw, those of explicit
``generator=`` arguments included (:mod:`pshard._remat.rng`).

Internal interface (for :mod:`pshard._remat.replay` and :mod:`pshard._remat.explain`):
:class:`Sources`, :func:`flat_call`, :func:`arg_paths`, :func:`key_of`, :func:`new_source`,
:func:`traced`, :func:`fresh_outputs`, :func:`bind_outputs`, :func:`rebuild`,
:func:`run_factory`, :func:`version_of`, :func:`is_outside`.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Hashable, Sequence
from typing import Any

import optree
import torch

from pshard._core.tree import NAMESPACE

from .. import _compat as compat
from .ops import (
    describe,
    factory_value,
    is_work,
)
from .policies import Policy
from .rng import RngStates

__all__ = [
    "Entry",
    "Sources",
    "Tape",
    "arg_paths",
    "bind_outputs",
    "flat_call",
    "fresh_outputs",
    "is_outside",
    "key_of",
    "new_source",
    "outside_source",
    "output_template",
    "rebuild",
    "run_factory",
    "traced",
    "version_of",
]

_SIMPLE = (int, float, bool, str, complex, torch.dtype, torch.device, torch.layout)
_MEMORY_FORMAT = type(torch.contiguous_format)
_SMALL = 64  # tensors from outside with at most this many elements are known by value


@dataclasses.dataclass(eq=False)
class Entry:
    """One operator of the forward.

    ``key``: how the recompute identifies it (:func:`key_of`; a random draw by its place).
    ``draw``/``draw_key``: a random draw's arguments that are numbers (a rate; see
    :func:`pshard._remat.ops.draw_arguments`) and its key by content (:func:`key_of`: the
    tensors it reads, such as the probabilities of ``torch.bernoulli``), compared with the
    recompute's draw at its place.
    ``outside``: ``(position among its tensor arguments, index in :attr:`Tape.outside`)`` of
    the integer and boolean tensors from outside the function it read.
    ``refs``/``geometry``: its outputs (the ``n_fresh`` fresh ones, then the tensors it wrote),
    held weakly, and their (shape, stride, offset). While the forward runs, a saved
    entry holds them (``held``), or a live tensor on their storage when only a name reached
    them (``named``); from its end, ``slot`` is where in :attr:`Tape.kept` the values the
    recompute returns instead of running the operator are (to go back to ``devices``)."""

    op: Any
    kind: str
    spec: Any
    template: list[tuple[str, Any]]
    saved: bool = False
    vetoed: bool = False
    refs: list[weakref.ref[torch.Tensor]] = dataclasses.field(default_factory=list)
    geometry: list[tuple[Any, ...]] = dataclasses.field(default_factory=list)
    held: list[torch.Tensor] | None = None
    named: torch.Tensor | None = None
    slot: int = -1
    devices: list[torch.device] = dataclasses.field(default_factory=list)
    n_fresh: int = 0
    floating: bool = True
    inputs: list[Hashable | None] = dataclasses.field(default_factory=list)
    fresh_meta: list[tuple[torch.Size, torch.dtype, torch.device]] = dataclasses.field(
        default_factory=list
    )
    outside: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    key: Hashable = None
    draw: tuple[tuple[str, Any], ...] = ()
    draw_key: Hashable = None

    @property
    def text(self) -> str:
        """The operator and its tensors' shapes and dtypes, for errors (from its key)."""
        key = self.draw_key if self.kind == "random" else self.key
        parts = key[2] if isinstance(key, tuple) and len(key) == 4 else ()
        metas = [
            (p[1], p[2])
            for p in parts
            if isinstance(p, tuple) and len(p) == 3 and isinstance(p[1], torch.Size)
        ]
        return describe(self.op, metas)

    def unsave(self) -> None:
        self.saved, self.vetoed, self.held, self.named = False, True, None, None

    def outputs(self) -> list[torch.Tensor] | None:
        """Its outputs, from the live objects or rebuilt on the named storage (``None`` if one
        is gone)."""
        if self.held is not None:
            return self.held
        out = []
        for ref, (shape, stride, offset) in zip(self.refs, self.geometry, strict=True):
            t = ref()
            if t is None and self.named is not None:
                t = self.named.detach().as_strided(shape, stride, offset)
            if t is None:
                return None
            out.append(t)
        return out


@dataclasses.dataclass(eq=False)
class Tape:
    """The record of one forward (see the module docs).

    ``kept``: the values saved for the recompute, which the checkpoint hands to autograd to
    hold (so they are freed when autograd frees what it saved) and gives back to the replay.
    ``returned``: for the entries that computed the checkpoint's outputs, those outputs as the
    checkpoint returned them (held weakly, with their version): while they live unchanged, the
    recompute takes them instead of computing them again.
    ``outputs``: the sources of the function's outputs, then of the tensors that left it by
    another route (:mod:`pshard._remat.escapes`), whose shapes and dtypes are ``left_meta``.
    ``written_inputs``: the values of inputs the forward wrote in place, from before it did.
    ``outside``/``outside_versions``: the integer and boolean tensors from outside the function
    that the forward read (index tables, masks) and their versions at its end: they are matched
    by place, not by source (see the module docs), so the recompute checks that each is
    unchanged (:mod:`pshard._remat.replay`).
    ``made``: the fresh outputs of the forward's operators, held weakly, with the operator's
    index: one that is still alive and read from outside by the recompute is state the function
    kept from its forward (a cache), which the "another path" error names.
    ``error``: a policy's error, raised once the forward is done (raised inside an operator,
    Python may turn a ``TypeError`` into another one).
    """

    name: str
    policy: Policy
    vmapped: bool = False
    entries: list[Entry] = dataclasses.field(default_factory=list)
    index: dict[Hashable, list[int]] = dataclasses.field(default_factory=dict)
    outputs: list[Hashable | None] = dataclasses.field(default_factory=list)
    left_meta: list[tuple[torch.Size, torch.dtype]] = dataclasses.field(default_factory=list)
    rng: RngStates | None = None
    externals: list[torch.Tensor] = dataclasses.field(default_factory=list)
    written_inputs: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)
    outside: list[torch.Tensor] = dataclasses.field(default_factory=list)
    outside_versions: list[int] = dataclasses.field(default_factory=list)
    kept: list[torch.Tensor] = dataclasses.field(default_factory=list)
    returned: dict[int, dict[int, tuple[weakref.ref[torch.Tensor], int]]] = dataclasses.field(
        default_factory=dict
    )
    made: list[tuple[weakref.ref[torch.Tensor], int]] = dataclasses.field(default_factory=list)
    error: BaseException | None = None


class Sources:
    """Where each tensor seen in a run came from. Held weakly (a tensor that dies takes its
    entry with it; its ``id`` may then name another tensor, which the check of the reference
    tells apart), so the run keeps alive only what autograd keeps."""

    def __init__(self, inputs: Sequence[torch.Tensor | None]) -> None:
        self._src: dict[int, tuple[weakref.ref[torch.Tensor], Hashable]] = {}
        for i, t in enumerate(inputs):
            if t is not None:
                self.bind(compat.innermost(t), ("in", i))

    def bind(self, t: torch.Tensor, source: Hashable) -> None:
        self._src[id(t)] = (weakref.ref(t), source)

    def forget(self, t: torch.Tensor) -> None:
        self._src.pop(id(t), None)

    def get(self, t: torch.Tensor) -> Hashable | None:
        hit = self._src.get(id(t))
        return hit[1] if hit is not None and hit[0]() is t else None

    def find(self, source: Hashable) -> torch.Tensor | None:
        """The live tensor bound to ``source`` last (``None`` if there is none)."""
        found = None
        for ref, src in self._src.values():
            if src == source and (t := ref()) is not None:
                found = t
        return found


def outside_source(t: torch.Tensor) -> Hashable:
    """The source of a tensor from outside the function: a small constant by its value
    (``torch.tensor([...])`` makes a new one each run), anything else by identity and
    version (kept alive by the tape, so its ``id`` stays its own). Forward-mode AD's efficient
    zero tangents have no data to read."""
    if t._is_zerotensor():
        return ("zero", t.shape, t.dtype)
    if t.numel() <= _SMALL and t.device.type == "cpu" and not t.requires_grad:
        try:
            return ("c", t.shape, t.dtype, tuple(t.detach().flatten().tolist()))
        except RuntimeError:  # no data to read
            pass
    return ("x", id(t), version_of(t))


def version_of(t: torch.Tensor) -> int:
    """``t``'s version counter (what an in-place change bumps); -1 for inference tensors."""
    try:
        return int(t._version)
    except RuntimeError:  # inference tensors have no version counter
        return -1


def is_outside(source: Hashable | None) -> bool:
    """Whether ``source`` is that of a tensor from outside the function (or not seen before)."""
    return source is None or (isinstance(source, tuple) and source[0] in ("x", "c"))


def new_source(t: torch.Tensor, value: Hashable) -> Hashable:
    """The source of a factory's new tensor: its shape, dtype, device and what its values
    depend on (:func:`pshard._remat.ops.factory_value`), not which factory made it."""
    return ("new", t.shape, t.dtype, t.device.type, value)


_SEQUENCES = (list, tuple)
ONE = "one tensor"  # the structure of an operator's output that is a tensor (see output_template)


def flat_call(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[Any], Hashable]:
    """The leaves of an operator's ``(args, kwargs)`` (``None`` included) and their structure
    (:func:`arg_paths` names each leaf's argument). Operators take tensors, numbers and flat
    lists of them: those are flattened here without a pytree walk (a few microseconds an
    operator, twice per operator of each checkpointed call); anything deeper by optree."""
    leaves: list[Any] = []
    shape: list[int] = []
    for a in args:
        if type(a) in _SEQUENCES:
            if any(type(e) in _SEQUENCES or type(e) is dict for e in a):
                return _flat_tree(args, kwargs)
            leaves.extend(a)
            shape.append(len(a))
        elif type(a) is dict:
            return _flat_tree(args, kwargs)
        else:
            leaves.append(a)
            shape.append(-1)
    names: list[tuple[str, int]] = []
    for k, v in kwargs.items():
        if type(v) in _SEQUENCES:
            if any(type(e) in _SEQUENCES or type(e) is dict for e in v):
                return _flat_tree(args, kwargs)
            leaves.extend(v)
            names.append((k, len(v)))
        elif type(v) is dict:
            return _flat_tree(args, kwargs)
        else:
            leaves.append(v)
            names.append((k, -1))
    return leaves, (tuple(shape), tuple(names))


def _flat_tree(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[Any], Hashable]:
    return optree.tree_flatten(
        (args, kwargs),  # type: ignore[arg-type]
        none_is_leaf=True,
        namespace=NAMESPACE,
    )


def arg_paths(spec: Any) -> list[tuple[Any, ...]]:
    """The path of each leaf of a :func:`flat_call` in ``(args, kwargs)``: ``(0, i)`` the i-th
    positional argument, ``(1, name)`` a keyword argument, then the index in a list."""
    if not isinstance(spec, tuple):
        return list(spec.paths())
    positional, named = spec
    paths: list[tuple[Any, ...]] = []
    for where, items in ((0, list(enumerate(positional))), (1, list(named))):
        for head, n in items:
            if n < 0:
                paths.append((where, head))
            else:
                paths.extend((where, head, j) for j in range(n))
    return paths


def traced(leaves: Sequence[Any]) -> bool:
    """Whether an operator with these argument ``leaves`` runs on fake tensors (a tracer inside
    the function, such as ``pmap_microbatch``'s batch-dim analysis): not part of the program,
    passed through."""
    if compat.fake_mode_active():
        return True
    for x in leaves:  # a plain tensor is not fake: the common case costs a type check
        if type(x) is not torch.Tensor and isinstance(x, torch.Tensor) and compat.is_fake(x):
            return True
    return False


def key_of(
    op: Any, leaves: Sequence[Any], spec: Any, sources: Sources, extra: Any
) -> tuple[Hashable, list[torch.Tensor], list[Hashable | None]]:
    """The key of a call (see the module docs) from its :func:`flat_call`, its tensors and
    their sources (``None`` for a tensor not seen before)."""
    parts: list[Hashable] = []
    tensors: list[torch.Tensor] = []
    srcs: list[Hashable | None] = []
    for x in leaves:
        if isinstance(x, torch.Tensor):
            tensors.append(x)
            src = sources.get(x)
            srcs.append(src)
            if not (x.is_floating_point() or x.is_complex()):
                parts.append(("int", x.shape, x.dtype))  # known by its place, see the docs
                continue
            parts.append((outside_source(x) if src is None else src, x.shape, x.dtype))
        elif x is None or isinstance(x, (*_SIMPLE, _MEMORY_FORMAT)):
            parts.append(x)
        else:
            parts.append(type(x).__qualname__)
    return (op, spec, tuple(parts), extra), tensors, srcs


def output_template(
    out: Any, fresh: list[torch.Tensor], writes: list[torch.Tensor]
) -> tuple[Any, list[tuple[str, Any]]]:
    """How to rebuild ``out`` from kept tensors: its tree structure and, per leaf, ``("t", k)``
    the k-th fresh output, ``("w", m)`` the m-th written argument, ``("work", None)`` a finished
    Work, ``("v", value)`` a constant. Appends the fresh outputs to ``fresh``."""
    tmpl: list[tuple[str, Any]] = []
    if type(out) is torch.Tensor and not writes:  # most operators: one fresh tensor
        fresh.append(out)
        return ONE, [("t", len(fresh) - 1)]
    leaves, spec = optree.tree_flatten(out, none_is_leaf=True, namespace=NAMESPACE)
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            m = next((i for i, w in enumerate(writes) if w is leaf), None)
            if m is not None:
                tmpl.append(("w", m))
            else:
                tmpl.append(("t", len(fresh)))
                fresh.append(leaf)
        elif is_work(leaf):
            tmpl.append(("work", None))
        else:
            tmpl.append(("v", leaf))
    return spec, tmpl


def run_factory(sources: Sources, func: Any, args: tuple[Any, ...], kwargs: Any) -> Any:
    """Run a factory (``torch.zeros``, ``torch.arange``) and note its new tensors' sources: what
    fills them, not which factory made them (the forward and the recompute alike)."""
    out = func(*args, **kwargs)
    value = factory_value(func, args, kwargs)
    for t in fresh_outputs(out, []):
        sources.bind(t, new_source(t, value))
    return out


def rebuild(spec: Any, leaves: list[Any]) -> Any:
    """An operator's output from the structure :func:`output_template` noted and its leaves."""
    return leaves[0] if spec is ONE else optree.tree_unflatten(spec, leaves)


def fresh_outputs(out: Any, writes: list[torch.Tensor]) -> list[torch.Tensor]:
    if type(out) is torch.Tensor and not writes:
        return [out]
    leaves = optree.tree_leaves(out, none_is_leaf=True, namespace=NAMESPACE)
    return [x for x in leaves if isinstance(x, torch.Tensor) and not any(x is w for w in writes)]


def bind_outputs(
    sources: Sources, j: int, kind: str, out: Any, fresh: list[torch.Tensor], writes: list[Any]
) -> None:
    """The sources of entry ``j``'s outputs; a random draw's are its place among the draws and
    the position of each tensor in what it returns (``bernoulli_`` into a buffer in one run,
    ``bernoulli`` in the other)."""
    if kind == "random":
        tensors = [
            x for x in optree.tree_leaves(out, namespace=NAMESPACE) if isinstance(x, torch.Tensor)
        ]
        for m, t in enumerate(tensors):
            sources.bind(t, ("rand", j, m))
        return
    for k, t in enumerate(fresh):
        sources.bind(t, ("o", j, k))
    for m, t in enumerate(writes):
        sources.bind(t, ("o", j, "w", m))
