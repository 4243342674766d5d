"""Model adapters: what pshard's model-level rooms need from a family of models they do not
own.

On its own, ``sequence_parallel(model)`` splits a call by pshard's causal-LM batch convention
(the keys of :mod:`pshard.sequence._lm`: the sequence length is that of ``input_ids`` or
``inputs_embeds``, every argument with that length along dim 1 is split, labels padded with
-100, ``position_ids`` added, an int ``logits_to_keep`` made a mask, ``logits`` gathered), and
the model calls the sequence-parallel attention functions itself. A family of models with
conventions of its own is described by a :class:`ModelAdapter`:

- **which attention to swap in, and how to restore the model**: :meth:`~ModelAdapter.plug`
  makes the model's attention layers call :func:`pshard.sequence.plug.run_attention` (the
  attention ``sequence_parallel(model, attention=...)`` asked for, found with
  :func:`pshard.sequence.plug.plugged_attention`) and returns what restores the model's own;
  :meth:`~ModelAdapter.attention_name` and :meth:`~ModelAdapter.use_attention` let a backward
  pass through a call plug it again for recomputed (checkpointed) layers;
- **which arguments are sequences, and how to pad and shift them** before the split:
  :meth:`~ModelAdapter.prepare` sees the whole call (refusing what cannot be exact, shifting
  labels over the whole sequence, counting the whole batch's targets) and returns the segment
  ids of its padding and packed documents;
- **the model's own loss**: when the model computes a loss from the labels of its tokens,
  :meth:`~ModelAdapter.sum_loss` sums every rank's share.

The same adapter may describe the family to :func:`pshard.tensor_parallel`
(:class:`TensorParallelParts`, found with :func:`tensor_parallel_part`): the default plans of
its models, the layers that store their weight transposed (Hugging Face's ``Conv1D``), how an
attention module holds its heads (:class:`AttentionHeads`) and which of its attributes count
them, and the model's own loss on logits split over the vocabulary.

An adapter is registered once with :func:`register_adapter` and found with
:func:`find_adapter`. The registry is written when an integration is imported
(:mod:`pshard.integrations.transformers` registers the Hugging Face adapter when ``pshard`` is
imported) and read afterwards; the rooms that use it never import an integration, and
registering one imports nothing of the library it adapts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

__all__ = [
    "AttentionHeads",
    "ConfigPart",
    "ExpertsPart",
    "StackedNamesPart",
    "ModelAdapter",
    "InitializerPart",
    "LayersPart",
    "TensorParallelParts",
    "PreparedCall",
    "Reduce",
    "TracingPart",
    "config_file",
    "experts_part",
    "find_adapter",
    "initializer_part",
    "layers_part",
    "prepare_tracing",
    "register_adapter",
    "registered_adapters",
    "stacked_names",
    "tensor_parallel_part",
]

#: ``reduce(value, where)``: the sum over the sequence-parallel axis of every rank's ``value``
#: (its share of a loss); ``where`` names the output in errors (``"output['loss']"``).
Reduce = Callable[[torch.Tensor, str], torch.Tensor]


@dataclasses.dataclass(frozen=True, eq=False)
class PreparedCall:
    """A call of the model made ready to be split (:meth:`ModelAdapter.prepare`).

    Attributes:
        kwargs: the call's arguments by name, whole (the hooks split them next).
        segment_ids: the whole batch's segment ids (``(batch, seq)``: one id per document of a
            row, -1 for padding), or ``None`` for plain causal sequences.
        loss_share: the model computes a loss, and on each rank it is that rank's share (to be
            summed by :meth:`ModelAdapter.sum_loss`).
    """

    kwargs: dict[str, Any]
    segment_ids: torch.Tensor | None = None
    loss_share: bool = False


class ModelAdapter(Protocol):
    """What ``sequence_parallel`` needs to know about one family of models."""

    @property
    def name(self) -> str:
        """The adapter's registry name (``"transformers"``)."""
        ...

    @property
    def interface(self) -> str:
        """What ``attention=`` plugs into, for messages (``"a Hugging Face model's attention
        interface"``)."""
        ...

    def matches(self, model: nn.Module) -> bool:
        """Whether ``model`` is one of this family (cheap; imports nothing)."""
        ...

    def attention_name(self, model: nn.Module) -> str:
        """The name of the attention the model runs now (for messages and
        :meth:`use_attention`)."""
        ...

    def plug(self, model: nn.Module) -> Callable[[], None]:
        """Make the model's attention layers run :func:`pshard.sequence.plug.run_attention`
        when :func:`pshard.sequence.plug.plugged_attention` finds one, and their own attention
        otherwise; returns the function that restores the model's own. Raises
        ``RuntimeError`` when pshard's attention is already plugged (nesting)."""
        ...

    def use_attention(self, model: nn.Module, name: str) -> Callable[[], None] | None:
        """Make the model run the attention ``name`` (one :meth:`attention_name` returned)
        until the returned undo is called; ``None`` when it already does."""
        ...

    def prepare(
        self,
        model: nn.Module,
        kwargs: dict[str, Any],
        accepts: Callable[[str], bool],
        length: int,
    ) -> PreparedCall:
        """The whole-sequence side of a call with arguments ``kwargs`` (by name) and sequence
        ``length``: refuse what cannot be exact (``ValueError`` naming the cause and the fix),
        fill in and shift what must be computed over the whole sequence. ``accepts(name)``
        says whether the model's forward takes an argument. ``kwargs`` is not modified."""
        ...

    def sum_loss(self, output: Any, reduce: Reduce) -> Any:
        """``output`` with the loss it holds (this rank's share) replaced by ``reduce`` of it."""
        ...


