"""``ps.checkpoint`` inside a ``ps.jit`` program: what the policy does not keep is computed
again in the program's backward, as eager code computes it again.

**Recording** (:func:`recording`, :func:`call`). While ``ps.jit`` traces, a checkpointed call
runs its function once, as if it were not checkpointed, and marks the nodes its forward added
to the program: a *region*, with its policy, the nodes of its results, and the values named
with :func:`pshard.checkpoint_name`. A region inside a region belongs to both; the innermost
one's policy decides.

**Rewriting** (:func:`rematerialize`), once the trace is done. The program is first made
functional (traced again through functionalization: no value changes after it is made, so a
value computed again is the value computed the first time). Then, for each outermost region:

- *kept*: its results, what its policies keep (``policy(op, *args, **kwargs)`` as in eager
  code, asked with the op of the node and the fake values of its arguments; a named value
  ``policy(checkpoint_name, x, name=name)``), and its random draws (the program keeps the
  forward's numbers instead of drawing them again: the same numbers as eager code, which
  draws them again from the forward's generator state; the generator is untouched);
- every other value of the region that the backward reads (the nodes made while autograd
  ran a backward; later forward code reads the forward's value) is computed again, with
  everything it needs inside the region, just before the first node of the backward that
  reads it; collectives among them are issued again (a node of their own);
- what that recompute reads (the region's inputs and the values kept) passes through
  ``pshard::remat_barrier``, an op that copies them once the backward has reached that point:
  compilers can neither merge the recompute with the forward (its inputs are new values) nor
  move it before the backward needs it (JAX's ``optimization_barrier``).

An ``offload`` policy keeps what it saves on the device in a program (no copies to the CPU).

Internal interface: :func:`recording`, :func:`recording_active`, :func:`call`,
:func:`rematerialize`, :class:`Regions`.
"""

from __future__ import annotations

import contextlib
import contextvars
import operator
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.fx import Graph, GraphModule, Node

from .. import _compat as compat
from .function import flatten
from .names import NAMER, checkpoint_name
from .ops import op_kind
from .policies import Policy

__all__ = ["Regions", "call", "recording", "recording_active", "rematerialize"]

_TAG = "pshard_remat"  # node.meta key: the regions a node belongs to, outermost first
_OUT = "pshard_remat_out"  # the regions whose result the node is
_NAMES = "pshard_remat_names"  # names given with checkpoint_name
_BACKWARD = "pshard_remat_backward"  # made while autograd ran a backward
_KEYS = (_TAG, _OUT, _NAMES, _BACKWARD)


