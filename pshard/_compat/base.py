"""The private torch APIs of functorch, autograd, dispatch and c10d's registry that pshard
uses (see :mod:`pshard._compat`)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.utils._pytree as _torch_pytree
from torch._C import _functorch
from torch._functorch.pyfunctorch import coerce_cinterpreter as _coerce_interpreter
from torch._functorch.utils import unwrap_dead_wrappers as _unwrap_dead_wrappers
from torch._ops import OpOverload
from torch.utils._python_dispatch import TorchDispatchMode

if TYPE_CHECKING:
    from torch.distributed.distributed_c10d import GroupName

__all__ = [
    "OpOverload",
    "TorchDispatchMode",
    "aten_op",
    "completed_work",
    "constant_source",
    "dcp_metadata_classes",
    "default_store",
    "fake_mode_active",
    "fake_tensor_types",
    "flattened_group",
    "foreach",
    "forward_ad_active",
    "get_attr_key",
    "graph_task_id",
    "group_count",
    "innermost",
    "is_batched",
    "is_fake",
    "is_wrapped",
    "level_of",
    "live_wrapper",
    "lowered",
    "make_subclass",
    "mark_differentiable",
    "new_level",
    "outside_transforms",
    "queue_backward_callback",
    "register_torch_pytree",
    "profiler_enabled",
    "reparametrized",
    "resolve_group",
    "storage_key",
    "strided_shard_type",
    "top_transform",
    "tracing",
    "transforms",
    "transforms_active",
    "unwrap_dead",
    "unwrap_dead_tensor",
    "swap_contents",
    "symbolic_reference",
    "unwrap_level",
    "use_count",
    "wrap_level",
]


def transforms_active() -> bool:
    """Whether a ``torch.func`` transform (grad, vjp, jvp, vmap, ...) is running."""
    return bool(torch._C._are_functorch_transforms_active())


def is_wrapped(t: torch.Tensor) -> bool:
    """Whether ``t`` is wrapped by a ``torch.func`` transform (a grad, batched or dual tensor)."""
    return bool(torch._C._functorch.is_functorch_wrapped_tensor(t))


def innermost(t: torch.Tensor) -> torch.Tensor:
    """The tensor under every ``torch.func`` wrapper of ``t`` (``t`` itself when unwrapped):
    where in-place writes under a transform move the version counter."""
    while torch._C._functorch.is_functorch_wrapped_tensor(t):
        t = torch._C._functorch.get_unwrapped(t)
    return t


def unwrap_dead(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """``args`` with the wrappers of transforms that have exited removed (what
    ``torch.autograd.Function.apply`` does to its arguments)."""
    return tuple(_unwrap_dead_wrappers(args))


@contextlib.contextmanager
def outside_transforms() -> Iterator[None]:
    """Run the block as if no ``torch.func`` transform were active (a trace whose answer must
    not depend on the transforms calling it)."""
    from torch._functorch.pyfunctorch import temporarily_clear_interpreter_stack

    with temporarily_clear_interpreter_stack():
        yield


def graph_task_id() -> int:
    """The id of the backward pass running in this thread; negative outside one."""
    return int(torch._C._current_graph_task_id())


def queue_backward_callback(callback: Callable[[], None]) -> None:
    """Have the autograd engine call ``callback`` when the running backward pass succeeds."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def aten_op(name: str) -> Any:
    """The ``torch.ops.aten`` op ``name`` (a private kernel entry point), or ``None`` where
    this torch build lacks it."""
    return getattr(torch.ops.aten, name, None)


def foreach(name: str) -> Callable[..., Any]:
    """torch's multi-tensor kernel ``torch._foreach_<name>`` (what ``torch.optim``'s foreach
    paths run: one call over a list of tensors of one device and dtype)."""
    return cast(Callable[..., Any], getattr(torch, f"_foreach_{name}"))


def make_subclass(cls: type[torch.Tensor], t: torch.Tensor) -> torch.Tensor:
    """``t`` as an instance of the tensor subclass ``cls`` (the same storage; no grad)."""
    return torch.Tensor._make_subclass(cls, t, False)


