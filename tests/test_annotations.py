"""Spec annotations: ``specs_of`` on dataclasses, the reader of function signatures, and the
transforms taking their specs from annotations (compared with the same transforms given the
spec trees explicitly, and with the untransformed function).

This module's annotations are objects (no ``from __future__ import annotations``); string
annotations are tested in ``test_annotations_future.py``.
"""

import contextlib
import contextvars
import dataclasses
import functools
import gc
import io
import pathlib
import re
import weakref
from typing import Annotated, Optional

import pytest
import torch
import torch.nn.functional as F
from helpers import CausalLMOutputLike
from torch.func import grad, grad_and_value

import pshard as ps
from pshard._core import annotations as _annotations
from pshard._core import type_specs as _type_specs
from pshard._core.annotations import default_in_specs, default_out_specs
from pshard._core.specs import broadcast_prefix

DT = torch.float64
S0, S1, R = ps.Shard(0), ps.Shard(1), ps.Replicate()
MEAN = ps.Partial("mean")

Seq = Annotated[torch.Tensor, S1]


@dataclasses.dataclass
class Batch:
    input_ids: Annotated[torch.Tensor, S1]
    labels: Annotated[torch.Tensor, S1]
    num_tokens: int


@dataclasses.dataclass(frozen=True)
class FrozenBatch:
    x: Annotated[torch.Tensor, "a doc string first", S0]
    mask: torch.Tensor = dataclasses.field(metadata={"pshard": S1})
    scale: float = 1.0


@dataclasses.dataclass
class Checked:
    """Its ``__post_init__`` rejects anything but tensors: specs cannot be an instance."""

    x: Annotated[torch.Tensor, S0]
    y: torch.Tensor

    def __post_init__(self):
        if self.x.shape[0] != self.y.shape[0]:
            raise ValueError("x and y disagree")


@dataclasses.dataclass
class WithDerived:
    x: Annotated[torch.Tensor, S0]
    rows: int = dataclasses.field(init=False)

    def __post_init__(self):
        self.rows = self.x.shape[0]


@dataclasses.dataclass
class Inner:
    mask: Annotated[torch.Tensor, S0]
    note: str = ""


@dataclasses.dataclass
class Outer:
    inner: Inner
    many: list
    by_name: dict
    tokens: Seq
    fixed: Inner = dataclasses.field(metadata={"pshard": R})
    plain: torch.Tensor = None


@dataclasses.dataclass
class Unannotated:
    x: torch.Tensor
    n: int = 0


@dataclasses.dataclass
class LMOutput(CausalLMOutputLike):
    logits: Annotated[torch.Tensor | None, S0] = None


def inner(n=4):
    return Inner(torch.arange(float(n)), "i")


def outer():
    return Outer(
        inner=inner(),
        many=[inner(2), (inner(3), torch.zeros(1))],
        by_name={"a": inner(5), "b": 7},
        tokens=torch.zeros(2, 6),
        fixed=inner(1),
        plain=torch.ones(3),
    )


# --------------------------------------------------------------------------- specs_of


def test_specs_of_api_example():
    batch = Batch(torch.zeros(4, 8, dtype=torch.long), torch.zeros(4, 8, dtype=torch.long), 5)
    specs = ps.specs_of(batch)
    assert type(specs) is Batch
    assert specs == Batch(input_ids=S1, labels=S1, num_tokens=R)
    assert repr(specs) == "Batch(input_ids=Shard(1), labels=Shard(1), num_tokens=Replicate())"
    assert broadcast_prefix(specs, batch) == [S1, S1, R]


def test_specs_of_frozen_and_field_metadata():
    value = FrozenBatch(torch.zeros(2, 3), torch.zeros(2, 3))
    specs = ps.specs_of(value)
    # the first placement among the metadata wins; metadata={"pshard": ...} is read too
    assert type(specs) is FrozenBatch and specs == FrozenBatch(S0, S1, R)
    assert broadcast_prefix(specs, value) == [S0, S1, R]


@pytest.mark.parametrize("cls", [Checked, WithDerived])
def test_specs_of_classes_that_cannot_hold_placements_give_a_dict(cls):
    value = cls(torch.zeros(3), torch.zeros(3)) if cls is Checked else cls(torch.zeros(3))
    specs = ps.specs_of(value)
    expected = {"x": S0, "y": R} if cls is Checked else {"x": S0}
    assert type(specs) is dict and specs == expected
    assert broadcast_prefix(specs, value) == list(expected.values())


