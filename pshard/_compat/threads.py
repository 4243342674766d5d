"""What in-process ranks need of torch's process state: c10d's world per rank, its C++ group
registry per thread, a backend registered from Python, writes that autograd and the dispatch
modes do not see, and forward-mode AD's process globals (see :mod:`pshard._compat`)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

__all__ = [
    "THREADS_BACKEND",
    "ad_state",
    "install_world_switch",
    "new_c10d_world",
    "register_backend",
    "route_reparametrization",
    "set_ad_state",
    "share_dual_level",
    "thread_isolation",
    "unseen_writes",
]


# --- in-process ranks: c10d's world per rank thread ----------------------------------------------
#
# torch.distributed keeps its process groups in one module-level object (``distributed_c10d.
# _world``) and their names in a C++ registry, both one per process. In-process ranks
# (``ps.spawn(..., backend="threads")``) need one of each per rank: ``_world`` is replaced, once,
# by a switch that sends every access to the world of the rank whose context is current (a
# context variable, so a rank's own context decides, and any other thread, the caller's among
# them, keeps the process's own world), and the C++ registry is made per thread while in-process
# ranks run. DeviceMesh tells meshes of different threads apart only for a backend named
# "threaded" (it records the creating thread in the mesh's identity), so that is the name the
# in-process transport registers under.

THREADS_BACKEND = "threaded"


class _Switch:
    """Stands in for ``distributed_c10d._world``: the current rank's world, else the process's."""

    def __init__(self, own: Any, current: Callable[[], Any]) -> None:
        object.__setattr__(self, "_own", own)
        object.__setattr__(self, "_current", current)

    def _target(self) -> Any:
        world = self._current()
        return self._own if world is None else world

    def __getattr__(self, name: str) -> Any:
        return getattr(self._target(), name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._target(), name, value)


def new_c10d_world() -> Any:
    """A fresh, empty c10d world (what ``distributed_c10d._world`` holds) for one rank."""
    from torch.distributed import distributed_c10d as c10d

    class RankWorld(c10d._World):
        # _World's maps are module globals: a rank's world holds its own
        def __init__(self) -> None:
            super().__init__()
            self._maps: dict[str, dict] = {
                k: {}
                for k in (
                    "pg_map",
                    "pg_names",
                    "pg_group_ranks",
                    "pg_backend_config",
                    "tags_to_pg",
                    "pg_to_tag",
                )
            }
            self._count = 0

        pg_map = property(lambda self: self._maps["pg_map"])
        pg_names = property(lambda self: self._maps["pg_names"])
        pg_group_ranks = property(lambda self: self._maps["pg_group_ranks"])
        pg_backend_config = property(lambda self: self._maps["pg_backend_config"])
        tags_to_pg = property(lambda self: self._maps["tags_to_pg"])
        pg_to_tag = property(lambda self: self._maps["pg_to_tag"])

        @property
        def group_count(self) -> int:
            return self._count

        @group_count.setter
        def group_count(self, value: int) -> None:
            self._count = value

    return RankWorld()


def install_world_switch(current: Callable[[], Any]) -> None:
    """Route c10d's world through ``current()`` (a rank's world, or ``None`` for the process's
    own) from now on; idempotent. The switch stays for the life of the process: with no rank
    running it is the process's own world, unchanged."""
    from torch.distributed import distributed_c10d as c10d

    if not isinstance(c10d._world, _Switch):
        c10d._world = _Switch(c10d._world, current)  # type: ignore[assignment]


def route_reparametrization(
    hold: Callable[
        [Callable[[], contextlib.AbstractContextManager[Any]], torch.nn.Module, Sequence[str]],
        contextlib.AbstractContextManager[Any],
    ],
) -> None:
    """Route ``functional_call``'s reparametrization of a module
    (``torch.nn.utils.stateless._reparametrize_module``) through ``hold(enter, module, names)``
    from now on, ``enter()`` being torch's own; idempotent, for the life of the process (with no
    rank running, ``hold`` enters torch's own and nothing else)."""
    from torch.nn.utils import stateless

    own = stateless._reparametrize_module
    if getattr(own, "_pshard_routed", False):
        return

    @contextlib.contextmanager
    def routed(
        module: torch.nn.Module, parameters_and_buffers: dict[str, torch.Tensor], *a: Any, **k: Any
    ) -> Iterator[None]:
        def enter() -> contextlib.AbstractContextManager[Any]:
            return own(module, parameters_and_buffers, *a, **k)

        with hold(enter, module, list(parameters_and_buffers)):
            yield

    routed._pshard_routed = True  # type: ignore[attr-defined]
    stateless._reparametrize_module = routed


