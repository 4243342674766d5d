"""Values that must be the same on every rank, compared across the ranks, always.

``ps.shard`` gives each rank its block of a whole value that every rank passes, and
``ps.from_local`` takes the global shapes (and specs) every rank gives: ranks that pass
different ones make one ``GlobalTensor`` of blocks of different values, or ranks that disagree
on its shape, with no error. Both run once, at set-up, so the check is always on:
:func:`check_same_everywhere` exchanges one row of four integers per rank (its rank, the number
of leaves, a digest of them all) and, only when they differ, a second row per leaf to name the
key paths and the ranks (:func:`check_whole_values` for ``shard``,
:func:`check_global_shapes` for ``from_local``). :func:`tensor_digest` is the digest of a
tensor's contents that these checks and ``ps.save`` (copies of replicated values) compare.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from .._compat import is_wrapped
from .._core.global_tensor import GlobalMeta, is_global
from .._core.tree import keystr
from .._runtime.tracing import outside_trace
from .._runtime.wire import all_gather
from .mesh_view import MeshView

__all__ = [
    "check_global_shapes",
    "check_same_everywhere",
    "check_whole_values",
    "checkable",
    "groups_text",
    "tensor_digest",
]

#: Per leaf, the integers every rank must pass alike (a digest, a shape, ...).
Row = list[int]


def tensor_digest(t: torch.Tensor) -> int:
    """The CRC-32 of ``t``'s dtype, shape and elements (its bytes in row-major order, copied to
    the CPU first when it is elsewhere): equal tensors give equal digests, and two that differ
    give the same one with probability about 2**-32."""
    flat = t.detach()
    if flat.device.type != "cpu":
        flat = flat.cpu()
    data = flat.contiguous().reshape(-1).view(torch.uint8).numpy()  # a buffer, no copy
    head = zlib.crc32(f"{t.dtype}{tuple(t.shape)}".encode())
    return zlib.crc32(data, head)  # type: ignore[arg-type]  # numpy's stubs lack Buffer


def checkable(x: torch.Tensor) -> bool:
    """Whether a check may read ``x``'s values: a plain tensor with data (not on the ``meta``
    device), outside ``torch.func`` transforms and ``torch.compile`` (set-up code runs outside
    them)."""
    return x.device.type != "meta" and not is_wrapped(x) and not torch.compiler.is_compiling()


def groups_text(groups: Sequence[Sequence[int]]) -> str:
    """``[0, 2] vs [1, 3]``: ranks grouped by equal values."""
    return " vs ".join("[" + ", ".join(map(str, g)) + "]" for g in groups)


def check_same_everywhere(
    leaves: Sequence[tuple[str, Row]],
    view: MeshView,
    error: Callable[[str, dict[tuple[int, ...], list[int]]], str],
) -> None:
    """Raise ``ValueError(error(where, groups))`` on every rank of ``view``'s mesh unless
    every rank passes the same rows: ``leaves`` holds each leaf's key path (as the messages
    name it) and its row; ``groups`` maps each row held to the global ranks holding it. Every
    rank of the mesh calls it, with its leaves in the same order.

    Raises:
        ValueError: a leaf whose rows differ (the first), or ranks passing different numbers
            of leaves.
    """
    with outside_trace():  # metadata: exchanged when a program is made, not in it
        _check_same(leaves, view, error)


def _check_same(
    leaves: Sequence[tuple[str, Row]],
    view: MeshView,
    error: Callable[[str, dict[tuple[int, ...], list[int]]], str],
) -> None:
    c = view.all
    if c is None:
        return
    device = torch.device(view.mesh.device_type)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    width = max((len(row) for _, row in leaves), default=0)
    digest = zlib.crc32(json.dumps([row for _, row in leaves]).encode())
    me = dist.get_rank() if dist.is_initialized() else 0
    head = torch.tensor([me, len(leaves), width, digest], dtype=torch.int64, device=device)
    heads = all_gather(head, c, 0, False).tolist()
    if len({(n, d) for _, n, _, d in heads}) == 1:
        return
    ranks = [int(h[0]) for h in heads]
    counts = [int(h[1]) for h in heads]
    if len(set(counts)) > 1:
        held = ", ".join(f"rank {r}: {n}" for r, n in zip(ranks, counts, strict=True))
        raise ValueError(
            f"{view.fn}: the ranks pass trees with different numbers of leaves ({held}); every "
            f"rank passes the same tree"
        )
    wide = max(int(h[2]) for h in heads)
    table = torch.full((len(leaves), wide + 1), -1, dtype=torch.int64)
    for i, (_, row) in enumerate(leaves):
        table[i, 0] = len(row)
        table[i, 1 : 1 + len(row)] = torch.tensor(row, dtype=torch.int64)
    tables = all_gather(table.to(device), c, 0, False).tolist()
    for i, (where, _) in enumerate(leaves):
        groups: dict[tuple[int, ...], list[int]] = {}
        for k, rank in enumerate(ranks):
            got = tables[k][i]
            groups.setdefault(tuple(got[1 : 1 + got[0]]), []).append(rank)
        if len(groups) > 1:
            raise ValueError(error(where, groups))


def check_whole_values(paths: list[Any], leaves: list[Any], view: MeshView) -> None:
    """``shard``: raise on every rank unless each whole tensor is the same on every rank of
    the mesh (a digest of each, exchanged in one all-gather; outside transforms)."""
    rows = [
        (keystr(path, "tree"), [tensor_digest(x)])
        for path, x in zip(paths, leaves, strict=True)
        if isinstance(x, torch.Tensor) and not is_global(x) and checkable(x)
    ]

    def error(where: str, groups: dict[tuple[int, ...], list[int]]) -> str:
        return (
            f"{view.fn} {where}: the whole value differs between the ranks (global ranks "
            f"holding equal values: {groups_text(list(groups.values()))}); each rank takes its "
            f"block of the value it passes, so blocks of different values would make one "
            f"GlobalTensor: pass the same value on every rank (drawn from the same seed), or "
            f"make per-rank values a GlobalTensor with ps.from_local(block, spec)"
        )

    if torch.compiler.is_compiling():
        return
    check_same_everywhere(rows, view, error)


def check_global_shapes(metas: list[tuple[str, GlobalMeta]], view: MeshView) -> None:
    """``from_local``: raise on every rank unless every rank of the mesh gives each value the
    same global shape and spec (exchanged in one all-gather)."""
    rows = [
        (where, [zlib.crc32(repr(meta.spec).encode()), len(meta.shape), *meta.shape])
        for where, meta in metas
    ]

    def error(where: str, groups: dict[tuple[int, ...], list[int]]) -> str:
        shapes: dict[tuple[int, ...], list[int]] = {}
        for row, ranks in groups.items():
            shapes.setdefault(tuple(row[2 : 2 + row[1]]), []).extend(ranks)
        if len(shapes) == 1:
            return (
                f"{view.fn} {where}: the ranks pass different specs (global ranks passing "
                f"equal ones: {groups_text(list(groups.values()))}); every rank passes the "
                f"same specs"
            )
        held = ", ".join(f"{s} on global ranks {groups_text([r])}" for s, r in shapes.items())
        return (
            f"{view.fn} {where}: the ranks disagree on the global shape: {held}; every rank "
            f"passes the same global_shapes"
        )

    if torch.compiler.is_compiling():
        return
    check_same_everywhere(rows, view, error)
