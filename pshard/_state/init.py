"""``ps.init_sharded``: a module's random parameters as GlobalTensors, each rank drawing only
its blocks.

The whole value of a parameter is a function of ``(seed, name)`` (and of its shape, dtype and
initialiser), the same on any mesh: the parameter is cut into a fixed grid of tiles that
depends only on its shape (:func:`tile_shape`, at most :data:`TILE` elements each), every tile
drawn on the CPU from a generator of its own, seeded from ``(seed, name, tile index)``
(:func:`tile_seed`). A rank draws the tiles its block touches, one at a time, and copies their
overlap into its block: it never holds more than its block and one tile.

What a tile holds comes from the module's own initialiser, run once on stand-ins: the
parameters are swapped for storage-less tensors of their shapes (meta tensors that do not say
they are meta, so ``torch.nn.init`` functions that skip meta tensors run and fail loudly if they
read values) while a dispatch mode records, per parameter, each in-place operation that writes
it (a random fill such as ``normal_`` / ``uniform_``, or an elementwise one such as ``fill_``,
``zero_``, ``mul_``) with the box of the parameter it writes (a row for an embedding's
``padding_idx``). Replaying those operations on a tile, with the tile's generator for the
random ones, gives the tile the distribution the initialiser gives the parameter. Operations
that need the whole value (``nn.init.orthogonal_``, ``trunc_normal_``'s rejection sampling, a
``copy_`` from a computed tensor) are refused, naming the parameter.

The initialiser is the one the model adapter of the module's family gives
(:class:`pshard._modules.adapter.InitializerPart`; the Hugging Face integration's is the
model's own weight initialisation), else each submodule's ``reset_parameters()``, children
first (as ``Module.apply``). Ranks that are threads of one process may pass the same module:
one at a time swaps its parameters for stand-ins (a lock held while the initialiser runs).
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import math
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from .._compat import TorchDispatchMode, make_subclass, reparametrized, storage_key
from .._core.global_tensor import GlobalMeta, GlobalTensor, block_runs, mesh_key
from .._core.specs import broadcast_prefix_flat
from .._core.tree import describe, tree_flatten
from .._modules.adapter import initializer_part
from .._runtime.mesh import mesh_for
from .._shard_map.global_ops import global_spec

__all__ = [
    "TILE",
    "init_sharded",
    "tile_seed",
    "tile_shape",
]

_FN = "init_sharded"

#: The most elements a tile holds.
TILE = 1 << 16

Box = tuple[range, ...]


# held while a module's parameters are swapped for stand-ins (ranks that are threads of one
# process may pass the same module)
_SWAPPING = threading.Lock()


def _reset_all(module: nn.Module) -> Callable[[], None]:
    def reset(m: nn.Module) -> None:
        fn = getattr(m, "reset_parameters", None)
        if callable(fn):
            fn()

    def run() -> None:
        module.apply(reset)

    return run


def _initializer(module: nn.Module) -> tuple[str, Callable[[], None]]:
    part = initializer_part(module)
    run = part.initializer(module) if part is not None else None
    if part is not None and run is not None:
        return getattr(part, "name", type(part).__name__), run
    return "reset_parameters", _reset_all(module)


# --------------------------------------------------------------------------- recording


class _StandIn(torch.Tensor):
    """A parameter's stand-in: a meta tensor that does not say so, so that initialisers which
    skip meta tensors run (and fail where they read values)."""

    @property
    def is_meta(self) -> bool:  # type: ignore[override]
        return False


@dataclasses.dataclass(frozen=True)
class _Op:
    """One write of a parameter: ``func(view, *args, **kwargs)`` on the elements in ``box``
    (``generator=`` added for a random one)."""

    func: Any
    box: Box
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    random: bool


_ELEMENTWISE = ("fill_", "zero_")


def _box(view: torch.Tensor, shape: tuple[int, ...]) -> Box | None:
    """The elements of a contiguous tensor of ``shape`` that ``view`` (a view of its storage)
    covers, as one range per dim; ``None`` when they are not a box (a diagonal, a step)."""
    whole = tuple(range(n) for n in shape)
    if view.numel() == math.prod(shape) and view.storage_offset() == 0 and view.is_contiguous():
        return whole
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    starts, rest = [], int(view.storage_offset())
    for s in strides:
        q, rest = divmod(rest, s)
        starts.append(q)
    if any(q >= n for q, n in zip(starts, shape, strict=True)):
        return None
    box = [range(q, q + 1) for q in starts]
    used: set[int] = set()
    for n, st in zip(view.shape, view.stride(), strict=True):
        if n == 1:
            continue
        dims = [d for d in range(len(shape)) if strides[d] == st and shape[d] > 1 and d not in used]
        if not dims or starts[dims[0]] + n > shape[dims[0]]:
            return None
        d = dims[0]
        box[d] = range(starts[d], starts[d] + n)
        used.add(d)
    return tuple(box)


def _refusal(name: str, what: str) -> ValueError:
    return ValueError(
        f"{_FN}: the initialiser of parameter {name!r} {what}; init_sharded draws each rank's "
        f"blocks tile by tile, so it replays random fills (normal_, uniform_, ...) and "
        f"elementwise writes (fill_, zero_, mul_, ...) only; initialise this parameter "
        f"otherwise (e.g. give its module a reset_parameters() that does), or build it whole "
        f"and ps.shard it"
    )


class _Recorder(TorchDispatchMode):
    """Records every write of a stand-in (by storage) as an :class:`_Op` of its parameter."""

    def __init__(self, names: dict[int, str], shapes: dict[str, tuple[int, ...]]) -> None:
        super().__init__()
        self.names = names
        self.shapes = shapes
        self.ops: dict[str, list[_Op]] = {n: [] for n in shapes}
        self.last: str | None = None

    def _param(self, t: Any) -> str | None:
        if not isinstance(t, torch.Tensor) or t.device.type != "meta":
            return None
        return self.names.get(storage_key(t))

    def __torch_dispatch__(
        self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None
    ) -> Any:
        kwargs = dict(kwargs or {})
        schema = func._schema
        written = [
            (i, a.name)
            for i, a in enumerate(schema.arguments)
            if a.alias_info is not None and a.alias_info.is_write
        ]
        for i, arg_name in written:
            value = args[i] if i < len(args) else kwargs.get(arg_name)
            name = self._param(value)
            if name is not None:
                self._record(func, name, i, value, args, kwargs)
        return func(*args, **kwargs)

    def _record(
        self, func: Any, name: str, i: int, view: torch.Tensor, args: Sequence[Any], kwargs: Any
    ) -> None:
        self.last = name
        op = func.__name__.split(".")[0]
        random = torch.Tag.nondeterministic_seeded in func.tags
        if i != 0 or not (random or torch.Tag.pointwise in func.tags or op in _ELEMENTWISE):
            what = "copies a tensor into it" if op == "copy_" else f"writes it with {op}"
            raise _refusal(name, what)
        box = _box(view, self.shapes[name])
        if box is None:
            raise _refusal(name, f"writes a strided part of it ({op} on a view of shape "
                                 f"{tuple(view.shape)}, strides {view.stride()})")  # fmt: skip
        rest = list(args[1:])
        for value in [*rest, *kwargs.values()]:
            if isinstance(value, torch.Tensor) and (value.device.type == "meta" or value.ndim):
                raise _refusal(name, f"writes it with {op} from another tensor ({describe(value)})")
        kwargs = {k: v for k, v in kwargs.items() if k != "generator"}
        self.ops[name].append(_Op(func, box, tuple(rest), kwargs, random))


def _covered(ops: list[_Op], shape: tuple[int, ...]) -> bool:
    """Whether the boxes of ``ops`` together cover every element of ``shape``."""
    if math.prod(shape) == 0:
        return True
    cuts = [
        sorted({0, n, *(b for op in ops for b in (op.box[d].start, op.box[d].stop))})
        for d, n in enumerate(shape)
    ]
    cells = [list(zip(c[:-1], c[1:], strict=True)) for c in cuts]
    for cell in itertools.product(*cells):
        if not any(
            all(r.start <= a and b <= r.stop for (a, b), r in zip(cell, op.box, strict=True))
            for op in ops
        ):
            return False
    return True


def _record_writes(module: nn.Module) -> dict[str, tuple[list[_Op], torch.dtype, tuple[int, ...]]]:
    """Run the module's initialiser on stand-ins: per parameter (first name of each, as
    ``named_parameters()``), the writes that initialise it, its dtype and shape.

    Raises:
        ValueError: a write that cannot be replayed tile by tile, a parameter replaced or left
            (partly) unwritten, or an initialiser that fails on stand-ins.
    """
    every = dict(module.named_parameters(remove_duplicate=False))
    first: dict[int, str] = {}
    for name, p in every.items():
        first.setdefault(id(p), name)
    stand_ins: dict[int, torch.Tensor] = {}
    for p in every.values():
        if id(p) not in stand_ins:
            meta = torch.empty(tuple(p.shape), dtype=p.dtype, device="meta")
            stand_ins[id(p)] = make_subclass(_StandIn, meta)
    tensors = {name: stand_ins[id(p)] for name, p in every.items()}
    shapes = {first[i]: tuple(s.shape) for i, s in stand_ins.items()}
    keys = {storage_key(s): first[i] for i, s in stand_ins.items()}
    which, run = _initializer(module)
    recorder = _Recorder(keys, shapes)
    # ranks that are threads may share the module: one swaps its parameters at a time
    with _SWAPPING, reparametrized(module, tensors):
        try:
            with torch.no_grad(), recorder:
                run()
        except ValueError:
            raise
        except Exception as e:
            after = f" (after writing {recorder.last!r})" if recorder.last else ""
            raise ValueError(
                f"{_FN}: the module's initialiser ({which}) failed on pshard's stand-ins for its "
                f"parameters{after}: {type(e).__name__}: {e}; an initialiser that reads the "
                f"values it draws (nn.init.trunc_normal_'s rejection sampling, orthogonal_) or "
                f"computes them from data cannot be drawn tile by tile"
            ) from e
        now = dict(module.named_parameters(remove_duplicate=False))
        for name, t in tensors.items():
            if now.get(name) is not t or storage_key(t) not in keys:
                raise ValueError(
                    f"{_FN}: the module's initialiser ({which}) replaces parameter {name!r} "
                    f"instead of writing it in place; init_sharded can only replay writes"
                )
    out = {}
    for i, s in stand_ins.items():
        name = first[i]
        ops = recorder.ops[name]
        if not _covered(ops, shapes[name]):
            raise ValueError(
                f"{_FN}: parameter {name!r} (shape {shapes[name]}) is not initialised "
                f"{'in full ' if ops else ''}by the module's initialiser ({which}); give its "
                f"module a reset_parameters() that writes it (nn.init functions do)"
            )
        out[name] = (ops, s.dtype, shapes[name])
    return out


# --------------------------------------------------------------------------- tiles


def tile_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The tile grid's step per dim for a parameter of ``shape`` (a function of the shape
    alone): tiles of at most :data:`TILE` elements, as square as the dims allow (256 x 256 for
    a matrix), so that a block split along any dim touches few tiles it does not hold.

    Example:
        >>> from pshard._state.init import tile_shape
        >>> tile_shape((32000, 4096)), tile_shape((300, 20)), tile_shape((70000,)), tile_shape(())
        ((256, 256), (300, 20), (65536,), ())
    """
    out = [1] * len(shape)
    budget = TILE
    for d in reversed(range(len(shape))):
        cap = _root(budget, d + 1)
        out[d] = max(1, min(shape[d], cap))
        budget = max(1, budget // out[d])
    return tuple(out)


def _root(n: int, k: int) -> int:
    """The largest ``c`` with ``c ** k <= n`` (integers: the same on every machine)."""
    c = max(1, int(n ** (1 / k)))
    while c > 1 and c**k > n:
        c -= 1
    while (c + 1) ** k <= n:
        c += 1
    return c


def tile_seed(seed: int, name: str, index: int) -> int:
    """The seed of tile ``index`` (row-major in the grid) of parameter ``name``."""
    digest = hashlib.blake2b(f"{seed}\0{name}\0{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _overlap(a: Box, b: Box) -> Box | None:
    out = []
    for x, y in zip(a, b, strict=True):
        lo, hi = max(x.start, y.start), min(x.stop, y.stop)
        if lo >= hi:
            return None
        out.append(range(lo, hi))
    return tuple(out)


def _within(inner: Box, outer: Box) -> tuple[slice, ...]:
    return tuple(
        slice(i.start - o.start, i.stop - o.start) for i, o in zip(inner, outer, strict=True)
    )


def _draw_tile(ops: list[_Op], box: Box, buffer: torch.Tensor, seed: int) -> torch.Tensor:
    """The tile at ``box``, drawn into the front of ``buffer`` (contiguous, so that a random
    fill gives the same values whatever holds the tile)."""
    shape = [len(r) for r in box]
    tile = buffer[: math.prod(shape)].view(shape)
    gen = torch.Generator().manual_seed(seed)
    for op in ops:
        part = _overlap(op.box, box)
        if part is None:
            continue
        view = tile[_within(part, box)]
        if op.random:
            op.func(view, *op.args, **op.kwargs, generator=gen)
        else:
            op.func(view, *op.args, **op.kwargs)
    return tile


def _draw_block(
    name: str,
    ops: list[_Op],
    dtype: torch.dtype,
    shape: tuple[int, ...],
    runs: tuple[tuple[range, ...], ...],
    seed: int,
    device: torch.device,
) -> torch.Tensor:
    """This rank's block (the elements ``runs`` lists per dim) of parameter ``name``, drawn
    tile by tile."""
    block = torch.empty([sum(map(len, r)) for r in runs], dtype=dtype, device=device)
    if block.numel() == 0:
        return block
    step = tile_shape(shape)
    grid = [-(-n // t) for n, t in zip(shape, step, strict=True)]
    pieces = []  # per dim: (global range, first index in the block)
    for dim_runs in runs:
        at, dim_pieces = 0, []
        for r in dim_runs:
            dim_pieces.append((r, at))
            at += len(r)
        pieces.append(dim_pieces)
    buffer = torch.empty(math.prod(step), dtype=dtype)
    wanted = [
        sorted({i for r, _ in dim_pieces for i in range(r.start // t, -(-r.stop // t))})
        for dim_pieces, t in zip(pieces, step, strict=True)
    ]
    for index in itertools.product(*wanted):
        box = tuple(
            range(i * t, min((i + 1) * t, n)) for i, t, n in zip(index, step, shape, strict=True)
        )
        flat = 0
        for i, g in zip(index, grid, strict=True):
            flat = flat * g + i
        tile: torch.Tensor | None = None
        for combo in itertools.product(*pieces):
            part = _overlap(tuple(r for r, _ in combo), box)
            if part is None:
                continue
            if tile is None:
                tile = _draw_tile(ops, box, buffer, tile_seed(seed, name, flat))
            local = tuple(
                slice(p.start - r.start + at, p.stop - r.start + at)
                for p, (r, at) in zip(part, combo, strict=True)
            )
            block[local].copy_(tile[_within(part, box)])
    return block


# --------------------------------------------------------------------------- the function


def init_sharded(
    module: nn.Module, specs: Any, *, seed: int, mesh: DeviceMesh | None = None
) -> dict[str, GlobalTensor]:
    """Random parameters for ``module`` as :class:`~pshard.GlobalTensor` s laid out as
    ``specs`` says, each rank drawing only its blocks (never the whole).

    The whole value of each parameter is a function of ``(seed, name)``, the same on any mesh
    and in any layout (``ps.gather`` of the result is the same on 1, 2 or 4 ranks), with the
    distribution the module's own initialiser gives it: a Hugging Face model's weight
    initialisation (``normal(0, initializer_range)`` for linear and embedding weights, zeros
    for biases and an embedding's ``padding_idx`` row, ones for norm weights), else each
    submodule's ``reset_parameters()`` (``nn.Linear``: Kaiming-uniform weight,
    ``uniform(-1/sqrt(fan_in), 1/sqrt(fan_in))`` bias; ``nn.Embedding``: ``normal(0, 1)``;
    norms: ones and zeros). The values are not those the initialiser would draw on one
    device: each tile of the parameter is drawn from a generator of its own (see the module
    docs); their distribution is. Initialisers that need the whole value
    (``nn.init.orthogonal_``, ``trunc_normal_``) are refused.

    Args:
        module: the module, usually built on the meta device
            (``with torch.device("meta"): model = Model(config)``); its parameters are not
            modified (its meta buffers are computed, below).
        specs: a prefix tree of the dict of parameters by name (one spec for all, or
            ``{name: spec}``): ``P(...)`` over the mesh axes, ``None`` / ``Replicate()``
            (replicated), or ``Shard(d)``.
        seed: the seed of the whole (an int).
        mesh: the mesh; default :func:`pshard.current_mesh`.

    Returns:
        ``{name: GlobalTensor}`` for the parameters (tied ones once, under their first name,
        as ``named_parameters()``), in the parameters' dtypes, on the mesh's device type.
        Buffers are not drawn: the module's own initialiser computes those on the meta
        device (a rotary embedding's ``inv_freq``, a norm's running statistics) into real
        tensors on the mesh's device type, put in the module in place of the meta ones (the
        only change to ``module``; ranks that share the module compute them once).

    Raises:
        ValueError: a spec that does not fit (naming the parameter), or an initialiser that
            cannot be replayed tile by tile (naming the parameter and the operation).

    Example:
        >>> import torch, pshard as ps
        >>> mesh = ps.init_mesh({"dp": 1})
        >>> with torch.device("meta"):
        ...     layer = torch.nn.Linear(4, 3)
        >>> params = ps.init_sharded(layer, ps.P("dp"), seed=0)
        >>> params["weight"].shape, params["bias"].spec
        (torch.Size([3, 4]), P('dp'))
        >>> bool(params["weight"].local.abs().max() <= 0.5)      # uniform(-1/2, 1/2)
        True
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"{_FN}: module must be an nn.Module, got {describe(module)}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"{_FN}: seed must be an int, got {describe(seed)}")
    if mesh is None:
        mesh = mesh_for(_FN)
    elif not isinstance(mesh, DeviceMesh):
        raise TypeError(f"{_FN}: mesh must be a DeviceMesh, got {describe(mesh)}")
    recipes = _record_writes(module)
    leaves, treedef = tree_flatten({name: name for name in recipes})
    flat = broadcast_prefix_flat(specs, treedef, leaves, name="specs", fn_name=_FN)
    placed = dict(zip(leaves, flat, strict=True))
    key = mesh_key(mesh)
    coord = {n: mesh.get_local_rank(n) for n in key.names}
    device = torch.device(key.device_type)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    out: dict[str, GlobalTensor] = {}
    for name in recipes:
        ops, dtype, shape = recipes[name]
        spec = global_spec(placed[name], len(shape), mesh, _FN, f"specs[{name!r}]")
        meta = GlobalMeta(spec, key, shape, mesh)
        block = _draw_block(name, ops, dtype, shape, block_runs(meta, coord), seed, device)
        out[name] = GlobalTensor(block, meta)
    _materialise_buffers(module, device)
    return out


def _materialise_buffers(module: nn.Module, device: torch.device) -> None:
    """The module's buffers on the meta device computed by its own initialiser (a rotary
    embedding's ``inv_freq``, a norm's running statistics) into real tensors on ``device``,
    put in place of the meta ones; those it does not write wholly stay on the meta device
    (``sharded_call`` names them). The parameters are meta tensors meanwhile: nothing whole."""
    buffers = [(n, b) for n, b in module.named_buffers(remove_duplicate=False) if b.is_meta]
    if not buffers:
        return
    real = {n: _unwritten(b, device) for n, b in buffers}
    params = {
        n: make_subclass(_StandIn, torch.empty(tuple(p.shape), dtype=p.dtype, device="meta"))
        for n, p in module.named_parameters(remove_duplicate=False)
    }
    which, run = _initializer(module)
    with _SWAPPING, reparametrized(module, {**params, **real}), torch.no_grad():
        try:
            run()
        except Exception:  # an initialiser that reads its parameters' values: no buffers
            return
    for name, t in real.items():
        if not _written_whole(t):
            continue
        prefix, _, leaf = name.rpartition(".")
        owner = module.get_submodule(prefix) if prefix else module
        current = owner._buffers.get(leaf)
        if current is not None and current.is_meta:
            owner._buffers[leaf] = t


def _unwritten(b: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A real tensor of ``b``'s shape and dtype, filled with what a write would replace."""
    t = torch.empty(tuple(b.shape), dtype=b.dtype, device=device)
    if t.is_floating_point() or t.is_complex():
        return t.fill_(float("nan"))
    if t.dtype == torch.bool:
        return t.fill_(False)
    return t.fill_(torch.iinfo(t.dtype).min)


def _written_whole(t: torch.Tensor) -> bool:
    if t.is_floating_point() or t.is_complex():
        return not bool(torch.isnan(t).any())
    if t.dtype == torch.bool:
        return True
    return not bool((t == torch.iinfo(t.dtype).min).any())