def test_specs_of_nested():
    value = outer()
    specs = ps.specs_of(value)
    i = Inner(S0, R)
    assert specs == Outer(
        inner=i, many=[i, (i, R)], by_name={"a": i, "b": R}, tokens=S1, fixed=R, plain=R
    )
    # a prefix of the value: every leaf gets the spec of its field
    assert broadcast_prefix(specs, value) == [S0, R, S0, R, S0, R, R, S0, R, R, S1, R, R, R]


def test_specs_of_containers_and_plain_values():
    b = Batch(torch.zeros(2, 3), torch.zeros(2, 3), 1)
    b_specs = Batch(S1, S1, R)
    assert ps.specs_of([b, {"x": b, "y": torch.zeros(1)}, None]) == [
        b_specs,
        {"x": b_specs, "y": R},
        None,
    ]
    assert ps.specs_of((torch.zeros(2), {"a": 1})) == R
    assert ps.specs_of(torch.zeros(2)) == R
    assert ps.specs_of(Unannotated(torch.zeros(2))) == Unannotated(R, R)


def test_specs_of_mapping_dataclass():
    out = LMOutput(loss=torch.zeros(()), logits=torch.zeros(2, 3))
    specs = ps.specs_of(out)
    # a dataclass that is a Mapping is a Mapping: its keys are the fields it holds
    assert specs == {"loss": R, "logits": S0}
    assert broadcast_prefix(specs, out) == [R, S0]


def test_specs_of_is_fresh_and_split_works_with_it():
    batch = Batch(torch.arange(12.0).reshape(2, 6), torch.arange(12.0).reshape(2, 6), 12)
    a, b = ps.specs_of(batch), ps.specs_of(batch)
    assert a == b and a is not b  # a new tree each time: mutating one changes nothing else
    chunks = ps.split(batch, a, 3)
    assert [c.input_ids.shape for c in chunks] == [(2, 2)] * 3
    assert all(c.num_tokens == 12 for c in chunks)


def test_specs_of_errors():
    @dataclasses.dataclass
    class Twice:
        x: Annotated[torch.Tensor, S0] = dataclasses.field(metadata={"pshard": S1})

    with pytest.raises(
        TypeError,
        match=re.escape(
            "specs_of: test_specs_of_errors.<locals>.Twice.x has two specs: Shard(0) in its type "
            "and Shard(1) in dataclasses.field(metadata={'pshard': ...}); keep one"
        ),
    ):
        ps.specs_of(Twice(torch.zeros(1)))

    @dataclasses.dataclass
    class NotASpec:
        x: torch.Tensor = dataclasses.field(metadata={"pshard": {"a": "Shard(0)"}})

    with pytest.raises(
        TypeError,
        match=re.escape(
            "specs_of: test_specs_of_errors.<locals>.NotASpec.x: dataclasses.field(metadata="
            "{'pshard': ...}) must hold a spec tree of placements, P(...) or None, got a str "
            "('Shard(0)') in {'a': 'Shard(0)'}"
        ),
    ):
        ps.specs_of(NotASpec(torch.zeros(1)))

    @dataclasses.dataclass
    class Conflict:
        x: Annotated[torch.Tensor, S0] | None | Annotated[list, S1]

    with pytest.raises(TypeError, match=re.escape("carry different specs (Shard(0), Shard(1))")):
        ps.specs_of(Conflict(torch.zeros(1)))

    @dataclasses.dataclass
    class Nested:
        x: list[tuple[Annotated[torch.Tensor, S0], torch.Tensor]]

    with pytest.raises(
        TypeError,
        match=re.escape(
            "the elements of list[tuple[typing.Annotated[torch.Tensor, Shard(0)], torch.Tensor]] "
            "carry the spec tree (Shard(0), Replicate()), but a container of any length takes one "
            "placement for all its elements"
        ),
    ):
        ps.specs_of(Nested([]))


