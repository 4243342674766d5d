"""Run one rank's part of a pipeline schedule (:mod:`pshard._pipeline.schedule`).

The rank walks its plan (:func:`~pshard._pipeline.schedule.rank_plan`) in order. A forward
runs its stage (:mod:`pshard._pipeline.stage_call`) on the microbatch, or on the activation
received from the stage before, and sends its output on; a backward pulls the cotangent
received from the stage after (or the loss's, 1) back through its pullback, adds the
parameters' cotangent to the gradient and sends the input's upstream. Each pullback is
dropped as soon as its backward ran, and each sent tensor once its receiver is some ticks
past the action that takes it (:meth:`Outbox.settle`; ``2 N`` ticks, so that a receiver
running a little behind the timeline does not hold the sender up), so a rank holds only the
microbatches its schedule keeps alive, and a few sent activations.
Receives are posted an action ahead (:class:`Inbox`).

Failures do not strand the other ranks. A rank whose stage raises, or returns a dtype or a
shape beyond the split dim that differs from its first microbatch's, records the failure
and goes on with the schedule without computing: it still sends every message, with zeros
(or a header saying no data follows), so every send and receive still pairs up. At the end
every rank exchanges its status (one all-reduce, with the loss); then every rank raises: the
failing rank its own exception, the others the same error naming the stage and the rank.

A trace (:func:`record`) lists what the rank did and when, for tests and benchmarks.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from .._core.checks import WIRE_DTYPES
from .._core.tree import describe
from .._runtime.ranges import ranged
from .schedule import Action, Message, PipelineSchedule, Step, rank_plan
from .stage_call import Output, Pullback, StageParams, run_stage
from .transport import NO_DATA, Inbox, Layout, Link, Outbox

__all__ = ["Event", "Executor", "Failure", "record"]

_LOOKAHEAD = 2  # actions whose receives are posted ahead
_DETAIL = 768  # bytes of each rank's error text in the status exchange

_TRACE: contextvars.ContextVar[list[Event] | None] = contextvars.ContextVar(
    "pshard_pipeline_trace", default=None
)


@dataclasses.dataclass(frozen=True)
class Event:
    """One entry of a trace: ``what`` (``"wait"``, ``"compute"``, ``"send"``) for an action
    or a message, from ``start`` to ``end`` (``time.perf_counter()``)."""

    what: str
    action: Action | None
    message: Message | None
    start: float
    end: float


@contextlib.contextmanager
def record() -> Iterator[list[Event]]:
    """Collect the :class:`Event` s of the pipelines run in this context (this rank's)."""
    events: list[Event] = []
    token = _TRACE.set(events)
    try:
        yield events
    finally:
        _TRACE.reset(token)


@dataclasses.dataclass
class Failure:
    """What went wrong on this rank, in ``stage``: ``kind`` 1 a mistake in the call (a
    ``ValueError`` on every rank), 2 the stage raised (``exc``), 3 an input or a cotangent
    that never came (a failure elsewhere)."""

    kind: int
    stage: int
    text: str
    exc: BaseException | None = None


class Executor:
    """One rank's run of a schedule. See the module docs.

    Args:
        fn_name: the public function, for messages.
        axis: the pipeline axis' name, for messages.
        link: the axis.
        schedule: the schedule every rank runs.
        fns: this rank's stage functions, by stage: ``fn(params, x)``; the last stage's
            ``fn(params, x, microbatch)`` returns what the schedule's cotangent pairs with.
        params: this rank's stages' parameters, by stage.
        inputs: the first stage's input of each microbatch.
        sizes: each microbatch's size along the split dim.
        split_dim: the split dim of activations (their shape beyond it must not change).
        mode: ``"full"``, ``"vjp"``, ``"split"`` (zero bubble) or ``"none"`` (no gradient):
            see :mod:`pshard._pipeline.stage_call`.
        loss: the last stage returns the microbatch's loss (a scalar), summed here.
        input_grads: differentiate the first stage with respect to its inputs too.
    """

    def __init__(
        self,
        *,
        fn_name: str,
        axis: str,
        link: Link,
        schedule: PipelineSchedule,
        fns: dict[int, Callable[..., Any]],
        params: dict[int, StageParams],
        inputs: Sequence[Any],
        sizes: Sequence[int],
        split_dim: int,
        mode: str,
        loss: bool = False,
        input_grads: bool = False,
    ) -> None:
        self.fn_name = fn_name
        self.axis = axis
        self.link = link
        self.schedule = schedule
        self.fns = fns
        self.params = params
        self.inputs = inputs
        self.sizes = list(sizes)
        self.split_dim = split_dim
        self.mode = mode
        self.loss_mode = loss
        self.input_grads = input_grads
        self.last = schedule.num_stages - 1
        self.plan = rank_plan(schedule, link.rank)
        self.layouts = _Layouts(self.sizes)
        self.failure: Failure | None = None
        self.pulls: dict[tuple[int, int], Pullback | None] = {}
        self.saved_ct: dict[tuple[int, int], Any] = {}
        self.grads: dict[int, list[torch.Tensor] | None] = dict.fromkeys(params)
        self.loss: torch.Tensor | None = None  # the sum so far (last stage), float64
        self.loss_dtype: torch.dtype | None = None
        self.outputs: dict[int, Any] = {}  # the last stage's outputs (no loss)
        self.out_cts: dict[int, Any] = {}  # their cotangents, given from outside
        self.input_cts: dict[int, tuple[Any, ...]] = {}  # the first stage's inputs' cotangents
        # the layout of each stage's first output (the others must match it beyond the split dim)
        self.first: dict[int, tuple[int, Layout]] = {}
        self.got: dict[tuple[int, int], Any] = {}  # the layout of each stage's input
        self.local: dict[Action, Any] = {}
        self.outbox = Outbox(link)
        self.inboxes: dict[int, Inbox] = {}
        for src in range(link.size):
            msgs = schedule.channel(src, link.rank)
            if src != link.rank and msgs:
                lay = self.layouts  # not the executor: no cycle through the inboxes
                self.inboxes[src] = Inbox(link, src, msgs, lay.expect, lay.on_header)
        self.trace = _TRACE.get()

    # --- running ---------------------------------------------------------------------------

    def run(self, kinds: str = "FBIW") -> None:
        """Run this rank's actions whose kind is in ``kinds``, in the plan's order."""
        steps = [s for s in self.plan if s.action.kind in kinds]
        slack = 2 * self.link.size  # ticks: a receiver running a little late is not waited for
        for i, step in enumerate(steps):
            self.outbox.settle(step.tick - slack)
            for ahead in steps[i : i + _LOOKAHEAD]:
                for msg in ahead.recv:
                    if msg.src != self.link.rank:
                        self.inboxes[msg.src].post(msg.index, block=False)
            a = step.action
            with ranged(a.range_name):
                if a.kind == "F":
                    self._forward(step)
                elif a.kind == "B":
                    self._backward(step, inputs=True, weights=True)
                elif a.kind == "I":
                    self._backward(step, inputs=True, weights=False)
                else:
                    self._backward(step, inputs=False, weights=True)
        self.outbox.wait()

    def fail(self, kind: int, stage: int, text: str, exc: BaseException | None = None) -> None:
        if self.failure is None:
            self.failure = Failure(kind, stage, text, exc)

    def _where(self, stage: int) -> str:
        return f"stage {stage} (rank {self.link.rank} of axis {self.axis!r})"

    def _compute(self, a: Action, fn: Callable[[], Any]) -> Any:
        """``fn()`` unless this rank has failed; an exception is recorded, not raised."""
        if self.failure is not None:
            return None
        start = time.perf_counter()
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - raised again at the end, on this rank
            self.fail(
                2,
                a.stage,
                f"{self._where(a.stage)} raised {type(e).__name__}: {e} (in {a})",
                e,
            )
            return None
        finally:
            if self.trace is not None:
                self.trace.append(Event("compute", a, None, start, time.perf_counter()))

    def _receive(self, msg: Message) -> tuple[Any, tuple[torch.Tensor, ...]]:
        if msg.src == self.link.rank:
            return self.local.pop(msg.producer)
        start = time.perf_counter()
        got = self.inboxes[msg.src].take(msg)
        if self.trace is not None:
            self.trace.append(Event("wait", msg.consumer, msg, start, time.perf_counter()))
        return got

    def _send(
        self, msg: Message, layout: Any, tensors: Sequence[torch.Tensor], header: Any
    ) -> None:
        if msg.dst == self.link.rank:
            self.local[msg.producer] = (layout, tuple(tensors))
            return
        start = time.perf_counter()
        self.outbox.send(msg, tensors if layout is not NO_DATA else None, header)
        if self.trace is not None:
            self.trace.append(Event("send", msg.producer, msg, start, time.perf_counter()))

    # --- forward ---------------------------------------------------------------------------

    def _forward(self, step: Step) -> None:
        a = step.action
        s, m = a.stage, a.microbatch
        if s == 0:
            x: Any = self.inputs[m]
        else:
            layout, tensors = self._receive(step.recv[0])
            self.got[(s, m)] = layout
            if layout is NO_DATA:
                self.fail(3, s, f"{self._where(s)} got no input for microbatch {m}")
                x = None
            else:
                x = layout.build(tensors)
        mode = self.mode
        wrt_x = s > 0 or self.input_grads
        fn = self.fns[s]
        if s == self.last:
            call: Callable[[Any, Any], Any] = lambda p, x_: fn(p, x_, m)  # noqa: E731
        else:
            call = fn
        result = self._compute(
            a, lambda: run_stage(call, self.params[s], x, wrt_x=wrt_x, mode=mode)
        )
        out: Output | None = None
        if result is not None:
            out, self.pulls[(s, m)] = result
        if s == self.last:
            if out is not None:
                self._keep_last(s, m, out)
            return
        value = out.value if out is not None else None
        self._send_activation(step.send[0], value)

    def _keep_last(self, s: int, m: int, out: Output) -> None:
        value = out.value
        if self.loss_mode:
            if not (isinstance(value, torch.Tensor) and value.ndim == 0 and out.floats):
                self.fail(1, s, (
                    f"{self.fn_name}: loss_fn returned {describe(value)} for microbatch {m} "
                    f"(on {self._where(s)}); it must return the microbatch's loss, a "
                    f"floating-point scalar (reduce it, e.g. with .sum())"
                ))  # fmt: skip
                return
            self.loss_dtype = value.dtype
            loss = value.detach().to(torch.float64)
            self.loss = loss if self.loss is None else self.loss + loss
        elif self.mode != "none" and not out.floats:
            self.fail(1, s, (
                f"{self.fn_name}: {self._where(s)} returned {describe(value)}: nothing to "
                f"differentiate (the last stage's output needs a floating-point tensor)"
            ))  # fmt: skip
            return
        self.outputs[m] = value

    def _layout_problem(self, s: int, m: int, value: Any) -> tuple[int, str] | None:
        """Why ``value`` (stage ``s``'s output for microbatch ``m``) cannot be sent, if so."""
        where = f"{self.fn_name}: {self._where(s)}"
        tuple_ok = isinstance(value, tuple) and all(isinstance(t, torch.Tensor) for t in value)
        if not (isinstance(value, torch.Tensor) or (tuple_ok and value)):
            return 1, (
                f"{where} returned {describe(value)} for microbatch {m}; stages hand each other "
                f"a tensor or a tuple of tensors"
            )
        layout = Layout.of(value)
        if layout.encode() is None:
            return 1, (
                f"{where} returned {layout.describe()} for microbatch {m}, which does not fit "
                f"in the small header that tells the next stage the shapes; return at most a "
                f"few tensors of at most a few dims each (a dtype of {WIRE_DTYPES})"
            )
        first = self.first.get(s)
        if first is None:
            return None
        m0, layout0 = first
        if not _same_beyond(layout, layout0, self.split_dim):
            return 1, (
                f"{where} returned {layout.describe()} for microbatch {m} but "
                f"{layout0.describe()} for microbatch {m0}: a stage's output must keep its "
                f"dtype and its shape beyond the split dim {self.split_dim} for every "
                f"microbatch (the next rank receives it into buffers of an agreed shape)"
            )
        return None

    def _send_activation(self, msg: Message, value: Any) -> None:
        s, m = msg.stage, msg.microbatch
        key = (s, self.sizes[m])
        header = m in self.layouts.header_mbs
        sent_class = self.layouts.sent_class
        if value is not None:
            problem = self._layout_problem(s, m, value)
            if problem is None and not header and Layout.of(value) != sent_class[key]:
                m0 = self.sizes.index(self.sizes[m])
                problem = (
                    1,
                    (
                        f"{self.fn_name}: {self._where(s)} returned {Layout.of(value).describe()} "
                        f"for microbatch {m} but {sent_class[key].describe()} for microbatch "
                        f"{m0} of the same size: a stage's output shape must depend on the "
                        f"microbatch's size alone"
                    ),
                )
            if problem is not None:
                self.fail(problem[0], s, problem[1])
                value = None
        if value is not None:
            layout = Layout.of(value)
            self.first.setdefault(s, (m, layout))
            tensors = layout.tensors(value)
        elif header:
            layout, tensors = NO_DATA, ()
        else:  # the agreed layout, zeros in place of what could not be computed
            layout = sent_class[key]
            tensors = () if layout is NO_DATA else _zeros(layout, self.link.device)
        if header:
            sent_class[key] = layout
        self.layouts.sent[(s, m)] = layout
        said = (None if layout is NO_DATA else layout) if header else False
        self._send(msg, layout, tensors, said)

    # --- backward --------------------------------------------------------------------------

    def _cotangent(self, step: Step) -> Any:
        """The cotangent of ``step``'s stage output (``None``: none came)."""
        a = step.action
        s, m = a.stage, a.microbatch
        if s == self.last:
            if m in self.out_cts:
                return self.out_cts.pop(m)
            out = self.outputs.get(m)
            if self.mode == "none" or out is None:
                return None
            return (torch.ones_like(out),) if isinstance(out, torch.Tensor) else None
        layout, tensors = self._receive(step.recv[0])
        return None if layout is NO_DATA else tuple(tensors)

    def _backward(self, step: Step, *, inputs: bool, weights: bool) -> None:
        a = step.action
        s, m = a.stage, a.microbatch
        key = (s, m)
        if inputs or s == 0:
            ct = self._cotangent(step)
        else:
            ct = self.saved_ct.pop(key)
        if not weights:
            self.saved_ct[key] = ct
        pull = self.pulls.get(key)
        if ct is None or pull is None:
            self.fail(3, s, f"{self._where(s)} got no cotangent for microbatch {m}")
        gx: Any = None
        if inputs and weights:
            got = self._compute(a, lambda: pull.both(ct))  # type: ignore[union-attr]
            if got is not None:
                gp, gx = got
                if gp is not None:  # else added into the stage's autograd leaves
                    self._accumulate(s, gp)
        elif inputs:
            gx = self._compute(a, lambda: pull.inputs(ct))  # type: ignore[union-attr]
        else:
            gp = self._compute(a, lambda: pull.weights(ct))  # type: ignore[union-attr]
            if gp is not None:
                self._accumulate(s, gp)
        if weights:
            self.pulls.pop(key, None)  # its activations go now
        if s == 0:
            if gx is not None and self.input_grads:
                self.input_cts[m] = gx
            return
        if step.send:
            self._send_cotangent(step.send[0], gx)

    def _send_cotangent(self, msg: Message, gx: Any) -> None:
        got = self.got.pop((msg.stage, msg.microbatch))
        if got is NO_DATA:
            self._send(msg, NO_DATA, (), False)
            return
        layout = Layout(True, got.floats())
        tensors = _zeros(layout, self.link.device) if gx is None else tuple(gx)
        self._send(msg, layout, tensors, False)

    def _accumulate(self, s: int, gp: tuple[torch.Tensor, ...]) -> None:
        acc = self.grads[s]
        if acc is None:
            self.grads[s] = list(gp)
        else:
            for total, g in zip(acc, gp, strict=True):
                total.add_(g)

    # --- the end ---------------------------------------------------------------------------

    def status(self, extra: Sequence[float] = ()) -> list[float]:
        """Every rank's failure kind (0: none) and the sum of ``extra`` over the ranks: one
        all-reduce on every rank. Raises the step's error on every rank when one failed."""
        n = self.link.size
        vec = [0.0] * n + list(extra)
        if self.failure is not None:
            vec[self.link.rank] = float(self.failure.kind)
        t = torch.tensor(vec, dtype=torch.float64, device=self.link.device)
        out = self.link.all_reduce(t).tolist()
        if any(out[:n]):
            self._raise([int(k) for k in out[:n]])
        return out[n:]

    def _raise(self, kinds: list[int]) -> None:
        n = self.link.size
        rows = torch.zeros((n, _DETAIL), dtype=torch.int64, device=self.link.device)
        if self.failure is not None:
            raw = self.failure.text.encode()[:_DETAIL]
            rows[self.link.rank, : len(raw)] = torch.tensor(list(raw), dtype=torch.int64)
        texts = self.link.all_reduce(rows).tolist()
        self.pulls.clear()
        own = self.failure
        if own is not None and own.exc is not None:
            if hasattr(own.exc, "add_note"):  # Python 3.11+
                own.exc.add_note(
                    f"{self.fn_name}: raised by {self._where(own.stage)}; the other ranks of "
                    f"the axis raise an error naming it"
                )
            raise own.exc
        failed = [r for r in range(n) if kinds[r]]
        first = min((r for r in failed if kinds[r] in (1, 2)), default=failed[0])
        text = bytes(c for c in texts[first] if c).decode(errors="replace")
        if kinds[first] == 2:
            raise RuntimeError(
                f"{self.fn_name}: {text}; every rank of the axis stopped computing then and "
                f"raises this error (rank {first} raises the original)"
            )
        raise ValueError(text)

    def gradients(self, s: int) -> list[torch.Tensor | None] | None:
        """Stage ``s``'s gradient, its differentiated leaves in order (``None``: no backward
        ran), whichever way its backwards added them up."""
        summed: list[torch.Tensor | None] | None = None
        if self.grads[s] is not None:
            summed = list(self.grads[s] or ())
        leaves = self.params[s].accumulated()
        if leaves is None:
            return summed
        if summed is None:
            return leaves
        return [
            a if b is None else b if a is None else a + b
            for a, b in zip(summed, leaves, strict=True)
        ]

    def gradient_trees(self) -> dict[int, Any]:
        """Each of this rank's stages' gradient tree."""
        return {s: self.params[s].tree(self.gradients(s)) for s in self.params}


class _Layouts:
    """What each message carries, as this rank knows it: activations of each stage and
    microbatch size (sent and received; the first microbatch of each size brings a header),
    and what this rank sent of each microbatch (its cotangent comes back with that layout)."""

    def __init__(self, sizes: list[int]) -> None:
        self.sizes = sizes
        self.header_mbs = {m for m, n in enumerate(sizes) if n not in sizes[:m]}
        self.sent_class: dict[tuple[int, int], Any] = {}
        self.recv_class: dict[tuple[int, int], Any] = {}
        self.sent: dict[tuple[int, int], Any] = {}

    def expect(self, msg: Message) -> Any:
        """See :class:`pshard._pipeline.transport.Inbox`."""
        if msg.kind == "activation":
            if msg.microbatch in self.header_mbs:
                return "header"
            return self.recv_class.get((msg.stage, self.sizes[msg.microbatch]))
        sent = self.sent.get((msg.stage - 1, msg.microbatch))
        if sent is None:
            return None  # not sent yet: known once it is
        return NO_DATA if sent is NO_DATA else Layout(True, sent.floats())

    def on_header(self, msg: Message, layout: Any) -> None:
        self.recv_class[(msg.stage, self.sizes[msg.microbatch])] = layout


def _same_beyond(a: Layout, b: Layout, dim: int) -> bool:
    """Same structure, dtypes, and shapes outside ``dim``."""
    if a.is_tuple != b.is_tuple or len(a.leaves) != len(b.leaves):
        return False
    for (da, sa), (db, sb) in zip(a.leaves, b.leaves, strict=True):
        if da != db or len(sa) != len(sb):
            return False
        if len(sa) > dim and (sa[:dim] + sa[dim + 1 :]) != (sb[:dim] + sb[dim + 1 :]):
            return False
        if len(sa) <= dim and sa != sb:
            return False
    return True


def _zeros(layout: Layout, device: torch.device) -> tuple[torch.Tensor, ...]:
    return tuple(torch.zeros(shape, dtype=dtype, device=device) for dtype, shape in layout.leaves)


def loss_code(dtype: torch.dtype) -> int:
    """The loss dtype's code in the status exchange."""
    return WIRE_DTYPES.index(dtype) + 1 if dtype in WIRE_DTYPES else 0
