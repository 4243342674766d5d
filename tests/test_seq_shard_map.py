"""shard_map_seq beyond the LM: composition with pmap_microbatch and vmap, nested sequence
contexts, and the errors it raises (with their messages pinned)."""

from __future__ import annotations

import re
from unittest import mock

import pytest
import torch
from test_seq_model import (
    BATCH_SPECS,
    PADS,
    init_params,
    local_loss,
    make_batch,
    microbatched_against_reference,
    sp_attention,
)

import pshard as ps
from pshard._core.tree import tree_leaves
from pshard._runtime import wire as _comm
from pshard.sequence._context import find_context
from pshard.sequence._layouts import SeqLayout


def _microbatch_worker() -> dict:
    ps.init_mesh({"sp": 2})
    params, batch = init_params(4, 1, seed=3), make_batch(4, 7, seed=5)
    got = microbatched_against_reference(sp_attention, params, batch)
    (grad, ref_grad), (value, ref_value) = got["grad"], got["value"]
    empty_value, empty_grad = got["empty"]
    close = all(
        torch.allclose(a, b, rtol=1e-9, atol=1e-12)
        for a, b in zip(tree_leaves(grad), tree_leaves(ref_grad), strict=True)
    )
    # vmap over the whole map: a batch of sequences, each split on its own
    xs = torch.randn(3, 2, 5, dtype=torch.float64)
    double = ps.shard_map_seq(
        lambda x: 2 * x * (1 + ps.seq_positions()),
        in_specs=ps.Shard(1),
        out_specs=ps.Shard(1),
        layout="stripe",
    )
    ys = torch.func.vmap(double)(xs)
    # an empty sequence: every token is padding on every rank; loss 0, gradients 0, no NaN
    return {
        "empty": empty_value.item() == 0.0
        and all(torch.equal(g, torch.zeros_like(g)) for g in tree_leaves(empty_grad)),
        "value": torch.allclose(value, ref_value, rtol=1e-12, atol=0),
        "grad": close,
        "vmap": torch.allclose(ys, 2 * xs * (1 + torch.arange(5.0, dtype=torch.float64))),
    }


def test_pmap_microbatch_and_vmap_around(pool) -> None:
    got = pool.run(2, _microbatch_worker)
    assert got == [{"empty": True, "value": True, "grad": True, "vmap": True}] * 2


def _nested_worker() -> list:
    ps.init_mesh({"a": 2, "b": 2})
    seen = []

    def inner(x):
        seen.append(("inner", ps.seq_positions().tolist(), ps.seq_positions("a").tolist()))
        return x

    def outer(x):
        y = ps.shard_map_seq(
            inner, axis="b", in_specs=ps.Shard(1), out_specs=ps.Shard(1), layout="zigzag"
        )(x)
        seen.append(("outer", ps.seq_positions().tolist(), find_context("b") is None))
        return y

    x = torch.arange(5.0).view(1, 5)
    y = ps.shard_map_seq(
        outer, axis="a", in_specs=ps.Shard(1), out_specs=ps.Shard(1), layout="stripe"
    )(x)
    seen.append(("after", find_context() is None, torch.equal(x, y)))
    return seen


def test_nested_contexts(pool) -> None:
    got = pool.run(4, _nested_worker)
    for rank, seen in enumerate(got):
        a, b = divmod(rank, 2)
        outer = list(SeqLayout("stripe", 5, 2).positions(a))
        inner = list(SeqLayout("zigzag", 3, 2).positions(b))
        assert seen == [
            ("inner", inner, outer),
            ("outer", outer, True),
            ("after", True, True),
        ]


