"""Clipping sees the whole model: ps.optim.global_norm and clip_by_global_norm on the gradients
ps.pipeline_value_and_grad returns (one stage's part on each rank) equal one process clipping
the whole model's gradients: every schedule's shape of gradients (a tree; interleaved tuples),
inside a map over a data axis after a psum of the gradients, GlobalTensor blocks of tensor
parallelism inside a stage, stacked blocks inside a map over the pipeline axis (no double
count), and a chain(clip_by_global_norm, adamw) over several steps (float64)."""

from __future__ import annotations

import math

import optree
import pytest
import torch
from test_pipeline import _data, _layers, _reference, mlp, sq_loss

import pshard as ps

f64 = torch.float64
P = ps.P


def _whole_norm(ref_grads):
    return math.sqrt(sum(float((g**2).sum()) for tree in ref_grads for g in tree.values()))


def _diff(got, want):
    a, b = optree.tree_leaves(got), optree.tree_leaves(want)
    assert len(a) == len(b) > 0
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))


def rank_clip(schedule):
    torch.set_default_dtype(f64)
    ps.init_mesh({"pp": 4})
    r = ps.axis_index("pp")
    v = 2 if schedule == "interleaved_1f1b" else 1
    layers = _layers()
    per = 8 // (4 * v)
    mine = [[(k * 4 + r) * per + j for j in range(per)] for k in range(v)]
    stages = mlp if v == 1 else [mlp] * 8
    params = [layers[i] for i in mine[0]] if v == 1 else tuple([layers[i] for i in ids]
                                                              for ids in mine)  # fmt: skip
    x, t = _data(8)
    step = ps.pipeline_value_and_grad(stages, sq_loss, num_microbatches=4, schedule=schedule)
    _, grads = step(params, x, t)
    _, ref = _reference(layers, x, t, 4)
    whole = _whole_norm(ref)
    norm = ps.optim.global_norm(grads)
    limit = whole / 3
    clip = ps.optim.clip_by_global_norm(limit)
    clipped, _ = clip.update(grads, clip.init(params))
    want = [[{k: g * (limit / whole) for k, g in ref[i].items()} for i in ids] for ids in mine]
    want = want[0] if v == 1 else tuple(want)
    return abs(norm.item() - whole), _diff(clipped, want)


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved_1f1b", "zero_bubble"])
def test_clipping_a_pipelines_gradients_sees_the_whole_model(pool, schedule):
    for norm_diff, clip_diff in pool.run(4, rank_clip, schedule):
        assert norm_diff < 1e-12 and clip_diff < 1e-12


def rank_dp_pp_clip():
    """dp x pp: the gradients summed over "dp" inside the map, then clipped there."""
    torch.set_default_dtype(f64)
    ps.init_mesh({"dp": 2, "pp": 2})
    r = ps.axis_index("pp")
    layers = _layers(4)
    mine = [2 * r, 2 * r + 1]
    x, t = _data(9)
    _, ref = _reference(layers, x, t, 1)
    whole = _whole_norm(ref)
    step = ps.pipeline_value_and_grad(mlp, sq_loss, num_microbatches=2)
    clip = ps.optim.clip_by_global_norm(whole / 2)

    def body(params, x, t):
        _, grads = step(params, x, t)
        grads = ps.psum(grads, "dp")
        return ps.optim.global_norm(grads), clip.update(grads, clip.init(params))[0]

    mapped = ps.shard_map(
        body, in_specs=(None, P("dp"), P("dp")), out_specs=(P(), P()), axis_names="dp"
    )
    norm, clipped = mapped([layers[i] for i in mine], x, t)
    want = [{k: g / 2 for k, g in ref[i].items()} for i in mine]
    return abs(norm.item() - whole), _diff(clipped, want)


def test_clipping_inside_a_map_over_a_data_axis(pool):
    for norm_diff, clip_diff in pool.run(4, rank_dp_pp_clip):
        assert norm_diff < 1e-12 and clip_diff < 1e-12


def rank_stacked_norm():
    """Blocks stacked along P("pp") inside a map over "pp": specs=P("pp") already sums over
    the axis; the stage mark adds nothing more."""
    torch.set_default_dtype(f64)
    ps.init_mesh({"pp": 2})
    layers = _layers(4)
    stacked = {k: torch.stack([p[k] for p in layers]) for k in ("w", "b")}
    x, t = _data(5)

    def stage(block, h):
        for i in range(block["w"].shape[0]):
            h = torch.tanh(h @ block["w"][i] + block["b"][i])
        return h

    step = ps.pipeline_value_and_grad(stage, sq_loss, num_microbatches=2)

    def body(block, x, t):
        _, grads = step(block, x, t)
        return ps.optim.global_norm(grads, specs=P("pp"))

    norm = ps.shard_map(body, in_specs=(P("pp"), P(), P()), out_specs=P())(stacked, x, t)
    _, ref = _reference(layers, x, t, 1)
    return abs(norm.item() - _whole_norm(ref))


def test_stacked_blocks_are_not_counted_twice(pool):
    assert max(pool.run(2, rank_stacked_norm)) < 1e-12


def rank_train(steps):
    """chain(clip_by_global_norm, adamw) on each stage for several steps against one process
    clipping and updating the whole model."""
    torch.set_default_dtype(f64)
    ps.init_mesh({"pp": 2})
    r = ps.axis_index("pp")
    layers = _layers(4)
    mine = [2 * r, 2 * r + 1]
    x, t = _data(6)
    opt = ps.optim.chain(ps.optim.clip_by_global_norm(0.5), ps.optim.adamw(1e-2))
    step = ps.pipeline_value_and_grad(mlp, sq_loss, num_microbatches=2)
    params = [layers[i] for i in mine]
    state = opt.init(params)
    whole = list(layers)
    whole_state = opt.init(whole)
    for _ in range(steps):
        _, grads = step(params, x, t)
        updates, state = opt.update(grads, state, params)
        params = ps.optim.apply_updates(params, updates)
        _, ref = _reference(whole, x, t, 2)
        updates, whole_state = opt.update(ref, whole_state, whole)
        whole = ps.optim.apply_updates(whole, updates)
    return _diff(params, [whole[i] for i in mine])


def test_clipped_training_equals_one_process(pool):
    assert max(pool.run(2, rank_train, 4)) < 1e-12
