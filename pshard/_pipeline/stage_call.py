"""One stage's forward on one microbatch under ``torch.func.vjp``, and its pullbacks.

:class:`StageParams` flattens a stage's parameter tree once per call (each
:class:`~pshard.GlobalTensor` as its block, as ``torch.func`` flattens it); :func:`run_stage`
runs ``fn(params, x)`` and returns its output with a :class:`Pullback`:

- ``mode="full"``: one ``torch.func.vjp`` with respect to the parameters and to ``x``; the
  pullback gives both cotangents at once (``B``).
- ``mode="split"`` (zero bubble): one forward under autograd whose backward is cut in two
  (:mod:`pshard._pipeline.split_backward`): :meth:`Pullback.inputs` gives ``x``'s cotangent
  (``I``), :meth:`Pullback.weights` the parameters' (``W``), each part of the graph run once.
- ``mode="none"``: the plain call (no gradient wanted).

Only floating-point (and complex) tensors are differentiated: integer leaves of the
parameters or of ``x`` are passed as they are (their gradient is ``None``), integer leaves of
the output travel beside the differentiated ones (``has_aux``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import optree
import torch
from optree import PyTreeSpec

from .._core.tree import NAMESPACE, tree_flatten
from .split_backward import SplitBackward, run_split

__all__ = ["Pullback", "StageParams", "differentiable", "flat", "run_stage"]


def differentiable(x: Any) -> bool:
    """A tensor ``torch.func`` can differentiate (floating point or complex)."""
    return isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex())


def flat(tree: Any) -> tuple[list[Any], PyTreeSpec]:
    """The leaves of ``tree`` with each ``GlobalTensor`` as its block (``torch.func``'s view)."""
    tree_flatten(tree)  # registers the Mappings and dataclasses not seen before
    return optree.tree_flatten(tree, namespace=NAMESPACE)


class StageParams:
    """A stage's parameters, flattened: the leaves, which are differentiated, the structure."""

    def __init__(self, tree: Any) -> None:
        self.leaves, self.treedef = flat(tree)
        self.wrt = [i for i, leaf in enumerate(self.leaves) if differentiable(leaf)]

    def float_leaves(self) -> tuple[torch.Tensor, ...]:
        return tuple(self.leaves[i] for i in self.wrt)

    def tree(self, grads: Sequence[torch.Tensor] | None) -> Any:
        """The gradient tree: ``grads`` in the differentiated places, ``None`` elsewhere
        (zeros where ``grads`` is ``None``: no microbatch ran)."""
        out: list[Any] = [None] * len(self.leaves)
        for k, i in enumerate(self.wrt):
            out[i] = torch.zeros_like(self.leaves[i]) if grads is None else grads[k]
        return optree.tree_unflatten(self.treedef, out)


def _rebuild(
    leaves: list[Any], where: list[int], values: Sequence[Any], treedef: PyTreeSpec
) -> Any:
    if where:
        leaves = list(leaves)
        for i, v in zip(where, values, strict=True):
            leaves[i] = v
    return optree.tree_unflatten(treedef, leaves)


class Pullback:
    """The backward of one stage call: ``both(ct)``, or ``inputs(ct)`` then ``weights(ct)``
    (``mode="split"``); each returns cotangents of the differentiated leaves, in order."""

    def __init__(
        self, full: Any = None, of_p: Any = None, split: SplitBackward | None = None
    ) -> None:
        self._full = full
        self._of_p = of_p
        self._split = split

    def both(self, ct: tuple[torch.Tensor, ...]) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        if self._full is None:  # a split call: both halves
            gx = self.inputs(ct)
            return self.weights(ct), gx
        # retain_graph=False: each node's saved tensors go as soon as it ran (torch.func's
        # default keeps them all until the pullback itself is dropped)
        gp, gx = self._full(ct, retain_graph=False)
        self._full = None
        return gp, gx

    def inputs(self, ct: tuple[torch.Tensor, ...]) -> tuple[Any, ...]:
        if self._split is None:
            return ()
        return self._split.inputs(ct)

    def weights(self, ct: tuple[torch.Tensor, ...]) -> tuple[Any, ...]:
        if self._split is not None:
            grads = self._split.weights()
            self._split = None
            return grads
        (gp,) = self._of_p(ct, retain_graph=False)
        self._of_p = None
        return tuple(gp)


def _vjp(fn: Callable[..., tuple[Any, Any]], *primals: Any) -> tuple[Any, Any, Any]:
    """``torch.func.vjp(fn, *primals, has_aux=True)``: (outputs, pullback, aux)."""
    out = torch.func.vjp(fn, *primals, has_aux=True)
    return out[0], out[1], out[2]  # type: ignore[misc]


class Output:
    """A stage call's output: its differentiated leaves (what the cotangent pairs with), the
    others, and how to rebuild the value."""

    def __init__(self, value: Any, floats: tuple[torch.Tensor, ...]) -> None:
        self.value = value
        self.floats = floats


def run_stage(
    fn: Callable[[Any, Any], Any],
    params: StageParams,
    x: Any,
    *,
    wrt_x: bool,
    mode: str,
) -> tuple[Output, Pullback | None]:
    """``fn(params, x)`` (see the module docs). ``wrt_x``: differentiate with respect to the
    floating leaves of ``x`` too (every stage but the first)."""
    x_leaves, x_def = flat(x)
    x_wrt = [i for i, leaf in enumerate(x_leaves) if differentiable(leaf)] if wrt_x else []
    shape: list[Any] = []  # the output's structure and its other leaves, set by the call

    def call(pf: Sequence[torch.Tensor], xf: Sequence[torch.Tensor]) -> tuple[Any, Any]:
        out = fn(
            _rebuild(params.leaves, params.wrt, pf, params.treedef),
            _rebuild(x_leaves, x_wrt, xf, x_def),
        )
        leaves, treedef = flat(out)
        floats = [i for i, leaf in enumerate(leaves) if differentiable(leaf)]
        others = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        others = [i for i in others if i not in floats]
        shape[:] = [treedef, floats, others, leaves]
        return tuple(leaves[i] for i in floats), tuple(leaves[i] for i in others)

    def result(floats: tuple[torch.Tensor, ...], aux: tuple[torch.Tensor, ...]) -> Output:
        treedef, where, others, leaves = shape
        leaves = list(leaves)
        for i, v in zip(where + others, floats + aux, strict=True):
            leaves[i] = v
        return Output(optree.tree_unflatten(treedef, leaves), floats)

    pf = params.float_leaves()
    xf = tuple(x_leaves[i] for i in x_wrt)
    if mode == "none":
        return result(*call(pf, xf)), None
    if mode == "full":
        floats, full, aux = _vjp(call, pf, xf)
        return result(floats, aux), Pullback(full=full)
    if not x_wrt:  # split, but nothing to send upstream: the weights' pullback alone
        floats, pull_p, aux = _vjp(lambda p: call(p, ()), pf)
        return result(floats, aux), Pullback(of_p=pull_p)
    floats, aux, split = run_split(call, pf, xf)  # one autograd graph, cut at the weights
    return result(floats, tuple(a.detach() for a in aux)), Pullback(split=split)
