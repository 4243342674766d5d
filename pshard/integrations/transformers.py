"""Hugging Face transformers models under :func:`pshard.sequence_parallel` and
:func:`pshard.tensor_parallel`: the model adapter (:class:`pshard._modules.adapter.ModelAdapter`,
with its :class:`~pshard._modules.adapter.TensorParallelParts`) of models whose config has an
``_attn_implementation``, registered when this module is imported (``import pshard`` does).

``transformers`` stays optional: nothing here imports it until a Hugging Face model is used.

**Attention.** ``sequence_parallel(model, attention="ulysses" | "ring" | "usp")`` sets the model's
``config._attn_implementation`` to ``"pshard|<its own>"`` for the ``with`` block (and back on
exit). That name is registered once with transformers' ``AttentionInterface``; its function
reads the sequence context of the call, runs :func:`pshard.ulysses_attention` or
:func:`pshard.ring_attention` on the ``(batch, heads, seq, head_size)`` tensors the model hands
it (the layer's ``scaling``, its ``sliding_window`` if any, causal when the layer is), with the
call's segment ids, and falls back to the model's own implementation (the part after ``|``)
outside a sequence context. Because no mask function is registered under that name,
transformers builds no ``(seq, seq)`` mask for the local shard: padding and packed documents
reach the attention as segment ids computed over the whole sequence by the pre-hook.

**Activation checkpointing** (``gradient_checkpointing_enable()``): checkpointed layers run
again during the backward pass, which may come after the block has restored the model's own
attention. A backward pass through a call made inside the block therefore plugs pshard's
attention again for the duration of that pass (:meth:`TransformersAdapter.use_attention`,
through the call's backward scope, see :mod:`pshard.sequence._context`) and restores the model's
own when the pass ends.

**Initialisation** (:func:`pshard.init_sharded`): the model's own weight initialisation is
registered as the initialiser of Hugging Face models.

**Conventions the adapter owns** (:meth:`TransformersAdapter.prepare`, applied by the hooks to
the whole call before the split): a KV cache, ``use_cache=True`` and
``output_attentions`` are refused; ``labels`` are shifted over the whole sequence into
``shift_labels`` before the split (unless given), and ``num_items_in_batch`` is the count of the
whole batch (unless given), so the loss each rank's model computes is its share of the
single-process loss; the post-hook sums the shares (:meth:`TransformersAdapter.sum_loss`:
``loss`` is then the single-process loss on every rank, with a backward that leaves each rank
its share of the gradients).

**Tensor parallelism** (:class:`TransformersAdapter`'s tensor-parallel part): the default plans
of the Llama, Mistral, Qwen2 (``config.model_type`` ``"llama"``, ``"mistral"``, ``"qwen2"``)
and GPT-2 causal LMs (and their base models); ``Conv1D`` stores its weight ``(in, out)``;
attention modules hold their heads in ``q_proj``/``k_proj``/``v_proj``/``o_proj`` (the counts
from the config, ``num_key_value_groups`` set to this rank's) or, for GPT-2, in the fused
``c_attn`` (q|k|v; ``split_size`` and ``num_heads`` set to this rank's); with ``loss_parallel``
the model's ``loss_function`` (``ForCausalLMLoss``, which would reshape split logits with
``view(-1, vocab_size)`` and cast float64 to float32) is replaced for the block by the same
loss on the split vocabulary (:func:`pshard.cross_entropy`, in float32 for half-precision
logits and in the logits' dtype otherwise).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from .._compat import innermost
from .._modules.adapter import AttentionHeads, PreparedCall, Reduce, register_adapter
from .._runtime.rank_local import Slot, hold
from ..sequence._lm import (
    ATTENTION_MASK,
    IGNORE_INDEX,
    LABELS,
    NUM_ITEMS_IN_BATCH,
    POSITION_IDS,
    SHIFT_LABELS,
    segment_ids_of,
    shift_labels,
)
from ..sequence.plug import plugged_attention, run_attention
from ..tensor_parallel._loss import cross_entropy
from .moe import MoeParts

__all__ = ["TransformersAdapter"]

_PREFIX = "pshard|"


def _config(model: nn.Module) -> Any:
    return getattr(model, "config", None)


def _own(name: str | None) -> str:
    return name[len(_PREFIX) :] if name and name.startswith(_PREFIX) else (name or "eager")


def _hf_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """What transformers calls for ``"pshard|<own>"``: q, k, v are ``(batch, heads, seq,
    head_size)``; returns ``(batch, seq, heads, head_size)`` and no attention weights."""
    plugged = plugged_attention(query.shape[2])
    if plugged is None:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        own = _own(_config(module)._attn_implementation)
        if own == "eager":  # not in the interface: the model file's own eager attention
            fallback = getattr(
                sys.modules.get(type(module).__module__), "eager_attention_forward", None
            )
            if fallback is None:
                raise RuntimeError(
                    f"sequence_parallel: {type(module).__name__} ran outside a sequence-parallel "
                    f"call while its model's attention is plugged, and its eager attention "
                    f"cannot be found; call the model itself inside the block, or outside it"
                )
        else:
            fallback = ALL_ATTENTION_FUNCTIONS[own]
        return fallback(module, query, key, value, attention_mask, scaling=scaling,
                        dropout=dropout, sliding_window=sliding_window, **kwargs)  # fmt: skip
    if dropout:
        raise ValueError(
            f"sequence_parallel: {type(module).__name__} asks for attention dropout "
            f"(p={dropout}) in training mode; dropout inside sequence-parallel attention cannot "
            f"match one process (every rank would draw its own mask): set the config's "
            f"attention_dropout to 0, or call model.eval()"
        )
    out = run_attention(
        plugged, query, key, value, causal=bool(getattr(module, "is_causal", True)),
        window=sliding_window, scale=scaling, seq_dim=2, head_dim=1,
    )  # fmt: skip
    return out.transpose(1, 2), None


def _register(name: str) -> None:
    from transformers import AttentionInterface

    if name not in AttentionInterface._global_mapping:
        AttentionInterface.register(name, _hf_attention)


def _set_attention(model: nn.Module, name: str) -> Callable[[], None]:
    """Set the model's attention implementation to ``name``; returns the undo. The config may
    be shared by in-process ranks (models built from one config): the setting is this rank's
    (:mod:`pshard._runtime.rank_local`)."""
    slot = Slot(_config(model), "_attn_implementation", item=False)
    own = slot.get()
    slot.put(name)
    release = hold([slot], [own])

    def undo() -> None:
        release()
        slot.put(own)

    return undo


def _refuse(model: nn.Module, kwargs: dict[str, Any]) -> None:
    name = type(model).__name__
    cache = kwargs.get("past_key_values")
    if cache is not None:
        raise ValueError(
            f"sequence_parallel({name}): a KV cache (past_key_values) cannot be used inside the "
            f"block: each rank holds only its tokens' keys and values, so the cache would be "
            f"wrong for the next step; generate outside the block (without sequence_parallel)"
        )
    if kwargs.get("use_cache"):
        raise ValueError(
            f"sequence_parallel({name}): use_cache=True (a KV cache, as generate() asks for) "
            f"cannot be used inside the block: each rank holds only its tokens' keys and values; "
            f"pass use_cache=False, or generate outside the block"
        )
    config = _config(model)
    if kwargs.get("output_attentions") or getattr(config, "output_attentions", False):
        raise ValueError(
            f"sequence_parallel({name}): output_attentions=True cannot be honoured: "
            f"sequence-parallel attention never forms the (seq, seq) attention weights (no rank "
            f"holds them); turn output_attentions off"
        )


class TransformersAdapter(MoeParts):
    """The :class:`~pshard._modules.adapter.ModelAdapter` of Hugging Face transformers models
    (see the module docs)."""

    name = "transformers"
    interface = "a Hugging Face model's attention interface (a config._attn_implementation)"

    def matches(self, model: nn.Module) -> bool:
        """Whether ``model`` looks like a transformers model (a config with an attention
        implementation)."""
        config = _config(model)
        return config is not None and hasattr(config, "_attn_implementation")

    def attention_name(self, model: nn.Module) -> str:
        """The model's attention implementation now."""
        return str(_config(model)._attn_implementation)

    def plug(self, model: nn.Module) -> Callable[[], None]:
        """Make ``model`` use pshard's attention; returns the function that restores its own."""
        own = _config(model)._attn_implementation
        if own and own.startswith(_PREFIX):
            raise RuntimeError(
                f"sequence_parallel({type(model).__name__}): the model's attention is already "
                f"pshard's ({own!r}): sequence_parallel cannot be nested on one model"
            )
        name = _PREFIX + (own or "eager")
        _register(name)
        return _set_attention(model, name)

    def use_attention(self, model: nn.Module, name: str) -> Callable[[], None] | None:
        """For a backward pass through a call made inside the block: recomputed (checkpointed)
        layers must run the attention the forward ran, even after the block restored the
        model's own. Plugs ``name`` for the pass if the model is not using it; returns the
        undo."""
        if self.attention_name(model) == name:
            return None
        return _set_attention(model, name)

    def prepare(
        self,
        model: nn.Module,
        kwargs: dict[str, Any],
        accepts: Callable[[str], bool],
        length: int,
    ) -> PreparedCall:
        """The whole-sequence side of a call: refusals, ``use_cache=False``, labels shifted
        over the whole sequence, the whole batch's ``num_items_in_batch``, and the segment ids
        of padding and packed rows; the model's loss is then each rank's share."""
        _refuse(model, kwargs)
        kwargs = dict(kwargs)
        if accepts("use_cache"):
            kwargs["use_cache"] = False
        mask = kwargs.get(ATTENTION_MASK)
        positions = kwargs.get(POSITION_IDS)
        if mask is not None and (not isinstance(mask, torch.Tensor) or mask.dim() != 2):
            raise ValueError(
                f"sequence_parallel({type(model).__name__}): {ATTENTION_MASK} must be a (batch, "
                f"seq) tensor of 1 (token) and 0 (padding); a 4-D or custom mask cannot be split "
                f"by position: pass padding as {ATTENTION_MASK} and packed documents as "
                f"{POSITION_IDS}"
            )
        segments = segment_ids_of(
            positions if isinstance(positions, torch.Tensor) and positions.dim() == 2 else None,
            mask,
        )
        labels = kwargs.get(LABELS)
        share = False
        if isinstance(labels, torch.Tensor):
            if labels.dim() != 2 or labels.shape[1] != length:
                raise ValueError(
                    f"sequence_parallel({type(model).__name__}): {LABELS} must be (batch, seq) "
                    f"with seq = {length}, got shape {tuple(labels.shape)}"
                )
            if kwargs.get(SHIFT_LABELS) is None:
                kwargs[SHIFT_LABELS] = shift_labels(labels, IGNORE_INDEX)
            if kwargs.get(NUM_ITEMS_IN_BATCH) is None:
                kwargs[NUM_ITEMS_IN_BATCH] = (kwargs[SHIFT_LABELS] != IGNORE_INDEX).sum()
            share = True
        return PreparedCall(kwargs, segments, share)

    def sum_loss(self, output: Any, reduce: Reduce) -> Any:
        """The loss of a ``ModelOutput`` (``output.loss``, also ``output[0]`` of a tuple)
        summed over the ranks."""
        if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
            return (reduce(output[0], "output[0]"), *output[1:])
        try:
            loss = output["loss"]
        except (KeyError, TypeError, IndexError):
            return output
        if loss is not None:
            output["loss"] = reduce(loss, "output['loss']")
        return output

    # ------------------------------------------------------------- init_sharded

    def checkpoint_layers(self, model: nn.Module, fn: Callable[..., Any]) -> bool:
        """The model's gradient checkpointing (its decoder layers' ``GradientCheckpointingLayer``
        call) through ``fn``: ``_set_gradient_checkpointing``, the hook transformers' own
        ``activation_checkpointing_enable`` sets ``torch.utils.checkpoint`` with."""
        setter = getattr(model, "_set_gradient_checkpointing", None)
        if not getattr(model, "supports_gradient_checkpointing", False) or not callable(setter):
            return False
        setter(enable=True, gradient_checkpointing_func=fn)
        return True

    def config_file(self, config: Any) -> tuple[str, str] | None:
        """``config.json`` of a ``PretrainedConfig``, as ``save_pretrained`` writes it."""
        transformers = sys.modules.get("transformers")
        base = getattr(transformers, "PretrainedConfig", None)
        if base is None or not isinstance(config, base):
            return None
        return "config.json", config.to_json_string(use_diff=True)

    def prepare_tracing(self) -> None:
        """transformers skips its checks on values (``if (mask == 1).all():``) when it sees it
        is being traced: a fake tensor among them. Under ``torch.func`` the tensors it sees are
        wrappers of the fake ones; its test looks through them from now on."""
        utils: Any = sys.modules.get("transformers.utils.import_utils")
        own = getattr(utils, "is_fake_tensor", None)
        if own is None or getattr(own, "_pshard", False):
            return

        def is_fake_tensor(x: Any) -> bool:
            return bool(own(x) or (isinstance(x, torch.Tensor) and own(innermost(x))))

        is_fake_tensor._pshard = True  # type: ignore[attr-defined]
        utils.is_fake_tensor = is_fake_tensor

    def initializer(self, model: nn.Module) -> Callable[[], None] | None:
        """For :func:`pshard.init_sharded`: a Hugging Face model's own weight initialisation
        (``initialize_weights``: its ``_init_weights`` on every module, children first, as
        ``from_config`` runs it), with the modules' "already initialised" flags cleared for the
        run and put back after it."""
        initialize = getattr(model, "initialize_weights", None)
        if not (self.matches(model) and callable(initialize)):
            return None

        def run() -> None:
            modules = list(model.modules())
            flags = {id(m): m.__dict__.pop("_is_hf_initialized") for m in modules
                     if "_is_hf_initialized" in m.__dict__}  # fmt: skip
            try:
                initialize()
            finally:
                for m in modules:
                    m.__dict__.pop("_is_hf_initialized", None)
                    if id(m) in flags:
                        m.__dict__["_is_hf_initialized"] = flags[id(m)]

        return run

    # ------------------------------------------------------------- tensor parallelism

    def tensor_parallel_plan(
        self, model: nn.Module, sequence_parallel: bool
    ) -> dict[str, str] | None:
        """The default plan of a Llama, Mistral, Qwen2 or GPT-2 model (see the module docs)."""
        kind = getattr(_config(model), "model_type", None)
        known = _PLANS.get(kind) if isinstance(kind, str) else None
        if known is None:
            return None
        plan, sequence = known
        if sequence_parallel:
            plan = {**plan, **dict.fromkeys(sequence, "sequence")}
        prefix = getattr(model, "base_model_prefix", "")
        base = prefix if prefix and isinstance(getattr(model, prefix, None), nn.Module) else ""
        out = {(f"{base}.{k}" if base else k): v for k, v in plan.items()}
        output_embeddings = _attr(model, "get_output_embeddings", None)
        head = output_embeddings() if callable(output_embeddings) else None
        if head is not None and _attr(model, "lm_head", None) is head:
            out["lm_head"] = "colwise"
        return out

    def projection_layout(self, module: nn.Module) -> str | None:
        """``"transposed"`` for transformers' ``Conv1D`` (weight ``(in, out)``)."""
        if type(module).__name__ == "Conv1D" and _from_transformers(module):
            return "transposed"
        return None

    def attention_heads(self, module: nn.Module) -> AttentionHeads | None:
        """The heads of a Llama-style attention module (``q_proj``, ``k_proj``, ``v_proj``,
        ``o_proj``) or of GPT-2's (the fused ``c_attn``, then ``c_proj``)."""
        if not _from_transformers(module):
            return None
        config = _attr(module, "config", None)
        children = dict(module.named_children())
        if {"q_proj", "k_proj", "v_proj", "o_proj"} <= set(children) and hasattr(
            module, "num_key_value_groups"
        ):
            heads = int(config.num_attention_heads)
            kv = int(getattr(config, "num_key_value_heads", None) or heads)
            return AttentionHeads(heads, kv, int(_attr(module, "head_dim")),
                                  ("q_proj", "k_proj", "v_proj"), ("k_proj", "v_proj"), 1,
                                  "o_proj")  # fmt: skip
        if {"c_attn", "c_proj"} <= set(children) and hasattr(module, "split_size"):
            if getattr(module, "is_cross_attention", False):
                raise ValueError(
                    f"tensor_parallel: {type(module).__name__} is a cross-attention module "
                    f"(q_attn and a fused k|v c_attn); its heads cannot be split by this plan: "
                    f"leave it whole ('replicate')"
                )
            heads = int(_attr(module, "num_heads"))
            return AttentionHeads(heads, heads, int(_attr(module, "head_dim")), ("c_attn",), (), 3,
                                  "c_proj")  # fmt: skip
        return None

    def localize_attention(
        self, module: nn.Module, heads: int, kv_heads: int
    ) -> Callable[[], None]:
        """Set the attributes the module's code reads of its head counts to this rank's."""
        if hasattr(module, "num_key_value_groups"):
            values: dict[str, Any] = {"num_key_value_groups": heads // kv_heads}
        else:
            values = {"num_heads": heads, "split_size": heads * int(_attr(module, "head_dim"))}
        saved = {k: module.__dict__[k] for k in values}
        for k, v in values.items():
            setattr(module, k, v)

        def undo() -> None:
            for k, v in saved.items():
                setattr(module, k, v)

        return undo

    def parallel_loss(self, model: nn.Module, axis: str) -> Callable[[], None] | None:
        """The model's ``loss_function`` replaced by the causal-LM loss on logits split over
        the vocabulary (see the module docs)."""
        if not hasattr(type(model), "loss_function"):
            return None
        kind = getattr(model, "loss_type", None)
        name = type(model).__name__
        # a causal LM's forward passes its logits to loss_function (transformers falls back to
        # ForCausalLM where loss_type is None); other heads compute losses it cannot see
        if kind not in (None, "ForCausalLM") or not name.endswith(("ForCausalLM", "LMHeadModel")):
            raise ValueError(
                f"tensor_parallel({name}, loss_parallel=True): the model's loss ({kind!r}) is "
                f"not a causal LM's, which is the one computed on logits split over the "
                f"vocabulary; use loss_parallel=False"
            )
        # transformers' loss_function property reads (and its setter writes) _loss_function
        had = "_loss_function" in model.__dict__
        saved = model.__dict__.get("_loss_function")
        object.__setattr__(model, "loss_function", _split_vocabulary_loss(axis))

        def undo() -> None:
            if had:
                object.__setattr__(model, "loss_function", saved)
            else:
                model.__dict__.pop("_loss_function", None)

        return undo


def _attr(obj: Any, name: str, *default: Any) -> Any:
    """An attribute of a transformers object (typed ``Any``: nn.Module types its attributes
    as tensors or modules)."""
    return getattr(obj, name, *default)


def _from_transformers(module: nn.Module) -> bool:
    return type(module).__module__.startswith("transformers.")


_LLAMA = {
    "embed_tokens": "vocab",
    "layers.*.self_attn.q_proj": "colwise",
    "layers.*.self_attn.k_proj": "colwise",
    "layers.*.self_attn.v_proj": "colwise",
    "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.mlp.gate_proj": "colwise",
    "layers.*.mlp.up_proj": "colwise",
    "layers.*.mlp.down_proj": "rowwise",
}
_GPT2 = {
    "wte": "vocab",
    "h.*.attn.c_attn": "colwise",
    "h.*.attn.c_proj": "rowwise",
    "h.*.mlp.c_fc": "colwise",
    "h.*.mlp.c_proj": "rowwise",
}

# config.model_type -> the default plan of the base model (module names under its prefix), and
# the modules Megatron sequence parallelism adds as "sequence": the decoder layers (the first
# splits the embeddings' output, which transformers reads whole for masks and positions) and
# the final norm (which gathers: GPT-2 reshapes its output with the whole length)
_PLANS: dict[str, tuple[dict[str, str], tuple[str, ...]]] = {
    "llama": (_LLAMA, ("layers.*", "norm")),
    "mistral": (_LLAMA, ("layers.*", "norm")),
    "qwen2": (_LLAMA, ("layers.*", "norm")),
    "gpt2": (_GPT2, ("h.*", "ln_f")),
}


def _split_vocabulary_loss(axis: str) -> Callable[..., torch.Tensor]:
    """transformers' ``ForCausalLMLoss`` on logits split over the vocabulary across ``axis``."""

    def loss(
        logits: torch.Tensor,
        labels: torch.Tensor,
        vocab_size: int | None = None,
        num_items_in_batch: torch.Tensor | int | None = None,
        ignore_index: int = IGNORE_INDEX,
        shift_labels: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()  # as transformers computes the loss
        if shift_labels is None:
            shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        shift_labels = shift_labels.to(logits.device)
        reduction: Literal["sum", "mean"] = "sum" if num_items_in_batch is not None else "mean"
        out = cross_entropy(
            logits, shift_labels, axis=axis, ignore_index=ignore_index, reduction=reduction
        )
        if num_items_in_batch is not None:
            if isinstance(num_items_in_batch, torch.Tensor):
                num_items_in_batch = num_items_in_batch.to(out.device)
            out = out / num_items_in_batch
        return out

    return loss


register_adapter(TransformersAdapter())