@dataclasses.dataclass(frozen=True)
class AttentionHeads:
    """How an attention module holds its heads (:meth:`TensorParallelParts.attention_heads`).

    Attributes:
        heads: query heads.
        kv_heads: key/value heads (``heads`` without grouped-query attention).
        head_dim: the width of one head.
        projections: the children (names relative to the module) whose outputs are the heads:
            the query, key and value projections in that order, or one fused projection.
        kv: the key and value projections among them (empty for a fused one).
        parts: how many equal parts a fused projection packs on its output (q|k|v: 3), else 1.
        output: the child projecting the heads back to the model's width.
    """

    heads: int
    kv_heads: int
    head_dim: int
    projections: tuple[str, ...]
    kv: tuple[str, ...]
    parts: int
    output: str


@runtime_checkable
class TensorParallelParts(Protocol):
    """What ``tensor_parallel`` needs to know about one family of models."""

    def tensor_parallel_plan(
        self, model: nn.Module, sequence_parallel: bool
    ) -> dict[str, str] | None:
        """The default plan of ``model`` (module-name pattern -> style), with Megatron sequence
        parallelism when asked; ``None`` when the adapter has none for this model."""
        ...

    def projection_layout(self, module: nn.Module) -> str | None:
        """``"transposed"`` for a layer of the family that computes ``x @ weight + bias`` with
        ``weight`` stored ``(in, out)`` (Hugging Face's ``Conv1D``); ``None`` otherwise."""
        ...

    def attention_heads(self, module: nn.Module) -> AttentionHeads | None:
        """How ``module`` holds its heads, when it is an attention module of the family."""
        ...

    def localize_attention(
        self, module: nn.Module, heads: int, kv_heads: int
    ) -> Callable[[], None]:
        """Make the attention ``module`` compute with ``heads`` query and ``kv_heads`` key/value
        heads (this rank's: the attributes its code reads of them); returns the undo."""
        ...

    def parallel_loss(self, model: nn.Module, axis: str) -> Callable[[], None] | None:
        """Replace the loss ``model`` computes from its ``labels`` by the same loss on logits
        split over the vocabulary across ``axis``; returns the undo, or ``None`` when the model
        computes no loss of its own."""
        ...


@runtime_checkable
class InitializerPart(Protocol):
    """What ``init_sharded`` needs to know about one family of models."""

    def initializer(self, model: nn.Module) -> Callable[[], None] | None:
        """A function that writes every parameter of ``model`` in place as the family's own
        initialisation does (run once, on stand-ins), or ``None`` for a model it does not
        initialise."""
        ...


@runtime_checkable
class TracingPart(Protocol):
    """What tracing on fake tensors (batch-dim analysis, ``ps.jit``) needs of one family."""

    def prepare_tracing(self) -> None:
        """Make the family's code know that tensors under ``torch.func`` wrappers may be fake
        (so that it skips its checks on values while pshard traces it); idempotent."""
        ...


