"""``sequence_parallel``: sequence parallelism for an ``nn.Module`` through forward hooks.

For models whose code you do not want to rewrite as a function (Hugging Face models): while the
context manager is active, each call of the model

1. (pre-hook) binds positional arguments to their names by the ``forward`` signature, adds
   ``position_ids`` when absent (``arange(seq_len)``, before sharding, so they are the true
   positions), turns an int ``logits_to_keep`` into a boolean mask over the whole sequence,
   and splits every tensor argument whose dim 1 is the sequence (the length of ``input_ids`` or
   ``inputs_embeds``) exactly as :func:`pshard.shard_map_seq` does (pad, permute, take this
   rank's block through ``shard_map``'s boundary op); labels are padded with -100, everything
   else with 0 (``logits_to_keep`` with ``False``);
2. runs ``forward`` inside the sequence context, so ``ps.ulysses_attention`` and
   ``ps.seq_positions`` inside the model know the layout;
3. (post-hook) gathers every output tensor whose dim 1 is this rank's tokens (and ``logits``
   restricted by ``logits_to_keep``) back into the whole sequence through ``shard_map``'s
   boundary op, un-permuted and unpadded.

Gradients follow ``shard_map``'s convention: a gathered output is a whole value, the same on
every rank, whose cotangent each rank slices (no communication in the backward). Each rank's
parameter gradients are therefore its own tokens' share; :func:`reduce_gradients` (a ``psum``
of every ``.grad`` over the axis) completes them.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from .._collectives import all_gather
from .._comm import all_reduce, comm
from .._mesh import Axis, current_mesh, resolve_axis, use_mesh
from .._placements import Shard
from .._shard_map import _enter, _exit, _Mesh
from .._tree import describe, tree_flatten_with_path, tree_unflatten
from ._context import SeqContext, normalize_axis, record_for_backward, sequence_context
from ._layouts import SeqLayout, check_layout, pad_permute, unpermute_unpad

__all__ = ["SequenceParallel", "reduce_gradients", "sequence_parallel"]

_FN = "sequence_parallel"
_LABEL_KEYS = frozenset({"labels", "shift_labels"})
_KEEP = "logits_to_keep"


@dataclasses.dataclass
class _Call:
    """What the post-hook needs from its pre-hook: the layout, the whole logits_to_keep mask,
    and the context managers to leave."""

    layout: SeqLayout
    mesh: _Mesh
    keep: torch.Tensor | None
    scopes: list[Any]
    context: SeqContext


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
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"{_FN}: model must be an nn.Module, got {describe(model)}")
        names = normalize_axis(axis)
        if not isinstance(names, tuple) or not all(isinstance(n, str) for n in names):
            raise TypeError(
                f"{_FN}: axis must be a mesh-axis name or a tuple of names, got {axis!r}"
            )
        if mesh is not None and not isinstance(mesh, DeviceMesh):
            raise TypeError(f"{_FN}: mesh must be a DeviceMesh, got {describe(mesh)}")
        self.model = model
        self.axis = axis
        self._names = names
        self._mesh = mesh
        self._gather = bool(gather_outputs)
        self._layout = check_layout(layout, _FN)
        self._signature = inspect.signature(model.forward)
        self._handles: list[Any] = []
        self._calls: list[_Call] = []
        self._name = type(model).__name__

    # --- context manager ---------------------------------------------------------------------

    def __enter__(self) -> SequenceParallel:
        if self._handles:
            raise RuntimeError(f"{_FN}({self._name}): already entered")
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
        info = resolve_axis(self._names, mesh=mesh, fn=_FN)
        m = _Mesh(mesh, self._names)
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
        layout = SeqLayout(self._layout, length, info.size)
        if kwargs.get("position_ids") is None and self._accepts("position_ids"):
            kwargs["position_ids"] = (
                torch.arange(length, device=ref.device).unsqueeze(0).expand(ref.shape[0], length)
            )
        keep = kwargs.get(_KEEP)
        if keep is not None and not isinstance(keep, torch.Tensor):
            k = int(keep)
            keep = torch.arange(length, device=ref.device) >= (length - k if k else 0)
        whole_keep = keep if isinstance(keep, torch.Tensor) and keep.shape == (length,) else None

        def split(x: Any, where: str, pad: Any, dim: int = 1) -> Any:
            x = pad_permute(x, dim, layout, pad)
            return _enter(x, Shard(dim), f"{_FN} {where}", m, False)

        out = {}
        for key, value in kwargs.items():
            if key == _KEEP and whole_keep is not None:
                out[key] = split(whole_keep, f"kwargs[{key!r}]", False, dim=0)
            elif isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == length:
                pad = -100 if key in _LABEL_KEYS else False if value.dtype == torch.bool else 0
                out[key] = split(value, f"kwargs[{key!r}]", pad)
            else:
                out[key] = value
        rest = tuple(
            split(x, f"args[{i}]", 0)
            if isinstance(x, torch.Tensor) and x.dim() >= 2 and x.shape[1] == length
            else x
            for i, x in enumerate(rest)
        )
        ctx = SeqContext(normalize_axis(self._names), layout, info.rank, ref.device, mesh)
        scopes = [use_mesh(mesh), sequence_context(ctx)]
        for scope in scopes:
            scope.__enter__()
        self._calls.append(_Call(layout, m, whole_keep, scopes, ctx))
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
        if output is None:
            return output
        output = record_for_backward(output, call.context)  # for recomputation in backward
        return self._gather_outputs(output, call) if self._gather else output

    def _gather_outputs(self, output: Any, call: _Call) -> Any:
        layout, m = call.layout, call.mesh
        paths, leaves, treedef = tree_flatten_with_path(output)
        out = []
        for path, y in zip(paths, leaves, strict=True):
            where = f"{_FN} output{path.codify('')}"
            if not isinstance(y, torch.Tensor) or y.dim() < 2:
                out.append(y)
            elif (
                call.keep is not None and _last_key(path) == "logits" and not bool(call.keep.all())
            ):
                out.append(self._gather_kept(y, call, where))
            elif y.shape[1] == layout.local_length:
                whole = _exit(y, Shard(1), where, m, False)
                out.append(unpermute_unpad(whole, 1, layout))
            else:
                out.append(y)
        return tree_unflatten(treedef, out)

    def _gather_kept(self, y: torch.Tensor, call: _Call, where: str) -> torch.Tensor:
        """``logits`` computed at the kept positions only: put them at their local positions,
        gather the whole sequence, keep the kept positions (in sequence order)."""
        layout = call.layout
        info = resolve_axis(self._names, mesh=call.mesh.mesh, fn=_FN)
        keep = pad_permute(call.keep, 0, layout, False).view(info.size, -1)
        counts = keep.sum(1)
        group = info.group if info.group is not None else self._names
        sizes = all_gather(torch.tensor([y.shape[1]], device=y.device), group)
        if sizes.tolist() != counts.tolist():
            raise ValueError(
                f"{where}: logits_to_keep keeps {counts.tolist()} positions on the ranks but the "
                f"model returned {sizes.tolist()} logits along dim 1; the model must apply "
                f"logits_to_keep (a boolean mask over its tokens) to its logits"
            )
        mine = keep[info.rank].nonzero().view(-1).to(y.device)
        local = y.new_zeros((y.shape[0], layout.local_length, *y.shape[2:]))
        local = local.index_copy(1, mine, y)
        whole = unpermute_unpad(_exit(local, Shard(1), where, call.mesh, False), 1, layout)
        return whole.index_select(1, call.keep.nonzero().view(-1).to(y.device))


def _last_key(path: Any) -> Any:
    """The key of the last step of an optree accessor path (``'logits'``), or None."""
    return path[-1].entry if len(path) else None


def sequence_parallel(
    model: nn.Module,
    *,
    axis: str | tuple[str, ...] = "sp",
    mesh: DeviceMesh | None = None,
    gather_outputs: bool = True,
    layout: str = "contiguous",
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
    none is given; an int ``logits_to_keep`` becomes a boolean mask over the whole sequence;
    every tensor argument whose dim 1 has the sequence length (that of ``input_ids`` or
    ``inputs_embeds``) is padded (``labels``/``shift_labels`` with -100, others with 0),
    permuted by ``layout`` and sliced, as in :func:`pshard.shard_map_seq`; ``forward`` runs in
    the sequence context (attention inside must be :func:`pshard.ulysses_attention` or another
    sequence-parallel attention: plain attention would see only local tokens); outputs whose
    dim 1 is this rank's token count, and ``logits`` cut by ``logits_to_keep``, are gathered,
    un-permuted and unpadded. Other outputs (a loss the model computed on its own tokens, for
    example) are left as this rank's values. ``num_items_in_batch`` is passed as given: compute
    it on the whole batch (:func:`pshard.prepare_lm_batch`), not per shard.

    Gradients (``shard_map``'s convention): the gathered outputs are whole values, the same on
    every rank; each rank computes the same loss from them and its backward slices out the
    cotangent of its own tokens. So after ``loss.backward()`` each rank's parameter gradients
    are its own tokens' share of the gradient, and :func:`pshard.reduce_gradients` (a ``psum``
    over ``axis``) makes them the full gradient on every rank. The same holds with
    ``gather_outputs=False`` when each rank backpropagates its share of the loss (its tokens'
    summed loss divided by the *global* token count ``num_items_in_batch``). (A data-parallel
    wrapper that averages gradients over the ranks of ``axis`` too would divide by its size.)

    The hooks are removed on exit, also when the block raises; the sequence context of a forward
    that raised is left as well.

    Args:
        model: the module (its ``forward`` signature names the arguments).
        axis: the sequence-parallel mesh axis.
        mesh: the device mesh (default: the current mesh at each call).
        gather_outputs: gather sequence outputs back to the whole sequence.
        layout: ``"contiguous"``, ``"zigzag"`` or ``"stripe"`` (see :func:`pshard.shard_map_seq`).

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
    return SequenceParallel(model, axis, mesh, gather_outputs, layout)


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
    (every rank must have the same ones).

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
    grads = [p.grad for p in tensors if p.grad is not None]
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
