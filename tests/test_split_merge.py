"""split / merge: parity with torch pipelining's microbatch split, BlockMask splitting checked
with flex attention, merge reducers, pinned errors."""

from __future__ import annotations

import dataclasses
import math
import re
from collections import OrderedDict

import pytest
import torch
from helpers import (
    BATCH,
    BATCHED_TREES,
    Batch,
    BatchEncodingLike,
    Pair,
    assert_trees_equal,
    make_block_mask,
    parametrize_product,
)
from torch.distributed.pipelining.microbatch import (
    TensorChunkSpec,
    _Replicate,
    split_args_kwargs_into_chunks,
)
from torch.nn.attention.flex_attention import BlockMask, flex_attention

import pshard as ps
from pshard._core.tree import is_block_mask, tree_flatten

FLEX_EAGER = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def seq(*shape: int, dtype: torch.dtype = torch.float32, start: int = 0) -> torch.Tensor:
    n = math.prod(shape)
    return torch.arange(start, start + n).reshape(shape).to(dtype)


def assert_same_storage(piece: torch.Tensor, whole: torch.Tensor) -> None:
    assert piece.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr()


def dense_mask(mask: BlockMask) -> torch.Tensor:
    """The element-level mask a BlockMask describes: its blocks and its mask_mod, per batch."""
    b, _, q_len, kv_len = mask.shape
    blocks = mask.to_dense()  # (B, H, q blocks, kv blocks)
    q_block, kv_block = mask.BLOCK_SIZE
    in_block = blocks.repeat_interleave(q_block, 2).repeat_interleave(kv_block, 3)
    bi = torch.arange(b)[:, None, None, None]
    qi = torch.arange(q_len)[None, None, :, None]
    ki = torch.arange(kv_len)[None, None, None, :]
    return in_block[..., :q_len, :kv_len].bool() & mask.mask_mod(bi, torch.zeros(1), qi, ki)


def assert_block_masks_equal(a: BlockMask, b: BlockMask) -> None:
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None:
            assert torch.equal(x, y), name
    assert a.BLOCK_SIZE == b.BLOCK_SIZE and a.seq_lengths == b.seq_lengths
    assert torch.equal(dense_mask(a), dense_mask(b))


def assert_like_torch(ours: object, theirs: object) -> None:
    """Leaves equal; BlockMasks compared by blocks and by their mask_mod's values."""
    leaves_a, treedef_a = tree_flatten(ours)
    leaves_b, treedef_b = tree_flatten(theirs)
    assert treedef_a == treedef_b
    for x, y in zip(leaves_a, leaves_b, strict=True):
        if is_block_mask(x):
            assert_block_masks_equal(x, y)
        else:
            assert type(x) is type(y)
            if isinstance(x, torch.Tensor):
                assert x.shape == y.shape and torch.equal(x, y)
            else:
                assert x == y


# --------------------------------------------------------------------------- parity with torch

TORCH_TREES = {
    "tensor": seq(7, 3),
    "dict": {"b": seq(7, 2), "a": seq(7, dtype=torch.int64)},
    "nested": {"x": [seq(7, 3), (seq(7, 2, start=5), {"y": seq(7)})]},
    "namedtuple": Pair(seq(7, 2), seq(7, 1)),
    "ordereddict": OrderedDict(z=seq(7, 2), a=seq(7, 3)),
}


@parametrize_product(tree=TORCH_TREES, k=[1, 2, 3, 4, 7])
def test_split_matches_torch_uneven(tree, k):
    ours = ps.split(tree, ps.Shard(0), k)
    theirs, _ = split_args_kwargs_into_chunks((tree,), {}, k)
    assert len(ours) == len(theirs) == k
    for chunk, (expected,) in zip(ours, theirs, strict=True):
        assert_like_torch(chunk, expected)
    sizes = [len(tree_flatten(c)[0][0]) for c in ours]
    assert sizes == [t.shape[0] for t in torch.tensor_split(torch.empty(7), k)]


