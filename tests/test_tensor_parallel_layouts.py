"""Strided splits in specs, ``P(None, (3, "tp"))`` (each rank its share of q, of k and of v of a
fused projection: DTensor's ``_StridedShard(1, 3)``): the spelling, the blocks against DTensor's
own, and the layout through ``ps.shard``, ``gather``, ``shard_map`` in and out, DTensor
conversions and ``sharded_call`` (gradients included), on 2 ranks."""

from __future__ import annotations

import re

import pytest
import torch

import pshard as ps
from pshard._core.global_tensor import GlobalMeta, MeshKey, block_runs, spec_placements

P = ps.P


def test_the_spelling_of_parts() -> None:
    """An int before an axis name is its number of parts; 1 part is a plain split; an int
    that ends the entry or stands before another int is an error naming the entry."""
    assert P(None, (3, "tp")).axes == ("tp",)
    assert P((1, "tp")) == P("tp") and P(("dp", 1, "tp")) == P(("dp", "tp"))
    assert repr(P(None, (3, "tp"))) == "P(None, (3, 'tp'))"
    for bad in [(3,), ("tp", 3), (3, 2, "tp"), (0, "tp")]:
        with pytest.raises(ValueError, match=re.escape("a number of parts must be an int >= 1")):
            P(bad)
    with pytest.raises(TypeError, match="each optionally after an int number of parts"):
        P((2.0, "tp"))


@pytest.mark.parametrize(
    ("spec", "placements"),
    [
        (P(None, (3, "tp")), (ps.Replicate(), ps.StridedShard(1, 3))),
        (P("dp", (3, "tp")), (ps.Shard(0), ps.StridedShard(1, 3))),
        (P(("dp", 3, "tp")), (ps.Shard(0), ps.StridedShard(0, 3))),
    ],
)
def test_blocks_are_dtensors(spec: P, placements: tuple) -> None:
    """The spec's DTensor placements, and every coordinate's block is the one they give
    (``ps.local_indices``, checked against DTensor in test_layout), even and uneven."""
    key = MeshKey(("dp", "tp"), (2, 2), (0, 1, 2, 3), "cpu")
    assert spec_placements(spec, key) == placements
    for shape in [(12, 12), (6, 6), (5, 7)]:
        meta = GlobalMeta(spec, key, shape, None)
        for coord in [(0, 0), (0, 1), (1, 0), (1, 1)]:
            runs = block_runs(meta, dict(zip(key.names, coord, strict=True)))
            assert runs == ps.local_indices(shape, key.sizes, coord, placements)


def test_a_strided_split_out_of_mesh_order_is_refused() -> None:
    key = MeshKey(("dp", "tp"), (2, 2), (0, 1, 2, 3), "cpu")
    with pytest.raises(ValueError, match="list the axes of a strided dim in mesh order"):
        spec_placements(P((3, "tp", "dp")), key)


def _strided_worker() -> dict:
    ps.init_mesh({"tp": 2})
    spec = P(None, (3, "tp"))
    w = torch.arange(24.0, dtype=torch.float64).reshape(2, 12)
    g = ps.shard(w, spec)
    body = ps.shard_map(lambda x: 2 * x, in_specs=spec, out_specs=spec)
    kept = ps.shard_map(lambda x: x, in_specs=spec, out_specs=spec, gather_outputs=False)(w)
    lin = torch.nn.Linear(2, 12, bias=False, dtype=torch.float64)
    x = torch.randn(3, 2, dtype=torch.float64)
    wspec = {"weight": P((3, "tp"), None)}

    def loss(weight: torch.Tensor) -> torch.Tensor:
        def inside(blocks: dict, x: torch.Tensor) -> torch.Tensor:
            return ps.sharded_call(lin, blocks, (x,), specs=wspec)

        out = ps.shard_map(inside, in_specs=(wspec, None), out_specs=P())({"weight": weight}, x)
        return out.pow(2).sum()

    def plain(weight: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, weight).pow(2).sum()

    weight = torch.randn(12, 2, dtype=torch.float64)
    return {
        "local": g.local,
        "placements": g.placements,
        "gather": torch.equal(ps.gather(g), w),
        "map": torch.equal(body(w), 2 * w),
        "kept": torch.equal(kept.local, g.local) and kept.spec == spec,
        "dtensor": torch.equal(ps.to_dtensor(g).full_tensor(), w),
        "from_dtensor": ps.from_dtensor(ps.to_dtensor(g)).spec,
        "grad": (torch.func.grad(loss)(weight), torch.func.grad(plain)(weight)),
    }


def test_a_strided_layout_through_shard_gather_maps_and_sharded_call(pool) -> None:
    """Each rank holds its piece of each third; ps.shard, gather, shard_map (in, out and kept
    as a GlobalTensor), DTensor both ways and sharded_call (value and gradient) keep it."""
    for r, out in enumerate(pool.run(2, _strided_worker)):
        cols = [c for third in range(3) for c in range(4 * third + 2 * r, 4 * third + 2 * r + 2)]
        w = torch.arange(24.0, dtype=torch.float64).reshape(2, 12)
        assert torch.equal(out["local"], w[:, cols]), r
        assert out["placements"] == (ps.StridedShard(1, 3),)
        assert out["gather"] and out["map"] and out["kept"] and out["dtensor"], r
        assert out["from_dtensor"] == P(None, (3, "tp"))
        torch.testing.assert_close(*out["grad"], rtol=1e-12, atol=1e-12)
