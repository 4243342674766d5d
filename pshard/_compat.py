"""Every private torch API pshard uses, in one place.

pshard declares the torch versions it is tested on (``pyproject.toml``); the few private
functions it needs are looked up here, each behind a small function with the meaning pshard
relies on, so a torch release that moves one breaks this module's tests, not a feature far away.
Imports torch only; every layer of pshard may import it.

- functorch's state: :func:`transforms_active`, :func:`is_wrapped`, :func:`innermost`,
  :func:`unwrap_dead`, :func:`outside_transforms`;
- the autograd engine: :func:`graph_task_id`, :func:`queue_backward_callback`;
- private kernels and types: :func:`aten_op`, :func:`foreach` (torch's multi-tensor kernels),
  :func:`strided_shard_type`, :func:`dcp_metadata_classes`;
- tensors as objects: :func:`make_subclass` (a tensor viewed as a subclass),
  :func:`storage_key` (which storage a tensor, its views and aliases share);
- ``torch.distributed``'s registry: :func:`default_store`, :func:`resolve_group`,
  :func:`flattened_group`, :func:`group_count`;
- symbolic tracing (batch-dim inference): :func:`fake_tensor_types`, :func:`constant_source`,
  :data:`OpOverload`, :class:`TorchDispatchMode`;
- torch's own pytree: :func:`register_torch_pytree`, :func:`get_attr_key`;
- what ``ps.checkpoint`` needs: functorch's interpreter stack (:func:`transforms`,
  :func:`top_transform`, :func:`level_of`, :func:`unwrap_level`, :func:`wrap_level`,
  :func:`lowered`, :func:`live_wrapper`, :func:`is_batched`, :func:`unwrap_dead_tensor`),
  forward mode outside it (:func:`forward_ad_active`), tracing (:func:`tracing`,
  :func:`fake_mode_active`, :func:`is_fake`), ``functional_call``'s reparametrization
  (:func:`reparametrized`) and a finished c10d Work (:func:`completed_work`). The backward of a
  checkpoint recomputes its function with the ``grad`` level that runs that backward taken off
  the stack (:func:`lowered`), so only the transforms outside it record the recompute;
- in-process ranks: c10d's world per rank (:func:`install_world_switch`,
  :func:`new_c10d_world`), its C++ group registry per thread (:func:`thread_isolation`), a
  backend registered from Python (:func:`register_backend`) and writes that autograd and the
  dispatch modes do not see (:func:`unseen_writes`), forward-mode AD's process state
  (:func:`ad_state`, :func:`set_ad_state`, :func:`share_dual_level`);
- torch.compile's front end, loaded only when something compiles (:func:`when_compiling`,
  :func:`compile_disabled`, :func:`constant_result`).
"""

from __future__ import annotations

import contextlib
import importlib.abc
import inspect
import sys
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
    "THREADS_BACKEND",
    "OpOverload",
    "ad_state",
    "TorchDispatchMode",
    "aten_op",
    "compile_disabled",
    "completed_work",
    "constant_result",
    "constant_source",
    "dcp_metadata_classes",
    "default_store",
    "fake_mode_active",
    "fake_tensor_types",
    "flattened_group",
    "foreach",
    "forward_ad_active",
    "get_attr_key",
    "install_world_switch",
    "graph_task_id",
    "group_count",
    "innermost",
    "is_batched",
    "is_fake",
    "is_wrapped",
    "level_of",
    "new_c10d_world",
    "live_wrapper",
    "lowered",
    "make_subclass",
    "outside_transforms",
    "queue_backward_callback",
    "register_backend",
    "register_torch_pytree",
    "reparametrized",
    "set_ad_state",
    "share_dual_level",
    "resolve_group",
    "storage_key",
    "strided_shard_type",
    "thread_isolation",
    "top_transform",
    "tracing",
    "transforms",
    "transforms_active",
    "unseen_writes",
    "unwrap_dead",
    "unwrap_dead_tensor",
    "unwrap_level",
    "when_compiling",
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


def completed_work(tensors: Sequence[torch.Tensor]) -> Any:
    """A finished ``torch.distributed`` Work whose result is ``tensors``, as a c10d operator
    returns it (the TorchScript object)."""
    from torch._C._distributed_c10d import (  # type: ignore[attr-defined]
        _create_work_from_future,
    )

    fut: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future()
    fut.set_result(list(tensors))
    return _create_work_from_future(fut).boxed()


