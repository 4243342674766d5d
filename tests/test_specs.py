"""Spec trees: prefix broadcasting, its errors, and the per-leaf spec checks."""

from __future__ import annotations

import re
from collections import OrderedDict
from typing import Any

import optree
import pytest
import torch
from helpers import (
    BATCH,
    BATCHED_TREES,
    TREES,
    Batch,
    BatchEncodingLike,
    CausalLMOutputLike,
    Pair,
    make_block_mask,
    parametrize_product,
    tensor,
)

import pshard as ps
from pshard._core import specs as specs_module
from pshard._core.specs import (
    broadcast_prefix,
    broadcast_prefix_flat,
    check_specs,
    is_split,
    resolve_specs,
)
from pshard._core.tree import NAMESPACE, is_block_mask, tree_flatten, tree_leaves, tree_unflatten


def _markers(n: int) -> list[torch.Tensor]:
    # distinct objects with a batch dim, so look-alike classes that read shapes still build
    return [torch.full((BATCH,), i) for i in range(n)]


def _ids(xs: list[Any]) -> list[int]:
    return [id(x) for x in xs]


def _prefix_at_depth(tree: Any, depth: int, markers: list[Any]) -> Any:
    """``tree`` with every subtree at ``depth`` replaced by the next marker (optree walk)."""
    if depth == 0 or optree.tree_is_leaf(tree, namespace=NAMESPACE):
        return markers.pop(0)
    children, metadata, _, unflatten = optree.tree_flatten_one_level(tree, namespace=NAMESPACE)
    return unflatten(metadata, [_prefix_at_depth(c, depth - 1, markers) for c in children])


# --------------------------------------------------------------------------- broadcasting


@parametrize_product(tree=dict(TREES), spec=[ps.Shard(0), ps.Replicate(), None, ps.P("dp")])
def test_whole_tree_spec(tree: Any, spec: Any) -> None:
    expected = [spec] * len(tree_leaves(tree))
    assert broadcast_prefix(spec, tree) == expected


@parametrize_product(tree=dict(TREES))
def test_per_leaf_spec(tree: Any) -> None:
    leaves, treedef = tree_flatten(tree)
    markers = _markers(len(leaves))
    specs = tree_unflatten(treedef, markers)
    assert _ids(broadcast_prefix(specs, tree)) == _ids(markers)


@parametrize_product(tree=dict(TREES), depth=[1, 2, 3])
def test_mixed_prefix_against_optree(tree: Any, depth: int) -> None:
    tree_leaves(tree)  # registers the corpus' types in pshard's namespace
    prefix = _prefix_at_depth(tree, depth, _markers(200))
    expected = optree.broadcast_prefix(prefix, tree, namespace=NAMESPACE)
    assert _ids(broadcast_prefix(prefix, tree)) == _ids(expected)


def test_none_is_a_spec_leaf_and_an_empty_value() -> None:
    tree = {"a": tensor(2), "b": (tensor(1), None), "c": None}
    leaves, treedef = tree_flatten(tree)
    assert broadcast_prefix({"a": ps.Shard(1), "b": None, "c": ps.Shard(0)}, tree) == [
        ps.Shard(1),
        None,
    ]
    assert broadcast_prefix({"a": None, "b": (ps.Shard(0), None), "c": None}, tree) == [
        None,
        ps.Shard(0),
    ]
    assert resolve_specs({"a": None, "b": ps.Shard(0), "c": None}, leaves, treedef) == [
        ps.Replicate(),
        ps.Shard(0),
    ]


def test_sequence_specs_match_any_sequence() -> None:
    a, b = tensor(1), tensor(2)
    s0, s1 = ps.Shard(0), ps.Shard(1)
    assert broadcast_prefix([s0, s1], (a, b)) == [s0, s1]
    assert broadcast_prefix((s0, s1), [a, b]) == [s0, s1]
    assert broadcast_prefix((s0, s1), Pair(a, b)) == [s0, s1]
    assert broadcast_prefix(Pair(s1, s0), Pair(a, b)) == [s1, s0]


