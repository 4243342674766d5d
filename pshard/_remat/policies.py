"""What a checkpoint keeps for the backward: ``ps.checkpoint_policies``.

A policy is called once for each operation of the checkpointed function's forward, as
``policy(op, *args, **kwargs) -> bool``, and for each value named with
:func:`pshard.checkpoint_name`, as ``policy(checkpoint_name, x, name=name)``. ``True`` keeps
that output until the backward, where the recompute takes it instead of computing it again
(no FLOPs, no communication); ``False`` leaves it to the recompute. ``op`` is the operator that
runs below ``torch.func``'s transforms and autograd (a ``torch._ops.OpOverload`` such as
``torch.ops.aten.mm.default``, or ``torch.ops.c10d.allreduce_.default`` for the communication
of a pshard collective; inside a ``ps.jit`` program, the collective's own op,
``torch.ops.pshard.psum.default``) and ``args``/``kwargs`` are what it receives (plain
tensors, shapes, scalars; fake tensors inside a ``ps.jit`` program), as for
``torch.utils.checkpoint``'s selective policies and JAX's ``policy(prim, *avals, **params)``.

Not every operation can be kept: views and metadata (a view of a kept value costs nothing),
random draws (the recompute draws the same numbers again from the generator state of the
forward), factories without tensor inputs, and point-to-point exchanges (``ppermute``, ring
steps, gloo's pairwise gathers) are always run again, and a policy is not asked about them.
A value the forward overwrites in place after the policy kept it is recomputed (the kept copy
would be stale).

Internal interface: :class:`Policy` (the built-ins; ``vetoes(name)``, ``offload``),
:func:`resolve` (``policy=`` of ``ps.checkpoint`` to a :class:`Policy`, with its errors),
:func:`is_dot`, :func:`is_collective`, :func:`is_p2p`.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
from collections.abc import Callable
from typing import Any

import torch

from pshard._core.tree import describe

from .._runtime.dispatch import OPS_NAMESPACE
from .names import checkpoint_name

__all__ = [
    "CheckpointPolicies",
    "Policy",
    "checkpoint_policies",
    "dots_saveable",
    "everything_saveable",
    "is_collective",
    "is_dot",
    "is_p2p",
    "nothing_saveable",
    "offload",
    "recompute_collectives",
    "resolve",
    "save_anything_except_these_names",
    "save_collectives",
    "save_only_these_names",
]

PolicyFn = Callable[..., bool]

# --- operator classes -----------------------------------------------------------------------------

_DOTS = frozenset(
    {
        "mm", "addmm", "bmm", "baddbmm", "addbmm", "mv", "addmv", "dot", "vdot", "_int_mm",
        "_scaled_mm", "convolution", "_convolution", "mkldnn_convolution", "cudnn_convolution",
        "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_fused_attention_overrideable", "_flash_attention_forward",
        "_efficient_attention_forward",
    }
)  # fmt: skip
_COLLECTIVES = frozenset(
    {
        "allreduce_", "allreduce_coalesced_", "allgather_", "_allgather_base_",
        "allgather_coalesced_", "allgather_into_tensor_coalesced_", "reduce_scatter_",
        "_reduce_scatter_base_", "reduce_scatter_tensor_coalesced_", "alltoall_",
        "alltoall_base_", "broadcast_", "reduce_", "gather_", "scatter_",
    }
)  # fmt: skip


def is_dot(op: Any) -> bool:
    """Whether ``op`` is a matrix product, a convolution or an attention kernel (what
    ``torch.matmul``, ``F.linear``, ``torch.einsum``, convolutions and
    ``F.scaled_dot_product_attention`` run)."""
    return getattr(op, "namespace", None) == "aten" and getattr(op, "_opname", None) in _DOTS


# c10d's operators, and the in-process transport's of the same names
_COMMUNICATION = frozenset({"c10d", OPS_NAMESPACE})


# the collectives of a ps.jit program (pshard::<name>, :mod:`pshard._runtime.ops`)
_TRACED = frozenset(
    {
        "psum", "pextreme", "all_gather", "psum_scatter", "all_to_all", "broadcast", "reduce",
        "ragged_all_to_all",
    }
)  # fmt: skip


def is_collective(op: Any) -> bool:
    """Whether ``op`` is the communication of a collective (``torch.ops.c10d``, or the
    in-process ranks' ``torch.ops.pshard_threads``: all-reduce, all-gather, reduce-scatter,
    all-to-all, broadcast, reduce, gather, scatter; in a ``ps.jit`` program, the ``pshard::``
    op of a collective: ``torch.ops.pshard.all_gather.default``, ...)."""
    space, name = getattr(op, "namespace", None), getattr(op, "_opname", None)
    if space == "pshard":
        return name in _TRACED
    return space in _COMMUNICATION and name in _COLLECTIVES


def is_p2p(op: Any) -> bool:
    """Whether ``op`` communicates without being a collective (sends, receives, barriers; in a
    ``ps.jit`` program, ``pshard::ppermute``)."""
    space = getattr(op, "namespace", None)
    if space == "pshard":
        return getattr(op, "_opname", None) == "ppermute"
    return space in _COMMUNICATION and not is_collective(op)


# --- policies -------------------------------------------------------------------------------------


class Policy:
    """A checkpoint policy: ``policy(op, *args, **kwargs) -> bool`` (see the module docs).

    ``offload``: what the policy keeps waits for the backward in CPU memory.
    ``vetoes(name)``: values named ``name`` are recomputed even if their operation is kept.
    """

    offload: bool = False

    def __init__(self, decide: PolicyFn, text: str) -> None:
        self._decide = decide
        self._text = text

    def __call__(self, op: Any, *args: Any, **kwargs: Any) -> bool:
        return self._decide(op, *args, **kwargs)

    def vetoes(self, name: str) -> bool:
        return False

    def __repr__(self) -> str:
        return self._text


class _AllBut(Policy):
    def __init__(self, names: frozenset[str], text: str) -> None:
        super().__init__(lambda op, *a, **k: op is not checkpoint_name, text)
        self._names = names

    def vetoes(self, name: str) -> bool:
        return name in self._names


class _Offload(Policy):
    offload = True

    def __init__(self, inner: Policy) -> None:
        super().__init__(inner, f"ps.checkpoint_policies.offload({inner!r})")
        self._inner = inner

    def vetoes(self, name: str) -> bool:
        return self._inner.vetoes(name)


class _User(Policy):
    """A callable given by the user: its answers must be bools."""

    def __init__(self, fn: PolicyFn) -> None:
        super().__init__(fn, getattr(fn, "__qualname__", repr(fn)))
        self._fn = fn

    def __call__(self, op: Any, *args: Any, **kwargs: Any) -> bool:
        what = f"{op}" if op is not checkpoint_name else f"checkpoint_name {kwargs.get('name')!r}"
        try:
            answer = self._fn(op, *args, **kwargs)
        except Exception as e:
            kind: type[Exception] = RuntimeError
            if isinstance(e, (TypeError, ValueError)):
                kind = TypeError if isinstance(e, TypeError) else ValueError
            raise kind(
                f"ps.checkpoint: policy {self._text} raised {type(e).__name__}: {e} for {what}; "
                f"a policy is called as policy(op, *args, **kwargs) for each operator of the "
                f"forward and as policy(checkpoint_name, x, name=name) for each named value, "
                f"and returns True or False"
            ) from e
        if not isinstance(answer, bool):
            raise TypeError(
                f"ps.checkpoint: policy {self._text} returned {describe(answer)} for {what}; a "
                f"policy returns True (keep the output for the backward) or False (recompute it)"
            )
        return answer


nothing_saveable = Policy(lambda op, *a, **k: False, "ps.checkpoint_policies.nothing_saveable")
"""Keep only the checkpoint's inputs; recompute everything else (the default)."""