@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_split_matches_torch_dims_replicate_and_kwargs(k):
    x, y, lr = seq(5, 3), seq(2, 5, 4), seq(6)
    mask, ids = seq(3, 5, dtype=torch.bool), seq(5, 8, dtype=torch.int64)
    args, kwargs = (x, y, lr), {"mask": mask, "ids": ids}
    theirs = split_args_kwargs_into_chunks(
        args,
        kwargs,
        k,
        (TensorChunkSpec(0), TensorChunkSpec(1), _Replicate),
        {"mask": TensorChunkSpec(1), "ids": TensorChunkSpec(0)},
    )
    specs = ((ps.Shard(0), ps.Shard(1), None), {"mask": ps.Shard(-1), "ids": ps.Shard(0)})
    ours = ps.split((args, kwargs), specs, k)
    for chunk, expected in zip(ours, zip(*theirs, strict=True), strict=True):
        assert_like_torch(chunk, expected)
        assert chunk[0][2] is lr  # replicated leaves are passed whole


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_split_block_mask_matches_torch(k):
    tree = {"mask": make_block_mask(), "ids": seq(BATCH, 8)}
    ours = ps.split(tree, ps.Shard(0), k)
    theirs, _ = split_args_kwargs_into_chunks((tree,), {}, k)
    for chunk, (expected,) in zip(ours, theirs, strict=True):
        assert_like_torch(chunk, expected)


def test_split_pieces_are_views():
    x = seq(7, 3)
    for c, piece in enumerate(ps.split({"x": x}, ps.Shard(1), 2)):
        assert piece["x"]._base is x
        assert_same_storage(piece["x"], x)
        assert torch.equal(piece["x"], x[:, [0, 1] if c == 0 else [2]])


@parametrize_product(tree=dict(BATCHED_TREES), k=[1, 2, 3, 4])
def test_merge_split_roundtrip(tree, k):
    chunks = ps.split(tree, ps.Shard(0), k)
    assert len(chunks) == k
    for chunk in chunks:  # node types (Mapping subclasses, dataclasses) are rebuilt per chunk
        assert tree_flatten(chunk)[1] == tree_flatten(tree)[1]
    if any(is_block_mask(x) for x in tree_flatten(tree)[0]):
        return  # BlockMasks are split, not merged
    assert_trees_equal(ps.merge(chunks, ps.Shard(0)), tree)


def test_split_dataclass_and_mapping_batches():
    batch = Batch(seq(5, 4, dtype=torch.int64), seq(3, 5, dtype=torch.int64), 7)
    chunks = ps.split(batch, Batch(ps.Shard(0), ps.Shard(1), None), 2)
    assert [type(c) for c in chunks] == [Batch, Batch]
    assert chunks[1].input_ids.shape == (2, 4) and chunks[1].labels.shape == (3, 2)
    assert chunks[1].num_tokens == 7
    enc = BatchEncodingLike({"input_ids": seq(5, 4), "attention_mask": seq(5, 4)})
    chunks = ps.split(enc, {"input_ids": ps.Shard(0), "attention_mask": None}, 3)
    assert [type(c) for c in chunks] == [BatchEncodingLike] * 3
    assert [c["input_ids"].shape[0] for c in chunks] == [2, 2, 1]
    assert all(c["attention_mask"] is enc["attention_mask"] for c in chunks)


def test_split_without_shard_leaves_repeats_the_tree():
    tree = {"a": seq(3), "n": 2}
    chunks = ps.split(tree, None, 3)
    assert len(chunks) == 3 and all(c["a"] is tree["a"] and c["n"] == 2 for c in chunks)
    assert ps.split({}, ps.Shard(0), 2) == [{}, {}]


# --------------------------------------------------------------------------- BlockMask


@FLEX_EAGER
def test_split_block_mask_flex_attention():
    torch.manual_seed(0)
    q, key, v = (torch.randn(BATCH, 1, 128, 8) for _ in range(3))
    mask = make_block_mask(seq=128, block=64)
    full = flex_attention(q, key, v, block_mask=mask)
    chunks = ps.split({"q": q, "k": key, "v": v, "mask": mask}, ps.Shard(0), 3)
    outs = [flex_attention(c["q"], c["k"], c["v"], block_mask=c["mask"]) for c in chunks]
    torch.testing.assert_close(torch.cat(outs), full)
    # mask_mod reads the batch index: without re-indexing, chunk 1 would use rows 0-1's lengths
    assert not torch.equal(dense_mask(mask)[2:3], dense_mask(mask)[0:1])
    assert torch.equal(dense_mask(chunks[1]["mask"]), dense_mask(mask)[2:3])


