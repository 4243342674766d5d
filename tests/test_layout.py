"""Layout math against DTensor's own implementation (torch.distributed.tensor, no process group).

Oracles:
- ``_compute_local_shape_and_global_offset`` (plain-value entry point of DTensor's
  ``compute_local_shape_and_global_offset``) for shapes and offsets;
- ``Shard._split_tensor`` / ``_StridedShard._split_tensor`` applied mesh dim by mesh dim, left to
  right, plus ``Partial._partition_value``'s rule, exactly as ``distribute_tensor`` builds each
  coordinate's local tensor, for the data each coordinate holds;
- ``compute_global_tensor_info`` / ``compute_local_tensor_info`` / ``compute_local_stride`` for
  strides (given a stand-in mesh object that only answers ``size``).
"""

from __future__ import annotations

import itertools
import math
import operator
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import pshard as ps

tu = pytest.importorskip("torch.distributed.tensor._utils")
pt = pytest.importorskip("torch.distributed.tensor.placement_types")
if not hasattr(tu, "_compute_local_shape_and_global_offset") or torch.__version__ < (2, 13):
    pytest.skip("the DTensor oracles need torch >= 2.13", allow_module_level=True)

R, Pa, S, SS = ps.Replicate(), ps.Partial(), ps.Shard, ps.StridedShard


class _Mesh:
    """Stands in for a DeviceMesh where torch's helpers only ask for sizes."""

    def __init__(self, shape):
        self.shape = tuple(shape)
        self.ndim = len(self.shape)

    def size(self, mesh_dim=None):
        return self.shape[mesh_dim]


def _coords(mesh):
    return list(itertools.product(*map(range, mesh)))


def _options(ndim, split_factors=(1, 2, 3), partial=True):
    out = [R, Pa] if partial else [R]
    for d in range(ndim):
        out += [S(d)] + [SS(d, k) for k in split_factors]
    return out


def _dtensor_blocks(x, mesh, placements):
    """Every coordinate's local tensor, built as distribute_tensor does (left to right)."""
    blocks = {(): x}
    for n, p in zip(mesh, placements, strict=True):
        tp = ps.to_torch_placement(p)
        nxt = {}
        for key, t in blocks.items():
            if isinstance(p, (ps.Shard, ps.StridedShard)):
                parts = tp._split_tensor(t, n, with_padding=False, contiguous=True)[0]
            elif isinstance(p, ps.Partial) and p.reduce == "sum":
                parts = [t / n] * n
            else:
                parts = [t] * n
            nxt.update({key + (i,): part for i, part in enumerate(parts)})
        blocks = nxt
    return blocks


def _flat(runs):
    return [i for r in runs for i in r]


def _check_case(shape, mesh, placements):
    """Compare every public function with DTensor on one layout; return the coordinate count."""
    tp = [ps.to_torch_placement(p) for p in placements]
    x = torch.arange(math.prod(shape), dtype=torch.float64).reshape(shape)
    partial_sum = math.prod(n for p, n in zip(placements, mesh, strict=True) if p == Pa)
    row_major = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    ref_blocks = _dtensor_blocks(x, mesh, placements)
    blocks = {}
    for c in _coords(mesh):
        ref = tu._compute_local_shape_and_global_offset(shape, mesh, list(c), tp)
        got = ps.local_shape_and_offset(shape, mesh, c, placements)
        assert got == ref, (shape, mesh, c, placements)
        block = ps.shard_tensor(x, mesh, c, placements)
        assert block.dtype == ref_blocks[c].dtype
        assert torch.equal(block, ref_blocks[c]), (shape, mesh, c, placements)
        # local_indices: the arange values DTensor put on this coordinate, in order
        idx = ps.local_indices(shape, mesh, c, placements)
        flat = [_flat(r) for r in idx]
        values = [sum(map(operator.mul, i, row_major)) for i in itertools.product(*flat)]
        assert (ref_blocks[c] * partial_sum).round().flatten().tolist() == values
        for r in idx:  # canonical: maximal ascending runs of step 1, no empty range
            assert all(len(a) and a.step == 1 for a in r)
            assert all(a.stop < b.start for a, b in itertools.pairwise(r))
        blocks[c] = block
    back = ps.unshard_tensor(blocks, shape, mesh, placements)
    if partial_sum == 1:
        assert torch.equal(back, x)
    else:
        torch.testing.assert_close(back, x, rtol=1e-15, atol=1e-12)
    return len(blocks)


