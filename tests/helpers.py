"""Shared test helpers: a corpus of pytrees, look-alike container classes and a product
parametrize for pytest.

Import from a test module as ``from helpers import ...`` (pytest puts ``tests/`` on the path).

- ``TREES``: ``list[(id, tree)]``, nested dict/list/tuple/namedtuple/dataclass/None/empty
  containers, Mapping subclasses (``BatchEncodingLike``, ``CausalLMOutputLike``, ``UserDict``,
  custom Mappings), ``OrderedDict``, ``defaultdict``, ``deque``, a flex-attention ``BlockMask``,
  tensors of several shapes and dtypes and Python scalars. Every tensor with a dim has
  ``BATCH`` rows along dim 0 (the ``BlockMask`` too), so ``Shard(0)`` splits it.
- ``BATCHED_TREES``: the trees of ``TREES`` whose every leaf is a tensor with ``BATCH`` rows or a
  ``BlockMask`` (a whole-tree ``Shard(0)`` is valid for them).
- ``parametrize_product(**axes)``: ``pytest.mark.parametrize`` over the product of the axes;
  each axis is a list of values or a ``{id: value}`` dict (``dict(TREES)``).
- ``assert_trees_equal(a, b)``: same structure (node types included), leaves of the same type,
  tensors equal in dtype, shape and values.
- ``make_block_mask(...)``: a small CPU ``BlockMask`` whose ``mask_mod`` depends on the batch
  index (so splitting it must re-index ``mask_mod``).
- ``spy(owner, name, record)`` / ``spied(state)``: instrument a function for the ranks of a
  ``pool.run`` (threads of this process): the test wraps the run in ``with spy(...)``, each
  rank calls ``spied(state)`` first, and every call of ``owner.name`` in that rank runs
  ``record(state, *args)`` before the real function.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import itertools
from collections import OrderedDict, UserDict, defaultdict, deque
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

import pytest
import torch
from torch.nn.attention.flex_attention import BlockMask

from pshard._core.tree import is_block_mask, tree_flatten, tree_leaves
from pshard.sequence._layouts import SeqLayout, pad_permute

BATCH = 4

# --------------------------------------------------------------------------- look-alike classes


class BatchEncodingLike(UserDict):
    """Like ``transformers.BatchEncoding``: a ``UserDict`` built from a dict plus extras, with
    attribute access to its keys."""

    def __init__(self, data=None, encoding=None, tensor_type=None, n_sequences=None):
        super().__init__(data)
        self._encodings = encoding
        self._n_sequences = n_sequences

    def __getattr__(self, item: str) -> Any:
        if item == "data":
            raise AttributeError(item)
        try:
            return self.data[item]
        except KeyError:
            raise AttributeError(item) from None


class ModelOutputLike(OrderedDict):
    """Like ``transformers.ModelOutput``: an ``OrderedDict`` whose dataclass subclasses hold
    their fields that are not ``None`` as keys, in field order."""

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is not None:
                self[field.name] = value

    def __setitem__(self, key: Any, value: Any) -> None:
        super().__setitem__(key, value)
        super().__setattr__(key, value)

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, str):
            return dict(self.items())[key]
        return self.to_tuple()[key]

    def to_tuple(self) -> tuple:
        return tuple(self[k] for k in self.keys())


@dataclasses.dataclass
class CausalLMOutputLike(ModelOutputLike):
    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    hidden_states: tuple | None = None


class FrozenMapping(Mapping):
    """A read-only Mapping built from a dict (not a dict subclass)."""

    def __init__(self, data: Mapping) -> None:
        self._data = dict(data)

    def __getitem__(self, key: Any) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __repr__(self) -> str:
        return f"FrozenMapping({self._data!r})"


class KwargsMapping(FrozenMapping):
    """A Mapping whose constructor takes keyword arguments only."""

    def __init__(self, **items: Any) -> None:
        super().__init__(items)


class FactoryDict(defaultdict):
    """A ``defaultdict`` subclass (rebuilt with its default factory)."""


class Pair(NamedTuple):
    first: Any
    second: Any


@dataclasses.dataclass
class Batch:
    input_ids: Any
    labels: Any
    num_tokens: int = 0


@dataclasses.dataclass(frozen=True)
class Derived:
    """A frozen dataclass with a field computed in ``__post_init__`` (not an init field)."""

    x: torch.Tensor
    rows: int = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "rows", self.x.shape[0])


# --------------------------------------------------------------------------- values


def tensor(*trailing: int, dtype: torch.dtype = torch.float32, start: int = 0) -> torch.Tensor:
    """A deterministic tensor of shape ``(BATCH, *trailing)``."""
    shape = (BATCH, *trailing)
    n = 1
    for s in shape:
        n *= s
    values = torch.arange(start, start + n).reshape(shape)
    if dtype == torch.bool:
        return values % 3 == 0
    return values.to(dtype)


def make_block_mask(batch: int = BATCH, seq: int = 256, block: int = 128) -> BlockMask:
    """A causal CPU ``BlockMask`` with a per-batch key length (``mask_mod`` reads ``b``).

    Built directly from its block tensors (every causal block is a partial block), which is
    fast; ``create_block_mask`` gives the same dense mask.
    """
    lengths = torch.linspace(seq, seq // 4, batch).round().long()

    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (kv_idx < lengths[b])

    n = seq // block
    kv_num_blocks = torch.arange(1, n + 1, dtype=torch.int32).expand(batch, 1, n).contiguous()
    kv_indices = torch.arange(n, dtype=torch.int32).expand(batch, 1, n, n).contiguous()
    return BlockMask.from_kv_blocks(
        kv_num_blocks, kv_indices, BLOCK_SIZE=block, mask_mod=mask_mod, seq_lengths=(seq, seq)
    )


def _trees() -> list[tuple[str, Any]]:
    t = tensor(3)
    ids = tensor(8, dtype=torch.int64)
    return [
        ("tensor", tensor(3)),
        ("tensor_1d", tensor()),
        ("scalar_tensor", torch.tensor(2.5)),
        ("int", 3),
        ("float", 1.5),
        ("str", "hello"),
        ("bool", True),
        ("none", None),
        ("empty_dict", {}),
        ("empty_list", []),
        ("empty_tuple", ()),
        ("tuple", (tensor(2), 1, None)),
        ("list", [tensor(2, 5), [tensor(dtype=torch.int64), 2.0]]),
        ("dict", {"b": tensor(2), "a": tensor(dtype=torch.bool), "c": None}),
        ("dict_int_keys", {2: tensor(1), 1: tensor(2)}),
        ("nested", {"x": [t, (tensor(2, start=5), {"y": tensor(7)})], "z": (), "w": [None]}),
        ("namedtuple", Pair(tensor(2), 3)),
        ("namedtuple_nested", Pair(Pair(tensor(1), None), [tensor(2)])),
        ("ordereddict", OrderedDict(z=tensor(2), a=tensor(3))),
        ("defaultdict", defaultdict(list, {"b": tensor(2), "a": [tensor(1)]})),
        ("deque", deque([tensor(2), tensor(3)])),
        ("dataclass", Batch(ids, tensor(8, dtype=torch.int64, start=1), 7)),
        ("dataclass_nested", Batch({"ids": ids}, [tensor(8)], 0)),
        ("dataclass_none_field", Batch(ids, None)),
        ("dataclass_init_false", Derived(tensor(2))),
        (
            "batch_encoding",
            BatchEncodingLike(
                {"input_ids": ids, "attention_mask": tensor(8, dtype=torch.bool), "labels": ids}
            ),
        ),
        ("model_output", CausalLMOutputLike(loss=tensor(), logits=tensor(8, 11))),
        ("user_dict", UserDict({"k": tensor(2), "j": tensor(1)})),
        ("frozen_mapping", FrozenMapping({"b": tensor(2), 1: tensor(3), "a": tensor(1)})),
        ("kwargs_mapping", KwargsMapping(y=tensor(2), x=tensor(3))),
        ("factory_dict", FactoryDict(list, {"q": tensor(2), "p": tensor(4)})),
        ("block_mask", {"mask": make_block_mask(), "input_ids": ids}),
        (
            "hf_args",
            (
                BatchEncodingLike({"input_ids": ids, "labels": ids}),
                {"labels": tensor(8, dtype=torch.int64), "position_ids": ids},
                3,
                None,
            ),
        ),
        ("dtypes", [tensor(2, dtype=d) for d in (torch.float64, torch.int32, torch.bfloat16)]),
        ("mixed_scalars", {"lr": 0.1, "name": "x", "flag": False, "x": tensor(2)}),
        ("wide", {f"k{i:03d}": tensor(2, start=i) for i in range(64)}),
        ("deep", [[[[[{"leaf": tensor(1)}]]]]]),
    ]


TREES: list[tuple[str, Any]] = _trees()


def _is_batched(tree: Any) -> bool:
    leaves = tree_leaves(tree)
    return bool(leaves) and all(
        (isinstance(x, torch.Tensor) and x.ndim > 0 and x.shape[0] == BATCH)
        or (is_block_mask(x) and x.shape[0] == BATCH)
        for x in leaves
    )


BATCHED_TREES: list[tuple[str, Any]] = [(i, t) for i, t in TREES if _is_batched(t)]


# --------------------------------------------------------------------------- pytest helpers


def _value_id(value: Any) -> str:
    if value is None or isinstance(value, (bool, int, float, str)):
        return repr(value)
    text = repr(value)
    return text if len(text) <= 30 else type(value).__name__


def parametrize_product(**axes: Any) -> pytest.MarkDecorator:
    """``pytest.mark.parametrize`` over the product of ``axes`` (each a list or ``{id: value}``).

    Example (in a test module)::

        @parametrize_product(tree=dict(TREES), none_is_leaf=[False, True])
        def test_roundtrip(tree, none_is_leaf): ...
    """
    names = list(axes)
    columns = []
    for values in axes.values():
        if isinstance(values, Mapping):
            columns.append([(str(k), v) for k, v in values.items()])
        else:
            columns.append([(_value_id(v), v) for v in values])
    params = [
        pytest.param(*(v for _, v in combo), id="-".join(i for i, _ in combo))
        for combo in itertools.product(*columns)
    ]
    return pytest.mark.parametrize(",".join(names), params)


def assert_leaves_equal(x: Any, y: Any) -> None:
    """Two leaves are equal: same type; tensors equal in dtype, shape and values; BlockMasks in
    their block tensors, block size and ``mask_mod``."""
    assert type(x) is type(y), f"{type(x).__name__} != {type(y).__name__}"
    if isinstance(x, torch.Tensor):
        assert x.dtype == y.dtype, f"dtype {x.dtype} != {y.dtype}"
        assert x.shape == y.shape, f"shape {tuple(x.shape)} != {tuple(y.shape)}"
        assert torch.equal(x, y), f"values differ:\n{x}\n{y}"
    elif is_block_mask(x):
        assert x.shape == y.shape and x.BLOCK_SIZE == y.BLOCK_SIZE
        assert x.mask_mod is y.mask_mod
        for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
            a, b = getattr(x, name), getattr(y, name)
            assert (a is None) == (b is None), name
            if a is not None:
                assert torch.equal(a, b), name
    else:
        assert x == y, f"{x!r} != {y!r}"


def assert_trees_equal(a: Any, b: Any) -> None:
    """``a`` and ``b`` have the same structure (node types included) and equal leaves."""
    leaves_a, treedef_a = tree_flatten(a)
    leaves_b, treedef_b = tree_flatten(b)
    assert treedef_a == treedef_b, f"structures differ:\n{treedef_a}\n{treedef_b}"
    for x, y in zip(leaves_a, leaves_b, strict=True):
        assert_leaves_equal(x, y)


# ------------------------------------------------------------------ sequence parallelism


def full_attention(q, k, v, causal):
    """The oracle for sequence-parallel attention: SDPA over the whole sequence of
    ``(batch, seq, heads, head_size)`` inputs (GQA when k, v have fewer heads)."""
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        is_causal=causal,
        enable_gqa=q.shape[2] != k.shape[2],
    )
    return out.transpose(1, 2)


def seq_block(x: torch.Tensor, lay: SeqLayout, r: int) -> torch.Tensor:
    """Rank ``r``'s block of ``x`` (sequence on dim 1) under ``lay``, zero-padded."""
    return pad_permute(x, 1, lay, 0.0).chunk(lay.size, 1)[r]


