"""ps.optim on one process against torch.optim, float64: SGD (plain, momentum, Nesterov), Adam
and AdamW over several steps with a mask and nested trees; purity (no argument is written,
float64 stays float64); donation (the same numbers, written in place); the global norm and
clipping against torch.nn.utils; apply_updates' dtypes; errors naming the key path; and speed
against torch.optim.AdamW(foreach=True).step() on the same tensors."""

from __future__ import annotations

import math
import re
import statistics
import time
from typing import Any

import optree
import pytest
import torch

import pshard as ps
from pshard import optim

f64 = torch.float64
SHAPES = {"layer": {"w": (5, 3), "b": (3,)}, "head": [(3, 2), (2,)], "scale": ()}


def _tree(seed: int, dtype: torch.dtype = f64) -> Any:
    g = torch.Generator().manual_seed(seed)
    return optree.tree_map(
        lambda s: torch.randn(s, dtype=dtype, generator=g),
        SHAPES,
        is_leaf=lambda s: isinstance(s, tuple) and all(isinstance(i, int) for i in s),
    )


def _leaves(tree: Any) -> list[torch.Tensor]:
    """The tensors of ``tree`` (a state's count is an int)."""
    return [x for x in optree.tree_leaves(tree) if isinstance(x, torch.Tensor)]


def _torch_run(make: Any, params: Any, grads: list[Any]) -> list[torch.Tensor]:
    leaves = [p.clone().requires_grad_() for p in _leaves(params)]
    opt = make(leaves)
    for g in grads:
        for p, x in zip(leaves, _leaves(g), strict=True):
            p.grad = x.clone()
        opt.step()
    return [p.detach() for p in leaves]


def _ours(tx: Any, params: Any, grads: list[Any], donate: bool = False) -> tuple[Any, Any]:
    params = optree.tree_map(torch.clone, params) if donate else params
    state = tx.init(params)
    for g in grads:
        g = optree.tree_map(torch.clone, g) if donate else g
        updates, state = tx.update(g, state, params, donate=donate)
        params = optim.apply_updates(params, updates, donate=donate)
    return params, state


CASES = {
    "sgd": (lambda: optim.sgd(0.1), lambda p: torch.optim.SGD(p, lr=0.1)),
    "momentum": (
        lambda: optim.sgd(0.1, momentum=0.9),
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    ),
    "nesterov": (
        lambda: optim.sgd(0.1, momentum=0.8, nesterov=True),
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.8, nesterov=True),
    ),
    "adam": (
        lambda: optim.adam(0.05, b1=0.8, b2=0.95, eps=1e-6),
        lambda p: torch.optim.Adam(p, lr=0.05, betas=(0.8, 0.95), eps=1e-6, foreach=True),
    ),
    "adamw": (
        lambda: optim.adamw(0.05, weight_decay=0.3),
        lambda p: torch.optim.AdamW(p, lr=0.05, weight_decay=0.3, foreach=True),
    ),
}


@pytest.mark.parametrize("donate", [False, True], ids=["pure", "donate"])
@pytest.mark.parametrize("name", list(CASES))
def test_equal_to_torch_optim(name: str, donate: bool) -> None:
    ours, theirs = CASES[name]
    params, grads = _tree(0), [_tree(s) for s in range(1, 6)]
    got, state = _ours(ours(), params, grads, donate)
    want = _torch_run(theirs, params, grads)
    for a, b in zip(_leaves(got), want, strict=True):
        assert a.dtype == f64
        torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-15)
    assert state.count == 5


def test_adamw_mask_against_two_torch_groups() -> None:
    params, grads = _tree(0), [_tree(s) for s in range(1, 4)]
    mask = {"layer": {"w": True, "b": False}, "head": True, "scale": False}
    got, _ = _ours(optim.adamw(0.05, weight_decay=0.3, mask=mask), params, grads)

    # the same mask from a function of the params
    def decaying(p: Any) -> Any:
        return {"layer": {"w": True, "b": False}, "head": True, "scale": p["scale"].ndim > 0}

    by_fn, _ = _ours(optim.adamw(0.05, weight_decay=0.3, mask=decaying), params, grads)
    decays = [m for m in optree.tree_leaves(optree.tree_broadcast_prefix(mask, params))]
    leaves = [p.clone().requires_grad_() for p in _leaves(params)]
    opt = torch.optim.AdamW(
        [
            {"params": [p for p, d in zip(leaves, decays, strict=True) if d]},
            {
                "params": [p for p, d in zip(leaves, decays, strict=True) if not d],
                "weight_decay": 0,
            },
        ],
        lr=0.05,
        weight_decay=0.3,
        foreach=True,
    )
    for g in grads:
        for p, x in zip(leaves, _leaves(g), strict=True):
            p.grad = x.clone()
        opt.step()
    for a, b, c in zip(_leaves(got), leaves, _leaves(by_fn), strict=True):
        torch.testing.assert_close(a, b.detach(), rtol=1e-13, atol=1e-15)
        torch.testing.assert_close(c, b.detach(), rtol=1e-13, atol=1e-15)


