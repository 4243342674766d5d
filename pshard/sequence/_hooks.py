"""``sequence_parallel``: sequence parallelism for an ``nn.Module`` through forward hooks.

For models whose code you do not want to rewrite as a function (Hugging Face models): while the
context manager is active, each call of the model

1. (pre-hook) binds positional arguments to their names by the ``forward`` signature; when a
   model adapter knows the model (:mod:`pshard._modules.adapter`), lets it prepare the whole
   call (refusals, labels shifted over the whole sequence, segment ids of padding and packed
   documents); adds ``position_ids`` when absent (``arange(seq_len)``, before sharding, so they
   are the true positions), turns an int ``logits_to_keep`` into a boolean mask over the whole
   sequence, and splits every tensor argument whose dim 1 is the sequence (the length of
   ``input_ids`` or ``inputs_embeds``) exactly as :func:`pshard.shard_map_seq` does (pad,
   permute, take this rank's block); labels are padded with -100, everything else with 0
   (``logits_to_keep`` with ``False``). The argument names are pshard's causal-LM batch
   convention (:mod:`pshard.sequence._lm`);
2. runs ``forward`` inside the sequence context, so ``ps.ulysses_attention`` and
   ``ps.seq_positions`` inside the model know the layout (and an attention the adapter plugged
   finds the call's, :func:`pshard.sequence.plug.plugged_attention`);
3. (post-hook) gathers every output tensor whose dim 1 is this rank's tokens (and ``logits``
   restricted by ``logits_to_keep``) back into the whole sequence, un-permuted and unpadded;
   a loss the adapter says is this rank's share is summed over the axis.

Gradients: a gathered output is a whole value, the same on every rank, whose cotangent each
rank slices, and a split input's transpose puts the cotangent back at this rank's positions
(no communication either way). Each rank's parameter and input gradients are therefore its own
tokens' share; :func:`reduce_gradients` (a ``psum`` of every ``.grad`` over the axis) completes
them. The boundary itself is :class:`pshard.sequence._seq_boundary.SeqBoundary`.
"""

from __future__ import annotations

import contextlib
import inspect
import zlib
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from .._collectives.functions import all_gather
from .._core.checks import axis_names
from .._core.tree import describe, tree_flatten_with_path, tree_unflatten
from .._modules.adapter import ModelAdapter, PreparedCall, find_adapter, registered_adapters
from .._runtime.debug import debug_enabled
from .._runtime.mesh import Axis, AxisInfo, mesh_for, resolve_axis, use_mesh
from .._runtime.rank_local import MISSING, handle_slots, hold
from .._runtime.wire import Comm, all_reduce, comm
from .._shard_map.boundary import check_replicated
from ._context import SeqAttention, SeqContext, record_for_backward, sequence_context
from ._layouts import SeqLayout, check_layout, pad_permute
from ._lm import (
    IGNORE_INDEX,
    LABEL_KEYS,
    LOGITS,
    LOGITS_TO_KEEP,
    POSITION_IDS,
    SEQUENCE_KEYS,
)
from ._seq_boundary import SeqBoundary
from .plug import ATTENTIONS

__all__ = ["SequenceParallel", "reduce_gradients", "sequence_parallel"]

_FN = "sequence_parallel"


class _Call:
    """One call of the model: what the post-hook needs from its pre-hook, and what the
    sequence context carries of it (a :class:`~pshard.sequence._context.CallState`)."""

    def __init__(
        self,
        boundary: SeqBoundary,
        keep: torch.Tensor | None,
        prepared: PreparedCall | None,
        attention: SeqAttention | None,
        rescope: Callable[[], Callable[[], None] | None] | None,
    ) -> None:
        self.boundary = boundary
        self.keep = keep  # logits_to_keep over the whole sequence, when it keeps some
        self.prepared = prepared  # what the model adapter made of the call, if any
        self.attention = attention  # the attention plugged for the call, if any
        self._rescope = rescope
        self.attended = 0  # sequence-parallel attention calls during the forward
        self.context: SeqContext | None = None  # the call's sequence context
        self.scopes: list[contextlib.AbstractContextManager[Any]] = []

    def backward_scope(self) -> Callable[[], None] | None:
        """A backward pass through the call plugs its attention again for recomputed layers
        (see :mod:`pshard.sequence._context`)."""
        return None if self._rescope is None else self._rescope()


