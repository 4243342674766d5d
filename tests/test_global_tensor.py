"""GlobalTensor on one process: layout math against DTensor's, the pytree registrations seen by
torch.func / optree / torch's pytree, and the errors of the constructors.

The multi-process behaviour (blocks on real ranks, the shard_map boundary, gradients against
the one-process model) is in ``test_global_map.py``.
"""

from __future__ import annotations

import itertools
import math
import re

import optree
import pytest
import torch
import torch.utils._pytree as torch_pytree

import pshard as ps
from pshard._core.global_tensor import (
    GlobalMeta,
    GlobalTensor,
    MeshKey,
    block_runs,
    dtensor_placements,
    mesh_key,
    placements_spec,
    spec_placements,
)

tu = pytest.importorskip("torch.distributed.tensor._utils")
# torch.func.jvp's first use scripts its decompositions (torch's own deprecation warning)
pytestmark = pytest.mark.filterwarnings(
    "ignore:`torch.jit.script` is deprecated:DeprecationWarning"
)


def _key(**sizes: int) -> MeshKey:
    n = math.prod(sizes.values())
    return MeshKey(tuple(sizes), tuple(sizes.values()), tuple(range(n)), "cpu")


def _specs(names: tuple[str, ...], ndim: int) -> list[ps.P]:
    """Every P over ``names`` for ``ndim`` dims (each axis on at most one dim, any order)."""
    out = []
    for assign in itertools.product(range(-1, ndim), repeat=len(names)):
        for order in itertools.permutations(names):
            entries: list[list[str]] = [[] for _ in range(ndim)]
            for name in order:
                d = assign[names.index(name)]
                if d >= 0:
                    entries[d].append(name)
            out.append(ps.P(*(tuple(e) if e else None for e in entries)))
    return sorted(set(out), key=repr)


def _without_size_one(spec: ps.P, sizes: dict[str, int]) -> ps.P:
    """``spec`` without its size-1 axes: where they stand in an entry changes no block."""
    entries = [() if e is None else (e,) if isinstance(e, str) else e for e in spec]
    return ps.P(*(tuple(a for a in e if sizes[a] > 1) or None for e in entries))


@pytest.mark.parametrize(
    "sizes",
    [{"a": 2, "b": 3}, {"a": 2, "b": 2, "c": 2}, {"a": 2, "b": 1}, {"a": 2, "b": 1, "c": 2}],
)
def test_spec_placements_round_trip_and_dtensor_layout(sizes: dict[str, int]) -> None:
    """spec -> DTensor placements -> spec is the identity (up to where size-1 axes stand), and
    where DTensor can write the spec its blocks are the spec's blocks (nested torch.chunk in the
    spec's order) for divisible sizes, and for any size when no shard is strided."""
    key = _key(**sizes)
    names = tuple(sizes)
    mesh = tuple(sizes.values())
    checked = strided = 0
    for ndim in (1, 2):
        for spec in _specs(names, ndim):
            try:
                placements = spec_placements(spec, key)
            except ValueError as e:  # three axes on one dim in an order DTensor cannot write
                assert "cannot write" in str(e)
                assert len([n for n in names if sizes[n] > 1]) == 3
                continue
            back = placements_spec(placements, key, ndim)
            assert _without_size_one(back, sizes) == _without_size_one(spec, sizes)
            if all(n > 1 for n in mesh):
                assert back == spec
            is_strided = any(isinstance(p, ps.StridedShard) for p in placements)
            strided += is_strided
            torch_pl = [ps.to_torch_placement(p) for p in placements]
            unit = math.prod(mesh)
            lengths = (unit, 2 * unit) if is_strided else (0, 1, unit - 1, unit + 1, 2 * unit)
            for length in lengths:
                shape = (length,) * ndim
                meta = GlobalMeta(spec, key, shape, None)
                for coord in itertools.product(*map(range, mesh)):
                    runs = block_runs(meta, dict(zip(names, coord, strict=True)))
                    mine = tuple(sum(map(len, r)) for r in runs)
                    ref = tu._compute_local_shape_and_global_offset(
                        shape, mesh, list(coord), torch_pl
                    )[0]
                    assert mine == tuple(ref), (spec, shape, coord)
                    indices = ps.local_indices(shape, mesh, coord, placements)
                    assert runs == indices, (spec, shape, coord)
                    checked += 1
    assert checked > 100 and (strided > 0) == (sum(n > 1 for n in mesh) > 1)