def test_dict_specs_match_keyed_values_by_key() -> None:
    ids, labels = tensor(8), tensor(8)
    s0, s1 = ps.Shard(0), ps.Shard(1)
    specs = {"labels": s0, "input_ids": s1}
    assert broadcast_prefix(specs, BatchEncodingLike({"labels": labels, "input_ids": ids})) == [
        s1,
        s0,
    ]
    batch = Batch(ids, labels, 3)
    assert broadcast_prefix({"labels": s0, "input_ids": s1, "num_tokens": None}, batch) == [
        s1,
        s0,
        None,
    ]
    assert broadcast_prefix({"second": s0, "first": s1}, Pair(ids, labels)) == [s1, s0]
    out = CausalLMOutputLike(loss=tensor(), logits=tensor(3))
    assert broadcast_prefix({"logits": s0, "loss": None}, out) == [None, s0]
    # order never matters: OrderedDicts pair up by key
    value = OrderedDict(b=ids, a=labels)
    assert broadcast_prefix(OrderedDict(a=s0, b=s1), value) == [s1, s0]
    # a dataclass of specs (what specs_of builds) for the same dataclass
    assert broadcast_prefix(Batch(s1, s0, None), batch) == [s1, s0, None]


def test_match_is_cached_per_structure() -> None:
    tree = {"x": tensor(2), "y": [tensor(1), tensor(3)]}
    specs = {"x": ps.Shard(0), "y": [None, ps.Shard(1)]}
    broadcast_prefix(specs, tree)
    hits = specs_module._match_cached.cache_info().hits
    other = {"x": tensor(5), "y": [tensor(1), tensor(7)]}
    assert broadcast_prefix({"x": ps.Shard(1), "y": [None, None]}, other) == [
        ps.Shard(1),
        None,
        None,
    ]
    assert specs_module._match_cached.cache_info().hits == hits + 1


def test_clear_caches_empties_spec_matching() -> None:
    tree = {"x": tensor(2), "y": [tensor(1), tensor(3)]}
    specs = {"x": ps.Shard(0), "y": [None, ps.Shard(1)]}
    expected = [ps.Shard(0), None, ps.Shard(1)]
    assert broadcast_prefix(specs, tree) == expected
    assert specs_module._match_cached.cache_info().currsize > 0
    ps.clear_caches()
    assert specs_module._match_cached.cache_info().currsize == 0
    assert broadcast_prefix(specs, tree) == expected


# --------------------------------------------------------------------------- prefix errors


def _raises(spec: Any, tree: Any, message: str, **kwargs: Any) -> None:
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        broadcast_prefix(spec, tree, **kwargs)


def test_error_dict_keys() -> None:
    args = (tensor(2), {"ids": tensor(8), "mask": tensor(8)})
    _raises(
        (None, {"ids": ps.Shard(1), "labels": ps.Shard(1)}),
        args,
        "in_specs[1]: the spec is a dict with keys ['ids', 'labels'] but the value is a dict "
        "with keys ['ids', 'mask'] (missing from the spec: ['mask']; not in the value: "
        "['labels'])",
    )


def test_error_list_index_and_function_name() -> None:
    args = ([tensor(1), tensor(2), [tensor(3), tensor(4)]],)
    _raises(
        ([None, None, [None]],),
        args,
        "split specs[0][2]: the spec is a list of length 1 but the value is a list of length 2",
        name="specs",
        fn_name="split",
    )


def test_error_dataclass_field() -> None:
    value = (Batch(tensor(8), {"x": tensor(8)}),)
    _raises(
        (Batch(None, {"y": None}),),
        value,
        "in_specs[0].labels: the spec is a dict with keys ['y'] but the value is a dict with "
        "keys ['x'] (missing from the spec: ['x']; not in the value: ['y'])",
    )