def _errors_worker() -> dict:
    ps.init_mesh({"sp": 2})
    batch = {"input_ids": torch.zeros(2, 5, dtype=torch.long), "labels": torch.zeros(2, 6)}
    out = {}

    def run(name, call):
        try:
            call()
        except (ValueError, TypeError) as e:
            out[name] = f"{type(e).__name__}: {e}"

    ident = lambda b: b  # noqa: E731
    run(
        "dims",
        lambda: ps.shard_map_seq(
            ident, in_specs=({"input_ids": ps.Shard(2), "labels": None},), out_specs=ps.Shard(1)
        )(batch),
    )
    run(
        "lengths",
        lambda: ps.shard_map_seq(ident, in_specs=ps.Shard(1), out_specs=ps.Shard(1))(batch),
    )
    run("none", lambda: ps.shard_map_seq(ident, in_specs=None, out_specs=ps.Shard(1))(batch))
    x = torch.zeros(2, 5)
    run(
        "out_len",
        lambda: ps.shard_map_seq(lambda x: x[:, :1], in_specs=ps.Shard(1), out_specs=ps.Shard(1))(
            x
        ),
    )
    run(
        "strided",
        lambda: ps.shard_map_seq(
            lambda x: x, in_specs=ps.StridedShard(1, 2), out_specs=ps.Shard(1)
        )(x),
    )
    run(
        "partial_in",
        lambda: ps.shard_map_seq(lambda x: x, in_specs=ps.Partial(), out_specs=ps.Shard(1))(x),
    )
    run(
        "pad",
        lambda: ps.shard_map_seq(
            lambda x: x, in_specs=ps.Shard(1), out_specs=ps.Shard(1), pad_values="x"
        )(x),
    )
    run("layout", lambda: ps.shard_map_seq(lambda x: x, layout="ring", out_specs=ps.Shard(1)))
    params = init_params(3, 3)
    b = make_batch(1, 4, seed=0)
    run(
        "heads",
        lambda: ps.shard_map_seq(
            local_loss, in_specs=(None, BATCH_SPECS), out_specs=ps.Replicate(), pad_values=(0, PADS)
        )(params, b),
    )
    return out


def test_errors(pool) -> None:
    got = pool.run(2, _errors_worker)[0]
    assert got["dims"] == (
        "ValueError: shard_map_seq in_specs[0]['input_ids']: Shard(2) but the tensor has 2 dims "
        "(shape (2, 5)); did you mean Shard(1)?"
    )
    assert got["lengths"] == (
        "ValueError: shard_map_seq in_specs[0]['labels']: Shard(1) splits a sequence of 6 tokens "
        "(shape (2, 6)) but in_specs[0]['input_ids']: Shard(1) splits one of 5 (shape (2, 5)); "
        "every Shard input must be the same sequence: pad them to one length, or give the other "
        "inputs Replicate()"
    )
    assert got["none"].startswith(
        "ValueError: shard_map_seq(<lambda>): no input has a Shard(d) spec"
    )
    assert got["out_len"] == (
        "ValueError: shard_map_seq out_specs: Shard(1) but fn returned 1 tokens along dim 1 "
        "(shape (2, 1)) on a rank that holds 3 (a sequence of 5 on 2 ranks, contiguous layout, "
        "padding included); a Shard output has one entry per local token"
    )
    assert got["strided"] == (
        "ValueError: shard_map_seq in_specs[0]: StridedShard(1, split_factor=2) is not a "
        "sequence spec; shard_map_seq splits one sequence dim over its axis: use Shard(d), "
        "Replicate() or None (use ps.shard_map for other layouts)"
    )
    assert got["partial_in"].startswith(
        "ValueError: shard_map_seq in_specs[0]: Partial('sum') is not a sequence spec"
    )
    assert got["pad"] == (
        "TypeError: shard_map_seq pad_values[0]: a pad value must be a number (or None for 0), "
        "got a str ('x')"
    )
    assert got["layout"] == (
        "ValueError: shard_map_seq: layout must be one of 'contiguous', 'zigzag', 'stripe', got "
        "'ring'"
    )
    assert got["heads"].startswith(
        "ValueError: ulysses_attention: q has 3 heads (head_dim=2, shape (1, 2, 3, 2)), which do "
        "not divide by the size 2 of axis 'sp'"
    )


