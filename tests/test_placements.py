import pickle
import re

import pytest
from torch.distributed.tensor import placement_types as pt

import pshard as ps

ALL = [
    ps.Shard(0),
    ps.Shard(-1),
    ps.StridedShard(1, split_factor=3),
    ps.Replicate(),
    ps.Partial(),
    ps.Partial("mean"),
    ps.Partial("max"),
    ps.Partial("min"),
]


@pytest.mark.parametrize("p", ALL, ids=repr)
def test_value_semantics(p):
    same = pickle.loads(pickle.dumps(p))
    assert same == p and hash(same) == hash(p) and same is not p
    assert eval(repr(p), {**vars(ps)}) == p
    with pytest.raises(AttributeError):
        p.dim = 5  # frozen


def test_distinct_values():
    assert len(set(ALL)) == len(ALL)
    assert ps.Shard(0) != ps.StridedShard(0, split_factor=1)
    assert ps.Partial() == ps.Partial("sum")
    assert repr(ps.Shard(1)) == "Shard(1)"
    assert repr(ps.Partial("mean")) == "Partial('mean')"


@pytest.mark.parametrize("p", ALL, ids=repr)
def test_torch_round_trip(p):
    tp = ps.to_torch_placement(p)
    assert isinstance(tp, pt.Placement)
    assert ps.from_torch_placement(tp) == p


def test_torch_equivalents():
    assert ps.to_torch_placement(ps.Partial("mean")) == pt.Partial("avg")
    assert ps.to_torch_placement(ps.Shard(2)) == pt.Shard(2)
    strided = ps.to_torch_placement(ps.StridedShard(0, split_factor=2))
    assert isinstance(strided, pt._StridedShard) and strided.split_factor == 2


def test_bad_placements():
    with pytest.raises(ValueError, match=re.escape("Partial: reduce must be one of 'sum', 'mean'")):
        ps.Partial("avg")
    with pytest.raises(TypeError, match=re.escape("Shard: dim must be an int, got 1.0 (float)")):
        ps.Shard(1.0)
    with pytest.raises(TypeError, match="Shard: dim must be an int"):
        ps.Shard(True)
    with pytest.raises(ValueError, match=re.escape("split_factor must be >= 1, got 0")):
        ps.StridedShard(0, split_factor=0)
    with pytest.raises(TypeError, match=re.escape("to_torch_placement: expected Shard")):
        ps.to_torch_placement(ps.P("x"))
    with pytest.raises(ValueError, match=re.escape("Partial reduce_op 'product' has no pshard")):
        ps.from_torch_placement(pt.Partial("product"))
    with pytest.raises(TypeError, match="from_torch_placement: expected a torch"):
        ps.from_torch_placement("Shard(0)")


def test_partition_spec():
    spec = ps.P("dp", None, ("sp", "tp"), ("x",), ())
    assert tuple(spec) == ("dp", None, ("sp", "tp"), "x", None)
    assert spec.axes == ("dp", "sp", "tp", "x")
    assert repr(spec) == "P('dp', None, ('sp', 'tp'), 'x', None)"
    assert spec == ps.P("dp", None, ["sp", "tp"], "x", None) and hash(spec) == hash(
        ps.P("dp", None, ("sp", "tp"), "x", None)
    )
    assert pickle.loads(pickle.dumps(spec)) == spec
    assert ps.P() == ps.P() and len(ps.P()) == 0
    with pytest.raises(ValueError, match=re.escape("mesh axis 'dp' is used more than once")):
        ps.P("dp", ("sp", "dp"))
    with pytest.raises(TypeError, match=re.escape("P: entry 0 must be None, a mesh-axis name")):
        ps.P(0)
    with pytest.raises(AttributeError):
        spec._entries = ()
