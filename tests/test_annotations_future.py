"""Spec annotations written as strings (``from __future__ import annotations``): resolved in the
module that defines the class or function, with errors naming the class and field (or the
function and parameter) when a name cannot be resolved."""

from __future__ import annotations

import dataclasses
import re
from typing import TYPE_CHECKING, Annotated

import pytest
import torch
from torch.func import grad_and_value

import pshard as ps
from pshard._core.annotations import default_in_specs, default_out_specs

if TYPE_CHECKING:
    from collections import OrderedDict  # noqa: F401 - only for the type checker

S0, S1, R = ps.Shard(0), ps.Shard(1), ps.Replicate()
Seq = Annotated[torch.Tensor, ps.Shard(1)]


@dataclasses.dataclass(frozen=True)
class Tokens:
    ids: Seq
    weights: Annotated[torch.Tensor, ps.Shard(1)] | None = None


@dataclasses.dataclass
class Batch:
    tokens: Tokens  # a dataclass defined above, by name
    extra: list[Tokens]
    mask: torch.Tensor = dataclasses.field(metadata={"pshard": ps.Shard(0)})
    later: Later | None = None  # defined below: resolved when first read


@dataclasses.dataclass
class Later:
    x: Annotated[torch.Tensor, ps.Shard(0)]


@dataclasses.dataclass
class Hidden:
    x: Annotated[torch.Tensor, ps.Shard(0)]
    table: OrderedDict  # only imported under TYPE_CHECKING


@dataclasses.dataclass
class HiddenWithMetadata:
    x: OrderedDict = dataclasses.field(metadata={"pshard": ps.Shard(0)})


def step(params: dict, batch: Batch) -> tuple[Annotated[torch.Tensor, ps.Partial("mean")], Seq]:
    raise NotImplementedError


def hidden_step(x: Annotated[OrderedDict, S0]) -> Annotated[OrderedDict, S0]:
    raise NotImplementedError


def make_batch() -> Batch:
    t = Tokens(torch.zeros(2, 6), torch.ones(2, 6))
    return Batch(t, [t, Tokens(torch.zeros(2, 6))], torch.zeros(2), Later(torch.zeros(2)))


def test_string_annotations_resolve():
    tokens = Tokens(S1, S1)
    assert ps.specs_of(make_batch()) == Batch(tokens, [tokens, tokens], S0, Later(S0))
    batch = make_batch()
    in_specs, kw_specs = default_in_specs(step, ({}, batch), {}, transform="t")
    assert in_specs == (R, ps.specs_of(batch)) and kw_specs is None
    assert default_out_specs(step, transform="t") == (ps.Partial("mean"), S1)


def test_unresolvable_field_names_class_and_field():
    value = Hidden(torch.zeros(1), None)
    message = (
        "specs_of: cannot resolve the annotation of Hidden.table ('OrderedDict'): NameError: "
        "name 'OrderedDict' is not defined; make the name importable in module "
        "test_annotations_future at run time (not only under TYPE_CHECKING; a class defined "
        "inside a function cannot be found from a string annotation), or give the field its "
        "spec with dataclasses.field(metadata={'pshard': spec})"
    )
    with pytest.raises(TypeError, match=re.escape(message)):
        ps.specs_of(value)

    def f(x, b):
        raise NotImplementedError

    with pytest.raises(
        TypeError,
        match=re.escape(
            "pmap_microbatch(f) argument 1 ('b'): cannot resolve the annotation of Hidden.table"
        ),
    ) as info:
        ps.pmap_microbatch(f, num_microbatches=1)(torch.zeros(1), value)
    assert str(info.value).endswith(
        "; or pass in_specs and kw_specs explicitly (annotations are then not read)"
    )
    # explicit specs: annotations are not read
    explicit = ps.pmap_microbatch(
        f, num_microbatches=1, in_specs=(S0, None), kw_specs={}, out_specs=R
    )
    with pytest.raises(NotImplementedError):
        explicit(torch.zeros(1), value)
    # a field given its spec by metadata need not resolve
    assert ps.specs_of(HiddenWithMetadata(torch.zeros(1))) == HiddenWithMetadata(S0)


def test_unresolvable_parameter_and_return_name_the_function():
    with pytest.raises(
        TypeError,
        match=re.escape(
            "shard_map(hidden_step): cannot resolve the annotation of parameter 'x' "
            "('Annotated[OrderedDict, S0]'): NameError: name 'OrderedDict' is not defined; make "
            "the name importable in module test_annotations_future at run time (not only under "
            "TYPE_CHECKING; a name defined inside a function cannot be found from a string "
            "annotation), or pass in_specs and kw_specs explicitly (annotations are then not "
            "read)"
        ),
    ):
        default_in_specs(hidden_step, (1,), {}, transform="shard_map")
    with pytest.raises(
        TypeError,
        match=re.escape(
            "shard_map(hidden_step): cannot resolve the return annotation "
            "('Annotated[OrderedDict, S0]'): NameError: name 'OrderedDict' is not defined;"
        ),
    ):
        default_out_specs(hidden_step, transform="shard_map")


def test_class_defined_in_a_function():
    @dataclasses.dataclass
    class Local:
        x: Annotated[torch.Tensor, S0]  # S0 is a module global: resolves
        y: Local2  # noqa: F821 - a local name: cannot resolve from a string

    with pytest.raises(
        TypeError,
        match=re.escape(
            "specs_of: cannot resolve the annotation of "
            "test_class_defined_in_a_function.<locals>.Local.y ('Local2'): NameError: name "
            "'Local2' is not defined;"
        ),
    ):
        ps.specs_of(Local(torch.zeros(1), None))


@dataclasses.dataclass
class SeqBatch:
    ids: Seq
    targets: Seq
    num_tokens: int


def seq_loss(params: dict, batch: SeqBatch) -> Annotated[torch.Tensor, ps.Partial("mean")]:
    pred = batch.ids.unsqueeze(-1) * params["w"]
    return (pred.sum(-1) - batch.targets).square().mean()


def test_pmap_microbatch_with_string_annotations():
    g = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(3, dtype=torch.float64, generator=g)}
    ids, targets = torch.randn(2, 2, 9, dtype=torch.float64, generator=g)
    batch = SeqBatch(ids, targets, 18)
    annotated = ps.pmap_microbatch(grad_and_value(seq_loss), num_microbatches=3)
    explicit = ps.pmap_microbatch(
        grad_and_value(seq_loss),
        num_microbatches=3,
        in_specs=(None, SeqBatch(S1, S1, None)),
        out_specs=ps.Partial("mean"),
    )
    reference = grad_and_value(seq_loss)(params, batch)
    for got in (annotated(params, batch), explicit(params, batch)):
        torch.testing.assert_close(got, reference)
    value = ps.pmap_microbatch(seq_loss, num_microbatches=3)(params, batch)
    torch.testing.assert_close(value, reference[1])


@ps.shard_map
def later_step(x: Annotated[torch.Tensor, S0]) -> Annotated[DefinedLater, S0]:
    return 2 * x


class DefinedLater:
    """Named by ``later_step``'s return annotation before it exists: read at the first call."""


def test_shard_map_return_annotation_naming_a_later_class():
    with ps.use_mesh(ps.init_mesh({"sp": 1})):
        assert torch.equal(later_step(torch.ones(3)), torch.full((3,), 2.0))
    assert default_out_specs(later_step.__wrapped__, transform="t") == S0
