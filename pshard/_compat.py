"""Every private torch API pshard uses, in one place.

pshard declares the torch versions it is tested on (``pyproject.toml``); the few private
functions it needs are looked up here, each behind a small function with the meaning pshard
relies on, so a torch release that moves one breaks this module's tests, not a feature far away.
Imports torch only; every layer of pshard may import it.

- functorch's state: :func:`transforms_active`, :func:`is_wrapped`, :func:`innermost`,
  :func:`unwrap_dead`, :func:`outside_transforms`;
- the autograd engine: :func:`graph_task_id`, :func:`queue_backward_callback`;
- private kernels and types: :func:`aten_op`, :func:`strided_shard_type`,
  :func:`dcp_metadata_classes`;
- ``torch.distributed``'s registry: :func:`default_store`, :func:`resolve_group`,
  :func:`flattened_group`, :func:`group_count`;
- symbolic tracing (batch-dim inference): :func:`fake_tensor_types`, :func:`constant_source`,
  :data:`OpOverload`, :class:`TorchDispatchMode`;
- pytree registration with torch's own pytree: :func:`register_torch_pytree`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.utils._pytree as _torch_pytree
from torch._functorch.utils import unwrap_dead_wrappers as _unwrap_dead_wrappers
from torch._ops import OpOverload
from torch.utils._python_dispatch import TorchDispatchMode

if TYPE_CHECKING:
    from torch.distributed.distributed_c10d import GroupName

__all__ = [
    "OpOverload",
    "TorchDispatchMode",
    "constant_source",
    "dcp_metadata_classes",
    "default_store",
    "fake_tensor_types",
    "flattened_group",
    "aten_op",
    "graph_task_id",
    "innermost",
    "group_count",
    "is_wrapped",
    "outside_transforms",
    "queue_backward_callback",
    "register_torch_pytree",
    "resolve_group",
    "strided_shard_type",
    "transforms_active",
    "unwrap_dead",
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