everything_saveable = Policy(lambda op, *a, **k: True, "ps.checkpoint_policies.everything_saveable")
"""Keep everything: the function runs as if it were not checkpointed."""

dots_saveable = Policy(lambda op, *a, **k: is_dot(op), "ps.checkpoint_policies.dots_saveable")
"""Keep the outputs of matrix products, convolutions and attention kernels (``mm``, ``addmm``,
``bmm``, ``baddbmm`` ... as run by ``torch.matmul``, ``F.linear``, ``torch.einsum``,
``F.scaled_dot_product_attention``); recompute the rest, which is cheap next to them."""

save_collectives = Policy(
    lambda op, *a, **k: is_collective(op), "ps.checkpoint_policies.save_collectives"
)
"""Keep what collectives return (the recompute does not communicate again, except for
point-to-point exchanges); recompute every computation."""

recompute_collectives = Policy(
    lambda op, *a, **k: op is not checkpoint_name and not is_collective(op),
    "ps.checkpoint_policies.recompute_collectives",
)
"""Keep every computed value except what collectives return: the recompute only communicates
again (JAX's FSDP policy ``lambda op, *_, **__: str(op) != 'all_gather'``)."""


def _names(fn: str, names: tuple[Any, ...]) -> frozenset[str]:
    for n in names:
        if not isinstance(n, str):
            raise TypeError(
                f"ps.checkpoint_policies.{fn}: names must be strings, got {describe(n)}; pass "
                f"the names given to ps.checkpoint_name, e.g. {fn}('gather')"
            )
    return frozenset(names)


