"""pshard: JAX-style functional parallelism for PyTorch."""

from ._placements import P as P
from ._placements import Partial as Partial
from ._placements import Placement as Placement
from ._placements import Replicate as Replicate
from ._placements import Shard as Shard
from ._placements import StridedShard as StridedShard
from ._placements import from_torch_placement as from_torch_placement
from ._placements import to_torch_placement as to_torch_placement

__version__ = "0.1.0"

__all__ = [
    "P",
    "Partial",
    "Placement",
    "Replicate",
    "Shard",
    "StridedShard",
    "from_torch_placement",
    "to_torch_placement",
]