def test_specs_of_type_forms():
    @dataclasses.dataclass
    class Forms:
        optional: Optional[Seq] = None  # noqa: UP045 - typing.Union, not X | None
        union: Seq | None = None
        pair: tuple[Seq, torch.Tensor] = None
        many: list[Annotated[torch.Tensor, S0]] = None
        table: dict[str, Seq] = None
        p: Annotated[torch.Tensor, ps.P("dp", None)] = None
        nothing: tuple[int, str] = None

    specs = ps.specs_of(Forms())
    assert specs == Forms(S1, S1, (S1, R), S0, S1, ps.P("dp", None), R)


# --------------------------------------------------------------------------- function signatures


def annotated_step(
    params: dict, batch: Batch, *, mask: Annotated[torch.Tensor, S0] | None = None
) -> tuple[Annotated[torch.Tensor, MEAN], dict]:
    raise NotImplementedError


def test_reader_parameters_and_return():
    batch = Batch(torch.zeros(2, 3), torch.zeros(2, 3), 1)
    in_specs, kw_specs = default_in_specs(
        annotated_step, ({"w": torch.zeros(1)}, batch), {"mask": torch.zeros(2)}, transform="t"
    )
    assert in_specs == (R, Batch(S1, S1, R)) and kw_specs == {"mask": S0}
    assert default_out_specs(annotated_step, transform="t") == (MEAN, R)


def test_reader_replicates_the_rest_once_anything_is_annotated():
    def f(a, b, *rest, c=None, **more):
        raise NotImplementedError

    x = torch.zeros(4, 2)
    assert default_in_specs(f, (x, x, x), {"c": x, "d": x}, transform="t") is None
    # a dataclass argument whose fields carry specs is enough
    batch = Batch(x, x, 1)
    assert default_in_specs(f, (x, batch, x), {"c": x, "d": x}, transform="t") == (
        (R, Batch(S1, S1, R), R),
        {"c": R, "d": R},
    )
    # a dataclass argument without annotations is not
    assert default_in_specs(f, (Unannotated(x), x), {}, transform="t") is None


def test_reader_var_args_and_annotated_dataclass_parameter():
    def f(
        batch: Annotated[Batch, R], *xs: Annotated[torch.Tensor, S0], **kw: Seq
    ) -> Annotated[torch.Tensor, S0]:
        raise NotImplementedError

    x = torch.zeros(4, 2)
    # the parameter's own spec wins over the fields of the dataclass it receives
    assert default_in_specs(f, (Batch(x, x, 1), x, x), {"y": x}, transform="t") == (
        (R, S0, S0),
        {"y": S1},
    )


def test_reader_partial_method_callable_and_wrappers():
    def f(w, x: Annotated[torch.Tensor, S0], y: Seq) -> Annotated[torch.Tensor, MEAN]:
        raise NotImplementedError

    x = torch.zeros(4, 2)
    bound = functools.partial(f, x)
    assert default_in_specs(bound, (x, x), {}, transform="t") == ((S0, S1), None)
    assert default_out_specs(bound, transform="t") == MEAN
    by_keyword = functools.partial(f, y=x)
    assert default_in_specs(by_keyword, (x, x), {"y": x}, transform="t") == ((R, S0), {"y": S1})

    class Model:
        def step(self, x: Seq) -> Annotated[torch.Tensor, S1]:
            raise NotImplementedError

        def __call__(self, x: Annotated[torch.Tensor, S0]) -> Annotated[torch.Tensor, R]:
            raise NotImplementedError

    model = Model()
    assert default_in_specs(model.step, (x,), {}, transform="t") == ((S1,), None)
    assert default_out_specs(model.step, transform="t") == S1
    assert default_in_specs(model, (x,), {}, transform="t") == ((S0,), None)
    assert default_out_specs(model, transform="t") == R

    # torch.func.grad(f) takes f's arguments but returns something else: its parameters are
    # read through __wrapped__, its return is not
    for wrapper in (grad(f, argnums=1), grad_and_value(f, argnums=1)):
        assert default_in_specs(wrapper, (x, x, x), {}, transform="t") == ((R, S0, S1), None)
        assert default_out_specs(wrapper, transform="t", required=False) is None
    with pytest.raises(
        TypeError,
        match=re.escape(
            "shard_map(f): out_specs omitted and f is a wrapper (it has __wrapped__: "
            "torch.func.grad(f), a functools.wraps decorator), whose return annotation is not "
            "read because a wrapper may return something else; pass out_specs=..."
        ),
    ):
        default_out_specs(grad(f), transform="shard_map")
    # a class is not read
    assert default_in_specs(Batch, (x, x, 1), {}, transform="t") is None