@torch.library.custom_op("pshard::remat_barrier", mutates_args=())
def _barrier(xs: list[torch.Tensor], after: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of ``xs``, made once ``after`` exist (see the module docs)."""
    return [x.clone() for x in xs]


@_barrier.register_fake
def _(xs: list[torch.Tensor], after: list[torch.Tensor]) -> list[torch.Tensor]:
    return [x.clone() for x in xs]


class Regions:
    """The checkpointed calls of one trace: the policy of each, by index."""

    def __init__(self) -> None:
        self.policies: list[Policy] = []
        self.watched: set[int] = set()  # the tracers whose new nodes are marked

    def watch(self, tracer: Any) -> None:
        """Mark the nodes ``tracer`` makes while autograd runs a backward (its readers)."""
        if id(tracer) in self.watched:
            return
        self.watched.add(id(tracer))

        def seen(node: Node) -> None:
            if compat.graph_task_id() != -1:
                node.meta[_BACKWARD] = True

        compat.on_new_nodes(tracer, seen)


_REGIONS: contextvars.ContextVar[Regions | None] = contextvars.ContextVar(
    "pshard_remat_regions", default=None
)


@contextlib.contextmanager
def recording() -> Iterator[Regions]:
    """Checkpointed calls in the block are recorded as regions of the program being traced."""
    regions = Regions()
    token = _REGIONS.set(regions)
    try:
        yield regions
    finally:
        _REGIONS.reset(token)


def recording_active() -> bool:
    """Whether a program is being traced with its checkpointed calls recorded."""
    return _REGIONS.get() is not None


def call(
    fn: Callable[..., Any], policy: Policy, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """``fn(*args, **kwargs)`` run once, its nodes marked as a region with ``policy``."""
    regions = _REGIONS.get()
    found = compat.graph_in_trace()
    if regions is None or found is None:
        return fn(*args, **kwargs)
    graph, tracer = found
    regions.watch(tracer)
    index = len(regions.policies)
    regions.policies.append(policy)

    def name(x: torch.Tensor, label: str) -> None:
        # the name is the value's, and that of what its data was viewed or copied from (the
        # gather whose output a unit's weights are slices of)
        node: Node | None = compat.node_of(x, tracer)
        while node is not None:
            node.meta[_NAMES] = (*node.meta.get(_NAMES, ()), label)
            node = _copied(node)

    before = compat.last_node(graph)
    token = NAMER.set(name)
    try:
        out = fn(*args, **kwargs)
    finally:
        NAMER.reset(token)
    for node in compat.nodes_after(graph, before):
        node.meta[_TAG] = (index, *node.meta.get(_TAG, ()))
    leaves, _ = flatten(out)
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            made = compat.node_of(leaf, tracer)
            if made is not None:
                made.meta[_OUT] = (*made.meta.get(_OUT, ()), index)
    return out


# --- the rewrite ----------------------------------------------------------------------------------


def rematerialize(
    gm: GraphModule, regions: Regions, renamed: Callable[[Node, int], tuple[Any, ...] | None]
) -> GraphModule:
    """``gm`` with what its regions' policies do not keep computed again where the rest of the
    program reads it (see the module docs); ``gm`` itself when it has no region or no
    backward.

    ``renamed(node, k)`` gives the arguments of the ``k``-th copy of a node that needs others
    (a collective issued again has a key of its own), or ``None``."""
    traced = gm.graph.nodes
    if not any(_TAG in n.meta for n in traced) or not any(_BACKWARD in n.meta for n in traced):
        return gm  # no checkpoint, or nothing differentiated: nothing to compute again

    def made(old: Node, new: list[Node]) -> None:
        for key in _KEYS:
            if key in old.meta:
                for n in new:
                    n.meta[key] = old.meta[key]

    gm = compat.retrace_functional(gm, made)
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    members: dict[int, list[Node]] = {}
    for n in graph.nodes:
        tags = n.meta.get(_TAG)
        if tags:
            members.setdefault(tags[0], []).append(n)
    copies = [0]
    for region, nodes in members.items():
        _recompute(graph, region, nodes, regions, order, renamed, copies)
    graph.lint()
    gm.recompile()
    return gm


def _recompute(
    graph: Graph,
    region: int,
    nodes: list[Node],
    regions: Regions,
    order: dict[Node, int],
    renamed: Callable[[Node, int], tuple[Any, ...] | None],
    copies: list[int],
) -> None:
    """Rewrite one outermost region (see the module docs)."""
    inside = set(nodes)
    kept = {n for n in nodes if _kept(n, region, regions)}
    for n in nodes:  # the parts of a kept multi-output op are kept
        if n.target is operator.getitem and n.args[0] in kept:
            kept.add(n)
    readers = {n: [u for u in n.users if u not in inside and _BACKWARD in u.meta] for n in nodes}
    wanted = [n for n in nodes if n not in kept and readers[n]]
    if not wanted:
        return
    needed: set[Node] = set()
    stack = list(wanted)
    while stack:
        n = stack.pop()
        if n in needed:
            continue
        needed.add(n)
        stack.extend(a for a in n.all_input_nodes if a in inside and a not in kept)
    first = min((u for n in wanted for u in readers[n]), key=order.__getitem__)
    ordered = sorted(needed, key=order.__getitem__)
    fenced = _fenced(ordered)
    after = _reached(first, inside)
    env: dict[Node, Node] = {}
    with graph.inserting_before(first):
        if fenced and after:
            barrier = graph.call_function(torch.ops.pshard.remat_barrier.default, (fenced, after))
            barrier.meta["val"] = [a.meta["val"] for a in fenced]
            for i, a in enumerate(fenced):
                part = graph.call_function(operator.getitem, (barrier, i))
                part.meta["val"] = a.meta["val"]
                env[a] = part
        for n in ordered:
            c = graph.node_copy(n, lambda a: env.get(a, a))
            for key in _KEYS:
                c.meta.pop(key, None)
            new_args = renamed(n, copies[0] + 1)
            if new_args is not None:
                copies[0] += 1
                c.args = new_args
            env[n] = c
    for n in wanted:
        for u in readers[n]:
            u.replace_input_with(n, env[n])


def _fenced(ordered: list[Node]) -> list[Node]:
    """The values a recompute reads that pass through the barrier: those its computations
    (not its views) read, through views, that the program computed before (a region's input,
    a value it keeps); where a computation reads only the program's inputs (a first layer's
    ``x @ w``, a gather of a parameter's block), the smallest of those (the batch, not the
    weight), so that every computation of the recompute waits for the barrier."""
    needed = set(ordered)

    def source(a: Node) -> Node:
        while a in needed and _viewed(a) is not None:
            a = _viewed(a)  # type: ignore[assignment]
        return a

    fenced: list[Node] = []
    behind: set[Node] = set()
    for n in ordered:
        if _viewed(n) is not None:
            continue  # a view computes nothing: nothing to merge
        sources = [source(a) for a in n.all_input_nodes]
        outside = [a for a in sources if a not in needed and _is_tensor(a)]
        computed = [a for a in outside if not _is_input(a)]
        fenced.extend(a for a in computed if a not in fenced)
        if computed or any(a in behind for a in sources):
            behind.add(n)
            continue
        given = [a for a in outside if _is_input(a)]
        if given:
            smallest = min(given, key=_size)
            if smallest not in fenced:
                fenced.append(smallest)
            behind.add(n)
    return fenced


def _is_input(n: Node) -> bool:
    """Whether ``n`` is an input of the program (or a constant), or a view of one."""
    while _viewed(n) is not None:
        n = _viewed(n)  # type: ignore[assignment]
    return n.op in ("placeholder", "get_attr")


def _size(n: Node) -> int:
    try:
        return int(n.meta["val"].numel())
    except (TypeError, RuntimeError):  # a size the data decide
        return 1 << 62


def _viewed(n: Node) -> Node | None:
    """What ``n`` is a view of (``None``: ``n`` is no view)."""
    if n.op != "call_function" or not n.args or not isinstance(n.args[0], Node):
        return None
    if n.target is operator.getitem or (
        isinstance(n.target, compat.OpOverload) and op_kind(n.target) == "view"
    ):
        return n.args[0]
    return None


_COPIES = (torch.ops.aten.clone.default, torch.ops.aten._unsafe_view.default)


def _copied(n: Node) -> Node | None:
    """What ``n`` is a view or a plain copy of (``None``: neither)."""
    if n.op == "call_function" and n.target in _COPIES and isinstance(n.args[0], Node):
        return n.args[0]
    return _viewed(n)


def _reached(first: Node, inside: set[Node]) -> list[Node]:
    """The tensor the backward made last before ``first`` (the first node of the backward
    that reads the region's values): the point the backward has reached."""
    n = first.prev
    while n.op != "root":
        if _BACKWARD in n.meta and n not in inside and n.op == "call_function" and _is_tensor(n):
            return [n]
        n = n.prev
    return []


def _is_tensor(n: Node) -> bool:
    return isinstance(n.meta.get("val"), torch.Tensor)


def _kept(n: Node, region: int, regions: Regions) -> bool:
    """Whether the program keeps ``n`` (a node of ``region``) for the backward."""
    if region in n.meta.get(_OUT, ()):
        return True
    if n.op != "call_function" or not isinstance(n.target, compat.OpOverload):
        return False
    op = n.target
    kind = op_kind(op)
    if kind == "random":
        return True  # the forward's numbers, not drawn again
    policy = regions.policies[n.meta[_TAG][-1]]
    value = n.meta.get("val")
    keep = False
    if kind in ("compute", "collective"):  # what eager code asks a policy about
        args, kwargs = torch.fx.node.map_arg((n.args, n.kwargs), lambda a: a.meta.get("val"))
        keep = bool(policy(op, *args, **kwargs))
    for label in n.meta.get(_NAMES, ()):
        if policy.vetoes(label):
            return False
        keep = keep or bool(policy(checkpoint_name, value, name=label))
    return keep
