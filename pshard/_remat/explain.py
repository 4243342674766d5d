"""How a call of the recompute differs from the forward's call of the same operator, in words:
the text of ``ps.checkpoint``'s "another path" error when the operator and shapes are the same
(a Python number that changed, a tensor from outside modified in place).

Works on the keys of :func:`pshard._remat.tape.key_of`: ``(operator, structure of (args,
kwargs), parts, extra)``, where a part is a plain value, a type's name, or for a tensor a tuple
``(source, shape, dtype)`` (``("int", shape, dtype)`` for integer tensors).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

from .tape import arg_paths

__all__ = ["difference", "draw_difference"]


def difference(op: Any, forward: Hashable, recompute: Hashable) -> str | None:
    """``"other=2 where the forward had other=1"``: the first argument in which the call with
    key ``recompute`` differs from the forward's call with key ``forward``, or ``None`` when
    they are not calls of one operator with arguments of the same structure."""
    if not (isinstance(forward, tuple) and isinstance(recompute, tuple)):
        return None
    if len(forward) != 4 or len(recompute) != 4:
        return None
    if forward[0] is not recompute[0] or forward[1] != recompute[1]:
        return None
    paths = arg_paths(forward[1])
    for path, before, after in zip(paths, forward[2], recompute[2], strict=True):
        if before == after:
            continue
        name = _argument(op, path)
        if not isinstance(before, tuple) or not isinstance(after, tuple):
            return f"{name}={after!r} where the forward had {name}={before!r}"
        if before[0] == after[0]:  # the same source, another shape or dtype
            return f"{name} of {_meta(after)} where the forward had {name} of {_meta(before)}"
        text = f"{name} {_tensor(after)} where the forward had {name} {_tensor(before)}"
        if _outside(before[0]) and _outside(after[0]):
            if before[0][1] == after[0][1]:
                return f"{text}: it was modified in place between the forward and the backward"
            return f"{text}: it was replaced between the forward and the backward"
        return text
    return None


def draw_difference(
    forward: Sequence[tuple[str, Any]], recompute: Sequence[tuple[str, Any]]
) -> str | None:
    """``"p=0.9 where the forward had p=0.5"``: the first argument in which a random draw of the
    recompute differs from the forward's (:func:`pshard._remat.ops.draw_arguments` of each)."""
    for (name, before), (_, after) in zip(forward, recompute, strict=True):
        if before != after:
            return f"{name}={after!r} where the forward had {name}={before!r}"
    return None


def _argument(op: Any, path: Sequence[Any]) -> str:
    """``path`` in ``(args, kwargs)`` as the operator's argument name: ``other``,
    ``tensors[1]``."""
    if not path:
        return "an argument"
    if path[0] == 1:  # kwargs
        head = str(path[1]) if len(path) > 1 else "kwargs"
    else:
        i = path[1] if len(path) > 1 else 0
        arguments = getattr(getattr(op, "_schema", None), "arguments", ())
        head = arguments[i].name if isinstance(i, int) and i < len(arguments) else f"args[{i}]"
    return head + "".join(f"[{k}]" for k in path[2:])


def _outside(source: Any) -> bool:
    return isinstance(source, tuple) and source[:1] == ("x",)


def _meta(part: tuple[Any, ...]) -> str:
    return f"shape {tuple(part[1])} {str(part[2]).removeprefix('torch.')}"


def _tensor(part: tuple[Any, ...]) -> str:
    """A tensor part of a key (``(source, shape, dtype)``), in words."""
    return "an integer tensor" if part[0] == "int" else _source(part[0])


def _source(source: Any) -> str:
    """Where a tensor of a key came from, in words."""
    if not isinstance(source, tuple) or not source:
        return "a tensor"
    tag = source[0]
    if tag == "in":
        return f"the checkpoint's input {source[1]}"
    if tag == "o":
        written = " (written in place)" if len(source) > 3 else ""
        return f"the output of operation {source[1] + 1}{written}"
    if tag == "rand":
        return f"the random draw of operation {source[1] + 1}"
    if tag == "new":
        value = source[4] if len(source) > 4 else None
        if isinstance(value, tuple) and value[0] == "fill":
            return f"a new tensor filled with {value[1]!r}"
        if isinstance(value, tuple) and value[0] == "range":
            return f"a new tensor from {value[1]!r}"
        return "a new tensor"
    if tag == "c":
        values = list(source[3])
        shown = ", ".join(map(repr, values[:8])) + (", ..." if len(values) > 8 else "")
        return f"a {str(source[2]).removeprefix('torch.')} tensor of values [{shown}]"
    if tag == "x":
        return f"a tensor from outside (version {source[2]})"
    if tag == "zero":
        return "a zero tangent"
    return "a tensor"