def test_reader_missing_return_annotation_error():
    def loss(x: Annotated[torch.Tensor, S0]):
        raise NotImplementedError

    def loss2(x) -> torch.Tensor:
        raise NotImplementedError

    assert default_out_specs(loss, transform="pmap_microbatch", required=False) is None
    with pytest.raises(
        TypeError,
        match=re.escape(
            "shard_map(loss): out_specs omitted and loss has no return annotation; pass "
            "out_specs=... (a prefix tree of the output) or annotate the return, e.g. "
            "-> Annotated[torch.Tensor, ps.Replicate()]"
        ),
    ):
        default_out_specs(loss, transform="shard_map")
    with pytest.raises(
        TypeError,
        match=re.escape(
            "shard_map(loss2): out_specs omitted and the return annotation of loss2 carries no "
            "spec; pass out_specs=..."
        ),
    ):
        default_out_specs(loss2, transform="shard_map")


def test_reader_return_dataclass_type():
    @dataclasses.dataclass
    class Out:
        loss: Annotated[torch.Tensor, MEAN]
        inner: Inner
        logits: torch.Tensor

    def f(x) -> Out:
        raise NotImplementedError

    def g(x) -> Unannotated:
        raise NotImplementedError

    assert default_out_specs(f, transform="t") == Out(MEAN, Inner(S0, R), R)
    assert default_out_specs(g, transform="t", required=False) is None


def test_reader_is_cached_per_function_and_keeps_nothing_alive(monkeypatch):
    def f(x: Annotated[torch.Tensor, S0]) -> Annotated[torch.Tensor, S0]:
        raise NotImplementedError

    reads = []
    original = _annotations._FnInfo.__init__

    def counting(self, fn):
        reads.append(fn)
        original(self, fn)

    monkeypatch.setattr(_annotations._FnInfo, "__init__", counting)
    x = torch.zeros(3)
    for _ in range(3):
        assert default_in_specs(f, (x,), {}, transform="t") == ((S0,), None)
        assert default_out_specs(f, transform="t") == S0
    assert reads == [f]
    reads.clear()
    ref = weakref.ref(f)
    del f
    gc.collect()
    assert ref() is None


def test_reader_class_specs_cached_per_class(monkeypatch):
    calls = []
    original = _type_specs._class_hints

    def counting(cls, fields):
        calls.append(cls)
        return original(cls, fields)

    monkeypatch.setattr(_type_specs, "_class_hints", counting)

    @dataclasses.dataclass
    class Local:
        x: Annotated[torch.Tensor, S0]

    def f(b):
        raise NotImplementedError

    for n in range(3):
        assert default_in_specs(f, (Local(torch.zeros(n + 1)),), {}, transform="t") == (
            (Local(S0),),
            None,
        )
    assert calls == [Local]


def test_clear_caches_reads_annotations_again(monkeypatch):
    reads = []
    original = _annotations._FnInfo.__init__

    def counting(self, fn):
        reads.append(fn)
        original(self, fn)

    monkeypatch.setattr(_annotations._FnInfo, "__init__", counting)
    hints = []
    original_hints = _type_specs._class_hints

    def counting_hints(cls, fields):
        hints.append(cls)
        return original_hints(cls, fields)

    monkeypatch.setattr(_type_specs, "_class_hints", counting_hints)

    @dataclasses.dataclass
    class Local:
        x: Annotated[torch.Tensor, S0]

    def f(b: Local, y: Annotated[torch.Tensor, S1]) -> Annotated[torch.Tensor, R]:
        raise NotImplementedError

    args = (Local(torch.zeros(2)), torch.zeros(2, 3))
    for _ in range(2):
        assert default_in_specs(f, args, {}, transform="t") == ((Local(S0), S1), None)
        assert default_out_specs(f, transform="t") == R
    assert (reads, hints) == ([f], [Local])
    ps.clear_caches()
    assert default_in_specs(f, args, {}, transform="t") == ((Local(S0), S1), None)
    assert default_out_specs(f, transform="t") == R
    assert (reads, hints) == ([f, f], [Local, Local])


