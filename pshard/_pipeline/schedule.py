"""Pipeline schedules as data: which rank computes what at which tick, and what moves between
ranks, apart from the code that runs it (:mod:`pshard._pipeline.executor`).

A schedule is one simulated lock-step timeline that every rank computes the same way from
``(name, num_ranks, num_microbatches, virtual_stages)``: each rank's actions in order, the
tick each starts at, and the messages between ranks. The executor runs each rank's actions in
that order and posts its receives in the order the sender sends, so the ranks agree on the
order of every send and receive without exchanging a word about it; a timeline that could not
finish (a deadlock) is refused when it is built.

Actions (:class:`Action`), on stage ``s`` (rank ``s % num_ranks``) and microbatch ``m``:

- ``F``: the forward; it needs ``F(s - 1, m)``'s output (an *activation* message).
- ``B``: the whole backward; it needs ``F(s, m)`` and ``B(s + 1, m)``'s input cotangent (a
  *cotangent* message).
- ``I`` and ``W`` (zero bubble): the backward cut in two, the input cotangent (sent upstream at
  once) and the weight cotangent (computed where the rank would otherwise wait). Stage 0 has
  no input cotangent to send: its ``W`` takes the cotangent itself.

Durations in ticks: ``F`` 1, ``B`` 2, ``I`` 1, ``W`` 1 (a backward costs about two forwards).

Schedules (``N`` ranks, ``M`` microbatches, ``v`` virtual stages per rank):

- ``"gpipe"``: every forward, then every backward; keeps all ``M`` microbatches alive.
- ``"1f1b"``: ``N - 1 - r`` forwards on rank ``r``, then one forward and one backward in turn;
  at most ``N - r`` microbatches alive on rank ``r``. Bubble ``(N - 1) / (M + N - 1)``.
- ``"interleaved_1f1b"``: ``v`` stages per rank (``r, r + N, ...``), microbatches in rounds
  of ``N``, a backward whenever one is ready, else the next forward while fewer than
  ``(v - 1) * N + 2 * (N - 1 - r) + 1`` are alive (Megatron-LM's warm-up).
- ``"zero_bubble"``: ZB-H1: ``I`` whenever one is ready, else the next forward while fewer
  than ``N`` microbatches are alive (forward done, weight cotangent not), else a ``W``.

Public: :func:`pipeline_schedule` (the checked :func:`build_schedule`) and
:class:`PipelineSchedule`. Internal interface: :func:`build_schedule` (cached),
:class:`Action`, :class:`Message`, :func:`rank_plan` and :class:`Step` (what one rank sends and
receives around each action, in its order).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

from .._core.checks import check_int

__all__ = [
    "DURATION",
    "pipeline_schedule",
    "SCHEDULES",
    "Action",
    "Message",
    "PipelineSchedule",
    "Step",
    "build_schedule",
    "rank_plan",
]

#: The schedules, by name.
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")

#: Ticks each kind of action takes.
DURATION = {"F": 1, "B": 2, "I": 1, "W": 1}


@dataclasses.dataclass(frozen=True, order=True)
class Action:
    """One unit of work: ``kind`` (``"F"``, ``"B"``, ``"I"``, ``"W"``) on ``stage`` for
    ``microbatch``."""

    kind: str
    stage: int
    microbatch: int

    def __str__(self) -> str:
        return f"{self.kind}(stage {self.stage}, microbatch {self.microbatch})"

    def range_name(self) -> str:
        """Its name in a profiler's trace: ``pshard.stage[1].mb[3].F``."""
        return f"pshard.stage[{self.stage}].mb[{self.microbatch}].{self.kind}"


@dataclasses.dataclass(frozen=True)
class Message:
    """A tensor (or tuple of tensors) moving from rank ``src`` to rank ``dst``: the output of
    ``producer`` (an ``F``: an *activation*) or the input cotangent it computed (a ``B`` or an
    ``I``: a *cotangent*), which ``consumer`` takes. ``index`` is its place on the channel
    ``(src, dst)``: the sender sends and the receiver receives that channel's messages in that
    order. ``tick`` is when ``producer`` ends in the timeline, ``due`` when ``consumer``
    starts: a sender that has reached ``due`` may wait for the send to complete (the receiver
    gets there without it). ``src == dst`` when both stages are on one rank (nothing is
    sent)."""

    src: int
    dst: int
    producer: Action
    consumer: Action
    index: int
    tick: int
    due: int

    @property
    def kind(self) -> str:
        """``"activation"`` or ``"cotangent"``."""
        return "activation" if self.producer.kind == "F" else "cotangent"

    @property
    def stage(self) -> int:
        """The producing stage."""
        return self.producer.stage

    @property
    def microbatch(self) -> int:
        return self.producer.microbatch


