"""A module's ``forward`` (or a name in a namespace) replaced while a block runs it, and put
back: the patches ``tensor_parallel`` and ``expert_parallel`` install (an instance attribute
``forward``, as ``sharded_call`` installs its units), counted per model (threads that are ranks
share models), and the runs of a kind of block in this context (found again by the backward
passes through their calls).

Internal interface: ``own_forward(module, saved)``, ``set_forward(module, forward) -> undo``,
``set_name(namespace, name, value) -> undo``, :class:`Root`, :func:`install_counted`,
:func:`patched`, :class:`Runs`, :class:`Part`, :func:`patch_parts`.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from torch import nn

from .passes import recorded

__all__ = [
    "Part",
    "Root",
    "Runs",
    "install_counted",
    "own_forward",
    "patch_parts",
    "patched",
    "set_forward",
    "set_name",
]


def own_forward(module: nn.Module, saved: Any) -> Callable[..., Any]:
    """The ``forward`` ``module`` had before a patch (``saved``: its instance attribute then,
    ``None`` for the class's)."""
    return saved if saved is not None else type(module).forward.__get__(module)


def set_forward(module: nn.Module, forward: Any) -> Callable[[], None]:
    """``module.forward = forward``; the undo puts back what was there (if the patch is still
    in place)."""
    saved = module.__dict__.get("forward")
    module.forward = forward

    def undo() -> None:
        if module.__dict__.get("forward") is forward:
            if saved is None:
                del module.forward
            else:
                module.forward = saved

    return undo


def set_name(namespace: dict[str, Any], name: str, value: Any) -> Callable[[], None]:
    """``namespace[name] = value`` (a module's globals); the undo puts back what was there (if
    the patch is still in place)."""
    saved = namespace[name]
    namespace[name] = value

    def undo() -> None:
        if namespace.get(name) is value:
            namespace[name] = saved

    return undo


class Root:
    """A model's own ``forward`` while a kind of block is installed on it (subclasses call the
    model): the install count, what restores the model, and the key of the layout installed."""

    def __init__(self, model: nn.Module, saved: Any, key: Any) -> None:
        self.model, self.saved, self.key = model, saved, key
        self.count = 0
        self.undo: list[Callable[[], None]] = []

    def own(self) -> Callable[..., Any]:
        """The model's own ``forward``."""
        return own_forward(self.model, self.saved)


def install_counted(
    model: nn.Module,
    key: Any,
    kind: type[Root],
    patch: Callable[[Any], Root],
    lock: threading.Lock,
    clash: str,
) -> Callable[[], None]:
    """Install a block of ``kind`` on ``model`` (``patch(saved forward) -> root``, which patches
    the model, puts the undo of each patch in ``root.undo`` and ``root`` as the model's
    forward last), or count one more install of the same ``key``; returns the undo (the model
    restored when the last install ends). Threads that are ranks share models: ``lock``
    guards the counts.

    Raises:
        RuntimeError: ``clash``, the model holds a block of this kind with another key.
    """
    with lock:
        root = model.__dict__.get("forward")
        if not (isinstance(root, kind) and root.model is model):
            root = patch(root)
        elif root.key != key:
            raise RuntimeError(clash)
        root.count += 1

    def undo() -> None:
        with lock:
            root.count -= 1
            if root.count == 0:
                _restore(root)

    return undo


def patched(root: Root, steps: Callable[[Root], None]) -> Root:
    """``root`` after ``steps(root)`` patched the model (their undo in ``root.undo``); all
    undone if one fails."""
    try:
        steps(root)
    except BaseException:
        _restore(root)
        raise
    return root


def _restore(root: Root) -> None:
    for step in reversed(root.undo):
        step()
    root.undo.clear()


class Runs:
    """One kind of block (``tensor_parallel``, ``expert_parallel``): its runs in this context
    (a context variable of runs, each with its ``model`` and layout ``key``), those the running
    backward pass recorded, and how a run is installed on its model: ``root`` (a
    :class:`Root` subclass) becomes the model's ``forward`` after ``patch(run, root)`` patched
    the rest, counted per model; ``clash(run)`` is the error for a model that holds a block of
    this kind with another key."""

    def __init__(
        self,
        name: str,
        kind: type,
        root: type[Root],
        patch: Callable[[Any, Root], None],
        clash: Callable[[Any], str],
    ) -> None:
        self._var: contextvars.ContextVar[tuple[Any, ...]] = contextvars.ContextVar(
            name, default=()
        )
        self._kind, self._root, self._patch, self._clash = kind, root, patch, clash
        self._lock = threading.Lock()  # the install counts of models threads share

    def active(self, model: nn.Module) -> Any:
        """The innermost run of ``model`` in this context, else the one the running backward
        pass recorded, else ``None``."""
        for run in reversed(self._var.get()):
            if run.model is model:
                return run
        for entry in recorded():
            if isinstance(entry, self._kind) and getattr(entry, "model", None) is model:
                return entry
        return None

    def install(self, run: Any) -> Callable[[], None]:
        """Install ``run`` on its model (or count one more install); returns the undo."""
        model, key = run.model, run.key

        def make(saved: Any) -> Root:
            return patched(self._root(model, saved, key), lambda root: self._patch(run, root))

        return install_counted(model, key, self._root, make, self._lock, self._clash(run))

    @contextlib.contextmanager
    def running(self, run: Any) -> Iterator[Any]:
        """The block: ``run`` pushed on the context and installed on its model."""
        undo = self.install(run)
        token = self._var.set((*self._var.get(), run))
        try:
            yield run
        finally:
            self._var.reset(token)
            undo()


class Part:
    """A submodule's ``forward`` while its model is installed (subclasses call it): the model,
    the submodule and its name in the model, and its own ``forward`` before the patch."""

    def __init__(self, model: nn.Module, module: nn.Module, name: str, saved: Any) -> None:
        self.model, self.module, self.name, self.saved = model, module, name, saved

    def own(self) -> Callable[..., Any]:
        """The submodule's own ``forward``."""
        return own_forward(self.module, self.saved)


def patch_parts(root: Root, names: Iterable[str], part: type[Part]) -> None:
    """Patch each submodule of ``root``'s model named in ``names`` with ``part`` (the undo of
    each in ``root.undo``)."""
    for name in names:
        module = root.model.get_submodule(name)
        saved = module.__dict__.get("forward")
        root.undo.append(set_forward(module, part(root.model, module, name, saved)))