# --------------------------------------------------------------------------- pmap_microbatch


def make_params():
    g = torch.Generator().manual_seed(0)
    return {"emb": torch.randn(7, 4, dtype=DT, generator=g), "head": torch.randn(4, 7, dtype=DT)}


def make_batch(rows=6, seq=8):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 7, (rows, seq), generator=g)
    return Batch(ids, torch.roll(ids, -1, 1), rows * seq)


def lm_loss(params, batch):
    logits = params["emb"][batch.input_ids] @ params["head"]
    return F.cross_entropy(logits.reshape(-1, 7), batch.labels.reshape(-1))


def lm_annotated(params: dict, batch: Batch) -> Annotated[torch.Tensor, MEAN]:
    return lm_loss(params, batch)


EXPLICIT_IN = (None, Batch(S1, S1, None))


def close(a, b):
    for x, y in zip(
        torch.utils._pytree.tree_leaves(a), torch.utils._pytree.tree_leaves(b), strict=True
    ):
        torch.testing.assert_close(x, y)


@pytest.mark.parametrize("k", [1, 3, 4])
def test_pmap_forward_annotations_match_explicit(k):
    params, batch = make_params(), make_batch()
    annotated = ps.pmap_microbatch(lm_annotated, num_microbatches=k)
    explicit = ps.pmap_microbatch(lm_loss, num_microbatches=k, in_specs=EXPLICIT_IN, out_specs=MEAN)
    close(annotated(params, batch), explicit(params, batch))
    close(annotated(params, batch), lm_loss(params, batch))


@pytest.mark.parametrize("k", [1, 3])
def test_pmap_gradients_annotations_match_explicit(k):
    params, batch = make_params(), make_batch()
    # gradient accumulation: grad_and_value's return is not read, so out specs are inferred
    # (a mean over targets: weighted by each microbatch's count of them)
    accumulated = ps.pmap_microbatch(
        grad_and_value(lm_annotated), num_microbatches=k, weight_fn=lambda p, b: b.labels.numel()
    )
    explicit = ps.pmap_microbatch(
        grad_and_value(lm_loss), num_microbatches=k, in_specs=EXPLICIT_IN, out_specs=MEAN
    )
    close(accumulated(params, batch), explicit(params, batch))
    close(accumulated(params, batch), grad_and_value(lm_loss)(params, batch))
    # and the other nesting: grad of the microbatched function
    outer_grad = grad(ps.pmap_microbatch(lm_annotated, num_microbatches=k))
    close(outer_grad(params, batch), grad(lm_loss)(params, batch))


def recorder(seen):
    def f(w: torch.Tensor, x: Annotated[torch.Tensor, S0], y):
        seen.append((tuple(w.shape), tuple(x.shape), tuple(y.shape)))
        return x.sum() + w.sum() + y.sum()

    return f


def test_pmap_replicates_unannotated_parameters_once_anything_is_annotated():
    seen = []
    w, x, y = torch.zeros(6, 2), torch.zeros(6, 2), torch.zeros(6)
    ps.pmap_microbatch(recorder(seen), num_microbatches=2, out_specs=ps.Partial("sum"))(w, x, y)
    assert seen == [((6, 2), (3, 2), (6,))] * 2

    def plain(w, x, y):
        seen.append((tuple(w.shape), tuple(x.shape), tuple(y.shape)))
        return x.sum()

    seen.clear()  # nothing annotated: pmap_microbatch's default, Shard(0) for tensors
    ps.pmap_microbatch(plain, num_microbatches=2, out_specs=ps.Partial("sum"))(w, x, y)
    assert seen == [((3, 2), (3, 2), (3,))] * 2


def test_pmap_explicit_specs_win():
    seen = []
    w, x, y = torch.zeros(6, 2), torch.zeros(2, 6), torch.zeros(6)
    f = ps.pmap_microbatch(
        recorder(seen), num_microbatches=2, in_specs=(S0, S1, None), out_specs=ps.Partial("sum")
    )
    f(w, x, y)
    assert seen == [((3, 2), (2, 3), (6,))] * 2

    def summed(x: Annotated[torch.Tensor, S0]) -> Annotated[torch.Tensor, MEAN]:
        return x.sum()

    x = torch.arange(6.0)
    assert ps.pmap_microbatch(summed, num_microbatches=3)(x) == x.sum() / 3  # annotation: mean
    sums = ps.pmap_microbatch(summed, num_microbatches=3, out_specs=ps.Partial("sum"))(x)
    assert sums == x.sum()  # explicit out_specs win