def test_pure_and_dtypes() -> None:
    """update and apply_updates write nothing they were given; float64 stays float64."""
    tx = optim.chain(optim.clip_by_global_norm(0.1), optim.adamw(0.1, weight_decay=0.5))
    params, grads = _tree(0), _tree(1)
    state = tx.init(params)
    for _ in range(2):  # the second update starts from non-zero moments
        before = [x.clone() for x in _leaves((params, grads, state))]
        updates, new_state = tx.update(grads, state, params)
        new_params = optim.apply_updates(params, updates)
        for x, y in zip(_leaves((params, grads, state)), before, strict=True):
            assert torch.equal(x, y)
        kept = {id(x) for x in _leaves((params, grads, state))}
        assert not kept & {id(x) for x in _leaves((updates, new_state, new_params))}
        moments = (new_state[1].mu, new_state[1].nu)
        assert all(x.dtype == f64 for x in _leaves((updates, moments, new_params)))
        assert new_state[1].count.dtype == torch.int64 and new_state[1].count.dim() == 0
        params, state = new_params, new_state
    # a schedule's count and bf16 parameters moved by float32 updates keep their dtype
    p16 = {"w": torch.ones(3, dtype=torch.bfloat16)}
    out = optim.apply_updates(p16, {"w": torch.full((3,), 0.5)})
    assert out["w"].dtype == torch.bfloat16 and torch.equal(out["w"], torch.full((3,), 1.5))


def test_donate_writes_in_place() -> None:
    tx = optim.adamw(0.1)
    params, grads = _tree(0), _tree(1)
    state = tx.init(params)
    pure = tx.update(grads, state, params)
    mu = [x.data_ptr() for x in _leaves(state.mu)]
    p_ptrs = [x.data_ptr() for x in _leaves(params)]
    kept = [x.clone() for x in _leaves(params)]
    updates, new = tx.update(grads, state, params, donate=True)
    assert [x.data_ptr() for x in _leaves(new.mu)] == mu
    for a, b in zip(_leaves((updates, new)), _leaves(pure), strict=True):
        assert torch.equal(a, b)
    out = optim.apply_updates(params, updates, donate=True)
    assert [x.data_ptr() for x in _leaves(out)] == p_ptrs
    for a, p, u in zip(_leaves(out), kept, _leaves(updates), strict=True):
        assert torch.equal(a, p + u)


def test_global_norm_and_clipping_against_torch() -> None:
    grads = _tree(3)
    leaves = [x.clone().requires_grad_() for x in _leaves(grads)]
    for x, g in zip(leaves, _leaves(grads), strict=True):
        x.grad = g.clone()
    total = torch.nn.utils.clip_grad_norm_(leaves, max_norm=1.0)
    norm = optim.global_norm(grads)
    assert norm.dtype == f64 and norm.shape == ()
    torch.testing.assert_close(norm, total, rtol=1e-14, atol=0)
    clip = optim.clip_by_global_norm(1.0)
    clipped, _ = clip.update(grads, clip.init(grads))
    for a, g, x in zip(_leaves(clipped), _leaves(grads), leaves, strict=True):
        torch.testing.assert_close(a, g * (1.0 / norm), rtol=1e-15, atol=0)
        # torch divides by norm + 1e-6 (optax and pshard by norm)
        assert not torch.equal(a, x.grad)
        torch.testing.assert_close(a, x.grad * ((norm + 1e-6) / norm), rtol=1e-14, atol=0)
    torch.testing.assert_close(optim.global_norm(clipped), torch.tensor(1.0, dtype=f64))
    # below the threshold: unchanged
    loose = optim.clip_by_global_norm(float(norm) * 1.01)
    same, _ = loose.update(grads, loose.init(grads))
    assert all(a is b for a, b in zip(_leaves(same), _leaves(grads), strict=True))
    # 16-bit leaves are summed in float32
    assert optim.global_norm([torch.full((4,), 3.0, dtype=torch.bfloat16)]).dtype == torch.float32