def test_error_namedtuple_field() -> None:
    _raises(
        Pair(None, (None,)),
        Pair(tensor(1), (tensor(2), tensor(3))),
        "in_specs.second: the spec is a tuple of length 1 but the value is a tuple of length 2",
    )


def test_error_spec_container_over_a_leaf() -> None:
    _raises(
        {"loss": {"a": None}},
        {"loss": tensor()},
        f"out_specs['loss']: the spec is a dict with keys ['a'] but the value is a tensor of "
        f"shape ({BATCH},); out_specs must be a prefix of the value's tree: put one spec over "
        "this whole value instead of a container",
        name="out_specs",
    )
    _raises(
        (None, [None]),
        (1, None),
        "in_specs[1]: the spec is a list of length 1 but the value is None; in_specs must be a "
        "prefix of the value's tree: put one spec over this whole value instead of a container",
    )


def test_error_types_differ() -> None:
    _raises(
        Pair(None, None),
        (tensor(1), tensor(2)),
        "in_specs: the spec is a Pair (namedtuple) with fields ['first', 'second'] but the value "
        "is a tuple of length 2",
    )
    _raises(
        [{"a": None}],
        [[tensor(1)]],
        "in_specs[0]: the spec is a dict with keys ['a'] but the value is a list of length 1",
    )
    _raises(
        {"x": Batch(None, None)},
        {"x": Pair(tensor(1), tensor(2))},
        "in_specs['x']: the spec is a Batch (dataclass) with fields ['input_ids', 'labels', "
        "'num_tokens'] but the value is a Pair (namedtuple) with fields ['first', 'second']",
    )
    _raises(
        [{"input_ids": None}],
        [BatchEncodingLike({"input_ids": tensor(8), "labels": tensor(8)})],
        "in_specs[0]: the spec is a dict with keys ['input_ids'] but the value is a "
        "BatchEncodingLike with keys ['input_ids', 'labels'] (missing from the spec: ['labels'])",
    )


def test_error_without_leaves_and_at_the_root() -> None:
    _, treedef = tree_flatten(tensor(1))
    with pytest.raises(ValueError, match=re.escape("in_specs: the spec is a tuple of length 1 ")):
        broadcast_prefix_flat((None,), treedef)


# --------------------------------------------------------------------------- per-leaf checks


def _resolve(specs: Any, tree: Any, **kwargs: Any) -> list[Any]:
    leaves, treedef = tree_flatten(tree)
    return resolve_specs(specs, leaves, treedef, **kwargs)


def _resolve_raises(error: type, specs: Any, tree: Any, message: str, **kwargs: Any) -> None:
    with pytest.raises(error, match=f"^{re.escape(message)}$"):
        _resolve(specs, tree, **kwargs)


def test_shard_dim_out_of_range() -> None:
    args = (tensor(8), {"labels": torch.zeros(4, 1000, dtype=torch.long)})
    _resolve_raises(
        ValueError,
        (ps.Shard(1), ps.Shard(2)),
        args,
        "shard_map_seq in_specs[1]['labels']: Shard(2) but the tensor has 2 dims "
        "(shape (4, 1000)); did you mean Shard(1)?",
        fn_name="shard_map_seq",
    )
    _resolve_raises(
        ValueError,
        ps.Shard(-3),
        {"x": tensor(3)},
        "in_specs['x']: Shard(-3) but the tensor has 2 dims (shape (4, 3)); "
        "did you mean Shard(-2)?",
    )
    _resolve_raises(
        ValueError,
        ps.StridedShard(1, split_factor=2),
        [tensor()],
        "in_specs[0]: StridedShard(1, split_factor=2) but the tensor has 1 dim (shape (4,)); "
        "did you mean StridedShard(0, split_factor=2)?",
    )
    _resolve_raises(
        ValueError,
        ps.Shard(0),
        {"loss": torch.tensor(1.0)},
        "in_specs['loss']: Shard(0) but the tensor has 0 dims (shape ()); a 0-dim tensor "
        "cannot be split: give it Replicate() or None",
    )