@FLEX_EAGER
def test_split_batch1_block_mask_is_shared_and_reindexed():
    torch.manual_seed(0)
    lengths = torch.tensor([128, 100, 50, 32])
    one = make_block_mask(batch=1, seq=128, block=64)

    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (kv_idx < lengths[b])

    mask = BlockMask.from_kv_blocks(
        one.kv_num_blocks, one.kv_indices, BLOCK_SIZE=64, mask_mod=mask_mod, seq_lengths=(128, 128)
    )
    q, key, v = (torch.randn(BATCH, 1, 128, 8) for _ in range(3))
    full = flex_attention(q, key, v, block_mask=mask)
    chunks = ps.split({"q": q, "k": key, "v": v, "mask": mask}, ps.Shard(0), 2)
    assert chunks[0]["mask"] is mask
    assert chunks[1]["mask"].kv_num_blocks is mask.kv_num_blocks  # blocks shared
    outs = [flex_attention(c["q"], c["k"], c["v"], block_mask=c["mask"]) for c in chunks]
    torch.testing.assert_close(torch.cat(outs), full)


def test_split_block_mask_twice_composes_offsets():
    mask = make_block_mask()
    [_, second] = ps.split(mask, ps.Shard(0), 2)  # rows 2, 3
    [_, last] = ps.split(second, ps.Shard(0), 2)  # row 3
    assert torch.equal(dense_mask(last), dense_mask(mask)[3:])


# --------------------------------------------------------------------------- split errors


def test_split_error_sizes_disagree():
    batch = {"input_ids": seq(4, 8), "labels": seq(6, 8)}
    with pytest.raises(
        ValueError,
        match=re.escape(
            "split specs['labels']: Shard(0) splits a dim of size 6 (dim 0 of a tensor of shape "
            "(6, 8)) but specs['input_ids'] splits one of size 4 (dim 0 of a tensor of shape "
            "(4, 8)); every Shard leaf must have the same size along its split dim: give leaves "
            "that are not batched Replicate() or None"
        ),
    ):
        ps.split(batch, ps.Shard(0), 2)


def test_split_error_sizes_disagree_mixed_specs():
    with pytest.raises(
        ValueError, match=re.escape("split specs[1]: Shard(1) splits a dim of size 5")
    ):
        ps.split((seq(4, 8), seq(4, 5)), (ps.Shard(0), ps.Shard(1)), 2)


def test_split_error_too_many_chunks():
    with pytest.raises(
        ValueError,
        match=re.escape(
            "split specs['x']: num_chunks=5 but Shard(0) splits a dim of size 4 (dim 0 of a "
            "tensor of shape (4, 8)); there cannot be more chunks than entries along the split "
            "dim: use num_chunks <= 4"
        ),
    ):
        ps.split({"x": seq(4, 8), "y": seq(4)}, ps.Shard(0), 5)


def test_split_error_dim_out_of_range():
    with pytest.raises(
        ValueError,
        match=re.escape(
            "split specs['labels']: Shard(2) but the tensor has 2 dims (shape (4, 1000)); did "
            "you mean Shard(1)?"
        ),
    ):
        ps.split(
            {"ids": seq(4, 3), "labels": seq(4, 1000)}, {"ids": None, "labels": ps.Shard(2)}, 2
        )
    with pytest.raises(
        ValueError, match=re.escape("split specs[0]: Shard(0) but the tensor has 0")
    ):
        ps.split((torch.tensor(1.0),), ps.Shard(0), 1)


def test_split_error_values_that_cannot_be_split():
    class Opaque:
        pass

    with pytest.raises(ValueError, match=re.escape("split specs['o']: Shard(0) but the value is")):
        ps.split({"o": Opaque(), "x": seq(4)}, ps.Shard(0), 2)
    with pytest.raises(
        ValueError, match=re.escape("split specs['n']: Shard(0) but the value is an int")
    ):
        ps.split({"n": 3, "x": seq(4)}, ps.Shard(0), 2)
    with pytest.raises(
        ValueError, match=re.escape("split specs['m']: Shard(1) but the value is a BlockMask")
    ):
        ps.split({"m": make_block_mask()}, ps.Shard(1), 2)


def test_split_error_specs():
    with pytest.raises(
        ValueError, match=re.escape("split specs: the spec is a dict with keys ['a']")
    ):
        ps.split({"a": seq(4), "b": seq(4)}, {"a": ps.Shard(0)}, 2)
    with pytest.raises(
        TypeError, match=re.escape("split specs[0]: expected a Shard, a Replicate or None")
    ):
        ps.split((seq(4),), (ps.Partial(),), 2)
    with pytest.raises(ValueError, match=re.escape("split: num_chunks must be >= 1, got 0")):
        ps.split(seq(4), ps.Shard(0), 0)
    with pytest.raises(TypeError, match=re.escape("split: num_chunks must be an int, got 2.0")):
        ps.split(seq(4), ps.Shard(0), 2.0)


