"""The replay of a checkpoint's forward in its recompute (see :mod:`pshard._remat.tape`).

:class:`Replayer` identifies each operator the recompute runs by its key (operator, arguments
by source) against the :class:`~pshard._remat.tape.Tape` of the forward: a kept entry returns
its kept outputs; an entry whose outputs the checkpoint returned and that are still alive and
unchanged returns those; an entry that only feeds those through sums is not run
(:func:`_unread`); everything else runs. At its end it checks that the recompute ran the
forward's program.
"""

from __future__ import annotations

import weakref
from collections.abc import Hashable, Sequence
from typing import Any

import torch

from pshard._core.tree import article

from .. import _compat as compat
from .explain import difference, draw_difference
from .ops import (
    BOOKKEEPING,
    INPUT_FREE,
    OUTPUT_FREE,
    call_kind,
    describe_call,
    draw_arguments,
    run,
    storage,
    written,
)
from .rng import Rewind
from .tape import (
    Entry,
    Sources,
    Tape,
    bind_outputs,
    flat_call,
    fresh_outputs,
    is_outside,
    key_of,
    rebuild,
    run_factory,
    traced,
    version_of,
)

__all__ = ["Replayer"]


def _alive(slot: tuple[weakref.ref[torch.Tensor], int] | None) -> torch.Tensor | None:
    if slot is None:
        return None
    t = slot[0]()
    return t if t is not None and t._version == slot[1] else None


def _unread(tape: Tape, returned: set[int]) -> set[int]:
    """The entries the recompute need not run: each output is read only by operators the
    recompute replays and whose derivative does not read it (the last matrix product of a
    residual layer, whose sum with the input is the checkpoint's output, still alive), their
    own derivative does not read their output, and none is an output of the function. What
    autograd keeps for their derivatives (their inputs) is computed as usual."""
    consumers: dict[int, list[int]] = {}
    for c, entry in enumerate(tape.entries):
        for src in entry.inputs:
            if isinstance(src, tuple) and src[0] == "o":
                consumers.setdefault(src[1], []).append(c)
    outputs = {src[1] for src in tape.outputs if isinstance(src, tuple) and src[0] == "o"}
    unread: set[int] = set()
    for i in range(len(tape.entries) - 1, -1, -1):
        entry = tape.entries[i]
        if i in returned or i in outputs or entry.saved or entry.kind not in ("compute", "view"):
            continue
        if entry.op._opname not in OUTPUT_FREE and entry.kind != "view" or not entry.floating:
            continue
        readers = consumers.get(i)
        if readers and all(
            (c in returned or c in unread)
            and (tape.entries[c].op._opname in INPUT_FREE or tape.entries[c].kind == "view")
            for c in readers
        ):
            unread.add(i)
    return unread


def _stand_ins(entry: Entry) -> list[torch.Tensor]:
    """Outputs for an entry the recompute does not run: a NaN broadcast to each output's shape
    (no memory; a value nothing reads, and NaN if something ever did)."""
    return [
        torch.full((), float("nan"), dtype=dtype, device=device).expand(shape)
        for shape, dtype, device in entry.fresh_meta
    ]