def test_valid_dims_pass() -> None:
    tree = {"a": tensor(3), "b": tensor(2, 5)}
    assert _resolve(ps.Shard(-1), tree) == [ps.Shard(-1)] * 2
    assert _resolve({"a": ps.Shard(1), "b": ps.Shard(2)}, tree) == [ps.Shard(1), ps.Shard(2)]
    assert _resolve(ps.P("dp", "sp"), tree) == [ps.P("dp", "sp")] * 2


def test_partition_spec_too_long() -> None:
    _resolve_raises(
        ValueError,
        ps.P("dp", None, "sp"),
        [tensor(8)],
        "in_specs[0]: P('dp', None, 'sp') has 3 entries but the tensor has 2 dims "
        "(shape (4, 8)); give at most one entry per tensor dim",
    )
    # checked even when it names no mesh axis; fine on non-tensors when it splits nothing
    _resolve_raises(
        ValueError,
        ps.P(None, None),
        [tensor()],
        "in_specs[0]: P(None, None) has 2 entries but the tensor has 1 dim (shape (4,)); "
        "give at most one entry per tensor dim",
    )
    assert _resolve(ps.P(None), [3, "x"]) == [ps.P(None)] * 2


def test_scalar_under_shard() -> None:
    _resolve_raises(
        ValueError,
        ps.Shard(0),
        {"ids": tensor(8), "n": 3},
        "split specs['n']: Shard(0) but the value is an int (3), not a tensor; only tensors "
        "can be split: give it Replicate() or None",
        name="specs",
        fn_name="split",
    )


def test_opaque_container_under_shard_is_an_error() -> None:
    class Holder:
        def __init__(self) -> None:
            self.t = tensor(2)

    _resolve_raises(
        ValueError,
        {"batch": ps.Shard(0), "model": None},
        {"batch": [tensor(2), Holder()], "model": Holder()},
        "pmap_microbatch in_specs['batch'][1]: Shard(0) but the value is a Holder, which "
        "pshard cannot look into (it may hold tensors); make Holder a dataclass or Mapping, "
        "register it with optree.register_pytree_node(Holder, flatten, unflatten, "
        'namespace="pshard"), or give it Replicate() or None',
        fn_name="pmap_microbatch",
    )
    _resolve_raises(
        ValueError,
        ps.P("dp"),
        [object()],
        "in_specs[0]: P('dp') but the value is an object, which pshard cannot look into (it "
        "may hold tensors); make object a dataclass or Mapping, register it with "
        'optree.register_pytree_node(object, flatten, unflatten, namespace="pshard"), or give '
        "it Replicate() or None",
    )


def test_non_tensors_pass_under_replicate() -> None:
    holder = object()
    tree = (1, 2.5, "s", True, holder, {"n": None})
    assert _resolve(None, tree) == [ps.Replicate()] * 5
    assert _resolve(ps.Replicate(), tree) == [ps.Replicate()] * 5
    assert _resolve(ps.Partial("mean"), tree) == [ps.Partial("mean")] * 5


def test_spec_leaf_types() -> None:
    _resolve_raises(
        TypeError,
        (0, None),
        (tensor(2), 3),
        "in_specs[0]: expected a placement (Shard, StridedShard, Replicate, Partial), a P(...) "
        "or None as the spec, got an int (0)",
    )
    _resolve_raises(
        TypeError,
        ps.P("dp"),
        [tensor(2)],
        "split specs[0]: expected a placement (Shard, StridedShard, Replicate, Partial) or "
        "None as the spec, got a P (P('dp'))",
        name="specs",
        fn_name="split",
        allowed=(ps.Placement,),
    )
    # None is always allowed, as Replicate()
    assert _resolve(None, [tensor(1)], allowed=(ps.P,)) == [ps.Replicate()]