def reference_mask(length: int, segment_ids=None, causal=False, window=None) -> torch.Tensor:
    """The oracle's mask, written from the definitions: boolean ``(batch or 1, s, s)``, True
    where query ``i`` sees key ``j``. ``window``: an int ``w`` (Hugging Face's
    ``sliding_window``: ``i - w < j``) or ``(left, right)`` (``i - left <= j <= i + right``,
    ``None`` for an unbounded side)."""
    i = torch.arange(length).view(-1, 1)
    j = torch.arange(length).view(1, -1)
    mask = torch.ones(length, length, dtype=torch.bool)
    if causal:
        mask &= j <= i
    if isinstance(window, int):
        mask &= i - window < j
    elif window is not None:
        left, right = window
        if left is not None:
            mask &= j >= i - left
        if right is not None:
            mask &= j <= i + right
    mask = mask.unsqueeze(0)
    if segment_ids is not None:
        seg = segment_ids.unsqueeze(-1)
        mask = mask & (seg == segment_ids.unsqueeze(-2)) & (seg >= 0)
    return mask


def masked_attention(q, k, v, mask: torch.Tensor) -> torch.Tensor:
    """Attention of ``(batch, seq, heads, size)`` inputs under a boolean ``(batch or 1, s,
    s)`` mask, by explicit softmax (GQA by repeating k, v); a query that sees no key gets 0."""
    groups = q.shape[2] // k.shape[2]
    k, v = (t.repeat_interleave(groups, 2) for t in (k, v))
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) / q.shape[-1] ** 0.5
    m = mask.unsqueeze(1)
    seen = m.any(-1, keepdim=True)
    p = torch.softmax(torch.where(m & seen, s, torch.where(seen, -torch.inf, 0.0)), -1)
    p = torch.where(seen, p, 0.0)
    return torch.einsum("bhqk,bkhd->bqhd", p, v)


_SPIED: contextvars.ContextVar[Any] = contextvars.ContextVar("test_spied", default=None)


@contextlib.contextmanager
def spy(owner: Any, name: str, record: Callable[..., None]) -> Iterator[None]:
    """Replace ``owner.name`` for the duration by a function that calls ``record(state,
    *args)`` with the calling rank's state (see :func:`spied`) before the real one."""
    real = getattr(owner, name)

    def spying(*args: Any, **kwargs: Any) -> Any:
        state = _SPIED.get()
        if state is not None:
            record(state, *args)
        return real(*args, **kwargs)

    setattr(owner, name, spying)
    try:
        yield
    finally:
        setattr(owner, name, real)


def spied(state: Any) -> Any:
    """Called in a rank: the state that :func:`spy`'s ``record`` gets in this rank's calls."""
    _SPIED.set(state)
    return state
