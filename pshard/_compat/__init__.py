"""Every private torch API pshard uses, in one place (this package).

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
  :func:`new_level`, :func:`mark_differentiable`, :func:`lowered`, :func:`live_wrapper`,
  :func:`is_batched`, :func:`unwrap_dead_tensor`),
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
  :func:`compile_disabled`, :func:`constant_result`);
- what ``ps.jit`` needs: ``make_fx`` (:func:`trace_graph`), what it raises on values
  (:func:`data_dependent_errors`), real tensors inside a trace (:func:`real_tensors`), the
  compilers' backends and random numbers (:func:`compile_backends`,
  :func:`inductor_eager_random`), collectives kept by dead-code passes
  (:func:`mark_side_effect`), the graph being traced and its nodes (:func:`graph_in_trace`,
  :func:`last_node`, :func:`nodes_after`, :func:`node_of`, :func:`on_new_nodes`) and a
  graph made functional (:func:`retrace_functional`).
"""

from __future__ import annotations

from .base import (
    OpOverload as OpOverload,
)
from .base import (
    TorchDispatchMode as TorchDispatchMode,
)
from .base import (
    assert_in_program as assert_in_program,
)
from .base import (
    aten_op as aten_op,
)
from .base import (
    compile_backends as compile_backends,
)
from .base import (
    completed_work as completed_work,
)
from .base import (
    constant_source as constant_source,
)
from .base import (
    data_dependent_errors as data_dependent_errors,
)
from .base import (
    dcp_metadata_classes as dcp_metadata_classes,
)
from .base import (
    default_store as default_store,
)
from .base import (
    fake_mode_active as fake_mode_active,
)
from .base import (
    fake_tensor_types as fake_tensor_types,
)
from .base import (
    flattened_group as flattened_group,
)
from .base import (
    foreach as foreach,
)
from .base import (
    forward_ad_active as forward_ad_active,
)
from .base import (
    get_attr_key as get_attr_key,
)
from .base import (
    graph_in_trace as graph_in_trace,
)
from .base import (
    graph_task_id as graph_task_id,
)
from .base import (
    group_count as group_count,
)
from .base import (
    inductor_eager_random as inductor_eager_random,
)
from .base import (
    innermost as innermost,
)
from .base import (
    is_batched as is_batched,
)
from .base import (
    is_fake as is_fake,
)
from .base import (
    is_wrapped as is_wrapped,
)
from .base import (
    last_node as last_node,
)
from .base import (
    level_of as level_of,
)
from .base import (
    live_wrapper as live_wrapper,
)
from .base import (
    lowered as lowered,
)
from .base import (
    make_subclass as make_subclass,
)
from .base import (
    mark_differentiable as mark_differentiable,
)
from .base import (
    mark_side_effect as mark_side_effect,
)
from .base import (
    new_level as new_level,
)
from .base import (
    node_of as node_of,
)
from .base import (
    nodes_after as nodes_after,
)
from .base import (
    on_new_nodes as on_new_nodes,
)
from .base import (
    outside_transforms as outside_transforms,
)
from .base import (
    profiler_enabled as profiler_enabled,
)
from .base import (
    queue_backward_callback as queue_backward_callback,
)
from .base import (
    real_tensors as real_tensors,
)
from .base import (
    register_torch_pytree as register_torch_pytree,
)
from .base import (
    reparametrized as reparametrized,
)
from .base import (
    resolve_group as resolve_group,
)
from .base import (
    retrace_functional as retrace_functional,
)
from .base import (
    same_size as same_size,
)
from .base import (
    storage_key as storage_key,
)
from .base import (
    strided_shard_type as strided_shard_type,
)
from .base import (
    swap_contents as swap_contents,
)
from .base import (
    symbolic_reference as symbolic_reference,
)
from .base import (
    top_transform as top_transform,
)
from .base import (
    trace_graph as trace_graph,
)
from .base import (
    tracing as tracing,
)
from .base import (
    transforms as transforms,
)
from .base import (
    transforms_active as transforms_active,
)
from .base import (
    unwrap_dead as unwrap_dead,
)
from .base import (
    unwrap_dead_tensor as unwrap_dead_tensor,
)
from .base import (
    unwrap_level as unwrap_level,
)
from .base import (
    use_count as use_count,
)
from .base import (
    wrap_level as wrap_level,
)
from .compile import (
    compile_disabled as compile_disabled,
)
from .compile import (
    constant_result as constant_result,
)
from .compile import (
    when_compiling as when_compiling,
)
from .threads import (
    THREADS_BACKEND as THREADS_BACKEND,
)
from .threads import (
    ad_state as ad_state,
)
from .threads import (
    install_world_switch as install_world_switch,
)
from .threads import (
    new_c10d_world as new_c10d_world,
)
from .threads import (
    register_backend as register_backend,
)
from .threads import (
    route_reparametrization as route_reparametrization,
)
from .threads import (
    set_ad_state as set_ad_state,
)
from .threads import (
    share_dual_level as share_dual_level,
)
from .threads import (
    thread_isolation as thread_isolation,
)
from .threads import (
    unseen_writes as unseen_writes,
)

__all__ = [
    "THREADS_BACKEND",
    "OpOverload",
    "TorchDispatchMode",
    "ad_state",
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
    "graph_task_id",
    "group_count",
    "innermost",
    "install_world_switch",
    "is_batched",
    "is_fake",
    "is_wrapped",
    "level_of",
    "live_wrapper",
    "lowered",
    "make_subclass",
    "mark_differentiable",
    "new_c10d_world",
    "new_level",
    "outside_transforms",
    "queue_backward_callback",
    "register_backend",
    "route_reparametrization",
    "register_torch_pytree",
    "reparametrized",
    "resolve_group",
    "set_ad_state",
    "share_dual_level",
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
    "profiler_enabled",
    "swap_contents",
    "symbolic_reference",
    "unwrap_level",
    "use_count",
    "when_compiling",
    "wrap_level",
    "compile_backends",
    "data_dependent_errors",
    "inductor_eager_random",
    "mark_side_effect",
    "real_tensors",
    "trace_graph",
    "graph_in_trace",
    "last_node",
    "nodes_after",
    "on_new_nodes",
    "node_of",
    "retrace_functional",
    "same_size",
    "assert_in_program",
]
