"""Profiler ranges: a sharded_call step (dp, inside a map) on thread ranks profiled around the
spawn, a pipeline step and a checkpoint's recompute: the trace names pshard's work by what it
is (the collectives with their axes, each unit and its gather, each pipeline action, each
recompute). With no profiler, no range is made."""

from __future__ import annotations

import pytest
import torch
from torch._C._profiler import _ExperimentalConfig
from torch.profiler import profile

import pshard as ps

P = ps.P


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x))


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(_Block() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


def _names(prof: object) -> set[str]:
    return {e.name for e in prof.events() if e.name.startswith("pshard.")}  # type: ignore[attr-defined]


def _sharded_step(net: torch.nn.Module) -> None:
    ps.init_mesh({"dp": 2})
    params = ps.shard({k: v.detach() for k, v in net.named_parameters()}, P("dp"))

    def loss(p, x):
        return ps.sharded_call(net, p, (x,), units=_Block, specs=P("dp")).sum()

    body = ps.shard_map(torch.func.grad(loss), in_specs=(P("dp"), P("dp")), out_specs=P("dp"))
    body(ps.gather(params), torch.ones(4, 4))


def test_ranges_of_a_sharded_call_step_on_thread_ranks() -> None:
    net = _Net()
    with profile(experimental_config=_ExperimentalConfig(profile_all_threads=True)) as prof:
        ps.spawn(_sharded_step, net, nprocs=2, backend="threads")
    names = _names(prof)
    for want in (
        "pshard.unit[blocks.0]",
        "pshard.unit[blocks.1]",
        "pshard.unit[blocks.0].gather",
        "pshard.all_gather[dp]",
        "pshard.psum_scatter[dp]",
        "pshard.recompute[sharded_call unit 'blocks.1' (_Block)]",
    ):
        assert want in names, (want, sorted(names))


def test_ranges_of_pipeline_actions_and_collectives() -> None:
    def rank() -> set[str]:
        ps.init_mesh({"pp": 2})
        step = ps.pipeline_value_and_grad(
            lambda w, x: torch.tanh(x @ w), lambda y, t: (y - t).pow(2).sum(),
            num_microbatches=2, schedule="zero_bubble",
        )  # fmt: skip
        step(torch.eye(3), torch.ones(4, 3), torch.zeros(4, 3))
        ps.psum(torch.ones(2), "pp")
        return set()

    with profile(experimental_config=_ExperimentalConfig(profile_all_threads=True)) as prof:
        ps.spawn(rank, nprocs=2, backend="threads")
    names = _names(prof)
    for want in ("pshard.stage[0].mb[0].F", "pshard.stage[1].mb[1].I", "pshard.stage[0].mb[1].W",
                 "pshard.psum[pp]"):  # fmt: skip
        assert want in names, (want, sorted(names))


def test_no_range_without_a_profiler(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[str] = []
    real = torch.profiler.record_function

    def spy(name: str, *args: object) -> object:
        made.append(name)
        return real(name, *args)

    monkeypatch.setattr(torch.profiler, "record_function", spy)
    ps.spawn(_sharded_step, _Net(), nprocs=2, backend="threads")
    assert made == []
    with profile() as prof:  # and one process's own profile names them
        ps.init_mesh({"dp": 1})
        ps.checkpoint(lambda w: torch.sin(w).sum())(torch.ones(2, requires_grad=True)).backward()
    assert any(n.startswith("pshard.recompute[") for n in _names(prof)), _names(prof)
    assert made