def test_schedules_as_learning_rates() -> None:
    seen: list[int] = []

    def schedule(count: int) -> float:
        seen.append(count)
        return 0.1 * (count + 1)

    tx = optim.sgd(schedule)
    params = {"w": torch.zeros(2, dtype=f64)}
    state = tx.init(params)
    for _ in range(3):
        updates, state = tx.update({"w": torch.ones(2, dtype=f64)}, state)
    assert seen == [0, 1, 2]
    torch.testing.assert_close(updates["w"], torch.full((2,), -0.3, dtype=f64))


def test_global_tensors_on_one_process() -> None:
    ps.init_mesh({"dp": 1})
    specs = {"layer": ps.P("dp"), "head": [ps.P(None, "dp"), None], "scale": None}
    params = ps.shard(_tree(0), specs)
    tx = optim.adamw(0.1)
    state = tx.init(params)
    for part in (state.mu, state.nu):
        for leaf, p in zip(_gts(part), _gts(params), strict=True):
            assert isinstance(leaf, ps.GlobalTensor) and leaf.meta == p.meta
    updates, state = tx.update(optree.tree_map(torch.ones_like, params), state, params)
    new = optim.apply_updates(params, updates)
    assert all(isinstance(x, ps.GlobalTensor) for x in _gts(new))


def test_state_loaded_from_its_metadata(tmp_path: Any) -> None:
    """ps.load with like from ps.load_metadata gives NamedTuples back as dicts (and tuples as
    they were): the transforms take them and take the next step as from the saved state."""
    ps.init_mesh({"dp": 1})
    tx = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(0.1), optim.sgd(1.0, 0.5))
    params = ps.shard(_tree(0), ps.P())
    updates, state = tx.update(ps.shard(_tree(1), ps.P()), tx.init(params), params)
    ps.save(str(tmp_path / "ckpt"), {"opt": state})
    back = ps.load(str(tmp_path / "ckpt"), ps.load_metadata(str(tmp_path / "ckpt")))["opt"]
    assert isinstance(back[1], dict) and back[1]["count"] == 1
    grads = ps.shard(_tree(2), ps.P())
    want, want_state = tx.update(grads, state, params)
    got, got_state = tx.update(grads, back, params)
    assert isinstance(got_state[1], optim.ScaleByAdamState) and got_state[1].count == 2
    got_leaves, want_leaves = _leaves(ps.gather((got, got_state))), _leaves(ps.gather(want))
    want_leaves += _leaves(ps.gather(want_state))
    # updates, mu, nu, trace (5 leaves each) and the two counts
    assert len(got_leaves) == len(want_leaves) == 3 * 5 + 5 + 2
    for a, b in zip(got_leaves, want_leaves, strict=True):
        assert torch.equal(a, b)


def _gt(x: Any) -> bool:
    return isinstance(x, ps.GlobalTensor)


def _gts(tree: Any) -> list[Any]:
    return optree.tree_leaves(tree, is_leaf=_gt)


# --------------------------------------------------------------------------- errors


def test_errors_name_the_key_path() -> None:
    ps.init_mesh({"dp": 1})
    params = _tree(0)
    tx = optim.adamw(0.1)
    state = tx.init(params)
    grads = _tree(1)
    del grads["layer"]["b"]
    with pytest.raises(ValueError, match=re.escape("missing from grads: state.mu['layer']['b']")):
        tx.update(grads, state, params)
    grads = _tree(1)
    grads["head"][0] = torch.zeros(2, 3, dtype=f64)
    with pytest.raises(
        ValueError,
        match=re.escape(
            "adamw: grads['head'][0] is a tensor of shape (2, 3) but state.mu['head'][0] is a "
            "tensor of shape (3, 2); pass gradients of the params this state was made from"
        ),
    ):
        tx.update(grads, state, params)
    grads = _tree(1)
    grads["scale"] = ps.shard(grads["scale"], ps.P())
    with pytest.raises(ValueError, match=re.escape("grads['scale'] is a GlobalTensor of shape ()")):
        tx.update(grads, state, params)
    grads = _tree(1)
    grads["layer"]["w"] = "x"
    with pytest.raises(TypeError, match=re.escape("adamw: grads['layer']['w'] is a str ('x');")):
        tx.update(grads, state, params)
    with pytest.raises(ValueError, match=re.escape("adamw: weight decay reads the parameters")):
        tx.update(_tree(1), state)


