"""One call of an experts module under ``expert_parallel``, on this rank's tokens.

Every (token, choice) pair of the top-k routing is a row sent to the rank holding its expert
(ranks hold consecutive experts: rank ``r`` experts ``r * E/n`` to ``(r + 1) * E/n - 1``):

1. the pairs sorted by expert (so by rank too, stably: a token's choices keep their order);
2. the per-expert counts (``(n, E/n)``) exchanged in one small ``all_to_all``: each rank learns
   how many rows of each of its experts every rank sends;
3. the token rows exchanged with :func:`pshard.ragged_all_to_all`; this rank's experts run on
   what it received (the model adapter's ``run_experts``: each expert's rows together);
4. the results exchanged back (the reverse counts), weighted by the routing weights in the
   model's own dtype rule and added into each token's row.

Nothing is dropped: the rows each rank receives are exactly its experts' share of the tokens,
however unbalanced. Every step is differentiable (the exchanges transpose to the reverse
exchanges), so gradients reach the experts' blocks, the tokens and the routing weights.
"""

from __future__ import annotations

import torch
from torch import nn

from .._collectives.functions import all_to_all
from .._collectives.ragged import ragged_all_to_all
from .._modules.adapter import ExpertsPart

__all__ = ["dispatch"]


def dispatch(
    part: ExpertsPart,
    module: nn.Module,
    axis: str,
    size: int,
    local: int,
    hidden: torch.Tensor,
    index: torch.Tensor,
    weights: torch.Tensor,
) -> torch.Tensor:
    """``module``'s experts (this rank's ``local`` of them) on ``hidden`` (tokens, hidden)
    routed to the experts ``index`` (tokens, k) with ``weights`` (tokens, k), over ``axis``."""
    k = index.shape[-1]
    total = size * local
    chosen = index.reshape(-1)
    bad = bool(chosen.numel()) and not 0 <= int(chosen.min()) <= int(chosen.max()) <= total
    tokens = torch.arange(hidden.shape[0], device=hidden.device).repeat_interleave(k)
    # by expert, stably; the choices of expert ``total`` (none, as transformers' experts skip
    # it) sort last and stay home
    counted = torch.bincount(chosen.clamp(0, total), minlength=total + 1)
    per_expert = counted[:total].reshape(size, local)
    order = torch.argsort(chosen, stable=True)[: int(per_expert.sum())]
    # the counts each rank's experts get from every rank, and whether any rank's router chose
    # an expert that does not exist (then every rank raises, before any row moves)
    flag = torch.full((size, 1), int(bad), dtype=per_expert.dtype, device=per_expert.device)
    got = all_to_all(torch.cat([per_expert, flag], dim=1), axis, split_dim=0, concat_dim=0)
    if bool(got[:, -1].any()):
        ranks = got[:, -1].nonzero().flatten().tolist()
        raise ValueError(
            f"expert_parallel: the router of rank(s) {ranks} of {axis!r} chose experts outside "
            f"0..{total - 1} (or {total} for none); no token was sent"
        )
    coming = got[:, :-1]
    rows, counts = ragged_all_to_all(hidden[tokens[order]], per_expert.sum(dim=1), axis)
    ids = torch.arange(local, device=hidden.device).repeat(size)
    out = part.run_experts(module, rows, ids.repeat_interleave(coming.reshape(-1)))
    back, _ = ragged_all_to_all(out, counts, axis)
    weighted = (back * weights.reshape(-1)[order, None]).to(hidden.dtype)
    return torch.zeros_like(hidden).index_add(0, tokens[order], weighted)