def test_pmap_keyword_annotations():
    seen = []

    def f(x, *, mask: Annotated[torch.Tensor, S1], bias=None):
        seen.append((tuple(x.shape), tuple(mask.shape), tuple(bias.shape)))
        return mask.sum()

    x, mask, bias = torch.zeros(4), torch.zeros(2, 4), torch.zeros(4)
    ps.pmap_microbatch(f, num_microbatches=2, out_specs=ps.Partial("sum"))(x, mask=mask, bias=bias)
    assert seen == [((4,), (2, 2), (4,))] * 2
    seen.clear()  # explicit in_specs for the positional args, annotations for the keywords
    ps.pmap_microbatch(f, num_microbatches=2, in_specs=S0, out_specs=ps.Partial("sum"))(
        x, mask=mask, bias=bias
    )
    assert seen == [((2,), (2, 2), (4,))] * 2


def test_pmap_unannotated_dataclass_keeps_the_default():
    seen = []

    def f(b):
        seen.append(tuple(b.x.shape))
        return b.x.sum()

    ps.pmap_microbatch(f, num_microbatches=2, out_specs=MEAN)(Unannotated(torch.zeros(4, 3)))
    assert seen == [(2, 3)] * 2


def test_pmap_annotation_errors():
    def f(x: Annotated[torch.Tensor, ps.P("dp")]):
        return x

    with pytest.raises(TypeError, match=re.escape("pmap_microbatch(f) in_specs[0]: expected")):
        ps.pmap_microbatch(f, num_microbatches=2)(torch.zeros(4))

    def g(x: Annotated[torch.Tensor, S1]):
        return x

    with pytest.raises(
        ValueError,
        match=re.escape(
            "pmap_microbatch(g) in_specs[0]: Shard(1) but the tensor has 1 dim (shape (4,)); "
            "did you mean Shard(0)?"
        ),
    ):
        ps.pmap_microbatch(g, num_microbatches=2)(torch.zeros(4))


# --------------------------------------------------------------------------- shard_map

SP = ps.P(None, "sp")


@dataclasses.dataclass
class SeqBatch:
    x: Annotated[torch.Tensor, SP]  # (batch, seq, dim): the sequence split over "sp"
    y: torch.Tensor = dataclasses.field(metadata={"pshard": S1})  # the same split
    scale: float = 1.0


def seq_loss_body(w, batch, *, bias=None):
    """Inside the map: the global mean of squared errors over the sequence blocks."""
    err = batch.x @ w - batch.y
    if bias is not None:
        err = err + bias
    total = ps.psum((err**2).sum(), "sp")
    count = ps.psum(torch.tensor(float(err.numel()), dtype=DT), "sp")
    return batch.scale * total / count, err


def seq_loss_annotated(
    w: torch.Tensor, batch: SeqBatch, *, bias: Annotated[torch.Tensor, S0] = None
) -> tuple[Annotated[torch.Tensor, ps.P()], Annotated[torch.Tensor, SP]]:
    return seq_loss_body(w, batch, bias=bias)


def seq_loss_reference(w, batch, bias):
    err = batch.x @ w - batch.y + bias
    return batch.scale * (err**2).mean(), err


def seq_data(seq=8):
    g = torch.Generator().manual_seed(4)
    w = torch.randn(3, dtype=DT, generator=g)
    batch = SeqBatch(
        torch.randn(2, seq, 3, dtype=DT, generator=g), torch.randn(2, seq, dtype=DT, generator=g)
    )
    return w, batch, torch.randn(seq, dtype=DT, generator=g)


