"""Hugging Face mixture-of-experts causal LMs under :func:`pshard.expert_parallel` (Mixtral,
Qwen2-MoE, Qwen3-MoE): the experts part of the transformers adapter
(:class:`pshard._modules.adapter.ExpertsPart`).

- **Experts**: the modules holding every expert's weights stacked, ``gate_up_proj`` (experts,
  2 x intermediate, hidden) and ``down_proj`` (experts, hidden, intermediate), whose call is
  ``experts(hidden_states, top_k_index, top_k_weights)``; one expert is ``down(act(gate) *
  up)`` with ``gate, up = linear(x, gate_up_proj[e]).chunk(2)``, as transformers' eager
  experts compute it (whatever the model's experts implementation setting).
- **Load balancing**: the model's forward calls its modeling module's
  ``load_balancing_loss_func(router_logits, num_experts, top_k, attention_mask)``; inside the
  block it is the same loss of the statistics (per-expert counts of top-k assignments, router
  probability sums, token count) summed over the map's ranks, each rank returning its share.
- **The loss**: ``labels`` count their targets after the shift, ``labels[..., 1:] != -100``.
- **Checkpoints**: the hub's files and ``save_pretrained`` store each expert apart,
  ``<experts>.<e>.gate_proj.weight``, ``.up_proj.weight`` and ``.down_proj.weight`` (each
  ``nn.Linear``'s ``(out, in)``); the module's ``gate_up_proj[e]`` is ``gate`` then ``up`` on
  dim 0, ``down_proj[e]`` is ``down`` (what ``from_pretrained`` converts).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Collection
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .._compat import tracing

__all__ = ["MoeParts"]

_STACKED = ("gate_up_proj", "down_proj")
_IGNORE_INDEX = -100
_BALANCE = "load_balancing_loss_func"
_PER_EXPERT = re.compile(r"(.+\.experts)\.(\d+)\.(gate|up|down)_proj\.weight")


def _is_experts(module: nn.Module) -> bool:
    """Stacked experts in transformers' default layout: ``[gate; up]`` concatenated, weights
    ``(experts, out, in)``, no biases (what :meth:`MoeParts.run_experts` computes)."""
    stacked = all(isinstance(getattr(module, n, None), torch.Tensor) for n in _STACKED)
    layout = (
        getattr(module, "is_concatenated", True)
        and getattr(module, "has_gate", True)
        and not getattr(module, "is_transposed", False)
        and not getattr(module, "has_bias", False)
        and not getattr(module, "has_post_expert_norm", False)
    )
    return stacked and bool(layout) and hasattr(module, "act_fn")


def _gate(module: nn.Module, gate_up: torch.Tensor) -> torch.Tensor:
    apply: Any = getattr(module, "_apply_gate", None)
    if callable(apply):
        return apply(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    act: Any = module.act_fn
    return act(gate) * up


class MoeParts:
    """The :class:`~pshard._modules.adapter.ExpertsPart` of Hugging Face MoE models."""

    def experts_modules(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        return [(n, m) for n, m in model.named_modules() if n and _is_experts(m)]

    def experts_count(self, module: nn.Module) -> int:
        count = getattr(module, "num_experts", None)
        stacked: Any = module.gate_up_proj
        return int(count) if count is not None else int(stacked.shape[0])

    def experts_parameters(self, module: nn.Module) -> tuple[str, ...]:
        return _STACKED

    def run_experts(
        self, module: nn.Module, rows: torch.Tensor, experts: torch.Tensor
    ) -> torch.Tensor:
        gate_up: torch.Tensor = module.gate_up_proj  # type: ignore[assignment]
        down: torch.Tensor = module.down_proj  # type: ignore[assignment]
        if tracing([rows]):  # a program (ps.jit): each expert's rows by a mask, no host read
            out = rows.new_zeros((rows.shape[0], down.shape[1]))
            for e in range(gate_up.shape[0]):
                sel = experts == e
                y = F.linear(_gate(module, F.linear(rows[sel], gate_up[e])), down[e])
                out = out.index_put((sel,), y)
            return out
        order = torch.argsort(experts, stable=True)
        counts = torch.bincount(experts, minlength=gate_up.shape[0]).tolist()
        parts: list[torch.Tensor] = []
        for e, (x, n) in enumerate(zip(rows[order].split(counts), counts, strict=True)):
            if n or (e == len(counts) - 1 and not parts):
                # no rows at all: expert 0's computation on none, so that the backward pass
                # still reaches the exchange that brought them (every rank runs its transpose)
                e = e if n else 0
                parts.append(F.linear(_gate(module, F.linear(x, gate_up[e])), down[e]))
        grouped = torch.cat(parts)
        return grouped[torch.argsort(order)]  # back in the rows' order

    def balance_loss_slot(self, model: nn.Module) -> tuple[dict[str, Any], str] | None:
        home = sys.modules.get(type(model).__module__)
        if home is None or not callable(getattr(home, _BALANCE, None)):
            return None
        return home.__dict__, _BALANCE

    def balance_loss(
        self, reduce: Callable[[torch.Tensor], torch.Tensor], share: int
    ) -> Callable[..., Any]:
        def load_balancing_loss_func(
            gate_logits: Any, num_experts: int | None = None, top_k: int = 2,
            attention_mask: torch.Tensor | None = None,
        ) -> Any:  # fmt: skip
            if gate_logits is None or not isinstance(gate_logits, tuple):
                return 0
            assert num_experts is not None
            device = gate_logits[0].device
            counts = torch.zeros(num_experts, dtype=torch.float32, device=device)
            probs = torch.zeros(num_experts, dtype=torch.float32, device=device)
            rows = torch.zeros((), dtype=torch.float32, device=device)
            mask = None
            if attention_mask is not None:
                mask = attention_mask.reshape(-1).to(device=device, dtype=torch.float32)
            for layer in gate_logits:
                weights = F.softmax(layer.to(device), dim=-1)
                _, chosen = torch.topk(weights, top_k, dim=-1)
                if mask is None:
                    counts = counts + torch.histc(
                        chosen.reshape(-1).float(), bins=num_experts, min=0, max=num_experts
                    )
                    probs = probs + weights.float().sum(dim=0)
                    rows = rows + weights.shape[0]
                else:
                    counts = counts + torch.zeros(num_experts, dtype=torch.float32,
                                                  device=device).scatter_add_(
                        0, chosen.reshape(-1), mask.repeat_interleave(top_k)
                    )  # fmt: skip
                    probs = probs + (weights.float() * mask.unsqueeze(-1)).sum(dim=0)
                    rows = rows + mask.sum()
            # the statistics of the whole batch of the map: every rank's tokens
            total = reduce(torch.cat([counts, probs, rows.reshape(1)]))
            counts, probs, rows = total[:num_experts], total[num_experts:-1], total[-1]
            loss = torch.sum((counts / rows) * (probs / rows).unsqueeze(0)) * num_experts
            return loss / share

        return load_balancing_loss_func

    def stacked_names(self, keys: Collection[str]) -> dict[str, list[list[str]]]:
        found: dict[str, set[int]] = {}
        for k in keys:
            match = _PER_EXPERT.fullmatch(k)
            if match is not None:
                found.setdefault(match[1], set()).add(int(match[2]))
        out: dict[str, list[list[str]]] = {}
        for prefix, experts in found.items():
            grid = [[f"{prefix}.{e}.{p}_proj.weight" for p in ("gate", "up", "down")]
                    for e in range(max(experts) + 1)]  # fmt: skip
            if all(k in keys for parts in grid for k in parts):  # every expert, every part
                out[f"{prefix}.gate_up_proj"] = [parts[:2] for parts in grid]
                out[f"{prefix}.down_proj"] = [parts[2:] for parts in grid]
        return out

    def loss_items(self, kwargs: dict[str, Any]) -> torch.Tensor | None:
        labels = kwargs.get("labels")
        if not isinstance(labels, torch.Tensor) or kwargs.get("num_items_in_batch") is not None:
            return None
        shifted = kwargs.get("shift_labels")
        targets = shifted if isinstance(shifted, torch.Tensor) else labels[..., 1:]
        return (targets != _IGNORE_INDEX).sum()
