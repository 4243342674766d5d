"""``ps.visualize_sharding``: the blocks of a 1-D or 2-D value laid out over a mesh, drawn as a
grid whose cells name the ranks that hold them (JAX's ``jax.debug.visualize_array_sharding``).

The grid's lines are the union of every rank's block edges along each dim (an uneven split, or
a strided one whose blocks are several runs, gives cells of several sizes, drawn to scale);
each cell lists the global ranks whose block covers it (every rank of a replicated value in one
cell). Plain text with box-drawing characters; with ``rich`` installed the cells are coloured
when printed to a terminal (``use_color``).
"""

from __future__ import annotations

import importlib
import importlib.util
import itertools
import sys
from typing import Any

import torch

from .._core.global_tensor import GlobalMeta, GlobalTensor, block_runs, is_global
from .._core.placements import P
from .._core.tree import describe
from .._shard_map.global_ops import from_dtensor, from_local

__all__ = ["visualize_sharding"]

_FN = "visualize_sharding"
_WIDTH = 64  # characters across the grid (at least each label's width)
_HEIGHT = 8  # lines down a 2-D grid


def _meta(x: Any) -> GlobalMeta:
    if is_global(x):
        meta: GlobalMeta = x.meta
        return meta
    if isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], torch.Tensor):
        block, spec = x
        if not isinstance(spec, P):
            raise TypeError(
                f"{_FN}: (block, spec) needs a P over the mesh axes, got {describe(spec)}"
            )
        made: GlobalTensor = from_local(block, spec)  # one exchange of the blocks' shapes
        return made.meta
    if isinstance(x, torch.Tensor) and type(x) is not torch.Tensor:
        from torch.distributed.tensor import DTensor

        if isinstance(x, DTensor):
            return from_dtensor(x).meta
    raise TypeError(
        f"{_FN}: x must be a GlobalTensor, a DTensor or a (block, spec) pair (every rank "
        f"calls it then: the blocks' shapes are exchanged), got {describe(x)}"
    )


def _compact(ranks: list[int]) -> str:
    """``[0, 1, 2, 5, 6]`` -> ``"0-2,5,6"`` (a run of three or more as a range)."""
    parts = []
    for _, run in itertools.groupby(enumerate(sorted(ranks)), lambda p: p[1] - p[0]):
        values = [v for _, v in run]
        parts += [f"{values[0]}-{values[-1]}"] if len(values) > 2 else [str(v) for v in values]
    return ",".join(parts)


def cells(meta: GlobalMeta) -> tuple[list[int], list[int], list[list[list[int]]]]:
    """The grid of a value of at most 2 dims: the cells' edges along dim 0 and dim 1 (a
    1-D value is one row, a 0-D one one cell) and, per cell, the global ranks holding it."""
    shape = tuple(meta.shape) + (1,) * (2 - len(meta.shape))
    key = meta.key
    holders: list[tuple[int, tuple[tuple[range, ...], ...]]] = []
    for flat, coord in enumerate(itertools.product(*(range(s) for s in key.sizes))):
        runs = block_runs(meta, dict(zip(key.names, coord, strict=True)))
        runs = tuple(runs) + ((range(1),),) * (2 - len(runs))
        holders.append((key.ranks[flat], runs))
    edges = []
    for d in range(2):
        points = {0, shape[d]}
        for _, runs in holders:
            for r in runs[d]:
                if len(r):
                    points.update((r.start, r.stop))
        edges.append(sorted(points))
    grid = []
    for i0 in range(len(edges[0]) - 1):
        row = []
        for i1 in range(len(edges[1]) - 1):
            at = (edges[0][i0], edges[1][i1])
            row.append(
                sorted(
                    {
                        rank
                        for rank, runs in holders
                        if all(any(at[d] in r for r in runs[d]) for d in range(2))
                    }
                )  # fmt: skip
            )
        grid.append(row)
    rows = edges[0] if len(meta.shape) >= 1 else [0, 1]
    cols = edges[1] if len(meta.shape) == 2 else [0, 1]
    if len(meta.shape) == 1:  # a 1-D value is drawn along the page
        rows, cols = [0, 1], edges[0]
        grid = [[cell[0] for cell in grid]]
    return rows, cols, grid