def test_uneven_strided_layout_differs_from_dtensor_and_is_refused() -> None:
    """P(("b", "a")) splits by "b" first, then each piece by "a" (nested torch.chunk); DTensor's
    StridedShard cuts some uneven sizes differently, so the DTensor conversion refuses those."""
    key = _key(a=3, b=2)
    spec = ps.P(("b", "a"))
    placements = spec_placements(spec, key)
    assert placements == (ps.StridedShard(0, 2), ps.Shard(0))
    coords = list(itertools.product(range(3), range(2)))
    for n, differs in ((12, False), (6, False), (7, True)):
        meta = GlobalMeta(spec, key, (n,), None)
        mine = [block_runs(meta, {"a": a, "b": b}) for a, b in coords]
        theirs = [ps.local_indices((n,), (3, 2), c, placements) for c in coords]
        assert (mine != theirs) == differs
        if differs:
            with pytest.raises(ValueError, match=re.escape("other blocks than DTensor's")):
                dtensor_placements(meta)
        else:
            assert dtensor_placements(meta) == placements


def test_mesh_key_compares_by_value() -> None:
    a = ps.init_mesh({"dp": 1})
    b = ps.init_mesh({"dp": 1})
    assert a is not b and mesh_key(a) == mesh_key(b)
    c = ps.init_mesh({"tp": 1})
    assert mesh_key(c) != mesh_key(a)


@pytest.fixture
def mesh() -> object:
    return ps.init_mesh({"dp": 1, "tp": 1})


def _params(mesh: object) -> dict:
    torch.manual_seed(0)
    whole = {"w": torch.randn(5, 3, dtype=torch.float64), "b": torch.randn(3, dtype=torch.float64)}
    return whole, ps.shard(whole, {"w": ps.P("dp", "tp"), "b": ps.P("tp")})


def test_pytree_registrations_see_the_block(mesh: object) -> None:
    whole, params = _params(mesh)
    w = params["w"]
    assert isinstance(w, ps.GlobalTensor) and w.shape == (5, 3) and w.spec == ps.P("dp", "tp")
    assert w.dtype == torch.float64 and w.device == torch.device("cpu") and w.ndim == 2
    assert w.placements == (ps.Shard(0), ps.Shard(1))
    for leaves in (
        torch_pytree.tree_leaves(params),
        optree.tree_leaves(params),
        optree.tree_leaves(params, namespace="pshard"),
    ):
        assert sorted(map(id, leaves)) == sorted(id(params[k].local) for k in ("b", "w"))
    # pshard's own walks keep it whole
    from pshard._core.tree import tree_leaves

    assert tree_leaves(params) == [params["b"], params["w"]]
    paths = optree.tree_paths(params)
    assert paths == [("b", "local"), ("w", "local")]


def test_torch_func_returns_global_tensors_of_the_same_layout(mesh: object) -> None:
    whole, params = _params(mesh)
    x = torch.randn(4, 5, dtype=torch.float64)

    def loss(p: dict) -> torch.Tensor:
        return ((x @ p["w"].local + p["b"].local).tanh() ** 2).sum()

    def whole_loss(p: dict) -> torch.Tensor:
        return ((x @ p["w"] + p["b"]).tanh() ** 2).sum()

    grads = torch.func.grad(loss)(params)
    ref = torch.func.grad(whole_loss)(whole)
    for k in ("w", "b"):
        assert isinstance(grads[k], ps.GlobalTensor) and grads[k].meta == params[k].meta
        torch.testing.assert_close(grads[k].local, ref[k])
    # vjp / jvp / vmap see blocks too
    _, pull = torch.func.vjp(loss, params)
    (g,) = pull(torch.tensor(1.0, dtype=torch.float64))
    torch.testing.assert_close(g["w"].local, ref["w"])
    tangent = optree.tree_map(torch.ones_like, params)
    _, dot = torch.func.jvp(loss, (params,), (tangent,))
    torch.testing.assert_close(dot, sum((ref[k] * torch.ones_like(ref[k])).sum() for k in ref))
    stacked = optree.tree_map(lambda t: torch.stack([t, 2 * t]), params)
    out = torch.func.vmap(loss)(stacked)
    torch.testing.assert_close(out[0], whole_loss(whole))


def test_optree_tree_map_over_params_grads_and_moments(mesh: object) -> None:
    """AdamW's update over four trees: equal structures although the moments are float32."""
    _, params = _params(mesh)
    grads = optree.tree_map(torch.ones_like, params)
    m = optree.tree_map(lambda t: torch.zeros_like(t, dtype=torch.float32), params)
    v = optree.tree_map(lambda t: torch.zeros_like(t, dtype=torch.float32), params)
    assert optree.tree_structure(m) == optree.tree_structure(params)
    new = optree.tree_map(lambda p, g, a, b: p - 0.1 * g + a + b, params, grads, m, v)
    assert new["w"].meta == params["w"].meta
    torch.testing.assert_close(new["w"].local, params["w"].local - 0.1)
    assert m["w"].dtype == torch.float32


