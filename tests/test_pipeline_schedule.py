"""Pipeline schedules as data, without ranks: every rank's timeline, the sends and receives
pairing up, deadlock-freedom under any compute times, the bubble against the theory, memory,
and the text rendering."""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest

import pshard as ps
from pshard._pipeline.schedule import DURATION, Action, _deps, rank_plan

NAMES = ["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"]


def _grid(name):
    """(N, M, v) to check a schedule on: one rank, fewer microbatches than ranks, uneven."""
    for n in (1, 2, 3, 4, 8):
        for m in (1, 2, 5, 8, 11):
            for v in (1, 2, 3) if name == "interleaved_1f1b" else (1,):
                yield n, m, v


def _schedule(name, n, m, v):
    return ps.pipeline_schedule(name, num_ranks=n, num_microbatches=m, virtual_stages=v)


def _expected_actions(name, n, m, v):
    """What each stage must do for each microbatch, exactly once."""
    out = set()
    for s in range(v * n):
        for i in range(m):
            out.add(Action("F", s, i))
            if name != "zero_bubble":
                out.add(Action("B", s, i))
            else:
                out.add(Action("W", s, i))
                if s > 0:
                    out.add(Action("I", s, i))
    return out


@pytest.mark.parametrize("name", NAMES)
def test_every_action_once_on_its_rank_after_its_inputs(name):
    for n, m, v in _grid(name):
        _check_actions(name, n, m, v)


def _check_actions(name, n, m, v):
    s = _schedule(name, n, m, v)
    seen = []
    end = {}
    for r in range(n):
        for a, t in s.starts(r).items():
            assert a.stage % n == r  # stage s lives on rank s % N
            seen.append(a)
            end[a] = t + DURATION[a.kind]
            assert s.timeline[r][t : t + DURATION[a.kind]] == (a,) * DURATION[a.kind]
    assert len(seen) == len(set(seen))
    assert set(seen) == _expected_actions(name, n, m, v)
    for r in range(n):
        for a, t in s.starts(r).items():
            for d in _deps(a, s.num_stages, name == "zero_bubble"):
                assert end[d] <= t, (a, d)
    # every stage runs its forwards (and backwards) in microbatch order: activations of one
    # size class share a header (the first of its size comes first)
    for r in range(n):
        for stage in range(r, s.num_stages, n):
            for kind in "FBIW":
                mbs = [a.microbatch for a in s.actions(r) if a.kind == kind and a.stage == stage]
                assert mbs == sorted(mbs)


@pytest.mark.parametrize("name", NAMES)
def test_sends_and_receives_pair_up_in_channel_order(name):
    for n, m, v in _grid(name):
        _check_channels(name, n, m, v)


def _check_channels(name, n, m, v):
    s = _schedule(name, n, m, v)
    plans = [rank_plan(s, r) for r in range(n)]
    for src in range(n):
        for dst in range(n):
            sent = [msg for step in plans[src] for msg in step.send if msg.dst == dst]
            wanted = [msg for step in plans[dst] for msg in step.recv if msg.src == src]
            channel = s.channel(src, dst)
            assert sent == list(channel)  # the sender's order is the channel's
            assert sorted(wanted, key=lambda x: x.index) == list(channel)  # each received once
            assert [x.index for x in channel] == list(range(len(channel)))
            for msg in channel:
                assert msg.producer.stage % n == src and msg.consumer.stage % n == dst
                producer_end = s.starts(src)[msg.producer] + DURATION[msg.producer.kind]
                assert producer_end <= s.starts(dst)[msg.consumer]


def _run_async(plans, durations):
    """Every rank runs its plan in order with the given compute times; an action starts when
    its messages were sent. Returns the finish time, or None on a deadlock."""
    n = len(plans)
    pos, clock, sent = [0] * n, [0.0] * n, {}
    while any(p < len(plan) for p, plan in zip(pos, plans, strict=True)):
        moved = False
        for r in range(n):
            while pos[r] < len(plans[r]):
                step = plans[r][pos[r]]
                if not all(msg in sent for msg in step.recv):
                    break
                start = max([clock[r]] + [sent[msg] for msg in step.recv])
                clock[r] = start + durations[(r, step.action)]
                for msg in step.send:
                    sent[msg] = clock[r]
                pos[r] += 1
                moved = True
        if not moved:
            return None
    return max(clock)


@pytest.mark.parametrize("name", NAMES)
def test_no_deadlock_whatever_the_compute_times(name):
    rng = random.Random(0)
    for n, m in [(2, 3), (4, 4), (4, 7), (5, 2), (8, 16)]:
        v = 2 if name == "interleaved_1f1b" else 1
        s = _schedule(name, n, m, v)
        plans = [rank_plan(s, r) for r in range(n)]
        for _ in range(5):
            durations = {(r, a): rng.uniform(0.1, 3.0) for r in range(n) for a in s.actions(r)}
            assert _run_async(plans, durations) is not None, (name, n, m)


def test_the_deadlock_check_finds_one():
    # a rank that runs its backwards before the forwards they need waits forever
    s = _schedule("1f1b", 2, 3, 1)
    plans = [rank_plan(s, r) for r in range(2)]
    plans[0] = tuple(sorted(plans[0], key=lambda step: step.action.kind))  # B... before F...
    durations = {(r, a): 1.0 for r in range(2) for a in s.actions(r)}
    assert _run_async(plans, durations) is None