# --------------------------------------------------------------------------- merge


def test_merge_shard_is_one_new_tensor():
    x = seq(7, 3)
    chunks = ps.split(x, ps.Shard(0), 3)
    merged = ps.merge(chunks, ps.Shard(0))
    assert torch.equal(merged, x) and merged._base is None
    assert merged.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
    cols = ps.merge(ps.split(x, ps.Shard(-1), 2), ps.Shard(-1))
    assert torch.equal(cols, x)


def test_merge_reducers_tensors_and_numbers():
    chunks = [
        {"s": torch.tensor([1.0, 2.0]), "mx": torch.tensor([1.0, 5.0]), "n": 1, "r": "a"},
        {"s": torch.tensor([3.0, 4.0]), "mx": torch.tensor([2.0, 0.0]), "n": 2, "r": "a"},
        {"s": torch.tensor([5.0, 6.0]), "mx": torch.tensor([0.0, 9.0]), "n": 4, "r": "a"},
    ]
    specs = {"s": ps.Partial("sum"), "mx": ps.Partial("max"), "n": ps.Partial("min"), "r": None}
    out = ps.merge(chunks, specs)
    assert torch.equal(out["s"], torch.tensor([9.0, 12.0]))
    assert torch.equal(out["mx"], torch.tensor([2.0, 9.0]))
    assert out["n"] == 1 and out["r"] == "a"
    out = ps.merge(
        chunks, {"s": ps.Partial("min"), "mx": ps.Partial("min"), "n": ps.Partial(), "r": None}
    )
    assert torch.equal(out["s"], torch.tensor([1.0, 2.0])) and out["n"] == 7
    assert torch.equal(out["mx"], torch.tensor([0.0, 0.0]))


def test_merge_mean_weights():
    x = seq(7, 2, dtype=torch.float64)
    chunks = [{"x": c, "m": c.mean(0), "n": float(c.shape[0])} for c in torch.tensor_split(x, 3)]
    specs = {"x": ps.Shard(0), "m": ps.Partial("mean"), "n": ps.Partial("mean")}
    out = ps.merge(chunks, specs)  # default weights: the chunk sizes along the Shard leaf's dim
    torch.testing.assert_close(out["m"], x.mean(0))
    assert out["n"] == pytest.approx((3 * 3 + 2 * 2 + 2 * 2) / 7)
    # without a Shard leaf: equal weights
    equal = ps.merge([{"m": c["m"]} for c in chunks], ps.Partial("mean"))
    torch.testing.assert_close(equal["m"], torch.stack([c["m"] for c in chunks]).mean(0))
    # explicit weights, tensors among them
    weighted = ps.merge(
        [c["m"] for c in chunks], ps.Partial("mean"), weights=[1, torch.tensor(0), 3]
    )
    torch.testing.assert_close(weighted, (chunks[0]["m"] + 3 * chunks[2]["m"]) / 4)


def test_merge_mean_zero_weight_contributes_nothing():
    nan = torch.full((2,), float("nan"))
    out = ps.merge([torch.ones(2), nan, 3 * torch.ones(2)], ps.Partial("mean"), weights=[1, 0, 1])
    assert torch.equal(out, torch.full((2,), 2.0))
    assert torch.equal(ps.merge([nan, nan], ps.Partial("mean"), weights=[0, 0]), torch.zeros(2))
    assert ps.merge([float("nan"), 4.0], ps.Partial("mean"), weights=[0.0, 2.0]) == 4.0


def test_merge_single_chunk_is_exact():
    x = torch.tensor([0.1, 0.7], dtype=torch.float32)
    assert ps.merge([x], ps.Partial("mean"), weights=[3]) is x
    assert ps.merge([{"a": x}], ps.Shard(0))["a"] is x


def test_merge_gradients():
    x = torch.randn(6, 3, dtype=torch.float64, requires_grad=True)
    chunks = [{"y": 2 * c, "m": (c**2).mean()} for c in torch.tensor_split(x, 4)]
    out = ps.merge(chunks, {"y": ps.Shard(0), "m": ps.Partial("mean")}, weights=[2, 2, 1, 1])
    (out["y"].sum() + out["m"]).backward()
    expected = torch.full_like(x, 2.0) + 2 * x / 18  # d/dx of sum(x**2) / 18
    torch.testing.assert_close(x.grad, expected)