# (mesh, tensor shapes, placement options per mesh dim, number of coordinates checked): every
# placement combination on every mesh; every size 0..9 on every tensor dim for the smaller meshes
_ONE_D = [(a,) for a in range(10)]
_TWO_D = [(a, b) for a in range(10) for b in range(10)]
_DIAG = [(a, (3 * a + 1) % 10) for a in range(10)]
_FEW = [(5, 6), (7, 2), (8, 3)]
_GRID = {
    "1d-mesh2": ((2,), _ONE_D, _options(1), 120),
    "1d-mesh3": ((3,), _ONE_D, _options(1), 180),
    "1d-mesh2x2": ((2, 2), _ONE_D, _options(1), 1440),
    "1d-mesh2x3": ((2, 3), _ONE_D, _options(1), 2160),
    "1d-mesh2x2x2": ((2, 2, 2), [(5,), (8,)], _options(1), 3456),
    "2d-mesh2": ((2,), _TWO_D, _options(2), 2000),
    "2d-mesh3": ((3,), _DIAG, _options(2), 300),
    "2d-mesh2x2": ((2, 2), _FEW, _options(2), 1200),
    "2d-mesh2x3": ((2, 3), _FEW, _options(2), 1800),
    "2d-mesh2x2x2": ((2, 2, 2), _FEW[1:2], _options(2, (2,)), 1728),
}