def _shard_map_worker(nprocs):
    ps.init_mesh({"sp": nprocs})
    w, batch, bias = seq_data()
    annotated = ps.shard_map(seq_loss_annotated)
    explicit = ps.shard_map(
        seq_loss_body, in_specs=(None, SeqBatch(SP, S1, None)), out_specs=(ps.P(), SP)
    )
    out = {}
    # a keyword argument is split by its parameter's annotation (shard_map has no kw_specs:
    # without annotations keyword arguments are replicated)
    out["annotated_bias"] = annotated(w, batch, bias=bias)
    out["annotated_no_bias"] = annotated(w, batch)
    out["explicit"] = explicit(w, batch)

    def scalar(f, **kw):
        return lambda w_, x_: f(w_, SeqBatch(x_, batch.y, batch.scale), **kw)[0]

    out["grad_annotated"] = grad(scalar(annotated), argnums=(0, 1))(w, batch.x)
    out["grad_explicit"] = grad(scalar(explicit), argnums=(0, 1))(w, batch.x)
    # explicit in_specs win: replicated inputs, every rank computes the whole loss
    seen = []

    def spy(w: torch.Tensor, batch: SeqBatch) -> Annotated[torch.Tensor, ps.P()]:
        seen.append(tuple(batch.x.shape))
        return (batch.x @ w - batch.y).square().mean()

    out["override"] = ps.shard_map(spy, in_specs=ps.P())(w, batch)
    out["override_seen"] = seen[-1]
    ps.shard_map(spy)(w, batch)
    out["annotated_seen"] = seen[-1]
    return out


