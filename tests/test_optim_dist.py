"""ps.optim on 4 and 2 gloo ranks, float64, against one process on the whole values.

On a 2x2 mesh ("dp", "tp") a tree of leaves laid out as P("dp"), P(None, "tp"),
P(("dp", "tp")), replicated, uneven (7 rows on 2 ranks) and with an empty block (5 rows on 4):
the global norm on every rank equals torch.nn.utils.clip_grad_norm_'s total norm of the whole
gradients, outside a map (GlobalTensors) and inside one (blocks with specs=); five steps of
chain(clip_by_global_norm, adamw(schedule, mask)) equal the same steps on whole tensors in
one process, with every state tensor a GlobalTensor of its parameter's layout. The optimizer
state saved on 4 ranks and resumed on 2 in another layout takes the steps the uninterrupted
run took.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import optree
import pytest
import torch

import pshard as ps
from pshard import optim

pytestmark = pytest.mark.filterwarnings(
    "ignore:`torch.jit.script` is deprecated:DeprecationWarning"
)

f64 = torch.float64
P = ps.P

SHAPES = {"a": (6, 4), "b": (4, 6), "c": (8, 3), "d": (5,), "e": (7, 3), "f": (5, 2)}
SPECS = {"a": P("dp"), "b": P(None, "tp"), "c": P(("dp", "tp")), "d": P(), "e": P("dp")}
SPECS["f"] = P(("dp", "tp"))  # 5 rows on 4 ranks: 2, 2, 1 and an empty block
OTHER = {"a": P(None, "tp"), "b": P("tp"), "c": P(), "d": P("tp"), "e": P(None, "tp")}
OTHER["f"] = P("tp")
MASK = {"a": True, "b": True, "c": True, "d": False, "e": True, "f": False}


def _wholes(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, dtype=f64, generator=g) for k, s in SHAPES.items()}


def _tx() -> Any:
    schedule = optim.warmup_cosine_decay_schedule(0.0, 0.05, warmup_steps=2, decay_steps=8)
    return optim.chain(
        optim.clip_by_global_norm(10.0),  # clips the steps of seeds 1, 3 and 4
        optim.adamw(schedule, weight_decay=0.1, mask=MASK),
    )


def _run(params: Any, state: Any, tx: Any, seeds: range, place: Any) -> tuple[Any, Any, list]:
    """Steps with the gradients drawn from ``seeds`` (whole, then ``place``d); the whole
    parameters after each."""
    seen = []
    for seed in seeds:
        grads = place(_wholes(seed))
        updates, state = tx.update(grads, state, params)
        params = optim.apply_updates(params, updates)
        seen.append(ps.gather(params))
    return params, state, seen


def _torch_norm(grads: dict[str, torch.Tensor]) -> torch.Tensor:
    leaves = [g.clone().requires_grad_() for g in grads.values()]
    for x, g in zip(leaves, grads.values(), strict=True):
        x.grad = g.clone()
    return torch.nn.utils.clip_grad_norm_(leaves, max_norm=1.0)


def _layouts_worker() -> list[Any]:
    ps.init_mesh({"dp": 2, "tp": 2})
    grads = _wholes(1)
    norm = optim.global_norm(ps.shard(grads, SPECS))
    inside = ps.shard_map(
        lambda g: optim.global_norm(g, specs=SPECS), in_specs=(SPECS,), out_specs=P()
    )(grads)
    # one process on the whole values: the same transform on plain tensors
    tx = _tx()
    whole, whole_state, want = _run(_wholes(0), tx.init(_wholes(0)), tx, range(1, 6), dict)
    params = ps.shard(_wholes(0), SPECS)
    state = tx.init(params)
    params, state, got = _run(params, state, tx, range(1, 6), lambda w: ps.shard(w, SPECS))
    adam = state[1]
    for part in (adam.mu, adam.nu):
        for k, p in params.items():
            assert isinstance(part[k], ps.GlobalTensor) and part[k].meta == p.meta, k
    assert adam.count == 5
    for a, b in zip(got, want, strict=True):
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(ps.gather(adam.nu), whole_state[1].nu, rtol=1e-12, atol=1e-16)
    return [norm, inside]


def test_global_norm_and_adamw_on_a_2x2_mesh(pool: Any) -> None:
    results = pool.run(4, _layouts_worker)
    want = _torch_norm(_wholes(1))
    for norm, inside in results:
        torch.testing.assert_close(norm, want, rtol=1e-14, atol=0)
        torch.testing.assert_close(inside, want, rtol=1e-14, atol=0)
    assert all(torch.equal(r[0], results[0][0]) for r in results)  # the same on every rank


def _save4_worker(path: str) -> list[dict[str, torch.Tensor]]:
    ps.init_mesh({"dp": 2, "tp": 2})
    tx = _tx()
    params = ps.shard(_wholes(0), SPECS)
    place = lambda w: ps.shard(w, SPECS)  # noqa: E731
    params, state, _ = _run(params, tx.init(params), tx, range(1, 4), place)
    ps.save(path, {"params": params, "opt": state})
    _, _, after = _run(params, state, tx, range(4, 7), place)
    return after


def _resume2_worker(path: str) -> list[dict[str, torch.Tensor]]:
    ps.init_mesh({"tp": 2})
    tx = _tx()
    like_params = ps.shard(optree.tree_map(torch.zeros_like, _wholes(0)), OTHER)
    back = ps.load(path, {"params": like_params, "opt": tx.init(like_params)})
    params, state = back["params"], back["opt"]
    assert state[1].count == 3
    for k, p in params.items():
        assert p.meta == like_params[k].meta, k
        assert state[1].mu[k].meta == p.meta and state[1].nu[k].meta == p.meta, k
    _, _, after = _run(params, state, tx, range(4, 7), lambda w: ps.shard(w, OTHER))
    return after


def test_state_saved_on_4_ranks_resumes_on_2(pool: Any, tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    uninterrupted = pool.run(4, _save4_worker, path)[0]
    resumed = pool.run(2, _resume2_worker, path)
    for a, b in zip(uninterrupted, resumed[0], strict=True):
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=1e-12, atol=1e-14)
    for a, b in zip(resumed[0], resumed[1], strict=True):
        assert all(torch.equal(a[k], b[k]) for k in a)