def storage_key(t: torch.Tensor) -> int:
    """An id of ``t``'s storage, shared by its views and aliases (``.data``, ``detach``) and
    distinct for separately made tensors, meta tensors included (whose data pointers are all
    0); valid while the storage lives."""
    return int(t.untyped_storage()._cdata)


def strided_shard_type() -> Any:
    """DTensor's ``_StridedShard`` placement class (the FSDP2 + TP layout)."""
    from torch.distributed.tensor import placement_types

    return placement_types._StridedShard


def flattened_group(mesh: Any) -> Any:
    """The process group of a ``DeviceMesh`` (a slice of several axes) flattened into one axis;
    DeviceMesh caches the flattened mesh on its root, so the group is created once."""
    return mesh._flatten().get_group()


def dcp_metadata_classes() -> dict[str, frozenset[str]]:
    """module -> the names DCP's pickled ``.metadata`` file refers to (its metadata classes,
    some private), for an unpickler that builds those and nothing else."""
    return {
        "torch.distributed.checkpoint.metadata": frozenset(
            {
                "Metadata",
                "TensorStorageMetadata",
                "BytesStorageMetadata",
                "ChunkStorageMetadata",
                "TensorProperties",
                "MetadataIndex",
                "StorageMeta",
                "_MEM_FORMAT_ENCODING",
            }
        ),
        "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
        "torch.serialization": frozenset({"_get_layout"}),
    }


def default_store() -> Any:
    """The key-value store of the default process group."""
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


def resolve_group(name: str) -> Any:
    """The process group registered under ``name`` (``ProcessGroup.group_name``)."""
    from torch.distributed import distributed_c10d

    return distributed_c10d._resolve_process_group(cast("GroupName", name))


def group_count() -> int:
    """How many process groups this process has created so far (``0`` before the first)."""
    from torch.distributed import distributed_c10d

    return int(getattr(getattr(distributed_c10d, "_world", None), "group_count", 0))