def _sizes(edges: list[int], total: int, least: list[int]) -> list[int]:
    """Lengths of the segments between ``edges`` scaled to ``total`` characters, each at
    least ``least[i]``."""
    span = edges[-1] - edges[0] or 1
    return [max(m, round((b - a) / span * total)) for a, b, m in zip(edges, edges[1:], least,
                                                                     strict=False)]  # fmt: skip


def draw(meta: GlobalMeta) -> tuple[str, list[list[str]], list[int], list[int]]:
    """The plain-text grid; the cells' labels, column widths and row heights (for colouring)."""
    rows, cols, grid = cells(meta)
    labels = [[_compact(c) for c in row] for row in grid]
    widest = [max(len(labels[i][j]) for i in range(len(grid))) + 2 for j in range(len(cols) - 1)]
    widths = _sizes(cols, max(_WIDTH, sum(widest)), widest)
    tall = _HEIGHT if len(meta.shape) == 2 else len(rows) - 1
    heights = _sizes(rows, max(tall, len(rows) - 1), [1] * (len(rows) - 1))

    def rule(left: str, mid: str, right: str) -> str:
        return left + mid.join("─" * w for w in widths) + right

    lines = [rule("┌", "┬", "┐")]
    for i, h in enumerate(heights):
        for line in range(h):
            middle = line == (h - 1) // 2
            texts = [labels[i][j].center(w) if middle else " " * w for j, w in enumerate(widths)]
            lines.append("│" + "│".join(texts) + "│")
        lines.append(rule("├", "┼", "┤") if i < len(heights) - 1 else rule("└", "┴", "┘"))
    return "\n".join(lines), labels, widths, heights


def _print_coloured(text: str, labels: list[list[str]]) -> bool:
    """Print ``text`` with each cell's label coloured by its ranks (``rich``); ``False`` when
    rich is not installed."""
    try:
        rich_console = importlib.import_module("rich.console")
        rich_text = importlib.import_module("rich.text")
    except ImportError:
        return False
    palette = ["red", "green", "blue", "magenta", "cyan", "yellow", "bright_red", "bright_green",
               "bright_blue", "bright_magenta", "bright_cyan", "bright_yellow"]  # fmt: skip
    colour: dict[str, str] = {}
    for label in sorted({lab for row in labels for lab in row}):
        colour[label] = palette[len(colour) % len(palette)]
    styled = rich_text.Text(text)
    for label, c in colour.items():
        styled.highlight_words([label], style=f"bold white on {c}")
    rich_console.Console().print(styled)
    return True


def visualize_sharding(x: Any, *, use_color: bool | None = None) -> str:
    """Draw which ranks hold which block of ``x`` (a 1-D or 2-D value): a grid of its blocks,
    each cell naming the global ranks that hold it (``"0,2"``; ``"0-3"`` for a run of three or
    more), uneven
    blocks to scale, a replicated value one cell of every rank. Printed, and returned (the
    plain text).

    Args:
        x: a :class:`~pshard.GlobalTensor`, a DTensor, or ``(block, spec)`` (this rank's block
            and its ``P`` over the current mesh: every rank calls it then, the blocks' shapes
            being exchanged as :func:`pshard.from_local` exchanges them).
        use_color: colour the cells when printing (with ``rich`` installed); ``None``: when
            ``rich`` is installed and the output is a terminal.

    Returns:
        The grid as plain text (no colour codes).

    Raises:
        TypeError: ``x`` is none of these.
        ValueError: ``x`` has more than 2 dims (draw a 2-D view of it: a reshape's layout).

    Example:
        >>> import torch, pshard as ps
        >>> mesh = ps.init_mesh({"dp": 1})
        >>> _ = ps.visualize_sharding(ps.shard(torch.zeros(4, 6), ps.P("dp")))  # doctest: +SKIP
    """
    meta = _meta(x)
    if len(meta.shape) > 2:
        raise ValueError(
            f"{_FN}: a value of {len(meta.shape)} dims (shape {tuple(meta.shape)}); it draws 1-D "
            f"and 2-D layouts: draw the dims that are split (a 2-D layout of the same spec)"
        )
    text, labels, _, _ = draw(meta)
    colour = use_color
    if colour is None:
        colour = sys.stdout.isatty() and importlib.util.find_spec("rich") is not None
    if not (colour and _print_coloured(text, labels)):
        print(text)
    return text