# --- in-process ranks: c10d's world per rank thread ----------------------------------------------
#
# torch.distributed keeps its process groups in one module-level object (``distributed_c10d.
# _world``) and their names in a C++ registry, both one per process. In-process ranks
# (``ps.spawn(..., backend="threads")``) need one of each per rank: ``_world`` is replaced, once,
# by a switch that sends every access to the world of the rank whose context is current (a
# context variable, so a rank's own context decides, and any other thread, the caller's among
# them, keeps the process's own world), and the C++ registry is made per thread while in-process
# ranks run. DeviceMesh tells meshes of different threads apart only for a backend named
# "threaded" (it records the creating thread in the mesh's identity), so that is the name the
# in-process transport registers under.

THREADS_BACKEND = "threaded"


class _Switch:
    """Stands in for ``distributed_c10d._world``: the current rank's world, else the process's."""

    def __init__(self, own: Any, current: Callable[[], Any]) -> None:
        object.__setattr__(self, "_own", own)
        object.__setattr__(self, "_current", current)

    def _target(self) -> Any:
        world = self._current()
        return self._own if world is None else world

    def __getattr__(self, name: str) -> Any:
        return getattr(self._target(), name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._target(), name, value)


def new_c10d_world() -> Any:
    """A fresh, empty c10d world (what ``distributed_c10d._world`` holds) for one rank."""
    from torch.distributed import distributed_c10d as c10d

    class RankWorld(c10d._World):
        # _World's maps are module globals: a rank's world holds its own
        def __init__(self) -> None:
            super().__init__()
            self._maps: dict[str, dict] = {
                k: {}
                for k in (
                    "pg_map",
                    "pg_names",
                    "pg_group_ranks",
                    "pg_backend_config",
                    "tags_to_pg",
                    "pg_to_tag",
                )
            }
            self._count = 0

        pg_map = property(lambda self: self._maps["pg_map"])
        pg_names = property(lambda self: self._maps["pg_names"])
        pg_group_ranks = property(lambda self: self._maps["pg_group_ranks"])
        pg_backend_config = property(lambda self: self._maps["pg_backend_config"])
        tags_to_pg = property(lambda self: self._maps["tags_to_pg"])
        pg_to_tag = property(lambda self: self._maps["pg_to_tag"])

        @property
        def group_count(self) -> int:
            return self._count

        @group_count.setter
        def group_count(self, value: int) -> None:
            self._count = value

    return RankWorld()


def install_world_switch(current: Callable[[], Any]) -> None:
    """Route c10d's world through ``current()`` (a rank's world, or ``None`` for the process's
    own) from now on; idempotent. The switch stays for the life of the process: with no rank
    running it is the process's own world, unchanged."""
    from torch.distributed import distributed_c10d as c10d

    if not isinstance(c10d._world, _Switch):
        c10d._world = _Switch(c10d._world, current)  # type: ignore[assignment]


def thread_isolation(enabled: bool) -> None:
    """Make c10d's C++ registry of group names per thread (``True``) or per process."""
    from torch._C import _distributed_c10d

    _distributed_c10d._set_thread_isolation_mode(enabled)  # type: ignore[attr-defined]


def register_backend(name: str, creator: Callable[..., Any]) -> None:
    """Register ``creator(options, backend_options)`` as the c10d backend ``name`` (CPU only;
    the extended signature, which also gives the group's name and global ranks)."""
    import torch.distributed as dist

    dist.Backend.register_backend(name, creator, extended_api=True, devices=["cpu"])


@contextlib.contextmanager
def unseen_writes(tensors: Sequence[torch.Tensor]) -> Iterator[None]:
    """Write into ``tensors`` as a communication library does: no autograd, no dispatch mode,
    and their version counters left as they were."""
    from torch.utils._python_dispatch import _disable_current_modes

    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.no_grad())
        stack.enter_context(_disable_current_modes())
        for t in tensors:
            stack.enter_context(torch.autograd._unsafe_preserve_version_counter(t))
        yield


# Forward-mode AD is process state in torch: one dual level for the whole process (C++), the
# current level and functorch's jvp nesting in module globals. In-process ranks that run jvp at
# the same time share the one level (it lives while any rank is inside it) and each keeps its
# own view of the two globals, swapped with the turn (:func:`ad_state`, :func:`set_ad_state`).


def ad_state() -> tuple[int, int]:
    """This thread's view of forward-mode AD: functorch's jvp nesting and the dual level."""
    from torch._functorch import eager_transforms
    from torch.autograd import forward_ad

    return eager_transforms.JVP_NESTING, forward_ad._current_level


