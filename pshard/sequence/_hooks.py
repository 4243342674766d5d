"""``sequence_parallel``: sequence parallelism for an ``nn.Module`` through forward hooks.

For models whose code you do not want to rewrite as a function (Hugging Face models): while the
context manager is active, each call of the model

1. (pre-hook) binds positional arguments to their names by the ``forward`` signature, adds
   ``position_ids`` when absent (``arange(seq_len)``, before sharding, so they are the true
   positions), turns an int ``logits_to_keep`` into a boolean mask over the whole sequence,
   and splits every tensor argument whose dim 1 is the sequence (the length of ``input_ids`` or
   ``inputs_embeds``) exactly as :func:`pshard.shard_map_seq` does (pad, permute, take this
   rank's block); labels are padded with -100, everything else with 0 (``logits_to_keep``
   with ``False``); Hugging Face models also get their conventions applied (see
   :func:`sequence_parallel`);
2. runs ``forward`` inside the sequence context, so ``ps.ulysses_attention`` and
   ``ps.seq_positions`` inside the model know the layout;
3. (post-hook) gathers every output tensor whose dim 1 is this rank's tokens (and ``logits``
   restricted by ``logits_to_keep``) back into the whole sequence, un-permuted and unpadded.

Gradients: a gathered output is a whole value, the same on every rank, whose cotangent each
rank slices, and a split input's transpose puts the cotangent back at this rank's positions
(no communication either way). Each rank's parameter and input gradients are therefore its own
tokens' share; :func:`reduce_gradients` (a ``psum`` of every ``.grad`` over the axis) completes
them. The boundary itself is :class:`pshard.sequence._seq_boundary.SeqBoundary`; Hugging Face
conventions live in :mod:`pshard.integrations.transformers`.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from .._collectives.functions import all_gather
from .._core.checks import axis_names
from .._core.tree import describe, tree_flatten_with_path, tree_unflatten
from .._runtime.mesh import Axis, current_mesh, resolve_axis, use_mesh
from .._runtime.wire import all_reduce, comm
from ._context import SeqContext, normalize_axis, record_for_backward, sequence_context
from ._layouts import SeqLayout, check_layout, pad_permute
from ._seq_boundary import SeqBoundary

__all__ = ["SequenceParallel", "reduce_gradients", "sequence_parallel"]

_FN = "sequence_parallel"
_LABEL_KEYS = frozenset({"labels", "shift_labels"})
_KEEP = "logits_to_keep"


class _Call:
    """One call of the model: what the post-hook needs from its pre-hook, and what the
    sequence context carries for the attention (compared by identity)."""

    def __init__(self, boundary: SeqBoundary, keep: torch.Tensor | None, axis: Any) -> None:
        self.boundary = boundary
        self.keep = keep
        self.axis = axis
        self.attention: str | None = None  # the plugged attention (Hugging Face models)
        self.segments: torch.Tensor | None = None  # this rank's segment ids
        self.share = False  # the model's loss is this rank's share of the loss
        self.attended = 0  # sequence-parallel attention calls during the forward
        self.scopes: list[Any] = []
        self.context: SeqContext | None = None
        self.backward_scope: Any = None  # see SeqContext.call


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
        self._hf = _hf_model(model)
        if attention is not None:
            if attention not in ("ulysses", "ring", "usp"):
                raise ValueError(
                    f"{_FN}({self._name}): attention must be None, 'ulysses', 'ring' or 'usp', "
                    f"got {attention!r}"
                )
            if attention == "usp" and len(names) != 2:
                raise ValueError(
                    f"{_FN}({self._name}): attention='usp' needs axis=(ring_axis, ulysses_axis), "
                    f"two mesh axes (the ring across, Ulysses inside), got axis={axis!r}"
                )
            if not self._hf:
                raise TypeError(
                    f"{_FN}({self._name}): attention={attention!r} plugs into a Hugging Face "
                    f"model's attention interface, and this model has no "
                    f"config._attn_implementation; call ps.{attention}_attention inside its "
                    f"forward instead and leave attention=None"
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
        self._restore: Any = None

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
        if self._attention is not None:
            from ..integrations.transformers import plug

            self._restore = plug(self.model, self._attention)
        self._handles = [
            self.model.register_forward_pre_hook(self._pre, with_kwargs=True),
            self.model.register_forward_hook(self._post, always_call=True),
        ]
        return self

    def __exit__(self, *exc: Any) -> None:
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

    # --- hooks -------------------------------------------------------------------------------

    def _bind(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
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

    def _pre(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        mesh = current_mesh() if self._mesh is None else self._mesh
        rest, kwargs = self._bind(args, kwargs)
        ref = next(
            (
                kwargs[k]
                for k in ("input_ids", "inputs_embeds")
                if isinstance(kwargs.get(k), torch.Tensor)
            ),
            None,
        )
        if ref is None or ref.dim() < 2:
            raise ValueError(
                f"{_FN}({self._name}): the call has no 'input_ids' or 'inputs_embeds' tensor of "
                f"shape (batch, seq, ...) to read the sequence length from (arguments: "
                f"{sorted(kwargs)}); pass the sequence as input_ids= or inputs_embeds="
            )
        length = ref.shape[1]
        info = resolve_axis(self._names, mesh=mesh, fn=_FN)
        layout = SeqLayout(self._layout, length, info.size)
        boundary = SeqBoundary(_FN, mesh, self._names, layout)
        segments, share = None, False
        if self._hf:
            from ..integrations.transformers import prepare_call

            kwargs, segments, share = prepare_call(module, kwargs, self._accepts, length)
        if kwargs.get("position_ids") is None and self._accepts("position_ids"):
            kwargs["position_ids"] = (
                torch.arange(length, device=ref.device).unsqueeze(0).expand(ref.shape[0], length)
            )
        keep = kwargs.get(_KEEP)
        if keep is not None and not isinstance(keep, torch.Tensor):
            k = int(keep)
            keep = torch.arange(length, device=ref.device) >= (length - k if k else 0)
        whole_keep = keep if isinstance(keep, torch.Tensor) and keep.shape == (length,) else None
        if whole_keep is not None and bool(whole_keep.all()):
            # every position kept: let every rank compute all of its logits (a mask would give
            # the rank holding the padding fewer, and the gather would not match)
            kwargs[_KEEP], whole_keep = 0, None

        out = {}
        for key, value in kwargs.items():
            if key == _KEEP and whole_keep is not None:
                out[key] = boundary.split(whole_keep, 0, False)
            elif isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == length:
                pad = -100 if key in _LABEL_KEYS else False if value.dtype == torch.bool else 0
                out[key] = boundary.split(value, 1, pad)
            else:
                out[key] = value
        rest = tuple(
            boundary.split(x, 1, 0)
            if isinstance(x, torch.Tensor) and x.dim() >= 2 and x.shape[1] == length
            else x
            for i, x in enumerate(rest)
        )
        call = _Call(boundary, whole_keep, normalize_axis(self._names))
        call.attention, call.share = self._attention, share
        if self._attention is not None:
            from ..integrations.transformers import attention_name, replug

            name = attention_name(module)
            call.backward_scope = lambda: replug(module, name)
        if segments is not None:
            call.segments = boundary.take(segments, 1, -1)
        ctx = SeqContext(call.axis, layout, info.rank, ref.device, mesh, call)
        call.scopes = [use_mesh(mesh), sequence_context(ctx)]
        call.context = ctx
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

    def _post(self, module: nn.Module, args: tuple, output: Any) -> Any:
        if not self._calls:  # pragma: no cover - the pre-hook raised before recording
            return output
        call = self._calls.pop()
        self._leave(call)
        if self._hf and not call.attended:
            raise RuntimeError(
                f"{_FN}({self._name}): no sequence-parallel attention ran during this forward: "
                f"the model used its own attention ({self.model.config._attn_implementation!r}) "
                f"on this rank's tokens only, which is not attention over the sequence; pass "
                f"attention='ulysses' or 'ring' to sequence_parallel"
            )
        if output is None:
            return output
        output = record_for_backward(output, call.context)  # for recomputation in backward
        if call.share:  # the model's loss is this rank's share: the sum is the whole loss
            if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
                output = (call.boundary.reduce(output[0], "output[0]"), *output[1:])
            elif _loss_of(output) is not None:
                output["loss"] = call.boundary.reduce(output["loss"], "output['loss']")
        return self._gather_outputs(output, call) if self._gather else output

    def _gather_outputs(self, output: Any, call: _Call) -> Any:
        layout = call.boundary.layout
        paths, leaves, treedef = tree_flatten_with_path(output)
        out = []
        for path, y in zip(paths, leaves, strict=True):
            where = f"output{path.codify('')}"
            if not isinstance(y, torch.Tensor) or y.dim() < 2:
                out.append(y)
            elif (
                call.keep is not None and _last_key(path) == "logits" and not bool(call.keep.all())
            ):
                out.append(self._gather_kept(y, call, where))
            elif y.shape[1] == layout.local_length:
                out.append(call.boundary.gather(y, 1, where))
            else:
                out.append(y)
        return tree_unflatten(treedef, out)

    def _gather_kept(self, y: torch.Tensor, call: _Call, where: str) -> torch.Tensor:
        """``logits`` computed at the kept positions only: put them at their local positions,
        gather the whole sequence, keep the kept positions (in sequence order)."""
        b = call.boundary
        keep = pad_permute(call.keep, 0, b.layout, False).view(b.size, -1)
        counts = keep.sum(1)
        group = b.comm.group if b.comm is not None else self._names
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
        return whole.index_select(1, call.keep.nonzero().view(-1).to(y.device))


def _local(g: torch.Tensor) -> torch.Tensor:
    to_local = getattr(g, "to_local", None)  # a DTensor: its local shard
    return to_local() if callable(to_local) else g


def _hf_model(model: nn.Module) -> bool:
    from ..integrations.transformers import is_hf_model

    return is_hf_model(model)


def _loss_of(output: Any) -> Any:
    try:
        return output["loss"]
    except (KeyError, TypeError, IndexError):
        return None


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

    **Hugging Face models** (a ``config._attn_implementation``): ``attention="ulysses"`` or
    ``"ring"`` plugs :func:`pshard.ulysses_attention` / :func:`pshard.ring_attention` into the
    model's attention interface for the block (the model's own comes back on exit, and serves
    calls outside a sequence context), with the masks of the batch: padding
    (``attention_mask``), packed documents (``position_ids`` restarting at 0) and the model's
    sliding window, all by global position. The hooks own the model's conventions: ``labels=``
    are shifted over the whole sequence before the split (``shift_labels`` are used as given),
    ``num_items_in_batch`` is the whole batch's count, and the returned ``loss`` is the
    single-process loss on every rank. Refused with an error saying why: a KV cache or
    ``use_cache=True`` (``generate``), ``output_attentions``, attention dropout in training
    mode, a forward in which no sequence-parallel attention ran (the model used its own), and
    nesting on one model. See ``docs/huggingface.md``.

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
            ``"ulysses"`` / ``"ring"`` / ``"usp"`` to plug it into a Hugging Face model
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
