"""The in-process transport: a c10d process group whose ranks are threads of one process.

:class:`ThreadGroup` is a ``torch.distributed.ProcessGroup`` written in Python, registered as a
c10d backend (:data:`pshard._compat.THREADS_BACKEND`), so ``torch.distributed``'s own functions,
``DeviceMesh`` and everything above them run on it unchanged. The ranks of one world share a
:class:`Shared` (the store's keys, the groups' pending operations, the mailboxes of sends) and
take turns (:mod:`pshard._runtime.turns`), so its state needs no lock of its own: it is only
ever touched by the task holding the turn.

The ranks' shared state and the work handles are :mod:`pshard._runtime.rendezvous`'s; each
operation runs inside an operator that dispatch modes see (:mod:`pshard._runtime.dispatch`).

Every rank's ``k``-th collective on a group meets the others' ``k``-th; when the last one
arrives, it completes the operation for all of them at once (reductions in rank order, the same
result on every rank and from run to run) and the others find it done when they get the turn
back. Sends and receives meet in order per (source, destination, tag). Writes into other ranks'
tensors are invisible to autograd and to the dispatch modes, as a communication library's are
(:func:`pshard._compat.unseen_writes`). Ranks that call different collectives, or the same one
with shapes that cannot meet, get a ``ValueError`` naming every rank's call, where a real
backend hangs or aborts.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from .._compat import THREADS_BACKEND, innermost, unseen_writes
from .dispatch import dispatched
from .rendezvous import GroupState, Message, Shared, Slot, ThreadWork

__all__ = ["ThreadGroup"]

_REDUCE: dict[Any, tuple[str, Callable[[torch.Tensor, torch.Tensor], Any]]] = {
    dist.ReduceOp.SUM: ("sum", torch.Tensor.add_),
    dist.ReduceOp.PRODUCT: ("product", torch.Tensor.mul_),
    dist.ReduceOp.MIN: ("min", lambda a, b: torch.minimum(a, b, out=a)),
    dist.ReduceOp.MAX: ("max", lambda a, b: torch.maximum(a, b, out=a)),
    dist.ReduceOp.BAND: ("band", torch.Tensor.bitwise_and_),
    dist.ReduceOp.BOR: ("bor", torch.Tensor.bitwise_or_),
    dist.ReduceOp.BXOR: ("bxor", torch.Tensor.bitwise_xor_),
}


def _bare(x: Any) -> Any:
    """``x`` (a tensor, or a list of tensors or of lists) with ``torch.func``'s wrappers taken
    off: the transport reads and writes the tensors themselves, as a backend does."""
    if isinstance(x, torch.Tensor):
        return innermost(x)
    return [_bare(v) for v in x]


def _reduction(op: Any, fn: str) -> tuple[str, Callable[[torch.Tensor, torch.Tensor], Any]]:
    for key, value in _REDUCE.items():
        if op == key:
            return value
    if op == dist.ReduceOp.AVG:
        return ("avg", torch.Tensor.add_)
    raise ValueError(f"{fn}: reduce op {op} is not supported by in-process ranks")


def _reduce(tensors: Sequence[torch.Tensor], op: Any, fn: str) -> torch.Tensor:
    """``tensors`` reduced in rank order (a new tensor)."""
    name, combine = _reduction(op, fn)
    acc = tensors[0].clone(memory_format=torch.contiguous_format)
    for t in tensors[1:]:
        combine(acc, t)
    if name == "avg":
        acc.div_(len(tensors)) if acc.is_floating_point() else acc.floor_divide_(len(tensors))
    return acc


def _describe(op: str, tensors: Sequence[torch.Tensor]) -> str:
    shapes = ", ".join(f"{tuple(t.shape)} {str(t.dtype).replace('torch.', '')}" for t in tensors)
    return f"{op}({shapes})"


class ThreadGroup(dist.ProcessGroup):
    """One rank's handle on a process group of in-process ranks (see the module docs)."""

    def __init__(self, shared: Shared, state: GroupState, rank: int) -> None:
        super().__init__(rank, len(state.members))  # type: ignore[call-arg]
        self._shared = shared
        self._state = state
        self._rank = rank
        self._name = state.name
        self._desc = ""
        self.bound_device_id = None

    # -- identity, as c10d asks for it

    @property
    def group_name(self) -> str:  # type: ignore[override]
        return self._name

    def _set_group_name(self, name: str) -> None:
        self._name = name

    @property
    def group_desc(self) -> str:
        return self._desc

    def _set_group_desc(self, desc: str) -> None:
        self._desc = desc

    def getBackendName(self) -> str:  # noqa: N802 - c10d's name
        return THREADS_BACKEND

    def __repr__(self) -> str:
        return f"ThreadGroup({self._name!r}, rank {self._rank} of {len(self._state.members)})"

    # -- the machinery

    def _visibly(
        self, name: str, args: tuple[Any, ...], post: Callable[[], ThreadWork]
    ) -> ThreadWork:
        work = dispatched(name, args, post)
        if work is None:  # a dispatch mode replayed the operator: nothing to wait for
            return ThreadWork(self._shared.turns, lambda: True, lambda: None, f"{name} (replayed)")
        return work

    def _label(self) -> str:
        return f"process group {self._name!r} (global ranks {list(self._state.members)})"

    def _collective(
        self,
        op: str,
        part: Any,
        call: str,
        complete: Callable[[dict[int, Any]], None],
        writes: Callable[[dict[int, Any]], list[torch.Tensor]],
        result: list[torch.Tensor] | None = None,
    ) -> ThreadWork:
        """Post this rank's ``part`` of its next collective; the last rank to arrive runs
        ``complete(parts)`` (group rank -> part) inside :func:`unseen_writes` of ``writes``."""
        state = self._state
        index = state.issued[self._rank]
        state.issued[self._rank] = index + 1
        slot = state.slots.setdefault(index, Slot(op))
        slot.parts[self._rank] = part
        slot.calls[self._rank] = call
        if op != slot.op and slot.error is None:
            slot.error = self._mismatch(index, slot)
        if len(slot.parts) == len(state.members):
            del state.slots[index]
            if slot.error is None:
                try:
                    with unseen_writes(writes(slot.parts)):
                        complete(slot.parts)
                except (ValueError, RuntimeError) as exc:
                    slot.error = self._failed(index, slot, exc)
            slot.done = True
        what = f"{call} on {self._label()}"
        return ThreadWork(self._shared.turns, lambda: slot.done, lambda: slot.error, what, result)

    def _failed(self, index: int, slot: Slot, exc: BaseException) -> ValueError:
        calls = "\n".join(f"  rank {r}: {c}" for r, c in sorted(slot.calls.items()))
        return ValueError(
            f"in-process ranks: collective {index + 1} on {self._label()} failed ({exc}); "
            f"the ranks' calls:\n{calls}"
        )

    def _mismatch(self, index: int, slot: Slot) -> ValueError:
        calls = "\n".join(f"  rank {r}: {c}" for r, c in sorted(slot.calls.items()))
        return ValueError(
            f"in-process ranks: collective {index + 1} on {self._label()} does not match "
            f"across its ranks:\n{calls}\nEvery rank of a group must call the same collectives "
            f"in the same order, with shapes that fit"
        )

    # -- collectives

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> ThreadWork:  # type: ignore[override]
        tensors = _bare(tensors)
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        name = _reduction(op, "all_reduce")[0]

        def complete(parts: dict[int, Any]) -> None:
            for i in range(len(tensors)):
                total = _reduce([parts[r][i] for r in range(len(parts))], op, "all_reduce")
                for r in parts:
                    parts[r][i].copy_(total)

        return self._visibly(
            "allreduce_",
            (list(tensors),),
            functools.partial(
                self._collective,
                f"all_reduce:{name}",
                list(tensors),
                _describe(f"all_reduce[{name}]", tensors),
                complete,
                lambda parts: [t for p in parts.values() for t in p],
                list(tensors),
            ),
        )

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> ThreadWork:
        return self.allreduce(tensors, opts)

    def all_gather_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> ThreadWork:
        output, input = _bare(output), _bare(input)

        def complete(parts: dict[int, Any]) -> None:
            n = len(parts)
            for r in parts:
                out = parts[r][0].view(n, -1)
                for i in range(n):
                    out[i].copy_(parts[i][1].reshape(-1))

        return self._visibly(
            "_allgather_base_",
            (output, input),
            functools.partial(
                self._collective,
                "all_gather",
                (output, input),
                _describe("all_gather_into_tensor", [input]),
                complete,
                lambda parts: [p[0] for p in parts.values()],
                [output],
            ),
        )

    def allgather(  # type: ignore[override]
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> ThreadWork:
        outputs, inputs = _bare(outputs), _bare(inputs)

        def complete(parts: dict[int, Any]) -> None:
            for r in parts:
                for j, outs in enumerate(parts[r][0]):
                    for i in range(len(parts)):
                        outs[i].copy_(parts[i][1][j])

        return self._visibly(
            "allgather_",
            ([t for outs in outputs for t in outs], list(inputs)),
            functools.partial(
                self._collective,
                "allgather",
                (outputs, inputs),
                _describe("all_gather", inputs),
                complete,
                lambda parts: [t for p in parts.values() for outs in p[0] for t in outs],
                [t for outs in outputs for t in outs],
            ),
        )

    def allgather_coalesced(
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> ThreadWork:
        return self.allgather(outputs, inputs, opts)

    def all_gather_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> ThreadWork:
        work = None
        for o, i in zip(outputs, inputs, strict=True):
            work = self.all_gather_single(o, i, opts)
        assert work is not None
        return work

    def reduce_scatter_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> ThreadWork:
        output, input = _bare(output), _bare(input)
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        name = _reduction(op, "reduce_scatter")[0]

        def complete(parts: dict[int, Any]) -> None:
            n = len(parts)
            for r in parts:
                blocks = [parts[i][1].reshape(n, -1)[r] for i in range(n)]
                parts[r][0].view(-1).copy_(_reduce(blocks, op, "reduce_scatter"))

        return self._visibly(
            "_reduce_scatter_base_",
            (output, input),
            functools.partial(
                self._collective,
                f"reduce_scatter:{name}",
                (output, input),
                _describe(f"reduce_scatter_tensor[{name}]", [input]),
                complete,
                lambda parts: [p[0] for p in parts.values()],
                [output],
            ),
        )

    def reduce_scatter(  # type: ignore[override]
        self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None
    ) -> ThreadWork:
        outputs, inputs = _bare(outputs), _bare(inputs)
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        name = _reduction(op, "reduce_scatter")[0]

        def complete(parts: dict[int, Any]) -> None:
            for r in parts:
                for j, out in enumerate(parts[r][0]):
                    blocks = [parts[i][1][j][r] for i in range(len(parts))]
                    out.copy_(_reduce(blocks, op, "reduce_scatter"))

        return self._visibly(
            "reduce_scatter_",
            (list(outputs), [t for ins in inputs for t in ins]),
            functools.partial(
                self._collective,
                f"reduce_scatter_list:{name}",
                (outputs, inputs),
                _describe(f"reduce_scatter[{name}]", outputs),
                complete,
                lambda parts: [t for p in parts.values() for t in p[0]],
                list(outputs),
            ),
        )

    def reduce_scatter_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> ThreadWork:
        work = None
        for o, i in zip(outputs, inputs, strict=True):
            work = self.reduce_scatter_single(o, i, opts)
        assert work is not None
        return work

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: Any = None,
    ) -> ThreadWork:
        output, input = _bare(output), _bare(input)
        n = len(self._state.members)

        def splits(t: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
            if sizes:
                return list(t.split(sizes))
            return list(t.chunk(n)) if t.shape[0] else [t] * n

        def complete(parts: dict[int, Any]) -> None:
            for r in parts:
                out, _, out_sizes, _ = parts[r]
                dst = splits(out, out_sizes)
                for i in range(n):
                    src = splits(parts[i][1], parts[i][3])[r]
                    if src.numel() != dst[i].numel():
                        raise ValueError(
                            f"rank {i} sends {src.numel()} elements to rank {r}, which expects "
                            f"{dst[i].numel()}"
                        )
                    dst[i].copy_(src.reshape(dst[i].shape))

        return self._visibly(
            "alltoall_base_",
            (output, input),
            functools.partial(
                self._collective,
                "all_to_all",
                (output, input, list(output_split_sizes), list(input_split_sizes)),
                _describe("all_to_all_single", [input]),
                complete,
                lambda parts: [p[0] for p in parts.values()],
                [output],
            ),
        )

    def alltoall(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> ThreadWork:
        outputs, inputs = _bare(outputs), _bare(inputs)

        def complete(parts: dict[int, Any]) -> None:
            for r in parts:
                for i in range(len(parts)):
                    parts[r][0][i].copy_(parts[i][1][r])

        return self._visibly(
            "alltoall_",
            (list(outputs), list(inputs)),
            functools.partial(
                self._collective,
                "all_to_all_list",
                (outputs, inputs),
                _describe("all_to_all", inputs),
                complete,
                lambda parts: [t for p in parts.values() for t in p[0]],
                list(outputs),
            ),
        )

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> ThreadWork:  # type: ignore[override]
        tensors = _bare(tensors)
        root = opts.rootRank if opts is not None else 0
        index = opts.rootTensor if opts is not None else 0

        def complete(parts: dict[int, Any]) -> None:
            source = parts[root][index].clone()
            for r in parts:
                if r != root:
                    parts[r][index].copy_(source)

        return self._visibly(
            "broadcast_",
            (list(tensors),),
            functools.partial(
                self._collective,
                f"broadcast:{root}",
                list(tensors),
                _describe(f"broadcast[src={root}]", tensors),
                complete,
                lambda parts: [p[index] for r, p in parts.items() if r != root],
                list(tensors),
            ),
        )

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> ThreadWork:  # type: ignore[override]
        tensors = _bare(tensors)
        root = opts.rootRank if opts is not None else 0
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        name = _reduction(op, "reduce")[0]

        def complete(parts: dict[int, Any]) -> None:
            total = _reduce([parts[r][0] for r in range(len(parts))], op, "reduce")
            parts[root][0].copy_(total)

        return self._visibly(
            "reduce_",
            (list(tensors),),
            functools.partial(
                self._collective,
                f"reduce:{name}:{root}",
                list(tensors),
                _describe(f"reduce[{name}, dst={root}]", tensors),
                complete,
                lambda parts: [parts[root][0]],
                list(tensors),
            ),
        )

    def gather(  # type: ignore[override]
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> ThreadWork:
        outputs, inputs = _bare(outputs), _bare(inputs)
        root = opts.rootRank if opts is not None else 0

        def complete(parts: dict[int, Any]) -> None:
            for i in range(len(parts)):
                parts[root][0][0][i].copy_(parts[i][1][0])

        return self._visibly(
            "gather_",
            ([t for outs in outputs for t in outs], list(inputs)),
            functools.partial(
                self._collective,
                f"gather:{root}",
                (outputs, inputs),
                _describe(f"gather[dst={root}]", inputs),
                complete,
                lambda parts: list(parts[root][0][0]),
                [t for outs in outputs for t in outs],
            ),
        )

    def scatter(  # type: ignore[override]
        self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None
    ) -> ThreadWork:
        outputs, inputs = _bare(outputs), _bare(inputs)
        root = opts.rootRank if opts is not None else 0

        def complete(parts: dict[int, Any]) -> None:
            for r in parts:
                parts[r][0][0].copy_(parts[root][1][0][r])

        return self._visibly(
            "scatter_",
            (list(outputs), [t for ins in inputs for t in ins]),
            functools.partial(
                self._collective,
                f"scatter:{root}",
                (outputs, inputs),
                _describe(f"scatter[src={root}]", outputs),
                complete,
                lambda parts: [p[0][0] for p in parts.values()],
                list(outputs),
            ),
        )

    def barrier(self, opts: Any = None) -> ThreadWork:
        post = functools.partial(
            self._collective, "barrier", None, "barrier()", lambda parts: None, lambda p: []
        )
        return self._visibly("barrier", (), post)

    # -- point to point

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> ThreadWork:
        return self._visibly(
            "send", (list(tensors),), functools.partial(self._p2p, tensors, dst, tag, True)
        )

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> ThreadWork:
        return self._visibly(
            "recv_", (list(tensors),), functools.partial(self._p2p, tensors, src, tag, False)
        )

    def _p2p(self, tensors: list[torch.Tensor], peer: int, tag: int, sending: bool) -> ThreadWork:
        tensors = _bare(tensors)
        message = Message(tensors[0])
        if sending:
            self._post(self._state.sends, (self._rank, peer, tag), message)
            what = f"a send to rank {peer} (tag {tag}) on {self._label()}"
        else:
            self._post(self._state.recvs, (peer, self._rank, tag), message)
            what = f"a receive from rank {peer} (tag {tag}) on {self._label()}"
        return ThreadWork(
            self._shared.turns, lambda: message.done, lambda: message.error, what, list(tensors)
        )

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> ThreadWork:
        raise ValueError("in-process ranks: a receive from any source is not supported")

    def _post(
        self,
        boxes: dict[tuple[int, int, int], collections.deque[Message]],
        key: tuple[int, int, int],
        message: Message,
    ) -> None:
        boxes.setdefault(key, collections.deque()).append(message)
        sends = self._state.sends.get(key)
        recvs = self._state.recvs.get(key)
        while sends and recvs:
            sent, received = sends.popleft(), recvs.popleft()
            src, dst = sent.tensor, received.tensor
            if src.numel() != dst.numel() or src.dtype != dst.dtype:
                error = ValueError(
                    f"in-process ranks: rank {key[0]} sent {_describe('', [src])[1:-1]} to rank "
                    f"{key[1]} (tag {key[2]}) on {self._label()}, which receives into "
                    f"{_describe('', [dst])[1:-1]}"
                )
                sent.error = received.error = error
            else:
                with unseen_writes([dst]):
                    dst.copy_(src.reshape(dst.shape))
            sent.done = received.done = True
