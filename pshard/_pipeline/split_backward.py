"""A backward cut in two over one autograd graph: the input cotangent first, the weights'
later, without walking the graph twice (zero bubble's ``I`` and ``W``).

The stage runs once under autograd, its parameters and input as fresh leaves. Some nodes of
the graph lie on a path from the output to the input (*input nodes*); the weights hang off
them. The *cut* is made of the input nodes with an edge towards a weight that does not pass
through another input node. :meth:`SplitBackward.inputs` runs the graph from the output to
the input only (the engine skips the weights' branches: ``dW = x^T dy`` is not computed)
while a hook on each cut node keeps the cotangents arriving there; :meth:`SplitBackward.
weights` then runs from those cotangents (``torch.autograd.grad`` from
:class:`torch.autograd.graph.GradientEdge` s) to the weights alone. Outputs that do not
depend on the input start the weight pass themselves. torch.distributed.pipelining splits
its backward the same way (``stage_backward_input`` / ``stage_backward_weight``).

A node whose own backward computes every cotangent at once whatever is asked (a custom
``autograd.Function`` such as :func:`pshard.checkpoint`) on the cut runs in both passes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

__all__ = ["SplitBackward", "run_split"]


def _children(node: Node) -> list[Node]:
    return [child for child, _ in node.next_functions if child is not None]


def _node(root: Any) -> Node | None:
    """The node a backward root (a gradient edge or a tensor) starts at."""
    return root.node if isinstance(root, GradientEdge) else root.grad_fn


def _reaching(roots: Sequence[Node], goal: set[Node]) -> dict[Node, bool]:
    """For every node below ``roots``, whether a path leads from it to a node of ``goal``
    (an iterative post-order walk: graphs can be deep)."""
    memo: dict[Node, bool] = {}
    entered: set[Node] = set()
    for root in roots:
        stack: list[tuple[Node, bool]] = [(root, False)]
        while stack:
            node, done = stack.pop()
            if done:
                memo[node] = node in goal or any(memo[c] for c in _children(node))
            elif node not in entered:
                entered.add(node)
                stack.append((node, True))
                stack.extend((c, False) for c in _children(node) if c not in entered)
    return memo


class SplitBackward:
    """The two halves of one backward (see the module docs); each runs once."""

    def __init__(
        self,
        outputs: Sequence[torch.Tensor],
        params: Sequence[torch.Tensor],
        inputs: Sequence[torch.Tensor],
    ) -> None:
        # where each output's backward starts (its gradient edge: the output itself need not
        # stay alive), for those that require a gradient
        self._outputs: list[Any] = [
            get_gradient_edge(y) if y.grad_fn is not None else y for y in outputs if y.requires_grad
        ]
        self._mask = [y.requires_grad for y in outputs]
        self._params = list(params)
        self._inputs = list(inputs)
        # the weight pass: per group, where it starts (edges and their cotangents) and the
        # weights it reaches (indices into params)
        self._groups: list[tuple[list[GradientEdge], list[torch.Tensor], list[int]]] = []
        self._on_path: set[Node] = set()
        self._tied = False

    def _weights_below(self, node: Node, reaches_x: dict[Node, bool]) -> list[int]:
        """The weights reached from ``node`` through nodes off the input's paths."""
        index = {get_gradient_edge(p).node: i for i, p in enumerate(self._params)}
        found: set[int] = set()
        seen: set[Node] = set()
        stack = [c for c in _children(node) if not reaches_x.get(c, False)]
        while stack:
            n = stack.pop()
            if n in seen:
                continue
            seen.add(n)
            if n in index:
                found.add(index[n])
            stack.extend(_children(n))
        return sorted(found)

    def inputs(self, cts: Sequence[torch.Tensor]) -> tuple[torch.Tensor | None, ...]:
        """The input cotangent; keeps what the weight pass needs."""
        cts = [ct for ct, keep in zip(cts, self._mask, strict=True) if keep]
        roots = [n for n in map(_node, self._outputs) if n is not None]
        targets = {get_gradient_edge(x).node for x in self._inputs}
        reaches_x = _reaching(roots, targets)
        reaches_w = _reaching(roots, {get_gradient_edge(p).node for p in self._params})
        on_path = {n for n, hit in reaches_x.items() if hit and n not in targets}
        cut = {
            n: self._weights_below(n, reaches_x) for n in on_path
            if any(not reaches_x[c] and reaches_w[c] for c in _children(n))
        }  # fmt: skip
        kept: dict[Node, tuple[Any, ...]] = {}
        hooks = [
            n.register_prehook(lambda grads, n=n: kept.__setitem__(n, tuple(grads))) for n in cut
        ]
        try:
            grads = (
                torch.autograd.grad(
                    self._outputs, self._inputs, cts, retain_graph=True, allow_unused=True
                )
                if on_path
                else (None,) * len(self._inputs)
            )
        finally:
            for h in hooks:
                h.remove()
        for node, node_grads in kept.items():
            edges = [GradientEdge(node, i) for i, g in enumerate(node_grads) if g is not None]
            values = [g for g in node_grads if g is not None]
            self._groups.append((edges, values, cut[node]))
        for y, ct in zip(self._outputs, cts, strict=True):  # outputs off the input's paths
            start = _node(y)
            if start is None or start not in on_path:
                weights = {get_gradient_edge(p).node for p in self._params}
                below = _reaching([start], weights) if start is not None else {}
                reach = [i for i, p in enumerate(self._params)
                         if below.get(get_gradient_edge(p).node, False)]  # fmt: skip
                edge = y if isinstance(y, GradientEdge) else get_gradient_edge(y)
                self._groups.append(([edge], [ct], reach))
        counts: dict[int, int] = {}
        for _, _, idx in self._groups:
            for i in idx:
                counts[i] = counts.get(i, 0) + 1
        self._tied = any(c > 1 for c in counts.values())
        self._on_path = on_path
        return tuple(
            g if g is not None else torch.zeros_like(x)
            for g, x in zip(grads, self._inputs, strict=True)
        )

    def weights(self) -> tuple[torch.Tensor, ...]:
        """The weights' cotangents (zeros where they do not reach the output); frees the
        graph. Each group runs from its cut node to its own weights only, so the engine leaves
        the input's paths alone; a weight used at several cut nodes (tied) is reached from
        each, and the input's paths are then zeroed so that nothing is counted twice."""
        total: list[torch.Tensor | None] = [None] * len(self._params)
        for edges, values, idx in self._groups:
            if not idx:
                continue
            hooks = []
            if self._tied:
                starts = {e.node for e in edges}
                hooks = [
                    n.register_prehook(lambda grads: tuple(
                        None if g is None else torch.zeros_like(g) for g in grads))
                    for n in self._on_path if n not in starts
                ]  # fmt: skip
            try:
                got = torch.autograd.grad(
                    edges, [self._params[i] for i in idx], values,
                    retain_graph=True, allow_unused=True,
                )  # fmt: skip
            finally:
                for h in hooks:
                    h.remove()
            for i, g in zip(idx, got, strict=True):
                prev = total[i]
                if g is not None:
                    total[i] = g if prev is None else prev + g
        out = tuple(
            g if g is not None else torch.zeros_like(p)
            for g, p in zip(total, self._params, strict=True)
        )
        self._outputs, self._groups, self._on_path = [], [], set()
        return out


def run_split(
    call: Callable[[Sequence[torch.Tensor], Sequence[torch.Tensor]], tuple[Any, Any]],
    params: Sequence[torch.Tensor],
    inputs: Sequence[torch.Tensor],
) -> tuple[tuple[torch.Tensor, ...], Any, SplitBackward]:
    """``call(params, inputs) -> (differentiable outputs, other outputs)`` under autograd,
    on fresh leaves; the outputs (detached) and the :class:`SplitBackward` of the call."""
    with torch.enable_grad():
        p = [t.detach().requires_grad_() for t in params]
        x = [t.detach().requires_grad_() for t in inputs]
        floats, aux = call(p, x)
    split = SplitBackward(floats, p, x)
    return tuple(y.detach() for y in floats), aux, split
