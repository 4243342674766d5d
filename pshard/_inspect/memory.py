"""``ps.memory_estimate``: the bytes a layout takes on a rank, from shapes alone.

Each parameter's block on this rank (:func:`pshard._core.global_tensor.block_runs`, the layout
math every ``GlobalTensor`` uses: uneven and strided splits exact) gives the parameters' bytes,
and the gradients' (blocks of the same layout and dtype); the optimizer's state is what its
``init`` makes of meta tensors of those blocks (``ps.optim``'s transforms, and any optax-like
object whose ``init`` makes its state from the parameters' shapes and dtypes); the largest
``sharded_call`` unit's parameters whole (in ``param_dtype``) is what a rank holds gathered at
once. Nothing is allocated: a model built on the meta device, a 70B one on 64 ranks, costs
nothing to estimate.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import optree
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from .._core.global_tensor import GlobalMeta, MeshKey, block_runs, is_global, mesh_key
from .._core.specs import broadcast_prefix_flat
from .._core.tree import NAMESPACE, describe, tree_flatten
from .._runtime.mesh import mesh_for
from .._shard_map.global_ops import spec_over_key
from .._shard_map.sharded_call import default_units

__all__ = ["memory_estimate"]

_FN = "memory_estimate"


def _mesh(mesh: Any) -> tuple[MeshKey, dict[str, int]]:
    """The mesh by value and this rank's coordinate (rank 0's for a dict of axis sizes)."""
    if mesh is None:
        mesh = mesh_for(_FN)
    if isinstance(mesh, DeviceMesh):
        key = mesh_key(mesh)
        coord = mesh.get_coordinate()
        here = dict(zip(key.names, coord or (0,) * len(key.names), strict=True))
        return key, here
    if isinstance(mesh, Mapping) and all(
        isinstance(n, str) and isinstance(s, int) and s >= 1 for n, s in mesh.items()
    ):
        names, sizes = tuple(mesh), tuple(mesh.values())
        key = MeshKey(names, sizes, tuple(range(math.prod(sizes))), "cpu")
        return key, dict.fromkeys(names, 0)
    raise TypeError(
        f"{_FN}: mesh must be a DeviceMesh, a dict of axis name -> size, or None (the current "
        f"mesh), got {describe(mesh)}"
    )


def _parameters(module_or_params: Any) -> tuple[dict[str, Any], nn.Module | None]:
    if isinstance(module_or_params, nn.Module):
        return dict(module_or_params.named_parameters()), module_or_params
    if isinstance(module_or_params, Mapping):
        for name, v in module_or_params.items():
            if not (isinstance(v, torch.Tensor) or is_global(v)):
                raise TypeError(
                    f"{_FN}: params[{name!r}] is {describe(v)}; give tensors (meta ones do), "
                    f"GlobalTensors, or the module"
                )
        return dict(module_or_params), None
    raise TypeError(
        f"{_FN}: module_or_params must be an nn.Module or a dict of name -> tensor, got "
        f"{describe(module_or_params)}"
    )


def _bytes(tree: Any) -> int:
    leaves = optree.tree_leaves(tree, namespace=NAMESPACE)
    return sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))


def memory_estimate(
    module_or_params: Any,
    specs: Any,
    *,
    optimizer: Any = None,
    param_dtype: torch.dtype | None = None,
    mesh: Any = None,
) -> dict[str, int]:
    """The bytes a layout of a model's parameters takes on this rank, from shapes alone.

    Returns ``{"params", "grads", "optimizer", "gathered_unit"}``: this rank's blocks of the
    parameters (in their dtypes), of their gradients (the same blocks), of the optimizer's
    state (what ``optimizer.init`` makes for those blocks: AdamW's two moments, a step count),
    and the largest ``sharded_call`` unit's parameters whole (a decoder layer's, gathered
    before it runs; in ``param_dtype`` when given, as ``sharded_call(param_dtype=...)``
    gathers). They equal what ``ps.shard`` / ``ps.init_sharded`` and ``optimizer.init`` make
    (uneven and strided layouts included).

    Args:
        module_or_params: a module (built on the meta device costs nothing) or a dict of
            parameters by name (tensors, meta ones included, or GlobalTensors, whose own
            layout is used where ``specs`` gives ``None``).
        specs: a prefix tree of the parameters by name: ``P(...)`` over the mesh axes,
            ``Shard(d)``, ``None`` / ``Replicate()`` (replicated), as ``ps.init_sharded``.
        optimizer: a ``ps.optim`` transform (or any object whose ``init(params)`` makes its
            state from the parameters' shapes and dtypes); ``None``: no state.
        param_dtype: the dtype units are gathered in (FSDP2's mixed precision).
        mesh: the mesh, or a dict of axis sizes (``{"dp": 8, "tp": 8}``: no processes needed;
            the estimate is then rank 0's, the largest blocks under ``torch.chunk``'s sizes);
            default the current mesh.

    Returns:
        ``{"params": int, "grads": int, "optimizer": int, "gathered_unit": int}``, in bytes.

    Raises:
        TypeError: arguments of the wrong kind.
        ValueError: a spec that does not fit its parameter (naming it).

    Example:
        >>> import torch, pshard as ps
        >>> with torch.device("meta"):
        ...     model = torch.nn.Linear(1024, 1024)
        >>> ps.memory_estimate(model, ps.P("dp"), optimizer=ps.optim.adamw(1e-3),
        ...                    mesh={"dp": 4})
        {'params': 1049600, 'grads': 1049600, 'optimizer': 2099208, 'gathered_unit': 4198400}
    """
    key, here = _mesh(mesh)
    params, module = _parameters(module_or_params)
    leaves, treedef = tree_flatten({n: n for n in params})
    placed = dict(zip(leaves, broadcast_prefix_flat(specs, treedef, leaves, name="specs",
                                                    fn_name=_FN), strict=True))  # fmt: skip
    blocks: dict[str, torch.Tensor] = {}
    for name, value in params.items():
        spec = placed[name]
        if spec is None and is_global(value):
            meta: GlobalMeta = value.meta
            if meta.key.names != key.names or meta.key.sizes != key.sizes:
                raise ValueError(
                    f"{_FN} specs[{name!r}]: a GlobalTensor on mesh {meta.key.text()} but the "
                    f"estimate is for mesh {key.text()}; give its spec"
                )
            shape, dtype = tuple(meta.shape), value.dtype
        else:
            shape, dtype = tuple(value.shape), value.dtype
            full = spec_over_key(spec, len(shape), key, _FN, f"specs[{name!r}]")
            meta = GlobalMeta(full, key, shape, None)
        runs = block_runs(meta, here)
        blocks[name] = torch.empty(tuple(sum(map(len, r)) for r in runs), dtype=dtype,
                                   device="meta")  # fmt: skip
    size = _bytes(blocks)
    state = 0 if optimizer is None else _bytes(optimizer.init(blocks))
    return {
        "params": size,
        "grads": size,
        "optimizer": state,
        "gathered_unit": _largest_unit(params, module, param_dtype),
    }


def _largest_unit(params: dict[str, Any], module: nn.Module | None, dtype: Any) -> int:
    """The bytes of the largest group of parameters gathered at once: each ``sharded_call``
    unit of ``module`` (and the rest of its parameters, gathered with the model's own call),
    or each parameter alone without a module."""

    def whole(name: str) -> int:
        value = params[name]
        numel = math.prod(tuple(value.shape))
        kind = dtype if dtype is not None and value.is_floating_point() else value.dtype
        return numel * torch.empty((), dtype=kind, device="meta").element_size()

    if module is None:
        return max((whole(n) for n in params), default=0)
    prefixes = [p for p, _ in default_units(module)]
    groups: dict[str, int] = {}
    for name in params:
        owner = next((p for p in prefixes if name.startswith(p + ".")), "")
        groups[owner] = groups.get(owner, 0) + whole(name)
    return max(groups.values(), default=0)
