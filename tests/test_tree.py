"""pshard's pytree layer: flatten/unflatten, lazy registration, paths, BlockMask leaves."""

from __future__ import annotations

import dataclasses
import re
from collections import OrderedDict, UserDict
from collections.abc import Iterator, Mapping
from typing import Any

import optree
import pytest
import torch
from helpers import (
    BATCH,
    TREES,
    Batch,
    BatchEncodingLike,
    CausalLMOutputLike,
    Derived,
    FactoryDict,
    FrozenMapping,
    KwargsMapping,
    Pair,
    assert_trees_equal,
    make_block_mask,
    parametrize_product,
    tensor,
)

import pshard as ps
from pshard._core.tree import (
    NAMESPACE,
    describe,
    is_block_mask,
    is_opaque,
    keystr,
    leaf_path,
    tree_flatten,
    tree_flatten_with_path,
    tree_leaves,
    tree_map,
    tree_unflatten,
)


def _mappings_in(tree: Any) -> Iterator[Mapping]:
    """Every Mapping node of ``tree`` (for key-order checks), walked with optree."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, Mapping):
            yield node
        if not optree.tree_is_leaf(node, namespace=NAMESPACE):
            stack.extend(optree.tree_flatten_one_level(node, namespace=NAMESPACE)[0])


@parametrize_product(tree=dict(TREES), none_is_leaf=[False, True])
def test_roundtrip_keeps_types_and_leaves(tree: Any, none_is_leaf: bool) -> None:
    leaves, treedef = tree_flatten(tree, none_is_leaf=none_is_leaf)
    # pshard sees into every container of the corpus
    assert not any(isinstance(x, Mapping) or dataclasses.is_dataclass(x) for x in leaves)
    back = tree_unflatten(treedef, leaves)
    assert type(back) is type(tree)
    assert_trees_equal(back, tree)
    # key order of every Mapping is restored as it was
    original = [list(m.keys()) for m in _mappings_in(tree)]
    rebuilt = [list(m.keys()) for m in _mappings_in(back)]
    assert rebuilt == original
    # the leaves are the very objects of the tree (no copies)
    again, _ = tree_flatten(back, none_is_leaf=none_is_leaf)
    assert all(a is b for a, b in zip(again, leaves, strict=True))


@parametrize_product(tree=dict(TREES))
def test_paths_match_leaves(tree: Any) -> None:
    paths, leaves, treedef = tree_flatten_with_path(tree)
    assert all(a is b for a, b in zip(leaves, tree_leaves(tree), strict=True))
    assert len(paths) == len(leaves) == treedef.num_leaves
    for i, (path, leaf) in enumerate(zip(paths, leaves, strict=True)):
        assert path(tree) is leaf  # an accessor reads the leaf back from the tree
        assert leaf_path(treedef, i) == path


def test_none_is_leaf() -> None:
    tree = {"a": None, "b": (1, None)}
    assert tree_leaves(tree) == [1]
    assert tree_leaves(tree, none_is_leaf=True) == [None, 1, None]


def test_mapping_subclass_flattens_like_dict() -> None:
    # sorted keys, as for a dict; rebuilt in insertion order
    items = {"b": tensor(1), "a": tensor(2), "c": tensor(3)}
    for cls in (BatchEncodingLike, UserDict, FrozenMapping):
        value = cls(items)
        leaves, treedef = tree_flatten(value)
        assert [id(x) for x in leaves] == [id(items[k]) for k in "abc"]
        back = tree_unflatten(treedef, [1, 2, 3])
        assert type(back) is cls
        assert list(back.keys()) == ["b", "a", "c"]
        assert dict(back.items()) == {"a": 1, "b": 2, "c": 3}
    assert tree_unflatten(tree_flatten(BatchEncodingLike(items))[1], [1, 2, 3]).a == 1


def test_ordereddict_subclass_keeps_insertion_order() -> None:
    class Ordered(OrderedDict):
        pass

    value = Ordered(b=1, a=2)
    assert tree_leaves(value) == [1, 2]  # as optree does for OrderedDict
    assert tree_leaves(OrderedDict(b=1, a=2)) == [1, 2]


def test_model_output_like() -> None:
    loss, logits = tensor(), tensor(3)
    out = CausalLMOutputLike(loss=loss, logits=logits)
    paths, leaves, treedef = tree_flatten_with_path(out)
    assert [keystr(p, "out") for p in paths] == ["out['loss']", "out['logits']"]
    back = tree_unflatten(treedef, [loss * 2, logits * 2])
    assert type(back) is CausalLMOutputLike
    assert torch.equal(back.logits, logits * 2) and back.hidden_states is None
    assert list(back.keys()) == ["loss", "logits"]
    # a field that is None is not a key, so not a leaf
    assert tree_leaves(CausalLMOutputLike(logits=logits)) == [logits]


def test_kwargs_and_factory_mappings() -> None:
    back = tree_map(lambda x: x + 1, KwargsMapping(b=1, a=2))
    assert type(back) is KwargsMapping and dict(back) == {"b": 2, "a": 3}
    back = tree_map(lambda x: x + 1, FactoryDict(list, {"b": 1, "a": 2}))
    assert type(back) is FactoryDict and back.default_factory is list
    assert dict(back) == {"b": 2, "a": 3} and list(back) == ["b", "a"]


def test_mapping_that_cannot_be_rebuilt() -> None:
    class Strict(Mapping):
        def __init__(self, data: Mapping, secret: str) -> None:
            self._data = dict(data)

        def __getitem__(self, key: Any) -> Any:
            return self._data[key]

        def __iter__(self) -> Iterator:
            return iter(self._data)

        def __len__(self) -> int:
            return len(self._data)

    leaves, treedef = tree_flatten(Strict({"x": 1}, "s"))
    assert leaves == [1]
    with pytest.raises(TypeError, match=re.escape("pshard cannot rebuild a ")):
        tree_unflatten(treedef, [2])
    with pytest.raises(TypeError, match=re.escape('namespace="pshard") before pshard sees it')):
        tree_unflatten(treedef, [2])


def test_dataclass_by_init_fields() -> None:
    batch = Batch(tensor(2), tensor(3), 5)
    paths, leaves, treedef = tree_flatten_with_path(batch)
    assert [keystr(p) for p in paths] == [".input_ids", ".labels", ".num_tokens"]
    back = tree_unflatten(treedef, leaves)
    assert type(back) is Batch and back.num_tokens == 5


def test_dataclass_init_false_field_is_recomputed() -> None:
    value = Derived(tensor(2))
    assert tree_leaves(value) == [value.x]
    half = tree_map(lambda x: x[:2], value)
    assert type(half) is Derived and half.rows == 2 and value.rows == BATCH


def test_placements_are_leaves() -> None:
    specs = [ps.Shard(0), ps.Replicate(), ps.Partial("mean"), ps.StridedShard(1, 2), ps.P("x")]
    assert tree_leaves(specs) == specs
    for cls in (ps.Shard, ps.Replicate, ps.Partial, ps.StridedShard):
        assert optree.register_pytree_node.get(cls, namespace=NAMESPACE) is None


def test_registration_is_once_per_type_and_namespaced() -> None:
    @dataclasses.dataclass
    class Inner:
        v: Any

    class Box(UserDict):
        pass

    @dataclasses.dataclass
    class Outer:
        box: Any

    tree = Outer(Box({"k": Inner(1)}))
    assert tree_leaves(tree) == [1]  # three nested new types, all registered in one call
    entries = {
        c: optree.register_pytree_node.get(c, namespace=NAMESPACE) for c in (Inner, Box, Outer)
    }
    assert all(e is not None for e in entries.values())
    assert tree_leaves(Outer(Box({"k": Inner(2)}))) == [2]
    for cls, entry in entries.items():
        assert optree.register_pytree_node.get(cls, namespace=NAMESPACE) is entry
    # only in pshard's namespace: plain optree still sees a leaf
    assert optree.tree_leaves(tree) == [tree]


def test_user_registration_wins() -> None:
    @dataclasses.dataclass
    class Custom:
        a: int
        b: int

    optree.register_pytree_node(
        Custom,
        lambda c: ((c.a,), c.b, ("a",)),
        lambda b, children: Custom(children[0], b),
        namespace=NAMESPACE,
    )
    assert tree_leaves(Custom(1, 2)) == [1]


def test_is_leaf_stops_at_unregistered_dataclass() -> None:
    @dataclasses.dataclass
    class Stop:
        v: int

    leaves, _ = tree_flatten([Stop(1), 2], is_leaf=lambda x: isinstance(x, Stop))
    assert leaves == [Stop(1), 2]


def test_tree_map_several_trees() -> None:
    out = tree_map(lambda x, y: x * y, {"a": 2, "b": (3, None)}, {"a": 5, "b": (7, None)})
    assert out == {"a": 10, "b": (21, None)}
    out = tree_map(lambda x: x is None, {"a": None, "b": 1}, none_is_leaf=True)
    assert out == {"a": True, "b": False}


def test_keystr() -> None:
    tree = [{"k": Pair(1, Batch(2, 3))}]
    paths, _, _ = tree_flatten_with_path(tree)
    assert [keystr(p, "in_specs") for p in paths] == [
        "in_specs[0]['k'].first",
        "in_specs[0]['k'].second.input_ids",
        "in_specs[0]['k'].second.labels",
        "in_specs[0]['k'].second.num_tokens",
    ]
    assert keystr((), "in_specs") == "in_specs"
    assert keystr((1, "labels"), "in_specs") == "in_specs[1]['labels']"
    assert keystr(tuple(paths[0]), "x") == "x[0]['k'].first"


def test_describe() -> None:
    assert describe(torch.zeros(4, 1000)) == "a tensor of shape (4, 1000)"
    assert describe(torch.tensor(1.0)) == "a tensor of shape ()"
    assert describe(5) == "an int (5)"
    assert describe("abc") == "a str ('abc')"
    assert describe(None) == "None"
    assert describe(ps.Shard(0)) == "a Shard (Shard(0))"
    assert describe({"b": 1, "a": 2}) == "a dict with keys ['b', 'a']"
    assert describe([1, 2]) == "a list of length 2"
    assert describe(object()) == "an object"
    assert describe(UserDict(a=1)) == "a UserDict with keys ['a']"
    assert describe(OrderedDict()) == "an OrderedDict with keys []"
    assert describe(make_block_mask()) == f"a BlockMask of shape ({BATCH}, 1, 256, 256)"


def test_is_opaque() -> None:
    for value in (tensor(1), 1, 2.5, "s", None, True, ps.Shard(0), ps.P(), make_block_mask()):
        assert not is_opaque(value)
    for value in (object(), torch.nn.Linear(2, 2), [1]):
        assert is_opaque(value)


def test_block_mask_is_a_leaf() -> None:
    mask = make_block_mask()
    assert is_block_mask(mask) and not is_block_mask(tensor(1))
    paths, leaves, _ = tree_flatten_with_path({"mask": mask, "ids": tensor(3)})
    assert leaves[1] is mask and keystr(paths[1], "kw") == "kw['mask']"
    assert tree_map(lambda x: x, {"m": mask})["m"] is mask


def test_block_mask_from_create_block_mask_on_cpu() -> None:
    from torch.nn.attention.flex_attention import create_block_mask

    lengths = torch.tensor([128, 64])

    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (kv_idx < lengths[b])

    mask = create_block_mask(mask_mod, B=2, H=None, Q_LEN=128, KV_LEN=128, device="cpu")
    leaves, treedef = tree_flatten((mask, {"ids": torch.zeros(2, 128)}))
    assert leaves[0] is mask and treedef.num_leaves == 2
    assert mask.kv_num_blocks.shape[0] == 2
