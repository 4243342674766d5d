"""``ps.pipeline``: a pipeline's forward as a differentiable function (GPipe under autodiff).

The forward runs every microbatch through the stages (the forwards of the ``"gpipe"``
schedule, each under ``torch.func.vjp``), concatenates the last stage's outputs and
broadcasts them to every rank of the axis. It is one ``torch.autograd.Function``
(:class:`_Pipeline`) whose inputs are this rank's parameters and the inputs; its backward
runs the schedule's backwards: the last rank takes its own cotangent of the outputs (they
are replicated, shard_map's convention), each rank returns its stage's parameters'
gradient, and rank 0's gradient of the inputs is broadcast to every rank. So
``torch.func.grad``, ``torch.func.vjp`` and ``.backward()`` give each rank the one-process
gradient of its stage's parameters.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import optree
import torch

from .. import _compat as compat
from .._core.checks import check_int
from .._runtime.mesh import Axis
from .._runtime.tracing import refuse
from .executor import Executor
from .setup import Prepared, check_stages, prepare
from .stage_call import differentiable, flat
from .transport import HEADER_LEN, Layout

__all__ = ["pipeline"]

_FN = "pipeline"

Stages = Callable[..., Any] | Sequence[Callable[..., Any]]


class _Run:
    """One call: what the forward needs to rebuild its arguments, and what the backward
    needs of the forward (its executor)."""

    def __init__(
        self,
        stages: Stages,
        axis: Axis,
        num_microbatches: int,
        in_specs: Any,
        params: tuple[list[Any], Any, list[int]],
        inputs: tuple[list[Any], Any, list[int]],
        grad: bool,
    ) -> None:
        self.stages = stages
        self.axis = axis
        self.num_microbatches = num_microbatches
        self.in_specs = in_specs
        self.params = params
        self.inputs = inputs
        self.grad = grad
        self.ex: Executor | None = None
        self.prep: Prepared | None = None
        self.layout: Layout | None = None
        self.out_sizes: list[int] = []
        self.done = False

    @staticmethod
    def _tree(part: tuple[list[Any], Any, list[int]], values: Sequence[torch.Tensor]) -> Any:
        leaves, treedef, where = part
        leaves = list(leaves)
        for i, v in zip(where, values, strict=True):
            leaves[i] = v
        return optree.tree_unflatten(treedef, leaves)

    def forward(self, tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        n_p = len(self.params[2])
        params = self._tree(self.params, tensors[:n_p])
        inputs = self._tree(self.inputs, tensors[n_p:])
        prep = prepare(
            fn_name=_FN,
            stages=self.stages,
            params=params,
            axis=self.axis,
            schedule="gpipe",
            num_microbatches=self.num_microbatches,
            parts=[(inputs, self.in_specs, "in_specs")],
        )
        (mbs,) = prep.microbatches.parts
        last = prep.schedule.num_stages - 1
        fns = dict(prep.fns)
        if 0 in fns:  # called with the inputs as arguments
            first = fns[0]
            fns[0] = lambda p, x: first(p, *x)
        if last in fns:
            head = fns[last]
            fns[last] = lambda p, x, m: head(p, x)
        mode = "vjp" if self.grad else "none"  # torch.func.vjp: any enclosing transform
        ex = prep.executor(_FN, fns, mbs, mode=mode, input_grads=self.grad)
        self.ex, self.prep = ex, prep
        ex.run("F")
        out: tuple[torch.Tensor, ...] = ()
        link = prep.link
        d = prep.microbatches.split_dim
        if last in fns and ex.failure is None:
            out = self._concatenate(ex, d, last)
        ints = [0] * HEADER_LEN
        if last in fns and ex.failure is None and self.layout is not None:
            code = self.layout.encode() or []
            ints[: len(code) + 1] = [1, *code]
        meta = [int(v) for v in ex.status([float(i) for i in ints])]
        layout = Layout.decode(meta[1:])
        self.layout = layout
        if link.group is None:
            return out
        src = link.size - 1
        bufs = out if link.rank == src else tuple(
            torch.empty(shape, dtype=dtype, device=link.device) for dtype, shape in layout.leaves
        )  # fmt: skip
        return tuple(link.broadcast(b.to(link.device).contiguous(), src) for b in bufs)

    def _concatenate(self, ex: Executor, d: int, last: int) -> tuple[torch.Tensor, ...]:
        """The last stage's outputs, concatenated over microbatches along ``d``."""
        values = [ex.outputs[m] for m in range(len(ex.sizes))]
        layouts = [Layout.of(v) if _sendable(v) else None for v in values]
        if any(lay is None for lay in layouts) or any(
            len(s) <= d
            for lay in layouts
            for _, s in lay.leaves  # type: ignore[union-attr]
        ):
            bad = next(v for v, lay in zip(values, layouts, strict=True) if lay is None or any(
                len(s) <= d for _, s in lay.leaves))  # fmt: skip
            ex.fail(1, last, (
                f"{_FN}: the last stage (stage {last}) returned {_text(bad)}; its outputs are "
                f"concatenated over microbatches along the split dim {d}, so it must return a "
                f"tensor or a tuple of tensors with more than {d} dims"
            ))  # fmt: skip
            return ()
        tensors = [lay.tensors(v) for v, lay in zip(values, layouts, strict=True)]  # type: ignore[union-attr]
        per_leaf = list(zip(*tensors, strict=True))
        self.out_sizes = [t.shape[d] for t in per_leaf[0]]
        out = tuple(torch.cat(list(ts), d) for ts in per_leaf)
        self.layout = Layout(layouts[0].is_tuple, tuple((t.dtype, tuple(t.shape)) for t in out))  # type: ignore[union-attr]
        return out

    def backward(self, cts: Sequence[torch.Tensor], needs_x: Sequence[bool]) -> list[Any]:
        ex, prep = self.ex, self.prep
        assert ex is not None and prep is not None and self.layout is not None
        if self.done:
            raise RuntimeError(
                f"{_FN}: the backward ran twice; the pipeline frees each microbatch's "
                f"activations as its backward runs (retain_graph=True is not supported: call "
                f"the pipeline again)"
            )
        self.done = True
        last = prep.schedule.num_stages - 1
        d = prep.microbatches.split_dim
        if last in ex.fns and ex.failure is None:
            floats = [
                ct for ct, (dtype, _) in zip(cts, self.layout.leaves, strict=True)
                if dtype.is_floating_point or dtype.is_complex
            ]  # fmt: skip
            pieces = [ct.split(self.out_sizes, d) for ct in floats]
            for m in range(len(self.out_sizes)):
                ex.out_cts[m] = tuple(p[m] for p in pieces)
        ex.run("B")
        counts = ex.status([float(b) for b in needs_x])
        link = prep.link
        if any(0 < c < link.size for c in counts):
            raise ValueError(
                f"{_FN}: the ranks of axis {prep.axis_name!r} differ on which inputs need a "
                f"gradient (requires_grad); the inputs must be the same on every rank"
            )
        (stage,) = prep.stages
        got = ex.gradients(stage)
        grads: list[Any] = list(got) if got is not None else [None] * len(self.params[2])
        return grads + self._input_grads(ex, prep, [c > 0 for c in counts])

    def _input_grads(self, ex: Executor, prep: Prepared, wanted: list[bool]) -> list[Any]:
        """The inputs' gradients (rank 0's, broadcast): concatenated over microbatches where
        the input was cut, summed where it was passed whole."""
        link = prep.link
        leaves, _, where = self.inputs
        dims = prep.microbatches.dims
        out: list[Any] = []
        for k, i in enumerate(where):
            if not wanted[k]:
                out.append(None)
                continue
            if link.rank == 0:
                per_mb = [ex.input_cts[m][k] for m in range(len(ex.sizes))]
                dim = dims[i]
                g = torch.cat(per_mb, dim) if dim is not None else sum(per_mb[1:], per_mb[0])
            else:
                g = torch.empty_like(leaves[i], device=link.device)
            out.append(link.broadcast(g.to(link.device).contiguous(), 0) if link.group else g)
        return out