class Replayer(compat.TorchDispatchMode):
    """Replay ``tape`` in a recompute whose inputs are ``inputs``, with the values ``kept``
    (:attr:`Tape.kept`, as autograd held them) (see the module docs). ``replayed``: how many
    operators took a kept value instead of running."""

    def __init__(
        self,
        tape: Tape,
        inputs: Sequence[torch.Tensor | None],
        kept: Sequence[torch.Tensor],
    ) -> None:
        super().__init__()
        self.tape = tape
        self._kept = kept
        self._sources = Sources(inputs)
        self._next: dict[int, int] = {}  # id of a key's candidates in tape.index -> next one
        self._matched = bytearray(len(tape.entries))
        self._random = 0
        self._rewind = Rewind(tape.rng) if tape.rng is not None else None
        self._unmatched: str | None = None
        self._unmatched_keys: dict[Any, Hashable] = {}  # operator -> its first unmatched call
        self._changed: str | None = None  # a tensor from outside that changed, see finish
        self._carried: int | None = None  # the forward's entry whose output it read from outside
        self._made: dict[int, int] | None = None  # storage -> the forward's entry that made it
        self.replayed = 0
        self._returned: dict[int, list[torch.Tensor]] = {}
        for j, slots in tape.returned.items():
            n = sum(tag == "t" for tag, _ in tape.entries[j].template)
            alive = [_alive(slots.get(k)) for k in range(n)]
            if all(t is not None for t in alive):
                self._returned[j] = alive  # type: ignore[assignment]
        # (not under forward-mode AD, which writes the tangents of what the stand-ins replace)
        forward_mode = compat.forward_ad_active() or any(
            kind == "jvp" for kind, _ in compat.transforms()
        )
        self._unread = set() if forward_mode else _unread(tape, set(self._returned))

    def __enter__(self) -> Replayer:
        # the forward's generator states from the start, not from the first draw seen here: a
        # checkpoint nested inside records the states it sees before its draws reach this mode
        if self._rewind is not None:
            self._rewind.start()
        super().__enter__()
        return self

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        leaves, spec = flat_call(args, kwargs)
        if traced(leaves):
            return func(*args, **kwargs)
        kind = call_kind(func, args, kwargs)
        if kind == "factory":
            return run_factory(self._sources, func, args, kwargs)
        key, tensors, srcs = key_of(func, leaves, spec, self._sources, None)
        if self._carried is None and any(is_outside(src) for src in srcs):
            self._carried = self._carried_from_forward(tensors)
        content = key
        if kind == "random":
            key = ("random", self._random)
            self._random += 1
        j, again = None, False
        candidates = self.tape.index.get(key)
        if candidates is not None:
            slot = id(candidates)  # the key's list of entries: hashed once per operator
            n = self._next.get(slot, 0)
            if n < len(candidates):
                j = candidates[n]
                self._next[slot] = n + 1
                self._matched[j] = 1
            elif kind in ("compute", "view"):  # the same value again (an outer jvp's helper)
                j, again = candidates[-1], True
        writes = written(func, args, kwargs) if kind not in ("compute", "view") else []
        entry = None if j is None else self.tape.entries[j]
        if entry is not None and j is not None and not again and self._changed is None:
            if entry.outside:
                self._changed = self._outside_changed(entry, j, tensors)
            elif kind == "random" and entry.op is func:  # not when functorch draws otherwise
                draw = draw_arguments(func, args, kwargs)
                self._changed = self._draw_changed(entry, j, draw, content)
        if entry is not None and not again and (entry.saved or j in self._returned):
            out, fresh = self._replay(entry, writes, self._returned.get(j))  # type: ignore[arg-type]
            self.replayed += 1
        elif entry is not None and not again and j in self._unread:
            out, fresh = self._replay(entry, writes, _stand_ins(entry))
            self.replayed += 1
        else:
            out = run(func, kind, args, kwargs)
            fresh = fresh_outputs(out, writes)
        if j is None:
            if kind != "view" and func._opname not in BOOKKEEPING:
                if self._unmatched is None:
                    self._unmatched = describe_call(func, tensors)
                self._unmatched_keys.setdefault(func, key)
            for t in writes:
                self._sources.forget(t)
            return out
        bind_outputs(self._sources, j, kind, out, fresh, writes)
        return out

    def tensor_of(self, source: Hashable) -> torch.Tensor | None:
        """The recompute's tensor for the forward's ``source`` (``None`` if it made none)."""
        return self._sources.find(source)

    def _outside_changed(self, entry: Entry, j: int, tensors: list[torch.Tensor]) -> str | None:
        """Why an integer or boolean tensor from outside that entry ``j`` read differs from the
        forward's (``None`` if none does). One the recompute computed itself may stand for one
        the forward took from a cache, and the other way round (see the module docs of
        :mod:`pshard._remat.tape`)."""
        tape = self.tape
        for p, k in entry.outside:
            t = tensors[p]
            if not is_outside(self._sources.get(t)):
                continue
            before = tape.outside[k]
            if version_of(before) != tape.outside_versions[k]:
                how = "was modified in place"
            elif t is before or (t.device == before.device and torch.equal(t, before)):
                continue
            else:
                how = "was replaced by a tensor of other values"
            kind = str(t.dtype).removeprefix("torch.")
            return (
                f"ps.checkpoint: {tape.name} read {article(kind)} tensor from outside (shape "
                f"{tuple(t.shape)}, used by {entry.op}, operation {j + 1} of "
                f"{len(tape.entries)}) that {how} between the forward and the backward; the "
                f"recompute would compute another gradient than the forward's (without a "
                f"checkpoint, autograd raises too). Keep it unchanged until the backward (change "
                f"a copy), or pass it to the checkpointed function as an argument"
            )
        return None

    def _carried_from_forward(self, tensors: Sequence[torch.Tensor]) -> int | None:
        """The forward's entry that computed one of ``tensors`` read from outside (state the
        function kept from its forward: a cache), for the "another path" error."""
        for t in tensors:
            if not is_outside(self._sources.get(t)) or (s := storage(t)) is None:
                continue
            if self._made is None:
                self._made = {}
                for ref, j in self.tape.made:
                    if (out := ref()) is not None and (made := storage(out)) is not None:
                        self._made.setdefault(made, j)
            if s in self._made:
                return self._made[s]
        return None

    def _draw_changed(
        self, entry: Entry, j: int, draw: tuple[tuple[str, Any], ...], content: Hashable
    ) -> str | None:
        """Why a random draw of the recompute, the forward's draw ``j`` by its place and the
        same operator, differs in its arguments: a number (a rate, a deviation) or a tensor it
        reads (the probabilities of ``torch.bernoulli``)."""
        differs = draw_difference(entry.draw, draw) or difference(entry.op, entry.draw_key, content)
        if differs is None:
            return None
        return (
            f"ps.checkpoint: the recompute of {self.tape.name} drew with {differs} (the random "
            f"draw {entry.text}, operation {j + 1} of {len(self.tape.entries)}): it would draw "
            f"other numbers than the forward did. A checkpointed function must compute the same "
            f"thing each time it is called with the same arguments; make the draw depend on its "
            f"arguments only (a dropout rate that changes between the forward and the backward)"
        )

    def _replay(
        self, entry: Entry, writes: list[torch.Tensor], returned: list[torch.Tensor] | None
    ) -> tuple[Any, list[torch.Tensor]]:
        if returned is not None and not entry.saved:  # alive outputs, or stand-ins
            fresh = [t.detach() for t in returned]
        else:  # fresh aliases (autograd may set a history on them); written tensors get copies
            n = entry.n_fresh
            kept = self._kept[entry.slot : entry.slot + len(entry.devices)]
            fresh = [
                t.to(d, non_blocking=True).detach()
                for t, d in zip(kept[:n], entry.devices, strict=False)
            ]
            for w, t in zip(writes, kept[n:], strict=True):
                w.copy_(t, non_blocking=True)
        leaves: list[Any] = []
        for tag, value in entry.template:
            if tag == "t":
                leaves.append(fresh[value])
            elif tag == "w":
                leaves.append(writes[value])
            elif tag == "work":
                leaves.append(compat.completed_work(writes))
            else:
                leaves.append(value)
        return rebuild(entry.spec, leaves), fresh

    def finish(self, outputs: Sequence[torch.Tensor | None], *, vmapped: bool) -> None:
        """Check that the recompute ran the forward's program (see the module docs)."""
        tape = self.tape
        if vmapped or tape.vmapped:
            return
        if self._changed is not None:
            raise ValueError(self._changed)
        instead = f"; it ran {self._unmatched} instead" if self._unmatched else ""
        carried = ""
        if self._carried is not None:
            j = self._carried
            carried = (
                f". The tensor from outside that the recompute read is the output of operation "
                f"{j + 1} of its forward ({tape.entries[j].op}), kept outside the function (in a "
                f"cache, a list or an attribute it writes): a checkpointed function must not "
                f"carry state from one call to the next; turn that state off (a key/value cache "
                f"is not needed to differentiate) or do not checkpoint the function"
            )
        advice = (
            "A checkpointed function must compute the same thing each time it is called with "
            "the same arguments; a Python branch on a value that changed between the forward "
            "and the backward (a counter, a global flag, a tensor from outside modified in "
            "place) would make its gradient wrong. Make it depend on its arguments only, or do "
            "not checkpoint it"
        )
        for j, entry in enumerate(tape.entries):
            if self._matched[j] or entry.kind == "view" or not entry.floating:
                continue
            if entry.op._opname in BOOKKEEPING:
                continue
            other = self._unmatched_keys.get(entry.op)
            differs = None if other is None else difference(entry.op, entry.key, other)
            raise ValueError(
                f"ps.checkpoint: the recompute of {tape.name} took another path than its "
                f"forward: the forward ran {entry.text} (operation {j + 1} of "
                f"{len(tape.entries)}), which the recompute did not"
                f"{instead if differs is None else f'; it ran it with {differs}'}{carried}. "
                f"{advice}"
            )
        for i, (t, src) in enumerate(zip(outputs, tape.outputs, strict=True)):
            if t is None:  # a tensor that left the forward by another route
                shape, dtype = tape.left_meta[i - len(tape.outputs)]
                raise ValueError(
                    f"ps.checkpoint: the recompute of {tape.name} took another path than its "
                    f"forward: a tensor its forward let out by another route than its return "
                    f"value ({tuple(shape)}, {dtype}: appended to a list, written to a dict or "
                    f"an attribute, or recorded by a forward hook) was not computed again"
                    f"{instead}{carried}. {advice}"
                )
            if src is not None and self._sources.get(compat.innermost(t)) != src:
                raise ValueError(
                    f"ps.checkpoint: the recompute of {tape.name} took another path than its "
                    f"forward: its output {i} ({tuple(t.shape)}, {t.dtype}) was computed "
                    f"differently{instead}{carried}. {advice}"
                )

    def close(self) -> None:
        """Put the generators back where the backward had them; let go of the run."""
        if self._rewind is not None:
            self._rewind.finish()
        self._sources = Sources(())
        self._kept = ()
        self._returned = {}