def test_block_mask_specs() -> None:
    mask = make_block_mask()
    tree = {"mask": mask, "ids": tensor(8)}
    assert _resolve(ps.Shard(0), tree) == [ps.Shard(0)] * 2
    assert _resolve({"mask": ps.Shard(-4), "ids": None}, tree) == [ps.Replicate(), ps.Shard(-4)]
    assert _resolve(ps.P("dp"), tree) == [ps.P("dp")] * 2
    assert _resolve({"mask": None, "ids": ps.Shard(1)}, tree) == [ps.Shard(1), ps.Replicate()]
    shape = f"({BATCH}, 1, 256, 256)"
    for spec, fix in [
        (ps.Shard(1), "Shard(0)"),
        (ps.StridedShard(0, split_factor=2), "Shard(0)"),
        (ps.P(None, "sp"), "P(axis)"),
    ]:
        _resolve_raises(
            ValueError,
            {"mask": spec, "ids": None},
            tree,
            f"in_specs['mask']: {spec!r} but the value is a BlockMask of shape {shape}, which "
            f"can only be split along its batch dim 0; use {fix}",
        )


@parametrize_product(tree=dict(TREES))
def test_whole_tree_shard_on_corpus(tree: Any) -> None:
    leaves, treedef = tree_flatten(tree)
    splittable = all(
        (isinstance(x, torch.Tensor) and x.ndim > 0) or is_block_mask(x) for x in leaves
    )
    if splittable:
        assert resolve_specs(ps.Shard(0), leaves, treedef) == [ps.Shard(0)] * len(leaves)
    else:
        with pytest.raises(ValueError, match=re.escape("in_specs")):
            resolve_specs(ps.Shard(0), leaves, treedef)


def test_batched_trees_are_splittable() -> None:
    assert len(BATCHED_TREES) >= 10
    for _, tree in BATCHED_TREES:
        leaves, treedef = tree_flatten(tree)
        assert all(is_split(s) for s in resolve_specs(ps.Shard(0), leaves, treedef))


def test_check_specs_length() -> None:
    leaves, treedef = tree_flatten([tensor(1), tensor(2)])
    with pytest.raises(ValueError, match=re.escape("check_specs: 2 leaves but 1 specs")):
        check_specs(leaves, [None], treedef)


def test_is_split() -> None:
    assert is_split(ps.Shard(0)) and is_split(ps.StridedShard(0, 2)) and is_split(ps.P(None, "x"))
    assert not is_split(ps.Replicate()) and not is_split(ps.Partial())
    assert not is_split(ps.P()) and not is_split(ps.P(None))


def test_torch_placements_are_accepted_as_specs() -> None:
    """DTensor's placements work wherever pshard's do (converted), in every transform."""
    from torch.distributed.tensor import Partial as TPartial
    from torch.distributed.tensor import Replicate as TReplicate
    from torch.distributed.tensor import Shard as TShard

    ps.init_mesh({"sp": 1})
    x = torch.arange(8.0).view(4, 2)
    assert [c.shape for c in ps.split(x, TShard(0), 2)] == [(2, 2), (2, 2)]
    assert torch.equal(ps.merge(ps.split(x, TShard(1), 2), TShard(1)), x)
    assert torch.equal(ps.merge([x, 2 * x], TPartial("sum")), 3 * x)
    mb = ps.pmap_microbatch(lambda x: x * 2, num_microbatches=2, in_specs=(TShard(0),),
                            out_specs=TShard(0))  # fmt: skip
    assert torch.equal(mb(x), 2 * x)
    sm = ps.shard_map(lambda x: x + 1, in_specs=(TShard(0),), out_specs=TShard(0))
    assert torch.equal(sm(x), x + 1)
    seq = ps.shard_map_seq(lambda x: x, in_specs=(TShard(1),), out_specs={"a": TReplicate()})
    with pytest.raises(ValueError, match=re.escape("shard_map_seq out_specs: the spec is a dict")):
        seq(x)
    assert ps.infer_out_specs(lambda x: x, x, in_specs=TShard(0)) == ps.Shard(0)