@dataclasses.dataclass(frozen=True)
class Step:
    """One action of a rank, the tick it starts at, the messages it waits for and the
    messages it sends."""

    action: Action
    tick: int
    recv: tuple[Message, ...]
    send: tuple[Message, ...]


@dataclasses.dataclass(frozen=True)
class PipelineSchedule:
    """A simulated lock-step timeline (see the module docs).

    Attributes:
        name: the schedule (``"gpipe"``, ``"1f1b"``, ``"interleaved_1f1b"``,
            ``"zero_bubble"``).
        num_ranks: ranks on the pipeline axis (``N``).
        num_microbatches: microbatches per step (``M``).
        virtual_stages: stages per rank (``v``); there are ``v * N`` stages, stage ``s`` on
            rank ``s % N``.
        timeline: per rank, the action running at each tick (``None``: idle); a ``B`` fills
            two consecutive ticks. Every rank's row has the same length.
        messages: every message, ordered by the tick it is produced at, then by sender.
    """

    name: str
    num_ranks: int
    num_microbatches: int
    virtual_stages: int
    timeline: tuple[tuple[Action | None, ...], ...]
    messages: tuple[Message, ...]

    @property
    def num_stages(self) -> int:
        """``v * N``."""
        return self.virtual_stages * self.num_ranks

    @property
    def num_ticks(self) -> int:
        """The length of the timeline (the makespan)."""
        return len(self.timeline[0]) if self.timeline else 0

    def actions(self, rank: int) -> tuple[Action, ...]:
        """``rank``'s actions in the order it runs them."""
        out: list[Action] = []
        for a in self.timeline[rank]:
            if a is not None and (not out or out[-1] is not a):
                out.append(a)
        return tuple(out)

    def starts(self, rank: int) -> dict[Action, int]:
        """The tick each of ``rank``'s actions starts at."""
        out: dict[Action, int] = {}
        for t, a in enumerate(self.timeline[rank]):
            if a is not None and a not in out:
                out[a] = t
        return out

    def channel(self, src: int, dst: int) -> tuple[Message, ...]:
        """The messages from ``src`` to ``dst``, in the order they are sent and received."""
        return tuple(m for m in self.messages if m.src == src and m.dst == dst)

    def idle_ticks(self, rank: int) -> int:
        """Ticks ``rank`` spends waiting within the timeline."""
        return sum(a is None for a in self.timeline[rank])

    def bubble_fraction(self) -> float:
        """The share of the step the busiest rank waits: ``1 - its work / the step``
        (``(N - 1) / (M + N - 1)`` for 1F1B; a rank with less work, zero bubble's first with
        no input cotangent to compute, waits more without making the step longer)."""
        if not self.num_ticks:
            return 0.0
        busiest = min(map(self.idle_ticks, range(self.num_ranks)))
        return busiest / self.num_ticks

    def peak_alive(self, rank: int) -> int:
        """The most microbatches whose activations ``rank`` holds at once, per stage summed:
        from the start of a forward to the end of the backward that frees it (``B``, or
        ``W`` under zero bubble)."""
        alive = peak = 0
        for a in self.actions(rank):
            if a.kind == "F":
                alive += 1
                peak = max(peak, alive)
            elif a.kind in ("B", "W"):
                alive -= 1
        return peak

    def render(self, *, width: int | None = None) -> str:
        """The timeline as text: one row per rank, one column per tick.

        A cell is the action's kind and microbatch (``F3``: the forward of microbatch 3), with
        the rank's virtual stage as a letter when there are several (``F3b``: its second
        stage); ``.`` is an idle tick. A two-tick ``B`` fills two cells.

        Args:
            width: the most ticks per block of rows (longer timelines wrap); ``None`` for
                one block.
        """
        v = self.virtual_stages

        def label(a: Action | None) -> str:
            if a is None:
                return "."
            chunk = chr(ord("a") + a.stage // self.num_ranks) if v > 1 else ""
            return f"{a.kind}{a.microbatch}{chunk}"

        cells = [[label(a) for a in row] for row in self.timeline]
        cell = max([len(c) for row in cells for c in row] + [len(str(self.num_ticks - 1)), 1])
        head = f"rank {self.num_ranks - 1}"
        ticks = self.num_ticks
        step = ticks if width is None or width <= 0 else width
        lines = [
            f"{self.name}: {self.num_ranks} ranks, {self.num_microbatches} microbatches"
            + (f", {v} stages per rank" if v > 1 else "")
            + f"; bubble {self.bubble_fraction():.1%} of {ticks} ticks"
        ]
        for start in range(0, max(ticks, 1), step):
            cols = range(start, min(ticks, start + step))
            ticks_row = " ".join(str(t).ljust(cell) for t in cols)
            lines.append("tick".ljust(len(head)) + " | " + ticks_row.rstrip())
            for r, row in enumerate(cells):
                text = " ".join(row[t].ljust(cell) for t in cols)
                lines.append(f"rank {r}".ljust(len(head)) + " | " + text.rstrip())
        return "\n".join(lines)


def _rank_of(stage: int, n: int) -> int:
    return stage % n


def _deps(a: Action, n_stages: int, split: bool) -> list[Action]:
    """The actions ``a`` waits for (``split``: the backward is cut into ``I`` and ``W``)."""
    s, m = a.stage, a.microbatch
    last = n_stages - 1
    if a.kind == "F":
        return [Action("F", s - 1, m)] if s > 0 else []
    if a.kind == "B":
        return [Action("F", s, m)] + ([Action("B", s + 1, m)] if s < last else [])
    if a.kind == "I":
        return [Action("F", s, m)] + ([Action("I", s + 1, m)] if s < last else [])
    # W: after its own I; stage 0 has none and takes the cotangent itself
    if s > 0:
        return [Action("I", s, m)]
    return [Action("F", 0, m)] + ([Action("I", 1, m)] if last > 0 else [])


class _Sim:
    """The lock-step simulation: at each tick every idle rank starts the action ``choose``
    picks among what is ready (the outputs of actions that ended by then)."""

    def __init__(self, n: int, n_stages: int, split: bool) -> None:
        self.n = n
        self.n_stages = n_stages
        self.split = split
        self.end: dict[Action, int] = {}
        self.rows: list[list[Action | None]] = [[] for _ in range(n)]

    def ready(self, a: Action, t: int) -> bool:
        return all(self.end.get(d, t + 1) <= t for d in _deps(a, self.n_stages, self.split))

    def run(self, choose: list, total: int, name: str) -> None:  # list of callables
        done = 0
        t = 0
        while done < total:
            started = False
            for r in range(self.n):
                if len(self.rows[r]) > t:
                    continue  # busy with a longer action
                a = choose[r](t)
                if a is None:
                    self.rows[r].append(None)
                    continue
                d = DURATION[a.kind]
                self.rows[r] += [a] * d
                self.end[a] = t + d
                done += 1
                started = True
            if not started and max(self.end.values(), default=0) <= t:  # nothing will end
                raise RuntimeError(  # a bug in a schedule's rule, never the user's input
                    f"pipeline schedule {name!r}: deadlock at tick {t}"
                )
            t += 1
        ticks = max(map(len, self.rows))
        for row in self.rows:
            row += [None] * (ticks - len(row))


def _in_order(sim: _Sim, order: Sequence[Action]):  # noqa: ANN202
    """A chooser that runs ``order`` as given, each action once it is ready."""
    pos = [0]

    def choose(t: int) -> Action | None:
        if pos[0] < len(order) and sim.ready(order[pos[0]], t):
            pos[0] += 1
            return order[pos[0] - 1]
        return None

    return choose


def _orders_fixed(name: str, n: int, m: int, r: int) -> list[Action]:
    if name == "gpipe":
        return [Action("F", r, i) for i in range(m)] + [Action("B", r, i) for i in range(m)]
    warmup = min(n - 1 - r, m)  # 1f1b
    out = [Action("F", r, i) for i in range(warmup)]
    for i in range(m - warmup):
        out += [Action("F", r, warmup + i), Action("B", r, i)]
    return out + [Action("B", r, i) for i in range(m - warmup, m)]


def _interleaved(n: int, m: int, v: int, r: int) -> list[Action]:
    """Megatron-LM's interleaved order: forwards in rounds of ``n`` microbatches, stage by
    stage (``r``, ``r + n``, ...); backwards likewise, the stages in reverse; a warm-up of
    forwards, then one forward and one backward in turn, then the remaining backwards."""
    count = max(1, m // n)  # rounds of n or more microbatches, larger first
    sizes = [m // count + (i < m % count) for i in range(count)]
    starts = [sum(sizes[:i]) for i in range(count)]
    rounds = [range(a, a + k) for a, k in zip(starts, sizes, strict=True)]
    fwd = [Action("F", k * n + r, i) for g in rounds for k in range(v) for i in g]
    bwd = [Action("B", k * n + r, i) for g in rounds for k in reversed(range(v)) for i in g]
    warmup = min((v - 1) * sizes[0] + 2 * (n - 1 - r), len(fwd))
    out = fwd[:warmup]
    for i in range(len(fwd) - warmup):
        out += [fwd[warmup + i], bwd[i]]
    return out + bwd[len(fwd) - warmup :]


def _zero_bubble(sim: _Sim, n: int, m: int, r: int):  # noqa: ANN202
    fwd = [Action("F", r, i) for i in range(m)]
    inp = [Action("I", r, i) for i in range(m)] if r > 0 else []
    wgt = [Action("W", r, i) for i in range(m)]
    pos = {"F": 0, "I": 0, "W": 0}

    def take(kind: str, order: list[Action]) -> Action:
        pos[kind] += 1
        return order[pos[kind] - 1]

    def choose(t: int) -> Action | None:
        if pos["I"] < len(inp) and sim.ready(inp[pos["I"]], t):
            return take("I", inp)
        alive = pos["F"] - pos["W"]
        if pos["F"] < m and alive < n and sim.ready(fwd[pos["F"]], t):
            return take("F", fwd)
        if pos["W"] < m and sim.ready(wgt[pos["W"]], t):
            return take("W", wgt)
        return None

    return choose


def _consumer(a: Action, n_stages: int, split: bool) -> Action | None:
    """The action on another stage that takes ``a``'s output (None: it stays on its stage)."""
    s, m = a.stage, a.microbatch
    if a.kind == "F":
        return Action("F", s + 1, m) if s < n_stages - 1 else None
    if a.kind in ("B", "I") and s > 0:
        if not split:
            return Action("B", s - 1, m)
        return Action("I", s - 1, m) if s > 1 else Action("W", 0, m)
    return None


def _messages(
    timeline: list[list[Action | None]], n: int, n_stages: int, split: bool
) -> tuple[Message, ...]:
    """Every activation and cotangent that leaves its stage, in channel order."""
    produced: list[tuple[int, int, Action, Action]] = []  # (end tick, src, producer, consumer)
    starts: dict[Action, int] = {}
    for row in timeline:
        for t, a in enumerate(row):
            if a is not None:
                starts.setdefault(a, t)
    for r, row in enumerate(timeline):
        for t, a in enumerate(row):
            if a is None or (t > 0 and row[t - 1] is a):
                continue
            consumer = _consumer(a, n_stages, split)
            if consumer is not None:
                produced.append((t + DURATION[a.kind], r, a, consumer))
    produced.sort(key=lambda p: (p[0], p[1]))
    counts: dict[tuple[int, int], int] = {}
    out = []
    for end, src, producer, consumer in produced:
        dst = _rank_of(consumer.stage, n)
        index = counts.get((src, dst), 0)
        counts[(src, dst)] = index + 1
        out.append(Message(src, dst, producer, consumer, index, end, starts[consumer]))
    return tuple(out)


@functools.lru_cache(maxsize=64)
def build_schedule(
    name: str, num_ranks: int, num_microbatches: int, virtual_stages: int = 1
) -> PipelineSchedule:
    """Simulate schedule ``name`` (see the module docs); the same arguments give the same
    timeline on every rank. Arguments are checked by the callers."""
    n, m, v = num_ranks, num_microbatches, virtual_stages
    split = name == "zero_bubble"
    sim = _Sim(n, v * n, split)
    if name in ("gpipe", "1f1b", "interleaved_1f1b"):
        orders = [
            _interleaved(n, m, v, r) if v > 1 else _orders_fixed(name, n, m, r) for r in range(n)
        ]
        choose = [_in_order(sim, order) for order in orders]
        total = sum(map(len, orders))
    elif name == "zero_bubble":
        choose = [_zero_bubble(sim, n, m, r) for r in range(n)]
        total = 3 * n * m - m  # stage 0 has no I
    else:  # pragma: no cover - callers check the name
        raise ValueError(name)
    sim.run(choose, total, name)
    timeline = tuple(tuple(row) for row in sim.rows)
    return PipelineSchedule(name, n, m, v, timeline, _messages(sim.rows, n, v * n, split))


def rank_plan(schedule: PipelineSchedule, rank: int) -> tuple[Step, ...]:
    """``rank``'s actions in order, each with the messages it needs before it runs and those
    it sends when it has run (messages between stages on the same rank included)."""
    needs: dict[Action, list[Message]] = {}
    sends: dict[Action, list[Message]] = {}
    for msg in schedule.messages:
        if msg.dst == rank:
            needs.setdefault(msg.consumer, []).append(msg)
        if msg.src == rank:
            sends.setdefault(msg.producer, []).append(msg)
    starts = schedule.starts(rank)
    return tuple(
        Step(a, starts[a], tuple(needs.get(a, ())), tuple(sends.get(a, ())))
        for a in schedule.actions(rank)
    )


def pipeline_schedule(
    schedule: str = "1f1b",
    *,
    num_ranks: int,
    num_microbatches: int,
    virtual_stages: int = 1,
) -> PipelineSchedule:
    """The timeline a pipeline schedule runs: which rank computes what at which tick.

    The same data :func:`pshard.pipeline_value_and_grad` runs (every rank computes it the
    same way, so the ranks agree on the order of every send and receive): each rank's actions
    (``F`` forward, ``B`` backward, and under zero bubble ``I`` input cotangent and ``W``
    weight cotangent) on a lock-step timeline where a forward takes one tick and a backward
    two, the messages between ranks in the order they are sent and received, and the bubble.

    Args:
        schedule: ``"1f1b"``, ``"gpipe"``, ``"interleaved_1f1b"`` or ``"zero_bubble"``.
        num_ranks: ranks on the pipeline axis (``N``).
        num_microbatches: microbatches per step (``M``).
        virtual_stages: stages per rank (``v``, ``"interleaved_1f1b"`` only).

    Returns:
        A :class:`PipelineSchedule`: ``.timeline``, ``.actions(rank)``, ``.messages``,
        ``.channel(src, dst)``, ``.bubble_fraction()``, ``.peak_alive(rank)`` and
        ``.render()`` (the timeline as text).

    Example:
        >>> import pshard as ps
        >>> s = ps.pipeline_schedule("1f1b", num_ranks=2, num_microbatches=3)
        >>> print(s.render())
        1f1b: 2 ranks, 3 microbatches; bubble 25.0% of 12 ticks
        tick   | 0  1  2  3  4  5  6  7  8  9  10 11
        rank 0 | F0 F1 .  .  B0 B0 F2 B1 B1 .  B2 B2
        rank 1 | .  F0 B0 B0 F1 B1 B1 F2 B2 B2 .  .
        >>> s.bubble_fraction() == (2 - 1) / (3 + 2 - 1)
        True
    """
    fn = "pipeline_schedule"
    if schedule not in SCHEDULES:
        raise ValueError(
            f"{fn}: schedule={schedule!r} is not a schedule; use one of "
            f"{', '.join(map(repr, SCHEDULES))}"
        )
    n = check_int(fn, "num_ranks", num_ranks, minimum=1)
    m = check_int(fn, "num_microbatches", num_microbatches, minimum=1)
    v = check_int(fn, "virtual_stages", virtual_stages, minimum=1)
    if v > 1 and schedule != "interleaved_1f1b":
        raise ValueError(
            f"{fn}: virtual_stages={v} needs schedule='interleaved_1f1b' (the other "
            f"schedules run one stage per rank)"
        )
    return build_schedule(schedule, n, m, v)
