"""One stage's forward on one microbatch, and its pullbacks.

:class:`StageParams` flattens a stage's parameter tree once per call (each
:class:`~pshard.GlobalTensor` as its block, as ``torch.func`` flattens it); :func:`run_stage`
runs ``fn(params, x)`` and returns its output with a :class:`Pullback`:

- ``mode="full"``: the forward under autograd, on the parameters as autograd leaves made
  once per call and ``x`` as a fresh leaf; the pullback (``B``) adds the parameters'
  cotangents into their leaves' ``.grad`` as the engine makes them and frees each node's
  saved tensors as it runs, as ``.backward()`` does (its memory: one parameter's cotangent at
  a time next to the sum), and returns ``x``'s.
- ``mode="vjp"``: ``torch.func.vjp`` with respect to the parameters and ``x``; the pullback
  returns both. ``"full"`` and ``"split"`` run this way too under an enclosing ``torch.func``
  transform.
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
from torch.autograd.graph import get_gradient_edge

from .. import _compat as compat
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
    """A stage's parameters, flattened: the leaves, which are differentiated, the structure;
    and, made once per call, the differentiated leaves as autograd leaves (every
    microbatch's backward adds into their ``.grad``, as ``.backward()`` accumulates)."""

    def __init__(self, tree: Any) -> None:
        self.leaves, self.treedef = flat(tree)
        self.wrt = [i for i, leaf in enumerate(self.leaves) if differentiable(leaf)]
        self._autograd: list[torch.Tensor] | None = None

    def float_leaves(self) -> tuple[torch.Tensor, ...]:
        return tuple(self.leaves[i] for i in self.wrt)

    def autograd_leaves(self) -> list[torch.Tensor]:
        if self._autograd is None:
            self._autograd = [t.detach().requires_grad_() for t in self.float_leaves()]
        return self._autograd

    def accumulated(self) -> list[torch.Tensor | None] | None:
        """What the backwards added into the autograd leaves (None: none were made)."""
        return None if self._autograd is None else [t.grad for t in self._autograd]

    def tree(self, grads: Sequence[torch.Tensor | None] | None) -> Any:
        """The gradient tree: ``grads`` in the differentiated places (zeros for ``None``:
        nothing reached it), ``None`` elsewhere."""
        out: list[Any] = [None] * len(self.leaves)
        for k, i in enumerate(self.wrt):
            g = None if grads is None else grads[k]
            out[i] = torch.zeros_like(self.leaves[i]) if g is None else g
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
        self,
        full: Any = None,
        of_p: Any = None,
        split: SplitBackward | None = None,
        graph: tuple[list[Any], list[torch.Tensor], list[torch.Tensor]] | None = None,
    ) -> None:
        self._full = full
        self._of_p = of_p
        self._split = split
        self._graph = graph

    def _autograd(self, ct: tuple[torch.Tensor, ...], weights: bool) -> tuple[Any, ...]:
        """The backward of an autograd graph: the parameters' cotangents added into their
        leaves' ``.grad``, the input's returned."""
        assert self._graph is not None
        roots, leaves, xs = self._graph
        self._graph = None
        pairs = [(y, c) for y, c in zip(roots, ct, strict=True) if y is not None]
        wrt = [*leaves, *xs] if weights else xs
        if pairs and wrt:
            torch.autograd.backward([y for y, _ in pairs], [c for _, c in pairs], inputs=wrt)
        return tuple(torch.zeros_like(x) if x.grad is None else x.grad for x in xs)

    def both(self, ct: tuple[torch.Tensor, ...]) -> tuple[tuple[Any, ...] | None, tuple[Any, ...]]:
        """The parameters' cotangents (``None``: added into the autograd leaves) and the
        input's."""
        if self._graph is not None:
            return None, self._autograd(ct, weights=True)
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

    def weights(self, ct: tuple[torch.Tensor, ...]) -> tuple[Any, ...] | None:
        if self._graph is not None:
            self._autograd(ct, weights=True)
            return None
        if self._split is not None:
            grads = self._split.weights()
            self._split = None
            return grads
        (gp,) = self._of_p(ct, retain_graph=False)
        self._of_p = None
        return tuple(gp)


def _roots(outputs: Sequence[torch.Tensor]) -> list[Any]:
    """Where each output's backward starts, without keeping the output itself alive (its
    gradient edge; ``None`` where it does not require a gradient)."""
    return [
        None if not y.requires_grad else y if y.grad_fn is None else get_gradient_edge(y)
        for y in outputs
    ]


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
    if mode == "vjp" or (mode != "none" and compat.transforms_active()):
        floats, full, aux = _vjp(call, pf, xf)
        return result(floats, aux), Pullback(full=full)
    if mode == "full" or not x_wrt:  # zero bubble's first stage: the weights' backward alone
        leaves = params.autograd_leaves()
        with torch.enable_grad():
            xs = [t.detach().requires_grad_() for t in xf]
            floats, aux = call(leaves, xs)
        detached = tuple(y.detach() for y in floats)
        return result(detached, tuple(a.detach() for a in aux)), Pullback(
            graph=(_roots(floats), leaves, xs)
        )
    floats, aux, split = run_split(call, pf, xf)  # one autograd graph, cut at the weights
    return result(floats, tuple(a.detach() for a in aux)), Pullback(split=split)
