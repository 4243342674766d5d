"""pshard: JAX-style functional parallelism for PyTorch."""

from . import optim as optim
from ._collectives.functions import all_gather as all_gather
from ._collectives.functions import all_to_all as all_to_all
from ._collectives.functions import axis_index as axis_index
from ._collectives.functions import axis_size as axis_size
from ._collectives.functions import broadcast as broadcast
from ._collectives.functions import pmax as pmax
from ._collectives.functions import pmean as pmean
from ._collectives.functions import pmin as pmin
from ._collectives.functions import ppermute as ppermute
from ._collectives.functions import psum as psum
from ._collectives.functions import psum_scatter as psum_scatter
from ._collectives.ragged import ragged_all_to_all as ragged_all_to_all
from ._core.caches import clear_caches as clear_caches
from ._core.global_tensor import GlobalTensor as GlobalTensor
from ._core.layout import explicit_order as explicit_order
from ._core.layout import global_shape_and_stride as global_shape_and_stride
from ._core.layout import local_indices as local_indices
from ._core.layout import local_shape_and_offset as local_shape_and_offset
from ._core.layout import local_stride as local_stride
from ._core.layout import shard_tensor as shard_tensor
from ._core.layout import unshard_tensor as unshard_tensor
from ._core.placements import P as P
from ._core.placements import Partial as Partial
from ._core.placements import Placement as Placement
from ._core.placements import Replicate as Replicate
from ._core.placements import Shard as Shard
from ._core.placements import StridedShard as StridedShard
from ._core.placements import from_torch_placement as from_torch_placement
from ._core.placements import to_torch_placement as to_torch_placement
from ._core.type_specs import specs_of as specs_of
from ._core.version import version as __version__  # noqa: F401
from ._inspect.memory import memory_estimate as memory_estimate
from ._inspect.visualize import visualize_sharding as visualize_sharding
from ._jit.jit import jit as jit
from ._jit.program import ConcretizationError as ConcretizationError
from ._microbatch.batch_dim import infer_out_specs as infer_out_specs
from ._microbatch.merge import merge as merge
from ._microbatch.pmap import pmap_microbatch as pmap_microbatch
from ._microbatch.split import split as split
from ._modules.layers import checkpoint_layers as checkpoint_layers
from ._pipeline.forward import pipeline as pipeline
from ._pipeline.schedule import PipelineSchedule as PipelineSchedule
from ._pipeline.schedule import pipeline_schedule as pipeline_schedule
from ._pipeline.value_and_grad import pipeline_value_and_grad as pipeline_value_and_grad
from ._remat.checkpoint import CheckpointModule as CheckpointModule
from ._remat.checkpoint import checkpoint as checkpoint
from ._remat.checkpoint import remat as remat
from ._remat.names import checkpoint_name as checkpoint_name
from ._remat.policies import checkpoint_policies as checkpoint_policies
from ._runtime.debug import debug as debug
from ._runtime.debug import debug_enabled as debug_enabled
from ._runtime.mesh import current_mesh as current_mesh
from ._runtime.mesh import init_mesh as init_mesh
from ._runtime.mesh import use_mesh as use_mesh
from ._runtime.spawn import SpawnError as SpawnError
from ._runtime.spawn import spawn as spawn
from ._runtime.tracing import NotTraceable as NotTraceable
from ._shard_map.global_ops import from_callback as from_callback
from ._shard_map.global_ops import from_dtensor as from_dtensor
from ._shard_map.global_ops import from_local as from_local
from ._shard_map.global_ops import gather as gather
from ._shard_map.global_ops import reshard as reshard
from ._shard_map.global_ops import shard as shard
from ._shard_map.global_ops import to_dtensor as to_dtensor
from ._shard_map.shard_map import shard_map as shard_map
from ._shard_map.sharded_call import sharded_call as sharded_call
from ._state.api import load as load
from ._state.api import load_metadata as load_metadata
from ._state.api import save as save
from ._state.init import init_sharded as init_sharded
from ._state.manifest import SavedObject as SavedObject
from ._state.manifest import SavedTensor as SavedTensor
from ._state.rng import RngState as RngState
from .expert_parallel._api import expert_parallel as expert_parallel
from .expert_parallel._api import expert_parallel_specs as expert_parallel_specs
from .integrations import transformers as _transformers  # noqa: F401 (registers its adapter)
from .sequence._broadcast import broadcast_batches as broadcast_batches
from .sequence._context import seq_positions as seq_positions
from .sequence._heads import heads_to_seq as heads_to_seq
from .sequence._heads import seq_to_heads as seq_to_heads
from .sequence._hooks import SequenceParallel as SequenceParallel
from .sequence._hooks import reduce_gradients as reduce_gradients
from .sequence._hooks import sequence_parallel as sequence_parallel
from .sequence._lm import prepare_lm_batch as prepare_lm_batch
from .sequence._lm import token_mean_loss as token_mean_loss
from .sequence._ring import ring_attention as ring_attention
from .sequence._shard_map_seq import shard_map_seq as shard_map_seq
from .sequence._ulysses import ulysses_attention as ulysses_attention
from .sequence._usp import usp_attention as usp_attention
from .tensor_parallel._api import tensor_parallel as tensor_parallel
from .tensor_parallel._api import tensor_parallel_plan as tensor_parallel_plan
from .tensor_parallel._api import tensor_parallel_specs as tensor_parallel_specs
from .tensor_parallel._loss import cross_entropy as cross_entropy

__all__ = [
    "CheckpointModule",
    "save",
    "RngState",
    "SavedTensor",
    "SavedObject",
    "load_metadata",
    "load",
    "remat",
    "checkpoint_layers",
    "memory_estimate",
    "visualize_sharding",
    "checkpoint_policies",
    "checkpoint_name",
    "checkpoint",
    "sharded_call",
    "to_dtensor",
    "shard",
    "reshard",
    "GlobalTensor",
    "gather",
    "from_local",
    "from_dtensor",
    "from_callback",
    "all_gather",
    "all_to_all",
    "axis_index",
    "axis_size",
    "broadcast",
    "broadcast_batches",
    "clear_caches",
    "current_mesh",
    "debug",
    "debug_enabled",
    "explicit_order",
    "from_torch_placement",
    "global_shape_and_stride",
    "heads_to_seq",
    "infer_out_specs",
    "init_sharded",
    "init_mesh",
    "local_indices",
    "local_shape_and_offset",
    "local_stride",
    "merge",
    "optim",
    "P",
    "Partial",
    "Placement",
    "pmap_microbatch",
    "pipeline",
    "pipeline_schedule",
    "pipeline_value_and_grad",
    "PipelineSchedule",
    "pmax",
    "pmean",
    "pmin",
    "ppermute",
    "prepare_lm_batch",
    "psum",
    "ragged_all_to_all",
    "psum_scatter",
    "reduce_gradients",
    "Replicate",
    "ring_attention",
    "usp_attention",
    "seq_positions",
    "seq_to_heads",
    "sequence_parallel",
    "SequenceParallel",
    "Shard",
    "shard_map",
    "shard_map_seq",
    "shard_tensor",
    "spawn",
    "SpawnError",
    "specs_of",
    "split",
    "StridedShard",
    "to_torch_placement",
    "token_mean_loss",
    "ulysses_attention",
    "unshard_tensor",
    "use_mesh",
    "cross_entropy",
    "tensor_parallel",
    "tensor_parallel_plan",
    "tensor_parallel_specs",
    "expert_parallel",
    "expert_parallel_specs",
    "jit",
    "ConcretizationError",
    "NotTraceable",
]