def test_merge_replicate_checked_in_debug_mode(monkeypatch):
    chunks = [{"r": torch.ones(2)}, {"r": torch.zeros(2)}]
    assert torch.equal(ps.merge(chunks, None)["r"], torch.ones(2))  # not checked by default
    monkeypatch.setenv("PSHARD_DEBUG", "1")
    with pytest.raises(
        ValueError,
        match=re.escape(
            "merge specs['r']: Replicate() but chunks[1] (a tensor of shape (2,)) differs from "
            "chunks[0] (a tensor of shape (2,)); give this leaf a Partial or Shard spec if it "
            "varies"
        ),
    ):
        ps.merge(chunks, None)
    assert ps.merge([{"r": 1}, {"r": 1}], None) == {"r": 1}


def test_merge_errors():
    with pytest.raises(ValueError, match=re.escape("merge: chunks is empty")):
        ps.merge([], ps.Shard(0))
    with pytest.raises(
        ValueError,
        match=re.escape(
            "merge specs['b']: chunks[1] has a dict with keys ['c'] (1 leaves) but chunks[0] has "
            "a tensor of shape (2,); every one must have the same tree structure"
        ),
    ):
        ps.merge([{"a": seq(2), "b": seq(2)}, {"a": seq(2), "b": {"c": seq(2)}}], ps.Shard(0))
    with pytest.raises(ValueError, match=re.escape("merge specs: chunks[1] has a dict with keys")):
        ps.merge([{"a": seq(2)}, {"x": seq(2)}], ps.Shard(0))
    with pytest.raises(
        ValueError,
        match=re.escape(
            "merge specs['y']: Shard(0) but chunks[0] has a tensor of shape (2, 5) and chunks[2] "
            "a tensor of shape (1, 6): they differ in dim 1; every dim but the split dim 0 must "
            "agree"
        ),
    ):
        ps.merge([{"y": seq(2, 5)}, {"y": seq(2, 5)}, {"y": seq(1, 6)}], ps.Shard(0))
    with pytest.raises(
        ValueError, match=re.escape("merge specs[0]: Shard(2) but the tensor has 2")
    ):
        ps.merge([(seq(2, 5),), (seq(2, 5),)], ps.Shard(2))
    with pytest.raises(
        ValueError, match=re.escape("merge specs['m']: Shard(0) cannot concatenate BlockMasks")
    ):
        ps.merge([{"m": make_block_mask()}, {"m": make_block_mask()}], ps.Shard(0))
    with pytest.raises(ValueError, match=re.escape("merge: weights has 1 entries for 2 chunks")):
        ps.merge([1.0, 2.0], ps.Partial("mean"), weights=[1])
    with pytest.raises(
        ValueError, match=re.escape("merge: weights[1] must be finite and >= 0, got -1.0")
    ):
        ps.merge([1.0, 2.0], ps.Partial("mean"), weights=[1, -1])
    with pytest.raises(
        ValueError,
        match=re.escape("merge specs[0]: Partial('mean') of a torch.int64 tensor: a mean needs a"),
    ):
        ps.merge([(seq(2, dtype=torch.int64),)] * 2, ps.Partial("mean"))
    with pytest.raises(
        ValueError,
        match=re.escape("merge specs['t']: Partial('sum') reduces tensors and numbers, got a str"),
    ):
        ps.merge([{"t": "a"}, {"t": "b"}], ps.Partial())
    with pytest.raises(
        ValueError, match=re.escape("merge specs['r']: chunks[1] has a list of length 1")
    ):
        ps.merge([{"r": 1}, {"r": [1]}], None)


@dataclasses.dataclass
class Out:
    loss: torch.Tensor
    logits: torch.Tensor


def test_merge_dataclass_outputs():
    chunks = [Out(torch.tensor(1.0), seq(2, 3)), Out(torch.tensor(3.0), seq(1, 3))]
    out = ps.merge(chunks, Out(ps.Partial("mean"), ps.Shard(0)))
    assert isinstance(out, Out) and out.logits.shape == (3, 3)
    torch.testing.assert_close(out.loss, torch.tensor(5.0 / 3))