def _listed(names: frozenset[str]) -> str:
    return ", ".join(repr(n) for n in sorted(names))


def save_only_these_names(*names: str) -> Policy:
    """Keep the values named (with :func:`pshard.checkpoint_name`) with one of ``names``;
    recompute everything else.

    Example:
        >>> import pshard as ps
        >>> ps.checkpoint_policies.save_only_these_names("h", "gather")
        ps.checkpoint_policies.save_only_these_names('gather', 'h')
    """
    keep = _names("save_only_these_names", names)
    return Policy(
        lambda op, *a, **k: op is checkpoint_name and k.get("name") in keep,
        f"ps.checkpoint_policies.save_only_these_names({_listed(keep)})",
    )


def save_anything_except_these_names(*names: str) -> Policy:
    """Keep every value except those named with one of ``names``, which are recomputed
    (communication included): FSDP's reshard-after-forward is
    ``save_anything_except_these_names("gather")`` with the all-gathered weights named
    ``"gather"``.

    Example:
        >>> import pshard as ps
        >>> ps.checkpoint_policies.save_anything_except_these_names("gather")
        ps.checkpoint_policies.save_anything_except_these_names('gather')
    """
    drop = _names("save_anything_except_these_names", names)
    return _AllBut(
        drop, f"ps.checkpoint_policies.save_anything_except_these_names({_listed(drop)})"
    )


def offload(policy: Any) -> Policy:
    """``policy``, with what it keeps held in CPU memory between the forward and the backward
    (copied off the accelerator in the forward, back in the backward; tensors already on the
    CPU stay where they are).

    Example:
        >>> import pshard as ps
        >>> ps.checkpoint_policies.offload(ps.checkpoint_policies.dots_saveable)
        ps.checkpoint_policies.offload(ps.checkpoint_policies.dots_saveable)
    """
    inner = resolve(policy, fn="ps.checkpoint_policies.offload")
    return inner if inner.offload else _Offload(inner)


_FACTORIES: dict[Callable[..., Policy], str] = {
    save_only_these_names: "save_only_these_names('name', ...)",
    save_anything_except_these_names: "save_anything_except_these_names('name', ...)",
    offload: "offload(ps.checkpoint_policies.dots_saveable)",
}


@dataclasses.dataclass(frozen=True)
class CheckpointPolicies:
    """The built-in policies of :func:`pshard.checkpoint` (``ps.checkpoint_policies``), as
    ``jax.checkpoint_policies``.

    Attributes:
        nothing_saveable: keep only the inputs (the default).
        everything_saveable: keep everything (no recompute).
        dots_saveable: keep matrix products, convolutions and attention kernels.
        save_only_these_names: ``save_only_these_names(*names)``, keep named values only.
        save_anything_except_these_names: ``save_anything_except_these_names(*names)``, keep
            everything but the named values.
        save_collectives: keep what collectives return, recompute the computation.
        recompute_collectives: keep the computation, communicate again.
        offload: ``offload(policy)``, hold what ``policy`` keeps in CPU memory.

    Example:
        >>> import pshard as ps
        >>> ps.checkpoint_policies.dots_saveable
        ps.checkpoint_policies.dots_saveable
    """

    nothing_saveable: Policy = nothing_saveable
    everything_saveable: Policy = everything_saveable
    dots_saveable: Policy = dots_saveable
    save_collectives: Policy = save_collectives
    recompute_collectives: Policy = recompute_collectives
    save_only_these_names: Callable[..., Policy] = save_only_these_names
    save_anything_except_these_names: Callable[..., Policy] = save_anything_except_these_names
    offload: Callable[[Any], Policy] = offload

    def __repr__(self) -> str:
        return "ps.checkpoint_policies"