def test_single_process_round_trips(mesh: object) -> None:
    whole, params = _params(mesh)
    back = ps.gather(params)
    assert torch.equal(back["w"], whole["w"]) and torch.equal(back["b"], whole["b"])
    # an owned copy even when the block is the whole value
    x = ps.shard(whole["w"], ps.P())
    assert x.local.untyped_storage().data_ptr() != whole["w"].untyped_storage().data_ptr()
    y = ps.reshard(params, {"w": ps.P(None, ("dp", "tp")), "b": None})
    assert y["w"].spec == ps.P(None, ("dp", "tp")) and y["b"].spec == ps.P(None)
    assert torch.equal(ps.gather(y["w"]), whole["w"])
    assert ps.reshard(params["w"], ps.P("dp", "tp")) is params["w"]
    made = ps.from_callback((5, 3), ps.P("dp"), lambda index: whole["w"][index])
    assert torch.equal(made.local, whole["w"])
    local = ps.from_local({"w": whole["w"]}, ps.P("dp"))
    assert local["w"].local is whole["w"] and local["w"].shape == (5, 3)
    listed = ps.from_local({"w": whole["w"]}, ps.P("dp"), global_shapes={"w": [5, 3]})
    assert listed["w"].meta == local["w"].meta
    d = ps.to_dtensor(params["w"])
    storage = params["w"].local.untyped_storage().data_ptr()
    assert d.to_local().untyped_storage().data_ptr() == storage
    again = ps.from_dtensor(d)
    assert again.meta == params["w"].meta
    assert torch.equal(ps.gather(ps.shard(whole["w"], ps.Shard(1))), whole["w"])


def test_gather_and_reshard_are_differentiable(mesh: object) -> None:
    whole, _ = _params(mesh)
    w = whole["w"]

    def f(w: torch.Tensor) -> torch.Tensor:
        x = ps.reshard(ps.shard(w, ps.P("dp")), ps.P(None, "tp"))
        return (ps.gather(x) ** 3).sum()

    torch.testing.assert_close(torch.func.grad(f)(w), 3 * w**2)
    hess = torch.func.hessian(f)(w)  # diagonal: 6 w
    torch.testing.assert_close(hess.reshape(w.numel(), -1).diagonal(), 6 * w.flatten())


def _raises(exc: type, text: str) -> object:
    return pytest.raises(exc, match=re.escape(text))


def test_errors_name_the_key_path(mesh: object) -> None:
    whole, params = _params(mesh)
    with _raises(ValueError, "shard tree['w']: P('sp') names mesh axis 'sp', which is not in"):
        ps.shard(whole, {"w": ps.P("sp"), "b": None})
    with _raises(ValueError, "shard tree['b']: P('dp', None) has 2 entries but the tensor has 1"):
        ps.shard(whole, {"w": None, "b": ps.P("dp", None)})
    with _raises(TypeError, "shard tree['b']: already a GlobalTensor"):
        ps.shard(params, None)
    with _raises(ValueError, "from_local tree['w']: the block has shape (5, 3), but P('dp', None)"):
        ps.from_local({"w": whole["w"]}, ps.P("dp"), global_shapes={"w": (6, 3)})
    with _raises(ValueError, "from_callback fn((slice(0, 5, None),)): the block has shape (4,)"):
        ps.from_callback((5,), ps.P("dp"), lambda index: torch.zeros(4))
    with _raises(TypeError, "psum: x['b'] is a GlobalTensor of shape (3,) split over 'tp'"):
        ps.psum(params, "dp")
    with _raises(TypeError, "all_gather: x is a GlobalTensor of shape (5, 3)"):
        ps.all_gather(params["w"], "dp")
    text = (
        "psum: x is a GlobalTensor of shape (4,) split over 'dp'; collectives take this rank's "
        "block: pass it to ps.shard_map(f, in_specs=ps.P('dp'), ...) (f gets the block and can "
        "call psum on it; a map over other axes hands a GlobalTensor on as it is), or get the "
        "whole value with ps.gather(x)"
    )
    with _raises(TypeError, text):  # outside any map
        ps.psum(ps.shard(torch.ones(4), ps.P("dp")), "dp")
    with _raises(TypeError, text.split("; ")[1]):  # inside a map over another axis
        rows = ps.shard(torch.ones(4), ps.P("dp"))
        ps.shard_map(lambda: ps.psum(rows, "tp"), in_specs=(), out_specs=ps.P())()
    other = ps.init_mesh({"x": 1})
    with _raises(ValueError, "shard_map in_specs[0]: a GlobalTensor on mesh {'dp': 1, 'tp': 1}"):
        ps.shard_map(lambda w: w, mesh=other, in_specs=ps.P(), out_specs=ps.P())(params["w"])
    with _raises(ValueError, "placements[0] = Partial('sum') (mesh axis 'dp') is not a layout"):
        placements_spec((ps.Partial(),), mesh_key(ps.init_mesh({"dp": 1})), 1)


