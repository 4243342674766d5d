"""One program of ``ps.jit``: a function traced on one signature into a ``torch.fx`` graph of
aten ops and ``pshard::`` collectives, then compiled.

**Tracing** (:func:`lower`). ``make_fx`` runs the function on fake tensors of the arguments'
shapes, through every ``torch.func`` transform, with a :class:`pshard._runtime.tracing.Trace`
active: the wire emits each collective as its ``pshard::`` op (one node), metadata the ranks
exchange is exchanged for real, once. Real tensors the function closes over are constants of
the graph. Python that reads a traced value (``.item()``, ``bool(t)``, ``if loss > 0``) stops
the trace with a :class:`ConcretizationError` naming the line; a call that cannot be part of a
program (``ps.save``, ``ps.spawn``) with :class:`pshard._runtime.tracing.NotTraceable`.

**Donation.** For each donated argument's tensor, the first output of its shape, dtype and
device not yet given one is written into it at the end of the program (``copy_`` into the
input, which the compilers turn into writes in place) and returned as it: the output shares
the input's storage.

**Compiling** (:meth:`Lowered.compile`): ``torch.compile`` of the graph (``fullgraph``, static
shapes) with the chosen backend; inductor draws random numbers with the eager kernels (the
numbers eager code draws, the generator left where eager leaves it).

Internal interface: :class:`Lowered`, :class:`Compiled`, :class:`ConcretizationError`,
:func:`lower`.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .._compat import data_dependent_errors, inductor_eager_random, trace_graph
from .._core.tree import keystr, leaf_path, tree_flatten, tree_unflatten
from .._modules.adapter import prepare_tracing
from .._remat.traced import recording, rematerialize
from .._runtime.ops import OPS, emit
from .._runtime.tracing import Trace, tracing
from .signature import Flat, flatten_call, tensor_leaves, with_tensors

__all__ = ["Compiled", "ConcretizationError", "Lowered", "lower"]

_TORCH_DIR = os.path.dirname(torch.__file__)
_HERE = os.path.dirname(__file__)


class ConcretizationError(RuntimeError):
    """Python read a traced value while ``ps.jit`` traced (JAX's ``ConcretizationTypeError``):
    a branch on it, ``bool``, ``float``, ``.item()``, ``.tolist()``. (An operation whose
    output's shape depends on values, ``x[x > 0]``, is traced with a symbolic size.)"""


class _Out:
    """What the trace learns of the outputs: their structure and each leaf's kind."""

    def __init__(self) -> None:
        self.treedef: Any = None
        self.kinds: list[Any] = []
        self.donations: list[tuple[int, int]] = []  # (input, output) sharing storage


class Lowered:
    """A traced program: ``graph`` (a ``torch.fx.GraphModule`` of aten and ``pshard::`` ops),
    ``collectives`` (``(op name, axis)`` in program order), :meth:`as_text`, :meth:`compile`."""

    def __init__(
        self, graph: torch.fx.GraphModule, collectives: list[Any], out: _Out, flat: Flat, name: str
    ) -> None:
        self.graph = graph
        self.collectives = collectives
        self._out = out
        self._flat = flat
        self._name = name

    def as_text(self) -> str:
        """The program as Python code (``GraphModule.print_readable``)."""
        return self.graph.print_readable(print_output=False)

    def compile(self, backend: str | Callable[..., Any] = "inductor") -> Compiled:
        """The program compiled by ``backend`` (``"inductor"``, ``"aot_eager"``, or any
        ``torch.compile`` backend)."""
        return Compiled(self, backend)


class Compiled:
    """A compiled program: called with arguments of its signature, returns ``fn``'s result."""

    def __init__(self, lowered: Lowered, backend: str | Callable[..., Any]) -> None:
        self.lowered = lowered
        # the graph's forward, not the module: while another thread rank traces, make_fx
        # patches nn.Module.__call__ for the whole process
        self._program = torch.compile(
            lowered.graph.forward, backend=backend, fullgraph=True, dynamic=False
        )
        self._eager_random = backend == "inductor"
        self._first = True

    def run(self, tensors: Sequence[torch.Tensor]) -> Any:
        """The program on the call's tensor leaves; the result rebuilt."""
        if self._first:
            flat = self._compile_and_run(tensors)
        else:
            flat = self._program(*tensors)
        self._first = False
        out = self.lowered._out
        return tree_unflatten(out.treedef, with_tensors(out.kinds, flat))

    def _compile_and_run(self, tensors: Sequence[torch.Tensor]) -> Any:
        """The first call: the compiler runs (inductor reads its random-number setting now)."""
        try:
            if self._eager_random:
                with inductor_eager_random():
                    return self._program(*tensors)
            return self._program(*tensors)
        except Exception as e:
            if type(e).__name__ != "InductorError" or not _data_sized(self.lowered.graph):
                raise
            raise RuntimeError(
                f"{self.lowered._name}: inductor could not compile this program, whose sizes "
                f"depend on data (a ragged_all_to_all: expert parallelism; {e}); "
                f"backend='aot_eager' runs the same program"
            ) from e

    def __call__(self, *args: Any) -> Any:
        flat = self.lowered._flat
        now = flatten_call(args, tuple(flat.static), (), self.lowered._name)
        if now.key != flat.key:
            raise TypeError(
                f"{self.lowered._name}: these arguments do not have the signature the program "
                f"was traced for (shapes, dtypes, structure, static values or the mesh differ)"
            )
        return self.run(now.tensors)


def lower(fn: Callable[..., Any], flat: Flat, name: str) -> Lowered:
    """Trace ``fn`` on the signature of ``flat`` (see the module docs)."""
    out = _Out()
    trace = Trace(emit)
    donated = set(flat.donated)

    def program(*tensors: torch.Tensor) -> list[torch.Tensor]:
        result = fn(*flat.rebuild(tensors))
        leaves, treedef = tree_flatten(result)
        for i, leaf in enumerate(leaves):
            if isinstance(leaf, (torch.SymInt, torch.SymFloat, torch.SymBool)):
                raise ConcretizationError(
                    f"{name}: the result {keystr(leaf_path(treedef, i), 'result')} is a Python "
                    f"number read from a traced tensor (.item(), .tolist(), float(t)); a "
                    f"program returns tensors: return the tensor itself"
                )
        results, kinds = tensor_leaves(leaves)
        out.treedef, out.kinds = treedef, kinds
        return _donate(results, [(i, tensors[i]) for i in sorted(donated)], out.donations)

    prepare_tracing()  # model families skip their checks on values when they see a trace
    with tracing(trace), recording() as regions:
        try:
            graph = trace_graph(program, flat.tensors)
        except data_dependent_errors() as e:
            raise ConcretizationError(_concretization_message(e, name)) from None
    remade = rematerialize(graph, regions, _renamed)  # what checkpoints recompute
    if remade is not graph:
        _donated_outputs(remade, out.donations)
        graph = remade
    # checks whose results nothing reads (transforms compare shapes as they go) go; every
    # collective stays, used or not (each rank issues the same ones)
    graph.graph.eliminate_dead_code(is_impure_node=_kept)
    graph.recompile()
    return Lowered(graph, _collectives(graph, trace), out, flat, name)


def _renamed(node: torch.fx.Node, k: int) -> tuple[Any, ...] | None:
    """The arguments of a collective's node issued again (the ``k``-th copy): its own key
    (``None`` for any other node)."""
    if not _is_collective(node):
        return None
    x, key, *rest = node.args
    return (x, f"{key}.{k}", *rest)


def _is_collective(node: torch.fx.Node) -> bool:
    op: Any = node.target
    return (
        node.op == "call_function"
        and getattr(op, "namespace", None) == "pshard"
        and (getattr(op, "_opname", None) in OPS)
    )


def _collectives(graph: torch.fx.GraphModule, trace: Trace) -> list[Any]:
    """``(name, axis)`` of each collective node, in program order (the trace's list, with the
    collectives checkpoints issue again)."""
    found = []
    for n in graph.graph.nodes:
        if _is_collective(n):
            place = str(n.args[1]).partition("#")[2].partition(".")[0]
            found.append(trace.collectives[int(place)])
    return found


def _donated_outputs(graph: torch.fx.GraphModule, donations: list[tuple[int, int]]) -> None:
    """After the program was made functional, each donated output is its input again (the
    ``copy_`` into the input that ends the program, whose result is the input)."""
    if not donations:
        return
    inputs = [n for n in graph.graph.nodes if n.op == "placeholder"]
    writes = {}
    for n in graph.graph.nodes:
        if n.op == "call_function" and n.target is torch.ops.aten.copy_.default:
            writes[n.args[0]] = n
    output = graph.graph.output_node()
    results = list(output.args[0])  # type: ignore[arg-type]
    for i, j in donations:
        write = writes.get(inputs[i])
        if write is None:
            raise AssertionError(f"donated input {i} is not written by the functional program")
        results[j] = write
    output.args = (results, *output.args[1:])


def _data_sized(graph: torch.fx.GraphModule) -> bool:
    """Whether the program has an exchange whose size the data decide."""
    return any(str(n.target).startswith("pshard.ragged") for n in graph.graph.nodes)


def _kept(node: torch.fx.Node) -> bool:
    return node.is_impure() or str(node.target).startswith("pshard.")


def _donate(
    results: list[torch.Tensor],
    donated: list[tuple[int, torch.Tensor]],
    pairs: list[tuple[int, int]],
) -> list[torch.Tensor]:
    """Each donated input takes the first result of its shape, dtype and device not yet
    taken (written into it; the input returned in its place); ``pairs`` gets ``(input,
    output)`` for each."""
    taken: set[int] = set()
    out = list(results)
    for i, inp in donated:
        if inp.requires_grad:
            continue
        for j, r in enumerate(results):
            if j in taken or r.shape != inp.shape or r.dtype != inp.dtype or r.device != inp.device:
                continue
            taken.add(j)
            pairs.append((i, j))
            inp.copy_(r)
            out[j] = inp
            break
    return out


def _concretization_message(e: BaseException, name: str) -> str:
    """The error for Python reading a traced value: what it did, and the line (the innermost
    frame outside torch and this room)."""
    where = "an unknown line"
    for frame in reversed(traceback.extract_tb(e.__traceback__)):
        if not frame.filename.startswith((_TORCH_DIR, _HERE)):
            where = f"{frame.filename}:{frame.lineno} ({frame.line})"
            break
    what = str(e).splitlines()[0] if str(e) else type(e).__name__
    return (
        f"{name}: Python read the value of a traced tensor at {where} ({what}); ps.jit traces "
        f"with abstract values, so a branch on a tensor, bool(t), float(t), t.item() or "
        f"t.tolist() cannot run while tracing: compute with tensor operations (torch.where), "
        f"make the value a static argument (static_argnums), or call that code outside ps.jit"
    )