@runtime_checkable
class ExpertsPart(Protocol):
    """What ``expert_parallel`` needs to know about one family of mixture-of-experts models."""

    def experts_modules(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        """The model's stacked experts modules (name, module): each holds every expert's
        weights in tensors whose dim 0 is the expert (empty for a model without)."""
        ...

    def experts_count(self, module: nn.Module) -> int:
        """How many experts ``module`` holds in the whole model (its config's count)."""
        ...

    def experts_parameters(self, module: nn.Module) -> tuple[str, ...]:
        """The names (in ``module``) of its stacked parameters, expert first."""
        ...

    def run_experts(
        self, module: nn.Module, rows: torch.Tensor, experts: torch.Tensor
    ) -> torch.Tensor:
        """``module``'s experts on ``rows``: row ``i`` through expert ``experts[i]`` (an index
        into the stacked tensors ``module`` holds now), as the family computes one expert."""
        ...

    def balance_loss_slot(self, model: nn.Module) -> tuple[dict[str, Any], str] | None:
        """Where ``model``'s forward reads its load-balancing loss function from (a namespace
        and a name), or ``None``: the model has none."""
        ...

    def balance_loss(
        self, reduce: Callable[[torch.Tensor], torch.Tensor], share: int
    ) -> Callable[..., Any]:
        """The family's load-balancing loss function inside the block: the same loss of token
        statistics ``reduce`` sums over the ranks of the block's map, divided by ``share``
        (the number of those ranks, whose results the block sums)."""
        ...

    def loss_items(self, kwargs: dict[str, Any]) -> torch.Tensor | None:
        """The count of targets the model's own loss averages over in a call with ``kwargs``
        (``None``: no loss of its own, or the caller gave the count); the block passes the
        count of the whole map's batch instead, so that each rank's loss is its share."""
        ...


@runtime_checkable
class StackedNamesPart(Protocol):
    """A family whose checkpoints store per-expert tensors its modules hold stacked (Hugging
    Face's MoE models: ``experts.0.gate_proj.weight`` ... on the hub and from
    ``save_pretrained``, ``experts.gate_up_proj`` in the module)."""

    def stacked_names(self, keys: Collection[str]) -> dict[str, list[list[str]]]:
        """Of a checkpoint's ``keys``: each stacked name -> per expert (dim 0, in order), the
        keys whose tensors, concatenated on their dim 0, are that expert's slice."""
        ...


@runtime_checkable
class LayersPart(Protocol):
    """What ``ps.checkpoint_layers`` needs of one family: the model's own checkpointing of its
    layers pointed at a function."""

    def checkpoint_layers(self, model: nn.Module, fn: Callable[..., Any]) -> bool:
        """Make each of ``model``'s layers (those its own gradient checkpointing wraps) run
        through ``fn`` (called as ``torch.utils.checkpoint.checkpoint`` is: ``fn(layer_call,
        *args)``); ``False`` for a model the family cannot do it for."""
        ...


@runtime_checkable
class ConfigPart(Protocol):
    """What ``ps.save(..., format="huggingface", config=...)`` needs of one family."""

    def config_file(self, config: Any) -> tuple[str, str] | None:
        """The file a checkpoint of the family holds beside its weights for ``config`` (name
        and text: ``("config.json", ...)``), or ``None`` for a config of another family."""
        ...


# adapter name -> adapter; written when an integration is imported, read afterwards
_ADAPTERS: dict[str, ModelAdapter] = {}


def register_adapter(adapter: ModelAdapter) -> None:
    """Register ``adapter`` (under its name, replacing one registered before under that name)."""
    _ADAPTERS.pop(adapter.name, None)
    _ADAPTERS[adapter.name] = adapter


def registered_adapters() -> tuple[ModelAdapter, ...]:
    """The registered adapters, in registration order."""
    return tuple(_ADAPTERS.values())


def find_adapter(model: nn.Module) -> ModelAdapter | None:
    """The adapter of ``model``'s family (the latest registered that matches), or ``None``."""
    for adapter in reversed(_ADAPTERS.values()):
        if adapter.matches(model):
            return adapter
    return None


def tensor_parallel_part(model: nn.Module) -> TensorParallelParts | None:
    """The tensor-parallel part of the adapter of ``model``'s family (the latest registered
    that matches and has one), or ``None``."""
    for adapter in reversed(_ADAPTERS.values()):
        if isinstance(adapter, TensorParallelParts) and adapter.matches(model):
            return adapter
    return None


def initializer_part(model: nn.Module) -> InitializerPart | None:
    """The initialiser part of the adapter of ``model``'s family (the latest registered that
    matches and has one), or ``None``."""
    for adapter in reversed(_ADAPTERS.values()):
        if isinstance(adapter, InitializerPart) and adapter.matches(model):
            return adapter
    return None


def prepare_tracing() -> None:
    """Before tracing a function on fake tensors: every registered family that has a
    :class:`TracingPart` is told."""
    for adapter in _ADAPTERS.values():
        if isinstance(adapter, TracingPart):
            adapter.prepare_tracing()


def config_file(config: Any) -> tuple[str, str] | None:
    """The name and text of the file that holds ``config`` beside a model's weights, from the
    family that knows it (``None``: no registered family does)."""
    for adapter in reversed(_ADAPTERS.values()):
        if isinstance(adapter, ConfigPart):
            found = adapter.config_file(config)
            if found is not None:
                return found
    return None


def layers_part(model: nn.Module) -> LayersPart | None:
    """The layers part of the adapter of ``model``'s family (the latest registered that
    matches and has one), or ``None``."""
    for adapter in reversed(_ADAPTERS.values()):
        if isinstance(adapter, LayersPart) and adapter.matches(model):
            return adapter
    return None


def experts_part(model: nn.Module) -> ExpertsPart | None:
    """The experts part of the adapter of ``model``'s family (the latest registered that
    matches and has one), or ``None``."""
    for adapter in reversed(_ADAPTERS.values()):
        if isinstance(adapter, ExpertsPart) and adapter.matches(model):
            return adapter
    return None


def stacked_names(keys: Collection[str]) -> dict[str, list[list[str]]]:
    """The stacked names every registered adapter with a :class:`StackedNamesPart` finds in a
    checkpoint's ``keys`` (see there)."""
    out: dict[str, list[list[str]]] = {}
    for adapter in _ADAPTERS.values():
        if isinstance(adapter, StackedNamesPart):
            out.update(adapter.stacked_names(keys))
    return out
