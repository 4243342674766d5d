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
however unbalanced. While ``ps.jit`` traces, the counts are data of the program (the rows
received a size the data decide) and nothing is read on the host: a choice of no expert
travels to expert 0 with weight 0, and a router's choice outside the experts is an assertion of
the program. Every step is differentiable (the exchanges transpose to the reverse
exchanges), so gradients reach the experts' blocks, the tokens and the routing weights.
"""

from __future__ import annotations

import torch
from torch import nn

from .._collectives.functions import all_to_all
from .._collectives.ragged import ragged_all_to_all
from .._compat import assert_in_program, same_size, tracing
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
    traced = tracing([chosen])
    tokens = torch.arange(hidden.shape[0], device=hidden.device).repeat_interleave(k)
    keep = None
    route = chosen
    if traced:  # choices of no expert (``total``) travel to expert 0 with weight 0: no host read
        none = chosen == total
        route, keep = torch.where(none, 0, chosen), (~none).to(weights.dtype)
    # by expert, stably (so by rank); eagerly, the choices of no expert (``total``, which
    # transformers' experts skip) sort last and stay home
    clamped = route.clamp(0, total)
    counted = torch.zeros(total + 1, dtype=torch.int64, device=chosen.device)
    counted = counted.scatter_add(0, clamped, torch.ones_like(clamped))
    per_expert = counted[:total].reshape(size, local)
    order = torch.argsort(route, stable=True)
    if not traced:
        order = order[: int(per_expert.sum())]
    # the counts each rank's experts get from every rank, and whether any rank's router chose
    # an expert that does not exist (then every rank raises, before any row moves)
    bad = ((chosen < 0) | (chosen > total)).any().to(per_expert.dtype)
    got = all_to_all(torch.cat([per_expert, bad.expand(size, 1)], dim=1), axis, split_dim=0,
                     concat_dim=0)  # fmt: skip
    outside = f"chose experts outside 0..{total - 1} (or {total} for none); no token was sent"
    if traced:
        assert_in_program(got[:, -1].sum() == 0, f"expert_parallel: a router {outside}")
    elif bool(got[:, -1].any()):
        ranks = got[:, -1].nonzero().flatten().tolist()
        raise ValueError(f"expert_parallel: the router of rank(s) {ranks} of {axis!r} {outside}")
    coming = got[:, :-1]
    rows, counts = ragged_all_to_all(hidden[tokens[order]], per_expert.sum(dim=1), axis)
    expert_of = torch.arange(local, device=hidden.device).repeat(size)
    # as many as the rows received (the counts' sum): no size of its own to find, no sync
    expert_of = expert_of.repeat_interleave(coming.reshape(-1), output_size=rows.shape[0])
    out = part.run_experts(module, rows, expert_of)
    back, _ = ragged_all_to_all(out, counts, axis)
    same_size(back.shape[0], order.shape[0])
    w = weights.reshape(-1)[order, None]
    if keep is not None:
        w = w * keep[order, None]
    weighted = (back * w).to(hidden.dtype)
    return torch.zeros_like(hidden).index_add(0, tokens[order], weighted)