def test_schedule_and_mask_errors() -> None:
    params = _tree(0)
    bad = optim.adam(lambda count: torch.tensor(0.1))
    with pytest.raises(
        TypeError,
        match=re.escape(
            "adam: the learning-rate schedule returned a tensor of shape () for step count 0; "
            "a schedule returns a Python float (a tensor: return .item())"
        ),
    ):
        bad.update(_tree(1), bad.init(params))
    with pytest.raises(ValueError, match=re.escape("adamw mask['layer']: the spec is a dict")):
        optim.adamw(0.1, mask={"layer": {"w": True}, "head": True, "scale": True}).init(params)
    with pytest.raises(TypeError, match=re.escape("adamw mask for params['head'][1]: an int (1);")):
        optim.adamw(0.1, mask={"layer": True, "head": [True, 1], "scale": False}).init(params)
    with pytest.raises(TypeError, match=re.escape("sgd: learning_rate must be a real number")):
        optim.sgd("0.1")
    with pytest.raises(ValueError, match=re.escape("chain: the state is a tuple of length 1")):
        optim.chain(optim.sgd(0.1), optim.sgd(0.1)).update(_tree(1), (optim.SgdState(0, None),))


# --------------------------------------------------------------------------- speed


def _best_of(fn: Any, after: Any, calls: int = 5) -> float:
    """The shortest of ``calls`` timed calls of ``fn`` (``after`` untimed after each): on a
    shared machine, the time it takes when it has the core to itself."""
    best = math.inf
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
        if after is not None:
            after()
    return best


def _median_ratio(ours: Any, theirs: Any, rounds: int, after: Any = None) -> float:
    """The median over interleaved rounds (after two warm-up rounds) of ``ours``' time over
    ``theirs``', each the best of five calls; ``after`` runs untimed after each call of
    ``ours``."""
    ratios = []
    for r in range(rounds + 2):
        mine, torch_time = _best_of(ours, after), _best_of(theirs, None)
        if r >= 2:
            ratios.append(mine / torch_time)
    return statistics.median(ratios)


def _speed_case(shapes: list[tuple[int, ...]]) -> tuple[dict, dict, Any, Any]:
    g = torch.Generator().manual_seed(0)
    params = {f"p{i}": torch.randn(s, generator=g) for i, s in enumerate(shapes)}
    grads = {k: torch.randn(v.shape, generator=g) for k, v in params.items()}
    leaves = [v.clone().requires_grad_() for v in params.values()]
    for p, x in zip(leaves, grads.values(), strict=True):
        p.grad = x.clone()
    opt = torch.optim.AdamW(leaves, lr=1e-3, weight_decay=0.01, foreach=True)
    return params, grads, opt, optim.adamw(1e-3, weight_decay=0.01)


