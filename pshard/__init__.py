"""pshard: JAX-style functional parallelism for PyTorch."""

from ._mesh import current_mesh as current_mesh
from ._mesh import init_mesh as init_mesh
from ._mesh import use_mesh as use_mesh
from ._placements import P as P
from ._placements import Partial as Partial
from ._placements import Placement as Placement
from ._placements import Replicate as Replicate
from ._placements import Shard as Shard
from ._placements import StridedShard as StridedShard
from ._placements import from_torch_placement as from_torch_placement
from ._placements import to_torch_placement as to_torch_placement
from ._spawn import SpawnError as SpawnError
from ._spawn import spawn as spawn

__version__ = "0.1.0"

__all__ = [
    "current_mesh",
    "init_mesh",
    "use_mesh",
    "P",
    "Partial",
    "Placement",
    "Replicate",
    "Shard",
    "StridedShard",
    "from_torch_placement",
    "to_torch_placement",
    "SpawnError",
    "spawn",
]
