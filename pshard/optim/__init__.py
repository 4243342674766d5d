"""``ps.optim``: optax's gradient transformations for PyTorch pytrees.

A transform is a pair of pure functions, ``init(params) -> state`` and
``update(grads, state, params=None) -> (updates, state)``; ``apply_updates(params, updates)``
adds the updates. Names, arguments and update rules follow optax. On trees of
:class:`~pshard.GlobalTensor` s every state tensor is a ``GlobalTensor`` of its parameter's
layout (``ps.save`` / ``ps.load`` store and reshard it) and the math runs on this rank's blocks
with torch's multi-tensor (foreach) kernels, one call per device and dtype.
``docs/optim.md`` maps optax to pshard.

Private modules, bottom up: ``_kernels`` (torch's foreach kernels, looked up once),
``_leaves`` (trees as the kernels see them: flat lists of blocks, checked and grouped),
``_base`` (``GradientTransformation``, ``chain``, ``apply_updates``, schedules as learning
rates, donation), ``_schedules``, ``_norm`` (``global_norm`` over sharded trees,
``clip_by_global_norm``), ``_sgd``, ``_adam``.

Imports :mod:`pshard._compat`, :mod:`pshard._core`, :mod:`pshard._runtime` and
:mod:`pshard._collectives`; sits beside :mod:`pshard._microbatch`, :mod:`pshard.sequence` and
:mod:`pshard._state`.
"""

from ._adam import ScaleByAdamState as ScaleByAdamState
from ._adam import adam as adam
from ._adam import adamw as adamw
from ._base import EmptyState as EmptyState
from ._base import GradientTransformation as GradientTransformation
from ._base import apply_updates as apply_updates
from ._base import chain as chain
from ._norm import clip_by_global_norm as clip_by_global_norm
from ._norm import global_norm as global_norm
from ._schedules import cosine_decay_schedule as cosine_decay_schedule
from ._schedules import linear_schedule as linear_schedule
from ._schedules import warmup_cosine_decay_schedule as warmup_cosine_decay_schedule
from ._sgd import SgdState as SgdState
from ._sgd import sgd as sgd

__all__ = [
    "EmptyState",
    "GradientTransformation",
    "ScaleByAdamState",
    "SgdState",
    "adam",
    "adamw",
    "apply_updates",
    "chain",
    "clip_by_global_norm",
    "cosine_decay_schedule",
    "global_norm",
    "linear_schedule",
    "sgd",
    "warmup_cosine_decay_schedule",
]