def test_out_specs_required() -> None:
    with pytest.raises(
        TypeError,
        match=re.escape("shard_map_seq(<lambda>): out_specs omitted and <lambda> has no return"),
    ):
        ps.shard_map_seq(lambda x: x, in_specs=ps.Shard(1))


def _axis_order_worker(axis: tuple[str, str], layout: str) -> dict:
    ps.init_mesh({"a": 2, "b": 2})
    x = torch.arange(22.0, dtype=torch.float64).view(1, 11, 2).requires_grad_(True)
    ct = torch.linspace(-1, 1, 22, dtype=torch.float64).view(1, 11, 2)

    def body(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # each token with the position the map says it holds; padding slots are 0 and say >= 11
        held = 2 * ps.seq_positions().to(t.dtype)
        return t * 3, torch.where(held < 22, t[..., 0] - held, torch.zeros_like(held))

    y, off = ps.shard_map_seq(
        body, axis=axis, layout=layout, in_specs=ps.Shard(1), out_specs=ps.Shard(1)
    )(x)
    q = torch.randn(1, 11, 2, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    att = ps.shard_map_seq(
        lambda q: ps.ring_attention(q, q, q, axis=axis, causal=True),
        axis=axis, layout=layout, in_specs=ps.Shard(1), out_specs=ps.Shard(1),
    )(q)  # fmt: skip
    (grad,) = torch.autograd.grad((y * ct).sum(), x)
    full = torch.nn.functional.scaled_dot_product_attention(
        *(q.transpose(1, 2),) * 3, is_causal=True
    ).transpose(1, 2)
    return {
        "round trip": torch.equal(y, 3 * x),
        "positions": bool((off == 0).all()),
        "grad": torch.equal(grad, 3 * ct),
        "attention": torch.allclose(att, full, rtol=1e-12, atol=1e-12),
    }


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("axis", [("a", "b"), ("b", "a")])
def test_tuple_axis_in_any_order(pool, axis, layout) -> None:
    """A tuple of mesh axes splits the sequence in the order given (the first name major), not
    the mesh's: the tokens a rank holds, the positions it is told, the gathered output and the
    gradient of the whole input agree, and ring attention over the tuple equals full attention.
    (Given out of the mesh's order, the tokens and the positions used to disagree silently.)"""
    for got in pool.run(4, _axis_order_worker, axis, layout):
        assert got == {"round trip": True, "positions": True, "grad": True, "attention": True}


def _usp_mesh_order_worker(mesh_shape: dict, layout: str) -> bool:
    ps.init_mesh(mesh_shape)
    q = torch.randn(1, 13, 4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    got = ps.shard_map_seq(
        lambda q: ps.usp_attention(
            q, q, q, ulysses_axis="uly", ring_axis="ring", causal=True
        ),
        axis=("ring", "uly"), layout=layout, in_specs=ps.Shard(1), out_specs=ps.Shard(1),
    )(q)  # fmt: skip
    full = torch.nn.functional.scaled_dot_product_attention(
        *(q.transpose(1, 2),) * 3, is_causal=True
    ).transpose(1, 2)
    return torch.allclose(got, full, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_usp_on_a_mesh_of_the_other_order(pool, layout) -> None:
    """usp_attention over axis ("ring", "uly") equals full attention whichever order the mesh
    lists the two axes in (on a {"uly", "ring"} mesh it used to differ, silently)."""
    for shape in ({"ring": 2, "uly": 2}, {"uly": 2, "ring": 2}):
        assert pool.run(4, _usp_mesh_order_worker, shape, layout) == [True] * 4, shape


def test_compiled_maps_refuse_a_tuple_out_of_mesh_order() -> None:
    """Under torch.compile the blocks are shard_map's (mesh order): a tuple in another order is
    refused with an error naming both orders; the mesh's order passes."""
    from types import SimpleNamespace

    from pshard.sequence._shard_map_seq import check_mesh_order

    mesh = SimpleNamespace(mesh_dim_names=("a", "b", "c"))
    check_mesh_order(("a", "c"), mesh)
    with pytest.raises(
        NotImplementedError,
        match=re.escape("('c', 'a') must be given in the mesh's order ('a', 'c')"),
    ):
        check_mesh_order(("c", "a"), mesh)


def _strides_worker(layout: str) -> dict:
    ps.init_mesh({"sp": 2})
    x = torch.arange(26.0, dtype=torch.float64).view(1, 13, 2).requires_grad_(True)
    ct = torch.linspace(-1, 1, 26, dtype=torch.float64).view(1, 13, 2)

    def body(t: torch.Tensor) -> torch.Tensor:
        if ps.axis_index("sp") == 0:  # the same values, in other strides, on one rank only
            return (t * 3).transpose(1, 2).contiguous().transpose(1, 2)
        return t * 3

    # every gather pairwise, as large ones are: the runs go straight into place
    with mock.patch.object(_comm, "PAIRWISE_GATHER_BYTES", 0):
        y = ps.shard_map_seq(body, layout=layout, in_specs=ps.Shard(1), out_specs=ps.Shard(1))(x)
        (grad,) = torch.autograd.grad((y * ct).sum(), x)
    return {"out": torch.equal(y, 3 * x), "grad": torch.equal(grad, 3 * ct)}


@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "stripe"])
def test_outputs_of_rank_dependent_strides(pool, layout) -> None:
    """An output (or its cotangent) contiguous on one rank and strided on another is gathered
    and placed like any other: every rank takes the same path, decided from what they share
    (a path chosen by strides left the ranks in different exchanges)."""
    assert pool.run(2, _strides_worker, layout, timeout=30.0) == [{"out": True, "grad": True}] * 2


class _Boom(torch.autograd.Function):
    """The identity, whose backward raises."""

    @staticmethod
    def forward(x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        pass

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("boom")


class _Call:
    """A call state whose backward scope counts how often it began and was undone."""

    def __init__(self) -> None:
        self.attended, self.attention = 0, None
        self.begun = self.undone = 0

    def backward_scope(self):
        self.begun += 1

        def undo() -> None:
            self.undone += 1

        return undo


@pytest.mark.parametrize("fails", [False, True])
def test_contexts_recorded_for_a_backward_pass_end_with_it(fails: bool) -> None:
    """A context recorded for the backward pass is found during the pass, and gone with what it
    changed undone when the pass ends: after a pass that succeeds, and after one that raises
    (the engine runs no end-of-pass callbacks then)."""
    from pshard._modules import passes
    from pshard.sequence._context import SeqContext, record_for_backward

    call = _Call()
    ctx = SeqContext(("sp",), SeqLayout("zigzag", 6, 2), 0, torch.device("cpu"), None, call)
    found = []

    class _Look(torch.autograd.Function):  # the identity; its backward looks the context up
        @staticmethod
        def forward(x: torch.Tensor) -> torch.Tensor:
            return x.view_as(x)

        @staticmethod
        def setup_context(c, inputs, output) -> None:
            pass

        @staticmethod
        def backward(c, g: torch.Tensor) -> torch.Tensor:
            found.append(find_context("sp") is ctx)
            return g

    x = torch.ones(3, requires_grad=True)
    inner = _Look.apply(_Boom.apply(x) if fails else x)
    y = record_for_backward(inner * 2, ctx)
    if fails:
        with pytest.raises(RuntimeError, match="boom"):
            y.sum().backward()
    else:
        y.sum().backward()
    assert found == [True]  # during the pass
    assert find_context("sp") is None and not passes._PASSES  # after it
    assert (call.begun, call.undone) == (1, 1)