def set_ad_state(state: tuple[int, int]) -> None:
    from torch._functorch import eager_transforms
    from torch.autograd import forward_ad

    eager_transforms.JVP_NESTING, forward_ad._current_level = state


class _SharedLevel:
    """``enter_dual_level`` / ``exit_dual_level`` for in-process ranks: the first rank in
    creates the level, the last one out releases it; other threads are unchanged."""

    def __init__(self, enter: Any, exit_: Any, in_rank: Callable[[], bool]) -> None:
        self.enter, self.exit, self.in_rank, self.holders = enter, exit_, in_rank, 0

    def shared_enter(self) -> int:
        if not self.in_rank():
            return self.enter()
        from torch.autograd import forward_ad

        if self.holders == 0:
            level = self.enter()
        else:
            if forward_ad._current_level != -1:
                raise RuntimeError("Nested forward mode AD is not supported at the moment")
            level = forward_ad._current_level = 0
        self.holders += 1
        return level

    def shared_exit(self, *, level: int | None = None) -> None:
        if not self.in_rank():
            return self.exit(level=level)
        from torch.autograd import forward_ad

        self.holders -= 1
        if self.holders == 0:
            return self.exit(level=level)
        forward_ad._current_level = -1
        return None


def share_dual_level(in_rank: Callable[[], bool]) -> None:
    """Let in-process ranks (``in_rank()`` true in their threads) share the dual level;
    idempotent, and with no rank running nothing changes."""
    from torch.autograd import forward_ad

    if isinstance(getattr(forward_ad.enter_dual_level, "__self__", None), _SharedLevel):
        return
    shared = _SharedLevel(forward_ad.enter_dual_level, forward_ad.exit_dual_level, in_rank)
    forward_ad.enter_dual_level = shared.shared_enter
    forward_ad.exit_dual_level = shared.shared_exit


# --- torch.compile's front end, loaded only when something compiles -------------------------------
#
# ``torch.compiler.disable`` imports dynamo (and, with it, DTensor, FSDP and most of torch's
# compile stack: seconds at import). Nothing can compile before dynamo is imported, so pshard's
# functions that must stay out of compiled graphs are disabled when it is: ``when_compiling``
# runs its callbacks right after ``torch._dynamo`` has been imported (now, if it already is).


class _AfterDynamo(importlib.abc.MetaPathFinder):
    """A finder that lets the others find ``torch._dynamo`` and runs callbacks once it has
    been executed; it removes itself then."""

    def __init__(self) -> None:
        self.callbacks: list[Callable[[], None]] = []

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != "torch._dynamo":
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _ThenRun(spec.loader, self)
                return spec
        return None


class _ThenRun(importlib.abc.Loader):
    def __init__(self, loader: Any, hook: _AfterDynamo) -> None:
        self.loader, self.hook = loader, hook

    def create_module(self, spec: Any) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.loader.exec_module(module)
        if self.hook in sys.meta_path:
            sys.meta_path.remove(self.hook)
        callbacks, self.hook.callbacks = self.hook.callbacks, []
        for callback in callbacks:
            callback()

    def __getattr__(self, name: str) -> Any:  # the wrapped loader's other methods
        return getattr(self.loader, name)


def when_compiling(callback: Callable[[], None]) -> None:
    """Run ``callback`` once ``torch._dynamo`` is imported (now, if it already is)."""
    if "torch._dynamo" in sys.modules:
        callback()
        return
    hook = next((f for f in sys.meta_path if isinstance(f, _AfterDynamo)), None)
    if hook is None:
        hook = _AfterDynamo()
        sys.meta_path.insert(0, hook)
    hook.callbacks.append(callback)


def compile_disabled(owner: Any, name: str) -> None:
    """Replace ``owner.name`` (a module's function or a class's static method) by
    ``torch.compiler.disable(it, recursive=True)`` once dynamo is imported."""

    def disable() -> None:
        value = inspect.getattr_static(owner, name)
        fn = value.__func__ if isinstance(value, staticmethod) else value
        disabled = torch.compiler.disable(fn, recursive=True)
        setattr(
            owner, name, staticmethod(disabled) if isinstance(value, staticmethod) else disabled
        )

    when_compiling(disable)


def constant_result(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.compiler.assume_constant_result(fn)`` without importing dynamo: the mark it
    sets (dynamo reads it when it traces a call to ``fn``)."""
    fn._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return fn