checkpoint_policies = CheckpointPolicies()

_BUILTIN_NAMES = tuple(f.name for f in dataclasses.fields(CheckpointPolicies))


def resolve(policy: Any, *, fn: str = "ps.checkpoint") -> Policy:
    """``policy=`` of :func:`pshard.checkpoint` as a :class:`Policy`: ``None`` is
    ``nothing_saveable``, a built-in is itself, a callable ``policy(op, *args, **kwargs)`` is
    wrapped (its answers are checked to be bools).

    Raises:
        TypeError: ``policy`` is none of these (a name as a string, a factory not called, a
            callable that cannot take ``(op, *args, **kwargs)`` or
            ``(checkpoint_name, x, name=name)``).
    """
    if policy is None:
        return nothing_saveable
    if isinstance(policy, Policy):
        return policy
    menu = (
        "pass one of ps.checkpoint_policies (nothing_saveable, everything_saveable, "
        "dots_saveable, save_only_these_names(*names), save_anything_except_these_names(*names), "
        "save_collectives, recompute_collectives, offload(policy)) or a callable "
        "policy(op, *args, **kwargs) -> bool"
    )
    if any(policy is f for f in _FACTORIES):
        raise TypeError(
            f"{fn}: policy=ps.checkpoint_policies.{policy.__name__} is a function that makes a "
            f"policy, not a policy; call it: policy=ps.checkpoint_policies.{_FACTORIES[policy]}"
        )
    if isinstance(policy, str):
        close = _close_name(policy)
        hint = "" if close is None else f"; did you mean policy=ps.checkpoint_policies.{close}?"
        raise TypeError(f"{fn}: policy={policy!r} is a string, not a policy; {menu}{hint}")
    if not callable(policy):
        raise TypeError(f"{fn}: policy is {describe(policy)}, not a policy; {menu}")
    name = getattr(policy, "__qualname__", None) or repr(policy)
    forms: tuple[tuple[str, tuple[Any, ...], dict[str, Any], str], ...] = (
        (
            "policy(op, *args, **kwargs)",
            (torch.ops.aten.mm.default, None, None),
            {},
            "with an operator and the operator's arguments, e.g. "
            "policy(torch.ops.aten.mm.default, a, b)",
        ),
        (
            "policy(checkpoint_name, x, name=name)",
            (checkpoint_name, None),
            {"name": "n"},
            "for each value named with ps.checkpoint_name, with the name as a keyword; take "
            "it with **kwargs",
        ),
    )
    for form, args, kwargs, how in forms:
        try:
            inspect.signature(policy).bind(*args, **kwargs)
        except TypeError:
            raise TypeError(
                f"{fn}: policy {name} cannot be called as {form} -> bool (it is called {how}); "
                f"{menu}"
            ) from None
        except ValueError:  # no signature (a builtin): trust it, its answers are checked
            break
    return _User(policy)


def _close_name(text: str) -> str | None:
    """The built-in policy ``text`` most likely means (as it is written in a call), if any: the
    one it begins (three letters at least; none if several do), else a close spelling."""
    word = text.strip().lower().removeprefix("ps.").removeprefix("checkpoint_policies.")
    found = [n for n in _BUILTIN_NAMES if len(word) >= 3 and n.startswith(word)]
    if len(found) > 1:
        return None
    found = found or difflib.get_close_matches(word, _BUILTIN_NAMES, n=1, cutoff=0.6)
    if not found:
        return None
    factory = next((f for f in _FACTORIES if f.__name__ == found[0]), None)
    return found[0] if factory is None else _FACTORIES[factory]