class SequenceParallel:
    """The context manager :func:`sequence_parallel` returns (hooks live while it is entered).

    Attributes:
        model: the module.
        axis: the sequence-parallel axis.
    """

    def __init__(
        self,
        model: nn.Module,
        axis: str | tuple[str, ...],
        mesh: DeviceMesh | None,
        gather_outputs: bool,
        layout: str,
        attention: str | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"{_FN}: model must be an nn.Module, got {describe(model)}")
        names = axis_names(axis, _FN)
        if mesh is not None and not isinstance(mesh, DeviceMesh):
            raise TypeError(f"{_FN}: mesh must be a DeviceMesh, got {describe(mesh)}")
        self._name = type(model).__name__
        self._adapter = find_adapter(model)
        if attention is not None:
            if attention not in ATTENTIONS:
                raise ValueError(
                    f"{_FN}({self._name}): attention must be None, 'ulysses', 'ring' or 'usp', "
                    f"got {attention!r}"
                )
            if attention == "usp" and len(names) != 2:
                raise ValueError(
                    f"{_FN}({self._name}): attention='usp' needs axis=(ring_axis, ulysses_axis), "
                    f"two mesh axes (the ring across, Ulysses inside), got axis={axis!r}"
                )
            if self._adapter is None:
                interfaces = " or ".join(a.interface for a in registered_adapters())
                raise TypeError(
                    f"{_FN}({self._name}): attention={attention!r} plugs into "
                    f"{interfaces or 'the attention of a model a model adapter knows'}, and no "
                    f"registered model adapter knows {self._name}; call ps.{attention}_attention "
                    f"inside its forward instead and leave attention=None"
                )
        self.model = model
        self.axis = axis
        self._names = names
        self._mesh = mesh
        self._gather = bool(gather_outputs)
        self._layout = check_layout(layout, _FN)
        self._attention = attention
        self._signature = inspect.signature(model.forward)
        self._handles: list[Any] = []
        self._calls: list[_Call] = []
        self._restore: Callable[[], None] | None = None
        self._release: Callable[[], None] = lambda: None  # the hooks held for this rank
        self._check_model = False  # debug mode: check the model before the next call

    # --- context manager ---------------------------------------------------------------------

    def __enter__(self) -> SequenceParallel:
        if self._handles:
            raise RuntimeError(f"{_FN}({self._name}): already entered")
        for hook in self.model._forward_pre_hooks.values():
            if isinstance(getattr(hook, "__self__", None), SequenceParallel):
                raise RuntimeError(
                    f"{_FN}({self._name}): the model is already under sequence_parallel; it "
                    f"cannot be nested on one model (its tokens are split once): leave the "
                    f"outer block first"
                )
        self._check_model = debug_enabled()
        if self._check_model:
            try:
                mesh = mesh_for(_FN) if self._mesh is None else self._mesh
            except RuntimeError:  # no mesh yet: checked at the first call
                pass
            else:
                self._same_model(resolve_axis(self._names, mesh=mesh, fn=_FN))
        if self._attention is not None and self._adapter is not None:
            self._restore = self._adapter.plug(self.model)
        self._handles = [
            self.model.register_forward_pre_hook(self._pre, with_kwargs=True),
            self.model.register_forward_hook(self._post, always_call=True),
        ]
        # the hooks are this rank's: in-process ranks may share one model
        slots = handle_slots(self._handles)
        self._release = hold(slots, [MISSING] * len(slots))
        return self

    def __exit__(self, *exc: object) -> None:
        self._release()
        for handle in self._handles:
            handle.remove()
        self._handles = []
        while self._calls:  # a forward that never reached its post-hook
            self._leave(self._calls.pop())
        if self._restore is not None:
            self._restore()
            self._restore = None

    def reduce_gradients(self) -> None:
        """``reduce_gradients(self.model, self.axis)``: complete the parameter gradients."""
        reduce_gradients(self.model, self.axis, mesh=self._mesh)

    def _same_model(self, info: AxisInfo) -> None:
        """Debug mode: every rank of the axis holds the same parameters and buffers (each
        rank's tokens go through its own), else a ``ValueError`` on every rank naming the first
        that differs and the ranks."""
        self._check_model = False
        if info.group is None:
            return
        c = Comm(info.group, info.size, info.rank, info.name, True, info.order)
        tensors: list[tuple[str, str, torch.Tensor]] = [
            ("parameter", n, t) for n, t in self.model.named_parameters()
        ]
        tensors += [("buffer", n, t) for n, t in self.model.named_buffers()]
        fix = (
            "every rank of the sequence-parallel axis must hold the same model (load, or "
            "broadcast, the same weights on every rank)"
        )
        names = "\n".join(f"{kind} {name}" for kind, name, _ in tensors)
        device = _local(tensors[0][2]).device if tensors else torch.device("cpu")
        check_replicated(
            torch.tensor([zlib.crc32(names.encode())], dtype=torch.int64, device=device),
            c,
            f"{_FN}({self._name}): debug mode: the ranks of axis {info.name!r} hold models with "
            f"different parameters or buffers (by name); {fix}",
        )
        for kind, name, t in tensors:
            check_replicated(
                _local(t).detach(),
                c,
                f"{_FN}({self._name}): debug mode: {kind} {name!r} differs between the ranks of "
                f"axis {info.name!r}; {fix}",
            )

    # --- hooks -------------------------------------------------------------------------------

    def _bind(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict]:
        kwargs = dict(kwargs)
        used = 0
        for p in self._signature.parameters.values():
            if used == len(args) or p.kind is not inspect.Parameter.POSITIONAL_OR_KEYWORD:
                break
            if p.name in kwargs:
                raise TypeError(f"{self._name}.forward() got multiple values for {p.name!r}")
            kwargs[p.name] = args[used]
            used += 1
        return tuple(args[used:]), kwargs

    def _accepts(self, name: str) -> bool:
        params = self._signature.parameters
        return name in params or any(
            p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()
        )

    def _pre(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        mesh = mesh_for(_FN) if self._mesh is None else self._mesh
        rest, kwargs = self._bind(args, kwargs)
        ref = next(
            (kwargs[k] for k in SEQUENCE_KEYS if isinstance(kwargs.get(k), torch.Tensor)),
            None,
        )
        if ref is None or ref.dim() < 2:
            first, second = SEQUENCE_KEYS
            raise ValueError(
                f"{_FN}({self._name}): the call has no {first!r} or {second!r} tensor of "
                f"shape (batch, seq, ...) to read the sequence length from (arguments: "
                f"{sorted(kwargs)}); pass the sequence as {first}= or {second}="
            )
        length = ref.shape[1]
        info = resolve_axis(self._names, mesh=mesh, fn=_FN)
        if self._check_model:
            self._same_model(info)
        layout = SeqLayout(self._layout, length, info.size)
        boundary = SeqBoundary(_FN, mesh, self._names, layout)
        prepared = None
        if self._adapter is not None:
            prepared = self._adapter.prepare(module, kwargs, self._accepts, length)
            kwargs = prepared.kwargs
        if kwargs.get(POSITION_IDS) is None and self._accepts(POSITION_IDS):
            kwargs[POSITION_IDS] = (
                torch.arange(length, device=ref.device).unsqueeze(0).expand(ref.shape[0], length)
            )
        keep = kwargs.get(LOGITS_TO_KEEP)
        if keep is not None and not isinstance(keep, torch.Tensor):
            k = int(keep)
            keep = torch.arange(length, device=ref.device) >= (length - k if k else 0)
        whole_keep = keep if isinstance(keep, torch.Tensor) and keep.shape == (length,) else None
        if whole_keep is not None and bool(whole_keep.all()):
            # every position kept: let every rank compute all of its logits (a mask would give
            # the rank holding the padding fewer, and the gather would not match)
            kwargs[LOGITS_TO_KEEP], whole_keep = 0, None

        out = {}
        for key, value in kwargs.items():
            if key == LOGITS_TO_KEEP and whole_keep is not None:
                out[key] = boundary.split(whole_keep, 0, False)
            elif isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == length:
                pad = (
                    IGNORE_INDEX if key in LABEL_KEYS else False if value.dtype == torch.bool else 0
                )
                out[key] = boundary.split(value, 1, pad)
            else:
                out[key] = value
        rest = tuple(
            boundary.split(x, 1, 0)
            if isinstance(x, torch.Tensor) and x.dim() >= 2 and x.shape[1] == length
            else x
            for x in rest
        )
        attention, rescope = None, None
        if self._attention is not None and self._adapter is not None:
            segments = None if prepared is None else prepared.segment_ids
            attention = SeqAttention(
                self._attention,
                self._names,
                None if segments is None else boundary.take(segments, 1, -1),
            )
            rescope = _rescope(self._adapter, module)
        call = _Call(boundary, whole_keep, prepared, attention, rescope)
        call.context = SeqContext(self._names, layout, info.rank, ref.device, mesh, call)
        call.scopes = [use_mesh(mesh), sequence_context(call.context)]
        for scope in call.scopes:
            scope.__enter__()
        self._calls.append(call)
        return rest, out

    @staticmethod
    def _leave(call: _Call) -> None:
        for scope in reversed(call.scopes):
            try:
                scope.__exit__(None, None, None)
            except ValueError:  # pragma: no cover - left in another context already
                pass

    def _post(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        if not self._calls:  # pragma: no cover - the pre-hook raised before recording
            return output
        call = self._calls.pop()
        self._leave(call)
        if self._adapter is not None and not call.attended:
            raise RuntimeError(
                f"{_FN}({self._name}): no sequence-parallel attention ran during this forward: "
                f"the model used its own attention "
                f"({self._adapter.attention_name(self.model)!r}) on this rank's tokens only, "
                f"which is not attention over the sequence; pass attention='ulysses' or 'ring' "
                f"to sequence_parallel"
            )
        if output is None:
            return output
        if call.context is not None:  # for recomputation in backward
            output = record_for_backward(output, call.context)
        if self._adapter is not None and call.prepared is not None and call.prepared.loss_share:
            # the model's loss is this rank's share: the sum is the whole loss
            output = self._adapter.sum_loss(output, call.boundary.reduce)
        return self._gather_outputs(output, call) if self._gather else output

    def _gather_outputs(self, output: Any, call: _Call) -> Any:
        layout = call.boundary.layout
        paths, leaves, treedef = tree_flatten_with_path(output)
        out = []
        for path, y in zip(paths, leaves, strict=True):
            where = f"output{path.codify('')}"
            if not isinstance(y, torch.Tensor) or y.dim() < 2:
                out.append(y)
            elif call.keep is not None and _last_key(path) == LOGITS and not bool(call.keep.all()):
                out.append(self._gather_kept(y, call.keep, call.boundary, where))
            elif y.shape[1] == layout.local_length:
                out.append(call.boundary.gather(y, 1, where))
            else:
                out.append(y)
        return tree_unflatten(treedef, out)

    def _gather_kept(
        self, y: torch.Tensor, whole_keep: torch.Tensor, b: SeqBoundary, where: str
    ) -> torch.Tensor:
        """``logits`` computed at the kept positions only: put them at their local positions,
        gather the whole sequence, keep the kept positions (in sequence order)."""
        keep = pad_permute(whole_keep, 0, b.layout, False).view(b.size, -1)
        counts = keep.sum(1)
        group: Axis = self._names if b.comm is None or b.comm.group is None else b.comm.group
        sizes = all_gather(torch.tensor([y.shape[1]], device=y.device), group)
        if sizes.tolist() != counts.tolist():
            raise ValueError(
                f"{_FN} {where}: logits_to_keep keeps {counts.tolist()} positions on the ranks "
                f"but the model returned {sizes.tolist()} logits along dim 1; the model must "
                f"apply logits_to_keep (a boolean mask over its tokens) to its logits"
            )
        mine = keep[b.rank].nonzero().view(-1).to(y.device)
        local = y.new_zeros((y.shape[0], b.layout.local_length, *y.shape[2:]))
        local = local.index_copy(1, mine, y)
        whole = b.gather(local, 1, where)
        return whole.index_select(1, whole_keep.nonzero().view(-1).to(y.device))


def _rescope(adapter: ModelAdapter, model: nn.Module) -> Callable[[], Callable[[], None] | None]:
    """A call's backward scope: plug the attention the model runs now (pshard's) again."""
    name = adapter.attention_name(model)
    return lambda: adapter.use_attention(model, name)


def _local(g: torch.Tensor) -> torch.Tensor:
    to_local = getattr(g, "to_local", None)  # a DTensor: its local shard
    return to_local() if callable(to_local) else g


def _last_key(path: Any) -> Any:
    """The key of the last step of an optree accessor path (``'logits'``), or None."""
    return path[-1].entry if len(path) else None


def sequence_parallel(
    model: nn.Module,
    *,
    axis: str | tuple[str, ...] = "sp",
    mesh: DeviceMesh | None = None,
    layout: str = "contiguous",
    attention: str | None = None,
    gather_outputs: bool = True,
) -> SequenceParallel:
    """Run ``model`` sequence-parallel over ``axis`` while the ``with`` block is active.

    Every rank calls the model with the *whole* batch (the same on every rank of ``axis``);
    the model's forward sees this rank's tokens, and (with ``gather_outputs``) its outputs are
    the whole sequence again::

        with ps.sequence_parallel(model, axis="sp", layout="zigzag"):
            out = model(**ps.prepare_lm_batch(batch))     # out.logits: (batch, seq, vocab)
            loss = F.cross_entropy(out.logits.flatten(0, 1), shift_labels.flatten())
        loss.backward()
        ps.reduce_gradients(model, "sp")                  # each rank held its tokens' share

    What the hooks do to a call (see the module docs for details): positional arguments are
    bound to their names; ``position_ids`` (``arange``) is added when the forward accepts it and
    none is given; an int ``logits_to_keep`` becomes a boolean mask over the whole sequence
    (``0``, keep everything, is passed on as it is); every tensor argument whose dim 1 has the
    sequence length (that of ``input_ids`` or ``inputs_embeds``) is padded
    (``labels``/``shift_labels`` with -100, others with 0), permuted by ``layout`` and sliced, as
    in :func:`pshard.shard_map_seq`; ``forward`` runs in the sequence context (attention inside
    must be sequence-parallel: plain attention would see only local tokens); outputs whose dim 1
    is this rank's token count, and ``logits`` cut by ``logits_to_keep``, are gathered,
    un-permuted and unpadded. ``num_items_in_batch`` is passed as given: compute it on the whole
    batch (:func:`pshard.prepare_lm_batch`), not per shard.

    **Models a model adapter knows** (:mod:`pshard._modules.adapter`; Hugging Face models,
    through :mod:`pshard.integrations.transformers`, see ``docs/huggingface.md``):
    ``attention="ulysses"``, ``"ring"`` or ``"usp"`` plugs that sequence-parallel attention into
    the model for the block (the model's own comes back on exit, and serves calls outside a
    sequence context), with the masks of the batch (padding, packed documents, the model's
    sliding window), all by global position. The adapter owns the family's conventions: labels
    shifted over the whole sequence before the split, the whole batch's target count, the
    model's own loss summed over the ranks (the single-process loss on every rank), and the
    calls it refuses, with an error saying why. A forward in which no sequence-parallel
    attention ran (the model used its own) and nesting on one model are refused as well.

    In debug mode (:func:`pshard.debug`, ``PSHARD_DEBUG=1``) entering the block first checks
    that every rank of ``axis`` holds the same parameters and buffers (a ``ValueError`` names
    the first that differs and the ranks): each rank's tokens go through its own weights, so a
    rank with other weights would silently give other numbers.

    Gradients (one convention for everything crossing the boundary): after the backward pass
    every rank holds its own tokens' share of every gradient, of the parameters and of the
    inputs (``inputs_embeds``) alike, and :func:`pshard.reduce_gradients` (a ``psum`` over
    ``axis``) makes them the full gradient on every rank. A gathered output is a whole value,
    the same on every rank, whose backward slices out the cotangent of this rank's tokens; the
    model's ``loss`` is the sum of every rank's share, whose backward gives each share the
    cotangent unchanged. The same holds with ``gather_outputs=False`` when each rank
    backpropagates its share of the loss (its tokens' summed loss divided by the *global* token
    count ``num_items_in_batch``). Activation checkpointing inside the model gives the same
    numbers (the layout is recorded with the forward). (A data-parallel wrapper that averages
    gradients over the ranks of ``axis`` too would divide by its size.)

    The hooks are removed on exit, also when the block raises; the sequence context of a forward
    that raised is left as well.

    Args:
        model: the module (its ``forward`` signature names the arguments).
        axis: the sequence-parallel mesh axis.
        mesh: the device mesh (default: the current mesh at each call).
        layout: ``"contiguous"``, ``"zigzag"`` or ``"stripe"`` (see :func:`pshard.shard_map_seq`).
        attention: ``None`` (the model calls sequence-parallel attention itself), or
            ``"ulysses"`` / ``"ring"`` / ``"usp"`` to plug it into a model a model adapter knows
            (``"usp"``: :func:`pshard.usp_attention` with ``axis=(ring_axis, ulysses_axis)``).
        gather_outputs: gather sequence outputs back to the whole sequence.

    Returns:
        The context manager (a :class:`SequenceParallel`).

    Example:
        >>> import torch, pshard as ps
        >>> mesh = ps.init_mesh({"sp": 1})
        >>> class Embed(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.table = torch.nn.Embedding(10, 4)
        ...     def forward(self, input_ids, position_ids=None):
        ...         return {"hidden": self.table(input_ids) + position_ids.unsqueeze(-1)}
        >>> model = Embed()
        >>> ids = torch.tensor([[1, 2, 3]])
        >>> with ps.sequence_parallel(model, layout="stripe"):
        ...     out = model(ids)
        >>> torch.equal(out["hidden"], model.table(ids) + torch.arange(3.0).view(1, 3, 1))
        True
    """
    return SequenceParallel(model, axis, mesh, gather_outputs, layout, attention)


def reduce_gradients(
    params: nn.Module | Iterable[torch.Tensor],
    axis: Axis = "sp",
    *,
    mesh: DeviceMesh | None = None,
    mean: bool = False,
) -> None:
    """Sum (or average) the ``.grad`` of every parameter over ``axis``, in place.

    After a backward pass under :func:`sequence_parallel`, each rank's gradients are its own
    tokens' share; their sum over the sequence axis is the full gradient. One all-reduce per
    dtype and device moves every gradient at once. Parameters without a gradient are skipped
    (every rank must have the same ones). ``DTensor`` gradients (a model sharded with FSDP2
    over another mesh axis) are reduced shard by shard: each rank's local shard over ``axis``.

    Args:
        params: a module (its ``parameters()``) or an iterable of tensors.
        axis: the mesh axis to reduce over.
        mesh: the mesh to resolve ``axis`` in (default: the current mesh).
        mean: average instead of summing.

    Example:
        >>> import torch, pshard as ps
        >>> mesh = ps.init_mesh({"sp": 1})
        >>> layer = torch.nn.Linear(2, 1)
        >>> layer(torch.ones(1, 2)).sum().backward()
        >>> ps.reduce_gradients(layer, "sp")
        >>> layer.weight.grad
        tensor([[1., 1.]])
    """
    tensors = list(params.parameters() if isinstance(params, nn.Module) else params)
    if mesh is None:
        c = comm(axis, "reduce_gradients")
    else:
        with use_mesh(mesh):
            c = comm(axis, "reduce_gradients")
    if c.group is None:
        return
    # DTensor gradients (FSDP2 over another axis): each rank reduces its local shard
    grads = [_local(p.grad) for p in tensors if p.grad is not None]
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for g in grads:
        groups.setdefault((g.dtype, g.device), []).append(g)
    with torch.no_grad():
        for same in groups.values():
            flat = all_reduce(torch.cat([g.reshape(-1) for g in same]), c, "psum")
            if mean:
                flat /= c.size
            for g, part in zip(same, flat.split([g.numel() for g in same]), strict=True):
                g.copy_(part.view_as(g))