def _sendable(v: Any) -> bool:
    return isinstance(v, torch.Tensor) or (
        isinstance(v, tuple) and bool(v) and all(isinstance(t, torch.Tensor) for t in v)
    )


def _text(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        return f"a tensor of shape {tuple(v.shape)}"
    return f"a {type(v).__name__}"


class _Pipeline(torch.autograd.Function):
    @staticmethod
    def forward(run: _Run, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return run.forward(tensors)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        run = inputs[0]
        ctx.run = run
        assert run.layout is not None
        ctx.mark_non_differentiable(*(
            t for t, (dtype, _) in zip(output, run.layout.leaves, strict=True)
            if not (dtype.is_floating_point or dtype.is_complex)
        ))  # fmt: skip

    @staticmethod
    def backward(ctx: Any, *cts: torch.Tensor) -> tuple[Any, ...]:
        run: _Run = ctx.run
        n_p = len(run.params[2])
        needs_x = list(ctx.needs_input_grad[1 + n_p :])
        return (None, *run.backward(cts, needs_x))


def _split(tree: Any) -> tuple[list[Any], Any, list[int]]:
    leaves, treedef = flat(tree)
    return leaves, treedef, [i for i, leaf in enumerate(leaves) if differentiable(leaf)]


def pipeline(
    stages: Stages,
    *,
    axis: Axis = "pp",
    num_microbatches: int,
    in_specs: Any = None,
) -> Callable[..., Any]:
    """A model cut into stages along ``axis``, as one differentiable function.

    Rank ``r`` of ``axis`` (``N`` ranks) runs stage ``r``: ``stages`` is one function
    ``stage(params, x) -> y`` for every stage or a list of ``N`` of them; the first is called
    as ``stage(params, *inputs)`` on each microbatch of the inputs (cut along dim 0 by
    ``torch.chunk``'s sizes, or as ``in_specs`` says), the others on the previous stage's
    output (a tensor or a tuple of tensors). The last stage's outputs, concatenated over
    microbatches along the split dim, are returned on every rank of the axis::

        def fn(params, *inputs):                 # params: this rank's stage's
            return cat([stages[N-1](p_N-1, ... stages[0](p_0, *x)) for x in chunk(inputs)])

    It is differentiable under ``torch.func.grad``, ``torch.func.vjp`` and ``.backward()``:
    the outputs' cotangent is taken as replicated over the axis (shard_map's convention: every
    rank differentiates the same function of the outputs), the stages' backwards run in
    reverse (GPipe: every microbatch's activations are kept until the backward), and each rank
    gets the one-process gradient of its stage's parameters, and of the inputs. Every rank of
    the axis must run the backward (it sends and receives). Under ``torch.no_grad()`` nothing
    is kept. For training, :func:`pshard.pipeline_value_and_grad` runs better schedules.

    Args:
        stages: one function shared by every stage, or a list of ``N`` functions.
        axis: the mesh axis along which the stages lie.
        num_microbatches: how many microbatches (``>= 1``).
        in_specs: how to cut the inputs (a prefix tree of the positional inputs, in
            :func:`pshard.pmap_microbatch`'s spec language); default ``Shard(0)`` for
            tensors with a dim.

    Returns:
        ``fn(params, *inputs) -> outputs``, ``params`` this rank's stage's pytree.

    Raises:
        TypeError: ``stages`` is not a function or a list of functions.
        ValueError: on every rank: a count of stage functions other than the axis size, inputs
            that cannot be cut, a stage whose output dtype or shape beyond the split dim
            changes between microbatches (naming it), a last stage whose outputs cannot be
            concatenated.

    Example:
        >>> import torch, pshard as ps
        >>> mesh = ps.init_mesh({"pp": 1})
        >>> model = ps.pipeline(lambda w, x: torch.tanh(x @ w), num_microbatches=2)
        >>> w = torch.eye(3, requires_grad=True)
        >>> y = model(w, torch.ones(4, 3))
        >>> y.sum().backward()
        >>> y.shape, w.grad.shape
        (torch.Size([4, 3]), torch.Size([3, 3]))
    """
    refuse(_FN, "its schedule sends between stages as it goes (jit each stage's function)")
    check_stages(stages, _FN)
    count = check_int(_FN, "num_microbatches", num_microbatches, minimum=1)

    def fn(params: Any, *inputs: Any) -> Any:
        p_part, x_part = _split(params), _split(inputs)
        tensors = [p_part[0][i] for i in p_part[2]] + [x_part[0][i] for i in x_part[2]]
        grad = compat.transforms_active() or (
            torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
        )
        run = _Run(stages, axis, count, in_specs, p_part, x_part, grad)
        if not grad:
            out = run.forward(tensors)
        else:
            out = _Pipeline.apply(run, *tensors)
        assert run.layout is not None
        return run.layout.build(list(out))

    return fn