@pytest.mark.parametrize("name", list(_GRID))
def test_matches_dtensor_exhaustively(name):
    mesh, shapes, options, expected = _GRID[name]
    count = 0
    for shape in shapes:
        for placements in itertools.product(options, repeat=len(mesh)):
            count += _check_case(shape, mesh, placements)
    assert count == expected


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_matches_dtensor_random_layouts(data):
    ndim = data.draw(st.integers(0, 3), label="ndim")
    shape = tuple(data.draw(st.lists(st.integers(0, 13), min_size=ndim, max_size=ndim)))
    mesh = tuple(data.draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
    choices = [R, ps.Partial("max")]
    choices += [S(d) for d in range(ndim)] + [SS(d, k) for d in range(ndim) for k in range(1, 5)]
    placements = tuple(
        data.draw(st.lists(st.sampled_from(choices), min_size=len(mesh), max_size=len(mesh)))
    )
    assert _check_case(shape, mesh, placements) == len(_coords(mesh))


def test_negative_dims_are_normalised():
    count = 0
    for mesh in [(2,), (2, 3)]:
        for placements in itertools.product(_options(2, (2,)), repeat=len(mesh)):
            neg = tuple(
                type(p)(p.dim - 2, *([p.split_factor] if isinstance(p, SS) else []))
                if isinstance(p, (S, SS))
                else p
                for p in placements
            )
            for shape, c in itertools.product(_DIAG[::3], _coords(mesh)):
                want = ps.local_indices(shape, mesh, c, placements)
                assert ps.local_indices(shape, mesh, c, neg) == want
                count += 1
    assert count == 4 * (2 * 6 + 36 * 6)
    # torch's plain-value helper keys dims as written and gets mixed signs wrong; pshard does not
    got = ps.local_shape_and_offset((4, 4), (2, 2), (1, 1), (S(-1), S(1)))
    assert got == ((4, 1), (0, 3))


def test_strided_examples_from_the_docs():
    # FSDP2 + TP: rows 0-1, 4-5, 2-3, 6-7 on coordinates (0,0), (0,1), (1,0), (1,1)
    pl = (SS(0, 2), S(0))
    starts = [ps.local_shape_and_offset((8, 8), (2, 2), c, pl)[1][0] for c in _coords((2, 2))]
    assert starts == [0, 4, 2, 6]
    # uneven: arange(5) -> [0, 1], [3], [2], [4]
    x = torch.arange(5)
    got = [ps.shard_tensor(x, (2, 2), c, pl).tolist() for c in _coords((2, 2))]
    assert got == [[0, 1], [3], [2], [4]]
    assert ps.local_indices((5,), (2, 2), (0, 0), (SS(0, 2), R)) == ((range(0, 2), range(3, 4)),)
    assert ps.local_indices((3, 0), (4,), (3,), (S(0),)) == ((), ())
    assert ps.local_indices((), (2,), (1,), (R,)) == ()


def test_shard_tensor_views_and_copies():
    x = torch.arange(12).reshape(3, 4)
    view = ps.shard_tensor(x, (2,), (0,), (S(1),))
    assert view.data_ptr() == x.data_ptr() and view.shape == (3, 2)
    copy = ps.shard_tensor(x, (2,), (0,), (SS(1, 2),))
    assert copy.tolist() == [[0, 2], [4, 6], [8, 10]]
    assert copy.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
    whole = ps.shard_tensor(x, (2,), (1,), (R,))
    assert whole.data_ptr() == x.data_ptr() and torch.equal(whole, x)


@pytest.mark.parametrize("reduce", ["sum", "mean", "max", "min"])
def test_partial_round_trip(reduce):
    x = torch.randn(4, 3, dtype=torch.float64)
    mesh, pl = (2, 2), (ps.Partial(reduce), S(0))
    blocks = {c: ps.shard_tensor(x, mesh, c, pl) for c in _coords(mesh)}
    ref = _dtensor_blocks(x, mesh, pl)
    for c in blocks:
        assert torch.equal(blocks[c], ref[c])
    assert torch.equal(ps.unshard_tensor(blocks, x.shape, mesh, pl), x)
    # unshard reduces genuinely different partial values
    blocks[(1, 0)] = blocks[(1, 0)] + 1
    back = ps.unshard_tensor(blocks, x.shape, mesh, pl)
    change = {"sum": 1.0, "mean": 0.5, "max": 1.0, "min": 0.0}[reduce]
    torch.testing.assert_close(back[:2], x[:2] + change, rtol=0, atol=1e-15)
    assert torch.equal(back[2:], x[2:])


def test_partial_sum_of_integers_is_floating_like_dtensor():
    block = ps.shard_tensor(torch.arange(4), (2,), (0,), (Pa,))
    assert block.dtype == torch.get_default_dtype() and block.tolist() == [0, 0.5, 1, 1.5]


def test_unshard_reads_index_zero_on_replicate_dims():
    x = torch.arange(6.0)
    mesh, pl = (2, 3), (S(0), R)
    blocks = {c: ps.shard_tensor(x, mesh, c, pl) for c in _coords(mesh)}
    blocks[(0, 2)] = torch.full((3,), -1.0)
    assert torch.equal(ps.unshard_tensor(blocks, (6,), mesh, pl), x)


# ----------------------------------------------------------------------------- explicit_order


def test_explicit_order_examples():
    assert ps.explicit_order((2, 2, 2), (S(0), SS(0, 2), S(0))) == (
        (0, S(0)),
        (2, S(0)),
        (1, S(0)),
    )
    assert ps.explicit_order((2, 2, 2), (SS(0, 4), SS(0, 2), S(0))) == (
        (2, S(0)),
        (1, S(0)),
        (0, S(0)),
    )
    assert ps.explicit_order((2, 3), (SS(1, 3), S(1))) == ((1, S(1)), (0, S(1)))
    assert ps.explicit_order((2, 3), (Pa, R)) == ((0, Pa), (1, R))
    assert ps.explicit_order((3, 2, 2), (SS(0, 2), S(1), S(0))) == (
        (1, S(1)),
        (2, S(0)),
        (0, S(0)),
    )


def test_explicit_order_is_the_dtensor_layout_when_even():
    """Sharding by plain Shards in explicit order gives DTensor's layout for divisible sizes."""
    valid = 0
    for mesh in [(2,), (3,), (2, 2), (2, 3), (3, 2), (2, 2, 2), (2, 3, 2)]:
        for pl in itertools.product(_options(1, (1, 2, 3, 4, 6), partial=False), repeat=len(mesh)):
            try:
                order = ps.explicit_order(mesh, pl)
            except ValueError:
                continue
            valid += 1
            assert sorted(m for m, _ in order) == list(range(len(mesh)))
            size = 1
            for m, p in enumerate(pl):
                size *= mesh[m] if p.is_shard() else 1
            for length, c in itertools.product(range(0, 4 * size, size), _coords(mesh)):
                idx = list(range(length))
                for m, p in order:
                    if isinstance(p, S):
                        step = len(idx) // mesh[m]
                        idx = idx[c[m] * step : (c[m] + 1) * step]
                assert _flat(ps.local_indices((length,), mesh, c, pl)[0]) == idx
    assert valid == 45


def test_explicit_order_differs_from_dtensor_when_uneven():
    # explicit order (shard on mesh dim 1 first) would give coordinate (0, 1) [4, 5];
    # DTensor's left-to-right StridedShard rule gives [4], and pshard follows DTensor.
    assert ps.explicit_order((3, 2), (SS(0, 2), S(0))) == ((1, S(0)), (0, S(0)))
    assert ps.local_indices((7,), (3, 2), (0, 1), (SS(0, 2), S(0))) == ((range(4, 5),),)


def test_explicit_order_errors():
    with pytest.raises(
        ValueError,
        match=re.escape(
            "explicit_order: placements[2] = Shard(0) shards tensor dim 0 again after its "
            "strided part ended at placements[1]"
        ),
    ):
        ps.explicit_order((2, 2, 2), (SS(0, 2), S(0), S(0)))
    with pytest.raises(
        ValueError,
        match=re.escape(
            "explicit_order: placements[0] = StridedShard(0, split_factor=3) needs "
            "split_factor=2 (the number of pieces the later mesh dims cut tensor dim 0 into "
            "first), got 3"
        ),
    ):
        ps.explicit_order((2, 2), (SS(0, 3), S(0)))
    with pytest.raises(
        ValueError,
        match=re.escape(
            "explicit_order: placements[1] = StridedShard(1, split_factor=2) has no later "
            "Shard(1) to complete it"
        ),
    ):
        ps.explicit_order((2, 2), (S(0), SS(1, 2)))
    with pytest.raises(
        ValueError,
        match=re.escape("explicit_order: placements (Shard(0),) has 1 entries but mesh_shape"),
    ):
        ps.explicit_order((2, 2), (S(0),))


# ----------------------------------------------------------------------------- strides


def _dense(shape, perm):
    """A dense tensor of ``shape`` whose memory order of dims is ``perm`` (outermost first)."""
    inv = [perm.index(i) for i in range(len(shape))]
    return torch.empty([shape[i] for i in perm]).permute(*inv)


def test_strides_match_dtensor():
    count = 0
    for mesh in [(2,), (3,), (2, 2), (2, 3), (2, 2, 2)]:
        for ndim in (1, 2, 3)[: 5 - len(mesh)]:
            for pl in itertools.product(_options(ndim, (2,)), repeat=len(mesh)):
                tp = [ps.to_torch_placement(p) for p in pl]
                for shape in [(1,) * ndim, (2, 3, 1)[:ndim], (3, 1, 2)[:ndim], (2, 3, 2)[:ndim]]:
                    for perm in itertools.permutations(range(ndim)):
                        local = _dense(shape, perm)
                        want = tu.compute_global_tensor_info(local, _Mesh(mesh), tp)
                        got = ps.global_shape_and_stride(shape, local.stride(), mesh, pl)
                        assert got == (tuple(want[0]), tuple(want[1]))
                        glob = _dense(got[0], perm)
                        if 1 not in shape:  # size-1 dims leave the memory order ambiguous
                            assert got[1] == glob.stride()
                        stride = ps.local_stride(glob.stride(), mesh, pl)
                        assert stride == local.stride()
                        shape2, stride2 = tu.compute_local_tensor_info(glob, _Mesh(mesh), tp)
                        assert (tuple(shape2), tuple(stride2)) == (shape, stride)
                        torch_stride = tu.compute_local_stride(glob.stride(), shape)
                        # torch's newer helper may order size-1 dims differently; their
                        # strides are never used
                        for d in range(ndim):
                            assert shape[d] == 1 or torch_stride[d] == stride[d]
                        count += 1
    assert count == 6272


def test_global_shape_cannot_recover_uneven():
    # (2,) on 2 coordinates: 3 or 4 elements give the same first block; as DTensor, assume even
    assert ps.local_shape_and_offset((3,), (2,), (0,), (S(0),))[0] == (2,)
    assert ps.global_shape_and_stride((2,), (1,), (2,), (S(0),)) == ((4,), (1,))


# ----------------------------------------------------------------------------- errors


def _raises(exc, text):
    return pytest.raises(exc, match=re.escape(text))


def test_bad_placements():
    with _raises(
        ValueError,
        "local_shape_and_offset: placements (Shard(0),) has 1 entries but "
        "mesh_shape (2, 2) has 2 dims; give one placement per mesh dim",
    ):
        ps.local_shape_and_offset((4,), (2, 2), (0, 0), (S(0),))
    with _raises(
        ValueError,
        "local_indices: placements[1] = Shard(2) but the tensor has 2 dims "
        "(global_shape (4, 5)); use a dim in [-2, 1]",
    ):
        ps.local_indices((4, 5), (2, 2), (0, 0), (S(0), S(2)))
    with _raises(
        ValueError,
        "shard_tensor: placements[0] = StridedShard(-2, split_factor=2) "
        "but the tensor has 1 dims (tensor shape (4,)); use a dim in [-1, 0]",
    ):
        ps.shard_tensor(torch.ones(4), (2,), (0,), (SS(-2, 2),))
    with _raises(
        ValueError,
        "placements[0] = Shard(0) but the tensor has 0 dims (global_shape "
        "()); a 0-d tensor can only be Replicate() or Partial()",
    ):
        ps.local_shape_and_offset((), (2,), (0,), (S(0),))
    with _raises(
        TypeError,
        "local_shape_and_offset: placements is P('dp', None), a "
        "PartitionSpec (one entry per tensor dim); this function takes one "
        "placement per mesh dim, e.g. (Shard(0), Replicate())",
    ):
        ps.local_shape_and_offset((4, 4), (2,), (0,), ps.P("dp", None))
    with _raises(
        TypeError,
        "local_stride: placements must be a sequence with one placement per "
        "mesh dim, got the single placement Shard(0); wrap it: (Shard(0),)",
    ):
        ps.local_stride((1,), (2,), S(0))
    with _raises(
        TypeError,
        "unshard_tensor: placements[0] must be Shard, StridedShard, "
        "Replicate or Partial, got Shard(dim=0) (Shard); convert torch "
        "placements with ps.from_torch_placement",
    ):
        ps.unshard_tensor({}, (4,), (2,), (pt.Shard(0),))
    with _raises(
        ValueError,
        "shard_tensor: placements (Partial('sum'), Partial('max')) mix "
        "Partial reductions ['max', 'sum']",
    ):
        ps.shard_tensor(torch.ones(2), (2, 2), (0, 0), (Pa, ps.Partial("max")))


def test_bad_coordinates_and_shapes():
    with _raises(
        ValueError,
        "local_shape_and_offset: coordinate (0, 2) is outside mesh_shape "
        "(2, 2): coordinate[1] = 2 must be in [0, 2)",
    ):
        ps.local_shape_and_offset((4,), (2, 2), (0, 2), (S(0), R))
    with _raises(
        ValueError,
        "local_indices: coordinate (0,) has 1 entries but mesh_shape (2, 2) "
        "has 2 dims; give one index per mesh dim",
    ):
        ps.local_indices((4,), (2, 2), (0,), (S(0), R))
    with _raises(ValueError, "shard_tensor: coordinate (-1,) is outside mesh_shape (2,)"):
        ps.shard_tensor(torch.ones(4), (2,), (-1,), (S(0),))
    with _raises(ValueError, "local_shape_and_offset: mesh_shape[1] must be >= 1, got 0"):
        ps.local_shape_and_offset((4,), (2, 0), (0, 0), (S(0), R))
    with _raises(ValueError, "local_shape_and_offset: global_shape[0] must be >= 0, got -1"):
        ps.local_shape_and_offset((-1,), (2,), (0,), (S(0),))
    with _raises(TypeError, "local_indices: global_shape[0] must be an int, got 4.0 (float)"):
        ps.local_indices((4.0,), (2,), (0,), (S(0),))
    with _raises(TypeError, "local_indices: mesh_shape must be a sequence of ints, got 2"):
        ps.local_indices((4,), 2, (0,), (S(0),))
    with _raises(
        ValueError,
        "global_shape_and_stride: local_shape (2, 3) and local_stride (1,) have different lengths",
    ):
        ps.global_shape_and_stride((2, 3), (1,), (2,), (S(0),))
    with _raises(TypeError, "shard_tensor: tensor must be a torch.Tensor, got list"):
        ps.shard_tensor([1, 2], (2,), (0,), (S(0),))
    # torch.Size and lists are fine
    assert ps.local_shape_and_offset(torch.Size([4]), [2], [1], [S(0)]) == ((2,), (2,))


def test_unshard_errors():
    x = torch.arange(5.0)
    mesh, pl = (2,), (S(0),)
    blocks = {c: ps.shard_tensor(x, mesh, c, pl) for c in _coords(mesh)}
    with _raises(
        ValueError,
        "unshard_tensor: blocks misses coordinates [(1,)]; give one block "
        "for every coordinate of mesh_shape (2,) (2 in all)",
    ):
        ps.unshard_tensor({(0,): blocks[(0,)]}, (5,), mesh, pl)
    with _raises(ValueError, "unshard_tensor: blocks has extra keys [(2,)]"):
        ps.unshard_tensor({**blocks, (2,): x}, (5,), mesh, pl)
    with _raises(
        ValueError,
        "unshard_tensor: blocks[(1,)] has shape (3,) but placements "
        "(Shard(0),) on mesh_shape (2,) give that coordinate shape (2,) "
        "(global_shape (5,))",
    ):
        ps.unshard_tensor({**blocks, (1,): x[:3]}, (5,), mesh, pl)
    with _raises(TypeError, "unshard_tensor: blocks[(0,)] must be a torch.Tensor, got list"):
        ps.unshard_tensor({**blocks, (0,): [0, 1, 2]}, (5,), mesh, pl)
    with _raises(
        TypeError,
        "unshard_tensor: blocks must be a mapping from mesh coordinate to tensor, got list",
    ):
        ps.unshard_tensor(list(blocks.values()), (5,), mesh, pl)


def test_torch_rejects_what_pshard_rejects():
    # DTensor's helper fails with an IndexError, or silently answers for a coordinate outside
    # the mesh; pshard raises ValueError in both cases
    with pytest.raises(IndexError):
        tu._compute_local_shape_and_global_offset((4,), (2,), [0], [pt.Shard(1)])
    assert tu._compute_local_shape_and_global_offset((4,), (2,), [2], [pt.Shard(0)]) == (
        (2,),
        (4,),
    )
    with pytest.raises(ValueError):
        ps.local_shape_and_offset((4,), (2,), (0,), (S(1),))
    with pytest.raises(ValueError):
        ps.local_shape_and_offset((4,), (2,), (2,), (S(0),))