def test_block_written_in_place_under_a_transform_is_refused(mesh: object) -> None:
    whole, params = _params(mesh)

    def bad(p: dict) -> torch.Tensor:
        p["w"].local.mul_(2)
        return ps.gather(p)["w"].sum()

    def good(p: dict) -> torch.Tensor:
        return ps.gather(p)["w"].sum() * 2

    stacked = optree.tree_map(lambda t: torch.stack([t, t]), params)
    with _raises(ValueError, "gather tree['w']: the block of this GlobalTensor was modified in"):
        torch.func.vmap(bad)(stacked)
    stacked = optree.tree_map(lambda t: torch.stack([t, t]), params)  # bad wrote into it
    torch.testing.assert_close(torch.func.vmap(good)(stacked), 2 * whole["w"].sum().expand(2))
    # outside a transform, blocks are updated in place as torch.optim does
    params["w"].local.mul_(2)
    torch.testing.assert_close(ps.gather(params)["w"], 2 * whole["w"])


def test_global_tensors_are_immutable(mesh: object) -> None:
    """Rebinding .local under torch.func.grad would change what is differentiated (the
    gradient with respect to the new block, silently): a GlobalTensor cannot be rebound."""
    whole, params = _params(mesh)
    w = params["w"]

    def loss(w: ps.GlobalTensor) -> torch.Tensor:
        w.local = w.local * 2
        return ps.gather(w).sum()

    with _raises(AttributeError, "GlobalTensor is immutable: cannot set .local"):
        torch.func.grad(loss)(w)
    with _raises(AttributeError, "GlobalTensor is immutable: cannot set .meta"):
        w.meta = w.meta
    import copy

    c = copy.deepcopy(w)
    assert c.meta == w.meta and torch.equal(c.local, w.local) and c.local is not w.local
    assert copy.copy(w).local is w.local


def test_torch_functions_on_a_global_tensor_say_what_to_call(mesh: object) -> None:
    """torch.sum(x) on a GlobalTensor raised torch's own TypeError ("sum(): argument 'input'
    must be Tensor, not GlobalTensor"): it names .local and ps.gather instead."""
    _, params = _params(mesh)
    text = (
        "a GlobalTensor is a pytree node (this rank's block and the layout of the whole), not a "
        "tensor: inside a map (ps.shard_map) use its block, x.local; for the whole value, "
        "ps.gather(x)"
    )
    with _raises(TypeError, "sum: " + text):
        torch.sum(params["w"])
    with _raises(TypeError, "stack: " + text):
        torch.stack([params["b"], params["b"]])
    with _raises(TypeError, "matmul: " + text):
        torch.matmul(params["w"].local, params["b"])


def test_a_block_that_does_not_fit_its_layout_is_refused(mesh: object) -> None:
    """A tree_map that changes a block's shape, or a vmap batch dim carried out of the vmap,
    leaves a GlobalTensor whose block does not fit: gather, reshard, shard_map and to_dtensor
    refuse it (never zero-filled rows or a wrong shape)."""
    whole, params = _params(mesh)
    bad = {"w": optree.tree_map(lambda t: t[:1], params["w"]), "b": params["b"]}
    with _raises(ValueError, "gather tree['w']: the block has shape (1, 3), but P('dp', 'tp')"):
        ps.gather(bad)
    with _raises(ValueError, "reshard tree['w']: the block has shape (1, 3)"):
        ps.reshard(bad, {"w": ps.P(), "b": ps.P()})
    with _raises(ValueError, "to_dtensor x: the block has shape (1, 3)"):
        ps.to_dtensor(bad["w"])
    with _raises(ValueError, "shard_map in_specs[0]: the block has shape (1, 3)"):
        ps.shard_map(lambda w: w, in_specs=ps.P("dp", "tp"), out_specs=ps.P("dp", "tp"))(bad["w"])
    # per-example gradients: vmap's batch dim stays in the blocks of its output
    x = torch.randn(7, 4, 5, dtype=torch.float64)
    per_example = torch.func.vmap(
        torch.func.grad(lambda w, x: (x @ ps.gather(w)).pow(2).sum()), in_dims=(None, 0)
    )(params["w"], x)
    assert per_example.local.shape == (7, 5, 3)
    with _raises(ValueError, "the block has 3 dims but the GlobalTensor 2 (shape (5, 3), block"):
        ps.gather(per_example)


def test_repr() -> None:
    ps.init_mesh({"dp": 1})
    x = ps.shard(torch.zeros(4, 2), ps.P("dp"))
    assert repr(x) == (
        "GlobalTensor(shape=(4, 2), spec=P('dp', None), mesh={'dp': 1}, local shape=(4, 2))"
    )
    assert GlobalTensor(None, x.meta).local is None  # a node rebuilt around anything
