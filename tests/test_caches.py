"""ps.clear_caches: every cache pshard keeps is named and emptied, and results do not depend on
what was cached (the same calls give the same numbers before and after clearing, on 2 ranks)."""

from __future__ import annotations

from typing import Any

import torch

import pshard as ps
from pshard._core.caches import cache_names
from pshard._shard_map import boundary


def test_caches_are_named() -> None:
    names = cache_names()
    assert len(names) == len(set(names)) >= 10
    for expected in ("layout plans of map boundaries", "spec matching", "inferred out specs"):
        assert expected in names


def _workload() -> list[torch.Tensor]:
    """Calls that fill the layout, spec, kernel and ring caches."""
    torch.manual_seed(0)
    x = torch.randn(7, 5, dtype=torch.float64)
    q, k, v = (torch.randn(1, 11, 2, 4, dtype=torch.float64) for _ in range(3))
    out = [ps.shard_map(lambda x: 2 * x, in_specs=ps.P("sp"), out_specs=ps.P("sp"))(x)]
    attn = ps.shard_map_seq(
        lambda q, k, v: ps.ring_attention(q, k, v, causal=True),
        in_specs=ps.Shard(1),
        out_specs=ps.Shard(1),
        layout="zigzag",
    )
    out.append(attn(q, k, v))
    out.append(torch.func.grad(lambda q: attn(q, k, v).sum())(q))
    return out


def _worker() -> bool:
    ps.init_mesh({"sp": 2})
    first = _workload()
    assert boundary._plan.cache_info().currsize > 0  # type: ignore[attr-defined]
    ps.clear_caches()
    assert boundary._plan.cache_info().currsize == 0  # type: ignore[attr-defined]
    second = _workload()
    return all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


def test_results_do_not_depend_on_what_was_cached(procs: Any) -> None:
    assert procs.run(2, _worker) == [True, True]
