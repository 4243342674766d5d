"""The forward of a checkpoint recorded: :class:`Recorder`, the dispatch mode that writes one
:class:`~pshard._remat.tape.Entry` per operator into a :class:`~pshard._remat.tape.Tape` (what
an entry holds and how the recompute finds it: :mod:`pshard._remat.tape`)."""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch

from .. import _compat as compat
from .ops import KEEPABLE, call_kind, draw_arguments, run, storage, written
from .rng import before_draw
from .tape import (
    Entry,
    Sources,
    Tape,
    bind_outputs,
    flat_call,
    is_outside,
    key_of,
    output_template,
    outside_source,
    run_factory,
    traced,
    version_of,
)

__all__ = ["Recorder"]


class Recorder(compat.TorchDispatchMode):
    """Record the forward into ``tape`` (see the module docs); ``inputs`` are the checkpoint's
    inputs as the function receives them.

    Raises (from inside the operator that does it) when the function reads a tensor that
    requires grad without taking it as an argument (its gradient would be lost), or writes in
    place to an input that requires grad. ``name(x, name)`` is the namer of
    :func:`pshard.checkpoint_name` for this forward.
    """

    def __init__(
        self, tape: Tape, inputs: Sequence[torch.Tensor], needs: Sequence[bool] | None = None
    ) -> None:
        super().__init__()
        self.tape = tape
        self._sources = Sources(inputs)
        self._inputs = list(inputs)
        self._needs = [t.requires_grad for t in inputs] if needs is None else list(needs)
        self._input_storage = {storage(t): i for i, t in enumerate(inputs)}
        self._input_storage.pop(None, None)
        self._writer: dict[int, int] = {}  # storage -> entry that last wrote it
        self._outside: dict[int, int] = {}  # id -> index in tape.outside (held there)
        self._random = 0
        self._derived: set[int] = set()  # entries that read an input or a derived entry's output

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        leaves, spec = flat_call(args, kwargs)
        if traced(leaves):
            return func(*args, **kwargs)
        tape = self.tape
        kind = call_kind(func, args, kwargs)
        if kind == "factory":
            return run_factory(self._sources, func, args, kwargs)
        key, tensors, srcs = key_of(func, leaves, spec, self._sources, None)
        content = key
        if kind == "random":  # known by its place among the draws (functorch may draw otherwise)
            tape.rng = before_draw(tape.rng, args, kwargs)
            key = ("random", self._random)
            self._random += 1
        if None in srcs and torch.is_grad_enabled():
            self._closure(func, [t for t, src in zip(tensors, srcs, strict=True) if src is None])
        writes = written(func, args, kwargs) if kind not in ("compute", "view") else []
        if writes:
            self._before_writing(func, writes)
        out = run(func, kind, args, kwargs)
        j = len(tape.entries)
        fresh: list[torch.Tensor] = []
        entry = Entry(func, kind, *output_template(out, fresh, writes))
        entry.key = key
        if kind == "random":
            entry.draw, entry.draw_key = draw_arguments(func, args, kwargs), content
        parts = key[2] if kind != "random" else content[2]  # type: ignore[index]
        entry.floating = any(
            isinstance(p, tuple) and len(p) == 3 and p[0] != "int" and isinstance(p[1], torch.Size)
            for p in parts
        ) or any(t.is_floating_point() or t.is_complex() for t in fresh)
        entry.inputs = srcs
        entry.fresh_meta = [(t.shape, t.dtype, t.device) for t in fresh]
        tape.entries.append(entry)
        tape.index.setdefault(key, []).append(j)
        for p, (t, src) in enumerate(zip(tensors, srcs, strict=True)):
            if src is not None and not is_outside(src):
                continue
            if not (t.is_floating_point() or t.is_complex()):
                k = self._outside.setdefault(id(t), len(tape.outside))
                if k == len(tape.outside):
                    tape.outside.append(t)
                entry.outside.append((p, k))
            if src is None and self._sources.get(t) is None:  # (a tensor given twice)
                src = outside_source(t)
                self._sources.bind(t, src)
                if src[0] == "x":  # type: ignore[index]
                    tape.externals.append(t)
        if any(self._reads_input(src) for src in srcs):
            self._derived.add(j)
        bind_outputs(self._sources, j, kind, out, fresh, writes)
        if kind == "view":
            return out
        for t in writes:
            self._wrote(t, j)
        for t in fresh:
            st = storage(t)
            if st is not None:
                self._writer[st] = j
        outs = fresh + writes
        entry.n_fresh = len(fresh)
        entry.refs = [weakref.ref(t) for t in outs]
        entry.geometry = [(t.shape, t.stride(), t.storage_offset()) for t in outs]
        if kind in KEEPABLE and tensors and self._ask(func, *args, **kwargs):
            entry.saved, entry.held = True, outs
        return out

    def _reads_input(self, src: Any) -> bool:
        if not isinstance(src, tuple):
            return False
        if src[0] == "in":
            return True
        return src[0] in ("o", "rand") and src[1] in self._derived

    def derived_source(self, t: torch.Tensor) -> Any:
        """The source of ``t`` when an operation of this forward computed it from the inputs
        (its derivative may be asked for), else ``None``."""
        src = self._sources.get(compat.innermost(t))
        if isinstance(src, tuple) and src[0] in ("o", "rand") and src[1] in self._derived:
            return src
        return None

    def holding(self) -> list[int]:
        """The ``id`` of each reference this recorder holds to a tensor until :meth:`finish`
        (what a saved entry keeps)."""
        held = [id(t) for e in self.tape.entries if e.held is not None for t in e.held]
        return held + [id(e.named) for e in self.tape.entries if e.named is not None]

    def knows(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is an input of this forward or an output of one of its operations."""
        return not is_outside(self._sources.get(t))

    def _ask(self, op: Any, *args: Any, **kwargs: Any) -> bool:
        if self.tape.error is not None:
            return False
        try:
            return bool(self.tape.policy(op, *args, **kwargs))
        except Exception as e:  # raised after the forward, see Tape.error
            self.tape.error = e
            return False

    def _closure(self, func: Any, tensors: list[torch.Tensor]) -> None:
        for t in tensors:
            if t.requires_grad and self._sources.get(t) is None:
                raise ValueError(
                    f"ps.checkpoint: {self.tape.name} reads a tensor that requires grad "
                    f"(shape {tuple(t.shape)}, {t.dtype}, used by {func}) without taking it as "
                    f"an argument, so its gradient would be lost; pass it as an argument "
                    f"(ps.checkpoint(f)(x, w) rather than a closure over w), or checkpoint the "
                    f"module that holds it (ps.checkpoint(layer))"
                )

    def _before_writing(self, func: Any, writes: list[torch.Tensor]) -> None:
        """An input the function writes in place: keep its value from before (a BatchNorm's
        running statistics; the recompute starts from it), or refuse it if it needs a
        gradient."""
        for t in writes:
            i = self._input_storage.get(storage(t))
            if i is None or i in self.tape.written_inputs:
                continue
            if self._needs[i]:
                raise ValueError(
                    f"ps.checkpoint: {self.tape.name} writes its argument {i} in place (a "
                    f"tensor of shape {tuple(self._inputs[i].shape)}, with {func}) and that "
                    f"argument needs a gradient; a checkpointed function may write in place "
                    f"only to tensors that need none (a BatchNorm's running statistics); "
                    f"compute a new tensor instead (x = x * 2 rather than x.mul_(2))"
                )
            self.tape.written_inputs[i] = self._inputs[i].detach().clone()

    def _wrote(self, t: torch.Tensor, j: int) -> None:
        st = storage(t)
        if st is None:
            return
        before = self._writer.get(st)
        if before is not None and before != j:
            self.tape.entries[before].unsave()  # its kept value would be stale
        self._writer[st] = j

    def name(self, x: torch.Tensor, name: str) -> None:
        """``checkpoint_name(x, name)`` in this forward: the entry that wrote ``x``'s data is
        kept if the policy says so (``policy(checkpoint_name, x, name=name)``), recomputed if
        the policy vetoes the name."""
        from .names import checkpoint_name

        st = storage(compat.innermost(x))
        j = None if st is None else self._writer.get(st)
        if j is None:  # an input, a new tensor or a tensor from outside: nothing to recompute
            return
        entry = self.tape.entries[j]
        if self.tape.policy.vetoes(name):
            entry.unsave()
        elif entry.kind in KEEPABLE and not entry.vetoed:
            if self._ask(checkpoint_name, x, name=name):
                entry.saved = True
                if entry.held is None:
                    entry.named = compat.innermost(x)

    def finish(self, outputs: Sequence[torch.Tensor], returned: Sequence[torch.Tensor]) -> None:
        """End of the forward: note where the ``outputs`` came from (the values the function
        returned, then those that left it otherwise; what the checkpoint ``returned`` for the
        first), keep what is saved (on the CPU when the policy offloads) and
        let go of everything else."""
        tape = self.tape
        tape.outputs = [self._sources.get(compat.innermost(t)) for t in outputs]
        tape.outside_versions = [version_of(t) for t in tape.outside]
        self._outside.clear()
        self._derived.clear()
        for src, r in zip(tape.outputs, returned, strict=False):  # (not what left otherwise)
            if isinstance(src, tuple) and src[0] == "o" and isinstance(src[2], int):
                entry = tape.entries[src[1]]
                if entry.kind == "compute" and not entry.vetoed and not tape.vmapped:
                    slots = tape.returned.setdefault(src[1], {})
                    slots[src[2]] = (weakref.ref(r), r._version)
        for j, entry in enumerate(tape.entries):
            tape.made += [(ref, j) for ref in entry.refs[: entry.n_fresh]]
            returned_here = tape.returned.get(j, {})
            if returned_here and len(returned_here) == sum(t == "t" for t, _ in entry.template):
                # the checkpoint's own outputs: the recompute takes them back while they live
                # (the next layer's input, saved there anyway) and computes them again once
                # they are gone; keeping them too would hold the last layer's output for nothing
                entry.saved = False
            kept = entry.outputs() if entry.saved else None
            if kept is not None:
                entry.devices = [t.device for t in kept]
                entry.slot = len(tape.kept)
                # detached: the forward's own graph (it ran with grad) must not stay alive
                kept = [t.detach() for t in kept]
                tape.kept += [_offload(t) for t in kept] if tape.policy.offload else kept
            entry.saved = kept is not None
            entry.refs, entry.held, entry.named = [], None, None
        self._sources = Sources(())
        self._writer.clear()
        self._inputs, self._needs = [], []
        self._input_storage.clear()


def _offload(t: torch.Tensor) -> torch.Tensor:
    return t if t.device.type == "cpu" else host_copy(t, pin=True)


def host_copy(t: torch.Tensor, *, pin: bool) -> torch.Tensor:
    """``t`` copied to CPU memory (pinned with ``pin``, the copy then asynchronous), with
    ``t``'s strides where it is dense: a value kept for the recompute must come back as the
    forward had it, or the operators after it take another path (a reshape that was a view of
    it copies)."""
    host = torch.empty_like(t, device="cpu", pin_memory=pin)
    return host.copy_(t, non_blocking=pin)