def thread_isolation(enabled: bool) -> None:
    """Make c10d's C++ registry of group names per thread (``True``) or per process."""
    from torch._C import _distributed_c10d

    _distributed_c10d._set_thread_isolation_mode(enabled)  # type: ignore[attr-defined]


def register_backend(name: str, creator: Callable[..., Any]) -> None:
    """Register ``creator(options, backend_options)`` as the c10d backend ``name`` (CPU only;
    the extended signature, which also gives the group's name and global ranks)."""
    import torch.distributed as dist

    dist.Backend.register_backend(name, creator, extended_api=True, devices=["cpu"])


@contextlib.contextmanager
def unseen_writes(tensors: Sequence[torch.Tensor]) -> Iterator[None]:
    """Write into ``tensors`` as a communication library does: no autograd, no dispatch mode,
    and their version counters left as they were."""
    from torch.utils._python_dispatch import _disable_current_modes

    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.no_grad())
        stack.enter_context(_disable_current_modes())
        for t in tensors:
            stack.enter_context(torch.autograd._unsafe_preserve_version_counter(t))
        yield


# Forward-mode AD is process state in torch: one dual level for the whole process (C++), the
# current level and functorch's jvp nesting in module globals. In-process ranks that run jvp at
# the same time share the one level (it lives while any rank is inside it) and each keeps its
# own view of the two globals, swapped with the turn (:func:`ad_state`, :func:`set_ad_state`).


# ``make_fx`` (``ps.jit``'s tracer) keeps its tracer and torch.fx's "tracing" flag in module
# globals too: a rank that traces while another runs its compiled program (they hand the turn
# over in the collectives of the trace's metadata) must not make the other see a trace.


def ad_state() -> tuple[Any, ...]:
    """This thread's view of forward-mode AD (functorch's jvp nesting and the dual level) and
    of ``make_fx``'s globals (its tracer, torch.fx's tracing flag)."""
    from torch._functorch import eager_transforms
    from torch.autograd import forward_ad
    from torch.fx import _symbolic_trace
    from torch.fx.experimental import proxy_tensor

    return (
        eager_transforms.JVP_NESTING,
        forward_ad._current_level,
        proxy_tensor._CURRENT_MAKE_FX_TRACER,
        _symbolic_trace._is_fx_tracing_flag,
    )


def set_ad_state(state: tuple[Any, ...]) -> None:
    from torch._functorch import eager_transforms
    from torch.autograd import forward_ad
    from torch.fx import _symbolic_trace
    from torch.fx.experimental import proxy_tensor

    (
        eager_transforms.JVP_NESTING,
        forward_ad._current_level,
        proxy_tensor._CURRENT_MAKE_FX_TRACER,
        _symbolic_trace._is_fx_tracing_flag,
    ) = state


class _SharedLevel:
    """``enter_dual_level`` / ``exit_dual_level`` for in-process ranks: the first rank in
    creates the level, the last one out releases it; other threads are unchanged."""

    def __init__(self, enter: Any, exit_: Any, in_rank: Callable[[], bool]) -> None:
        self.enter, self.exit, self.in_rank, self.holders = enter, exit_, in_rank, 0

    def shared_enter(self) -> int:
        if not self.in_rank():
            return self.enter()
        from torch.autograd import forward_ad

        if self.holders == 0:
            level = self.enter()
        else:
            if forward_ad._current_level != -1:
                raise RuntimeError("Nested forward mode AD is not supported at the moment")
            level = forward_ad._current_level = 0
        self.holders += 1
        return level

    def shared_exit(self, *, level: int | None = None) -> None:
        if not self.in_rank():
            return self.exit(level=level)
        from torch.autograd import forward_ad

        self.holders -= 1
        if self.holders == 0:
            return self.exit(level=level)
        forward_ad._current_level = -1
        return None


def share_dual_level(in_rank: Callable[[], bool]) -> None:
    """Let in-process ranks (``in_rank()`` true in their threads) share the dual level;
    idempotent, and with no rank running nothing changes."""
    from torch.autograd import forward_ad

    if isinstance(getattr(forward_ad.enter_dual_level, "__self__", None), _SharedLevel):
        return
    shared = _SharedLevel(forward_ad.enter_dual_level, forward_ad.exit_dual_level, in_rank)
    forward_ad.enter_dual_level = shared.shared_enter
    forward_ad.exit_dual_level = shared.shared_exit