@pytest.mark.parametrize("nprocs", [2, 4])
def test_shard_map_annotations_match_explicit(pool, nprocs):
    w, batch, bias = seq_data()
    ref_loss, ref_err = seq_loss_reference(w, batch, torch.zeros(()))
    ref_grads = grad(
        lambda w_, x_: seq_loss_reference(w_, SeqBatch(x_, batch.y), torch.zeros(()))[0],
        argnums=(0, 1),
    )(w, batch.x)
    for out in pool.run(nprocs, _shard_map_worker, nprocs):
        close(out["annotated_bias"], seq_loss_reference(w, batch, bias))
        close(out["annotated_no_bias"], (ref_loss, ref_err))
        close(out["explicit"], (ref_loss, ref_err))
        close(out["grad_annotated"], ref_grads)
        close(out["grad_explicit"], ref_grads)
        close(out["override"], (batch.x @ w - batch.y).square().mean())
        assert out["override_seen"] == (2, 8, 3)
        assert out["annotated_seen"] == (2, 8 // nprocs, 3)


def test_shard_map_decoration_errors():
    def loss(x: Annotated[torch.Tensor, S0]):
        return x.sum()

    def valued(x: Annotated[torch.Tensor, S0]) -> Annotated[torch.Tensor, ps.P()]:
        return x.sum()

    with pytest.raises(
        TypeError,
        match="^"
        + re.escape(
            "shard_map(loss): out_specs omitted and loss has no return annotation; pass "
            "out_specs=... (a prefix tree of the output) or annotate the return, e.g. "
            "-> Annotated[torch.Tensor, ps.Replicate()]"
        )
        + "$",
    ):
        ps.shard_map(loss)
    with pytest.raises(TypeError, match=re.escape("shard_map(valued): out_specs omitted and")):
        ps.shard_map()(grad(valued))
    # given explicitly, nothing is read
    ps.shard_map(loss, out_specs=ps.P())
    ps.shard_map(grad(valued), out_specs=S0)


# --------------------------------------------------------------------------- docs


def test_docs_worked_example_runs():
    """The python blocks of docs/annotations.md run in order, and print what they say."""
    text = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "annotations.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(blocks) >= 4
    expected = []
    for block in blocks:
        lines = block.splitlines()
        expected += [
            nxt[2:]
            for line, nxt in zip(lines, lines[1:], strict=False)
            if line.startswith("print(")
        ]
    assert len(expected) == 2
    namespace = {"__name__": "docs_annotations"}
    out = io.StringIO()

    def run():
        with contextlib.redirect_stdout(out):
            for block in blocks:
                exec(compile(block, "docs/annotations.md", "exec"), namespace)

    contextvars.copy_context().run(run)  # the example's mesh does not outlive it
    assert out.getvalue().splitlines() == expected


# shard_map_seq: the API's example, annotations against explicit specs


def seq_lm_body(params, batch):
    logits = params["emb"][batch.input_ids] @ params["out"]
    losses = F.cross_entropy(logits.flatten(0, 1), batch.labels.flatten(), reduction="sum")
    count = (batch.labels != -100).sum().to(DT)
    return ps.psum(losses, "sp") / ps.psum(count, "sp")


def seq_lm_annotated(params: dict, batch: Batch) -> Annotated[torch.Tensor, ps.Replicate()]:
    return seq_lm_body(params, batch)


def seq_lm_reference(params, batch):
    logits = params["emb"][batch.input_ids] @ params["out"]
    return F.cross_entropy(logits.flatten(0, 1), batch.labels.flatten(), ignore_index=-100)


def seq_lm_data(seq=7):
    g = torch.Generator().manual_seed(5)
    params = {
        "emb": torch.randn(11, 4, dtype=DT, generator=g),
        "out": torch.randn(4, 11, dtype=DT, generator=g),
    }
    ids = torch.randint(0, 11, (2, seq), generator=g)
    labels = torch.randint(0, 11, (2, seq), generator=g)
    labels[:, -1] = -100
    return params, Batch(ids, labels, int((labels != -100).sum()))


def _shard_map_seq_worker(nprocs):
    ps.init_mesh({"sp": nprocs})
    params, batch = seq_lm_data()
    pads = (0, {"input_ids": 0, "labels": -100, "num_tokens": 0})
    annotated = ps.shard_map_seq(seq_lm_annotated, layout="zigzag", pad_values=pads)
    explicit = ps.shard_map_seq(
        seq_lm_body,
        in_specs=(None, Batch(S1, S1, None)),
        out_specs=R,
        layout="zigzag",
        pad_values=pads,
    )
    return {
        "annotated": grad_and_value(annotated)(params, batch),
        "explicit": grad_and_value(explicit)(params, batch),
    }


@pytest.mark.parametrize("nprocs", [2, 4])
def test_shard_map_seq_annotations_match_explicit(pool, nprocs):
    params, batch = seq_lm_data()
    ref = grad_and_value(seq_lm_reference)(params, batch)
    for out in pool.run(nprocs, _shard_map_seq_worker, nprocs):
        close(out["annotated"], ref)
        close(out["explicit"], ref)


def test_shard_map_seq_annotation_errors():
    def no_return(x: Seq):
        return x

    with pytest.raises(
        TypeError,
        match=re.escape("shard_map_seq(no_return): out_specs omitted and no_return has no return"),
    ):
        ps.shard_map_seq(no_return)

    def split_kw(x: Seq, *, y: Seq = None) -> Seq:
        return x

    mapped = ps.shard_map_seq(split_kw)
    ctx = contextvars.Context()
    with pytest.raises(
        ValueError,
        match=re.escape(
            "shard_map_seq(split_kw): keyword argument 'y' is annotated Shard(1), but keyword "
            "arguments are passed whole to every rank; pass it positionally"
        ),
    ):
        ctx.run(lambda: (ps.init_mesh({"sp": 1}), mapped(torch.ones(1, 3), y=torch.ones(1, 3))))


def test_annotations_that_would_be_ignored_are_errors():
    """A spec written as a string, or two specs in one Annotated, were silently ignored."""

    @dataclasses.dataclass
    class Text:
        a: Annotated[torch.Tensor, "Shard(0)"]

    @dataclasses.dataclass
    class Two:
        b: Annotated[torch.Tensor, ps.Shard(0), ps.Replicate()]

    with pytest.raises(TypeError, match=re.escape("carries the string 'Shard(0)', not a spec")):
        ps.specs_of(Text(torch.zeros(2)))
    with pytest.raises(TypeError, match=re.escape("carries 2 specs (Shard(0), Replicate())")):
        ps.specs_of(Two(torch.zeros(2)))

    def f(x: Annotated[torch.Tensor, ps.Shard(0), ps.Shard(1)]) -> torch.Tensor:
        return x

    with pytest.raises(TypeError, match=re.escape("carries 2 specs (Shard(0), Shard(1))")):
        ps.pmap_microbatch(f, num_microbatches=2)(torch.zeros(4, 2))

    @dataclasses.dataclass
    class Doc:  # other metadata is left alone
        c: Annotated[torch.Tensor, "the ids", ps.Shard(0)]

    assert ps.specs_of(Doc(torch.zeros(2))) == Doc(ps.Shard(0))