@pytest.mark.parametrize("n,m", [(2, 1), (2, 5), (4, 4), (4, 8), (4, 13), (8, 3), (8, 32)])
def test_1f1b_and_gpipe_bubbles_are_the_theory(n, m):
    theory = (n - 1) / (m + n - 1)
    for name in ("1f1b", "gpipe"):
        s = _schedule(name, n, m, 1)
        assert s.bubble_fraction() == pytest.approx(theory, abs=1e-12)
        assert s.num_ticks == 3 * (m + n - 1)  # a forward 1 tick, a backward 2
        assert all(s.idle_ticks(r) == 3 * (n - 1) for r in range(n))


@pytest.mark.parametrize("n,m,v", [(2, 4, 2), (4, 8, 2), (4, 4, 3), (3, 9, 4)])
def test_interleaved_bubble_is_the_theory_when_n_divides_m(n, m, v):
    s = _schedule("interleaved_1f1b", n, m, v)
    assert s.bubble_fraction() == pytest.approx((n - 1) / (v * m + n - 1), abs=1e-12)


@pytest.mark.parametrize("n,m", [(2, 4), (4, 8), (4, 16), (8, 8)])
def test_zero_bubble_idles_a_third_of_1f1b(n, m):
    zb, one = _schedule("zero_bubble", n, m, 1), _schedule("1f1b", n, m, 1)
    assert zb.num_ticks == 3 * m + n - 1  # ZB-H1's makespan, against 3 (m + n - 1)
    assert zb.bubble_fraction() == pytest.approx((n - 1) / (3 * m + n - 1), abs=1e-12)
    for r in range(1, n):  # rank 0 has no input cotangent to compute: less work
        assert zb.idle_ticks(r) == n - 1 == one.idle_ticks(r) // 3


@pytest.mark.parametrize("n,m", [(1, 4), (4, 2), (4, 8), (8, 16)])
def test_microbatches_alive(n, m):
    assert [_schedule("gpipe", n, m, 1).peak_alive(r) for r in range(n)] == [m] * n
    assert [_schedule("1f1b", n, m, 1).peak_alive(r) for r in range(n)] == [
        min(n - r, m) for r in range(n)
    ]
    assert max(_schedule("zero_bubble", n, m, 1).peak_alive(r) for r in range(n)) <= n


def test_render_is_the_timeline():
    s = _schedule("1f1b", 2, 3, 1)
    assert s.render() == (
        "1f1b: 2 ranks, 3 microbatches; bubble 25.0% of 12 ticks\n"
        "tick   | 0  1  2  3  4  5  6  7  8  9  10 11\n"
        "rank 0 | F0 F1 .  .  B0 B0 F2 B1 B1 .  B2 B2\n"
        "rank 1 | .  F0 B0 B0 F1 B1 B1 F2 B2 B2 .  ."
    )
    zb = _schedule("zero_bubble", 2, 2, 1).render()
    assert "I0" in zb and "W1" in zb
    inter = _schedule("interleaved_1f1b", 2, 2, 2).render(width=6)
    assert "F0b" in inter and inter.count("tick ") == 3  # 15 ticks wrapped into blocks of 6
    rows = [line for line in inter.splitlines() if line.startswith("rank 0")]
    cells = " ".join(row.split("| ")[1] for row in rows).split()
    assert cells == [
        (f"{a.kind}{a.microbatch}{'ab'[a.stage // 2]}" if a else ".")
        for a in _schedule("interleaved_1f1b", 2, 2, 2).timeline[0]
    ]


def test_bad_arguments():
    with pytest.raises(ValueError, match=re.escape("schedule='1F1B' is not a schedule")):
        ps.pipeline_schedule("1F1B", num_ranks=2, num_microbatches=2)
    with pytest.raises(ValueError, match="virtual_stages=2 needs schedule='interleaved_1f1b'"):
        ps.pipeline_schedule("1f1b", num_ranks=2, num_microbatches=2, virtual_stages=2)
    with pytest.raises(ValueError, match="num_ranks"):
        ps.pipeline_schedule("1f1b", num_ranks=0, num_microbatches=2)


def test_the_diagrams_in_the_docs_are_the_schedules():
    docs = (Path(__file__).resolve().parents[1] / "docs" / "pipeline.md").read_text()
    blocks = re.findall(r"```text\n(.*?)\n```", docs, flags=re.S)
    head = re.compile(r"(\w+): (\d+) ranks, (\d+) microbatches(?:, (\d+) stages per rank)?;")
    drawn = 0
    for block in blocks:
        found = head.match(block)
        if found is None:
            continue
        name, n, m, v = found.group(1), int(found.group(2)), int(found.group(3)), found.group(4)
        ticks = block.splitlines()[1].split("| ")[1].split()
        s = _schedule(name, n, m, int(v or 1))
        width = len(ticks) if len(ticks) < s.num_ticks else None
        assert block == s.render(width=width)
        drawn += 1
    assert drawn == 4