def test_adamw_speed_against_torch_foreach() -> None:
    """A pure update plus apply_updates within 1.75x of torch's in-place foreach step on the
    same tensors, and a donating one within 1.5x (the benchmark measures about 1.0x): medians
    over interleaved rounds, each the best of five calls.

    The pure step allocates its results (moments, updates, parameters) where torch's writes in
    place. Tensors of at most 128 KiB come from the allocator's heap, where that costs little;
    larger ones are fresh pages each time, whose first touch costs more than a pass over them
    on a CPU (benchmarks/optim.py measures both): there the donating step is the one to use.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # on a shared machine, threads that wait for each other time out
    try:
        _speeds()
    finally:
        torch.set_num_threads(threads)


def _speeds() -> None:
    params, grads, opt, tx = _speed_case([(128, 128)] * 24 + [(128,)] * 24)
    box = {"params": params, "state": tx.init(params)}

    def pure() -> None:
        updates, box["state"] = tx.update(grads, box["state"], box["params"])
        box["params"] = optim.apply_updates(box["params"], updates)

    ratio = _median_ratio(pure, opt.step, rounds=21)
    assert ratio <= 1.75, ratio

    params, grads, opt, tx = _speed_case([(512, 512)] * 4 + [(512,)] * 4)
    box = {"params": params, "state": tx.init(params)}
    spare = optree.tree_map(torch.clone, grads)

    def donating() -> None:
        updates, box["state"] = tx.update(spare, box["state"], box["params"], donate=True)
        box["params"] = optim.apply_updates(box["params"], updates, donate=True)

    def refresh() -> None:  # the next gradients, as a backward pass would write them
        for s, x in zip(spare.values(), grads.values(), strict=True):
            s.copy_(x)

    ratio = _median_ratio(donating, opt.step, rounds=21, after=refresh)
    assert ratio <= 1.5, ratio


def test_integer_leaves_are_named() -> None:
    """An int64 leaf: the key path and the dtype (it was torch's 'lerp_kernel_scalar not
    implemented for Long')."""
    params = {"w": torch.ones(2), "step": torch.tensor(3)}
    for tx in (ps.optim.adamw(1e-3), ps.optim.adam(1e-3), ps.optim.sgd(0.1, momentum=0.9)):
        with pytest.raises(TypeError, match=re.escape("params['step'] is an int64 tensor")):
            tx.init(params)
    tx = ps.optim.adam(1e-3)
    state = tx.init({"w": torch.ones(2)})
    with pytest.raises(TypeError, match=re.escape("grads['w'] is a bool tensor")):
        tx.update({"w": torch.ones(2, dtype=torch.bool)}, state)


def test_donating_updates_to_shared_memory_is_refused() -> None:
    """Two keys holding one tensor (or overlapping views), updated in place: one would take
    both updates; the error names both keys."""
    w = torch.ones(3)
    with pytest.raises(ValueError, match=re.escape("params['a'] and params['b'] share memory")):
        ps.optim.apply_updates({"a": w, "b": w}, {"a": torch.ones(3), "b": torch.ones(3)},
                               donate=True)  # fmt: skip
    base = torch.zeros(4)
    with pytest.raises(ValueError, match=re.escape("params['x'] and params['y'] share memory")):
        ps.optim.apply_updates({"x": base[:3], "y": base[2:]},
                               {"x": torch.ones(3), "y": torch.ones(2)}, donate=True)  # fmt: skip
    # views that do not overlap are fine, and so is the pure update of one tensor twice
    out = ps.optim.apply_updates({"x": base[:2], "y": base[2:]},
                                 {"x": torch.ones(2), "y": torch.ones(2)}, donate=True)  # fmt: skip
    assert torch.equal(base, torch.ones(4)) and out["x"] is not None
    pure = ps.optim.apply_updates({"a": w, "b": w}, {"a": torch.ones(3), "b": torch.ones(3)})
    assert torch.equal(pure["a"], torch.full((3,), 2.0)) and torch.equal(w, torch.ones(3))


def test_a_state_loaded_with_one_spec_for_everything(tmp_path: Any) -> None:
    """ps.load(path, specs=P("dp")) of a saved state: the step count (a 0-d tensor) has no dim
    to split and comes back whole (a replicated GlobalTensor), and the next update takes it."""
    ps.init_mesh({"dp": 1})
    tx = optim.adamw(0.1)

    def tree(seed: int) -> dict:
        g = torch.Generator().manual_seed(seed)
        return {
            "w": torch.randn(4, 3, dtype=f64, generator=g),
            "b": torch.randn(3, dtype=f64, generator=g),
        }

    params = ps.shard(tree(0), ps.P("dp"))
    _, state = tx.update(ps.shard(tree(1), ps.P("dp")), tx.init(params), params)
    ps.save(str(tmp_path / "ckpt"), {"opt": state})
    back = ps.load(str(tmp_path / "ckpt"), specs=ps.P("dp"))["opt"]
    assert back["count"].shape == () and back["count"].spec == ps.P()
    grads = ps.shard(tree(2), ps.P("dp"))
    got, got_state = tx.update(grads, back, params)
    want, want_state = tx.update(grads, state, params)
    assert int(got_state.count) == int(want_state.count) == 2
    for a, b in zip(_leaves(ps.gather(got)), _leaves(ps.gather(want)), strict=True):
        assert torch.equal(a, b)