def fake_tensor_types() -> tuple[type, type]:
    """``(FakeTensor, FakeTensorMode)``."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    return FakeTensor, FakeTensorMode


def symbolic_reference(op: Any) -> Callable[..., Any] | None:
    """The Python reference (``torch._refs``) of an operator whose fake kernel fixes a symbolic
    size to its example value (``constant_pad_nd`` reads its input's sizes as integers: the
    padding of labels in Hugging Face's causal-LM loss), ``None`` for the others: run on fake
    tensors with symbolic sizes, the reference keeps them symbolic."""
    import torch._refs as refs

    if op is torch.ops.aten.constant_pad_nd.default:
        return refs.constant_pad_nd
    return None


def constant_source(name: str) -> Any:
    """A dynamo ``ConstantSource`` for a symbolic size made by hand."""
    from torch._dynamo.source import ConstantSource

    return ConstantSource(name)


def register_torch_pytree(
    cls: type,
    flatten: Callable[[Any], tuple[list[Any], Any]],
    unflatten: Callable[[Any, Any], Any],
    flatten_with_keys: Callable[[Any], tuple[list[tuple[Any, Any]], Any]],
    serialized_type_name: str,
) -> None:
    """Register ``cls`` as a node of ``torch.utils._pytree`` (what ``torch.func`` flattens)."""
    _torch_pytree.register_pytree_node(
        cls,
        flatten,
        unflatten,
        serialized_type_name=serialized_type_name,
        flatten_with_keys_fn=flatten_with_keys,
    )


def get_attr_key(name: str) -> Any:
    """torch pytree's key for an attribute of a node (``GetAttrKey``), as key paths show it."""
    from torch.utils._pytree import GetAttrKey

    return GetAttrKey(name)


_KINDS = {
    _functorch.TransformType.Grad: "grad",
    _functorch.TransformType.Jvp: "jvp",
    _functorch.TransformType.Vmap: "vmap",
    _functorch.TransformType.Functionalize: "functionalize",
}


def tracing(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether this runs in a trace rather than for real: dynamo compiling, a fake-tensor,
    proxy or functionalization mode active, or fake tensors given."""
    if torch.compiler.is_compiling():
        return True
    keys = torch._C._TorchDispatchModeKey
    for key in (keys.FAKE, keys.PROXY, keys.FUNCTIONAL):
        if torch._C._get_dispatch_mode(key) is not None:
            return True
    return any(is_fake(t) for t in tensors)


def fake_mode_active() -> bool:
    """Whether a fake-tensor or proxy (``make_fx``) mode is active."""
    keys = torch._C._TorchDispatchModeKey
    return any(torch._C._get_dispatch_mode(k) is not None for k in (keys.FAKE, keys.PROXY))


def is_fake(t: torch.Tensor) -> bool:
    """Whether ``t`` is a fake tensor (shapes without data, as tracers make)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def transforms() -> list[tuple[str, int]]:
    """The running ``torch.func`` transforms, outermost first: ``("grad" | "jvp" | "vmap" |
    "functionalize", level)``."""
    stack = _functorch.get_interpreter_stack() or []
    return [(_KINDS.get(ci.key(), "other"), ci.level()) for ci in stack]


def top_transform() -> tuple[str, int] | None:
    """The innermost running transform as ``(kind, level)``, or ``None``."""
    ci = _functorch.peek_interpreter_stack()
    return None if ci is None else (_KINDS.get(ci.key(), "other"), ci.level())


def forward_ad_active() -> bool:
    """Whether a ``torch.autograd.forward_ad.dual_level`` is open (forward mode outside
    ``torch.func``)."""
    from torch.autograd import forward_ad

    return bool(getattr(forward_ad, "_current_level", -1) >= 0)


def level_of(t: torch.Tensor) -> int:
    """The level of the outermost functorch wrapper of ``t`` (-1 for a plain tensor)."""
    level = _functorch.maybe_get_level(t)
    return -1 if level is None else int(level)


def live_wrapper(t: torch.Tensor) -> bool:
    """Whether ``t`` is a functorch wrapper of a transform that is still running."""
    dead = _functorch.is_dead_tensor_wrapper(t)  # type: ignore[attr-defined]
    return bool(_functorch.is_functorch_wrapped_tensor(t)) and not bool(dead)


def is_batched(t: torch.Tensor) -> bool:
    """Whether ``t`` is a ``vmap`` BatchedTensor."""
    return bool(_functorch.is_batchedtensor(t))


def unwrap_dead_tensor(t: torch.Tensor) -> torch.Tensor:
    """``t`` without the wrappers of transforms that have returned (a ``vjp``'s saved values
    when its ``vjp_fn`` runs)."""
    return _functorch.unwrap_if_dead(t)


def unwrap_level(t: torch.Tensor, level: int) -> torch.Tensor:
    """``t`` seen from below the ``grad``/``jvp`` transform ``level`` (``t`` itself when it is not
    wrapped at that level)."""
    return _functorch._unwrap_for_grad(t, level)


def wrap_level(t: torch.Tensor, level: int) -> torch.Tensor:
    """``t`` as a value of the ``grad``/``jvp`` transform ``level``, with no history there."""
    return _functorch._wrap_for_grad(t, level)


@contextlib.contextmanager
def new_level(kind: str) -> Iterator[int]:
    """A new ``"grad"`` or ``"jvp"`` transform level for the body, as ``torch.func.vjp`` and
    ``torch.func.jvp`` open one (without their pytree handling of inputs and outputs); yields
    its number."""
    grad = kind == "grad"
    level = _functorch._grad_increment_nesting() if grad else _functorch._jvp_increment_nesting()
    try:
        yield level
    finally:
        if grad:
            _functorch._grad_decrement_nesting()
        else:
            _functorch._jvp_decrement_nesting()


def mark_differentiable(t: torch.Tensor) -> torch.Tensor:
    """``t``, a value of the innermost ``grad`` level, requiring grad there (what
    ``torch.func.vjp`` does to its primals)."""
    allowed = _functorch.get_inplace_requires_grad_allowed()
    _functorch.set_inplace_requires_grad_allowed(True)
    try:
        return t.requires_grad_()
    finally:
        _functorch.set_inplace_requires_grad_allowed(allowed)


@contextlib.contextmanager
def lowered() -> Iterator[None]:
    """Run the body with the innermost transform taken off the stack, as functorch itself does
    when it hands an operation to the next transform (the grad mode outside a ``grad`` that was
    entered under ``torch.no_grad`` is restored with it)."""
    ci = _functorch.peek_interpreter_stack()
    if ci is None:
        yield
        return
    with _coerce_interpreter(ci).lower():
        yield


@contextlib.contextmanager
def reparametrized(module: torch.nn.Module, tensors: Mapping[str, torch.Tensor]) -> Iterator[None]:
    """Within the block, ``module``'s parameters and buffers named in ``tensors`` are those
    tensors (as in ``torch.func.functional_call``)."""
    from torch.nn.utils.stateless import _reparametrize_module

    with _reparametrize_module(module, dict(tensors), tie_weights=False, strict=False):
        yield


def swap_contents(a: torch.Tensor, b: torch.Tensor) -> None:
    """Make the Python object ``a`` hold ``b``'s tensor and ``b`` hold ``a``'s
    (``torch.utils.swap_tensors`` without its check that nothing else holds either tensor:
    what else holds ``a``'s tensor, a dead transform's graph, keeps it unchanged)."""
    if type(a) is not type(b):
        raise TypeError(
            f"a {type(a).__qualname__} cannot take the place of a {type(b).__qualname__}"
        )
    torch._C._swap_tensor_impl(a, b)


def profiler_enabled() -> bool:
    """Whether a ``torch.profiler`` (or ``torch.autograd.profiler``) records now, in this
    thread or (``profile_all_threads``) in every thread of the process."""
    import torch.autograd.profiler as profiler

    return bool(profiler._is_profiler_enabled or torch.autograd._profiler_enabled())


def use_count(t: torch.Tensor) -> int:
    """How many references hold ``t``'s C++ tensor (its Python object's one among them)."""
    return int(t._use_count())  # type: ignore[attr-defined]


def completed_work(tensors: Sequence[torch.Tensor]) -> Any:
    """A finished ``torch.distributed`` Work whose result is ``tensors``, as a c10d operator
    returns it (the TorchScript object)."""
    from torch._C._distributed_c10d import (  # type: ignore[attr-defined]
        _create_work_from_future,
    )

    fut: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future()
    fut.set_result(list(tensors))
    return _create_work_from_future(fut).boxed()


@contextlib.contextmanager
def real_tensors() -> Iterator[None]:
    """Inside a ``make_fx`` trace: real tensors and real kernels for the block (fake-tensor and
    proxy modes suspended), as if no trace ran."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

    with unset_fake_temporarily(), disable_proxy_modes_tracing():
        yield


def trace_graph(fn: Callable[..., Any], args: Sequence[Any]) -> torch.fx.GraphModule:
    """``make_fx`` of ``fn`` on fake copies of ``args`` (real tensors ``fn`` closes over are
    constants of the graph): every operator it runs, through ``torch.func``'s transforms, as
    aten ops."""
    from torch.fx.experimental.proxy_tensor import make_fx

    return make_fx(fn, tracing_mode="fake", _allow_non_fake_inputs=True)(*args)


def graph_in_trace() -> tuple[torch.fx.Graph, Any] | None:
    """The graph ``make_fx`` is building in this thread and its tracer, or ``None``."""
    mode = torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.PROXY)
    if mode is None:
        return None
    return mode.tracer.graph, mode.tracer


def last_node(graph: torch.fx.Graph) -> torch.fx.Node | None:
    """The node appended last to ``graph`` (``None`` while it is empty)."""
    return next(iter(reversed(graph.nodes)), None)


def nodes_after(graph: torch.fx.Graph, last: torch.fx.Node | None) -> list[torch.fx.Node]:
    """The nodes appended to ``graph`` after ``last`` (every node when ``last`` is ``None``)."""
    if last is None:
        return list(graph.nodes)
    out = []
    node = last.next
    while node.op != "root":
        out.append(node)
        node = node.next
    return out


def node_of(t: torch.Tensor, tracer: Any) -> torch.fx.Node | None:
    """The node of the graph ``tracer`` builds that made ``t`` (under ``torch.func``'s
    wrappers), or ``None`` (a tensor the trace does not know: a constant)."""
    from torch.fx.experimental.proxy_tensor import get_proxy_slot

    slot = get_proxy_slot(innermost(t), tracer, None)
    return None if slot is None else slot.proxy.node


def on_new_nodes(tracer: Any, seen: Callable[[torch.fx.Node], None]) -> None:
    """Call ``seen(node)`` for each node ``tracer`` (``make_fx``'s) adds from now on."""
    create = tracer.create_node

    def create_node(*args: Any, **kwargs: Any) -> torch.fx.Node:
        node = create(*args, **kwargs)
        seen(node)
        return node

    tracer.create_node = create_node


def retrace_functional(
    gm: torch.fx.GraphModule, made: Callable[[torch.fx.Node, list[torch.fx.Node]], None]
) -> torch.fx.GraphModule:
    """``gm`` traced again through functionalization (no operation writes in place in the new
    graph; writes into inputs are ``copy_`` s at its end), on its inputs' fake values;
    ``made(node, new_nodes)`` is told which nodes of the new graph each node of ``gm`` made."""
    from torch.fx.experimental.proxy_tensor import make_fx

    class Run(torch.fx.Interpreter):
        def run_node(self, n: torch.fx.Node) -> Any:
            found = graph_in_trace()
            if found is None or n.op in ("placeholder", "output"):
                return super().run_node(n)
            before = last_node(found[0])
            out = super().run_node(n)
            made(n, nodes_after(found[0], before))
            return out

    values = [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"]
    run = Run(gm)
    return make_fx(
        torch.func.functionalize(run.run, remove="mutations"),
        tracing_mode="fake",
        _allow_non_fake_inputs=True,
    )(*values)


def data_dependent_errors() -> tuple[type[BaseException], ...]:
    """What a fake-tensor trace raises where Python reads a traced value (``.item()``,
    ``bool(t)``) or an output's shape depends on values (``nonzero``)."""
    from torch._subclasses.fake_tensor import (
        DataDependentOutputException,
        DynamicOutputShapeException,
    )
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    return (DataDependentOutputException, DynamicOutputShapeException, GuardOnDataDependentSymNode)


@contextlib.contextmanager
def inductor_eager_random() -> Iterator[None]:
    """Inductor's random ops drawn by the eager kernels from torch's generator (the numbers
    eager code draws), for the compilations in the block."""
    import torch._inductor.config as config

    with config.patch(fallback_random=True):
        yield


def compile_backends() -> list[str]:
    """The names ``torch.compile`` takes as ``backend`` (imports dynamo)."""
    import torch._dynamo

    return list(torch._dynamo.list_backends(exclude_tags=()))


def mark_side_effect(op: Any) -> None:
    """Tell torch.fx (and the compilers' dead-code passes that ask it) that ``op`` has effects
    beyond its result: never dropped, never merged."""
    torch.fx.node.has_side_effect(op)


def same_size(a: Any, b: Any) -> None:
    """Tell a trace that two sizes it cannot know are equal (``torch._check``); a plain check
    of two ints otherwise."""
    torch._check(a == b)


def assert_in_program(condition: torch.Tensor, message: str) -> None:
    """``condition`` (a bool tensor) must hold when the program runs; a trace records the
    check (``torch._assert_async``) instead of reading the value."""
    torch._assert_async(condition, message)
