"""What one call of a pipeline needs, checked on every rank before anything is sent.

:func:`prepare` resolves the axis, checks the stage functions against its size (a count
that does not fit is the same error on every rank, with no communication), gives this rank
its stages (rank ``r`` holds stages ``r, r + N, ...``) and their parameters, cuts the
microbatches and builds the schedule. In debug mode (:func:`pshard.debug`) the ranks then
compare what they are about to run (schedule, counts, microbatch sizes) in one all-reduce,
and a rank that differs is an error on every rank naming it.

Internal interface: :func:`prepare` -> :class:`Prepared`, :func:`check_stages`.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .._core.tree import describe
from .._runtime.mesh import Axis
from .._runtime.wire import comm
from .executor import Executor
from .schedule import SCHEDULES, PipelineSchedule, build_schedule
from .split import Microbatches, split_microbatches
from .stage_call import StageParams
from .transport import Link

__all__ = ["Prepared", "check_stages", "prepare"]


@dataclasses.dataclass
class Prepared:
    """One call's setting on this rank (see :func:`prepare`)."""

    link: Link
    axis_name: str
    schedule: PipelineSchedule
    stages: list[int]  # this rank's stages, in order
    fns: dict[int, Callable[..., Any]]
    params: dict[int, StageParams]
    microbatches: Microbatches

    def executor(
        self, fn_name: str, fns: dict[int, Callable[..., Any]], inputs: Sequence[Any], **kw: Any
    ) -> Executor:
        """An :class:`Executor` of this call with these stage functions and first inputs
        (``kw``: its ``mode``, ``loss``, ``input_grads``)."""
        return Executor(
            fn_name=fn_name,
            axis=self.axis_name,
            link=self.link,
            schedule=self.schedule,
            fns=fns,
            params=self.params,
            inputs=inputs,
            sizes=self.microbatches.sizes,
            split_dim=self.microbatches.split_dim,
            **kw,
        )


def check_stages(stages: Any, fn_name: str) -> None:
    """``stages`` is a function or a non-empty sequence of functions (when the pipeline is
    made: the counts are checked against the axis when it is called)."""
    if callable(stages) and not isinstance(stages, (list, tuple)):
        return
    if isinstance(stages, (list, tuple)) and stages and all(map(callable, stages)):
        return
    raise TypeError(
        f"{fn_name}: stages must be a function stage(params, x) -> y shared by every stage, or "
        f"a list of such functions, one per stage; got {describe(stages)}"
    )


def _stage_fns(stages: Any, n: int, schedule: str, axis: str, fn_name: str) -> tuple[Any, int]:
    """The stage functions as a list of ``v * n`` (or one shared function) and ``v``."""
    if not isinstance(stages, (list, tuple)):
        if schedule == "interleaved_1f1b":
            raise ValueError(
                f"{fn_name}: schedule='interleaved_1f1b' needs a list of v * {n} stage "
                f"functions (v stages on each of the {n} ranks of axis {axis!r}), not one "
                f"shared function; pass [stage] * (v * {n}) for one function at every stage"
            )
        return [stages] * n, 1
    count = len(stages)
    if schedule == "interleaved_1f1b":
        if count % n:
            raise ValueError(
                f"{fn_name}: stages has {count} functions but axis {axis!r} has {n} ranks; "
                f"schedule='interleaved_1f1b' needs v stages per rank, a multiple of {n} "
                f"functions (v = 2: {2 * n})"
            )
        return list(stages), count // n
    if count != n:
        raise ValueError(
            f"{fn_name}: stages has {count} functions but axis {axis!r} has {n} ranks; give "
            f"one function per rank (or one shared function)"
            + (
                f", or use schedule='interleaved_1f1b' for {count // n} stages per rank"
                if count % n == 0 and count > n
                else ""
            )
        )
    return list(stages), 1


def _rank_params(params: Any, v: int, interleaved: bool, fn_name: str) -> list[Any]:
    if not interleaved:
        return [params]
    if isinstance(params, list):
        raise ValueError(
            f"{fn_name}: with {v} stages per rank (schedule='interleaved_1f1b') params must be "
            f"a tuple of {v} trees, this rank's stages' parameters in order; got a list of "
            f"{len(params)}, which is one tree (a stage's list of layers, say): pass "
            f"tuple(params) if each item is a stage's tree"
        )
    if not isinstance(params, tuple) or len(params) != v:
        raise ValueError(
            f"{fn_name}: with {v} stages per rank (schedule='interleaved_1f1b') params must be "
            f"a tuple of {v} trees, this rank's stages' parameters in order; got "
            f"{describe(params)}"
        )
    return list(params)


def prepare(
    *,
    fn_name: str,
    stages: Any,
    params: Any,
    axis: Axis,
    schedule: str,
    num_microbatches: int,
    parts: Sequence[tuple[Any, Any, str]],
) -> Prepared:
    """Check and resolve one call (see the module docs)."""
    c = comm(axis, fn_name)
    n = c.size
    fns, v = _stage_fns(stages, n, schedule, c.name, fn_name)
    mine = [k * n + c.rank for k in range(v)]
    trees = _rank_params(params, v, schedule == "interleaved_1f1b", fn_name)
    mb = split_microbatches(parts, num_microbatches, where=fn_name)
    link = Link(c)
    sched = build_schedule(schedule, n, num_microbatches, v)
    if link.debug and link.group is not None:
        _check_same(link, fn_name, c.name, schedule, len(fns) if isinstance(stages, (list, tuple))
                    else 0, mb, v)  # fmt: skip
    return Prepared(
        link=link,
        axis_name=c.name,
        schedule=sched,
        stages=mine,
        fns={s: fns[s] for s in mine},
        params={s: StageParams(tree) for s, tree in zip(mine, trees, strict=True)},
        microbatches=mb,
    )


_FIELDS = ("schedule", "num_microbatches", "stages per rank", "stage functions", "microbatch sizes")


def _check_same(
    link: Link, fn_name: str, axis: str, schedule: str, count: int, mb: Microbatches, v: int
) -> None:
    """Debug mode: every rank runs the same schedule on microbatches of the same sizes."""
    row = [
        SCHEDULES.index(schedule),
        len(mb.sizes),
        v,
        count,
        zlib.crc32(repr((mb.sizes, mb.split_dim)).encode()),
    ]
    table = torch.zeros((link.size, len(row)), dtype=torch.int64, device=link.device)
    table[link.rank] = torch.tensor(row, dtype=torch.int64)
    rows = link.all_reduce(table).tolist()
    if all(r == rows[0] for r in rows):
        return
    differ = [i for i in range(len(row)) if len({r[i] for r in rows}) > 1]
    lines = []
    for r, values in enumerate(rows):
        shown = []
        for i in differ:
            value = SCHEDULES[values[i]] if i == 0 else values[i]
            shown.append(f"{_FIELDS[i]}={value!r}" if i != 4 else "microbatch sizes (digest "
                         f"{values[i]:08x})")  # fmt: skip
        lines.append(f"  rank {r}: " + ", ".join(shown))
    raise ValueError(
        f"{fn_name} (pshard debug mode): the ranks of axis {axis!r} would run different "
        f"pipelines (this is rank {link.rank}):\n" + "\n".join(lines) + "\nEvery rank of the "
        "axis must call it with the same schedule, stage count and batch; without debug mode "
        "the sends and receives would not pair up."
    )
